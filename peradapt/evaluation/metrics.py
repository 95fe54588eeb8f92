"""Scores of personalized and global adapters on local-test and global-test (PerAda Sec. 7.1).

local-test: each client's own test split (same label distribution as its training data).
global-test: the union of all clients' test splits.
The score is accuracy, or for multi-label data (CheXpert) the mean ROC-AUC over the labels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from peradapt.adapters import AdapterState
from peradapt.data import ClientData, ImageSet

if TYPE_CHECKING:  # annotations only: federation.local imports mean_auc from this module
    from peradapt.federation.local import LocalTrainer


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


def summary(values: Sequence[float]) -> dict[str, float]:
    """Mean and std over clients. A client whose score is undefined (no test images, or AUC on a test split
    with a single class in every label) is left out rather than making the mean undefined."""
    array = np.asarray(values, dtype=float)
    defined = array[~np.isnan(array)]
    return (
        {"mean": float(defined.mean()), "std": float(defined.std())}
        if len(defined)
        else {"mean": float("nan"), "std": 0.0}
    )


def evaluate_adapters(
    trainer: LocalTrainer,
    personalized: Callable[[int], AdapterState],
    global_state: AdapterState,
    clients: Sequence[ClientData],
    global_test: ImageSet,
    *,
    personalized_global_test: bool,
    on_client: Callable[[], None] | None = None,
) -> dict:
    """Scores per client (see `metric_name`); global-test of every personalized adapter is the expensive part,
    so optional."""
    local_personal, global_personal, local_global = [], [], []
    for client in clients:
        state = personalized(client.client_id)
        local_personal.append(trainer.score(state, client.test))
        if personalized_global_test:
            global_personal.append(trainer.score(state, global_test))
        local_global.append(trainer.score(global_state, client.test))
        if on_client is not None:
            on_client()
    result = {
        "metric": metric_name(global_test),
        "clients": [client.client_id for client in clients],
        "personalized": {"local_test": local_personal},
        "global": {"local_test": local_global, "global_test": trainer.score(global_state, global_test)},
    }
    if personalized_global_test:
        result["personalized"]["global_test"] = global_personal
    return result


def summarize(evaluation: dict) -> dict[str, float]:
    """Flat means and stds, the form logged per round and printed in tables."""
    flat: dict[str, float] = {}
    for who in ("personalized", "global"):
        for split, values in evaluation[who].items():
            if isinstance(values, list):
                stats = summary(values)
                flat[f"{who}_{split}"] = stats["mean"]
                flat[f"{who}_{split}_std"] = stats["std"]
            else:
                flat[f"{who}_{split}"] = values
    return flat
