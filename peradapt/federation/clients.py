"""The clients' side of a round: what the server asks of them (`RoundTask`), where they run (`Clients`: in this
process, `LocalClients`, or in Flower ClientApps), and one client's update as every engine plays it (`play_client`),
or several clients' SGD jobs at once (`play_clients_together`, --concurrent-clients)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from rich.console import Console

from peradapt.adapters import AdapterState
from peradapt.compute.concurrent import ConcurrentSGD, unsupported_layers
from peradapt.compute.costs import ClientWork, own_elements, state_bytes
from peradapt.compute.privacy import charged_to
from peradapt.data import ClientData
from peradapt.federation.session import Session
from peradapt.methods import ClientUpdate
from peradapt.methods.base import LocalSGDMethod, trains_by_sgd_jobs
from peradapt.seeds import derive_seed


@dataclass(frozen=True)
class RoundTask:
    """What a round asks of its clients: those `trained` (in the order their updates come back), each from its
    payload (`Method.payload`: most often the one global state object for all), doing its share of its local work
    (`shares`, `LocalTrainer.work_share`: a straggler's, a --budget's last round; a client not there does all)."""

    round_index: int
    trained: list[int]
    payloads: dict[int, AdapterState]
    shares: dict[int, float] = field(default_factory=dict)

    def share(self, client_id: int) -> float:
        return self.shares.get(client_id, 1.0)


class Clients(Protocol):
    """Where the clients' side of the rounds runs: in this process (`LocalClients`, the builtin engine) or in
    Flower ClientApps (`peradapt.flower`). Both play each client with `play_client`."""

    def train(self, task: RoundTask, on_client: Callable[[int], None]) -> list[ClientUpdate]:
        """The updates of the clients `task.trained`, in their order; `on_client(client_id)` as each finishes."""

    def personalized(
        self, clients: Sequence[ClientData], global_state: AdapterState, *, played: int, checkpointed: int
    ) -> Callable[[int], AdapterState]:
        """Client id -> the adapter it is evaluated and exported with (`Method.personalized`), to be asked for
        `clients` in their order, after round `played` with the checkpoint of round `checkpointed` written."""

    def own_elements(self, client_id: int, state: AdapterState, global_state: AdapterState) -> int:
        """The elements of client `client_id`'s personalized adapter `state` (as `personalized` gave it, with
        `global_state`) that are its own (`costs.own_elements`)."""

    def traffic(self) -> dict:
        """What was sent since the last call, for the round's record: at least the bytes sent to (`bytes_down`) and
        by (`bytes_up`) each trained client, in the order of `trained`."""


class LocalClients:
    """The builtin engine's clients, simulated in this process on the session's one model: one after the other, or
    up to --concurrent-clients at once (`concurrent_training`)."""

    def __init__(self, session: Session, console: Console) -> None:
        self.session = session
        self.concurrent = concurrent_training(session, console)  # with how many clients train at once
        self._traffic: dict = {}

    def train(self, task: RoundTask, on_client: Callable[[int], None]) -> list[ClientUpdate]:
        updates = []
        if self.concurrent is None:
            for client_id in task.trained:
                payload = task.payloads[client_id]
                updates.append(play_client(self.session, client_id, payload, task.round_index, task.share(client_id)))
                on_client(client_id)
        else:
            concurrent, together = self.concurrent
            for start in range(0, len(task.trained), together):
                group = task.trained[start : start + together]
                updates += play_clients_together(self.session, concurrent, group, task, on_client)
        # What a deployment would send: the payload's tensors and the upload's, as they are (their bytes).
        self._traffic = {
            "bytes_down": [state_bytes(task.payloads[client_id]) for client_id in task.trained],
            "bytes_up": [state_bytes(update.upload) for update in updates],
        }
        return updates

    def personalized(
        self, clients: Sequence[ClientData], global_state: AdapterState, *, played: int, checkpointed: int
    ) -> Callable[[int], AdapterState]:
        return lambda client_id: self.session.method.personalized(client_id, global_state)

    def own_elements(self, client_id: int, state: AdapterState, global_state: AdapterState) -> int:
        return own_elements(state, global_state)

    def traffic(self) -> dict:
        traffic, self._traffic = self._traffic, {}
        return traffic


def play_client(
    session: Session, client_id: int, payload: AdapterState, round_index: int, share: float = 1.0
) -> ClientUpdate:
    """Client `client_id`'s side of round `round_index` (from 0): the method's client update from what the server
    sent it (the global state, or the client's own payload), seeded by (seed, round, client), so that any engine,
    process or machine gives the same numbers; `share` of its local work (`LocalTrainer.sharing`)."""
    client_seed = derive_seed(session.config.seed, round_index, client_id)
    trainer, started = session.trainer, time.perf_counter()
    samples, trained = trainer.samples_trained, trainer.elements_trained
    with charged_to(trainer.privacy, session.store, client_id), trainer.sharing(share):  # --dp-noise: its DP-SGD steps
        update = session.method.client_update(session.data.clients[client_id], payload, client_seed)
    update.work = ClientWork(
        trainer.samples_trained - samples, time.perf_counter() - started, trainer.elements_trained - trained
    )
    return update


def play_clients_together(
    session: Session,
    concurrent: ConcurrentSGD,
    client_ids: list[int],
    task: RoundTask,
    on_client: Callable[[int], None],
) -> list[ClientUpdate]:
    """`play_client` for each of `client_ids` (of those `task` trains), their SGD jobs trained at once
    (`concurrent_training`); `on_client(client_id)` is called as each finishes."""
    method, seed = session.method, session.config.seed
    assert isinstance(method, LocalSGDMethod), "concurrent_training serves only methods that train by SGD jobs"
    steps = [
        method.client_steps(session.data.clients[c], task.payloads[c], derive_seed(seed, task.round_index, c))
        for c in client_ids
    ]
    work: dict[int, ClientWork] = {}

    def finished(index: int, done: ClientWork) -> None:
        work[index] = done
        on_client(client_ids[index])

    started = time.perf_counter()
    updates = concurrent.run_steps(steps, on_finished=finished, shares=[task.share(c) for c in client_ids])
    seconds = (time.perf_counter() - started) / len(client_ids)  # one pass for all: its time shared out evenly
    for index, update in enumerate(updates):
        update.work = ClientWork(work[index].samples, seconds, work[index].trained)
    return updates


def concurrent_training(session: Session, console: Console) -> tuple[ConcurrentSGD, int] | None:
    """What trains K > 1 clients at once, and K (--concurrent-clients, or auto: `clients_at_once`), or None: one
    after another (K = 1, or a run it cannot serve, which it says)."""
    asked, method = session.config.federation.concurrent_clients, session.config.method.method
    if asked == 1 or (asked is None and session.device.type != "cuda"):
        return None  # auto on a CPU: one after another, faster there (docs/BENCHMARKS.md)
    unsupported = unsupported_layers(session.trainer.model.module)
    if not trains_by_sgd_jobs(type(session.method)):
        reason = f"--method {method} trains clients with update rules of its own, not plain local SGD"
    elif session.trainer.privacy is not None:
        reason = "--dp-noise clips and accounts every client's gradients on its own"
    elif unsupported:
        reason = f"the model's {unsupported[0]} draws random numbers that cannot be replayed client by client"
    else:
        concurrent = ConcurrentSGD(session.trainer)
        together = asked or clients_at_once(session, concurrent, console)
        return (concurrent, together) if together > 1 else None
    if asked is not None:  # auto says nothing: it chose what it could
        console.print(f"--concurrent-clients {asked}: {reason}; clients train one after another")
    return None


def clients_at_once(session: Session, concurrent: ConcurrentSGD, console: Console) -> int:
    """--concurrent-clients auto on a GPU: as many federated clients as fit --gpu-memory-fraction of its memory
    (`ConcurrentSGD.clients_at_once`), said in one line."""
    federation = session.config.federation
    clients = session.data.clients[: federation.clients - federation.holdout_clients]
    fraction = federation.gpu_memory_fraction
    together, per_client = concurrent.clients_at_once([client.train for client in clients], fraction)
    total = torch.cuda.get_device_properties(session.device).total_memory
    console.print(
        f"--concurrent-clients auto: {together} clients at once ({per_client:,} bytes each of {fraction:g} of "
        f"{total / 2**30:.0f} GiB)"
    )
    return together
