"""Client-side computation on the shared model: minibatch SGD (optionally proximal) and batched inference.

Every random choice (minibatch order, dropout, augmentation) is drawn from a seed that the engine derives from
(run seed, round, client, phase). A round replayed after a crash therefore gives exactly the same numbers.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from peradapt.adapters import AdapterState
from peradapt.compute.costs import SampleFlops, inference_flops, schedule_sizes, shared_sizes, training_flops
from peradapt.compute.task_metric import metric_value
from peradapt.data import ImageSet, iterate_minibatches, to_model_input
from peradapt.data.batches import (
    AUGMENTATIONS,
    AugmentationDraws,
    apply_augmentation,
    draw_augmentation,
    neutral_augmentation_draws,
)
from peradapt.errors import TrainingDiverged

if TYPE_CHECKING:  # annotations only: privacy imports this package's leaf modules; the model's module imports PEFT
    from peradapt.adapters import AdaptedModel
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
        """Model inputs of uint8 `images`, augmented with draws from `generator` if one is given (training)."""
        draws = self.draw(len(images), tuple(images.shape[2:]), generator) if generator is not None else None
        return self.prepared(images, draws)

    def draw(self, count: int, size: tuple[int, ...], generator: torch.Generator) -> AugmentationDraws | None:
        """The augmentation's random draws for a batch of `count` images of `size` (height, width), from
        `generator`; None when nothing is drawn."""
        if self.augment == "none":
            return None
        height, width = size
        return draw_augmentation(self.augment, count, height, width, generator)

    def neutral(self, count: int, size: tuple[int, ...]) -> AugmentationDraws | None:
        """Draws for `count` images of `size` that leave them as they are (`neutral_augmentation_draws`)."""
        if self.augment == "none":
            return None
        height, width = size
        return neutral_augmentation_draws(self.augment, count, height, width)

    def prepared(self, images: torch.Tensor, draws: AugmentationDraws | None) -> torch.Tensor:
        """Model inputs of uint8 `images`, augmented by `draws` (`draw`: of this batch, or the concatenated draws
        of the batches `images` concatenates)."""
        if draws is not None:
            # Augmented on the model's device: the uint8 batch travels (a quarter of the bytes of floats), and the
            # resampling of resized crops runs as two batched matrix products where the compute is.
            size = self.image_size or images.shape[-1]
            images = apply_augmentation(images.to(self.device, non_blocking=True), self.augment, draws, size)
        return to_model_input(images, self.mean, self.std, self.device, self.image_size)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.device.type == "cuda":
            # Without autocast's cache of bf16 weights, which a CUDA graph cannot capture (concurrent clients'
            # captured steps): a pass casts each weight once either way.
            return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)
        return contextlib.nullcontext()


@dataclass(frozen=True)
class ParameterGroup:
    """State keys that train at one learning rate: their parameters take SGD steps at `lr`, their buffers (BatchNorm
    running statistics) follow the forward passes in training mode."""

    keys: tuple[str, ...]  # the state keys of the group: parameters and buffers
    lr: float  # their learning rate


@dataclass
class SGDJob:
    """One run of local SGD (`LocalTrainer.run`), as a value: methods whose client update is a few of these
    (`LocalSGDMethod`) can have several clients' jobs trained together (`peradapt.compute.concurrent`).

    `groups` says what trains and at which rate; None: every trainable parameter at `lr`. A state key in no group
    is frozen: it gets no gradient, and it comes back exactly as it is in `start` (the running statistics of its
    BatchNorms too, which the forward passes move). `lr` is --lr either way, the rate a diverged run names.

    `correction` is a fixed linear term added to the gradient at every step, state-shaped (an entry per trained
    parameter; a parameter without one gets none): SCAFFOLD's c − c_i (Karimireddy et al. 2020, Algorithm 1,
    line 10), the gradient of the linear term <correction, v> of a local objective. The step is then
    v <- v - lr (grad L(v) + lam (v - w) + correction) in every form of the loop (`descend`, `private_sgd`,
    concurrent clients).
    """

    start: AdapterState  # the state SGD starts from (the model's keys exactly)
    data: ImageSet  # the minibatches' data: the client's training split
    epochs: int  # passes over `data` (unless `steps`)
    lr: float  # the learning rate (of every trained parameter, unless `groups`)
    seed: int  # the minibatches' order, augmentation and dropout (`derive_seed(seed, PHASE)`)
    anchor: AdapterState | None = None  # w of the proximal pull lam (v - w); None: no pull
    lam: float = 0.0  # the pull's strength λ
    steps: int | None = None  # that many minibatch steps instead of `epochs` passes (--local-steps)
    groups: tuple[ParameterGroup, ...] | None = None  # what trains at which rate; None: everything at `lr`
    correction: AdapterState | None = None  # added to every step's gradient, by parameter name; None: nothing

    def rates(self, parameters: Iterable[str]) -> dict[str, float]:
        """The learning rate of each of the named `parameters` that trains, in their order."""
        if self.groups is None:
            return dict.fromkeys(parameters, self.lr)
        rate = {key: group.lr for group in self.groups for key in group.keys}
        return {name: rate[name] for name in parameters if name in rate}

    def finished(self, state: AdapterState) -> AdapterState:
        """`state`, the model's after training, with every key of no group as it is in `start`."""
        if self.groups is None:
            return state
        trained = {key for group in self.groups for key in group.keys}
        return {key: tensor if key in trained else self.start[key] for key, tensor in state.items()}


@dataclass(frozen=True)
class Objective:
    """What local SGD minimizes on a minibatch: the sum of the loss terms `terms(images, labels)` gives, each
    reported by its name in `names` as its mean over the steps. `LocalTrainer.descend(job, objective)` descends it
    (`run`'s is `Objective(lambda x, y: (trainer.unchecked_loss(x, y),), ("loss",))`); a change of the gradient
    that is a fixed linear term needs none: `SGDJob.correction`. Not DP-SGD, and trained one client at a time."""

    # (images, labels) of a minibatch, the model loaded and in training mode -> the loss terms, scalar tensors
    terms: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]
    names: tuple[str, ...]  # a name for each term: the keys of the means `descend` returns


SGDResult = tuple[AdapterState, float]  # what a job gives: the final state and the mean training loss
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


def finite_means(steps: list[torch.Tensor], terms: int, lr: float) -> list[float]:
    """The mean over a job's steps of each of its `terms` loss terms (`steps`: each step's terms, a tensor left on
    the device), read from the device once, after the job: no host synchronisation inside it. The end of the run if
    a step's loss, the sum of its terms, was not finite."""
    rows = torch.stack(steps).reshape(len(steps), terms).tolist() if steps else []
    bad = next((sum(row) for row in rows if not math.isfinite(sum(row))), None)
    if bad is not None:
        raise diverged(bad, lr)
    return [sum(column) / len(rows) for column in zip(*rows, strict=True)] if rows else [0.0] * terms


def finite(loss: torch.Tensor, lr: float) -> torch.Tensor:
    """`loss`, or the end of the run if it is no longer finite."""
    if not torch.isfinite(loss):
        raise diverged(loss.item(), lr)
    return loss


def _corrections(job: SGDJob, parameters: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
    """The job's gradient correction (`SGDJob.correction`) of each trained parameter that has one, by name, on the
    parameter's device."""
    correction = job.correction or {}
    return {name: correction[name].to(p.device) for name, p in parameters.items() if name in correction}


def rate_groups(parameters: dict[str, nn.Parameter], rates: dict[str, float]) -> list[dict[str, Any]]:
    """`torch.optim` parameter groups of the named `parameters`, one per learning rate in `rates`."""
    groups: dict[float, list[nn.Parameter]] = {}
    for name, rate in rates.items():
        groups.setdefault(rate, []).append(parameters[name])
    return [{"params": group, "lr": rate} for rate, group in groups.items()]


@dataclass
class LocalTrainer:
    """Trains and evaluates the one shared model on client data (`self.trainer` of a method): SGD jobs (`run`,
    `descend`), minibatches and losses for update rules of a method's own, logits and scores."""

    model: AdaptedModel  # the shared model: load a state into it, read its trainable parameters
    inputs: InputPipeline  # stored images to model inputs (normalized, augmented when training)
    batch_size: int  # --batch-size: the minibatches' size
    eval_batch_size: int = 512  # images per inference pass
    privacy: PrivateTraining | None = None  # --dp-noise: every `run` is DP-SGD, its steps charged to the client
    # Samples through a training forward and backward pass in this process (`loss` and `descend` count them; a
    # caller reads the change over a client update: `peradapt.compute.costs`).
    samples_trained: int = field(default=0, init=False)
    # Elements of the parameters trained in this process, each trained state counted once (`count_trained`; a
    # caller reads the change over a client update: `costs.ClientWork.trained`).
    elements_trained: int = field(default=0, init=False)
    # The share of its local work the client being trained does (`sharing`): a straggler's, or its part of what is
    # left of a --budget. Every minibatch schedule (`index_batches`) is cut to that share of its samples.
    work_share: float = field(default=1.0, init=False)

    def run(self, job: SGDJob) -> SGDResult:
        """`job.epochs` passes of minibatch SGD on the loss (see `loss`) from `job.start`; with `job.steps`, that many
        minibatch steps instead (`minibatches`).

        Each step is v <- v - lr_v * (grad L(v) + lam * (v - w)) for every trained parameter v, lr_v its group's rate
        (`SGDJob.groups`): with an `anchor` w the proximal update of PerAda Algorithm 1, line 10, without one plain SGD
        (line 15); partial models train their parts at their own rates or one part alone. Returns the final state
        and the mean training loss. With `privacy`, the gradient of L is DP-SGD's (see `private_sgd`).
        """
        if self.privacy is not None:
            return self.private_sgd(job)
        task = Objective(lambda images, labels: (self.unchecked_loss(images, labels),), ("loss",))
        state, means = self.descend(job, task)
        return state, means["loss"]

    def count_trained(self, parameters: Iterable[torch.Tensor]) -> None:
        """Count `parameters` as one state a client update trains (`elements_trained`): every job of `descend` and
        `private_sgd` counts its own; a method that trains with update rules of its own counts each model it
        trains (pFedMe's θ_i and w_i: two)."""
        self.elements_trained += sum(parameter.numel() for parameter in parameters)

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
    ) -> SGDResult:
        """`run` of the job these arguments describe: every trainable parameter at `lr`."""
        return self.run(SGDJob(start, data, epochs=epochs, lr=lr, seed=seed, anchor=anchor, lam=lam, steps=steps))

    def descend(self, job: SGDJob, objective: Objective) -> tuple[AdapterState, dict[str, float]]:
        """The one loop of local SGD: `run`'s steps (see there) on the sum of `objective`'s terms; the state after
        them and each term's mean. `run` descends the task loss; a method whose loss is another (FedRoD's two
        risks) passes its own. Not DP-SGD: with `privacy`, `run` takes `private_sgd` instead."""
        if self.privacy is not None:
            raise ValueError("DP-SGD clips the task loss's per-sample gradients only: train with `run`")
        with self._training(job) as (parameters, rates):
            values = list(parameters.values())
            anchors = [job.anchor[name] for name in parameters] if job.anchor is not None and job.lam > 0 else None
            corrections = _corrections(job, parameters)
            self.count_trained(values)
            # One kernel call per operation over all tensors: a ResNet's adapters, BatchNorms and head are ~80 tensors.
            optimizer = torch.optim.SGD(rate_groups(parameters, rates), lr=job.lr, foreach=True)
            steps: list[torch.Tensor] = []
            for images, labels in self.minibatches(job.data, epochs=job.epochs, seed=job.seed, steps=job.steps):
                terms = objective.terms(images, labels)
                loss = sum(terms[1:], terms[0])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if anchors is not None:
                    with torch.no_grad():
                        gradients = [parameter.grad for parameter in values]
                        torch._foreach_add_(gradients, torch._foreach_sub(values, anchors), alpha=job.lam)
                if corrections:  # g <- g + c (SCAFFOLD)
                    torch._foreach_add_([parameters[name].grad for name in corrections], list(corrections.values()))
                optimizer.step()
                steps.append(torch.stack([term.detach() for term in terms]))
                self.samples_trained += len(labels)  # its objective's terms need not go through `loss`
        # Checked once the job is done (a diverged job's remaining steps are wasted, never its result)
        means = finite_means(steps, len(objective.names), job.lr)
        return job.finished(self.model.state()), dict(zip(objective.names, means, strict=True))

    def private_sgd(self, job: SGDJob) -> SGDResult:
        """`run` as DP-SGD (`peradapt.compute.privacy`): Poisson-sampled batches, each sample's gradient clipped
        to C, Gaussian noise of std σC, the mean over the expected batch size; then the proximal pull
        lam * (v - w) and the correction, functions of parameters only, taken as they are. Returns the final state
        and the mean loss per sample. With `steps`, that many Poisson batches."""
        privacy, data, anchor, lam = self.privacy, job.data, job.anchor, job.lam
        assert privacy is not None and data.labels is not None
        with self._training(job) as (parameters, rates):
            corrections = _corrections(job, parameters)
            self.count_trained(parameters.values())
            generator = seeded_generator(job.seed)  # Poisson draws, augmentation and dropout; the noise has its own
            batches = privacy.batches(len(data), self.batch_size, job.epochs, job.steps)
            optimizer = privacy.optimizer(rate_groups(parameters, rates), lr=job.lr, batches=batches, seed=job.seed)
            total_loss, samples = 0.0, 0
            with privacy.per_sample_gradients(self.model.module):
                for batch in batches.draw(generator):
                    optimizer.zero_grad(set_to_none=True)
                    if len(batch):
                        images = self.inputs(data.images[batch], generator)
                        labels = data.labels[batch].to(self.inputs.device, non_blocking=True)
                        loss = self.loss(images, labels, job.lr, reduction="sum")  # per-sample gradients: their own
                        loss.backward()
                        total_loss, samples = total_loss + loss.item(), samples + len(batch)
                    else:
                        privacy.no_samples(parameters.values())
                    with torch.no_grad():
                        proximal = anchor is not None and lam > 0
                        pull = {n: lam * (p - anchor[n]) for n, p in parameters.items()} if proximal else {}
                        optimizer.step()
                        # the pull and the correction: functions of parameters only, taken as they are (no clipping)
                        for name, step in pull.items():
                            parameters[name].sub_(step, alpha=rates[name])
                        for name, correction in corrections.items():
                            parameters[name].sub_(correction, alpha=rates[name])
                optimizer.zero_grad(set_to_none=True)  # the last step's clipped sum is not left on the shared model
        privacy.spend(batches)
        return job.finished(self.model.state()), total_loss / max(samples, 1)

    @contextlib.contextmanager
    def _training(self, job: SGDJob) -> Iterator[tuple[dict[str, nn.Parameter], dict[str, float]]]:
        """For the block: `job.start` loaded, the model in training mode, and the trainable parameters of no group
        without gradients (none is computed for them at all, as for the frozen backbone). Gives the parameters that
        train, by name, and their learning rates."""
        model = self.model
        model.load_state(job.start)
        model.train()
        everything = model.trainable_parameters()
        rates = job.rates(everything)
        frozen = [parameter for name, parameter in everything.items() if name not in rates]
        try:
            for parameter in frozen:
                parameter.requires_grad_(False)
            yield {name: everything[name] for name in rates}, rates
        finally:
            for parameter in frozen:
                parameter.requires_grad_(True)

    def minibatches(
        self, data: ImageSet, *, epochs: int, seed: int, steps: int | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Shuffled, augmented (images, labels) batches on the model's device for `epochs` passes; with `steps`,
        exactly `steps` batches instead, pass after pass (`--local-steps`: papers that count local iterations).

        The order, the augmentation and dropout all follow `seed`. Methods with their own update rules
        (pFedMe, APFL, ...) loop over these and call `loss`, with the model in training mode.
        """
        assert data.labels is not None, "training data must be labeled"
        stored, labels = data.images, data.labels
        if self.inputs.device.type == "cuda":  # resident on the device for the job: one copy, not one per step
            stored, labels = stored.to(self.inputs.device), labels.to(self.inputs.device)
        for batch, generator in self.index_batches(len(data), epochs=epochs, seed=seed, steps=steps):
            yield self.inputs(stored[batch], generator), labels[batch].to(self.inputs.device, non_blocking=True)

    def index_batches(
        self, count: int, *, epochs: int, seed: int, steps: int | None = None, share: float | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Generator]]:
        """The index batches of `minibatches` into `count` images, each with the generator its augmentation draws
        from (the one that shuffled it): a caller draws a batch's augmentation before it asks for the next batch,
        so the draws come in `minibatches`' order (concurrent clients: `peradapt.compute.concurrent`).

        With a `share` below 1 (None: `work_share`, the client's being trained), only the first batches of that
        share of the samples, the last one cut short (`costs.shared_sizes`): the same batches as the whole work
        until it stops."""
        share = self.work_share if share is None else share
        allowed = (
            None
            if share >= 1
            else shared_sizes(schedule_sizes(count, self.batch_size, epochs=epochs, steps=steps), share)
        )
        generator = seeded_generator(seed)
        drawn, passes = 0, 0
        while (drawn < steps) if steps is not None else (passes < epochs):
            for batch in iterate_minibatches(count, self.batch_size, generator):
                if (steps is not None and drawn == steps) or (allowed is not None and drawn == len(allowed)):
                    return
                drawn += 1
                yield (batch if allowed is None else batch[: allowed[drawn - 1]]), generator
            passes += 1

    def steps_of(self, job: SGDJob) -> int:
        """The SGD steps `run` takes for `job`: its minibatches at the client's `work_share`, or with `privacy` its
        Poisson batches (a step each, empty or not)."""
        if self.privacy is not None:
            return self.privacy.batches(len(job.data), self.batch_size, job.epochs, job.steps).steps
        sizes = schedule_sizes(len(job.data), self.batch_size, epochs=job.epochs, steps=job.steps)
        return len(shared_sizes(sizes, self.work_share))

    @contextlib.contextmanager
    def sharing(self, share: float) -> Iterator[None]:
        """For the block, every minibatch schedule cut to `share` of its samples (`work_share`)."""
        self.work_share = share
        try:
            yield
        finally:
            self.work_share = 1.0

    def loss(self, images: torch.Tensor, labels: torch.Tensor, lr: float, reduction: str = "mean") -> torch.Tensor:
        """`task_loss` of the model as it is loaded, the forward pass of a training step: its samples are counted
        (`samples_trained`). Stops the run if it is no longer finite."""
        self.samples_trained += len(labels)
        return finite(self.unchecked_loss(images, labels, reduction), lr)

    def unchecked_loss(self, images: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """`loss` without its check, nor its count (for `descend`, which checks the sum of its terms and counts its
        steps)."""
        with self.inputs.autocast():
            return task_loss(self.model(images), labels, reduction)

    def sample_flops(self, images: torch.Tensor) -> SampleFlops:
        """FLOPs per sample of a training step with every trainable parameter training (`costs.training_flops`) and
        of an inference pass (`costs.inference_flops`), on `images` (uint8, as stored) made model inputs. In
        evaluation mode, which changes no count: no BatchNorm statistic moves and no dropout draws, so the rounds
        see the model and random streams they would without."""
        training = self.model.module.training
        self.model.eval()
        try:
            with self.inputs.autocast():
                inputs = self.inputs(images)
                with torch.no_grad():  # a first pass builds what the model caches (frozen convolutions on small
                    self.model(inputs)  # maps as a dense matrix: `SmallInputConv2d`), once, not at every step
                trained = training_flops(self.model, inputs, self.model.trainable_parameters().values())
                return SampleFlops(trained, inference_flops(self.model, inputs))
        finally:
            if training:
                self.model.train()

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
