"""Evaluation of personalized and global adapters, and result tables."""

from peradapt.compute.task_metric import local_test_statistics, mean_and_std, mean_auc, metric_name, roc_auc
from peradapt.evaluation.adapter_scores import evaluate_adapters, flat_scores
from peradapt.evaluation.report import METRIC_LABELS, cost_summary, results_table
from peradapt.evaluation.selection import per_client_record, select_on_test

__all__ = [
    "METRIC_LABELS",
    "cost_summary",
    "evaluate_adapters",
    "flat_scores",
    "local_test_statistics",
    "mean_and_std",
    "mean_auc",
    "metric_name",
    "per_client_record",
    "results_table",
    "roc_auc",
    "select_on_test",
]
