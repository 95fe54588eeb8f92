"""Standalone: every client trains its own model on its own data and nothing is communicated.

The "Standalone" row of PerAda's Table 1 (Xie et al., CVPR 2024): a full model per client, 0 communicated
parameters, so the whole network trains unless --scope says otherwise. Each round client m is sampled it
continues from its own stored model v_m (the initial model v_m^0 = w^0 the first time):

    v_m <- v_m - eta * grad L_m(v_m)                                      E = --local-epochs epochs

It uploads nothing and the server leaves the global model at w^0; client m is evaluated and exported with v_m.
"""

from __future__ import annotations

from collections.abc import Callable

from peradapt.adapters import AdapterState
from peradapt.data import ClientData
from peradapt.methods.base import ClientSteps, ClientUpdate, LocalSGDMethod, register

OWN_KEY = "own"


@register
class Standalone(LocalSGDMethod):
    name = "standalone"
    summary = "each client trains alone on its own data; nothing is communicated (PerAda Table 1)"
    default_scope = "full"
    default_aggregation = None  # nothing is sent, nothing averaged
    supports_dp = True

    def client_steps(self, client: ClientData, global_state: AdapterState, seed: int) -> ClientSteps:
        own, loss = yield self.local_job(client, self.personalized(client.client_id, global_state), seed)
        self.store.put(client.client_id, OWN_KEY, own)
        return ClientUpdate(client.client_id, {}, len(client.train), {"local_loss": loss})

    def client_samples_bound(self, client: ClientData) -> int:
        return self.local_samples(client)

    def payload(self, client_id: int, global_state: AdapterState) -> AdapterState:
        return {}  # nothing is sent: v_m^0 = w^0 is the initial model every client builds from the run's seed

    def server_update(
        self,
        global_state: AdapterState,
        updates: list[ClientUpdate],
        seed: int,
        round_index: int,
        on_step: Callable[[int], None] | None = None,
    ) -> tuple[AdapterState, dict[str, float]]:
        return global_state, {}

    def personalized(self, client_id: int, global_state: AdapterState) -> AdapterState:
        return self.store.get(client_id, OWN_KEY) or self.context.initial
