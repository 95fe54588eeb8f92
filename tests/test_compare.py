"""`peradapt compare`: several methods on the same seeds, one table, finished runs reused."""

from __future__ import annotations

import json

import peradapt.comparison as compare_module

from .test_cli import run_cli, tiny_args


def compare_args(fmnist_dir, out, *extra):
    train_flags = tiny_args(fmnist_dir, out)[1:]
    at = train_flags.index("--out")
    del train_flags[at : at + 2]
    return ["compare", "--methods", "perada,perada-nokd", "--seeds", "1", "--out", str(out), *train_flags, *extra]


def test_compare_runs_every_method_and_reuses_finished_runs(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    out = tmp_path / "cmp"
    code, stdout, err = run_cli(compare_args(fmnist_dir, out, "--rounds", "1"), capsys, monkeypatch)
    assert code == 0, err
    assert "perada-nokd" in stdout and "compare.md" in stdout
    summary = json.loads((out / "compare.json").read_text())
    rows = {row["method"]: row for row in summary["rows"]}
    assert set(rows) == {"perada", "perada-nokd"}
    for method, row in rows.items():
        report = json.loads((out / f"{method}-seed0" / "report.json").read_text())
        assert row["personalized_local_test"]["seeds"] == [100 * report["summary"]["personalized_local_test"]]
        resolved = json.loads((out / f"{method}-seed0" / "config.json").read_text())["resolved"]
        assert row["trained"] == 2 * resolved["trainable_parameters"]  # PerAda trains v_m and theta_m
    # Both methods saw the same partition.
    partitions = [json.loads((out / f"{m}-seed0" / "partition.json").read_text()) for m in rows]
    assert partitions[0] == partitions[1]
    assert "| perada-nokd | adapter |" in (out / "compare.md").read_text()

    def no_training(*args, **kwargs):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(compare_module, "train", no_training)
    code, _, err = run_cli(compare_args(fmnist_dir, out, "--rounds", "1"), capsys, monkeypatch)
    assert code == 0, err

    code, _, err = run_cli(compare_args(fmnist_dir, out, "--rounds", "1", "--lr", "0.2"), capsys, monkeypatch)
    assert code == 2 and "other settings" in err


def test_compare_rejects_what_it_sets_itself(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    out = tmp_path / "cmp"
    code, _, err = run_cli(compare_args(fmnist_dir, out, "--seed", "4"), capsys, monkeypatch)
    assert code == 2 and "seed" in err
    code, _, err = run_cli(compare_args(fmnist_dir, out, "--no-such-flag", "1"), capsys, monkeypatch)
    assert code == 2 and "no-such-flag" in err
    args = compare_args(fmnist_dir, out)
    args[args.index("--methods") + 1] = "perada,fedsomething"
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 2 and "fedsomething" in err
    assert not out.exists()


def test_compare_gives_each_method_only_the_settings_it_takes(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    out = tmp_path / "cmp"
    args = compare_args(fmnist_dir, out, "--rounds", "1", "--mu", "0.5", "--limit-samples", "400")
    args[args.index("--methods") + 1] = "fedavg,fedprox-li"
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    saved = {
        m: json.loads((out / f"{m}-seed0" / "config.json").read_text())["config"]["method"] for m in args[2].split(",")
    }
    assert "mu" not in saved["fedavg"] and saved["fedprox-li"]["mu"] == 0.5
    assert json.loads((out / "compare.json").read_text())["settings"]["mu"] == 0.5


def test_compare_refuses_a_setting_no_compared_method_takes(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    out = tmp_path / "cmp"
    code, _, err = run_cli(compare_args(fmnist_dir, out, "--feddyn-alpha", "0.1"), capsys, monkeypatch)
    assert code == 2 and "--feddyn-alpha is a setting of feddyn: none of --methods perada, perada-nokd takes it" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()
