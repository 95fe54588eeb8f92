"""Where peradapt keeps what outlives a run: backbones (`pretrain`, pinned copies), decoded datasets, OOD sets; and
how it reads its environment variables."""

from __future__ import annotations

import os
from pathlib import Path


def environment_setting(name: str) -> str | None:
    """Environment variable `name`, None where it is unset or empty: `NAME=` in a shell, a job script or a CI
    file's env block means "not set", not a setting of "" (an empty path, tracking URI or project name)."""
    return os.environ.get(name) or None


def peradapt_home() -> Path:
    """`$PERADAPT_HOME`, default `~/.cache/peradapt`."""
    return Path(environment_setting("PERADAPT_HOME") or Path.home() / ".cache" / "peradapt")
