"""FedALA (Zhang et al. 2023, Algorithm 1) and federated MTL (Smith et al. 2017, problem (1) with tr(WΩWᵀ)) against
hand computations.

Every expected value is recomputed here with plain torch autograd (and numpy/scipy for Ω) on a copy of the tiny
model, following the papers' rules, never by calling the methods' code.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import scipy.linalg
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from peradapt.errors import TrainingDiverged
from peradapt.methods import ClientUpdate, MethodContext
from peradapt.methods.base import PERSONAL_KEY
from peradapt.methods.fedala import LOCAL_KEY, MAX_START_EPOCHS, WEIGHTS_KEY, FedALA
from peradapt.methods.mtl import MTL
from peradapt.rundir.store import ClientStore
from peradapt.seeds import ALA, derive_seed

from .conftest import method_config
from .test_cli import crash_after_round, expect_user_error, results, run_cli, tiny_args
from .test_perada import BATCH, TOL, assign, client, hand_sgd_step, image_set, normalized, perturbed, tiny_trainer
from .test_perada import train_mode as train_mode_of

pytestmark = pytest.mark.usefixtures("one_thread")

LR, LAM, ETA = 0.1, 0.5, 1.0  # η: the paper's; much larger ones make W_i oscillate between its bounds
HEAD = ["base_model.model.fc.modules_to_save.default.weight", "base_model.model.fc.modules_to_save.default.bias"]
BN2 = [f"base_model.model.layer4.0.bn2.modules_to_save.default.{suffix}" for suffix in ("weight", "bias")]


def make(cls, trainer, federated=None, **overrides):
    settings = {"local_epochs": 1, "lr": LR, "lam": LAM, "batch_size": BATCH, "ala_lr": ETA, **overrides}
    shared, own = method_config(cls, **settings)
    context = MethodContext(
        shared, trainer, ClientStore(), trainer.model.state(), None, federated=federated, settings=own
    )
    return cls(context)


def trainable(trainer):
    return list(trainer.model.trainable_parameters())


def module_at(trainer, state):
    module = copy.deepcopy(trainer.model.module)
    assign(module, state)
    train_mode_of(module)
    return module


# ---------------------------------------------------------------- FedALA: the ALA module (lines 6-16)


def hand_ala(trainer, local, global_, weights, higher, batches, start_phase):
    """Θ̂ = Θ with Θ_i + (Θ - Θ_i) ⊙ W on `higher`; W <- clip(W - η ∇_Θ̂ L ⊙ (Θ - Θ_i), 0, 1) per batch, until the
    std of the last 10 epoch losses (last batch of each) is below 0.1 (first phase) or for one epoch."""
    difference = {n: global_[n] - local[n] for n in higher}
    weights = {n: w.clone() for n, w in weights.items()}
    module = module_at(trainer, {**global_, **{n: local[n] + difference[n] * weights[n] for n in higher}})
    named = dict(module.named_parameters())
    losses = []
    while True:
        for images, labels in batches:
            loss = F.cross_entropy(module(images), labels)
            grads = torch.autograd.grad(loss, [named[n] for n in higher])
            with torch.no_grad():
                for name, grad in zip(higher, grads, strict=True):
                    weights[name] = torch.clamp(weights[name] - ETA * grad * difference[name], 0, 1)
                    named[name].copy_(local[name] + difference[name] * weights[name])
        losses.append(loss.item())
        if not start_phase or (len(losses) > 10 and np.std(losses[-10:]) < 0.1) or len(losses) == MAX_START_EPOCHS:
            break
    start = {**global_, **{n: named[n].detach().clone() for n in higher}}
    return start, weights, len(losses)


def test_higher_layers_are_counted_in_modules_from_the_output():
    trainer = tiny_trainer()
    assert make(FedALA, trainer).higher == HEAD  # p = 1: the classifier, weight and bias
    assert make(FedALA, trainer, ala_layers=2).higher == BN2 + HEAD  # then the last block's trainable bn2
    assert make(FedALA, trainer, ala_layers=0).higher == trainable(trainer)


def test_first_round_with_ala_learns_the_weights_until_they_converge_then_trains_locally():
    trainer = tiny_trainer()
    data = image_set(BATCH, seed=3)  # one minibatch: its order inside cannot matter
    local, global_ = perturbed(trainer.model, seed=1), perturbed(trainer.model, seed=2)
    method = make(FedALA, trainer, ala_layers=2, ala_sample=100)
    method.store.put(4, LOCAL_KEY, local)
    higher = BN2 + HEAD

    update = method.client_update(client(4, data), global_, seed=0)

    ones = {n: torch.ones_like(local[n]) for n in higher}
    batch = [(normalized(data.images), data.labels)]
    start, weights, epochs = hand_ala(trainer, local, global_, ones, higher, batch, start_phase=True)
    assert 10 < epochs < MAX_START_EPOCHS and update.metrics["ala_epochs"] == epochs
    assert_close(method.store.get(4, WEIGHTS_KEY), weights, **TOL)
    moved = torch.cat([w.flatten() for w in weights.values()])
    assert ((moved > 0) & (moved < 1)).any() and (moved == 0).any()  # W left 1, some of it clipped at 0
    expected, loss = hand_sgd_step(trainer, start, data, lr=LR)  # E = 1 epoch of SGD from Θ̂
    assert_close(update.upload, expected, **TOL)
    assert_close(method.store.get(4, LOCAL_KEY), expected, **TOL)
    assert_close(method.personalized(4, global_), expected, **TOL)
    assert update.metrics["local_loss"] == pytest.approx(loss, abs=1e-5)
    assert (update.client_id, update.num_samples) == (4, BATCH)


def test_lower_layers_take_the_global_model_and_later_rounds_train_the_weights_one_epoch():
    trainer = tiny_trainer()
    data = image_set(4 * BATCH, seed=5)
    local, global_ = perturbed(trainer.model, seed=1), perturbed(trainer.model, seed=2)
    method = make(FedALA, trainer, ala_sample=50)
    generator = torch.Generator().manual_seed(9)
    stored = {n: torch.rand(local[n].shape, generator=generator) for n in HEAD}
    method.store.put(1, LOCAL_KEY, local)
    method.store.put(1, WEIGHTS_KEY, stored)

    start, weights, epochs = method.adaptive_local_aggregation(client(1, data), global_, seed=7)

    # the documented sample: s% of the client's data by a permutation seeded from (round seed, ALA), in minibatches
    ala_seed = derive_seed(7, ALA)
    order = torch.randperm(4 * BATCH, generator=torch.Generator().manual_seed(ala_seed))[: 2 * BATCH]
    batches = list(trainer.minibatches(data.subset(order), epochs=1, seed=ala_seed))
    assert len(batches) == 2
    expected_start, expected_weights, expected_epochs = hand_ala(
        trainer, local, global_, stored, HEAD, batches, start_phase=False
    )
    assert epochs == expected_epochs == 1
    assert_close(weights, expected_weights, **TOL)
    assert_close(start, expected_start, **TOL)
    for name in trainable(trainer):  # everything below the head is Θ as it is, running statistics included
        if name not in HEAD:
            assert torch.equal(start[name], global_[name])
    assert all(torch.equal(start[k], global_[k]) for k in start if k not in trainable(trainer))


def test_ala_is_skipped_while_the_local_model_is_the_global_one():
    trainer = tiny_trainer()
    data = image_set(BATCH, seed=3)
    method = make(FedALA, trainer)
    initial = trainer.model.state()

    update = method.client_update(client(0, data), initial, seed=0)  # round 1: Θ_i = Θ = Θ^0

    expected, _ = hand_sgd_step(trainer, initial, data, lr=LR)
    assert_close(update.upload, expected, **TOL)
    assert update.metrics["ala_epochs"] == 0 and method.store.get(0, WEIGHTS_KEY) is None
    # a client first sampled after round 1 blends the global model into Θ^0 from W = 1, until convergence
    later = method.client_update(client(2, data), perturbed(trainer.model, seed=2), seed=0)
    assert later.metrics["ala_epochs"] > 10 and method.store.get(2, WEIGHTS_KEY) is not None


def test_fedala_server_takes_the_sample_weighted_mean():
    trainer = tiny_trainer()
    method = make(FedALA, trainer)
    states = [perturbed(trainer.model, seed=s) for s in (1, 2)]
    updates = [ClientUpdate(0, states[0], 10), ClientUpdate(3, states[1], 30)]
    new_state, _ = method.server_update(states[0], updates, seed=0, round_index=0)
    for name in trainable(trainer):
        assert_close(new_state[name], 0.25 * states[0][name] + 0.75 * states[1][name], **TOL)


# ---------------------------------------------------------------- MTL: payloads, client step, Ω


M = 3


def uploads(trainer):
    """Client k's model w_k, distinct for the three clients."""
    return [ClientUpdate(k, perturbed(trainer.model, seed=10 + k), 5 + k) for k in range(M)]


def hand_omega_mean(m):
    centering = np.eye(m) - np.ones((m, m)) / m
    return centering @ centering


def hand_omega_learned(models, names):
    """Σ = (WᵀW)^{1/2} / tr(WᵀW)^{1/2}, Ω = Σ⁻¹ (MOCHA's Ω-step) with scipy's matrix square root."""
    columns = np.stack([np.concatenate([w[n].double().flatten().numpy() for n in names]) for w in models], axis=1)
    root = np.real(scipy.linalg.sqrtm(columns.T @ columns))
    return np.linalg.inv(root / np.trace(root))


def hand_anchor(omega, models, k, names):
    """a_k = -(1/Ω_kk) Σ_{j≠k} Ω_kj w_j."""
    return {n: -sum(omega[k, j] * models[j][n] for j in range(M) if j != k) / omega[k, k] for n in names}


@pytest.mark.parametrize("omega", ["mean", "learned"])
def test_mtl_server_keeps_every_model_and_sends_each_client_its_own_anchor(omega):
    trainer = tiny_trainer()
    method = make(MTL, trainer, federated=M, mtl_omega=omega)
    names = trainable(trainer)
    initial = trainer.model.state()
    if omega == "learned":  # before any Ω-step: Σ = I/M, Ω = M I, a pure ridge term: anchor 0, Ω_kk = M
        first = method.payload(0, initial)
        assert float(first["mtl.omega_kk"]) == pytest.approx(M)
        assert all(torch.count_nonzero(first[n]) == 0 for n in names)
    updates = uploads(trainer)
    models = [u.upload for u in updates]

    mean, _ = method.server_update(initial, updates, seed=0, round_index=0)

    for name, value in mean.items():  # w̄ over all M clients, only for bookkeeping and export
        if value.is_floating_point():
            assert_close(value, sum(w[name] for w in models) / M, **TOL)
    expected_omega = hand_omega_mean(M) if omega == "mean" else hand_omega_learned(models, names)
    payloads = [method.payload(k, mean) for k in range(M)]
    for k, payload in enumerate(payloads):
        assert float(payload["mtl.omega_kk"]) == pytest.approx(expected_omega[k, k], rel=1e-6)
        assert_close(
            {n: payload[n] for n in names}, hand_anchor(expected_omega, models, k, names), atol=1e-4, rtol=1e-4
        )
    if omega == "mean":  # the mean of the other clients' models, Ω_kk = (M - 1)/M
        others = {n: (models[1][n] + models[2][n]) / 2 for n in names}
        assert_close({n: payloads[0][n] for n in names}, others, **TOL)
    assert any(not torch.allclose(payloads[0][n], payloads[1][n]) for n in names)  # each its own payload


def test_mtl_client_step_is_sgd_on_the_loss_plus_the_trace_regularizer():
    trainer = tiny_trainer()
    data = image_set(BATCH, seed=3)
    method = make(MTL, trainer, federated=M)
    updates = uploads(trainer)
    models = [u.upload for u in updates]
    method.server_update(trainer.model.state(), updates, seed=0, round_index=0)
    method.store.put(1, PERSONAL_KEY, models[1])  # the client keeps the w_1 the server holds

    update = method.client_update(client(1, data), method.payload(1, models[0]), seed=0)

    # w_1 - lr (grad L_1(w_1) + lam (W Ω)_1), the gradient of lam/2 tr(W Ω Wᵀ) in w_1
    omega = hand_omega_mean(M)
    module = module_at(trainer, models[1])
    named = {n: p for n, p in module.named_parameters() if p.requires_grad}
    loss = F.cross_entropy(module(normalized(data.images)), data.labels)
    grads = dict(zip(named, torch.autograd.grad(loss, list(named.values())), strict=True))
    expected = {k: v.detach().clone() for k, v in module.state_dict().items() if k in models[1]}
    for name in named:
        coupling = sum(omega[1, j] * models[j][name] for j in range(M))
        expected[name] = models[1][name] - LR * (grads[name] + LAM * coupling)
    assert_close(update.upload, expected, **TOL)
    assert_close(method.personalized(1, models[0]), expected, **TOL)
    assert method.personalized(2, models[0]) is method.context.initial  # never trained: w^0


def test_mtl_without_lam_trains_each_client_alone():
    """--lam 0 leaves only each client's own loss (what PFLlib's FedMTL computes: its regularizer has no gradient)."""
    trainer = tiny_trainer()
    data = image_set(BATCH, seed=3)
    initial = trainer.model.state()
    method = make(MTL, trainer, federated=M, lam=0.0)
    method.server_update(initial, uploads(trainer), seed=0, round_index=0)
    update = method.client_update(client(0, data), method.payload(0, initial), seed=0)  # from its w^0
    expected, _ = hand_sgd_step(trainer, initial, data, lr=LR)
    assert_close(update.upload, expected, **TOL)


def test_mtl_refuses_a_pull_whose_steps_diverge():
    trainer = tiny_trainer()
    method = make(MTL, trainer, federated=M, lam=40.0)  # lr lam Ω_kk = 0.1 * 40 * 2/3 > 2
    with pytest.raises(TrainingDiverged, match="--lam"):
        method.client_update(client(0, image_set(BATCH, seed=3)), method.payload(0, trainer.model.state()), seed=0)


# ---------------------------------------------------------------- the command line


def records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_fedala_runs_and_exports_every_clients_local_model(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    run = tmp_path / "fedala"
    args = tiny_args(fmnist_dir, run, "--method", "fedala", "--rounds", "2", "--eval-every", "2")
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    first, second = records(run)
    assert first["ala_epochs"] == 0 and second["ala_epochs"] > 10  # round 1: Θ_i = Θ; round 2: the first ALA
    assert sorted(p.name for p in (run / "clients").iterdir()) == ["0", "1", "2", "3"]
    assert json.loads((run / "report.json").read_text())["method"] == "fedala"


def test_mtl_resumed_run_equals_an_uninterrupted_one(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    full, crashed = tmp_path / "full", tmp_path / "crashed"
    extra = ("--method", "mtl", "--rounds", "2", "--eval-every", "2")
    code, _, err = run_cli(tiny_args(fmnist_dir, full, *extra), capsys, monkeypatch)
    assert code == 0, err
    assert sorted(p.name for p in (full / "clients").iterdir()) == ["0", "1", "2", "3"]
    crash_after_round(1, tiny_args(fmnist_dir, crashed, *extra), capsys, monkeypatch)
    code, _, err = run_cli(tiny_args(fmnist_dir, crashed, *extra, "--resume"), capsys, monkeypatch)
    assert code == 0, err
    assert results(crashed) == results(full)  # the server's models and Ω came back from the checkpoint


@pytest.mark.parametrize(
    ("extra", "needle"),
    [(["--method", "fedala", "--ala-sample", "0"], "--ala-sample"), (["--method", "mtl", "--mtl-omega", "x"], "x")],
)
def test_bad_settings_are_one_error_line(extra, needle, tmp_path, fmnist_dir, capsys, monkeypatch, home):
    expect_user_error(tiny_args(fmnist_dir, tmp_path / "bad", *extra), capsys, monkeypatch, needle)
    assert not (tmp_path / "bad").exists()
