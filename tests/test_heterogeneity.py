"""System heterogeneity (issue 36): --participation P (a client answers with probability P) and --stragglers F (a
fraction F of a round's clients do part of their local work), checked against the rules as stated, drawn by hand."""

from __future__ import annotations

import json

import numpy as np
import pytest

from peradapt.seeds import derive_seed

from .test_cli import crash_after_round, expect_refusal, results, run_cli, tiny_args
from .test_costs import cut, records, session_of

PARTICIPATION_PHASE, STRAGGLERS_PHASE = 8, 9  # the phases of peradapt.seeds, as docs/METHODS.md states them


def answers(seed: int, round_index: int, client: int, p: float) -> bool:
    """By hand: a client answers when its own uniform draw for (seed, round, client, participation) is below P."""
    return np.random.default_rng(derive_seed(seed, round_index, client, PARTICIPATION_PHASE)).random() < p


def train(args: list[str], capsys, monkeypatch) -> None:
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err


def test_only_the_clients_that_answer_train_and_are_aggregated(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    run = tmp_path / "half"
    train(tiny_args(fmnist_dir, run, "--method", "fedavg", "--participation", "0.5"), capsys, monkeypatch)
    session = session_of(run)
    assert json.loads((run / "config.json").read_text())["config"]["federation"]["participation"] == 0.5
    dropped = 0
    for index, record in enumerate(records(run)):
        answered = [c for c in record["clients"] if answers(0, index, c, 0.5)]
        assert record.get("unanswered", []) == [c for c in record["clients"] if c not in answered]
        # each answering client trains its one epoch; the others neither train nor send
        assert record["client_samples"] == [len(session.data.clients[c].train) for c in answered]
        assert len(record["bytes_up"]) == len(answered)
        assert ("local_loss" in record) == bool(answered)
        dropped += len(record["clients"]) - len(answered)
    assert dropped > 0  # the draws of seed 0 drop some client: the test tests something


def test_a_round_nobody_answers_keeps_the_global_model(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    run = tmp_path / "nobody"
    train(tiny_args(fmnist_dir, run, "--method", "fedavg", "--participation", "0.001"), capsys, monkeypatch)
    assert not any(answers(0, r, c, 0.001) for r in range(3) for c in records(run)[r]["clients"])
    assert all(record["client_samples"] == [] and record["cost"]["bytes_up"] == 0 for record in records(run))
    untrained = tmp_path / "untrained"  # the initial global adapter, exported after no round at all
    train(tiny_args(fmnist_dir, untrained, "--method", "fedavg", "--rounds", "0"), capsys, monkeypatch)
    assert (run / "global" / "model.safetensors").read_bytes() == (
        untrained / "global" / "model.safetensors"
    ).read_bytes()


def test_stragglers_do_their_drawn_share_of_the_work(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    run = tmp_path / "stragglers"
    train(tiny_args(fmnist_dir, run, "--method", "fedavg", "--stragglers", "0.5"), capsys, monkeypatch)
    session = session_of(run)
    for index, record in enumerate(records(run)):
        # round(0.5 x 2) = 1 straggler of the round's 2 clients, drawn with its share from the round's generator
        rng = np.random.default_rng(derive_seed(0, index, STRAGGLERS_PHASE))
        chosen = record["clients"][int(rng.choice(2, size=1, replace=False)[0])]
        share = float(rng.random())
        assert record["stragglers"] == {str(chosen): pytest.approx(share)}
        sizes = [len(session.data.clients[c].train) for c in record["clients"]]
        expected = [cut(n, 32, share) if c == chosen else n for c, n in zip(record["clients"], sizes, strict=True)]
        assert record["client_samples"] == expected


def test_a_heterogeneous_run_resumes_to_the_same_files(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    extra = ("--participation", "0.6", "--stragglers", "0.5")
    whole = tmp_path / "whole"
    train(tiny_args(fmnist_dir, whole, *extra), capsys, monkeypatch)
    crashed = tmp_path / "crashed"
    crash_after_round(1, tiny_args(fmnist_dir, crashed, *extra), capsys, monkeypatch)
    train(tiny_args(fmnist_dir, crashed, "--resume"), capsys, monkeypatch)
    assert results(crashed) == results(whole)


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--participation", "0"], ["--participation"]),
        (["--participation", "1.5"], ["--participation"]),
        (["--stragglers", "-0.1"], ["--stragglers"]),
        (["--stragglers", "1.2"], ["--stragglers"]),
        (["--stragglers", "0.5", "--dp-noise", "1", "--dp-clip", "1"], ["--stragglers", "--dp-noise"]),
    ],
)
def test_bad_heterogeneity_settings_are_refused(extra, needles, tmp_path, fmnist_dir, capsys, monkeypatch, home):
    run = tmp_path / "refused"
    expect_refusal(tiny_args(fmnist_dir, run, *extra), capsys, monkeypatch, *needles, untouched=run)
