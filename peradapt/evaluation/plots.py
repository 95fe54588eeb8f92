"""PNG plots of finished runs: accuracy per round and per client, for `peradapt report`.

Figures are drawn on matplotlib's Agg canvas directly (no pyplot, no display, no global backend switch) at a
fixed size, so every plot of a kind has the same pixel size whatever it shows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

DPI = 100
ROUNDS_SIZE = (13.0, 4.8)  # inches: 1300 x 480 pixels at DPI
PER_CLIENT_SIZE = (12.0, 5.0)  # 1200 x 500 pixels

# metrics.jsonl / report.json key -> (panel, line label); personalized lines solid, the global model's dashed
ROUND_METRICS = (
    ("personalized_local_test", "local", "personalized"),
    ("global_local_test", "local", "global model"),
    ("personalized_global_test", "global", "personalized"),
    ("global_global_test", "global", "global model"),
)
PANEL_TITLES = {
    "local": "local-test (each client's own test split)",
    "global": "global-test (union of the clients' test splits)",
    "ood": "OOD sets (after the last round)",
}


@dataclass
class RunResults:
    """What the plots need from one run; accuracies in percent."""

    label: str  # `method (seed N)`
    rounds: int
    metric: str = "accuracy"  # or "auc" (multi-label runs)
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # metric key -> (round, accuracy)
    clients: list[int] = field(default_factory=list)
    personalized_local: list[float] = field(default_factory=list)  # per client, same order as clients
    global_local: list[float] = field(default_factory=list)
    ood: dict[str, dict[str, float]] = field(default_factory=dict)  # set name -> personalized / global, after the end


def _figure(size: tuple[float, float]):  # -> matplotlib.figure.Figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=size, dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _save(figure, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    figure.savefig(tmp, dpi=DPI, format="png")  # no bbox_inches="tight": the pixel size stays as set
    os.replace(tmp, path)


def _metric_label(runs: list[RunResults]) -> str:
    metrics = {run.metric for run in runs}
    return "score (accuracy or AUC)" if len(metrics) > 1 else {"auc": "AUC"}.get(metrics.pop(), "accuracy")


def _color(index: int) -> str:
    return f"C{index % 10}"


def plot_accuracy_per_round(runs: list[RunResults], path: Path) -> Path:
    """One panel per test set (local-test, global-test, and OOD when a run has it); one line per run and model."""
    from matplotlib.ticker import MaxNLocator

    panels = ["local", "global"] + (["ood"] if any(run.ood for run in runs) else [])
    figure = _figure(ROUNDS_SIZE)
    # Shared x axis: the OOD markers sit at the last round of the same scale as the curves.
    axes = dict(zip(panels, figure.subplots(1, len(panels), squeeze=False, sharex=True)[0], strict=True))
    for index, run in enumerate(runs):
        for key, panel, model in ROUND_METRICS:
            points = run.curves.get(key, [])
            if not points:
                continue
            x, y = zip(*points, strict=True)
            style = "-" if model == "personalized" else "--"
            marker = "o" if model == "personalized" else "s"
            axes[panel].plot(
                x, y, style, marker=marker, markersize=4, color=_color(index), label=f"{run.label}, {model}"
            )
        for marker, (name, accuracies) in zip("*PXD^v", sorted(run.ood.items()), strict=False):
            for model, fill in (("personalized", _color(index)), ("global", "none")):
                axes["ood"].plot(
                    [run.rounds],
                    [accuracies[model]],
                    marker,
                    markersize=11,
                    color=_color(index),
                    markerfacecolor=fill,
                    label=f"{run.label}, {name}, {model if model == 'personalized' else 'global model'}",
                )
    last_round = max((run.rounds for run in runs), default=1)
    for panel, axis in axes.items():
        axis.set_title(PANEL_TITLES[panel], fontsize=10)
        axis.set_xlim(0.5, last_round + 0.5)  # the whole training, even when only the final evaluation exists
        axis.set_xlabel("round")
        axis.set_ylabel(f"{_metric_label(runs)} %")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.grid(alpha=0.3)
    # One legend for all panels (a run keeps its colour everywhere), outside so that it hides no line.
    entries = {}
    for axis in axes.values():
        for handle, label in zip(*axis.get_legend_handles_labels(), strict=True):
            entries.setdefault(label, handle)
    if entries:
        figure.legend(entries.values(), entries.keys(), loc="outside right upper", fontsize=8)
    title = "accuracy per round (personalized models solid, global model dashed)"
    if all(len(points) <= 1 for run in runs for points in run.curves.values()):
        title += ": only the final evaluation (train with --eval-every N for curves)"
    figure.suptitle(title, fontsize=11)
    _save(figure, path)
    return path


def plot_per_client(runs: list[RunResults], path: Path) -> Path:
    """Grouped bars: each client's personalized local-test per run; a black tick marks the run's global model."""
    clients = sorted({client for run in runs for client in run.clients})
    position = {client: index for index, client in enumerate(clients)}
    width = 0.8 / max(len(runs), 1)
    figure = _figure(PER_CLIENT_SIZE)
    axis = figure.subplots()
    for index, run in enumerate(runs):
        x = [position[c] - 0.4 + width * (index + 0.5) for c in run.clients]
        axis.bar(x, run.personalized_local, width=width * 0.95, color=_color(index), label=f"{run.label}, personalized")
        axis.scatter(
            x,
            run.global_local,
            marker="_",
            s=max(40.0, 600.0 * width),
            linewidths=2,
            color="black",
            zorder=3,
            label="global model (same run)" if index == 0 else None,
        )
    axis.set_xticks(range(len(clients)), [str(c) for c in clients])
    axis.set_xlabel("client")
    axis.set_ylabel(f"local-test {_metric_label(runs)} %")
    axis.set_ylim(0, 105)
    axis.grid(axis="y", alpha=0.3)
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # outside: bars stay visible
    axis.set_title("per-client local-test accuracy: personalized adapters (bars) and the global model (black ticks)")
    _save(figure, path)
    return path
