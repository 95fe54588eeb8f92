"""SCAFFOLD: local SGD corrected by control variates.

Karimireddy, Kale, Mohri, Reddi, Stich & Suresh, "SCAFFOLD: Stochastic Controlled Averaging for Federated
Learning" (ICML 2020), Algorithm 1 with option II. The server keeps the global model x and a control variate c;
each client i keeps its own c_i (zero before its first round, in the client store). In round r the server sends
(x, c) to the sampled set S (line 4; the payload's extra entries); client i (lines 5-13) runs K steps

    y_i <- x;   y_i <- y_i - eta_l (g_i(y_i) - c_i + c)                   line 10

(`SGDJob.correction` = c - c_i, so concurrent clients and DP-SGD keep it; K the steps its job took, eta_l = --lr),
then updates its control variate by option II and sends (Δy_i, Δc_i) (the upload's y_i and extra entries):

    c_i^+ <- c_i - c + (x - y_i) / (K eta_l)                               line 12, option II
    Δy_i = y_i - x,   Δc_i = c_i^+ - c_i,   c_i <- c_i^+                  line 13

The server (lines 15-17), with N the federated clients, sampled or not:

    (Δx, Δc) = (1/|S|) sum_{i in S} (Δy_i, Δc_i)
    x <- x + eta_g Δx,   c <- c + (|S| / N) Δc                            eta_g = --scaffold-server-lr

Conventions of this implementation:
- Only trainable parameters are optimization variables and carry control variates; BatchNorm running statistics
  travel with y_i and the server takes their plain mean (integer counters from the first upload), as FedDyn's.
- --aggregation samples weighs Δx by the clients' sample counts (as FedAvg's mean); Δc stays the plain mean of
  line 16, which keeps c the mean of the clients' c_i.
- Every client is evaluated and exported with x: SCAFFOLD is a global-model baseline (generic FL), trained in
  full unless --scope says otherwise.
- A client that takes no step (a straggler or a --budget round that leaves it nothing) keeps its c_i and sends
  Δy = Δc = 0: option II divides by K.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch

from peradapt.adapters import AdapterState, average_states
from peradapt.data import ClientData
from peradapt.methods.base import ClientSteps, ClientUpdate, MethodContext, register
from peradapt.methods.fedavg import FedAvg
from peradapt.settings import setting

CONTROL_KEY = "scaffold_control"  # c_i in the client store
CONTROL = "scaffold.c/"  # the payload's entries: the server's c, by parameter name
CONTROL_DELTA = "scaffold.delta_c/"  # the upload's entries: Δc_i, by parameter name

Tensors = dict[str, torch.Tensor]


@dataclass
class ScaffoldSettings:
    scaffold_server_lr: float = setting(
        1.0,  # Karimireddy et al., Sec. 7: "we always use global step-size eta_g = 1"
        help="SCAFFOLD's global step size η_g: x <- x + η_g Δx.",
        minimum=0.0,
        exclusive_minimum=True,
        symbol="η_g",
    )


@register
class Scaffold(FedAvg):
    name = "scaffold"
    summary = "SCAFFOLD: local SGD corrected by control variates c - c_i (Karimireddy et al. 2020, Algorithm 1, II)"
    default_aggregation = "uniform"  # lines 16-17: (1/|S|) sum over the sampled clients
    settings_class = ScaffoldSettings
    settings: ScaffoldSettings

    def __init__(self, context: MethodContext) -> None:
        super().__init__(context)
        self.num_clients = context.federated if context.federated is not None else len(context.clients)  # N
        self.control: Tensors | None = None  # the server's c; None: zero

    def payload(self, client_id: int, global_state: AdapterState) -> AdapterState:
        """(x, c): the global state and, under `CONTROL`-prefixed names, the server's control variate (line 4)."""
        return {**global_state, **{CONTROL + name: c for name, c in self._control(global_state).items()}}

    def client_steps(self, client: ClientData, global_state: AdapterState, seed: int) -> ClientSteps:
        x = {name: t for name, t in global_state.items() if not name.startswith(CONTROL)}
        c = {name[len(CONTROL) :]: t for name, t in global_state.items() if name.startswith(CONTROL)}
        names = list(c)
        own = self.store.get(client.client_id, CONTROL_KEY) or zeros(x, names)  # c_i
        job = replace(self.local_job(client, x, seed), correction={n: c[n] - own[n] for n in names})  # line 10
        steps = self.trainer.steps_of(job)
        y, loss = yield job
        if steps:  # option II (line 12)
            updated = {name: own[name] - c[name] + (x[name] - y[name]) / (steps * job.lr) for name in names}
        else:
            updated = own
        self.store.put(client.client_id, CONTROL_KEY, updated)
        upload = {**y, **{CONTROL_DELTA + name: updated[name] - own[name] for name in names}}
        return ClientUpdate(client.client_id, upload, len(client.train), {"local_loss": loss})

    def server_update(
        self,
        global_state: AdapterState,
        updates: list[ClientUpdate],
        seed: int,
        round_index: int,
        on_step: Callable[[int], None] | None = None,
    ) -> tuple[AdapterState, dict[str, float]]:
        c = self._control(global_state)
        models = [
            replace(u, upload={n: t for n, t in u.upload.items() if not n.startswith(CONTROL_DELTA)}) for u in updates
        ]
        mean_y = self.server_mean(models)  # (1/|S|) sum y_i (or --aggregation samples); statistics: the mean too
        mean_dc = average_states([{n: u.upload[CONTROL_DELTA + n] for n in c} for u in updates])  # always 1/|S|
        eta_g = self.settings.scaffold_server_lr
        x = dict(mean_y)
        for name in c:  # x <- x + eta_g (1/|S|) sum (y_i - x)
            x[name] = global_state[name] + eta_g * (mean_y[name] - global_state[name])
        share = len(updates) / self.num_clients
        self.control = {name: c[name] + share * mean_dc[name] for name in c}  # c <- c + (|S|/N) Δc
        return x, {}

    def server_state(self) -> dict[str, torch.Tensor]:
        return dict(self.control) if self.control is not None else {}

    def load_server_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.control = dict(tensors) or None

    def _control(self, state: AdapterState) -> Tensors:
        return self.control or zeros(state, self.trainer.model.trainable_parameters())


def zeros(state: AdapterState, names: Iterable[str]) -> Tensors:
    """Zero tensors shaped as `state`'s entries `names`: c^0 and every c_i^0."""
    return {name: torch.zeros_like(state[name]) for name in names}
