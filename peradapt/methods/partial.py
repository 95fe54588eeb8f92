"""Partial-model personalization: each client keeps one part of the network, the server averages the rest.

The partial-model baselines of PerAda (Xie et al., CVPR 2024, Sec. 7.1 "Baselines" and Table 1). The model
w = (u, v_m) splits into a shared part u, averaged by the server, and a personal part v_m that never leaves
client m. Client m is evaluated and exported with (u, v_m); a client never sampled has the initial v^0.
The methods differ in which part is personal and in how the two parts are trained locally:

FedAlt (Pillutla et al., "Federated Learning with Partial Model Personalization", ICML 2022), alternating:

    v_m <- v_m - eta_p * grad_v L_m(u, v_m)       S = --personal-epochs epochs, u frozen
    u_m <- u;  u_m <- u_m - eta * grad_u L_m(u_m, v_m)   E = --local-epochs epochs, v_m frozen

FedSim (same paper), simultaneous: (u_m, v_m) <- (u_m, v_m) - (eta, eta_p) * grad L_m(u_m, v_m), E epochs.

In both the client uploads u_m only and the server takes u <- sum_m n_m u_m / sum_m n_m over the sampled
clients (`--aggregation samples`; `uniform`: their plain mean, the default of methods whose paper prints it);
the personal entries of the global state stay as they are. eta = --lr, eta_p = --personal-lr (default --lr).
A frozen part is left exactly as it was, BatchNorm running statistics included. Each phase is one SGD job
whose parameter groups are the parts (`part_job`), so --concurrent-clients trains several clients together.

    fedalt, fedsim  personal part --personal-part (default `output`: of Table 1's FedAlt/FedSim rows the best
                    on CIFAR-10, and it needs no adapter); `adapter` makes the session inject residual adapters.
    fedper, fedrep  the head personal, trained with the body (FedSim) or before it (FedAlt): `body_head`.
    fedbn           FedSim with every BatchNorm layer personal (Li et al., ICLR 2021, Algorithm 1).
    lg-fedavg       FedSim with the feature extractor personal and the head shared (Liang et al. 2020,
                    Algorithm 1: local representations, global head).

The personal parts (`personal_keys`), matched to how Table 1 / Tables 7-8 count them on ResNet-18:
bn = every BatchNorm layer (weights, biases, running statistics; downsample BNs included), head = output =
the classifier, input = every module named `conv1` or `bn1` (the stem and the first conv + BN of every basic
block: 4.73M on ResNet-18, Table 7's "Input layer", leaving the 6.45M communicated of Table 1; the stem alone
would be 0.0095M), adapter = the adapters' own modules (`lora_` names), extractor = all but the classifier.
On a ViT the same roles fall to: bn = every LayerNorm (the normalization layers, as FedBN keeps local), input =
the embedding (patch projection, class token, position embeddings: timm `patch_embed`/`cls_token`/`pos_embed`,
transformers `embeddings`).

These are full-model methods in Table 1 (11.18M trained per client), so they train the whole network
(scope `full`) unless --scope says otherwise.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Collection, Generator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from peradapt.adapters import AdapterState
from peradapt.compute.trainer import ParameterGroup, SGDJob, SGDResult
from peradapt.data import ClientData, ImageSet
from peradapt.errors import ConfigError
from peradapt.methods.base import (
    PERSONAL_KEY,
    ClientSteps,
    ClientUpdate,
    LocalSGDMethod,
    Method,
    MethodContext,
    register,
)
from peradapt.seeds import LOCAL, PERSONAL, derive_seed
from peradapt.settings import Search, setting

if TYPE_CHECKING:  # annotations only: the model's module imports PEFT, which listing the methods does not need
    from peradapt.adapters import AdaptedModel

EXTRACTOR = "extractor"  # LG-FedAvg's personal part: no --personal-part value, only a method default
PERSONAL_PARTS = ("bn", "head", "input", "output", "adapter")
INPUT_MODULES = ("conv1", "bn1", "patch_embed", "cls_token", "reg_token", "pos_embed", "embeddings")
ADAPTER_MARK = "lora_"

# A client's local training as SGD jobs: yields each, is sent its (state, mean loss); returns the final state and
# the losses to log.
LocalSteps = Generator[SGDJob, SGDResult, tuple[AdapterState, dict[str, float]]]


def personal_keys(model: AdaptedModel, part: str) -> list[str]:
    """The state keys of `model` that form personal part `part` (bn, head, output, input, adapter, extractor)."""
    keys = list(model.state())
    if part == "bn":
        norms = {n for n, module in model.module.named_modules() if isinstance(module, _BatchNorm | nn.LayerNorm)}
        return [k for k in keys if k.rpartition(".")[0] in norms]
    if part in ("head", "output", EXTRACTOR):
        head = model.classifier_name() + "."
        return [k for k in keys if k.startswith(head) == (part != EXTRACTOR)]
    if part == "input":
        return [k for k in keys if ADAPTER_MARK not in k and set(k.split(".")) & set(INPUT_MODULES)]
    if part == "adapter":
        return [k for k in keys if ADAPTER_MARK in k]
    raise ConfigError(f"unknown --personal-part '{part}': use bn, head, input, output or adapter")


def subset(state: AdapterState, keys: Collection[str]) -> AdapterState:
    return {k: state[k] for k in keys}


@dataclass
class PartialModelSettings:
    personal_part: str | None = setting(
        None,
        help="Partial-model methods: bn, head, input, output or adapter.",
        choices=PERSONAL_PARTS,
        shown_default="the method's",
    )


class PartialModel(Method):
    """Shared part averaged by the server, personal part kept in the client store."""

    default_scope = "full"
    default_part: ClassVar[str]
    tunes: ClassVar[Mapping[str, Search | None]] = {"personal_lr": None}  # the personal part's η_p
    settings_class: ClassVar[type] = PartialModelSettings
    settings: PartialModelSettings

    def __init__(self, context: MethodContext) -> None:
        super().__init__(context)
        self.part = self.settings.personal_part or self.default_part
        personal = set(self.personal_part_keys())
        self.personal = [k for k in context.initial if k in personal]
        self.shared = [k for k in context.initial if k not in personal]
        if not self.personal:
            hint = ""
            if self.part == "adapter":
                hint = ": the model has no adapters (drop --adapter none)"
            elif self.trainer.model.scope == "adapter":
                hint = ": that part of the backbone is frozen with --scope adapter (use --scope full)"
            raise ConfigError(f"--personal-part {self.part} matches nothing in this model{hint}")
        if not any(k in self.trainer.model.trainable_parameters() for k in self.shared):
            raise ConfigError(f"--personal-part {self.part} leaves nothing to share: use --scope full")
        self.initial_personal = subset(context.initial, self.personal)

    def personal_part_keys(self) -> list[str]:
        """The state keys of the personal part: --personal-part's (or the method's default part)."""
        return personal_keys(self.trainer.model, self.part)

    def kept_and_sent(self, client: ClientData, state: AdapterState, metrics: dict[str, float]) -> ClientUpdate:
        """The end of client m's update, trained to `state`: v_m kept in the client store, u_m uploaded."""
        self.store.put(client.client_id, PERSONAL_KEY, subset(state, self.personal))
        return ClientUpdate(client.client_id, subset(state, self.shared), len(client.train), metrics)

    def part_job(
        self,
        start: AdapterState,
        data: ImageSet,
        train: Collection[str],
        *,
        epochs: int,
        seed: int,
        steps: int | None = None,
    ) -> SGDJob:
        """Minibatch SGD on the keys in `train` only (personal at eta_p, shared at eta); the rest is frozen, its
        BatchNorm running statistics included (`SGDJob.groups`)."""
        config, training = self.config, set(train)
        groups = (
            ParameterGroup(tuple(k for k in self.personal if k in training), config.personal_lr or config.lr),
            ParameterGroup(tuple(k for k in self.shared if k in training), config.lr),
        )
        return SGDJob(start, data, epochs=epochs, lr=config.lr, seed=seed, steps=steps, groups=groups)

    def server_update(
        self,
        global_state: AdapterState,
        updates: list[ClientUpdate],
        seed: int,
        round_index: int,
        on_step: Callable[[int], None] | None = None,
    ) -> tuple[AdapterState, dict[str, float]]:
        """u <- sum_m n_m u_m / sum_m n_m (or the plain mean); the personal entries of the global state are kept."""
        averaged = self.server_mean(updates)
        return {**global_state, **averaged}, {}

    def personalized(self, client_id: int, global_state: AdapterState) -> AdapterState:
        """(u, v_m): the global shared part with client m's personal part (v^0 before its first round)."""
        personal = self.store.get(client_id, PERSONAL_KEY) or self.initial_personal
        return {**subset(global_state, self.shared), **personal}

    def personalize_new_client(self, client: ClientData, global_state: AdapterState, seed: int) -> AdapterState:
        """(u, v_m): v_m from v^0, --personal-epochs of SGD with the global shared part u fixed."""
        start = self.personalized(client.client_id, global_state)
        epochs, seed = self.config.personal_epochs, derive_seed(seed, PERSONAL)
        return self.trainer.run(self.part_job(start, client.train, self.personal, epochs=epochs, seed=seed))[0]


class PartialSGD(PartialModel, LocalSGDMethod):
    """A partial model whose client update is SGD jobs on its parts (`local_steps`): several clients can train
    together (--concurrent-clients)."""

    @abstractmethod
    def local_steps(self, start: AdapterState, data: ImageSet, seed: int) -> LocalSteps:
        """The client's local epochs from (u, v_m) as SGD jobs: the state after them, and losses to log."""

    def client_steps(self, client: ClientData, global_state: AdapterState, seed: int) -> ClientSteps:
        start = self.personalized(client.client_id, global_state)
        state, metrics = yield from self.local_steps(start, client.train, seed)
        return self.kept_and_sent(client, state, metrics)


@register
class FedAlt(PartialSGD):
    name = "fedalt"
    summary = "partial personalization, alternating: personal part, then shared part (Pillutla et al. 2022)"
    default_part = "output"

    @property
    def shared_epochs(self) -> int:
        """Epochs on the shared part, after the personal part's."""
        return self.config.local_epochs

    def local_steps(self, start: AdapterState, data: ImageSet, seed: int) -> LocalSteps:
        config = self.config
        state, personal_loss = yield self.part_job(
            start, data, self.personal, epochs=config.personal_epochs, seed=derive_seed(seed, PERSONAL)
        )
        state, local_loss = yield self.part_job(
            state,
            data,
            self.shared,
            epochs=self.shared_epochs,
            steps=config.local_steps,
            seed=derive_seed(seed, LOCAL),
        )
        return state, {"personal_loss": personal_loss, "local_loss": local_loss}

    def client_samples_bound(self, client: ClientData) -> int:
        config = self.config
        return self.sgd_samples(client, config.personal_epochs) + self.sgd_samples(
            client, self.shared_epochs, config.local_steps
        )


@register
class FedSim(PartialSGD):
    name = "fedsim"
    summary = "partial personalization, simultaneous: both parts in the same SGD steps (Pillutla et al. 2022)"
    default_part = "output"

    def local_steps(self, start: AdapterState, data: ImageSet, seed: int) -> LocalSteps:
        everything = self.personal + self.shared
        state, loss = yield self.part_job(
            start,
            data,
            everything,
            epochs=self.config.local_epochs,
            steps=self.config.local_steps,
            seed=derive_seed(seed, LOCAL),
        )
        return state, {"local_loss": loss}

    def client_samples_bound(self, client: ClientData) -> int:
        return self.local_samples(client)


@register
class FedBN(FedSim):
    name = "fedbn"
    summary = "FedBN: FedAvg that keeps every BatchNorm layer local (Li et al. 2021, Algorithm 1)"
    default_part = "bn"


@register
class LGFedAvg(FedSim):
    name = "lg-fedavg"
    summary = "LG-FedAvg: local feature extractor, global head (Liang et al. 2020, Algorithm 1)"
    default_part = EXTRACTOR
