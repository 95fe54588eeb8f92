"""Tests for PerAda (Algorithm 1): proximal local SGD, client/server updates and ensemble distillation."""

from __future__ import annotations

import copy
import importlib
import math
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm
from torch.testing import assert_close

from peradapt.adapters import inject_adapters
from peradapt.backbones import create_backbone, freeze
from peradapt.compute.trainer import InputPipeline, LocalTrainer
from peradapt.config import DistillConfig, MethodConfig
from peradapt.data import ClientData, ImageSet
from peradapt.distill import Distiller, ensemble_logits, kd_loss
from peradapt.methods import ClientUpdate, MethodContext
from peradapt.methods.base import PERSONAL_KEY
from peradapt.methods.perada import PerAda, PerAdaNoKD
from peradapt.rundir.store import ClientStore

BATCH = 8
SIZE = 16
TOL = {"atol": 1e-5, "rtol": 1e-5}


def tiny_trainer(batch_size=BATCH):
    torch.manual_seed(0)
    backbone = freeze(create_backbone("resnet10_w4", num_classes=3, in_chans=1))
    model = inject_adapters(backbone, "residual", dropout=0.0, lora_rank=2)
    pipeline = InputPipeline(mean=(0.5,), std=(0.5,), device=torch.device("cpu"))
    return LocalTrainer(model, pipeline, batch_size=batch_size)


def image_set(count, seed, labeled=True):
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (count, 1, SIZE, SIZE), dtype=torch.uint8, generator=generator)
    labels = torch.randint(0, 3, (count,), generator=generator) if labeled else None
    return ImageSet(images, labels, num_classes=3)


def normalized(images):
    return (images.float() / 255 - 0.5) / 0.5


def perturbed(model, seed, scale=0.1):
    generator = torch.Generator().manual_seed(seed)
    state = model.state()
    for name in model.trainable_parameters():
        state[name] = state[name] + scale * torch.randn(state[name].shape, generator=generator)
    return state


def assign(module, state):
    """Copy an adapter state into a PEFT module with plain torch (independent of AdaptedModel.load_state)."""
    result = module.load_state_dict(state, strict=False)
    assert not result.unexpected_keys


def train_mode(module):
    """Training mode with every BatchNorm that has no trainable parameter kept on its running statistics."""
    module.train()
    for layer in module.modules():
        if isinstance(layer, _BatchNorm) and not any(p.requires_grad for p in layer.parameters()):
            layer.eval()


def hand_sgd_step(trainer, start, data, lr, anchor=None, lam=0.0):
    """One full-batch step v - lr * (grad + lam * (v - anchor)) by autograd, and its loss."""
    module = trainer.model.module
    assign(module, start)
    train_mode(module)
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    parameters = [p for p in module.parameters() if p.requires_grad]
    loss = F.cross_entropy(module(normalized(data.images)), data.labels)
    grads = torch.autograd.grad(loss, parameters)
    expected = {k: v.detach().clone() for k, v in module.state_dict().items() if k in start}
    for name, grad in zip(names, grads, strict=True):
        prox = lam * (start[name] - anchor[name]) if anchor is not None else 0.0
        expected[name] = start[name] - lr * (grad + prox)
    return expected, loss.item()


def hand_logits(module, state, images):
    assign(module, state)
    module.eval()
    with torch.no_grad():
        return module(normalized(images))


def hand_kl(student_logits, teacher_logits, temperature=1.0):
    """KL(softmax(t/T) || softmax(s/T)) * T^2, batch mean."""
    log_p = torch.log_softmax(teacher_logits / temperature, dim=1)
    log_q = torch.log_softmax(student_logits / temperature, dim=1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=1).mean() * temperature**2


def test_distillation_and_methods_import_without_a_circular_import(monkeypatch):
    """`import peradapt.distill` (or `peradapt.methods`) as the first peradapt import must work."""
    import peradapt

    prefixes = ("peradapt.distill", "peradapt.federation", "peradapt.methods")
    for name in [n for n in sys.modules if n.startswith(prefixes)]:
        monkeypatch.delitem(sys.modules, name)
    for attribute in ("distill", "federation", "personalize"):
        monkeypatch.delattr(peradapt, attribute, raising=False)
    importlib.import_module("peradapt.distill")


# ---------------------------------------------------------------- local SGD (Algorithm 1, lines 10 and 15)


def test_proximal_sgd_step_matches_algorithm_line_10():
    trainer = tiny_trainer()
    data = image_set(BATCH, seed=3)
    v, w = perturbed(trainer.model, seed=1), perturbed(trainer.model, seed=2)
    actual, loss = trainer.sgd(v, data, epochs=1, lr=0.1, seed=0, anchor=w, lam=0.5)
    expected, expected_loss = hand_sgd_step(trainer, v, data, lr=0.1, anchor=w, lam=0.5)
    assert actual.keys() == expected.keys() == v.keys()
    assert_close(actual, expected, **TOL)
    assert loss == pytest.approx(expected_loss, abs=1e-5)


def test_sgd_without_proximal_weight_is_plain_sgd():
    trainer = tiny_trainer()
    data = image_set(BATCH, seed=3)
    v, w = perturbed(trainer.model, seed=1), perturbed(trainer.model, seed=2)
    actual, loss = trainer.sgd(v, data, epochs=1, lr=0.1, seed=0, anchor=w, lam=0.0)
    expected, expected_loss = hand_sgd_step(trainer, v, data, lr=0.1)
    assert_close(actual, expected, **TOL)
    assert loss == pytest.approx(expected_loss, abs=1e-5)
    proximal, _ = hand_sgd_step(trainer, v, data, lr=0.1, anchor=w, lam=0.5)
    name = next(iter(trainer.model.trainable_parameters()))
    assert not torch.allclose(actual[name], proximal[name], atol=1e-4)


def test_sgd_keeps_frozen_backbone_untouched():
    trainer = tiny_trainer()
    frozen = {k: v.clone() for k, v in trainer.model.module.state_dict().items() if k not in trainer.model.state()}
    trainer.sgd(perturbed(trainer.model, seed=1), image_set(2 * BATCH, seed=3), epochs=2, lr=0.1, seed=0)
    after = trainer.model.module.state_dict()
    assert all(torch.equal(after[k], v) for k, v in frozen.items())  # weights and BatchNorm statistics


def test_sgd_computes_gradients_of_the_adapter_only():
    trainer = tiny_trainer()
    anchor = perturbed(trainer.model, seed=2)
    trainer.sgd(trainer.model.state(), image_set(BATCH, seed=3), epochs=1, lr=0.1, seed=0, anchor=anchor, lam=0.5)
    trainable = set(trainer.model.trainable_parameters().values())
    parameters = list(trainer.model.module.parameters())
    assert all(p.grad is None for p in parameters if p not in trainable)  # no weight gradient for the backbone
    assert all(p.grad is not None for p in trainable)


# ---------------------------------------------------------------- PerAda client and server updates


def perada_context(trainer, initial, lam=0.5, lr=0.1):
    config = MethodConfig(local_epochs=1, personal_epochs=1, lam=lam, lr=lr, batch_size=BATCH)
    return MethodContext(config, trainer, ClientStore(), initial, distiller=None)


def client(client_id, data):
    indices = np.arange(len(data))
    return ClientData(client_id, data, data, indices, indices)


def test_client_update_uploads_plain_sgd_and_stores_the_proximal_personal_adapter():
    trainer = tiny_trainer()
    data = image_set(BATCH, seed=3)
    initial, global_state = perturbed(trainer.model, seed=1), perturbed(trainer.model, seed=2)
    method = PerAda(perada_context(trainer, initial))

    update = method.client_update(client(4, data), global_state, seed=0)

    assert (update.client_id, update.num_samples) == (4, BATCH)
    expected_upload, _ = hand_sgd_step(trainer, global_state, data, lr=0.1)
    assert_close(update.upload, expected_upload, **TOL)
    expected_personal, _ = hand_sgd_step(trainer, initial, data, lr=0.1, anchor=global_state, lam=0.5)
    assert_close(method.store.get(4, PERSONAL_KEY), expected_personal, **TOL)
    assert_close(method.personalized(4, global_state), expected_personal, **TOL)


def test_second_client_update_continues_from_the_stored_personal_adapter():
    trainer = tiny_trainer()
    data = image_set(BATCH, seed=3)
    initial = perturbed(trainer.model, seed=1)
    first_global, second_global = perturbed(trainer.model, seed=2), perturbed(trainer.model, seed=5)
    method = PerAda(perada_context(trainer, initial))
    method.client_update(client(4, data), first_global, seed=0)
    personal = method.store.get(4, PERSONAL_KEY)

    method.client_update(client(4, data), second_global, seed=1)

    expected, _ = hand_sgd_step(trainer, personal, data, lr=0.1, anchor=second_global, lam=0.5)
    from_initial, _ = hand_sgd_step(trainer, initial, data, lr=0.1, anchor=second_global, lam=0.5)
    actual = method.store.get(4, PERSONAL_KEY)
    assert_close(actual, expected, **TOL)
    name = next(iter(trainer.model.trainable_parameters()))
    assert not torch.allclose(actual[name], from_initial[name], atol=1e-4)
    # Another client has no personal adapter yet: it is evaluated with the initial one.
    assert method.personalized(5, second_global) is initial


def test_nokd_server_update_is_the_uniform_mean_of_uploads():
    trainer = tiny_trainer()
    method = PerAdaNoKD(perada_context(trainer, trainer.model.state()))
    uploads = [
        {"w": torch.tensor([1.0, 2.0]), "steps": torch.tensor(4)},
        {"w": torch.tensor([2.0, 4.0]), "steps": torch.tensor(9)},
        {"w": torch.tensor([6.0, 0.0]), "steps": torch.tensor(1)},
    ]
    updates = [
        ClientUpdate(i, upload, num_samples)
        for i, (upload, num_samples) in enumerate(zip(uploads, [1, 100, 10], strict=True))
    ]
    start = {"w": torch.zeros(2), "steps": torch.tensor(0)}
    averaged, info = method.server_update(start, updates, seed=0, round_index=0)
    assert_close(averaged["w"], torch.tensor([3.0, 2.0]))
    assert averaged["steps"].item() == 4
    assert info == {}


# ---------------------------------------------------------------- distillation (Algorithm 1, lines 19-22)


def test_kd_loss_on_a_hand_computed_example():
    student = torch.tensor([[0.0, 0.0]])
    teacher = torch.tensor([[math.log(3.0), 0.0]])  # softmax: (3/4, 1/4)
    expected = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)
    assert kd_loss(student, teacher, 1.0).item() == pytest.approx(expected, rel=1e-6)
    # T = 2: teacher softmax(t / 2) = (sqrt 3, 1) / (sqrt 3 + 1); student stays uniform; times T^2 = 4.
    p = math.sqrt(3.0) / (math.sqrt(3.0) + 1)
    expected = 4 * (p * math.log(p / 0.5) + (1 - p) * math.log((1 - p) / 0.5))
    assert kd_loss(student, teacher, 2.0).item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_kd_loss_is_teacher_to_student_kl_times_t_squared(temperature):
    generator = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(5, 4, generator=generator), 3 * torch.randn(5, 4, generator=generator)
    p, q = torch.softmax(teacher / temperature, 1), torch.softmax(student / temperature, 1)
    expected = (p * (p / q).log()).sum(1).mean() * temperature**2
    assert kd_loss(student, teacher, temperature).item() == pytest.approx(expected.item(), rel=1e-5)
    assert kd_loss(teacher, teacher, temperature).item() == pytest.approx(0.0, abs=1e-6)


def test_ensemble_logits_is_the_mean_of_the_teachers():
    trainer = tiny_trainer()
    data = image_set(12, seed=3, labeled=False)
    teachers = [perturbed(trainer.model, seed=s) for s in (1, 2, 3)]
    module = copy.deepcopy(trainer.model.module)
    expected = sum(hand_logits(module, t, data.images) for t in teachers) / 3
    assert_close(ensemble_logits(trainer, teachers, data), expected, **TOL)


def brightness_set(count, seed, labeled=True):
    """Images whose class is their brightness (dark, grey, bright) under noise: learnable by the tiny model."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 3, (count,), generator=generator)
    noise = torch.randint(0, 60, (count, 1, SIZE, SIZE), generator=generator)
    images = (labels.view(-1, 1, 1, 1) * 90 + noise).clamp(0, 255).to(torch.uint8)
    return ImageSet(images, labels if labeled else None, num_classes=3)


def distill_problem(kd_steps, **config):
    """Two teachers trained on labeled data, an untrained student, unlabeled KD data from the same task."""
    trainer = tiny_trainer()
    student = trainer.model.state()
    teachers = [trainer.sgd(student, brightness_set(32, seed=s), epochs=20, lr=0.05, seed=s)[0] for s in (1, 2)]
    kd_data, val_data = brightness_set(64, seed=3, labeled=False), brightness_set(32, seed=4)
    distill_config = DistillConfig(kd_steps=kd_steps, kd_batch_size=32, server_lr=1e-2, **config)
    return trainer, student, teachers, Distiller(trainer, kd_data, val_data, distill_config)


def test_distillation_moves_the_student_towards_the_ensemble():
    trainer, student, teachers, distiller = distill_problem(30)
    module = copy.deepcopy(trainer.model.module)
    teacher_logits = ensemble_logits(trainer, teachers, distiller.kd_data)
    last = {}

    def remember(step):
        last["step"], last["state"] = step, trainer.model.state()

    best, info = distiller.distill(student, teachers, seed=0, on_step=remember)

    def kl(state):
        return hand_kl(hand_logits(module, state, distiller.kd_data.images), teacher_logits).item()

    assert last["step"] == 30
    assert kl(last["state"]) < 0.5 * kl(student)
    assert {"kd_loss", "kd_val_before", "kd_val_after", "kd_best_step"} <= info.keys()

    def accuracy(state):
        predictions = hand_logits(module, state, distiller.val_data.images).argmax(dim=1)
        return (predictions == distiller.val_data.labels).float().mean().item()

    assert info["kd_val_before"] == pytest.approx(accuracy(student))
    assert info["kd_val_after"] == pytest.approx(accuracy(best))
    assert info["kd_val_after"] >= info["kd_val_before"]
    assert info["kd_val_after"] > info["kd_val_before"]  # on this problem distillation does help
    assert kl(best) < kl(student)


def test_cached_teacher_logits_give_the_same_steps_as_recomputing_the_teachers():
    steps, seed, lr = 3, 7, 1e-2
    trainer, student, teachers, distiller = distill_problem(steps, kd_eval_every=1000)
    captured = {}
    distiller.distill(student, teachers, seed=seed, on_step=lambda s: captured.update({s: trainer.model.state()}))

    # The same R Adam steps in plain torch, the teachers' ensemble recomputed on every batch.
    teacher_modules = [copy.deepcopy(trainer.model.module) for _ in teachers]
    for module, teacher in zip(teacher_modules, teachers, strict=True):
        assign(module, teacher)
        module.eval()
    learner = copy.deepcopy(trainer.model.module)
    assign(learner, student)
    learner.eval()
    parameters = [p for p in learner.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(parameters, lr=lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch = torch.randperm(len(distiller.kd_data), generator=generator)[:32]
        images = normalized(distiller.kd_data.images[batch])
        with torch.no_grad():
            targets = sum(module(images) for module in teacher_modules) / len(teacher_modules)
        loss = hand_kl(learner(images), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()

    expected = {k: v.detach() for k, v in learner.state_dict().items() if k in student}
    assert sorted(captured) == [1, 2, 3]
    assert_close(captured[steps], expected, **TOL)
    # Inference-mode training: the student's BatchNorm statistics are the ones it started with.
    buffers = [k for k in student if k not in trainer.model.trainable_parameters()]
    assert buffers
    assert all(torch.equal(captured[steps][k], student[k]) for k in buffers)
