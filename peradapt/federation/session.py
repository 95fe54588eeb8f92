"""Everything a run is built from its config: data, frozen backbone with adapters, trainer, method.

Building a session validates every user input (data, weights, method, sizes) before anything is written, so a
mistake never leaves a half-made run directory behind.
"""

from __future__ import annotations

import functools
import importlib.metadata
import platform
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from peradapt.adapters import AdaptedModel, AdapterState, default_adapter_kind, inject_adapters
from peradapt.backbones import (
    BackboneInfo,
    DataFacts,
    check_input_sizes,
    check_weights,
    fixed_image_size,
    load_backbone,
    pinned_weights_path,
    weights_fingerprint,
)
from peradapt.compute.privacy import private_training
from peradapt.compute.trainer import InputPipeline, LocalTrainer
from peradapt.config import TrainConfig
from peradapt.data import ClientData, FederatedData, build_federation, has_pretraining_split
from peradapt.data.images import channel_statistics
from peradapt.distill import Distiller
from peradapt.errors import ConfigError, WeightsError
from peradapt.methods import METHODS, Method, MethodContext, build_method, check_private_method, method_class
from peradapt.methods.partial import PartialModelSettings
from peradapt.rundir.layout import read_partition, read_run_config
from peradapt.rundir.records import Resolved
from peradapt.rundir.store import ClientStore, DiskClientStore
from peradapt.seeds import EVALUATION, derive_seed

AUGMENTED_DATASETS = ("cifar10", "cifar100")  # the paper trains CIFAR with random crop + flip
# Beyond this many clients, what costs a pass over a large set per client (personalized global-test, OOD sets) or a
# state per client held at once (--lam auto) goes through a seeded sample of this many, as do --eval-every rounds.
CLIENT_SAMPLE = 100


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
    backbone_sha256: str  # `weights_fingerprint` of the backbone: a reopened run refuses other weights
    pinned_copy: Path | None = None  # loaded from the run's pinned copy of its weights file (`open_session`)

    def use_lam(self, lam: float) -> None:
        """Train with proximal strength `lam` (--lam auto's choice, made once the session is built): the session's
        config and its method's settings become copies with it, so that the config the session was built from is
        not written."""
        method_config = replace(self.config.method, lam=lam)
        self.config = replace(self.config, method=method_config)
        self.method.config = method_config

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

    @property
    def class_names(self) -> tuple[str, ...]:
        """The name of each class index (the data's own; its index as text where a source names none)."""
        return self.data.classes or tuple(str(index) for index in range(self.data.num_classes))

    def resolved(self) -> Resolved:
        """What the flags resolved to on this machine, written beside the config."""
        packages = ("peradapt", "torch", "timm", "peft", "numpy")
        return Resolved(
            adapter=self.adapter_kind,
            scope=self.model.scope,
            client_store=self.store.kind,
            weights=self.backbone.source,
            backbone_sha256=self.backbone_sha256,
            device=str(self.device),
            num_classes=self.data.num_classes,
            classes=list(self.class_names),
            skipped_images=list(self.data.skipped_images) or None,
            channels=self.data.channels,
            image_size=self.data.image_size,
            trainable_parameters=self.model.num_trainable(),
            backbone_parameters=self.model.num_backbone(),
            versions={
                "python": platform.python_version(),
                **{p: _version(p) for p in packages},
                "peradapt_source": source_commit(),
            },
        )


@functools.cache
def source_commit() -> str:
    """The commit of peradapt's source where it runs from a git checkout (an editable install), with "-dirty" when
    its tracked files differ from it: the numbers' exact code, which the version number alone does not name. An
    installed release says so. Read once per process: the code a process runs is what it loaded, so every run of one
    `compare` names the same source, even where the checkout changes while it runs."""
    here = Path(__file__).resolve().parents[1]  # the package: a checkout's top is its parent
    command = ["git", "-C", str(here.parent), "describe", "--always", "--dirty", "--abbrev=12"]
    if not (here.parent / ".git").exists():
        return "not a git checkout (an installed release: its version says it)"
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown (git could not read the checkout)"
    return done.stdout.strip()


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
    config: TrainConfig,
    saved_partition: dict | None = None,
    *,
    client_store: Path | None = None,
    weights: Path | None = None,
    backbone_sha256: str | None = None,
    recorded_image_size: int | None = None,
) -> Session:
    """Data, model, trainer and method of `config`; `saved_partition` reuses a run's partition.json, and clients'
    private state goes to a `DiskClientStore` in the directory `client_store` (None: in memory). `weights` loads
    the backbone from that file instead of the config's; `backbone_sha256` refuses a backbone of another
    fingerprint; `recorded_image_size` is the input size a saved run resolved, which its data keeps where the
    config names none (`open_session` passes all three for a saved run)."""
    config.validate()
    method_cls = method_class(config.method.method)
    check_private_method(config.method.method, config.privacy.enabled)
    if config.method.lam_auto and not method_cls.uses_proximal:
        proximal = ", ".join(name for name, cls in METHODS.items() if cls.uses_proximal)
        raise ConfigError(
            f"--lam auto chooses a proximal strength, which --method {config.method.method} has not: "
            f"pass a number, or use one of {proximal}"
        )
    check_input_sizes(config.backbone.backbone, config.data.image_size, config.distill.kd_image_size)
    backbone_section = config.backbone if weights is None else replace(config.backbone, weights=str(weights))
    pretrainable = has_pretraining_split(config.data.data)
    # Every check that needs no images is made before the data is loaded, which may take minutes to decode.
    check_weights(backbone_section, data=config.data.data, pretrainable=pretrainable)
    # A ViT takes the resolution it was made for; ResNets take any (None: the dataset's own default).
    # A saved run keeps the size it was trained at, whatever a later peradapt would choose for the same images.
    image_size = config.data.image_size or recorded_image_size or fixed_image_size(config.backbone.backbone)
    data = build_federation(
        replace(config.data, image_size=image_size),
        num_clients=config.federation.clients,
        seed=config.seed,
        saved_partition=saved_partition,
        normalization_constants=config.backbone.normalization_constants,
    )
    device = resolve_device(config.device)
    if device.type == "cuda":  # the memory the user allows this run (--concurrent-clients auto fills it)
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.set_per_process_memory_fraction(config.federation.gpu_memory_fraction, index)
    torch.manual_seed(config.seed)  # the new classifier head and the adapters' initial values
    facts = DataFacts(data.dataset, data.num_classes, data.channels, data.image_size, data.mean, data.std)
    backbone, info = load_backbone(backbone_section, facts, pretrainable=pretrainable)
    fingerprint = weights_fingerprint(backbone, info)
    if backbone_sha256 is not None and fingerprint != backbone_sha256:
        raise WeightsError(
            f"the backbone weights {info.source} are not the ones this run was trained on (fingerprint "
            f"{fingerprint[:12]}, the run's {backbone_sha256[:12]}): give the weights it was trained on"
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
    context = MethodContext(
        config.method, trainer, store, initial, distiller, data.clients, config.seed, federated, config.method_settings
    )
    method = build_method(config.method.method, context)
    return Session(config, data, model, trainer, method, store, initial, info, kind, device, fingerprint)


def open_session(
    run_dir: Path,
    config: TrainConfig | None = None,
    *,
    client_store: Path | None = None,
    weights: Path | None = None,
) -> Session:
    """The session of the saved run in `run_dir`, with `config` (default: its saved one; else one with the changes
    `--resume` or a Flower node may make), on the backbone the run was trained on: the weights file `weights`
    (`eval`/`export`/`personalize --weights`), else the pinned copy of its weights file where this machine has it
    (unless `config` names other weights), and in any case weights of the run's recorded fingerprint."""
    saved, resolved = read_run_config(run_dir)
    config = config or saved
    fingerprint = resolved.backbone_sha256
    trained_on = resolved.weights
    if weights is not None and not weights.is_file():
        raise WeightsError(f"--weights {weights} is not a file: give the weights file {run_dir} was trained on")
    pinned = pinned_weights_path(fingerprint)
    pinned_copy = pinned if weights is None and pinned.is_file() else None
    if config.backbone.weights != saved.backbone.weights:  # `--resume` or a Flower node naming other weights
        pinned_copy = None
    try:
        session = build_session(
            config,
            read_partition(run_dir),
            client_store=client_store,
            weights=weights or pinned_copy,
            backbone_sha256=fingerprint,
            recorded_image_size=resolved.image_size,
        )
    except WeightsError:
        if weights is not None or pinned_copy is not None:
            raise
        # Without the run's copy, the weights it names are gone or were replaced (a new `pretrain`, another machine).
        raise WeightsError(
            f"{run_dir} was trained on the backbone weights {trained_on} (fingerprint {fingerprint[:12]}), and this "
            f"machine has neither them nor the run's copy of them: copy that weights file (with its .json) to "
            f"{pinned}, where the run looks for it, or give it to eval, export or personalize with --weights FILE"
        ) from None
    if pinned_copy is not None or weights is not None:
        # The weights the run names, as their fingerprint says: it keeps naming them as it was trained.
        session.backbone.source, session.pinned_copy = trained_on, pinned_copy
    return session


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
    settings = config.method_settings
    if scope == "full" and not (isinstance(settings, PartialModelSettings) and settings.personal_part == "adapter"):
        return "none"
    return default_adapter_kind(config.backbone.backbone)
