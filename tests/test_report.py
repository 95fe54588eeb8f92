"""`peradapt report`: PNG plots and a comparison table built from the files of finished runs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from .test_cli import run_cli, run_main, tiny_args

ROUNDS_PNG = (1300, 480)  # ROUNDS_SIZE at DPI
PER_CLIENT_PNG = (1200, 500)
C0, C1 = (0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)  # matplotlib's first two colours: the first and second run


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pretrained_home, fmnist_dir) -> tuple[Path, Path]:
    """A PerAda run with an OOD evaluation and a personalized new client, and a FedAvg run."""
    root = tmp_path_factory.mktemp("report-runs")
    perada, fedavg = root / "perada", root / "fedavg"
    commands = [
        tiny_args(fmnist_dir, perada, "--rounds", "2", "--eval-every", "1", "--holdout-clients", "1"),
        ["eval", "--run", str(perada), "--ood", "fmnist-c", "--ood-limit", "10"],
        ["personalize", "--run", str(perada), "--new-client", "3"],
        tiny_args(fmnist_dir, fedavg, "--rounds", "2", "--method", "fedavg"),
    ]
    for args in commands:
        run_main(args, pretrained_home)
    return perada, fedavg


def pixels(path: Path, size: tuple[int, int]) -> np.ndarray:
    with Image.open(path) as image:
        image.load()
        assert image.format == "PNG" and image.size == size
        return np.asarray(image.convert("RGB"))


def has_colour(image: np.ndarray, colour: tuple[int, int, int]) -> bool:
    return bool((np.abs(image.astype(int) - colour).sum(axis=2) < 12).any())


def test_report_of_one_run_writes_plots_and_tables_beside_it(runs, capsys, monkeypatch, home):
    perada, _ = runs
    code, out, err = run_cli(["report", str(perada)], capsys, monkeypatch)
    assert code == 0, err
    for name in ("accuracy_per_round.png", "per_client.png", "summary.md", "summary.json"):
        assert f"written {perada / name}" in out.replace("\n", "")
    assert has_colour(pixels(perada / "accuracy_per_round.png", ROUNDS_PNG), C0)
    assert has_colour(pixels(perada / "per_client.png", PER_CLIENT_PNG), C0)

    report = json.loads((perada / "report.json").read_text())
    [row] = json.loads((perada / "summary.json").read_text())["rows"]
    assert row["method"] == "perada" and row["clients"] == 3 and row["rounds"] == 2
    local = report["personalized"]["local_test"]
    assert row["personalized_local_test"] == pytest.approx({"mean": 100 * local["mean"], "std": 100 * local["std"]})
    assert row["global_global_test"] == pytest.approx(100 * report["global"]["global_test"])
    ood = json.loads((perada / "ood-fmnist-c.json").read_text())["average"]
    assert row["ood"] == {
        "fmnist-c": pytest.approx({"personalized": 100 * ood["personalized_mean"], "global": 100 * ood["global"]})
    }
    new_client = json.loads((perada / "new_clients" / "3" / "result.json").read_text())
    assert row["new_clients"] == pytest.approx(
        {
            "clients": 1,
            "before": 100 * new_client["before"]["local_test"],
            "after": 100 * new_client["after"]["local_test"],
            "samples": new_client["cost"]["samples"],  # its personalization's work
            "flops": new_client["cost"]["flops"],
        }
    )
    table = (perada / "summary.md").read_text()
    assert "fmnist-c (personalized / global)" in table and "new clients" in table
    assert f"{row['personalized_local_test']['mean']:.2f} ± {row['personalized_local_test']['std']:.2f}" in table


def test_report_compares_runs_in_reports_dir(runs, tmp_path, capsys, monkeypatch, home):
    perada, fedavg = runs
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(["report", str(perada), str(fedavg)], capsys, monkeypatch)
    assert code == 0, err
    out = tmp_path / "reports"
    rounds_plot = pixels(out / "accuracy_per_round.png", ROUNDS_PNG)
    assert has_colour(rounds_plot, C0) and has_colour(rounds_plot, C1)  # one colour per run
    assert has_colour(pixels(out / "per_client.png", PER_CLIENT_PNG), C1)
    rows = json.loads((out / "summary.json").read_text())["rows"]
    assert [(r["method"], r["clients"]) for r in rows] == [("perada", 3), ("fedavg", 4)]
    assert rows[1]["ood"] == {} and rows[1]["new_clients"] is None
    lines = (out / "summary.md").read_text().splitlines()
    fedavg_line = next(line for line in lines if "| fedavg |" in line)
    assert fedavg_line.rstrip(" |").endswith("| - | -")  # no OOD set, no new clients for that run
    # --out elsewhere; the per-round plot is the same picture wherever it is written
    code, _, err = run_cli(["report", str(perada), str(fedavg), "--out", str(tmp_path / "x")], capsys, monkeypatch)
    assert code == 0, err
    assert np.array_equal(pixels(tmp_path / "x" / "accuracy_per_round.png", ROUNDS_PNG), rounds_plot)


def test_report_refuses_what_is_not_a_finished_run(runs, tmp_path, capsys, monkeypatch, home):
    perada, _ = runs
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "config.json").write_bytes((perada / "config.json").read_bytes())
    for path, message in ((tmp_path / "missing", "not a directory"), (unfinished, "has not finished")):
        code, _, err = run_cli(["report", str(path)], capsys, monkeypatch)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not (unfinished / "summary.md").exists()
