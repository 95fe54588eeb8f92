"""Round checkpoints: one safetensors file per round, written atomically; only the newest is kept.

A checkpoint holds tensors (global adapter, client store) and JSON metadata (the round records so far). No pickle
is involved, so a checkpoint from anywhere is safe to load.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from peradapt.errors import writing
from peradapt.progress import counted
from peradapt.rundir.files import damaged
from peradapt.rundir.records import CheckpointMeta, RoundRecord

_META_KEY = "peradapt"
_PATTERN = "round-*.safetensors"


def checkpoint_path(directory: Path, completed_rounds: int) -> Path:
    return directory / f"round-{completed_rounds:05d}.safetensors"


def checkpointed_rounds(directory: Path) -> int:
    """The round of the newest checkpoint in `directory`, by its name (0: none)."""
    return max((int(path.stem.partition("-")[2]) for path in directory.glob(_PATTERN)), default=0)


def redo_from_round_1(directory: Path) -> str:
    """The remedy for a damaged checkpoint in `directory` (a run's checkpoints/): no older one is kept."""
    return (
        f"only the newest checkpoint is kept, so delete {directory} and run "
        f"`peradapt train --out {directory.parent} --resume` to redo the run from round 1"
    )


def save_checkpoint(
    directory: Path, completed_rounds: int, tensors: dict[str, torch.Tensor], history: list[RoundRecord]
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(directory, completed_rounds)
    tmp = path.with_suffix(".tmp")
    contiguous, seen = {}, set()
    for name, tensor in tensors.items():
        tensor = tensor.detach().cpu().contiguous()
        if tensor.numel() and tensor.data_ptr() in seen:  # a state held by several clients: safetensors wants copies
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        contiguous[name] = tensor
    with replaced_by_temporary(path, tmp), writing(tmp):
        save_file(contiguous, str(tmp), metadata={_META_KEY: json.dumps(CheckpointMeta(metrics=history).to_json())})
    for older in directory.glob(_PATTERN):
        if older != path:
            older.unlink()
    return path


def load_latest_checkpoint(directory: Path) -> tuple[dict[str, torch.Tensor], list[RoundRecord]] | None:
    """The tensors and round records of the newest checkpoint in `directory`, checked (None: there is none). Older
    ones, left by a run killed between writing a checkpoint and deleting its predecessor, are deleted once it
    loads."""
    candidates = sorted(directory.glob(_PATTERN))
    if not candidates:
        return None
    path = candidates[-1]
    remedy = redo_from_round_1(directory)
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    except (SafetensorError, OSError) as exc:
        raise damaged(path, f"not a readable safetensors file: {exc}", remedy) from None
    if _META_KEY not in metadata:
        raise damaged(path, f'its metadata has no "{_META_KEY}" entry', remedy)
    try:
        meta = json.loads(metadata[_META_KEY])
    except ValueError as exc:
        raise damaged(path, f"its metadata is not JSON: {exc}", remedy) from None
    history = CheckpointMeta.from_json(meta, path, remedy, "metadata").metrics
    rounds = [record.round for record in history]
    if path != checkpoint_path(directory, len(rounds)):
        raise damaged(path, f"its metadata records {counted(len(rounds), 'round')}, not the number in its name", remedy)
    if rounds != list(range(1, len(rounds) + 1)):
        raise damaged(path, "the rounds of its metadata are not numbered 1, 2, 3, ...", remedy)
    for older in candidates[:-1]:
        older.unlink()
    return tensors, history


def write_json_atomic(path: Path, payload: Any) -> None:
    write_text_atomic(path, json.dumps(payload, indent=2) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with replaced_by_temporary(path, tmp):
        tmp.write_text(text)


@contextmanager
def replaced_by_temporary(path: Path, tmp: Path) -> Iterator[None]:
    """The block writes `tmp`, which then replaces `path`; if it fails (a full disk), `tmp` goes too, so that a
    failed write leaves `path` as it was and no half file next to it."""
    try:
        yield
        os.replace(tmp, path)
    except BaseException as error:
        if isinstance(error, OSError) and error.filename in (None, str(tmp)):  # None: write() on a full disk
            error.filename = str(path)  # the file that could not be written is `path`: `tmp` is only how
        with suppress(OSError):  # a read-only place has no `tmp`; the error that stopped the write is the one to tell
            tmp.unlink(missing_ok=True)
        raise
