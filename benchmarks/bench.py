"""peradapt's speed, memory and scale against the reference PerAda design (issue 6): docs/BENCHMARKS.md.

    python benchmarks/bench.py --quick --json bench.json   # under 5 minutes on 2 CPU cores
    python benchmarks/bench.py --json bench.json           # the paper's model and batch, longer phases
    python benchmarks/bench.py --smoke --data-dir DIR      # every phase at toy size: the test suite's check that
                                                           # it runs (its figures mean nothing)

Every figure is a ratio of two things run interleaved in this one process, with `torch.set_num_threads` fixed and
the order of the two alternating between repetitions, so that other work on the machine slows both alike; the
median over the repetitions is reported. The scale figures compare two fresh processes, one per federation size,
each measuring its own peak RSS and round times.

The reference baselines (two model copies per client, teachers recomputed at every distillation step, a bare
training loop) are written here from the issue's description of the reference code, not taken from it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from peradapt.adapters import AdaptedModel, AdapterState, inject_adapters
from peradapt.backbones import BackboneInfo, create_backbone, freeze, save_backbone
from peradapt.compute.concurrent import ConcurrentSGD
from peradapt.compute.trainer import InputPipeline, LocalTrainer, Objective, SGDJob
from peradapt.config import DistillConfig, MethodConfig, TrainConfig
from peradapt.data import ClientData, ImageSet
from peradapt.distill import Distiller, ensemble_logits
from peradapt.distill.kd import validation_checks
from peradapt.federation.session import CLIENT_SAMPLE
from peradapt.methods import MethodContext, build_method
from peradapt.methods.base import LocalSGDMethod, Method
from peradapt.presets import preset_settings
from peradapt.rundir.store import ClientStore
from peradapt.seeds import SERVER, derive_seed

CLASSES = 10
CHANNELS = 3
MEAN, STD = (0.5,) * CHANNELS, (0.25,) * CHANNELS
# The run `estimate` prices: the preset's settings, and CIFAR-10's sizes (50,000 training images of which the server
# keeps 1/10 for validation, peradapt.data.federation; 10,000 test images, all divided among the clients).
ESTIMATE_PRESET = "perada-cifar10"
CIFAR10_TRAIN, CIFAR10_TEST, CIFAR10_VAL_SHARE = 50_000, 10_000, 0.1
LAM, LR, DROPOUT = 1.0, 0.01, 0.3  # the paper's λ, client learning rate and adapter dropout
# On CPU, measured with no goal: compute, not launches, binds
GPU_GOALS = {
    "concurrent_vs_sequential": (4.0, True),
    "concurrent_vs_sequential_32": (8.0, True),
    "fused_step_vs_inference": (0.40, True),
}
GOALS = {  # (key, goal, whether bigger is better)
    "adapter_step_vs_inference": (0.40, True),
    "state_ratio": (15.0, True),
    "kd_phase_vs_student_only": (1.25, False),
    "engine_overhead": (1.15, False),
    "scale_rss_ratio": (1.2, False),
    "scale_time_ratio": (1.2, False),
}


@dataclass(frozen=True)
class Settings:
    backbone: str = "resnet18"  # the paper's CIFAR-10 model, at its 32 px input and batch 64
    image_size: int = 32
    batch_size: int = 64
    threads: int = 1  # see --threads
    repeats: int = 15  # adapter step against inference
    step_batches: int = 4  # minibatches per timed call of LocalTrainer.sgd
    fused_steps: int = 8  # steps per client per timed call of the fused step (concurrent phase)
    small_clients: int = 32  # concurrent phase on a GPU: many clients of smaller data
    small_client_images: int = 64
    small_repeats: int = 3
    kd_teachers: int = 8  # the paper's 8 sampled clients per round
    kd_images: int = 512
    kd_batch_size: int = 128
    kd_steps: int = 80  # 20 passes over the distillation images, as the paper's 500 steps x 2048 over 50k
    kd_val_images: int = 256  # half the distillation images, as Fashion-MNIST's validation and KD splits
    kd_repeats: int = 3
    round_clients: int = 8
    client_images: int = 128
    round_epochs: int = 2  # local and personal epochs of a round
    round_repeats: int = 5
    scale_backbone: str = "resnet10_w4"
    scale_small: int = 100
    scale_large: int = 10_000
    scale_per_round: int = 8
    scale_client_images: int = 2  # Fashion-MNIST's client pool (25,000 images) has 2 for each of 10,000 clients
    scale_rounds: int = 6
    scale_repeats: int = 3
    # On a GPU (issue 35): a round of 1,000 clients x 50 images, every client trained, and 10,000 clients x 2
    # images with 1,000 a round (Fashion-MNIST's client pool of 25,000 images bounds clients x images)
    scale_gpu_clients: int = 1_000
    scale_gpu_client_images: int = 50
    scale_gpu_large: int = 10_000
    scale_gpu_large_images: int = 2
    scale_gpu_per_round: int = 1_000
    estimate_kd_batch_size: int = 256  # on a CPU; on a GPU the preset's own 2048 (see estimate)
    estimate_kd_steps: int = 4  # per timed distillation: its steps 2.. are timed
    estimate_val_images: int = 512  # on a CPU (one inference chunk); on a GPU the preset's 5,000
    size: str = "full"  # full, quick or smoke: which of SIZES these are (the scale phase's children rebuild them)
    data_dir: str | None = None  # the scale phase's Fashion-MNIST IDX files; None: Debian's dataset-fashion-mnist
    device: str = "cpu"  # --device: cuda measures the GPU path (bf16 autocast, channels-last)


QUICK = Settings(
    repeats=7,
    kd_images=128,
    kd_val_images=64,
    kd_batch_size=64,
    kd_steps=10,  # 5 passes: the least the issue allows
    kd_repeats=3,
    client_images=64,
    round_epochs=1,
    round_repeats=3,
    scale_repeats=2,
    estimate_kd_batch_size=64,
    estimate_kd_steps=3,
    size="quick",
)
# Every phase at toy size, one repetition: tests/test_bench.py runs it to prove that each phase still runs through
# peradapt's current interfaces. Its figures measure nothing.
SMOKE = Settings(
    backbone="resnet10_w4",
    batch_size=8,
    repeats=1,
    step_batches=1,
    fused_steps=1,
    kd_teachers=2,
    kd_images=16,
    kd_batch_size=8,
    kd_steps=2,
    kd_val_images=8,
    kd_repeats=1,
    round_clients=2,
    client_images=8,
    round_epochs=1,
    round_repeats=1,
    scale_small=4,
    scale_large=40,
    scale_per_round=2,
    scale_rounds=3,
    scale_repeats=1,
    small_clients=4,
    small_client_images=8,
    small_repeats=1,
    scale_gpu_clients=4,
    scale_gpu_client_images=4,
    scale_gpu_large=40,
    scale_gpu_large_images=2,
    scale_gpu_per_round=8,
    estimate_kd_batch_size=8,
    estimate_kd_steps=2,
    estimate_val_images=8,
    size="smoke",
)
SIZES = {"full": Settings(), "quick": QUICK, "smoke": SMOKE}


# ---------------------------------------------------------------- measuring


def interleaved(candidates: dict[str, Callable[[], object]], repeats: int, warm_up: bool = True) -> dict[str, list]:
    """Seconds per call of each candidate, `repeats` times; each repetition starts with the next candidate, so a
    slow phase of the machine falls on all of them alike."""
    names = list(candidates)
    if warm_up:  # first calls pay for allocations and oneDNN kernel selection
        for name in names:
            candidates[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for repetition in range(repeats):
        shift = repetition % len(names)
        for name in names[shift:] + names[:shift]:
            synchronize()
            start = time.perf_counter()
            candidates[name]()
            synchronize()  # a GPU runs asynchronously: the time is the kernels', not their launches'
            times[name].append(time.perf_counter() - start)
    return times


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def on_device(model: torch.nn.Module, settings: Settings) -> torch.nn.Module:
    """`model` where the benchmark runs; on a GPU in channels-last, as `build_session` puts the backbone."""
    device = torch.device(settings.device)
    model.to(device)
    if device.type == "cuda":
        model.to(memory_format=torch.channels_last)
    return model


def median_ratio(numerators: list[float], denominators: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(numerators, denominators, strict=True))


def random_images(count: int, settings: Settings, seed: int, labeled: bool = True) -> ImageSet:
    generator = torch.Generator().manual_seed(seed)
    size = settings.image_size
    images = torch.randint(0, 256, (count, CHANNELS, size, size), dtype=torch.uint8, generator=generator)
    labels = torch.randint(0, CLASSES, (count,), generator=generator) if labeled else None
    return ImageSet(images, labels, CLASSES)


def adapted_trainer(
    settings: Settings, batch_size: int | None = None, *, frozen_bn: str = "eval", augment: str = "none"
) -> LocalTrainer:
    """PerAda's model: the frozen backbone with residual adapters (random weights: speed does not depend on them)."""
    torch.manual_seed(0)
    backbone = freeze(create_backbone(settings.backbone, CLASSES, CHANNELS))
    on_device(backbone, settings)
    model = inject_adapters(backbone, "residual", dropout=DROPOUT, lora_rank=8, frozen_bn=frozen_bn)
    pipeline = InputPipeline(MEAN, STD, torch.device(settings.device), augment=augment)
    return LocalTrainer(model, pipeline, batch_size or settings.batch_size)


def perturbed(model: AdaptedModel, seed: int, scale: float = 0.05) -> AdapterState:
    generator = torch.Generator().manual_seed(seed)
    state = model.state()
    for name in model.trainable_parameters():
        noise = torch.randn(state[name].shape, generator=generator).to(state[name].device)
        state[name] = state[name] + scale * noise
    return state


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


# ---------------------------------------------------------------- adapter step against inference


def adapter_step_vs_inference(settings: Settings) -> dict:
    """PerAda's personalized step (LocalTrainer.sgd with an anchor: forward, loss, proximal term, backward, SGD
    step) against inference of the plain backbone, without adapters, on batches of the same size.

    "Plain" is the backbone as timm makes it. peradapt's own frozen backbone (`freeze`: small feature maps as one
    matrix product, peradapt.backbones.small_inputs) infers faster; the step is also given against that."""
    trainer = adapted_trainer(settings)
    images = settings.batch_size * settings.step_batches
    data = random_images(images, settings, seed=1)
    start, anchor = trainer.model.state(), perturbed(trainer.model, seed=2)
    plain = on_device(create_backbone(settings.backbone, CLASSES, CHANNELS).requires_grad_(False).eval(), settings)
    own = on_device(freeze(create_backbone(settings.backbone, CLASSES, CHANNELS)).eval(), settings)
    batches = [trainer.inputs(chunk) for chunk in data.images.split(settings.batch_size)]
    contiguous = [batch.contiguous() for batch in batches]

    def step() -> None:
        trainer.sgd(start, data, epochs=1, lr=LR, seed=0, anchor=anchor, lam=LAM)

    def read_back(loss: torch.Tensor) -> torch.Tensor:
        """What each step did before issue 35's first step: checked the loss and read it into Python, two waits of
        the host for the device."""
        if not torch.isfinite(loss):
            raise RuntimeError("diverged")
        loss.item()
        return loss

    synced = Objective(lambda images, labels: (read_back(trainer.unchecked_loss(images, labels)),), ("loss",))
    job = SGDJob(start, data, epochs=1, lr=LR, seed=0, anchor=anchor, lam=LAM)

    def step_reading_each_loss() -> None:
        trainer.descend(job, synced)

    def inference(model: torch.nn.Module, inputs: list[torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            with torch.inference_mode(), trainer.inputs.autocast():  # bf16 on a GPU, as training
                for batch in inputs:
                    model(batch)

        return run

    def forward_backward() -> None:
        """The issue's bound: one forward and one input-gradient backward of the plain backbone."""
        with trainer.inputs.autocast():
            for batch in batches:
                plain(batch.requires_grad_()).sum().backward()

    candidates = {
        "step": step,
        "step_reading_each_loss": step_reading_each_loss,
        "inference_channels_last": inference(plain, batches),
        "inference_contiguous": inference(plain, contiguous),
        "own_inference": inference(own, batches),
        "forward_backward": forward_backward,
    }
    times = interleaved(candidates, settings.repeats)
    # The faster memory layout of inference in each repetition: the baseline is the best the backbone does.
    best = [min(pair) for pair in zip(times["inference_channels_last"], times["inference_contiguous"], strict=True)]
    return {
        "adapter_step_vs_inference": median_ratio(best, times["step"]),
        # > 1: how much faster the step is for reading its losses once per job rather than at every step
        "step_losses_read_once_vs_each_step": median_ratio(times["step_reading_each_loss"], times["step"]),
        "adapter_step_vs_own_inference": median_ratio(times["own_inference"], times["step"]),
        "own_inference_vs_inference": median_ratio(best, times["own_inference"]),
        "forward_backward_vs_inference": median_ratio(best, times["forward_backward"]),
        "adapter_step_images_per_s": images / statistics.median(times["step"]),
        "inference_images_per_s": images / statistics.median(best),
        "own_inference_images_per_s": images / statistics.median(times["own_inference"]),
        "inference_contiguous_images_per_s": images / statistics.median(times["inference_contiguous"]),
        "inference_channels_last_images_per_s": images / statistics.median(times["inference_channels_last"]),
    }


# ---------------------------------------------------------------- per-client state


def state_ratio(settings: Settings) -> dict:
    """Bytes per client: two full models (the reference's personalized and local copies) against what peradapt's
    client store holds for a PerAda client after its first round."""
    full = create_backbone("resnet18", CLASSES, CHANNELS)  # the model, whatever the size says
    reference = 2 * nbytes(full.state_dict())
    tiny = replace(settings, backbone="resnet18", batch_size=8)
    trainer = adapted_trainer(tiny)
    store = ClientStore()
    config = MethodConfig(method="perada-nokd", local_epochs=1, personal_epochs=1, lr=LR, batch_size=8)
    initial = trainer.model.state()
    method = build_method("perada-nokd", MethodContext(config, trainer, store, initial, None))
    data = random_images(16, tiny, seed=3)
    indices = np.arange(len(data))
    method.client_update(ClientData(0, data, data, indices, indices), initial, seed=0)
    held = nbytes(store.checkpoint_tensors())  # one client: everything the store holds
    return {
        "state_ratio": reference / held,
        "reference_bytes_per_client": reference,
        "peradapt_bytes_per_client": held,
    }


# ---------------------------------------------------------------- distillation phase


def kd_phase_vs_student_only(settings: Settings) -> dict:
    """A distillation phase (PerAda's server: the 8 sampled clients as teachers, R Adam steps of the student, with
    validation checks) against its student-only cost: the same phase less the teachers' logits, which peradapt
    computes once per round (`ensemble_logits`) and times here in the same repetition. At the paper's 20 passes over
    the distillation data the teachers' one pass each should cost at most a quarter of the student's steps."""
    trainer = adapted_trainer(settings, settings.kd_batch_size)
    model = trainer.model
    teachers = [perturbed(model, seed=10 + t) for t in range(settings.kd_teachers)]
    student = {k: v.clone() for k, v in teachers[0].items()}
    kd_data = random_images(settings.kd_images, settings, seed=4, labeled=False)
    val_data = random_images(settings.kd_val_images, settings, seed=5)
    config = DistillConfig(kd_steps=settings.kd_steps, kd_batch_size=settings.kd_batch_size)
    distiller = Distiller(trainer, kd_data, val_data, config)

    def phase() -> None:
        distiller.distill(student, teachers, seed=0)

    def teacher_logits() -> None:
        ensemble_logits(trainer, teachers, kd_data, distiller.inputs)

    # Each phase is long (seconds): its own first repetition is warm-up enough.
    times = interleaved({"phase": phase, "teachers": teacher_logits}, settings.kd_repeats, warm_up=False)
    student_only = [whole - part for whole, part in zip(times["phase"], times["teachers"], strict=True)]
    return {
        "kd_phase_vs_student_only": median_ratio(times["phase"], student_only),
        "kd_phase_s": statistics.median(times["phase"]),
        "kd_teachers_s": statistics.median(times["teachers"]),
        "kd_passes_over_data": settings.kd_steps * settings.kd_batch_size / settings.kd_images,
    }


# ---------------------------------------------------------------- engine overhead


def perada_round(settings: Settings) -> tuple[Method, list[ClientData]]:
    """PerAda without distillation on `round_clients` clients of `client_images` random images each, with
    `round_epochs` personal and local epochs: a round's client side."""
    trainer = adapted_trainer(settings)
    clients = []
    for client_id in range(settings.round_clients):
        data = random_images(settings.client_images, settings, seed=100 + client_id)
        indices = np.arange(len(data))
        clients.append(ClientData(client_id, data, data, indices, indices))
    config = MethodConfig(
        method="perada-nokd",
        local_epochs=settings.round_epochs,
        personal_epochs=settings.round_epochs,
        lam=LAM,
        lr=LR,
        batch_size=settings.batch_size,
    )
    initial = trainer.model.state()
    return build_method("perada-nokd", MethodContext(config, trainer, ClientStore(), initial, None)), clients


def engine_overhead(settings: Settings) -> dict:
    """One PerAda round without distillation through peradapt's method code (`client_update` for every sampled
    client, then `server_update`) against a bare PyTorch loop doing the same SGD steps on the same data."""
    method, clients = perada_round(settings)
    trainer, initial = method.trainer, method.context.initial

    def peradapt_round() -> None:
        updates = [method.client_update(c, initial, derive_seed(0, 0, c.client_id)) for c in clients]
        method.server_update(initial, updates, seed=derive_seed(0, 0, SERVER), round_index=0)

    bare = BareLoop(trainer.model, clients, trainer.inputs, settings)
    times = interleaved({"peradapt": peradapt_round, "bare": lambda: bare.round(initial)}, settings.round_repeats)
    steps = len(clients) * 2 * settings.round_epochs * -(-settings.client_images // settings.batch_size)
    return {
        "engine_overhead": median_ratio(times["peradapt"], times["bare"]),
        "round_s": statistics.median(times["peradapt"]),
        "bare_round_s": statistics.median(times["bare"]),
        "round_sgd_steps": steps,
    }


# ---------------------------------------------------------------- concurrent clients


def one_after_another(method: LocalSGDMethod, clients: list[ClientData]) -> Callable[[], None]:
    """A round's client side, one client after another (`client_update`), from the method's initial state."""

    def run() -> None:
        for client in clients:
            method.client_update(client, method.context.initial, derive_seed(0, 0, client.client_id))

    return run


def together(concurrent: ConcurrentSGD, method: LocalSGDMethod, clients: list[ClientData]) -> Callable[[], None]:
    """The same client side, the clients trained at once by `concurrent`."""

    def run() -> None:
        initial = method.context.initial
        concurrent.run_steps([method.client_steps(c, initial, derive_seed(0, 0, c.client_id)) for c in clients])

    return run


def concurrent_vs_sequential(settings: Settings) -> dict:
    """The client side of a PerAda round (8 clients, each its personal then its local epochs) with the clients
    trained together (`--concurrent-clients 8`: `ConcurrentSGD`, by its fused step; on a GPU also without CUDA
    graphs; and by `vmap` over `grad`) against one after another (`client_update`). Then the fused step itself
    (`fused_step_vs_inference`): the 8 clients' steps of batch 64 at once against inference of the plain backbone
    on batches of 8 x 64 images."""
    method, clients = perada_round(settings)
    assert isinstance(method, LocalSGDMethod)
    gpu = settings.device == "cuda"
    fused, by_vmap = ConcurrentSGD(method.trainer), ConcurrentSGD(method.trainer, fused=False)
    assert fused.fused is not None, "the bench's model is one the fused step serves"
    candidates = {
        "sequential": one_after_another(method, clients),
        "fused": together(fused, method, clients),
        "vmap": together(by_vmap, method, clients),
    }
    if gpu:
        candidates["fused_eager"] = together(ConcurrentSGD(method.trainer, graphs=False), method, clients)
    times = interleaved(candidates, settings.round_repeats)
    images = len(clients) * 2 * settings.round_epochs * settings.client_images
    results = {
        "concurrent_vs_sequential": median_ratio(times["sequential"], times["fused"]),
        "vmap_vs_sequential": median_ratio(times["sequential"], times["vmap"]),
        "fused_vs_vmap": median_ratio(times["vmap"], times["fused"]),
        "concurrent_clients": len(clients),
        "concurrent_clients_round_s": statistics.median(times["fused"]),
        "sequential_clients_round_s": statistics.median(times["sequential"]),
        "concurrent_images_per_s": images / statistics.median(times["fused"]),
    }
    if gpu:
        results["graphs_vs_eager"] = median_ratio(times["fused_eager"], times["fused"])
        results |= many_small_clients(settings)
    return results | fused_step_vs_inference(settings, method.trainer, len(clients))


def many_small_clients(settings: Settings) -> dict:
    """The issue's second GPU goal: `concurrent_vs_sequential` for 32 clients of smaller data (64 images each)."""
    small = replace(settings, round_clients=settings.small_clients, client_images=settings.small_client_images)
    method, clients = perada_round(small)
    assert isinstance(method, LocalSGDMethod)
    candidates = {
        "sequential": one_after_another(method, clients),
        "fused": together(ConcurrentSGD(method.trainer), method, clients),
    }
    times = interleaved(candidates, settings.small_repeats)
    return {
        "concurrent_vs_sequential_32": median_ratio(times["sequential"], times["fused"]),
        "concurrent_32_clients": f"{len(clients)} clients x {settings.small_client_images} images",
        "concurrent_32_round_s": statistics.median(times["fused"]),
        "sequential_32_round_s": statistics.median(times["sequential"]),
    }


def fused_step_vs_inference(settings: Settings, trainer: LocalTrainer, clients: int) -> dict:
    """`clients` clients' proximal steps at once (jobs of `fused_steps` steps of batch `batch_size` each, as
    `ConcurrentSGD.run` takes them: inputs, masks, the fused forward and backward, the pull and the SGD step)
    against inference of the plain backbone on the same images, `clients` x `batch_size` at a time."""
    batch = settings.batch_size
    data = random_images(batch * settings.fused_steps, settings, seed=1)
    anchor = perturbed(trainer.model, seed=2)
    jobs = [
        SGDJob(perturbed(trainer.model, seed=30 + k), data, 1, LR, seed=k, anchor=anchor, lam=LAM)
        for k in range(clients)
    ]
    concurrent = ConcurrentSGD(trainer)
    plain = on_device(create_backbone(settings.backbone, CLASSES, CHANNELS).requires_grad_(False).eval(), settings)
    inputs = trainer.inputs(data.images)
    everything = inputs.repeat(clients, 1, 1, 1)  # each client's images, as the fused step trains on them
    chunks = list(everything.split(clients * batch))

    def inference() -> None:
        with torch.inference_mode(), trainer.inputs.autocast():
            for chunk in chunks:
                plain(chunk)

    times = interleaved({"fused": lambda: concurrent.run(jobs), "inference": inference}, settings.repeats)
    images = clients * len(data)
    return {
        "fused_step_vs_inference": median_ratio(times["inference"], times["fused"]),
        "fused_step_images_per_s": images / statistics.median(times["fused"]),
        "fused_inference_images_per_s": images / statistics.median(times["inference"]),
        "fused_step_batch": clients * batch,
    }


class BareLoop:
    """The hand-written loop: normalized images held as float tensors, a list of tensors per client state, plain
    torch.optim.SGD; only what the round needs, no seeds per phase, no store, no checks."""

    def __init__(self, model: AdaptedModel, clients: list[ClientData], pipeline: InputPipeline, settings: Settings):
        self.model = model
        named = model.module.state_dict(keep_vars=True)
        # A client's state: the trainable parameters, then the trainable BatchNorms' statistics.
        names = sorted(model.state(), key=lambda name: not isinstance(named[name], torch.nn.Parameter))
        self.names = names
        self.tensors = [named[name] for name in names]
        self.parameters = [t for t in self.tensors if isinstance(t, torch.nn.Parameter)]
        self.inputs = [pipeline(c.train.images) for c in clients]
        self.labels = [c.train.labels for c in clients]
        self.personal: list[list[torch.Tensor] | None] = [None] * len(clients)
        self.batch_size = settings.batch_size
        self.epochs = settings.round_epochs
        self.generator = torch.Generator().manual_seed(0)

    def round(self, initial: AdapterState) -> list[torch.Tensor]:
        """Personal (proximal) and local SGD for every client, then the mean of the local states."""
        global_values = [initial[name] for name in self.names]
        uploads = []
        for client in range(len(self.inputs)):
            self.personal[client] = self._train(client, self.personal[client] or global_values, global_values)
            uploads.append(self._train(client, global_values, None))
        return [
            torch.stack(values).mean(dim=0) if values[0].is_floating_point() else values[0]
            for values in zip(*uploads, strict=True)
        ]

    def _train(self, client: int, start: list[torch.Tensor], anchor: list[torch.Tensor] | None) -> list[torch.Tensor]:
        with torch.no_grad():
            for tensor, value in zip(self.tensors, start, strict=True):
                tensor.copy_(value)
        self.model.train()
        optimizer = torch.optim.SGD(self.parameters, lr=LR)
        images, labels = self.inputs[client], self.labels[client]
        for _ in range(self.epochs):
            for batch in torch.randperm(len(images), generator=self.generator).split(self.batch_size):
                loss = F.cross_entropy(self.model(images[batch]), labels[batch])
                optimizer.zero_grad()
                loss.backward()
                if anchor is not None:
                    with torch.no_grad():
                        for parameter, fixed in zip(self.parameters, anchor, strict=False):
                            parameter.grad.add_(parameter - fixed, alpha=LAM)
                optimizer.step()
        return [t.detach().clone() for t in self.tensors]


# ---------------------------------------------------------------- cost of a paper-shaped run


def estimate(settings: Settings) -> dict:
    """Hours of a whole PerAda run on CIFAR-10 as preset perada-cifar10 sets it, from unit times measured here on
    random 32 px images with the preset's model (ResNet-18, residual adapters, dropout 0.3, frozen_bn train) and
    inputs (crop-flip), through peradapt's own code:

    - t_p, t_l: one personal (proximal) and one local step of `LocalTrainer.sgd`, batch 64;
    - t_kd(B): one distillation step of `Distiller.distill` (kd_mode train, kd_augment crop-flip) at batch B with
      the 8 sampled clients as teachers, less the validation check that follows it (kd_eval_every 1): the time
      between two steps' `on_step` calls less the `trainer.score` call between them. In train mode (and with
      augmented images) the 8 teachers run on every batch, so a step is 8 teacher forwards and one student
      forward and backward of B images: t_kd scales as B;
    - t_i: inference of one image (eval mode, chunks of 512): the validation checks' `trainer.score`, per image.

    With n = 45,000 / 20 client images (CIFAR-10 less the server's 5,000 validation images), s = ceil(n / 64)
    steps per epoch, K = 8 clients per round, E = S = 10 local and personal epochs, R = 200 rounds:
        client side  = R K s (S t_p + E t_l)
        distillation = rounds distilling x [500 t_kd(B) 2048 / B + 501 checks x 5,000 t_i]   (one check before)
        evaluation   = (R / 2 x 30,000 + 230,000) t_i
    30,000 images every 2 rounds: every client's test split with its personalized and with the global adapter,
    and the global adapter on all 10,000 test images; the final evaluation adds each of the 20 personalized
    adapters on all 10,000. Rounds distilling: the authors' 30 (`estimate_run_hours`) or all 200, Algorithm 1
    (`estimate_run_hours_kd_every_round`). Not counted: averaging, checkpoints, data loading.

    On a CPU the distillation batch and validation split are scaled down (per-image costs hold there); on a GPU
    the preset's own 2048 and 5,000 are measured, as per-image costs there fall with the batch. `peradapt train
    --dry-run` and `compare --dry-run` price a user's own runs from the same unit times, measured on the run's own
    model and data (`peradapt.commands.estimate`)."""
    config = TrainConfig.from_flat(preset_settings(ESTIMATE_PRESET))
    fed, method, distill = config.federation, config.method, config.distill
    gpu = settings.device == "cuda"
    val_images = round(CIFAR10_TRAIN * CIFAR10_VAL_SHARE)
    kd_batch = distill.kd_batch_size if gpu else settings.estimate_kd_batch_size
    measured_val = val_images if gpu else settings.estimate_val_images
    kd_steps = max(settings.estimate_kd_steps, 2)  # steps 2.. follow a check: the first is not timed

    trainer = adapted_trainer(settings, method.batch_size, frozen_bn=method.frozen_bn, augment=config.data.augment)
    model = trainer.model
    start, anchor = model.state(), perturbed(model, seed=2)
    data = random_images(method.batch_size * settings.step_batches, settings, seed=1)

    def sgd(proximal: bool) -> Callable[[], None]:
        def run() -> None:
            trainer.sgd(
                start, data, epochs=1, lr=method.lr, seed=0, anchor=anchor if proximal else None, lam=method.lam
            )

        return run

    concurrent = ConcurrentSGD(trainer)
    others = [perturbed(model, seed=20 + k) for k in range(fed.clients_per_round)]

    def sgd_together(proximal: bool) -> Callable[[], None]:
        """A step of the round's clients at once (--concurrent-clients auto on a GPU trains them so)."""
        jobs = [
            SGDJob(s, data, 1, method.lr, seed=k, anchor=anchor if proximal else None, lam=method.lam)
            for k, s in enumerate(others)
        ]

        def run() -> None:
            concurrent.run(jobs)

        return run

    candidates = {"personal": sgd(True), "local": sgd(False)}
    if gpu:
        candidates |= {"personal_together": sgd_together(True), "local_together": sgd_together(False)}
    steps = interleaved(candidates, settings.repeats)
    personal_s = statistics.median(steps["personal"]) / settings.step_batches
    local_s = statistics.median(steps["local"]) / settings.step_batches

    teachers = [perturbed(model, seed=10 + t) for t in range(fed.clients_per_round)]
    student = {k: v.clone() for k, v in teachers[0].items()}
    kd_data = random_images(kd_batch, settings, seed=4, labeled=False)
    val_data = random_images(measured_val, settings, seed=5)
    kd_config = replace(distill, kd_steps=kd_steps, kd_batch_size=kd_batch)
    kd_inputs = replace(trainer.inputs, augment=distill.kd_augment)
    distiller = Distiller(trainer, kd_data, val_data, kd_config, kd_inputs)
    checks: list[float] = []  # seconds of each validation check, as the distillation makes it
    score = trainer.score

    def timed_score(state: AdapterState, images: ImageSet) -> float:
        synchronize()
        began = time.perf_counter()
        value = score(state, images)
        synchronize()
        checks.append(time.perf_counter() - began)
        return value

    trainer.score = timed_score  # type: ignore[method-assign]
    calls: list[tuple[list[float], list[float]]] = []  # per distillation: its on_step times, its checks

    def distillation() -> None:
        marks: list[float] = []

        def on_step(step: int) -> None:
            synchronize()
            marks.append(time.perf_counter())

        checks.clear()
        distiller.distill(student, teachers, seed=0, on_step=on_step)
        calls.append((marks, list(checks)))

    augmented = kd_inputs(kd_data.images, torch.Generator().manual_seed(6))

    def teacher_logits() -> None:
        distiller.teacher_logits(teachers, augmented, model.train)

    times = interleaved({"distill": distillation, "teachers": teacher_logits}, settings.kd_repeats)
    timed = calls[1:]  # the first is the warm-up
    # Between on_step k and k+1: check k (checks[k]; checks[0] is the one before the first step), then step k+1.
    kd_step_measured = statistics.median(
        marks[k + 1] - marks[k] - made[k + 1] for marks, made in timed for k in range(len(marks) - 1)
    )
    inference_image_s = statistics.median(c for _, made in timed for c in made) / measured_val

    client_images = round(CIFAR10_TRAIN * (1 - CIFAR10_VAL_SHARE)) / fed.clients
    steps_per_epoch = -(-round(client_images) // method.batch_size)  # a last partial batch is a step too
    client_round_s = (
        fed.clients_per_round * steps_per_epoch * (method.personal_epochs * personal_s + method.local_epochs * local_s)
    )
    sequential_client_s = fed.rounds * client_round_s
    together_s: dict[str, float] = {}
    if gpu:  # the round's clients as one (what auto does there): a step of all of them per step of one
        for kind in ("personal", "local"):
            together_s[kind] = statistics.median(steps[f"{kind}_together"]) / settings.step_batches
        client_round_s = steps_per_epoch * (
            method.personal_epochs * together_s["personal"] + method.local_epochs * together_s["local"]
        )
    kd_checks = validation_checks(distill)  # the starting mean's, then every --kd-eval-every steps and the last
    kd_step_s = kd_step_measured * distill.kd_batch_size / kd_batch
    kd_phase_s = distill.kd_steps * kd_step_s + kd_checks * val_images * inference_image_s
    kd_rounds = min(distill.kd_rounds or fed.rounds, fed.rounds)
    evaluated = min(fed.clients, CLIENT_SAMPLE)
    local_test = CIFAR10_TEST * evaluated // fed.clients  # the evaluated clients' test splits
    evaluations = fed.rounds // fed.eval_every if fed.eval_every else 0
    check_images = 2 * local_test + CIFAR10_TEST  # personalized and global on local test, global on global test
    final_images = check_images + evaluated * CIFAR10_TEST  # and each personalized adapter on global test
    evaluation_images = evaluations * check_images + final_images
    client_s = fed.rounds * client_round_s
    evaluation_s = evaluation_images * inference_image_s
    hours = 1 / 3600
    return {
        "estimate_run_hours": (client_s + kd_rounds * kd_phase_s + evaluation_s) * hours,
        # With the clients one after another (on a GPU; on a CPU that is what auto does, the same figure)
        "estimate_run_hours_sequential": (sequential_client_s + kd_rounds * kd_phase_s + evaluation_s) * hours,
        "estimate_clients_at_once": fed.clients_per_round if gpu else 1,
        **{f"estimate_client_{k}_step_together_s": v for k, v in together_s.items()},
        "estimate_run_hours_kd_every_round": (client_s + fed.rounds * kd_phase_s + evaluation_s) * hours,
        "estimate_client_side_hours": client_s * hours,
        "estimate_distillation_hours": kd_rounds * kd_phase_s * hours,
        "estimate_distillation_hours_every_round": fed.rounds * kd_phase_s * hours,
        "estimate_evaluation_hours": evaluation_s * hours,
        "estimate_client_step_s": (personal_s + local_s) / 2,
        "estimate_client_personal_step_s": personal_s,
        "estimate_client_local_step_s": local_s,
        "estimate_kd_step_s": kd_phase_s / distill.kd_steps,  # at 2048 images, with its validation check
        "estimate_kd_step_without_check_s": kd_step_s,
        "estimate_kd_measured_batch": kd_batch,
        "estimate_kd_measured_step_s": kd_step_measured,
        "estimate_kd_teacher_share": statistics.median(times["teachers"]) / kd_step_measured,
        "estimate_kd_phase_s": kd_phase_s,
        "estimate_inference_image_s": inference_image_s,
        "estimate_rounds": fed.rounds,
        "estimate_client_images": client_images,
        "estimate_client_steps_per_round": fed.clients_per_round
        * steps_per_epoch
        * (method.personal_epochs + method.local_epochs),
        "estimate_kd_rounds": kd_rounds,
        "estimate_kd_steps": distill.kd_steps,
        "estimate_kd_batch_size": distill.kd_batch_size,
        "estimate_kd_teachers": fed.clients_per_round,
        "estimate_kd_checks_per_round": kd_checks,
        "estimate_kd_val_images": val_images,
        "estimate_evaluations": evaluations,
        "estimate_evaluation_images": evaluation_images,
    }


# ---------------------------------------------------------------- scale


def scale(settings: Settings, workdir: Path) -> dict:
    """Peak RSS and seconds per round of PerAda (no distillation) at M = 10,000 clients against M = 100: the same
    clients per round and a few images per client, client states on disk. Each size runs `peradapt train` in a
    fresh process, which reports its own peak RSS and the time between its rounds; the two sizes alternate.
    On a GPU: `scale_on_gpu` instead."""
    weights = workdir / "backbone.safetensors"
    backbone = create_backbone(settings.scale_backbone, CLASSES, 1)
    info = BackboneInfo(settings.scale_backbone, 1, 28, (0.5,), (0.25,), "random weights: speed does not need more")
    save_backbone(backbone.state_dict(), info, weights)
    if settings.device == "cuda":
        return scale_on_gpu(settings, weights, workdir)
    sizes = (settings.scale_small, settings.scale_large)
    runs: dict[int, list[dict]] = {clients: [] for clients in sizes}
    for repetition in range(settings.scale_repeats):
        for clients in sizes if repetition % 2 == 0 else sizes[::-1]:
            run = ScaleRun(clients, settings.scale_per_round, settings.scale_client_images)
            runs[clients].append(scale_run(run, weights, workdir / f"run-{clients}-{repetition}", settings))
    small, large = runs[settings.scale_small], runs[settings.scale_large]
    return {
        "scale_rss_ratio": median_ratio([r["peak_rss_bytes"] for r in large], [r["peak_rss_bytes"] for r in small]),
        "scale_time_ratio": median_ratio([r["round_s"] for r in large], [r["round_s"] for r in small]),
        "scale_peak_rss_bytes": {str(m): statistics.median(r["peak_rss_bytes"] for r in runs[m]) for m in sizes},
        "scale_round_s": {str(m): statistics.median(r["round_s"] for r in runs[m]) for m in sizes},
    }


def scale_on_gpu(settings: Settings, weights: Path, workdir: Path) -> dict:
    """On a GPU, with what --concurrent-clients auto does there:

    - `round_1000_clients_s`: a PerAda round (no distillation) of 1,000 clients of 50 images each, every one
      trained (a personal and a local epoch), in this process through the method's code as `perada_round` builds
      it (the paper's model, random 32 px images, states in memory): the clients in groups of as many as fit the
      GPU (`ConcurrentSGD.clients_at_once`), then the server's update. Fashion-MNIST's client pool (25,000
      images) cannot give 1,000 clients 50 images each, so this one is not a CLI run;
    - 10,000 clients of 2 images, 1,000 trained a round, client states on disk: a `peradapt train` run in a fresh
      process (as the CPU scale phase), its round time and peak GPU memory."""
    round_settings = replace(
        settings, round_clients=settings.scale_gpu_clients, client_images=settings.scale_gpu_client_images
    )
    method, clients = perada_round(replace(round_settings, round_epochs=1))
    assert isinstance(method, LocalSGDMethod)
    initial = method.context.initial
    concurrent = ConcurrentSGD(method.trainer)
    together, _ = concurrent.clients_at_once([client.train for client in clients], 0.9)

    def one_round() -> None:
        updates = []
        for start in range(0, len(clients), together):
            group = clients[start : start + together]
            updates += concurrent.run_steps([method.client_steps(c, initial, c.client_id) for c in group])
        method.server_update(initial, updates, seed=derive_seed(0, 0, SERVER), round_index=0)

    torch.cuda.reset_peak_memory_stats()
    times = interleaved({"round": one_round}, settings.scale_repeats)
    peak = torch.cuda.max_memory_allocated()
    large = ScaleRun(settings.scale_gpu_large, settings.scale_gpu_per_round, settings.scale_gpu_large_images)
    run = scale_run(large, weights, workdir / "gpu-large", settings)
    return {
        "round_1000_clients_s": statistics.median(times["round"]),
        "round_1000_clients": f"{len(clients)} clients x {settings.scale_gpu_client_images} images, all trained",
        "round_1000_clients_at_once": together,
        "round_1000_clients_peak_cuda_bytes": peak,
        "scale_gpu_10000_round_s": run["round_s"],
        "scale_gpu_10000_peak_cuda_bytes": run["peak_cuda_bytes"],
        "scale_gpu_10000": f"{large.clients} clients x {large.images} images, {large.per_round} a round",
    }


@dataclass(frozen=True)
class ScaleRun:
    clients: int
    per_round: int
    images: int  # per client


def scale_run(run: ScaleRun, weights: Path, out: Path, settings: Settings) -> dict:
    command = [sys.executable, __file__, "--scale-child", str(run.clients), "--weights", str(weights)]
    command += ["--out", str(out), "--per-round", str(run.per_round), "--client-images", str(run.images)]
    command += ["--threads", str(settings.threads), "--size", settings.size, "--device", settings.device]
    command += ["--data-dir", settings.data_dir] if settings.data_dir else []
    finished = subprocess.run(command, capture_output=True, text=True, check=False)
    if finished.returncode != 0:
        tail = (finished.stderr or finished.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"the {run.clients}-client run failed: {' / '.join(tail)}")
    return json.loads(finished.stdout.strip().splitlines()[-1])


class RoundClock:
    """A file for rich's Console that notes the time and the peak RSS so far at every round line the engine prints
    (one per round when the output is no terminal), and ends the process after the last round: the final
    evaluation and export of every client that follow are no rounds, and take time proportional to M."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds
        self.times: list[float] = []
        self.pending = ""

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if line.startswith("round "):
                self.times.append(time.perf_counter())
                if len(self.times) == self.rounds:
                    self.report()
        return len(text)

    def flush(self) -> None:
        pass

    def report(self) -> None:
        gaps = np.diff(self.times)  # round 1 pays for first-touch costs: rounds 2.. are timed
        cuda = torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else None
        figures = {"peak_rss_bytes": peak_rss_bytes(), "round_s": float(np.median(gaps)), "peak_cuda_bytes": cuda}
        print(json.dumps(figures), flush=True)
        os._exit(0)


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status: the scale figures need Linux")


def scale_child(run: ScaleRun, weights: str, out: str, settings: Settings) -> None:
    from rich.console import Console

    from peradapt.config import TrainConfig
    from peradapt.federation.engine import train

    flat = {
        "data": "fmnist",  # the offline default: Debian's dataset-fashion-mnist
        "backbone": settings.scale_backbone,
        "weights": weights,
        "clients": run.clients,
        "clients_per_round": run.per_round,
        "rounds": settings.scale_rounds,
        "eval_every": 0,
        "partition": "iid",
        "method": "perada-nokd",
        "local_epochs": 1,
        "personal_epochs": 1,
        "batch_size": run.images,
        "limit_samples": run.clients * run.images,  # a few images per client at any M
        "data_dir": settings.data_dir,
        "client_store": "disk",
        "device": settings.device,
        "out": out,
    }
    clock = RoundClock(settings.scale_rounds)
    train(TrainConfig.from_flat(flat), console=Console(file=clock, width=200))
    raise RuntimeError(f"the run ended after {len(clock.times)} of {settings.scale_rounds} round lines")


# ---------------------------------------------------------------- main


def machine() -> dict:
    fields = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())  # the first processor's
    return {
        "cpu": fields.get("model name", platform.processor()),
        "cpu_family_model": f"{fields.get('cpu family', '?')}/{fields.get('model', '?')}",
        "cpu_flags_avx512": "avx512f" in fields.get("flags", "").split(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


BENCHMARKS: dict[str, Callable[[Settings], dict]] = {
    "step": adapter_step_vs_inference,
    "state": state_ratio,
    "kd": kd_phase_vs_student_only,
    "engine": engine_overhead,
    "concurrent": concurrent_vs_sequential,
    "estimate": estimate,
}
ON_DEVICE = ("step", "kd", "concurrent", "estimate")  # the figures --device moves to a GPU (and `make gpu-check` takes)
ON_GPU = (*ON_DEVICE, "scale")  # what --device cuda measures: the scale phase there is `scale_on_gpu`


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--quick", action="store_true", help="smaller phases: under 5 minutes on 2 CPU cores")
    sizes.add_argument(
        "--smoke", action="store_true", help="every phase at toy size, once: checks that it runs, measures nothing"
    )
    sizes.add_argument("--size", choices=tuple(SIZES), help=argparse.SUPPRESS)  # the scale phase's children
    parser.add_argument(
        "--data-dir", help="Fashion-MNIST's IDX files for the scale phase (default: Debian's dataset-fashion-mnist)"
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads for every measurement (default 1: on a shared machine, a second OpenMP thread "
        "waits on cores that other jobs hold, and the figures measure the neighbours)",
    )
    parser.add_argument("--only", help=f"comma-separated subset of {', '.join([*BENCHMARKS, 'scale'])}")
    parser.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help=f"where the {', '.join(ON_GPU)} figures are measured (the others are CPU figures; scale on a GPU is "
        "other runs: see scale_on_gpu)",
    )
    parser.add_argument("--scale-child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--weights", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--per-round", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--client-images", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = args.size or ("smoke" if args.smoke else "quick" if args.quick else "full")
    settings = replace(SIZES[size], threads=args.threads, device=args.device, data_dir=args.data_dir)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible")
    torch.set_num_threads(settings.threads)
    if args.scale_child:
        scale_child(ScaleRun(args.scale_child, args.per_round, args.client_images), args.weights, args.out, settings)
        return
    chosen = args.only.split(",") if args.only else [*BENCHMARKS, "scale"]
    if args.device == "cuda" and not set(chosen) <= set(ON_GPU):
        parser.error(f"--device cuda measures {', '.join(ON_GPU)}: pass --only with those")
    results: dict = {"size": size, "device": args.device, "machine": machine(), "settings": asdict(settings)}
    failed: dict[str, str] = {}
    for name in chosen:
        started = time.perf_counter()
        try:
            if name == "scale":
                with tempfile.TemporaryDirectory(prefix="peradapt-bench-") as workdir:
                    results.update(scale(settings, Path(workdir)))
            else:
                results.update(BENCHMARKS[name](settings))
        except Exception as error:  # the other phases' figures still count (a GPU is lent briefly): exit 1 at the end
            traceback.print_exc()
            failed[name] = f"{type(error).__name__}: {error}"
        print(f"{name}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        if args.json:  # after every phase: a run stopped by a time limit keeps the figures it took
            args.json.write_text(json.dumps({**results, **({"failed": failed} if failed else {})}, indent=2) + "\n")
    if failed:
        results["failed"] = failed
    print_results(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    if failed:
        sys.exit(f"error: phase(s) {', '.join(failed)} failed (tracebacks above)")


def print_results(results: dict) -> None:
    goals = {**GOALS, **(GPU_GOALS if results["device"] == "cuda" else {})}
    for key, (goal, bigger_is_better) in goals.items():
        if key in results:
            value = results[key]
            met = value >= goal if bigger_is_better else value <= goal
            relation = ">=" if bigger_is_better else "<="
            print(f"{key:28s} {value:8.3f}   goal {relation} {goal:<5}  {'met' if met else 'MISSED'}")
    for key, value in results.items():
        if key not in goals and key not in ("machine", "settings", "size", "device", "failed"):
            print(f"{key:36s} {value}")


if __name__ == "__main__":
    main()
