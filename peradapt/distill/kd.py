"""Server-side ensemble distillation of the global adapter (PerAda Global Obj and Algorithm 1, lines 17-22).

The teachers are the clients' uploaded local adapters, the student starts from their mean. Each of the R Adam
steps (cosine learning rate over the R steps) minimizes on a batch of unlabeled distillation data
KL(softmax(mean teacher logits / T) || softmax(student logits / T)) * T^2 (the paper's l_KD with sigma the
softmax; T = 1 in the paper), or with `--kd-loss bernoulli`, for multi-label tasks, the KL of the two Bernoulli
distributions sigmoid(logit / T) per label. The adapter with the best score on the server's labeled validation
split (the starting mean included) is kept, checked every `--kd-eval-every` steps (0: ten checks).

Two ways to run it, `--kd-mode`:
- `eval` (default): teachers and student in inference mode (BatchNorm on running statistics, no dropout). The
  distilled function is then exactly the one clients receive, and without augmentation (`--kd-augment none`) the
  teachers' logits do not change while the student trains: they are computed once per round and averaged.
- `train` (the PerAda authors' code): teachers and student in training mode, so dropout is on, BatchNorm
  normalizes with the distillation batch's statistics and the student's running statistics follow the
  distillation data; the teachers then run on every batch, as they do with augmented images.

Each step's batch (`distillation_batches`, `--kd-batches`) is a fresh random subset of the distillation set
(`independent`), or the next batch of an epoch through it without replacement, with a shorter last batch (`epochs`:
the authors' DataLoader over a SubsetRandomSampler, whose iterator every round starts afresh).

Only during the first `--kd-rounds` rounds, if set (the authors' `kd_max_round`); later rounds keep the mean.

The teachers are read, never changed, unless `distill` is given a list for their statistics (PerAda's
`--kd-teacher-statistics authors`): the authors' teachers are the clients' local models, left in training mode, so
every teacher pass of a batch moves the teacher's frozen BatchNorms' running statistics, and the client keeps them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from peradapt.adapters import AdapterState
from peradapt.compute.trainer import InputPipeline, LocalTrainer, seeded_generator
from peradapt.config import DistillConfig
from peradapt.data import ImageSet, iterate_minibatches
from peradapt.errors import TrainingDiverged


def ensemble_logits(
    trainer: LocalTrainer, teachers: Sequence[AdapterState], data: ImageSet, inputs: InputPipeline | None = None
) -> torch.Tensor:
    """Mean inference-mode logits of the teachers on `data` (the pseudo-labels of Global Obj), computed once."""
    total = trainer.logits(teachers[0], data, inputs)
    for teacher in teachers[1:]:
        total += trainer.logits(teacher, data, inputs)
    return total / len(teachers)


def distillation_batches(
    num_samples: int, batch_size: int, kind: str, generator: torch.Generator
) -> Iterator[torch.Tensor]:
    """The distillation set's index batches, one per step, without end: `independent`, `batch_size` of the
    `num_samples` drawn afresh at every step; `epochs`, a permutation of them per epoch cut into batches of
    `batch_size`, the last shorter (`iterate_minibatches`, which joins a last batch of one sample to the one before:
    BatchNorm cannot normalize a single sample in training mode). Each permutation is drawn from `generator` when
    its epoch's first batch is asked for."""
    while True:
        if kind == "epochs":
            yield from iterate_minibatches(num_samples, batch_size, generator)
        else:
            yield torch.randperm(num_samples, generator=generator)[:batch_size]


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(softmax(teacher / T) || softmax(student / T)) * T^2, averaged over the batch."""
    return (
        F.kl_div(
            F.log_softmax(student_logits / temperature, dim=1),
            F.log_softmax(teacher_logits / temperature, dim=1),
            reduction="batchmean",
            log_target=True,
        )
        * temperature**2
    )


def multilabel_kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per label, KL(Bernoulli(sigmoid(teacher / T)) || Bernoulli(sigmoid(student / T))) * T^2, averaged over the
    labels and the batch."""
    student, teacher = student_logits / temperature, teacher_logits / temperature
    teacher_yes = torch.sigmoid(teacher)
    # log sigmoid(x) and log(1 - sigmoid(x)) = log sigmoid(-x), stable for logits of any size.
    kl = teacher_yes * (F.logsigmoid(teacher) - F.logsigmoid(student)) + (1 - teacher_yes) * (
        F.logsigmoid(-teacher) - F.logsigmoid(-student)
    )
    return kl.mean() * temperature**2


def check_interval(config: DistillConfig) -> int:
    """Distillation steps between two validation checks: --kd-eval-every, or a tenth of --kd-steps."""
    return config.kd_eval_every or max(1, config.kd_steps // 10)


def validation_checks(config: DistillConfig) -> int:
    """The most validation checks one `Distiller.distill` makes (fewer where --kd-patience stops it): the starting
    state's, then one every `check_interval` steps and one after the last."""
    return 1 + -(-config.kd_steps // check_interval(config))


@dataclass
class Distiller:
    trainer: LocalTrainer
    kd_data: ImageSet
    val_data: ImageSet
    config: DistillConfig
    inputs: InputPipeline | None = None  # distillation images -> model inputs; None: as the clients' (unaugmented)
    # Wall-clock seconds of every `distill` so far in this process: the engine tells distillation from the rest of
    # a method's server update by its change over the update.
    seconds: float = field(default=0.0, init=False)
    # Samples of every `distill` so far, counted as `LocalTrainer.samples_trained` counts a client's: through the
    # student's forward and backward pass, and through an inference pass (the teachers' logits, the validation
    # checks). The engine prices them per sample (`costs.SampleFlops`).
    samples_trained: int = field(default=0, init=False)
    samples_inferred: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.inputs is None:
            self.inputs = replace(self.trainer.inputs, augment="none")

    def active(self, round_index: int) -> bool:
        """Whether round `round_index` (from 0) distills: all rounds, or the first `--kd-rounds`."""
        return not self.config.kd_rounds or round_index < self.config.kd_rounds

    def distill(
        self,
        student: AdapterState,
        teachers: Sequence[AdapterState],
        *,
        seed: int,
        on_step: Callable[[int], None] | None = None,
        teacher_statistics: list[AdapterState] | None = None,
    ) -> tuple[AdapterState, dict[str, float]]:
        """R Adam steps from `student` towards the teachers' mean logits; returns the best adapter on validation.

        With a `teacher_statistics` list, each teacher pass moves the teacher's frozen BatchNorms' running
        statistics (`AdaptedModel.frozen_norm_buffers`) as the training-mode pass moves them, teacher after teacher
        and batch after batch, and the list receives each teacher's as the last pass left them, in the teachers'
        order: the authors' teachers are models the clients keep. In inference mode no pass moves them."""
        started = time.perf_counter()
        config, trainer, inputs = self.config, self.trainer, self.inputs
        assert inputs is not None
        model = trainer.model
        moving = model.frozen_norm_buffers if teacher_statistics is not None else frozenset()
        steps = config.kd_steps
        check_every = check_interval(config)
        loss_of = multilabel_kd_loss if config.kd_loss == "bernoulli" else kd_loss
        training_mode = config.kd_mode == "train"
        set_mode = model.train if training_mode else model.eval  # for teachers and student alike, at every step
        # Teacher logits are a fixed function of the image only in inference mode on unaugmented images.
        cached = (
            None
            if training_mode or inputs.augment != "none"
            else ensemble_logits(trainer, teachers, self.kd_data, inputs)
        )
        if cached is not None:
            self.samples_inferred += len(teachers) * len(self.kd_data)
        best_state, best_score = student, self.score(student)
        start_score, best_step, checks_without_gain = best_score, 0, 0
        model.load_state(student)
        parameters = list(model.trainable_parameters().values())
        optimizer = torch.optim.Adam(parameters, lr=config.server_lr)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(steps, 1))
        # The batches and the augmentation share the round's generator: every round replays from its seed alone.
        generator = seeded_generator(seed)
        batch_size = min(config.kd_batch_size, len(self.kd_data))
        batches = distillation_batches(len(self.kd_data), batch_size, config.kd_batches, generator)
        last_loss = float("nan")
        for step in range(1, steps + 1):
            batch = next(batches)
            images = inputs(self.kd_data.images[batch], generator)
            if cached is not None:
                teacher_logits = cached[batch.to(cached.device)]
            else:
                teacher_logits, teachers = self.teacher_logits(teachers, images, set_mode, moving)
                self.samples_inferred += len(teachers) * len(batch)
            set_mode()
            with inputs.autocast():
                student_logits = model(images).float()
            loss = loss_of(student_logits, teacher_logits, config.kd_temperature)
            if not torch.isfinite(loss):
                raise TrainingDiverged(f"distillation loss became {loss.item()}: lower --server-lr")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            self.samples_trained += len(batch)
            last_loss = loss.item()
            if on_step is not None:
                on_step(step)
            if step % check_every == 0 or step == steps:
                candidate = model.state()
                score = self.score(candidate)
                model.load_state(candidate)
                if score > best_score:
                    best_state, best_score, best_step, checks_without_gain = candidate, score, step, 0
                else:
                    checks_without_gain += 1
                    if config.kd_patience and checks_without_gain >= config.kd_patience:
                        break
        if teacher_statistics is not None:
            teacher_statistics[:] = [{key: teacher[key] for key in moving} for teacher in teachers]
        info = {
            "kd_loss": last_loss,
            "kd_val_before": start_score,
            "kd_val_after": best_score,
            "kd_best_step": best_step,
        }
        self.seconds += time.perf_counter() - started
        return best_state, info

    def score(self, state: AdapterState) -> float:
        """`state` scored on the server's validation split, an inference pass over it (counted)."""
        self.samples_inferred += len(self.val_data)
        return self.trainer.score(state, self.val_data)

    @torch.no_grad()
    def teacher_logits(
        self,
        teachers: Sequence[AdapterState],
        images: torch.Tensor,
        set_mode: Callable[[], None],
        moving: frozenset[str] = frozenset(),
    ) -> tuple[torch.Tensor, list[AdapterState]]:
        """The teachers' mean logits on this batch, each teacher loaded into the shared model in turn and put in
        the distillation's mode by `set_mode`; the student's state is put back afterwards. Also the teachers after
        their passes: their entries `moving` as the pass left them in the model, the rest as they were."""
        assert self.inputs is not None
        model = self.trainer.model
        student = model.state()
        total = torch.zeros(())
        passed = []
        for teacher in teachers:
            model.load_state(teacher)
            set_mode()
            with self.inputs.autocast():
                total = total + model(images).float()
            if moving:
                teacher = {**teacher, **model.state(moving)}
            passed.append(teacher)
        model.load_state(student)
        return total / len(teachers), passed
