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

    w_g <- w_g - gamma * mean_i lam (w_g - w_i) = w_g - gamma lam * (w_g - mean_i w_i).

`--fedprox-server-step` is the product gamma lam (default 1: gamma = 1/lam, the global step of the paper's MNIST
experiments, Section 6.1, so the global model becomes the mean personalized model). The step applies to the
trainable parameters, the optimization variables of eq. (10). BatchNorm running statistics are not optimization
variables: the server takes their plain mean (1/m) sum_i, as pFedMe does, so that a step > 1 cannot push a running
variance below zero; integer step counters come from the first upload. Clients are evaluated with their own w_i.

Defaults: FedProx is not a personalized baseline of PerAda's Table 1, so it trains adapters
(`default_scope = "adapter"`, backbone frozen); `--scope full` trains the whole network. `--lam auto` picks lam
with the paper's Theorem 1 rule (see `auto_lam`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar

from peradapt.adapters import AdapterState
from peradapt.data import ClientData
from peradapt.methods.base import ClientSteps, ClientUpdate, ProximalPersonalization, register
from peradapt.settings import Search, setting


@dataclass
class FedProxSettings:
    """Personalized FedProx's own setting."""

    # The key this step shared with pFedMe's β until each had its own: refused, naming the new one, in flags, config
    # files and a run's config.json alike (config.renamed_settings)
    renamed: ClassVar[Mapping[str, str]] = {"beta": "fedprox_server_step"}

    fedprox_server_step: float = setting(
        1.0,
        help="Personalized FedProx server step γλ: w_g <- w_g + γλ (mean_i w_i - w_g) (eq. 10); 1: γ = 1/λ.",
        minimum=0.0,
        exclusive_minimum=True,
        symbol="γλ",
    )


@register
class FedProx(ProximalPersonalization):
    name = "fedprox"
    summary = "personalized FedProx: proximal local models, server gradient step on the Moreau envelope (Alg. 1)"
    default_scope = "adapter"
    default_aggregation = "uniform"  # Algorithm 1 averages with 1/m
    uses_proximal = True
    supports_dp = True
    settings_class = FedProxSettings
    # Its one SGD job is the personal one, at --personal-lr or else --lr: searching --lr covers it.
    tunes: ClassVar[Mapping[str, Search | None]] = {"lam": None}
    settings: FedProxSettings

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
        step = self.settings.fedprox_server_step  # gamma * lam
        stepped = dict(mean)  # running statistics: the plain mean
        for name in self.trainer.model.trainable_parameters():
            stepped[name] = global_state[name] + step * (mean[name] - global_state[name])
        return stepped, {}
