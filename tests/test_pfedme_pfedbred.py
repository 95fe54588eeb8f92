"""pFedMe (Dinh et al. 2020) and pFedBreD (Shi et al. 2023, Algorithm 1, Eqs. 2, 13, 14) against hand computations.

Every expected value is recomputed here with plain torch autograd on a copy of the tiny model, following the
papers' update rules, never by calling the methods' code.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from peradapt.config import MethodConfig
from peradapt.errors import ConfigError
from peradapt.federation.seeds import LOCAL, derive_seed
from peradapt.federation.store import ClientStore
from peradapt.personalize import ClientUpdate, MethodContext
from peradapt.personalize.base import PERSONAL_KEY
from peradapt.personalize.pfedbred import MEMORY_KEY, PFedBreD
from peradapt.personalize.pfedme import PFedMe

from .test_cli import run_cli, tiny_args
from .test_perada import BATCH, TOL, assign, client, image_set, normalized, perturbed, tiny_trainer, train_mode

LAM, LR, PERSONAL_LR, K = 0.5, 0.1, 0.05, 2
PRIOR_LR, PRIOR_ETA = 0.3, 0.4  # large enough that each term of Eq. (14) visibly moves mu


def make(cls, trainer, **overrides):
    settings = {
        "local_epochs": 1,
        "lam": LAM,
        "lr": LR,
        "personal_lr": PERSONAL_LR,
        "inner_steps": K,
        "batch_size": BATCH,
        "prior_lr": PRIOR_LR,
        "prior_eta": PRIOR_ETA,
        **overrides,
    }
    return cls(MethodContext(MethodConfig(**settings), trainer, ClientStore(), trainer.model.state(), None))


def names_of(trainer):
    return list(trainer.model.trainable_parameters())


# ---------------------------------------------------------------- the hand computations


def module_at(trainer, state):
    module = copy.deepcopy(trainer.model.module)
    assign(module, state)
    train_mode(module)
    return module


def params(module):
    return {n: p for n, p in module.named_parameters() if p.requires_grad}


def values(module, keys):
    return {k: v.detach().clone() for k, v in module.state_dict().items() if k in keys}


def set_params(module, new):
    with torch.no_grad():
        for name, parameter in params(module).items():
            parameter.copy_(new[name])


def grad_f(module, images, labels):
    """grad of the minibatch cross-entropy at the module's current parameters."""
    named = params(module)
    loss = F.cross_entropy(module(images), labels)
    return dict(zip(named, torch.autograd.grad(loss, list(named.values())), strict=True))


def hand_inner(module, images, labels, anchor, steps=K, lr=PERSONAL_LR, lam=LAM):
    """theta <- theta - lr * (grad f(theta) + lam * (theta - anchor)), K times (pFedMe's inner problem, Eq. 2)."""
    for _ in range(steps):
        grads = grad_f(module, images, labels)
        with torch.no_grad():
            for name, parameter in params(module).items():
                parameter.sub_(lr * (grads[name] + lam * (parameter - anchor[name])))


def batches_of(trainer, data, seed=0, epochs=1):
    """The minibatches (order and all) that the client sees with this round seed."""
    return list(trainer.minibatches(data, epochs=epochs, seed=derive_seed(seed, LOCAL)))


def hand_pfedme(trainer, w, batches):
    names = names_of(trainer)
    module = module_at(trainer, w)  # theta starts at w^t
    local = {n: w[n].clone() for n in names}
    for images, labels in batches:
        hand_inner(module, images, labels, anchor=local)
        theta = values(module, names)
        local = {n: local[n] - LR * LAM * (local[n] - theta[n]) for n in names}
    personal = values(module, w)
    return personal, {**personal, **local}


def hand_prior_mean(module, prior, local, theta, memory, images, labels):
    """Eq. (14): lg w - eta_a grad f(w); meg w - eta (w_mem - theta); mh both terms. Leaves theta loaded."""
    mu = {n: v.clone() for n, v in local.items()}
    if prior in ("lg", "mh"):
        set_params(module, local)
        grads = grad_f(module, images, labels)
        mu = {n: mu[n] - PRIOR_LR * grads[n] for n in mu}
    if prior in ("meg", "mh"):
        mu = {n: mu[n] - PRIOR_ETA * (memory[n] - theta[n]) for n in mu}
    set_params(module, theta)
    return mu


def hand_pfedbred(trainer, prior, w, theta0, memory, batches):
    names = names_of(trainer)
    module = module_at(trainer, w)  # running statistics from w^{t-1}
    set_params(module, theta0)  # theta_{i,0} = theta_{i,R}^{(t-1)}
    local = {n: w[n].clone() for n in names}
    for images, labels in batches:
        theta = values(module, names)
        mu = hand_prior_mean(module, prior, local, theta, memory, images, labels)  # line 7
        hand_inner(module, images, labels, anchor=mu)  # line 8
        theta = values(module, names)
        local = {n: local[n] - LR * LAM * (mu[n] - theta[n]) for n in names}  # line 9, Eq. (13)
    personal = values(module, w)
    return personal, {**personal, **local}


def differs(a, b, names):
    return any(not torch.allclose(a[n], b[n], atol=1e-5) for n in names)


# ---------------------------------------------------------------- pFedMe client step


def test_pfedme_one_local_step_is_k_inner_steps_then_the_envelope_step():
    trainer = tiny_trainer()
    data = image_set(BATCH, seed=3)
    w = perturbed(trainer.model, seed=2)
    method = make(PFedMe, trainer)

    update = method.client_update(client(4, data), w, seed=0)

    personal, upload = hand_pfedme(trainer, w, [(normalized(data.images), data.labels)])
    assert (update.client_id, update.num_samples) == (4, BATCH)
    assert_close(update.upload, upload, **TOL)
    assert_close(method.store.get(4, PERSONAL_KEY), personal, **TOL)
    assert_close(method.personalized(4, w), personal, **TOL)
    assert method.personalized(5, w) is w  # never sampled: the global model
    # Not a plain SGD step: K inner steps at eta_p, a w-step of eta * lam, so theta, w_i and w all differ.
    names = names_of(trainer)
    assert differs(update.upload, personal, names) and differs(update.upload, w, names)
    one_step = make(PFedMe, trainer, inner_steps=1).client_update(client(4, data), w, seed=0)
    assert differs(one_step.upload, update.upload, names)


def test_pfedme_warm_starts_theta_across_local_steps():
    trainer = tiny_trainer()
    data = image_set(3 * BATCH, seed=4)
    w = perturbed(trainer.model, seed=2)
    method = make(PFedMe, trainer)

    update = method.client_update(client(1, data), w, seed=5)

    batches = batches_of(trainer, data, seed=5)
    assert len(batches) == 3
    personal, upload = hand_pfedme(trainer, w, batches)
    assert_close(update.upload, upload, **TOL)
    assert_close(method.store.get(1, PERSONAL_KEY), personal, **TOL)


# ---------------------------------------------------------------- pFedBreD prior means (Eq. 14)


@pytest.mark.parametrize("prior", ["lg", "meg", "mh"])
def test_prior_mean_is_eq_14(prior):
    trainer = tiny_trainer()
    data = image_set(BATCH, seed=3)
    names = names_of(trainer)
    w, theta_state, memory = (perturbed(trainer.model, seed=s) for s in (2, 6, 7))
    local, theta = {n: w[n] for n in names}, {n: theta_state[n] for n in names}
    images, labels = normalized(data.images), data.labels
    method = make(PFedBreD, trainer, prior=prior)
    trainer.model.load_state(theta_state)
    trainer.model.train()

    mu = method.prior_mean(local, memory, images, labels)

    module = module_at(trainer, theta_state)
    set_params(module, w)
    grads = grad_f(module, images, labels)  # grad f_i(w_{r-1})
    by_term = {
        "lg": {n: w[n] - PRIOR_LR * grads[n] for n in names},
        "meg": {n: w[n] - PRIOR_ETA * (memory[n] - theta[n]) for n in names},
        "mh": {n: w[n] - PRIOR_LR * grads[n] - PRIOR_ETA * (memory[n] - theta[n]) for n in names},
    }
    assert_close(mu, by_term[prior], **TOL)
    for other in {"lg", "meg", "mh"} - {prior}:
        assert differs(mu, by_term[other], names)
    # theta_{r-1} is what the model holds again afterwards (the inner problem starts from it).
    after = trainer.model.state()
    assert_close({n: after[n] for n in names}, theta)


# ---------------------------------------------------------------- pFedBreD client step (Algorithm 1, lines 5-9)


def test_pfedbred_client_step_with_stored_theta_and_memory_for_each_prior():
    trainer = tiny_trainer()
    data = image_set(BATCH, seed=3)
    batch = [(normalized(data.images), data.labels)]
    w, theta0, memory = (perturbed(trainer.model, seed=s) for s in (2, 6, 7))
    uploads = {}
    for prior in ("lg", "meg", "mh"):
        method = make(PFedBreD, trainer, prior=prior)
        method.store.put(4, PERSONAL_KEY, theta0)
        method.store.put(4, MEMORY_KEY, memory)

        update = method.client_update(client(4, data), w, seed=0)

        personal, upload = hand_pfedbred(trainer, prior, w, theta0, memory, batch)
        assert_close(update.upload, upload, **TOL)
        assert_close(method.store.get(4, PERSONAL_KEY), personal, **TOL)
        assert_close(method.personalized(4, w), personal, **TOL)
        assert_close(method.store.get(4, MEMORY_KEY), upload, **TOL)  # w_{i,R}^{(t)}, memorized for next round
        uploads[prior] = update.upload
    # The prior matters: the three strategies give three different uploads.
    names = names_of(trainer)
    assert differs(uploads["lg"], uploads["meg"], names) and differs(uploads["lg"], uploads["mh"], names)
    assert differs(uploads["meg"], uploads["mh"], names)


def test_pfedbred_mh_over_several_local_steps_and_two_rounds():
    trainer = tiny_trainer()
    data = image_set(2 * BATCH, seed=4)
    w1, w2 = perturbed(trainer.model, seed=2), perturbed(trainer.model, seed=9)
    method = make(PFedBreD, trainer)  # mh, the default
    assert method.config.prior == "mh"

    first = method.client_update(client(3, data), w1, seed=1)
    # First participation: theta and the memory are the received global model.
    personal1, upload1 = hand_pfedbred(trainer, "mh", w1, w1, w1, batches_of(trainer, data, seed=1))
    assert_close(first.upload, upload1, **TOL)

    second = method.client_update(client(3, data), w2, seed=2)
    personal2, upload2 = hand_pfedbred(trainer, "mh", w2, personal1, upload1, batches_of(trainer, data, seed=2))
    assert_close(second.upload, upload2, **TOL)
    assert_close(method.personalized(3, w2), personal2, **TOL)


def test_pfedbred_meg_on_first_participation_is_pfedme():
    """mu = w when theta = memory = w, and the w-step lam * (mu - theta) is then pFedMe's lam * (w - theta)."""
    data = image_set(BATCH, seed=3)
    trainer = tiny_trainer()
    w = perturbed(trainer.model, seed=2)
    bred = make(PFedBreD, trainer, prior="meg").client_update(client(0, data), w, seed=0)
    me = make(PFedMe, trainer).client_update(client(0, data), w, seed=0)
    assert_close(bred.upload, me.upload, **TOL)


def test_pfedbred_rejects_an_unknown_prior():
    trainer = tiny_trainer()
    with pytest.raises(ConfigError, match="lg, meg, mh"):
        make(PFedBreD, trainer, prior="median")
    with pytest.raises(ConfigError, match="prior-eta"):
        make(PFedBreD, trainer, prior_eta=-1.0)


# ---------------------------------------------------------------- server step (pFedMe Alg. 1; pFedBreD line 12)


def server_problem(trainer):
    """A global state and three uploads whose parameters and running statistics all differ."""
    names = set(names_of(trainer))
    states = [perturbed(trainer.model, seed=s) for s in (1, 2, 3, 4)]
    floats = [k for k, v in states[0].items() if k not in names and v.is_floating_point()]
    integers = [k for k, v in states[0].items() if not v.is_floating_point()]
    assert floats and integers
    for index, state in enumerate(states):
        for key in floats:
            state[key] = state[key] + 0.1 * (index + 1)
        for key in integers:
            state[key] = torch.tensor(10 * (index + 1))
    global_state, uploads = states[0], states[1:]
    updates = [ClientUpdate(i, upload, n) for i, (upload, n) in enumerate(zip(uploads, [1, 50, 7], strict=True))]
    return global_state, uploads, updates, floats, integers


@pytest.mark.parametrize("cls", [PFedMe, PFedBreD])
@pytest.mark.parametrize(("beta", "am", "effective"), [(1.0, False, 1.0), (0.7, False, 0.7), (0.7, True, 2.0)])
def test_server_step_is_a_beta_step_towards_the_uniform_mean(cls, beta, am, effective):
    trainer = tiny_trainer()
    global_state, uploads, updates, floats, integers = server_problem(trainer)
    method = make(cls, trainer, beta=beta, am=am)

    new_state, info = method.server_update(global_state, updates, seed=0, round_index=0)

    assert info == {} and new_state.keys() == global_state.keys()
    for name in names_of(trainer):
        mean = (uploads[0][name] + uploads[1][name] + uploads[2][name]) / 3  # uniform, not by sample counts
        assert_close(new_state[name], (1 - effective) * global_state[name] + effective * mean, **TOL)
    for key in floats:  # running statistics: the plain mean, whatever beta
        assert_close(new_state[key], (uploads[0][key] + uploads[1][key] + uploads[2][key]) / 3, **TOL)
    for key in integers:
        assert new_state[key].item() == 20


def test_am_overrides_beta():
    trainer = tiny_trainer()
    global_state, _, updates, _, _ = server_problem(trainer)
    plain, _ = make(PFedBreD, trainer, beta=1.0).server_update(global_state, updates, seed=0, round_index=0)
    am, _ = make(PFedBreD, trainer, beta=1.0, am=True).server_update(global_state, updates, seed=0, round_index=0)
    name = names_of(trainer)[0]
    assert_close(am[name], 2 * plain[name] - global_state[name], **TOL)  # w + 2 (mean - w)
    assert not torch.allclose(am[name], plain[name])


def test_parameter_counts_are_two_models_trained_one_sent():
    trainer = tiny_trainer()
    n = trainer.model.num_trainable()
    for cls in (PFedMe, PFedBreD):
        assert make(cls, trainer).parameter_counts() == {"personalized": n, "trained": 2 * n, "communicated": n}
        assert cls.default_scope == "full" and cls.uses_proximal


# ---------------------------------------------------------------- the command line


@pytest.mark.parametrize(
    "extra", [("--method", "pfedme"), ("--method", "pfedbred"), ("--method", "pfedbred", "--prior", "lg", "--am")]
)
def test_one_round_cli_run(extra, fmnist_dir, tmp_path, capsys, monkeypatch, home):
    run = tmp_path / "run"
    small = ("--rounds", "1", "--limit-samples", "400", "--eval-every", "0")
    code, _, err = run_cli(tiny_args(fmnist_dir, run, *extra, *small), capsys, monkeypatch)
    assert code == 0, err
    for client_id in range(4):
        assert any((run / "clients" / str(client_id)).iterdir())
    report = json.loads((run / "report.json").read_text())
    assert report["method"] == extra[1] and len(report["personalized"]["local_test"]["per_client"]) == 4
    saved = json.loads((run / "config.json").read_text())["config"]["method"]
    assert saved["scope"] is None and saved["prior"] == ("lg" if "lg" in extra else "mh")
    assert saved["am"] == ("--am" in extra)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 1 and metrics[0]["local_loss"] > 0


def test_cli_rejects_an_unknown_prior(fmnist_dir, tmp_path, capsys, monkeypatch, home):
    args = tiny_args(fmnist_dir, tmp_path / "run", "--method", "pfedbred", "--prior", "median", "--rounds", "1")
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 2
    assert "unknown --prior 'median'" in err
    assert not (tmp_path / "run" / "config.json").exists()
