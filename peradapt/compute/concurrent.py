"""Several clients' local SGD at once on the one shared model (`--concurrent-clients`).

`LocalTrainer.run` trains one client at a time: on a GPU, a step of a small model at 32 px is a few hundred tiny
kernel launches, and the device waits on them. Here the jobs of K clients step together. Their adapter states
(parameters and trainable BatchNorms' running statistics) are stacked on a leading axis, and one call of
`torch.func.vmap` over `torch.func.grad` of one client's loss, through `torch.func.functional_call` on the shared
frozen model, gives all K gradients: each frozen layer runs once on the K batches, each client's layer once as a
batched kernel (a grouped product, a BatchNorm over K×C channels). Nothing of the backbone is copied.

Each client's numbers are those of `LocalTrainer.run` run alone, as the paper's update rule says (PerAda Algorithm
1, lines 10 and 15): the same minibatches from the job's own generator, the same dropout masks, and per step g =
grad L(v) (+ lam (v - w) with an anchor, + c with a correction), then v <- v - lr g, each parameter at its group's
rate (`SGDJob.groups`: a partial model's parts at their own rates). Parameters of no group are held fixed, no
gradient computed for them, and every key of no group comes back as it started (its BatchNorms' running statistics,
which the forward passes move, restored). Jobs that train other parameters (partial models in another phase) step in
a batched pass of their own. Dropout is the one random draw inside the model; `vmap` cannot split the global
generator by client, so each client's masks are drawn before the step from a generator seeded as `LocalTrainer.run`
seeds the global one, in the order and layout the model's forward pass draws them (recorded once per input shape).
On CPU that reproduces `run`'s masks exactly, and the results agree with one-after-another training to float
rounding (batched kernels sum in another order). On a GPU, `nn.Dropout` draws inside a fused kernel that cannot be
replayed, so the masks are other (equally distributed) draws: one draw per dropout call for the whole group, from a
generator seeded by the group's jobs, so that runs (and resumed runs) repeat themselves.

Clients with different amounts of data take different numbers of steps, and an epoch's last minibatch is smaller:
each step trains together the clients whose batches have the same shape, and a client that is done drops out.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

from peradapt.adapters.branch import AdapterDropout, ChannelProjection, keep_mask
from peradapt.adapters.model import logits_of
from peradapt.backbones.small_inputs import SmallInputConv2d
from peradapt.compute.costs import ClientWork, sgd_samples
from peradapt.compute.fused import RANDOM_DRAWS, FusedStep, fusable, masked_dropouts
from peradapt.compute.trainer import LocalTrainer, SGDJob, SGDResult, T, finite_means, task_loss
from peradapt.data import ImageSet
from peradapt.data.batches import AugmentationDraws
from peradapt.errors import ConfigError
from peradapt.seeds import derive_seed

# Where a dropout module is called in the forward pass, and the rest of its input's shape and its strides.
DropoutCall = tuple[str, tuple[int, ...], tuple[int, ...]]


@dataclass
class _Lane:
    """One job's progress: its index batches (`LocalTrainer.index_batches`) into its rows of the pooled images,
    which start at `offset`; its dropout generator; its losses so far."""

    job: SGDJob
    batches: Iterator[tuple[torch.Tensor, torch.Generator]]
    offset: int
    dropout: torch.Generator
    losses: list[torch.Tensor] = field(default_factory=list)


@dataclass
class _Together:
    """Jobs stepping together: their lanes, their update, and the generator of their dropout masks off CPU."""

    lanes: list[_Lane]
    rule: _Rule
    generator: torch.Generator  # off CPU, the group's dropout masks (see _masks)


@dataclass
class _Rule:
    """The update of jobs that train the same parameters, stepping together: their states stacked on a leading axis
    (one lane per job), what trains at which rate, the anchors and pulls. With CUDA graphs a rule is kept for the
    next jobs of its kind (the next round's), its tensors refilled in place, so that the steps captured for it
    (`graphs`, by input shape) replay for them too."""

    stacked: dict[str, torch.Tensor]  # every state key
    trained: list[str]  # the parameters that train, in the model's order
    fixed: list[str]  # the other keys: buffers (running statistics: updated in place) and frozen parameters
    # The trained parameters by their rates in the lanes, as factors -lr (one per lane): v <- v - lr g.
    rates: list[tuple[list[float], list[str]]]
    anchors: dict[str, torch.Tensor] | None  # of the trained parameters; None: no lane is pulled
    lams: list[float]
    # of the trained parameters (`SGDJob.correction`, zero for a lane without one); None: no lane has one
    corrections: dict[str, torch.Tensor] | None = None
    eager_steps: dict[tuple[int, ...], int] = field(default_factory=dict)  # steps of every lane, by input shape
    graphs: dict[tuple[int, ...], _Captured] = field(default_factory=dict)  # by input shape
    _factors: dict[tuple[float, ...], torch.Tensor] = field(default_factory=dict)

    def factors(self, values: list[float], group: list[int]) -> float | torch.Tensor:
        """The lanes `group`'s factors of `values` (one per lane) for `_add_scaled_`: one number where they agree
        (the usual case: one --lr, one lam), else a tensor on the device, made once per set of factors (no copy
        from the host inside a captured step)."""
        chosen = tuple(values[i] for i in group)
        if len(set(chosen)) == 1:
            return float(chosen[0])
        if chosen not in self._factors:
            device = next(iter(self.stacked.values())).device
            self._factors[chosen] = torch.tensor(chosen, device=device)
        return self._factors[chosen]

    @torch.no_grad()
    def refill(
        self,
        stacked: dict[str, list[torch.Tensor]],
        anchors: dict[str, list[torch.Tensor]] | None,
        corrections: dict[str, list[torch.Tensor]] | None,
    ) -> None:
        """The next jobs' states, anchors and corrections (one tensor per lane), copied into this rule's tensors."""
        for into, sources in ((self.stacked, stacked), (self.anchors, anchors), (self.corrections, corrections)):
            for name, tensors in (sources or {}).items():
                into[name].copy_(torch.stack(tensors))  # type: ignore[index]


GRAPH_WARM_UP = 2  # eager steps of a shape before its step is captured as a CUDA graph


@dataclass
class _StepInputs:
    """A captured step's inputs: buffers at fixed addresses that each step fills."""

    images: torch.Tensor
    labels: torch.Tensor
    masks: dict[str, list[torch.Tensor]]
    weights: torch.Tensor | None  # a padded step's (`ConcurrentSGD._padded_step`)

    def fill(
        self,
        masks: dict[str, list[torch.Tensor]],
        images: torch.Tensor,
        labels: torch.Tensor,
        weights: torch.Tensor | None,
    ) -> None:
        self.images.copy_(images)
        self.labels.copy_(labels)
        if self.weights is not None and weights is not None:
            self.weights.copy_(weights)
        for name, calls in masks.items():
            torch._foreach_copy_(self.masks[name], calls)


@dataclass
class _Captured:
    """One shape's step (`step`, on `inputs`) as a CUDA graph: captured at the first `replay`, replayed after;
    without a graph (off the GPU), run again at each `replay`. `replay` gives the lanes' losses (a buffer the
    next replay overwrites)."""

    inputs: _StepInputs
    step: Callable[[], torch.Tensor]
    graph: torch.cuda.CUDAGraph | None
    pool: Any = None  # the memory pool the graph allocates from (`torch.cuda.graph_pool_handle`)
    losses: torch.Tensor | None = None

    def replay(self) -> torch.Tensor:
        if self.graph is None:
            self.losses = self.step()
        else:
            if self.losses is None:  # capturing records the kernels without running them
                with torch.cuda.graph(self.graph, pool=self.pool):
                    self.losses = self.step()
            self.graph.replay()
        return self.losses


def unsupported_layers(module: nn.Module) -> list[str]:
    """Random layers other than `nn.Dropout` (e.g. `nn.Dropout2d`) whose draws could not be replayed per client."""
    return [
        name
        for name, layer in module.named_modules()
        if isinstance(layer, _DropoutNd) and not isinstance(layer, nn.Dropout) and layer.p > 0
    ]


class ConcurrentSGD:
    """Trains several `SGDJob`s at once on `trainer`'s model (see the module's docstring)."""

    def __init__(self, trainer: LocalTrainer, fused: bool = True, graphs: bool | None = None) -> None:
        """`fused`: a model whose clients' state lies in modules `peradapt.compute.fused` serves trains by its fused
        step; False, or any other model: by `vmap` over `grad` (this module's docstring). `graphs`: the fused
        steps of every lane replayed from CUDA graphs (`_replayed`); None: on a GPU. Off the GPU, True runs the
        same path without graphs (tests)."""
        if trainer.privacy is not None:
            raise ValueError("DP-SGD clips each client's per-sample gradients: its clients train one at a time")
        self.trainer = trainer
        self.model = trainer.model
        self.module = trainer.model.module
        self.parameter_names = list(self.model.trainable_parameters())
        self.state_names = self.model.state_names()
        self.dropouts = {name: m for name, m in self.module.named_modules() if isinstance(m, nn.Dropout)}
        self.projections = [m for m in self.module.modules() if isinstance(m, ChannelProjection)]
        self.norms = [m for m in self.module.modules() if isinstance(m, _BatchNorm)]
        # The BatchNorm kernel where `vmap` can differentiate it (CPU); elsewhere the formula (see its docstring).
        on_cpu, on_gpu = trainer.model.device.type == "cpu", trainer.model.device.type == "cuda"
        self.norm_forward = _native_batch_norm if on_cpu else _batch_norm_by_formula
        self.small_convs = {f"{n}.weight": m for n, m in self.module.named_modules() if isinstance(m, SmallInputConv2d)}
        self._calls: dict[tuple[int, ...], list[DropoutCall]] = {}
        self._gradients = vmap(grad(self._client_loss, has_aux=True))
        self.fused = (
            FusedStep(
                self.module,
                self.state_names,
                self.dropouts,
                trainer.inputs.autocast,
                functools.partial(task_loss, reduction="none"),
            )
            if fused and fusable(self.module, self.state_names)
            else None
        )
        self.graphs = self.fused is not None and (on_gpu if graphs is None else graphs)
        self._rules: dict[tuple, _Rule] = {}  # with graphs: kept for the next jobs like theirs (`_rule`)
        self._pool: Any = None  # with graphs on a GPU: the memory pool of all captured steps

    def run_steps(
        self,
        steps: Sequence[Generator[SGDJob, SGDResult, T]],
        on_finished: Callable[[int, ClientWork], None] | None = None,
        shares: Sequence[float] | None = None,
    ) -> list[T]:
        """Drive generators of SGD jobs (e.g. `LocalSGDMethod.client_steps`) side by side: the next job of each
        trained together with the others' (`run`); what each returns, in their order, calling
        `on_finished(i, work)` as the i-th one ends, with the training samples of its jobs (the minibatches
        `LocalTrainer.minibatches` draws for them: `sgd_samples`) and the elements they train, and what it trains
        itself between them (FedALA's ALA, counted by `LocalTrainer.samples_trained` and `elements_trained`).
        `LocalTrainer.run_steps` drives one. `shares`: the share of its work each does (`LocalTrainer.work_share`;
        None: all)."""
        finished: dict[int, T] = {}
        pending: dict[int, SGDJob] = {}
        work = [ClientWork() for _ in steps]
        shares = [1.0] * len(steps) if shares is None else shares
        trainer = self.trainer

        def advance(index: int, result: SGDResult | None) -> None:
            samples, trained = trainer.samples_trained, trainer.elements_trained
            try:
                with trainer.sharing(shares[index]):  # what a client trains itself between jobs: its share
                    pending[index] = steps[index].send(result)  # type: ignore[arg-type]  # None starts a generator
            except StopIteration as done:
                finished[index] = done.value
            work[index].samples += trainer.samples_trained - samples  # trained by the client itself: FedALA's ALA
            work[index].trained += trainer.elements_trained - trained
            if index in finished and on_finished is not None:
                on_finished(index, work[index])

        for index in range(len(steps)):
            advance(index, None)
        while pending:
            jobs = dict(pending)
            pending.clear()
            job_shares = [shares[index] for index in jobs]
            for index, result in zip(jobs, self.run(list(jobs.values()), job_shares), strict=True):
                job = jobs[index]
                work[index].samples += sgd_samples(
                    len(job.data), trainer.batch_size, epochs=job.epochs, steps=job.steps, share=shares[index]
                )
                work[index].trained += sum(job.start[name].numel() for name in job.rates(self.parameter_names))
                advance(index, result)
        return [finished[index] for index in range(len(steps))]

    def run(self, jobs: Sequence[SGDJob], shares: Sequence[float] | None = None) -> list[SGDResult]:
        """The result of `LocalTrainer.run` for each job, in their order (each at its share of the work: `shares`,
        None: all): the jobs that train the same parameters together (`_run_together`)."""
        shares = [1.0] * len(jobs) if shares is None else shares
        alike: dict[tuple[str, ...], list[int]] = {}
        for index, job in enumerate(jobs):
            alike.setdefault(tuple(job.rates(self.parameter_names)), []).append(index)
        results: dict[int, SGDResult] = {}
        for indices in alike.values():
            together = self._run_together([jobs[i] for i in indices], [shares[i] for i in indices])
            results.update(zip(indices, together, strict=True))
        return [results[index] for index in range(len(jobs))]

    def _run_together(self, jobs: list[SGDJob], shares: list[float]) -> list[SGDResult]:
        """`run` of jobs that all train the same parameters. Their images are pooled (on a GPU, resident there for
        the jobs), so that a step's inputs for all its lanes are one gather, one augmentation and one normalization
        (`_inputs`); each lane's batch and augmentation are drawn from its own generator, in `LocalTrainer.run`'s
        order."""
        device = self.model.device
        rule = self._rule(jobs)
        offsets = [0]
        for job in jobs[:-1]:
            offsets.append(offsets[-1] + len(job.data))
        lanes = [
            _Lane(
                job,
                self.trainer.index_batches(
                    len(job.data), epochs=job.epochs, seed=job.seed, steps=job.steps, share=share
                ),
                offset,
                torch.Generator(device=device).manual_seed(job.seed),
            )
            for job, offset, share in zip(jobs, offsets, shares, strict=True)
        ]
        pooled = self._pooled([job.data for job in jobs])
        image_size = tuple(pooled[0].shape[2:])
        masks = torch.Generator(device=device).manual_seed(derive_seed(*(job.seed for job in jobs)))  # see _masks
        together = _Together(lanes, rule, masks)
        self.model.train()
        while True:
            drawn: dict[int, tuple[torch.Tensor, AugmentationDraws | None]] = {}
            for index, lane in enumerate(lanes):
                batch = next(lane.batches, None)  # an ended lane's generator stays ended
                if batch is not None:
                    rows, generator = batch
                    # drawn now, before the lane's next batch: its generator's order is `minibatches`'
                    drawn[index] = (rows + lane.offset, self.trainer.inputs.draw(len(rows), image_size, generator))
            if not drawn:
                break
            if self.graphs:  # every lane in every step, padded, so that one captured step serves
                self._padded_step(together, *self._padded_inputs(pooled, drawn, len(lanes)))
                continue
            sizes: dict[int, list[int]] = {}
            for index, (rows, _) in drawn.items():
                sizes.setdefault(len(rows), []).append(index)
            for group in sizes.values():
                self._step(together, group, *self._inputs(pooled, [drawn[i] for i in group]))
        return [self._result(lane, {n: t[i] for n, t in rule.stacked.items()}) for i, lane in enumerate(lanes)]

    def _pooled(self, data: list[ImageSet]) -> tuple[torch.Tensor, torch.Tensor]:
        """The jobs' images and labels, one after another, on the model's device."""
        device = self.model.device
        labels = [part.labels for part in data]
        assert all(part is not None for part in labels), "training data must be labeled"
        return torch.cat([part.images for part in data]).to(device), torch.cat(labels).to(device)  # type: ignore[arg-type]

    def _inputs(
        self, pooled: tuple[torch.Tensor, torch.Tensor], drawn: list[tuple[torch.Tensor, AugmentationDraws | None]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A step's inputs [K, B, ...] and labels [K, B, ...] of K lanes' rows of the pooled images and their
        augmentation draws: one gather, one augmentation, one normalization for all of them."""
        images, labels = pooled
        rows = torch.cat([lane_rows for lane_rows, _ in drawn]).to(images.device, non_blocking=True)
        draws = None
        if drawn[0][1] is not None:
            draws = tuple(torch.cat(parts) for parts in zip(*(lane_draws for _, lane_draws in drawn), strict=True))
        inputs = self.trainer.inputs.prepared(images[rows], draws)
        return inputs.unflatten(0, (len(drawn), -1)), labels[rows].unflatten(0, (len(drawn), -1))

    def _padded_inputs(
        self,
        pooled: tuple[torch.Tensor, torch.Tensor],
        drawn: dict[int, tuple[torch.Tensor, AugmentationDraws | None]],
        lanes: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """`_inputs` of every lane, each padded to the step's widest batch: a lane whose batch is shorter (the end of
        its epoch), or that is done, fills its rows with the pool's first image, unaugmented, of weight 0. The
        images and labels [K, width, ...], the weights [K, width] on the host (1: a lane's own image), each lane's
        count."""
        images = pooled[0]
        width = max(len(rows) for rows, _ in drawn.values())
        size = tuple(images.shape[2:])
        padded, weights, counts = [], torch.zeros(lanes, width), []
        for lane in range(lanes):
            rows, draws = drawn.get(lane, (torch.zeros(0, dtype=torch.int64), None))
            missing = width - len(rows)
            if missing:
                neutral = self.trainer.inputs.neutral(missing, size)
                if neutral is not None:
                    draws = neutral if draws is None else tuple(map(torch.cat, zip(draws, neutral, strict=True)))
                rows = torch.cat([rows, rows.new_zeros(missing)])
            padded.append((rows, draws))
            weights[lane, : width - missing] = 1
            counts.append(width - missing)
        inputs, labels = self._inputs(pooled, padded)
        return inputs, labels, weights, counts

    def _padded_step(
        self,
        together: _Together,
        images: torch.Tensor,
        labels: torch.Tensor,
        weights: torch.Tensor,
        counts: list[int],
    ) -> None:
        """One SGD step of every lane on its padded batch (`_padded_inputs`), replayed from a captured step
        (`_replayed`): each lane as if it stepped alone on its own images, and a lane without any (done) does not
        move: its gradient is 0, its pull and step are multiplied by 0 and its BatchNorms' statistics stay. Steps
        in which every lane has a whole batch take the unweighted step."""
        lanes = together.lanes
        padded = any(count != images.shape[1] for count in counts)
        generators = [lane.dropout for lane in lanes]
        masks = self._masks(images[0], generators, together.generator, counts if padded else None)
        on_device = weights.to(images.device, non_blocking=True) if padded else None  # a whole step needs none
        losses = self._replayed(together.rule, masks, images, labels, on_device)
        for lane, count, loss in zip(lanes, counts, losses, strict=True):
            if count:
                lane.losses.append(loss)

    def _rule(self, jobs: list[SGDJob]) -> _Rule:
        """The `_Rule` of `jobs`, their states and anchors stacked; with CUDA graphs the kept rule of jobs like
        these (same count, parameters, rates and pulls), refilled."""
        device = self.model.device
        trained = list(jobs[0].rates(self.parameter_names))
        stacked = {name: [job.start[name].to(device) for job in jobs] for name in self.state_names}
        anchored = [job.anchor is not None and job.lam > 0 for job in jobs]
        anchors = None
        if any(anchored):  # a job without a pull gets lam 0 and its own start as anchor: it adds exactly 0
            sources = [job.anchor if pulled else job.start for job, pulled in zip(jobs, anchored, strict=True)]
            anchors = {n: [s[n].to(device) for s in sources] for n in trained}  # type: ignore[index]
        lane_rates = [job.rates(trained) for job in jobs]
        rates: dict[tuple[float, ...], list[str]] = {}
        for name in trained:
            rates.setdefault(tuple(-lane[name] for lane in lane_rates), []).append(name)
        lams = [job.lam if pulled else 0.0 for job, pulled in zip(jobs, anchored, strict=True)]
        corrections = None
        if any(job.correction for job in jobs):  # a lane without a correction adds zeros
            corrections = {
                n: [(job.correction or {}).get(n, torch.zeros_like(job.start[n])).to(device) for job in jobs]
                for n in trained
            }
        shape = (len(jobs), anchors is not None, corrections is not None, tuple(lams))
        key = (*shape, tuple((f, tuple(n)) for f, n in rates.items()))
        kept = self._rules.get(key) if self.graphs else None
        if kept is not None:
            kept.refill(stacked, anchors, corrections)
            return kept
        rule = _Rule(
            {name: torch.stack(tensors) for name, tensors in stacked.items()},
            trained,
            [name for name in self.state_names if name not in set(trained)],
            [(list(factors), names) for factors, names in rates.items()],
            None if anchors is None else {name: torch.stack(tensors) for name, tensors in anchors.items()},
            lams,
            None if corrections is None else {name: torch.stack(tensors) for name, tensors in corrections.items()},
        )
        if self.graphs:
            self._rules[key] = rule
        return rule

    def _step(self, together: _Together, group: list[int], images: torch.Tensor, labels: torch.Tensor) -> None:
        """One SGD step of the lanes `group` (indices into the stacks), each on its own batch (without graphs: with
        them every step is `_padded_step`)."""
        lanes, rule = together.lanes, together.rule
        whole = group == list(range(len(lanes)))  # else the group's rows are gathered, stepped and put back
        index = torch.tensor(group, device=self.model.device) if not whole else None
        part = rule.stacked if index is None else {name: tensor[index] for name, tensor in rule.stacked.items()}
        masks = self._masks(images[0], [lanes[i].dropout for i in group], together.generator)
        losses = self._update(rule, group, index, part, masks, images, labels)
        if index is not None:
            with torch.no_grad():
                for name, tensor in part.items():
                    rule.stacked[name][index] = tensor
        for lane_index, loss in zip(group, losses, strict=True):
            lanes[lane_index].losses.append(loss)

    def _update(
        self,
        rule: _Rule,
        group: list[int],
        index: torch.Tensor | None,
        part: dict[str, torch.Tensor],
        masks: dict[str, list[torch.Tensor]],
        images: torch.Tensor,
        labels: torch.Tensor,
        weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The step's tensor work on the lanes `group`'s stacked state `part` (rows `index` of the stacks; None:
        all): each lane's gradient, the proximal pull and the SGD step in place; the lanes' losses. With `weights`
        (a padded step of the fused pass, `_padded_step`) a lane without images of weight 1 does not move."""
        parameters = {name: part[name] for name in rule.trained}
        fixed = {name: part[name] for name in rule.fixed}
        try:
            if weights is None:
                gradients, losses = (self.fused or self._gradients)(parameters, fixed, masks, images, labels)
            else:
                assert self.fused is not None, "padded steps are the fused pass's"
                gradients, losses = self.fused(parameters, fixed, masks, images, labels, weights)
        except RuntimeError as error:
            if "randomness" not in str(error):
                raise
            raise ConfigError(RANDOM_DRAWS) from None
        anchors = rule.anchors
        moving = None if weights is None else (weights.sum(1) > 0).to(weights.dtype)  # lanes with images

        def factors(values: list[float]) -> float | torch.Tensor:
            chosen = rule.factors(values, group)
            return chosen if moving is None else moving * chosen

        with torch.no_grad():
            steps = [gradients[name] for name in parameters]
            if anchors is not None:  # g <- g + lam (v - w): PerAda Algorithm 1, line 10
                pulls = torch._foreach_sub(
                    list(parameters.values()), [anchors[n] if index is None else anchors[n][index] for n in parameters]
                )
                _add_scaled_(steps, pulls, factors(rule.lams))
            if rule.corrections is not None:  # g <- g + c: SCAFFOLD's c - c_i (`SGDJob.correction`)
                corrections = rule.corrections
                torch._foreach_add_(
                    steps, [corrections[n] if index is None else corrections[n][index] for n in parameters]
                )
            for rates, names in rule.rates:  # v <- v - lr g
                targets, addends = [parameters[n] for n in names], [gradients[n] for n in names]
                _add_scaled_(targets, addends, factors(rates))
        return losses

    def _replayed(
        self,
        rule: _Rule,
        masks: dict[str, list[torch.Tensor]],
        images: torch.Tensor,
        labels: torch.Tensor,
        weights: torch.Tensor | None,
    ) -> torch.Tensor:
        """`_update` of every lane, replayed from a CUDA graph captured for `rule` and the shape of `images` once
        the first `GRAPH_WARM_UP` such steps ran eagerly (on a side stream: the libraries' lazy set-up is not
        captured). The graph reads the step's inputs and masks from buffers of its own, which each step fills (a
        copy each), and works on the rule's stacked state in place, as `_update` does. All graphs share one memory
        pool: they run one after another. Off the GPU (tests) the same buffers are used without a graph."""
        key = (*images.shape, weights is not None)
        done = rule.eager_steps.get(key, 0)
        device = self.model.device
        on_gpu = device.type == "cuda"
        everyone = list(range(len(images)))
        if done < GRAPH_WARM_UP:
            rule.eager_steps[key] = done + 1
            side = torch.cuda.Stream(device) if on_gpu else None
            with contextlib.ExitStack() as stack:
                if side is not None:
                    side.wait_stream(torch.cuda.current_stream(device))
                    stack.enter_context(torch.cuda.stream(side))
                losses = self._update(rule, everyone, None, rule.stacked, masks, images, labels, weights)
            if side is not None:
                torch.cuda.current_stream(device).wait_stream(side)
            return losses
        captured = rule.graphs.get(key)
        if captured is None:
            copies = {name: [mask.clone() for mask in calls] for name, calls in masks.items()}
            inputs = _StepInputs(images.clone(), labels.clone(), copies, None if weights is None else weights.clone())
            step = functools.partial(
                self._update,
                rule,
                everyone,
                None,
                rule.stacked,
                inputs.masks,
                inputs.images,
                inputs.labels,
                inputs.weights,
            )
            if on_gpu and self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph() if on_gpu else None
            captured = rule.graphs[key] = _Captured(inputs, step, graph, self._pool)
        else:
            captured.inputs.fill(masks, images, labels, weights)
        return captured.replay().clone()

    def _client_loss(
        self,
        parameters: dict[str, torch.Tensor],
        fixed: dict[str, torch.Tensor],
        masks: dict[str, list[torch.Tensor]],
        images: torch.Tensor,
        labels: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One client's mean training loss on its batch, as `LocalTrainer.loss` computes it (vmapped over clients),
        differentiated by `grad` in the trained `parameters` only."""
        with self._batched_forwards(masks, fixed), self.trainer.inputs.autocast():
            loss = task_loss(logits_of(functional_call(self.module, {**parameters, **fixed}, (images,))), labels)
        return loss, loss.detach()

    @contextlib.contextmanager
    def _batched_forwards(self, masks: dict[str, list[torch.Tensor]], fixed: dict[str, torch.Tensor]) -> Iterator[None]:
        """Inside `vmap`:
        - each training dropout multiplies by its client's masks, `masks[name]` one per call in call order (a
          dropout of rate 0 passes its input);
        - BatchNorms compute in float32 (`vmap`'s BatchNorm rule cannot take the bf16 inputs of autocast), off
          the CPU by their formula (`_batch_norm_by_formula`);
        - the residual adapters' projections are the matrix product `vmap` batches into one (their own test for a
          channels-last input cannot be asked of a batched tensor);
        - convolutions whose weights are the clients' own but do not train (`fixed`: a partial model's frozen part)
          run as convolutions: the dense matrix `SmallInputConv2d` makes of frozen weights is one weight's."""
        replaced: list[nn.Module] = []
        for name in fixed:
            conv = self.small_convs.get(name)
            if conv is not None:
                conv.forward = functools.partial(nn.Conv2d.forward, conv)  # type: ignore[method-assign]
                replaced.append(conv)
        for norm in self.norms:
            norm.forward = functools.partial(self.norm_forward, norm)  # type: ignore[method-assign]
            replaced.append(norm)
        for projection in self.projections:
            projection.forward = projection.channel_product  # type: ignore[method-assign]
            replaced.append(projection)
        try:
            with masked_dropouts(self.dropouts, masks):
                yield
        finally:
            for module in replaced:
                del module.forward

    def _masks(
        self,
        example: torch.Tensor,
        generators: list[torch.Generator],
        generator: torch.Generator,
        counts: list[int] | None = None,
    ) -> dict[str, list[torch.Tensor]]:
        """Per dropout of a forward pass on batches like `example`, the group's masks stacked on the lane axis (one
        lane per generator of `generators`), one per call of it in call order. `counts`: of a padded step, each
        lane's own images, the first of its rows (on CPU its masks are drawn for those alone, the rest are 1).

        On CPU each client's masks come from its own generator, drawn as the layer's own forward pass draws them
        (`keep_mask` or `F.dropout`'s noise) in the layout it sees: `LocalTrainer.run`'s masks, exactly. Elsewhere
        `nn.Dropout` draws inside a fused kernel that cannot be replayed, so the whole group's masks of all calls of
        one rate are one draw from `generator` (one kernel instead of one per client and call)."""
        calls = self._dropout_calls(example)
        if self.model.device.type != "cpu":  # the masks of all calls of one rate: one draw, one scaling
            shapes = [(len(generators), len(example), *rest) for _, rest, _ in calls]
            stacked: list[torch.Tensor] = [torch.empty(0)] * len(calls)
            rates: dict[float, list[int]] = {}
            for position, (name, _, _) in enumerate(calls):
                rates.setdefault(self.dropouts[name].p, []).append(position)
            for p, positions in rates.items():
                sizes = [math.prod(shapes[i]) for i in positions]
                drawn = torch.empty(sum(sizes), device=self.model.device).bernoulli_(1 - p, generator=generator)
                for position, part in zip(positions, drawn.div_(1 - p).split(sizes), strict=True):
                    stacked[position] = part.view(shapes[position])
        else:
            width = len(example)
            per_client = [
                [_padded_to(self._cpu_mask(name, (count, *rest), stride, lane), width) for name, rest, stride in calls]
                for lane, count in zip(generators, counts or [width] * len(generators), strict=True)
            ]
            stacked = [torch.stack([masks[i] for masks in per_client]) for i in range(len(calls))]
        masks: dict[str, list[torch.Tensor]] = {}
        for (name, _, _), mask in zip(calls, stacked, strict=True):
            masks.setdefault(name, []).append(mask)
        return masks

    def clients_at_once(self, datasets: Sequence[ImageSet], fraction: float) -> tuple[int, int]:
        """How many clients of `datasets` (their training images) to train at once on this GPU within `fraction`
        of its memory, with a tenth of that kept free for the round's other tensors and the allocator's slack;
        and the bytes each takes. From the peak memory of a step of one client and of two (`clients_that_fit`),
        each with the largest client's images resident on the device. Steps replayed from CUDA graphs hold their
        memory twice: the captured steps' pool, and the blocks the eager warm-up steps left in the allocator's
        cache."""
        largest = max(datasets, key=len)
        if len(datasets) < 2 or len(largest) == 0:
            return 1, 0
        device = self.model.device
        self.peak_step_bytes(largest, 1)  # the first step's one-off allocations (cuDNN's, cuBLAS's) are no client's
        one, two = (self.peak_step_bytes(largest, count) + count * largest.images.nbytes for count in (1, 2))
        total = torch.cuda.get_device_properties(device).total_memory
        allowed = int(0.9 * fraction * total) - torch.cuda.memory_allocated(device)
        if self.graphs:
            allowed //= 2
        return min(clients_that_fit(one, two, allowed), len(datasets)), _per_client_bytes(one, two)

    def peak_step_bytes(self, example: ImageSet, clients: int) -> int:
        """The device memory one step of `clients` clients on minibatches of `example`'s images takes at its peak
        (CUDA): their stacked states, inputs, masks, activations and gradients, measured by a step on copies of
        the model's state (nothing of the model or the clients changes)."""
        device = self.model.device
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        assert example.labels is not None
        batch = example.images[: self.trainer.batch_size]
        inputs = self.trainer.inputs(batch, torch.Generator().manual_seed(0))
        labels = example.labels[: len(batch)].to(device)
        state = self.model.state()
        trained = set(self.parameter_names)
        stacked = {name: torch.stack([state[name]] * clients) for name in self.state_names}
        generators = [torch.Generator(device=device).manual_seed(0)] * clients
        self.model.train()
        gradients, _ = (self.fused or self._gradients)(
            {name: tensor for name, tensor in stacked.items() if name in trained},
            {name: tensor for name, tensor in stacked.items() if name not in trained},
            self._masks(inputs, generators, generators[0]),
            torch.cat([inputs] * clients).unflatten(0, (clients, -1)),
            torch.stack([labels] * clients),
        )
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        del gradients, stacked
        return peak

    def _cpu_mask(
        self, name: str, shape: tuple[int, ...], stride: tuple[int, ...], generator: torch.Generator
    ) -> torch.Tensor:
        """The scaled keep mask the dropout `name` multiplies its input by on CPU, as its own forward pass draws it."""
        dropout = self.dropouts[name]
        p = dropout.p
        like = torch.empty_strided(shape, stride)
        if isinstance(dropout, AdapterDropout):
            return keep_mask(like, p, generator).div_(1 - p)
        return like.bernoulli_(1 - p, generator=generator).div_(1 - p)  # F.dropout's noise

    def _dropout_calls(self, example: torch.Tensor) -> list[DropoutCall]:
        """The training dropouts of rate > 0 in the order a forward pass on batches like `example` calls them, with
        the rest of their input's shape and its strides; found once per input shape by a pass with hooks."""
        key = tuple(example.shape[1:])
        if key not in self._calls:
            calls: list[DropoutCall] = []
            hooks = [
                dropout.register_forward_pre_hook(
                    lambda _, args, name=name: calls.append((name, tuple(args[0].shape[1:]), args[0].stride()))
                )
                for name, dropout in self.dropouts.items()
                if dropout.training and dropout.p > 0
            ]
            try:
                with torch.no_grad(), self.trainer.inputs.autocast():
                    self.model.eval()  # the shapes without touching any running statistics
                    self.model(example[:2])
            finally:
                self.model.train()
                for hook in hooks:
                    hook.remove()
            self._calls[key] = calls
        return self._calls[key]

    def _result(self, lane: _Lane, state: dict[str, torch.Tensor]) -> SGDResult:
        (mean_loss,) = finite_means(lane.losses, 1, lane.job.lr)
        trained = lane.job.finished({name: tensor.clone() for name, tensor in state.items()})
        return trained, mean_loss


def _padded_to(mask: torch.Tensor, width: int) -> torch.Tensor:
    """A lane's masks for its own rows, then 1 for the rows that pad its batch to `width`."""
    if len(mask) == width:
        return mask
    return torch.cat([mask, mask.new_ones((width - len(mask), *mask.shape[1:]))])


def _add_scaled_(targets: list[torch.Tensor], addends: list[torch.Tensor], factors: float | torch.Tensor) -> None:
    """targets += factor * addends: one factor for all lanes (one fused kernel per tensor list, as
    `torch.optim.SGD`), or one per lane (the stacked tensors' leading axis)."""
    if isinstance(factors, float):
        torch._foreach_add_(targets, addends, alpha=factors)
        return
    shaped = [factors.view(-1, *[1] * (t.dim() - 1)).to(t.dtype) for t in addends]
    torch._foreach_add_(targets, torch._foreach_mul(addends, shaped))


def _native_batch_norm(norm: _BatchNorm, x: torch.Tensor) -> torch.Tensor:
    """`norm`'s own forward in float32: on CPU `vmap` batches PyTorch's BatchNorm kernel, which one client alone
    runs too, so concurrent clients round exactly as they would alone."""
    return type(norm).forward(norm, x.float()).to(x.dtype)


def _batch_norm_by_formula(norm: _BatchNorm, x: torch.Tensor) -> torch.Tensor:
    """`norm`'s forward as `nn.BatchNorm2d` defines it (batch statistics in training, running ones updated with its
    momentum and the unbiased variance; running statistics in evaluation), written out in float32 for `vmap`.

    Not `F.batch_norm`, for two reasons: `vmap`'s BatchNorm rule cannot take the bf16 inputs of autocast, and on a
    GPU the backward of cuDNN's BatchNorm in training mode asks for its gradient in its input's memory layout, a copy
    that `vmap` cannot make of a batched gradient ("NYI: Tensor.clone(memory_format) inside vmap ... (got
    ChannelsLast)", seen on an H100 with PyTorch 2.11, in either layout of the input)."""
    values = x.float()
    shape = (1, -1) + (1,) * (x.dim() - 2)  # a per-channel vector against [N, C, ...]
    if norm.training or norm.running_mean is None:
        dims = [0, *range(2, x.dim())]
        mean, var = values.mean(dims), values.var(dims, unbiased=False)
        if norm.training and norm.running_mean is not None and norm.running_var is not None:
            count = x.numel() / x.size(1)
            with torch.no_grad():
                norm.num_batches_tracked.add_(1)  # type: ignore[union-attr, operator]
                momentum = 1.0 / norm.num_batches_tracked if norm.momentum is None else norm.momentum
                norm.running_mean.mul_(1 - momentum).add_(mean.detach() * momentum)
                norm.running_var.mul_(1 - momentum).add_(var.detach() * (count / (count - 1)) * momentum)
    else:
        mean, var = norm.running_mean, norm.running_var
    normalized = (values - mean.reshape(shape)) * torch.rsqrt(var.reshape(shape) + norm.eps)
    if norm.affine:
        normalized = normalized * norm.weight.reshape(shape) + norm.bias.reshape(shape)
    return normalized.to(x.dtype)


def clients_that_fit(one: int, two: int, allowed: int) -> int:
    """How many clients' steps fit in `allowed` bytes, from the peak bytes of a step of one client (`one`) and of
    two (`two`): a step of K clients takes a fixed part plus K times each client's part. Where two clients measure
    no more than one (an allocator that rounds blocks up), each client is taken to need half of two's step."""
    per_client = _per_client_bytes(one, two)
    fixed = max(one - per_client, 0)
    return max(1, (allowed - fixed) // per_client)


def _per_client_bytes(one: int, two: int) -> int:
    """Each client's part of a step, from a step of one client and of two (see `clients_that_fit`)."""
    return two - one if two > one else max(two // 2, 1)
