"""FedDF: FedAvg whose aggregate is refined by ensemble distillation on unlabeled server data.

Lin et al., "Ensemble Distillation for Robust Model Fusion in Federated Learning" (NeurIPS 2020), Algorithm 1.
Clients run FedAvg's local SGD from the global model x_t (see `fedavg`). The server initializes the student
with the sample-size weighted mean x_{t,0} = sum_k n_k / n * x_t^k, then takes R Adam steps (cosine schedule)
on the unlabeled distillation data d,

    x_{t,j} <- x_{t,j-1} - eta * grad KL( softmax(1/|S_t| sum_k f(x_t^k, d)) || softmax(f(x_{t,j-1}, d)) ),

keeping the step with the best accuracy on the server's validation split, as PerAda's Global Obj does
(Algorithm 1, lines 19-22; the shared `peradapt.distill`). No personalization: every client is evaluated with
the global model. PerAda's Table 2 lists FedDF as generic FL that "updates the full model", so the whole network
trains unless --scope says otherwise; the paper uses the same distillation data and steps as for PerAda.
"""

from __future__ import annotations

from collections.abc import Callable

from peradapt.adapters import AdapterState
from peradapt.methods.base import ClientUpdate, register
from peradapt.methods.fedavg import FedAvg


@register
class FedDF(FedAvg):
    name = "feddf"
    summary = "FedDF: FedAvg, then server ensemble distillation of the global model on unlabeled data (Lin et al.)"
    uses_distillation = True

    def server_update(
        self,
        global_state: AdapterState,
        updates: list[ClientUpdate],
        seed: int,
        round_index: int,
        on_step: Callable[[int], None] | None = None,
    ) -> tuple[AdapterState, dict[str, float]]:
        distiller = self.context.distiller
        assert distiller is not None
        averaged = self.server_mean(updates)
        if not distiller.active(round_index):
            return averaged, {}
        return distiller.distill(averaged, [u.upload for u in updates], seed=seed, on_step=on_step)
