"""The result table printed at the end of `train` and by `eval`."""

from __future__ import annotations

from rich.table import Table

from peradapt.rundir.records import Cost, SelectedOnTest

ROWS = (
    ("personalized", "local_test", "personalized", "local"),
    ("personalized", "global_test", "personalized", "global"),
    ("global", "local_test", "global", "local"),
    ("global", "global_test", "global", "global"),
)
# How tables name a report's "metric".
METRIC_LABELS = {"accuracy": "accuracy", "auc": "AUC"}


def results_table(
    flat: dict[str, float],
    title: str,
    metric: str = "accuracy",
    selected: SelectedOnTest | None = None,
    eval_split: str = "test",
) -> Table:
    """The final round's scores; with `selected` (a report's `selected_on_test`), the PerAda authors' numbers too:
    each client's best evaluated round on its local-test and the global model's best round on global-test, in rows
    that say they were selected on the test data. `eval_split`: what the run scored on (`--eval-split`); a
    validation run's "test" scores are on its validation splits, and its rows say so."""
    table = Table(title=title)
    table.add_column("model")
    table.add_column(f"{eval_split} set")
    table.add_column(f"{METRIC_LABELS[metric]} % (mean ± std over clients)", justify="right")
    for who, split, label, where in ROWS:
        key = f"{who}_{split}"
        if key not in flat:
            continue
        std = flat.get(f"{key}_std")
        value = f"{100 * flat[key]:.2f}" + (f" ± {100 * std:.2f}" if std is not None else "")
        table.add_row(label, f"{where}-{eval_split}", value)
    if selected is not None:
        personal, best_global = selected.personalized_local_test, selected.global_global_test
        table.add_section()
        table.add_row(
            "personalized",
            f"local-{eval_split}, best round per client (selected on {eval_split})",
            f"{100 * personal.mean:.2f} ± {100 * personal.std:.2f}",
        )
        table.add_row(
            "global",
            f"global-{eval_split}, best round ({best_global.round}, selected on {eval_split})",
            f"{100 * best_global.value:.2f}",
        )
    return table


def quantity(value: float, unit: str) -> str:
    """`value` with a decimal prefix (k, M, G, T, P): 1.23 MB, 4.5 GFLOPs."""
    for prefix in ("", "k", "M", "G", "T"):
        if abs(value) < 1000:
            return f"{value:.3g} {prefix}{unit}"
        value /= 1000
    return f"{value:.3g} P{unit}"


def cost_summary(cost: Cost) -> str:
    """A report's `cost` in one line: traffic, client work, seconds, peak memory, and the budget's outcome."""
    timing, budget = cost.timing, cost.budget
    server = timing.aggregation_seconds + timing.distillation_seconds
    personalization = cost.personalization_samples  # fine-tuning the clients' models after the rounds
    distilled = f"server {cost.server_samples:,} distillation samples, {quantity(cost.server_flops, 'FLOPs')}"
    parts = [
        f"cost: {quantity(cost.bytes_up, 'B')} up, {quantity(cost.bytes_down, 'B')} down "
        f"({quantity(cost.bytes_up_per_client_round, 'B')} up per client and round)",
        f"{cost.client_samples:,} client training samples, {quantity(cost.client_flops, 'FLOPs')}"
        + (f" (and {personalization:,} personalizing the clients' models)" if personalization else ""),
        *([distilled] if cost.server_flops else []),  # the server's distillation, where it did any
        f"clients {timing.client_seconds:.1f} s, server {server:.1f} s "
        f"(distillation {timing.distillation_seconds:.1f} s)",
        f"peak memory {quantity(timing.peak_rss_bytes, 'B')}"
        + ("" if timing.peak_cuda_bytes is None else f", GPU {quantity(timing.peak_cuda_bytes, 'B')}"),
    ]
    if budget is not None:
        outcome = "reached" if budget.reached else "not reached"
        parts.append(
            f"--budget client-samples:{budget.client_samples} {outcome} in {cost.rounds_played} rounds "
            f"({budget.spent:,} spent)"
        )
    return "; ".join(parts)
