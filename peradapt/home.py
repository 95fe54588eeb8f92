"""Where peradapt keeps what outlives a run: backbones (`pretrain`, pinned copies), decoded datasets, OOD sets."""

from __future__ import annotations

import os
from pathlib import Path


def peradapt_home() -> Path:
    """`$PERADAPT_HOME`, default `~/.cache/peradapt`."""
    return Path(os.environ.get("PERADAPT_HOME", Path.home() / ".cache" / "peradapt"))
