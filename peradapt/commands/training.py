"""Training with the engine a config names: the builtin round loop, or Flower's simulation (`--engine flower`).

Above both engines, so that neither imports the other: `federation.engine` runs the rounds, `flower` drives the
same loop through Flower and imports the engine.
"""

from __future__ import annotations

from rich.console import Console

from peradapt.config import TrainConfig
from peradapt.federation import engine
from peradapt.federation.lifecycle import opened_run
from peradapt.progress import text_console
from peradapt.rundir.records import Report


def train(config: TrainConfig, *, resume: bool = False, console: Console | None = None) -> Report:
    """Run (or continue, `resume`) the federation of `config`; returns the report also written to `report.json`."""
    console = console or text_console(stderr=True)
    if config.federation.engine != "flower":
        return engine.train(config, resume=resume, console=console)
    from peradapt.flower.simulation import simulate  # needs flwr: imported for --engine flower only

    if (config.federation.concurrent_clients or 1) > 1:
        console.print(
            f"--concurrent-clients {config.federation.concurrent_clients}: each Flower ClientApp trains its one client"
        )

    with opened_run(config, resume=resume, console=console) as run:
        return simulate(run, console)
