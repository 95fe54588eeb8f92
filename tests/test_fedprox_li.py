"""FedProx (Li et al., Algorithm 2) against a hand computation of its proximal local problem and weighted mean, and
personalized FedProx's (Yu et al.) server step on a model with BatchNorm, where beta > 1 must not extrapolate running
variances below zero."""

from __future__ import annotations

import json

import pytest
import torch
from torch.testing import assert_close

from peradapt.methods import METHODS, ClientUpdate, MethodContext
from peradapt.methods.fedprox_li import FedProxLi
from peradapt.rundir.store import ClientStore

from .conftest import measured_counts, method_config
from .test_cli import expect_user_error, run_cli, tiny_args
from .test_partial import export_loads_in_plain_timm, full_trainer
from .test_perada import BATCH, TOL, client, hand_sgd_step, image_set, perturbed

pytestmark = pytest.mark.usefixtures("one_thread")

LR, MU = 0.1, 0.5


def build(name, trainer, initial, **settings):
    values = {"local_epochs": 1, "personal_epochs": 1, "lr": LR, "mu": MU, **settings}
    config, own = method_config(name, method=name, **values)
    return METHODS[name](MethodContext(config, trainer, ClientStore(), initial, None, settings=own))


# ---------------------------------------------------------------- FedProx (Li et al.)


def test_client_solves_the_proximal_problem_by_sgd_from_the_global_model():
    trainer = full_trainer()
    data = image_set(BATCH, seed=3)
    global_state = perturbed(trainer.model, seed=2)
    method = build("fedprox-li", trainer, trainer.model.state(), local_epochs=2)

    update = method.client_update(client(4, data), global_state, seed=0)

    # w <- w - eta (grad F_k(w) + mu (w - w^t)) from w = w^t, one full-batch step per epoch; the pull is 0 at first.
    first, _ = hand_sgd_step(trainer, global_state, data, lr=LR, anchor=global_state, lam=MU)
    expected, _ = hand_sgd_step(trainer, first, data, lr=LR, anchor=global_state, lam=MU)
    assert (update.client_id, update.num_samples, set(update.metrics)) == (4, BATCH, {"local_loss"})
    assert_close(update.upload, expected, **TOL)
    without_pull, _ = hand_sgd_step(trainer, first, data, lr=LR)  # mu = 0: FedAvg's step
    name = "layer1.0.conv1.weight"
    assert not torch.allclose(update.upload[name], without_pull[name], atol=1e-6)
    assert method.store.get(4, "personal") is None  # no client state: a generic FL method


def test_server_takes_the_sample_weighted_mean_and_every_client_uses_the_global_model():
    trainer = full_trainer()
    method = build("fedprox-li", trainer, trainer.model.state())
    global_state = perturbed(trainer.model, seed=2)
    uploads = [perturbed(trainer.model, seed=s) for s in (3, 4, 5)]
    sizes = [1, 3, 6]
    updates = [ClientUpdate(i, u, n) for i, (u, n) in enumerate(zip(uploads, sizes, strict=True))]

    new_global, info = method.server_update(global_state, updates, seed=0, round_index=0)

    for key in ("fc.weight", "layer2.0.bn1.running_var"):  # w^{t+1} = sum_k n_k w_k / sum_k n_k
        assert_close(new_global[key], sum(n * u[key] for n, u in zip(sizes, uploads, strict=True)) / 10, **TOL)
    assert info == {}
    assert method.personalized(2, new_global) is new_global
    assert measured_counts(method, client(0, image_set(BATCH, seed=3)), new_global)["personalized"] == 0  # w alone
    assert FedProxLi.default_scope == "full" and not FedProxLi.uses_proximal  # --lam auto is Yu et al.'s


def test_one_round_on_the_command_line(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    run = tmp_path / "run"
    args = tiny_args(fmnist_dir, run, "--method", "fedprox-li", "--rounds", "1", "--limit-samples", "400")
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    saved = json.loads((run / "config.json").read_text())
    assert saved["config"]["method"]["mu"] == 1.0  # Li et al.'s value for MNIST and FEMNIST
    assert (saved["resolved"]["scope"], saved["resolved"]["adapter"]) == ("full", "none")
    for client_id in range(4):
        assert (run / "clients" / str(client_id) / "model.safetensors").read_bytes() == (
            run / "global" / "model.safetensors"
        ).read_bytes()
    export_loads_in_plain_timm(run, tmp_path / "exported", capsys, monkeypatch)


def test_a_negative_mu_exits_2_and_writes_nothing(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    run = tmp_path / "run"
    expect_user_error(tiny_args(fmnist_dir, run, "--method", "fedprox-li", "--mu", "-1"), capsys, monkeypatch, "--mu")
    assert not run.exists()


# ---------------------------------------------------------------- personalized FedProx (Yu et al.) with BatchNorm


def test_yu_server_step_moves_parameters_by_gamma_lam_and_takes_the_plain_mean_of_running_statistics():
    trainer = full_trainer()
    method = build("fedprox", trainer, trainer.model.state(), lam=1.0, fedprox_server_step=2.0)
    global_state = perturbed(trainer.model, seed=2)
    uploads = [perturbed(trainer.model, seed=s) for s in (3, 4)]
    variance = "layer1.0.bn1.running_var"
    global_state[variance] = torch.ones_like(global_state[variance])
    uploads[0][variance], uploads[1][variance] = (torch.full_like(global_state[variance], v) for v in (0.2, 0.4))
    updates = [ClientUpdate(i, u, n) for i, (u, n) in enumerate(zip(uploads, [1, 5], strict=True))]

    stepped, _ = method.server_update(global_state, updates, seed=0, round_index=0)

    # a step γλ = 2 would take 1 + 2 * (0.3 - 1) = -0.4: running statistics take the plain mean 0.3 instead
    assert_close(stepped[variance], torch.full_like(global_state[variance], 0.3), **TOL)
    running = [k for k in stepped if k.endswith(("running_mean", "running_var"))]
    assert running
    for key in running:
        assert_close(stepped[key], (uploads[0][key] + uploads[1][key]) / 2, **TOL)
    assert all((stepped[k] >= 0).all() for k in running if k.endswith("running_var"))
    for key in trainer.model.trainable_parameters():  # w <- w + γλ (mean_i w_i - w), uniform over clients
        mean = (uploads[0][key] + uploads[1][key]) / 2
        assert_close(stepped[key], global_state[key] + 2.0 * (mean - global_state[key]), **TOL)
    assert stepped["layer1.0.bn1.num_batches_tracked"].item() == uploads[0]["layer1.0.bn1.num_batches_tracked"].item()
