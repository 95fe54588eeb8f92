"""Run configuration: one dataclass per concern, one flat namespace of keys, every setting declared once.

Every field is a `peradapt.settings.setting` (type, default, help, bounds or choices, help panel): the `train`
flags, config-file keys, config.json and their checks all come from these declarations. Every name is unique across
sections, so a config file (YAML or JSON) and the command-line flags use the same flat keys (`clients`, `lam`,
`kd_steps`, ...) while library code reads `config.method.lam`.

The sections hold what the engine and several methods use. A method's own settings (FedDyn's α, pFedMe's K, ...)
are a dataclass in the method's own file, its `Method.settings_class`. The method registry is `METHODS` here (which
`peradapt.methods` fills and re-exports, imported by the registry when it is first read), so their keys are known
here without this module importing the layer above, and `TrainConfig.method_settings` holds the chosen method's. A
method's setting given to another method is refused.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peradapt.errors import ConfigError, PeradaptError
from peradapt.progress import counted
from peradapt.registry import METHODS
from peradapt.settings import NoSettings, Search, Setting, check_search, declared_settings, setting

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
IN_MEMORY = "the data is held in memory at that size"
# `--client-store auto` keeps client states on disk above this many clients. In memory, every state is held and
# rewritten into every round's checkpoint: for PerAda's ResNet-18 adapters (1.41M parameters, 5.6 MB a client) 100
# clients already make a 565 MB checkpoint per round, more than the disk store's cost of one small file read and
# written per sampled client. Up to here a run directory keeps the plain layout of small federations.
DISK_STORE_ABOVE = 100

# `compare --tune`'s ranges of the shared settings, from PerAda's hyper-parameter grids (Xie et al., CVPR 2024,
# Appendix A.2), which every compared method was tuned over: the client learning rate from {5e-4, 1e-3, 5e-3, 1e-2}
# (CIFAR-10, CheXpert) and up to 5e-2 (Office-Home), the server's (distillation) learning rate from {1e-5, 1e-4, 1e-3,
# 1e-2}, and λ from {0.1, 1} for PerAda, Ditto and pFedMe alike (after Ditto). The authors' λ is half of peradapt's
# (methods/perada.py: their λ = 1 is `--lam 2`), so the range reaches 2.
CLIENT_LR_SEARCH = Search.log(5e-4, 5e-2)

# The help panels of `peradapt train --help`, in order; each method's own settings follow under "Method: NAME".
DATA = "Data"
BACKBONE = "Backbone and adapters"
FEDERATION = "Federation"
METHOD = "Method"
DISTILLATION = "Distillation"
AUTHORS = "Authors'-code settings"  # they select the authors' code's behaviour where it departs from the paper
PRIVACY = "Privacy"
OUTPUT = "Output and logging"
PANELS = (DATA, BACKBONE, FEDERATION, METHOD, DISTILLATION, AUTHORS, PRIVACY, OUTPUT)

EVAL_SPLITS = ("test", "validation")  # --eval-split: what the clients' models are scored on
TRAIN_CLIENTS = ("all", "sampled")  # --train-clients: every federated client each round, or only the sampled ones
AGGREGATIONS = ("samples", "uniform")  # server mean over the sampled clients: n_m-weighted or plain
AUGMENTATIONS = ("auto", "none", "crop-flip", "resized-crop")
RESIZES = ("squeeze", "center-crop")
NORMALIZATIONS = ("auto", "data")
# --normalization-constants: the datasets' own statistics, or the constants the PerAda authors' code normalizes with
NORMALIZATION_CONSTANTS = ("exact", "authors")
BN_MODES = ("eval", "train")
KD_AUGMENTATIONS = ("none", "crop-flip")
KD_LOSSES = ("softmax", "bernoulli")
KD_NORMALIZATIONS = ("model", "own")
KD_BATCHES = ("independent", "epochs")  # --kd-batches: a fresh draw at every step, or epochs without replacement
CLIENT_STORES = ("auto", "memory", "disk")
ENGINES = ("builtin", "flower")
TRACKERS = (
    "tensorboard",
    "wandb",
    "mlflow",
)  # --log: experiment trackers (peradapt.federation.tracking), each an extra

# The settings `compare` gives each run itself (`--methods`, its seeds, its run directories, validation splits for the
# trials and test splits for the final runs): not taken from its command line or config.
COMPARE_SETS = frozenset({"method", "seed", "out", "eval_split"})


def method_path_label(method: str) -> str:
    """Method `method`'s name in a path (default run directories): a plugin's `module:Class` with a dot for the
    colon, which Windows refuses in file names and `scp` takes for a host."""
    return method.replace(":", ".")


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


BUDGET_KINDS = ("client-samples",)  # --budget KIND:N: the work a run stops at


def parse_budget(budget: str) -> tuple[str, int]:
    """`--budget KIND:N` as (KIND, N); one line naming the flag for anything else."""
    kind, _, count = budget.partition(":")
    # ASCII digits only: isdigit() also takes '²', which int() refuses
    if kind not in BUDGET_KINDS or not re.fullmatch(r"[0-9]+", count.strip()) or int(count) < 1:
        raise ConfigError(
            f"--budget must be {' or '.join(k + ':N' for k in BUDGET_KINDS)} with N a whole number of at least 1, "
            f"got '{budget}'"
        )
    return kind, int(count)


def check_device(device: str) -> None:
    if device not in ("auto", "cpu", "cuda") and not device.startswith("cuda:"):
        raise ConfigError(f"--device must be auto, cpu or cuda, got '{device}'")


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


def _check_dp_noise(sigma: float) -> None:
    if sigma < MIN_DP_NOISE:
        raise ConfigError(
            f"--dp-noise must be at least {MIN_DP_NOISE:g}, got {sigma:g}: the privacy accountant cannot bound ε for "
            "less noise in floating point (and a σ much below 1 already gives a vacuous ε)"
        )


def _check_run_directory(out: str) -> None:
    check_output_path(Path(out), "--out", directory=True)


@dataclass
class DataConfig:
    data: str = setting(
        "fmnist",
        help="Dataset: fmnist, cifar10, cifar100, svhn, stl10, office-home, chexpert, imagefolder:PATH "
        "(PATH/<class>/<images>, or PATH/train/ and PATH/test/ of class folders) or hf:NAME_OR_PATH[:CONFIG] "
        "(a Hugging Face dataset: save_to_disk directory, parquet, or a Hub name; needs peradapt[hf-data]). "
        "Image files are decoded once and cached in $PERADAPT_HOME/cache.",
        group=DATA,
    )
    data_dir: str | None = setting(None, help="Where the dataset files are.", group=DATA, metavar="PATH")
    partition: str = setting(
        "dir:0.1",
        help="dir:ALPHA, iid, classes:K (over meta-categories for chexpert), domain (office-home, --clients 4: "
        "client i gets domain i), dir-balanced:ALPHA (the PerAda authors' Dirichlet split: 2 samples of every "
        "class per client, clients capped at an even share, test split with the same proportions) or file:PATH "
        "(a peradapt partition.json, or the authors' JSON of client number -> rows and -1 -> validation rows).",
        group=DATA,
    )
    kd_data: str = setting(
        "auto",
        help="Unlabeled distillation data: auto (the dataset's own split, STL-10's unlabeled split for stl10, "
        "or the paper's choice: cifar100 for cifar10, cifar10 for the others), digits, fmnist, cifar10, "
        "cifar100, svhn, stl10 (its 100,000 unlabeled images), imagefolder:PATH or hf:NAME (their images, "
        "labels ignored).",
        group=DISTILLATION,
    )
    limit_samples: int | None = setting(
        None,
        help="Cut every split to at most K images (smoke runs; of imagefolder:PATH and hf:NAME data only those are "
        "decoded).",
        group=DATA,
        minimum=1,
        metavar="K",
    )
    image_size: int | None = setting(
        None,
        help="Resize images to PX x PX.",
        group=DATA,
        minimum=1,
        maximum=MAX_IMAGE_SIZE,
        why=IN_MEMORY,
        metavar="PX",
        shown_default="a ViT's input size (vit_small_patch16_224: 224); else native size, 224 for office-home and "
        "chexpert, decoded once and cached in $PERADAPT_HOME/cache",
    )
    download: bool = setting(False, help="Download missing datasets (needs a network).", group=DATA)
    skip_bad_images: bool = setting(
        False,
        help="imagefolder:PATH and hf:NAME data: leave out the images that cannot be decoded (listed in "
        "$PERADAPT_HOME/bad-images/ and the run's config.json) instead of stopping; they leave before the fixed "
        "split, which a given set of files always splits the same way.",
        group=DATA,
    )
    augment: str = setting(
        "auto",
        help="Client training augmentation: auto (crop + flip for CIFAR, none otherwise), none, crop-flip, or "
        "resized-crop (random 5-100% area crop + flip: the authors' CheXpert).",
        group=DATA,
        choices=AUGMENTATIONS,
    )
    channels: int | None = setting(
        None,
        help="1 or 3: grey images as 3 equal channels, as the authors' CheXpert.",
        group=AUTHORS,
        choices=(1, 3),
        shown_default="the dataset's",
    )
    resize: str = setting(
        "squeeze",
        help="Images decoded from files (office-home, chexpert): squeeze (whole image to a square) or center-crop "
        "(shorter side to the size, then the central square: the authors').",
        group=AUTHORS,
        choices=RESIZES,
    )
    image_column: str | None = setting(
        None,
        help="--data hf:NAME: the column of images.",
        group=DATA,
        metavar="NAME",
        shown_default="its Image feature",
    )
    label_column: str | None = setting(
        None,
        help="--data hf:NAME: the column of labels.",
        group=DATA,
        metavar="NAME",
        shown_default="its ClassLabel, or label, ...",
    )
    eval_split: str = setting(
        "test",
        help="What the clients' models are scored on: test (their test splits and the global test set) or "
        "validation (a --validation-fraction of each client's training images, held out of its training; the "
        "global score is on the union of those): what `compare --tune` scores trials on, and the test split is "
        "then never read.",
        group=DATA,
        choices=EVAL_SPLITS,
    )
    validation_fraction: float = setting(
        0.2,
        help="--eval-split validation: the share of each client's training images held out as its validation "
        "split (at least one image, and one left to train on).",
        group=DATA,
        minimum=0.0,
        maximum=1.0,
        exclusive_minimum=True,
        exclusive_maximum=True,
    )


@dataclass
class BackboneConfig:
    backbone: str = setting(
        "resnet18",
        help="timm model name, with a pretrained tag if wanted (resnet18, resnet18.tv_in1k, resnet18_w16, "
        "vit_small_patch16_224, vit_tiny_p4_32, ...; published weights are fetched once into the Hugging Face "
        "cache) or hf:DIR_OR_ID (a transformers image classifier from a directory or the local Hugging Face cache).",
        group=BACKBONE,
    )
    weights: str | None = setting(
        None, help="Backbone weights (safetensors).", group=BACKBONE, metavar="PATH", shown_default="from `pretrain`"
    )
    offline: bool = setting(
        False,
        help="Never fetch backbone weights from the hub: only the local cache (HF_HUB_OFFLINE=1).",
        group=BACKBONE,
        outcome=False,
    )
    normalization: str = setting(
        "auto",
        help="Input statistics: auto (the backbone weights' own where known, else the data's) or data (the "
        "dataset's, as the authors' code does with torchvision weights).",
        group=AUTHORS,
        choices=NORMALIZATIONS,
    )
    normalization_constants: str = setting(
        "exact",
        help="The statistics CIFAR-10 and CIFAR-100 are normalized with, as the model's inputs (--normalization "
        "data) and as distillation images (--kd-normalization own): exact (the datasets' own, to four decimals) "
        "or authors (the PerAda authors' constants: CIFAR-10's std to three decimals, CIFAR-100's differing in the "
        "fourth, STL-10 normalized as CIFAR-100).",
        group=AUTHORS,
        choices=NORMALIZATION_CONSTANTS,
    )


@dataclass
class AdapterConfig:
    adapter: str | None = setting(
        None,
        help="residual (PerAda's, default for ResNets; on ViTs a bottleneck adapter on every block's MLP) or "
        "lora (default for ViTs: attention and MLP projections).",
        group=BACKBONE,
        shown_default="the backbone's",
    )
    adapter_dropout: float = setting(
        0.3, help="Dropout inside adapters.", group=BACKBONE, minimum=0.0, maximum=1.0, exclusive_maximum=True
    )
    lora_rank: int = setting(
        8, help="LoRA rank; bottleneck width of ViT residual adapters.", group=BACKBONE, minimum=1, symbol="r"
    )


@dataclass
class FederationConfig:
    clients: int = setting(20, help="Number of clients M.", group=FEDERATION, minimum=1, symbol="M")
    clients_per_round: int = setting(8, help="Clients sampled per round C.", group=FEDERATION, minimum=1, symbol="C")
    rounds: int = setting(200, help="Communication rounds T.", group=FEDERATION, minimum=0, symbol="T")
    eval_every: int = setting(  # what is measured along the way, not what trains
        10,
        help="Evaluate every N rounds (0: only at the end).",
        group=FEDERATION,
        minimum=0,
        metavar="N",
        outcome=False,
    )
    holdout_clients: int = setting(  # 0 <= K < --clients: a rule between settings (`TrainConfig.validate`)
        0, help="Keep the last K clients out of training, for `peradapt personalize`.", group=FEDERATION, metavar="K"
    )
    client_store: str = setting(
        "auto",
        help="Where clients' private state (e.g. PerAda's personalized adapters) lives between rounds: memory "
        "(and in every checkpoint), disk (OUT/client_store/, a safetensors file per client; memory holds only "
        f"the clients at work) or auto: disk above {DISK_STORE_ABOVE} clients, and always with --engine flower.",
        group=FEDERATION,
        choices=CLIENT_STORES,
    )
    engine: str = setting(
        "builtin",
        help="builtin (clients simulated in this process, one after the other or --concurrent-clients at once) "
        "or flower (the same rounds with clients in Flower ClientApps, simulated here with Ray; docs/DEPLOY.md "
        "runs them on other machines).",
        group=FEDERATION,
        choices=ENGINES,
    )
    # The builtin engine trains up to this many of a round's clients at once (peradapt.compute.concurrent).
    # None (auto): all of a round's clients that fit --gpu-memory-fraction on a GPU, one at a time on a CPU, where
    # the batched step is slower (docs/BENCHMARKS.md).
    concurrent_clients: int | None = setting(
        None,
        help="Train up to K of a round's clients at once on the one device, sharing the frozen backbone (one "
        "fused pass for all of them); on CPU the same numbers as one after another, to float rounding (on a "
        "GPU, other dropout draws). auto: on a GPU as many of the round's clients as fit --gpu-memory-fraction, "
        "on a CPU one after another (faster there). For methods whose client update is local SGD (perada, ditto, "
        "fedprox, fedavg, ..., and the partial models fedalt, fedsim, fedbn, lg-fedavg, fedper, fedrep, fedbabu; "
        "others say so and train one after another) on the builtin engine, without --dp-noise. May change on "
        "--resume.",
        group=FEDERATION,
        minimum=1,
        metavar="K|auto",
        none_word="auto",
        outcome=False,
    )
    gpu_memory_fraction: float = setting(
        0.9,
        help="The share of the GPU's memory this run may use (PyTorch's per-process memory fraction); "
        "--concurrent-clients auto trains as many clients at once as fit in it. No effect on a CPU. May change "
        "on --resume.",
        group=FEDERATION,
        minimum=0.0,
        maximum=1.0,
        exclusive_minimum=True,
        metavar="F",
        outcome=False,
    )

    budget: str | None = setting(
        None,
        help="Stop once the clients have done this much work (--rounds stays the most): client-samples:N, the "
        "training images their SGD steps processed, summed over clients and rounds, with the personalization "
        "the method trains when it hands out the clients' models (fedavg-ft's fine-tuning), set aside first. The "
        "last round's clients each do the same share of their work, what is left: N is met to within a sample "
        "per SGD job. Compares methods at equal client compute (e.g. those that train every client each round).",
        group=FEDERATION,
        metavar="KIND:N",
        check=parse_budget,
    )

    participation: float = setting(
        1.0,
        help="System heterogeneity: each client a round trains answers with probability P (drawn per round and "
        "client from --seed); the round goes on with those that do, and a round without any keeps the global "
        "model. 1: all answer.",
        group=FEDERATION,
        minimum=0.0,
        maximum=1.0,
        exclusive_minimum=True,
        metavar="P",
    )
    stragglers: float = setting(
        0.0,
        help="System heterogeneity: a fraction F of each round's trained clients are stragglers, each completing "
        "a share of its local work drawn uniformly in [0, 1) (its first minibatches; the FedProx paper's "
        "experiments), drawn from --seed. Not with --dp-noise.",
        group=FEDERATION,
        minimum=0.0,
        maximum=1.0,
        metavar="F",
    )

    def store_kind(self) -> str:
        """Where clients' private state lives between rounds: `memory` or `disk`, `auto` resolved."""
        if self.client_store != "auto":
            return self.client_store
        # Flower's ClientApps run in other processes (or machines), re-created every round: state lives on disk.
        return "disk" if self.clients > DISK_STORE_ABOVE or self.engine == "flower" else "memory"


@dataclass
class MethodConfig:
    """The settings of the method's training that the engine and several methods read; a method's own are its
    `settings_class` (`TrainConfig.method_settings`)."""

    method: str = setting(
        "perada",
        help="The personalization method: {choices} (`peradapt methods` describes each), or MODULE:CLASS, a method "
        "of your own (docs/ADDING_A_METHOD.md).",
        group=METHOD,
        choices=METHODS,  # the registry itself: methods registered later are choices too
    )
    scope: str | None = setting(
        None,
        help="adapter (frozen backbone) or full (whole network).",
        group=METHOD,
        choices=("adapter", "full"),
        shown_default="the method's",
    )
    local_epochs: int = setting(10, help="Epochs E on the local adapter.", group=METHOD, minimum=0, symbol="E")
    local_steps: int | None = setting(
        None,
        help="Local work as N minibatch steps instead of --local-epochs (pFedMe and pFedBreD count R = 20 iterations).",
        group=METHOD,
        minimum=1,
        metavar="N",
        shown_default="--local-epochs",
    )
    personal_epochs: int = setting(
        10, help="Epochs S on the personalized adapter.", group=METHOD, minimum=0, symbol="S"
    )
    lam: float = setting(
        1.0,
        help="Proximal strength λ towards the global model, or auto (personalized-FedProx rule).",
        group=METHOD,
        minimum=0.0,
        symbol="λ",
        auto="lam_auto",
        metavar="FLOAT|auto",
        search=Search.log(0.1, 2.0),  # PerAda A.2, in peradapt's λ (CLIENT_LR_SEARCH's note)
    )
    lam_auto: bool = setting(
        False,
        help="Set by --lam auto: the personalized-FedProx rule chose λ from the clients' heterogeneity.",
        group=METHOD,
        flag=False,
    )
    lr: float = setting(
        0.01,
        help="Client SGD learning rate.",
        group=METHOD,
        minimum=0.0,
        exclusive_minimum=True,
        symbol="η",
        search=CLIENT_LR_SEARCH,
    )
    personal_lr: float | None = setting(
        None,
        help="Learning rate of personalized models.",
        group=METHOD,
        minimum=0.0,
        exclusive_minimum=True,
        shown_default="--lr",
        symbol="η_p",
        search=CLIENT_LR_SEARCH,  # a client learning rate too: PerAda's grid (A.2) for the personal steps
    )
    batch_size: int = setting(
        64,
        help="Client minibatch size.",
        group=METHOD,
        minimum=MIN_BATCH_SIZE,
        why="BatchNorm layers (in ResNet adapters, --scope full) train on each batch's statistics, which one "
        "sample has not",
    )
    aggregation: str | None = setting(
        None,
        help="The server's mean over the sampled clients: samples (weighted by their sample counts) or uniform "
        "(e.g. the PerAda authors' FedAvg).",
        group=METHOD,
        choices=AGGREGATIONS,
        shown_default="the method's paper: uniform for perada, apfl, pfedme, pfedbred, perfedavg, fedprox, feddyn "
        "and fedrep, samples for the others; standalone and mtl average nothing",
    )
    train_clients: str | None = setting(
        None,
        help="Who trains each round: all (every client, the server averaging only the sampled ones: pFedMe and "
        "pFedBreD, Algorithm 1) or sampled.",
        group=METHOD,
        choices=TRAIN_CLIENTS,
        shown_default="the method's paper",
    )
    frozen_bn: str = setting(
        "eval",
        help="The frozen backbone's BatchNorms during client training: eval (pretrained statistics) or train "
        "(batch statistics, running statistics re-estimated on each client's data: the authors' code).",
        group=AUTHORS,
        choices=BN_MODES,
    )


@dataclass
class DistillConfig:
    kd_steps: int = setting(500, help="Distillation steps R per round.", group=DISTILLATION, minimum=0, symbol="R")
    kd_batch_size: int = setting(2048, help="Distillation batch size.", group=DISTILLATION, minimum=1)
    server_lr: float = setting(
        1e-3,
        help="Distillation Adam learning rate.",
        group=DISTILLATION,
        minimum=0.0,
        exclusive_minimum=True,
        search=Search.log(1e-5, 1e-2),  # PerAda A.2's grid of the server learning rate
    )
    kd_temperature: float = setting(
        1.0,
        help="Distillation temperature.",
        group=DISTILLATION,
        minimum=MIN_KD_TEMPERATURE,
        why="the distillation loss is scaled by its square, which float32 cannot hold below that",
        # PerAda and FedDF distill at T = 1 and tune no T; Hinton et al. (2015), who introduced it, distill at T
        # from 1 to 20
        search=Search.log(1.0, 20.0),
    )
    kd_eval_every: int = setting(
        0,
        help="Check the student on the validation split every N distillation steps, keeping the best (the "
        "authors' code: 1; 10 on CheXpert).",
        group=AUTHORS,
        minimum=0,
        metavar="N",
        shown_default="0: ten checks per round",
    )
    kd_patience: int = setting(
        0,
        help="Stop distilling after N checks without a better student (0: never).",
        group=DISTILLATION,
        minimum=0,
        metavar="N",
    )
    kd_rounds: int = setting(
        0,
        help="Distill only in the first N rounds, then only average (the authors' code: 30 of 200 on CIFAR-10); "
        "0: every round, as Algorithm 1.",
        group=AUTHORS,
        minimum=0,
        metavar="N",
    )
    kd_mode: str = setting(
        "eval",
        help="eval: teachers and student in inference mode (teacher logits computed once per round); train: "
        "dropout on and BatchNorm on each distillation batch's statistics, the student's running statistics "
        "following the distillation data (the authors' code).",
        group=AUTHORS,
        choices=BN_MODES,
    )
    kd_augment: str = setting(
        "none",
        help="Distillation images: none, or crop-flip at every step (the authors').",
        group=AUTHORS,
        choices=KD_AUGMENTATIONS,
    )
    kd_loss: str = setting(
        "softmax",
        help="softmax: KL of the softmaxes (the paper's σ, also for CheXpert's 5 labels); bernoulli: per-label "
        "KL of the sigmoids (multi-label tasks).",
        group=DISTILLATION,
        choices=KD_LOSSES,
    )
    kd_image_size: int | None = setting(
        None,
        help="Distillation images at PX px (the authors' code: CIFAR-10 at 32 px for Office-Home and CheXpert).",
        group=AUTHORS,
        minimum=1,
        maximum=MAX_IMAGE_SIZE,
        why=IN_MEMORY,
        metavar="PX",
        shown_default="the model's input size",
    )
    kd_normalization: str = setting(
        "model",
        help="Distillation images normalized with the clients' data statistics (model) or the distillation "
        "set's own (own, the authors').",
        group=AUTHORS,
        choices=KD_NORMALIZATIONS,
    )
    kd_batches: str = setting(
        "independent",
        help="Distillation batches: independent (a fresh random subset at every step) or "
        "epochs (through the distillation set without replacement, a shorter last batch, a new epoch at every "
        "round's start: the authors' DataLoader).",
        group=AUTHORS,
        choices=KD_BATCHES,
    )


@dataclass
class PrivacyConfig:
    """Sample-level differential privacy of client training: DP-SGD (`peradapt.compute.privacy`)."""

    dp_noise: float | None = setting(
        None,
        help="Differential privacy: train clients with DP-SGD (opacus) at noise multiplier SIGMA; needs --dp-clip. "
        "Each client's ε is accounted across rounds and reported.",
        group=PRIVACY,
        minimum=0.0,
        exclusive_minimum=True,
        check=_check_dp_noise,
        metavar="SIGMA",
        shown_default="none: no differential privacy",
        symbol="σ",
    )
    dp_clip: float | None = setting(
        None,
        help="DP-SGD: clip every sample's gradient to this L2 norm C.",
        group=PRIVACY,
        minimum=0.0,
        exclusive_minimum=True,
        metavar="C",
        symbol="C",
    )
    dp_delta: float = setting(
        1e-5,
        help="DP-SGD: the δ at which each client's ε is reported.",
        group=PRIVACY,
        minimum=0.0,
        maximum=1.0,
        exclusive_minimum=True,
        exclusive_maximum=True,
        symbol="δ",
    )

    @property
    def enabled(self) -> bool:
        return self.dp_noise is not None

    def validate(self, *, lam_auto: bool) -> None:
        if (self.dp_noise is None) != (self.dp_clip is None):
            raise ConfigError("differential privacy takes both --dp-noise SIGMA and --dp-clip C: pass both or neither")
        if self.enabled and lam_auto:
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
    seed: int = setting(
        0, help="Random seed (partition, sampling, training).", group=FEDERATION, minimum=0, maximum=2**63 - 1
    )  # the range torch's and numpy's generators take
    device: str = setting("auto", help="auto, cpu or cuda.", group=FEDERATION, check=check_device, outcome=False)
    out: str | None = setting(
        None,
        help="Run directory.",
        group=OUTPUT,
        metavar="PATH",
        shown_default="runs/DATA-METHOD-seedSEED",
        check=_check_run_directory,
        outcome=False,
    )
    log: str | None = setting(
        None,
        help="Experiment tracking, repeatable or comma-separated: tensorboard (RUN/tensorboard), wandb, mlflow "
        "(each an extra: pip install 'peradapt[tensorboard]', 'peradapt[wandb]', 'peradapt[mlflow]'), or none; "
        "never changes results, and may change on --resume.",
        group=OUTPUT,
        metavar="TRACKER",
        shown_default="none",
        repeatable=True,
        check=tracker_names,  # unknown names refused (installed packages: when a run opens, `check_installed`)
        outcome=False,
    )
    # The --method's own settings, an instance of its `settings_class`; None: their defaults.
    method_settings: Any = None
    # Where the settings the user did not give as flags or arguments came from, by key ("--preset NAME", "--config
    # FILE"): errors that name one of them say so (`origins_named`). Not a setting: config.json does not keep it.
    origins: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.method_settings is None:
            self.method_settings = settings_class_of(self.method.method)()

    def to_flat(self) -> dict[str, Any]:
        flat: dict[str, Any] = {}
        for section in _SECTIONS:
            flat.update(dataclasses.asdict(getattr(self, section)))
            if section == "method":
                flat.update(dataclasses.asdict(self.method_settings))
        flat.update({name: getattr(self, name) for name in _TOP_LEVEL})
        return flat

    def to_dict(self) -> dict[str, Any]:
        """The sections as config.json holds them; the method's own settings in its `method` section."""
        nested: dict[str, Any] = {section: dataclasses.asdict(getattr(self, section)) for section in _SECTIONS}
        nested["method"].update(dataclasses.asdict(self.method_settings))
        nested.update({name: getattr(self, name) for name in _TOP_LEVEL})
        return nested

    @classmethod
    def from_flat(cls, values: dict[str, Any]) -> TrainConfig:
        """The config of flat settings from flags, a config file or the API, each checked as it is read; a
        setting of another method than the one chosen is refused by name."""
        config = cls()
        owned: dict[str, Any] = {}
        chosen = values.get("method", MethodConfig.method)
        renamed = renamed_settings(chosen)  # a plugin named here is found: its keys known
        for key, value in values.items():
            key = key.replace("-", "_")
            if key in renamed:
                new = renamed[key].replace("_", "-")
                raise ConfigError(f"--{key.replace('_', '-')} is no setting of --method {chosen} any more: use --{new}")
            declared = find_setting(key)
            if declared is None:
                known = sorted([*_SHARED, *_method_declarations()])
                raise ConfigError(f"unknown setting '{key}'; known settings: {', '.join(known)}")
            if declared.auto and isinstance(value, str) and value.strip().lower() == "auto":
                setattr(config.method, declared.auto, True)  # `--lam auto`: the rule chooses the value
                continue
            value = declared.coerce(value)
            declared.validate(value)
            if key in _SHARED:
                section = _SHARED[key][0]
                setattr(getattr(config, section) if section else config, key, value)
            else:
                owned[key] = value
        method = config.method.method
        settings_class = settings_class_of(method)  # an unknown method: refused by `validate`
        takes = {declared.name for declared in declared_settings(settings_class)}
        for key in owned.keys() - takes:
            raise ConfigError(
                f"--{key.replace('_', '-')} is a setting of {', '.join(setting_owners(key))}: --method {method} "
                "does not take it"
            )
        config.method_settings = settings_class(**owned)
        config.validate()
        return config

    @classmethod
    def from_dict(cls, nested: Any) -> TrainConfig:
        """The config that `to_dict` gave (a run's config.json): its sections as objects, every value of its
        setting's JSON type. Unlike `from_flat` (flags, config files), nothing is converted: another type is a
        ConfigError. Other methods' settings are dropped: config.json files written before methods owned their
        settings hold every method's (each without effect on other methods)."""
        if not isinstance(nested, dict):
            raise ConfigError(f"the config is {type(nested).__name__}, not an object of sections")
        missing = [section for section in _SAVED_SECTIONS if section not in nested]
        if missing:
            raise ConfigError(f"the config has no section '{missing[0]}'")
        flat: dict[str, Any] = {}
        for key, value in nested.items():
            if key in _SECTIONS:
                if not isinstance(value, dict):
                    raise ConfigError(f"section '{key}' is {type(value).__name__}, not an object of settings")
                flat.update(value)
            else:
                flat[key] = value
        method = flat.get("method", MethodConfig.method)
        for key, value in flat.items():
            declared = find_setting(key)
            if declared is not None and not declared.is_json_type(value):
                kind = declared.type.replace(" | None", " or null")
                raise ConfigError(f"setting '{key}' must be {kind}, got {value!r}")
        kept = settings_for_method(flat, method)
        kept.update({old: flat[old] for old in renamed_settings(method) if old in flat})  # refused, naming the new key
        return cls.from_flat(kept)

    def validate(self) -> None:
        """Every setting's own checks (`Setting.validate`), then the rules between settings."""
        for section in (*(getattr(self, name) for name in _SECTIONS), self.method_settings, self):
            for declared in declared_settings(type(section)):
                declared.validate(getattr(section, declared.name))
        fed, distill = self.federation, self.distill
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
                f"--clients-per-round {fed.clients_per_round} is more than the "
                f"{counted(fed.clients - fed.holdout_clients, 'client')} left in training by --holdout-clients "
                f"{fed.holdout_clients}: lower one of them"
            )
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
        # perada's own setting (methods/perada.py), whose server writes into the client store
        if fed.engine == "flower" and getattr(self.method_settings, "kd_teacher_statistics", None) == "authors":
            raise ConfigError(
                "--kd-teacher-statistics authors has the server change each distilled client's private state, which "
                "Flower's nodes keep for themselves: run it with --engine builtin"
            )
        for name, column in (("image_column", self.data.image_column), ("label_column", self.data.label_column)):
            if column is not None and (not column or not self.data.data.startswith("hf:")):
                raise ConfigError(
                    f"--{name.replace('_', '-')} {column!r}: give a column name of the --data hf:NAME dataset "
                    f"(--data is {self.data.data})"
                )
        if distill.kd_mode == "train" and distill.kd_batch_size < MIN_BATCH_SIZE:
            raise ConfigError(
                f"--kd-mode train normalizes each distillation batch by its own statistics: --kd-batch-size must be "
                f"at least {MIN_BATCH_SIZE}, got {distill.kd_batch_size}"
            )
        if self.privacy.enabled and fed.stragglers > 0:
            raise ConfigError(
                "--stragglers cuts clients' minibatch schedules, which DP-SGD's Poisson-sampled batches do not "
                "have: drop --stragglers or --dp-noise"
            )
        if self.privacy.enabled and self.method.frozen_bn == "train":
            raise ConfigError(
                "--frozen-bn train normalizes each sample with its batch's statistics, which no per-sample clipping "
                "bounds: differentially private training needs --frozen-bn eval"
            )
        self.privacy.validate(lam_auto=self.method.lam_auto)


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
# Every shared setting: its key -> (its section, None at the top level; its declaration).
_SHARED: dict[str, tuple[str | None, Setting]] = {}
for _section, _cls in [*_SECTION_CLASSES.items(), (None, TrainConfig)]:
    for _declared in declared_settings(_cls):
        assert _declared.name not in _SHARED, f"duplicate config key {_declared.name}"
        _SHARED[_declared.name] = (_section, _declared)


# The settings no result depends on (`Setting.outcome` False): what `--resume`, a study's trials and `compare`'s reuse
# of a finished run let differ
OUTCOME_FREE: tuple[str, ...] = tuple(name for name, (_, declared) in _SHARED.items() if not declared.outcome)


def settings_class_of(method: str) -> type:
    """The settings dataclass of registered method `method` (of an unknown one: none)."""
    return METHODS[method].settings_class if method in METHODS else NoSettings


def renamed_settings(method: str) -> Mapping[str, str]:
    """The former keys of registered method `method`'s settings, each with its key now: the class attribute `renamed`
    of its settings dataclass, beside the setting (none: empty)."""
    return getattr(settings_class_of(method), "renamed", {})


def check_method_settings(settings_class: type) -> None:
    """Refuse a method's settings class whose keys clash: a method's setting shares no key with the shared ones,
    and two methods share a key only as one declaration (a family's base class). It is checked against the methods
    registered so far (`MethodRegistry.loaded`: checking a plugin finds no other), so a clash is found by whichever of
    the two comes second."""
    loaded = METHODS.loaded()
    for declared in declared_settings(settings_class):
        where = f"{settings_class.__name__}.{declared.name}"
        if declared.name in _SHARED:
            raise TypeError(f"{where}: a shared setting has that key")
        if declared.group is not None:
            raise TypeError(f"{where}: a method's setting is shown under the method")
        for method, cls in loaded.items():
            if any(d.name == declared.name and d != declared for d in declared_settings(cls.settings_class)):
                raise TypeError(f"{where}: method {method} declares that key")


def _method_declarations() -> dict[str, Setting]:
    """Every registered method's settings by key."""
    return {declared.name: declared for cls in METHODS.values() for declared in declared_settings(cls.settings_class)}


def find_setting(key: str) -> Setting | None:
    """The declaration of flat key `key`: a shared setting or a registered method's; None if there is none."""
    if key in _SHARED:
        return _SHARED[key][1]
    return _method_declarations().get(key)


def setting_owners(key: str) -> list[str]:
    """The registered methods that take method setting `key`, in registration order."""
    return [method for method in METHODS if any(d.name == key for d in declared_settings(settings_class_of(method)))]


def search_space(method: str) -> dict[str, Setting]:
    """What `compare --tune` searches for registered method `method`, by key: --lr, which every method trains its
    clients at, the shared settings its update rules read besides (`Method.tunes`, with the method's own range where
    its paper searches another), the distillation settings with a search if it distills (`uses_distillation`), and
    its own settings declared with a search. Each declaration's `search` is the range tried."""
    if method not in METHODS:
        raise ConfigError(f"unknown --method '{method}': use one of {', '.join(METHODS)}")
    cls = METHODS[method]
    shared: dict[str, Search | None] = {"lr": None, **cls.tunes}
    if cls.uses_distillation:
        shared.update({declared.name: None for declared in declared_settings(DistillConfig) if declared.search})
    space: dict[str, Setting] = {}
    for key, search in shared.items():
        if key not in _SHARED:
            raise TypeError(f"{cls.__qualname__}.tunes: {key} is no shared setting")
        declared = _SHARED[key][1] if search is None else dataclasses.replace(_SHARED[key][1], search=search)
        check_search(declared, f"{cls.__qualname__}.tunes[{key!r}]")
        if declared.search is None:
            raise TypeError(f"{cls.__qualname__}.tunes: {key} has no search declared; give it one")
        space[key] = declared
    own = declared_settings(cls.settings_class)
    return {**space, **{declared.name: declared for declared in own if declared.search is not None}}


def settings_for_method(values: dict[str, Any], method: str) -> dict[str, Any]:
    """`values` without the settings of registered methods that `method` does not take: compare's runs of several
    methods, a preset's method under another --method, an old config.json. Keys no setting has stay, to be refused."""
    takes = {declared.name for declared in declared_settings(settings_class_of(method))}  # a plugin: found first
    others = _method_declarations().keys() - takes
    return {key: value for key, value in values.items() if key.replace("-", "_") not in others}


def listed_settings() -> list[tuple[Setting, str]]:
    """Every setting with its help panel: the shared ones panel by panel, then each registered method's own
    under "Method: " and the methods that take them."""
    shared = sorted((declared for _, declared in _SHARED.values()), key=lambda declared: PANELS.index(declared.group))
    listed = [(declared, str(declared.group)) for declared in shared]
    for key, declared in _method_declarations().items():
        listed.append((declared, f"{METHOD}: {', '.join(setting_owners(key))}"))
    return listed


# A setting as an error names it: its flag, or `setting 'key'` (a value of the wrong type, from a flag or a file).
_SETTING_IN_MESSAGE = re.compile(r"(?<![\w-])--([a-z][a-z0-9]*(?:-[a-z0-9]+)*)|setting '(\w+)'")


def setting_origins(sources: Iterable[tuple[Iterable[str], str]], given: Iterable[str]) -> dict[str, str]:
    """By key, where each setting that is not in `given` (the flags, the API's arguments) came from: the last of
    `sources`, (keys, "--preset NAME" or "--config FILE") in the order they are applied, that sets it."""
    origins = {key.replace("-", "_"): origin for keys, origin in sources for key in keys}
    for key in given:
        origins.pop(key.replace("-", "_"), None)
    return origins


@contextmanager
def origins_named(origins: Mapping[str, str]) -> Iterator[None]:
    """A PeradaptError raised in the block that names a setting whose value came from a preset or config file
    (`origins`, by key) says so, with how to override it: `--preset perada-cifar10 --data fmnist` is refused for a
    `--kd-data cifar100` that the user never typed."""
    try:
        yield
    except PeradaptError as error:
        named_keys = [(flag or key).replace("-", "_") for flag, key in _SETTING_IN_MESSAGE.findall(str(error))]
        # each once, in the order the message names them
        sources = {f"--{key.replace('_', '-')}": origins[key] for key in named_keys if key in origins}
        if not sources:
            raise
        note = ", ".join(f"{flag} came from {source}" for flag, source in sources.items())
        # A preset's value is overridden by giving it; a config file's the user wrote, and edits where it stands.
        from_preset = [flag for flag, source in sources.items() if source.startswith("--preset ")]
        if from_preset:
            note += (
                f": give {' and '.join(from_preset)} yourself to override {'them' if len(from_preset) > 1 else 'it'}"
            )
        raise type(error)(f"{error} ({note})") from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Flat settings from a YAML or JSON file (nested sections as written by a run's config.json work too)."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory: give a YAML or JSON file")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
        values = yaml.safe_load(text) if path.suffix.lower() in (".yaml", ".yml") else json.loads(text)
    except yaml.MarkedYAMLError as exc:  # its own text spans lines, with the offending line drawn under a caret
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise ConfigError(f"cannot read config file {path}: {where}{exc.problem or exc.context}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"cannot read config file {path}: line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    except (yaml.YAMLError, UnicodeDecodeError, OSError) as exc:
        raise ConfigError(f"cannot read config file {path}: {' '.join(str(exc).split())}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"config file {path} must hold a mapping of settings")
    flat: dict[str, Any] = {}
    for key, value in values.items():
        section = key in _SECTIONS and isinstance(value, dict)
        for name in value if section else [key]:  # YAML turns `1:`, `null:`, `true:` into keys no setting has
            if not isinstance(name, str):
                raise ConfigError(f"config file {path}: {name!r} is not a setting name (use the flags' names as keys)")
        if section:
            flat.update(value)
        elif key not in ("versions", "resolved"):
            flat[key] = value
    return flat
