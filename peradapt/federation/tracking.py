"""Experiment tracking (`train --log tensorboard,wandb,mlflow`): round metrics, settings and the final summary.

Each tracker gets every numeric entry of each round's record (what `metrics.jsonl` holds, at step = round: the
round's `cost/...` totals and `timing/...` seconds and memory among them), the settings as hyper-parameters
(`TrainConfig.to_flat()` and the session's resolved values under `resolved/`, nested values flattened with `/`) and,
at the end, `report.json`'s summary under `summary/` and its cost totals under `run_cost/` (not the rounds' `cost/`:
TensorBoard would draw them as one more step). Trackers only read what the run wrote: they never change its numbers.

One small class per backend behind `Tracker`; each backend's package is an optional extra (`peradapt[wandb]`, ...),
imported when its tracker starts. `RUN/trackers.json` keeps what continues each tracker's run (TensorBoard: the
run's own `RUN/tensorboard/`; W&B: the run id, resumed with `resume="allow"`; MLflow: the run id and tracking URI)
and the last round it logged: `--resume` continues the same runs, logs the rounds of the checkpoint that a tracker
has not seen (one added on resume, or a crash between a checkpoint and its logging), and never logs a round twice.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar, Protocol

from peradapt.config import TRACKERS, TrainConfig, tracker_names
from peradapt.errors import ConfigError, MachineError, PeradaptError
from peradapt.home import environment_setting
from peradapt.rundir.checkpoint import write_json_atomic
from peradapt.rundir.files import check, read_json
from peradapt.rundir.records import Report, RoundRecord

TRACKERS_FILE = "trackers.json"
TENSORBOARD_DIR = "tensorboard"
MLFLOW_DIR = "mlruns"  # the run's own MLflow file store, without MLFLOW_TRACKING_URI
PACKAGES = {name: name for name in TRACKERS}  # --log name -> its module (and the extra that installs it)


def check_installed(log: str | None) -> None:
    """Refuse a tracker whose package is not installed, with the extra that installs it."""
    for name in tracker_names(log):
        if importlib.util.find_spec(PACKAGES[name]) is None:
            raise ConfigError(
                f"--log {name} needs the {PACKAGES[name]} package: pip install 'peradapt[{name}]' "
                f"(or leave {name} out of --log; on --resume, --log none)"
            )


def hyperparameters(config: TrainConfig, resolved: dict) -> dict[str, bool | int | float | str]:
    """The settings as one flat mapping of scalars: nested values flattened with `/`, others (None, lists) as JSON."""
    flat = {**config.to_flat(), **_flattened(resolved, "resolved/")}
    return {k: v if isinstance(v, (bool, int, float, str)) else json.dumps(v) for k, v in flat.items()}


def _flattened(values: dict, prefix: str) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(_flattened(value, f"{prefix}{key}/"))
        else:
            flat[prefix + str(key)] = value
    return flat


def numeric(record: dict, prefix: str = "") -> dict[str, float]:
    """The numbers of a round record (or the report's summary and cost), but the round itself, which is the step;
    nested entries (a round's `cost` and `timing`) flattened with `/`. Lists (per client) are left to the files."""
    return {
        key: float(value)
        for key, value in _flattened(record, prefix).items()
        if key != prefix + "round" and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def final_numbers(report: Report) -> dict[str, float]:
    """What trackers get at the end: the report's summary and its costs in total."""
    return {**numeric(report.summary, "summary/"), **numeric(report.cost.to_json(), "run_cost/")}


class Tracker(Protocol):
    """One backend's run, continued across `--resume` through `state()`, which `trackers.json` keeps."""

    STATE: ClassVar[dict]  # the structure of `state()` (see peradapt.rundir.files), checked when it is read back

    def start(self, config: TrainConfig, resolved: dict, resume_state: dict | None) -> None:
        """Open the backend's run: a new one (`resume_state` None) or the one `resume_state` names."""

    def log_round(self, record: RoundRecord) -> None:
        """A round's record (a line of metrics.jsonl), at step = its round."""

    def finish(self, report: Report) -> None:
        """The final report's summary, then end the backend's run as finished."""

    def state(self) -> dict:
        """What `start` needs to continue this run after a `--resume` (JSON)."""

    def close(self) -> None:
        """End a run that did not finish (a failure, Ctrl-C); it may continue on `--resume`."""


class TensorBoardTracker:
    """Event files in `RUN/tensorboard/`: scalars per round, the settings as HParams (and as text), the summary."""

    STATE: ClassVar[dict] = {}

    def __init__(self, run_dir: Path) -> None:
        self.log_dir = run_dir / TENSORBOARD_DIR
        self.writer: Any = None

    def start(self, config: TrainConfig, resolved: dict, resume_state: dict | None) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
        from torch.utils.tensorboard.summary import hparams

        params = hyperparameters(config, resolved)
        self.writer = SummaryWriter(str(self.log_dir))  # a resumed run appends a new event file to the same run
        _, session_start, self.session_end = hparams(params, {})
        if resume_state is None:  # one HParams session per run (its metrics: the run's scalars), ended by `finish`
            self.writer.file_writer.add_summary(session_start)
        text = "\n".join(f"    {key}: {value}" for key, value in params.items())  # markdown code block
        self.writer.add_text("config", text, global_step=resume_state.get("round", 0) if resume_state else 0)
        self.writer.flush()

    def log_round(self, record: RoundRecord) -> None:
        for key, value in numeric(record.to_json()).items():
            self.writer.add_scalar(key, value, record.round)
        self.writer.flush()  # trackers.json says the round is logged right after

    def finish(self, report: Report) -> None:
        for key, value in final_numbers(report).items():
            self.writer.add_scalar(key, value, report.rounds)
        self.writer.file_writer.add_summary(self.session_end)
        self.close()

    def state(self) -> dict:
        return {}

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class WandbTracker:
    """A Weights & Biases run (project $WANDB_PROJECT, else peradapt; WANDB_MODE, WANDB_DIR as wandb reads them)."""

    STATE: ClassVar[dict] = {"id": str, "project": str}

    def __init__(self, run_dir: Path) -> None:
        self.name = run_dir.name
        self.run: Any = None

    def start(self, config: TrainConfig, resolved: dict, resume_state: dict | None) -> None:
        import wandb

        project = resume_state["project"] if resume_state else environment_setting("WANDB_PROJECT") or "peradapt"
        resume = {"id": resume_state["id"], "resume": "allow"} if resume_state else {}
        settings = wandb.Settings(console="off")  # peradapt's output stays as it is: no wrapped stdout/stderr
        self.run = wandb.init(project=project, name=self.name, settings=settings, **resume)
        self.run.config.update(hyperparameters(config, resolved), allow_val_change=True)  # resumable changes

    def log_round(self, record: RoundRecord) -> None:
        self.run.log(numeric(record.to_json()), step=record.round)

    def finish(self, report: Report) -> None:
        self.run.summary.update(final_numbers(report))
        self.run.finish()
        self.run = None

    def state(self) -> dict:
        return {"id": self.run.id, "project": self.run.project}

    def close(self) -> None:
        if self.run is not None:
            self.run.finish(exit_code=1)
            self.run = None


class MlflowTracker:
    """An MLflow run in experiment $MLFLOW_EXPERIMENT_NAME (else peradapt), at $MLFLOW_TRACKING_URI, else in the run's
    own file store `RUN/mlruns/` (`mlflow ui --backend-store-uri RUN/mlruns`)."""

    # no tracking_uri: the run's own store, wherever the run directory moves
    STATE: ClassVar[dict] = {"run_id": str, "tracking_uri?": str}

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.client: Any = None
        self.run_id: str | None = None
        self.tracking_uri: str | None = None

    def start(self, config: TrainConfig, resolved: dict, resume_state: dict | None) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        state = resume_state or {}
        self.tracking_uri = state.get("tracking_uri") if resume_state else environment_setting("MLFLOW_TRACKING_URI")
        if self.tracking_uri is None and environment_setting("MLFLOW_ALLOW_FILE_STORE") is None:
            # MLflow 3 keeps its file store in maintenance mode, behind this switch; it needs no database package.
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
        self.client = MlflowClient(tracking_uri=self.tracking_uri or (self.run_dir / MLFLOW_DIR).resolve().as_uri())
        if resume_state:
            self.run_id = resume_state["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            logged = self.client.get_run(self.run_id).data.params  # a parameter, once logged, cannot change
        else:
            name = environment_setting("MLFLOW_EXPERIMENT_NAME") or "peradapt"
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
            self.run_id = self.client.create_run(experiment_id, run_name=self.run_dir.name).info.run_id
            logged = {}
        params = [Param(k, str(v)) for k, v in hyperparameters(config, resolved).items() if k not in logged]
        for begin in range(0, len(params), 100):  # MLflow takes at most 100 parameters a batch
            self.client.log_batch(self.run_id, params=params[begin : begin + 100])

    def _log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def log_round(self, record: RoundRecord) -> None:
        self._log(numeric(record.to_json()), record.round)

    def finish(self, report: Report) -> None:
        self._log(final_numbers(report), report.rounds)
        self.client.set_terminated(self.run_id, "FINISHED")
        self.client = None

    def state(self) -> dict:
        return {"run_id": self.run_id, **({"tracking_uri": self.tracking_uri} if self.tracking_uri else {})}

    def close(self) -> None:
        if self.client is not None and self.run_id is not None:  # no run yet: nothing to ask the server again
            self.client.set_terminated(self.run_id, "FAILED")
        self.client = None


TRACKERS: dict[str, type] = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}


class Tracking:
    """The run's trackers, as the engine sees them: each round to every tracker that has not logged it, the report
    at the end, and `trackers.json` (atomic) after each."""

    def __init__(self, run_dir: Path, saved: dict[str, dict]) -> None:
        self.path = run_dir / TRACKERS_FILE
        self.saved = saved  # kept for trackers left out of this --log: a later --resume may take them up again
        self.trackers: dict[str, Tracker] = {}
        self.rounds: dict[str, int] = {}
        self.finished = False

    def log_round(self, record: RoundRecord) -> None:
        behind = [name for name in self.trackers if record.round > self.rounds[name]]
        for name in behind:
            with _backend(name, f"could not log round {record.round}"):
                self.trackers[name].log_round(record)
            self.rounds[name] = record.round
        if behind:
            self._save()

    def finish(self, report: Report) -> None:
        for name, tracker in self.trackers.items():
            with _backend(name, "could not log the final report"):
                tracker.finish(report)
        self.finished = True

    def close(self) -> None:
        """End the trackers' runs unless `finish` did; errors here must not hide the one that stopped the run."""
        if not self.finished:
            for tracker in self.trackers.values():
                with contextlib.suppress(Exception):
                    tracker.close()
            self.finished = True

    def _save(self) -> None:
        states = {name: {**tracker.state(), "round": self.rounds[name]} for name, tracker in self.trackers.items()}
        write_json_atomic(self.path, {**self.saved, **states})


def open_tracking(
    config: TrainConfig, run_dir: Path, *, resolved: dict, history: list[RoundRecord], resume: bool
) -> Tracking | None:
    """Start the trackers of `config.log` (None: none), continuing the runs `trackers.json` names on `resume`, and
    log the rounds of `history` they have not logged."""
    names = tracker_names(config.log)
    if not names:
        return None
    path = run_dir / TRACKERS_FILE
    saved = _read_saved(path) if resume and path.exists() else {}
    tracking = Tracking(run_dir, saved)
    try:
        for name in names:
            tracker = TRACKERS[name](run_dir)
            state = saved.get(name)
            tracking.trackers[name] = tracker  # ended by `tracking.close()` below if anything fails from here
            tracking.rounds[name] = state["round"] if state else 0
            with _backend(name, "could not start its run"):
                tracker.start(config, resolved, state)
        tracking._save()
        for record in history:
            tracking.log_round(record)
    except BaseException:
        tracking.close()
        raise
    return tracking


@contextlib.contextmanager
def _backend(name: str, failed: str) -> Iterator[None]:
    """A tracker backend's failure inside the block (no login, a server that does not answer, ...) as one line: its
    own message says which."""
    try:
        yield
    except PeradaptError:
        raise
    except Exception as exc:
        said = " ".join(str(exc).split()) or type(exc).__name__  # one line, as backends' messages often are not
        raise MachineError(
            f"--log {name} {failed}: {said}: check its server or login, or leave {name} out of --log "
            "(--resume may change --log)"
        ) from exc


def _read_saved(path: Path) -> dict[str, dict]:
    remedy = "delete it and resume: the trackers then start new runs and log every round again"
    saved = read_json(path, remedy)
    check(saved, {str: dict}, path, remedy)
    for name, cls in TRACKERS.items():
        if name in saved:
            check(saved[name], {**cls.STATE, "round": int}, path, remedy, name)
    return saved


def remove_tracking_files(run_dir: Path) -> None:
    """What trackers wrote into a new run directory that is taken back (it failed before its first round)."""
    import shutil

    (run_dir / TRACKERS_FILE).unlink(missing_ok=True)
    for directory in (TENSORBOARD_DIR, MLFLOW_DIR):
        shutil.rmtree(run_dir / directory, ignore_errors=True)
