"""FedDyn (Acar et al. 2021, Algorithm 1) and Per-FedAvg (Fallah et al. 2020, Algorithm 1) against hand computations.

Every expected value is recomputed here with plain torch autograd on a copy of the tiny model (or on an MLP written
out from its flat parameters, with its whole Hessian), from the papers' objectives and update rules, never by calling
the methods' code.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from torch.testing import assert_close

from peradapt.adapters import inject_adapters
from peradapt.compute.trainer import InputPipeline, LocalTrainer
from peradapt.data import ClientData, ImageSet
from peradapt.errors import ConfigError
from peradapt.methods import MethodContext
from peradapt.methods.feddyn import GRADIENT_KEY, FedDyn
from peradapt.methods.perfedavg import PerFedAvg
from peradapt.rundir.store import ClientStore
from peradapt.seeds import FINETUNE, LOCAL, derive_seed

from .conftest import method_config
from .test_cli import crash_after_round, expect_user_error, results, run_cli, tiny_args
from .test_perada import BATCH, TOL, image_set, normalized, perturbed, tiny_trainer
from .test_pfedme_pfedbred import module_at, names_of, params, server_problem, set_params, values

pytestmark = pytest.mark.usefixtures("one_thread")

LR, ALPHA, DYN_ALPHA, DELTA = 0.1, 0.05, 0.3, 1e-3


def make(cls, trainer, clients=(), federated=None, **overrides):
    settings = {
        "local_epochs": 1,
        "lr": LR,
        "personal_lr": ALPHA,
        "batch_size": BATCH,
        "feddyn_alpha": DYN_ALPHA,
        "perfedavg_delta": DELTA,
        **overrides,
    }
    shared, own = method_config(cls, **settings)
    context = MethodContext(shared, trainer, ClientStore(), trainer.model.state(), None, clients, 0, federated, own)
    return cls(context)


def client_of(client_id, data):
    indices = np.arange(len(data))
    return ClientData(client_id, data, data, indices, indices)


# ---------------------------------------------------------------- the hand computations


def grad_of(module, loss):
    named = params(module)
    return dict(zip(named, torch.autograd.grad(loss, list(named.values())), strict=True))


def grad_f(module, images, labels):
    """grad of the minibatch cross-entropy at the module's current parameters."""
    return grad_of(module, F.cross_entropy(module(images), labels))


def batches_of(trainer, data, seed, epochs=1, steps=None):
    """The minibatches (order and all) that the client sees with this round seed."""
    return list(trainer.minibatches(data, epochs=epochs, steps=steps, seed=derive_seed(seed, LOCAL)))


def differs(a, b, names):
    return any(not torch.allclose(a[n], b[n], atol=1e-5) for n in names)


def hand_feddyn_client(trainer, theta_prev, gradient, batches, alpha):
    """SGD on L_k(theta) - <grad L_k(theta_k^{t-1}), theta> + alpha/2 ||theta - theta^{t-1}||^2 (Algorithm 1),
    then grad L_k(theta_k^t) = grad L_k(theta_k^{t-1}) - alpha (theta_k^t - theta^{t-1})."""
    module = module_at(trainer, theta_prev)
    for images, labels in batches:
        named = params(module)
        linear = sum((gradient[n] * p).sum() for n, p in named.items())
        quadratic = sum(((p - theta_prev[n]) ** 2).sum() for n, p in named.items())
        objective = F.cross_entropy(module(images), labels) - linear + alpha / 2 * quadratic
        grads = grad_of(module, objective)
        with torch.no_grad():
            for name, parameter in named.items():
                parameter.sub_(LR * grads[name])
    local = values(module, theta_prev)
    return local, {n: gradient[n] - alpha * (local[n] - theta_prev[n]) for n in gradient}


def hand_perfedavg(trainer, w_state, groups, variant):
    """Algorithm 1, lines 8-10: w~ = w - alpha grad f(w; D), then w - beta g (fo), w - beta (g - alpha d) (hf), or
    w - beta (g - alpha hess f(w; D'') g) (exact: the gradient of <grad f(w; D''), g>)."""
    names = names_of(trainer)
    module = module_at(trainer, w_state)
    for group in groups:
        w = values(module, names)
        grads = grad_f(module, *group[0])
        set_params(module, {n: w[n] - ALPHA * grads[n] for n in names})
        g = grad_f(module, *group[1])
        if variant == "hf":
            set_params(module, {n: w[n] + DELTA * g[n] for n in names})
            plus = grad_f(module, *group[2])
            set_params(module, {n: w[n] - DELTA * g[n] for n in names})
            minus = grad_f(module, *group[2])
            g = {n: g[n] - ALPHA * (plus[n] - minus[n]) / (2 * DELTA) for n in names}
        if variant == "exact":
            set_params(module, w)
            named = params(module)
            gradient = torch.autograd.grad(
                F.cross_entropy(module(group[2][0]), group[2][1]), list(named.values()), create_graph=True
            )
            directional = sum((grad * g[n]).sum() for grad, n in zip(gradient, named, strict=True))
            product = dict(zip(named, torch.autograd.grad(directional, list(named.values())), strict=True))
            g = {n: g[n] - ALPHA * product[n] for n in names}
        set_params(module, {n: w[n] - LR * g[n] for n in names})
    return values(module, w_state)


def test_feddyn_client_step_solves_the_dynamically_regularized_problem_and_updates_its_gradient():
    trainer = tiny_trainer()
    data = image_set(2 * BATCH, seed=3)
    theta_prev = perturbed(trainer.model, seed=2)
    names = names_of(trainer)
    batches = batches_of(trainer, data, seed=4)
    assert len(batches) == 2

    first = make(FedDyn, trainer, federated=4)
    update = first.client_update(client_of(1, data), theta_prev, seed=4)
    zero = {n: torch.zeros_like(theta_prev[n]) for n in names}
    local, gradient = hand_feddyn_client(trainer, theta_prev, zero, batches, DYN_ALPHA)  # grad L_k(theta_k^0) = 0
    assert (update.client_id, update.num_samples) == (1, 2 * BATCH)
    assert_close(update.upload, local, **TOL)
    assert_close(first.store.get(1, GRADIENT_KEY), gradient, **TOL)
    assert first.personalized(1, theta_prev) is theta_prev  # evaluated with the global model

    # A client that took part before: its stored gradient enters as the linear term.
    stored = {n: 0.5 * torch.randn(theta_prev[n].shape, generator=torch.Generator().manual_seed(7)) for n in names}
    later = make(FedDyn, trainer, federated=4)
    later.store.put(1, GRADIENT_KEY, stored)
    update_later = later.client_update(client_of(1, data), theta_prev, seed=4)
    local_later, gradient_later = hand_feddyn_client(trainer, theta_prev, stored, batches, DYN_ALPHA)
    assert_close(update_later.upload, local_later, **TOL)
    assert_close(later.store.get(1, GRADIENT_KEY), gradient_later, **TOL)
    assert differs(update_later.upload, update.upload, names)


def test_feddyn_by_size_scales_alpha_by_the_mean_sample_count_over_the_clients_own():
    trainer = tiny_trainer()
    sets = [image_set(n, seed=3 + i) for i, n in enumerate((BATCH, 2 * BATCH, 3 * BATCH))]
    clients = [client_of(i, s) for i, s in enumerate(sets)]
    theta_prev = perturbed(trainer.model, seed=2)
    zero = {n: torch.zeros_like(theta_prev[n]) for n in names_of(trainer)}
    method = make(FedDyn, trainer, clients=clients, federated=3, feddyn_client_alpha="by-size")

    update = method.client_update(clients[2], theta_prev, seed=1)

    alpha_2 = DYN_ALPHA * (2 * BATCH) / (3 * BATCH)  # the authors' alpha / (n_k / mean n)
    batches = batches_of(trainer, sets[2], seed=1)
    local, gradient = hand_feddyn_client(trainer, theta_prev, zero, batches, alpha_2)
    assert_close(update.upload, local, **TOL)
    assert_close(method.store.get(2, GRADIENT_KEY), gradient, **TOL)
    uniform = make(FedDyn, trainer, clients=clients, federated=3)
    assert differs(uniform.client_update(clients[2], theta_prev, seed=1).upload, update.upload, names_of(trainer))
    assert differs(uniform.store.get(2, GRADIENT_KEY), gradient, names_of(trainer))


def test_feddyn_rejects_an_unknown_client_alpha():  # numeric ranges: TrainConfig.validate (test_validation.py)
    trainer = tiny_trainer()
    with pytest.raises(ConfigError, match="uniform, by-size"):
        make(FedDyn, trainer, feddyn_client_alpha="weighted")


# ---------------------------------------------------------------- FedDyn server step (Algorithm 1, lines 9-10)


def test_feddyn_server_keeps_h_over_all_m_clients_and_corrects_the_mean():
    trainer = tiny_trainer()
    names = names_of(trainer)
    m = 5  # clients in the federation; 2 are sampled
    theta_0, uploads, updates, floats, integers = server_problem(trainer, seeds=(1, 2, 3), sizes=(1, 50))
    method = make(FedDyn, trainer, federated=m)
    assert method.server_state() == {}

    theta_1, info = method.server_update(theta_0, updates, seed=0, round_index=0)

    h_1 = {n: -DYN_ALPHA / m * ((uploads[0][n] - theta_0[n]) + (uploads[1][n] - theta_0[n])) for n in names}
    assert info == {} and theta_1.keys() == theta_0.keys()
    for n in names:  # uniform mean of the sampled models, whatever their sample counts, minus h / alpha
        assert_close(theta_1[n], (uploads[0][n] + uploads[1][n]) / 2 - h_1[n] / DYN_ALPHA, **TOL)
    for key in floats:  # running statistics: the plain mean, no h
        assert_close(theta_1[key], (uploads[0][key] + uploads[1][key]) / 2, **TOL)
    for key in integers:
        assert theta_1[key].item() == 20  # the first upload's
    assert_close(method.server_state(), h_1, **TOL)

    # Round 2: h accumulates; a server restored from the saved state continues exactly, a fresh one does not.
    _, uploads_2, updates_2, _, _ = server_problem(trainer, seeds=(1, 8, 9), sizes=(1, 50))
    theta_2, _ = method.server_update(theta_1, updates_2, seed=0, round_index=1)
    h_2 = {n: h_1[n] - DYN_ALPHA / m * sum(u[n] - theta_1[n] for u in uploads_2) for n in names}
    for n in names:
        assert_close(theta_2[n], (uploads_2[0][n] + uploads_2[1][n]) / 2 - h_2[n] / DYN_ALPHA, **TOL)
    restored = make(FedDyn, trainer, federated=m)
    restored.load_server_state(h_1)
    assert_close(restored.server_update(theta_1, updates_2, seed=0, round_index=1)[0], theta_2, **TOL)
    fresh, _ = make(FedDyn, trainer, federated=m).server_update(theta_1, updates_2, seed=0, round_index=1)
    assert differs(fresh, theta_2, names)


# ---------------------------------------------------------------- Per-FedAvg client step (Algorithm 1, lines 8-10)


@pytest.mark.parametrize("variant", ["fo", "hf", "exact"])
def test_perfedavg_local_steps_on_independent_minibatches(variant):
    trainer = tiny_trainer()
    data = image_set(3 * BATCH, seed=3)
    w = perturbed(trainer.model, seed=2)
    per_step = {"fo": 2, "hf": 3, "exact": 3}[variant]
    method = make(PerFedAvg, trainer, perfedavg_variant=variant, local_steps=2)

    update = method.client_update(client_of(4, data), w, seed=5)

    batches = batches_of(trainer, data, seed=5, steps=2 * per_step)  # tau = 2 local steps
    groups = [batches[i : i + per_step] for i in range(0, len(batches), per_step)]
    assert (update.client_id, update.num_samples) == (4, 3 * BATCH)
    assert_close(update.upload, hand_perfedavg(trainer, w, groups, variant), **TOL)
    other = "hf" if variant == "fo" else "fo"
    unlike = make(PerFedAvg, trainer, perfedavg_variant=other, local_steps=2).client_update(client_of(4, data), w, 5)
    assert differs(update.upload, unlike.upload, names_of(trainer))


def test_perfedavg_epochs_give_a_local_step_per_minibatch_of_an_epoch():
    trainer = tiny_trainer()
    data = image_set(2 * BATCH, seed=3)  # 2 minibatches per epoch: 2 local steps of 3 minibatches (hf)
    w = perturbed(trainer.model, seed=2)
    update = make(PerFedAvg, trainer).client_update(client_of(0, data), w, seed=1)  # hf, the default

    batches = batches_of(trainer, data, seed=1, epochs=3)
    assert len(batches) == 6
    assert_close(update.upload, hand_perfedavg(trainer, w, [batches[:3], batches[3:]], "hf"), **TOL)


def test_perfedavg_hf_difference_approximates_the_hessian_vector_product_of_algorithm_1():
    """d ~= hess f(w; D'') g: the HF update approximates line 10 as printed, here, where no ReLU of this tiny net
    changes sides between w - delta g and w + delta g (where one does: the kinked MLP below)."""
    trainer = tiny_trainer()
    data = image_set(BATCH, seed=3)
    w = perturbed(trainer.model, seed=2)
    names = names_of(trainer)
    images, labels = normalized(data.images), data.labels
    g = {n: 0.1 * torch.randn(w[n].shape, generator=torch.Generator().manual_seed(6)) for n in names}
    method = make(PerFedAvg, trainer)  # delta = 1e-3
    trainer.model.load_state(w)
    trainer.model.train()

    d = method.hessian_free_product({n: w[n] for n in names}, g, (images, labels))

    module = module_at(trainer, w)
    named = params(module)
    gradient = torch.autograd.grad(F.cross_entropy(module(images), labels), list(named.values()), create_graph=True)
    directional = sum((grad * g[n]).sum() for grad, n in zip(gradient, named, strict=True))
    exact = dict(zip(named, torch.autograd.grad(directional, list(named.values())), strict=True))
    norm = lambda tensors: torch.sqrt(sum((t**2).sum() for t in tensors.values()))  # noqa: E731
    assert norm({n: d[n] - exact[n] for n in names}) < 1e-2 * norm(exact)
    assert norm(exact) > 1e-2 * norm(g)  # the Hessian term is not negligible here


def test_perfedavg_rejects_an_unknown_variant():  # numeric ranges: TrainConfig.validate (test_validation.py)
    with pytest.raises(ConfigError, match="fo, hf, exact"):
        make(PerFedAvg, tiny_trainer(), perfedavg_variant="so")


# ---------------------------------------------------------------- Per-FedAvg's line 10 with the Hessian formed in full

PIXELS, HIDDEN, CLASSES = 3, 4, 3  # a 9-4-3 MLP on 3 x 3 grey images: 55 parameters, a 55 x 55 Hessian
SHAPES = ((HIDDEN, PIXELS**2), (HIDDEN,), (CLASSES, HIDDEN), (CLASSES,))  # W1, b1, W2, b2: nn.Sequential's order
SIZES = [int(np.prod(shape)) for shape in SHAPES]
BIAS_0 = SIZES[0]  # b1[0] in the flat parameters


def mlp_loss(theta, images, labels, activation):
    """f(theta; batch): the MLP's cross-entropy written out from its flat parameters theta = (W1, b1, W2, b2)."""
    w1, b1, w2, b2 = (chunk.view(shape) for chunk, shape in zip(theta.split(SIZES), SHAPES, strict=True))
    return F.cross_entropy(activation(images.flatten(1) @ w1.T + b1) @ w2.T + b2, labels)


def line_10(theta, batches, activation):
    """One local step of Algorithm 1 in float64 from w = theta: w~ = w - alpha grad f(w; D), g = grad f(w~; D'),
    then w - beta (I - alpha H) g with H = hess f(w; D''), the whole 55 x 55 matrix. Returns the step, H g and g."""
    (images, labels), (images_1, labels_1), (images_2, labels_2) = batches
    grad_f = torch.func.grad(mlp_loss)
    g = grad_f(theta - ALPHA * grad_f(theta, images, labels, activation), images_1, labels_1, activation)
    hessian = torch.autograd.functional.hessian(lambda t: mlp_loss(t, images_2, labels_2, activation), theta)
    assert hessian.shape == (theta.numel(), theta.numel())
    return theta - LR * (g - ALPHA * hessian @ g), hessian @ g, g


def kinked_problem(activation):
    """The MLP with `activation` on a client, one local step's minibatches D, D', D'' (float64) and parameters w at
    which hidden unit 0 of the first image of D'' is off its kink at 0 by half of what the difference steps
    +- delta g move it: a ReLU there is on at w and on one of w +- delta g, off at the other. Also unit 0's input
    as a function of the flat parameters."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Flatten(), nn.Linear(PIXELS**2, HIDDEN), activation(), nn.Linear(HIDDEN, CLASSES))
    pipeline = InputPipeline(mean=(0.5,), std=(0.5,), device=torch.device("cpu"))
    trainer = LocalTrainer(inject_adapters(module, "none", dropout=0.0, lora_rank=2, scope="full"), pipeline, BATCH)
    generator = torch.Generator().manual_seed(3)
    images = torch.randint(0, 256, (3 * BATCH, 1, PIXELS, PIXELS), dtype=torch.uint8, generator=generator)
    data = ImageSet(images, torch.randint(0, CLASSES, (3 * BATCH,), generator=generator), CLASSES)
    batches = [(inputs.double(), labels) for inputs, labels in batches_of(trainer, data, seed=5, steps=3)]
    theta = torch.randn(sum(SIZES), generator=generator, dtype=torch.float64)
    image = batches[2][0][0].flatten()
    unit = lambda t: t[: PIXELS**2] @ image + t[BIAS_0]  # noqa: E731  (W1[0] . x + b1[0])
    theta[BIAS_0] -= unit(theta)  # on the kink
    _, _, g = line_10(theta, batches, activation())
    theta[BIAS_0] += DELTA * abs(torch.func.jvp(unit, (theta,), (g,))[1]) / 2
    return trainer, client_of(0, data), theta, batches, unit


def step_of(trainer, client, theta, variant):
    """The flat parameters one local step of `variant` uploads from the flat theta."""
    names = names_of(trainer)
    state = {
        name: chunk.float().view(shape) for name, chunk, shape in zip(names, theta.split(SIZES), SHAPES, strict=True)
    }
    upload = make(PerFedAvg, trainer, perfedavg_variant=variant, local_steps=1).client_update(client, state, 5).upload
    return torch.cat([upload[name].double().flatten() for name in names])


@pytest.mark.parametrize("activation", [nn.Tanh, nn.ReLU])
def test_perfedavg_exact_step_is_line_10_with_the_hessian_formed_in_full(activation):
    trainer, client, theta, batches, _ = kinked_problem(activation)

    step = step_of(trainer, client, theta, "exact")

    expected, _, _ = line_10(theta, batches, activation())
    assert_close(step, expected, **TOL)
    assert not torch.allclose(step_of(trainer, client, theta, "fo"), expected, **TOL)  # the Hessian term counts


def test_perfedavg_hf_differs_from_line_10_where_a_relu_unit_changes_sides():
    """The central difference d = [grad f(w + delta g) - grad f(w - delta g)] / (2 delta) is H g only where the
    gradient is smooth: with a ReLU on at one of w +- delta g and off at the other, d takes the jump of that image's
    gradient over 2 delta. The same network with tanh, no kink, agrees."""
    relative_errors = {}
    for activation in (nn.Tanh, nn.ReLU):
        trainer, client, theta, batches, unit = kinked_problem(activation)
        _, product, g = line_10(theta, batches, activation())
        d = (step_of(trainer, client, theta, "hf") - theta) / (LR * ALPHA) + g / ALPHA  # from w - beta (g - alpha d)
        relative_errors[activation] = ((d - product).norm() / product.norm()).item()
    sides = [unit(theta + sign * DELTA * g) for sign in (1, -1)]  # of the last network, the ReLU one
    assert unit(theta) > 0 and min(sides) < 0 < max(sides)
    assert relative_errors[nn.Tanh] < 1e-2  # float32 rounding over 2 delta: ~5e-4
    assert relative_errors[nn.ReLU] > 0.5


# ---------------------------------------------------------------- Per-FedAvg server and personalization


@pytest.mark.parametrize(("aggregation", "weights"), [(None, (1, 1)), ("uniform", (1, 1)), ("samples", (1, 50))])
def test_perfedavg_server_takes_the_mean_of_the_sampled_models(aggregation, weights):
    trainer = tiny_trainer()
    global_state, uploads, updates, floats, _ = server_problem(trainer, seeds=(1, 2, 3), sizes=(1, 50))
    method = make(PerFedAvg, trainer, aggregation=aggregation)

    new_state, info = method.server_update(global_state, updates, seed=0, round_index=0)

    total = sum(weights)
    for key in [*names_of(trainer), *floats]:
        expected = (weights[0] * uploads[0][key] + weights[1] * uploads[1][key]) / total
        assert_close(new_state[key], expected, **TOL)
    assert info == {}


def test_perfedavg_personalizes_with_one_local_sgd_step_from_the_global_model():
    trainer = tiny_trainer()
    data = image_set(2 * BATCH, seed=3)
    w = perturbed(trainer.model, seed=2)
    names = names_of(trainer)
    method = make(PerFedAvg, trainer, clients=[client_of(0, data)])

    personal = method.personalized(0, w)

    module = module_at(trainer, w)
    batch = next(trainer.minibatches(data, epochs=1, seed=derive_seed(0, 0, FINETUNE)))  # run seed 0, client 0
    assert batch[0].shape[0] == BATCH  # one minibatch, not the epoch
    grads = grad_f(module, *batch)
    expected = {n: w[n] - ALPHA * grads[n] for n in names}
    assert_close({n: personal[n] for n in names}, expected, **TOL)
    assert differs(personal, w, names)
    assert make(PerFedAvg, trainer, clients=[client_of(0, data)], ft_steps=0).personalized(0, w) is w
    epochs = make(PerFedAvg, trainer, clients=[client_of(0, data)], ft_epochs=1).personalized(0, w)
    assert differs(epochs, personal, names)  # --ft-epochs given: a whole epoch (2 steps) instead


# ---------------------------------------------------------------- the command line


SMALL = ("--limit-samples", "400", "--eval-every", "0")


@pytest.mark.parametrize("method", ["feddyn", "perfedavg"])
def test_one_round_cli_run_exports_every_client(method, fmnist_dir, tmp_path, capsys, monkeypatch, home):
    run = tmp_path / "run"
    args = tiny_args(fmnist_dir, run, "--method", method, "--rounds", "1", *SMALL)
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    for client_id in range(4):
        assert any((run / "clients" / str(client_id)).iterdir())
    report = json.loads((run / "report.json").read_text())
    assert report["method"] == method and len(report["personalized"]["local_test"]["per_client"]) == 4
    saved = json.loads((run / "config.json").read_text())["config"]["method"]
    # each method's own settings, at their defaults, in config.json; not the other method's
    own = {"feddyn": {"feddyn_alpha": 0.01}, "perfedavg": {"perfedavg_variant": "hf", "perfedavg_delta": 0.001}}
    assert {key: saved[key] for key in own[method]} == own[method]
    assert not any(key in saved for other, settings in own.items() if other != method for key in settings)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 1 and metrics[0]["local_loss"] > 0


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (("--method", "feddyn", "--feddyn-alpha", "-0.1"), "--feddyn-alpha"),
        (("--method", "perfedavg", "--perfedavg-variant", "so"), "--perfedavg-variant"),
        (("--method", "perfedavg", "--ft-steps", "-1"), "--ft-steps"),
    ],
)
def test_cli_rejects_bad_values(extra, needle, fmnist_dir, tmp_path, capsys, monkeypatch, home):
    run = tmp_path / "run"
    expect_user_error(tiny_args(fmnist_dir, run, *extra, "--rounds", "1"), capsys, monkeypatch, needle)
    assert not run.exists()


def test_feddyn_resumed_after_round_1_ends_as_an_uninterrupted_run(fmnist_dir, tmp_path, capsys, monkeypatch, home):
    """h is server state: saved in the checkpoint of round 1 and restored on --resume."""
    full, crashed = tmp_path / "full", tmp_path / "crashed"
    extra = ("--method", "feddyn", "--rounds", "2", *SMALL)
    code, _, err = run_cli(tiny_args(fmnist_dir, full, *extra), capsys, monkeypatch)
    assert code == 0, err

    crash_after_round(1, tiny_args(fmnist_dir, crashed, *extra), capsys, monkeypatch)
    saved = load_file(crashed / "checkpoints" / "round-00001.safetensors")
    h = [tensor for name, tensor in saved.items() if name.startswith("server/")]
    assert h and any(tensor.abs().max() > 0 for tensor in h)
    code, _, err = run_cli(tiny_args(fmnist_dir, crashed, *extra, "--resume"), capsys, monkeypatch)
    assert code == 0, err
    assert "after round 1" in err
    assert results(crashed) == results(full)
