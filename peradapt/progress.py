"""Consoles and progress bars for long loops (rounds, clients, distillation steps, pretraining epochs).

Everything peradapt prints is text: names, paths and error messages a user typed may hold brackets (`w[/b]`),
which rich would read as markup (and raise on, or drop). So no console or progress column parses markup.
"""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


def text_console(*, stderr: bool = False, **options) -> Console:
    """A rich console that prints strings as they are: never as markup."""
    return Console(stderr=stderr, markup=False, **options)


def progress_display(console: Console) -> Progress:
    """A rich Progress on `console`; use it as a context manager."""
    return Progress(
        TextColumn("{task.description}", style="progress.description", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not console.is_terminal,
    )
