"""APFL: each client's personalized model is a learned mixture of its own local model and the global model.

Deng, Kamani and Mahdavi, "Adaptive Personalized Federated Learning" (2020), Algorithm 1 with the adaptive alpha of
Section 4.2, as run as a full-model baseline in PerAda (Xie et al., CVPR 2024, Table 1). Client m keeps a local
model v_m and a mixing weight alpha_m in [0, 1]; its personalized model is v_bar_m = alpha_m v_m + (1 - alpha_m) w.
A sampled client starts from the server's w and, for every minibatch xi of `local_epochs` epochs, updates all three
from their values before the step (same minibatch, same step size eta as in the paper):

    w_m     <- w_m - eta * grad f_m(w_m; xi)                                                   (eq. 6)
    v_m     <- v_m - eta * grad_v f_m(v_bar_m; xi) = v_m - eta * alpha_m * grad f_m(v_bar_m; xi)  (eq. 7)
    alpha_m <- Proj_[0,1](alpha_m - eta_alpha * <v_m - w_m, grad f_m(v_bar_m; xi)>)            (eq. 10, 9)

then uploads w_m: the synchronisation gap tau is `local_epochs` epochs of steps. The server averages uniformly,
w = (1/|U_t|) sum_{m in U_t} w_m (eq. 8). Clients are evaluated with v_bar_m = alpha_m v_m + (1 - alpha_m) w, the
mixture of Algorithm 1's output with the last iterate instead of its p_t-weighted average over iterations.

Initialisation. The paper leaves v_m^(0) an input and only remarks (Section 4.2) that alpha barely moves while
v_m and w_m are close, since its gradient <v_m - w_m, grad f_m(v_bar_m)> vanishes with v_m - w_m. Every v_m^(0) is
the pretrained model, i.e. w^(0) (PerAda initialises all methods from the same pretrained network; a random v_m
would wreck v_bar_m). This does not freeze alpha: its first step is 0, but that step moves w_m by eta g and v_m
by eta alpha g (g the shared gradient at v_bar_m = w_m), so v_m - w_m = eta (1 - alpha) g != 0 and alpha moves from
the second step on, for any alpha^(0) < 1 (alpha^(0) = 1 with v_m = w_m is a fixed point up to dropout: keep
--apfl-alpha below 1). Later rounds start from a new w, apart from v_m anyway.

BatchNorm running statistics are taken from the model that was run: w_m keeps those of its forward passes (and
uploads them, as FedAvg does); v_m stores those of the forward passes at v_bar_m, and v_bar_m is evaluated with
them. Defaults: the whole network trains (`default_scope = "full"`, Table 1 of PerAda); alpha^(0) = `--apfl-alpha`
0.5 (the paper's EMNIST setting, mid-range of PerAda's grid {0.1, 0.3, 0.5, 0.7}); eta_alpha = `--alpha-lr`,
default `--lr` (eq. 10 uses the same eta_t); `--alpha-lr 0` keeps alpha fixed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from peradapt.adapters import AdapterState
from peradapt.data import ClientData
from peradapt.methods.base import ClientUpdate, Method, register
from peradapt.seeds import LOCAL, derive_seed
from peradapt.settings import Search, setting

LOCAL_KEY = "local"  # v_m
ALPHA_KEY = "alpha"  # {"alpha": alpha_m}, a 0-d float64 tensor


@dataclass
class APFLSettings:
    apfl_alpha: float = setting(
        0.5,
        help="APFL initial mixing weight α.",
        minimum=0.0,
        maximum=1.0,
        symbol="α_m^(0)",
        search=Search.uniform(0.1, 0.7),  # PerAda A.2 selects it from {0.1, 0.3, 0.5, 0.7}
    )
    alpha_lr: float | None = setting(
        None,
        help="APFL step size of α (0: α stays fixed).",
        minimum=0.0,
        shown_default="--lr",
        symbol="η_α",
    )


@register
class APFL(Method):
    name = "apfl"
    summary = "personalized model alpha v + (1 - alpha) w with a learned mixing weight (APFL, Algorithm 1)"
    default_scope = "full"
    default_aggregation = "uniform"  # eq. 8: (1/|S|) sum of the uploads
    settings_class = APFLSettings
    settings: APFLSettings

    def client_update(self, client: ClientData, global_state: AdapterState, seed: int) -> ClientUpdate:
        return self._local_steps(client, global_state, seed, train_w=True)

    def client_samples_bound(self, client: ClientData) -> int:
        return 2 * self.local_samples(client)  # each minibatch: a gradient of w and one of the mixed model

    def personalize_new_client(self, client: ClientData, global_state: AdapterState, seed: int) -> AdapterState:
        """v_m (from v_m = w) and alpha_m learned by eqs. 7 and 10 against the final global w, which stays fixed."""
        self.store.put(client.client_id, LOCAL_KEY, global_state)
        self._local_steps(client, global_state, seed, train_w=False)
        return self.personalized(client.client_id, global_state)

    def _local_steps(self, client: ClientData, global_state: AdapterState, seed: int, *, train_w: bool) -> ClientUpdate:
        config, trainer = self.config, self.trainer
        eta = config.lr
        eta_alpha = eta if self.settings.alpha_lr is None else self.settings.alpha_lr
        w, v, alpha = global_state, self.local_model(client.client_id), self.alpha(client.client_id)
        trainer.model.train()
        for _ in range(2 if train_w else 1):  # w and v (alpha_m, one scalar, is not counted: Table 1)
            trainer.count_trained(trainer.model.trainable_parameters().values())
        w_losses, mixed_losses = [], []
        for images, labels in trainer.minibatches(
            client.train, epochs=config.local_epochs, steps=config.local_steps, seed=derive_seed(seed, LOCAL)
        ):
            grad_w, w_buffers, w_loss = self._gradient(w, images, labels) if train_w else ({}, w, 0.0)
            grad_mixed, mixed_buffers, mixed_loss = self._gradient(self.mix(alpha, v, w), images, labels)
            with torch.no_grad():
                grad_alpha = sum(torch.sum((v[n] - w[n]) * g) for n, g in grad_mixed.items()).item()  # eq. 10
                w = {**w_buffers, **{n: w[n] - eta * g for n, g in grad_w.items()}}  # eq. 6
                v = {**mixed_buffers, **{n: v[n] - eta * alpha * g for n, g in grad_mixed.items()}}  # eq. 7
            alpha = min(max(alpha - eta_alpha * grad_alpha, 0.0), 1.0)  # eq. 10, projected onto [0, 1]
            w_losses.append(w_loss)
            mixed_losses.append(mixed_loss)
        self.store.put(client.client_id, LOCAL_KEY, v)
        self.store.put(client.client_id, ALPHA_KEY, {ALPHA_KEY: torch.tensor(alpha, dtype=torch.float64)})
        metrics = {"local_loss": _mean(w_losses), "personal_loss": _mean(mixed_losses), "alpha": alpha}
        return ClientUpdate(client.client_id, w, len(client.train), metrics)

    def _gradient(
        self, state: AdapterState, images: torch.Tensor, labels: torch.Tensor
    ) -> tuple[AdapterState, AdapterState, float]:
        """grad f_m(state; xi) by name, the buffers (BatchNorm statistics) after this forward pass, and the loss."""
        model = self.trainer.model
        model.load_state(state)
        parameters = model.trainable_parameters()
        loss = self.trainer.loss(images, labels, self.config.lr)
        grads = torch.autograd.grad(loss, list(parameters.values()))
        buffers = {n: t for n, t in model.state().items() if n not in parameters}
        return dict(zip(parameters, grads, strict=True)), buffers, loss.item()

    def local_model(self, client_id: int) -> AdapterState:
        return self.store.get(client_id, LOCAL_KEY) or self.context.initial

    def alpha(self, client_id: int) -> float:
        stored = self.store.get(client_id, ALPHA_KEY)
        return float(stored[ALPHA_KEY].item()) if stored else self.settings.apfl_alpha

    def personalized(self, client_id: int, global_state: AdapterState) -> AdapterState:
        return self.mix(self.alpha(client_id), self.local_model(client_id), global_state)

    def mix(self, alpha: float, v: AdapterState, w: AdapterState) -> AdapterState:
        """v_bar = alpha v + (1 - alpha) w on the trainable parameters; the buffers (BatchNorm statistics) are v's."""
        parameters = self.trainer.model.trainable_parameters()
        return {**v, **{n: alpha * v[n] + (1.0 - alpha) * w[n] for n in parameters}}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
