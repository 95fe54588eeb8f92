"""FedDyn: federated learning with a dynamic regularizer per client.

Acar, Zhao, Matas Navarro, Mattina, Whatmough & Saligrama, "Federated Learning Based on Dynamic Regularization"
(ICLR 2021), Algorithm 1; a generic-FL baseline of PerAda's Table 2 (full model). Client k, sampled in round t
(the set P_t), receives theta^{t-1} and approximately solves

    theta_k^t = argmin_theta  L_k(theta) - <grad L_k(theta_k^{t-1}), theta> + alpha/2 ||theta - theta^{t-1}||^2

with E epochs (--local-epochs, or --local-steps minibatch steps) of SGD at --lr, then updates the gradient state it
keeps in the client store (zero before its first round):

    grad L_k(theta_k^t) = grad L_k(theta_k^{t-1}) - alpha (theta_k^t - theta^{t-1}).

The server keeps h (zero at first; server state, saved in every checkpoint and restored on --resume), with m the
number of clients in the federation, sampled or not:

    h^t     = h^{t-1} - alpha (1/m) sum_{k in P_t} (theta_k^t - theta^{t-1})
    theta^t = (1/|P_t|) sum_{k in P_t} theta_k^t - (1/alpha) h^t.

The gradient of the client objective is grad L_k(theta) + alpha (theta - a_k) with the shifted anchor
a_k = theta^{t-1} + grad L_k(theta_k^{t-1}) / alpha, so the client step is proximal SGD towards a_k
(`LocalTrainer.sgd`, which --dp-noise makes DP-SGD). Every client is evaluated and exported with the global model.

Conventions of this implementation:
- alpha is --feddyn-alpha (0.01, the authors' released CIFAR-10 script). `--feddyn-client-alpha by-size` gives
  client k alpha_k = alpha * n_mean / n_k (n_k its training samples, n_mean their mean over the federation), as
  the authors' code does; the server keeps the common alpha, so h tracks the same parameter drift either way.
- Only trainable parameters are optimization variables. BatchNorm running statistics are not: clients upload the
  statistics their training accumulated, and the server takes their plain mean (integer counters from the first
  upload), without the h correction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from peradapt.adapters import AdapterState
from peradapt.data import ClientData
from peradapt.methods.base import ClientSteps, ClientUpdate, MethodContext, register
from peradapt.methods.fedavg import FedAvg
from peradapt.settings import Search, setting

GRADIENT_KEY = "feddyn_gradient"  # grad L_k(theta_k^{t-1}) in the ClientStore
CLIENT_ALPHAS = ("uniform", "by-size")

Tensors = dict[str, torch.Tensor]


@dataclass
class FedDynSettings:
    feddyn_alpha: float = setting(
        0.01,  # the authors' CIFAR-10 script
        help="FedDyn α: weight of the dynamic regularizer.",
        minimum=0.0,
        exclusive_minimum=True,
        symbol="α",
        search=Search.log(1e-3, 0.1),  # Acar et al. (Sec. 5) choose α from {0.1, 0.01, 0.001}
    )
    feddyn_client_alpha: str = setting(
        "uniform",
        help="FedDyn α per client: uniform (Algorithm 1) or by-size (the authors' code: α·n̄/n_k, n_k the client's "
        "samples, n̄ their mean).",
        choices=CLIENT_ALPHAS,
        symbol="α_k",
    )


@register
class FedDyn(FedAvg):
    name = "feddyn"
    summary = "FedDyn: local problems with a dynamic linear + quadratic regularizer (Acar et al. 2021, Algorithm 1)"
    default_scope = "full"  # PerAda Table 2: "FedDyn, generic FL, Full"
    default_aggregation = "uniform"  # Algorithm 1: (1/|P_t|) sum_k theta_k^t
    settings_class = FedDynSettings
    settings: FedDynSettings

    def __init__(self, context: MethodContext) -> None:
        super().__init__(context)
        self.num_clients = context.federated if context.federated is not None else len(context.clients)  # m
        self.h: Tensors | None = None  # the server state h^{t-1}; None: zero

    def client_alpha(self, client: ClientData) -> float:
        """alpha, or with --feddyn-client-alpha by-size the authors' alpha * n_mean / n_k."""
        alpha = self.settings.feddyn_alpha
        if self.settings.feddyn_client_alpha == "uniform":
            return alpha
        sizes = [len(c.train) for c in self.context.clients[: self.num_clients]]
        return alpha * (sum(sizes) / len(sizes)) / len(client.train)

    def client_steps(self, client: ClientData, global_state: AdapterState, seed: int) -> ClientSteps:
        alpha = self.client_alpha(client)
        names = list(self.trainer.model.trainable_parameters())
        gradient = self.store.get(client.client_id, GRADIENT_KEY) or zeros(global_state, names)
        anchor = {n: global_state[n] + gradient[n] / alpha for n in names}  # a_k = theta^{t-1} + grad L_k / alpha
        local, loss = yield self.local_job(
            client,
            global_state,
            seed,
            anchor=anchor,
            lam=alpha,
        )
        updated = {n: gradient[n] - alpha * (local[n] - global_state[n]) for n in names}
        self.store.put(client.client_id, GRADIENT_KEY, updated)
        return ClientUpdate(client.client_id, local, len(client.train), {"local_loss": loss})

    def server_update(
        self,
        global_state: AdapterState,
        updates: list[ClientUpdate],
        seed: int,
        round_index: int,
        on_step: Callable[[int], None] | None = None,
    ) -> tuple[AdapterState, dict[str, float]]:
        alpha, m = self.settings.feddyn_alpha, self.num_clients
        mean = self.server_mean(updates)  # (1/|P_t|) sum_k theta_k^t; statistics too
        h = self.h or zeros(global_state, self.trainer.model.trainable_parameters())
        drift = {n: sum(update.upload[n] - global_state[n] for update in updates) for n in h}
        self.h = {n: h[n] - alpha / m * drift[n] for n in h}
        new_state = dict(mean)
        for name, h_t in self.h.items():
            new_state[name] = mean[name] - h_t / alpha
        return new_state, {}

    def server_state(self) -> dict[str, torch.Tensor]:
        return dict(self.h) if self.h is not None else {}

    def load_server_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.h = dict(tensors) or None


def zeros(state: AdapterState, names: Iterable[str]) -> Tensors:
    """Zero tensors shaped as `state`'s entries `names`: the initial grad L_k(theta_k^0) and h^0."""
    return {name: torch.zeros_like(state[name]) for name in names}
