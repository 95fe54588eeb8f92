"""Personalized FedProx: a model per client shrunk towards a global model by a proximal term.

Yu, He, Sun, Xue & Li, "The Effect of Personalization in FedProx: A Fine-grained Analysis on Statistical
Accuracy and Communication Efficiency", objective (1)

    min_{w_g, {w_i}}  Σ_i p_i ( L_i(w_i) + lam/2 ||w_g - w_i||² ),

solved by Algorithm 1 (One-stage FedProx). Client i, sampled in round t, warm-starts from its stored w_i
(w_{t,0} = w_{t-1,K}, line 3; the initial adapter before its first round) and runs proximal SGD on
h_i(w_i, w_g) = L_i(w_i) + lam/2 ||w_g - w_i||² (eq. 11, line 5; minibatches as Remark 1 allows):

    w_i <- w_i - eta * (grad L_i(w_i) + lam * (w_i - w_g))         `--personal-epochs` epochs, eta = --personal-lr

then pushes w_i, from which the server forms grad^F_i(w_g) = lam (w_g - w_i) (line 6) and takes the step of
eq. (10) / line 7, averaging over the sampled clients as Algorithm 1 averages with 1/m:

    w_g <- w_g - gamma * mean_i lam (w_g - w_i) = w_g - beta * (w_g - mean_i w_i),   beta = gamma * lam.

`--beta` is that product (default 1: gamma = 1/lam, the global step of the paper's MNIST experiments,
Section 6.1, so the global model becomes the mean personalized model). The step applies to the trainable
parameters, the optimization variables of eq. (10). BatchNorm running statistics are not optimization variables:
the server takes their plain mean (1/m) sum_i, as pFedMe does, so that beta > 1 cannot push a running variance
below zero; integer step counters come from the first upload. Clients are evaluated with their own w_i.

Defaults: FedProx is not a personalized baseline of PerAda's Table 1, so it trains adapters
(`default_scope = "adapter"`, backbone frozen); `--scope full` trains the whole network. `--lam auto` picks lam
with the paper's Theorem 1 rule (see `auto_lam`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import ClassVar

from peradapt.adapters import AdapterState
from peradapt.data import ClientData
from peradapt.methods.base import ClientSteps, ClientUpdate, ProximalPersonalization, ServerStepSettings, register
from peradapt.settings import Search


@register
class FedProx(ProximalPersonalization):
    name = "fedprox"
    summary = "personalized FedProx: proximal local models, server gradient step on the Moreau envelope (Alg. 1)"
    default_scope = "adapter"
    default_aggregation = "uniform"  # Algorithm 1 averages with 1/m
    uses_proximal = True
    supports_dp = True
    settings_class = ServerStepSettings  # --beta = gamma * lam
    # Its one SGD job is the personal one, at --personal-lr or else --lr: searching --lr covers it.
    tunes: ClassVar[Mapping[str, Search | None]] = {"lam": None}
    settings: ServerStepSettings

    def client_steps(self, client: ClientData, global_state: AdapterState, seed: int) -> ClientSteps:
        # eq. (11): K steps on h_i(., w_g) from the warm start w_{t-1,K}
        personal, loss = yield from self.proximal_personal_steps(client, global_state, seed)
        return ClientUpdate(client.client_id, personal, len(client.train), {"personal_loss": loss})

    def client_samples_bound(self, client: ClientData) -> int:
        return self.personal_samples(client)

    def server_update(
        self,
        global_state: AdapterState,
        updates: list[ClientUpdate],
        seed: int,
        round_index: int,
        on_step: Callable[[int], None] | None = None,
    ) -> tuple[AdapterState, dict[str, float]]:
        mean = self.server_mean(updates)  # (1/m) Σ_i w_{t,K}^(i)
        beta = self.settings.beta  # gamma * lam
        stepped = dict(mean)  # running statistics: the plain mean
        for name in self.trainer.model.trainable_parameters():
            stepped[name] = global_state[name] + beta * (mean[name] - global_state[name])
        return stepped, {}
