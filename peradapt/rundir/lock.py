"""Guards of a run directory: one writer at a time, and Ctrl-C only between consistent states.

`RunLock` is an advisory lock (`flock`) on the run directory itself, so it leaves no file behind and dies with its
process (a `kill -9` never leaves a stale lock). `train` holds it exclusively for the whole run; `eval`, `export`,
`personalize` and `report` hold it shared, so they refuse a directory a `train` is writing, and a `train` refuses one
they are reading. Systems without `flock` (Windows) get no lock.

`deferred_interrupts` holds back Ctrl-C (SIGINT) while a round's record and checkpoint are written, so that an
interrupted run stops after a whole round or before it, never between a checkpoint and its client store.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Concatenate, ParamSpec, TypeVar

from peradapt.errors import RunError

try:
    import fcntl
except ImportError:  # Windows: no advisory locks on directories
    fcntl = None  # type: ignore[assignment]

P = ParamSpec("P")
R = TypeVar("R")


class RunLock:
    """`with RunLock(run_dir, exclusive=True):` creates `run_dir` if needed and holds it for one writer;
    `exclusive=False` holds an existing directory for readers (a missing one is left to the reader to refuse)."""

    def __init__(self, run_dir: Path, *, exclusive: bool) -> None:
        self.run_dir = run_dir
        self.exclusive = exclusive
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        if self.exclusive:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        elif not self.run_dir.is_dir():
            return self
        if fcntl is None:
            return self
        fd = os.open(self.run_dir, os.O_RDONLY)
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if self.exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if self.exclusive:
                raise RunError(
                    f"{self.run_dir} is in use by another peradapt process (a train writing it, or an eval, export, "
                    "personalize or report reading it): wait for it to end, or pass another --out"
                ) from None
            raise RunError(
                f"{self.run_dir} is being written by a running `peradapt train`: wait for it to end"
            ) from None
        self._fd = fd
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None):
        if self._fd is not None:
            os.close(self._fd)  # which releases the lock
            self._fd = None


def reads_run(function: Callable[Concatenate[Path, P], R]) -> Callable[Concatenate[Path, P], R]:
    """`function(run_dir, ...)` under a shared `RunLock` of `run_dir`: refused while a `train` writes it."""

    @functools.wraps(function)
    def locked(run_dir: Path, *args: P.args, **kwargs: P.kwargs) -> R:
        with RunLock(run_dir, exclusive=False):
            return function(run_dir, *args, **kwargs)

    return locked


@contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Ctrl-C inside the block takes effect when the block ends (as a KeyboardInterrupt). Only the main thread
    receives signals, so elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt
