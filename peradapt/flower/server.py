"""The server's side under Flower: the clients of peradapt's round loop reached through a Flower Grid, and the
ServerApp that `flwr run` starts on a SuperLink.

`FlowerClients` is the engine's `Clients` for Flower: it connects the nodes once (setup), then sends each round's
sampled clients to their nodes and waits for the replies, and fetches personalized adapters for evaluation and
export. The loop, `Method.server_update`, evaluation, checkpoints and exports are `federation.engine`'s own.

The ServerApp (`app`) reads its run config, as `flwr run` passes it (docs/DEPLOY.md):

    config   a peradapt train config file (YAML or JSON, the keys of `peradapt train`), a path on the SuperLink
    out      the run directory, on the SuperLink's machine
    resume   true: continue the run in `out` from its newest checkpoint (`config` may then change --rounds etc.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import TypeVar

from flwr.app import Context, Message
from flwr.serverapp import Grid, ServerApp

from peradapt.adapters import AdapterState
from peradapt.config import TrainConfig, read_config_file
from peradapt.data import ClientData
from peradapt.errors import ConfigError, RunError
from peradapt.federation.clients import RoundTask
from peradapt.federation.lifecycle import PreparedRun, opened_run, resume_config
from peradapt.federation.rounds import FederatedRun
from peradapt.flower import records as r
from peradapt.flower.strategy import PeradaptStrategy
from peradapt.methods import ClientUpdate
from peradapt.progress import counted, text_console

NODE_WAIT_S = 600  # how long the server waits for SuperNodes that host every client to connect
REPLY_TIMEOUT_S = 3600  # how long it waits for one step's replies (Flower's strategies wait as long)
POLL_S = 0.05
PREFETCH = 16  # personalized adapters asked for at once: nodes work in parallel, memory holds this many

Key = TypeVar("Key", bound=Hashable)


class FlowerClients:
    """The clients of a run, played by Flower ClientApps on the nodes of `grid`."""

    def __init__(self, grid: Grid, run: PreparedRun, *, stopped: Callable[[], bool] = lambda: False) -> None:
        self.grid = grid
        self.session = run.session
        self.strategy = PeradaptStrategy(run.session, run.paths.root)
        self.stopped = stopped  # the simulation runtime has ended: no reply will come
        self._connected = False

    def train(self, task: RoundTask, on_client: Callable[[int], None]) -> list[ClientUpdate]:
        self._connect()
        messages = self.strategy.configure_train(task)
        return self.strategy.aggregate_train(task.trained, self._exchange(messages, "client", on_client))

    def personalized(
        self, clients: Sequence[ClientData], global_state: AdapterState, *, played: int, checkpointed: int
    ) -> Callable[[int], AdapterState]:
        self._connect()
        order = [client.client_id for client in clients]
        position = {client_id: i for i, client_id in enumerate(order)}
        global_arrays = r.to_record(global_state)
        ready: dict[int, AdapterState] = {}

        def personalized(client_id: int) -> AdapterState:
            nonlocal ready
            if client_id not in ready:  # the next PREFETCH clients, from this one on
                start = position[client_id]
                batch = order[start : start + PREFETCH]
                messages = self.strategy.configure_personalized(
                    batch, global_arrays, played=played, checkpointed=checkpointed
                )
                ready = self.strategy.aggregate_personalized(self._exchange(messages, "client"), global_state)
            return ready[client_id]

        return personalized

    def own_elements(self, client_id: int, state: AdapterState, global_state: AdapterState) -> int:
        return self.strategy.own_elements[client_id]  # counted on the node, before its state travelled

    def traffic(self) -> dict:
        return self.strategy.traffic()

    def _connect(self) -> None:
        """Set up every node until each federated client has one; SuperNodes may still be connecting."""
        if self._connected:
            return
        federated = [client.client_id for client in self.session.federated_clients]
        deadline = time.monotonic() + NODE_WAIT_S
        while True:
            new = [node for node in self.grid.get_node_ids() if node not in self.strategy.nodes]
            if new:
                self.strategy.aggregate_setup(self._exchange(self.strategy.configure_setup(new), "SuperNode"))
            unhosted = self.strategy.unhosted(federated)
            if not unhosted:
                self._connected = True
                return
            if self.stopped() or time.monotonic() > deadline:
                partitions = sorted(partition for partition, _ in self.strategy.nodes.values())
                raise RunError(
                    f"no Flower node hosts client {unhosted[0]} ({counted(len(unhosted), 'client')} unhosted; nodes "
                    f"connected with partition-id {partitions or 'none'}): start a SuperNode for every partition, "
                    "--node-config 'partition-id=K num-partitions=N' with K = 0 .. N-1 (client c goes to K = c mod N)"
                )
            time.sleep(1.0)

    def _exchange(
        self, messages: list[tuple[Key, Message]], what: str, on_reply: Callable[[Key], None] = lambda key: None
    ) -> dict[Key, Message]:
        """Send every message and wait for all replies, calling `on_reply(key)` as each comes; a node's error stops
        the run with its reason."""
        pending: dict[str, Key] = {}
        for key, message in messages:
            sent = list(self.grid.push_messages([message]))
            if not sent:
                raise RunError(f"Flower did not accept the message to {what} {key}: is its node still connected?")
            pending[sent[0]] = key
        replies: dict[Key, Message] = {}
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while pending:
            for reply in self.grid.pull_messages(list(pending)):
                key = pending.pop(reply.metadata.reply_to_message_id)
                if reply.has_error():
                    raise RunError(f"{what} {key} failed on its Flower node: {reply.error.reason}")
                replies[key] = reply
                on_reply(key)
            if pending:
                if self.stopped():
                    raise RunError("Flower's runtime stopped while the server waited for its nodes")
                if time.monotonic() > deadline:
                    raise RunError(f"no reply from {what} {next(iter(pending.values()))} in {REPLY_TIMEOUT_S} s")
                time.sleep(POLL_S)
        return replies


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """`flwr run`: the run of the run config's `config` file into `out`, with clients on the SuperNodes."""
    console = text_console(stderr=True)
    config, resume = deployed_config(context.run_config)
    with opened_run(config, resume=resume, console=console) as run:
        FederatedRun(run, FlowerClients(grid, run), console).play()
    console.print(f"run directory: {config.out}")


def deployed_config(run_config: dict) -> tuple[TrainConfig, bool]:
    """The train config that the ServerApp's run config names, and whether to resume."""
    config_file, out = str(run_config.get("config", "")), str(run_config.get("out", ""))
    if not out:
        raise ConfigError("the Flower run config needs out = RUN_DIRECTORY (flwr run --run-config 'out=\"DIR\"')")
    settings = read_config_file(config_file) if config_file else {}
    settings.update(engine="flower", out=out)
    resume = bool(run_config.get("resume", False))
    if resume:
        return resume_config(Path(out), settings), True
    if not config_file:
        raise ConfigError("the Flower run config needs config = TRAIN_CONFIG_FILE (the keys of peradapt train)")
    return TrainConfig.from_flat(settings), False
