"""PNG plots of finished runs: accuracy per round, per client and against cost, for `peradapt report`; the
ranking and the methods' curves over seeds, for `peradapt compare`.

Figures are drawn on matplotlib's Agg canvas directly (no pyplot, no display, no global backend switch) at a
fixed size, so every plot of a kind has the same pixel size whatever it shows.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from peradapt.evaluation.curves import CurvePoint
from peradapt.rundir.checkpoint import replaced_by_temporary

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
MODEL_STYLES = {"personalized": "o-", "global model": "s--"}  # marker, then line style
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
    with replaced_by_temporary(path, tmp):
        figure.savefig(tmp, dpi=DPI, format="png")  # no bbox_inches="tight": the pixel size stays as set


def _metric_label(runs: list[RunResults]) -> str:
    metrics = {run.metric for run in runs}
    return "score (accuracy or AUC)" if len(metrics) > 1 else {"auc": "AUC"}.get(metrics.pop(), "accuracy")


def _colors(count: int) -> list:
    """One colour per run: matplotlib's ten default colours, then tab20, then a continuous map."""
    from matplotlib import colormaps

    if count <= 10:
        return [f"C{index}" for index in range(count)]
    if count <= 20:
        return [colormaps["tab20"](index) for index in range(count)]
    return [colormaps["turbo"](index / (count - 1)) for index in range(count)]


def _legend(figure, handles: list, count: int) -> None:
    """Outside on the right, so that it hides no data; two columns when it would not fit in one."""
    figure.legend(handles=handles, loc="outside right upper", fontsize=8, ncols=1 if count <= 22 else 2)


def plot_accuracy_per_round(runs: list[RunResults], path: Path) -> Path:
    """One panel per test set (local-test, global-test, and OOD when a run has it); one line per run and model."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    panels = ["local", "global"] + (["ood"] if any(run.ood for run in runs) else [])
    ood_markers = dict(zip(sorted({name for run in runs for name in run.ood}), itertools.cycle("*PXD^v"), strict=False))
    figure = _figure(ROUNDS_SIZE)
    # Shared x axis: the OOD markers sit at the last round of the same scale as the curves.
    axes = dict(zip(panels, figure.subplots(1, len(panels), squeeze=False, sharex=True)[0], strict=True))
    colors = _colors(len(runs))
    for run, color in zip(runs, colors, strict=True):
        for key, panel, model in ROUND_METRICS:
            points = run.curves.get(key, [])
            if points:
                x, y = zip(*points, strict=True)
                axes[panel].plot(x, y, MODEL_STYLES[model], markersize=4, color=color)
        for name, accuracies in run.ood.items():
            for model, fill in (("personalized", color), ("global model", "none")):
                value = accuracies["personalized" if model == "personalized" else "global"]
                axes["ood"].plot([run.rounds], [value], ood_markers[name], markersize=11, color=color, mfc=fill)
    last_round = max((run.rounds for run in runs), default=1)
    for panel, axis in axes.items():
        axis.set_title(PANEL_TITLES[panel], fontsize=10)
        axis.set_xlim(0.5, last_round + 0.5)  # the whole training, even when only the final evaluation exists
        axis.set_xlabel("round")
        axis.set_ylabel(f"{_metric_label(runs)} %")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.grid(alpha=0.3)
    # A run keeps its colour in every panel; line style and marker say which model and which OOD set.
    handles = [Line2D([], [], color=color, lw=6, label=run.label) for run, color in zip(runs, colors, strict=True)]
    handles += [
        Line2D([], [], color="black", ls=MODEL_STYLES[m][1:], marker="os"[i], label=m)
        for i, m in enumerate(MODEL_STYLES)
    ]
    for name, marker in ood_markers.items():
        handles += [
            Line2D([], [], ls="", marker=marker, markersize=9, color="black", mfc=fill, label=f"{name}, {model}")
            for model, fill in (("personalized", "black"), ("global model", "none"))
        ]
    _legend(figure, handles, len(handles))
    title = f"{_metric_label(runs)} per round"
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
    for index, (run, color) in enumerate(zip(runs, _colors(len(runs)), strict=True)):
        x = [position[c] - 0.4 + width * (index + 0.5) for c in run.clients]
        axis.bar(x, run.personalized_local, width=width * 0.95, color=color, label=run.label)
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
    _legend(figure, axis.get_legend_handles_labels()[0], len(runs) + 1)
    axis.set_title(
        f"per-client local-test {_metric_label(runs)}: personalized models (bars), the global model (black ticks)"
    )
    _save(figure, path)
    return path


@dataclass(frozen=True)
class RankedScore:
    """A method's place in a comparison: its rank label ("2=" when shared), mean over seeds and 95% interval (None
    with one seed), in percent."""

    method: str
    rank: str
    mean: float
    low: float | None = None
    high: float | None = None


def plot_ranking(scores: list[RankedScore], metric: str, reference: str, path: Path) -> Path:
    """Each method's mean over seeds with its 95% interval as a horizontal bar, best at the top, the reference's mean
    as a dashed line: intervals that overlap it are what "n.s." in the table says in numbers."""
    figure = _figure((9.0, 1.2 + 0.45 * len(scores)))
    axis = figure.subplots()
    positions = list(range(len(scores)))[::-1]
    for position, score in zip(positions, scores, strict=True):
        color = "C3" if score.method == reference else "C0"
        if score.low is not None and score.high is not None:
            axis.plot([score.low, score.high], [position, position], "-", color=color, lw=3, alpha=0.5)
        axis.plot([score.mean], [position], "o", color=color, markersize=7)
    means = {score.method: score.mean for score in scores}
    reference_line = ""
    if reference in means:  # named in the x label, not a legend, which would hide a bar
        axis.axvline(means[reference], color="C3", ls="--", lw=1)
        reference_line = f"; dashed: {reference}'s mean (the reference)"
    axis.set_yticks(positions, [f"{score.rank}  {score.method}" for score in scores])
    axis.set_xlabel(f"{metric} % (mean over seeds, 95% interval){reference_line}")
    axis.grid(axis="x", alpha=0.3)
    axis.set_title(f"ranking by {metric}: ranks tie where a paired test does not separate methods", fontsize=10)
    _save(figure, path)
    return path


CostPoint = tuple[str, float, float]  # (label, cost, score): one run


def _cost_scale(axis, costs: Sequence[float]) -> None:
    """A logarithmic cost axis where every cost is positive: methods differ by orders of magnitude (an adapter
    against a whole model); standalone sends nothing, and zero has no place on a log axis."""
    if costs and all(cost > 0 for cost in costs):
        axis.set_xscale("log")


def plot_accuracy_vs_cost(panels: Sequence[tuple[str, Sequence[CostPoint]]], y_name: str, path: Path) -> Path:
    """A panel per kind of cost, given as its axis name and its points: each run's score against what it cost, the
    point labelled and coloured by its label (a method: its seeds share a colour), on a `_cost_scale` axis."""
    labels = list(dict.fromkeys(label for _, points in panels for label, _, _ in points))
    colors = dict(zip(labels, _colors(len(labels)), strict=True))
    figure = _figure(ROUNDS_SIZE)
    for axis, (x_name, points) in zip(figure.subplots(1, len(panels), squeeze=False)[0], panels, strict=True):
        for label, x, y in points:
            axis.plot([x], [y], "o", markersize=7, color=colors[label])
            axis.annotate(label, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7)
        _cost_scale(axis, [x for _, x, _ in points])
        axis.set_xlabel(x_name)
        axis.set_ylabel(y_name)
        axis.grid(alpha=0.3)
    figure.suptitle(f"{y_name} against cost (one point per run)", fontsize=11)
    _save(figure, path)
    return path


def plot_curves(
    curves: Mapping[str, Sequence[CurvePoint]], x: str, x_name: str, y_name: str, target: float, path: Path
) -> Path:
    """A line per method through its seeds' mean score at each evaluation against `x` (a `CurvePoint` field:
    round, client_samples or bytes), shaded over the seeds' range, with the target as a dotted line; cost axes are
    `_cost_scale`d."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    figure = _figure(ROUNDS_SIZE)
    axis = figure.subplots()
    handles = []
    for (method, curve), color in zip(curves.items(), _colors(len(curves)), strict=True):
        xs = [getattr(point, x) for point in curve]
        axis.fill_between(xs, [p.low for p in curve], [p.high for p in curve], color=color, alpha=0.2, lw=0)
        axis.plot(xs, [p.mean for p in curve], "o-", markersize=4, color=color)
        handles.append(Line2D([], [], color=color, marker="o", label=method))
    axis.axhline(target, color="black", ls=":", lw=1)
    handles += [
        Patch(color="grey", alpha=0.3, label="min to max over seeds"),
        Line2D([], [], color="black", ls=":", label=f"target {target:.1f}%"),
    ]
    if x == "round":
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    else:
        _cost_scale(axis, [getattr(point, x) for curve in curves.values() for point in curve])
    axis.set_xlabel(x_name)
    axis.set_ylabel(f"{y_name}\n(line: mean over seeds; shaded: min to max)")
    axis.grid(alpha=0.3)
    _legend(figure, handles, len(handles))
    axis.set_title("a point per evaluated round (--eval-every), the last the final evaluation", fontsize=9)
    figure.suptitle(f"{y_name} against {x_name}", fontsize=11)
    _save(figure, path)
    return path
