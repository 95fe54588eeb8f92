"""The engine's hooks for methods beyond "train the sampled clients from the global model and aggregate them":
server state that survives checkpoints and --resume, a payload of its own per client, more clients trained than
aggregated, and local work counted in minibatch steps.

A probe method, registered for these tests only, records what the engine hands it; the expected values follow
from the hooks' contracts (base.Method), never from the engine's code.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import ClassVar

import pytest
import torch

from peradapt.adapters import AdapterState, average_states
from peradapt.compute.privacy import PrivateTraining
from peradapt.methods import METHODS, ClientUpdate, Method
from peradapt.methods.base import PERSONAL_KEY

from .test_cli import crash_after_round, expect_user_error, run_cli, tiny_args
from .test_perada import BATCH, image_set, tiny_trainer

SHIFT = 0.25  # the probe's payload for client c: the global state with every float tensor shifted by SHIFT * c


class Probe(Method):
    """Trains every client, aggregates the sampled, sends each client its own payload, counts rounds on the server."""

    name = "probe"
    summary = "engine hooks probe (tests only)"
    received: ClassVar[list[tuple[int, float]]] = []  # (client, first float entry of its payload), in call order
    aggregated: ClassVar[list[list[int]]] = []  # the clients of each server update's uploads, round by round

    def __init__(self, context) -> None:
        super().__init__(context)
        self.rounds = torch.zeros(())

    def clients_to_train(self, sampled: list[int], federated: list[int]) -> list[int]:
        return federated

    def payload(self, client_id: int, global_state: AdapterState) -> AdapterState:
        return {k: v + SHIFT * client_id if v.is_floating_point() else v for k, v in global_state.items()}

    def client_update(self, client, global_state, seed) -> ClientUpdate:
        first = next(v for v in global_state.values() if v.is_floating_point())
        Probe.received.append((client.client_id, float(first.flatten()[0])))
        self.store.put(client.client_id, PERSONAL_KEY, global_state)
        return ClientUpdate(client.client_id, global_state, len(client.train), {"local_loss": float(client.client_id)})

    def server_update(
        self,
        global_state,
        updates,
        seed: int,
        round_index: int,
        on_step: Callable[[int], None] | None = None,
    ):
        self.rounds = self.rounds + 1
        Probe.aggregated.append([u.client_id for u in updates])
        mean = average_states([u.upload for u in updates])
        return mean, {"server_rounds": float(self.rounds)}

    def personalized(self, client_id: int, global_state: AdapterState) -> AdapterState:
        return self.store.get(client_id, PERSONAL_KEY) or global_state

    def server_state(self) -> dict[str, torch.Tensor]:
        return {"rounds": self.rounds}

    def load_server_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.rounds = tensors.get("rounds", torch.zeros(())).cpu()


@pytest.fixture
def probe(monkeypatch):
    monkeypatch.setitem(METHODS, "probe", Probe)
    Probe.received, Probe.aggregated = [], []
    return Probe


def records(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_every_client_trains_on_its_own_payload_and_only_the_sample_is_aggregated(
    probe, tmp_path, fmnist_dir, capsys, monkeypatch, home
):
    run = tmp_path / "probe"
    code, _, err = run_cli(tiny_args(fmnist_dir, run, "--method", "probe", "--rounds", "2"), capsys, monkeypatch)
    assert code == 0, err
    first_round = probe.received[:4]
    assert [c for c, _ in first_round] == [0, 1, 2, 3]  # all 4 clients, not the 2 sampled
    base = first_round[0][1]
    for client_id, value in first_round:  # each its own payload: the global state shifted by SHIFT * client
        assert value == pytest.approx(base + SHIFT * client_id, abs=1e-5)
    history = records(run)
    for record, aggregated in zip(history, probe.aggregated, strict=True):
        assert record["trained_clients"] == 4
        assert aggregated == record["clients"]  # server_update saw the sampled clients, in order
        assert len(record["clients"]) == 2
        assert record["local_loss"] == pytest.approx(1.5)  # the mean over all trained clients' losses (0..3)
    # the round-2 global state is the mean of round 1's sampled payloads: base + SHIFT * mean(sampled ids)
    sampled = history[0]["clients"]
    second_round = dict(probe.received[4:8])
    assert second_round[0] == pytest.approx(base + SHIFT * sum(sampled) / 2, abs=1e-5)


def test_server_state_is_checkpointed_and_restored_on_resume(probe, tmp_path, fmnist_dir, capsys, monkeypatch, home):
    args = tiny_args(fmnist_dir, tmp_path / "crashed", "--method", "probe", "--rounds", "3")
    crash_after_round(2, args, capsys, monkeypatch)
    code, _, err = run_cli([*args, "--resume"], capsys, monkeypatch)
    assert code == 0, err
    # the server counted rounds 1 and 2 before the crash; restored, it counts round 3 as its third
    assert [r["server_rounds"] for r in records(tmp_path / "crashed")] == [1.0, 2.0, 3.0]


def test_local_steps_draw_exactly_that_many_minibatches_continuing_pass_after_pass():
    trainer = tiny_trainer()
    data = image_set(2 * BATCH + 3, seed=5)  # 3 batches a pass
    by_epochs = [labels for _, labels in trainer.minibatches(data, epochs=3, seed=7)]
    by_steps = [labels for _, labels in trainer.minibatches(data, epochs=1, seed=7, steps=7)]
    assert len(by_epochs) == 9 and len(by_steps) == 7
    for expected, drawn in zip(by_epochs, by_steps, strict=False):  # the same stream, cut after 7 batches
        assert torch.equal(expected, drawn)


def test_sgd_with_steps_stops_after_them():
    trainer = tiny_trainer()
    data = image_set(2 * BATCH + 3, seed=5)
    start = trainer.model.state()
    one_pass, _ = trainer.sgd(start, data, epochs=1, lr=0.1, seed=3)
    three_steps, _ = trainer.sgd(start, data, epochs=5, lr=0.1, seed=3, steps=3)
    two_steps, _ = trainer.sgd(start, data, epochs=1, lr=0.1, seed=3, steps=2)
    for name in trainer.model.trainable_parameters():
        assert torch.equal(one_pass[name], three_steps[name])  # 3 steps are the first pass's 3 batches
    assert any(not torch.equal(one_pass[n], two_steps[n]) for n in trainer.model.trainable_parameters())


def test_dp_sgd_with_steps_takes_that_many_poisson_batches():
    assert PrivateTraining.batches(100, 32, 2).steps == 8  # 2 epochs of ceil(100 / 32) steps
    batches = PrivateTraining.batches(100, 32, 2, steps=5)
    assert batches.steps == 5 and batches.sample_rate == pytest.approx(1 / 4)


def test_local_steps_must_be_positive(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    expect_user_error(
        tiny_args(fmnist_dir, tmp_path / "bad", "--local-steps", "0"), capsys, monkeypatch, "--local-steps"
    )
    assert not (tmp_path / "bad").exists()


def test_local_steps_reach_the_methods(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    """--local-steps 1 and --local-epochs 1 give different runs (the tiny clients have several batches)."""
    steps, epochs = tmp_path / "steps", tmp_path / "epochs"
    for run, extra in ((steps, ("--local-steps", "1")), (epochs, ())):
        args = tiny_args(fmnist_dir, run, "--method", "fedavg", "--rounds", "1", "--eval-every", "1", *extra)
        code, _, err = run_cli(args, capsys, monkeypatch)
        assert code == 0, err
    assert records(steps)[0]["local_loss"] != records(epochs)[0]["local_loss"]
    assert json.loads((steps / "config.json").read_text())["config"]["method"]["local_steps"] == 1
