"""SCAFFOLD (Karimireddy et al. 2020, Algorithm 1, option II) against a hand computation of its rules.

Every expected value is recomputed here with plain torch autograd on a copy of the tiny model, from the paper's
update rules (lines 10, 12, 13, 16, 17), never by calling the method's code; a run end to end trains it concurrently
and resumes to identical files.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from peradapt.methods.base import ClientUpdate
from peradapt.methods.scaffold import CONTROL, CONTROL_DELTA, CONTROL_KEY, Scaffold

from .test_cli import crash_after_round, expect_user_error, results, run_cli, tiny_args
from .test_feddyn_perfedavg import batches_of, client_of, differs, make
from .test_perada import BATCH, TOL, image_set, perturbed, tiny_trainer
from .test_pfedme_pfedbred import grad_f, module_at, names_of, params, server_problem, values

pytestmark = pytest.mark.usefixtures("one_thread")

LR, ETA_G = 0.1, 0.7


def noise(state, names, seed, scale=0.3):
    generator = torch.Generator().manual_seed(seed)
    return {n: scale * torch.randn(state[n].shape, generator=generator) for n in names}


def hand_client(trainer, x, c, c_i, batches):
    """Lines 5-13: y <- x; K times y <- y - eta_l (g(y) - c_i + c); option II c_i+ = c_i - c + (x - y) / (K eta_l);
    returns y, c_i+ and Δc = c_i+ - c_i."""
    module = module_at(trainer, x)
    for images, labels in batches:
        grads = grad_f(module, images, labels)
        with torch.no_grad():
            for name, parameter in params(module).items():
                parameter.sub_(LR * (grads[name] - c_i[name] + c[name]))
    y = values(module, x)
    steps = len(batches)
    updated = {n: c_i[n] - c[n] + (x[n] - y[n]) / (steps * LR) for n in c}
    return y, updated, {n: updated[n] - c_i[n] for n in c}


def test_a_client_takes_corrected_steps_and_updates_its_control_variate_by_option_ii():
    trainer = tiny_trainer()
    data = image_set(2 * BATCH + 3, seed=3)  # batches of 8, 8 and 3: K = 3
    names = names_of(trainer)
    x = perturbed(trainer.model, seed=2)
    c, c_i = noise(x, names, 5), noise(x, names, 6)
    method = make(Scaffold, trainer, federated=4, lr=LR)
    method.store.put(1, CONTROL_KEY, c_i)
    payload = method.payload(1, x)
    assert all(torch.equal(payload[CONTROL + n], torch.zeros_like(x[n])) for n in names)  # c^0 = 0 before round 1
    method.load_server_state(c)
    payload = method.payload(1, x)
    assert all(torch.equal(payload[CONTROL + n], c[n]) for n in names) and all(payload[k] is x[k] for k in x)

    update = method.client_update(client_of(1, data), payload, seed=4)

    batches = batches_of(trainer, data, seed=4)
    assert len(batches) == 3
    y, updated, delta = hand_client(trainer, x, c, c_i, batches)
    assert_close({k: v for k, v in update.upload.items() if not k.startswith(CONTROL_DELTA)}, y, **TOL)
    assert_close({n: update.upload[CONTROL_DELTA + n] for n in names}, delta, **TOL)
    assert_close(method.store.get(1, CONTROL_KEY), updated, **TOL)
    assert method.personalized(1, x) is x  # a global-model method

    # without the correction (c = c_i) the step is plain SGD: the correction is what moves it
    plain, _, _ = hand_client(trainer, x, c, c, batches)
    assert differs(plain, y, names)


def test_a_client_that_takes_no_step_keeps_its_control_variate():
    trainer = tiny_trainer()
    names = names_of(trainer)
    x = perturbed(trainer.model, seed=2)
    method = make(Scaffold, trainer, federated=4, lr=LR)
    c_i = noise(x, names, 6)
    method.store.put(0, CONTROL_KEY, c_i)
    with trainer.sharing(0.0):  # a straggler that did none of its work
        update = method.client_update(client_of(0, image_set(BATCH, seed=1)), method.payload(0, x), seed=1)
    assert all(torch.equal(update.upload[n], x[n]) for n in x)
    assert all(torch.equal(update.upload[CONTROL_DELTA + n], torch.zeros_like(x[n])) for n in names)
    assert all(torch.equal(method.store.get(0, CONTROL_KEY)[n], c_i[n]) for n in names)


def test_the_server_steps_x_by_eta_g_and_c_by_the_sampled_share_of_all_clients():
    trainer = tiny_trainer()
    names = names_of(trainer)
    n_clients = 5  # N; 2 sampled
    x, uploads, plain_updates, floats, _ = server_problem(trainer, seeds=(1, 2, 3), sizes=(1, 50))
    deltas = [noise(x, names, 10 + i) for i in range(2)]
    updates = [
        ClientUpdate(u.client_id, {**u.upload, **{CONTROL_DELTA + n: d[n] for n in names}}, u.num_samples)
        for u, d in zip(plain_updates, deltas, strict=True)
    ]
    method = make(Scaffold, trainer, federated=n_clients, scaffold_server_lr=ETA_G)
    c_0 = noise(x, names, 20)
    method.load_server_state(c_0)

    x_1, info = method.server_update(x, updates, seed=0, round_index=0)

    assert info == {} and x_1.keys() == x.keys()  # no control entries in the global model
    for n in names:  # line 17: x + eta_g (1/|S|) sum (y_i - x), uniform whatever the sample counts
        assert_close(x_1[n], x[n] + ETA_G * ((uploads[0][n] + uploads[1][n]) / 2 - x[n]), **TOL)
    for key in floats:  # running statistics: the plain mean
        assert_close(x_1[key], (uploads[0][key] + uploads[1][key]) / 2, **TOL)
    c_1 = {n: c_0[n] + 2 / n_clients * (deltas[0][n] + deltas[1][n]) / 2 for n in names}  # c + |S|/N mean Δc
    assert_close(method.server_state(), c_1, **TOL)
    assert all(torch.equal(method.payload(0, x_1)[CONTROL + n], method.server_state()[n]) for n in names)

    # Round 2 from the saved state: a restored server continues exactly, a fresh one (c = 0) does not.
    restored = make(Scaffold, trainer, federated=n_clients, scaffold_server_lr=ETA_G)
    restored.load_server_state(method.server_state())
    method.server_update(x_1, updates, seed=0, round_index=1)
    restored.server_update(x_1, updates, seed=0, round_index=1)
    assert_close(restored.server_state(), method.server_state(), **TOL)
    fresh = make(Scaffold, trainer, federated=n_clients, scaffold_server_lr=ETA_G)
    fresh.server_update(x_1, updates, seed=0, round_index=1)
    assert differs(fresh.server_state(), method.server_state(), names)


def test_scaffold_trains_concurrently_and_resumes_to_identical_files(fmnist_dir, tmp_path, capsys, monkeypatch, home):
    base = ("--method", "scaffold", "--scaffold-server-lr", "0.9")
    alone, together = tmp_path / "alone", tmp_path / "together"
    for out, extra in ((alone, ()), (together, ("--concurrent-clients", "2"))):
        code, _, err = run_cli(tiny_args(fmnist_dir, out, *base, *extra), capsys, monkeypatch)
        assert code == 0, err
        assert "one after another" not in err  # its corrected steps keep concurrent clients (test_concurrent.py)
    assert results(together).keys() == results(alone).keys()
    crashed = tmp_path / "crashed"
    crash_after_round(1, tiny_args(fmnist_dir, crashed, *base), capsys, monkeypatch)
    code, _, err = run_cli(tiny_args(fmnist_dir, crashed, "--resume"), capsys, monkeypatch)
    assert code == 0, err
    assert results(crashed) == results(alone)  # the server's c and every c_i restored from the checkpoint


def test_scaffold_refuses_a_bad_server_rate(fmnist_dir, tmp_path, capsys, monkeypatch, home):
    args = tiny_args(fmnist_dir, tmp_path / "bad", "--method", "scaffold", "--scaffold-server-lr", "0")
    expect_user_error(args, capsys, monkeypatch, "--scaffold-server-lr")
