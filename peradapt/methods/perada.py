"""PerAda: personalized adapters regularized towards a distilled global adapter.

Xie et al., "PerAda: Parameter-Efficient Federated Learning Personalization with Generalization Guarantees"
(CVPR 2024), Algorithm 1. Client m keeps a personalized adapter v_m and, each round it is sampled:

    v_m <- v_m - eta_p * (grad L_m(v_m) + lam * (v_m - w))     S epochs   (line 10, Personal Obj)
    theta_m <- w;  theta_m <- theta_m - eta_l * grad L_m(theta_m)  E epochs (lines 12-15)

and uploads theta_m. The server sets w <- mean of theta_m over sampled clients (lines 17-18), then distills:
R steps on KL(softmax(mean teacher logits) || softmax(student logits)) over unlabeled data (lines 19-22,
Global Obj). `perada-nokd` stops after the mean (the paper's "PerAda w/o KD" ablation), as every round does
after the first `--kd-rounds` if that is set (the authors' code distills only in the first rounds).

The proximal term: Algorithm 1 steps with lam * (v - w), the gradient of lam/2 ||v - w||^2. The authors' code adds
lam * ||v - w||^2 to the loss, whose gradient is 2 lam (v - w): their lam is half of peradapt's (their lam = 1 is
`--lam 2`, as the paper presets set it). docs/REPRODUCING.md lists every such difference.
"""

from __future__ import annotations

from collections.abc import Callable

from peradapt.adapters import AdapterState
from peradapt.data import ClientData
from peradapt.methods.base import ClientSteps, ClientUpdate, ProximalPersonalization, register


@register
class PerAda(ProximalPersonalization):
    name = "perada"
    summary = "personalized adapters with a proximal term to a KD-distilled global adapter (Algorithm 1)"
    default_aggregation = "uniform"  # Algorithm 1, lines 17-18: (1/C) sum of the local adapters
    uses_distillation = True
    uses_proximal = True  # the personal update (line 10); perada-nokd inherits it
    supports_dp = True

    def client_steps(self, client: ClientData, global_state: AdapterState, seed: int) -> ClientSteps:
        _, personal_loss = yield from self.proximal_personal_steps(client, global_state, seed)  # line 10
        local, local_loss = yield self.local_job(client, global_state, seed)  # lines 12-15
        metrics = {"personal_loss": personal_loss, "local_loss": local_loss}
        return ClientUpdate(client.client_id, local, len(client.train), metrics)

    def server_update(
        self,
        global_state: AdapterState,
        updates: list[ClientUpdate],
        seed: int,
        round_index: int,
        on_step: Callable[[int], None] | None = None,
    ) -> tuple[AdapterState, dict[str, float]]:
        teachers = [update.upload for update in updates]
        averaged = self.server_mean(updates)  # lines 17-18 (uniform)
        distiller = self.context.distiller
        if not self.uses_distillation or not distiller or not distiller.active(round_index):
            return averaged, {}
        return distiller.distill(averaged, teachers, seed=seed, on_step=on_step)  # lines 19-22

    def parameter_counts(self) -> dict[str, int]:
        adapter = self.trainer.model.num_trainable()
        return {"personalized": adapter, "trained": 2 * adapter, "communicated": adapter}  # v_m and theta_m


@register
class PerAdaNoKD(PerAda):
    name = "perada-nokd"
    summary = "PerAda without server distillation: the global adapter is the plain mean of local adapters"
    uses_distillation = False
