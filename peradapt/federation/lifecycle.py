"""A run directory's life around its rounds: opening it (a new run's config, partition and pinned weights written
after every check; a resumed one reopened at its newest checkpoint, with only outcome-free settings changed), the
lock held while it runs, --lam auto's choice before round 1, and what a failure or Ctrl-C leaves (nothing of a new
run before its first checkpoint; else the run as of its newest checkpoint, for --resume)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console

from peradapt.adapters import AdapterState
from peradapt.backbones import pin_weights
from peradapt.compute.costs import reset_peak_memory
from peradapt.config import OUTCOME_FREE, TrainConfig, method_path_label
from peradapt.data.sources import dataset_label
from peradapt.errors import Interrupted, MachineError, RunError, machine_error
from peradapt.federation.budget import check_budget
from peradapt.federation.checkpoints import metrics_lines, restored
from peradapt.federation.session import Session, build_session, open_session
from peradapt.federation.tracking import Tracking, check_installed, open_tracking, remove_tracking_files
from peradapt.methods.auto_lam import estimate_lam
from peradapt.progress import counted
from peradapt.rundir.checkpoint import checkpointed_rounds, load_latest_checkpoint, write_json_atomic, write_text_atomic
from peradapt.rundir.files import first_missing
from peradapt.rundir.layout import RunPaths, read_run_config
from peradapt.rundir.lock import RunLock, deferred_interrupts
from peradapt.rundir.records import LamAuto, RoundRecord

# What --resume lets change: --rounds (a run may go on), and every setting no result depends on
RESUMABLE_CHANGES = ("rounds", *OUTCOME_FREE)


def default_run_dir(config: TrainConfig) -> Path:
    method = method_path_label(config.method.method)
    return Path("runs") / f"{dataset_label(config.data.data)}-{method}-seed{config.seed}"


def resume_config(run_dir: Path, overrides: dict) -> TrainConfig:
    """The saved config of `run_dir` with `overrides` applied; only settings that keep results valid may change.
    Values compare as parsed: `--lam 1` is the saved 1.0."""
    saved, _ = read_run_config(run_dir)
    flat = saved.to_flat()
    auto = str(overrides.get("lam", "")).strip().lower() == "auto"
    if flat["lam_auto"] and auto:
        overrides = {k: v for k, v in overrides.items() if k != "lam"}  # keep the λ chosen when the run began
    merged = {**flat, **overrides, "out": str(run_dir)}
    if auto and not flat["lam_auto"]:  # --lam auto on a run of a fixed λ: the saved lam_auto (False) must not undo it
        merged.pop("lam_auto")
    resumed = TrainConfig.from_flat(merged)
    parsed = resumed.to_flat()
    changed = sorted(
        key
        for key in (k.replace("-", "_") for k in overrides)
        if key not in RESUMABLE_CHANGES
        and (parsed[key] != flat[key] or (key == "lam" and parsed["lam_auto"] != flat["lam_auto"]))
    )
    if changed:
        raise RunError(
            f"--resume continues {run_dir} with its saved settings; these differ: {', '.join(changed)}. "
            f"Only {', '.join(RESUMABLE_CHANGES)} may change; start a new run with --out for anything else"
        )
    return resumed


@dataclass
class PreparedRun:
    """A run directory ready for its rounds: session built, config written, state as of the newest checkpoint."""

    session: Session
    paths: RunPaths
    global_state: AdapterState
    history: list[RoundRecord]
    tracking: Tracking | None = None  # --log: the experiment trackers (peradapt.federation.tracking)


@contextmanager
def opened_run(config: TrainConfig, *, resume: bool, console: Console) -> Iterator[PreparedRun]:
    """The run of `config` for its rounds, its directory locked against other processes until the block ends.

    Every input is checked (the session built) before the directory is created. A new run that fails or is
    interrupted before its first checkpoint leaves nothing behind; after it, a failure leaves the run as of its
    newest checkpoint, for `--resume`, and Ctrl-C becomes `Interrupted`, which says how to resume.
    """
    check_installed(config.log)  # --log: each tracker's package, before anything is built or written
    reset_peak_memory()  # this run's peaks, not those of the runs this process made before (compare)
    run_dir = Path(config.out) if config.out else default_run_dir(config)
    config = replace(config, out=str(run_dir))  # the run's own copy, with its directory: the caller's is not written
    paths = RunPaths(run_dir)
    if not resume and paths.config.exists():  # said before the session is built, which takes a while
        raise _already_a_run(run_dir)
    if resume:
        _check_rounds_to_play(paths, config.federation.rounds)
        store = read_run_config(run_dir)[1].client_store  # resume keeps the run's store
        session = open_session(run_dir, config, client_store=store_directory(store, paths))
    else:
        session = build_session(config, client_store=store_directory(config.federation.store_kind(), paths))
    check_budget(session)
    created = first_missing(run_dir)
    with RunLock(run_dir, exclusive=True):
        try:
            run = _prepare(session, paths, resume, console)
            try:
                yield run
            finally:  # the trackers' runs end as failed unless `finish` ended them
                if run.tracking is not None:
                    run.tracking.close()
        except BaseException as error:  # whatever the cause: a new run is kept from its first checkpoint on
            nothing_kept = not resume and checkpointed_rounds(paths.checkpoints) == 0
            if nothing_kept:
                _remove_new_run(paths, created)
            kept = f"no round of {run_dir} had ended, so nothing of it was kept" if nothing_kept else ""
            if isinstance(error, KeyboardInterrupt):
                raise Interrupted(kept or _how_to_resume(paths)) from None
            refused = machine_error(error)
            if refused is not None:  # a full disk, a dead tracker server: said with what of the run is kept
                raise MachineError(f"{refused}; {kept or _how_to_resume(paths)}") from error
            raise


def _prepare(session: Session, paths: RunPaths, resume: bool, console: Console) -> PreparedRun:
    """Write the run's config (and partition, and pin its backbone), or reopen it at its newest checkpoint."""
    config, run_dir = session.config, paths.root
    checkpoint = None
    if resume:  # its rounds were counted by `opened_run`; their number is checked against the name as it loads
        checkpoint = load_latest_checkpoint(paths.checkpoints)
    elif paths.config.exists():  # written by another process since `opened_run` looked
        raise _already_a_run(run_dir)
    global_state, history = restored(session, checkpoint, paths)  # checked before anything is written
    pinned = f" (the run's copy, {session.pinned_copy})" if session.pinned_copy else ""
    console.print(f"backbone weights: {session.backbone.source}{pinned}")
    if session.method.uses_distillation and config.distill.kd_mode == "train" and config.method.frozen_bn != "train":
        console.print(
            "note: --kd-mode train without --frozen-bn train distills with the frozen BatchNorms on their pretrained "
            "statistics; the authors' distillation needs both (docs/REPRODUCING.md)"
        )
    lam_auto = choose_lam(session, run_dir, resume, console)
    if lam_auto is not None and not resume:  # a resumed run's saved config holds its λ already
        session.use_lam(lam_auto.lam)
    config = session.config
    resolved = replace(session.resolved(), lam_auto=lam_auto)
    # --log: the trackers start (or continue their runs) after every check, and log the rounds they lack
    tracking = open_tracking(config, run_dir, resolved=resolved.to_json(), history=history, resume=resume)
    with deferred_interrupts():
        if resume:  # results of the run as it was are no longer the run's: they go before anything changes
            _unfinish(paths)
        else:  # config.json marks a run directory, so it comes last: a run killed here always has its partition.
            write_json_atomic(paths.partition, session.data.partition)
            source = Path(session.backbone.source)
            if source.is_file():  # a weights file, which a later `pretrain` may replace: the run keeps its own
                pin_weights(source, session.backbone_sha256)
        write_json_atomic(paths.config, {"config": config.to_dict(), "resolved": resolved.to_json()})
        if history:  # as the checkpoint records it: a damaged metrics.jsonl is whole again
            write_text_atomic(paths.metrics, metrics_lines(history))
    start = len(history)
    if start:
        console.print(f"resuming {run_dir} after round {start}")
    return PreparedRun(session, paths, global_state, history, tracking)


def _check_rounds_to_play(paths: RunPaths, rounds: int) -> None:
    """Refuse to resume with fewer --rounds than the run has done (by its newest checkpoint's name, before any data
    is loaded)."""
    done = checkpointed_rounds(paths.checkpoints)
    if done > rounds:
        raise RunError(
            f"{paths.root} has done {counted(done, 'round')}, more than --rounds {rounds}: rounds cannot be undone "
            f"(only the newest checkpoint is kept), so pass --rounds {done} or more, or start a new run"
        )


def _already_a_run(run_dir: Path) -> RunError:
    return RunError(f"{run_dir} already holds a run: pass --resume to continue it, or --out DIR for a new one")


def _unfinish(paths: RunPaths) -> None:
    """Take away what says a run is finished (report.json, first: `eval` and `export` refuse a run without it) and
    the evaluations of its exported adapters, which its next export replaces."""
    paths.report.unlink(missing_ok=True)
    for evaluation in (paths.root / "eval.json", *paths.root.glob("ood-*.json")):
        evaluation.unlink(missing_ok=True)


def _how_to_resume(paths: RunPaths) -> str:
    done = checkpointed_rounds(paths.checkpoints)
    kept = f"rounds 1-{done}" if done else "no finished round yet"
    return f"{paths.root} holds {kept}: continue it with `peradapt train --out {paths.root} --resume`"


def _remove_new_run(paths: RunPaths, created: Path | None) -> None:
    """Delete what a new run wrote before its first checkpoint (and `created`, the directories the run made for
    itself). Best effort: what stopped the run is the error to tell, not a file that could not be deleted."""
    with suppress(OSError):
        for path in (paths.config, paths.partition, paths.metrics):
            path.unlink(missing_ok=True)
        for directory in (paths.checkpoints, paths.client_store):
            shutil.rmtree(directory, ignore_errors=True)
        remove_tracking_files(paths.root)
    if created is not None:
        shutil.rmtree(created, ignore_errors=True)


def store_directory(kind: str, paths: RunPaths) -> Path | None:
    return paths.client_store if kind == "disk" else None


def choose_lam(session: Session, run_dir: Path, resume: bool, console: Console) -> LamAuto | None:
    """`--lam auto`: λ from the fitted clients' optima (R² of Theorem 1), once, before round 1 (a resumed run keeps
    it). The fits are deterministic and draw no random numbers, so the rounds see the RNG they would see without."""
    config = session.config.method
    if not config.lam_auto:  # a method without a proximal strength was refused by `build_session`
        return None
    if resume:  # the saved config's λ is that choice
        return read_run_config(run_dir)[1].lam_auto
    lam_max = 1 / max(config.lr, config.personal_lr or config.lr)  # a proximal step never overshoots w_g
    record = LamAuto(
        **estimate_lam(
            session.trainer,
            session.initial,
            session.client_sample,  # an optimum per client, held together: a sample in large federations
            lam_max=lam_max,
            num_clients=len(session.federated_clients),
        )
    )
    console.print(
        f"--lam auto: R²={record.r2:.4g} (max over {counted(record.clients, 'client')}, "
        f"median {record.r2_median:.4g}; n={record.n:.4g}), regime {record.regime}, "
        f"lam={record.lam:.4g} ({record.explanation})"
    )
    return record
