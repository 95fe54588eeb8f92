"""Concurrent clients (`--concurrent-clients`, peradapt.compute.concurrent): several clients' local SGD in one
batched pass through the shared model, equal to the update rule computed by hand and to one-after-another training."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file
from torch.testing import assert_close

from peradapt.adapters import inject_adapters
from peradapt.backbones import create_backbone, freeze
from peradapt.compute.concurrent import ConcurrentSGD, clients_that_fit, unsupported_layers
from peradapt.compute.trainer import InputPipeline, LocalTrainer, ParameterGroup, SGDJob
from peradapt.config import TrainConfig
from peradapt.data import ImageSet
from peradapt.errors import ConfigError, TrainingDiverged
from peradapt.federation.clients import LocalClients, RoundTask
from peradapt.methods import METHODS
from peradapt.methods.base import LocalSGDMethod, trains_by_sgd_jobs
from peradapt.methods.partial import personal_keys
from peradapt.methods.scaffold import CONTROL_DELTA
from peradapt.seeds import SERVER, derive_seed

from .conftest import TINY_BACKBONE, TINY_VIT
from .test_cli import crash_after_round, results, run_cli, tiny_args
from .test_newclients import tiny_session as newclients_session
from .test_perada_authors import perturbed  # trainable tensors moved off their start (LoRA B = 0)

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = {"atol": 2e-5, "rtol": 2e-5}
# Methods whose client update is plain local SGD (LocalSGDMethod.client_steps), which train concurrently (partial
# models as jobs whose parameter groups are their parts); the others have update rules of their own (pFedMe's inner
# problem, APFL's mixture, FedRoD's two risks...).
CONCURRENT = {
    "perada",
    "perada-nokd",
    "ditto",
    "fedprox",
    "fedavg",
    "fedavg-ft",
    "fedprox-li",
    "feddyn",
    "feddf",
    "mtl",
    "standalone",
    "fedala",
    "fedalt",
    "fedsim",
    "fedbn",
    "lg-fedavg",
    "fedper",
    "fedrep",
    "fedbabu",
    "scaffold",
}


# How ConcurrentSGD steps: the fused step; the fused step through `_replayed`'s captured-step buffers (replayed from
# CUDA graphs on a GPU, run again without one here); `vmap` over `grad`.
PATHS = ["fused", "graphed", "vmap"]


def concurrent_sgd(trainer_: LocalTrainer, path: str) -> ConcurrentSGD:
    concurrent = ConcurrentSGD(trainer_, fused=path != "vmap", graphs=path == "graphed")
    assert (concurrent.fused is not None, concurrent.graphs) == (path != "vmap", path == "graphed")
    return concurrent


def trainer(
    backbone: str = TINY_BACKBONE,
    kind: str = "residual",
    dropout: float = 0.0,
    scope: str = "adapter",
    frozen_bn: str = "eval",
) -> LocalTrainer:
    torch.manual_seed(0)
    frozen = freeze(create_backbone(backbone, num_classes=3, in_chans=1))
    model = inject_adapters(frozen, kind, dropout=dropout, lora_rank=2, scope=scope, frozen_bn=frozen_bn)
    return LocalTrainer(model, InputPipeline(mean=(0.5,), std=(0.5,), device=torch.device("cpu")), batch_size=8)


def images(count: int, seed: int, size: int = 16) -> ImageSet:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (count, 1, size, size), dtype=torch.uint8, generator=generator)
    return ImageSet(pixels, torch.randint(0, 3, (count,), generator=generator), num_classes=3)


# ---------------------------------------------------------------- the update rule, by hand


@pytest.mark.parametrize("path", PATHS)
def test_each_client_takes_the_proximal_sgd_steps_of_perada_algorithm_1_by_hand(path):
    """Three clients at once, full batches (one batch = the client's data, so minibatch order cannot matter), three
    steps each of v <- v - lr (grad L(v) + lam (v - w)) (PerAda Algorithm 1, line 10), each with its own lr, lam and
    anchor (none for the second: plain SGD, line 15); computed here with autograd on the model, client by client.
    By the fused step, the fused step as CUDA graphs replay it, and by `vmap` over `grad`."""
    trainer_ = trainer()
    model, module = trainer_.model, trainer_.model.module
    w = perturbed(trainer_, seed=9)
    # the third also with a gradient correction c (SCAFFOLD's c - c_i): v <- v - lr (grad L(v) + lam (v - w) + c)
    generator = torch.Generator().manual_seed(5)
    c = {n: 0.1 * torch.randn(p.shape, generator=generator) for n, p in model.trainable_parameters().items()}
    jobs = [
        SGDJob(perturbed(trainer_, seed=1), images(8, seed=1), epochs=3, lr=0.1, seed=11, anchor=w, lam=0.5),
        SGDJob(perturbed(trainer_, seed=2), images(6, seed=2), epochs=3, lr=0.05, seed=12),
        SGDJob(
            perturbed(trainer_, seed=3), images(8, seed=3), epochs=3, lr=0.2, seed=13, anchor=w, lam=2.0, correction=c
        ),
    ]
    concurrent = concurrent_sgd(trainer_, path)
    together = concurrent.run(jobs)

    for job, (state, loss) in zip(jobs, together, strict=True):
        model.load_state(job.start)
        model.train()
        parameters = model.trainable_parameters()
        x = (job.data.images.float() / 255 - 0.5) / 0.5
        losses = []
        for _ in range(3):
            step_loss = torch.nn.functional.cross_entropy(module(x), job.data.labels)  # BN statistics update here
            gradients = torch.autograd.grad(step_loss, list(parameters.values()))
            with torch.no_grad():
                for (name, v), g in zip(parameters.items(), gradients, strict=True):
                    pull = job.lam * (v - job.anchor[name]) if job.anchor is not None else 0.0
                    correction = job.correction[name] if job.correction is not None else 0.0
                    v -= job.lr * (g + pull + correction)
            losses.append(step_loss.item())
        by_hand = model.state()
        assert state.keys() == by_hand.keys()
        for name in by_hand:
            assert_close(state[name], by_hand[name], **TOL, msg=name)
        assert loss == pytest.approx(sum(losses) / 3, rel=1e-5)
        assert any(not torch.equal(state[n], job.start[n]) for n in parameters)  # it trained


def test_a_job_trains_its_groups_at_their_rates_and_leaves_the_rest_as_it_started():
    """Jobs with parameter groups (SGDJob.groups) on the whole network: the head at one rate, the last stage at
    another, the rest (the stem and the first stages, their BatchNorms included) frozen. Three full-batch steps of
    v <- v - lr_v (grad L(v) + lam (v - w)) on the grouped parameters, computed here with autograd, each client alone
    and all at once (a job without groups in the same call trains in a batched pass of its own); every key of no
    group comes back exactly as it started, though the forward passes move its running statistics, and no gradient
    is computed for its parameters."""
    trainer_ = trainer(kind="none", scope="full")
    model, module = trainer_.model, trainer_.model.module
    head = tuple(personal_keys(model, "head"))
    last_stage = tuple(key for key in model.state_names() if key.startswith("layer4."))
    w = perturbed(trainer_, seed=9)
    jobs = [
        SGDJob(
            perturbed(trainer_, seed=1),
            images(8, seed=1),
            epochs=3,
            lr=0.1,
            seed=11,
            anchor=w,
            lam=0.5,
            groups=(ParameterGroup(head, 0.3), ParameterGroup(last_stage, 0.05)),
        ),
        SGDJob(
            perturbed(trainer_, seed=2),
            images(6, seed=2),
            epochs=3,
            lr=0.1,
            seed=12,
            groups=(ParameterGroup(head, 0.02), ParameterGroup(last_stage, 0.2)),
        ),
        SGDJob(perturbed(trainer_, seed=3), images(8, seed=3), epochs=3, lr=0.05, seed=13),
    ]
    frozen = [name for name in model.trainable_parameters() if name not in head + last_stage]
    alone = [trainer_.run(job) for job in jobs[:2]]
    assert all(model.trainable_parameters()[name].grad is None for name in frozen)  # none was ever computed
    assert all(parameter.requires_grad for parameter in model.trainable_parameters().values())
    together = ConcurrentSGD(trainer_).run(jobs)

    for index, job in enumerate(jobs):
        model.load_state(job.start)
        model.train()
        parameters = model.trainable_parameters()
        groups = job.groups or (ParameterGroup(tuple(model.state_names()), job.lr),)  # no groups: all of it
        rates = {key: group.lr for group in groups for key in group.keys if key in parameters}
        x = (job.data.images.float() / 255 - 0.5) / 0.5
        losses = []
        for _ in range(3):
            step_loss = torch.nn.functional.cross_entropy(module(x), job.data.labels)  # every BN's statistics move
            gradients = torch.autograd.grad(step_loss, [parameters[name] for name in rates])
            with torch.no_grad():
                for (name, lr), g in zip(rates.items(), gradients, strict=True):
                    v = parameters[name]
                    pull = job.lam * (v - job.anchor[name]) if job.anchor is not None else 0.0
                    v -= lr * (g + pull)
            losses.append(step_loss.item())
        by_hand = model.state()
        trained = {key for group in groups for key in group.keys}
        results = [together[index]] + ([alone[index]] if index < len(alone) else [])
        for state, loss in results:
            assert state.keys() == by_hand.keys()
            for name, tensor in by_hand.items():
                if name in trained:
                    assert_close(state[name], tensor, **TOL, msg=name)
                else:
                    assert torch.equal(state[name], job.start[name]), name
            assert loss == pytest.approx(sum(losses) / 3, rel=1e-5)
        assert all(not torch.equal(by_hand[name], job.start[name]) for name in trained)  # every group trained
        if job.groups is not None:  # the frozen stem's statistics moved by hand: the job restored them
            assert not torch.equal(by_hand["bn1.running_mean"], job.start["bn1.running_mean"])


# ---------------------------------------------------------------- equal to one after another


# Whether the fused step serves a model: every module with clients' own state is a linear layer, a 1x1 convolution, a
# BatchNorm or a LayerNorm (LoRA on a ResNet has 3x3 convolutions as its A factors: `vmap` trains those).
FUSED = {
    (TINY_BACKBONE, "residual"): True,
    (TINY_BACKBONE, "lora"): False,
    (TINY_VIT, "residual"): True,
    (TINY_VIT, "lora"): True,
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("backbone", "kind", "size"),
    [(TINY_BACKBONE, "residual", 16), (TINY_BACKBONE, "lora", 16), (TINY_VIT, "residual", 32), (TINY_VIT, "lora", 32)],
)
def test_concurrent_training_equals_one_client_after_another(backbone, kind, size, path):
    """Ragged clients (13, 20, 7 and 9 images at batch 8: last batches of 5, 4, 7 and 9, one client done after one
    batch per epoch), dropout 0.3, anchors, rates and step counts differing: every state and mean loss as
    `LocalTrainer.sgd` gives them one job after another, to float rounding; by the fused step where it serves the
    model (also as CUDA graphs replay it), and by `vmap` over `grad`."""
    if path != "vmap" and not FUSED[(backbone, kind)]:
        assert ConcurrentSGD(trainer(backbone, kind)).fused is None
        return
    trainer_ = trainer(backbone, kind, dropout=0.3)
    w = perturbed(trainer_, seed=7)
    jobs = [
        SGDJob(perturbed(trainer_, seed=1), images(13, 1, size), epochs=2, lr=0.05, seed=101, anchor=w, lam=1.0),
        SGDJob(perturbed(trainer_, seed=2), images(20, 2, size), epochs=2, lr=0.05, seed=102),
        SGDJob(perturbed(trainer_, seed=3), images(7, 3, size), epochs=1, lr=0.1, seed=103, anchor=w, lam=0.3),
        SGDJob(perturbed(trainer_, seed=4), images(9, 4, size), epochs=0, steps=3, lr=0.02, seed=104),
    ]
    alone = [trainer_.run(job) for job in jobs]
    together = concurrent_sgd(trainer_, path).run(jobs)
    for job, (state, loss), (expected, expected_loss) in zip(jobs, together, alone, strict=True):
        assert state.keys() == expected.keys()
        for name in expected:
            assert_close(state[name], expected[name], **TOL, msg=name)
        assert loss == pytest.approx(expected_loss, rel=1e-5)
        assert max((state[n] - job.start[n]).abs().max() for n in trainer_.model.trainable_parameters()) > 1e-3


def test_steps_replayed_from_captured_buffers_equal_one_client_after_another(monkeypatch):
    """Equal clients (32 images at batch 8, 2 epochs: 8 steps of every lane, the shape's first 2 eager, then
    captured and replayed), dropout 0.3, each lane its own lr and lam: as one after another, to float rounding; and
    so are the next jobs of the kind, replaying the same captured step."""
    import peradapt.compute.concurrent as concurrent_module

    replays = []
    real_replay = concurrent_module._Captured.replay

    def counted(self):
        replays.append(self)
        return real_replay(self)

    monkeypatch.setattr(concurrent_module._Captured, "replay", counted)
    trainer_ = trainer(dropout=0.3)
    w = perturbed(trainer_, seed=7)
    jobs = [
        SGDJob(perturbed(trainer_, k), images(32, k), epochs=2, lr=lr, seed=k, anchor=w, lam=lam)
        for k, lr, lam in ((1, 0.05, 1.0), (2, 0.1, 0.3), (3, 0.05, 0.0))
    ]
    # The next round's jobs of this kind: other starts and data, the rule's tensors refilled, the same step replayed.
    later = [replace(job, start=perturbed(trainer_, 10 + k), data=images(32, 10 + k)) for k, job in enumerate(jobs)]
    concurrent = concurrent_sgd(trainer_, "graphed")
    for batch in (jobs, later):
        alone = [trainer_.run(job) for job in batch]
        together = concurrent.run(batch)
        for (state, loss), (expected, expected_loss) in zip(together, alone, strict=True):
            for name in expected:
                assert_close(state[name], expected[name], **TOL, msg=name)
            assert loss == pytest.approx(expected_loss, rel=1e-5)
    assert len(replays) == 2 * 8 - concurrent_module.GRAPH_WARM_UP and len(set(map(id, replays))) == 1


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("augment", ["crop-flip", "resized-crop"])
def test_augmented_clients_train_concurrently_as_one_after_another(augment, path):
    """Each lane's crops and flips drawn from its own generator in `minibatches`' order, applied to all the lanes'
    images at once (one gather, one resampling): the augmented batches of one after another, to float rounding."""
    trainer_ = trainer(dropout=0.3)
    trainer_.inputs = replace(trainer_.inputs, augment=augment, image_size=16)
    jobs = [SGDJob(perturbed(trainer_, k), images(n, k), epochs=2, lr=0.05, seed=k) for k, n in ((1, 13), (2, 20))]
    alone = [trainer_.run(job) for job in jobs]
    for (state, loss), (expected, expected_loss) in zip(concurrent_sgd(trainer_, path).run(jobs), alone, strict=True):
        for name in expected:
            assert_close(state[name], expected[name], **TOL, msg=name)
        assert loss == pytest.approx(expected_loss, rel=1e-5)


def test_uneven_clients_step_padded_and_replayed_as_one_after_another(monkeypatch):
    """Clients of 13 and 13 images for 4 epochs and of 5 for 1, at batch 8: every step of the captured path has
    every lane, a short batch padded with rows of weight 0 and a done lane all padding (its state held), so that
    captured padded steps replay; with dropout 0.3, crop-flip and lanes' own lr and lam: each client as one after
    another, to float rounding."""
    import peradapt.compute.concurrent as concurrent_module

    replayed = []
    real_replay = concurrent_module._Captured.replay

    def counted(self):
        replayed.append(self.inputs.weights is not None)
        return real_replay(self)

    monkeypatch.setattr(concurrent_module._Captured, "replay", counted)
    trainer_ = trainer(dropout=0.3)
    trainer_.inputs = replace(trainer_.inputs, augment="crop-flip")
    w = perturbed(trainer_, seed=7)
    jobs = [
        SGDJob(perturbed(trainer_, k), images(n, k), epochs=epochs, lr=lr, seed=k, anchor=w, lam=lam)
        for k, n, epochs, lr, lam in ((1, 13, 4, 0.05, 1.0), (2, 13, 4, 0.1, 0.0), (3, 5, 1, 0.05, 0.3))
    ]
    alone = [trainer_.run(job) for job in jobs]
    together = concurrent_sgd(trainer_, "graphed").run(jobs)
    # Steps (8, 8, 5), (5, 5, done), then (8, 8, done), (5, 5, done) three times: padded to width 8 and to width
    # 5, two shapes of 4 steps each, of which the first GRAPH_WARM_UP run eagerly
    assert replayed.count(True) == 2 * (4 - concurrent_module.GRAPH_WARM_UP) and all(replayed)
    for (state, loss), (expected, expected_loss) in zip(together, alone, strict=True):
        for name in expected:
            assert_close(state[name], expected[name], **TOL, msg=name)
        assert loss == pytest.approx(expected_loss, rel=1e-5)


def test_dropout_masks_are_each_clients_own():
    """The agreement above rests on each client's dropout masks: with another job's seed (so other masks, the same
    minibatch order being irrelevant on a full batch), the same client lands far outside the tolerance."""
    trainer_ = trainer(dropout=0.5)
    start, data = perturbed(trainer_, seed=1), images(8, 1)
    first, _ = trainer_.run(SGDJob(start, data, epochs=3, lr=0.1, seed=5))
    (same, _), (other, _) = ConcurrentSGD(trainer_).run(
        [SGDJob(start, data, epochs=3, lr=0.1, seed=5), SGDJob(start, data, epochs=3, lr=0.1, seed=6)]
    )
    names = list(trainer_.model.trainable_parameters())
    assert max((same[n] - first[n]).abs().max() for n in names) < 1e-5
    assert max((other[n] - first[n]).abs().max() for n in names) > 1e-3


def test_generators_of_jobs_are_driven_side_by_side():
    """`run_steps`: each generator's next job trained with the others'; one that yields nothing finishes at once."""
    trainer_ = trainer()
    start = perturbed(trainer_, seed=1)
    sizes_seen: list[int] = []
    original = ConcurrentSGD.run

    def counting_run(self, jobs, shares=None):
        sizes_seen.append(len(jobs))
        return original(self, jobs, shares)

    def client(seed: int, jobs: int):
        losses = []
        for index in range(jobs):
            _, loss = yield SGDJob(start, images(8, seed), epochs=1, lr=0.05, seed=seed * 10 + index)
            losses.append(loss)
        return seed, losses

    concurrent = ConcurrentSGD(trainer_)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ConcurrentSGD, "run", counting_run)
        finished = concurrent.run_steps([client(1, 2), client(2, 0), client(3, 1)])
    assert sizes_seen == [2, 1]  # clients 1 and 3, then client 1's second job
    assert [seed for seed, _ in finished] == [1, 2, 3]
    assert [len(losses) for _, losses in finished] == [2, 0, 1]
    alone = trainer_.run_steps(client(1, 2))
    assert alone[1] == pytest.approx(finished[0][1], rel=1e-5)


def test_a_diverging_client_stops_the_run_with_the_sequential_message():
    trainer_ = trainer()
    jobs = [SGDJob(perturbed(trainer_, seed=k), images(8, k), epochs=3, lr=1e30, seed=k) for k in (1, 2)]
    with pytest.raises(TrainingDiverged, match=r"training loss became (nan|inf): lower --lr \(now 1e\+30\)"):
        ConcurrentSGD(trainer_).run(jobs)


def test_one_after_another_a_diverging_client_stops_the_run_with_the_same_message():
    trainer_ = trainer()
    job = SGDJob(perturbed(trainer_, seed=1), images(8, 1), epochs=3, lr=1e30, seed=1)
    with pytest.raises(TrainingDiverged, match=r"training loss became (nan|inf): lower --lr \(now 1e\+30\)"):
        trainer_.run(job)


def test_a_job_reads_its_losses_from_the_device_once_whatever_its_steps(monkeypatch):
    """No host synchronisation inside a job (issue 35): the losses stay on the device and are read, and checked,
    once the job is done. Counted as the reads of a tensor's values into Python (`item`, `tolist`, `bool`) that a
    job of 2 and a job of 6 steps make: the same number, and the mean loss that of the steps' losses."""
    trainer_ = trainer()
    start, data = perturbed(trainer_, seed=3), images(8, 3)
    counted = {"reads": 0}
    for name in ("item", "tolist", "__bool__"):
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, **kwargs):
            counted["reads"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)

    reads = {}
    for steps in (2, 6):
        counted["reads"] = 0
        _, mean_loss = trainer_.run(SGDJob(start, data, epochs=1, lr=0.05, seed=3, steps=steps))
        reads[steps] = counted["reads"]
        assert mean_loss > 0
    assert reads[2] == reads[6] <= 2, reads


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "vmap"])
def test_bf16_autocast_trains_concurrently_as_one_after_another(monkeypatch, fused):
    """The CUDA path's precision, on CPU: under bf16 autocast (where `vmap`'s BatchNorm rule refuses bf16 inputs,
    so BatchNorms compute in float32) the clients train as one after another does, to bf16's rounding."""
    monkeypatch.setattr(InputPipeline, "autocast", lambda self: torch.autocast("cpu", dtype=torch.bfloat16))
    trainer_ = trainer(dropout=0.3)
    w = perturbed(trainer_, seed=7)
    jobs = [
        SGDJob(perturbed(trainer_, k), images(n, k), epochs=2, lr=0.05, seed=k, anchor=w, lam=1.0)
        for k, n in ((1, 13), (2, 20))
    ]
    alone = [trainer_.run(job) for job in jobs]
    together = ConcurrentSGD(trainer_, fused=fused).run(jobs)
    names = list(trainer_.model.trainable_parameters())
    for job, (state, loss), (expected, expected_loss) in zip(jobs, together, alone, strict=True):
        difference = max((state[n] - expected[n]).abs().max() for n in names)
        moved = max((expected[n] - job.start[n]).abs().max() for n in names)
        assert difference < 0.02 * moved, (difference, moved)
        assert loss == pytest.approx(expected_loss, rel=0.01)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "vmap"])
def test_random_draws_outside_dropout_layers_are_refused_in_one_line(fused):
    """A random op that is no `nn.Dropout` module (functional dropout, drop-path) cannot be drawn per client."""
    trainer_ = trainer()
    classifier = trainer_.model.base_model.fc
    classifier.register_forward_pre_hook(lambda _, args: (torch.nn.functional.dropout(args[0], 0.5, training=True),))
    jobs = [SGDJob(perturbed(trainer_, k), images(8, k), epochs=1, lr=0.05, seed=k) for k in (1, 2)]
    with pytest.raises(
        ConfigError, match=r"random numbers outside its nn\.Dropout layers.*without --concurrent-clients"
    ):
        ConcurrentSGD(trainer_, fused=fused).run(jobs)


def test_batchnorms_with_a_cumulative_average_train_concurrently_as_one_after_another():
    """BatchNorms of momentum None average their batches' statistics (1 / batches seen, per client)."""
    trainer_ = trainer()
    for module in trainer_.model.module.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.momentum = None
    jobs = [SGDJob(perturbed(trainer_, k), images(n, k), epochs=2, lr=0.05, seed=k) for k, n in ((1, 13), (2, 20))]
    alone = [trainer_.run(job) for job in jobs]
    for (state, _), (expected, _) in zip(ConcurrentSGD(trainer_).run(jobs), alone, strict=True):
        for name in expected:
            assert_close(state[name], expected[name], **TOL, msg=name)
    assert any(
        not torch.equal(expected[name], job.start[name])
        for job, (expected, _) in zip(jobs, alone, strict=True)
        for name in expected
        if name.endswith("running_var")
    )


@pytest.mark.parametrize("path", PATHS)
def test_frozen_batchnorms_in_training_mode_train_concurrently_as_one_after_another(path):
    """--frozen-bn train (the authors' mode): the frozen BatchNorms take batch statistics and move their running
    statistics, each client's own, while their affine weights stay the backbone's, shared by all."""
    trainer_ = trainer(dropout=0.3, frozen_bn="train")
    assert trainer_.model.frozen_norm_buffers
    jobs = [SGDJob(perturbed(trainer_, k), images(n, k), epochs=2, lr=0.05, seed=k) for k, n in ((1, 16), (2, 16))]
    alone = [trainer_.run(job) for job in jobs]
    for job, (state, _), (expected, _) in zip(jobs, concurrent_sgd(trainer_, path).run(jobs), alone, strict=True):
        for name in expected:
            assert_close(state[name], expected[name], **TOL, msg=name)
        assert any(not torch.equal(state[n], job.start[n]) for n in trainer_.model.frozen_norm_buffers)


def test_clients_that_fit_the_memory_allowed():
    # A step of one client peaks at 300 bytes, of two at 500: 100 fixed and 200 per client.
    assert clients_that_fit(300, 500, allowed=1000) == 4
    assert clients_that_fit(300, 500, allowed=899) == 3
    assert clients_that_fit(300, 500, allowed=200) == 1  # even one does not fit: one, as without --concurrent-clients
    # Two measure no more than one: each client is taken to need half of two's step (150 each, 150 fixed)
    assert clients_that_fit(300, 300, allowed=1000) == 5
    assert clients_that_fit(300, 280, allowed=1000) == 6  # 140 each, 160 fixed


def test_concurrent_clients_auto_trains_one_after_another_on_a_cpu_and_says_nothing(fmnist_dir, home):
    session = tiny_session(fmnist_dir, "perada", None)
    assert session.config.federation.concurrent_clients is None
    console = Console(record=True, width=400)
    assert LocalClients(session, console).concurrent is None
    assert console.export_text() == ""


def test_models_with_other_random_layers_train_one_after_another(fmnist_dir, home):
    session = tiny_session(fmnist_dir, "perada", 2)
    session.model.base_model.add_module("extra", torch.nn.Dropout2d(0.2))
    assert unsupported_layers(session.model.module) == ["base_model.model.extra"]
    console = Console(record=True, width=400)
    assert LocalClients(session, console).concurrent is None
    assert "the model's base_model.model.extra draws random numbers" in console.export_text()


def test_flower_says_its_clientapps_train_one_client_each(fmnist_dir, home, tmp_path, monkeypatch):
    import peradapt.flower.simulation as simulation
    from peradapt.commands.training import train

    monkeypatch.setattr(simulation, "simulate", lambda run, console: {"simulated": True})
    config = TrainConfig.from_flat(
        {
            "data": "fmnist",
            "data_dir": str(fmnist_dir),
            "backbone": TINY_BACKBONE,
            "clients": 4,
            "rounds": 1,
            "clients_per_round": 2,
            "engine": "flower",
            "concurrent_clients": 2,
            "out": str(tmp_path / "run"),
        }
    )
    console = Console(record=True, width=400)
    assert train(config, console=console) == {"simulated": True}
    assert "--concurrent-clients 2: each Flower ClientApp trains its one client" in console.export_text()


# ---------------------------------------------------------------- every method of the local-SGD shape


def test_the_methods_that_train_concurrently():
    assert {name for name, cls in METHODS.items() if trains_by_sgd_jobs(cls)} == CONCURRENT
    assert issubclass(METHODS["perfedavg"], LocalSGDMethod)  # a FedAvg subclass whose client_update is its own
    assert not trains_by_sgd_jobs(METHODS["perfedavg"])
    assert not trains_by_sgd_jobs(METHODS["fedrod"])  # a partial model descending its own two risks


def tiny_session(fmnist_dir: Path, method: str, concurrent: int | None, **overrides: object):
    """The tiny federation with 3 clients a round, all federated, trained `concurrent` at once."""
    # full-model training at higher rates amplifies rounding past any fixed tolerance: lr 0.01
    settings = {"clients_per_round": 3, "holdout_clients": 0, "lr": 0.01, "concurrent_clients": concurrent}
    settings |= overrides
    return newclients_session(fmnist_dir, method, **settings)


def assert_states_close(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        # SCAFFOLD's Δc_i = (x - y_i) / (K lr) - c: y's rounding divided by K lr (lr 0.01, K >= 1 here)
        atol = 1e-2 if name.startswith(CONTROL_DELTA) else 1e-4
        assert_close(actual[name], tensor, atol=atol, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("method", sorted(CONCURRENT))
def test_every_local_sgd_method_gives_the_same_rounds_concurrently(method, fmnist_dir, home):
    """Two rounds of 3 sampled clients out of 4 through the builtin engine's clients, one after another and 2 at
    once (a group of 2, then one of 1): each round's uploads and client metrics, and at the end every client's
    personalized state (stored state included: Ditto's and PerAda's v_m, FedDyn's gradient, MTL's models, FedALA's
    weights). Both sessions get the same server steps, from the one-after-another uploads: a server's own
    arithmetic (Adam's normalized steps in distillation) would turn rounding into steps of its learning rate, which
    says nothing about the clients."""
    assert_same_rounds(method, tiny_session(fmnist_dir, method, 1), tiny_session(fmnist_dir, method, 2))


def test_a_partial_model_trains_its_parts_at_their_rates_concurrently(fmnist_dir, home):
    """FedSim with --personal-lr apart from --lr: each step of a client's one job takes its two groups at their two
    rates, together as alone."""
    alone, together = (tiny_session(fmnist_dir, "fedsim", k, personal_lr=0.03) for k in (1, 2))
    assert_same_rounds("fedsim", alone, together)


@pytest.mark.parametrize("method", ["perada", "fedala"])
def test_clients_doing_part_of_their_work_give_the_same_rounds_concurrently(method, fmnist_dir, home):
    """Stragglers and a --budget's last round: clients 0 and 3 do 40% and 75% of their work, alone as together
    (with FedALA, what the client trains itself between its jobs too)."""
    alone, together = (tiny_session(fmnist_dir, method, k) for k in (1, 2))
    assert_same_rounds(method, alone, together, shares={0: 0.4, 3: 0.75})


def assert_same_rounds(method: str, alone, together, shares: dict[int, float] | None = None) -> None:
    """Two rounds of 3 sampled clients out of 4 through the builtin engine's clients of the sessions `alone` (one
    after another) and `together` (2 at once: a group of 2, then one of 1), compared as
    `test_every_local_sgd_method_gives_the_same_rounds_concurrently` says; each client doing its share of its work
    (`shares`; all of it where not there): the same samples either way, fewer than all for a client with a share."""
    assert_states_close(together.initial, alone.initial)
    sessions = {"alone": alone, "together": together}
    clients = {way: LocalClients(session, Console(quiet=True)) for way, session in sessions.items()}
    assert clients["alone"].concurrent is None and clients["together"].concurrent is not None
    global_state = alone.initial
    for round_index, sampled in enumerate(([0, 1, 3], [0, 2, 3])):
        updates = {}
        for way, session in sessions.items():
            payloads = {c: session.method.payload(c, global_state) for c in sampled}
            finished: list[int] = []
            task = RoundTask(round_index, sampled, payloads, shares or {})
            updates[way] = clients[way].train(task, finished.append)
            assert sorted(finished) == sampled  # the progress bar advances once per client, told which
        for update, expected in zip(updates["together"], updates["alone"], strict=True):
            assert update.client_id == expected.client_id
            assert update.work.samples == expected.work.samples
            if update.client_id in (shares or {}):  # at most what the method's client update can process
                assert update.work.samples < alone.method.client_samples_bound(alone.data.clients[update.client_id])
            assert_states_close(update.upload, expected.upload)
            assert update.metrics == pytest.approx(expected.metrics, rel=1e-4)
        seed = derive_seed(0, round_index, SERVER)
        next_state, _ = alone.method.server_update(global_state, updates["alone"], seed, round_index)
        together.method.server_update(global_state, updates["alone"], seed, round_index)  # its server state too
        global_state = next_state
    if method not in ("fedavg-ft", "fedbabu"):  # personalized by fine-tuning at evaluation time, one by one
        for client_id in range(4):
            expected = alone.method.personalized(client_id, global_state)
            assert_states_close(together.method.personalized(client_id, global_state), expected)


# ---------------------------------------------------------------- the command line


def run_dir_adapters(run: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {str(p.relative_to(run)): load_file(p) for p in sorted(run.glob("clients/*/*.safetensors"))}


def test_train_with_concurrent_clients_end_to_end(fmnist_dir, home, tmp_path, capsys, monkeypatch):
    """`--concurrent-clients 2` on PerAda: the exported adapters and the report agree with a run one client after
    another; a crashed concurrent run resumes to identical files; it may change on --resume, and is recorded in
    config.json."""
    alone, together = tmp_path / "alone", tmp_path / "together"
    assert run_cli(tiny_args(fmnist_dir, alone), capsys, monkeypatch)[0] == 0
    code, _, err = run_cli(tiny_args(fmnist_dir, together, "--concurrent-clients", "2"), capsys, monkeypatch)
    assert code == 0, err
    assert "one after another" not in err
    adapters, expected = run_dir_adapters(together), run_dir_adapters(alone)
    assert adapters.keys() == expected.keys() and len(expected) == 4
    for path, tensors in expected.items():
        for name, tensor in tensors.items():
            assert_close(adapters[path][name], tensor, atol=1e-4, rtol=1e-4, msg=f"{path} {name}")
    report, expected_report = (json.loads((run / "report.json").read_text()) for run in (together, alone))
    for key, value in expected_report["summary"].items():
        assert report["summary"][key] == pytest.approx(value, abs=0.02), key
    assert json.loads((together / "config.json").read_text())["config"]["federation"]["concurrent_clients"] == 2

    crashed = tmp_path / "crashed"
    crash_after_round(2, tiny_args(fmnist_dir, crashed, "--concurrent-clients", "2"), capsys, monkeypatch)
    code, _, err = run_cli(tiny_args(fmnist_dir, crashed, "--resume"), capsys, monkeypatch)
    assert code == 0, err
    assert results(crashed) == results(together)  # a crashed concurrent run resumes to the very same files

    resumed = tiny_args(fmnist_dir, alone, "--rounds", "4", "--concurrent-clients", "3", "--resume")
    code, _, err = run_cli(resumed, capsys, monkeypatch)
    assert code == 0, err
    assert json.loads((alone / "config.json").read_text())["config"]["federation"]["concurrent_clients"] == 3
    assert len((alone / "metrics.jsonl").read_text().splitlines()) == 4


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        (["--method", "apfl"], "--method apfl trains clients with update rules of its own"),
        (["--adapter", "lora", "--dp-noise", "1", "--dp-clip", "1"], "--dp-noise clips and accounts"),
    ],
)
def test_runs_it_cannot_serve_say_so_and_train_one_after_another(
    extra, reason, fmnist_dir, home, tmp_path, capsys, monkeypatch
):
    alone, together = tmp_path / "alone", tmp_path / "together"
    assert run_cli(tiny_args(fmnist_dir, alone, "--rounds", "1", *extra), capsys, monkeypatch)[0] == 0
    args = tiny_args(fmnist_dir, together, "--rounds", "1", "--concurrent-clients", "4", *extra)
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    assert f"--concurrent-clients 4: {reason}" in err and "clients train one after another" in err
    assert run_dir_adapters(together).keys() == run_dir_adapters(alone).keys()
    for path, tensors in run_dir_adapters(alone).items():
        for name, tensor in tensors.items():
            assert torch.equal(run_dir_adapters(together)[path][name], tensor)  # the sequential code path itself
