"""The `peradapt` command line: parses flags into configs and calls the library. No algorithm lives here."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from peradapt import api
from peradapt.config import DISK_STORE_ABOVE, TrainConfig
from peradapt.errors import ConfigError, Interrupted, PeradaptError
from peradapt.methods import METHODS
from peradapt.presets import PRESETS
from peradapt.progress import text_console

try:
    from typer import TyperException as UsageError  # typer >= 0.26, which vendors click
except ImportError:  # older typer (flwr 1.41 pins typer < 0.21): click's own exceptions
    from click import ClickException as UsageError

app = typer.Typer(
    help="Personalized federated learning with adapters (PerAda and friends) on frozen pretrained backbones.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# Text, never markup: paths and names a user typed may hold brackets (see peradapt.progress).
out_console = text_console()
err_console = text_console(stderr=True, soft_wrap=True)  # paths and messages stay on one line in logs

_DEFAULTS = TrainConfig().to_flat()


def _default(key: str) -> str:
    return f"\\[default: {_DEFAULTS[key]}]"  # escaped: rich would read [..] as markup


Opt = typer.Option
INFO_CLIENT_ROWS = 100  # `info` lists this many clients of a larger federation; partition.json has them all
RunDir = Annotated[Path, Opt("--run", help="A run directory written by `peradapt train`.", show_default=False)]


@app.command()
def pretrain(
    data: Annotated[str, Opt(help="Dataset whose labeled pretraining split trains the backbone.")] = "fmnist",
    backbone: Annotated[
        str, Opt(help="timm model name, a narrow ResNet such as resnet18_w16, or the tiny ViT vit_tiny_p4_32.")
    ] = "resnet18",
    epochs: Annotated[int, Opt(help="Passes over the pretraining split.")] = 5,
    batch_size: Annotated[int, Opt(help="Minibatch size.")] = 128,
    lr: Annotated[
        float | None,
        Opt(help="Peak learning rate of the one-cycle schedule \\[default: 0.05 (SGD); ViTs: 0.001 (AdamW)]."),
    ] = None,
    limit_samples: Annotated[int | None, Opt(help="Use at most this many images (smoke runs).")] = None,
    data_dir: Annotated[Path | None, Opt(help="Where the dataset files are.")] = None,
    download: Annotated[bool, Opt(help="Download the dataset if missing (needs a network).")] = False,
    out: Annotated[Path | None, Opt(help="Weights file to write \\[default: the store `train` looks in].")] = None,
    seed: Annotated[int, Opt(help="Random seed.")] = 0,
    device: Annotated[str, Opt(help="auto, cpu or cuda.")] = "auto",
) -> None:
    """Make a backbone offline by training it on a labeled split the clients never see (stands in for ImageNet)."""
    from peradapt.backbones import default_weights_path, pinned_weights_path

    replaced = (out or default_weights_path(data, backbone)).is_file()
    path, accuracy = api.pretrain(
        data=data,
        backbone=backbone,
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        limit_samples=limit_samples,
        data_dir=data_dir,
        download=download,
        out=out,
        seed=seed,
        device=device,
        console=err_console,
    )
    out_console.print(f"backbone written to {path} (held-out accuracy {100 * accuracy:.2f}%)")
    if replaced:  # runs record their backbone's fingerprint and keep a copy: they do not move to the new weights
        out_console.print(
            f"it replaces the weights that were there; runs trained on those keep using them "
            f"(pinned under {pinned_weights_path('').parent})"
        )


@app.command()
def train(
    data: Annotated[
        str | None,
        Opt(
            help="Dataset: fmnist, cifar10, cifar100, svhn, stl10, office-home, chexpert, imagefolder:PATH "
            "(PATH/<class>/<images>, or PATH/train/ and PATH/test/ of class folders) or hf:NAME_OR_PATH[:CONFIG] "
            "(a Hugging Face dataset: save_to_disk directory, parquet, or a Hub name; needs peradapt[hf-data]). "
            f"Image files are decoded once and cached in $PERADAPT_HOME/cache. {_default('data')}"
        ),
    ] = None,
    clients: Annotated[int | None, Opt(help=f"Number of clients M. {_default('clients')}")] = None,
    method: Annotated[str | None, Opt(help=f"{' | '.join(METHODS)}. {_default('method')}")] = None,
    backbone: Annotated[
        str | None,
        Opt(
            help="timm model name, with a pretrained tag if wanted (resnet18, resnet18.tv_in1k, resnet18_w16, "
            "vit_small_patch16_224, vit_tiny_p4_32, ...; published weights are fetched once into the Hugging Face "
            "cache) or "
            "hf:DIR_OR_ID (a transformers image classifier from a directory or the local Hugging Face cache). "
            f"{_default('backbone')}"
        ),
    ] = None,
    weights: Annotated[Path | None, Opt(help="Backbone weights (safetensors) \\[default: from `pretrain`].")] = None,
    adapter: Annotated[
        str | None,
        Opt(
            help="residual (PerAda's, default for ResNets; on ViTs a bottleneck adapter on every block's MLP) or "
            "lora (default for ViTs: attention and MLP projections)."
        ),
    ] = None,
    adapter_dropout: Annotated[
        float | None, Opt(help=f"Dropout inside adapters. {_default('adapter_dropout')}")
    ] = None,
    lora_rank: Annotated[
        int | None, Opt(help=f"LoRA rank; bottleneck width of ViT residual adapters. {_default('lora_rank')}")
    ] = None,
    scope: Annotated[
        str | None, Opt(help="adapter (frozen backbone) or full (whole network) \\[default: the method's]")
    ] = None,
    personal_part: Annotated[
        str | None, Opt(help="Partial-model methods: bn, head, input, output or adapter \\[default: the method's]")
    ] = None,
    partition: Annotated[
        str | None,
        Opt(
            help="dir:ALPHA, iid, classes:K (over meta-categories for chexpert), domain (office-home, --clients 4: "
            "client i gets domain i), dir-balanced:ALPHA (the PerAda authors' Dirichlet split: 2 samples of every "
            "class per client, clients capped at an even share, test split with the same proportions) or file:PATH "
            "(a peradapt partition.json, or the authors' JSON of client number -> rows and -1 -> validation rows). "
            f"{_default('partition')}"
        ),
    ] = None,
    rounds: Annotated[int | None, Opt(help=f"Communication rounds T. {_default('rounds')}")] = None,
    clients_per_round: Annotated[
        int | None, Opt(help=f"Clients sampled per round C. {_default('clients_per_round')}")
    ] = None,
    local_epochs: Annotated[int | None, Opt(help=f"Epochs E on the local adapter. {_default('local_epochs')}")] = None,
    local_steps: Annotated[
        int | None,
        Opt(
            help="Local work as N minibatch steps instead of --local-epochs (pFedMe and pFedBreD count R = 20 "
            "iterations) \\[default: --local-epochs].",
            metavar="N",
        ),
    ] = None,
    personal_epochs: Annotated[
        int | None, Opt(help=f"Epochs S on the personalized adapter. {_default('personal_epochs')}")
    ] = None,
    body_epochs: Annotated[
        int | None,
        Opt(
            help="FedRep: epochs on the shared body after --personal-epochs on the head (it ignores --local-epochs; "
            f"Collins et al.: 1, 5 on some datasets). {_default('body_epochs')}"
        ),
    ] = None,
    lam: Annotated[
        str | None,
        Opt(
            help=f"Proximal strength λ towards the global model, or auto (personalized-FedProx rule). {_default('lam')}"
        ),
    ] = None,
    lr: Annotated[float | None, Opt(help=f"Client SGD learning rate. {_default('lr')}")] = None,
    personal_lr: Annotated[float | None, Opt(help="Learning rate of personalized models \\[default: --lr].")] = None,
    ft_epochs: Annotated[
        int | None, Opt(help="Fine-tuning epochs of fedavg-ft and fedbabu \\[default: the method's: 1, 5].")
    ] = None,
    inner_steps: Annotated[int | None, Opt(help=f"pFedMe/pFedBreD inner steps K. {_default('inner_steps')}")] = None,
    beta: Annotated[
        float | None, Opt(help=f"Server step: β of pFedMe/pFedBreD, γλ of fedprox. {_default('beta')}")
    ] = None,
    mu: Annotated[
        float | None, Opt(help=f"fedprox-li: proximal strength μ towards the global model. {_default('mu')}")
    ] = None,
    aggregation: Annotated[
        str | None,
        Opt(
            help="The server's mean over the sampled clients: samples (weighted by their sample counts) or uniform "
            "(e.g. the PerAda authors' FedAvg) \\[default: the method's paper: uniform for perada, apfl, pfedme, "
            "pfedbred, perfedavg, fedprox, feddyn and fedrep, samples for the others; standalone and mtl average "
            "nothing]."
        ),
    ] = None,
    train_clients: Annotated[
        str | None,
        Opt(
            help="Who trains each round: all (every client, the server averaging only the sampled ones: pFedMe and "
            "pFedBreD, Algorithm 1) or sampled \\[default: the method's paper].",
        ),
    ] = None,
    am: Annotated[
        bool | None, Opt("--am", help="pFedMe/pFedBreD aggregate momentum: server step β = 2, overriding --beta.")
    ] = None,
    prior: Annotated[
        str | None,
        Opt(
            help="pFedBreD prior mean: lg, meg, mh (Eq. 14) or mh-code (the authors' code's mh: the Eq. 24 look-ahead "
            f"gradient on a second minibatch, w stepped by it, the inner problem started there). {_default('prior')}"
        ),
    ] = None,
    prior_lr: Annotated[
        float | None, Opt(help=f"pFedBreD meta-step η_α on the loss gradient (lg, mh, mh-code). {_default('prior_lr')}")
    ] = None,
    prior_eta: Annotated[
        float | None, Opt(help=f"pFedBreD meta-step η on the memorized envelope gradient. {_default('prior_eta')}")
    ] = None,
    apfl_alpha: Annotated[float | None, Opt(help=f"APFL initial mixing weight α. {_default('apfl_alpha')}")] = None,
    alpha_lr: Annotated[float | None, Opt(help="APFL step size of α (0: α stays fixed) \\[default: --lr].")] = None,
    ft_steps: Annotated[
        int | None,
        Opt(
            help="Fine-tuning methods (fedavg-ft, perfedavg, ...): fine-tune with N minibatch steps instead of "
            "--ft-epochs (0: none) \\[default: perfedavg 1 unless --ft-epochs is given, the paper's one step; the "
            "others --ft-epochs].",
            metavar="N",
        ),
    ] = None,
    feddyn_alpha: Annotated[
        float | None, Opt(help=f"FedDyn α: weight of the dynamic regularizer. {_default('feddyn_alpha')}")
    ] = None,
    feddyn_client_alpha: Annotated[
        str | None,
        Opt(
            help="FedDyn α per client: uniform (Algorithm 1) or by-size (the authors' code: α·n̄/n_k, n_k the "
            f"client's samples, n̄ their mean). {_default('feddyn_client_alpha')}"
        ),
    ] = None,
    perfedavg_variant: Annotated[
        str | None,
        Opt(
            help="Per-FedAvg meta-gradient: hf (Hessian-free: finite-difference Hessian-vector product) or fo "
            f"(first-order, as PFLlib). {_default('perfedavg_variant')}"
        ),
    ] = None,
    perfedavg_delta: Annotated[
        float | None, Opt(help=f"Per-FedAvg (HF) finite-difference step δ. {_default('perfedavg_delta')}")
    ] = None,
    ala_sample: Annotated[
        float | None,
        Opt(help=f"FedALA s: percent of the local data ALA learns its weights on. {_default('ala_sample')}"),
    ] = None,
    ala_layers: Annotated[
        int | None,
        Opt(help=f"FedALA p: ALA on the last p layers (1: the head; 0: all). {_default('ala_layers')}"),
    ] = None,
    ala_lr: Annotated[
        float | None, Opt(help=f"FedALA η: step size of the aggregation weights. {_default('ala_lr')}")
    ] = None,
    mtl_omega: Annotated[
        str | None,
        Opt(
            help="MTL task relationships Ω: mean (fixed (I - 11ᵀ/M)², mean-regularized) or learned (MOCHA's "
            f"Ω-step every round, as the authors' code). {_default('mtl_omega')}"
        ),
    ] = None,
    personal_head_init: Annotated[
        str | None,
        Opt(
            help="FedRoD: each client's personal head at start: zero (the global model is then the generic one) "
            f"or generic (a copy of the initial generic head, as PFLlib). {_default('personal_head_init')}"
        ),
    ] = None,
    batch_size: Annotated[int | None, Opt(help=f"Client minibatch size. {_default('batch_size')}")] = None,
    server_lr: Annotated[float | None, Opt(help=f"Distillation Adam learning rate. {_default('server_lr')}")] = None,
    kd_steps: Annotated[int | None, Opt(help=f"Distillation steps R per round. {_default('kd_steps')}")] = None,
    kd_batch_size: Annotated[int | None, Opt(help=f"Distillation batch size. {_default('kd_batch_size')}")] = None,
    kd_data: Annotated[
        str | None,
        Opt(
            help="Unlabeled distillation data: auto (the dataset's own split, STL-10's unlabeled split for stl10, "
            "or the paper's choice: cifar100 for cifar10, cifar10 for the others), digits, fmnist, cifar10, "
            "cifar100, svhn, stl10 (its 100,000 unlabeled images), imagefolder:PATH or hf:NAME (their images, "
            "labels ignored)."
        ),
    ] = None,
    kd_temperature: Annotated[float | None, Opt(help=f"Distillation temperature. {_default('kd_temperature')}")] = None,
    kd_rounds: Annotated[
        int | None,
        Opt(
            help="Distill only in the first N rounds, then only average (the authors' code: 30 of 200 on CIFAR-10); "
            f"0: every round, as Algorithm 1. {_default('kd_rounds')}",
            metavar="N",
        ),
    ] = None,
    kd_mode: Annotated[
        str | None,
        Opt(
            help="eval: teachers and student in inference mode (teacher logits computed once per round); train: "
            "dropout on and BatchNorm on each distillation batch's statistics, the student's running statistics "
            f"following the distillation data (the authors' code). {_default('kd_mode')}"
        ),
    ] = None,
    kd_augment: Annotated[
        str | None,
        Opt(help=f"Distillation images: none, or crop-flip at every step (the authors'). {_default('kd_augment')}"),
    ] = None,
    kd_loss: Annotated[
        str | None,
        Opt(
            help="softmax: KL of the softmaxes (the paper's σ, also for CheXpert's 5 labels); bernoulli: per-label "
            f"KL of the sigmoids (multi-label tasks). {_default('kd_loss')}"
        ),
    ] = None,
    kd_image_size: Annotated[
        int | None,
        Opt(
            help="Distillation images at PX px (the authors' code: CIFAR-10 at 32 px for Office-Home and CheXpert) "
            "\\[default: the model's input size].",
            metavar="PX",
        ),
    ] = None,
    kd_normalization: Annotated[
        str | None,
        Opt(
            help="Distillation images normalized with the clients' data statistics (model) or the distillation "
            f"set's own (own, the authors'). {_default('kd_normalization')}"
        ),
    ] = None,
    kd_eval_every: Annotated[
        int | None,
        Opt(
            help="Check the student on the validation split every N distillation steps, keeping the best "
            "(the authors' code: 1; 10 on CheXpert) \\[default: 0: ten checks per round].",
            metavar="N",
        ),
    ] = None,
    kd_patience: Annotated[
        int | None,
        Opt(help="Stop distilling after N checks without a better student (0: never). \\[default: 0]", metavar="N"),
    ] = None,
    frozen_bn: Annotated[
        str | None,
        Opt(
            help="The frozen backbone's BatchNorms during client training: eval (pretrained statistics) or train "
            "(batch statistics, running statistics re-estimated on each client's data: the authors' code). "
            f"{_default('frozen_bn')}"
        ),
    ] = None,
    eval_every: Annotated[
        int | None, Opt(help=f"Evaluate every N rounds (0: only at the end). {_default('eval_every')}")
    ] = None,
    holdout_clients: Annotated[
        int | None,
        Opt(help=f"Keep the last K clients out of training, for `peradapt personalize`. {_default('holdout_clients')}"),
    ] = None,
    client_store: Annotated[
        str | None,
        Opt(
            help="Where clients' private state (e.g. PerAda's personalized adapters) lives between rounds: memory "
            "(and in every checkpoint), disk (OUT/client_store/, a safetensors file per client; memory holds only "
            f"the clients at work) or auto: disk above {DISK_STORE_ABOVE} clients, and always with --engine flower. "
            f"{_default('client_store')}"
        ),
    ] = None,
    engine: Annotated[
        str | None,
        Opt(
            help="builtin (clients simulated in this process, one after the other or --concurrent-clients at once) "
            "or flower (the same rounds with "
            "clients in Flower ClientApps, simulated here with Ray; docs/DEPLOY.md runs them on other machines). "
            f"{_default('engine')}"
        ),
    ] = None,
    concurrent_clients: Annotated[
        int | None,
        Opt(
            help="Train up to K of a round's clients at once on the one device, sharing the frozen backbone (one "
            "batched pass for all of them); on CPU the same numbers as one after another, to float rounding (on a "
            "GPU, other dropout draws). For methods "
            "whose client update is local SGD (perada, ditto, fedprox, fedavg, ...; others say so and train one "
            "after another) on the builtin engine, without --dp-noise. Faster where kernel launches dominate (a "
            "GPU and a small model); slower on CPU (docs/BENCHMARKS.md). May change on --resume. "
            f"{_default('concurrent_clients')}",
            metavar="K",
        ),
    ] = None,
    dp_noise: Annotated[
        float | None,
        Opt(
            help="Differential privacy: train clients with DP-SGD (opacus) at noise multiplier SIGMA; needs --dp-clip. "
            "Each client's ε is accounted across rounds and reported.",
            metavar="SIGMA",
        ),
    ] = None,
    dp_clip: Annotated[
        float | None, Opt(help="DP-SGD: clip every sample's gradient to this L2 norm C.", metavar="C")
    ] = None,
    dp_delta: Annotated[
        float | None, Opt(help=f"DP-SGD: the δ at which each client's ε is reported. {_default('dp_delta')}")
    ] = None,
    limit_samples: Annotated[int | None, Opt(help="Cut every split to at most K images (smoke runs).")] = None,
    image_size: Annotated[
        int | None,
        Opt(
            help="Resize images to PX x PX \\[default: a ViT's input size (vit_small_patch16_224: 224); else native "
            "size, 224 for office-home and chexpert, decoded once and cached in $PERADAPT_HOME/cache].",
            metavar="PX",
        ),
    ] = None,
    augment: Annotated[
        str | None,
        Opt(
            help="Client training augmentation: auto (crop + flip for CIFAR, none otherwise), none, crop-flip, or "
            f"resized-crop (random 5-100% area crop + flip: the authors' CheXpert). {_default('augment')}"
        ),
    ] = None,
    channels: Annotated[
        int | None,
        Opt(help="1 or 3: grey images as 3 equal channels, as the authors' CheXpert \\[default: the dataset's]."),
    ] = None,
    resize: Annotated[
        str | None,
        Opt(
            help="Images decoded from files (office-home, chexpert): squeeze (whole image to a square) or "
            f"center-crop (shorter side to the size, then the central square: the authors'). {_default('resize')}"
        ),
    ] = None,
    normalization: Annotated[
        str | None,
        Opt(
            help="Input statistics: auto (the backbone weights' own where known, else the data's) or data (the "
            f"dataset's, as the authors' code does with torchvision weights). {_default('normalization')}"
        ),
    ] = None,
    offline: Annotated[
        bool | None,
        Opt("--offline", help="Never fetch backbone weights from the hub: only the local cache (HF_HUB_OFFLINE=1)."),
    ] = None,
    seed: Annotated[int | None, Opt(help=f"Random seed (partition, sampling, training). {_default('seed')}")] = None,
    device: Annotated[str | None, Opt(help=f"auto, cpu or cuda. {_default('device')}")] = None,
    log: Annotated[
        list[str] | None,
        Opt(
            help="Experiment tracking, repeatable or comma-separated: tensorboard (RUN/tensorboard), wandb, mlflow "
            "(each an extra: pip install 'peradapt\\[tensorboard]', 'peradapt\\[wandb]', 'peradapt\\[mlflow]'), "
            "or none; may change on --resume \\[default: none].",
            metavar="TRACKER",
        ),
    ] = None,
    data_dir: Annotated[Path | None, Opt(help="Where the dataset files are.")] = None,
    image_column: Annotated[
        str | None, Opt(help="--data hf:NAME: the column of images \\[default: its Image feature].", metavar="NAME")
    ] = None,
    label_column: Annotated[
        str | None,
        Opt(help="--data hf:NAME: the column of labels \\[default: its ClassLabel, or label, ...].", metavar="NAME"),
    ] = None,
    download: Annotated[bool | None, Opt("--download", help="Download missing datasets (needs a network).")] = None,
    out: Annotated[Path | None, Opt(help="Run directory \\[default: runs/DATA-METHOD-seedSEED].")] = None,
    resume: Annotated[bool, Opt("--resume", help="Continue the run in --out from its last checkpoint.")] = False,
    preset: Annotated[
        str | None,
        Opt(
            help=f"Start from a paper preset: {', '.join(PRESETS)} (`peradapt info --preset NAME` shows its "
            "settings); --config and flags win over it."
        ),
    ] = None,
    config: Annotated[Path | None, Opt(help="YAML or JSON file with the same keys as these flags; flags win.")] = None,
) -> None:
    """Train personalized adapters in a simulated federation and write a run directory."""
    flags = {k: v for k, v in locals().items() if k not in ("resume", "config", "preset")}
    settings = {k: v for k, v in flags.items() if v is not None}
    train_config = api.training_config(resume=resume, preset=preset, config_file=config, **settings)
    report = api.train(train_config, resume=resume, console=err_console)
    from peradapt.evaluation import results_table

    title = f"{report['method']} on {report['data']}, {len(report['clients'])} clients, {report['rounds']} rounds"
    if "privacy" in report:  # as the paper's Table 5: the clients' mean ε ± std
        privacy = report["privacy"]
        title += (
            f", DP ε = {privacy['epsilon']['mean']:.2f} ± {privacy['epsilon']['std']:.2f} (δ = {privacy['delta']:g})"
        )
    out_console.print(results_table(report["summary"], title, report["metric"], report["selected_on_test"]))
    out_console.print(f"run directory: {train_config.out}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def compare(
    context: typer.Context,
    methods: Annotated[str, Opt(help="Comma-separated methods, e.g. perada,perada-nokd,ditto.", show_default=False)],
    seeds: Annotated[int, Opt(help="Seeds 0..N-1; each fixes the partition shared by all methods.")] = 3,
    out: Annotated[Path, Opt(help="Directory for the runs and compare.json / compare.md.")] = Path("runs/compare"),
    config: Annotated[Path | None, Opt(help="YAML or JSON file of train settings; flags win.")] = None,
) -> None:
    """Run several methods on the same partitions and seeds and print a Table-1-style comparison.

    Any `peradapt train` flag (--data, --clients, --rounds, --limit-samples, ...) after these applies to every run.
    """
    from peradapt.comparison import rich_table

    train_command = typer.main.get_command(app).commands["train"]  # type: ignore[attr-defined]
    try:
        flags = train_command.make_context("train", list(context.args)).params
    except UsageError as exc:
        raise ConfigError(f"compare: {exc.format_message()}") from None  # type: ignore[attr-defined]
    if flags.pop("resume") or flags.get("config"):
        raise ConfigError("compare takes --config itself and cannot --resume: re-run it to finish missing runs")
    flags.pop("config")
    settings = {k: v for k, v in flags.items() if v is not None}
    names = [name.strip() for name in methods.split(",") if name.strip()]
    rows = api.compare(names, seeds=seeds, out=out, config_file=config, console=err_console, **settings)
    # Piped output has no width to fit: keep the table's rows on one line each for logs and scripts.
    console = out_console if out_console.is_terminal else text_console(width=160)
    console.print(rich_table(rows, seeds))
    out_console.print(f"written to {out / 'compare.json'} and {out / 'compare.md'}")


@app.command("eval")
def evaluate(
    run: RunDir,
    ood: Annotated[
        str | None,
        Opt(
            help="Instead: accuracy on an out-of-distribution set: fmnist-c (corruptions generated from the test "
            "set), cifar10-c[:PATH] (the published files; generated with imagecorruptions when absent), "
            "cifar10.1[:PATH], svhn[:PATH] or stl10[:PATH] (their test images), imagefolder:PATH (PATH/<class "
            "index or name>/<images>) or hf:NAME_OR_PATH[:CONFIG] (a Hugging Face dataset's test split); named "
            "classes are matched to the run's. Generated sets are cached under $PERADAPT_HOME/ood."
        ),
    ] = None,
    ood_limit: Annotated[int | None, Opt(help="Use at most N images of each OOD corruption and severity.")] = None,
) -> None:
    """local-test and global-test of every client's personalized adapter and of the global adapter."""
    from peradapt.commands.finished_run import ood_report_name, ood_table
    from peradapt.evaluation import results_table, summarize

    if ood is not None:
        result = api.evaluate(run, ood=ood, ood_limit=ood_limit, console=err_console)
        console = out_console if out_console.is_terminal else text_console(width=120)
        console.print(ood_table(result, f"{ood} on {run}, {len(result['clients'])} clients"))
        out_console.print(f"images: {result['provenance']}", soft_wrap=True)
        out_console.print(f"written to {run / ood_report_name(ood)}", soft_wrap=True)
        return
    evaluation = api.evaluate(run, ood_limit=ood_limit)
    out_console.print(results_table(summarize(evaluation), f"evaluation of {run}", evaluation["metric"]))
    out_console.print(f"written to {run / 'eval.json'}")


@app.command()
def export(
    run: RunDir,
    out: Annotated[Path, Opt(help="Directory to write the adapters and backbone to.", show_default=False)],
    push_to_hub: Annotated[
        str | None,
        Opt(
            help="Also upload the export to this Hugging Face model repository (OWNER/NAME, created if new): the "
            "backbone, the global adapter, the --clients' adapters and their model cards. It replaces the adapters "
            "an earlier push put there. Needs a token: `hf auth login` or HF_TOKEN.",
            show_default=False,
        ),
    ] = None,
    clients: Annotated[
        str | None,
        Opt(help="With --push-to-hub: the clients whose adapters go up, as ids (0,3,5) or all.", show_default=False),
    ] = None,
    private: Annotated[bool, Opt("--private", help="With --push-to-hub: create the repository private.")] = False,
) -> None:
    """Copy every client's adapter and the global adapter (PEFT layout) with their frozen backbone, and a model card
    (README.md) for each that says how to load it."""
    if push_to_hub is None and (clients is not None or private):
        raise ConfigError("--clients and --private choose what --push-to-hub uploads: add --push-to-hub OWNER/NAME")
    if push_to_hub is None:
        path, url = api.export(run, out), None
    else:
        path, url = (
            out,
            api.push_to_hub(run, out, push_to_hub, clients="all" if clients is None else clients, private=private),
        )
    out_console.print(f"adapters, backbone and model cards written to {path}", soft_wrap=True)
    out_console.print(f"how to load them: {path / 'README.md'} and each adapter's README.md", soft_wrap=True)
    if url is not None:
        out_console.print(f"uploaded to {url}", soft_wrap=True)


@app.command()
def personalize(
    run: RunDir,
    new_client: Annotated[
        str,
        Opt(
            help="Id of a client the run held out with --holdout-clients, or a directory of the new client's images: "
            "DIR/<class>/<images> (a quarter kept for its test) or DIR/train/<class>/ and DIR/test/<class>/ (also "
            "as imagefolder:DIR), or hf:NAME_OR_PATH[:CONFIG] (a Hugging Face dataset).",
            show_default=False,
        ),
    ],
) -> None:
    """Personalize a client that never took part in training, from the run's global model, with the run's method.

    Prints its local-test accuracy with the global model and with its personalized model; writes the model and
    result.json under RUN/new_clients/<name>/."""
    from peradapt.evaluation.report import METRIC_LABELS

    result = api.personalize_new_client(run, new_client)
    before, after = result["before"]["local_test"], result["after"]["local_test"]
    out_console.print(
        f"new client {result['client']} ({result['method']}): local-test {METRIC_LABELS[result['metric']]} "
        f"{100 * before:.2f}% with the global model, {100 * after:.2f}% personalized",
        soft_wrap=True,
    )
    if "privacy" in result:
        privacy = result["privacy"]
        out_console.print(
            f"differential privacy: ε = {privacy['epsilon']:.2f} at δ = {privacy['delta']:g} "
            f"({privacy['steps']} DP-SGD steps on its data)"
        )
    out_console.print(f"personalized model written to {result['adapter']}", soft_wrap=True)


@app.command()
def info(
    run: Annotated[
        Path | None, Opt("--run", help="A run directory written by `peradapt train`.", show_default=False)
    ] = None,
    preset: Annotated[
        str | None, Opt(help=f"Instead: what a paper preset sets ({', '.join(PRESETS)}).", show_default=False)
    ] = None,
) -> None:
    """Resolved config, partition statistics and trainable-parameter count of a run, or a preset's settings."""
    if (run is None) == (preset is None):
        raise ConfigError("info takes --run DIR or --preset NAME (one of them)")
    if preset is not None:
        _print_preset(preset)
        return
    assert run is not None
    from peradapt.commands.finished_run import label_skew
    from peradapt.rundir.layout import read_partition, read_report, read_run_config

    config, resolved = read_run_config(run)
    partition = read_partition(run)
    finished = read_report(run) or {}  # every file is checked before anything is printed
    out_console.print_json(json.dumps({"config": config.to_flat(), "resolved": resolved}))
    privacy = finished.get("privacy")  # --dp-noise: each client's ε, known once the run has finished
    epsilons = dict(zip(finished["clients"], privacy["epsilon"]["per_client"], strict=True)) if privacy else {}
    table = Table(title=f"partition {partition['spec']} (seed {partition['seed']})")
    histogram_column = f"train histogram of {partition.get('histograms_of', 'classes')}"
    for column in ("client", "train", "test", *(["ε"] if privacy else []), histogram_column):
        table.add_column(column, justify="right" if column != histogram_column else "left")
    clients = partition["clients"]
    for client in clients[:INFO_CLIENT_ROWS]:
        histogram = " ".join(str(n) for n in client["train_histogram"])
        spent = [f"{epsilons[client['id']]:.2f}" if client["id"] in epsilons else "-"] if privacy else []
        table.add_row(str(client["id"]), str(len(client["train"])), str(len(client["test"])), *spent, histogram)
    out_console.print(table)
    if len(clients) > INFO_CLIENT_ROWS:
        more = len(clients) - INFO_CLIENT_ROWS
        out_console.print(f"... and {more:,} more clients ({run / 'partition.json'})", soft_wrap=True)
    skew = label_skew([c["train_histogram"] for c in partition["clients"]])
    out_console.print(f"label skew (mean total-variation distance to the pooled labels, 0 = IID): {skew:.3f}")
    if resolved.get("backbone_parameters") and "trainable_parameters" in resolved:
        trainable, total = resolved["trainable_parameters"], resolved["backbone_parameters"]
        out_console.print(
            f"trainable parameters: {trainable:,} of {total:,} ({100 * trainable / total:.1f}%), "
            f"adapter: {resolved['adapter']}, scope: {resolved.get('scope', 'adapter')}"
        )
    if "client_store" in resolved:
        where = f" ({run / 'client_store'})" if resolved["client_store"] == "disk" else ", in the checkpoints"
        out_console.print(f"client state: {resolved['client_store']}{where}", soft_wrap=True)
    if "parameter_counts" in resolved:  # the columns of the PerAda paper's Table 1, per client
        counts = resolved["parameter_counts"]
        out_console.print(
            f"per client: {counts['personalized']:,} personalized, {counts['trained']:,} trained, "
            f"{counts['communicated']:,} communicated parameters"
        )
    if config.privacy.enabled:
        dp = config.privacy
        spent = (
            f"ε per client {privacy['epsilon']['mean']:.2f} ± {privacy['epsilon']['std']:.2f} on average, "
            f"{privacy['epsilon']['max']:.2f} at most ({privacy['accountant']} accountant)"
            if privacy
            else "ε per client in report.json once the run has finished"
        )
        out_console.print(
            f"differential privacy: DP-SGD with noise multiplier {dp.dp_noise:g}, clipping norm {dp.dp_clip:g}, "
            f"δ = {dp.dp_delta:g}; {spent}",
            soft_wrap=True,
        )


def _print_preset(name: str) -> None:
    from peradapt.presets import preset_rows, read_preset

    record = read_preset(name)
    table = Table(title=f"preset {name}: `peradapt train --preset {name}` (flags win)")
    for column in ("setting", "preset", "peradapt default", "why"):
        table.add_column(column, overflow="fold")
    for key, value, default, note in preset_rows(name):
        table.add_row(f"--{key.replace('_', '-')}", str(value), "auto" if default is None else str(default), note)
    console = out_console if out_console.is_terminal else text_console(width=200)
    console.print(record["description"], soft_wrap=True, highlight=False, markup=False)
    console.print(table)
    console.print(f"from the authors' {record['source']}", soft_wrap=True, highlight=False, markup=False)


@app.command()
def report(
    runs: Annotated[
        list[Path], typer.Argument(metavar="RUN", help="Finished run directories (`peradapt train --out`).")
    ],
    out: Annotated[
        Path | None,
        Opt(help="Directory for the plots and tables \\[default: the run's own directory for one run, else reports/]."),
    ] = None,
) -> None:
    """Plots (accuracy per round, per client) and a Markdown/JSON table comparing finished runs."""
    for path in api.report(runs, out):
        out_console.print(f"written {path}")


def main() -> None:
    try:
        code = app(standalone_mode=False)
    except PeradaptError as exc:
        err_console.print(Text.assemble(("error:", "red"), f" {exc}"), highlight=False)
        sys.exit(2)
    except Interrupted as exc:  # Ctrl-C during a run: what was kept and how to continue
        err_console.print(f"interrupted: {exc}", highlight=False)
        sys.exit(130)
    except (typer.Abort, KeyboardInterrupt):
        code = 130
    except UsageError as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # `peradapt` alone: the help, as asked for
            exc.show()  # type: ignore[attr-defined]
        else:  # a flag of the wrong type, an unknown flag: one line like every other mistake
            context = getattr(exc, "ctx", None)
            command = context.command_path if context is not None else "peradapt"
            message = exc.format_message()  # type: ignore[attr-defined]
            err_console.print(Text.assemble(("error:", "red"), f" {message} (see `{command} --help`)"), highlight=False)
        sys.exit(getattr(exc, "exit_code", 2))
    # Without standalone mode click returns what would have been the exit code: 130 for a Ctrl-C (outside a run,
    # before anything was written), which must not read as success to `peradapt train ... && peradapt export ...`.
    if code == 130:
        err_console.print("interrupted: nothing was written")
    if isinstance(code, int) and code:
        sys.exit(code)
