"""FedAvgM: FedAvg with server momentum, a peradapt method from outside peradapt (docs/ADDING_A_METHOD.md).

Hsu, Qi & Brown, "Measuring the Effects of Non-Identical Data Distribution for Federated Visual Classification"
(2019), section 3. Clients train as in FedAvg (E epochs of local SGD from the global model w). The server takes the
pseudo-gradient Δ = w − (the sample-weighted mean of the uploads) and steps with momentum β, server learning rate 1
as in the paper:

    v ← β v + Δ,   w ← w − v        (v = 0 before the first round)

β = 0 is FedAvg. v is the server's state across rounds: `server_state` saves it in every checkpoint and
`load_server_state` restores it, so a resumed run ends as an uninterrupted one. Only the trainable parameters take
the momentum; BatchNorm running statistics are the uploads' mean, as FedAvg's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from peradapt import method_class
from peradapt.adapters import AdapterState
from peradapt.methods.base import ClientUpdate
from peradapt.settings import Search, setting

FedAvg = method_class("fedavg")  # the built-in FedAvg: its client update is FedAvgM's


@dataclass
class FedAvgMSettings:
    fedavgm_beta: float = setting(
        0.9,
        help="FedAvgM server momentum β (0: FedAvg).",
        minimum=0.0,
        maximum=1.0,
        exclusive_maximum=True,
        symbol="β",
        search=Search.choices(0.0, 0.7, 0.9, 0.97, 0.99, 0.997),  # the momenta Hsu et al. sweep
    )


class FedAvgM(FedAvg):
    summary = "FedAvgM: FedAvg with server momentum, v ← βv + Δ, w ← w − v (Hsu, Qi & Brown 2019)"
    settings_class = FedAvgMSettings
    settings: FedAvgMSettings
    velocity: dict[str, torch.Tensor] | None = None  # v; None: zero (no round yet)

    def server_update(
        self,
        global_state: AdapterState,
        updates: list[ClientUpdate],
        seed: int,
        round_index: int,
        on_step: Callable[[int], None] | None = None,
    ) -> tuple[AdapterState, dict[str, float]]:
        mean = self.server_mean(updates)  # FedAvg's sample-weighted mean; running statistics too
        beta, names = self.settings.fedavgm_beta, self.trainer.model.trainable_parameters()
        velocity = self.velocity or {name: torch.zeros_like(global_state[name]) for name in names}
        self.velocity = {name: beta * velocity[name] + (global_state[name] - mean[name]) for name in names}
        new_state = dict(mean)
        for name, v in self.velocity.items():
            new_state[name] = global_state[name] - v
        return new_state, {}

    def server_state(self) -> dict[str, torch.Tensor]:
        return dict(self.velocity or {})

    def load_server_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.velocity = dict(tensors) or None
