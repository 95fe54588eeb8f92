"""Ditto: a personalized model per client, regularized towards the FedAvg global model.

Li, Hu, Beirami and Smith, "Ditto: Fair and Robust Federated Learning Through Personalization" (ICML 2021),
Algorithm 1, as run as a full-model baseline in PerAda (Xie et al., CVPR 2024, Table 1). Each round, a sampled
client m receives w^t and

    w_m <- w^t;  w_m <- w_m - eta * grad F_m(w_m)                          E epochs  (UPDATE_GLOBAL, FedAvg)
    v_m <- v_m - eta_p * (grad F_m(v_m) + lam * (v_m - w^t))               S epochs  (the personal objective h_m)

uploads w_m and keeps v_m private. The server aggregates as FedAvg: w^{t+1} = sum_m n_m w_m / sum_m n_m, weighted
by the clients' numbers of training samples n_m, as FedAvg (McMahan et al., 2017) and Ditto's reference code
aggregate. Clients are evaluated with v_m (the initial model w^0 until a client is first sampled).

Defaults: the whole network trains (`default_scope = "full"`, Table 1 of PerAda); eta_p is `--personal-lr`
(default `--lr`); lam is `--lam`, or `--lam auto` (the engine reads `uses_proximal`).
"""

from __future__ import annotations

from peradapt.adapters import AdapterState
from peradapt.data import ClientData
from peradapt.methods.base import ClientSteps, ClientUpdate, ProximalPersonalization, register


@register
class Ditto(ProximalPersonalization):
    name = "ditto"
    summary = "FedAvg global model plus a personalized model proximal to it (Ditto, Li et al. 2021, Algorithm 1)"
    default_scope = "full"
    uses_proximal = True
    supports_dp = True

    def client_steps(self, client: ClientData, global_state: AdapterState, seed: int) -> ClientSteps:
        local, local_loss = yield self.local_job(client, global_state, seed)  # UPDATE_GLOBAL: E epochs from w^t
        # S epochs on h_m(v_m; w^t) = F_m(v_m) + lam/2 ||v_m - w^t||^2
        _, personal_loss = yield from self.proximal_personal_steps(client, global_state, seed)
        metrics = {"personal_loss": personal_loss, "local_loss": local_loss}
        return ClientUpdate(client.client_id, local, len(client.train), metrics)

    def client_samples_bound(self, client: ClientData) -> int:
        return self.local_samples(client) + self.personal_samples(client)
