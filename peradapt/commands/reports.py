"""`peradapt report`: plots and a comparison table of finished runs, from their own files.

Per run it reads `config.json` (scope), `metrics.jsonl` (accuracies of the evaluation rounds, `--eval-every`),
`report.json` (the final evaluation: per client, personalized and global), any `ood-<name>.json` (`peradapt eval
--ood NAME`: accuracy on an out-of-distribution set, averaged over its parts) and any
`new_clients/<id>/result.json` (`peradapt personalize`). Nothing is re-evaluated: the numbers are exactly the
ones those commands wrote. It writes `accuracy_per_round.png`, `per_client.png`, `accuracy_vs_cost.png` (runs that
recorded their costs), `summary.md` and `summary.json` into `out`: by default the run directory itself for one run,
`reports/` for several.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from peradapt.commands.newclients import NEW_CLIENTS_DIR
from peradapt.errors import RunError
from peradapt.evaluation import METRIC_LABELS
from peradapt.evaluation.plots import (
    ROUND_METRICS,
    CostPoint,
    RunResults,
    plot_accuracy_per_round,
    plot_accuracy_vs_cost,
    plot_per_client,
)
from peradapt.rundir.checkpoint import write_json_atomic, write_text_atomic
from peradapt.rundir.files import check, damaged, read_json, read_text
from peradapt.rundir.layout import RunPaths, read_report, read_run_config
from peradapt.rundir.lock import RunLock
from peradapt.rundir.records import Report, RoundRecord, Stats

DEFAULT_OUT = Path("reports")
OOD_PREFIX = "ood-"
ACCURACIES = (  # (summary key, column label) of the task's metric: accuracy, or AUC for multi-label data
    ("personalized_local_test", "local-test"),
    ("personalized_global_test", "global-test"),
    ("global_global_test", "global-test of w"),
)


def default_out(runs: list[Path]) -> Path:
    """One run: its own directory (next to report.json); several: `reports/`."""
    return runs[0] if len(runs) == 1 else DEFAULT_OUT


def write_report(runs: list[Path], out: Path | None = None) -> list[Path]:
    """Plots and summary table of finished runs; returns the files written (in `out`, see `default_out`). Each run
    is held for reading (`RunLock`) while its files are read and the report written: a run that a `train` is
    writing is refused, before anything is written."""
    if not runs:
        raise RunError("report needs at least one run directory")
    with ExitStack() as held:
        for run in runs:
            held.enter_context(RunLock(run, exclusive=False))
        return _write_report(runs, out)


def _write_report(runs: list[Path], out: Path | None) -> list[Path]:
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
    metrics = "/".join(sorted({METRIC_LABELS[run["report"].metric] for run in loaded}))
    y_name = f"personalized local-test {metrics} %"
    written.append(plot_accuracy_vs_cost(cost_panels(loaded), y_name, out / "accuracy_vs_cost.png"))
    write_text_atomic(out / "summary.md", markdown_summary(rows))
    write_json_atomic(out / "summary.json", {"accuracy_unit": "percent", "rows": rows})
    return [*written, out / "summary.md", out / "summary.json"]


# ---------------------------------------------------------------- reading a run


def _load_run(run: Path) -> dict:
    if not run.is_dir():
        raise RunError(f"{run} is not a directory: pass run directories written by `peradapt train`")
    _, resolved = read_run_config(run)  # refuses directories without a readable config.json
    paths = RunPaths(run)
    report = read_report(run)  # checked as this module reads it
    if report is None:
        raise RunError(f"{run} has not finished (no report.json): finish it with `peradapt train --out {run} --resume`")
    return {
        "path": run,
        "report": report,
        "scope": resolved.scope,
        "history": read_metrics(paths.metrics),
        "ood": read_ood(run),
    }


def read_metrics(path: Path) -> list[RoundRecord]:
    """A run's metrics.jsonl, a record per round, each checked."""
    if not path.is_file():
        return []  # only the final evaluation to show
    remedy = f"write it again from the run's newest checkpoint with `peradapt train --out {path.parent} --resume`"
    text = read_text(path, remedy)
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise damaged(path, f"line {number} is not JSON: {exc}", remedy) from None
        records.append(RoundRecord.from_json(record, path, remedy, f"line {number}"))
    return records


def cost_panels(runs: list[dict]) -> list[tuple[str, list[CostPoint]]]:
    """`plot_accuracy_vs_cost`'s panels: each run's personalized local-test (percent) against the bytes its clients
    sent and received, their training FLOPs and their training samples (report.json's `cost`), by method."""
    panels: dict[str, list[CostPoint]] = {
        "bytes sent, up and down": [],
        "client training FLOPs": [],
        "client training samples": [],
    }
    for run in runs:
        report, cost = run["report"], run["report"].cost
        score = _percent(report.personalized.local_test)
        costs = (cost.bytes_up + cost.bytes_down, cost.client_flops, cost.client_samples)
        for points, value in zip(panels.values(), costs, strict=True):
            points.append((report.method, float(value), score))
    return list(panels.items())


def _percent(value: float | Stats) -> float:
    """A score in percent: a fraction, or the mean of per-client values."""
    return 100 * float(value.mean if isinstance(value, Stats) else value)


def read_ood(run: Path) -> dict[str, dict[str, float]]:
    """OOD set name -> mean over clients of the personalized adapters and the global adapter, in percent,
    averaged over the set's parts (from `peradapt eval --ood NAME`)."""
    ood = {}
    for path in sorted(run.glob(f"{OOD_PREFIX}*.json")):
        remedy = f"delete it, or write it again with `peradapt eval --run {run} --ood` and the name of its set"
        data = read_json(path, remedy)
        check(data, {"ood": str, "average": {"personalized_mean": float, "global": float}}, path, remedy)
        average = data["average"]
        ood[data["ood"]] = {
            "personalized": _percent(average["personalized_mean"]),
            "global": _percent(average["global"]),
        }
    return ood


def _label_runs(loaded: list[dict]) -> None:
    for run in loaded:
        run["label"] = f"{run['report'].method} (seed {run['report'].seed})"
    labels = [run["label"] for run in loaded]
    for run in loaded:
        if labels.count(run["label"]) > 1:  # same method and seed, other settings: name the directory too
            run["label"] = f"{run['report'].method} (seed {run['report'].seed}, {run['path'].name})"


# ---------------------------------------------------------------- what the plots and the table show


def round_curve(history: list[RoundRecord], report: Report, key: str) -> list[tuple[int, float]]:
    """(round, percent) of a round record's score `key` at the run's evaluated rounds, in order; the last round's
    point is the final evaluation (report.json), which every run has, even one trained with --eval-every 0."""
    points = {record.round: 100 * float(getattr(record, key)) for record in history if getattr(record, key) is not None}
    final = report.scores()
    if key in final:
        points[report.rounds] = _percent(final[key])  # the last round ends where report.json says
    return sorted(points.items())


def _plot_results(run: dict) -> RunResults:
    report = run["report"]
    return RunResults(
        label=run["label"],
        rounds=report.rounds,
        metric=report.metric,
        curves={key: round_curve(run["history"], report, key) for key, _, _ in ROUND_METRICS},
        clients=list(report.clients),
        personalized_local=[100 * v for v in report.personalized.local_test.per_client],
        global_local=[100 * v for v in report.global_.local_test.per_client],
        ood=run["ood"],
    )


def _stats(entry: float | Stats) -> dict[str, float] | float:
    if isinstance(entry, Stats):
        return {"mean": 100 * float(entry.mean), "std": 100 * float(entry.std)}
    return 100 * float(entry)


def read_new_clients(run: Path) -> dict | None:
    """Mean local-test % of the run's new clients (`peradapt personalize`) with the global and personalized model,
    and the training samples and FLOPs of their personalization (where all of them recorded it)."""
    results = []
    for path in sorted(run.glob(f"{NEW_CLIENTS_DIR}/*/result.json")):
        remedy = f"delete {path.parent}, or personalize that client again with `peradapt personalize --run {run}`"
        results.append(read_json(path, remedy))
        check(results[-1], {"before": {"local_test": float}, "after": {"local_test": float}}, path, remedy)
    if not results:
        return None
    costs = [r["cost"] for r in results if "cost" in r]  # personalized before issue 36: not counted
    return {
        "clients": len(results),
        "before": float(np.mean([100 * r["before"]["local_test"] for r in results])),
        "after": float(np.mean([100 * r["after"]["local_test"] for r in results])),
        **(
            {"samples": sum(c["samples"] for c in costs), "flops": sum(c["flops"] for c in costs)}
            if len(costs) == len(results)
            else {}
        ),
    }


def _row(run: dict) -> dict:
    report = run["report"]
    return {
        "run": str(run["path"]),
        "label": run["label"],
        "method": report.method,
        "seed": report.seed,
        "scope": run["scope"],
        "metric": report.metric,
        "data": report.data,
        "rounds": report.rounds,
        "clients": len(report.clients),
        **{key: _stats(report.scores()[key]) for key, _ in ACCURACIES},
        "ood": run["ood"],
        "new_clients": read_new_clients(run["path"]),
        # --dp-noise runs: ε per client, mean, std, max
        "dp_epsilon": report.privacy.epsilon.to_json() if report.privacy else None,
    }


def _cell(value: dict[str, float] | float | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):
        return f"{value['mean']:.2f} ± {value['std']:.2f}"
    return f"{value:.2f}"


def markdown_summary(rows: list[dict]) -> str:
    """The comparison table; accuracy columns and their names as in `peradapt compare`, then OOD and new clients."""
    ood_names = sorted({name for row in rows for name in row["ood"]})
    new_clients = any(row["new_clients"] for row in rows)
    headers = ["run", "method", "seed", "scope", "metric", *(label for _, label in ACCURACIES)]
    headers += [f"{name} (personalized / global)" for name in ood_names]
    headers += ["new clients: global → personalized"] if new_clients else []
    private = any(row["dp_epsilon"] for row in rows)
    headers += ["DP ε: mean ± std (max)"] if private else []
    lines = [
        "Accuracy % (AUC % for multi-label runs: see `metric`), mean ± std over clients, of each run's personalized "
        "models; `global-test of w`: the global "
        "model. OOD columns: mean over clients and over the set's corruptions and severities (`peradapt eval --ood`). "
        "New clients: mean local-test of the held-out clients before and after `peradapt personalize`. DP ε: the "
        "clients' sample-level ε at the run's δ (`--dp-noise`).",
        "",
        "| " + " | ".join(headers) + " |",
        "|" + "---|" * len(headers),
    ]
    for row in rows:
        cells = [f"`{row['run']}`", row["method"], str(row["seed"]), row["scope"], row["metric"]]
        cells += [_cell(row[key]) for key, _ in ACCURACIES]
        for name in ood_names:
            ood = row["ood"].get(name)
            cells.append("-" if ood is None else f"{ood['personalized']:.2f} / {ood['global']:.2f}")
        if new_clients:
            new = row["new_clients"]
            cells.append("-" if new is None else f"{new['before']:.2f} → {new['after']:.2f} ({new['clients']})")
        if private:
            spent = row["dp_epsilon"]
            cells.append("-" if spent is None else f"{spent['mean']:.2f} ± {spent['std']:.2f} ({spent['max']:.2f})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
