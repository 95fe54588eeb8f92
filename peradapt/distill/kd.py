"""Server-side ensemble distillation of the global adapter (PerAda Global Obj and Algorithm 1, lines 17-22).

The teachers are the clients' uploaded local adapters. Their logits on the unlabeled distillation data do not
change while the student trains, so they are computed once per round and averaged; each of the R Adam steps
then runs only the student. The loss is KL(softmax(mean teacher logits / T) || softmax(student logits / T)),
scaled by T^2 (T = 1 in the paper); for multi-label tasks (CheXpert), where every label is its own yes/no
question, the KL of the two Bernoulli distributions sigmoid(logit / T) per label. The learning rate follows a
cosine schedule over the R steps.

The student is trained in inference mode (BatchNorm on its running statistics, no dropout): the distilled
function is then exactly the one clients receive and evaluate, and out-of-domain distillation images cannot
overwrite the BatchNorm statistics averaged from the clients. The adapter with the best accuracy on the
server's labeled validation split (the FedAvg starting point included) is kept: best accuracy, or best AUC.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from peradapt.adapters import AdapterState
from peradapt.config import DistillConfig
from peradapt.data import ImageSet
from peradapt.errors import TrainingDiverged
from peradapt.federation.local import LocalTrainer, seeded_generator


def ensemble_logits(trainer: LocalTrainer, teachers: Sequence[AdapterState], data: ImageSet) -> torch.Tensor:
    """Mean logits of the teachers on `data` (the pseudo-labels of Global Obj), computed once."""
    total = trainer.logits(teachers[0], data)
    for teacher in teachers[1:]:
        total += trainer.logits(teacher, data)
    return total / len(teachers)


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


@dataclass
class Distiller:
    trainer: LocalTrainer
    kd_data: ImageSet
    val_data: ImageSet
    config: DistillConfig

    @property
    def multilabel(self) -> bool:
        # The unlabeled distillation data cannot tell the task's kind; the labeled validation split can.
        return self.val_data.multilabel

    def distill(
        self,
        student: AdapterState,
        teacher_logits: torch.Tensor,
        *,
        seed: int,
        on_step: Callable[[int], None] | None = None,
    ) -> tuple[AdapterState, dict[str, float]]:
        """R Adam steps from `student` towards the teachers; returns the best adapter on validation."""
        config, trainer = self.config, self.trainer
        model = trainer.model
        steps = config.kd_steps
        check_every = config.kd_eval_every or max(1, steps // 10)
        loss_of = multilabel_kd_loss if self.multilabel else kd_loss
        best_state, best_score = student, trainer.score(student, self.val_data)
        start_score, best_step, checks_without_gain = best_score, 0, 0
        model.load_state(student)
        model.eval()
        parameters = list(model.trainable_parameters().values())
        optimizer = torch.optim.Adam(parameters, lr=config.server_lr)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(steps, 1))
        generator = seeded_generator(seed)
        batch_size = min(config.kd_batch_size, len(self.kd_data))
        last_loss = float("nan")
        for step in range(1, steps + 1):
            batch = torch.randperm(len(self.kd_data), generator=generator)[:batch_size]
            # No augmentation: the cached teacher logits belong to the images as they are.
            images = trainer.inputs(self.kd_data.images[batch])
            with trainer.inputs.autocast():
                student_logits = model(images).float()
            loss = loss_of(student_logits, teacher_logits[batch.to(teacher_logits.device)], config.kd_temperature)
            if not torch.isfinite(loss):
                raise TrainingDiverged(f"distillation loss became {loss.item()}: lower --server-lr")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            last_loss = loss.item()
            if on_step is not None:
                on_step(step)
            if step % check_every == 0 or step == steps:
                candidate = model.state()
                score = trainer.score(candidate, self.val_data)
                model.load_state(candidate)
                model.eval()
                if score > best_score:
                    best_state, best_score, best_step, checks_without_gain = candidate, score, step, 0
                else:
                    checks_without_gain += 1
                    if config.kd_patience and checks_without_gain >= config.kd_patience:
                        break
        info = {
            "kd_loss": last_loss,
            "kd_val_before": start_score,
            "kd_val_after": best_score,
            "kd_best_step": best_step,
        }
        return best_state, info
