"""`peradapt report`: plots and a comparison table of finished runs, from their own files.

Per run it reads `config.json` (scope), `metrics.jsonl` (accuracies of the evaluation rounds, `--eval-every`),
`report.json` (the final evaluation: per client, personalized and global) and any `ood-<name>.json` (accuracy on
an out-of-distribution set; the average over sets is reported). Nothing is re-evaluated: the numbers are exactly
the ones `train` wrote. It writes `accuracy_per_round.png`, `per_client.png`, `summary.md` and `summary.json`
into `out`: by default the run directory itself for one run, `reports/` for several.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from peradapt.compare import ACCURACIES
from peradapt.errors import RunError
from peradapt.evaluation.plots import ROUND_METRICS, RunResults, plot_accuracy_per_round, plot_per_client
from peradapt.federation.checkpoint import write_json_atomic, write_text_atomic
from peradapt.federation.session import RunPaths, read_run_config

DEFAULT_OUT = Path("reports")
OOD_PREFIX = "ood-"


def default_out(runs: list[Path]) -> Path:
    """One run: its own directory (next to report.json); several: `reports/`."""
    return runs[0] if len(runs) == 1 else DEFAULT_OUT


def build_report(runs: list[Path], out: Path | None = None) -> list[Path]:
    """Plots and summary table of finished runs; returns the files written (in `out`, see `default_out`)."""
    if not runs:
        raise RunError("report needs at least one run directory")
    loaded = [_load_run(run) for run in runs]
    _label_runs(loaded)
    out = out if out is not None else default_out(runs)
    if out.exists() and not out.is_dir():
        raise RunError(f"{out} is a file: pass a directory to --out")
    out.mkdir(parents=True, exist_ok=True)
    results = [_plot_results(run) for run in loaded]
    rows = [_row(run) for run in loaded]
    written = [
        plot_accuracy_per_round(results, out / "accuracy_per_round.png"),
        plot_per_client(results, out / "per_client.png"),
    ]
    write_text_atomic(out / "summary.md", markdown_summary(rows))
    write_json_atomic(out / "summary.json", {"accuracy_unit": "percent", "rows": rows})
    return [*written, out / "summary.md", out / "summary.json"]


# ---------------------------------------------------------------- reading a run


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise RunError(f"{path} is unreadable ({exc})") from None


def _load_run(run: Path) -> dict:
    if not run.is_dir():
        raise RunError(f"{run} is not a directory: pass run directories written by `peradapt train`")
    config, resolved = read_run_config(run)  # refuses directories without a readable config.json
    paths = RunPaths(run)
    if not paths.report.is_file():
        raise RunError(
            f"{run} has not finished (no report.json): finish it with `peradapt train --out {run} --resume`"
        )
    report = _read_json(paths.report)
    if not isinstance(report, dict) or not {"method", "seed", "clients", "personalized", "global"} <= report.keys():
        raise RunError(f"{paths.report} is not a report written by `peradapt train`")
    return {
        "path": run,
        "report": report,
        "scope": resolved.get("scope") or config.method.scope or "adapter",
        "history": _read_metrics(paths.metrics),
        "ood": _read_ood(run),
    }


def _read_metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []  # only the final evaluation to show
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError as exc:
            raise RunError(f"{path} line {number} is not JSON ({exc})") from None
    return records


def _accuracy(value: Any) -> float | None:
    """Mean accuracy in percent from a number, a per-client list, {"mean": ...} or {"per_client": [...]}."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value) * (100 if value <= 1 else 1)  # the engine writes fractions
    if isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
        return _accuracy(float(np.mean(value)))
    if isinstance(value, dict):
        for key in ("mean", "per_client", "accuracy", "local_test", "ood", "test"):
            if key in value:
                return _accuracy(value[key])
        if len(value) == 1:
            return _accuracy(next(iter(value.values())))
    return None


def _read_ood(run: Path) -> dict[str, float]:
    """Name -> mean accuracy % of the personalized adapters (or of what the file holds) on each OOD set."""
    ood = {}
    for path in sorted(run.glob(f"{OOD_PREFIX}*.json")):
        data = _read_json(path)
        value = None
        if isinstance(data, dict):
            summary = data.get("summary", {})
            flat = [v for k, v in summary.items() if k.startswith("personalized") and not k.endswith("_std")]
            value = _accuracy(data.get("personalized"))
            if value is None and flat:
                value = _accuracy(flat[0])
        value = value if value is not None else _accuracy(data)
        if value is not None:  # files of another layout are left out rather than guessed at
            ood[path.stem[len(OOD_PREFIX) :]] = value
    return ood


def _label_runs(loaded: list[dict]) -> None:
    for run in loaded:
        run["label"] = f"{run['report']['method']} (seed {run['report']['seed']})"
    labels = [run["label"] for run in loaded]
    for run in loaded:
        if labels.count(run["label"]) > 1:  # same method and seed, other settings: name the directory too
            run["label"] = f"{run['report']['method']} (seed {run['report']['seed']}, {run['path'].name})"


# ---------------------------------------------------------------- what the plots and the table show


def _final(report: dict) -> dict[str, float]:
    """The report's final accuracies under the metrics.jsonl keys, in percent."""
    final = {}
    for who in ("personalized", "global"):
        for split, value in report[who].items():
            accuracy = _accuracy(value)
            if accuracy is not None:
                final[f"{who}_{split}"] = accuracy
    return final


def _plot_results(run: dict) -> RunResults:
    report = run["report"]
    rounds = int(report.get("rounds") or len(run["history"]))
    final = _final(report)
    curves = {}
    for key, _, _ in ROUND_METRICS:
        points = {int(r["round"]): 100 * float(r[key]) for r in run["history"] if key in r and "round" in r}
        if key in final:
            points[rounds] = final[key]  # the last round ends where report.json says
        curves[key] = sorted(points.items())
    ood = run["ood"]
    return RunResults(
        label=run["label"],
        rounds=rounds,
        curves=curves,
        clients=list(report["clients"]),
        personalized_local=[100 * v for v in report["personalized"]["local_test"]["per_client"]],
        global_local=[100 * v for v in report["global"]["local_test"]["per_client"]],
        ood_average=float(np.mean(list(ood.values()))) if ood else None,
    )


def _stats(entry: Any) -> dict[str, float] | float | None:
    if isinstance(entry, dict) and "mean" in entry:
        return {"mean": 100 * float(entry["mean"]), "std": 100 * float(entry.get("std", 0.0))}
    if isinstance(entry, (int, float)):
        return 100 * float(entry)
    return None


def _row(run: dict) -> dict:
    report, ood = run["report"], run["ood"]
    return {
        "run": str(run["path"]),
        "label": run["label"],
        "method": report["method"],
        "seed": report["seed"],
        "scope": run["scope"],
        "data": report.get("data"),
        "rounds": report.get("rounds"),
        "clients": len(report["clients"]),
        "personalized_local_test": _stats(report["personalized"].get("local_test")),
        "personalized_global_test": _stats(report["personalized"].get("global_test")),
        "global_local_test": _stats(report["global"].get("local_test")),
        "global_global_test": _stats(report["global"].get("global_test")),
        "ood": ood,
        "ood_average": float(np.mean(list(ood.values()))) if ood else None,
    }


def _cell(value: dict[str, float] | float | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):
        return f"{value['mean']:.2f} ± {value['std']:.2f}"
    return f"{value:.2f}"


def markdown_summary(rows: list[dict]) -> str:
    """The comparison table; accuracy columns and their names as in `peradapt compare`."""
    headers = ["run", "method", "seed", "scope", *(label for _, label in ACCURACIES), "OOD avg"]
    lines = [
        "Accuracy % (mean ± std over clients) of each run's personalized adapters; "
        "`global-test of w`: the global adapter; `OOD avg`: mean over the run's ood-*.json sets.",
        "",
        "| " + " | ".join(headers) + " |",
        "|" + "---|" * len(headers),
    ]
    for row in rows:
        cells = [f"`{row['run']}`", row["method"], str(row["seed"]), row["scope"]]
        cells += [_cell(row[key]) for key, _ in ACCURACIES]
        cells.append(_cell(row["ood_average"]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
