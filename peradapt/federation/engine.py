"""The builtin engine, and how a run is cut: `train` opens a run directory (`federation.lifecycle`), plays its rounds
(`federation.rounds.FederatedRun`: sample, client updates, server update, evaluate, checkpoint) and ends it
(`federation.finish`), each client's side played in this process (`federation.clients`).

`train` runs a federation from a config into a run directory; `--resume` continues from the newest checkpoint
and, because every random draw is derived from (seed, round, client, phase), ends with exactly the numbers an
uninterrupted run gives. The client store (memory or disk, `--client-store`) is restored to that checkpoint and
committed after each one, so clients' private state always matches the checkpoint's round (see `store`).

The loop is the same for both engines (`--engine`); only where the clients' side runs differs (`Clients`): here
(`LocalClients`), one client after the other (`play_client`) or --concurrent-clients at once
(`play_clients_together`), or in Flower ClientApps that receive the global adapter and send their uploads back
(`peradapt.flower`, each playing its client with `play_client`). Checkpoints: `federation.checkpoints`; --budget:
`federation.budget`; what a user sees: `federation.progress`, an observer of the rounds' events.

Nothing in the loop grows with the number of clients M beyond the data: one model serves every client, a disk
store holds the states, and in federations of more than CLIENT_SAMPLE clients the evaluations that cost a state
or a large pass per client use the session's seeded `client_sample`.
"""

from __future__ import annotations

from rich.console import Console

from peradapt.config import TrainConfig
from peradapt.errors import ConfigError
from peradapt.federation.clients import LocalClients
from peradapt.federation.lifecycle import opened_run
from peradapt.federation.rounds import FederatedRun
from peradapt.progress import text_console
from peradapt.rundir.records import Report


def train(config: TrainConfig, *, resume: bool = False, console: Console | None = None) -> Report:
    """Run (or continue) a federation on the builtin engine; returns the report also written to `report.json`.
    (`peradapt.commands.training.train` picks the engine the config names.)"""
    if config.federation.engine != "builtin":
        raise ConfigError(f"--engine {config.federation.engine}: train with peradapt.commands.training.train")
    console = console or text_console(stderr=True)
    with opened_run(config, resume=resume, console=console) as run:
        return FederatedRun(run, LocalClients(run.session, console), console).play()
