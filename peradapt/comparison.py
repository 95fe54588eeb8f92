"""`peradapt compare`: several methods on the same partitions and seeds, summarized like the paper's Table 1.

Every method runs once per seed with otherwise identical settings; a seed fixes the partition, the client
sampling and the initial adapters, so all methods see the same clients. Runs are ordinary run directories
under `out/<method>-seed<seed>/` (a plugin's `module:Class` as `module.Class`): a finished one is reused and an
interrupted one resumed, so re-running the same comparison only does what is missing.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table
from rich.text import Text

from peradapt.config import TrainConfig, method_path_label, setting_owners, settings_for_method
from peradapt.errors import ConfigError, RunError
from peradapt.evaluation import METRIC_LABELS
from peradapt.federation.engine import resume_config
from peradapt.methods import method_class
from peradapt.progress import counted, text_console
from peradapt.rundir.checkpoint import write_json_atomic, write_text_atomic
from peradapt.rundir.layout import RunPaths, read_report, read_run_config
from peradapt.training import train

ACCURACIES = (  # of the task's metric: accuracy, or AUC for multi-label data
    ("personalized_local_test", "local-test"),
    ("personalized_global_test", "global-test"),
    ("global_global_test", "global-test of w"),
)
COUNTS = ("personalized", "trained", "communicated")


def compare(
    settings: dict, methods: Sequence[str], seeds: Sequence[int], out: Path, console: Console | None = None
) -> list[dict]:
    """Train (or reuse) every method x seed run and return one row per method; also writes compare.json/.md."""
    console = console or text_console(stderr=True)
    fixed = sorted({"method", "seed", "out"} & settings.keys())
    if fixed:
        raise ConfigError(f"compare sets {', '.join(fixed)} itself: leave them out (use --methods, --seeds, --out)")
    if not methods or not seeds:
        raise ConfigError("compare needs at least one method in --methods and one seed")
    for method in methods:
        method_class(method)  # unknown names stop the comparison before anything trains
    for key in settings:
        owners = setting_owners(key.replace("-", "_"))
        if owners and not set(owners) & set(methods):
            raise ConfigError(
                f"--{key.replace('_', '-')} is a setting of {', '.join(owners)}: none of --methods "
                f"{', '.join(methods)} takes it"
            )
    configs = {  # each method gets the settings it takes: a method's own settings are refused by the others
        (method, seed): TrainConfig.from_flat(
            {
                **settings_for_method(settings, method),
                "method": method,
                "seed": seed,
                "out": str(out / f"{method_path_label(method)}-seed{seed}"),
            }
        )
        for method in methods
        for seed in seeds
    }
    rows = []
    for method in methods:
        reports = [_run(configs[method, seed], console) for seed in seeds]
        _, resolved = read_run_config(Path(configs[method, seeds[0]].out))
        rows.append(_row(method, resolved, reports))
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "compare.json", {"settings": settings, "seeds": list(seeds), "rows": rows})
    write_text_atomic(out / "compare.md", markdown_table(rows, len(seeds)))
    return rows


def _run(config: TrainConfig, console: Console) -> dict:
    paths = RunPaths(Path(config.out))
    if not paths.config.exists():
        console.print(Text.assemble((config.method.method, "bold"), f", seed {config.seed}"))
        return train(config, console=console)
    saved = resume_config(paths.root, {})
    if _comparable(saved) != _comparable(config):
        raise RunError(f"{paths.root} holds a run with other settings: remove it or pass another --out")
    report = read_report(paths.root)  # checked: None until the run has finished
    if report is not None:
        return report
    return train(saved, resume=True, console=console)


def _comparable(config: TrainConfig) -> dict:
    flat = config.to_flat()
    for key in ("out", "device", "eval_every", "log"):
        flat.pop(key)
    return flat


def _row(method: str, resolved: dict, reports: list[dict]) -> dict:
    row = {
        "method": method,
        "scope": resolved.get("scope", "adapter"),
        "metric": reports[0].get("metric", "accuracy"),  # reports from before multi-label data lack it
        **resolved.get("parameter_counts", {}),
    }
    for key, _ in ACCURACIES:
        values = [100 * report["summary"][key] for report in reports if key in report["summary"]]
        row[key] = {"mean": float(np.mean(values)), "std": float(np.std(values)), "seeds": values}
    return row


def _count(value: int) -> str:
    return f"{value / 1e6:.2f}M" if value >= 100_000 else f"{value / 1e3:.1f}k"


def _cells(row: dict) -> list[str]:
    counts = [_count(row[name]) if name in row else "-" for name in COUNTS]
    scores = [f"{row[key]['mean']:.2f} ± {row[key]['std']:.2f}" for key, _ in ACCURACIES]
    return [row["method"], row["scope"], *counts, *scores]


def _headers() -> list[str]:
    return ["method", "scope", "# personal", "# trained", "# sent", *(label for _, label in ACCURACIES)]


def _metric_label(rows: list[dict]) -> str:
    # One comparison is one dataset, so every row has the same metric.
    return METRIC_LABELS[rows[0]["metric"]] if rows else METRIC_LABELS["accuracy"]


def rich_table(rows: list[dict], num_seeds: int) -> Table:
    table = Table(title=f"personalized models, {_metric_label(rows)} % (mean ± std over {counted(num_seeds, 'seed')})")
    for index, header in enumerate(_headers()):
        table.add_column(header, justify="left" if index < 2 else "right")
    for row in rows:
        table.add_row(*_cells(row))
    return table


def markdown_table(rows: list[dict], num_seeds: int) -> str:
    lines = [
        f"Personalized models, {_metric_label(rows)} % (mean ± std over {counted(num_seeds, 'seed')}); "
        "parameters per client.",
        "",
        "| " + " | ".join(_headers()) + " |",
        "|" + "---|" * len(_headers()),
    ]
    lines += ["| " + " | ".join(_cells(row)) + " |" for row in rows]
    return "\n".join(lines) + "\n"
