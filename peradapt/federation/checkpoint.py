"""Round checkpoints: one safetensors file per round, written atomically; only the newest is kept.

A checkpoint holds tensors (global adapter, client store) and JSON metadata (round, metrics so far). No pickle
is involved, so a checkpoint from anywhere is safe to load.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from peradapt.errors import RunError

_META_KEY = "peradapt"
_PATTERN = "round-*.safetensors"


def checkpoint_path(directory: Path, completed_rounds: int) -> Path:
    return directory / f"round-{completed_rounds:05d}.safetensors"


def save_checkpoint(directory: Path, completed_rounds: int, tensors: dict[str, torch.Tensor], meta: dict) -> Path:
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
    save_file(contiguous, str(tmp), metadata={_META_KEY: json.dumps(meta)})
    os.replace(tmp, path)
    for older in directory.glob(_PATTERN):
        if older != path:
            older.unlink()
    return path


def load_latest_checkpoint(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    candidates = sorted(directory.glob(_PATTERN))
    if not candidates:
        return None
    path = candidates[-1]
    try:
        with safe_open(str(path), framework="pt") as handle:
            meta = json.loads((handle.metadata() or {})[_META_KEY])
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, KeyError, ValueError) as exc:
        raise RunError(f"checkpoint {path} is unreadable ({exc}): delete it to resume from the one before") from None
    return tensors, meta


def write_json_atomic(path: Path, payload: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
