"""How long the command line takes to start (issue 34, item 5): the wall time of `peradapt --help`, `peradapt
methods`, `peradapt train --help`, of `import peradapt`, and of the imports that a command's own work waits for (the
training stack for train, the finished-run commands for eval and export), each in a fresh process; and which heavy
packages each leaves imported.

    python benchmarks/startup.py --repeats 5 --json startup.json

The cases run in turn, round after round, so that a busy phase of the machine slows them alike; the least of the
repeats is reported (the time a quiet machine takes), with the median beside it.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

# A case: what runs in the fresh process (`peradapt ARGS` through its entry point, or Python code).
CASES: dict[str, list[str]] = {
    "peradapt --help": ["-m", "peradapt", "--help"],
    "peradapt methods": ["-m", "peradapt", "methods"],
    "peradapt train --help": ["-m", "peradapt", "train", "--help"],
    "import peradapt": ["-c", "import peradapt"],
    "train's own work can start (import peradapt.commands.training)": [
        "-c",
        "import peradapt.cli, peradapt.commands.training",
    ],
    "eval's own work can start (import peradapt.commands.finished_run)": [
        "-c",
        "import peradapt.cli, peradapt.commands.finished_run",
    ],
}
HEAVY = ("torch", "torchvision", "timm", "peft", "transformers", "matplotlib", "optuna", "sklearn", "scipy", "flwr")
# Appended to a case: the heavy top-level packages left in sys.modules, printed as JSON on the last line of stderr.
REPORT_IMPORTS = (
    "import atexit, json, sys\n"
    f"atexit.register(lambda: print(json.dumps(sorted(set({HEAVY!r}) & set(sys.modules))), file=sys.stderr))\n"
)


def command_line(arguments: list[str]) -> list[str]:
    """A case as a command line that also reports its imports."""
    if arguments[0] == "-m":  # `python -m peradapt ARGS`, with the reporter registered first
        code = REPORT_IMPORTS + f"import sys, runpy; sys.argv = ['peradapt', *{arguments[2:]!r}]\n"
        code += "runpy.run_module('peradapt', run_name='__main__')"
        return [sys.executable, "-c", code]
    return [sys.executable, "-c", REPORT_IMPORTS + arguments[1]]


def run_once(arguments: list[str]) -> tuple[float, list[str]]:
    start = time.perf_counter()
    finished = subprocess.run(command_line(arguments), capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if finished.returncode not in (0, 2):  # `peradapt` alone exits 2 after its help; anything else is a failure
        raise SystemExit(f"{arguments}: exit {finished.returncode}\n{finished.stderr}")
    return seconds, json.loads(finished.stderr.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes per case")
    parser.add_argument("--json", type=Path, help="write the results here")
    options = parser.parse_args()
    seconds: dict[str, list[float]] = {name: [] for name in CASES}
    imported: dict[str, list[str]] = {}
    for _ in range(options.repeats):
        for name, arguments in CASES.items():
            took, heavy = run_once(arguments)
            seconds[name].append(took)
            imported[name] = heavy
    results = {
        name: {"least_s": min(times), "median_s": statistics.median(times), "heavy_imports": imported[name]}
        for name, times in seconds.items()
    }
    for name, result in results.items():
        heavy = ", ".join(result["heavy_imports"]) or "none"
        print(f"{result['least_s']:6.2f} s (median {result['median_s']:.2f})  {name}  [heavy: {heavy}]")
    if options.json:
        machine = {"python": platform.python_version(), "machine": platform.processor() or platform.machine()}
        record = {"machine": machine, "repeats": options.repeats, "cases": results}
        options.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
