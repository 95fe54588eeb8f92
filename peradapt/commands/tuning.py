"""`compare --tune N`: each method gets N trials over its own declared search space, with Optuna.

What is searched is what the method's settings declare (`setting(..., search=...)`, gathered by
`config.search_space`): --lr, the shared settings its update rules read, the distillation ones if it distills, and
its own; a value given in the settings is fixed, not searched. Every trial is an ordinary run directory,
`OUT/tuning/<study>/trial-<number>/`, trained with `--eval-split validation`: its score, report.json's
`personalized_local_test`, is the clients' personalized models on validation splits held out of their training
images, and no test image is read. The sampler is Optuna's TPE, seeded where the study is this comparison's alone (the
default storage) from --seed and the trials the study already holds, so that a sweep run again from scratch makes
the same trials and a resumed one does not replay the first draws; workers sharing a --storage each draw their own.
Its choices, every trial and the best are returned
and written to `OUT/tuning/<study>/trials.json`.

**Stages and pruning.** The engine reports nothing between rounds, so a trial plays its rounds in stages
(`STAGES`: a quarter, half, then all of --rounds): each stage finishes the run at its round (a final evaluation
and export), the score is reported to Optuna, and the pruner (median by default) may stop a hopeless trial there;
else the run resumes to the next stage (`train(..., resume=True)`, --rounds being one of the settings a resume may
change). A resumed run ends with the numbers of an uninterrupted one, so stages change no score. A trial whose
training diverges is pruned too: its score says nothing about the method.

**The study** is named after the method and a hash of everything fixed (the settings, the search space), so a
comparison with other settings never reuses stale trials, and lives in an Optuna storage: by default SQLite in
`OUT/tuning.db`, or any database URL (PostgreSQL, MySQL: several machines) or `journal:FILE` (a journal file, one
machine). A sweep killed or stopped resumes from it: finished trials are kept, and the trial of a worker that died
is failed and retried with the same values, resuming its run directory from the stage it had reached. A database
notices a dead worker by Optuna's heartbeats (silent for `GRACE_PERIODS` heartbeats); a journal file by the
worker's process id being gone from its machine.

**Workers.** Any number of `tune` calls on one storage share the study: each takes the next trial until the study
holds N, and returns once no trial is running anywhere, so all of them return the same best. Optuna's own
`MaxTrialsCallback` stops a worker after N finished trials, but workers asking at the same moment overshoot it;
here a trial is one of the N when fewer than N trials that have not failed are numbered before it (Optuna numbers
trials atomically), and a surplus trial is failed at once, marked `surplus` and left out of the results.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import re
import socket
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from peradapt.commands.training import train
from peradapt.config import OUTCOME_FREE, TrainConfig, method_path_label, search_space, settings_for_method
from peradapt.errors import ConfigError, Interrupted, TrainingDiverged
from peradapt.federation.lifecycle import resume_config
from peradapt.progress import counted, text_console
from peradapt.rundir.checkpoint import write_json_atomic
from peradapt.rundir.layout import RunPaths, read_report
from peradapt.seeds import TUNING, derive_seed
from peradapt.settings import Search, Setting

if TYPE_CHECKING:
    import optuna

TUNING_DIR = "tuning"  # OUT/tuning/<study>/: the trials' run directories and trials.json
STAGES = (0.25, 0.5, 1.0)  # the shares of --rounds after which a trial's score is reported and it may be pruned
OBJECTIVE = "personalized_local_test"  # report.json summary: under --eval-split validation, the validation score
HEARTBEAT_S = 60  # a database worker's heartbeat, and how often a waiting worker looks at the study
GRACE_PERIODS = 3  # heartbeats missed before a database worker counts as dead and its trial is retried
MAX_RETRIES = 3  # a trial whose workers died this often is left failed: another trial, other values, takes its place
RUN_DIR = "run_dir"  # a trial's user attribute: its run directory, relative to the study's (a retry keeps it)
WORKER = "worker"  # a trial's user attribute: "host:pid:trial number" of the worker running it
# Trials of equal best score: the one numbered first (asked first) is the best; the others are listed as tied_with
TIE_RULE = "of trials with the same best score, the lowest-numbered (the first asked)"
SURPLUS = "surplus"  # a trial's user attribute: asked beyond the N trials, failed at once
DIVERGED = "diverged"  # a trial's user attribute: the message of a training that diverged (the trial is pruned)
SCHEMES = "sqlite:///FILE, postgresql://USER:PASSWORD@HOST/DB, mysql://USER:PASSWORD@HOST/DB or journal:FILE"


class _Surplus(Exception):
    """A trial asked when the study already holds its N trials (another worker asked at the same moment)."""


def tune(
    method: str,
    settings: dict[str, Any],
    *,
    trials: int,
    out: Path,
    storage: str | None = None,
    console: Console | None = None,
    pruner: optuna.pruners.BasePruner | None = None,
    sampler: optuna.samplers.BaseSampler | None = None,
    heartbeat_s: int = HEARTBEAT_S,
) -> dict[str, Any]:
    """Tune `method` with `trials` trials over its search space, the flat `settings` fixed (given keys are not
    searched), in the study of `storage` (default: SQLite in `out`/tuning.db), shared with any other worker on it;
    return once the study holds its trials and none is running. The result (also `out`/tuning/<study>/trials.json):
    `best_params` (the searched settings' best values, {} if nothing was tuned or no trial completed),
    `best_value`, `best_trial`, `searched` (each key's range), and every trial (`number`, `state`, `params`,
    `value`, `intermediate_values` by rounds played, `run_dir`, and `retry_of` or `diverged` where so).

    `pruner` and `sampler` default to Optuna's median pruner and TPE sampler; `heartbeat_s` is a database worker's
    heartbeat (a worker silent for `GRACE_PERIODS` of them is dead)."""
    optuna = _optuna()
    console = console or text_console(stderr=True)
    if trials < 1:
        raise ConfigError(f"--tune must be at least 1 trial, got {trials}")
    fixed = settings_for_method({key.replace("-", "_"): value for key, value in settings.items()}, method)
    space = searched(method, fixed)
    base = TrainConfig.from_flat({**fixed, "method": method, "eval_split": "validation"})  # refused before any trial
    if not space:
        given = ", ".join(declared.flag_name for declared in search_space(method).values())
        console.print(f"{method}: nothing left to tune ({given} given), so it runs with the settings given")
        return {"method": method, "study": None, "searched": {}, **_best(None), "trials": []}
    study_name = f"{method_path_label(method)}-{_digest(base, space)}"
    directory = out / TUNING_DIR / study_name
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # a line per trial is printed here; Optuna's would repeat it
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # heartbeats, retries
            opened = _storage(storage, out, heartbeat_s)
            study = optuna.create_study(
                study_name=study_name,
                storage=opened,
                direction="maximize",
                sampler=sampler,
                pruner=pruner or optuna.pruners.MedianPruner(),
                load_if_exists=True,
            )
            if sampler is None:
                study.sampler = _sampler(base.seed, len(study.trials), study_name, shared=storage is not None)
            objective = _Objective(study, base, space, fixed, trials, directory, console)
            journal = isinstance(opened, optuna.storages.JournalStorage)
            _work(study, objective, trials, journal=journal, poll_s=heartbeat_s, console=console)
            result = _result(study, method, space, directory)
    finally:
        optuna.logging.set_verbosity(verbosity)
    directory.mkdir(parents=True, exist_ok=True)  # a worker elsewhere may have run every trial
    write_json_atomic(directory / "trials.json", result)
    best = f"best {result['best_value']:.4g} with {_values(result['best_params'])}" if result["best_params"] else ""
    console.print(f"{method}: {counted(trials, 'trial')} in study {study_name}; {best or 'no trial completed'}")
    return result


def searched(method: str, fixed: dict[str, Any]) -> dict[str, Setting]:
    """The settings `tune` searches for `method`: its search space (`config.search_space`) less the keys `fixed`
    gives. Empty: the method runs no trial."""
    return {key: declared for key, declared in search_space(method).items() if key not in fixed}


def trial_stages(rounds: int) -> list[int]:
    """The rounds after which a trial of `rounds` rounds reports its score (`STAGES`); each stage finishes the run
    at that round, final evaluation included."""
    return sorted({min(rounds, max(1, math.ceil(share * rounds))) for share in STAGES})


def _optuna() -> Any:
    """The optuna module: an extra, named in one line where it is missing."""
    try:
        import optuna
    except ImportError:
        raise ConfigError("--tune needs the optuna package: pip install 'peradapt[tune]'") from None
    return optuna


def _digest(base: TrainConfig, space: dict) -> str:
    """A hash of what a study's trials have in common: the settings that score (not the searched ones) and the
    search space."""
    scored = {key: value for key, value in base.to_flat().items() if key not in OUTCOME_FREE and key not in space}
    searched = {key: dataclasses.asdict(declared.search) for key, declared in space.items()}
    text = json.dumps({"settings": scored, "space": searched}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _storage(url: str | None, out: Path, heartbeat_s: int) -> optuna.storages.BaseStorage:
    """The Optuna storage of `url` (default: SQLite in `out`/tuning.db), opened now: a URL that cannot be opened is
    one ConfigError naming it, with nothing written."""
    optuna = _optuna()
    if url is None:
        out.mkdir(parents=True, exist_ok=True)
        url = f"sqlite:///{out / 'tuning.db'}"
    shown = _without_password(url)
    if url.startswith("journal:"):
        path = Path(url.removeprefix("journal:"))
        if not path.parent.is_dir():
            raise ConfigError(f"--storage {shown}: {path.parent} is no directory; create it or name a file in one")
        try:
            return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(path)))
        except OSError as error:
            raise ConfigError(f"--storage {shown}: cannot open {path}: {error.strerror}") from None
    if not re.match(r"(sqlite|postgresql|mysql)(\+\w+)?://", url):
        raise ConfigError(f"--storage {shown}: use {SCHEMES}")
    sqlite = url.startswith("sqlite")
    if sqlite:
        found = re.match(r"sqlite(\+\w+)?:///(.+)", url)
        if found is None:  # `sqlite://t.db` names a host, which SQLite has not
            raise ConfigError(
                f"--storage {shown}: a SQLite URL is sqlite:///FILE, three slashes before a relative path and four "
                "before an absolute one (sqlite:////tmp/tuning.db)"
            )
        path = Path(found.group(2))
        if not path.parent.is_dir():
            raise ConfigError(f"--storage {shown}: {path.parent} is no directory; create it or name a file in one")
    import sqlalchemy.exc

    def opened() -> optuna.storages.RDBStorage:
        return optuna.storages.RDBStorage(
            url,
            # SQLite locks the whole file for a write: workers wait their turn rather than fail at once
            engine_kwargs={"connect_args": {"timeout": 60}} if sqlite else None,
            heartbeat_interval=heartbeat_s,
            grace_period=GRACE_PERIODS * heartbeat_s,
            heartbeat_stale_trial_callback=_retry(),
        )

    try:
        return _opened_while_others_create_tables(opened, sqlalchemy.exc)
    except ImportError as error:  # the database's driver (psycopg2, PyMySQL) is not installed
        raise ConfigError(f"--storage {shown}: {error}; install the database's Python driver") from None
    except (sqlalchemy.exc.SQLAlchemyError, ValueError) as error:
        reason = " ".join(str(getattr(error, "orig", None) or error).split())
        raise ConfigError(f"--storage {shown} cannot be opened ({reason}): check the URL and the server") from None


def _opened_while_others_create_tables(opened: Callable[[], Any], exc: Any, patience_s: float = 60.0) -> Any:
    """`opened()`, tried again while workers that started together race to create Optuna's tables: the losers see
    IntegrityError (a version row inserted twice) or, on SQLite and PostgreSQL, "table ... already exists"
    (OperationalError / ProgrammingError). Once the winner has committed, a new attempt finds the tables and only
    reads them; any other error, or one that outlasts `patience_s`, is the caller's."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            return opened()
        except (exc.IntegrityError, exc.OperationalError, exc.ProgrammingError) as error:
            racing = isinstance(error, exc.IntegrityError) or "already exists" in str(error)
            if not racing or time.monotonic() > deadline:
                raise
            time.sleep(random.uniform(0.05, 0.25))  # apart, so that the retries themselves do not race again


def _sampler(seed: int, trials_held: int, study: str, *, shared: bool) -> optuna.samplers.BaseSampler:
    """TPE, its random stream drawn from (--seed, the trials the study holds, the study's name, TUNING) unless the
    study is `shared` by workers, which would then all propose the same values. The study's name (the method and
    its fixed settings) keeps methods apart: TPE's first trials are random draws, and without it every method
    tuning the same settings would draw the same values."""
    name = int(hashlib.sha256(study.encode()).hexdigest()[:8], 16)
    return _optuna().samplers.TPESampler(seed=None if shared else derive_seed(seed, trials_held, name, TUNING))


def _retry() -> Callable[[optuna.Study, optuna.trial.FrozenTrial], None]:
    """Optuna's retry of a trial whose worker died: a waiting copy with its values, attributes (its run directory)
    and reports (the stages it played)."""
    return _optuna().storages.RetryHeartbeatStaleTrialCallback(MAX_RETRIES, inherit_intermediate_values=True)


def _without_password(url: str) -> str:
    return re.sub(r"(://[^:/@]+):[^@/]*@", r"\1:***@", url)


def _work(
    study: optuna.Study, objective: _Objective, trials: int, *, journal: bool, poll_s: int, console: Console
) -> None:
    """Run trials until the study holds `trials` that have not failed and none is waiting, then wait, looking every
    `poll_s` seconds, until no worker is running one (a dead worker's trial is failed and retried: by whoever is
    waiting)."""
    optuna = _optuna()
    state = optuna.trial.TrialState
    while True:
        _fail_dead_workers(study, journal=journal)
        held = study.get_trials(deepcopy=False)
        counted_trials = [trial for trial in held if trial.state != state.FAIL]
        if len(counted_trials) < trials or any(trial.state == state.WAITING for trial in held):
            study.optimize(objective, n_trials=1, catch=(_Surplus,), callbacks=[_progress(console)])
        elif any(trial.state == state.RUNNING for trial in held):
            time.sleep(poll_s)
        else:
            return


def _fail_dead_workers(study: optuna.Study, *, journal: bool) -> None:
    """Fail the trials of workers that died, which retries them: by their heartbeats in a database (Optuna's own),
    by their process ids on this machine in a `journal` file, which keeps no heartbeat."""
    optuna = _optuna()
    if not journal:
        optuna.storages.fail_stale_trials(study)
        return
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        host, _, rest = trial.user_attrs.get(WORKER, "").partition(":")
        pid, _, number = rest.partition(":")
        # A retry inherits the attributes of the trial it retries: only a worker id with the trial's own number is
        # the worker that runs it.
        if host == socket.gethostname() and number == str(trial.number) and not _alive(int(pid)):
            try:
                failed = study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
            except (ValueError, RuntimeError):  # another waiting worker failed it first, and retries it
                continue
            _retry()(study, failed)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class _Objective:
    """One trial: its values sampled (or, for a retry, kept), its run directory played stage by stage."""

    def __init__(
        self,
        study: optuna.Study,
        base: TrainConfig,
        space: dict,
        fixed: dict[str, Any],
        trials: int,
        directory: Path,
        console: Console,
    ) -> None:
        self.study, self.space, self.fixed, self.trials = study, space, fixed, trials
        self.directory, self.console = directory, console
        self.method = base.method.method
        self.stages = trial_stages(base.federation.rounds)

    def __call__(self, trial: optuna.Trial) -> float:
        optuna = _optuna()
        trial.set_user_attr(WORKER, f"{socket.gethostname()}:{os.getpid()}:{trial.number}")
        failed = optuna.trial.TrialState.FAIL
        before = [t for t in self.study.get_trials(deepcopy=False) if t.number < trial.number and t.state != failed]
        if len(before) >= self.trials:
            trial.set_user_attr(SURPLUS, True)
            raise _Surplus(f"trial {trial.number}: the study holds its {counted(self.trials, 'trial')} already")
        params = {key: _suggested(trial, key, declared.search) for key, declared in self.space.items()}
        relative = trial.user_attrs.get(RUN_DIR, f"trial-{trial.number}")  # a retry resumes its original's
        trial.set_user_attr(RUN_DIR, relative)
        values = {**self.fixed, **params, "method": self.method, "eval_split": "validation"}
        values["out"] = str(self.directory / relative)
        reported = _frozen(self.study, trial.number).intermediate_values  # a retry's: before its worker died
        try:
            for rounds in self.stages:
                if rounds in reported:
                    score = reported[rounds]
                    continue
                score = _stage(TrainConfig.from_flat({**values, "rounds": rounds}), self.console)
                trial.report(score, rounds)
                if rounds < self.stages[-1] and trial.should_prune():
                    raise optuna.TrialPruned(f"pruned after {counted(rounds, 'round')} at {score:.4g}")
        except TrainingDiverged as error:
            trial.set_user_attr(DIVERGED, str(error))
            raise optuna.TrialPruned(str(error)) from None
        except Interrupted:  # Ctrl-C: the trial fails, and is retried from its run directory by the next call
            _retry()(self.study, _frozen(self.study, trial.number))
            raise
        return score


def _frozen(study: optuna.Study, number: int) -> optuna.trial.FrozenTrial:
    """Trial `number` as the storage holds it (a running `optuna.Trial` shows neither its attributes nor its
    reports)."""
    return next(trial for trial in study.get_trials(deepcopy=False) if trial.number == number)


def _suggested(trial: optuna.Trial, key: str, search: Search) -> Any:
    if search.values:
        return trial.suggest_categorical(key, list(search.values))
    if search.integer:
        return trial.suggest_int(key, int(search.low), int(search.high))
    return trial.suggest_float(key, search.low, search.high, log=search.log_scale)


def _stage(config: TrainConfig, console: Console) -> float:
    """The score of the trial's run played to `config`'s rounds: trained anew, resumed, or (a stage that ended
    before its worker died) read."""
    run_dir, rounds = Path(str(config.out)), config.federation.rounds
    if not RunPaths(run_dir).config.exists():
        return train(config, console=console).summary[OBJECTIVE]
    report = read_report(run_dir)
    if report is not None and resume_config(run_dir, {}).federation.rounds == rounds:
        return report.summary[OBJECTIVE]
    return train(resume_config(run_dir, {"rounds": rounds}), resume=True, console=console).summary[OBJECTIVE]


def _progress(console: Console) -> Callable[[optuna.Study, optuna.trial.FrozenTrial], None]:
    """A line for each trial this worker finishes: its score or why it stopped, and its values."""

    def line(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        if trial.user_attrs.get(SURPLUS):
            return
        if trial.user_attrs.get(DIVERGED):
            outcome = f"pruned: {trial.user_attrs[DIVERGED]}"
        elif trial.value is not None:
            outcome = f"{trial.value:.4g}"
        elif trial.intermediate_values:
            played = max(trial.intermediate_values)
            outcome = f"pruned after {counted(played, 'round')} at {trial.intermediate_values[played]:.4g}"
        else:
            outcome = trial.state.name.lower()
        console.print(f"{study.study_name} trial {trial.number}: {outcome} ({_values(trial.params)})", soft_wrap=True)

    return line


def _values(params: dict[str, Any]) -> str:
    return ", ".join(
        f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}" for key, value in params.items()
    )


def _result(study: optuna.Study, method: str, space: dict, directory: Path) -> dict[str, Any]:
    """What `tune` returns and trials.json holds (module docstring)."""
    optuna = _optuna()
    listed = []
    for trial in study.get_trials(deepcopy=False):
        if trial.user_attrs.get(SURPLUS):
            continue
        entry = {
            "number": trial.number,
            "state": trial.state.name,
            "params": trial.params,
            "value": trial.value,
            "intermediate_values": {str(rounds): value for rounds, value in sorted(trial.intermediate_values.items())},
            "run_dir": str(directory / trial.user_attrs[RUN_DIR]) if RUN_DIR in trial.user_attrs else None,
        }
        original = optuna.storages.RetryHeartbeatStaleTrialCallback.retried_trial_number(trial)
        if original is not None:
            entry["retry_of"] = original
        if DIVERGED in trial.user_attrs:
            entry[DIVERGED] = trial.user_attrs[DIVERGED]
        listed.append(entry)
    completed = [trial for trial in listed if trial["state"] == "COMPLETE"]
    best = max(completed, key=lambda trial: trial["value"], default=None)  # the first of equals: TIE_RULE
    tied = [t["number"] for t in completed if best is not None and t is not best and t["value"] == best["value"]]
    return {
        "method": method,
        "study": study.study_name,
        "searched": {key: declared.search.text() for key, declared in space.items()},
        **_best(best),
        "tie_rule": TIE_RULE,
        "tied_with": tied,
        "trials": listed,
    }


def _best(trial: dict | None) -> dict[str, Any]:
    """The result's best trial: its values, score and number; none (nothing tuned, nothing completed) fixes nothing."""
    if trial is None:
        return {"best_params": {}, "best_value": None, "best_trial": None}
    return {"best_params": trial["params"], "best_value": trial["value"], "best_trial": trial["number"]}
