"""`make gpu-check`: verify peradapt's CUDA path on this machine and take the GPU benchmark figures, in one command.

    python benchmarks/gpu_check.py [--json gpu-check.json] [--quick | --smoke] [--device cuda|cpu] [--scale]
        [--reference benchmarks/reference/PerAda]

1. The tests marked `cuda` (tests/test_cuda.py: bf16 against fp32 predictions, channels-last, a crashed and resumed
   GPU run bit-identical to an uninterrupted one, seeded DP noise on the device, Flower with GPU resources,
   concurrent clients agreeing with one after another and resuming bit-identically), on the
   tests' own synthetic Fashion-MNIST stand-in: no network, no dataset needed.
2. The benchmark figures that a GPU changes (`bench.py --device cuda --only` the `ON_DEVICE` figures: step, kd,
   concurrent, estimate), on random images.
3. With `--scale`, the scale phase too (on a GPU a round of 1,000 clients and a 10,000-client run: `scale_on_gpu`);
   with `--reference DIR`, one round of the authors' NVlabs/PerAda code against peradapt's
   (`benchmarks/reference_round.py`; DIR is its export of their tree).
4. One JSON: the device, the tests' outcome, the figures, written after each part (a time limit keeps what is
   done). Exit code 0 only when every test passed and every part ran.

Without a visible CUDA GPU it stops at once with one line (exit 2): it has nothing to check.

`--device cpu` runs the same steps in the same order on the CPU (the `cuda` tests with their device switched to cpu
through PERADAPT_CHECK_DEVICE, the figures with `bench.py --device cpu`), and `--smoke` shrinks the figures to toy
size: tests/test_bench.py drives it so, so that only the CUDA kernels themselves go untested without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
from bench import ON_DEVICE  # this directory: the script runs as benchmarks/gpu_check.py

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path("gpu-check.json"), help="where to write the results")
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--quick", action="store_true", help="the benchmark's shorter phases")
    sizes.add_argument("--smoke", action="store_true", help="the benchmark's phases at toy size (measures nothing)")
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the same steps on the CPU, to test this driver"
    )
    parser.add_argument("--scale", action="store_true", help="also the scale phase (on a GPU: scale_on_gpu)")
    parser.add_argument(
        "--reference",
        type=Path,
        help="also benchmarks/reference_round.py against the NVlabs/PerAda tree exported here (see its docstring)",
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA GPU is visible (torch.cuda.is_available() is False): run this on a GPU machine")
        sys.exit(2)
    gpu = args.device == "cuda"
    results: dict = {
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "bf16": torch.cuda.is_bf16_supported() if gpu else None,
        "tests": run_tests(args.device),
    }
    args.json.write_text(json.dumps(results, indent=2) + "\n")  # after each part: a time limit keeps what is done
    bench_json = args.json.with_suffix(".bench.json")
    bench_json.unlink(missing_ok=True)  # an earlier check's figures are not this one's
    size = ["--smoke"] if args.smoke else ["--quick"] if args.quick else []
    phases = [*ON_DEVICE, *(["scale"] if args.scale else [])]
    command = [sys.executable, str(ROOT / "benchmarks" / "bench.py"), "--device", args.device, *size]
    command += ["--only", ",".join(phases), "--json", str(bench_json.resolve())]
    finished = subprocess.run(command, cwd=ROOT / "benchmarks", capture_output=True, text=True, check=False)
    # A failed phase leaves the others' figures, and its error under "failed".
    results["benchmark"] = json.loads(bench_json.read_text()) if bench_json.exists() else None
    results["benchmark_log"] = finished.stdout[-4000:] + finished.stderr[-4000:]
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    ok = results["tests"]["returncode"] == 0 and finished.returncode == 0
    if args.reference is not None:
        reference_json = args.json.with_suffix(".reference.json")
        command = [sys.executable, str(ROOT / "benchmarks" / "reference_round.py"), "--device", args.device]
        command += ["--reference", str(args.reference.resolve()), "--json", str(reference_json.resolve())]
        command += ["--smoke"] if args.smoke else []
        finished = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
        results["reference_round"] = json.loads(reference_json.read_text()) if reference_json.exists() else None
        results["reference_round_log"] = finished.stdout[-2000:] + finished.stderr[-2000:]
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        ok = ok and finished.returncode == 0
    print(f"{results['device']}: tests {results['tests']['summary']}; figures in {args.json}")
    sys.exit(0 if ok else 1)


def run_tests(device: str) -> dict:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", "tests/test_cuda.py"]
    environment = {**os.environ, "PERADAPT_CHECK_DEVICE": device}
    finished = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False, env=environment)
    lines = finished.stdout.strip().splitlines()
    summary = next((line for line in reversed(lines) if re.search(r"\d+ (passed|failed|skipped|error)", line)), "")
    return {"returncode": finished.returncode, "summary": summary.strip("= "), "log": finished.stdout[-6000:]}


if __name__ == "__main__":
    main()
