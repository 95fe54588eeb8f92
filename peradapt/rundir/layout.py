"""A run directory's layout (`RunPaths`) and its records read back checked: config.json, partition.json,
report.json. Damage is reported with the file's path and a remedy that works (`peradapt.rundir.files`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from peradapt.config import TrainConfig
from peradapt.errors import ConfigError, PluginError, RunError
from peradapt.progress import counted
from peradapt.registry import METHODS
from peradapt.rundir.files import PARTITION, check, damaged, read_json
from peradapt.rundir.records import Report, Resolved


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


def read_run_config(run_dir: Path) -> tuple[TrainConfig, Resolved]:
    """The saved config of the run in `run_dir` and what its settings resolved to (config.json), checked."""
    paths = RunPaths(run_dir)
    if not paths.config.is_file():
        # A new run writes partition.json (through partition.json.tmp) before config.json, which marks a run.
        if paths.partition.exists() or paths.partition.with_name(paths.partition.name + ".tmp").exists():
            raise RunError(
                f"{run_dir} holds a run stopped while it wrote its start (partition.json, no config.json): no round "
                f"of it ran, so start it again, with the `peradapt train` command that began it and no --resume, or "
                f"delete {run_dir}"
            )
        raise RunError(f"{run_dir} is not a peradapt run directory (no config.json): pass the --out of a train run")
    remedy = (
        "the run's settings are kept nowhere else: put back a copy of the file, or start a new run with the "
        "settings it was trained with and another --out"
    )
    saved = read_json(paths.config, remedy)
    check(saved, {"config": dict, "resolved": dict}, paths.config, remedy)
    resolved = Resolved.from_json(saved["resolved"], paths.config, remedy, "resolved")
    try:
        _check_method_found(saved["config"])
        config = TrainConfig.from_dict(saved["config"])
    except PluginError as exc:  # the file is intact: the plugin it names is what is missing here
        raise PluginError(f"{run_dir} was trained with a method that cannot be loaded here: {exc}") from None
    except ConfigError as exc:
        raise damaged(paths.config, str(exc), remedy) from None
    return config, resolved


def _check_method_found(saved: dict) -> None:
    """Refuse a saved config whose method is an installed package's that is not installed here (a `module:Class`
    that does not import is refused by looking it up)."""
    section = saved.get("method")
    method = section.get("method") if isinstance(section, dict) else None
    if isinstance(method, str) and ":" not in method and method not in METHODS:
        raise PluginError(
            f"--method {method} is no built-in method, and no installed package declares it: pip install the "
            "package that does"
        )


def read_partition(run_dir: Path) -> dict:
    """The clients' data split of the run in `run_dir` (partition.json), checked against its config."""
    paths = RunPaths(run_dir)
    config, _ = read_run_config(run_dir)
    path = paths.partition
    remedy = (
        f"peradapt does not rebuild a run's data split: start a new run with the settings in {paths.config} and "
        "another --out (the same --seed and --partition give the same split)"
    )
    if not path.is_file():
        raise RunError(f"{path} is missing: {remedy}")
    partition = read_json(path, remedy)
    check(partition, PARTITION, path, remedy)
    clients = partition["clients"]
    if len(clients) != config.federation.clients:
        raise damaged(path, f"it has {counted(len(clients), 'client')}, the run {config.federation.clients}", remedy)
    for index, client in enumerate(clients):
        if client["id"] != index:
            raise damaged(path, f"clients[{index}].id is {client['id']}", remedy)
        if sum(client["train_histogram"]) != len(client["train"]):
            raise damaged(path, f"clients[{index}].train_histogram does not count its train list", remedy)
        if len(client["train_histogram"]) != len(clients[0]["train_histogram"]):
            raise damaged(path, "the clients' train histograms differ in length", remedy)
    return partition


def read_report(run_dir: Path) -> Report | None:
    """The final evaluation of the run in `run_dir` (report.json), checked; None: the run has not finished."""
    path = RunPaths(run_dir).report
    if not path.is_file():
        return None
    remedy = f"rewrite it with `peradapt train --out {run_dir} --resume`, which redoes the final evaluation and export"
    report = Report.from_json(read_json(path, remedy), path, remedy)
    if report.privacy is not None and len(report.privacy.epsilon.per_client) != len(report.clients):
        raise damaged(path, "privacy.epsilon.per_client and clients differ in length", remedy)
    return report
