"""Tests for Ditto (Li et al. 2021, Algorithm 1) and APFL (Deng et al. 2020, Algorithm 1 and eq. 10).

Expected values come from the papers' equations in plain torch autograd, never from the methods' own code.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call
from torch.testing import assert_close

from peradapt.compute.costs import elements
from peradapt.methods import ClientUpdate, MethodContext
from peradapt.methods.apfl import ALPHA_KEY, APFL, LOCAL_KEY
from peradapt.methods.base import PERSONAL_KEY, Method
from peradapt.methods.ditto import Ditto
from peradapt.rundir.store import ClientStore

from .conftest import measured_counts, method_config
from .test_cli import run_cli, tiny_args
from .test_perada import BATCH, TOL, client, hand_sgd_step, image_set, normalized, perturbed, tiny_trainer, train_mode


def context(trainer, initial, method=APFL, **config):
    defaults = {"local_epochs": 1, "personal_epochs": 1, "lam": 0.5, "lr": 0.1, "batch_size": BATCH}
    shared, own = method_config(method, **{**defaults, **config})
    return MethodContext(shared, trainer, ClientStore(), initial, distiller=None, settings=own)


def uploads_with_samples(samples):
    uploads = [
        {"w": torch.tensor([1.0, 2.0]), "steps": torch.tensor(4)},
        {"w": torch.tensor([2.0, 4.0]), "steps": torch.tensor(9)},
        {"w": torch.tensor([6.0, 0.0]), "steps": torch.tensor(1)},
    ]
    return [ClientUpdate(i, upload, n) for i, (upload, n) in enumerate(zip(uploads, samples, strict=True))]


def first_parameter(trainer):
    return next(iter(trainer.model.trainable_parameters()))


# ---------------------------------------------------------------- Ditto


def test_ditto_client_update_uploads_local_sgd_and_keeps_the_proximal_personal_model():
    trainer = tiny_trainer()
    data = image_set(BATCH, seed=3)
    initial, global_state = perturbed(trainer.model, seed=1), perturbed(trainer.model, seed=2)
    method = Ditto(context(trainer, initial, Ditto, personal_lr=0.05))

    update = method.client_update(client(4, data), global_state, seed=0)

    assert (update.client_id, update.num_samples) == (4, BATCH)
    expected_upload, expected_local_loss = hand_sgd_step(trainer, global_state, data, lr=0.1)
    assert_close(update.upload, expected_upload, **TOL)
    assert update.metrics["local_loss"] == pytest.approx(expected_local_loss, abs=1e-5)
    # v <- v - eta_p (grad F(v) + lam (v - w^t)) with eta_p = --personal-lr, anchored at the received w^t
    expected_personal, _ = hand_sgd_step(trainer, initial, data, lr=0.05, anchor=global_state, lam=0.5)
    assert_close(method.store.get(4, PERSONAL_KEY), expected_personal, **TOL)
    assert_close(method.personalized(4, global_state), expected_personal, **TOL)
    with_global_lr, _ = hand_sgd_step(trainer, initial, data, lr=0.1, anchor=global_state, lam=0.5)
    name = first_parameter(trainer)
    assert not torch.allclose(expected_personal[name], with_global_lr[name], atol=1e-4)
    assert method.personalized(5, global_state) is initial  # never sampled: the initial model


def test_ditto_personal_model_persists_across_rounds_and_lr_defaults_to_lr():
    trainer = tiny_trainer()
    data = image_set(BATCH, seed=3)
    initial = perturbed(trainer.model, seed=1)
    first_global, second_global = perturbed(trainer.model, seed=2), perturbed(trainer.model, seed=5)
    method = Ditto(context(trainer, initial, Ditto))
    method.client_update(client(4, data), first_global, seed=0)
    personal = method.store.get(4, PERSONAL_KEY)
    expected_first, _ = hand_sgd_step(trainer, initial, data, lr=0.1, anchor=first_global, lam=0.5)
    assert_close(personal, expected_first, **TOL)

    method.client_update(client(4, data), second_global, seed=1)

    expected, _ = hand_sgd_step(trainer, personal, data, lr=0.1, anchor=second_global, lam=0.5)
    assert_close(method.store.get(4, PERSONAL_KEY), expected, **TOL)


def test_ditto_server_update_is_the_sample_weighted_fedavg_mean():
    trainer = tiny_trainer()
    method = Ditto(context(trainer, trainer.model.state(), Ditto))
    global_state = {"w": torch.zeros(2), "steps": torch.tensor(0)}
    averaged, info = method.server_update(global_state, uploads_with_samples([1, 100, 10]), seed=0, round_index=0)
    # (1 * [1, 2] + 100 * [2, 4] + 10 * [6, 0]) / 111
    assert_close(averaged["w"], torch.tensor([261.0 / 111, 402.0 / 111]))
    assert averaged["steps"].item() == 4
    assert info == {}


def test_ditto_class_attributes_and_parameter_counts():
    trainer = tiny_trainer()
    method = Ditto(context(trainer, trainer.model.state(), Ditto))
    n, whole = trainer.model.num_trainable(), elements(trainer.model.state())
    assert (Ditto.default_scope, Ditto.uses_proximal, Method.uses_proximal) == ("full", True, False)
    # v_m and w_m trained; v_m the client's own, its statistics too; w_m sent with its statistics
    counts = measured_counts(method, client(0, image_set(BATCH, seed=3)), trainer.model.state())
    assert counts == {"personalized": whole, "trained": 2 * n, "communicated": whole}


# ---------------------------------------------------------------- APFL


def hand_apfl_step(trainer, v, w, alpha, data, lr, alpha_lr):
    """One full-batch APFL step (eqs. 6, 7, 10) by autograd through v_bar = alpha v + (1 - alpha) w.

    Returns w', v' (parameters; buffers as after the forward pass at v_bar), alpha' projected onto [0, 1].
    """
    module = trainer.model.module
    train_mode(module)
    expected_w, _ = hand_sgd_step(trainer, w, data, lr=lr)  # eq. 6: plain SGD on w
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    v_leaves = {n: v[n].clone().requires_grad_(True) for n in names}
    alpha_leaf = torch.tensor(alpha, requires_grad=True)
    buffers = {n: t.clone() for n, t in v.items() if n not in v_leaves}  # BatchNorm statistics: v's, updated in place
    mixed = {n: alpha_leaf * v_leaves[n] + (1 - alpha_leaf) * w[n] for n in names}
    logits = functional_call(module, {**mixed, **buffers}, (normalized(data.images),))
    loss = F.cross_entropy(logits, data.labels)
    grads = torch.autograd.grad(loss, [*v_leaves.values(), alpha_leaf])
    expected_v = {**buffers, **{n: v[n] - lr * g for n, g in zip(names, grads[:-1], strict=True)}}  # eq. 7
    expected_alpha = min(max(alpha - alpha_lr * grads[-1].item(), 0.0), 1.0)  # eq. 10
    return expected_w, expected_v, expected_alpha, grads[-1].item()


def test_apfl_one_local_step_matches_equations_6_7_and_10():
    trainer = tiny_trainer()
    data = image_set(BATCH, seed=3)
    v, w = perturbed(trainer.model, seed=1), perturbed(trainer.model, seed=2)
    method = APFL(context(trainer, v, apfl_alpha=0.3, alpha_lr=0.5))

    update = method.client_update(client(2, data), w, seed=0)

    expected_w, expected_v, expected_alpha, grad_alpha = hand_apfl_step(trainer, v, w, 0.3, data, 0.1, 0.5)
    assert_close(update.upload, expected_w, **TOL)
    assert_close(method.store.get(2, LOCAL_KEY), expected_v, **TOL)
    alpha = method.store.get(2, ALPHA_KEY)[ALPHA_KEY].item()
    assert 0.0 < expected_alpha < 1.0 and abs(0.5 * grad_alpha) > 1e-3  # a real, unclamped move
    assert alpha == pytest.approx(expected_alpha, abs=1e-6)
    assert update.metrics["alpha"] == pytest.approx(expected_alpha, abs=1e-6)
    # The personalized model mixes v with the (next) global model; buffers are v's.
    new_global = perturbed(trainer.model, seed=7)
    personal = method.personalized(2, new_global)
    stored_v = method.store.get(2, LOCAL_KEY)
    for name, tensor in personal.items():
        if name in trainer.model.trainable_parameters():
            assert_close(tensor, alpha * stored_v[name] + (1 - alpha) * new_global[name], **TOL)
        else:
            assert torch.equal(tensor, stored_v[name])


def test_apfl_alpha_learning_rate_defaults_to_lr():
    trainer = tiny_trainer()
    data = image_set(BATCH, seed=3)
    v, w = perturbed(trainer.model, seed=1), perturbed(trainer.model, seed=2)
    method = APFL(context(trainer, v, apfl_alpha=0.6))
    method.client_update(client(0, data), w, seed=0)
    _, _, expected_alpha, _ = hand_apfl_step(trainer, v, w, 0.6, data, 0.1, 0.1)
    assert method.alpha(0) == pytest.approx(expected_alpha, abs=1e-6)
    assert method.alpha(1) == 0.6  # never sampled: the initial alpha


def test_apfl_alpha_moves_from_v_equal_w_and_stays_in_unit_interval():
    trainer = tiny_trainer()
    data = image_set(BATCH, seed=3)
    start = perturbed(trainer.model, seed=1)
    # v = w: the first step of eq. 10 is exactly zero (v - w = 0) ...
    one_step = APFL(context(trainer, start, apfl_alpha=0.5, alpha_lr=0.05))
    one_step.client_update(client(0, data), start, seed=0)
    assert one_step.alpha(0) == 0.5
    name = first_parameter(trainer)
    assert not torch.allclose(one_step.store.get(0, LOCAL_KEY)[name], start[name])
    # ... but v and w separate, so alpha moves over the next steps.
    several = APFL(context(trainer, start, apfl_alpha=0.5, alpha_lr=0.05, local_epochs=3))
    several.client_update(client(0, data), start, seed=0)
    assert abs(several.alpha(0) - 0.5) > 1e-2
    assert 0.0 < several.alpha(0) < 1.0


def test_apfl_alpha_is_projected_onto_unit_interval():
    trainer = tiny_trainer()
    data = image_set(BATCH, seed=3)
    v, w = perturbed(trainer.model, seed=1), perturbed(trainer.model, seed=2)
    _, _, _, grad_alpha = hand_apfl_step(trainer, v, w, 0.3, data, 0.1, 1e6)
    method = APFL(context(trainer, v, apfl_alpha=0.3, alpha_lr=1e6))
    method.client_update(client(0, data), w, seed=0)
    assert method.alpha(0) == (0.0 if grad_alpha > 0 else 1.0)
    many = APFL(context(trainer, v, apfl_alpha=0.3, alpha_lr=1e6, local_epochs=3))
    many.client_update(client(0, data), w, seed=0)
    assert many.alpha(0) in (0.0, 1.0)  # every step overshoots and is projected back onto [0, 1]


def test_apfl_fixed_alpha_with_zero_alpha_lr():
    trainer = tiny_trainer()
    data = image_set(BATCH, seed=3)
    v, w = perturbed(trainer.model, seed=1), perturbed(trainer.model, seed=2)
    method = APFL(context(trainer, v, apfl_alpha=0.3, alpha_lr=0.0))
    method.client_update(client(0, data), w, seed=0)
    assert method.alpha(0) == 0.3


def test_apfl_server_update_is_the_uniform_mean_of_equation_8():
    trainer = tiny_trainer()
    method = APFL(context(trainer, trainer.model.state()))
    global_state = {"w": torch.zeros(2), "steps": torch.tensor(0)}
    averaged, info = method.server_update(global_state, uploads_with_samples([1, 100, 10]), seed=0, round_index=0)
    assert_close(averaged["w"], torch.tensor([3.0, 2.0]))
    assert averaged["steps"].item() == 4
    assert info == {}
    n, whole = trainer.model.num_trainable(), elements(trainer.model.state())
    assert APFL.default_scope == "full"
    # v_m and w trained (alpha_m, one scalar, is not counted: Table 1); the mixed model is the client's own
    counts = measured_counts(method, client(0, image_set(BATCH, seed=3)), trainer.model.state())
    assert counts == {"personalized": whole, "trained": 2 * n, "communicated": whole}


# ---------------------------------------------------------------- command line


@pytest.mark.parametrize("method", ["ditto", "apfl"])
def test_one_round_from_the_command_line(method, tmp_path, home, fmnist_dir, capsys, monkeypatch):
    run = tmp_path / "run"
    code, _, err = run_cli(tiny_args(fmnist_dir, run, "--method", method, "--rounds", "1"), capsys, monkeypatch)
    assert code == 0, err
    for client_id in range(4):
        assert (run / "clients" / str(client_id) / "model.safetensors").is_file()  # full model by default
    assert (run / "report.json").is_file()
