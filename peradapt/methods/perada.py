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

With `--frozen-bn train` the frozen BatchNorms' running statistics (the ResNets' downsample BatchNorms) are part of
every state. By default they are averaged and sent like the rest of the global adapter. `--frozen-bn-statistics
local` does as the authors' code: their server averages only the adapters, BatchNorms bn1/bn2 and classifier and
takes every other entry from the first client of the round's sample (aggregation/averaging.py; `random.sample`'s
first, which is uniform over the sampled clients: here a seeded uniform draw among them), and sends only what it
averaged, so each client's local model keeps its own frozen statistics from one round it is sampled to the next
(optim/base.py, `state_dict_sever_to_client`).

Those local models are also the authors' distillation teachers, left in training mode by client training, so every
teacher pass under `--kd-mode train` moves their frozen BatchNorms' running statistics, which the client trains
from when it is next sampled (aggregation/distillation.py). `--kd-teacher-statistics authors` does the same: the
statistics each teacher's passes leave replace its client's own. The server's were taken before distillation, from
the uploads, as the authors' averaging takes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from peradapt.adapters import AdapterState
from peradapt.data import ClientData
from peradapt.errors import ConfigError
from peradapt.methods.base import ClientSteps, ClientUpdate, MethodContext, ProximalPersonalization, register
from peradapt.seeds import SAMPLING, derive_seed
from peradapt.settings import setting

FROZEN_BN_STATISTICS = ("averaged", "local")
KD_TEACHER_STATISTICS = ("unchanged", "authors")
LOCAL_NORMS_KEY = "local_frozen_bn"  # a client's own frozen BatchNorm statistics, with --frozen-bn-statistics local


@dataclass
class PerAdaSettings:
    frozen_bn_statistics: str = setting(
        "averaged",
        help="With --frozen-bn train, the frozen BatchNorms' running statistics: averaged (by the server and sent "
        "to the clients, as every trained statistic) or local (each client's local model keeps its own across "
        "rounds; the server takes one sampled client's, drawn uniformly: the authors' code).",
        choices=FROZEN_BN_STATISTICS,
    )


@dataclass
class PerAdaKDSettings(PerAdaSettings):
    """perada's own, beside those perada-nokd shares: what its distillation does to the teachers."""

    kd_teacher_statistics: str = setting(
        "unchanged",
        help="What distillation's teacher passes do to the clients' frozen BatchNorm statistics: unchanged (the "
        "teachers are read) or authors (each training-mode pass moves its teacher's, which its client trains from "
        "next: the authors' code; needs --kd-mode train, --frozen-bn train, --frozen-bn-statistics local).",
        choices=KD_TEACHER_STATISTICS,
    )


@register
class PerAda(ProximalPersonalization):
    name = "perada"
    summary = "personalized adapters with a proximal term to a KD-distilled global adapter (Algorithm 1)"
    default_aggregation = "uniform"  # Algorithm 1, lines 17-18: (1/C) sum of the local adapters
    uses_distillation = True
    uses_proximal = True  # the personal update (line 10); perada-nokd inherits it
    supports_dp = True
    settings_class = PerAdaKDSettings
    settings: PerAdaKDSettings  # perada-nokd's are PerAdaSettings: kd_teacher_statistics is read where it distills

    def __init__(self, context: MethodContext) -> None:
        super().__init__(context)
        local = self.settings.frozen_bn_statistics == "local"
        self.moves_teachers = self.uses_distillation and self.settings.kd_teacher_statistics == "authors"
        if self.moves_teachers:
            distiller = self.context.distiller
            needs = {
                "--kd-mode train": distiller is not None and distiller.config.kd_mode == "train",  # passes that move
                "--frozen-bn train": self.config.frozen_bn == "train",  # the statistics in the state
                "--frozen-bn-statistics local": local,  # a client's own, which it trains from
            }
            missing = [flag for flag, holds in needs.items() if not holds]
            if missing:
                raise ConfigError(
                    "--kd-teacher-statistics authors moves the frozen BatchNorm statistics each client keeps in "
                    f"distillation's training-mode teacher passes: add {' '.join(missing)}"
                )
        # The state keys each client keeps for itself (none: all of the state is the global adapter's).
        self.local_norms = self.trainer.model.frozen_norm_buffers if local else frozenset()
        if local and not self.local_norms:
            raise ConfigError(
                "--frozen-bn-statistics local keeps the frozen BatchNorms' running statistics on the clients, and "
                "this model trains none: add --frozen-bn train, or drop it for a backbone without BatchNorms"
            )

    def client_steps(self, client: ClientData, global_state: AdapterState, seed: int) -> ClientSteps:
        _, personal_loss = yield from self.proximal_personal_steps(client, global_state, seed)  # line 10
        start = {**global_state, **self.own_norms(client.client_id)}
        local, local_loss = yield self.local_job(client, start, seed)  # lines 12-15
        if self.local_norms:
            self.store.put(client.client_id, LOCAL_NORMS_KEY, {key: local[key] for key in self.local_norms})
        metrics = {"personal_loss": personal_loss, "local_loss": local_loss}
        return ClientUpdate(client.client_id, local, len(client.train), metrics)

    def client_samples_bound(self, client: ClientData) -> int:
        return self.personal_samples(client) + self.local_samples(client)

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
        if self.local_norms:  # the authors' averaging: the frozen statistics of one sampled client, drawn uniformly
            first = updates[np.random.default_rng(derive_seed(seed, SAMPLING)).integers(len(updates))]
            averaged = {**averaged, **{key: first.upload[key] for key in self.local_norms}}
        distiller = self.context.distiller
        if not self.uses_distillation or not distiller or not distiller.active(round_index):
            return averaged, {}
        moved: list[AdapterState] | None = [] if self.moves_teachers else None
        distilled = distiller.distill(averaged, teachers, seed=seed, on_step=on_step, teacher_statistics=moved)
        if moved is not None:  # each client's statistics as its teacher's passes left them, for its next round
            for update, statistics in zip(updates, moved, strict=True):
                self.store.put(update.client_id, LOCAL_NORMS_KEY, statistics)
        return distilled  # lines 19-22

    def own_norms(self, client_id: int) -> AdapterState:
        """The frozen statistics the client's local model keeps (`--frozen-bn-statistics local`): from the round it
        was last sampled in, or the initial ones; none when they are the global adapter's."""
        if not self.local_norms:
            return {}
        stored = self.store.get(client_id, LOCAL_NORMS_KEY)
        return stored if stored is not None else {key: self.context.initial[key] for key in self.local_norms}


@register
class PerAdaNoKD(PerAda):
    name = "perada-nokd"
    summary = "PerAda without server distillation: the global adapter is the plain mean of local adapters"
    uses_distillation = False
    settings_class = PerAdaSettings  # no teachers: no --kd-teacher-statistics
