"""A round's checkpoint, written after every round and read back on --resume: the global adapter (`global/`), the
method's server state (`server/`), the clients' private states (`clients/`), and the round records, which
metrics.jsonl repeats; each checked against the session as it loads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from peradapt.adapters import AdapterState
from peradapt.federation.session import Session
from peradapt.rundir.checkpoint import checkpoint_path, redo_from_round_1, save_checkpoint, write_text_atomic
from peradapt.rundir.files import damaged
from peradapt.rundir.layout import RunPaths
from peradapt.rundir.records import RoundRecord

GLOBAL_PREFIX = "global/"


SERVER_PREFIX = "server/"  # the method's server state (`Method.server_state`) in round checkpoints


_CLIENT_TENSOR = re.compile(r"clients/\d+/\w+/.+")  # a client state in a checkpoint (`ClientStore`)


def restored(
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


def metrics_lines(history: list[RoundRecord]) -> str:
    """metrics.jsonl: a JSON line per round."""
    return "".join(json.dumps(record.to_json()) + "\n" for record in history)


def save_round(session: Session, global_state: dict, history: list[RoundRecord], paths: RunPaths) -> None:
    tensors = {GLOBAL_PREFIX + name: tensor for name, tensor in global_state.items()}
    tensors.update({SERVER_PREFIX + name: tensor for name, tensor in session.method.server_state().items()})
    tensors.update(session.store.checkpoint_tensors())
    write_text_atomic(paths.metrics, metrics_lines(history))
    save_checkpoint(paths.checkpoints, len(history), tensors, history)
    session.store.commit(len(history))
