"""Evaluation of personalized and global adapters, and result tables."""

from peradapt.compute.metrics import local_test_statistics, mean_auc, metric_name, roc_auc, summary
from peradapt.evaluation.metrics import evaluate_adapters, summarize
from peradapt.evaluation.report import METRIC_LABELS, cost_summary, results_table
from peradapt.evaluation.selection import per_client_record, select_on_test

__all__ = [
    "METRIC_LABELS",
    "cost_summary",
    "evaluate_adapters",
    "local_test_statistics",
    "mean_auc",
    "metric_name",
    "per_client_record",
    "results_table",
    "roc_auc",
    "select_on_test",
    "summarize",
    "summary",
]
