"""The commands' own options, declared once as settings (`peradapt.settings.setting`), as `train`'s are.

Each command has one options class here: its fields are the command's flags (`peradapt.cli` makes them from the
declarations), the keyword arguments of its `peradapt.api` function, and their checks; docs/SETTINGS.md lists them
under the command. An options object checks itself when it is made (`__post_init__`): a value of the wrong type, out
of its bounds or against another option is refused in one line naming the flag, before anything is read or written.
`train`'s and `compare`'s flags for the shared settings (`peradapt.config`) come on top of these.

This module is light (no torch): `peradapt --help` builds every command's flags from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from peradapt.config import MIN_BATCH_SIZE, check_device, check_output_path, listed_settings
from peradapt.errors import ConfigError
from peradapt.presets import PRESETS
from peradapt.settings import REQUIRED, Setting, declared_settings, markdown_table, setting, validate_settings

Options = TypeVar("Options", bound="CommandOptions")

# The run seed of every trial of `compare --tune` (its partition, sampling and draws): none of compare's final seeds
# 0..N-1 (N <= 1000, `--seeds`' bound), so that the final runs are scored on partitions the tuning never saw
TUNING_SEED = 1000
RUN_HELP = "A run directory written by `peradapt train`."
PAIRED_TESTS = ("t", "wilcoxon")  # compare --test: `peradapt.evaluation.statistics.TEST_LABELS` names them
HELD_OUT_FRACTION = 0.1  # of the pretraining split (one image at least), only to report how good the backbone is
# Pretraining holds out HELD_OUT_FRACTION of its images and trains on a batch of what is left.
MIN_PRETRAIN_SAMPLES = 1 + MIN_BATCH_SIZE


@dataclass(kw_only=True)
class CommandOptions:
    """A command's options: made from flags or keyword arguments, each turned into its declared type and checked."""

    command: ClassVar[str]  # the command they belong to, as errors and docs name it

    def __post_init__(self) -> None:
        for declared in declared_settings(type(self)):
            setattr(self, declared.name, declared.coerce(getattr(self, declared.name)))
        validate_settings(self)
        self.check()

    def check(self) -> None:
        """Refuse a combination of options that no single option's bounds can see (none by default)."""

    @classmethod
    def declared(cls) -> tuple[Setting, ...]:
        """The options, as help and docs list them: the command's own first, then those it shares with others."""
        by_name = {declared.name: declared for declared in declared_settings(cls)}
        ordered = [name for klass in cls.__mro__ for name in vars(klass).get("__annotations__", {}) if name in by_name]
        return tuple(by_name[name] for name in dict.fromkeys(ordered))

    @classmethod
    def from_values(cls: type[Options], values: Mapping[str, Any]) -> Options:
        """The options of keyword arguments or given flags (`-` or `_` in names); an unknown name is refused."""
        known = {declared.name for declared in declared_settings(cls)}
        given = {key.replace("-", "_"): value for key, value in values.items()}
        unknown = sorted(given.keys() - known)
        if unknown:
            raise ConfigError(f"unknown {cls.command} option '{unknown[0]}': use {', '.join(sorted(known))}")
        missing = [d.flag_name for d in declared_settings(cls) if d.required and d.name not in given]
        if missing:
            raise ConfigError(f"{cls.command} needs {missing[0]}")
        return cls(**given)

    @classmethod
    def of(cls: type[Options], given: Any, values: Mapping[str, Any], *, first: str | None = None) -> Options:
        """What an API function takes: a whole options object, or else its options as keyword arguments `values`,
        with `given` the value of option `first` where the function takes that one positionally."""
        if isinstance(given, cls):
            if values:
                raise ConfigError(f"{cls.command} takes {cls.__name__} or options, not both: put them into it")
            return given
        return cls.from_values({first: given, **values} if first else values)

    @classmethod
    def split(cls: type[Options], given: Options | None, values: Mapping[str, Any]) -> tuple[Options, dict[str, Any]]:
        """The options of a command that takes settings too: `given`, or those of `values` that are its options;
        and the rest of `values`, the settings."""
        named = {declared.name for declared in declared_settings(cls)}
        own = {key: value for key, value in values.items() if given is None and key.replace("-", "_") in named}
        rest = {key: value for key, value in values.items() if key not in own}
        return (given if given is not None else cls.from_values(own)), rest


@dataclass(kw_only=True)
class OodOptions(CommandOptions):
    """An out-of-distribution set to score on: `eval --ood` instead of the clients' own test data, `compare --ood`
    besides it."""

    ood: str | None = setting(
        None,
        help="Score on an out-of-distribution set: fmnist-c (corruptions generated from the test set), "
        "cifar10-c[:PATH] (the published files; generated with imagecorruptions when absent), cifar10.1[:PATH], "
        "svhn[:PATH] or stl10[:PATH] (their test images), imagefolder:PATH (PATH/<class index or name>/<images>) or "
        "hf:NAME_OR_PATH[:CONFIG] (a Hugging Face dataset's test split); named classes are matched to the run's. "
        "Generated sets are cached under $PERADAPT_HOME/ood.",
        metavar="NAME",
    )
    ood_limit: int | None = setting(
        None, help="With --ood: at most N images of each corruption and severity.", minimum=1, metavar="N"
    )

    def check(self) -> None:
        super().check()
        if self.ood_limit is not None and self.ood is None:
            raise ConfigError("--ood-limit needs --ood NAME")


@dataclass(kw_only=True)
class RunsOptions(CommandOptions):
    """What the commands that train runs take besides the shared settings: a config file and a dry run."""

    config: Path | None = setting(
        None, help="YAML or JSON file with the same keys as the `train` flags; flags win over it.", metavar="FILE"
    )
    dry_run: bool = setting(
        False,
        help="Write nothing: print what would run (runs, rounds, client samples) and its time on this machine, from "
        "a few timed steps of the run's own model (GPU-hours on a GPU).",
    )


@dataclass(kw_only=True)
class TrainOptions(RunsOptions):
    command = "train"

    resume: bool = setting(False, help="Continue the run in --out from its last checkpoint.")
    preset: str | None = setting(
        None,
        help="Start from a paper preset: {choices} (`peradapt info --preset NAME` shows its settings); --config and "
        "flags win over it.",
        choices=PRESETS,
        metavar="NAME",
    )

    def check(self) -> None:
        super().check()
        if self.resume and (self.preset or self.config):
            raise ConfigError("--resume continues with the run's saved settings: drop --preset and --config")
        if self.resume and self.dry_run:
            raise ConfigError("--dry-run estimates a new run: drop --resume")


@dataclass(kw_only=True)
class CompareOptions(RunsOptions, OodOptions):
    command = "compare"

    methods: str = setting(
        REQUIRED, help="Comma-separated methods, e.g. perada,perada-nokd,ditto.", repeatable=True, metavar="NAMES"
    )
    seeds: int = setting(
        3,
        help="Seeds 0..N-1; each fixes the partition shared by all methods.",
        minimum=1,
        maximum=TUNING_SEED,
        why=f"seed {TUNING_SEED} is the trials' partition",
        metavar="N",
    )
    out: Path = setting(
        Path("runs/compare"), help="Directory for the runs, the trials and compare.json / compare.md / PNGs."
    )
    tune: int = setting(
        0,
        help="Trials per method over its declared search space (`peradapt methods`), scored on validation splits of "
        "the clients' training images; the test split is read only by the final runs. 0: no tuning.",
        minimum=0,
        metavar="N",
    )
    storage: str | None = setting(
        None,
        help="Where the trials are kept (Optuna storage): sqlite:///FILE, postgresql://..., mysql://... or "
        "journal:FILE; workers given the same one share the trials (docs/DEPLOY.md).",
        shown_default="sqlite:///OUT/tuning.db",
    )
    tune_only: bool = setting(
        False, help="Stop after the trials: a worker helping another `compare` that runs the final seeds."
    )
    reference: str | None = setting(
        None, help="The method each other is tested against (paired over seeds).", shown_default="perada, if compared"
    )
    anchors: bool = setting(True, help="Add standalone (local training) and fedavg-ft as anchors where not listed.")
    test: str = setting(
        "t",
        help="The paired test over seeds: t (paired t-test) or wilcoxon (signed-rank: cannot reach p < 0.05 below 6 "
        "seeds). Its p are Holm-adjusted over the comparisons shown together.",
        choices=PAIRED_TESTS,
    )
    target_accuracy: float | None = setting(
        None,
        help="The personalized local-test % whose first evaluated round (and client samples and bytes by then) each "
        "method's curve is scored by, in the column 'rounds to'.",
        minimum=0,
        exclusive_minimum=True,
        maximum=100,
        why="a percentage",
        shown_default="90% of the best method's final mean",
        metavar="PERCENT",
    )

    def check(self) -> None:
        super().check()
        if self.tune_only and not self.tune:
            raise ConfigError("--tune-only runs trials: give their number with --tune N")
        if self.storage is not None and not self.tune:
            raise ConfigError(
                "--storage keeps the trials of --tune N, and there are none: give --tune N or drop --storage"
            )

    @property
    def method_names(self) -> list[str]:
        return [name.strip() for name in self.methods.split(",") if name.strip()]


@dataclass(kw_only=True)
class PretrainOptions(CommandOptions):
    """`peradapt pretrain`: which backbone is trained on which labeled split, and how."""

    command = "pretrain"

    data: str = setting("fmnist", help="Dataset whose labeled pretraining split trains the backbone.")
    backbone: str = setting(
        "resnet18", help="timm model name, a narrow ResNet such as resnet18_w16, or the tiny ViT vit_tiny_p4_32."
    )
    epochs: int = setting(5, help="Passes over the pretraining split.", minimum=1)
    batch_size: int = setting(
        128,
        help="Minibatch size.",
        minimum=MIN_BATCH_SIZE,
        why="the backbone's BatchNorm layers train on each batch's statistics, which one sample has not",
    )
    lr: float | None = setting(
        None,
        help="Peak learning rate of the one-cycle schedule.",
        minimum=0,
        exclusive_minimum=True,
        shown_default="0.05 (SGD); ViTs: 0.001 (AdamW)",
    )
    weight_decay: float | None = setting(
        None, help="Weight decay.", minimum=0, shown_default="0.0005 (SGD); ViTs: 0.05 (AdamW)"
    )
    limit_samples: int | None = setting(
        None,
        help="Use at most this many images (smoke runs).",
        minimum=MIN_PRETRAIN_SAMPLES,
        why=f"{HELD_OUT_FRACTION:.0%} of the images (1 at least) are held out to measure the backbone, and a batch of "
        f"{MIN_BATCH_SIZE} must be left to train on",
        metavar="N",
    )
    data_dir: Path | None = setting(None, help="Where the dataset files are.")
    download: bool = setting(False, help="Download the dataset if missing (needs a network).")
    out: Path | None = setting(
        None,
        help="Weights file to write (safetensors; its description is written beside it as .json).",
        shown_default="the store `train` looks in",
        check=lambda out: check_output_path(out, "--out", directory=False),
    )
    seed: int = setting(0, help="Random seed.", minimum=0, maximum=2**63 - 1, why="the range torch's generators take")
    device: str = setting("auto", help="auto, cpu or cuda (cuda:N).", check=check_device)

    def check(self) -> None:
        super().check()
        if self.out is not None and self.out.suffix.lower() == ".json":
            raise ConfigError(
                f"--out {self.out}: the weights' description is written beside them as .json; "
                "give the weights a .safetensors name"
            )


@dataclass(kw_only=True)
class FinishedRunOptions(CommandOptions):
    """What the commands that read a finished run's models take: the run, and its backbone's file if it moved."""

    run: Path = setting(REQUIRED, help=RUN_HELP)
    weights: Path | None = setting(
        None,
        help="The backbone weights file (safetensors) the run was trained on, where this machine has no copy of them "
        "(the run looks in $PERADAPT_HOME/backbones/sha256/FINGERPRINT.safetensors); checked against the run's "
        "fingerprint.",
    )


@dataclass(kw_only=True)
class EvalOptions(FinishedRunOptions, OodOptions):
    command = "eval"


@dataclass(kw_only=True)
class ExportOptions(FinishedRunOptions):
    command = "export"

    out: Path = setting(REQUIRED, help="Directory to write the adapters and backbone to.")
    push_to_hub: str | None = setting(
        None,
        help="Also upload the export to this Hugging Face model repository (OWNER/NAME, created if new): the "
        "backbone, the global adapter, the --clients' adapters and their model cards. It replaces the adapters an "
        "earlier push put there. Needs a token: `hf auth login` or HF_TOKEN.",
        metavar="OWNER/NAME",
    )
    clients: str | None = setting(
        None,
        help="With --push-to-hub: the clients whose adapters go up, as ids (0,3,5, or the flag repeated) or all.",
        shown_default="all",
        repeatable=True,
    )
    private: bool = setting(False, help="With --push-to-hub: create the repository private.")
    merge: bool = setting(
        False,
        help="Export each client's model and the global one with the adapters folded into the backbone's weights: "
        "plain timm (or transformers) models, same outputs in eval mode, that load without peradapt (residual "
        "adapters of ResNets, LoRA and full models; not the ViT bottleneck adapter).",
    )
    license: str | None = setting(
        None,
        help="The license the model cards declare (a Hub license id: apache-2.0, mit, cc-by-nc-4.0, other, ...).",
        shown_default="the backbone weights' own where their Hub config names one, else none",
    )

    def check(self) -> None:
        super().check()
        if self.push_to_hub is None and (self.clients is not None or self.private):
            raise ConfigError("--clients and --private choose what --push-to-hub uploads: add --push-to-hub OWNER/NAME")


@dataclass(kw_only=True)
class PersonalizeOptions(FinishedRunOptions):
    command = "personalize"

    new_client: str = setting(
        REQUIRED,
        help="Id of a client the run held out with --holdout-clients, or a directory of the new client's images: "
        "DIR/<class>/<images> (a quarter kept for its test) or DIR/train/<class>/ and DIR/test/<class>/ (also as "
        "imagefolder:DIR), or hf:NAME_OR_PATH[:CONFIG] (a Hugging Face dataset).",
    )


@dataclass(kw_only=True)
class InfoOptions(CommandOptions):
    command = "info"

    run: Path | None = setting(None, help=RUN_HELP)
    preset: str | None = setting(
        None, help="Instead: what a paper preset sets ({choices}).", choices=PRESETS, metavar="NAME"
    )

    def check(self) -> None:
        super().check()
        if (self.run is None) == (self.preset is None):
            raise ConfigError("info takes --run DIR or --preset NAME (one of them)")


@dataclass(kw_only=True)
class ReportOptions(CommandOptions):
    command = "report"

    out: Path | None = setting(
        None,
        help="Directory for the plots and tables.",
        shown_default="the run's own directory for one run, else reports/",
    )


# Every command's options, in the order docs/SETTINGS.md lists them.
COMMAND_OPTIONS: tuple[type[CommandOptions], ...] = (
    TrainOptions,
    CompareOptions,
    PretrainOptions,
    EvalOptions,
    ExportOptions,
    PersonalizeOptions,
    InfoOptions,
    ReportOptions,
)


def settings_markdown() -> str:
    """docs/SETTINGS.md: every setting of `peradapt train`, then every command's own options (`make settings-doc`
    writes it; a test compares)."""
    intro = (
        "# Settings of `peradapt train`, and every command's options\n\n"
        "Generated from the declarations in `peradapt/config.py`, the methods' own settings in `peradapt/methods/` and "
        "the commands' options in `peradapt/options.py` by `make settings-doc`: do not edit by hand. Each setting's "
        "flag is also a config-file key (`--kd-steps 50` is `kd_steps: 50` or `kd-steps: 50`); flags win over "
        '`--config`, which wins over `--preset`. A method\'s own settings (panels "Method: NAME") are refused with '
        "any other `--method`; `peradapt methods NAME` shows them with their paper's symbols. `peradapt compare` takes "
        "these settings too, for every run, except those it sets itself (--method, --seed, --out, --eval-split).\n\n"
    )
    sections = [intro + markdown_table(listed_settings())]
    for options_class in COMMAND_OPTIONS:
        command = options_class.command
        rows = [(declared, command) for declared in options_class.declared()]
        sections.append(f"## `peradapt {command}`\n\n" + markdown_table(rows))
    return "\n".join(sections)
