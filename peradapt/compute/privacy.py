"""Differential privacy of client training: DP-SGD through opacus, with an (ε, δ) accounted for each client.

What is protected: every sample of every client's training data, at the sample level (Abadi et al., "Deep Learning
with Differential Privacy", CCS 2016), as in PerAda's Table 5. Each step of client training (`LocalTrainer.sgd`:
personalized and local adapters alike) is a DP-SGD step:

    draw a batch by Poisson sampling: every sample of the client's n independently with probability q
    g_i <- per-sample gradient of sample i's loss                     (opacus GradSampleModule)
    g   <- (sum_i g_i * min(1, C / ||g_i||) + N(0, σ² C² I)) / (q n)  (opacus DPOptimizer: clip, noise, mean)
    v   <- v - η (g + λ (v - w))                                       (λ (v - w): the proximal pull, see below)

An epoch is ceil(n / B) steps with q = 1 / ceil(n / B): every sample is used once per epoch on average, as opacus'
own Poisson data loader does. Dividing by the expected batch size q n, not by the drawn one, keeps the batch size
itself private. The proximal pull λ (v - w) of PerAda / Ditto / FedProx depends on the parameters and on the global
model w, which the server sent, never on the data: a function of what is already private, it needs neither clipping
nor noise, and is taken at the same v as the private gradient. A step whose Poisson draw took no sample still
happens: noise only.

Accounting: a client's steps compose over every round in which it is sampled, personal and local training alike.
Each client keeps its history, a list of (σ, q, steps), in the `ClientStore` under PRIVACY_KEY, so that it follows
the round checkpoints (memory store) or the versioned files of the disk store: a resumed run sees exactly the
history of its checkpoint. ε at δ comes from opacus' RDP accountant (Mironov, "Rényi Differential Privacy", 2017;
the subsampled Gaussian of Mironov, Talwar & Zhang, 2019): RDP composes by adding, so a history of any length reduces
to one entry per (σ, q), and ε is a bound computed in tens of milliseconds per client, cached for clients with equal
histories. (opacus' PRV accountant gives ~10% smaller ε for the same steps, at several times the cost.)

Server-side distillation (PerAda, FedDF) reads the clients' uploaded models, themselves DP-SGD outputs, and public
unlabeled data: post-processing, which spends nothing. Test-set scores are measurements of the simulation, outside
the guarantee. Noise comes from a generator seeded by the training call's derived seed (opacus' `secure_mode` off), so
that a resumed run ends with the same numbers; a deployment would want opacus' secure_mode instead.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from peradapt.adapters import AdaptedModel
from peradapt.compute.task_metric import mean_and_std
from peradapt.config import PrivacyConfig, TrainConfig
from peradapt.errors import ConfigError
from peradapt.rundir.records import Privacy, Stats
from peradapt.rundir.store import ClientStore
from peradapt.seeds import NOISE, derive_seed

if TYPE_CHECKING:
    from opacus.optimizers import DPOptimizer

PRIVACY_KEY = "privacy"  # the client store slot of a client's accountant history
ACCOUNTANT = "rdp"
VIT_HINT = "use a ViT (--backbone vit_tiny_p4_32, vit_small_patch16_224, ...)"

History = tuple[tuple[float, float, int], ...]  # (noise multiplier σ, sample rate q, steps), as opacus' accountants


def _opacus() -> Any:
    try:
        import opacus
    except ImportError:
        raise ConfigError("--dp-noise trains with opacus, which is not installed: pip install 'peradapt[dp]'") from None
    return opacus


@dataclass(frozen=True)
class PoissonBatches:
    """`steps` batches of indices into n samples, each holding every sample independently with probability q."""

    num_samples: int
    sample_rate: float
    steps: int

    @property
    def expected_size(self) -> float:
        return self.sample_rate * self.num_samples

    def draw(self, generator: torch.Generator) -> Iterator[torch.Tensor]:
        from opacus.utils.uniform_sampler import UniformWithReplacementSampler

        if self.steps == 0:
            return
        sampler = UniformWithReplacementSampler(
            num_samples=self.num_samples, sample_rate=self.sample_rate, generator=generator, steps=self.steps
        )
        for indices in sampler:
            yield torch.tensor(indices, dtype=torch.long)


@dataclass
class PrivateTraining:
    """DP-SGD for `LocalTrainer.sgd`: the run's σ and C, opacus' machinery, and the steps taken since the last
    `charged_to` (what the current client spends)."""

    config: PrivacyConfig
    spent: list[tuple[float, float, int]] = field(default_factory=list)

    @property
    def noise_multiplier(self) -> float:
        assert self.config.dp_noise is not None
        return self.config.dp_noise

    @property
    def max_grad_norm(self) -> float:
        assert self.config.dp_clip is not None
        return self.config.dp_clip

    @staticmethod
    def batches(num_samples: int, batch_size: int, epochs: int, steps: int | None = None) -> PoissonBatches:
        """`epochs` epochs of ceil(n / B) steps at q = 1 / ceil(n / B): each sample once per epoch on average; with
        `steps`, that many steps at the same q."""
        steps_per_epoch = math.ceil(num_samples / batch_size)
        if steps_per_epoch == 0:  # no data, no step (as plain SGD)
            return PoissonBatches(0, 1.0, 0)
        return PoissonBatches(num_samples, 1 / steps_per_epoch, epochs * steps_per_epoch if steps is None else steps)

    def optimizer(self, groups: list[dict[str, Any]], *, lr: float, batches: PoissonBatches, seed: int) -> DPOptimizer:
        """SGD on the parameter `groups` (`torch.optim`'s, each with its learning rate; `lr` by default) wrapped by
        opacus' DPOptimizer: per-sample clipping to C over all of them, noise σC from a generator seeded by `seed`,
        and the mean over the expected batch size (the loss it sees is summed over the batch)."""
        noise = torch.Generator(device=groups[0]["params"][0].device).manual_seed(derive_seed(seed, NOISE))
        return _opacus().optimizers.DPOptimizer(
            torch.optim.SGD(groups, lr=lr),
            noise_multiplier=self.noise_multiplier,
            max_grad_norm=self.max_grad_norm,
            expected_batch_size=batches.expected_size,
            loss_reduction="mean",
            generator=noise,
        )

    @contextmanager
    def per_sample_gradients(self, module: nn.Module) -> Iterator[None]:
        """opacus' hooks on `module` while the block runs: every trainable parameter gets `grad_sample` at each
        backward pass, by opacus' layer rules (Linear, LayerNorm, Conv2d, ...) or its functorch fallback for other
        layers (timm's LayerNorm subclass, a ViT's class token and position embeddings). The hooks leave with the
        block: the server's distillation and evaluations run on the plain model."""
        hooks = _opacus().GradSampleModule(module, batch_first=True, loss_reduction="sum", strict=True)
        try:
            with warnings.catch_warnings():
                # opacus reads the gradients of a layer's outputs; that its frozen inputs get none is expected.
                warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
                yield
        finally:
            hooks.cleanup()

    @staticmethod
    def no_samples(parameters: Iterable[nn.Parameter]) -> None:
        """Per-sample gradients of a Poisson batch that drew no sample: none. The step then adds noise only."""
        for parameter in parameters:
            parameter.grad_sample = parameter.new_zeros((0, *parameter.shape))

    def spend(self, batches: PoissonBatches) -> None:
        if batches.steps:
            self.spent.append((self.noise_multiplier, batches.sample_rate, batches.steps))


def private_training(config: TrainConfig, model: AdaptedModel) -> PrivateTraining | None:
    """DP-SGD for `config`'s client training on `model`, or None without --dp-noise.

    Refuses a model whose trained layers cannot give per-sample gradients: BatchNorm in training mode normalizes each
    sample with its batch's statistics, so no sample's gradient is its own (PerAda Sec. 7.3 turns to a ViT for this).
    A ResNet's BatchNorms that stay frozen (LoRA with --scope adapter) normalize with fixed statistics and are fine.
    """
    if not config.privacy.enabled:
        return None
    opacus = _opacus()
    model.train()
    try:
        problems = opacus.validators.ModuleValidator.validate(model.module) + opacus.GradSampleModule.validate(
            model.module
        )
        batch_norms = [n for n, m in model.module.named_modules() if isinstance(m, _BatchNorm) and _trains(m)]
    finally:
        model.eval()
    if batch_norms:
        raise ConfigError(
            f"--dp-noise: this model trains BatchNorm layers (e.g. {batch_norms[0]}), whose batch statistics mix "
            f"samples, so no per-sample gradient can be clipped: {VIT_HINT}, or on a ResNet --adapter lora "
            "--scope adapter, which keeps its BatchNorms frozen"
        )
    if problems:
        reason = str(problems[0]).split(". ")[0]
        raise ConfigError(f"--dp-noise needs per-sample gradients of every trained layer, but {reason}: {VIT_HINT}")
    return PrivateTraining(config.privacy)


def _trains(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters(recurse=False))


# ---------------------------------------------------------------- accounting per client


@contextmanager
def charged_to(privacy: PrivateTraining | None, store: ClientStore, client_id: int) -> Iterator[None]:
    """Every DP-SGD step taken in the block is added to the history of `client_id` in `store`."""
    if privacy is None:
        yield
        return
    privacy.spent.clear()
    yield
    history = _merged(history_of(store, client_id) + tuple(privacy.spent))
    privacy.spent.clear()
    store.put(client_id, PRIVACY_KEY, {"history": torch.tensor(history, dtype=torch.float64).reshape(-1, 3)})


def history_of(store: ClientStore, client_id: int) -> History:
    """The (σ, q, steps) entries client `client_id` has spent; empty for a client that never trained."""
    state = store.get(client_id, PRIVACY_KEY)
    if state is None:
        return ()
    return tuple((float(sigma), float(rate), int(steps)) for sigma, rate, steps in state["history"].tolist())


def _merged(history: History) -> History:
    """One entry per (σ, q): RDP composes by adding, so steps of equal mechanisms add up in any order."""
    steps: dict[tuple[float, float], int] = {}
    for sigma, rate, count in history:
        steps[(sigma, rate)] = steps.get((sigma, rate), 0) + count
    return tuple((sigma, rate, count) for (sigma, rate), count in steps.items())


@functools.lru_cache(maxsize=4096)  # clients of equal size sampled equally often share a history
def epsilon(history: History, delta: float) -> float:
    """ε of the (ε, δ)-DP guarantee that `history` gives at `delta`, by opacus' RDP accountant; 0 for no steps."""
    if not history:
        return 0.0
    accountant = _opacus().accountants.RDPAccountant()
    accountant.history = list(history)
    return float(accountant.get_epsilon(delta))


def round_epsilons(privacy: PrivateTraining | None, store: ClientStore, clients: list[int]) -> dict[str, list[float]]:
    """For a round's record: the ε each of its clients has spent so far (nothing without DP)."""
    if privacy is None:
        return {}
    return {"dp_epsilon": [epsilon(history_of(store, c), privacy.config.dp_delta) for c in clients]}


def privacy_report(privacy: PrivateTraining | None, store: ClientStore, clients: list[int]) -> Privacy | None:
    """report.json's `privacy`: the mechanism's settings and every client's ε, with their mean, std and max."""
    if privacy is None:
        return None
    histories = [history_of(store, c) for c in clients]
    per_client = [epsilon(history, privacy.config.dp_delta) for history in histories]
    return Privacy(
        **_settings(privacy.config),
        epsilon=Stats(**mean_and_std(per_client), max=max(per_client, default=0.0), per_client=per_client),
        steps=[_steps(history) for history in histories],
    )


def client_privacy(privacy: PrivateTraining | None, store: ClientStore, client_id: int) -> dict:
    """The `privacy` of one client's result (a new client personalized after training): settings, its ε and steps."""
    if privacy is None:
        return {}
    history = history_of(store, client_id)
    epsilon_spent = epsilon(history, privacy.config.dp_delta)
    return {"privacy": {**_settings(privacy.config), "epsilon": epsilon_spent, "steps": _steps(history)}}


def _settings(config: PrivacyConfig) -> dict:
    return {
        "mechanism": "DP-SGD, Poisson sampling, per-sample clipping (opacus)",
        "accountant": ACCOUNTANT,
        "noise_multiplier": config.dp_noise,
        "max_grad_norm": config.dp_clip,
        "delta": config.dp_delta,
    }


def _steps(history: History) -> int:
    return sum(steps for _, _, steps in history)
