"""`train --dry-run` and `compare --dry-run`: what would run and its estimated time, with nothing written; the
counted rounds and client samples as the engine counts them."""

from __future__ import annotations

import json

import pytest

from peradapt.seeds import sample_clients

from .test_cli import expect_user_error, run_cli, tiny_args
from .test_compare import compare_args

pytestmark = pytest.mark.usefixtures("one_thread")

# 4 clients of 100 training images each (iid over --limit-samples 400), 2 a round, 3 rounds, batch 32
EVEN = ("--partition", "iid", "--limit-samples", "400", "--method", "fedavg", "--local-epochs", "2")


def estimate_of(args, capsys, monkeypatch, tmp_path, api_call):
    """The estimate the API returns for `api_call`, and the CLI's printed dry run of `args`, checked to have written
    nothing under `tmp_path`."""
    before = sorted(tmp_path.rglob("*"))
    code, stdout, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    assert sorted(tmp_path.rglob("*")) == before  # no run directory, no --out, no file at all
    return api_call(), stdout


def test_train_dry_run_counts_rounds_and_samples_by_hand_and_writes_nothing(
    tmp_path, fmnist_dir, capsys, monkeypatch, home
):
    import peradapt

    out = tmp_path / "run"
    args = [*tiny_args(fmnist_dir, out, *EVEN), "--dry-run"]
    flat = {**_flat(args[1:-1]), "quiet": True}
    estimate, stdout = estimate_of(args, capsys, monkeypatch, tmp_path, lambda: peradapt.train(**flat, dry_run=True))
    assert not out.exists()
    (row,) = estimate["rows"]
    # By hand: every client has 100 images, so a round trains 2 x 2 epochs x 100 = 400 samples, whichever two
    assert (row["method"], row["phase"], row["runs"], row["rounds"]) == ("fedavg", "final", 1, 3)
    assert row["client_samples"] == 3 * 2 * 2 * 100 and row["distillation_steps"] == 0
    assert estimate["seconds"] > 0 and row["seconds"] == estimate["seconds"]
    assert estimate["hours_unit"] == "hours on this CPU" and not estimate["gpu"]
    assert "fedavg" in stdout and "1,200" in stdout and "hours on this CPU" in stdout

    # --budget: round 1 trains 400, round 2 the 100 left (its clients a quarter of their work each), as the engine
    budget = peradapt.train(**flat, budget="client-samples:500", dry_run=True)
    assert (budget["rows"][0]["rounds"], budget["rows"][0]["client_samples"]) == (2, 500)
    assert budget["seconds"] < estimate["seconds"]
    # fedavg-ft: and, after the rounds, one epoch of fine-tuning of each of the 4 clients' models (as --budget counts)
    tuned = peradapt.train(**{**flat, "method": "fedavg-ft"}, dry_run=True)
    assert tuned["rows"][0]["client_samples"] == 1200 + 4 * 100
    assert not out.exists()


def test_dry_run_counts_what_the_run_then_trains(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    """Uneven clients (Dirichlet) and PerAda's two jobs a client: the estimate's samples per round are the sampled
    clients' as the run records them, and its distillation steps every round's --kd-steps."""
    import peradapt

    out = tmp_path / "run"
    flat = {**_flat(tiny_args(fmnist_dir, out)[1:]), "quiet": True}
    estimate = peradapt.train(**flat, dry_run=True)
    assert not out.exists()
    (row,) = estimate["rows"]
    report = peradapt.train(**flat)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [record["clients"] for record in records] == [sample_clients(0, r, 4, 2) for r in range(3)]
    assert row["client_samples"] == sum(record["cost"]["client_samples"] for record in records) > 0
    assert row["rounds"] == report.rounds == 3 and row["distillation_steps"] == 3 * 4


def test_compare_dry_run_counts_trials_and_seeds_and_writes_nothing(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    import peradapt

    out = tmp_path / "cmp"
    args = compare_args(fmnist_dir, out, *EVEN[:4], "--local-epochs", "2", "--tune", "2", "--seeds", "2")
    del args[args.index("--lr") : args.index("--lr") + 2]  # left to the trials to choose
    args[args.index("--methods") + 1] = "fedavg"
    settings = _flat(args[args.index("--out") + 2 : args.index("--tune")])

    def estimate(anchors: bool) -> dict:
        return peradapt.compare(["fedavg"], tune=2, seeds=2, out=out, anchors=anchors, dry_run=True, **settings)

    without, stdout = estimate_of(
        [*args, "--no-anchors", "--dry-run"], capsys, monkeypatch, tmp_path, lambda: estimate(anchors=False)
    )
    assert not out.exists()
    rows = {row["phase"]: row for row in without["rows"]}
    # compare holds 1 of the 4 clients out (10%, rounded up): 2 of the 3 others a round, each 2 epochs of its
    # 100 images (the trials: of its 80, the rest its validation split)
    assert (rows["final"]["runs"], rows["final"]["rounds"]) == (2, 3)
    assert rows["final"]["client_samples"] == 2 * 3 * 2 * 2 * 100
    assert (rows["trials"]["runs"], rows["trials"]["rounds"]) == (2, 3)
    assert rows["trials"]["client_samples"] == 2 * 3 * 2 * 2 * 80
    assert without["runs"] == 4 and without["upper_figure"] and without["seconds"] > 0
    assert "fedavg trials, seed 1000" in stdout and "pruned trials stop earlier" in stdout
    # With the anchors: standalone and fedavg-ft too, each tuned and run on both seeds
    rows = estimate(anchors=True)["rows"]
    assert sorted((row["method"], row["phase"], row["runs"]) for row in rows) == [
        ("fedavg", "final", 2),
        ("fedavg", "trials", 2),
        ("fedavg-ft", "final", 2),
        ("fedavg-ft", "trials", 2),
        ("standalone", "final", 2),
        ("standalone", "trials", 2),
    ]
    assert not out.exists()


def test_dry_run_refuses_bad_values_in_one_line_and_writes_nothing(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    out = tmp_path / "run"
    cases = [
        ([*tiny_args(fmnist_dir, out, "--clients-per-round", "9"), "--dry-run"], "--clients-per-round"),
        ([*tiny_args(fmnist_dir, out, "--resume"), "--dry-run"], "--dry-run estimates a new run"),
        ([*tiny_args(fmnist_dir, out, "--budget", "client-samples:100000000"), "--dry-run"], "cannot be reached"),
        ([*compare_args(fmnist_dir, out, "--seeds", "0"), "--dry-run"], "--seeds must be between 1 and 1000"),
        ([*compare_args(fmnist_dir, out, "--budget", "client-samples:100000000"), "--dry-run"], "cannot be reached"),
    ]
    for args, needle in cases:
        expect_user_error(args, capsys, monkeypatch, needle)
    assert list(tmp_path.iterdir()) == []


def _flat(flags: list[str]) -> dict:
    """`--key value` pairs as the API's settings."""
    return {flags[i].removeprefix("--").replace("-", "_"): flags[i + 1] for i in range(0, len(flags), 2)}


def test_a_gpu_estimate_is_said_in_gpu_hours():
    from peradapt.commands.estimate import Estimate, UnitTimes, estimate_dict, estimate_lines

    row = Estimate("perada", "final", 3, 200, 10**8, 0, 10**6, 7200.0, UnitTimes(0.015, 1e-5))
    estimate = estimate_dict([row], "NVIDIA H200", gpu=True)
    assert estimate["hours"] == 2.0 and estimate["hours_unit"] == "GPU-hours"
    lines = estimate_lines(estimate)
    assert lines[0] == "estimated 2.0 h in all: 2.00 GPU-hours"
    assert any("--concurrent-clients" in line for line in lines)
