"""Consoles and progress for long loops (rounds, clients, distillation steps, decoding, pretraining epochs).

Everything peradapt prints is text: names, paths and error messages a user typed may hold brackets (`w[/b]`),
which rich would read as markup (and raise on, or drop). So no console or progress column parses markup.

On a terminal, progress is rich's live bars. A log (nohup, SLURM, CI: a console that is no terminal) would get
nothing from a live display, so there progress is plain lines instead (`ProgressLines`): at most one every
PROGRESS_INTERVAL_S, written as a task moves on; a line when a task that already had one ends; and every step of
a task added with `log_each_step=True` (the rounds).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from time import monotonic
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

PROGRESS_INTERVAL_S = 30.0  # without a terminal: the most frequent progress lines, for big federations' logs


def text_console(*, stderr: bool = False, **options) -> Console:
    """A rich console that prints strings as they are: never as markup."""
    return Console(stderr=stderr, markup=False, **options)


def counted(number: int, noun: str, plural: str | None = None) -> str:
    """`1 round`, `3 rounds`, `1,200 clients`: a number and its noun, in the plural (default noun + s) unless 1."""
    return f"{number:,} {noun if number == 1 else plural or noun + 's'}"


def progress_display(console: Console, *, clock: Callable[[], float] | None = None) -> Progress | ProgressLines:
    """Progress on `console`, used as a context manager with rich's `Progress` methods (add_task, advance, update,
    remove_task): live bars on a terminal, else `ProgressLines` timed by `clock` (default: `time.monotonic`).
    Fields given to add_task or update (`samples=`, `log_each_step=`) shape the lines and are ignored by the bars."""
    if not console.is_terminal:
        return ProgressLines(console, clock=clock or monotonic)
    return Progress(
        TextColumn("{task.description}", style="progress.description", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    )


@dataclass
class _Task:
    description: str
    total: float | None
    completed: float
    started: float  # on the display's clock
    log_each_step: bool
    fields: dict[str, Any] = field(default_factory=dict)
    logged: bool = False  # a line was printed for it, so its end gets one too


class ProgressLines:
    """rich's `Progress` interface for a console that is no terminal: a plain line when a task moves on and at least
    `interval` seconds of `clock` have passed since the display's last line (or since it began), when a task that
    had such a line ends, and at every step of a task added with `log_each_step=True`.

    A line says the task's description, its count (`4/10`), the rate of its `samples` field where the loop reports
    one (samples so far, per second since the task began), and the time since it began:
    `round 2: clients  4/10  812 samples/s  elapsed 0:02:13`. Slow steps (clients of minutes) get a line each; fast
    ones a line every `interval`, so a big federation's log stays short.
    """

    def __init__(
        self, console: Console, *, clock: Callable[[], float] = monotonic, interval: float = PROGRESS_INTERVAL_S
    ) -> None:
        self.console, self.clock, self.interval = console, clock, interval
        self.tasks: dict[int, _Task] = {}
        self.last_line = clock()
        self._next_id = 0

    def __enter__(self) -> ProgressLines:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def add_task(self, description: str, total: float | None = None, completed: float = 0, **fields: Any) -> int:
        task_id, self._next_id = self._next_id, self._next_id + 1
        each_step = bool(fields.pop("log_each_step", False))
        self.tasks[task_id] = _Task(description, total, completed, self.clock(), each_step, fields)
        return task_id

    def advance(self, task_id: int, advance: float = 1) -> None:
        self.update(task_id, advance=advance)

    def update(
        self,
        task_id: int,
        *,
        total: float | None = None,
        completed: float | None = None,
        advance: float | None = None,
        description: str | None = None,
        **fields: Any,
    ) -> None:
        task = self.tasks[task_id]
        task.description = task.description if description is None else description
        task.total = task.total if total is None else total
        task.fields.update(fields)
        if completed is None and advance is None:
            return
        task.completed = (task.completed if completed is None else completed) + (advance or 0)
        now = self.clock()
        ended = task.total is not None and task.completed >= task.total
        if task.log_each_step or now - self.last_line >= self.interval or (ended and task.logged):
            self.console.print(self._line(task, now), soft_wrap=True)
            self.last_line, task.logged = now, True

    def remove_task(self, task_id: int) -> None:
        del self.tasks[task_id]

    @staticmethod
    def _line(task: _Task, now: float) -> str:
        count = _amount(task.completed) + ("" if task.total is None else f"/{_amount(task.total)}")
        parts = [task.description, count]
        elapsed = now - task.started
        if "samples" in task.fields and elapsed > 0:
            rate = task.fields["samples"] / elapsed
            parts.append(f"{rate:,.0f} samples/s" if rate >= 10 else f"{rate:.2g} samples/s")  # slow: 0.17, not 0
        parts.append(f"elapsed {timedelta(seconds=round(elapsed))}")
        return "  ".join(parts)


def _amount(value: float) -> str:
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.2f}"
