"""pFedMe: personalized models as Moreau-envelope proximal points of a shared local model.

T. Dinh, Tran and Nguyen, "Personalized Federated Learning with Moreau Envelopes" (NeurIPS 2020), Algorithm 1,
as restated by pFedBreD (Shi et al., NeurIPS 2023, Eqs. (2), (8) and (13) with g = g* = ||.||^2 / 2 and
mu_i(w) = w) and run as a full-model baseline in PerAda (Xie et al., CVPR 2024, Table 1). Every round the server
sends w^t to all N clients and every client i trains: from w_i <- w^t, for each of R local steps r, each on a fresh
minibatch D,

    theta_i ~= argmin_theta f_i(theta; D) + lam/2 ||theta - w_i||^2        K = --inner-steps gradient steps:
        theta <- theta - eta_p * (grad f_i(theta; D) + lam * (theta - w_i))                (the inner problem)
    w_i <- w_i - eta * lam * (w_i - theta_i)                                 (the Moreau envelope gradient step)

Only then does the server draw a uniform sample S^t of S clients and move w^{t+1} = (1 - beta) w^t +
beta * (1/S) sum_{i in S^t} w_{i,R}; the other clients' w_{i,R} are discarded (`trains_all_clients`: the engine
runs every federated client and gives `server_update` the sampled ones). Client i is evaluated with its last
theta_i (the global model until its first update). As in pFedMe's reference code, theta starts at w^t each round
and warm-starts every local step from the previous theta.

Conventions of this implementation:
- R is `--local-steps` (the paper counts R = 20 local iterations) or, by default, one local step per minibatch
  of `--local-epochs` passes over the client's data.
- `--train-clients sampled` trains only the sampled clients (as PFLlib does); `--aggregation samples` weighs the
  server mean by training-set size (as the authors' code does); see docs/METHODS.md for the other differences.
- eta is `--lr`, eta_p `--personal-lr` (default `--lr`), lam `--lam` (or `--lam auto`: `uses_proximal`), K
  `--inner-steps` (3, as PerAda's appendix uses), beta `--beta`; `--am` is pFedBreD's "aggregate momentum"
  trick (Shi et al., Appendix C.4: beta = 2), which overrides `--beta`.
- The whole network trains (`default_scope = "full"`: pFedMe is a full-model baseline in PerAda's Table 1).
- BatchNorm running statistics are no optimization variable: both theta_i and the uploaded w_i carry the
  statistics the client's training forward passes accumulated, and the server takes their plain mean (a
  beta-step with beta = 2 could make a running variance negative).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from peradapt.adapters import AdapterState
from peradapt.compute.trainer import LocalTrainer
from peradapt.data import ClientData
from peradapt.methods.base import PERSONAL_KEY, ClientUpdate, Method, register
from peradapt.seeds import LOCAL, derive_seed
from peradapt.settings import Search, setting

AM_BETA = 2.0  # pFedBreD, Appendix C.4: "beta = 2 for methods ... employing AM"

Tensors = dict[str, torch.Tensor]
Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class PFedMeSettings:
    """pFedMe's and pFedBreD's own settings."""

    beta: float = setting(
        1.0,
        help="pFedMe/pFedBreD server step β: w <- (1 - β) w + β mean (Algorithm 1).",
        minimum=0.0,
        exclusive_minimum=True,
        symbol="β",
    )
    inner_steps: int = setting(
        3,  # as PerAda's appendix uses
        help="pFedMe/pFedBreD inner steps K.",
        minimum=1,
        symbol="K",
    )
    am: bool = setting(False, help="pFedMe/pFedBreD aggregate momentum: server step β = 2, overriding --beta.")


@register
class PFedMe(Method):
    name = "pfedme"
    summary = "personalized models as Moreau-envelope proximal points of the local model (Dinh et al. 2020)"
    default_scope = "full"
    default_aggregation = "uniform"  # Algorithm 1: (1/S) sum_i w_i
    uses_proximal = True
    tunes: ClassVar[Mapping[str, Search | None]] = {"lam": None, "personal_lr": None}  # λ, the inner steps' η_p
    trains_all_clients = True  # Algorithm 1: "for all i = 1..N"; the server samples S^t afterwards
    settings_class = PFedMeSettings
    settings: PFedMeSettings

    def client_update(self, client: ClientData, global_state: AdapterState, seed: int) -> ClientUpdate:
        lam, eta = self.config.lam, self.config.lr
        model = self.trainer.model
        model.load_state(global_state)  # theta <- w^t and w_i <- w^t
        model.train()
        theta = model.trainable_parameters()
        local = detached(theta)
        for model_trained in (theta, local):  # theta_i and w_i
            self.trainer.count_trained(model_trained.values())
        losses = []
        for images, labels in self.minibatches(client, seed):  # local step r
            losses += self.inner_steps(images, labels, anchor=local)
            with torch.no_grad():
                for name, parameter in theta.items():
                    local[name].sub_(eta * lam * (local[name] - parameter))
        return self._finish(client, local, losses)

    def minibatches(self, client: ClientData, seed: int, per_step: int = 1) -> Iterator[Batch]:
        """The minibatches of R local steps of `per_step` minibatches each: R = --local-steps, or by default as many
        local steps as --local-epochs passes have minibatches."""
        epochs, steps = self.minibatch_count(per_step)
        return self.trainer.minibatches(client.train, epochs=epochs, steps=steps, seed=derive_seed(seed, LOCAL))

    def minibatch_count(self, per_step: int) -> tuple[int, int | None]:
        """The epochs and steps of `minibatches`."""
        steps = self.config.local_steps
        return per_step * self.config.local_epochs, None if steps is None else per_step * steps

    def client_samples_bound(self, client: ClientData) -> int:
        """K gradients on each minibatch."""
        return self.settings.inner_steps * self.sgd_samples(client, *self.minibatch_count(1))

    def inner_steps(self, images: torch.Tensor, labels: torch.Tensor, anchor: Tensors) -> list[float]:
        """theta ~= argmin f(theta; batch) + lam/2 ||theta - anchor||^2: K gradient steps on the loaded model."""
        lam, lr = self.config.lam, self.config.personal_lr or self.config.lr
        theta = self.trainer.model.trainable_parameters()
        losses = []
        for _ in range(self.settings.inner_steps):
            loss, grads = self.gradient(images, labels)
            with torch.no_grad():
                for name, parameter in theta.items():
                    parameter.sub_(lr * (grads[name] + lam * (parameter - anchor[name])))
            losses.append(loss)
        return losses

    def gradient(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[float, Tensors]:
        """Minibatch loss f(.; batch) of the loaded model and its gradient in the trainable parameters."""
        return minibatch_gradient(self.trainer, images, labels, self.config.lr)

    def _finish(self, client: ClientData, local: Tensors, losses: list[float]) -> ClientUpdate:
        """Store theta_i (with the running statistics) and upload w_i with the same statistics."""
        personal = self.trainer.model.state()
        self.store.put(client.client_id, PERSONAL_KEY, personal)
        upload = {name: local[name] if name in local else stat.clone() for name, stat in personal.items()}
        metrics = {"local_loss": sum(losses) / max(len(losses), 1)}  # mean inner-step loss of theta
        return ClientUpdate(client.client_id, upload, len(client.train), metrics)

    @property
    def beta(self) -> float:
        return AM_BETA if self.settings.am else self.settings.beta

    def server_update(
        self,
        global_state: AdapterState,
        updates: list[ClientUpdate],
        seed: int,
        round_index: int,
        on_step: Callable[[int], None] | None = None,
    ) -> tuple[AdapterState, dict[str, float]]:
        # (1/S) sum_i w_i, the sampled clients' uploads only; --aggregation samples: weighted by n_i (authors' code)
        mean = self.server_mean(updates)
        beta, parameters = self.beta, self.trainer.model.trainable_parameters()
        new_state = dict(mean)  # running statistics: the plain mean
        for name in parameters:
            new_state[name] = (1 - beta) * global_state[name] + beta * mean[name]
        return new_state, {}

    def personalized(self, client_id: int, global_state: AdapterState) -> AdapterState:
        return self.store.get(client_id, PERSONAL_KEY) or global_state


def minibatch_gradient(
    trainer: LocalTrainer, images: torch.Tensor, labels: torch.Tensor, lr: float
) -> tuple[float, Tensors]:
    """Minibatch loss f(.; batch) of the model as loaded and its gradient in the trainable parameters (`lr`: the
    learning rate a diverging loss tells the user to lower)."""
    parameters = trainer.model.trainable_parameters()
    loss = trainer.loss(images, labels, lr)
    grads = torch.autograd.grad(loss, list(parameters.values()))
    return loss.item(), dict(zip(parameters, grads, strict=True))


def detached(tensors: dict[str, torch.Tensor]) -> Tensors:
    return {name: tensor.detach().clone() for name, tensor in tensors.items()}


@torch.no_grad()
def assign(parameters: dict[str, torch.nn.Parameter], values: Tensors) -> None:
    """Copy `values` into the model's trainable parameters (running statistics untouched)."""
    for name, parameter in parameters.items():
        parameter.copy_(values[name])
