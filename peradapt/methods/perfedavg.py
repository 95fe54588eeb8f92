"""Per-FedAvg: a global model trained to be a good starting point for one step of local adaptation.

Fallah, Mokhtari & Ozdaglar, "Personalized Federated Learning with Theoretical Guarantees: A Model-Agnostic
Meta-Learning Approach" (NeurIPS 2020), Algorithm 1, which minimizes F(w) = (1/n) sum_i f_i(w - alpha grad f_i(w))
(eq. 3). A sampled client i starts from w <- w_k and takes tau local steps, each on three independent minibatches
D, D', D'' of its data (lines 8-10):

    w~ = w - alpha grad f_i(w; D)
    w  <- w - beta (I - alpha hess f_i(w; D'')) grad f_i(w~; D')

with the Hessian-vector product hess f_i(w; D'') g, g = grad f_i(w~; D'), computed as `--perfedavg-variant` says:

    fo     (first-order)            w <- w - beta g
    hf     (Hessian-free)           w <- w - beta (g - alpha d)   with the central difference
                                    d = [grad f_i(w + delta g; D'') - grad f_i(w - delta g; D'')] / (2 delta)
    exact  (Algorithm 1 as printed) w <- w - beta (g - alpha h)   with h = hess f_i(w; D'') g by double backward

then uploads w. The server takes the plain mean over the sampled clients, w_{k+1} = (1/rn) sum_{i in A_k} w^i
(line 14). Client i is evaluated and exported as the paper evaluates it: the global model after one step of
local SGD with step size alpha (--ft-steps 1 of FedAvg+FT's fine-tuning).

Conventions of this implementation:
- alpha is --personal-lr (default --lr), beta --lr, delta --perfedavg-delta (0.001, the paper's experiments).
- hf is the default because the paper's experiments run its two practical variants, FO and HF, and not the exact
  product. d is within O(delta) of h where the Hessian is Lipschitz (smooth activations), but a ReLU or max-pool
  network's gradient jumps where a unit changes sides between w - delta g and w + delta g, and in a network of
  many units (peradapt's ResNets) some do at any delta: d is then far from h (docs/METHODS.md, perfedavg), and only
  `exact` takes the step line 10 prints. The two gradients at w +- delta g see the same dropout masks, so that d
  differences one function.
- exact differentiates <grad f_i(w; D''), g> in w (Pearlmutter 1994) from one forward pass at w, with attention on
  PyTorch's math kernel, since the fused attention kernels have no second derivative.
- tau is --local-steps; by default as many local steps as --local-epochs passes have minibatches, as for pFedMe.
  Each local step draws k fresh minibatches (k = 2 for fo, 3 for hf and exact), so E epochs read the data k * E times.
- --aggregation samples weights the server mean by the clients' sample counts (PFLlib).
- BatchNorm running statistics are no optimization variable: every training forward pass updates them (at w, w~
  and w +- delta g (hf) or w (exact)), clients upload them, and the server averages them as the parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from peradapt.adapters import AdapterState
from peradapt.data import ClientData
from peradapt.methods.base import ClientUpdate, register
from peradapt.methods.fedavg import FedAvgFT, FineTuningSettings
from peradapt.methods.pfedme import Batch, Tensors, assign, detached, minibatch_gradient
from peradapt.seeds import LOCAL, derive_seed
from peradapt.settings import setting

VARIANTS = {"fo": 2, "hf": 3, "exact": 3}  # minibatches each local step uses: D, D' (and D'')


@dataclass
class PerFedAvgSettings(FineTuningSettings):
    perfedavg_variant: str = setting(
        "hf",
        help="Per-FedAvg meta-gradient: hf (Hessian-free: finite-difference Hessian-vector product, as the paper's "
        "experiments), exact (the Hessian-vector product by double backward: Algorithm 1 as printed) or fo "
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
    summary = (
        "Per-FedAvg: MAML-style local meta-steps (FO, HF or exact), one local step at evaluation (Fallah et al. 2020)"
    )
    default_scope = "full"  # a full-model personalized baseline, as pFedMe
    default_aggregation = "uniform"  # line 14: (1/rn) sum_i w^i
    default_ft_steps = 1  # the paper evaluates after one step of local SGD
    settings_class = PerFedAvgSettings
    settings: PerFedAvgSettings

    def client_update(self, client: ClientData, global_state: AdapterState, seed: int) -> ClientUpdate:
        trainer, per_step = self.trainer, VARIANTS[self.settings.perfedavg_variant]
        trainer.model.load_state(global_state)  # w_{k+1,0} = w_k
        trainer.model.train()
        trainer.count_trained(trainer.model.trainable_parameters().values())
        epochs, steps = self.minibatch_count()
        batches = trainer.minibatches(client.train, epochs=epochs, steps=steps, seed=derive_seed(seed, LOCAL))
        local_steps = zip(*[batches] * per_step, strict=False)  # consecutive minibatches: (D, D') or (D, D', D'')
        losses = [self.local_step(list(step)) for step in local_steps]
        metrics = {"local_loss": sum(losses) / max(len(losses), 1)}
        return ClientUpdate(client.client_id, trainer.model.state(), len(client.train), metrics)

    def minibatch_count(self) -> tuple[int, int | None]:
        """The epochs and steps of the client's minibatches: k per local step."""
        per_step, steps = VARIANTS[self.settings.perfedavg_variant], self.config.local_steps
        return per_step * self.config.local_epochs, None if steps is None else per_step * steps

    def client_samples_bound(self, client: ClientData) -> int:
        """A gradient on each minibatch, two on D'' for hf (exact's Hessian-vector product counts as one)."""
        gradients = 2 if self.settings.perfedavg_variant == "hf" else 1
        return gradients * self.sgd_samples(client, *self.minibatch_count())

    def local_step(self, batches: list[Batch]) -> float:
        """One local step t (Algorithm 1, lines 8-10) of the loaded model on D, D' (and D''); returns f(w; D)."""
        alpha, beta = self.config.personal_lr or self.config.lr, self.config.lr
        parameters = self.trainer.model.trainable_parameters()
        w = detached(parameters)
        loss, grad = self.gradient(batches[0])  # grad f(w; D)
        assign(parameters, {n: w[n] - alpha * grad[n] for n in w})  # w~
        _, meta_gradient = self.gradient(batches[1])  # g = grad f(w~; D')
        variant = self.settings.perfedavg_variant
        if variant != "fo":
            product = self.hessian_vector_product if variant == "exact" else self.hessian_free_product
            d = product(w, meta_gradient, batches[2])  # ~ hess f(w; D'') g
            meta_gradient = {n: meta_gradient[n] - alpha * d[n] for n in w}
        assign(parameters, {n: w[n] - beta * meta_gradient[n] for n in w})
        return loss

    def hessian_free_product(self, w: Tensors, g: Tensors, batch: Batch) -> Tensors:
        """d = [grad f(w + delta g; D'') - grad f(w - delta g; D'')] / (2 delta), the Hessian-free estimate of
        hess f(w; D'') g (Per-FedAvg (HF))."""
        delta, parameters = self.settings.perfedavg_delta, self.trainer.model.trainable_parameters()
        device = self.trainer.inputs.device
        assign(parameters, {n: w[n] + delta * g[n] for n in w})
        # The RNG is rewound after the first pass, so that the second draws the same dropout masks.
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            _, plus = self.gradient(batch)
        assign(parameters, {n: w[n] - delta * g[n] for n in w})
        _, minus = self.gradient(batch)
        return {n: (plus[n] - minus[n]) / (2 * delta) for n in w}

    def hessian_vector_product(self, w: Tensors, g: Tensors, batch: Batch) -> Tensors:
        """h = hess f(w; D'') g of Algorithm 1, line 10, exactly: the gradient in w of <grad f(w; D''), g>."""
        parameters = self.trainer.model.trainable_parameters()
        assign(parameters, w)
        # The math kernel: the fused attention kernels' backward passes have no derivative of their own.
        with sdpa_kernel(SDPBackend.MATH):
            loss = self.trainer.loss(*batch, self.config.lr)
        gradient = torch.autograd.grad(loss, list(parameters.values()), create_graph=True)
        directional = sum((grad * g[n]).sum() for n, grad in zip(parameters, gradient, strict=True))
        return dict(zip(parameters, torch.autograd.grad(directional, list(parameters.values())), strict=True))

    def gradient(self, batch: Batch) -> tuple[float, Tensors]:
        return minibatch_gradient(self.trainer, *batch, self.config.lr)
