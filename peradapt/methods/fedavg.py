"""FedAvg and FedAvg+FT: one global model, optionally fine-tuned locally before evaluation.

FedAvg: McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data"
(AISTATS 2017), Algorithm 1 (FederatedAveraging). Each round, every sampled client k starts from the global
state w_t and runs E epochs of minibatch SGD on its own data,

    w^k <- w_t;  w^k <- w^k - eta * grad L_k(w^k)                       E = --local-epochs epochs

and uploads w^k. The server takes the mean weighted by the clients' sample counts n_k over the sampled set S_t,

    w_{t+1} = sum_{k in S_t} (n_k / n) w^k,   n = sum_{k in S_t} n_k.

There is no personalization: every client is evaluated and exported with w. It is the global-model baseline of
PerAda's Table 2 ("FedAvg, generic FL, Full"), so the whole network trains unless --scope says otherwise.

FedAvg+FT (`fedavg-ft`): the full-model baseline of PerAda's Table 1 ([65] there). FedAvg as above, then each
client fine-tunes the final global model on its own training data for --ft-epochs epochs before it is evaluated
or exported (learning rate --personal-lr, default --lr). The fine-tuning is local: it communicates nothing
(the table's footnote), and it is seeded from (run seed, client id), so evaluating twice gives the same model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from peradapt.adapters import AdapterState
from peradapt.data import ClientData
from peradapt.methods.base import ClientSteps, ClientUpdate, LocalSGDMethod, Method, register
from peradapt.seeds import FINETUNE, derive_seed
from peradapt.settings import Search, setting


@register
class FedAvg(LocalSGDMethod):
    name = "fedavg"
    summary = "FedAvg: local SGD from the global model, sample-size weighted mean (McMahan et al., Algorithm 1)"
    default_scope = "full"
    supports_dp = True

    def client_steps(self, client: ClientData, global_state: AdapterState, seed: int) -> ClientSteps:
        local, loss = yield self.local_job(client, global_state, seed)
        return ClientUpdate(client.client_id, local, len(client.train), {"local_loss": loss})

    def client_samples_bound(self, client: ClientData) -> int:
        return self.local_samples(client)

    def personalized(self, client_id: int, global_state: AdapterState) -> AdapterState:
        return global_state

    def personalize_new_client(self, client: ClientData, global_state: AdapterState, seed: int) -> AdapterState:
        return self.personalized(client.client_id, global_state)  # no training: the global model, as for all


@dataclass
class FineTuningSettings:
    ft_epochs: int | None = setting(
        None,
        help="Fine-tuning epochs of fedavg-ft and fedbabu.",
        minimum=0,
        shown_default="the method's: 1, 5",
    )
    ft_steps: int | None = setting(
        None,
        help="Fine-tuning methods (fedavg-ft, perfedavg, ...): fine-tune with N minibatch steps instead of "
        "--ft-epochs (0: none).",
        minimum=0,
        metavar="N",
        shown_default="perfedavg 1 unless --ft-epochs is given, the paper's one step; the others --ft-epochs",
    )


class FineTuning(Method):
    """Personalization by local fine-tuning at evaluation time (FedAvg+FT, FedBABU): client m is evaluated and
    exported with the global model after --ft-epochs (default: the method's `default_ft_epochs`) of SGD on all its
    trainable parameters, on its own training data (or --ft-steps minibatch steps: `ft_steps`). It communicates
    nothing."""

    default_ft_epochs: ClassVar[int]
    default_ft_steps: ClassVar[int | None] = None  # fine-tuning counted in steps unless --ft-epochs is given
    supports_dp = False  # it fine-tunes on client data at every evaluation, outside the rounds' accounting
    tunes: ClassVar[Mapping[str, Search | None]] = {"personal_lr": None}  # the fine-tuning's (Per-FedAvg's α)
    settings_class: ClassVar[type] = FineTuningSettings
    settings: FineTuningSettings

    @property
    def ft_epochs(self) -> int:
        return self.default_ft_epochs if self.settings.ft_epochs is None else self.settings.ft_epochs

    @property
    def ft_steps(self) -> int | None:
        """--ft-steps; else, unless --ft-epochs is given, the method's `default_ft_steps`. None: count epochs."""
        if self.settings.ft_steps is not None or self.settings.ft_epochs is not None:
            return self.settings.ft_steps
        return self.default_ft_steps

    def personalized(self, client_id: int, global_state: AdapterState) -> AdapterState:
        seed = derive_seed(self.context.run_seed, client_id, FINETUNE)
        return self.finetune(global_state, self.context.clients[client_id], seed)

    def personalize_new_client(self, client: ClientData, global_state: AdapterState, seed: int) -> AdapterState:
        return self.finetune(global_state, client, derive_seed(seed, FINETUNE))

    def personalization_samples(self, client: ClientData) -> int:
        """`finetune`'s samples: --ft-epochs passes, or `ft_steps` minibatches."""
        return self.sgd_samples(client, self.ft_epochs, self.ft_steps)

    def finetune(self, global_state: AdapterState, client: ClientData, seed: int) -> AdapterState:
        """--ft-epochs (or `ft_steps` steps) of SGD on the client's training data from the global model (at
        --personal-lr)."""
        config, steps = self.config, self.ft_steps
        if (self.ft_epochs if steps is None else steps) == 0:
            return global_state
        finetuned, _ = self.trainer.sgd(
            global_state,
            client.train,
            epochs=self.ft_epochs,
            steps=steps,
            lr=config.personal_lr or config.lr,
            seed=seed,
        )
        return finetuned


@register
class FedAvgFT(FineTuning, FedAvg):
    name = "fedavg-ft"
    summary = "FedAvg, then --ft-epochs of local fine-tuning of the global model per client (PerAda Table 1)"
    default_ft_epochs = 1
