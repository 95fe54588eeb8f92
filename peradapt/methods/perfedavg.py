"""Per-FedAvg: a global model trained to be a good starting point for one step of local adaptation.

Fallah, Mokhtari & Ozdaglar, "Personalized Federated Learning with Theoretical Guarantees: A Model-Agnostic
Meta-Learning Approach" (NeurIPS 2020), Algorithm 1, which minimizes F(w) = (1/n) sum_i f_i(w - alpha grad f_i(w))
(eq. 3). A sampled client i starts from w <- w_k and takes tau local steps, each on three independent minibatches
D, D', D'' of its data (lines 8-10):

    w~ = w - alpha grad f_i(w; D)
    w  <- w - beta (I - alpha hess f_i(w; D'')) grad f_i(w~; D')

with the Hessian-vector product approximated as the paper's two practical variants do (`--perfedavg-variant`):

    fo  (first-order)   w <- w - beta g                       with g = grad f_i(w~; D')
    hf  (Hessian-free)  w <- w - beta (g - alpha d)           with the finite difference
                        d = [grad f_i(w + delta g; D'') - grad f_i(w - delta g; D'')] / (2 delta)

then uploads w. The server takes the plain mean over the sampled clients, w_{k+1} = (1/rn) sum_{i in A_k} w^i
(line 14). Client i is evaluated and exported as the paper evaluates it: the global model after one step of
local SGD with step size alpha (--ft-steps 1 of FedAvg+FT's fine-tuning).

Conventions of this implementation:
- alpha is --personal-lr (default --lr), beta --lr, delta --perfedavg-delta (0.001, the paper's experiments).
- hf is the default: it approximates the update Algorithm 1 prints, with an O(delta) error, where fo drops its
  Hessian term. The two gradients at w +- delta g see the same dropout masks, so that d differences one function.
- tau is --local-steps; by default as many local steps as --local-epochs passes have minibatches, as for pFedMe.
  Each local step draws k fresh minibatches (k = 2 for fo, 3 for hf), so E epochs read the data k * E times.
- --aggregation samples weights the server mean by the clients' sample counts (PFLlib).
- BatchNorm running statistics are no optimization variable: every training forward pass updates them (at w, w~
  and w +- delta g), clients upload them, and the server averages them as the parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from peradapt.adapters import AdapterState
from peradapt.data import ClientData
from peradapt.methods.base import ClientUpdate, register
from peradapt.methods.fedavg import FedAvgFT, FineTuningSettings
from peradapt.methods.pfedme import Batch, Tensors, assign, detached, minibatch_gradient
from peradapt.seeds import LOCAL, derive_seed
from peradapt.settings import setting

VARIANTS = {"fo": 2, "hf": 3}  # minibatches each local step uses: D, D' (and D'')


@dataclass
class PerFedAvgSettings(FineTuningSettings):
    perfedavg_variant: str = setting(
        "hf",
        help="Per-FedAvg meta-gradient: hf (Hessian-free: finite-difference Hessian-vector product) or fo "
        "(first-order, as PFLlib).",
        choices=tuple(VARIANTS),
    )
    perfedavg_delta: float = setting(
        0.001,
        help="Per-FedAvg (HF) finite-difference step δ.",
        minimum=0.0,
        exclusive_minimum=True,
        symbol="δ",
    )


@register
class PerFedAvg(FedAvgFT):
    name = "perfedavg"
    summary = "Per-FedAvg: MAML-style local meta-steps (FO or HF), one local step at evaluation (Fallah et al. 2020)"
    default_scope = "full"  # a full-model personalized baseline, as pFedMe
    default_aggregation = "uniform"  # line 14: (1/rn) sum_i w^i
    default_ft_steps = 1  # the paper evaluates after one step of local SGD
    settings_class = PerFedAvgSettings
    settings: PerFedAvgSettings

    def client_update(self, client: ClientData, global_state: AdapterState, seed: int) -> ClientUpdate:
        config, trainer = self.config, self.trainer
        per_step = VARIANTS[self.settings.perfedavg_variant]
        trainer.model.load_state(global_state)  # w_{k+1,0} = w_k
        trainer.model.train()
        batches = trainer.minibatches(
            client.train,
            epochs=per_step * config.local_epochs,
            steps=None if config.local_steps is None else per_step * config.local_steps,
            seed=derive_seed(seed, LOCAL),
        )
        local_steps = zip(*[batches] * per_step, strict=False)  # consecutive minibatches: (D, D') or (D, D', D'')
        losses = [self.local_step(list(step)) for step in local_steps]
        metrics = {"local_loss": sum(losses) / max(len(losses), 1)}
        return ClientUpdate(client.client_id, trainer.model.state(), len(client.train), metrics)

    def local_step(self, batches: list[Batch]) -> float:
        """One local step t (Algorithm 1, lines 8-10) of the loaded model on D, D' (and D''); returns f(w; D)."""
        alpha, beta = self.config.personal_lr or self.config.lr, self.config.lr
        parameters = self.trainer.model.trainable_parameters()
        w = detached(parameters)
        loss, grad = self.gradient(batches[0])  # grad f(w; D)
        assign(parameters, {n: w[n] - alpha * grad[n] for n in w})  # w~
        _, meta_gradient = self.gradient(batches[1])  # g = grad f(w~; D')
        if self.settings.perfedavg_variant == "hf":
            d = self.hessian_vector_product(w, meta_gradient, batches[2])
            meta_gradient = {n: meta_gradient[n] - alpha * d[n] for n in w}
        assign(parameters, {n: w[n] - beta * meta_gradient[n] for n in w})
        return loss

    def hessian_vector_product(self, w: Tensors, g: Tensors, batch: Batch) -> Tensors:
        """d = [grad f(w + delta g; D'') - grad f(w - delta g; D'')] / (2 delta), the Hessian-free estimate of
        hess f(w; D'') g."""
        delta, parameters = self.settings.perfedavg_delta, self.trainer.model.trainable_parameters()
        device = self.trainer.inputs.device
        assign(parameters, {n: w[n] + delta * g[n] for n in w})
        # The RNG is rewound after the first pass, so that the second draws the same dropout masks.
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            _, plus = self.gradient(batch)
        assign(parameters, {n: w[n] - delta * g[n] for n in w})
        _, minus = self.gradient(batch)
        return {n: (plus[n] - minus[n]) / (2 * delta) for n in w}

    def gradient(self, batch: Batch) -> tuple[float, Tensors]:
        return minibatch_gradient(self.trainer, *batch, self.config.lr)
