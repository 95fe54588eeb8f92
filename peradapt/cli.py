"""The `peradapt` command line: parses flags into configs and calls the library. No algorithm lives here."""

from __future__ import annotations

import functools
import inspect
import json
import sys
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from peradapt import api
from peradapt.config import COMPARE_SETS, listed_settings, search_space
from peradapt.errors import INTERRUPTED_BEFORE_WRITING, Interrupted, PeradaptError, interrupts_raise
from peradapt.options import (
    CommandOptions,
    CompareOptions,
    EvalOptions,
    ExportOptions,
    InfoOptions,
    PersonalizeOptions,
    PretrainOptions,
    ReportOptions,
    TrainOptions,
)
from peradapt.presets import PresetInfo
from peradapt.progress import counted, text_console
from peradapt.registry import METHODS
from peradapt.settings import Setting, declared_settings

if TYPE_CHECKING:  # what `api.info` returns for a run, whose module loads with the training stack
    from peradapt.commands.finished_run import RunInfo

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


@dataclass(frozen=True)
class _Takes:
    """What a command built by `takes_options` takes: its parameters before any setting flag (its arguments, then a
    flag per option), whether it takes a flag per setting too, and the settings whose flags it hides."""

    parameters: list[inspect.Parameter]
    settings: bool
    hidden: frozenset[str]


_TAKES: dict[Callable[..., Any], _Takes] = {}


def takes_options(
    options_class: type[CommandOptions], *, settings: bool = False, hidden: Collection[str] = ()
) -> Callable[[F], F]:
    """A command whose flags are the options `options_class` declares (`peradapt.options`), and with `settings` one
    flag per shared and method setting too, each in its setting's help panel, except where an option has its name.
    The function gets its options object as `options`, made and checked from the flags given, the settings given as
    keyword arguments (`**settings`) and its other parameters (arguments) as they are. The setting flags of `hidden`
    are not shown: the command refuses them with its own explanation."""

    def declare(function: F) -> F:
        parameters = inspect.signature(function, eval_str=True).parameters.values()
        own = [p for p in parameters if p.name != "options" and p.kind is not inspect.Parameter.VAR_KEYWORD]
        named = {declared.name for declared in options_class.declared()}

        @functools.wraps(function)
        def run(**flags: Any) -> Any:
            arguments = {p.name: flags.pop(p.name) for p in own}
            options = options_class.from_values(
                {key: flags.pop(key) for key in list(flags) if key in named and _was_given(flags[key])}
            )
            return function(options=options, **arguments, **given_settings(flags))

        _TAKES[run] = _Takes([*own, *map(_option_parameter, options_class.declared())], settings, frozenset(hidden))
        # Typer reads a command's flags from its function's signature (`inspect.signature`, which honours
        # `__signature__`). The setting flags are added by `main`, for a command line that runs such a command: they
        # are every method's settings, and reading those imports the methods (torch), which `peradapt --help` and
        # the other commands do not need.
        run.__signature__ = inspect.Signature(_TAKES[run].parameters)  # type: ignore[attr-defined]
        return run  # type: ignore[return-value]

    return declare


def add_setting_flags() -> None:
    """Give the commands that take settings a flag for every setting of the methods registered now. `main` calls it
    for a command line that runs one of them, once the plugins it names are registered; whatever else builds the
    commands from `app` (`typer.main.get_command`) calls it first."""
    for function, takes in _TAKES.items():
        if not takes.settings:
            continue
        names = {parameter.name for parameter in takes.parameters}
        flags = [
            _setting_parameter(declared, panel, hidden=declared.name in takes.hidden)
            for declared, panel in listed_settings()
            if declared.flag and declared.name not in names
        ]
        function.__signature__ = inspect.Signature([*takes.parameters, *flags])  # type: ignore[attr-defined]


def _option_parameter(declared: Setting) -> inspect.Parameter:
    """The flag of a command's own option: required where it has no default, `--x/--no-x` for a switch that is on
    unless turned off."""
    names = [f"{declared.flag_name}/--no-{declared.flag_name[2:]}"] if declared.default is True else []
    return _setting_parameter(declared, None, names=names, required=declared.required)


def _setting_parameter(
    declared: Setting,
    panel: str | None,
    *,
    hidden: bool = False,
    names: list[str] | None = None,
    required: bool = False,
) -> inspect.Parameter:
    """The flag of a setting: a switch for a bool, text where a word may stand for the value (`--lam auto`), a list
    for a repeatable flag; default None, so that a flag not given leaves the preset's or config file's value (or the
    option's default)."""
    help_text = declared.help_text()
    shown = declared.default is not None or declared.shown_default is not None or declared.none_word is not None
    if declared.base_type != "bool" and shown and not required:
        help_text += f" [default: {declared.default_text()}]"
    kinds: dict[str, type] = {"bool": bool, "int": int, "float": float, "str": str, "Path": Path}
    value = str if declared.auto or declared.none_word else kinds[declared.base_type]
    option = Opt(
        *(names or [declared.flag_name]),
        help=help_text,
        metavar=declared.metavar,
        rich_help_panel=panel,
        show_default=False,
        hidden=hidden,
    )
    annotation: Any = list[value] if declared.repeatable else value  # type: ignore[valid-type]
    return inspect.Parameter(
        declared.name,
        inspect.Parameter.KEYWORD_ONLY,
        default=inspect.Parameter.empty if required else None,
        annotation=Annotated[annotation if required else annotation | None, option],
    )


def _was_given(value: Any) -> bool:
    """Whether a flag was given: Typer passes None for an option not given, an empty list for a repeatable one."""
    return value is not None and value not in ((), [])


def given_settings(flags: dict[str, Any]) -> dict[str, Any]:
    """The settings a command line gave: a switch is on or not given, a repeatable flag not given is empty."""
    # identity for None and False: 0 == False, and --rounds 0 is given
    return {
        key: value for key, value in flags.items() if value is not None and value is not False and value not in ((), [])
    }


# The title's note for a run of --eval-split validation, whose scores are on no test image.
SCORED_ON_VALIDATION = ", scored on validation splits held out of the clients' training images (no test image)"
INFO_CLIENT_ROWS = 100  # `info` lists this many clients of a larger federation; partition.json has them all


@command()
@takes_options(PretrainOptions)
def pretrain(options: PretrainOptions) -> None:
    """Make a backbone offline by training it on a labeled split the clients never see (stands in for ImageNet)."""
    from peradapt.backbones import default_weights_path, pinned_weights_path

    replaced = (options.out or default_weights_path(options.data, options.backbone)).is_file()
    path, accuracy = api.pretrain(options, console=err_console)
    out_console.print(f"backbone written to {path} (held-out accuracy {100 * accuracy:.2f}%)", soft_wrap=True)
    if replaced:  # runs record their backbone's fingerprint and keep a copy: they do not move to the new weights
        out_console.print(
            f"it replaces the weights that were there; runs trained on those keep using them "
            f"(pinned under {pinned_weights_path('').parent})",
            soft_wrap=True,
        )


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
@takes_options(TrainOptions, settings=True)
def train(options: TrainOptions, **settings: Any) -> None:
    """Train personalized adapters in a simulated federation and write a run directory."""
    if options.dry_run:
        _print_estimate(api.train(options, **settings))
        return
    train_config = api.training_config(options, **settings)
    report = api.train(train_config, resume=options.resume, console=err_console)
    from peradapt.evaluation import cost_summary, results_table

    clients, rounds = counted(len(report.clients), "client"), counted(report.rounds, "round")
    title = f"{report.method} on {report.data}, {clients}, {rounds}"
    if report.eval_split == "validation":
        title += SCORED_ON_VALIDATION
    if report.privacy is not None:  # as the paper's Table 5: the clients' mean ε ± std
        epsilon = report.privacy.epsilon
        title += f", DP ε = {epsilon.mean:.2f} ± {epsilon.std:.2f} (δ = {report.privacy.delta:g})"
    selected = report.selected_on_test
    out_console.print(results_table(report.summary, title, report.metric, selected, report.eval_split))
    out_console.print(cost_summary(report.cost), soft_wrap=True)
    out_console.print(f"run directory: {train_config.out}", soft_wrap=True)


@command()
@takes_options(CompareOptions, settings=True, hidden=COMPARE_SETS)
def compare(options: CompareOptions, **settings: Any) -> None:
    """Tune, repeat and cost several methods on the same partitions and seeds, and print the ranked comparison.

    The `peradapt train` flags (--data, --clients, --rounds, --budget, --limit-samples, ...) apply to every run, but
    for those compare sets itself (--method, --seed, --out, --eval-split); a method's own setting (--feddyn-alpha,
    ...) applies to the runs of the methods that take it, and is then not tuned. 10% of the clients are held out of
    training for the new-client accuracy unless --holdout-clients is given. docs/METHODS.md, "Comparing methods",
    says what each number is.
    """
    from peradapt.commands.comparison import rich_table

    result = api.compare(options, console=err_console, **settings)
    if options.dry_run:
        _print_estimate(result)
        return
    if options.tune_only:
        out_console.print(f"trials done: {', '.join(result['methods'])}", soft_wrap=True)
        return
    _table_console().print(rich_table(result))
    out = options.out
    out_console.print(f"written to {out / 'compare.json'}, {out / 'compare.md'} and PNGs", soft_wrap=True)


@command("eval")
@takes_options(EvalOptions)
def evaluate(options: EvalOptions) -> None:
    """local-test and global-test of every client's personalized adapter and of the global adapter."""
    from peradapt.commands.finished_run import ood_report_name, ood_table
    from peradapt.evaluation import flat_scores, results_table

    run, ood = options.run, options.ood
    if ood is not None:
        result = api.evaluate(options, console=err_console)
        console = out_console if out_console.is_terminal else text_console(width=120)
        console.print(ood_table(result, f"{ood} on {run}, {counted(len(result['clients']), 'client')}"))
        out_console.print(f"images: {result['provenance']}", soft_wrap=True)
        out_console.print(f"written to {run / ood_report_name(ood)}", soft_wrap=True)
        return
    evaluation = api.evaluate(options)
    split = evaluation["eval_split"]
    title = f"evaluation of {run}" + (SCORED_ON_VALIDATION if split == "validation" else "")
    out_console.print(results_table(flat_scores(evaluation), title, evaluation["metric"], eval_split=split))
    out_console.print(f"written to {run / 'eval.json'}", soft_wrap=True)


@command()
@takes_options(ExportOptions)
def export(options: ExportOptions) -> None:
    """Copy every client's adapter and the global adapter (PEFT layout) with their frozen backbone, and a model card
    (README.md) for each that says how to load it; with --merge, whole models instead."""
    if options.push_to_hub is None:
        path, url = api.export(options), None
    else:
        path, url = options.out, api.push_to_hub(options)
    what = "merged models" if options.merge else "adapters, backbone"
    out_console.print(f"{what} and model cards written to {path}", soft_wrap=True)
    out_console.print(f"how to load them: {path / 'README.md'} and each model's README.md", soft_wrap=True)
    if url is not None:
        out_console.print(f"uploaded to {url}", soft_wrap=True)


@command()
@takes_options(PersonalizeOptions)
def personalize(options: PersonalizeOptions) -> None:
    """Personalize a client that never took part in training, from the run's global model, with the run's method.

    Prints its local-test accuracy with the global model and with its personalized model; writes the model and
    result.json under RUN/new_clients/<name>/."""
    from peradapt.evaluation.report import METRIC_LABELS

    result = api.personalize_new_client(options)
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
@takes_options(InfoOptions)
def info(options: InfoOptions) -> None:
    """Resolved config, partition statistics and trainable-parameter count of a run, or a preset's settings."""
    shown = api.info(options)
    if isinstance(shown, PresetInfo):
        _print_preset(shown)
    else:
        assert options.run is not None
        _print_run(shown, options.run)


def _print_run(shown: RunInfo, run: Path) -> None:
    config, resolved, partition, finished = shown.config, shown.resolved, shown.partition, shown.report
    out_console.print_json(json.dumps({"config": config.to_flat(), "resolved": resolved.to_json()}))
    privacy = finished and finished.privacy  # --dp-noise: each client's ε, known once the run has finished
    epsilons = dict(zip(finished.clients, privacy.epsilon.per_client, strict=True)) if privacy else {}
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
    if partition.get("histograms_of", "classes") == "classes":  # the histograms' order
        out_console.print(f"classes: {', '.join(resolved.classes)}", soft_wrap=True)
    out_console.print(
        f"label skew (mean total-variation distance to the pooled labels, 0 = IID): {shown.label_skew:.3f}",
        soft_wrap=True,
    )
    trainable, total = resolved.trainable_parameters, resolved.backbone_parameters
    out_console.print(
        f"trainable parameters: {trainable:,} of {total:,} ({100 * trainable / total:.1f}%), "
        f"adapter: {resolved.adapter}, scope: {resolved.scope}",
        soft_wrap=True,  # a terminal wraps it; rich would break it between "scope:" and its value
    )
    where = f" ({run / 'client_store'})" if resolved.client_store == "disk" else ", in the checkpoints"
    out_console.print(f"client state: {resolved.client_store}{where}", soft_wrap=True)
    if finished:  # the columns of the PerAda paper's Table 1, measured
        counts = finished.cost.parameters
        out_console.print(
            f"per client: {counts.personalized:,} personalized, {counts.trained:,} trained, "
            f"{counts.communicated:,} communicated elements",
            soft_wrap=True,
        )
    if config.privacy.enabled:
        dp = config.privacy
        spent = (
            f"ε per client {privacy.epsilon.mean:.2f} ± {privacy.epsilon.std:.2f} on average, "
            f"{privacy.epsilon.max:.2f} at most ({privacy.accountant} accountant)"
            if privacy
            else "ε per client in report.json once the run has finished"
        )
        out_console.print(
            f"differential privacy: DP-SGD with noise multiplier {dp.dp_noise:g}, clipping norm {dp.dp_clip:g}, "
            f"δ = {dp.dp_delta:g}; {spent}",
            soft_wrap=True,
        )


def _print_preset(shown: PresetInfo) -> None:
    table = Table(title=f"preset {shown.name}: `peradapt train --preset {shown.name}` (flags win)")
    for column in ("setting", "preset", "peradapt default", "why", "what it is"):
        table.add_column(column, overflow="fold")
    for declared, value, note in shown.rows:
        flag = f"{declared.flag_name} ({declared.symbol})" if declared.symbol else declared.flag_name
        table.add_row(flag, str(value), declared.default_text(), note, declared.help_text())
    console = out_console if out_console.is_terminal else text_console(width=240)
    console.print(shown.description, soft_wrap=True, highlight=False, markup=False)
    console.print(table)
    console.print(f"from the authors' {shown.source}", soft_wrap=True, highlight=False, markup=False)


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
@takes_options(ReportOptions)
def report(
    runs: Annotated[list[Path], Arg(metavar="RUN", help="Finished run directories (`peradapt train --out`).")],
    options: ReportOptions,
) -> None:
    """Plots (accuracy per round, per client) and a Markdown/JSON table comparing finished runs."""
    for path in api.report(runs, options):
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
