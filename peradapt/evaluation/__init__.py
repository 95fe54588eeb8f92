"""Evaluation of personalized and global adapters, and result tables."""

from peradapt.evaluation.metrics import evaluate_adapters, mean_auc, metric_name, roc_auc, summarize, summary
from peradapt.evaluation.report import METRIC_LABELS, results_table

__all__ = [
    "METRIC_LABELS",
    "evaluate_adapters",
    "mean_auc",
    "metric_name",
    "results_table",
    "roc_auc",
    "summarize",
    "summary",
]
