"""The benchmark script runs, every phase of it, and so does `make gpu-check`'s driver; its one deterministic figure
(bytes kept per client) meets the issue's goal.

Timings are never asserted (they depend on the machine's load); the byte count does not."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench.py"
sys.path.insert(0, str(BENCH.parent))
from bench import ON_DEVICE  # noqa: E402  (benchmarks/ is no package)


def test_state_ratio_counts_two_resnet18_copies_against_one_adapter(tmp_path):
    out = tmp_path / "bench.json"
    finished = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--only", "state", "--json", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert finished.returncode == 0, finished.stderr
    results = json.loads(out.read_text())
    # ResNet-18 for 10 classes: 11,181,642 parameters + 9,600 BatchNorm statistics + 20 step counters, float32
    # apart from the int64 counters, twice (the reference's personalized and local model per client).
    assert results["reference_bytes_per_client"] == 2 * ((11_181_642 + 9_600) * 4 + 20 * 8)
    assert results["state_ratio"] == results["reference_bytes_per_client"] / results["peradapt_bytes_per_client"]
    assert results["state_ratio"] >= 15
    assert "state_ratio" in finished.stdout and "met" in finished.stdout


def test_gpu_check_without_a_gpu_says_so_in_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: `make gpu-check` runs there")
    finished = subprocess.run(
        [sys.executable, str(BENCH.with_name("gpu_check.py"))], capture_output=True, text=True, check=False
    )
    assert finished.returncode == 2
    assert finished.stdout.strip().startswith("error: no CUDA GPU is visible") and "\n" not in finished.stdout.strip()


# Each phase's headline figure: a phase that stops writing it (or writes a non-number) fails here.
PHASE_FIGURES = {
    "step": "adapter_step_vs_inference",
    "state": "state_ratio",
    "kd": "kd_phase_vs_student_only",
    "engine": "engine_overhead",
    "concurrent": "concurrent_vs_sequential",
    "estimate": "estimate_run_hours",
    "scale": "scale_rss_ratio",
}


def finite_numbers(value: object) -> list[float]:
    """Every number in `value` (nested dicts included); anything else fails the test."""
    if isinstance(value, dict):
        return [number for item in value.values() for number in finite_numbers(item)]
    assert isinstance(value, int | float) and not isinstance(value, bool), value
    assert math.isfinite(value), value
    return [float(value)]


def figures(results: dict) -> dict:
    return {k: v for k, v in results.items() if k not in ("size", "device", "machine", "settings")}


def test_every_phase_runs_at_toy_size_and_writes_finite_figures(tmp_path, fmnist_dir):
    """`bench.py --smoke` runs every phase through peradapt's current interfaces (the scale phase's `peradapt train`
    children on the tests' Fashion-MNIST stand-in); a phase that no longer runs, or writes no figure, fails here."""
    out = tmp_path / "bench.json"
    command = [sys.executable, str(BENCH), "--smoke", "--data-dir", str(fmnist_dir), "--json", str(out)]
    finished = subprocess.run(command, capture_output=True, text=True, check=False, cwd=BENCH.parent)
    assert finished.returncode == 0, finished.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["size"] == "smoke" and results["settings"]["backbone"] == "resnet10_w4"
    for phase, figure in PHASE_FIGURES.items():
        assert f"{phase}: " in finished.stderr, phase  # the phase reported its time
        assert finite_numbers(results[figure]), figure
    assert finite_numbers(figures(results))
    assert set(results["scale_peak_rss_bytes"]) == {"4", "40"}


def test_gpu_check_on_the_cpu_runs_the_cuda_tests_then_the_device_figures(tmp_path):
    """The driver of `make gpu-check`, its device switched to the CPU: the `cuda` tests run (none skipped but the
    channels-last one, which is a GPU layout), then the on-device figures, into one JSON."""
    out = tmp_path / "check.json"
    command = [sys.executable, str(BENCH.with_name("gpu_check.py")), "--device", "cpu", "--smoke", "--json", str(out)]
    finished = subprocess.run(command, capture_output=True, text=True, check=False)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    check = json.loads(out.read_text())
    assert check["device"] == "cpu" and check["torch"]
    tests = check["tests"]
    assert tests["returncode"] == 0, tests["log"]
    assert re.match(r"\d+ passed, 1 skipped\b", tests["summary"]), tests["summary"]
    assert "channels-last" in tests["log"]  # the skip's reason, from -ra
    benchmark = check["benchmark"]
    assert benchmark["device"] == "cpu" and benchmark["size"] == "smoke"
    on_device = {phase: figure for phase, figure in PHASE_FIGURES.items() if phase in ON_DEVICE}
    assert set(on_device) == set(ON_DEVICE)
    for figure in on_device.values():
        assert finite_numbers(benchmark[figure])
    assert "state_ratio" not in benchmark  # a CPU-only figure: not the driver's to take
    assert json.loads(out.with_suffix(".bench.json").read_text()) == benchmark
    assert f"cpu: tests {tests['summary']}; figures in {out}" in finished.stdout
