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
from typing import Any

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
from peradapt.progress import text_console

PathLike = str | Path


@refusals_reported
def training_config(
    *,
    resume: bool = False,
    preset: str | None = None,
    config_file: PathLike | None = None,
    **settings: Any,
) -> TrainConfig:
    """The config `peradapt train` runs: a paper `preset`, then `config_file` (YAML or JSON), then `settings` win.
    With `resume`, the saved config of the run in `settings["out"]`, where only the settings that keep its results
    valid may change (rounds, eval_every, device, out, offline, log, concurrent_clients,
    gpu_memory_fraction)."""
    from peradapt.federation.engine import resume_config
    from peradapt.presets import preset_settings

    if resume:
        if "out" not in settings:
            raise ConfigError("--resume needs --out: the run directory to continue")
        if preset or config_file:
            raise ConfigError("--resume continues with the run's saved settings: drop --preset and --config")
        return resume_config(Path(settings["out"]), settings)
    from_preset = preset_settings(preset) if preset else {}
    from_file = read_config_file(Path(config_file)) if config_file else {}
    method = {**from_preset, **from_file, **settings}.get("method", MethodConfig.method)
    # A preset sets its method's own settings, which another --method (the paper's baselines on its setup) goes without.
    values = {**settings_for_method(from_preset, method), **from_file, **settings}
    origins = setting_origins([(from_preset, f"--preset {preset}"), (from_file, f"--config {config_file}")], settings)
    with origins_named(origins):
        config = TrainConfig.from_flat(values)
        if _given("validation_fraction", values) and config.data.eval_split != "validation":
            raise ConfigError(
                "--validation-fraction sizes the validation split of --eval-split validation, and this run scores on "
                "its test split: give --eval-split validation, or drop --validation-fraction"
            )
    config.origins = origins
    return config


@refusals_reported
def train(
    config: TrainConfig | None = None,
    /,
    *,
    resume: bool = False,
    preset: str | None = None,
    config_file: PathLike | None = None,
    dry_run: bool = False,
    quiet: bool = False,
    console: Console | None = None,
    **settings: Any,
) -> dict:
    """Train a federation (or continue one: `resume=True, out=RUN`) into its run directory; returns `report.json`.

    `config`: a whole `TrainConfig`; else one from `preset`, `config_file` and `settings` (see `training_config`).
    The run directory is `config.out` (set to the default, `runs/DATA-METHOD-seedSEED`, when none is given).
    `dry_run`: instead, what the run would do and about how long it would take on this machine, with nothing
    written (`peradapt.commands.estimate.estimate_sweep`)."""
    from peradapt.training import train as run_training

    if dry_run and resume:
        raise ConfigError("--dry-run estimates a new run: drop --resume")
    if config is None:
        config = training_config(resume=resume, preset=preset, config_file=config_file, **_as_text(settings))
    elif settings or preset or config_file:
        raise ConfigError("train takes a TrainConfig or settings, not both: put the settings into the config")
    with origins_named(config.origins):
        if dry_run:
            from peradapt.commands.estimate import estimate_sweep

            return estimate_sweep(config.to_flat(), [config.method.method], [config.seed])
        return run_training(config, resume=resume, console=_console(console, quiet))


@refusals_reported
def evaluate(
    run: PathLike,
    *,
    ood: str | None = None,
    ood_limit: int | None = None,
    weights: PathLike | None = None,
    quiet: bool = False,
    console: Console | None = None,
) -> dict:
    """local-test and global-test of every exported adapter of a finished run (written to `eval.json`), or with
    `ood` their accuracy on an out-of-distribution set (`ood-NAME.json`; `ood_limit`: images per part).
    `weights`: the backbone weights file the run was trained on, where this machine has no copy of them (checked
    against the run's fingerprint); the same in `export` and `personalize_new_client`."""
    from peradapt.commands.finished_run import evaluate_ood_run, evaluate_run

    weights_file = _path(weights)
    if ood is not None:
        return evaluate_ood_run(Path(run), ood, limit=ood_limit, weights=weights_file, console=_console(console, quiet))
    if ood_limit is not None:
        raise ConfigError("--ood-limit needs --ood NAME")
    return evaluate_run(Path(run), weights=weights_file)


@refusals_reported
def export(
    run: PathLike,
    out: PathLike,
    *,
    merge: bool = False,
    license: str | None = None,
    weights: PathLike | None = None,
) -> Path:
    """Every client's adapter and the global adapter (PEFT layout) with their frozen backbone, into `out`, each with
    a model card declaring `license` (default: the backbone weights' own, where known). `merge`: instead every
    client's model and the global one with the adapters folded into the backbone, plain timm or transformers
    models that load without peradapt."""
    from peradapt.commands.finished_run import export_run

    return export_run(Path(run), Path(out), merge=merge, license=license, weights=_path(weights))


@refusals_reported
def push_to_hub(
    run: PathLike,
    out: PathLike,
    repo_id: str,
    *,
    clients: str | Sequence[int] = "all",
    private: bool = False,
    merge: bool = False,
    license: str | None = None,
    weights: PathLike | None = None,
) -> str:
    """`export` into `out` (`merge`, `license`, `weights`: as there), then upload it to the Hugging Face model
    repository `repo_id` (OWNER/NAME): the backbone, the global model, the models of `clients` (ids, or "all") and
    their model cards; returns its URL."""
    from peradapt.commands.share import push_export

    chosen = clients if isinstance(clients, str) else ",".join(str(client) for client in clients)
    return push_export(
        Path(run), Path(out), repo_id, chosen, private=private, merge=merge, license=license, weights=_path(weights)
    )


@refusals_reported
def personalize_new_client(run: PathLike, new_client: str, *, weights: PathLike | None = None) -> dict:
    """Personalize a client that never took part in training (a held-out client's id, or a directory of its
    images) from the run's global model with the run's method (`weights`: as `evaluate` takes them); returns its
    `result.json`."""
    from peradapt.commands.newclients import personalize_new_client as personalize

    return personalize(Path(run), str(new_client), weights=_path(weights))


@refusals_reported
def pretrain(*, quiet: bool = False, console: Console | None = None, **settings: Any) -> tuple[Path, float]:
    """Make a backbone offline on a dataset's labeled pretraining split (the `pretrain` flags as settings); returns
    where the weights were written and their held-out accuracy."""
    from peradapt.pretraining import PretrainConfig
    from peradapt.pretraining import pretrain as run_pretrain

    known = {field.name for field in dataclasses.fields(PretrainConfig)}
    unknown = sorted(settings.keys() - known)
    if unknown:
        raise ConfigError(f"unknown pretrain setting '{unknown[0]}': use {', '.join(sorted(known))}")
    return run_pretrain(PretrainConfig(**_as_text(settings)), _console(console, quiet))


@refusals_reported
def compare(
    methods: Sequence[str],
    *,
    seeds: int = 3,
    out: PathLike = "runs/compare",
    config_file: PathLike | None = None,
    tune: int = 0,
    storage: str | None = None,
    tune_only: bool = False,
    reference: str | None = None,
    anchors: bool = True,
    ood: str | None = None,
    ood_limit: int | None = None,
    test: str = "t",
    target_accuracy: float | None = None,
    dry_run: bool = False,
    quiet: bool = False,
    console: Console | None = None,
    **settings: Any,
) -> dict:
    """Tune every method with `tune` trials on validation splits (0: their settings as given), train it on seeds
    0..seeds-1 (shared partitions), and return what OUT/compare.json holds (rows, ranks, trials, audit), also
    written as compare.md and PNGs; finished runs and trials in `out` (or `storage`) are reused. `target_accuracy`:
    the local-test % whose first round compare.json's `to_target` gives (default: 90% of the best final mean). See
    `peradapt.commands.comparison`. `dry_run`: instead, what the comparison would run and about how long it would
    take on this machine, with nothing written (`peradapt.commands.estimate.estimate_sweep`)."""
    from peradapt.commands.comparison import compare as run_compare
    from peradapt.tuning import TUNING_SEED

    for flag, value, least in (("--seeds", seeds, 1), ("--tune", tune, 0), ("--ood-limit", ood_limit, 1)):
        if value is not None and value < least:
            raise ConfigError(f"{flag} must be at least {least}, got {value}")
    if seeds > TUNING_SEED:  # before `range(seeds)`, which a count past C's integers makes an OverflowError
        raise ConfigError(
            f"--seeds must be at most {TUNING_SEED}, got {seeds}: seed {TUNING_SEED} is the trials' partition"
        )
    if tune_only and not tune:
        raise ConfigError("--tune-only runs trials: give their number with --tune N")
    if storage is not None and not tune:
        raise ConfigError("--storage keeps the trials of --tune N, and there are none: give --tune N or drop --storage")
    if ood_limit is not None and ood is None:
        raise ConfigError("--ood-limit needs --ood NAME")
    if target_accuracy is not None and not 0 < target_accuracy <= 100:  # `not`: NaN is refused too
        raise ConfigError(f"--target-accuracy is a percentage: above 0 and at most 100, got {target_accuracy}")
    values: dict[str, Any] = read_config_file(Path(config_file)) if config_file else {}
    origins = setting_origins([(values, f"--config {config_file}")], settings)
    values.update(_as_text(settings))
    with origins_named(origins):
        if _given("validation_fraction", values) and not tune:
            raise ConfigError(
                "--validation-fraction sizes the validation split the trials of --tune N score on, and there are "
                "none (the final runs score on the test split): give --tune N, or drop --validation-fraction"
            )
        return run_compare(
            values,
            list(methods),
            list(range(seeds)),
            Path(out),
            _console(console, quiet),
            tune_trials=tune,
            storage=storage,
            tune_only=tune_only,
            reference=reference,
            anchors=anchors,
            ood=ood,
            ood_limit=ood_limit,
            test=test,  # type: ignore[arg-type]  # checked there, in one line
            target_accuracy=target_accuracy,
            dry_run=dry_run,
        )


@refusals_reported
def report(runs: Sequence[PathLike], out: PathLike | None = None) -> list[Path]:
    """Plots and a Markdown/JSON table of finished runs; returns the files written."""
    from peradapt.commands.reports import build_report

    return build_report([Path(run) for run in runs], None if out is None else Path(out))


def _given(key: str, values: dict[str, Any]) -> bool:
    """Whether flat settings `values` (flags, a config file, which may write `validation-fraction`) set `key`."""
    return any(name.replace("-", "_") == key for name in values)


def _as_text(settings: dict[str, Any]) -> dict[str, Any]:
    """Paths as the strings configs hold."""
    return {key: str(value) if isinstance(value, Path) else value for key, value in settings.items()}


def _path(path: PathLike | None) -> Path | None:
    return None if path is None else Path(path)


def _console(console: Console | None, quiet: bool) -> Console:
    return console or text_console(stderr=True, quiet=quiet)
