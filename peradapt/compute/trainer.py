"""Client-side computation on the shared model: minibatch SGD (optionally proximal) and batched inference.

Every random choice (minibatch order, dropout, augmentation) is drawn from a seed that the engine derives from
(run seed, round, client, phase). A round replayed after a crash therefore gives exactly the same numbers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.nn.functional as F

from peradapt.adapters import AdaptedModel, AdapterState
from peradapt.compute.metrics import metric_value
from peradapt.data import ImageSet, iterate_minibatches, to_model_input
from peradapt.data.batches import AUGMENTATIONS, augment_batch
from peradapt.errors import TrainingDiverged

if TYPE_CHECKING:  # annotations only: privacy imports this package's leaf modules
    from peradapt.compute.privacy import PrivateTraining


@dataclass
class InputPipeline:
    """Turns stored uint8 images into normalized model inputs on the model's device, at the model's `image_size`
    (None: as stored). Batches drawn with a generator (training) are augmented as `augment` says:

    - "none": as stored (peradapt's default for all but CIFAR-10/100);
    - "crop-flip": a random crop of the 4-px zero-padded image at its stored size and a random horizontal flip
      (peradapt's CIFAR augmentation);
    - "resized-crop": torchvision's RandomResizedCrop (area fraction in [0.05, 1]) straight to the model's size,
      then a random horizontal flip: the PerAda authors' CheXpert training augmentation (their code,
      datasets/chexpert.py), here cropped from the stored images rather than the original files.
    """

    mean: tuple[float, ...]
    std: tuple[float, ...]
    device: torch.device
    augment: str = "none"
    image_size: int | None = None

    def __post_init__(self) -> None:
        if self.augment not in AUGMENTATIONS:
            raise ValueError(f"unknown augmentation {self.augment!r}: use {', '.join(AUGMENTATIONS)}")

    def __call__(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        if generator is not None and self.augment != "none":
            # Augmented on the model's device: the uint8 batch travels (a quarter of the bytes of floats), and the
            # resampling of resized crops runs as two batched matrix products where the compute is.
            size = self.image_size or images.shape[-1]
            images = augment_batch(images.to(self.device, non_blocking=True), self.augment, generator, size)
        return to_model_input(images, self.mean, self.std, self.device, self.image_size)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()


@dataclass
class SGDJob:
    """One run of `LocalTrainer.sgd`, as a value: methods whose client update is a few of these (`LocalSGDMethod`)
    can have several clients' jobs trained together (`peradapt.compute.concurrent`)."""

    start: AdapterState
    data: ImageSet
    epochs: int
    lr: float
    seed: int
    anchor: AdapterState | None = None
    lam: float = 0.0
    steps: int | None = None


SGDResult = tuple[AdapterState, float]  # the final state and the mean training loss
T = TypeVar("T")


def seeded_generator(seed: int) -> torch.Generator:
    """A CPU generator for data order, and the global seed for dropout, both from one number."""
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def task_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy for class indices; binary cross-entropy per label (mean over labels and batch) for multi-hot
    labels. With `reduction` "sum", the sum over the batch of each sample's loss."""
    if labels.dim() == 2:
        loss = F.binary_cross_entropy_with_logits(logits, labels, reduction=reduction)
        return loss / labels.shape[1] if reduction == "sum" else loss  # a sample's loss: the mean over its labels
    return F.cross_entropy(logits, labels, reduction=reduction)


def diverged(loss: float, lr: float) -> TrainingDiverged:
    return TrainingDiverged(f"training loss became {loss}: lower --lr (now {lr})")


@dataclass
class LocalTrainer:
    model: AdaptedModel
    inputs: InputPipeline
    batch_size: int
    eval_batch_size: int = 512
    privacy: PrivateTraining | None = None  # --dp-noise: every `sgd` is DP-SGD, its steps charged to the client

    def run(self, job: SGDJob) -> SGDResult:
        """`sgd` as `job` describes it."""
        return self.sgd(
            job.start,
            job.data,
            epochs=job.epochs,
            lr=job.lr,
            seed=job.seed,
            anchor=job.anchor,
            lam=job.lam,
            steps=job.steps,
        )

    def run_steps(self, steps: Generator[SGDJob, SGDResult, T]) -> T:
        """Drive a generator of SGD jobs (e.g. `LocalSGDMethod.client_steps`) to its end, one job after another."""
        try:
            job = next(steps)
            while True:
                job = steps.send(self.run(job))
        except StopIteration as finished:
            return finished.value

    def sgd(
        self,
        start: AdapterState,
        data: ImageSet,
        *,
        epochs: int,
        lr: float,
        seed: int,
        anchor: AdapterState | None = None,
        lam: float = 0.0,
        steps: int | None = None,
    ) -> tuple[AdapterState, float]:
        """`epochs` passes of minibatch SGD on the loss (see `loss`) from `start`; with `steps`, that many minibatch
        steps instead (`minibatches`).

        With an `anchor` w, each step is the proximal update v <- v - lr * (grad L(v) + lam * (v - w))
        (PerAda Algorithm 1, line 10). Returns the final state and the mean training loss. With `privacy`, the
        gradient of L is DP-SGD's (see `private_sgd`).
        """
        if self.privacy is not None:
            return self.private_sgd(start, data, epochs=epochs, lr=lr, seed=seed, anchor=anchor, lam=lam, steps=steps)
        model = self.model
        model.load_state(start)
        model.train()
        parameters = model.trainable_parameters()
        values = list(parameters.values())
        anchors = [anchor[name] for name in parameters] if anchor is not None and lam > 0 else None
        # One kernel call per operation over all tensors: a ResNet's adapters, BatchNorms and head are ~80 tensors.
        optimizer = torch.optim.SGD(values, lr=lr, foreach=True)
        total_loss, batches = 0.0, 0
        for images, labels in self.minibatches(data, epochs=epochs, seed=seed, steps=steps):
            loss = self.loss(images, labels, lr)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if anchors is not None:
                with torch.no_grad():
                    gradients = [parameter.grad for parameter in values]
                    torch._foreach_add_(gradients, torch._foreach_sub(values, anchors), alpha=lam)
            optimizer.step()
            total_loss += loss.item()
            batches += 1
        return model.state(), total_loss / max(batches, 1)

    def private_sgd(
        self,
        start: AdapterState,
        data: ImageSet,
        *,
        epochs: int,
        lr: float,
        seed: int,
        anchor: AdapterState | None = None,
        lam: float = 0.0,
        steps: int | None = None,
    ) -> tuple[AdapterState, float]:
        """`sgd` as DP-SGD (`peradapt.compute.privacy`): Poisson-sampled batches, each sample's gradient clipped
        to C, Gaussian noise of std σC, the mean over the expected batch size; then the proximal pull
        lam * (v - w), a function of parameters only, taken as it is. Returns the final state and the mean loss
        per sample. With `steps`, that many Poisson batches."""
        privacy = self.privacy
        assert privacy is not None and data.labels is not None
        model = self.model
        model.load_state(start)
        model.train()
        parameters = model.trainable_parameters()
        generator = seeded_generator(seed)  # Poisson draws, augmentation and dropout; the noise has its own
        batches = privacy.batches(len(data), self.batch_size, epochs, steps)
        optimizer = privacy.optimizer(parameters.values(), lr=lr, batches=batches, seed=seed)
        total_loss, samples = 0.0, 0
        with privacy.per_sample_gradients(model.module):
            for batch in batches.draw(generator):
                optimizer.zero_grad(set_to_none=True)
                if len(batch):
                    images = self.inputs(data.images[batch], generator)
                    labels = data.labels[batch].to(self.inputs.device, non_blocking=True)
                    loss = self.loss(images, labels, lr, reduction="sum")  # per-sample gradients are the samples' own
                    loss.backward()
                    total_loss, samples = total_loss + loss.item(), samples + len(batch)
                else:
                    privacy.no_samples(parameters.values())
                with torch.no_grad():
                    proximal = anchor is not None and lam > 0
                    pull = {n: lam * (p - anchor[n]) for n, p in parameters.items()} if proximal else {}
                    optimizer.step()
                    for name, step in pull.items():
                        parameters[name].sub_(step, alpha=lr)
            optimizer.zero_grad(set_to_none=True)  # the last step's clipped sum is not left on the shared model
        privacy.spend(batches)
        return model.state(), total_loss / max(samples, 1)

    def minibatches(
        self, data: ImageSet, *, epochs: int, seed: int, steps: int | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Shuffled, augmented (images, labels) batches on the model's device for `epochs` passes; with `steps`,
        exactly `steps` batches instead, pass after pass (`--local-steps`: papers that count local iterations).

        The order, the augmentation and dropout all follow `seed`. Methods with their own update rules
        (pFedMe, APFL, ...) loop over these and call `loss`, with the model in training mode.
        """
        assert data.labels is not None, "training data must be labeled"
        generator = seeded_generator(seed)
        drawn, passes = 0, 0
        while (drawn < steps) if steps is not None else (passes < epochs):
            for batch in iterate_minibatches(len(data), self.batch_size, generator):
                if steps is not None and drawn == steps:
                    return
                images = self.inputs(data.images[batch], generator)
                drawn += 1
                yield images, data.labels[batch].to(self.inputs.device, non_blocking=True)
            passes += 1

    def loss(self, images: torch.Tensor, labels: torch.Tensor, lr: float, reduction: str = "mean") -> torch.Tensor:
        """`task_loss` of the model as it is loaded. Stops the run if it is no longer finite."""
        with self.inputs.autocast():
            loss = task_loss(self.model(images), labels, reduction)
        if not torch.isfinite(loss):
            raise diverged(loss.item(), lr)
        return loss

    @torch.no_grad()  # not inference_mode: cached teacher logits are used in autograd later
    def logits(self, state: AdapterState, data: ImageSet, inputs: InputPipeline | None = None) -> torch.Tensor:
        """Inference-mode logits of the model with `state` loaded, for every image of `data`, as float32; the
        images made model inputs by `inputs` (default: the clients' pipeline, never augmenting here)."""
        self.model.load_state(state)
        self.model.eval()
        inputs = inputs or self.inputs
        chunks = [self._forward(chunk, inputs) for chunk in self._chunks(data)]
        return torch.cat(chunks) if chunks else torch.empty(0)

    def _chunks(self, data: ImageSet) -> Iterator[torch.Tensor]:
        for start in range(0, len(data), self.eval_batch_size):
            yield data.images[start : start + self.eval_batch_size]

    def _forward(self, images: torch.Tensor, inputs: InputPipeline) -> torch.Tensor:
        with inputs.autocast():
            return self.model(inputs(images)).float()

    def score(self, state: AdapterState, data: ImageSet) -> float:
        """The task's metric for the model with `state` on `data`: accuracy for class labels, mean ROC-AUC over
        the labels for multi-hot labels (PerAda Sec. 7: AUC for CheXpert). NaN when it is undefined."""
        assert data.labels is not None
        if len(data) == 0:
            return float("nan")
        return metric_value(self.logits(state, data).cpu(), data.labels)
