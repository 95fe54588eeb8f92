"""FedRep's schedule (head epochs, then body epochs) and FedBABU (fixed random head, body averaged, whole model
fine-tuned per client), against hand computations in plain torch on the tiny ResNet; one CLI round each.
FedPer's client and server steps are FedSim's with the head personal: tests/test_partial.py."""

from __future__ import annotations

import json

import pytest
import torch
from torch.testing import assert_close

from peradapt.commands.finished_run import open_run
from peradapt.compute.costs import elements
from peradapt.methods import METHODS, ClientUpdate, MethodContext
from peradapt.methods.base import PERSONAL_KEY
from peradapt.rundir.store import ClientStore

from .conftest import measured_counts, method_config
from .test_cli import expect_user_error, run_cli, tiny_args, without_timing
from .test_partial import LR, PERSONAL_LR, export_loads_in_plain_timm, full_trainer, hand_step, split
from .test_perada import BATCH, TOL, client, image_set, perturbed

pytestmark = pytest.mark.usefixtures("one_thread")

HEAD = {"fc.weight", "fc.bias"}
FT_LR = 0.05  # five full-model steps at PERSONAL_LR amplify float rounding past the tolerance on one thread


def build(name, trainer, initial, clients=(), **settings):
    values = {"local_epochs": 1, "personal_epochs": 1, "lr": LR, "personal_lr": PERSONAL_LR, **settings}
    config, own = method_config(name, method=name, **values)
    context = MethodContext(config, trainer, ClientStore(), initial, None, clients, settings=own)
    return METHODS[name](context)


def rates(trainer, keys, lr):
    return {k: lr for k in trainer.model.trainable_parameters() if k in keys}


def steps(trainer, start, data, step_rates, count):
    """`count` full-batch SGD steps (one per epoch: the data is one batch) by autograd."""
    state = start
    for _ in range(count):
        state = hand_step(trainer, state, data, step_rates)
    return state


# ---------------------------------------------------------------- FedRep: tau_h head epochs, then the body's


def test_fedrep_client_update_trains_the_head_for_its_epochs_then_the_body_for_body_epochs():
    trainer = full_trainer()
    data = image_set(BATCH, seed=3)
    initial, global_state = perturbed(trainer.model, seed=1), perturbed(trainer.model, seed=2)
    # --local-epochs 3 is FedAlt's body schedule; FedRep's is --body-epochs.
    method = build("fedrep", trainer, initial, personal_epochs=2, body_epochs=1, local_epochs=3)
    start = {k: (initial if k in HEAD else global_state)[k] for k in initial}  # (phi^t, h^0) for a new client

    update = method.client_update(client(4, data), global_state, seed=0)

    body = set(initial) - HEAD
    after_head = steps(trainer, start, data, rates(trainer, HEAD, PERSONAL_LR), 2)  # h <- h - alpha grad_h, twice
    expected = steps(trainer, after_head, data, rates(trainer, body, LR), 1)  # then phi <- phi - eta grad_phi, once
    expected_head, expected_body = split(expected, HEAD)
    assert_close(update.upload, expected_body, **TOL)
    assert_close(method.store.get(4, PERSONAL_KEY), expected_head, **TOL)
    assert_close(subset_of(after_head, HEAD), expected_head, atol=0, rtol=0)  # the body phase leaves the head alone
    assert set(update.metrics) == {"personal_loss", "local_loss"}
    three_body_epochs = steps(trainer, after_head, data, rates(trainer, body, LR), 3)
    assert not torch.allclose(update.upload["layer1.0.conv1.weight"], three_body_epochs["layer1.0.conv1.weight"])


def subset_of(state, keys):
    return {k: v for k, v in state.items() if k in keys}


def test_fedrep_server_takes_the_plain_mean_of_the_bodies():
    trainer = full_trainer()
    initial = perturbed(trainer.model, seed=1)
    method = build("fedrep", trainer, initial)
    global_state = perturbed(trainer.model, seed=2)
    uploads = [subset_of(perturbed(trainer.model, seed=s), set(initial) - HEAD) for s in (3, 4)]
    updates = [ClientUpdate(i, u, n) for i, (u, n) in enumerate(zip(uploads, [1, 9], strict=True))]

    new_global, _ = method.server_update(global_state, updates, seed=0, round_index=0)

    key = "layer2.0.conv2.weight"  # Algorithm 1: phi^{t+1} = (1/|I^t|) sum_i phi_i, whatever the sample counts
    assert_close(new_global[key], (uploads[0][key] + uploads[1][key]) / 2, **TOL)
    assert all(torch.equal(new_global[k], global_state[k]) for k in HEAD)


def test_fedrep_and_fedalt_differ_on_the_command_line_by_schedule_and_mean(
    tmp_path, fmnist_dir, capsys, monkeypatch, home
):
    def metrics(name, *extra):
        run = tmp_path / "-".join((name, *extra))
        args = tiny_args(fmnist_dir, run, "--method", name, "--rounds", "1", "--limit-samples", "400", *extra)
        code, _, err = run_cli([*args, "--local-epochs", "2"], capsys, monkeypatch)  # the last flag wins
        assert code == 0, err
        return without_timing("metrics.jsonl", (run / "metrics.jsonl").read_bytes())  # seconds differ, all else same

    fedalt = metrics("fedalt")
    assert metrics("fedrep") != fedalt  # 1 head + 1 body epoch, plain mean; FedAlt: 1 + 2 epochs, n_m-weighted
    # With FedAlt's body epochs and mean, FedRep is FedAlt with the head personal: nothing else differs.
    assert metrics("fedrep", "--body-epochs", "2", "--aggregation", "samples") == fedalt


# ---------------------------------------------------------------- FedBABU


def test_fedbabu_client_update_trains_the_body_only_from_the_global_model():
    trainer = full_trainer()
    data = image_set(BATCH, seed=3)
    initial, global_state = perturbed(trainer.model, seed=1), perturbed(trainer.model, seed=2)
    method = build("fedbabu", trainer, initial)
    assert set(method.shared) == set(initial) - HEAD

    update = method.client_update(client(4, data), global_state, seed=0)

    expected = steps(trainer, global_state, data, rates(trainer, set(initial) - HEAD, LR), 1)
    assert_close(expected["fc.weight"], global_state["fc.weight"], atol=0, rtol=0)  # the head never moves
    assert_close(update.upload, split(expected, HEAD)[1], **TOL)
    assert method.store.get(4, PERSONAL_KEY) is None  # nothing stays on the client
    assert set(update.metrics) == {"local_loss"}


def test_fedbabu_server_averages_the_bodies_by_samples_and_keeps_the_initial_head():
    trainer = full_trainer()
    initial = perturbed(trainer.model, seed=1)
    method = build("fedbabu", trainer, initial)
    uploads = [subset_of(perturbed(trainer.model, seed=s), set(initial) - HEAD) for s in (3, 4)]
    updates = [ClientUpdate(i, u, n) for i, (u, n) in enumerate(zip(uploads, [1, 3], strict=True))]

    new_global, _ = method.server_update(initial, updates, seed=0, round_index=0)

    key = "layer3.0.bn1.running_var"
    assert_close(new_global[key], (uploads[0][key] + 3 * uploads[1][key]) / 4, **TOL)
    assert all(torch.equal(new_global[k], initial[k]) for k in HEAD)


def test_fedbabu_personalizes_by_fine_tuning_the_whole_global_model_for_five_epochs():
    trainer = full_trainer()
    clients = [client(i, image_set(BATCH, seed=10 + i)) for i in range(2)]
    initial, global_state = perturbed(trainer.model, seed=1), perturbed(trainer.model, seed=2)
    method = build("fedbabu", trainer, initial, clients, personal_lr=FT_LR)

    personalized = method.personalized(1, global_state)

    everything = rates(trainer, set(initial), FT_LR)  # body and head, at --personal-lr
    assert_close(personalized, steps(trainer, global_state, clients[1].train, everything, 5), **TOL)
    assert not torch.allclose(personalized["fc.weight"], global_state["fc.weight"])
    method.settings.ft_epochs = 2  # --ft-epochs overrides the paper's 5
    assert_close(method.personalized(1, global_state), steps(trainer, global_state, clients[1].train, everything, 2))
    # a round trains (and sends) the body, the head staying as it started; fine-tuning makes the whole model the
    # client's own (every parameter, and the running statistics of the layers that see data)
    parameters = trainer.model.trainable_parameters()
    n, head = trainer.model.num_trainable(), sum(parameters[k].numel() for k in HEAD)
    counts = measured_counts(method, clients[0], global_state)
    assert counts["trained"] == n - head and counts["communicated"] == elements(global_state) - head
    assert n < counts["personalized"] <= elements(global_state)


def test_fedbabu_round_on_the_command_line_keeps_the_initial_head(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    run = tmp_path / "run"
    args = tiny_args(fmnist_dir, run, "--method", "fedbabu", "--rounds", "1", "--limit-samples", "400")
    code, _, err = run_cli([*args, "--ft-epochs", "1"], capsys, monkeypatch)
    assert code == 0, err
    resolved = json.loads((run / "config.json").read_text())["resolved"]
    assert (resolved["scope"], resolved["adapter"]) == ("full", "none")
    session = open_run(run)
    global_state = session.model.load_pretrained(run / "global")
    assert all(torch.equal(global_state[k], session.initial[k]) for k in HEAD)  # the random head, never trained
    assert not torch.equal(global_state["layer1.0.conv1.weight"], session.initial["layer1.0.conv1.weight"])
    for client_id in range(4):  # each client's model is the global one fine-tuned on its data, head included
        mine = session.model.load_pretrained(run / "clients" / str(client_id))
        assert not torch.equal(mine["fc.weight"], global_state["fc.weight"])
    export_loads_in_plain_timm(run, tmp_path / "exported", capsys, monkeypatch)


# ---------------------------------------------------------------- bad settings


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--method", "fedrep", "--body-epochs", "0"], ["--body-epochs"]),
        (["--method", "fedrep", "--aggregation", "median"], ["median", "uniform"]),
        (["--method", "fedbabu", "--personal-part", "bn"], ["fedbabu", "--personal-part"]),
    ],
)
def test_bad_settings_exit_2_in_one_line_and_write_nothing(
    extra, needles, tmp_path, fmnist_dir, capsys, monkeypatch, home
):
    run = tmp_path / "run"
    expect_user_error(tiny_args(fmnist_dir, run, *extra), capsys, monkeypatch, *needles)
    assert not run.exists()
