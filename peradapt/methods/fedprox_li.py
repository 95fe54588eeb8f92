"""FedProx (Li et al.): FedAvg whose clients solve a proximal local problem; one global model, no personalization.

Li, Sahu, Zaheer, Sanjabi, Talwalkar & Smith, "Federated Optimization in Heterogeneous Networks" (MLSys 2020),
Algorithm 2. Each sampled client k receives w^t and approximately solves

    min_w  h_k(w; w^t) = F_k(w) + mu/2 ||w - w^t||^2

by E = --local-epochs epochs of minibatch SGD from w^t (their solver; Sec. 5.1), each step being

    w <- w - eta * (grad F_k(w) + mu * (w - w^t))                        eta = --lr, mu = --mu

and uploads w_k^{t+1}. The server takes the sample-weighted mean over the sampled clients,
w^{t+1} = sum_k n_k w_k^{t+1} / sum_k n_k (the authors' code: clients sampled uniformly, as here; Algorithm 2
samples them with probability n_k / n and takes the plain mean, an estimator of the same sum_k p_k w_k).
BatchNorm running statistics are averaged the same way; the proximal term concerns trainable parameters only.

It is a generic FL method (PerAda Table 2: "FedProx, generic FL, Full"): every client is evaluated and exported
with the global model w, and the whole network trains unless --scope says otherwise. mu defaults to 1, the value
Li et al. select for MNIST, FEMNIST and their synthetic data from {0.001, 0.01, 0.1, 1} (Sec. 5.3); mu = 0 is
FedAvg. This is not `fedprox`, Yu et al.'s personalized FedProx, whose lam pulls per-client models to w.
"""

from __future__ import annotations

from dataclasses import dataclass

from peradapt.adapters import AdapterState
from peradapt.data import ClientData
from peradapt.methods.base import ClientSteps, ClientUpdate, register
from peradapt.methods.fedavg import FedAvg
from peradapt.settings import Search, setting


@dataclass
class FedProxLiSettings:
    mu: float = setting(
        1.0,  # Li et al.'s best value on MNIST, FEMNIST and synthetic data
        help="fedprox-li: proximal strength μ towards the global model.",
        minimum=0.0,
        symbol="μ",
        search=Search.log(1e-3, 1.0),  # the values Li et al. select μ from, {0.001, 0.01, 0.1, 1} (Sec. 5.3)
    )


@register
class FedProxLi(FedAvg):
    name = "fedprox-li"
    summary = "FedProx: FedAvg with a proximal term mu/2 ||w - w^t||^2 in the local problem (Li et al., Alg. 2)"
    settings_class = FedProxLiSettings
    settings: FedProxLiSettings

    def client_steps(self, client: ClientData, global_state: AdapterState, seed: int) -> ClientSteps:
        local, loss = yield self.local_job(
            client,
            global_state,
            seed,
            anchor=global_state,  # w^t, fixed during the local epochs
            lam=self.settings.mu,
        )
        return ClientUpdate(client.client_id, local, len(client.train), {"local_loss": loss})
