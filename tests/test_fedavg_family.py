"""Tests for FedAvg, FedAvg+FT, Standalone and FedDF: each update checked against hand-computed SGD and means."""

from __future__ import annotations

import json

import pytest
import torch
from torch.testing import assert_close

from peradapt.compute.costs import elements
from peradapt.config import DistillConfig, MethodConfig
from peradapt.distill import Distiller
from peradapt.errors import ConfigError
from peradapt.methods import ClientUpdate, MethodContext, build_method
from peradapt.methods.fedavg import FedAvg, FedAvgFT
from peradapt.methods.feddf import FedDF
from peradapt.methods.standalone import OWN_KEY, Standalone
from peradapt.rundir.store import ClientStore

from .conftest import measured_counts, method_config
from .test_cli import run_cli, tiny_args
from .test_perada import (
    BATCH,
    TOL,
    brightness_set,
    client,
    hand_sgd_step,
    image_set,
    perturbed,
    tiny_trainer,
)


def method_context(trainer, initial, clients=(), distiller=None, method=None, **settings):
    """A context with the shared settings, and `method`'s own ones if it is given."""
    values = {"local_epochs": 1, "lr": 0.1, "batch_size": BATCH, **settings}
    config, own = method_config(method, **values) if method else (MethodConfig(**values), None)
    return MethodContext(config, trainer, ClientStore(), initial, distiller, clients, settings=own)


def hand_sgd(trainer, start, data, lr, epochs):
    """`epochs` full-batch plain SGD steps (one batch per epoch: `data` holds BATCH images)."""
    state = start
    for _ in range(epochs):
        state, _ = hand_sgd_step(trainer, state, data, lr=lr)
    return state


def differs(a, b):
    return any(not torch.allclose(a[k].float(), b[k].float(), atol=1e-4) for k in a)


def clone(state):
    return {k: v.clone() for k, v in state.items()}


# ---------------------------------------------------------------- FedAvg (McMahan et al., Algorithm 1)


def test_fedavg_client_update_is_plain_sgd_from_the_global_state():
    trainer = tiny_trainer()
    data = image_set(BATCH, seed=3)
    initial, global_state = perturbed(trainer.model, seed=1), perturbed(trainer.model, seed=2)
    method = FedAvg(method_context(trainer, initial, local_epochs=2))

    update = method.client_update(client(4, data), global_state, seed=0)

    assert (update.client_id, update.num_samples) == (4, BATCH)
    expected = hand_sgd(trainer, global_state, data, lr=0.1, epochs=2)
    assert update.upload.keys() == global_state.keys()
    assert_close(update.upload, expected, **TOL)
    assert differs(update.upload, hand_sgd(trainer, initial, data, lr=0.1, epochs=2))
    assert differs(update.upload, hand_sgd(trainer, global_state, data, lr=0.1, epochs=1))
    assert method.personalized(4, global_state) is global_state  # no personalization
    assert method.store.checkpoint_tensors() == {}


def test_fedavg_server_update_is_the_sample_size_weighted_mean():
    trainer = tiny_trainer()
    method = FedAvg(method_context(trainer, trainer.model.state()))
    uploads = [
        {"w": torch.tensor([1.0, 2.0]), "steps": torch.tensor(4)},
        {"w": torch.tensor([2.0, 4.0]), "steps": torch.tensor(9)},
        {"w": torch.tensor([6.0, 0.0]), "steps": torch.tensor(1)},
    ]
    updates = [ClientUpdate(i, u, n) for i, (u, n) in enumerate(zip(uploads, [1, 100, 10], strict=True))]

    start = {"w": torch.zeros(2), "steps": torch.tensor(0)}
    averaged, info = method.server_update(start, updates, seed=0, round_index=0)

    # (1 * [1, 2] + 100 * [2, 4] + 10 * [6, 0]) / 111; the uniform mean would be [3, 2].
    assert_close(averaged["w"], torch.tensor([261.0, 402.0]) / 111)
    assert averaged["steps"].item() == 4
    assert info == {}


def test_aggregation_uniform_gives_the_plain_mean_as_the_perada_authors_fedavg():
    trainer = tiny_trainer()
    method = FedAvg(method_context(trainer, trainer.model.state(), aggregation="uniform"))
    uploads = [{"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([2.0, 4.0])}, {"w": torch.tensor([6.0, 0.0])}]
    updates = [ClientUpdate(i, u, n) for i, (u, n) in enumerate(zip(uploads, [1, 100, 10], strict=True))]
    averaged, _ = method.server_update({"w": torch.zeros(2)}, updates, seed=0, round_index=0)
    assert_close(averaged["w"], torch.tensor([3.0, 2.0]))  # (1/3) of the sum, whatever the sample counts


def test_aggregation_is_refused_by_methods_that_average_nothing():
    trainer = tiny_trainer()
    context = method_context(trainer, trainer.model.state(), aggregation="uniform")
    with pytest.raises(ConfigError, match="--aggregation"):
        build_method("standalone", context)


def test_fedavg_parameter_counts_and_default_scope():
    trainer = tiny_trainer()
    n, whole = trainer.model.num_trainable(), elements(trainer.model.state())
    clients = [client(0, image_set(BATCH, seed=3))]
    counts = {
        cls: measured_counts(
            cls(method_context(trainer, trainer.model.state(), clients, method=cls)), clients[0], trainer.model.state()
        )
        for cls in (FedAvg, FedAvgFT, Standalone, FedDF)
    }
    # the model and its statistics sent; FedAvg's clients have no model of their own, Standalone's send nothing
    assert counts[FedAvg] == counts[FedDF] == {"personalized": 0, "trained": n, "communicated": whole}
    assert counts[Standalone] == {"personalized": whole, "trained": n, "communicated": 0}
    # fine-tuning makes every trained parameter the client's own, and the statistics of the layers that see data
    tuned = counts[FedAvgFT]
    assert n < tuned["personalized"] <= whole and (tuned["trained"], tuned["communicated"]) == (n, whole)
    assert {cls.default_scope for cls in counts} == {"full"}  # full-model baselines in Tables 1 and 2


# ---------------------------------------------------------------- FedAvg+FT


def test_fedavg_ft_fine_tunes_the_global_state_on_the_clients_own_data():
    trainer = tiny_trainer()
    clients = [client(i, image_set(BATCH, seed=10 + i)) for i in range(3)]
    global_state = perturbed(trainer.model, seed=2)
    before = clone(global_state)
    method = FedAvgFT(
        method_context(trainer, trainer.model.state(), clients, method=FedAvgFT, ft_epochs=2, personal_lr=0.05)
    )

    personalized = method.personalized(1, global_state)

    expected = hand_sgd(trainer, global_state, clients[1].train, lr=0.05, epochs=2)
    assert_close(personalized, expected, **TOL)
    assert differs(personalized, hand_sgd(trainer, global_state, clients[2].train, lr=0.05, epochs=2))
    assert_close(global_state, before, atol=0, rtol=0)  # the global state itself is left alone
    # Training is FedAvg's: the upload is plain SGD from the global state at --lr.
    update = method.client_update(clients[0], global_state, seed=0)
    assert_close(update.upload, hand_sgd(trainer, global_state, clients[0].train, lr=0.1, epochs=1), **TOL)


def test_fedavg_ft_is_deterministic_and_zero_epochs_means_the_global_state():
    trainer = tiny_trainer()
    clients = [client(0, image_set(2 * BATCH, seed=10))]  # two shuffled minibatches per epoch
    global_state = perturbed(trainer.model, seed=2)
    method = FedAvgFT(method_context(trainer, trainer.model.state(), clients, method=FedAvgFT, ft_epochs=2))

    first = method.personalized(0, global_state)
    trainer.sgd(perturbed(trainer.model, seed=7), clients[0].train, epochs=1, lr=0.1, seed=123)  # disturb RNG
    assert_close(method.personalized(0, global_state), first, atol=0, rtol=0)
    assert differs(first, global_state)

    method.settings.ft_epochs = 0
    assert method.personalized(0, global_state) is global_state


# ---------------------------------------------------------------- Standalone


def test_standalone_trains_from_its_own_state_and_communicates_nothing():
    trainer = tiny_trainer()
    data = image_set(BATCH, seed=3)
    initial = perturbed(trainer.model, seed=1)
    first_global, second_global = perturbed(trainer.model, seed=2), perturbed(trainer.model, seed=5)
    method = Standalone(method_context(trainer, initial))

    update = method.client_update(client(4, data), first_global, seed=0)

    assert update.upload == {} and update.num_samples == BATCH
    own = method.store.get(4, OWN_KEY)
    assert_close(own, hand_sgd(trainer, initial, data, lr=0.1, epochs=1), **TOL)
    assert_close(method.personalized(4, first_global), own, atol=0, rtol=0)

    method.client_update(client(4, data), second_global, seed=1)

    continued = method.store.get(4, OWN_KEY)
    assert_close(continued, hand_sgd(trainer, own, data, lr=0.1, epochs=1), **TOL)
    assert differs(continued, hand_sgd(trainer, initial, data, lr=0.1, epochs=1))
    assert differs(continued, hand_sgd(trainer, second_global, data, lr=0.1, epochs=1))
    assert method.personalized(5, second_global) is initial  # a client never sampled keeps the initial state


def test_standalone_server_leaves_the_global_state_untouched():
    trainer = tiny_trainer()
    method = Standalone(method_context(trainer, trainer.model.state()))
    global_state = perturbed(trainer.model, seed=2)
    before = clone(global_state)
    updates = [method.client_update(client(i, image_set(BATCH, seed=i)), global_state, seed=i) for i in (0, 1)]

    after, info = method.server_update(global_state, updates, seed=0, round_index=0)

    assert_close(after, before, atol=0, rtol=0)
    assert info == {}
    assert differs(method.personalized(0, after), method.personalized(1, after))  # nothing was mixed


# ---------------------------------------------------------------- FedDF (Lin et al. 2020)


def test_feddf_server_distills_the_weighted_mean_towards_the_uniform_ensemble():
    trainer = tiny_trainer()
    start = trainer.model.state()
    good, _ = trainer.sgd(start, brightness_set(32, seed=1), epochs=10, lr=0.05, seed=1)
    kd_data, val_data = brightness_set(64, seed=3, labeled=False), brightness_set(32, seed=4)
    distiller = Distiller(trainer, kd_data, val_data, DistillConfig(kd_steps=10, kd_batch_size=32, server_lr=1e-2))
    method = FedDF(method_context(trainer, start, distiller=distiller))
    updates = [ClientUpdate(0, good, 30), ClientUpdate(1, start, 10)]
    steps = []

    distilled, info = method.server_update(start, updates, seed=5, round_index=0, on_step=steps.append)

    # FedAvg initialization by hand: n_k / n = 3/4 and 1/4; integer BatchNorm counters from the first client.
    mean = {k: 0.75 * good[k] + 0.25 * start[k] if good[k].is_floating_point() else good[k] for k in good}
    expected, expected_info = distiller.distill(mean, [good, start], seed=5)
    assert steps == list(range(1, 11))
    assert_close(distilled, expected, **TOL)
    assert info == pytest.approx(expected_info, rel=1e-4)
    assert info["kd_val_after"] > info["kd_val_before"] and info["kd_best_step"] > 0
    assert differs(distilled, mean)  # distillation moved the global state away from the plain mean
    assert method.personalized(0, distilled) is distilled


def test_feddf_needs_distillation_data():
    trainer = tiny_trainer()
    with pytest.raises(ConfigError, match="--kd-data"):
        build_method("feddf", method_context(trainer, trainer.model.state()))


# ---------------------------------------------------------------- the command line


@pytest.mark.parametrize("name", ["fedavg", "fedavg-ft", "standalone", "feddf"])
def test_one_round_from_the_command_line(name, tmp_path, fmnist_dir, home, capsys, monkeypatch):
    run = tmp_path / "run"
    code, _, err = run_cli(tiny_args(fmnist_dir, run, "--method", name, "--rounds", "1"), capsys, monkeypatch)
    assert code == 0, err
    assert all((run / "clients" / str(c)).is_dir() and any((run / "clients" / str(c)).iterdir()) for c in range(4))
    report = json.loads((run / "report.json").read_text())
    assert report["method"] == name and len(report["personalized"]["local_test"]["per_client"]) == 4
    resolved = json.loads((run / "config.json").read_text())["resolved"]
    assert resolved["scope"] == "full"
    communicated = report["cost"]["parameters"]["communicated"]
    assert (communicated == 0) == (name == "standalone")
