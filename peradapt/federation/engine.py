"""The round loop, written once for every method: sample, client updates, server update, evaluate, checkpoint.

`train` runs a federation from a config into a run directory; `--resume` continues from the newest checkpoint
and, because every random draw is derived from (seed, round, client, phase), ends with exactly the numbers an
uninterrupted run gives. The client store (memory or disk, `--client-store`) is restored to that checkpoint and
committed after each one, so clients' private state always matches the checkpoint's round (see `store`).

The loop is the same for both engines (`--engine`); only where the clients' side runs differs (`Clients`): here
(`LocalClients`), one client after the other (`play_client`) or --concurrent-clients at once
(`play_clients_together`), or in Flower ClientApps that receive the global adapter and send their uploads back
(`peradapt.flower`, each playing its client with `play_client`).

Nothing in the loop grows with the number of clients M beyond the data: one model serves every client, a disk
store holds the states, and in federations of more than CLIENT_SAMPLE clients the evaluations that cost a state
or a large pass per client use the session's seeded `client_sample`.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from rich.console import Console
from rich.progress import Progress

from peradapt.adapters import AdaptedModel, AdapterState
from peradapt.adapters.model import write_files
from peradapt.backbones import pin_weights
from peradapt.compute.concurrent import ConcurrentSGD, unsupported_layers
from peradapt.compute.costs import (
    ClientWork,
    SampleFlops,
    elements,
    own_elements,
    peak_memory,
    reset_peak_memory,
    state_bytes,
)
from peradapt.compute.privacy import charged_to, privacy_report, round_epsilons
from peradapt.config import OUTCOME_FREE, TrainConfig, method_path_label, parse_budget
from peradapt.data import ClientData
from peradapt.data.sources import dataset_label
from peradapt.distill import Distiller
from peradapt.errors import ConfigError, Interrupted, MachineError, RunError, machine_error
from peradapt.evaluation import (
    evaluate_adapters,
    flat_scores,
    local_test_statistics,
    mean_and_std,
    per_client_record,
    select_on_test,
)
from peradapt.federation.session import Session, build_session, open_session
from peradapt.federation.tracking import Tracking, check_installed, open_tracking, remove_tracking_files
from peradapt.methods import ClientUpdate
from peradapt.methods.auto_lam import estimate_lam
from peradapt.methods.base import LocalSGDMethod, trains_by_sgd_jobs
from peradapt.progress import ProgressLines, counted, progress_display, text_console
from peradapt.rundir.checkpoint import (
    checkpoint_path,
    checkpointed_rounds,
    load_latest_checkpoint,
    redo_from_round_1,
    save_checkpoint,
    write_json_atomic,
    write_text_atomic,
)
from peradapt.rundir.files import damaged, first_missing
from peradapt.rundir.layout import RunPaths, read_run_config
from peradapt.rundir.lock import RunLock, deferred_interrupts
from peradapt.rundir.records import (
    Budget,
    Cost,
    Global,
    LamAuto,
    ParameterCounts,
    Parameters,
    Personalized,
    Report,
    RoundCost,
    RoundRecord,
    RoundTiming,
    Stats,
    Timing,
)
from peradapt.seeds import SERVER, answering, derive_seed, sample_clients, straggler_shares

# What --resume lets change: --rounds (a run may go on), and every setting no result depends on
RESUMABLE_CHANGES = ("rounds", *OUTCOME_FREE)
GLOBAL_PREFIX = "global/"
SERVER_PREFIX = "server/"  # the method's server state (`Method.server_state`) in round checkpoints
_CLIENT_TENSOR = re.compile(r"clients/\d+/\w+/.+")  # a client state in a checkpoint (`ClientStore`)


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


def train(config: TrainConfig, *, resume: bool = False, console: Console | None = None) -> Report:
    """Run (or continue) a federation on the builtin engine; returns the report also written to `report.json`.
    (`peradapt.commands.training.train` picks the engine the config names.)"""
    if config.federation.engine != "builtin":
        raise ConfigError(f"--engine {config.federation.engine}: train with peradapt.commands.training.train")
    console = console or text_console(stderr=True)
    with opened_run(config, resume=resume, console=console) as run:
        return run_federation(run, LocalClients(run.session, console), console)


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
    config.out = str(run_dir)
    paths = RunPaths(run_dir)
    if not resume and paths.config.exists():  # said before the session is built, which takes a while
        raise _already_a_run(run_dir)
    if resume:
        _check_rounds_to_play(paths, config.federation.rounds)
        store = read_run_config(run_dir)[1].client_store  # resume keeps the run's store
        session = open_session(run_dir, config, client_store=_store_directory(store, paths))
    else:
        session = build_session(config, client_store=_store_directory(config.federation.store_kind(), paths))
    check_budget(session)
    created = first_missing(run_dir)
    with RunLock(run_dir, exclusive=True):
        try:
            run = _prepare(session, paths, resume, console)
            try:
                yield run
            finally:  # the trackers' runs end as failed unless `_finish` ended them
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
    global_state, history = _restored(session, checkpoint, paths)  # checked before anything is written
    pinned = f" (the run's copy, {session.pinned_copy})" if session.pinned_copy else ""
    console.print(f"backbone weights: {session.backbone.source}{pinned}")
    if session.method.uses_distillation and config.distill.kd_mode == "train" and config.method.frozen_bn != "train":
        console.print(
            "note: --kd-mode train without --frozen-bn train distills with the frozen BatchNorms on their pretrained "
            "statistics; the authors' distillation needs both (docs/REPRODUCING.md)"
        )
    lam_auto = _choose_lam(session, run_dir, resume, console)
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
            write_text_atomic(paths.metrics, _metrics_lines(history))
    start = len(history)
    if start:
        console.print(f"resuming {run_dir} after round {start}")
    return PreparedRun(session, paths, global_state, history, tracking)


def _restored(
    session: Session, checkpoint: tuple[dict[str, torch.Tensor], list[RoundRecord]] | None, paths: RunPaths
) -> tuple[AdapterState, list[RoundRecord]]:
    """The global state and round records of `checkpoint` (None: the run starts at round 1), whose tensors are
    checked against the session before its client store and the method's server state are restored to them."""
    global_state, history, tensors = session.initial, [], {}
    if checkpoint is not None:
        tensors, history = checkpoint
        _check_checkpoint(session, tensors, checkpoint_path(paths.checkpoints, len(history)))
        global_state = {
            k[len(GLOBAL_PREFIX) :]: v.to(session.device) for k, v in tensors.items() if k.startswith(GLOBAL_PREFIX)
        }
    session.store.restore(tensors, len(history))
    session.method.load_server_state(
        {k[len(SERVER_PREFIX) :]: v.to(session.device) for k, v in tensors.items() if k.startswith(SERVER_PREFIX)}
    )
    return global_state, history


def _check_checkpoint(session: Session, tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Refuse a checkpoint whose tensors do not fit the session: the global adapter must have the initial state's
    names and shapes; the method's server state those of its fresh one (or, where that is empty until the first
    round, as FedDyn's h, entries of the adapter state); a client state (memory store) a `clients/<id>/<name>/...`
    name."""
    remedy = redo_from_round_1(path.parent)
    expected = {name: tuple(tensor.shape) for name, tensor in session.initial.items()}
    fresh_server = {name: tuple(tensor.shape) for name, tensor in session.method.server_state().items()}
    parts: dict[str, dict[str, tuple[int, ...]]] = {GLOBAL_PREFIX: {}, SERVER_PREFIX: {}}
    for name, tensor in tensors.items():
        prefix = next((p for p in parts if name.startswith(p)), None)
        if prefix is not None:
            parts[prefix][name[len(prefix) :]] = tuple(tensor.shape)
        elif not _CLIENT_TENSOR.fullmatch(name):
            raise damaged(path, f"it holds a tensor {name!r} that no checkpoint of peradapt has", remedy)
    for prefix, reference, exact in (
        (GLOBAL_PREFIX, expected, True),
        (SERVER_PREFIX, fresh_server or expected, bool(fresh_server)),
    ):
        found = parts[prefix]
        names = sorted(found.keys() ^ reference.keys()) if exact else sorted(found.keys() - reference.keys())
        names += [name for name in sorted(found.keys() & reference.keys()) if found[name] != reference[name]]
        if names:
            what = "global adapter" if prefix == GLOBAL_PREFIX else "server state"
            raise damaged(
                path, f"its {what} does not fit this run's model, e.g. at {prefix}{names[0]}: another run's?", remedy
            )


def _check_rounds_to_play(paths: RunPaths, rounds: int) -> None:
    """Refuse to resume with fewer --rounds than the run has done (by its newest checkpoint's name, before any data
    is loaded)."""
    done = checkpointed_rounds(paths.checkpoints)
    if done > rounds:
        raise RunError(
            f"{paths.root} has done {counted(done, 'round')}, more than --rounds {rounds}: rounds cannot be undone "
            f"(only the newest checkpoint is kept), so pass --rounds {done} or more, or start a new run"
        )


def _metrics_lines(history: list[RoundRecord]) -> str:
    """metrics.jsonl: a JSON line per round."""
    return "".join(json.dumps(record.to_json()) + "\n" for record in history)


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


def run_federation(run: PreparedRun, clients: Clients, console: Console) -> Report:
    """The rounds left, then the final evaluation and export: the same for every engine."""
    flops = sample_flops(run.session)
    global_state = _run_rounds(
        run.session, run.global_state, run.history, run.paths, console, clients, flops, tracking=run.tracking
    )
    return _finish(run.session, global_state, run.history, run.paths, console, clients, flops, tracking=run.tracking)


@dataclass(frozen=True)
class RoundTask:
    """What a round asks of its clients: those `trained` (in the order their updates come back), each from its
    payload (`Method.payload`: most often the one global state object for all), doing its share of its local work
    (`shares`, `LocalTrainer.work_share`: a straggler's, a --budget's last round; a client not there does all)."""

    round_index: int
    trained: list[int]
    payloads: dict[int, AdapterState]
    shares: dict[int, float] = field(default_factory=dict)

    def share(self, client_id: int) -> float:
        return self.shares.get(client_id, 1.0)


class Clients(Protocol):
    """Where the clients' side of the rounds runs: in this process (`LocalClients`, the builtin engine) or in
    Flower ClientApps (`peradapt.flower`). Both play each client with `play_client`."""

    def train(self, task: RoundTask, on_client: Callable[[int], None]) -> list[ClientUpdate]:
        """The updates of the clients `task.trained`, in their order; `on_client(client_id)` as each finishes."""

    def personalized(
        self, clients: Sequence[ClientData], global_state: AdapterState, *, played: int, checkpointed: int
    ) -> Callable[[int], AdapterState]:
        """Client id -> the adapter it is evaluated and exported with (`Method.personalized`), to be asked for
        `clients` in their order, after round `played` with the checkpoint of round `checkpointed` written."""

    def own_elements(self, client_id: int, state: AdapterState, global_state: AdapterState) -> int:
        """The elements of client `client_id`'s personalized adapter `state` (as `personalized` gave it, with
        `global_state`) that are its own (`costs.own_elements`)."""

    def traffic(self) -> dict:
        """What was sent since the last call, for the round's record: at least the bytes sent to (`bytes_down`) and
        by (`bytes_up`) each trained client, in the order of `trained`."""


class LocalClients:
    """The builtin engine's clients, simulated in this process on the session's one model: one after the other, or
    up to --concurrent-clients at once (`concurrent_training`)."""

    def __init__(self, session: Session, console: Console) -> None:
        self.session = session
        self.concurrent = concurrent_training(session, console)  # with how many clients train at once
        self._traffic: dict = {}

    def train(self, task: RoundTask, on_client: Callable[[int], None]) -> list[ClientUpdate]:
        updates = []
        if self.concurrent is None:
            for client_id in task.trained:
                payload = task.payloads[client_id]
                updates.append(play_client(self.session, client_id, payload, task.round_index, task.share(client_id)))
                on_client(client_id)
        else:
            concurrent, together = self.concurrent
            for start in range(0, len(task.trained), together):
                group = task.trained[start : start + together]
                updates += play_clients_together(self.session, concurrent, group, task, on_client)
        # What a deployment would send: the payload's tensors and the upload's, as they are (their bytes).
        self._traffic = {
            "bytes_down": [state_bytes(task.payloads[client_id]) for client_id in task.trained],
            "bytes_up": [state_bytes(update.upload) for update in updates],
        }
        return updates

    def personalized(
        self, clients: Sequence[ClientData], global_state: AdapterState, *, played: int, checkpointed: int
    ) -> Callable[[int], AdapterState]:
        return lambda client_id: self.session.method.personalized(client_id, global_state)

    def own_elements(self, client_id: int, state: AdapterState, global_state: AdapterState) -> int:
        return own_elements(state, global_state)

    def traffic(self) -> dict:
        traffic, self._traffic = self._traffic, {}
        return traffic


def play_client(
    session: Session, client_id: int, payload: AdapterState, round_index: int, share: float = 1.0
) -> ClientUpdate:
    """Client `client_id`'s side of round `round_index` (from 0): the method's client update from what the server
    sent it (the global state, or the client's own payload), seeded by (seed, round, client), so that any engine,
    process or machine gives the same numbers; `share` of its local work (`LocalTrainer.sharing`)."""
    client_seed = derive_seed(session.config.seed, round_index, client_id)
    trainer, started = session.trainer, time.perf_counter()
    samples, trained = trainer.samples_trained, trainer.elements_trained
    with charged_to(trainer.privacy, session.store, client_id), trainer.sharing(share):  # --dp-noise: its DP-SGD steps
        update = session.method.client_update(session.data.clients[client_id], payload, client_seed)
    update.work = ClientWork(
        trainer.samples_trained - samples, time.perf_counter() - started, trainer.elements_trained - trained
    )
    return update


def play_clients_together(
    session: Session,
    concurrent: ConcurrentSGD,
    client_ids: list[int],
    task: RoundTask,
    on_client: Callable[[int], None],
) -> list[ClientUpdate]:
    """`play_client` for each of `client_ids` (of those `task` trains), their SGD jobs trained at once
    (`concurrent_training`); `on_client(client_id)` is called as each finishes."""
    method, seed = session.method, session.config.seed
    assert isinstance(method, LocalSGDMethod), "concurrent_training serves only methods that train by SGD jobs"
    steps = [
        method.client_steps(session.data.clients[c], task.payloads[c], derive_seed(seed, task.round_index, c))
        for c in client_ids
    ]
    work: dict[int, ClientWork] = {}

    def finished(index: int, done: ClientWork) -> None:
        work[index] = done
        on_client(client_ids[index])

    started = time.perf_counter()
    updates = concurrent.run_steps(steps, on_finished=finished, shares=[task.share(c) for c in client_ids])
    seconds = (time.perf_counter() - started) / len(client_ids)  # one pass for all: its time shared out evenly
    for index, update in enumerate(updates):
        update.work = ClientWork(work[index].samples, seconds, work[index].trained)
    return updates


def concurrent_training(session: Session, console: Console) -> tuple[ConcurrentSGD, int] | None:
    """What trains K > 1 clients at once, and K (--concurrent-clients, or auto: `clients_at_once`), or None: one
    after another (K = 1, or a run it cannot serve, which it says)."""
    asked, method = session.config.federation.concurrent_clients, session.config.method.method
    if asked == 1 or (asked is None and session.device.type != "cuda"):
        return None  # auto on a CPU: one after another, faster there (docs/BENCHMARKS.md)
    unsupported = unsupported_layers(session.trainer.model.module)
    if not trains_by_sgd_jobs(type(session.method)):
        reason = f"--method {method} trains clients with update rules of its own, not plain local SGD"
    elif session.trainer.privacy is not None:
        reason = "--dp-noise clips and accounts every client's gradients on its own"
    elif unsupported:
        reason = f"the model's {unsupported[0]} draws random numbers that cannot be replayed client by client"
    else:
        concurrent = ConcurrentSGD(session.trainer)
        together = asked or clients_at_once(session, concurrent, console)
        return (concurrent, together) if together > 1 else None
    if asked is not None:  # auto says nothing: it chose what it could
        console.print(f"--concurrent-clients {asked}: {reason}; clients train one after another")
    return None


def clients_at_once(session: Session, concurrent: ConcurrentSGD, console: Console) -> int:
    """--concurrent-clients auto on a GPU: as many federated clients as fit --gpu-memory-fraction of its memory
    (`ConcurrentSGD.clients_at_once`), said in one line."""
    federation = session.config.federation
    clients = session.data.clients[: federation.clients - federation.holdout_clients]
    fraction = federation.gpu_memory_fraction
    together, per_client = concurrent.clients_at_once([client.train for client in clients], fraction)
    total = torch.cuda.get_device_properties(session.device).total_memory
    console.print(
        f"--concurrent-clients auto: {together} clients at once ({per_client:,} bytes each of {fraction:g} of "
        f"{total / 2**30:.0f} GiB)"
    )
    return together


def sample_flops(session: Session) -> SampleFlops:
    """FLOPs per sample of a training step and of an inference pass (`LocalTrainer.sample_flops`), measured once per
    run, on a federated client's first training image twice: the rounds multiply them by the samples they count."""
    images = next(client.train.images[:1] for client in session.federated_clients if len(client.train))
    return session.trainer.sample_flops(images.repeat(2, 1, 1, 1))


def budget_limit(config: TrainConfig) -> int | None:
    """--budget client-samples:N's N (None: no budget)."""
    budget = config.federation.budget
    return None if budget is None else parse_budget(budget)[1]


def check_budget(session: Session) -> None:
    """Refuse a --budget that the run cannot reach within --rounds, before anything is written: a round processes
    at most what the method's client update can (`Method.client_samples_bound`) on the clients with the most data,
    as many as a round trains, and the final personalization's samples are set aside first
    (`personalization_reserve`). Not checked where that is not known before the run: with --dp-noise (DP-SGD's
    Poisson batches have no largest size) or for a method that does not say."""
    limit, fed, method = budget_limit(session.config), session.config.federation, session.method
    if limit is None or session.trainer.privacy is not None:
        return
    reserve = personalization_reserve(session)
    if reserve >= limit:
        raise ConfigError(
            f"--budget {fed.budget} cannot be reached: --method {session.config.method.method}'s personalization "
            f"of every client after the rounds alone trains {reserve:,} samples; raise N"
        )
    bounds = [method.client_samples_bound(client) for client in session.federated_clients]
    known = [bound for bound in bounds if bound is not None]
    if len(known) < len(bounds):
        return
    federated = [client.client_id for client in session.federated_clients]
    trained = len(method.clients_to_train(federated[: fed.clients_per_round], federated))
    per_round = sum(sorted(known, reverse=True)[:trained])
    if per_round * fed.rounds < limit - reserve:
        needed = f"--rounds {-(-(limit - reserve) // per_round)}" if per_round else "clients with training data"
        set_aside = f" besides the {reserve:,} of the final personalization" if reserve else ""
        raise ConfigError(
            f"--budget {fed.budget} cannot be reached: --method {session.config.method.method} processes at most "
            f"{per_round:,} client training samples a round ({counted(trained, 'client')}), "
            f"{per_round * fed.rounds:,} in --rounds {fed.rounds}{set_aside}; lower N or give it {needed}"
        )


def personalization_reserve(session: Session) -> int:
    """The training samples of the federated clients' personalization when the run hands out their models
    (`Method.personalization_samples`: fedavg-ft's fine-tuning), which --budget counts and so sets aside."""
    return sum(session.method.personalization_samples(client) for client in session.federated_clients)


def budget_reached(history: list[RoundRecord], limit: int, reserve: int) -> bool:
    """Whether the rounds of `history` used up --budget client-samples:`limit` (less `reserve`): their samples
    reach it, or the last round trained only what was left of it (`budget_share`)."""
    return client_samples(history) + reserve >= limit or bool(history and history[-1].budget_share is not None)


def budget_share(session: Session, left: float, trained: list[int], shares: dict[int, float]) -> float | None:
    """The share of their work the clients `trained` (doing `shares` of it already: stragglers) do so that the
    round trains no more than `left`, what is left of --budget: None where all of it fits, or where the most a
    client trains is not known (`Method.client_samples_bound`; DP-SGD), and the budget is then met to within a
    round. Each SGD job of a client is cut to the share (`LocalTrainer.work_share`), so the round trains at most
    what is left, less under a sample per job. `--dry-run` counts a budget's last round by it too."""
    if session.trainer.privacy is not None:
        return None
    bounds = [session.method.client_samples_bound(session.data.clients[c]) for c in trained]
    if any(bound is None for bound in bounds):
        return None
    planned = sum(shares.get(c, 1.0) * bound for c, bound in zip(trained, bounds, strict=True))  # type: ignore[operator]
    return left / planned if planned > left else None


def _store_directory(kind: str, paths: RunPaths) -> Path | None:
    return paths.client_store if kind == "disk" else None


def _choose_lam(session: Session, run_dir: Path, resume: bool, console: Console) -> LamAuto | None:
    """`--lam auto`: λ from the fitted clients' optima (R² of Theorem 1), once, before round 1 (a resumed run keeps
    it). The fits are deterministic and draw no random numbers, so the rounds see the RNG they would see without."""
    config = session.config.method
    if not config.lam_auto:  # a method without a proximal strength was refused by `build_session`
        return None
    if resume:  # config.lam already holds the saved choice
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
    config.lam = record.lam  # the method's config is this same object
    console.print(
        f"--lam auto: R²={record.r2:.4g} (max over {counted(record.clients, 'client')}, "
        f"median {record.r2_median:.4g}; n={record.n:.4g}), regime {record.regime}, "
        f"lam={record.lam:.4g} ({record.explanation})"
    )
    return record


def _run_rounds(
    session: Session,
    global_state: dict,
    history: list[RoundRecord],
    paths: RunPaths,
    console: Console,
    clients: Clients,
    flops: SampleFlops,
    tracking: Tracking | None = None,
) -> dict:
    config, method = session.config, session.method
    fed, seed = config.federation, config.seed
    federated = fed.clients - fed.holdout_clients  # held-out clients are the last ids: never sampled
    distiller = method.context.distiller
    federated_ids = list(range(federated))
    limit = budget_limit(config)
    reserve = personalization_reserve(session) if limit is not None else 0
    with progress_display(console) as progress:
        # without a terminal, a line per round (`ProgressLines`): what a live display shows as it goes
        rounds_bar = progress.add_task("rounds", total=fed.rounds, completed=len(history), log_each_step=True)
        for round_index in range(len(history), fed.rounds):
            if limit is not None and budget_reached(history, limit, reserve):
                set_aside = f" and {reserve:,} set aside for the final personalization" if reserve else ""
                console.print(
                    f"--budget {fed.budget}: reached after round {round_index} "
                    f"({client_samples(history):,} client training samples{set_aside}); no more rounds"
                )
                break
            sampled = sample_clients(seed, round_index, federated, fed.clients_per_round)
            # --participation: the clients that do not answer neither train nor are aggregated
            asked = method.clients_to_train(sampled, federated_ids)  # pFedMe, pFedBreD: every client trains
            trained = answering(seed, round_index, asked, fed.participation)
            answered = set(trained)
            aggregated = [client_id for client_id in sampled if client_id in answered]
            shares = straggler_shares(seed, round_index, trained, fed.stragglers) if fed.stragglers else {}
            stragglers = dict(shares)
            left = None if limit is None else limit - reserve - client_samples(history)
            cut = None if left is None else budget_share(session, left, trained, shares)
            if cut is not None:  # the last round of --budget: every client does its part of what is left
                shares = {client_id: shares.get(client_id, 1.0) * cut for client_id in trained}
            payloads = {client_id: method.payload(client_id, global_state) for client_id in trained}
            clients_bar = progress.add_task(f"round {round_index + 1}: clients", total=len(trained), samples=0)
            task = RoundTask(round_index, trained, payloads, shares)
            updates = clients.train(task, _client_progress(session, progress, clients_bar))
            progress.remove_task(clients_bar)
            by_client = {update.client_id: update for update in updates}
            kd_steps = config.distill.kd_steps if distiller and distiller.active(round_index) else 0
            server_bar = progress.add_task(f"round {round_index + 1}: server", total=max(kd_steps, 1))
            server_started, distilled = time.perf_counter(), distiller.seconds if distiller else 0.0
            server_samples = _distiller_samples(distiller)
            server_metrics: dict[str, float] = {}
            if aggregated:  # a round that no sampled client answered keeps the global model
                global_state, server_metrics = method.server_update(
                    global_state,
                    [by_client[client_id] for client_id in aggregated],  # the sample is aggregated, whoever trained
                    derive_seed(seed, round_index, SERVER),
                    round_index,
                    on_step=lambda step, bar=server_bar: progress.update(bar, completed=step),
                )
            server_seconds = time.perf_counter() - server_started
            distillation_seconds = (distiller.seconds if distiller else 0.0) - distilled
            server_trained, server_inferred = (
                now - before for now, before in zip(_distiller_samples(distiller), server_samples, strict=True)
            )
            progress.remove_task(server_bar)
            epsilons = round_epsilons(session.trainer.privacy, session.store, aggregated)
            scores, evaluation_samples = {}, 0
            if fed.eval_every and (round_index + 1) % fed.eval_every == 0:
                evaluated = session.client_sample  # after this round, whose checkpoint is not written yet
                personalized = clients.personalized(
                    evaluated, global_state, played=round_index + 1, checkpointed=round_index
                )
                evaluation = _evaluate(session, personalized, global_state, evaluated)
                # with each client's scores, for the authors' selection on test data
                scores = {**flat_scores(evaluation), "per_client": per_client_record(evaluation)}
                evaluation_samples = sum(method.personalization_samples(client) for client in evaluated)
            traffic = clients.traffic()
            samples = [update.work.samples for update in updates]  # `updates` are in the order of `trained`
            counts = None  # what a client trains and sends, as measured (`ClientWork.trained`, `costs.elements`)
            if updates:
                counts = ParameterCounts(
                    trained=max(update.work.trained for update in updates),
                    communicated=max(elements(update.upload) for update in updates),
                )
            record = RoundRecord(
                round=round_index + 1,
                clients=sampled,
                metrics={**_mean_client_metrics(updates), **server_metrics},
                trained_clients=len(trained) if trained != sampled else None,
                unanswered=[c for c in asked if c not in answered] if len(trained) < len(asked) else None,
                stragglers={str(client_id): share for client_id, share in stragglers.items()} or None,
                budget_share=cut,
                **epsilons,
                **scores,
                **traffic,
                parameter_counts=counts,
                client_samples=samples,
                cost=RoundCost(
                    bytes_down=sum(traffic["bytes_down"]),
                    bytes_up=sum(traffic["bytes_up"]),
                    client_samples=sum(samples),
                    client_flops=sum(samples) * flops.training,
                    server_samples=server_trained,
                    server_flops=server_trained * flops.training + server_inferred * flops.inference,
                    # what --eval-every costs, apart from the method's own training
                    evaluation_samples=evaluation_samples,
                    evaluation_flops=evaluation_samples * flops.training,
                ),
                timing=RoundTiming(
                    client_seconds=sum(update.work.seconds for update in updates),
                    aggregation_seconds=server_seconds - distillation_seconds,
                    distillation_seconds=distillation_seconds,
                    **peak_memory(session.device),
                ),
            )
            with deferred_interrupts():  # Ctrl-C: after the round's checkpoint, not between its files
                history.append(record)
                _save_round(session, global_state, history, paths)
            if tracking is not None:  # once the round is kept: a crash before this logs it on --resume
                tracking.log_round(record)
            progress.update(rounds_bar, advance=1, description=_round_description(record))
    return global_state


def _distiller_samples(distiller: Distiller | None) -> tuple[int, int]:
    """The distiller's samples so far, trained and inferred (`Distiller.samples_trained`, `samples_inferred`)."""
    return (distiller.samples_trained, distiller.samples_inferred) if distiller else (0, 0)


def client_samples(history: list[RoundRecord]) -> int:
    """The client training samples of the rounds of `history`, which --budget client-samples:N stops at."""
    return sum(record.cost.client_samples for record in history)


def _client_progress(session: Session, progress: Progress | ProgressLines, bar: int) -> Callable[[int], None]:
    """`Clients.train`'s `on_client`: `bar` advanced by each client as it finishes, with the training samples of
    the clients finished so far (each client's training set once, whatever its local epochs) for a samples/s."""
    samples = 0

    def finished(client_id: int) -> None:
        nonlocal samples
        samples += len(session.data.clients[client_id].train)
        progress.update(bar, advance=1, samples=samples)

    return finished


def _evaluate(
    session: Session,
    personalized: Callable[[int], AdapterState],
    global_state: dict,
    clients: Sequence[ClientData],
    **options,
) -> dict:
    """The clients' personalized adapters and the global adapter on the clients' test data."""
    return evaluate_adapters(
        session.trainer,
        personalized,
        global_state,
        clients,
        session.data.global_test,
        **options,
    )


def _mean_client_metrics(updates: list) -> dict[str, float]:
    names = updates[0].metrics.keys() if updates else []
    return {name: float(np.mean([u.metrics[name] for u in updates])) for name in names}


def _round_description(record: RoundRecord) -> str:
    parts = [f"round {record.round}"]
    if "local_loss" in record.metrics:
        parts.append(f"loss {record.metrics['local_loss']:.3f}")
    if record.personalized_local_test is not None:
        parts.append(f"local-test {100 * record.personalized_local_test:.1f}%")
    return "  ".join(parts)


def _save_round(session: Session, global_state: dict, history: list[RoundRecord], paths: RunPaths) -> None:
    tensors = {GLOBAL_PREFIX + name: tensor for name, tensor in global_state.items()}
    tensors.update({SERVER_PREFIX + name: tensor for name, tensor in session.method.server_state().items()})
    tensors.update(session.store.checkpoint_tensors())
    write_text_atomic(paths.metrics, _metrics_lines(history))
    save_checkpoint(paths.checkpoints, len(history), tensors, history)
    session.store.commit(len(history))


def _finish(
    session: Session,
    global_state: dict,
    history: list[RoundRecord],
    paths: RunPaths,
    console: Console,
    clients: Clients,
    flops: SampleFlops,
    tracking: Tracking | None = None,
) -> Report:
    federated, played = session.federated_clients, len(history)  # fewer than --rounds if --budget stopped the run
    with progress_display(console) as progress:
        finished = progress.add_task("final evaluation and export", total=len(federated))
        # Each personalized adapter is asked for once (under Flower, fetched from its node once): scored and saved.
        personalized = clients.personalized(federated, global_state, played=played, checkpointed=played)
        own = _OwnElements(clients, personalized, global_state, _first_trained(history))
        evaluation = _evaluate(
            session,
            exporting(session.model, own, paths.root),
            global_state,
            federated,
            global_test_clients={c.client_id for c in session.client_sample},
            on_client=lambda: progress.advance(finished),
        )
        session.model.save_pretrained(paths.global_adapter, global_state)
    report = build_report(
        session, evaluation, history, flops, personalized_elements=own.counted, partition=paths.partition
    )
    write_json_atomic(paths.report, report.to_json())
    if tracking is not None:
        tracking.finish(report)
    return report


def _first_trained(history: list[RoundRecord]) -> int:
    """The first client that trained in the rounds of `history` (client 0 if none did)."""
    for record in history:
        answered = [c for c in record.clients if c not in (record.unanswered or [])]
        if answered:
            return answered[0]
    return 0


class _OwnElements:
    """`personalized`, which also counts, for client `client`, the elements of its model that are its own
    (`Clients.own_elements`), as the final evaluation asks for it."""

    def __init__(
        self, clients: Clients, personalized: Callable[[int], AdapterState], global_state: AdapterState, client: int
    ) -> None:
        self.clients, self.personalized, self.global_state, self.client = clients, personalized, global_state, client
        self.counted = 0

    def __call__(self, client_id: int) -> AdapterState:
        state = self.personalized(client_id)
        if client_id == self.client:
            self.counted = self.clients.own_elements(client_id, state, self.global_state)
        return state


def exporting(
    model: AdaptedModel, personalized: Callable[[int], AdapterState], directory: Path
) -> Callable[[int], AdapterState]:
    """`personalized`, which also writes each client's adapter as it is asked for, in PEFT layout, to
    `directory/clients/<id>/`.

    Clients asked for in a row with the same state object (e.g. never-sampled ones: the initial adapter) share one
    serialization: with many clients, writing files is then all that is left to do for most of them.
    """
    last_state, files = None, {}

    def personalized_and_exported(client_id: int) -> AdapterState:
        nonlocal last_state, files
        state = personalized(client_id)
        if state is not last_state:
            last_state, files = state, model.saved_files(state)
        write_files(directory / "clients" / str(client_id), files)
        return state

    return personalized_and_exported


def build_report(
    session: Session,
    evaluation: dict,
    history: list[RoundRecord],
    flops: SampleFlops,
    *,
    personalized_elements: int,
    partition: Path,
) -> Report:
    test_sizes = [len(session.data.clients[client].test) for client in evaluation["clients"]]

    def local_test(values: list[float]) -> Stats:  # the clients' own test splits: also weighted and worst-10%
        return Stats(**mean_and_std(values), per_client=values, **local_test_statistics(values, test_sizes))

    config = session.config
    personalized = evaluation["personalized"]
    return Report(
        method=config.method.method,
        data=config.data.data,
        metric=evaluation["metric"],
        eval_split=config.data.eval_split,
        classes=list(session.class_names),
        rounds=len(history),
        seed=config.seed,
        clients=evaluation["clients"],
        personalized=Personalized(
            local_test=local_test(personalized["local_test"]),
            # a large federation scores a sample of personalized adapters on the global test set: which ones
            global_test=Stats(
                **mean_and_std(personalized["global_test"]),
                per_client=personalized["global_test"],
                clients=evaluation.get("global_test_clients"),
            ),
        ),
        global_=Global(
            local_test=local_test(evaluation["global"]["local_test"]),
            global_test=evaluation["global"]["global_test"],
        ),
        summary=flat_scores(evaluation),
        selected_on_test=select_on_test(history, len(history), evaluation),
        trainable_parameters=session.model.num_trainable(),
        backbone_parameters=session.model.num_backbone(),
        held_out_clients=[c.client_id for c in session.held_out_clients] or None,
        privacy=privacy_report(session.trainer.privacy, session.store, evaluation["clients"]),
        cost=cost_report(session, history, flops, personalized_elements),
        # The clients' data as scored: a table built from this report can be checked against the split it names.
        partition_sha256=hashlib.sha256(partition.read_bytes()).hexdigest(),
    )


def cost_report(session: Session, history: list[RoundRecord], flops: SampleFlops, personalized_elements: int) -> Cost:
    """report.json's `cost`: the rounds' costs (their records' `cost` and `timing`) in total, the final
    personalization's, with the method's parameter counts and the budget."""
    rounds = RoundCost.totals([record.cost for record in history])
    client_rounds = sum(len(record.bytes_up) for record in history)
    timings = [record.timing for record in history]
    now = peak_memory(session.device)  # the final evaluation's too
    rss = [*(t.peak_rss_bytes for t in timings), now["peak_rss_bytes"]]
    cuda = [peak for peak in (*(t.peak_cuda_bytes for t in timings), now.get("peak_cuda_bytes")) if peak is not None]
    counts = [record.parameter_counts for record in history if record.parameter_counts is not None]
    limit = budget_limit(session.config)
    personalization = personalization_reserve(session)
    return Cost(
        rounds_played=len(history),
        **{f"{key}_per_client_round": rounds[key] / max(client_rounds, 1) for key in ("bytes_down", "bytes_up")},
        **rounds,
        # the clients' models handed out after the rounds: what the method trains then (fine-tuning)
        personalization_samples=personalization,
        personalization_flops=personalization * flops.training,
        training_flops_per_sample=flops.training,
        inference_flops_per_sample=flops.inference,
        # per client, measured: its model's own elements (in the final evaluation), the most one client update
        # trained and sent (`parameter_counts` of the round records)
        parameters=Parameters(
            personalized=personalized_elements,
            trained=max((count.trained for count in counts), default=0),
            communicated=max((count.communicated for count in counts), default=0),
        ),
        budget=None
        if limit is None
        else Budget(
            client_samples=limit,
            spent=rounds["client_samples"] + personalization,
            reached=budget_reached(history, limit, personalization),
        ),
        timing=Timing(
            client_seconds=sum(t.client_seconds for t in timings),
            aggregation_seconds=sum(t.aggregation_seconds for t in timings),
            distillation_seconds=sum(t.distillation_seconds for t in timings),
            peak_rss_bytes=max(rss),
            peak_cuda_bytes=max(cuda, default=None),
        ),
    )
