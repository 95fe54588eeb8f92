"""The PerAda authors' last differences, each a setting: their normalization constants, their distillation batches
(epochs of a DataLoader over a SubsetRandomSampler), their frozen BatchNorm statistics (the server's from the first
sampled client, each local model's kept across rounds, and moved by the distillation's teacher passes), and the
note when `--kd-mode train` runs alone.

Expected values come from the authors' code as it reads (NVlabs/PerAda: datasets/prepare_data.py,
aggregation/distillation.py, aggregation/averaging.py, optim/base.py), written out here in plain torch: the
constants typed from their file, an epoch sampler and rounds of their `FedBase` with persistent local models.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from peradapt.compute.trainer import InputPipeline
from peradapt.config import DataConfig, DistillConfig
from peradapt.data import ClientData, ImageSet, build_federation
from peradapt.data.images import SourceData
from peradapt.data.sources import normalization_statistics
from peradapt.distill import Distiller
from peradapt.distill.kd import distillation_batches
from peradapt.errors import ConfigError
from peradapt.methods import ClientUpdate, MethodContext
from peradapt.methods.perada import LOCAL_NORMS_KEY, PerAda
from peradapt.rundir.store import ClientStore

from .conftest import method_config
from .test_cli import crash_after_round, expect_user_error, results, run_cli, tiny_args
from .test_data import skip_cifar_md5, write_cifar  # noqa: F401 (skip_cifar_md5: a fixture used by name)
from .test_perada_authors import BATCH, image_set, module_with, normalized, perturbed, tiny_trainer

pytestmark = pytest.mark.usefixtures("one_thread")

# datasets/prepare_data.py, `_get_transform`: transforms.Normalize(mean, std) per dataset.
AUTHORS_CIFAR10 = ((0.4914, 0.4822, 0.4465), (0.247, 0.243, 0.261))
AUTHORS_CIFAR100 = ((0.5071, 0.4867, 0.4408), (0.2675, 0.2565, 0.2761))  # also their STL-10's


# ---------------------------------------------------------------- normalization constants


def source_named(name: str) -> SourceData:
    images = ImageSet(torch.zeros((2, 3, 4, 4), dtype=torch.uint8), torch.zeros(2, dtype=torch.int64), 10)
    return SourceData(name=name, train=images, test=None, mean=(0.1, 0.2, 0.3), std=(0.4, 0.5, 0.6))


def test_authors_constants_replace_the_statistics_of_the_sources_they_normalize_otherwise():
    for name, expected in (("cifar10", AUTHORS_CIFAR10), ("cifar100", AUTHORS_CIFAR100), ("stl10", AUTHORS_CIFAR100)):
        assert normalization_statistics(source_named(name), "authors") == expected
        assert normalization_statistics(source_named(name), "exact") == ((0.1, 0.2, 0.3), (0.4, 0.5, 0.6))
    # ImageNet's for Office-Home and CheXpert are peradapt's too; the others the authors never normalize
    assert normalization_statistics(source_named("svhn"), "authors") == ((0.1, 0.2, 0.3), (0.4, 0.5, 0.6))


@pytest.mark.usefixtures("skip_cifar_md5")
def test_a_cifar10_federation_takes_the_authors_constants_for_its_data_and_cifar100_distillation(tmp_path: Path):
    write_cifar(tmp_path, "cifar10", seed=1)
    write_cifar(tmp_path, "cifar100", seed=2)
    data = DataConfig("cifar10", tmp_path, partition="iid")
    authors = build_federation(data, num_clients=3, seed=0, normalization_constants="authors")
    assert (authors.mean, authors.std) == AUTHORS_CIFAR10
    assert (authors.kd_mean, authors.kd_std) == AUTHORS_CIFAR100
    exact = build_federation(data, num_clients=3, seed=0)
    assert exact.std == (0.2470, 0.2435, 0.2616) and exact.kd_std == (0.2673, 0.2564, 0.2762)
    assert torch.equal(exact.kd.images, authors.kd.images)  # the same images, other statistics


# ---------------------------------------------------------------- distillation batches


def authors_epoch_batches(num_samples: int, batch_size: int, steps: int, seed: int) -> list[torch.Tensor]:
    """aggregation/distillation.py over run.py's DataLoader(batch_size, sampler=SubsetRandomSampler(all indices)):
    `next(data_iter)`, and a new iterator (a new permutation) when one runs out; drop_last off."""
    generator = torch.Generator().manual_seed(seed)
    batches: list[torch.Tensor] = []
    while len(batches) < steps:
        permutation = torch.randperm(num_samples, generator=generator)  # SubsetRandomSampler.__iter__
        batches += [permutation[start : start + batch_size] for start in range(0, num_samples, batch_size)]
    return batches[:steps]


def test_epoch_batches_are_the_authors_dataloader():
    num_samples, batch_size, steps = 10, 4, 8  # epochs of 4 + 4 + 2
    batches = distillation_batches(num_samples, batch_size, "epochs", torch.Generator().manual_seed(5))
    drawn = [next(batches) for _ in range(steps)]
    expected = authors_epoch_batches(num_samples, batch_size, steps, seed=5)
    assert [batch.tolist() for batch in drawn] == [batch.tolist() for batch in expected]
    assert [len(batch) for batch in drawn] == [4, 4, 2, 4, 4, 2, 4, 4]
    for epoch in (drawn[0:3], drawn[3:6]):
        assert sorted(torch.cat(epoch).tolist()) == list(range(num_samples))  # every image once per epoch
    # independent draws: a fresh subset at every step, so images repeat before the set is used up
    independent = distillation_batches(num_samples, batch_size, "independent", torch.Generator().manual_seed(5))
    first = [next(independent) for _ in range(3)]
    assert sorted(torch.cat(first).tolist()) != list(range(num_samples))


class RecordingInputs(InputPipeline):
    """The distillation's inputs, recording each step's images (drawn with the generator: not the teachers' and
    validation passes)."""

    def __init__(self) -> None:
        super().__init__(mean=(0.5,), std=(0.5,), device=torch.device("cpu"))
        self.batches: list[torch.Tensor] = []

    def __call__(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        if generator is not None:
            self.batches.append(images[:, 0, 0, 0].long())  # each image's index, written in its first pixel
        return super().__call__(images, generator)


@pytest.mark.parametrize("kd_mode", ["eval", "train"])
def test_the_distiller_steps_through_epochs_of_the_distillation_set(kd_mode):
    trainer = tiny_trainer(frozen_bn="train")
    num_samples, steps, seed = 20, 7, 13  # batches of 8, 8, 4, 8, ...
    images = torch.arange(num_samples, dtype=torch.uint8).view(-1, 1, 1, 1).repeat(1, 1, 16, 16)
    kd_data = ImageSet(images, None, num_classes=3)
    config = DistillConfig(
        kd_steps=steps, kd_batch_size=BATCH, kd_mode=kd_mode, kd_batches="epochs", kd_eval_every=1000
    )
    inputs = RecordingInputs()
    distiller = Distiller(trainer, kd_data, image_set(6, seed=5), config, inputs)
    distiller.distill(perturbed(trainer, seed=3), [perturbed(trainer, seed=1)], seed=seed)
    expected = authors_epoch_batches(num_samples, BATCH, steps, seed)
    assert [batch.tolist() for batch in inputs.batches] == [batch.tolist() for batch in expected]

    again = RecordingInputs()  # a round replays from its seed alone: a resumed run draws the same batches
    Distiller(trainer, kd_data, image_set(6, seed=5), config, again).distill(
        perturbed(trainer, seed=3), [perturbed(trainer, seed=1)], seed=seed
    )
    assert all(torch.equal(a, b) for a, b in zip(again.batches, inputs.batches, strict=True))


# ---------------------------------------------------------------- frozen BatchNorm statistics


def authors_local_step(module: torch.nn.Module, data: ImageSet, lr: float) -> None:
    """optim/base.py, `train`: model.train() on the whole network, SGD on the trainable parameters; one batch."""
    module.zero_grad()
    module.train()
    parameters = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(parameters, lr=lr)
    F.cross_entropy(module(normalized(data.images)), data.labels).backward()
    optimizer.step()


def test_local_frozen_statistics_follow_the_authors_rounds():
    """Two rounds of optim/base.py's FedBase with persistent local models: each sampled client's local model loads
    only what the server averaged (`state_dict_sever_to_client`: adapters, bn1/bn2, fc), trains, and the server
    averages those and takes every other entry, the downsample BatchNorms' statistics, from one client
    (aggregation/averaging.py). Client 0 is sampled twice: its second round starts from its own statistics."""
    lr = 0.1
    trainer = tiny_trainer(frozen_bn="train")
    initial = perturbed(trainer, seed=1)
    frozen = trainer.model.frozen_norm_buffers
    assert frozen and frozen <= initial.keys()
    clients = [
        ClientData(c, image_set(BATCH, seed=10 + c), image_set(2, seed=20 + c), np.arange(0), np.arange(0))
        for c in range(3)
    ]
    config, settings = method_config(
        PerAda, local_epochs=1, personal_epochs=0, lr=lr, batch_size=BATCH, frozen_bn_statistics="local"
    )
    method = PerAda(MethodContext(config, trainer, ClientStore(), initial, None, clients, settings=settings))

    local_models = {c: module_with(trainer, initial) for c in range(3)}  # deep copies of the global model
    global_state = initial
    for round_index, sampled in enumerate(([0, 1], [0, 2])):
        updates = [method.client_update(clients[c], global_state, seed=10 * round_index + c) for c in sampled]
        uploads = []
        for c in sampled:
            module = local_models[c]
            module.load_state_dict({k: v for k, v in global_state.items() if k not in frozen}, strict=False)
            authors_local_step(module, clients[c].train, lr)
            uploads.append({k: v.detach().clone() for k, v in module.state_dict().items() if k in initial})
        for update, upload in zip(updates, uploads, strict=True):
            assert_close(update.upload, upload, atol=1e-5, rtol=1e-5)
            assert_close(method.store.get(update.client_id, LOCAL_NORMS_KEY), {k: upload[k] for k in frozen})
        if round_index == 1:  # client 2 starts from the initial statistics, not the server's
            assert any(not torch.equal(initial[k], global_state[k]) for k in frozen)

        new_global, _ = method.server_update(global_state, updates, seed=round_index, round_index=round_index)
        taken = [
            i for i, u in enumerate(uploads) if all(torch.allclose(new_global[k], u[k], atol=1e-5) for k in frozen)
        ]
        assert len(taken) == 1  # one client's, not the mean
        for key, value in new_global.items():
            if key not in frozen and value.is_floating_point():
                assert_close(value, (uploads[0][key] + uploads[1][key]) / 2, atol=1e-5, rtol=1e-5)
        global_state = new_global


def test_the_server_takes_each_sampled_clients_statistics_as_often():
    """random.sample's first client is uniform over the sample; peradapt draws one from the round's seed."""
    trainer = tiny_trainer(frozen_bn="train")
    initial = trainer.model.state()
    frozen = trainer.model.frozen_norm_buffers
    config, settings = method_config(PerAda, frozen_bn_statistics="local")
    method = PerAda(MethodContext(config, trainer, ClientStore(), initial, None, settings=settings))
    updates = [
        ClientUpdate(c, {**initial, **{k: torch.full_like(initial[k], c) for k in frozen}}, 10) for c in range(3)
    ]
    key = sorted(frozen)[0]
    taken = [int(method.server_update(initial, updates, seed, 0)[0][key].flatten()[0]) for seed in range(60)]
    assert sorted(set(taken)) == [0, 1, 2] and all(taken.count(c) >= 10 for c in range(3))
    assert taken == [int(method.server_update(initial, updates, seed, 0)[0][key].flatten()[0]) for seed in range(60)]


def test_local_frozen_statistics_need_frozen_batchnorms_in_training():
    trainer = tiny_trainer(frozen_bn="eval")
    config, settings = method_config(PerAda, frozen_bn_statistics="local")
    with pytest.raises(ConfigError, match="--frozen-bn train"):
        PerAda(MethodContext(config, trainer, ClientStore(), trainer.model.state(), None, settings=settings))


# ---------------------------------------------------------------- distillation's teacher passes


def teacher_statistics_method(trainer, clients, kd_data, **settings):
    """PerAda distilling as the authors do (training mode, epoch batches) with `settings`, and its distiller."""
    distill = DistillConfig(
        kd_steps=3, kd_batch_size=BATCH, server_lr=1e-2, kd_mode="train", kd_batches="epochs", kd_eval_every=1000
    )
    inputs = InputPipeline(mean=(0.5,), std=(0.5,), device=torch.device("cpu"))
    distiller = Distiller(trainer, kd_data, image_set(6, seed=5), distill, inputs)
    config, own = method_config(PerAda, local_epochs=1, personal_epochs=0, lr=0.1, batch_size=BATCH, **settings)
    context = MethodContext(config, trainer, ClientStore(), trainer.model.state(), distiller, clients, settings=own)
    return PerAda(context), distiller


AUTHORS_TEACHERS = {"frozen_bn": "train", "frozen_bn_statistics": "local", "kd_teacher_statistics": "authors"}


def test_teacher_passes_move_the_local_statistics_as_in_the_authors_rounds():
    """Two rounds in the authors' order, in plain torch: each sampled client's local model loads what the server
    sent and trains (optim/base.py); the server takes the downsample BatchNorms' statistics from one upload, then
    distills with those local models as teachers, left in training mode by their training, each run under no_grad
    on every batch in the epochs' order (aggregation/distillation.py), which moves their running statistics; a
    client trains its next round from them. Client 0 is sampled in both rounds."""
    trainer = tiny_trainer(frozen_bn="train")
    frozen = trainer.model.frozen_norm_buffers
    clients = [
        ClientData(c, image_set(BATCH, seed=10 + c), image_set(2, seed=20 + c), np.arange(0), np.arange(0))
        for c in range(3)
    ]
    kd_data = image_set(20, seed=30, labeled=False)  # epochs of 8, 8 and 4 images: 3 steps, one epoch
    method, distiller = teacher_statistics_method(trainer, clients, kd_data, **AUTHORS_TEACHERS)
    students = []  # what each round's distillation starts from
    distill = distiller.distill

    def recording(student, *args, **kwargs):
        students.append(student)
        return distill(student, *args, **kwargs)

    distiller.distill = recording

    global_state = trainer.model.state()
    local_models = {c: module_with(trainer, global_state) for c in range(3)}  # deep copies of the global model
    for round_index, sampled in enumerate(([0, 1], [0, 2])):
        seed = 7 + round_index
        updates = [method.client_update(clients[c], global_state, seed=seed + c) for c in sampled]
        for c, update in zip(sampled, updates, strict=True):
            module = local_models[c]
            module.load_state_dict({k: v for k, v in global_state.items() if k not in frozen}, strict=False)
            authors_local_step(module, clients[c].train, lr=0.1)
            trained = {k: v.detach().clone() for k, v in module.state_dict().items() if k in global_state}
            assert_close(update.upload, trained, atol=1e-5, rtol=1e-5)  # client 0's second: from the moved statistics

        global_state, _ = method.server_update(global_state, updates, seed=seed, round_index=round_index)
        teachers = [local_models[c] for c in sampled]
        assert all(teacher.training for teacher in teachers)
        for batch in authors_epoch_batches(len(kd_data), BATCH, 3, seed):
            with torch.no_grad():
                for teacher in teachers:
                    teacher(normalized(kd_data.images[batch]))
        for c, update in zip(sampled, updates, strict=True):
            moved = {k: v for k, v in local_models[c].state_dict().items() if k in frozen}
            assert_close(method.store.get(c, LOCAL_NORMS_KEY), moved, atol=1e-5, rtol=1e-5)
            mean = sorted(k for k in frozen if k.endswith("running_mean"))[0]
            assert not torch.allclose(moved[mean], update.upload[mean], atol=1e-3)  # the passes moved them
        # the server's statistics: one upload's, as its training left them
        assert [u.client_id for u in updates if all(torch.equal(students[-1][k], u.upload[k]) for k in frozen)]


def test_the_teachers_statistics_stay_where_the_setting_is_off():
    trainer = tiny_trainer(frozen_bn="train")
    clients = [
        ClientData(c, image_set(BATCH, seed=c), image_set(2, seed=c), np.arange(0), np.arange(0)) for c in (0, 1)
    ]
    kd_data = image_set(20, seed=30, labeled=False)
    method, _ = teacher_statistics_method(trainer, clients, kd_data, frozen_bn="train", frozen_bn_statistics="local")
    updates = [method.client_update(client, trainer.model.state(), seed=c) for c, client in enumerate(clients)]
    method.server_update(trainer.model.state(), updates, seed=0, round_index=0)
    frozen = trainer.model.frozen_norm_buffers
    for update in updates:  # as client training left them
        assert_close(method.store.get(update.client_id, LOCAL_NORMS_KEY), {k: update.upload[k] for k in frozen})


@pytest.mark.parametrize(
    ("given", "missing"),
    [
        ({"kd_teacher_statistics": "authors"}, "passes: add --frozen-bn train --frozen-bn-statistics local$"),
        ({**AUTHORS_TEACHERS, "frozen_bn_statistics": "averaged"}, "passes: add --frozen-bn-statistics local$"),
    ],
)
def test_moving_the_teachers_statistics_needs_the_authors_distillation(given, missing):
    trainer = tiny_trainer(frozen_bn="train")
    with pytest.raises(ConfigError, match=missing):
        teacher_statistics_method(trainer, [], image_set(4, seed=1, labeled=False), **given)


# ---------------------------------------------------------------- runs: the note, resume


KD_TRAIN = ("--kd-mode", "train", "--rounds", "1", "--eval-every", "1")


def test_kd_mode_train_alone_is_noted_once(fmnist_dir, home, tmp_path, capsys, monkeypatch):
    code, _, err = run_cli(tiny_args(fmnist_dir, tmp_path / "alone", *KD_TRAIN), capsys, monkeypatch)
    assert code == 0, err
    assert err.count("note: --kd-mode train without --frozen-bn train") == 1
    both = tiny_args(fmnist_dir, tmp_path / "both", *KD_TRAIN, "--frozen-bn", "train")
    code, _, err = run_cli(both, capsys, monkeypatch)
    assert code == 0, err
    assert "--kd-mode train without" not in err


LOCAL_STATISTICS = (
    *("--frozen-bn", "train", "--frozen-bn-statistics", "local"),
    *("--kd-mode", "train", "--kd-batches", "epochs"),
)
AUTHORS = (*LOCAL_STATISTICS, "--kd-teacher-statistics", "authors")


def test_a_run_with_the_authors_settings_resumes_to_identical_files(fmnist_dir, home, tmp_path, capsys, monkeypatch):
    whole = tmp_path / "whole"
    code, _, err = run_cli(tiny_args(fmnist_dir, whole, *AUTHORS), capsys, monkeypatch)
    assert code == 0, err
    run = tmp_path / "crashed"
    crash_after_round(2, tiny_args(fmnist_dir, run, *AUTHORS), capsys, monkeypatch)
    code, _, err = run_cli(tiny_args(fmnist_dir, run, *AUTHORS, "--resume"), capsys, monkeypatch)
    assert code == 0, err
    assert results(run) == results(whole)

    unmoved = tmp_path / "unmoved"  # a client sampled again uploads other statistics, which the server may take
    code, _, err = run_cli(tiny_args(fmnist_dir, unmoved, *LOCAL_STATISTICS), capsys, monkeypatch)
    assert code == 0, err
    statistics = "global/frozen_bn_statistics.safetensors"
    assert results(unmoved)[statistics] != results(whole)[statistics]


def test_teacher_statistics_are_refused_where_they_cannot_move(fmnist_dir, home, tmp_path, capsys, monkeypatch):
    args = tiny_args(fmnist_dir, tmp_path / "run", "--kd-teacher-statistics", "authors")
    missing = "add --kd-mode train --frozen-bn train --frozen-bn-statistics local"
    expect_user_error(args, capsys, monkeypatch, "--kd-teacher-statistics authors", missing)
    nokd = [*args, "--method", "perada-nokd"]  # no teachers
    expect_user_error(nokd, capsys, monkeypatch, "--kd-teacher-statistics is a setting of perada:")
    flower = [*args, *AUTHORS, "--engine", "flower"]
    expect_user_error(flower, capsys, monkeypatch, "--engine builtin")
    assert not (tmp_path / "run").exists()
