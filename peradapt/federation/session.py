"""Everything a run is built from its config: data, frozen backbone with adapters, trainer, method.

Building a session validates every user input (data, weights, method, sizes) before anything is written, so a
mistake never leaves a half-made run directory behind.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from peradapt.adapters import AdaptedModel, AdapterState, default_adapter_kind, inject_adapters
from peradapt.backbones import BackboneInfo, fixed_image_size, load_backbone
from peradapt.config import TrainConfig
from peradapt.data import ClientData, FederatedData, build_federation
from peradapt.data.images import channel_statistics
from peradapt.distill import Distiller
from peradapt.errors import ConfigError, RunError
from peradapt.federation.local import InputPipeline, LocalTrainer
from peradapt.federation.privacy import check_private_method, private_training
from peradapt.federation.seeds import EVALUATION, derive_seed
from peradapt.federation.store import ClientStore, DiskClientStore
from peradapt.personalize import Method, MethodContext, build_method, method_class

AUGMENTED_DATASETS = ("cifar10", "cifar100")  # the paper trains CIFAR with random crop + flip
# Beyond this many clients, what costs a pass over a large set per client (personalized global-test, OOD sets) or a
# state per client held at once (--lam auto) goes through a seeded sample of this many, as do --eval-every rounds.
CLIENT_SAMPLE = 100


@dataclass
class RunPaths:
    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def partition(self) -> Path:
        return self.root / "partition.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def report(self) -> Path:
        return self.root / "report.json"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def clients(self) -> Path:
        return self.root / "clients"

    @property
    def global_adapter(self) -> Path:
        return self.root / "global"

    @property
    def client_store(self) -> Path:
        return self.root / "client_store"


@dataclass
class Session:
    config: TrainConfig
    data: FederatedData
    model: AdaptedModel
    trainer: LocalTrainer
    method: Method
    store: ClientStore
    initial: AdapterState
    backbone: BackboneInfo
    adapter_kind: str
    device: torch.device

    @property
    def federated_clients(self) -> list[ClientData]:
        """The clients that take part in training: all but the last --holdout-clients."""
        fed = self.config.federation
        return self.data.clients[: fed.clients - fed.holdout_clients]

    @property
    def held_out_clients(self) -> list[ClientData]:
        """The last --holdout-clients clients: never trained nor exported by `train`, kept for `personalize`."""
        return self.data.clients[len(self.federated_clients) :]

    @property
    def client_sample(self) -> list[ClientData]:
        """Every federated client, or beyond CLIENT_SAMPLE of them that many, drawn from --seed (always the same)."""
        clients = self.federated_clients
        if len(clients) <= CLIENT_SAMPLE:
            return clients
        rng = np.random.default_rng(derive_seed(self.config.seed, EVALUATION))
        return [clients[i] for i in sorted(rng.choice(len(clients), size=CLIENT_SAMPLE, replace=False))]

    def resolved(self) -> dict:
        """What the flags resolved to on this machine, written beside the config."""
        packages = ("peradapt", "torch", "timm", "peft", "numpy")
        return {
            "adapter": self.adapter_kind,
            "scope": self.model.scope,
            "client_store": self.store.kind,
            "parameter_counts": self.method.parameter_counts(),
            "weights": self.backbone.source,
            "device": str(self.device),
            "num_classes": self.data.num_classes,
            "channels": self.data.channels,
            "image_size": self.data.image_size,
            "trainable_parameters": self.model.num_trainable(),
            "backbone_parameters": self.model.num_backbone(),
            "versions": {"python": platform.python_version(), **{p: _version(p) for p in packages}},
        }


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but no CUDA GPU is visible: use --device cpu")
    return torch.device(name)


def build_session(
    config: TrainConfig, saved_partition: dict | None = None, *, client_store: Path | None = None
) -> Session:
    """Data, model, trainer and method of `config`; `saved_partition` reuses a run's partition.json, and clients'
    private state goes to a `DiskClientStore` in the directory `client_store` (None: in memory)."""
    config.validate()
    method_cls = method_class(config.method.method)
    check_private_method(config, method_cls)
    # A ViT takes the resolution it was made for; ResNets take any (None: the dataset's own default).
    image_size = config.data.image_size or fixed_image_size(config.backbone.backbone)
    data = build_federation(
        config.data.data,
        config.data.data_dir,
        num_clients=config.federation.clients,
        partition=config.data.partition,
        seed=config.seed,
        kd_data=config.data.kd_data,
        limit_samples=config.data.limit_samples,
        image_size=image_size,
        download=config.data.download,
        saved_partition=saved_partition,
        channels=config.data.channels,
        resize=config.data.resize,
    )
    device = resolve_device(config.device)
    torch.manual_seed(config.seed)  # the new classifier head and the adapters' initial values
    backbone, info = load_backbone(
        config.backbone.backbone,
        data=config.data.data,
        num_classes=data.num_classes,
        in_chans=data.channels,
        weights=config.backbone.weights,
        mean=data.mean,
        std=data.std,
        image_size=data.image_size,
        offline=config.backbone.offline,
        normalization=config.backbone.normalization,
    )
    backbone.to(device)
    if device.type == "cuda":
        backbone.to(memory_format=torch.channels_last)
    scope = config.method.scope or method_cls.default_scope
    kind = config.adapter.adapter or _default_kind(config, scope)
    model = inject_adapters(
        backbone,
        kind,
        dropout=config.adapter.adapter_dropout,
        lora_rank=config.adapter.lora_rank,
        scope=scope,
        frozen_bn=config.method.frozen_bn,
    )
    if method_cls.second_head:  # before anything reads the model's parameters: trainer, DP checks, initial state
        model.add_personal_head()
    inputs = InputPipeline(
        *channel_statistics(info.mean, info.std, data.channels),
        device,
        augment=_augmentation(config),
        image_size=data.image_size,
    )
    trainer = LocalTrainer(model, inputs, config.method.batch_size, privacy=private_training(config, model))
    distiller = None
    if method_cls.uses_distillation:
        distiller = Distiller(trainer, data.kd, data.val, config.distill, _distillation_inputs(config, data, inputs))
    store = ClientStore(device) if client_store is None else DiskClientStore(client_store, device)
    initial = model.state()
    federated = config.federation.clients - config.federation.holdout_clients
    context = MethodContext(config.method, trainer, store, initial, distiller, data.clients, config.seed, federated)
    method = build_method(config.method.method, context)
    return Session(config, data, model, trainer, method, store, initial, info, kind, device)


def _augmentation(config: TrainConfig) -> str:
    """`--augment`, with auto resolved: crop + flip for CIFAR (as the paper trains it), nothing otherwise."""
    if config.data.augment != "auto":
        return config.data.augment
    return "crop-flip" if config.data.data in AUGMENTED_DATASETS else "none"


def _distillation_inputs(config: TrainConfig, data: FederatedData, inputs: InputPipeline) -> InputPipeline:
    """How distillation images become model inputs: at the model's size or `--kd-image-size` (the authors' code
    feeds CIFAR-10 at its own 32 px to Office-Home and CheXpert models), normalized as the clients' data or with
    the distillation set's own statistics (`--kd-normalization own`, the authors'), cropped and flipped at every
    step with `--kd-augment crop-flip`."""
    distill = config.distill
    own = distill.kd_normalization == "own"
    return replace(
        inputs,
        mean=data.kd_mean if own else inputs.mean,
        std=data.kd_std if own else inputs.std,
        augment=distill.kd_augment,
        image_size=distill.kd_image_size or inputs.image_size,
    )


def _default_kind(config: TrainConfig, scope: str) -> str:
    """Full-model training needs no adapter unless the adapter is the personal part (FedAlt/FedSim)."""
    if scope == "full" and config.method.personal_part != "adapter":
        return "none"
    return default_adapter_kind(config.backbone.backbone)


def read_run_config(run_dir: Path) -> tuple[TrainConfig, dict]:
    paths = RunPaths(run_dir)
    if not paths.config.is_file():
        raise RunError(f"{run_dir} is not a peradapt run directory (no config.json): pass the --out of a train run")
    try:
        saved = json.loads(paths.config.read_text())
        return TrainConfig.from_dict(saved["config"]), saved.get("resolved", {})
    except (ValueError, KeyError) as exc:
        raise RunError(f"{paths.config} is unreadable ({exc})") from None


def read_partition(run_dir: Path) -> dict:
    path = RunPaths(run_dir).partition
    if not path.is_file():
        raise RunError(f"{run_dir} has no partition.json: the run was never started")
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise RunError(f"{path} is unreadable ({exc})") from None
