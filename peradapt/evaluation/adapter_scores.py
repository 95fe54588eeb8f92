"""Scores of personalized and global adapters on local-test and global-test (PerAda Sec. 7.1).

local-test: each client's own test split (same label distribution as its training data).
global-test: the union of all clients' test splits.
The score is accuracy, or for multi-label data (CheXpert) the mean ROC-AUC over the labels.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Sequence

import torch

from peradapt.adapters import AdapterState
from peradapt.compute.task_metric import mean_and_std, metric_name, metric_value
from peradapt.compute.trainer import LocalTrainer
from peradapt.data import ClientData, ImageSet


def evaluate_adapters(
    trainer: LocalTrainer,
    personalized: Callable[[int], AdapterState],
    global_state: AdapterState,
    clients: Sequence[ClientData],
    global_test: ImageSet,
    *,
    global_test_clients: Collection[int] = (),
    on_client: Callable[[], None] | None = None,
) -> dict:
    """Scores per client (see `metric_name`) of each client's personalized adapter and of the global adapter on the
    client's test split, and of the global adapter on `global_test`. The personalized adapters of the clients in
    `global_test_clients` are scored on `global_test` too: |global_test| images each, the expensive part; when they
    are not all of `clients`, the result lists them under `global_test_clients`.

    `personalized` is asked once for each client, in the order of `clients` (the engine exports the adapters as
    they come). Clients in a row that share one state object (the global adapter; the initial adapter of every
    client that a method keeps no state for) are scored in one inference pass over their test splits, and a state
    that comes back (the initial adapter between clients with states of their own) is scored on `global_test` once.
    """
    local_personal: list[float] = []
    global_personal: dict[int, float] = {}
    # Global-test scores of the states used last, by id; holding the states keeps their ids from being reused.
    recent: OrderedDict[int, tuple[AdapterState, float]] = OrderedDict()
    for state, group in _runs_of_shared_state(personalized, clients):
        local_personal += scores(trainer, state, [client.test for client in group])
        chosen = [client.client_id for client in group if client.client_id in global_test_clients]
        if chosen:
            if id(state) not in recent:
                recent[id(state)] = (state, trainer.score(state, global_test))
                if len(recent) > _RECENT_STATES:
                    recent.popitem(last=False)
            recent.move_to_end(id(state))
            global_personal.update(dict.fromkeys(chosen, recent[id(state)][1]))
        if on_client is not None:
            for _ in group:
                on_client()
    result = {
        "metric": metric_name(global_test),
        "clients": [client.client_id for client in clients],
        "personalized": {"local_test": local_personal},
        "global": {
            "local_test": scores(trainer, global_state, [client.test for client in clients]),
            "global_test": trainer.score(global_state, global_test),
        },
    }
    if global_personal:
        result["personalized"]["global_test"] = list(global_personal.values())
        if len(global_personal) < len(clients):
            result["global_test_clients"] = list(global_personal)
    return result


_RECENT_STATES = 4


def scores(trainer: LocalTrainer, state: AdapterState, datasets: Sequence[ImageSet]) -> list[float]:
    """`trainer.score(state, data)` for every set of `datasets`, from one inference pass over all of them."""
    sizes = [len(data) for data in datasets]
    if not any(sizes):
        return [float("nan")] * len(datasets)
    union = ImageSet(
        torch.cat([data.images for data in datasets]),
        torch.cat([data.labels for data in datasets]),
        datasets[0].num_classes,
    )
    logits = trainer.logits(state, union).cpu().split(sizes)
    return [
        metric_value(part, data.labels) if len(data) else float("nan")
        for part, data in zip(logits, datasets, strict=True)
    ]


def _runs_of_shared_state(
    personalized: Callable[[int], AdapterState], clients: Sequence[ClientData]
) -> Iterator[tuple[AdapterState, list[ClientData]]]:
    """The clients cut into runs of consecutive clients with the same state object; at most two states are held."""
    run: list[ClientData] = []
    run_state: AdapterState = {}
    for client in clients:
        state = personalized(client.client_id)
        if run and state is not run_state:
            yield run_state, run
            run = []
        run_state = state
        run.append(client)
    if run:
        yield run_state, run


def flat_scores(evaluation: dict) -> dict[str, float]:
    """Flat means and stds, the form logged per round and printed in tables."""
    flat: dict[str, float] = {}
    for who in ("personalized", "global"):
        for split, values in evaluation[who].items():
            if isinstance(values, list):
                stats = mean_and_std(values)
                flat[f"{who}_{split}"] = stats["mean"]
                flat[f"{who}_{split}_std"] = stats["std"]
            else:
                flat[f"{who}_{split}"] = values
    return flat
