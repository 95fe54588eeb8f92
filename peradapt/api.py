"""The Python API: every command as a function, with the command line's behaviour (`peradapt.cli` only parses flags
and prints what these return).

    import peradapt

    report = peradapt.train(data="fmnist", backbone="resnet18_w16", clients=4, rounds=2, out="runs/api")
    evaluation = peradapt.evaluate("runs/api")           # eval.json: local-/global-test of every adapter
    peradapt.export("runs/api", "adapters/")             # PEFT adapters + backbone
    new_client = peradapt.personalize_new_client("runs/api", "ID")  # held out with holdout_clients=K

Settings are the `train` flags with underscores (`clients_per_round=8`, `kd_steps=50`), as in a config file, or a
whole `TrainConfig`. A mistake raises a `peradapt.PeradaptError` whose message is the command line's `error:` line;
nothing is written then. The machine refusing a write (a read-only place, a full disk) raises a `MachineError`, its
`PeradaptError` too. Progress goes to stderr, as on the command line (`quiet=True`: nothing).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from peradapt.config import (
    MethodConfig,
    TrainConfig,
    origins_named,
    read_config_file,
    setting_origins,
    settings_for_method,
)
from peradapt.errors import ConfigError, refusals_reported
from peradapt.options import (
    CompareOptions,
    EvalOptions,
    ExportOptions,
    InfoOptions,
    PersonalizeOptions,
    PretrainOptions,
    ReportOptions,
    TrainOptions,
)
from peradapt.progress import text_console
from peradapt.rundir.records import Report

if TYPE_CHECKING:  # what `info` returns, whose modules load when it is called
    from peradapt.commands.finished_run import RunInfo
    from peradapt.presets import PresetInfo

PathLike = str | Path


@refusals_reported
def training_config(options: TrainOptions | None = None, /, **values: Any) -> TrainConfig:
    """The config `peradapt train` runs: `preset` (a paper preset), then `config` (a YAML or JSON file), then the
    settings win; `values` are the settings and those of `train`'s options (`TrainOptions`), or the settings alone
    where `options` is given. With `resume`, the saved config of the run in `out`, where only the settings no result
    depends on may change (`config.OUTCOME_FREE`: rounds, eval_every, device, out, ...)."""
    from peradapt.federation.lifecycle import default_run_dir, resume_config
    from peradapt.presets import preset_settings

    options, settings = TrainOptions.split(options, values)
    if options.resume:
        if "out" not in settings:
            raise ConfigError("--resume needs --out: the run directory to continue")
        return resume_config(Path(settings["out"]), _as_text(settings))
    preset, config_file = options.preset, options.config
    from_preset = preset_settings(preset) if preset else {}
    from_file = read_config_file(config_file) if config_file else {}
    method = {**from_preset, **from_file, **settings}.get("method", MethodConfig.method)
    # A preset sets its method's own settings, which another --method (the paper's baselines on its setup) goes without.
    flat = {**settings_for_method(from_preset, method), **from_file, **_as_text(settings)}
    origins = setting_origins([(from_preset, f"--preset {preset}"), (from_file, f"--config {config_file}")], settings)
    with origins_named(origins):
        config = TrainConfig.from_flat(flat)
        if _given("validation_fraction", flat) and config.data.eval_split != "validation":
            raise ConfigError(
                "--validation-fraction sizes the validation split of --eval-split validation, and this run scores on "
                "its test split: give --eval-split validation, or drop --validation-fraction"
            )
    if config.out is None:  # the run directory named, as `train` prints it: runs/DATA-METHOD-seedSEED
        config = dataclasses.replace(config, out=str(default_run_dir(config)))
    config.origins = origins
    return config


@refusals_reported
def train(
    config: TrainConfig | TrainOptions | None = None,
    /,
    *,
    quiet: bool = False,
    console: Console | None = None,
    **values: Any,
) -> Report | dict:
    """Train a federation (or continue one: `resume=True, out=RUN`) into its run directory; returns its report
    (`peradapt.rundir.records.Report`, as written to report.json).

    `config`: a whole `TrainConfig` (`values` may then say `resume` or `dry_run`), or the `train` command's options
    (`TrainOptions`: resume, preset, config, dry_run) with `values` the settings; else `values` are both (see
    `training_config`). The run directory is
    `config.out` (the default, `runs/DATA-METHOD-seedSEED`, where none is given). `dry_run`: instead, what the
    run would do and about how long it would take on this machine, with nothing written
    (`peradapt.commands.estimate.estimate_sweep`)."""
    from peradapt.commands.training import train as run_training

    options, settings = TrainOptions.split(None if isinstance(config, TrainConfig) else config, values)
    if not isinstance(config, TrainConfig):
        config = training_config(options, **settings)
    elif settings or options.preset or options.config:
        raise ConfigError("train takes a TrainConfig or settings, not both: put the settings into the config")
    with origins_named(config.origins):
        if options.dry_run:
            from peradapt.commands.estimate import estimate_sweep

            return estimate_sweep(config.to_flat(), [config.method.method], [config.seed])
        return run_training(config, resume=options.resume, console=_console(console, quiet))


@refusals_reported
def evaluate(
    run: PathLike | EvalOptions, /, *, quiet: bool = False, console: Console | None = None, **values: Any
) -> dict:
    """local-test and global-test of every exported adapter of a finished run (written to `eval.json`), or with
    `ood` their accuracy on an out-of-distribution set (`ood-NAME.json`; `ood_limit`: images per part).
    `weights`: the backbone weights file the run was trained on, where this machine has no copy of them (checked
    against the run's fingerprint); the same in `export` and `personalize_new_client`. `run` may be the whole
    `EvalOptions` instead."""
    from peradapt.commands.finished_run import evaluate_ood_run, evaluate_run

    options = EvalOptions.of(run, values, first="run")
    if options.ood is not None:
        return evaluate_ood_run(
            options.run, options.ood, limit=options.ood_limit, weights=options.weights, console=_console(console, quiet)
        )
    return evaluate_run(options.run, weights=options.weights)


@refusals_reported
def export(run: PathLike | ExportOptions, out: PathLike | None = None, /, **values: Any) -> Path:
    """Every client's adapter and the global adapter (PEFT layout) with their frozen backbone, into `out`, each with
    a model card declaring `license` (default: the backbone weights' own, where known). `merge`: instead every
    client's model and the global one with the adapters folded into the backbone, plain timm or transformers
    models that load without peradapt. `run` may be the whole `ExportOptions` instead (without `push_to_hub`: that
    is `push_to_hub`)."""
    from peradapt.commands.finished_run import export_run

    options = ExportOptions.of(run, values if out is None else {"out": out, **values}, first="run")
    if options.push_to_hub is not None:
        raise ConfigError("export writes the export only: push_to_hub writes it and uploads it")
    return export_run(options.run, options.out, merge=options.merge, license=options.license, weights=options.weights)


@refusals_reported
def push_to_hub(
    run: PathLike | ExportOptions, out: PathLike | None = None, repo_id: str | None = None, /, **values: Any
) -> str:
    """`export` into `out` (`merge`, `license`, `weights`: as there), then upload it to the Hugging Face model
    repository `repo_id` (OWNER/NAME): the backbone, the global model, the models of `clients` (ids, or "all", the
    default) and their model cards; returns its URL. `run` may be the whole `ExportOptions` instead."""
    from peradapt.commands.share import push_export

    given = {"out": out, "push_to_hub": repo_id}
    options = ExportOptions.of(run, {**{k: v for k, v in given.items() if v is not None}, **values}, first="run")
    if options.push_to_hub is None:
        raise ConfigError("push_to_hub needs the repository: OWNER/NAME")
    return push_export(options)


@refusals_reported
def personalize_new_client(run: PathLike | PersonalizeOptions, new_client: str | None = None, /, **values: Any) -> dict:
    """Personalize a client that never took part in training (a held-out client's id, or a directory of its
    images) from the run's global model with the run's method (`weights`: as `evaluate` takes them); returns its
    `result.json`. `run` may be the whole `PersonalizeOptions` instead."""
    from peradapt.commands.newclients import personalize_new_client as personalize

    given = values if new_client is None else {"new_client": str(new_client), **values}
    options = PersonalizeOptions.of(run, given, first="run")
    return personalize(options.run, options.new_client, weights=options.weights)


@refusals_reported
def pretrain(
    options: PretrainOptions | None = None, /, *, quiet: bool = False, console: Console | None = None, **values: Any
) -> tuple[Path, float]:
    """Make a backbone offline on a dataset's labeled pretraining split (`PretrainOptions`, or its fields as
    keyword arguments: the `pretrain` flags); returns where the weights were written and their held-out accuracy."""
    from peradapt.commands.pretraining import pretrain as run_pretrain

    return run_pretrain(PretrainOptions.of(options, values), _console(console, quiet))


@refusals_reported
def compare(
    methods: Sequence[str] | CompareOptions,
    /,
    *,
    quiet: bool = False,
    console: Console | None = None,
    **values: Any,
) -> dict:
    """Tune every method with `tune` trials on validation splits (0: their settings as given), train it on seeds
    0..seeds-1 (shared partitions), and return what OUT/compare.json holds (rows, ranks, trials, audit), also
    written as compare.md and PNGs; finished runs and trials in `out` (or `storage`) are reused. `target_accuracy`:
    the local-test % whose first round compare.json's `to_target` gives (default: 90% of the best final mean). See
    `peradapt.commands.comparison`. `dry_run`: instead, what the comparison would run and about how long it would
    take on this machine, with nothing written (`peradapt.commands.estimate.estimate_sweep`).

    `methods`: the names, with compare's options (`CompareOptions`: seeds, tune, ...) and the `train` settings
    for every run in `values`; or the whole `CompareOptions`, with `values` the settings."""
    from peradapt.commands.comparison import compare as run_compare

    if isinstance(methods, CompareOptions):
        options, settings = CompareOptions.split(methods, values)
    else:
        options, settings = CompareOptions.split(None, {"methods": list(methods), **values})
    config_file = options.config
    flat = read_config_file(config_file) if config_file else {}
    origins = setting_origins([(flat, f"--config {config_file}")], settings)
    flat.update(_as_text(settings))
    with origins_named(origins):
        if _given("validation_fraction", flat) and not options.tune:
            raise ConfigError(
                "--validation-fraction sizes the validation split the trials of --tune N score on, and there are "
                "none (the final runs score on the test split): give --tune N, or drop --validation-fraction"
            )
        return run_compare(options, flat, _console(console, quiet))


@refusals_reported
def info(run: PathLike | InfoOptions | None = None, /, **values: Any) -> RunInfo | PresetInfo:
    """What `peradapt info` shows: a run's config, resolved values, partition, report and label skew (`RunInfo`),
    or with `preset=NAME` (and no run) what a paper preset sets (`PresetInfo`). `run` may be the whole
    `InfoOptions` instead."""
    from peradapt.commands.finished_run import run_info
    from peradapt.presets import preset_info

    options = InfoOptions.of(run, values, first="run")
    return run_info(options.run) if options.run is not None else preset_info(str(options.preset))


@refusals_reported
def report(runs: Sequence[PathLike], out: PathLike | ReportOptions | None = None, /, **values: Any) -> list[Path]:
    """Plots and a Markdown/JSON table of finished runs (`out`: where; or the whole `ReportOptions`); returns the
    files written."""
    from peradapt.commands.reports import write_report

    options = ReportOptions.of(out, values, first="out")
    return write_report([Path(run) for run in runs], options.out)


def _given(key: str, values: dict[str, Any]) -> bool:
    """Whether flat settings `values` (flags, a config file, which may write `validation-fraction`) set `key`."""
    return any(name.replace("-", "_") == key for name in values)


def _as_text(settings: dict[str, Any]) -> dict[str, Any]:
    """Paths as the strings configs hold."""
    return {key: str(value) if isinstance(value, Path) else value for key, value in settings.items()}


def _console(console: Console | None, quiet: bool) -> Console:
    return console or text_console(stderr=True, quiet=quiet)
