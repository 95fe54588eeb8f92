"""The method interface: what a personalization algorithm defines, and nothing the engine already does.

A method holds the paper's update rules only, and declares the settings of its own (`settings_class`, a dataclass of
`peradapt.settings.setting` fields; a family's base class declares the family's, which its subclasses inherit). The
engine samples clients, runs each one's update (`client_update`, or for `LocalSGDMethod`s several clients'
`client_steps` together), passes the uploads to `server_update`, evaluates and checkpoints. Private per-client state
lives in the `ClientStore`, so methods stay stateless between calls apart from what they put there.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from peradapt.adapters import AdapterState, average_states
from peradapt.compute.costs import ClientWork, ServerWork, sgd_samples
from peradapt.compute.trainer import LocalTrainer, SGDJob, SGDResult
from peradapt.config import MethodConfig, check_method_settings
from peradapt.data import ClientData
from peradapt.distill import Distiller
from peradapt.errors import ConfigError
from peradapt.registry import BUILT_IN, METHODS
from peradapt.rundir.store import ClientStore
from peradapt.seeds import LOCAL, PERSONAL, derive_seed
from peradapt.settings import NoSettings, Search, validate_settings

PERSONAL_KEY = "personal"  # where methods keep a client's personalized state in the ClientStore


@dataclass
class ClientUpdate:
    """What one client's update returns (`client_update`, `client_steps`): the upload that `server_update` receives
    among the sampled clients' updates, and what the round's record says of it."""

    client_id: int  # the client's id, `client.client_id`
    # What the client sends to the server, as `server_update` receives it: the trained state, and any entries of
    # the method's own under names no model state has (SCAFFOLD's Δc_i), which `server_update` must take out
    # before it averages (`server_mean` averages every entry) and which count as bytes sent.
    upload: AdapterState
    # n_m, the client's sample count: by convention its training samples, `len(client.train)`; the weights of
    # `server_mean` under --aggregation samples. (The samples it trained on are measured apart: `work`.)
    num_samples: int
    # Scalars of the update, each averaged over the round's clients into its record in metrics.jsonl; the
    # progress line shows `local_loss` (the mean local training loss) as "loss".
    metrics: dict[str, float] = field(default_factory=dict)
    work: ClientWork = field(default_factory=ClientWork)  # filled in by the engine, which measures the update


@dataclass
class MethodContext:
    """What a method is built with (`Method.__init__` keeps it as `self.context`): the run's settings, trainer,
    client store and initial state."""

    config: MethodConfig  # the shared settings of the method's training (--lr, --lam, --local-epochs, ...)
    trainer: LocalTrainer  # the one trainer of the shared model, `self.trainer`
    store: ClientStore  # the clients' private states across rounds, in every checkpoint: `self.store`
    initial: AdapterState  # the injected adapter before any training: w^0 and every v_m^0
    distiller: Distiller | None  # the server's distillation, for methods that set `uses_distillation`; else None
    # Every client's data, for methods that personalize at evaluation time: the --holdout-clients too, which never
    # train, so `len(clients)` is not the number of federated clients (`federated` is).
    clients: Sequence[ClientData] = ()
    run_seed: int = 0  # --seed, for randomness outside the rounds (e.g. fine-tuning at evaluation time)
    # N, the number of clients that take part in training (all but --holdout-clients; their ids are 0 .. N-1), as
    # SCAFFOLD's server scales by |S|/N; None (a context built in code without it): every client of `clients`.
    federated: int | None = None
    settings: Any = None  # the method's own settings, an instance of its `settings_class`; None: their defaults


class Method(ABC):
    """A personalization method: its paper's update rules as hooks the engine calls (`client_update`,
    `server_update`, `personalized`, ...), and class attributes that say what it needs.

    The engine builds it once per run with a `MethodContext` and keeps, for the hooks: `self.context`, the context;
    `self.config`, the shared settings (`MethodConfig`: `self.config.lr`, `.lam`, `.local_epochs`, ...);
    `self.settings`, its own settings (an instance of `settings_class`); `self.trainer`, the `LocalTrainer` of the
    shared model; `self.store`, the `ClientStore`. State it keeps across rounds goes to the store (a client's) or
    through `server_state` (the server's), so that checkpoints carry it and --resume restores it.
    """

    # The `--method` name `register` adds it under (built-in methods); a plugin found as `module:Class` or by its
    # entry point is named that way instead, and need not set it.
    name: ClassVar[str]
    summary: ClassVar[str]  # one line: what `peradapt methods` and the model cards show (the paper, the rule)
    # The settings of its own: `--flag`s and config keys that only the methods declaring them take.
    settings_class: ClassVar[type] = NoSettings
    # It distills on the server's unlabeled data (`context.distiller`), so it needs --kd-data and is tuned on the
    # distillation settings.
    uses_distillation: ClassVar[bool] = False
    uses_proximal: ClassVar[bool] = False  # has a proximal strength lam that `--lam auto` may choose
    # What trains unless --scope says otherwise (the paper's setting): "adapter" (the adapters on the frozen
    # backbone) or "full" (the whole network: global-model baselines such as FedAvg and SCAFFOLD).
    default_scope: ClassVar[str] = "adapter"
    # All its training on client data goes through `LocalTrainer.sgd`, which --dp-noise makes DP-SGD.
    supports_dp: ClassVar[bool] = False
    # The model carries a second, personal linear head beside the classifier, zero at start: logits are
    # generic(h) + personal(h) (`AdaptedModel.add_personal_head`; FedRoD).
    second_head: ClassVar[bool] = False
    # Its paper trains every federated client each round and aggregates only the sample (pFedMe, pFedBreD
    # Algorithm 1): `clients_to_train` returns them all unless --train-clients sampled; the others refuse "all".
    trains_all_clients: ClassVar[bool] = False
    # The shared settings besides --lr that its update rules read, which `compare --tune` searches for it: each with
    # the range its paper searches where that is not the shared declaration's, else None (`config.search_space`;
    # the distillation settings come with `uses_distillation`, its own settings with their declarations' `search`).
    tunes: ClassVar[Mapping[str, Search | None]] = {}
    # The server's mean over the sampled clients as the paper prints it: "samples" (n_m-weighted) or "uniform";
    # --aggregation selects the other (the authors' codes and PFLlib differ; docs/METHODS.md says where). None: the
    # server takes no mean of the uploads (standalone, MTL), and --aggregation is refused.
    default_aggregation: ClassVar[str | None] = "samples"

    def __init__(self, context: MethodContext) -> None:
        self.context = context
        self.config = context.config
        self.settings = self.settings_class() if context.settings is None else context.settings
        if not isinstance(self.settings, self.settings_class):
            raise TypeError(
                f"{type(self).__name__} takes {self.settings_class.__name__}, not {type(self.settings).__name__}"
            )
        validate_settings(self.settings)  # a config checks them already; a context built in code is checked here
        self.trainer = context.trainer
        self.store = context.store

    @abstractmethod
    def client_update(self, client: ClientData, global_state: AdapterState, seed: int) -> ClientUpdate:
        """Train on one sampled client, starting from what the server sent it (`global_state`: `payload`'s value,
        extra entries included); return the upload. `seed` is the client's in this round, derived from (run seed,
        round, client id): draw what it needs from `derive_seed(seed, PHASE)`."""

    def server_update(
        self,
        global_state: AdapterState,
        updates: list[ClientUpdate],
        seed: int,
        round_index: int,
        on_step: Callable[[int], None] | None = None,
    ) -> tuple[AdapterState, dict[str, float]]:
        """Build the next global adapter from the uploads of round `round_index` (from 0); return it with metrics to
        log in the round's record. `updates`: the sampled clients' that answered, uploads as they were sent (extra
        entries included); the state returned holds the model's entries only. `seed`: the server's in this round;
        `on_step(k)`: progress of a server step that takes many (distillation). Default: the mean of the uploads
        (`server_mean`), FedAvg's server step, which most methods share."""
        return self.server_mean(updates), {}

    def server_steps(self, round_index: int) -> int:
        """The steps of round `round_index`'s server update that it reports through `on_step`: the distillation's
        where it distills that round, else none (the engine shows them as progress)."""
        distiller = self.context.distiller
        return distiller.config.kd_steps if distiller is not None and distiller.active(round_index) else 0

    def server_work(self) -> ServerWork:
        """The server's work so far beyond averaging (the engine counts each round's as the difference): the
        distillation's samples and seconds, or none."""
        distiller = self.context.distiller
        if distiller is None:
            return ServerWork()
        return ServerWork(distiller.samples_trained, distiller.samples_inferred, distiller.seconds)

    @abstractmethod
    def personalized(self, client_id: int, global_state: AdapterState) -> AdapterState:
        """The adapter client `client_id` is evaluated and exported with."""

    def server_mean(self, updates: list[ClientUpdate]) -> AdapterState:
        """The mean of the uploads: n_m-weighted (`ClientUpdate.num_samples`) or plain, as --aggregation (or
        `default_aggregation`) says; of every entry (integer ones, BatchNorm counters, from the first upload)."""
        aggregation = self.config.aggregation or self.default_aggregation
        weights = [u.num_samples for u in updates] if aggregation == "samples" else None
        return average_states([u.upload for u in updates], weights)

    def clients_to_train(self, sampled: list[int], federated: list[int]) -> list[int]:
        """The clients that run `client_update` this round: the sampled ones, or every federated client for methods
        whose papers train them all (`trains_all_clients`) unless --train-clients sampled; `server_update` always
        gets the sampled clients' updates only."""
        if self.trains_all_clients and self.config.train_clients != "sampled":
            return federated
        return sampled

    def payload(self, client_id: int, global_state: AdapterState) -> AdapterState:
        """What the server sends client `client_id` for its update (`client_update`'s `global_state`), counted as
        the bytes sent: the global state itself, unless the method sends each client a model of its own (MTL) or
        more than the model. Entries beyond the model's state may be added under names no model state has
        (SCAFFOLD's control variate c); the client takes them out before it trains from the state."""
        return global_state

    def server_state(self) -> dict[str, torch.Tensor]:
        """State the server keeps between rounds beyond the global adapter (FedDyn's h, MTL's client models,
        SCAFFOLD's c), as named tensors: saved in every round checkpoint and given back to `load_server_state` on
        --resume. Default: none."""
        return {}

    def load_server_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore what `server_state` returned at the checkpoint a run resumes from ({} at round 0)."""
        del tensors  # no server state by default

    def personalize_new_client(self, client: ClientData, global_state: AdapterState, seed: int) -> AdapterState:
        """The personalized model of a client that never took part in training, from the final global model.

        Default: one round of the method's own client update against the fixed global model, then the model the
        method evaluates that client with. Methods whose personalization needs something else override it.
        """
        self.client_update(client, global_state, seed)
        return self.personalized(client.client_id, global_state)

    def local_job(
        self,
        client: ClientData,
        start: AdapterState,
        seed: int,
        *,
        anchor: AdapterState | None = None,
        lam: float = 0.0,
    ) -> SGDJob:
        """The job of E epochs (or --local-steps) of SGD at --lr from `start`: plain, FedAvg's client step (PerAda
        Algorithm 1, line 15), or proximal towards `anchor` with strength `lam` (FedProx, FedDyn, MTL local problems).
        `LocalSGDMethod.client_steps` yield it; other callers train it with `LocalTrainer.run`. Its seed is
        `derive_seed(seed, LOCAL)`; `dataclasses.replace(job, correction=...)` adds a gradient correction."""
        config = self.config
        return SGDJob(
            start,
            client.train,
            epochs=config.local_epochs,
            steps=config.local_steps,
            lr=config.lr,
            seed=derive_seed(seed, LOCAL),
            anchor=anchor,
            lam=lam,
        )

    def client_samples_bound(self, client: ClientData) -> int | None:
        """The most training samples (`ClientWork.samples`) one `client_update` of `client` processes, for the
        up-front check of --budget; None: not known before it runs (a method of its own that does not say), and
        the budget is then not checked. Exact for local SGD by epochs or steps, at least the count otherwise."""
        return None

    def personalization_samples(self, client: ClientData) -> int:
        """The training samples `personalized` processes for `client` when it hands out the client's model (at each
        evaluation and at the export): 0, a stored state, unless the method trains then (fine-tuning). Declared,
        not measured, so that either engine reports it and --budget can set it aside before the rounds."""
        del client  # most methods hand out a state they keep
        return 0

    def sgd_samples(self, client: ClientData, epochs: int, steps: int | None = None) -> int:
        """The training samples of `epochs` passes over the client's training data, or of `steps` minibatches."""
        return sgd_samples(len(client.train), self.trainer.batch_size, epochs=epochs, steps=steps)

    def local_samples(self, client: ClientData) -> int:
        """The training samples of `local_job`: E = --local-epochs passes, or --local-steps minibatches."""
        return self.sgd_samples(client, self.config.local_epochs, self.config.local_steps)


# `client_steps`' type: a generator that yields SGD jobs, is sent each one's result and returns the client's update.
ClientSteps = Generator[SGDJob, SGDResult, ClientUpdate]


class LocalSGDMethod(Method):
    """A method whose client update is a few runs of local SGD (`SGDJob`s) and bookkeeping between them, written as
    the generator `client_steps`: it yields each job and is sent the job's result. `client_update` runs the jobs one
    after another; the engine may instead train several clients' jobs at once (`--concurrent-clients`,
    `peradapt.compute.concurrent`), to the same numbers."""

    @abstractmethod
    def client_steps(self, client: ClientData, global_state: AdapterState, seed: int) -> ClientSteps:
        """`client_update` as SGD jobs: yield each `SGDJob`, receive its `SGDResult` (the state after it, its mean
        loss), return the `ClientUpdate`. Between jobs it may read and write the client store; it must not train
        the model otherwise (the jobs of several clients may be trained at once)."""

    def client_update(self, client: ClientData, global_state: AdapterState, seed: int) -> ClientUpdate:
        return self.trainer.run_steps(self.client_steps(client, global_state, seed))


def trains_by_sgd_jobs(cls: type[Method]) -> bool:
    """Whether the method's client update is exactly its `client_steps` SGD jobs: not for a method with update rules
    of its own, including a `LocalSGDMethod` subclass that overrides `client_update` (Per-FedAvg)."""
    return issubclass(cls, LocalSGDMethod) and cls.client_update is LocalSGDMethod.client_update


class ProximalPersonalization(LocalSGDMethod):
    """Methods whose personalized model is a stored v_m trained proximal to the global w: PerAda, Ditto, FedProx."""

    tunes: ClassVar[Mapping[str, Search | None]] = {"lam": None, "personal_lr": None}  # the personal steps' λ, η_p

    def personalized(self, client_id: int, global_state: AdapterState) -> AdapterState:
        return self.stored_personal(client_id)

    def personalize_new_client(self, client: ClientData, global_state: AdapterState, seed: int) -> AdapterState:
        """A new client's v from v = w: S epochs of the proximal personal update towards the fixed global w."""
        self.store.put(client.client_id, PERSONAL_KEY, global_state)
        personal, _ = self.trainer.run_steps(self.proximal_personal_steps(client, global_state, seed))
        return personal

    def personal_samples(self, client: ClientData) -> int:
        """The training samples of `proximal_personal_steps`: S = --personal-epochs passes."""
        return self.sgd_samples(client, self.config.personal_epochs)

    def stored_personal(self, client_id: int) -> AdapterState:
        """The client's personalized state, or the initial one for a client that was never sampled."""
        return self.store.get(client_id, PERSONAL_KEY) or self.context.initial

    def proximal_personal_steps(
        self, client: ClientData, global_state: AdapterState, seed: int
    ) -> Generator[SGDJob, SGDResult, SGDResult]:
        """S epochs of v <- v - eta_p (grad L(v) + lam (v - w)) from the stored v, which it replaces.

        The personalized update shared by PerAda (Algorithm 1, line 10), Ditto and personalized FedProx (eq. 11).
        """
        config = self.config
        personal, loss = yield SGDJob(
            self.stored_personal(client.client_id),
            client.train,
            epochs=config.personal_epochs,
            lr=config.personal_lr or config.lr,
            seed=derive_seed(seed, PERSONAL),
            anchor=global_state,
            lam=config.lam,
        )
        self.store.put(client.client_id, PERSONAL_KEY, personal)
        return personal, loss


def register(cls: type[Method]) -> type[Method]:
    """Add a method under its `name` (a class decorator; returns the class); the settings it takes are its
    `settings_class`'s. A method of peradapt's own is built-in; one that a plugin module registers this way is named
    by that module as its source. A plugin need not register: `--method module:Class` and entry points find it."""
    taken = METHODS.loaded().get(cls.name)
    if taken is not None and taken is not cls:
        raise TypeError(f"{cls.__module__}.{cls.__qualname__}: method {cls.name} is {taken.__qualname__} already")
    check_method_settings(cls.settings_class)
    METHODS.add(cls.name, cls, BUILT_IN if cls.__module__.startswith("peradapt.") else f"module {cls.__module__}")
    return cls


def method_class(name: str, asked_as: str = "--method") -> type[Method]:
    """The class of method `name`: a registered one, `module:Class`, or an installed package's entry point.
    `asked_as`: how the user named it, for the error of an unknown name."""
    if name not in METHODS:
        raise ConfigError(
            f"unknown {asked_as} '{name}': use one of {', '.join(METHODS)}, or MODULE:CLASS for a method of your own "
            "(docs/ADDING_A_METHOD.md)"
        )
    return METHODS[name]


def check_private_method(name: str, private: bool) -> None:
    """With --dp-noise (`private`), refuse methods whose client training does not all go through `LocalTrainer.sgd`
    (DP-SGD)."""
    if not private or method_class(name).supports_dp:
        return
    supported = ", ".join(method for method, cls in METHODS.items() if cls.supports_dp)
    raise ConfigError(
        f"--method {name} trains clients with update rules of its own, which DP-SGD does not cover: "
        f"with --dp-noise use one of {supported}"
    )


def build_method(name: str, context: MethodContext) -> Method:
    cls = method_class(name)
    if cls.uses_distillation and context.distiller is None:
        raise ConfigError(f"--method {name} distills on unlabeled data: it needs --kd-data")
    if context.config.aggregation and cls.default_aggregation is None:
        raise ConfigError(f"--aggregation: --method {name} takes no mean of the clients' uploads; drop --aggregation")
    if context.config.train_clients == "all" and not cls.trains_all_clients:
        raise ConfigError(
            f"--train-clients all: --method {name} trains only the sampled clients, as its paper does; "
            "drop --train-clients"
        )
    return cls(context)
