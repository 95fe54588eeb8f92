"""Accuracy of personalized and global adapters on local-test and global-test (PerAda Sec. 7.1).

local-test: each client's own test split (same label distribution as its training data).
global-test: the union of all clients' test splits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from peradapt.adapters import AdapterState
from peradapt.data import ClientData, ImageSet
from peradapt.federation.local import LocalTrainer


def summary(values: Sequence[float]) -> dict[str, float]:
    array = np.asarray(values, dtype=float)
    return (
        {"mean": float(array.mean()), "std": float(array.std())} if len(array) else {"mean": float("nan"), "std": 0.0}
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
    """Accuracies per client; global-test of every personalized adapter is the expensive part, so optional."""
    local_personal, global_personal, local_global = [], [], []
    for client in clients:
        state = personalized(client.client_id)
        local_personal.append(trainer.accuracy(state, client.test))
        if personalized_global_test:
            global_personal.append(trainer.accuracy(state, global_test))
        local_global.append(trainer.accuracy(global_state, client.test))
        if on_client is not None:
            on_client()
    result = {
        "clients": [client.client_id for client in clients],
        "personalized": {"local_test": local_personal},
        "global": {"local_test": local_global, "global_test": trainer.accuracy(global_state, global_test)},
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
