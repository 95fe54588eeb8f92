"""Personalized FedProx (Yu et al., Algorithm 1) and `--lam auto` (their Theorem 1 rule), checked by hand."""

from __future__ import annotations

import contextlib
import io
import json
import math
import sys

import pytest
import torch
from torch.testing import assert_close

import peradapt.federation.engine as engine
from peradapt.cli import main
from peradapt.config import MethodConfig
from peradapt.errors import RunError
from peradapt.federation.store import ClientStore
from peradapt.personalize import METHODS, ClientUpdate, Method, MethodContext
from peradapt.personalize.auto_lam import RHO, choose_lam, estimate_lam, heterogeneity
from peradapt.personalize.base import PERSONAL_KEY
from peradapt.personalize.fedprox import FedProx
from peradapt.personalize.perada import PerAda, PerAdaNoKD

from .test_cli import crash_after_round, results, run_cli, tiny_args
from .test_perada import BATCH, TOL, client, hand_sgd_step, image_set, perturbed, tiny_trainer

# ---------------------------------------------------------------- FedProx client step (eq. 11) and server step (eq. 10)


def fedprox(trainer, initial, lam=0.5, lr=0.3, personal_lr=0.1, beta=1.0):
    config = MethodConfig("fedprox", local_epochs=1, personal_epochs=1, lam=lam, lr=lr, personal_lr=personal_lr)
    config.beta, config.batch_size = beta, BATCH
    return FedProx(MethodContext(config, trainer, ClientStore(), initial, distiller=None))


def test_client_step_is_proximal_sgd_from_the_stored_personal_model():
    trainer = tiny_trainer()
    data = image_set(BATCH, seed=3)
    initial, first_global, second_global = (perturbed(trainer.model, seed=s) for s in (1, 2, 5))
    method = fedprox(trainer, initial)

    first = method.client_update(client(4, data), first_global, seed=0)
    # w_{1,1} = w_{0,K} - eta_p (grad L(w_{0,K}) + lam (w_{0,K} - w_g)), w_{0,K} the initial adapter, eta_p = 0.1
    expected, _ = hand_sgd_step(trainer, initial, data, lr=0.1, anchor=first_global, lam=0.5)
    assert (first.client_id, first.num_samples) == (4, BATCH)
    assert_close(first.upload, expected, **TOL)
    assert_close(method.store.get(4, PERSONAL_KEY), expected, **TOL)
    assert_close(method.personalized(4, first_global), expected, **TOL)
    assert method.personalized(7, first_global) is initial  # never sampled: still the initial local model

    method.client_update(client(4, data), second_global, seed=1)
    # Warm start w_{t,0} = w_{t-1,K} (Algorithm 1, line 3), anchored at the new global model.
    warm, _ = hand_sgd_step(trainer, expected, data, lr=0.1, anchor=second_global, lam=0.5)
    cold, _ = hand_sgd_step(trainer, initial, data, lr=0.1, anchor=second_global, lam=0.5)
    actual = method.store.get(4, PERSONAL_KEY)
    assert_close(actual, warm, **TOL)
    name = next(iter(trainer.model.trainable_parameters()))
    assert not torch.allclose(actual[name], cold[name], atol=1e-4)


def test_client_step_pulls_harder_towards_the_global_model_with_larger_lam():
    trainer = tiny_trainer()
    data = image_set(BATCH, seed=3)
    initial, global_state = perturbed(trainer.model, seed=1), perturbed(trainer.model, seed=2)
    names = list(trainer.model.trainable_parameters())

    def distance(lam):
        state = fedprox(trainer, initial, lam=lam).client_update(client(0, data), global_state, seed=0).upload
        return sum(float(((state[n] - global_state[n]) ** 2).sum()) for n in names)

    assert distance(5.0) < distance(0.5) < distance(0.0)


def test_server_step_is_the_gradient_step_on_the_moreau_envelope():
    lam, beta = 2.0, 0.5
    gamma = beta / lam
    method = fedprox(None, {}, lam=lam, beta=beta)  # the server step needs no model
    global_state = {"w": torch.tensor([1.0, 2.0]), "steps": torch.tensor(7)}
    uploads = [
        {"w": torch.tensor([3.0, 2.0]), "steps": torch.tensor(4)},
        {"w": torch.tensor([0.0, 8.0]), "steps": torch.tensor(9)},
    ]
    updates = [ClientUpdate(i, u, n) for i, (u, n) in enumerate(zip(uploads, [1, 100], strict=True))]

    stepped, info = method.server_update(global_state, updates, seed=0, round_index=0)

    # w <- w - gamma/m sum_i lam (w - w_i): [1, 2] - 0.25 * 2 * ([-2, 0] + [1, -6]) / 2 = [1.25, 3.5]
    grads = [lam * (global_state["w"] - u["w"]) for u in uploads]
    assert_close(stepped["w"], global_state["w"] - gamma * sum(grads) / 2)
    assert_close(stepped["w"], torch.tensor([1.25, 3.5]))  # uniform over clients, not weighted by 1 : 100 samples
    assert stepped["steps"].item() == 4
    assert info == {}

    method.config.beta = 1.0  # gamma = 1/lam (the paper's MNIST setting): the mean of the personalized models
    stepped, _ = method.server_update(global_state, updates, seed=0, round_index=0)
    assert_close(stepped["w"], torch.tensor([1.5, 5.0]))


def test_method_flags_and_parameter_counts():
    trainer = tiny_trainer()
    method = fedprox(trainer, trainer.model.state())
    trainable = trainer.model.num_trainable()
    assert method.parameter_counts() == {"personalized": trainable, "trained": trainable, "communicated": trainable}
    assert METHODS["fedprox"] is FedProx and FedProx.default_scope == "adapter"
    assert FedProx.uses_proximal and PerAda.uses_proximal and PerAdaNoKD.uses_proximal  # nokd keeps line 10
    assert not Method.uses_proximal


# ---------------------------------------------------------------- Theorem 1's rule on hand-computed numbers


@pytest.mark.parametrize(
    ("h_hat", "lam", "regime"),
    [
        (1e-4, 20.0, "homogeneous"),  # R = 0.01 <= 1/(m sqrt n) = 0.01: rho/(sqrt(n) R) = 2/(10 * 0.01)
        (2.5e-3, 4.0, "moderate"),  # R = 0.05 in (0.01, 0.1]: 2/(10 * 0.05)
        (0.04, 1.0, "heterogeneous"),  # R = 0.2 > 0.1: rho^2/(n R^2) = 4/(100 * 0.04)
        (1.0, 0.04, "heterogeneous"),  # R = 1: 4/100
    ],
)
def test_rule_in_each_regime(h_hat, lam, regime):
    choice = choose_lam(h_hat, n=100, m=10, rho=2.0)
    assert choice.lam == pytest.approx(lam)
    assert choice.regime == regime
    assert regime in choice.explanation and "\n" not in choice.explanation


def test_rule_at_the_threshold_and_with_a_cap():
    # R = 1/sqrt(n) exactly still takes the first branch: rho/(sqrt(n) R) = rho; just above it, rho^2.
    at_threshold = choose_lam(0.25, n=4, m=2, rho=2.0)
    assert (at_threshold.lam, at_threshold.regime) == (pytest.approx(2.0), "moderate")
    assert choose_lam(0.25 * 1.0001, n=4, m=2, rho=2.0).lam == pytest.approx(4.0 / 1.0001)
    # R = 0 is GlobalTrain (lam = infinity) unless capped; caps apply to the homogeneous side only.
    assert choose_lam(0.0, n=100, m=10).lam == math.inf
    capped = choose_lam(0.0, n=100, m=10, lam_max=10.0)
    assert (capped.lam, capped.regime) == (10.0, "homogeneous") and "capped" in capped.explanation
    assert choose_lam(1e-6, n=100, m=10, lam_max=50.0).lam == 50.0  # uncapped: 2/(10 * 0.001) = 200
    assert choose_lam(1.0, n=100, m=10, lam_max=50.0).lam == pytest.approx(0.04)
    assert RHO == 2.0  # the paper's Section 6.1 value
    with pytest.raises(ValueError):
        choose_lam(-1.0, n=100, m=10)


def test_heterogeneity_is_the_weighted_spread_around_the_weighted_mean():
    states = [
        {"a": torch.tensor([0.0, 0.0]), "bn": torch.tensor([0.0])},
        {"a": torch.tensor([2.0, 0.0]), "bn": torch.tensor([100.0])},
        {"a": torch.tensor([0.0, 4.0]), "bn": torch.tensor([-50.0])},
    ]
    # p = (1/4, 1/4, 1/2); w_g = (0.5, 2); squared distances 4.25, 6.25, 4.25 -> 4.75. "bn" is not a key.
    assert heterogeneity(states, [1, 1, 2], keys=["a"]) == pytest.approx(4.75)
    assert heterogeneity(states, [1, 1, 2], keys=["a", "bn"]) > 1000


# ---------------------------------------------------------------- a problem whose heterogeneity is known


def shifted_regression(shift, m=5, n=200, d=3, noise=0.5, seed=0):
    """Client optima w*_i = w0 + shift * u_i; each client's local least-squares fit (LocalTrain) and the truth."""
    generator = torch.Generator().manual_seed(seed)
    w0 = torch.randn(d, generator=generator, dtype=torch.float64)
    directions = torch.randn(m, d, generator=generator, dtype=torch.float64)
    fits, optima = [], []
    for i in range(m):
        optimum = w0 + shift * directions[i]
        x = torch.randn(n, d, generator=generator, dtype=torch.float64)
        y = x @ optimum + noise * torch.randn(n, generator=generator, dtype=torch.float64)
        fits.append({"w": torch.linalg.lstsq(x, y.unsqueeze(1)).solution.squeeze(1)})
        optima.append(optimum)
    true_h = float(((torch.stack(optima) - torch.stack(optima).mean(0)) ** 2).sum(1).mean())
    return fits, true_h


def test_larger_client_shift_gives_larger_heterogeneity_and_smaller_lam():
    shifts = [0.0, 0.1, 0.5, 2.0]
    estimates, choices = [], []
    for shift in shifts:
        fits, true_h = shifted_regression(shift)
        h_hat = heterogeneity(fits, [200] * 5, keys=["w"])
        estimates.append(h_hat)
        choices.append(choose_lam(h_hat, n=200, m=5))
        if shift >= 0.5:  # the noise of the local fits (~ d sigma^2 / n) is small next to the true spread
            assert h_hat == pytest.approx(true_h, rel=0.1)
    assert estimates == sorted(estimates) and estimates[0] < 0.01 < 1.0 < estimates[-1]
    lams = [c.lam for c in choices]
    # Theorem 1: more heterogeneity -> smaller lam (more personalization), from near-GlobalTrain to LocalTrain.
    assert lams == sorted(lams, reverse=True) and lams[0] > 100 * lams[-1]
    assert choices[0].regime in ("homogeneous", "moderate") and choices[-1].regime == "heterogeneous"
    assert lams[-1] == pytest.approx(RHO**2 / (200 * estimates[-1]))


# ---------------------------------------------------------------- the warm-up estimator


def test_warmup_estimate_matches_one_hand_step_per_client():
    trainer = tiny_trainer()
    start = perturbed(trainer.model, seed=1)
    clients = [
        client(0, image_set(BATCH, seed=3)),
        client(1, image_set(BATCH, seed=4)),
        client(2, image_set(4, seed=5)),
    ]

    record = estimate_lam(trainer, start, clients, lr=0.1, seed=0)

    # One epoch = one full-batch step (every client has at most BATCH images); p = (8, 8, 4) / 20.
    states = [hand_sgd_step(trainer, start, c.train, lr=0.1)[0] for c in clients]
    names = list(trainer.model.trainable_parameters())
    p = [0.4, 0.4, 0.2]
    center = {k: sum(pi * s[k] for pi, s in zip(p, states, strict=True)) for k in names}
    h = sum(pi * sum(float(((s[k] - center[k]) ** 2).sum()) for k in names) for pi, s in zip(p, states, strict=True))
    assert record["h_hat"] == pytest.approx(h, rel=1e-4)
    n = 20 / 3
    r = math.sqrt(h)
    lam = RHO**2 / (n * h) if r > 1 / math.sqrt(n) else RHO / (math.sqrt(n) * r)
    assert (record["n"], record["m"]) == (pytest.approx(n), 3)
    assert record["lam"] == pytest.approx(lam, rel=1e-4)
    assert estimate_lam(trainer, start, clients, lr=0.1, seed=0) == record  # seeded


# ---------------------------------------------------------------- the command line


SMALL = ("--limit-samples", "400", "--eval-every", "0")  # keeps the CLI runs of this file short
AUTO = ("--method", "perada", "--lam", "auto", "--rounds", "2", *SMALL)


def assert_complete(run, code, err):
    assert code == 0, err
    for client_id in range(4):
        assert (run / "clients" / str(client_id) / "adapter_model.safetensors").is_file()
    assert (run / "report.json").is_file()


def test_cli_fedprox_one_round(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    run = tmp_path / "run"
    code, _, err = run_cli(
        tiny_args(fmnist_dir, run, "--method", "fedprox", "--rounds", "1", *SMALL), capsys, monkeypatch
    )
    assert_complete(run, code, err)
    saved = json.loads((run / "config.json").read_text())
    assert saved["resolved"]["scope"] == "adapter" and "lam_auto" not in saved["resolved"]
    assert saved["config"]["method"]["lam"] == 1.0
    metrics = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert "personal_loss" in metrics


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory, pretrained_home, fmnist_dir):
    """One uninterrupted 2-round `perada --lam auto` run: its directory, exit code and stderr."""
    run = tmp_path_factory.mktemp("auto") / "run"
    stderr = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stderr(stderr):
        patch.setenv("PERADAPT_HOME", str(pretrained_home))
        patch.setattr(sys, "argv", ["peradapt", *tiny_args(fmnist_dir, run, *AUTO)])
        try:
            main()
            code = 0
        except SystemExit as exit_:
            code = exit_.code
    return run, code, stderr.getvalue()


def test_cli_lam_auto_records_the_estimate_and_trains_with_it(auto_run):
    run, code, err = auto_run
    assert_complete(run, code, err)
    saved = json.loads((run / "config.json").read_text())
    record = saved["resolved"]["lam_auto"]
    partition = json.loads((run / "partition.json").read_text())
    n = sum(len(c["train"]) for c in partition["clients"]) / 4
    assert (record["n"], record["m"], record["rho"]) == (pytest.approx(n), 4, RHO)
    assert record["h_hat"] > 0
    expected = choose_lam(record["h_hat"], n, 4, lam_max=1 / 0.05)  # tiny_args: --lr 0.05
    assert (record["lam"], record["regime"], record["explanation"]) == tuple(expected)
    assert saved["config"]["method"]["lam"] == record["lam"] != 1.0  # the rounds used the chosen lam
    assert saved["config"]["method"]["lam_auto"] is True
    assert f"H_hat={record['h_hat']:.4g}" in err and f"regime {record['regime']}" in err


def test_resume_reuses_the_saved_lam_without_estimating_again(
    auto_run, tmp_path, fmnist_dir, capsys, monkeypatch, home
):
    finished, code, err = auto_run
    assert code == 0, err
    run = tmp_path / "crashed"
    crash_after_round(1, tiny_args(fmnist_dir, run, *AUTO), capsys, monkeypatch)

    def no_estimate(*args, **kwargs):
        raise AssertionError("a resumed run must not estimate lam again")

    monkeypatch.setattr(engine, "estimate_lam", no_estimate)
    code, _, err = run_cli(tiny_args(fmnist_dir, run, *AUTO, "--resume"), capsys, monkeypatch)  # `--lam auto` again
    assert code == 0, err
    assert "after round 1" in err
    assert results(run) == results(finished)  # same lam, same record, same numbers as the uninterrupted run


def test_resume_config_keeps_the_chosen_lam(auto_run):
    run = auto_run[0]
    saved = json.loads((run / "config.json").read_text())["config"]["method"]["lam"]
    for overrides in ({"out": str(run)}, {"out": str(run), "lam": "auto"}, {"out": str(run), "lam": "AUTO"}):
        config = engine.resume_config(run, overrides)
        assert (config.method.lam, config.method.lam_auto) == (saved, True)
    with pytest.raises(RunError, match="lam"):
        engine.resume_config(run, {"out": str(run), "lam": "0.5"})


class NoProximal(Method):
    name = "no-proximal-test"
    summary = "a method without a proximal term"

    def client_update(self, client, global_state, seed):
        raise AssertionError("never reached")

    def server_update(self, global_state, updates, seed, round_index, on_step=None):
        raise AssertionError("never reached")

    def personalized(self, client_id, global_state):
        return global_state


def test_lam_auto_without_a_proximal_term_is_a_user_error(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    monkeypatch.setitem(METHODS, NoProximal.name, NoProximal)
    run = tmp_path / "run"
    args = tiny_args(fmnist_dir, run, "--method", NoProximal.name, "--lam", "auto", "--rounds", "1")
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 2
    assert "--lam auto" in err and NoProximal.name in err and "fedprox" in err
    assert not (run / "config.json").exists()
