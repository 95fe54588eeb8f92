"""Evaluation of personalized and global adapters, and result tables."""

from peradapt.evaluation.metrics import evaluate_adapters, summarize, summary
from peradapt.evaluation.report import results_table

__all__ = ["evaluate_adapters", "results_table", "summarize", "summary"]
