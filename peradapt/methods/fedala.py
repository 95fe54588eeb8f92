"""FedALA: each client blends the global model into its own old model, weight by weight, before training.

Zhang, Hua, Wang, Song, Xue, Ma & Guan, "FedALA: Adaptive Local Aggregation for Personalized Federated Learning"
(AAAI 2023), Algorithm 1. Client i, sampled in round t, receives the global model Θ and keeps its local model Θ_i
(Θ^0 before its first round: Algorithm 1, line 1) and its aggregation weights W_i. Adaptive Local Aggregation
(ALA, Algorithm 1 lines 6-16) builds its starting point

    Θ̂_i = Θ_i + (Θ - Θ_i) ⊙ W_i      on the higher p layers (W_i element-wise in [0, 1]);  Θ̂_i = Θ below them

learning W_i with Θ and Θ_i fixed on a random s% of the client's training data, by SGD on the loss of Θ̂_i:

    W_i <- clip(W_i - η ∇_W L(Θ̂_i),  0, 1),   ∇_W L(Θ̂_i) = ∇_Θ̂ L(Θ̂_i) ⊙ (Θ - Θ_i)      (every minibatch)

In the client's first round with ALA W_i starts at 1 (Θ̂_i = Θ) and trains until it converges; in later rounds it
starts from the stored W_i and trains one epoch. Then E epochs of SGD at --lr from Θ̂_i give the new Θ_i, which the
client keeps and uploads; the server takes the FedAvg mean weighted by the clients' sample counts (line 19). ALA is
skipped while Θ_i equals Θ on the higher layers (round 1, where both are Θ^0): there is nothing to aggregate, and
W_i is neither created nor trained. A client first sampled later starts ALA from Θ_i = Θ^0. Client i is evaluated
and exported with Θ_i.

Conventions of this implementation:
- s = --ala-sample (percent, 80), p = --ala-layers (1), η = --ala-lr (1.0): the defaults of the paper and of the
  authors' code. A layer is one module's own trainable parameters (the weight and bias of a conv, linear or
  norm layer), counted from the output end in parameter order: p = 1 is the classifier head on every model here.
  With --scope adapter (the default) the layers are the trainable ones: the head, then each adapter's conv and its
  BatchNorm, the blocks' trainable norms; with --scope full, every layer of the network. --ala-layers 0 takes all.
- Convergence is the authors' test (their utils/ALA.py): after more than 10 epochs, the standard deviation of the
  last 10 epoch losses (each the loss of the epoch's last minibatch) is below 0.1; at most MAX_START_EPOCHS.
  Within a round every ALA epoch runs the same minibatches, so the losses compared differ only through W_i.
- Running statistics are no parameters, so W_i does not cover them: Θ̂_i takes them from Θ, as the lower layers.
- FedALA trains full models in its paper; it is no baseline of PerAda's Table 1, so here, as fedprox, it trains
  adapters on the frozen backbone unless --scope full says otherwise.
- ALA trains on client data outside `LocalTrainer.sgd`, so --dp-noise is not offered.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from peradapt.adapters import AdapterState
from peradapt.data import ClientData, ImageSet
from peradapt.methods.base import ClientSteps, ClientUpdate, LocalSGDMethod, MethodContext, register
from peradapt.seeds import ALA, derive_seed
from peradapt.settings import setting

LOCAL_KEY = "local"  # Θ_i in the ClientStore
WEIGHTS_KEY = "ala_weights"  # W_i in the ClientStore (the higher layers only)
CONVERGED_STD, CONVERGED_WINDOW = 0.1, 10  # the authors' threshold and num_pre_loss
MAX_START_EPOCHS = 100  # a bound the authors' loop has not: a W_i that never settles must not stall the run

Tensors = dict[str, torch.Tensor]


def higher_layers(names: list[str], p: int) -> list[str]:
    """The parameter names of the last `p` layers (modules, in the order of `names`); all of them for p = 0."""
    layers = list(dict.fromkeys(name.rpartition(".")[0] for name in names))
    top = set(layers[-p:] if p else layers)
    return [name for name in names if name.rpartition(".")[0] in top]


def converged(losses: list[float]) -> bool:
    window = losses[-CONVERGED_WINDOW:]
    return len(losses) > CONVERGED_WINDOW and float(np.std(window)) < CONVERGED_STD


@dataclass
class FedALASettings:
    ala_sample: float = setting(
        80.0,
        help="FedALA s: percent of the local data ALA learns its weights on.",
        minimum=0.0,
        maximum=100.0,
        exclusive_minimum=True,
        symbol="s",
    )
    ala_layers: int = setting(
        1, help="FedALA p: ALA on the last p layers (1: the head; 0: all).", minimum=0, symbol="p"
    )
    ala_lr: float = setting(
        1.0,
        help="FedALA η: step size of the aggregation weights.",
        minimum=0.0,
        exclusive_minimum=True,
        symbol="η",
    )


@register
class FedALA(LocalSGDMethod):
    name = "fedala"
    summary = "FedALA: adaptive element-wise aggregation of the global into the local model (Zhang et al. 2023)"
    settings_class = FedALASettings
    settings: FedALASettings

    def __init__(self, context: MethodContext) -> None:
        super().__init__(context)
        self.higher = higher_layers(list(self.trainer.model.trainable_parameters()), self.settings.ala_layers)

    def client_steps(self, client: ClientData, global_state: AdapterState, seed: int) -> ClientSteps:
        start, weights, ala_epochs = self.adaptive_local_aggregation(client, global_state, seed)
        local, loss = yield self.local_job(client, start, seed)  # E epochs of SGD from the ALA initialization
        self.store.put(client.client_id, LOCAL_KEY, local)
        if weights is not None:
            self.store.put(client.client_id, WEIGHTS_KEY, weights)
        metrics = {"local_loss": loss, "ala_epochs": float(ala_epochs)}
        return ClientUpdate(client.client_id, local, len(client.train), metrics)

    def client_samples_bound(self, client: ClientData) -> int:
        """E epochs, and at most MAX_START_EPOCHS of ALA on its sample (one from the client's second round on)."""
        return MAX_START_EPOCHS * self.sample_size(client.train) + self.local_samples(client)

    def adaptive_local_aggregation(
        self, client: ClientData, global_state: AdapterState, seed: int
    ) -> tuple[AdapterState, Tensors | None, int]:
        """Θ̂_i, the learned W_i (None when ALA is skipped) and the number of ALA epochs (Algorithm 1, lines 6-16)."""
        local = self.personalized(client.client_id, global_state)  # Θ_i
        if all(torch.equal(local[name], global_state[name]) for name in self.higher):
            return dict(global_state), None, 0
        stored = self.store.get(client.client_id, WEIGHTS_KEY)
        weights = dict(stored) if stored else {name: torch.ones_like(local[name]) for name in self.higher}
        difference = {name: global_state[name] - local[name] for name in self.higher}  # Θ - Θ_i
        model, trainer, eta = self.trainer.model, self.trainer, self.settings.ala_lr
        model.load_state({**global_state, **{n: local[n] + difference[n] * weights[n] for n in self.higher}})
        model.train()
        parameters = model.trainable_parameters()
        higher = [parameters[name] for name in self.higher]
        lower = [p for name, p in parameters.items() if name not in difference]
        sample, sample_seed = self.sample(client.train, seed), derive_seed(seed, ALA)
        trainer.count_trained(weights.values())  # W_i, trained by ALA
        losses: list[float] = []
        try:
            for parameter in lower:  # Θ is fixed below the higher layers: no gradient is needed there
                parameter.requires_grad_(False)
            while True:
                for images, labels in trainer.minibatches(sample, epochs=1, seed=sample_seed):
                    loss = trainer.loss(images, labels, self.config.lr)
                    gradients = torch.autograd.grad(loss, higher)
                    with torch.no_grad():
                        for name, parameter, gradient in zip(self.higher, higher, gradients, strict=True):
                            weights[name] = (weights[name] - eta * gradient * difference[name]).clamp(0, 1)
                            parameter.copy_(local[name] + difference[name] * weights[name])
                losses.append(loss.item())
                if stored is not None or converged(losses) or len(losses) == MAX_START_EPOCHS:
                    break
        finally:
            for parameter in lower:
                parameter.requires_grad_(True)
        start = {**global_state, **{name: parameters[name].detach().clone() for name in self.higher}}
        return start, weights, len(losses)

    def sample(self, data: ImageSet, seed: int) -> ImageSet:
        """s% of the client's training samples, drawn afresh every round (Algorithm 1, line 6)."""
        generator = torch.Generator().manual_seed(derive_seed(seed, ALA))
        return data.subset(torch.randperm(len(data), generator=generator)[: self.sample_size(data)])

    def sample_size(self, data: ImageSet) -> int:
        return max(1, int(self.settings.ala_sample / 100 * len(data)))

    def personalized(self, client_id: int, global_state: AdapterState) -> AdapterState:
        """Θ_i: the local model after the client's last round (Θ^0 before its first)."""
        return self.store.get(client_id, LOCAL_KEY) or self.context.initial
