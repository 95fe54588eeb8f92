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
from safetensors.torch import load_file
from torch.testing import assert_close

from peradapt.compute.costs import elements
from peradapt.config import MethodConfig
from peradapt.errors import ConfigError
from peradapt.methods import ClientUpdate, MethodContext
from peradapt.methods.base import PERSONAL_KEY, build_method
from peradapt.methods.pfedbred import MEMORY_KEY, PFedBreD
from peradapt.methods.pfedme import PFedMe
from peradapt.rundir.checkpoint import load_latest_checkpoint
from peradapt.rundir.store import ClientStore
from peradapt.seeds import LOCAL, derive_seed

from .conftest import measured_counts, method_config
from .test_cli import expect_user_error, run_cli, tiny_args
from .test_perada import BATCH, TOL, assign, client, image_set, normalized, perturbed, tiny_trainer, train_mode

pytestmark = pytest.mark.usefixtures("one_thread")

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
    shared, own = method_config(cls, **settings)
    return cls(MethodContext(shared, trainer, ClientStore(), trainer.model.state(), None, settings=own))


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


def batches_of(trainer, data, seed=0, epochs=1, steps=None):
    """The minibatches (order and all) that the client sees with this round seed."""
    return list(trainer.minibatches(data, epochs=epochs, steps=steps, seed=derive_seed(seed, LOCAL)))


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


def hand_mh_code(trainer, w, theta0, memory, batches):
    """The authors' code's mh (pFedBreD_public, pFedBreD_ns_mh), local step r on consecutive minibatches D, D':
    w <- w - eta_a grad f(w - eta_a grad f(w; D); D'); mu = w - eta (w_mem - theta_{r-1}); K inner steps on D'
    from that w; w <- w - alpha_m lam (mu - theta_r)."""
    names = names_of(trainer)
    module = module_at(trainer, w)
    set_params(module, theta0)
    local = {n: w[n].clone() for n in names}
    assert len(batches) % 2 == 0
    for (images1, labels1), (images2, labels2) in zip(batches[::2], batches[1::2], strict=True):
        theta = values(module, names)  # theta_{r-1}
        set_params(module, local)
        at_w = grad_f(module, images1, labels1)
        set_params(module, {n: local[n] - PRIOR_LR * at_w[n] for n in names})  # the look-ahead point
        look_ahead = grad_f(module, images2, labels2)
        local = {n: local[n] - PRIOR_LR * look_ahead[n] for n in names}  # w takes the step itself
        mu = {n: local[n] - PRIOR_ETA * (memory[n] - theta[n]) for n in names}
        set_params(module, local)  # the inner problem starts at the stepped w, not at theta_{r-1}
        hand_inner(module, images2, labels2, anchor=mu)
        theta = values(module, names)
        local = {n: local[n] - LR * LAM * (mu[n] - theta[n]) for n in names}
    personal = values(module, w)
    return personal, {**personal, **local}


def counting(trainer):
    """Record every minibatch the trainer hands out (to count the local work)."""
    drawn, original = [], trainer.minibatches

    def minibatches(*args, **kwargs):
        for batch in original(*args, **kwargs):
            drawn.append(batch)
            yield batch

    trainer.minibatches = minibatches
    return drawn


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

    mu = method.prior_mean(local, memory, [(images, labels)])

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
    assert method.settings.prior == "mh"

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


# ---------------------------------------------------------------- pFedBreD mh as the authors' code (Eq. 24)


def test_mh_code_local_step_takes_the_look_ahead_gradient_on_a_second_minibatch():
    trainer = tiny_trainer()
    data = image_set(2 * BATCH, seed=3)
    w, theta0, memory = (perturbed(trainer.model, seed=s) for s in (2, 6, 7))
    method = make(PFedBreD, trainer, prior="mh-code", local_steps=1)
    method.store.put(4, PERSONAL_KEY, theta0)
    method.store.put(4, MEMORY_KEY, memory)
    drawn = counting(trainer)

    update = method.client_update(client(4, data), w, seed=0)

    used = list(drawn)
    batches = batches_of(trainer, data, steps=2)  # one local step reads two minibatches
    assert len(used) == 2 and all(torch.equal(a[0], b[0]) for a, b in zip(used, batches, strict=True))
    personal, upload = hand_mh_code(trainer, w, theta0, memory, batches)
    assert_close(update.upload, upload, **TOL)
    assert_close(method.store.get(4, PERSONAL_KEY), personal, **TOL)
    assert_close(method.store.get(4, MEMORY_KEY), upload, **TOL)
    # Not Eq. (14)'s mh on either minibatch.
    names = names_of(trainer)
    for batch in batches:
        _, eq14 = hand_pfedbred(trainer, "mh", w, theta0, memory, [batch])
        assert differs(update.upload, eq14, names)


def test_mh_code_pairs_consecutive_minibatches_over_two_passes_per_local_epoch():
    """E = 1 pass of 2 minibatches gives R = 2 local steps, so mh-code reads 4 minibatches (2 passes)."""
    trainer = tiny_trainer()
    data = image_set(2 * BATCH, seed=4)
    w = perturbed(trainer.model, seed=2)
    method = make(PFedBreD, trainer, prior="mh-code")
    drawn = counting(trainer)

    update = method.client_update(client(3, data), w, seed=1)

    used = len(drawn)
    batches = batches_of(trainer, data, seed=1, epochs=2)
    assert used == len(batches) == 4
    personal, upload = hand_mh_code(trainer, w, w, w, batches)  # first time trained: theta = memory = w
    assert_close(update.upload, upload, **TOL)
    assert_close(method.personalized(3, w), personal, **TOL)


# ---------------------------------------------------------------- --local-steps: R outer local steps


def test_local_steps_runs_exactly_that_many_local_steps():
    trainer = tiny_trainer()
    data = image_set(2 * BATCH, seed=4)  # 2 minibatches per pass: 3 steps run into a second pass
    w = perturbed(trainer.model, seed=2)
    for cls, prior, per_step in ((PFedMe, "mh", 1), (PFedBreD, "mh", 1), (PFedBreD, "mh-code", 2)):
        trainer = tiny_trainer()
        method = make(cls, trainer, prior=prior, local_steps=3, local_epochs=5)
        drawn = counting(trainer)

        update = method.client_update(client(1, data), w, seed=5)

        assert len(drawn) == 3 * per_step, (cls.name, prior)
        assert len(update.metrics) == 1 and update.metrics["local_loss"] > 0
    # the pFedMe upload is exactly 3 local steps' worth (hand computation on the same 3 minibatches)
    trainer = tiny_trainer()
    update = make(PFedMe, trainer, local_steps=3).client_update(client(1, data), w, seed=5)
    _, upload = hand_pfedme(trainer, w, batches_of(trainer, data, seed=5, steps=3))
    assert_close(update.upload, upload, **TOL)
    _, four = hand_pfedme(trainer, w, batches_of(trainer, data, seed=5, steps=4))
    assert differs(update.upload, four, names_of(trainer))


# ---------------------------------------------------------------- who trains (Algorithm 1, line 4: all N clients)


def test_every_federated_client_trains_unless_train_clients_sampled():
    trainer = tiny_trainer()
    sampled, federated = [3, 1], [0, 1, 2, 3]
    for cls in (PFedMe, PFedBreD):
        assert make(cls, trainer).clients_to_train(sampled, federated) == federated
        assert make(cls, trainer, train_clients="all").clients_to_train(sampled, federated) == federated
        assert make(cls, trainer, train_clients="sampled").clients_to_train(sampled, federated) == sampled


def test_other_methods_train_the_sample_and_refuse_train_clients_all():
    trainer = tiny_trainer()

    def context(**settings):
        return MethodContext(MethodConfig(**settings), trainer, ClientStore(), trainer.model.state(), None)

    assert build_method("fedavg", context()).clients_to_train([2], [0, 1, 2]) == [2]
    assert build_method("fedavg", context(train_clients="sampled")).clients_to_train([2], [0, 1, 2]) == [2]
    with pytest.raises(ConfigError, match="--train-clients all: --method fedavg"):
        build_method("fedavg", context(train_clients="all"))
    assert build_method("pfedme", context(train_clients="all")).clients_to_train([2], [0, 1, 2]) == [0, 1, 2]


# ---------------------------------------------------------------- server step (pFedMe Alg. 1; pFedBreD line 12)


def server_problem(trainer, seeds=(1, 2, 3, 4), sizes=(1, 50, 7)):
    """A global state (from seeds[0]) and uploads (one per further seed, with `sizes` samples) whose parameters and
    running statistics all differ."""
    names = set(names_of(trainer))
    states = [perturbed(trainer.model, seed=s) for s in seeds]
    floats = [k for k, v in states[0].items() if k not in names and v.is_floating_point()]
    integers = [k for k, v in states[0].items() if not v.is_floating_point()]
    assert floats and integers
    for index, state in enumerate(states):
        for key in floats:
            state[key] = state[key] + 0.1 * (index + 1)
        for key in integers:
            state[key] = torch.tensor(10 * (index + 1))
    global_state, uploads = states[0], states[1:]
    updates = [ClientUpdate(i, upload, n) for i, (upload, n) in enumerate(zip(uploads, sizes, strict=True))]
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


@pytest.mark.parametrize("cls", [PFedMe, PFedBreD])
def test_aggregation_samples_weighs_the_mean_by_training_set_size(cls):
    """The authors' codes' server mean: sum_i n_i w_i / sum_i n_i over the sampled clients, then the beta-step."""
    trainer = tiny_trainer()
    global_state, uploads, updates, floats, _ = server_problem(trainer)
    method = make(cls, trainer, beta=0.7, aggregation="samples")

    new_state, _ = method.server_update(global_state, updates, seed=0, round_index=0)

    counts = [1, 50, 7]
    for name in names_of(trainer):
        mean = sum(n * upload[name] for n, upload in zip(counts, uploads, strict=True)) / sum(counts)
        assert_close(new_state[name], 0.3 * global_state[name] + 0.7 * mean, **TOL)
    for key in floats:
        assert_close(new_state[key], sum(n * u[key] for n, u in zip(counts, uploads, strict=True)) / 58, **TOL)
    uniform, _ = make(cls, trainer, beta=0.7).server_update(global_state, updates, seed=0, round_index=0)
    assert differs(new_state, uniform, names_of(trainer))


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
    n, whole = trainer.model.num_trainable(), elements(trainer.model.state())
    data = image_set(BATCH, seed=3)
    for cls in (PFedMe, PFedBreD):
        counts = measured_counts(make(cls, trainer), client(0, data), trainer.model.state())
        assert counts == {"personalized": whole, "trained": 2 * n, "communicated": whole}  # theta_i and w_i
        assert cls.default_scope == "full" and cls.uses_proximal


# ---------------------------------------------------------------- the command line


SMALL = ("--rounds", "1", "--limit-samples", "400", "--eval-every", "0")


def cli_run(fmnist_dir, run, capsys, monkeypatch, *extra):
    """A 1-round run of 4 clients, 2 sampled: its metrics and its round checkpoint's tensors."""
    code, _, err = run_cli(tiny_args(fmnist_dir, run, *extra, *SMALL), capsys, monkeypatch)
    assert code == 0, err
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    tensors, _ = load_latest_checkpoint(run / "checkpoints")
    return metrics, tensors


def stored(tensors, prefix):
    return {name[len(prefix) :]: tensor for name, tensor in tensors.items() if name.startswith(prefix)}


def exports(run):
    """The run's exported full models: each client's personalized model and the global one."""
    models = {c: load_file(str(run / "clients" / str(c) / "model.safetensors")) for c in range(4)}
    return {**models, "global": load_file(str(run / "global" / "model.safetensors"))}


@pytest.mark.parametrize(
    "extra",
    [("--method", "pfedme"), ("--method", "pfedbred", "--prior", "mh-code", "--am", "--local-steps", "2")],
)
def test_one_round_cli_run_exports_every_clients_model(extra, fmnist_dir, tmp_path, capsys, monkeypatch, home):
    run = tmp_path / "run"
    metrics, _ = cli_run(fmnist_dir, run, capsys, monkeypatch, *extra)
    for client_id in range(4):
        assert (run / "clients" / str(client_id) / "model.safetensors").is_file()  # full scope: the whole model
    report = json.loads((run / "report.json").read_text())
    assert report["method"] == extra[1] and len(report["personalized"]["local_test"]["per_client"]) == 4
    saved = json.loads((run / "config.json").read_text())["config"]["method"]
    prior = "mh-code" if "mh-code" in extra else "mh"
    assert saved["scope"] is None and saved.get("prior") == (prior if extra[1] == "pfedbred" else None)  # its own
    assert saved["am"] == ("--am" in extra) and saved["train_clients"] is None
    assert len(metrics) == 1 and metrics[0]["local_loss"] > 0
    assert len(metrics[0]["clients"]) == 2 and metrics[0]["trained_clients"] == 4  # all trained, 2 aggregated


def test_every_client_trains_and_the_server_averages_only_the_sample(fmnist_dir, tmp_path, capsys, monkeypatch, home):
    """pFedBreD (beta = 1): w^1 is the uniform mean of the sampled clients' uploads (each client's memorized
    w_{i,R}); with --train-clients sampled the others keep no state and are exported with the global model."""
    metrics, tensors = cli_run(fmnist_dir, tmp_path / "all", capsys, monkeypatch, "--method", "pfedbred")
    sampled = metrics[0]["clients"]
    unsampled = sorted(set(range(4)) - set(sampled))
    uploads = {c: stored(tensors, f"clients/{c}/{MEMORY_KEY}/") for c in range(4)}
    global_state = stored(tensors, "global/")
    assert all(uploads.values()) and all(stored(tensors, f"clients/{c}/{PERSONAL_KEY}/") for c in unsampled)
    floats = [key for key, value in global_state.items() if value.is_floating_point()]
    for key in floats:
        assert_close(global_state[key], sum(uploads[c][key] for c in sampled) / len(sampled), **TOL)
    assert any(not torch.allclose(global_state[k], sum(u[k] for u in uploads.values()) / 4) for k in floats)
    exported = exports(tmp_path / "all")
    for c in unsampled:  # trained though not aggregated: its theta moved away from the global model
        assert differs(exported[c], exported["global"], floats)

    run = tmp_path / "sampled"
    metrics, tensors = cli_run(
        fmnist_dir, run, capsys, monkeypatch, "--method", "pfedbred", "--train-clients", "sampled"
    )
    assert metrics[0]["clients"] == sampled and "trained_clients" not in metrics[0]  # same seed, same sample
    assert all(stored(tensors, f"clients/{c}/{MEMORY_KEY}/") for c in sampled)
    assert not any(stored(tensors, f"clients/{c}/") for c in unsampled)
    exported = exports(run)
    for c in unsampled:  # never trained: evaluated and exported with the global model
        assert_close(exported[c], exported["global"])
    assert differs(exported[sampled[0]], exported["global"], floats)


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--method", "pfedbred", "--prior", "median"], ["unknown --prior 'median'", "mh-code"]),
        (["--method", "pfedme", "--train-clients", "everyone"], ["unknown --train-clients 'everyone'", "sampled"]),
        (["--method", "fedavg", "--train-clients", "all"], ["--train-clients all", "fedavg"]),
    ],
)
def test_bad_settings_exit_2_in_one_line_and_write_nothing(
    extra, needles, fmnist_dir, tmp_path, capsys, monkeypatch, home
):
    run = tmp_path / "run"
    expect_user_error(tiny_args(fmnist_dir, run, *extra, "--rounds", "1"), capsys, monkeypatch, *needles)
    assert not run.exists()
