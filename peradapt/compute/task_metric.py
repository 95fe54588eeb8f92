"""The task's metric on logits (accuracy, or mean ROC-AUC for multi-label data) and its mean over clients: what
`LocalTrainer.score` reports and the evaluation and privacy reports summarize."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from peradapt.data import ImageSet


def metric_name(data: ImageSet) -> str:
    """What `LocalTrainer.score` measures on data labeled like `data`: "auc" or "accuracy"."""
    return "auc" if data.multilabel else "accuracy"


def roc_auc(scores: np.ndarray, positives: np.ndarray) -> float:
    """Area under the ROC curve: the chance that a random positive scores above a random negative (ties count
    half), from the ranks of the scores (Mann-Whitney U). NaN unless both classes are present."""
    positives = np.asarray(positives, dtype=bool)
    num_positive = int(positives.sum())
    num_negative = len(positives) - num_positive
    if num_positive == 0 or num_negative == 0:
        return float("nan")
    order = np.argsort(scores, kind="stable")
    _, first, counts = np.unique(np.asarray(scores)[order], return_index=True, return_counts=True)
    ranks = np.empty(len(order))
    ranks[order] = np.repeat(first + (counts + 1) / 2, counts)  # 1-based, tied scores share their mean rank
    rank_sum = ranks[positives].sum()
    return float((rank_sum - num_positive * (num_positive + 1) / 2) / (num_positive * num_negative))


def mean_auc(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean ROC-AUC over the labels (columns) of multi-hot `labels`, skipping labels that are all positive or all
    negative in this set; NaN when every label is."""
    scores, targets = logits.double().numpy(), labels.numpy() > 0.5
    aucs = [roc_auc(scores[:, label], targets[:, label]) for label in range(targets.shape[1])]
    defined = [auc for auc in aucs if not np.isnan(auc)]
    return float(np.mean(defined)) if defined else float("nan")


def metric_value(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Accuracy of `logits` for class-index `labels`, or for multi-hot labels the mean ROC-AUC (see `mean_auc`)."""
    if labels.dim() == 2:
        return mean_auc(logits, labels)
    return (logits.argmax(dim=1) == labels).float().mean().item()


WORST_SHARE = 0.1  # `worst_10pct`: the mean over this share of the clients with the lowest scores


def local_test_statistics(values: Sequence[float], test_sizes: Sequence[int]) -> dict[str, float]:
    """What the strongest pFL benchmarks report of the clients' own test scores, besides `mean_and_std`:
    the mean weighted by each client's test images (`weighted_mean`: the score of all local test images pooled, for
    accuracy) and the mean of the worst 10% of clients (`worst_10pct`: ceil(10% of them), at least one). Clients
    whose score is undefined are left out of both."""
    scores, sizes = np.asarray(values, dtype=float), np.asarray(test_sizes, dtype=float)
    defined = ~np.isnan(scores)
    scores, sizes = scores[defined], sizes[defined]
    if not len(scores):
        return {"weighted_mean": float("nan"), "worst_10pct": float("nan")}
    worst = np.sort(scores)[: max(1, math.ceil(WORST_SHARE * len(scores)))]
    weighted = float(np.average(scores, weights=sizes)) if sizes.sum() > 0 else float("nan")
    return {"weighted_mean": weighted, "worst_10pct": float(worst.mean())}


def mean_and_std(values: Sequence[float]) -> dict[str, float]:
    """Mean and std over clients. A client whose score is undefined (no test images, or AUC on a test split
    with a single class in every label) is left out rather than making the mean undefined."""
    array = np.asarray(values, dtype=float)
    defined = array[~np.isnan(array)]
    return (
        {"mean": float(defined.mean()), "std": float(defined.std())}
        if len(defined)
        else {"mean": float("nan"), "std": 0.0}
    )
