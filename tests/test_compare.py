"""`peradapt compare`: methods on the same seeds, tuned on validation splits, with intervals, paired tests, tied ranks,
new-client accuracy, costs and an audit record; finished runs reused."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
from pathlib import Path

import pytest
from scipy import stats

import peradapt.commands.comparison as compare_module
from peradapt.rundir.layout import read_run_config

from .test_cli import expect_user_error, run_cli, tiny_args
from .test_eval_split import marked_dir, white_images_seen  # noqa: F401 (marked_dir: a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def compare_args(fmnist_dir, out, *extra, methods="perada,perada-nokd"):
    train_flags = tiny_args(fmnist_dir, out)[1:]
    at = train_flags.index("--out")
    del train_flags[at : at + 2]
    return ["compare", "--methods", methods, "--seeds", "1", "--out", str(out), *train_flags, *extra]


def read(path):
    return json.loads(path.read_text())


def test_compare_over_seeds_gives_intervals_paired_tests_ranks_and_an_audit(
    tmp_path, fmnist_dir, capsys, monkeypatch, home
):
    out = tmp_path / "cmp"
    args = compare_args(fmnist_dir, out, "--rounds", "1", "--seeds", "2", "--no-anchors", "--reference", "perada")
    code, stdout, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    assert "perada-nokd" in stdout and "compare.md" in stdout
    result = read(out / "compare.json")
    rows = {row["method"]: row for row in result["rows"]}
    assert set(rows) == {"perada", "perada-nokd"} and result["reference"] == "perada"
    reports = {m: [read(out / f"{m}-seed{s}" / "report.json") for s in (0, 1)] for m in rows}
    for method, row in rows.items():
        values = [100 * r["personalized"]["local_test"]["mean"] for r in reports[method]]
        entry = row["local_test"]
        assert entry["seeds"] == pytest.approx(values)
        # By hand: two seeds, s = |a - b| / sqrt(2), half-width t(0.975, 1) * s / sqrt(2) = 12.7062... * |a - b| / 2
        assert entry["mean"] == pytest.approx((values[0] + values[1]) / 2)
        assert entry["std"] == pytest.approx(abs(values[0] - values[1]) / math.sqrt(2))
        half = 12.706204736174698 * abs(values[0] - values[1]) / 2
        assert (entry["low"], entry["high"]) == pytest.approx((entry["mean"] - half, entry["mean"] + half))
        worst = [100 * r["personalized"]["local_test"]["worst_10pct"] for r in reports[method]]
        assert row["local_test_worst_10pct"]["seeds"] == pytest.approx(worst)
        assert row["global_test"]["seeds"] == pytest.approx(
            [100 * r["summary"]["global_global_test"] for r in reports[method]]
        )
        resolved = read(out / f"{method}-seed0" / "config.json")["resolved"]
        assert row["trained"] == 2 * resolved["trainable_parameters"]  # PerAda trains v_m and theta_m
        assert row["cost"]["bytes_up"] == pytest.approx(sum(r["cost"]["bytes_up"] for r in reports[method]) / 2)
    # The paired test against the reference, by hand: differences per seed, t = mean / (sd / sqrt(n)).
    differences = [
        a - b
        for a, b in zip(rows["perada-nokd"]["local_test"]["seeds"], rows["perada"]["local_test"]["seeds"], strict=True)
    ]
    paired = rows["perada-nokd"]["vs_reference"]
    assert paired["mean_difference"] == pytest.approx(sum(differences) / 2)
    spread = abs(differences[0] - differences[1]) / math.sqrt(2)
    if spread > 1e-9:
        t = (sum(differences) / 2) / (spread / math.sqrt(2))
        assert paired["p_value"] == pytest.approx(2 * stats.t.sf(abs(t), 1))
        assert paired["significant"] == (paired["p_value"] < 0.05)
    # One comparison with the reference: Holm's adjustment over a family of one leaves p as it is
    assert paired["p_holm"] == paired["p_value"] and result["test"] == "paired t-test"
    # Two seeds never reach p < 0.05 unless the differences agree almost exactly: the methods tie.
    if not paired["significant"]:
        assert {rows[m]["rank"] for m in rows} == {"1="}
    # The audit: each seed's split as the runs scored it, the same for both methods.
    audit = result["audit"]
    for seed in (0, 1):
        digest = hashlib.sha256((out / f"perada-seed{seed}" / "partition.json").read_bytes()).hexdigest()
        assert audit["partition_sha256"][str(seed)] == digest
    assert "local_test" in audit["scored"] and "last round" in audit["selection"]
    assert audit["versions"]["torch"] and audit["versions"]["peradapt"] and audit["versions"]["peradapt_source"]
    markdown = (out / "compare.md").read_text()
    assert "intervals within [0, 100]" in markdown and "Holm-adjusted p < 0.05" in markdown
    assert "| 1= | perada |" in markdown or "| 1 | perada |" in markdown or "| 2 | perada |" in markdown
    assert "reference" in markdown and (out / "ranking.png").stat().st_size > 0
    assert "| perada-nokd | adapter |" in markdown  # scope and parameter counts, as the paper's Table 1

    def no_training(*args, **kwargs):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(compare_module, "train", no_training)
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    assert read(out / "compare.json")["rows"] == result["rows"]
    # settings no result depends on (`Setting.outcome`) may differ from the finished runs', as on --resume
    code, _, err = run_cli([*args, "--concurrent-clients", "2", "--offline"], capsys, monkeypatch)
    assert code == 0, err
    assert read(out / "compare.json")["rows"] == result["rows"]

    code, _, err = run_cli([*args, "--lr", "0.2"], capsys, monkeypatch)
    assert code == 2 and "other settings" in err


def test_compare_adds_the_anchors_and_scores_held_out_clients(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    out = tmp_path / "cmp"
    args = compare_args(
        fmnist_dir,
        out,
        "--rounds",
        "1",
        "--ood",
        "fmnist-c",
        "--ood-limit",
        "5",
        "--stragglers",
        "0.5",
        methods="perada",
    )
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    result = read(out / "compare.json")
    rows = {row["method"]: row for row in result["rows"]}
    assert set(rows) == {"perada", "standalone", "fedavg-ft"}
    assert result["audit"]["scenario"] == [{"participation": 1.0, "stragglers": 0.5}]  # every method's runs alike
    for method, row in rows.items():
        run = out / f"{method}-seed0"
        assert read(run / "config.json")["config"]["federation"]["holdout_clients"] == 1  # 10% of 4, rounded up
        report = read(run / "report.json")
        held_out = report["held_out_clients"]
        results = [read(run / "new_clients" / str(c) / "result.json") for c in held_out]
        after = [result["after"]["local_test"] for result in results]
        assert row["new_client"]["seeds"] == pytest.approx([100 * sum(after) / len(after)])
        # every training sample counted: the rounds', the final personalization's, the new clients'; the server's
        cost = report["cost"]
        assert row["cost"]["client_samples"] == cost["client_samples"] + cost["personalization_samples"]
        assert row["cost"]["new_client_samples"] == sum(result["cost"]["samples"] for result in results) > 0
        assert row["cost"]["server_flops"] == cost["server_flops"]
        assert (cost["server_flops"] > 0) == (method == "perada")
        assert (cost["personalization_samples"] > 0) == (method == "fedavg-ft")
        gap = row["local_test"]["seeds"][0] - row["new_client"]["seeds"][0]
        assert row["new_client_gap"]["seeds"] == pytest.approx([gap])
        ood = read(run / "ood-fmnist-c.json")["average"]["personalized_mean"]  # as `peradapt eval --ood` writes it
        assert row["ood"]["seeds"] == pytest.approx([100 * ood])
    assert "new clients" in (out / "compare.md").read_text() and "| OOD |" in (out / "compare.md").read_text()
    # A report.json without its costs is damaged (every run writes them): refused in one line, with the remedy
    path = out / "standalone-seed0" / "report.json"
    report = read(path)
    del report["cost"]
    path.write_text(json.dumps(report))
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 2 and f'{path} is damaged (its content has no "cost")' in err and "--resume" in err, err


def test_compare_refuses_bad_input_in_one_line_and_writes_nothing(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    out = tmp_path / "cmp"
    cases = [
        (compare_args(fmnist_dir, out, "--seed", "4"), "seed"),
        (compare_args(fmnist_dir, out, "--no-such-flag", "1"), "no-such-flag"),
        (compare_args(fmnist_dir, out, methods="perada,fedsomething"), "fedsomething"),
        (compare_args(fmnist_dir, out, "--seeds", "0"), "--seeds must be between 1 and 1000"),
        (compare_args(fmnist_dir, out, "--tune", "-1"), "--tune must not be negative"),
        (compare_args(fmnist_dir, out, "--tune-only"), "--tune-only runs trials"),
        (compare_args(fmnist_dir, out, "--ood-limit", "5"), "--ood-limit needs --ood"),
        (compare_args(fmnist_dir, out, "--reference", "ditto"), "--reference ditto is not among"),
        (compare_args(fmnist_dir, out, "--eval-split", "validation"), "compare sets eval_split itself"),
        (compare_args(fmnist_dir, out, "--feddyn-alpha", "0.1", "--no-anchors"), "--feddyn-alpha is a setting of"),
        (compare_args(fmnist_dir, out, "--budget", "client-samples:100000000"), "cannot be reached"),
        (compare_args(fmnist_dir, out, "--tune", "1", "--storage", "nosuchdb://here/x"), "nosuchdb://here/x"),
        (compare_args(fmnist_dir, out, "--test", "anova"), "unknown --test 'anova': use t, wilcoxon"),
        (compare_args(fmnist_dir, out, "--seeds", "1001"), "--seeds must be between 1 and 1000, got 1001"),
        (compare_args(fmnist_dir, out, "--seeds", "100000000000000000000"), "--seeds must be between 1 and 1000"),
        (compare_args(fmnist_dir, out, "--storage", "sqlite:///x.db"), "--storage keeps the trials of --tune N"),
        (compare_args(fmnist_dir, out, "--validation-fraction", "0.3"), "give --tune N, or drop --validation"),
    ]
    for args, needle in cases:
        expect_user_error(args, capsys, monkeypatch, needle)
    assert not out.exists()


def test_compare_gives_each_method_only_the_settings_it_takes(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    out = tmp_path / "cmp"
    args = compare_args(fmnist_dir, out, "--rounds", "1", "--mu", "0.5", "--limit-samples", "400", "--no-anchors")
    args[args.index("--methods") + 1] = "fedavg,fedprox-li"
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    saved = {m: read(out / f"{m}-seed0" / "config.json")["config"]["method"] for m in ("fedavg", "fedprox-li")}
    assert "mu" not in saved["fedavg"] and saved["fedprox-li"]["mu"] == 0.5
    assert read(out / "compare.json")["settings"]["mu"] == 0.5


def test_tuning_reads_no_test_image_before_the_final_runs(
    tmp_path,
    marked_dir,  # noqa: F811 (the fixture, imported above)
    capsys,
    monkeypatch,
    home,
):
    """Test images are marked (all white; no training image is): none reaches a model during the trials, and the
    final runs, scored on the test split, do feed them to the model."""
    seen, finals_started = white_images_seen(monkeypatch), []
    final_run = compare_module._final_run

    def marking_the_finals(*args, **kwargs):
        finals_started.append(len(seen))
        return final_run(*args, **kwargs)

    monkeypatch.setattr(compare_module, "_final_run", marking_the_finals)
    out = tmp_path / "cmp"
    args = compare_args(marked_dir, out, "--rounds", "2", "--tune", "2", "--no-anchors", methods="perada-nokd")
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    before = seen[: finals_started[0]]
    assert before and sum(before) == 0
    assert sum(seen[finals_started[0] :]) > 0
    result = read(out / "compare.json")
    tuning = result["tuning"]["perada-nokd"]
    assert len(tuning["trials"]) == 2 and tuning["best_params"]
    final = read_run_config(out / "perada-nokd-seed0")[0].to_flat()
    assert {key: final[key] for key in tuning["best_params"]} == tuning["best_params"]  # the final run takes the best
    for trial in tuning["trials"]:  # every trial scored on validation splits, of a partition no final run scores
        saved = read(Path(trial["run_dir"]) / "config.json")["config"]
        assert saved["data"]["eval_split"] == "validation" and saved["seed"] == result["tuning_seed"]
    assert result["tuning_seed"] not in result["seeds"] and result["tuning_tie_rule"]
    assert result["rows"][0]["tuned"] == tuning["best_params"]


def test_intervals_are_shown_within_0_and_100():
    """A t interval of few seeds can reach past a percentage's ends: the table shows it within them."""
    from peradapt.commands.comparison import _score

    entry = {"mean": 41.2, "std": 33.31, "low": -258.08, "high": 340.49}
    assert _score(entry, interval=True) == "41.20 ± 33.31 [0.00, 100.00]"
    assert _score({**entry, "low": 10.0, "high": 70.0}, interval=True) == "41.20 ± 33.31 [10.00, 70.00]"


def test_the_source_a_process_runs_is_read_once(monkeypatch):
    """Every run of one `compare` names the same source, even where the checkout changes while the sweep runs: the
    process runs the code it loaded."""
    from peradapt.federation import session as session_module

    calls = []

    def describe(command, **kwargs):
        calls.append(command)
        return subprocess.CompletedProcess(command, 0, stdout=f"commit-{len(calls)}\n")

    session_module.source_commit.cache_clear()
    monkeypatch.setattr(session_module.subprocess, "run", describe)
    try:
        first = session_module.source_commit()
        assert session_module.source_commit() == first and len(calls) <= 1
    finally:
        session_module.source_commit.cache_clear()
