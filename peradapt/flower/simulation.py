"""`peradapt train --engine flower`: the run in Flower's simulation runtime, on this machine.

The run is prepared here first (session, config.json, partition, checkpoint), so that a mistake in the settings
stops before Ray starts. Then Flower's `run_simulation` starts Ray, a ServerApp in a thread of this process that
runs peradapt's rounds with `FlowerClients`, and virtual SuperNodes whose ClientApps (`client.app`) run in Ray
worker processes. Simulated node k hosts the clients c with c mod N = k (N nodes: one per client, at most
SIMULATED_NODES); they share this run's directory, so the clients' store is the run's `client_store/`.

Workers: as many as fit the CPU cores and the clients sampled per round, each with an equal share of the cores
(and of the GPUs when the run is on one); each keeps the run's session (data and model) for all its messages.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation
from rich.console import Console

from peradapt.errors import ConfigError, PeradaptError, RunError
from peradapt.federation.lifecycle import PreparedRun
from peradapt.federation.rounds import FederatedRun
from peradapt.flower.client import app as client_app
from peradapt.flower.server import FlowerClients
from peradapt.rundir.records import Report

if importlib.util.find_spec("ray") is None:  # checked on import: before the run directory is written
    raise ConfigError("--engine flower simulates with Ray, which is not installed: pip install 'peradapt[flower]'")

SIMULATED_NODES = 100  # virtual SuperNodes at most: each is set up by a message of its own when the run starts


def simulate(run: PreparedRun, console: Console) -> Report:
    """Run the prepared run's rounds, evaluation and export in Flower's simulation; returns the report."""
    fed = run.session.config.federation
    federated = fed.clients - fed.holdout_clients
    stopped = threading.Event()
    outcome: dict[str, dict] = {}
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        outcome["report"] = FederatedRun(run, FlowerClients(grid, run, stopped=stopped.is_set), console).play()

    try:
        with _quiet():
            run_simulation(
                server_app=server_app,
                client_app=client_app,
                num_supernodes=min(federated, SIMULATED_NODES),
                backend_config=backend_config(fed.clients_per_round, run.session.device),
            )
    except PeradaptError:
        raise
    except Exception as exc:
        cause = f"{type(exc).__name__}: {next(iter(str(exc).splitlines()), '')}"  # one line: Ray's may have many
        raise RunError(f"Flower's simulation failed ({cause}): see the log above, or use --engine builtin") from exc
    finally:
        stopped.set()  # the ServerApp thread, if still waiting for nodes, gives up
    if "report" not in outcome:
        raise RunError("Flower's simulation ended before the run did: see the log above, or use --engine builtin")
    return outcome["report"]


def backend_config(clients_per_round: int, device: torch.device) -> dict:
    """Ray resources: a worker per sampled client up to the cores, the cores (and GPUs) shared out evenly."""
    cores = os.cpu_count() or 1
    workers = max(1, min(cores, clients_per_round))
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    return {
        "client_resources": {"num_cpus": cores // workers, "num_gpus": gpus / workers},
        "init_args": {"num_cpus": cores // workers * workers, "num_gpus": gpus},
    }


@contextmanager
def _quiet() -> Iterator[None]:
    """Silence two notices that say nothing to a peradapt user: Flower's deprecation of `run_simulation` (its
    replacement, `flwr run`, is for deployments: docs/DEPLOY.md) and Ray's notice of a future default for GPUs."""
    logger = logging.getLogger("flwr")
    logger.addFilter(_not_the_deprecation)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning, module=r"ray\.")
            yield
    finally:
        logger.removeFilter(_not_the_deprecation)


def _not_the_deprecation(record: logging.LogRecord) -> bool:
    return "`run_simulation` function is deprecated" not in record.getMessage()
