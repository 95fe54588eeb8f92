"""Run configuration: one dataclass per concern, one flat namespace of keys.

Every field name is unique across sections, so a config file (YAML or JSON) and the command-line flags use
the same flat keys (`clients`, `lam`, `kd_steps`, ...) while library code reads `config.method.lam`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peradapt.errors import ConfigError

# Settings reach torch as float32, which holds no larger magnitude (torch refuses to convert one).
FLOAT32_MAX = 3.4028234663852886e38
# BatchNorm in training mode normalizes a batch by its own statistics, which one sample has not: client minibatches
# (and distillation batches under --kd-mode train) hold 2 samples or more.
MIN_BATCH_SIZE = 2
# The distillation loss is scaled by T², which float32 holds from about here (below: a loss of 0, then NaN).
MIN_KD_TEMPERATURE = 1e-18
# opacus' RDP accountant adds terms (α² - α) / (2σ²) in log space: below σ ≈ 5e-154 they overflow a float and its
# series for fractional orders α never ends (below ~1e-162, σ² is 0 and it divides by zero); below ~2e-73 the ε of
# a client's 1e9 steps (about steps / 2σ²) overflows the report's statistics (its square). Measured, opacus 1.6.
MIN_DP_NOISE = 1e-70
# Images are resized once and held in memory (a client pool of 10,000 RGB images at 4096 px: 500 GB): larger sizes
# only end in an allocation failure. Backbones take 224-518 px.
MAX_IMAGE_SIZE = 4096


@dataclass
class DataConfig:
    data: str = "fmnist"
    data_dir: str | None = None
    partition: str = "dir:0.1"
    kd_data: str = "auto"
    limit_samples: int | None = None
    image_size: int | None = None  # None: a ViT's input size; else native, or 224 px for data decoded from files
    download: bool = False
    # Client-training augmentation: auto (crop + flip for CIFAR, none otherwise), none, crop-flip, or resized-crop
    # (RandomResizedCrop to the model's size, area scale in [0.05, 1], + flip: the authors' CheXpert pipeline).
    augment: str = "auto"
    channels: int | None = None  # None: the dataset's own (1 for fmnist/chexpert); 3: grey repeated as RGB
    resize: str = "squeeze"  # images decoded from files: squeeze (whole image to a square) or center-crop
    image_column: str | None = None  # --data hf:NAME: the column of images (None: its Image feature)
    label_column: str | None = None  # --data hf:NAME: the column of labels (None: its ClassLabel, or label, ...)


@dataclass
class BackboneConfig:
    backbone: str = "resnet18"  # a timm model name (pretrained tag allowed), or hf:PATH_OR_ID
    weights: str | None = None
    offline: bool = False  # never fetch hub weights: only what the local cache already holds
    normalization: str = "auto"  # auto: the weights' own statistics where known, else the data's; data: the data's


@dataclass
class AdapterConfig:
    adapter: str | None = None  # None: residual for ResNets, lora for ViTs
    adapter_dropout: float = 0.3
    lora_rank: int = 8


# `--client-store auto` keeps client states on disk above this many clients. In memory, every state is held and
# rewritten into every round's checkpoint: for PerAda's ResNet-18 adapters (1.41M parameters, 5.6 MB a client) 100
# clients already make a 565 MB checkpoint per round, more than the disk store's cost of one small file read and
# written per sampled client. Up to here a run directory keeps the plain layout of small federations.
DISK_STORE_ABOVE = 100


@dataclass
class FederationConfig:
    clients: int = 20
    clients_per_round: int = 8
    rounds: int = 200
    eval_every: int = 10
    holdout_clients: int = 0  # the last K client ids never take part in training (`peradapt personalize` them)
    client_store: str = "auto"  # memory, disk, or auto: disk above DISK_STORE_ABOVE clients (always under Flower)
    engine: str = "builtin"  # builtin (clients simulated in this process) or flower (ServerApp/ClientApp)
    # The builtin engine trains up to this many of a round's clients at once (peradapt.compute.concurrent);
    # 1: one after another, the default: on CPU the batched step is slower (docs/BENCHMARKS.md).
    concurrent_clients: int = 1

    def store_kind(self) -> str:
        """Where clients' private state lives between rounds: `memory` or `disk`, `auto` resolved."""
        if self.client_store != "auto":
            return self.client_store
        # Flower's ClientApps run in other processes (or machines), re-created every round: state lives on disk.
        return "disk" if self.clients > DISK_STORE_ABOVE or self.engine == "flower" else "memory"


@dataclass
class MethodConfig:
    method: str = "perada"
    scope: str | None = None  # adapter or full; None: the method's own default
    personal_part: str | None = None  # partial-model methods: bn, head, input, output or adapter
    local_epochs: int = 10
    local_steps: int | None = None  # E as minibatch steps instead of epochs (papers that count local iterations)
    personal_epochs: int = 10
    body_epochs: int = 1  # FedRep: epochs on the shared body after the head's personal_epochs (Collins et al.: 1)
    lam: float = 1.0
    lam_auto: bool = False  # `--lam auto`: the personalized-FedProx rule chooses lam from heterogeneity
    lr: float = 0.01
    personal_lr: float | None = None  # None: --lr
    batch_size: int = 64
    ft_epochs: int | None = None  # fine-tuning epochs before evaluation (fedavg-ft, fedbabu); None: the method's
    inner_steps: int = 3  # K: inner steps of pFedMe / pFedBreD
    beta: float = 1.0  # server step size of pFedMe / pFedBreD
    mu: float = 1.0  # FedProx (Li et al.) proximal mu: 1 is their best value on MNIST, FEMNIST and synthetic data
    aggregation: str | None = None  # the server's mean: samples (n_m-weighted) or uniform; None: the paper's
    am: bool = False  # pFedMe / pFedBreD aggregate momentum (pFedBreD Appendix C.4): beta = 2, overriding beta
    # Who runs the client update each round: all (every federated client; only the sample is aggregated) or
    # sampled; None: the method's paper (all for pFedMe and pFedBreD, Algorithm 1; sampled for the others).
    train_clients: str | None = None
    prior: str = "mh"  # pFedBreD prior mean: lg, meg, mh (Shi et al. Eq. 14) or mh-code (the authors' code's mh)
    prior_lr: float = 0.01  # pFedBreD eta_alpha: meta-step on the loss gradient (lg, mh, mh-code)
    prior_eta: float = 0.05  # pFedBreD eta: meta-step on the memorized envelope gradient (meg, mh)
    apfl_alpha: float = 0.5  # APFL: initial mixing weight alpha_m^(0) of every client
    alpha_lr: float | None = None  # APFL: step size of alpha (Deng et al. eq. 10); None: --lr, 0: alpha fixed
    # fine-tuning methods (fedavg-ft, perfedavg, ...): N minibatch steps instead of --ft-epochs; None: the method's
    # default (perfedavg: 1 step, the paper's evaluation, unless --ft-epochs is given; others: --ft-epochs), 0: none
    ft_steps: int | None = None
    feddyn_alpha: float = 0.01  # FedDyn alpha: weight of the dynamic regularizer (the authors' CIFAR-10 script)
    feddyn_client_alpha: str = "uniform"  # FedDyn: uniform (alpha for all, Algorithm 1) or by-size (authors' code)
    perfedavg_variant: str = "hf"  # Per-FedAvg meta-gradient: hf (Hessian-free) or fo (first-order)
    perfedavg_delta: float = 0.001  # Per-FedAvg (HF): finite-difference step delta of the Hessian-vector product
    ala_sample: float = 80.0  # FedALA s: percent of the local data on which ALA learns its weights (the paper: 80)
    ala_layers: int = 1  # FedALA p: ALA on the last p layers (modules), 1 = the head; 0: every layer
    ala_lr: float = 1.0  # FedALA eta: SGD step size of the aggregation weights (the paper: 1.0)
    mtl_omega: str = "mean"  # MTL task relationships: mean (fixed (I - 11^T/M)^2) or learned (MOCHA's Omega-step)
    # FedRoD: each client's personal head at start: zero (the model's own, peradapt) or generic (a copy of the
    # initial generic head, as PFLlib's clientrod.py deep-copies the model's head)
    personal_head_init: str = "zero"
    # BatchNorms of the frozen backbone during client training: eval (pretrained statistics, Algorithm 1 trains
    # adapters only) or train (batch statistics, running statistics re-estimated per client: the authors' code).
    frozen_bn: str = "eval"


@dataclass
class DistillConfig:
    kd_steps: int = 500
    kd_batch_size: int = 2048
    server_lr: float = 1e-3
    kd_temperature: float = 1.0
    kd_eval_every: int = 0  # 0: ten validation checks per distillation
    kd_patience: int = 0  # 0: never stop early, only keep the best adapter
    kd_rounds: int = 0  # distill only in the first N rounds, then only average (the authors' kd_max_round); 0: all
    kd_mode: str = "eval"  # eval: teachers and student in inference mode; train: dropout and batch statistics on
    kd_augment: str = "none"  # none, or crop-flip: distillation images randomly cropped and flipped every step
    kd_loss: str = "softmax"  # softmax: KL of softmaxes (the paper's sigma); bernoulli: per-label KL (multi-label)
    kd_image_size: int | None = None  # None: the model's input size; N: distillation images at N px
    kd_normalization: str = "model"  # model: the client data's statistics; own: the distillation set's own


@dataclass
class PrivacyConfig:
    """Sample-level differential privacy of client training: DP-SGD (`peradapt.compute.privacy`)."""

    dp_noise: float | None = None  # noise multiplier σ; None: no differential privacy
    dp_clip: float | None = None  # C: every sample's gradient is clipped to this L2 norm
    dp_delta: float = 1e-5  # the δ at which each client's ε is reported

    @property
    def enabled(self) -> bool:
        return self.dp_noise is not None

    def validate(self, *, lam_auto: bool) -> None:
        if (self.dp_noise is None) != (self.dp_clip is None):
            raise ConfigError("differential privacy takes both --dp-noise SIGMA and --dp-clip C: pass both or neither")
        if not 0 < self.dp_delta < 1:
            raise ConfigError(f"--dp-delta must be between 0 and 1 (e.g. 1e-5), got {self.dp_delta}")
        if self.dp_noise is None or self.dp_clip is None:
            return
        if self.dp_noise <= 0 or self.dp_clip <= 0:
            raise ConfigError(f"--dp-noise and --dp-clip must be positive, got {self.dp_noise} and {self.dp_clip}")
        if self.dp_noise < MIN_DP_NOISE:
            raise ConfigError(
                f"--dp-noise must be at least {MIN_DP_NOISE:g}, got {self.dp_noise:g}: the privacy accountant cannot "
                "bound ε for less noise in floating point (and a σ much below 1 already gives a vacuous ε)"
            )
        if lam_auto:
            raise ConfigError(
                "--lam auto measures heterogeneity by training on every client's data outside the privacy "
                "accounting: with --dp-noise pass a number"
            )


@dataclass
class TrainConfig:
    data: DataConfig = field(default_factory=DataConfig)
    backbone: BackboneConfig = field(default_factory=BackboneConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    federation: FederationConfig = field(default_factory=FederationConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    seed: int = 0
    device: str = "auto"
    out: str | None = None
    log: str | None = None  # experiment trackers, comma-separated (peradapt.federation.tracking); never changes results

    def to_flat(self) -> dict[str, Any]:
        flat: dict[str, Any] = {}
        for section in _SECTIONS:
            flat.update(dataclasses.asdict(getattr(self, section)))
        flat.update({name: getattr(self, name) for name in _TOP_LEVEL})
        return flat

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_flat(cls, values: dict[str, Any]) -> TrainConfig:
        config = cls()
        for key, value in values.items():
            key = key.replace("-", "_")
            if key not in _FLAT_FIELDS:
                raise ConfigError(f"unknown setting '{key}'; known settings: {', '.join(sorted(_FLAT_FIELDS))}")
            if key == "lam" and isinstance(value, str) and value.strip().lower() == "auto":
                config.method.lam_auto = True
                continue
            section = _FLAT_FIELDS[key]
            target = getattr(config, section) if section else config
            setattr(target, key, _coerce(key, value, _field_types[key]))
        config.validate()
        return config

    @classmethod
    def from_dict(cls, nested: Any) -> TrainConfig:
        """The config that `to_dict` gave (a run's config.json): its sections as objects, every value of its field's
        JSON type. Unlike `from_flat` (flags, config files), nothing is converted: another type is a ConfigError."""
        if not isinstance(nested, dict):
            raise ConfigError(f"the config is {type(nested).__name__}, not an object of sections")
        missing = [section for section in _SAVED_SECTIONS if section not in nested]
        if missing:
            raise ConfigError(f"the config has no section '{missing[0]}'")
        flat: dict[str, Any] = {}
        for key, value in nested.items():
            if key in _SECTION_CLASSES:
                if not isinstance(value, dict):
                    raise ConfigError(f"section '{key}' is {type(value).__name__}, not an object of settings")
                flat.update(value)
            else:
                flat[key] = value
        for key, value in flat.items():
            type_name = _field_types.get(key)
            if type_name is not None and not _is_json_type(value, type_name):
                raise ConfigError(f"setting '{key}' must be {type_name.replace(' | None', ' or null')}, got {value!r}")
        return cls.from_flat(flat)

    def validate(self) -> None:
        fed, method, distill = self.federation, self.method, self.distill
        for name, value in self.to_flat().items():  # inf and nan pass every comparison below: refuse them first
            if isinstance(value, float) and not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
                raise ConfigError(
                    f"--{name.replace('_', '-')} must be a finite number no larger than {FLOAT32_MAX:.4g} in size "
                    f"(training computes in float32), got {value}"
                )
        if not 0 <= self.seed < 2**63:  # the range torch's and numpy's generators take
            raise ConfigError(f"--seed must be between 0 and 2^63 - 1, got {self.seed}")
        positive = {
            "clients": fed.clients,
            "clients_per_round": fed.clients_per_round,
            "kd_batch_size": distill.kd_batch_size,
            "lora_rank": self.adapter.lora_rank,
            "inner_steps": method.inner_steps,
            "concurrent_clients": fed.concurrent_clients,
        }
        if method.local_steps is not None:  # None: --local-epochs counts the local work
            positive["local_steps"] = method.local_steps
        positive["body_epochs"] = method.body_epochs
        for name, value in positive.items():
            if value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if method.batch_size < MIN_BATCH_SIZE:
            raise ConfigError(
                f"--batch-size must be at least {MIN_BATCH_SIZE}, got {method.batch_size}: BatchNorm layers (in "
                "ResNet adapters, --scope full) train on each batch's statistics, which one sample has not"
            )
        non_negative = {
            "rounds": fed.rounds,
            "local_epochs": method.local_epochs,
            "personal_epochs": method.personal_epochs,
            "kd_steps": distill.kd_steps,
            "lam": method.lam,
            "ft_epochs": method.ft_epochs or 0,  # None: the method's own
            "ft_steps": method.ft_steps or 0,  # None: the method's own
            "mu": method.mu,
            "eval_every": fed.eval_every,
            "ala_layers": method.ala_layers,
            "prior_lr": method.prior_lr,
            "prior_eta": method.prior_eta,
            "alpha_lr": method.alpha_lr or 0.0,  # None: --lr
        }
        for name, value in non_negative.items():
            if value < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must not be negative, got {value}")
        if fed.clients_per_round > fed.clients:
            raise ConfigError(
                f"--clients-per-round {fed.clients_per_round} is more than --clients {fed.clients}: "
                "lower --clients-per-round or raise --clients"
            )
        if not 0 <= fed.holdout_clients < fed.clients:
            raise ConfigError(
                f"--holdout-clients must be at least 0 and less than --clients {fed.clients}, got {fed.holdout_clients}"
            )
        if fed.clients_per_round > fed.clients - fed.holdout_clients:
            raise ConfigError(
                f"--clients-per-round {fed.clients_per_round} is more than the {fed.clients - fed.holdout_clients} "
                f"clients left in training by --holdout-clients {fed.holdout_clients}: lower one of them"
            )
        if fed.client_store not in CLIENT_STORES:
            raise ConfigError(f"unknown --client-store '{fed.client_store}': use {', '.join(CLIENT_STORES)}")
        if fed.engine not in ENGINES:
            raise ConfigError(f"unknown --engine '{fed.engine}': use {', '.join(ENGINES)}")
        if fed.engine == "flower" and fed.client_store == "memory":
            raise ConfigError(
                "--engine flower keeps clients' private state on disk (its ClientApps are re-created every round): "
                "use --client-store disk or auto"
            )
        if fed.engine == "flower" and self.privacy.enabled:
            raise ConfigError(
                "--dp-noise accounts each client's ε in the server's client store, which Flower's nodes keep for "
                "themselves: run differentially private training with --engine builtin"
            )
        if method.scope not in (None, "adapter", "full"):
            raise ConfigError(f"unknown --scope '{method.scope}': use adapter or full")
        if method.personal_part not in (None, *PERSONAL_PARTS):
            raise ConfigError(f"unknown --personal-part '{method.personal_part}': use {', '.join(PERSONAL_PARTS)}")
        if method.train_clients not in (None, *TRAIN_CLIENTS):
            raise ConfigError(f"unknown --train-clients '{method.train_clients}': use {', '.join(TRAIN_CLIENTS)}")
        if method.aggregation not in (None, *AGGREGATIONS):
            raise ConfigError(f"unknown --aggregation '{method.aggregation}': use {', '.join(AGGREGATIONS)}")
        if (method.personal_lr is not None and method.personal_lr <= 0) or method.beta <= 0:
            raise ConfigError("--personal-lr and --beta must be positive")
        if method.lr <= 0 or distill.server_lr <= 0:
            raise ConfigError("--lr and --server-lr must be positive")
        positive_floats = {
            "feddyn_alpha": method.feddyn_alpha,
            "perfedavg_delta": method.perfedavg_delta,
            "ala_lr": method.ala_lr,
        }
        for name, value in positive_floats.items():
            if value <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {value}")
        if not 0.0 <= method.apfl_alpha <= 1.0:
            raise ConfigError(f"--apfl-alpha is a mixing weight: give one in [0, 1], got {method.apfl_alpha}")
        if not 0.0 < method.ala_sample <= 100.0:
            raise ConfigError(
                f"--ala-sample is a percent of the local data: give one in (0, 100], got {method.ala_sample}"
            )
        if distill.kd_temperature < MIN_KD_TEMPERATURE:
            raise ConfigError(
                f"--kd-temperature must be at least {MIN_KD_TEMPERATURE:g}, got {distill.kd_temperature}: the "
                "distillation loss is scaled by its square, which float32 cannot hold below that"
            )
        if not 0.0 <= self.adapter.adapter_dropout < 1.0:
            raise ConfigError("--adapter-dropout must be in [0, 1)")
        if self.data.limit_samples is not None and self.data.limit_samples < 1:
            raise ConfigError("--limit-samples must be at least 1")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"--device must be auto, cpu or cuda, got '{self.device}'")
        choices = {
            "augment": (self.data.augment, AUGMENTATIONS),
            "resize": (self.data.resize, RESIZES),
            "normalization": (self.backbone.normalization, NORMALIZATIONS),
            "frozen_bn": (method.frozen_bn, BN_MODES),
            "kd_mode": (distill.kd_mode, BN_MODES),
            "kd_augment": (distill.kd_augment, KD_AUGMENTATIONS),
            "kd_loss": (distill.kd_loss, KD_LOSSES),
            "kd_normalization": (distill.kd_normalization, KD_NORMALIZATIONS),
        }
        for name, (value, allowed) in choices.items():
            if value not in allowed:
                raise ConfigError(f"unknown --{name.replace('_', '-')} '{value}': use {', '.join(allowed)}")
        if self.data.channels not in (None, 1, 3):
            raise ConfigError(f"--channels must be 1 or 3, got {self.data.channels}")
        for name, column in (("image_column", self.data.image_column), ("label_column", self.data.label_column)):
            if column is not None and (not column or not self.data.data.startswith("hf:")):
                raise ConfigError(
                    f"--{name.replace('_', '-')} {column!r}: give a column name of the --data hf:NAME dataset "
                    f"(--data is {self.data.data})"
                )
        for name, size in (("image_size", self.data.image_size), ("kd_image_size", distill.kd_image_size)):
            if size is not None and not 1 <= size <= MAX_IMAGE_SIZE:
                raise ConfigError(
                    f"--{name.replace('_', '-')} must be between 1 and {MAX_IMAGE_SIZE} px, got {size} (the data is "
                    "held in memory at that size)"
                )
        if distill.kd_eval_every < 0 or distill.kd_patience < 0 or distill.kd_rounds < 0:
            raise ConfigError("--kd-eval-every, --kd-patience and --kd-rounds must not be negative")
        if distill.kd_mode == "train" and distill.kd_batch_size < MIN_BATCH_SIZE:
            raise ConfigError(
                f"--kd-mode train normalizes each distillation batch by its own statistics: --kd-batch-size must be "
                f"at least {MIN_BATCH_SIZE}, got {distill.kd_batch_size}"
            )
        if self.privacy.enabled and method.frozen_bn == "train":
            raise ConfigError(
                "--frozen-bn train normalizes each sample with its batch's statistics, which no per-sample clipping "
                "bounds: differentially private training needs --frozen-bn eval"
            )
        self.privacy.validate(lam_auto=method.lam_auto)
        if self.out is not None:
            check_output_path(Path(self.out), "--out", directory=True)
        tracker_names(self.log)  # unknown names refused (installed packages: when a run opens, `check_installed`)


TRACKERS = (
    "tensorboard",
    "wandb",
    "mlflow",
)  # --log: experiment trackers (peradapt.federation.tracking), each an extra


def tracker_names(log: str | None) -> list[str]:
    """`--log` as tracker names, each once and in order: comma-separated, `none` for no tracker."""
    names: list[str] = []
    for name in (part.strip().lower() for part in (log or "").split(",")):
        if name in ("", "none") or name in names:
            continue
        if name not in TRACKERS:
            raise ConfigError(
                f"unknown --log '{name}': use {', '.join(TRACKERS)} (repeated or comma-separated), or none"
            )
        names.append(name)
    return names


PERSONAL_PARTS = ("bn", "head", "input", "output", "adapter")
TRAIN_CLIENTS = ("all", "sampled")  # --train-clients: every federated client each round, or only the sampled ones
AGGREGATIONS = ("samples", "uniform")  # server mean over the sampled clients: n_m-weighted or plain
AUGMENTATIONS = ("auto", "none", "crop-flip", "resized-crop")
RESIZES = ("squeeze", "center-crop")
NORMALIZATIONS = ("auto", "data")
BN_MODES = ("eval", "train")
KD_AUGMENTATIONS = ("none", "crop-flip")
KD_LOSSES = ("softmax", "bernoulli")
KD_NORMALIZATIONS = ("model", "own")
CLIENT_STORES = ("auto", "memory", "disk")
ENGINES = ("builtin", "flower")
_SECTIONS = ("data", "backbone", "adapter", "federation", "method", "distill", "privacy")
_TOP_LEVEL = ("seed", "device", "out", "log")
_SAVED_SECTIONS = ("data", "backbone", "adapter", "federation", "method", "distill")  # in every run's config.json
_SECTION_CLASSES = {
    "data": DataConfig,
    "backbone": BackboneConfig,
    "adapter": AdapterConfig,
    "federation": FederationConfig,
    "method": MethodConfig,
    "distill": DistillConfig,
    "privacy": PrivacyConfig,
}
_FLAT_FIELDS: dict[str, str | None] = {}
_field_types: dict[str, str] = {}
for _section, _cls in _SECTION_CLASSES.items():
    for _field in dataclasses.fields(_cls):
        assert _field.name not in _FLAT_FIELDS, f"duplicate config key {_field.name}"
        _FLAT_FIELDS[_field.name] = _section
        _field_types[_field.name] = str(_field.type)
for _field in dataclasses.fields(TrainConfig):
    if _field.name in _TOP_LEVEL:
        _FLAT_FIELDS[_field.name] = None
        _field_types[_field.name] = str(_field.type)


def _is_json_type(value: Any, type_name: str) -> bool:
    """Whether `value`, read from JSON, is of the field type `type_name` as `to_dict` writes it (a float field
    takes a whole number too; bools are no numbers)."""
    if value is None:
        return "None" in type_name
    base = type_name.replace(" | None", "")
    if base == "bool" or isinstance(value, bool):
        return base == "bool" and isinstance(value, bool)
    kinds = {"int": int, "float": (int, float), "str": str}
    return isinstance(value, kinds.get(base, object))


def check_output_path(path: Path, flag: str, *, directory: bool) -> None:
    """Refuse an output path that cannot be written as `flag` asks: a file where a directory goes (`directory`)
    or the reverse, or a path under a file."""
    if path.exists():
        if directory and not path.is_dir():
            raise ConfigError(f"{flag} {path} is a file, not a directory: give a directory path")
        if not directory and path.is_dir():
            raise ConfigError(f"{flag} {path} is a directory: give a file path, e.g. {path / 'backbone.safetensors'}")
        return
    parent = next((parent for parent in path.parents if parent.exists()), None)  # the nearest that exists
    if parent is not None and not parent.is_dir():
        raise ConfigError(f"{flag} {path} is under {parent}, which is a file: give a path in a directory")


def _coerce(key: str, value: Any, type_name: str) -> Any:
    """Turn a value read from YAML/JSON into the field's type, with a message naming the key on failure."""
    if value is None:
        if "None" not in type_name:
            raise ConfigError(f"setting '{key}' may not be empty")
        return None
    if key == "log" and isinstance(value, (list, tuple)):  # `--log a --log b`, or a list in a config file
        value = ",".join(map(str, value))
    base = type_name.replace(" | None", "")
    try:
        if base == "bool":
            if isinstance(value, str):
                return value.lower() in ("1", "true", "yes", "on")
            return bool(value)
        if base == "int":
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if base == "float":
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"setting '{key}' must be {base}, got {value!r}") from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Flat settings from a YAML or JSON file (nested sections as written by a run's config.json work too)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            values = yaml.safe_load(text)
        else:
            values = json.loads(text)
    except Exception as exc:  # the parser's own message says where the syntax error is
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"config file {path} must hold a mapping of settings")
    flat: dict[str, Any] = {}
    for key, value in values.items():
        section = key in _SECTION_CLASSES and isinstance(value, dict)
        for name in value if section else [key]:  # YAML turns `1:`, `null:`, `true:` into keys no setting has
            if not isinstance(name, str):
                raise ConfigError(f"config file {path}: {name!r} is not a setting name (use the flags' names as keys)")
        if section:
            flat.update(value)
        elif key not in ("versions", "resolved"):
            flat[key] = value
    return flat
