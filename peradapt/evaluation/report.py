"""The result table printed at the end of `train` and by `eval`."""

from __future__ import annotations

from rich.table import Table

ROWS = (
    ("personalized", "local_test", "personalized", "local-test"),
    ("personalized", "global_test", "personalized", "global-test"),
    ("global", "local_test", "global", "local-test"),
    ("global", "global_test", "global", "global-test"),
)
# How tables name a report's "metric".
METRIC_LABELS = {"accuracy": "accuracy", "auc": "AUC"}


def results_table(flat: dict[str, float], title: str, metric: str = "accuracy", selected: dict | None = None) -> Table:
    """The final round's scores; with `selected` (a report's `selected_on_test`), the PerAda authors' numbers too:
    each client's best evaluated round on its local-test and the global model's best round on global-test, in rows
    that say they were selected on the test data."""
    table = Table(title=title)
    table.add_column("model")
    table.add_column("test set")
    table.add_column(f"{METRIC_LABELS[metric]} % (mean ± std over clients)", justify="right")
    for who, split, label, test_set in ROWS:
        key = f"{who}_{split}"
        if key not in flat:
            continue
        std = flat.get(f"{key}_std")
        value = f"{100 * flat[key]:.2f}" + (f" ± {100 * std:.2f}" if std is not None else "")
        table.add_row(label, test_set, value)
    if selected is not None:
        personal, best_global = selected["personalized_local_test"], selected["global_global_test"]
        table.add_section()
        table.add_row(
            "personalized",
            "local-test, best round per client (selected on test)",
            f"{100 * personal['mean']:.2f} ± {100 * personal['std']:.2f}",
        )
        table.add_row(
            "global",
            f"global-test, best round ({best_global['round']}, selected on test)",
            f"{100 * best_global['value']:.2f}",
        )
    return table
