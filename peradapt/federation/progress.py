"""What a run shows as it goes: an observer of the round loop's events (`RoundEvents`), so that the loop itself
says only what happened. `RoundProgress` draws them as bars on a terminal, or as lines in a log
(`peradapt.progress.progress_display`)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from types import TracebackType
from typing import Protocol

from rich.console import Console

from peradapt.progress import progress_display
from peradapt.rundir.records import RoundRecord


class RoundEvents(Protocol):
    """The events of a run's rounds and its end, in the order they happen."""

    def clients_started(self, round_index: int, clients: int) -> Callable[[int], None]:
        """Round `round_index` (from 0) asks `clients` clients to train; returns what is called with each client's
        id as it finishes (`Clients.train`'s `on_client`)."""

    def clients_finished(self) -> None: ...

    def server_started(self, round_index: int, steps: int) -> Callable[[int], None]:
        """The server update of round `round_index` starts, `steps` steps reported (`Method.server_steps`); returns
        its `on_step`."""

    def server_finished(self) -> None: ...

    def round_finished(self, record: RoundRecord) -> None:
        """The round is kept: its checkpoint written."""

    def final_started(self, clients: int) -> Callable[[], None]:
        """The final evaluation and export of `clients` clients starts; returns what is called after each."""

    def final_finished(self) -> None: ...


class RoundProgress:
    """`RoundEvents` as progress bars (or log lines), used as a context manager: one display for the rounds, with
    a bar for them, one for a round's clients (with the samples/s of their training sets) and one for its server
    steps; then one for the final evaluation."""

    def __init__(self, console: Console, rounds: int, played: int, samples_of: Callable[[int], int]) -> None:
        """`rounds`: --rounds, of which `played` are kept already; `samples_of(client_id)`: a client's training
        images, for the clients' samples/s."""
        self.console, self.rounds, self.played, self.samples_of = console, rounds, played, samples_of
        self.shown = ExitStack()

    def __enter__(self) -> RoundProgress:
        self.progress = self.shown.enter_context(progress_display(self.console))
        # without a terminal, a line per round (`ProgressLines`): what a live display shows as it goes
        self.rounds_bar = self.progress.add_task("rounds", total=self.rounds, completed=self.played, log_each_step=True)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.shown.close()

    def clients_started(self, round_index: int, clients: int) -> Callable[[int], None]:
        bar = self.progress.add_task(f"round {round_index + 1}: clients", total=clients, samples=0)
        self.clients_bar, samples = bar, 0

        def finished(client_id: int) -> None:
            nonlocal samples
            samples += self.samples_of(client_id)  # each client's training set once, whatever its local epochs
            self.progress.update(bar, advance=1, samples=samples)

        return finished

    def clients_finished(self) -> None:
        self.progress.remove_task(self.clients_bar)

    def server_started(self, round_index: int, steps: int) -> Callable[[int], None]:
        bar = self.server_bar = self.progress.add_task(f"round {round_index + 1}: server", total=max(steps, 1))
        return lambda step: self.progress.update(bar, completed=step)

    def server_finished(self) -> None:
        self.progress.remove_task(self.server_bar)

    def round_finished(self, record: RoundRecord) -> None:
        self.progress.update(self.rounds_bar, advance=1, description=_round_description(record))

    def final_started(self, clients: int) -> Callable[[], None]:
        self.shown.close()  # the rounds' display ends, and the final evaluation's begins
        self.progress = self.shown.enter_context(progress_display(self.console))
        bar = self.progress.add_task("final evaluation and export", total=clients)
        return lambda: self.progress.advance(bar)

    def final_finished(self) -> None:
        self.shown.close()


def _round_description(record: RoundRecord) -> str:
    parts = [f"round {record.round}"]
    if "local_loss" in record.metrics:
        parts.append(f"loss {record.metrics['local_loss']:.3f}")
    if record.personalized_local_test is not None:
        parts.append(f"local-test {100 * record.personalized_local_test:.1f}%")
    return "  ".join(parts)
