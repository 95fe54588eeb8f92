"""The `peradapt` command line: parses flags into configs and calls the library. No algorithm lives here."""

from __future__ import annotations

import inspect
import json
import sys
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from peradapt import api
from peradapt.config import COMPARE_SETS, METHODS, listed_settings, search_space
from peradapt.errors import INTERRUPTED_BEFORE_WRITING, ConfigError, Interrupted, PeradaptError, interrupts_raise
from peradapt.presets import PRESETS
from peradapt.progress import counted, text_console
from peradapt.settings import Setting, declared_settings

try:  # what a command-line mistake raises: Typer >= 0.26 vendors click and raises its own exceptions
    from typer import TyperException as CommandLineError
except ImportError:  # older Typer (Flower pins typer < 0.21) raises click's
    from click import ClickException as CommandLineError

# Help texts are rich markup (the same mode on every Typer release): `Opt`, `Arg` and `command` escape what we write,
# so that brackets print as written ("needs peradapt[hf-data]", "[default: ...]") and `*`, `_`, `<class>` stay text.
app = typer.Typer(
    help="Personalized federated learning with adapters (PerAda and friends) on frozen pretrained backbones.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
# Text, never markup: paths and names a user typed may hold brackets (see peradapt.progress).
out_console = text_console()
err_console = text_console(stderr=True, soft_wrap=True)  # paths and messages stay on one line in logs

F = TypeVar("F", bound=Callable[..., Any])


def Opt(*names: str, help: str | None = None, **details: Any) -> Any:
    """`typer.Option` with its help printed as written."""
    return typer.Option(*names, help=None if help is None else escape(help), **details)


def Arg(*, help: str, **details: Any) -> Any:
    """`typer.Argument` with its help printed as written."""
    return typer.Argument(help=escape(help), **details)


def command(name: str | None = None, **details: Any) -> Callable[[F], F]:
    """Register a command whose docstring is its help, printed as written."""

    def register(function: F) -> F:
        return app.command(name, help=escape(inspect.getdoc(function) or ""), **details)(function)

    return register


# The commands that take a flag per setting: their own parameters and the settings whose flags they hide.
_TAKE_SETTINGS: dict[Callable[..., Any], tuple[list[inspect.Parameter], frozenset[str]]] = {}


def takes_settings(hidden: Collection[str] = ()) -> Callable[[F], F]:
    """A command that also takes one flag per declared setting, each in its setting's help panel, but where it has a
    parameter of that name itself; the function gets them as keyword arguments (`**settings`), None where a flag was
    not given. The flags of `hidden` are not shown: the command refuses them with its own explanation."""

    def declare(function: F) -> F:
        parameters = inspect.signature(function, eval_str=True).parameters.values()
        own = [parameter for parameter in parameters if parameter.kind is not inspect.Parameter.VAR_KEYWORD]
        _TAKE_SETTINGS[function] = own, frozenset(hidden)
        # Its flags are added by `main`, for a command line that runs it: they are every method's settings, and
        # reading those imports the methods (torch), which `peradapt --help` and the other commands do not need.
        function.__signature__ = inspect.Signature(own)  # type: ignore[attr-defined]
        return function

    return declare


def add_setting_flags() -> None:
    """Give the commands that take settings a flag for every setting of the methods registered now. `main` calls it
    for a command line that runs one of them, once the plugins it names are registered; whatever else builds the
    commands from `app` (`typer.main.get_command`) calls it first."""
    for function in _TAKE_SETTINGS:
        _add_setting_flags(function)


def _add_setting_flags(function: Callable[..., Any]) -> None:
    # Typer reads a command's options from its function's signature (`inspect.signature`, which honours
    # `__signature__`): the generated flags are keyword parameters of it, each annotated with its `typer.Option`.
    own, hidden = _TAKE_SETTINGS[function]
    names = {parameter.name for parameter in own}
    flags = [
        _setting_parameter(declared, panel, hidden=declared.name in hidden)
        for declared, panel in listed_settings()
        if declared.flag and declared.name not in names
    ]
    function.__signature__ = inspect.Signature([*own, *flags])  # type: ignore[attr-defined]


def _setting_parameter(declared: Setting, panel: str, *, hidden: bool) -> inspect.Parameter:
    """The flag of a setting: a switch for a bool, text where a word may stand for the value (`--lam auto`), a list
    for a repeatable flag; default None, so that a flag not given leaves the preset's or config file's value."""
    help_text = declared.help_text()
    shown = declared.default is not None or declared.shown_default is not None or declared.none_word is not None
    if declared.base_type != "bool" and shown:
        help_text += f" [default: {declared.default_text()}]"
    kinds: dict[str, type] = {"bool": bool, "int": int, "float": float, "str": str}
    value = str if declared.auto or declared.none_word else kinds[declared.base_type]
    option = Opt(
        declared.flag_name,
        help=help_text,
        metavar=declared.metavar,
        rich_help_panel=panel,
        show_default=False,
        hidden=hidden,
    )
    annotation: Any = list[value] if declared.repeatable else value  # type: ignore[valid-type]
    return inspect.Parameter(
        declared.name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[annotation | None, option]
    )


def given_settings(flags: dict[str, Any]) -> dict[str, Any]:
    """The settings a command line gave: a switch is on or not given, a repeatable flag not given is empty."""
    # identity for None and False: 0 == False, and --rounds 0 is given
    return {
        key: value for key, value in flags.items() if value is not None and value is not False and value not in ((), [])
    }


# The title's note for a run of --eval-split validation, whose scores are on no test image.
SCORED_ON_VALIDATION = ", scored on validation splits held out of the clients' training images (no test image)"
INFO_CLIENT_ROWS = 100  # `info` lists this many clients of a larger federation; partition.json has them all
RunDir = Annotated[Path, Opt("--run", help="A run directory written by `peradapt train`.", show_default=False)]
RunWeights = Annotated[
    Path | None,
    Opt(
        "--weights",
        help="The backbone weights file (safetensors) the run was trained on, where this machine has no copy of them "
        "(the run looks in $PERADAPT_HOME/backbones/sha256/FINGERPRINT.safetensors); checked against the run's "
        "fingerprint.",
        show_default=False,
    ),
]


@command()
def pretrain(
    data: Annotated[str, Opt(help="Dataset whose labeled pretraining split trains the backbone.")] = "fmnist",
    backbone: Annotated[
        str, Opt(help="timm model name, a narrow ResNet such as resnet18_w16, or the tiny ViT vit_tiny_p4_32.")
    ] = "resnet18",
    epochs: Annotated[int, Opt(help="Passes over the pretraining split.")] = 5,
    batch_size: Annotated[int, Opt(help="Minibatch size.")] = 128,
    lr: Annotated[
        float | None,
        Opt(help="Peak learning rate of the one-cycle schedule [default: 0.05 (SGD); ViTs: 0.001 (AdamW)]."),
    ] = None,
    limit_samples: Annotated[int | None, Opt(help="Use at most this many images (smoke runs).")] = None,
    data_dir: Annotated[Path | None, Opt(help="Where the dataset files are.")] = None,
    download: Annotated[bool, Opt(help="Download the dataset if missing (needs a network).")] = False,
    out: Annotated[Path | None, Opt(help="Weights file to write [default: the store `train` looks in].")] = None,
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
    out_console.print(f"backbone written to {path} (held-out accuracy {100 * accuracy:.2f}%)", soft_wrap=True)
    if replaced:  # runs record their backbone's fingerprint and keep a copy: they do not move to the new weights
        out_console.print(
            f"it replaces the weights that were there; runs trained on those keep using them "
            f"(pinned under {pinned_weights_path('').parent})",
            soft_wrap=True,
        )


DryRun = Annotated[
    bool,
    Opt(
        "--dry-run",
        help="Write nothing: print what would run (runs, rounds, client samples) and its time on this machine, from "
        "a few timed steps of the run's own model (GPU-hours on a GPU).",
    ),
]


def _table_console() -> Console:
    """Where a wide table prints: piped output has no width to fit, so its rows stay on one line each for logs and
    scripts."""
    return out_console if out_console.is_terminal else text_console(width=220)


def _print_estimate(estimate: dict) -> None:
    """`--dry-run`'s table and what its total comes to (`commands.estimate`)."""
    from peradapt.commands.estimate import estimate_lines, estimate_table

    _table_console().print(estimate_table(estimate))
    for line in estimate_lines(estimate):
        out_console.print(line, soft_wrap=True)


@command()
@takes_settings()
def train(
    resume: Annotated[bool, Opt("--resume", help="Continue the run in --out from its last checkpoint.")] = False,
    preset: Annotated[
        str | None,
        Opt(
            help=f"Start from a paper preset: {', '.join(PRESETS)} (`peradapt info --preset NAME` shows its "
            "settings); --config and flags win over it."
        ),
    ] = None,
    config: Annotated[Path | None, Opt(help="YAML or JSON file with the same keys as these flags; flags win.")] = None,
    dry_run: DryRun = False,
    **settings: Any,
) -> None:
    """Train personalized adapters in a simulated federation and write a run directory."""
    if dry_run:
        given = given_settings(settings)
        _print_estimate(api.train(resume=resume, preset=preset, config_file=config, dry_run=True, **given))
        return
    train_config = api.training_config(resume=resume, preset=preset, config_file=config, **given_settings(settings))
    report = api.train(train_config, resume=resume, console=err_console)
    from peradapt.evaluation import cost_summary, results_table

    clients, rounds = counted(len(report["clients"]), "client"), counted(report["rounds"], "round")
    title = f"{report['method']} on {report['data']}, {clients}, {rounds}"
    if report["eval_split"] == "validation":
        title += SCORED_ON_VALIDATION
    if "privacy" in report:  # as the paper's Table 5: the clients' mean ε ± std
        privacy = report["privacy"]
        title += (
            f", DP ε = {privacy['epsilon']['mean']:.2f} ± {privacy['epsilon']['std']:.2f} (δ = {privacy['delta']:g})"
        )
    selected = report["selected_on_test"]
    out_console.print(results_table(report["summary"], title, report["metric"], selected, report["eval_split"]))
    if "cost" in report:  # not for a run resumed from rounds recorded before costs were
        out_console.print(cost_summary(report["cost"]), soft_wrap=True)
    out_console.print(f"run directory: {train_config.out}", soft_wrap=True)


@command()
@takes_settings(hidden=COMPARE_SETS)
def compare(
    methods: Annotated[str, Opt(help="Comma-separated methods, e.g. perada,perada-nokd,ditto.", show_default=False)],
    seeds: Annotated[int, Opt(help="Seeds 0..N-1; each fixes the partition shared by all methods.")] = 3,
    out: Annotated[Path, Opt(help="Directory for the runs, the trials and compare.json / compare.md / PNGs.")] = Path(
        "runs/compare"
    ),
    config: Annotated[Path | None, Opt(help="YAML or JSON file of train settings; flags win.")] = None,
    tune: Annotated[
        int,
        Opt(
            help="Trials per method over its declared search space (`peradapt methods`), scored on validation "
            "splits of the clients' training images; the test split is read only by the final runs. 0: no tuning."
        ),
    ] = 0,
    storage: Annotated[
        str | None,
        Opt(
            help="Where the trials are kept (Optuna storage): sqlite:///FILE, postgresql://..., mysql://... or "
            "journal:FILE; workers given the same one share the trials (docs/DEPLOY.md).",
            show_default="sqlite:///OUT/tuning.db",
        ),
    ] = None,
    tune_only: Annotated[
        bool, Opt(help="Stop after the trials: a worker helping another `compare` that runs the final seeds.")
    ] = False,
    reference: Annotated[
        str | None,
        Opt(help="The method each other is tested against (paired over seeds).", show_default="perada, if compared"),
    ] = None,
    anchors: Annotated[
        bool, Opt(help="Add standalone (local training) and fedavg-ft as anchors where not listed.")
    ] = True,
    ood: Annotated[str | None, Opt(help="Also score every run on this OOD set (as `peradapt eval --ood`).")] = None,
    ood_limit: Annotated[int | None, Opt(help="With --ood: at most N images of each corruption and severity.")] = None,
    test: Annotated[
        str,
        Opt(
            help="The paired test over seeds: t (paired t-test) or wilcoxon (signed-rank: cannot reach p < 0.05 "
            "below 6 seeds). Its p are Holm-adjusted over the comparisons shown together.",
            metavar="t|wilcoxon",
        ),
    ] = "t",
    target_accuracy: Annotated[
        float | None,
        Opt(
            help="The personalized local-test % whose first evaluated round (and client samples and bytes by then) "
            "each method's curve is scored by, in the column 'rounds to'.",
            show_default="90% of the best method's final mean",
            metavar="PERCENT",
        ),
    ] = None,
    dry_run: DryRun = False,
    **settings: Any,
) -> None:
    """Tune, repeat and cost several methods on the same partitions and seeds, and print the ranked comparison.

    The `peradapt train` flags (--data, --clients, --rounds, --budget, --limit-samples, ...) apply to every run, but
    for those compare sets itself (--method, --seed, --out, --eval-split); a method's own setting (--feddyn-alpha,
    ...) applies to the runs of the methods that take it, and is then not tuned. 10% of the clients are held out of
    training for the new-client accuracy unless --holdout-clients is given. docs/METHODS.md, "Comparing methods",
    says what each number is.
    """
    from peradapt.commands.comparison import rich_table

    names = [name.strip() for name in methods.split(",") if name.strip()]
    result = api.compare(
        names,
        seeds=seeds,
        out=out,
        config_file=config,
        tune=tune,
        storage=storage,
        tune_only=tune_only,
        reference=reference,
        anchors=anchors,
        ood=ood,
        ood_limit=ood_limit,
        test=test,
        target_accuracy=target_accuracy,
        dry_run=dry_run,
        console=err_console,
        **given_settings(settings),
    )
    if dry_run:
        _print_estimate(result)
        return
    if tune_only:
        out_console.print(f"trials done: {', '.join(result['methods'])}", soft_wrap=True)
        return
    _table_console().print(rich_table(result))
    out_console.print(f"written to {out / 'compare.json'}, {out / 'compare.md'} and PNGs", soft_wrap=True)


@command("eval")
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
    weights: RunWeights = None,
) -> None:
    """local-test and global-test of every client's personalized adapter and of the global adapter."""
    from peradapt.commands.finished_run import ood_report_name, ood_table
    from peradapt.evaluation import results_table, summarize

    if ood is not None:
        result = api.evaluate(run, ood=ood, ood_limit=ood_limit, weights=weights, console=err_console)
        console = out_console if out_console.is_terminal else text_console(width=120)
        console.print(ood_table(result, f"{ood} on {run}, {counted(len(result['clients']), 'client')}"))
        out_console.print(f"images: {result['provenance']}", soft_wrap=True)
        out_console.print(f"written to {run / ood_report_name(ood)}", soft_wrap=True)
        return
    evaluation = api.evaluate(run, ood_limit=ood_limit, weights=weights)
    split = evaluation["eval_split"]
    title = f"evaluation of {run}" + (SCORED_ON_VALIDATION if split == "validation" else "")
    out_console.print(results_table(summarize(evaluation), title, evaluation["metric"], eval_split=split))
    out_console.print(f"written to {run / 'eval.json'}", soft_wrap=True)


@command()
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
    merge: Annotated[
        bool,
        Opt(
            "--merge",
            help="Export each client's model and the global one with the adapters folded into the backbone's "
            "weights: plain timm (or transformers) models, same outputs in eval mode, that load without peradapt "
            "(residual adapters of ResNets, LoRA and full models; not the ViT bottleneck adapter).",
        ),
    ] = False,
    license: Annotated[
        str | None,
        Opt(
            help="The license the model cards declare (a Hub license id: apache-2.0, mit, cc-by-nc-4.0, other, "
            "...). Default: the backbone weights' own where their Hub config names one, else none.",
            show_default=False,
        ),
    ] = None,
    weights: RunWeights = None,
) -> None:
    """Copy every client's adapter and the global adapter (PEFT layout) with their frozen backbone, and a model card
    (README.md) for each that says how to load it; with --merge, whole models instead."""
    if push_to_hub is None and (clients is not None or private):
        raise ConfigError("--clients and --private choose what --push-to-hub uploads: add --push-to-hub OWNER/NAME")
    if push_to_hub is None:
        path, url = api.export(run, out, merge=merge, license=license, weights=weights), None
    else:
        chosen = "all" if clients is None else clients
        url = api.push_to_hub(
            run, out, push_to_hub, clients=chosen, private=private, merge=merge, license=license, weights=weights
        )
        path = out
    what = "merged models" if merge else "adapters, backbone"
    out_console.print(f"{what} and model cards written to {path}", soft_wrap=True)
    out_console.print(f"how to load them: {path / 'README.md'} and each model's README.md", soft_wrap=True)
    if url is not None:
        out_console.print(f"uploaded to {url}", soft_wrap=True)


@command()
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
    weights: RunWeights = None,
) -> None:
    """Personalize a client that never took part in training, from the run's global model, with the run's method.

    Prints its local-test accuracy with the global model and with its personalized model; writes the model and
    result.json under RUN/new_clients/<name>/."""
    from peradapt.evaluation.report import METRIC_LABELS

    result = api.personalize_new_client(run, new_client, weights=weights)
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
            f"({privacy['steps']} DP-SGD steps on its data)",
            soft_wrap=True,
        )
    out_console.print(f"personalized model written to {result['adapter']}", soft_wrap=True)


@command()
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
    if resolved.get("classes") and partition.get("histograms_of", "classes") == "classes":  # the histograms' order
        out_console.print(f"classes: {', '.join(resolved['classes'])}", soft_wrap=True)
    skew = label_skew([c["train_histogram"] for c in partition["clients"]])
    out_console.print(
        f"label skew (mean total-variation distance to the pooled labels, 0 = IID): {skew:.3f}", soft_wrap=True
    )
    if resolved.get("backbone_parameters") and "trainable_parameters" in resolved:
        trainable, total = resolved["trainable_parameters"], resolved["backbone_parameters"]
        out_console.print(
            f"trainable parameters: {trainable:,} of {total:,} ({100 * trainable / total:.1f}%), "
            f"adapter: {resolved['adapter']}, scope: {resolved.get('scope', 'adapter')}",
            soft_wrap=True,  # a terminal wraps it; rich would break it between "scope:" and its value
        )
    if "client_store" in resolved:
        where = f" ({run / 'client_store'})" if resolved["client_store"] == "disk" else ", in the checkpoints"
        out_console.print(f"client state: {resolved['client_store']}{where}", soft_wrap=True)
    counts = finished.get("cost", {}).get("parameters")  # the columns of the PerAda paper's Table 1, measured
    if counts:
        out_console.print(
            f"per client: {counts['personalized']:,} personalized, {counts['trained']:,} trained, "
            f"{counts['communicated']:,} communicated elements",
            soft_wrap=True,
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
    for column in ("setting", "preset", "peradapt default", "why", "what it is"):
        table.add_column(column, overflow="fold")
    for declared, value, note in preset_rows(name):
        flag = f"{declared.flag_name} ({declared.symbol})" if declared.symbol else declared.flag_name
        table.add_row(flag, str(value), declared.default_text(), note, declared.help_text())
    console = out_console if out_console.is_terminal else text_console(width=240)
    console.print(record["description"], soft_wrap=True, highlight=False, markup=False)
    console.print(table)
    console.print(f"from the authors' {record['source']}", soft_wrap=True, highlight=False, markup=False)


@command("methods")
def list_methods(
    name: Annotated[
        str | None, Arg(help="A method's name: its description and settings in full.", show_default=False)
    ] = None,
) -> None:
    """Every registered method: what it is, its paper, its defaults and its own settings; or one method in full."""
    from peradapt.methods import method_class
    from peradapt.methods.plugins import ENTRY_POINT_GROUP

    console = out_console if out_console.is_terminal else text_console(width=200)
    if name is not None:
        _print_method(name, method_class(name, asked_as="method"), console)
        return
    table = Table(title="methods (`peradapt methods NAME`: one in full; `peradapt train --method NAME`)")
    for column in ("method", "summary (paper)", "scope", "server mean", "own settings [default]", "source"):
        table.add_column(column, overflow="fold")
    for method, cls in METHODS.items():
        own = [_setting_line(declared) for declared in declared_settings(cls.settings_class)]
        aggregation = str(cls.default_aggregation or "none")
        table.add_row(method, cls.summary, cls.default_scope, aggregation, "\n".join(own), METHODS.source(method))
    console.print(table)
    for method, error in METHODS.broken().items():  # listed, not fatal: only the commands that name it fail
        console.print(f"broken: {method}: {error}", soft_wrap=True, highlight=False, markup=False)
    console.print(
        "A method of your own: `--method MODULE:CLASS`, or an installed package's entry point in group "
        f"{ENTRY_POINT_GROUP} (docs/ADDING_A_METHOD.md).",
        soft_wrap=True,
        highlight=False,
    )


def _setting_line(declared: Setting) -> str:
    symbol = f" ({declared.symbol})" if declared.symbol else ""
    return f"{declared.flag_name}{symbol} [{declared.default_text()}]"


def _print_method(name: str, cls: type, console: Any) -> None:
    """One method: its summary, its module's description (paper, update rules, conventions), what it supports,
    and its settings."""
    from peradapt.methods.base import trains_by_sgd_jobs

    console.print(f"{name}: {cls.summary}", soft_wrap=True, highlight=False)
    console.print(inspect.getdoc(sys.modules[cls.__module__]) or "", highlight=False)
    facts = {
        "source": METHODS.source(name),
        "default scope": cls.default_scope,
        "server mean": cls.default_aggregation or "none (the server averages nothing)",
        "distills on unlabeled data": "yes" if cls.uses_distillation else "no",
        "--lam auto": "yes" if cls.uses_proximal else "no",
        "--dp-noise": "yes" if cls.supports_dp else "no",
        "--concurrent-clients": "yes" if trains_by_sgd_jobs(cls) else "no (clients train one after another)",
        "trains": "every federated client each round" if cls.trains_all_clients else "the sampled clients",
        "compare --tune searches": ", ".join(
            f"{declared.flag_name} {declared.search.text()}" for declared in search_space(name).values()
        )
        or "nothing",
    }
    for fact, value in facts.items():
        console.print(f"{fact}: {value}", highlight=False)
    own = declared_settings(cls.settings_class)
    if not own:
        console.print("settings of its own: none (the shared ones: `peradapt train --help`)", highlight=False)
        return
    table = Table(title=f"settings of {name} (the shared ones: `peradapt train --help`)")
    for column in ("flag", "symbol", "default", "values", "help"):
        table.add_column(column, overflow="fold")
    for d in own:
        table.add_row(d.flag_name, d.symbol, d.default_text(), d.allowed(), d.help_text())
    console.print(table)


@command()
def report(
    runs: Annotated[list[Path], Arg(metavar="RUN", help="Finished run directories (`peradapt train --out`).")],
    out: Annotated[
        Path | None,
        Opt(help="Directory for the plots and tables [default: the run's own directory for one run, else reports/]."),
    ] = None,
) -> None:
    """Plots (accuracy per round, per client) and a Markdown/JSON table comparing finished runs."""
    for path in api.report(runs, out):
        out_console.print(f"written {path}", soft_wrap=True)


def find_named_plugins(args: list[str]) -> None:
    """Find the plugin methods a command line names (`--method module:Class`, compare's `--methods a,module:Class`)
    before the commands are built, so that their settings are flags (and shown by --help) too."""
    for index, arg in enumerate(args):
        flag, equals, value = arg.partition("=")
        if flag in ("--method", "--methods"):
            value = value if equals else (args[index + 1] if index + 1 < len(args) else "")
            for name in value.split(","):
                if ":" in name:
                    from peradapt.methods import method_class  # the methods, only for a command line that names one

                    method_class(name.strip())


def _command_name(args: list[str]) -> str | None:
    """The command a command line runs: its first word that is no option (`peradapt` takes none with a value)."""
    return next((arg for arg in args if not arg.startswith("-")), None)


def main() -> None:
    interrupts_raise()  # Ctrl-C while peradapt was imported exited quietly; from here on it is handled below
    try:
        find_named_plugins(sys.argv[1:])
        if _command_name(sys.argv[1:]) in ("train", "compare"):  # the commands whose flags are every setting
            add_setting_flags()
        code = app(standalone_mode=False)
    except PeradaptError as exc:
        err_console.print(Text.assemble(("error:", "red"), f" {exc}"), highlight=False)
        sys.exit(2)
    except Interrupted as exc:  # Ctrl-C during a run: what was kept and how to continue
        err_console.print(f"interrupted: {exc}", highlight=False)
        sys.exit(130)
    except (typer.Abort, KeyboardInterrupt):
        code = 130
    except CommandLineError as exc:
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
        err_console.print(INTERRUPTED_BEFORE_WRITING)
    if isinstance(code, int) and code:
        sys.exit(code)
