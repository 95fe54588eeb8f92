"""`peradapt compare`'s curves (issue 36, item 3): per method the seeds' local-test against rounds, client samples
and bytes, with their range; the first round at a target score and the area under the curve."""

from __future__ import annotations

import json
import math

import pytest

from peradapt.evaluation.curves import CurvePoint, Evaluation, area_per_round, first_reaching, mean_curve

from .test_cli import expect_user_error, run_cli
from .test_compare import compare_args, read

pytestmark = pytest.mark.usefixtures("one_thread")

METHODS = ("perada-nokd", "fedavg")


def by_hand(run) -> list[tuple[int, float, int, int]]:
    """(round, local-test %, client samples and bytes so far) at each evaluated round, from the run's own files:
    metrics.jsonl's evaluated rounds and costs, report.json's final evaluation at the last round."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    report = read(run / "report.json")
    points, samples, sent = [], 0, 0
    for record in records:
        samples += record["cost"]["client_samples"]
        sent += record["cost"]["bytes_down"] + record["cost"]["bytes_up"]
        if record["round"] == report["rounds"]:
            points.append((record["round"], 100 * report["personalized"]["local_test"]["mean"], samples, sent))
        elif "personalized_local_test" in record:
            points.append((record["round"], 100 * record["personalized_local_test"], samples, sent))
    return points


def test_compare_writes_each_methods_curve_over_seeds_its_area_and_rounds_to_target(
    tmp_path, fmnist_dir, capsys, monkeypatch, home
):
    out = tmp_path / "cmp"
    args = compare_args(
        fmnist_dir, out, "--rounds", "3", "--eval-every", "1", "--seeds", "2", "--no-anchors", methods=",".join(METHODS)
    )
    code, stdout, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    result = read(out / "compare.json")
    rows = {row["method"]: row for row in result["rows"]}
    best = max(row["local_test"]["mean"] for row in rows.values())
    assert result["target"]["score"] == pytest.approx(0.9 * best) and "90%" in result["target"]["rule"]
    for method in METHODS:
        seeds = [by_hand(out / f"{method}-seed{seed}") for seed in (0, 1)]
        assert [round_ for round_, *_ in seeds[0]] == [1, 2, 3]  # every round evaluated, the last from report.json
        curve = rows[method]["curve"]
        assert len(curve) == 3
        for index, point in enumerate(curve):
            round_, *_ = seeds[0][index]
            scores = [seed[index][1] for seed in seeds]
            assert point["round"] == round_
            assert point["mean"] == pytest.approx(sum(scores) / 2)
            assert (point["low"], point["high"]) == pytest.approx((min(scores), max(scores)))
            assert point["client_samples"] == pytest.approx(sum(seed[index][2] for seed in seeds) / 2)
            assert point["bytes"] == pytest.approx(sum(seed[index][3] for seed in seeds) / 2)
        # The area per round, by hand: rounds 1..3, trapezoids of width 1, divided by the 2 rounds they span
        areas = [((s[0][1] + s[1][1]) / 2 + (s[1][1] + s[2][1]) / 2) / 2 for s in seeds]
        assert rows[method]["local_test_auc"]["seeds"] == pytest.approx(areas)
        reached = next((point for point in curve if point["mean"] >= result["target"]["score"]), None)
        assert rows[method]["to_target"] == reached
        assert curve[-1]["mean"] == pytest.approx(rows[method]["local_test"]["mean"])  # ends at the table's headline
    for name in ("curves_rounds.png", "curves_client_samples.png", "curves_bytes.png"):
        assert (out / name).read_bytes().startswith(b"\x89PNG")
    markdown = (out / "compare.md").read_text()
    header = next(line for line in markdown.splitlines() if line.startswith("| rank |"))
    assert "| area under curve |" in header and f"| rounds to {result['target']['score']:.2f}% |" in header
    assert "area under curve" in stdout and "rounds to" in stdout

    # A target given: one every method reaches at its first evaluation, and one no method can reach
    code, stdout, err = run_cli([*args, "--target-accuracy", "0.01"], capsys, monkeypatch)
    assert code == 0, err
    result = read(out / "compare.json")
    assert result["target"] == {"score": 0.01, "rule": "given (--target-accuracy)"}
    assert all(row["to_target"]["round"] == 1 for row in result["rows"])
    code, stdout, err = run_cli([*args, "--target-accuracy", "100"], capsys, monkeypatch)
    assert code == 0, err
    assert all(row["to_target"] is None for row in read(out / "compare.json")["rows"])
    assert "not reached" in (out / "compare.md").read_text()


def test_a_target_outside_0_to_100_is_refused_in_one_line_and_nothing_is_written(
    tmp_path, fmnist_dir, capsys, monkeypatch, home
):
    out = tmp_path / "cmp"
    for value in ("0", "-5", "100.5"):
        args = compare_args(fmnist_dir, out, "--target-accuracy", value)
        expect_user_error(args, capsys, monkeypatch, "--target-accuracy must be in (0, 100]")
    args = compare_args(fmnist_dir, out, "--target-accuracy", "nan")
    expect_user_error(args, capsys, monkeypatch, "--target-accuracy must be a finite number")
    assert not out.exists()


def evaluations(*points: tuple[int, float]) -> list[Evaluation]:
    return [Evaluation(round_, score, 100 * round_, 1000 * round_) for round_, score in points]


def test_the_area_is_the_mean_score_over_the_rounds_by_the_trapezoid_rule():
    # Rounds 2, 4, 8: trapezoids 2 * (10 + 30) / 2 + 4 * (30 + 50) / 2 = 40 + 160 over the 6 rounds spanned
    assert area_per_round(evaluations((2, 10.0), (4, 30.0), (8, 50.0))) == pytest.approx(200 / 6)
    assert area_per_round(evaluations((5, 70.0), (6, 70.0))) == pytest.approx(70.0)
    assert math.isnan(area_per_round(evaluations((10, 70.0))))  # --eval-every 0: the final evaluation, no area


def test_the_mean_curve_keeps_the_rounds_every_seed_evaluated_and_each_seeds_end():
    # Seed 1 stopped (--budget) after round 6, seed 2 played 8: the points are the rounds both evaluated before 6,
    # then each seed's final evaluation, at the mean of the rounds they played.
    first = evaluations((2, 10.0), (4, 20.0), (6, 40.0))
    second = evaluations((2, 30.0), (3, 35.0), (4, 40.0), (6, 45.0), (8, 60.0))
    curve = mean_curve([first, second])
    assert curve == [
        CurvePoint(2.0, 200.0, 2000.0, 20.0, 10.0, 30.0),
        CurvePoint(4.0, 400.0, 4000.0, 30.0, 20.0, 40.0),
        CurvePoint(7.0, 700.0, 7000.0, 50.0, 40.0, 60.0),
    ]
    assert first_reaching(curve, 30.0) == curve[1]  # reached: at least the target
    assert first_reaching(curve, 50.5) is None
    assert mean_curve([evaluations((3, 55.0))]) == [CurvePoint(3.0, 300.0, 3000.0, 55.0, 55.0, 55.0)]
