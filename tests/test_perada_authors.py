"""The PerAda authors' code's rules, each one setting away, against hand computations in plain torch.

Every expected value here is computed from the rule as the authors' code states it (NVlabs/PerAda: optim/our.py,
aggregation/distillation.py, models/model_utils.py), on a copy of the tiny model driven by plain torch: not by
calling the code under test.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.testing import assert_close

from peradapt.adapters import inject_adapters
from peradapt.backbones import create_backbone, freeze
from peradapt.compute.trainer import InputPipeline, LocalTrainer
from peradapt.config import DistillConfig, MethodConfig
from peradapt.data import ImageSet, random_crop_flip
from peradapt.distill import Distiller
from peradapt.evaluation import select_on_test
from peradapt.methods import ClientUpdate, MethodContext
from peradapt.methods.perada import PerAda
from peradapt.rundir.records import PerClient, RoundCost, RoundRecord, RoundTiming
from peradapt.rundir.store import ClientStore

BATCH = 8
SIZE = 16
TOL = {"atol": 1e-5, "rtol": 1e-5}

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_trainer(frozen_bn: str = "eval", dropout: float = 0.0) -> LocalTrainer:
    torch.manual_seed(0)
    backbone = freeze(create_backbone("resnet10_w4", num_classes=3, in_chans=1))
    model = inject_adapters(backbone, "residual", dropout=dropout, lora_rank=2, frozen_bn=frozen_bn)
    return LocalTrainer(model, InputPipeline(mean=(0.5,), std=(0.5,), device=torch.device("cpu")), batch_size=BATCH)


def image_set(count: int, seed: int, labeled: bool = True) -> ImageSet:
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (count, 1, SIZE, SIZE), dtype=torch.uint8, generator=generator)
    labels = torch.randint(0, 3, (count,), generator=generator) if labeled else None
    return ImageSet(images, labels, num_classes=3)


def normalized(images: torch.Tensor) -> torch.Tensor:
    return (images.float() / 255 - 0.5) / 0.5


def perturbed(trainer: LocalTrainer, seed: int, scale: float = 0.1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    state = trainer.model.state()
    for name in trainer.model.trainable_parameters():
        noise = torch.randn(state[name].shape, generator=generator).to(state[name].device)
        state[name] = state[name] + scale * noise
    return state


def module_with(trainer: LocalTrainer, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A plain-torch copy of the model with `state` assigned by load_state_dict."""
    module = copy.deepcopy(trainer.model.module)
    assert not module.load_state_dict(state, strict=False).unexpected_keys
    return module


def frozen_norm_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Running statistics of the BatchNorms that own no trainable parameter and run in the forward pass (ResNet
    downsample BNs; not PEFT's idle `original_module` copies of the trained ones)."""
    return {
        f"{name}.{buffer_name}": buffer.clone()
        for name, layer in module.named_modules()
        if isinstance(layer, torch.nn.modules.batchnorm._BatchNorm)
        and not any(p.requires_grad for p in layer.parameters())
        and "original_module" not in name
        for buffer_name, buffer in layer.named_buffers(recurse=False)
    }


# ---------------------------------------------------------------- the proximal term: lam ||v - w||^2 in the loss


def test_authors_lambda_one_is_peradapt_lambda_two():
    """optim/our.py: loss = CE(v) + lam * sum ||v - w||^2 over the parameters, one SGD step. Its gradient is
    grad CE + 2 lam (v - w): peradapt's step with lam' = 2 lam."""
    trainer = tiny_trainer()
    data = image_set(BATCH, seed=3)
    v, w = perturbed(trainer, seed=1), perturbed(trainer, seed=2)
    authors_lam, lr = 1.0, 0.1

    module = module_with(trainer, v)
    module.train()
    for layer in module.modules():  # frozen BatchNorms on their statistics, as peradapt's default
        if isinstance(layer, torch.nn.modules.batchnorm._BatchNorm) and not any(
            p.requires_grad for p in layer.parameters()
        ):
            layer.eval()
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    parameters = [p for p in module.parameters() if p.requires_grad]
    proximal = sum(torch.sum((p - w[n]) ** 2) for n, p in zip(names, parameters, strict=True))
    loss = F.cross_entropy(module(normalized(data.images)), data.labels) + authors_lam * proximal
    optimizer = torch.optim.SGD(parameters, lr=lr)
    loss.backward()
    optimizer.step()
    expected = {n: p.detach() for n, p in zip(names, parameters, strict=True)}

    actual, _ = trainer.sgd(v, data, epochs=1, lr=lr, seed=0, anchor=w, lam=2 * authors_lam)
    assert_close({n: actual[n] for n in names}, expected, **TOL)
    same_lambda, _ = trainer.sgd(v, data, epochs=1, lr=lr, seed=0, anchor=w, lam=authors_lam)
    assert not torch.allclose(same_lambda[names[0]], expected[names[0]], atol=1e-4)


# ---------------------------------------------------------------- frozen BatchNorms in training mode


def test_frozen_bn_train_is_model_train_on_the_whole_network():
    """models/model_utils.py + optim/base.py: model.train() on the whole network, so the frozen downsample BNs
    normalize with batch statistics and update their running statistics; peradapt keeps those in the state."""
    trainer = tiny_trainer(frozen_bn="train")
    data = image_set(BATCH, seed=3)
    start = perturbed(trainer, seed=1)
    frozen = frozen_norm_buffers(trainer.model.module)
    assert frozen and frozen.keys() <= start.keys()  # the frozen norms' statistics travel with the adapter

    module = module_with(trainer, start)
    module.train()  # everything, frozen BatchNorms too
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    parameters = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(parameters, lr=0.1)
    F.cross_entropy(module(normalized(data.images)), data.labels).backward()
    optimizer.step()
    expected = {k: v.detach() for k, v in module.state_dict().items() if k in start}

    actual, _ = trainer.sgd(start, data, epochs=1, lr=0.1, seed=0)
    assert_close(actual, expected, **TOL)
    moved = [k for k in frozen if k.endswith("running_mean")]
    assert moved and all(not torch.equal(actual[k], start[k]) for k in moved)

    eval_mode, _ = tiny_trainer(frozen_bn="eval").sgd(
        {k: v for k, v in start.items() if k not in frozen}, data, epochs=1, lr=0.1, seed=0
    )
    assert not torch.allclose(eval_mode[names[0]], expected[names[0]], atol=1e-6)


def test_frozen_bn_statistics_survive_export_and_reload(tmp_path):
    trainer = tiny_trainer(frozen_bn="train")
    state, _ = trainer.sgd(perturbed(trainer, seed=1), image_set(BATCH, seed=3), epochs=1, lr=0.1, seed=0)
    trainer.model.save_pretrained(tmp_path / "client", state)
    assert (tmp_path / "client" / "frozen_bn_statistics.safetensors").is_file()
    fresh = tiny_trainer(frozen_bn="train")
    assert_close(fresh.model.load_pretrained(tmp_path / "client"), state)
    # As the README tells users of plain PEFT: the statistics load into the PEFT model by their names.
    statistics = load_file(str(tmp_path / "client" / "frozen_bn_statistics.safetensors"))
    assert (
        statistics and not copy.deepcopy(fresh.model.module).load_state_dict(statistics, strict=False).unexpected_keys
    )


# ---------------------------------------------------------------- distillation as the authors run it


def distill_setup(kd_mode: str, kd_augment: str, steps: int):
    # As the authors run it, training mode reaches the frozen BatchNorms too (their model.train()).
    trainer = tiny_trainer(frozen_bn="train" if kd_mode == "train" else "eval")
    teachers = [perturbed(trainer, seed=s, scale=0.3) for s in (1, 2)]
    student = perturbed(trainer, seed=3, scale=0.1)
    kd_data, val_data = image_set(24, seed=4, labeled=False), image_set(12, seed=5)
    config = DistillConfig(
        kd_steps=steps, kd_batch_size=BATCH, server_lr=1e-2, kd_mode=kd_mode, kd_augment=kd_augment, kd_eval_every=1000
    )
    inputs = InputPipeline(mean=(0.5,), std=(0.5,), device=torch.device("cpu"), augment=kd_augment)
    return trainer, teachers, student, Distiller(trainer, kd_data, val_data, config, inputs)


@pytest.mark.parametrize("kd_augment", ["none", "crop-flip"])
def test_train_mode_distillation_matches_the_authors_loop(kd_augment):
    """aggregation/distillation.py: per batch, the teachers' mean logits under no_grad with the teachers as they
    left client training (training mode), then student.train(), KL(softmax(teacher) || softmax(student)) batch
    mean, one Adam step, cosine schedule; the student's running statistics follow the distillation batches.

    One step: in training mode the adapter BatchNorm's bias, which the next BatchNorm's batch mean cancels, has a
    gradient that is zero up to rounding, and Adam turns rounding into steps of size lr; so it is left out of the
    comparison, and the second step would already differ by it."""
    steps, seed = 1, 11
    trainer, teachers, student, distiller = distill_setup("train", kd_augment, steps)
    captured = {}
    distiller.distill(student, teachers, seed=seed, on_step=lambda s: captured.update({s: trainer.model.state()}))

    teacher_modules = [module_with(trainer, t) for t in teachers]
    learner = module_with(trainer, student)
    parameters = [p for p in learner.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(parameters, lr=1e-2)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch = torch.randperm(len(distiller.kd_data), generator=generator)[:BATCH]
        images = distiller.kd_data.images[batch]
        if kd_augment == "crop-flip":
            images = random_crop_flip(images, generator)
        images = normalized(images)
        with torch.no_grad():
            targets = sum(m.train()(images) for m in teacher_modules) / len(teacher_modules)
        learner.train()
        loss = F.kl_div(F.log_softmax(learner(images), dim=1), F.softmax(targets, dim=1), reduction="batchmean")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    cancelled = {n for n, p in learner.named_parameters() if p.grad is not None and p.grad.abs().max() < 1e-7}
    assert cancelled and all(".lora_residual." in n and n.endswith(".bias") for n in cancelled)
    expected = {k: v.detach() for k, v in learner.state_dict().items() if k in student and k not in cancelled}
    assert_close({k: captured[steps][k] for k in expected}, expected, **TOL)
    statistics = [k for k in student if k.endswith("running_mean")]
    assert all(not torch.equal(captured[steps][k], student[k]) for k in statistics)


def test_eval_mode_distillation_keeps_the_students_statistics():
    trainer, teachers, student, distiller = distill_setup("eval", "none", 2)
    captured = {}
    distiller.distill(student, teachers, seed=0, on_step=lambda s: captured.update({s: trainer.model.state()}))
    statistics = [k for k in student if k.endswith(("running_mean", "running_var"))]
    assert statistics and all(torch.equal(captured[2][k], student[k]) for k in statistics)


def test_distillation_only_in_the_first_kd_rounds():
    """optim/our.py: `aggregation == "kd" and current_round < kd_max_round`; later rounds keep the plain mean."""
    trainer, teachers, _, distiller = distill_setup("eval", "none", 3)
    distiller.config.kd_rounds = 2
    config = MethodConfig(local_epochs=1, personal_epochs=1, batch_size=BATCH)
    method = PerAda(MethodContext(config, trainer, ClientStore(), trainer.model.state(), distiller))
    updates = [ClientUpdate(i, teacher, 10) for i, teacher in enumerate(teachers)]
    mean = {
        k: (teachers[0][k] + teachers[1][k]) / 2 if teachers[0][k].is_floating_point() else teachers[0][k]
        for k in teachers[0]
    }

    late, late_info = method.server_update(trainer.model.state(), updates, seed=0, round_index=2)
    assert_close(late, mean) and late_info == {}
    early, early_info = method.server_update(trainer.model.state(), updates, seed=0, round_index=1)
    assert early_info["kd_best_step"] >= 0 and "kd_loss" in early_info
    name = next(iter(trainer.model.trainable_parameters()))
    if early_info["kd_best_step"] > 0:  # the validation kept a distilled student
        assert not torch.allclose(early[name], mean[name])


def test_distillation_images_at_their_own_size_and_statistics():
    """--kd-image-size and --kd-normalization own: teacher logits on the images scaled to that size and normalized
    with the distillation set's statistics (the authors feed CIFAR-10 at 32 px with its own mean/std)."""
    trainer = tiny_trainer()
    kd_data = image_set(6, seed=4, labeled=False)
    inputs = InputPipeline(mean=(0.3,), std=(0.2,), device=torch.device("cpu"), image_size=8)
    state = perturbed(trainer, seed=1)
    from peradapt.distill import ensemble_logits

    module = module_with(trainer, state).eval()
    small = F.interpolate(kd_data.images.float(), size=(8, 8), mode="bilinear", align_corners=False, antialias=True)
    with torch.no_grad():
        expected = module((small / 255 - 0.3) / 0.2)
    assert_close(ensemble_logits(trainer, [state], kd_data, inputs), expected, **TOL)


# ---------------------------------------------------------------- reporting: selected on test data


def round_record(number: int, global_global_test: float | None = None, personalized: list[float] | None = None):
    """A round of clients 0 and 1, evaluated where the scores are given, with no traffic or work (zero costs)."""
    per_client = None
    if personalized is not None:
        per_client = PerClient(clients=[0, 1], personalized_local_test=personalized, global_local_test=[0.0, 0.0])
    return RoundRecord(
        round=number,
        clients=[0, 1],
        global_global_test=global_global_test,
        per_client=per_client,
        bytes_down=[],
        bytes_up=[],
        client_samples=[],
        cost=RoundCost(**RoundCost.totals([])),
        timing=RoundTiming(client_seconds=0, aggregation_seconds=0, distillation_seconds=0, peak_rss_bytes=0),
    )


def test_selection_on_test_takes_each_clients_best_round():
    """optim/our.py save_checkpoints: per client the checkpoint of its best local-test; the global model of the
    best global-test round."""
    history = [
        round_record(2, global_global_test=0.5, personalized=[0.6, 0.9]),
        round_record(3),  # not evaluated
        round_record(4, global_global_test=0.7, personalized=[0.8, float("nan")]),
    ]
    final = {"clients": [0, 1], "personalized": {"local_test": [0.7, 0.85]}, "global": {"global_test": 0.6}}
    selected = select_on_test(history, 6, final)
    assert selected.personalized_local_test.per_client == [0.8, 0.9]
    assert selected.personalized_local_test.rounds == [4, 2]
    assert selected.personalized_local_test.mean == pytest.approx(0.85)
    assert selected.global_global_test.to_json() == {"value": 0.7, "round": 4}
    assert selected.rounds_evaluated == [2, 4, 6]
