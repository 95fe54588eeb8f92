"""Personalized FedProx (Yu et al., Algorithm 1) and `--lam auto` (their Theorem 1 rule), checked by hand."""

from __future__ import annotations

import contextlib
import io
import json
import math
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch.testing import assert_close

import peradapt.federation.lifecycle as lifecycle
from peradapt.cli import main
from peradapt.compute.costs import elements
from peradapt.config import MethodConfig, TrainConfig
from peradapt.errors import ConfigError, RunError
from peradapt.methods import METHODS, ClientUpdate, Method, MethodContext, auto_lam
from peradapt.methods.auto_lam import RHO, choose_lam, client_risk, estimate_lam, heterogeneity
from peradapt.methods.base import PERSONAL_KEY
from peradapt.methods.fedprox import FedProx, FedProxSettings
from peradapt.methods.perada import PerAda, PerAdaNoKD
from peradapt.rundir.store import ClientStore

from .conftest import measured_counts, settings
from .test_cli import crash_after_round, results, run_cli, tiny_args
from .test_perada import BATCH, TOL, assign, client, hand_sgd_step, image_set, normalized, perturbed, tiny_trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models; L-BFGS's many small operations

# ---------------------------------------------------------------- FedProx client step (eq. 11) and server step (eq. 10)


def fedprox(trainer, initial, lam=0.5, lr=0.3, personal_lr=0.1, step=1.0):
    config = MethodConfig("fedprox", local_epochs=1, personal_epochs=1, lam=lam, lr=lr, personal_lr=personal_lr)
    config.batch_size = BATCH
    settings = FedProxSettings(fedprox_server_step=step)
    return FedProx(MethodContext(config, trainer, ClientStore(), initial, distiller=None, settings=settings))


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
    lam, step = 2.0, 0.5
    gamma = step / lam
    from types import SimpleNamespace

    model = SimpleNamespace(trainable_parameters=lambda: {"w": None})  # the server step needs only their names
    method = fedprox(SimpleNamespace(model=model), {}, lam=lam, step=step)
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

    method.settings.fedprox_server_step = 1.0  # gamma = 1/lam (the paper's MNIST setting): the mean of the w_i
    stepped, _ = method.server_update(global_state, updates, seed=0, round_index=0)
    assert_close(stepped["w"], torch.tensor([1.5, 5.0]))


def test_the_server_steps_former_key_is_refused_naming_its_own():
    """--beta, the key fedprox shared with pFedMe's β until each had its own, names --fedprox-server-step, in flags
    and in a run's config.json alike (the package was never released with the old key)."""
    refusal = r"^--beta is no setting of --method fedprox any more: use --fedprox-server-step$"
    with pytest.raises(ConfigError, match=refusal):
        TrainConfig.from_flat({"method": "fedprox", "beta": 0.5})
    saved = TrainConfig.from_flat({"method": "fedprox", "fedprox_server_step": 0.5}).to_dict()
    saved["method"]["beta"] = saved["method"].pop("fedprox_server_step")
    with pytest.raises(ConfigError, match=refusal):
        TrainConfig.from_dict(saved)
    assert TrainConfig.from_flat({"method": "pfedme", "beta": 0.5}).method_settings.beta == 0.5  # pFedMe's own β


def test_method_flags_and_parameter_counts():
    trainer = tiny_trainer()
    method = fedprox(trainer, trainer.model.state())
    trainable, whole = trainer.model.num_trainable(), elements(trainer.model.state())
    # only the personalized w_i trains (w_g is averaged), and it is both the client's own and what it sends
    counts = measured_counts(method, client(0, image_set(BATCH, seed=3)), trainer.model.state())
    assert counts == {"personalized": whole, "trained": trainable, "communicated": whole}
    assert METHODS["fedprox"] is FedProx and FedProx.default_scope == "adapter"
    assert FedProx.uses_proximal and PerAda.uses_proximal and PerAdaNoKD.uses_proximal  # nokd keeps line 10
    assert not Method.uses_proximal


# ---------------------------------------------------------------- Theorem 1's rule on hand-computed numbers


@pytest.mark.parametrize(
    ("r2", "lam", "regime"),
    [
        (1e-4, 20.0, "homogeneous"),  # R = 0.01 <= 1/(m sqrt n) = 0.01: rho/(sqrt(n) R) = 2/(10 * 0.01)
        (2.5e-3, 4.0, "moderate"),  # R = 0.05 in (0.01, 0.1]: 2/(10 * 0.05)
        (0.04, 1.0, "heterogeneous"),  # R = 0.2 > 0.1: rho^2/(n R^2) = 4/(100 * 0.04)
        (1.0, 0.04, "heterogeneous"),  # R = 1: 4/100
    ],
)
def test_rule_in_each_regime(r2, lam, regime):
    choice = choose_lam(r2, n=100, m=10, rho=2.0)
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


# ---------------------------------------------------------------- R² on problems whose optima are known

N, M, D = 300, 5, 5  # samples per client, clients, dimension


def max_squared_distance(minimizers):
    """Assumption 1's R² of these client minimizers, w*_g = their mean (the paper's w*_g, with p_i = 1/m)."""
    return float(((minimizers - minimizers.mean(0)) ** 2).sum(1).max())


def shifted_regression(shift, noise, seed=0):
    """M clients of N samples x ~ N(0, I), y = x^T (w + delta_i) + noise, delta_i ~ shift * N(0, I): one shared
    parameter, each client's MSE risk on it and each client's least-squares minimizer in closed form."""
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(D, generator=generator, dtype=torch.float64)
    parameter = torch.zeros(D, dtype=torch.float64, requires_grad=True)
    risks, minimizers = [], []
    for _ in range(M):
        x = torch.randn(N, D, generator=generator, dtype=torch.float64)
        optimum = w + shift * torch.randn(D, generator=generator, dtype=torch.float64)
        y = x @ optimum + noise * torch.randn(N, generator=generator, dtype=torch.float64)
        risks.append(lambda x=x, y=y: [((x @ parameter - y) ** 2).mean()])
        minimizers.append(torch.linalg.lstsq(x, y.unsqueeze(1)).solution.squeeze(1))
    return parameter, risks, torch.stack(minimizers)


@pytest.mark.parametrize(
    ("shift", "noise", "regime"),
    [(0.0, 0.05, "homogeneous"), (0.01, 0.05, "moderate"), (0.3, 0.5, "heterogeneous"), (2.0, 0.5, "heterogeneous")],
)
def test_r2_of_shifted_linear_regression_and_the_lam_of_theorem_1(shift, noise, regime):
    """R² within a factor 1.25 of the least-squares minimizers' (the prior moves them by O(1/n), L-BFGS solves
    this quadratic well within its budget), and λ within a factor 2 of Theorem 1's λ for the true R²."""
    parameter, risks, minimizers = shifted_regression(shift, noise)
    true_r2 = max_squared_distance(minimizers)

    estimate = heterogeneity([parameter], risks, [N] * M)

    assert true_r2 / 1.25 <= estimate.r2 <= 1.25 * true_r2
    median = float(((minimizers - minimizers.mean(0)) ** 2).sum(1).median())
    assert median / 1.25 <= estimate.r2_median <= 1.25 * median
    # Theorem 1: lam = rho/(sqrt(n) R) if R <= 1/sqrt(n), else rho^2/(n R^2); Table 1's regimes.
    r = math.sqrt(true_r2)
    lam = 2 / (math.sqrt(N) * r) if r <= 1 / math.sqrt(N) else 4 / (N * true_r2)
    true_regime = (
        "heterogeneous" if r > 1 / math.sqrt(N) else "moderate" if r > 1 / (M * math.sqrt(N)) else "homogeneous"
    )
    choice = choose_lam(estimate.r2, N, M)
    assert lam / 2 <= choice.lam <= 2 * lam
    assert choice.regime == true_regime == regime  # each case lies in the regime it names


def test_separable_classes_give_the_finite_map_optima_whatever_the_budget(monkeypatch):
    """Logistic regression on separable labels has no minimizer (the loss falls as ||w|| grows); with the
    N(w0, I) prior (w0 = 0 here) client i's objective L_i(w) + ||w||² / (2 n) has one, found here by Newton's
    method, and the estimate is its R² whether L-BFGS may evaluate the risk EVALUATIONS times or four times that."""
    n, m, d = 100, 3, 3
    generator = torch.Generator().manual_seed(0)
    parameter = torch.zeros(d, dtype=torch.float64, requires_grad=True)
    risks, maps = [], []
    for _ in range(m):
        x = torch.randn(n, d, generator=generator, dtype=torch.float64)
        direction = torch.randn(d, generator=generator, dtype=torch.float64)
        y = (x @ direction > 0).double()  # separable
        risks.append(lambda x=x, y=y: [F.binary_cross_entropy_with_logits(x @ parameter, y)])
        w = torch.zeros(d, dtype=torch.float64)
        for _ in range(50):
            p = torch.sigmoid(x @ w)
            gradient = x.T @ (p - y) / n + w / n
            hessian = x.T @ (x * (p * (1 - p)).unsqueeze(1)) / n + torch.eye(d, dtype=torch.float64) / n
            w = w - torch.linalg.solve(hessian, gradient)
        # No minimizer without the prior: the risk falls along the separating direction, below the MAP's.
        far = F.binary_cross_entropy_with_logits(x @ (100 * direction), y)
        assert far < 0.1 * F.binary_cross_entropy_with_logits(x @ w, y)
        maps.append(w)
    true_r2 = max_squared_distance(torch.stack(maps))
    assert auto_lam.PRIOR == 1.0

    estimate = heterogeneity([parameter], risks, [n] * m)
    assert estimate.r2 == pytest.approx(true_r2, rel=0.01)
    monkeypatch.setattr(auto_lam, "EVALUATIONS", 4 * auto_lam.EVALUATIONS)
    with torch.no_grad():
        parameter.zero_()
    assert heterogeneity([parameter], risks, [n] * m).r2 == pytest.approx(estimate.r2, rel=1e-6)


# ---------------------------------------------------------------- the estimate on the model (LocalTrainer)


def test_client_risk_is_the_mean_loss_in_eval_mode_over_chunks(monkeypatch):
    monkeypatch.setattr(auto_lam, "CHUNK", 5)
    trainer = tiny_trainer()
    start = perturbed(trainer.model, seed=1)
    data = image_set(12, seed=3)
    trainer.model.load_state(start)
    trainer.model.eval()
    parameters = list(trainer.model.trainable_parameters().values())

    terms = list(client_risk(trainer, client(0, data))())
    gradients = torch.autograd.grad(sum(terms), parameters)

    assert len(terms) == 3  # chunks of 5, 5 and 2 images
    module = trainer.model.module
    assign(module, start)
    module.eval()  # no dropout, BatchNorm on its running statistics
    loss = F.cross_entropy(module(normalized(data.images)), data.labels)  # mean over all 12 images at once
    expected = torch.autograd.grad(loss, [p for p in module.parameters() if p.requires_grad])
    assert_close(sum(terms), loss, **TOL)
    assert_close(gradients, expected, **TOL)


def test_identical_clients_have_no_heterogeneity_and_the_statistics_stay():
    trainer = tiny_trainer()
    start = perturbed(trainer.model, seed=1)
    data = image_set(16, seed=3)

    record = estimate_lam(trainer, start, [client(i, data) for i in range(3)], lam_max=10.0, num_clients=30)

    assert record["r2"] < 1e-10 and record["r2_median"] <= record["r2"]
    assert (record["lam"], record["regime"]) == (10.0, "homogeneous")  # GlobalTrain, capped
    assert (record["clients"], record["n"], record["m"], record["rho"]) == (3, 16, 30, RHO)
    state = trainer.model.state()
    for name in state.keys() - trainer.model.trainable_parameters().keys():  # BatchNorm statistics: eval mode
        assert_close(state[name], start[name], rtol=0, atol=0)


def test_r2_does_not_move_with_the_learning_rate_or_the_batch_size(tmp_path):
    """Through the engine's `--lam auto`: lr and lr/2, batch and batch/4. The one-epoch SGD spread that the
    estimate replaced moves about 4x with lr/2 on the same clients."""
    clients = [client(i, image_set(24, seed=3 + i)) for i in range(3)]

    def auto_lam_record(lr, batch_size):
        trainer = tiny_trainer(batch_size)
        config = MethodConfig("fedprox", lam_auto=True, lr=lr)
        session = SimpleNamespace(
            config=SimpleNamespace(method=config),
            method=FedProx,
            trainer=trainer,
            initial=trainer.model.state(),
            client_sample=clients,
            federated_clients=clients,
        )
        return lifecycle.choose_lam(session, tmp_path, resume=False, console=Console(file=io.StringIO()))

    def warmup_spread(lr):
        trainer = tiny_trainer(BATCH)
        start, names = trainer.model.state(), list(trainer.model.trainable_parameters())
        states = [trainer.sgd(start, c.train, epochs=1, lr=lr, seed=0)[0] for c in clients]
        center = {k: sum(s[k] for s in states) / len(states) for k in names}
        return max(sum(float(((s[k] - center[k]) ** 2).sum()) for k in names) for s in states)

    base = auto_lam_record(0.1, BATCH)
    assert base.r2 > 0
    for other in (auto_lam_record(0.05, BATCH), auto_lam_record(0.1, BATCH // 4)):
        assert abs(other.r2 / base.r2 - 1) < 0.25
    assert warmup_spread(0.05) < 0.5 * warmup_spread(0.1)


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
    assert record["r2"] > 0 and record["r2_median"] <= record["r2"] and record["clients"] == 4
    expected = choose_lam(record["r2"], n, 4, lam_max=1 / 0.05)  # tiny_args: --lr 0.05
    assert (record["lam"], record["regime"], record["explanation"]) == tuple(expected)
    assert saved["config"]["method"]["lam"] == record["lam"] != 1.0  # the rounds used the chosen lam
    assert saved["config"]["method"]["lam_auto"] is True
    assert f"R²={record['r2']:.4g} (max over 4 clients" in err and f"regime {record['regime']}" in err


def test_a_run_leaves_the_config_it_was_given_as_it_was(tmp_path, fmnist_dir, monkeypatch, home):
    """The run takes its directory and --lam auto's λ into a copy of its own: the caller's config is not written."""
    from peradapt.federation.engine import train

    monkeypatch.chdir(tmp_path)  # no --out: the default run directory, under runs/
    values = {**settings(fmnist_dir, tmp_path, method="perada", lam="auto", rounds=1), "out": None}
    config = TrainConfig.from_flat(values)
    before = config.to_dict()
    train(config, console=Console(file=io.StringIO()))
    assert config.to_dict() == before and config.out is None and config.method.lam == MethodConfig.lam
    saved = json.loads(next((tmp_path / "runs").glob("*/config.json")).read_text())
    assert saved["config"]["method"]["lam"] == saved["resolved"]["lam_auto"]["lam"] != config.method.lam


def test_resume_reuses_the_saved_lam_without_estimating_again(
    auto_run, tmp_path, fmnist_dir, capsys, monkeypatch, home
):
    finished, code, err = auto_run
    assert code == 0, err
    run = tmp_path / "crashed"
    crash_after_round(1, tiny_args(fmnist_dir, run, *AUTO), capsys, monkeypatch)

    def no_estimate(*args, **kwargs):
        raise AssertionError("a resumed run must not estimate lam again")

    monkeypatch.setattr(lifecycle, "estimate_lam", no_estimate)
    code, _, err = run_cli(tiny_args(fmnist_dir, run, *AUTO, "--resume"), capsys, monkeypatch)  # `--lam auto` again
    assert code == 0, err
    assert "after round 1" in err
    assert results(run) == results(finished)  # same lam, same record, same numbers as the uninterrupted run


def test_resume_config_keeps_the_chosen_lam(auto_run):
    run = auto_run[0]
    saved = json.loads((run / "config.json").read_text())["config"]["method"]["lam"]
    for overrides in ({"out": str(run)}, {"out": str(run), "lam": "auto"}, {"out": str(run), "lam": "AUTO"}):
        config = lifecycle.resume_config(run, overrides)
        assert (config.method.lam, config.method.lam_auto) == (saved, True)
    with pytest.raises(RunError, match="lam"):
        lifecycle.resume_config(run, {"out": str(run), "lam": "0.5"})


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
