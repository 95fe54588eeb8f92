"""The PerAda authors' way of reporting, beside peradapt's final-round headline: numbers selected on test data.

The authors' code evaluates every `--eval-every` rounds and keeps, for each client, the personalized checkpoint with
the best local-test score over the rounds, and the global checkpoint of the round with the best global-test score
(their optim/our.py, save_checkpoints; infer.py and infer_per.py then score those checkpoints). A score chosen as
the best of several on the very data it is reported on is optimistic: peradapt's headline stays the final round,
and this selection is reported beside it under a name that says what it is.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from peradapt.compute.task_metric import mean_and_std
from peradapt.rundir.records import Best, PerClient, RoundRecord, SelectedOnTest, Stats


def per_client_record(evaluation: dict) -> PerClient:
    """What a round's record keeps of an evaluation, client by client, so that a selection can be made later."""
    return PerClient(
        clients=evaluation["clients"],
        personalized_local_test=evaluation["personalized"]["local_test"],
        global_local_test=evaluation["global"]["local_test"],
    )


def select_on_test(history: Sequence[RoundRecord], final_round: int, final: dict) -> SelectedOnTest:
    """Per client the best personalized local-test over the evaluated rounds and the final one, and the best
    global-test of the global model over the same rounds, each with the round it came from."""
    best: dict[int, tuple[float, int]] = {}
    global_best = (final["global"]["global_test"], final_round)
    evaluated = [(record.round, record) for record in history if record.per_client is not None]
    for round_number, record in [*evaluated, (final_round, None)]:
        if record is None:
            clients, values = final["clients"], final["personalized"]["local_test"]
        else:
            clients, values = record.per_client.clients, record.per_client.personalized_local_test
            global_value = float("nan") if record.global_global_test is None else record.global_global_test
            if _better(global_value, global_best[0]):
                global_best = (global_value, round_number)
        for client, value in zip(clients, values, strict=True):
            if client not in best or _better(value, best[client][0]):
                best[client] = (value, round_number)
    clients = final["clients"]
    values = [best[client][0] if client in best else float("nan") for client in clients]
    return SelectedOnTest(
        rounds_evaluated=[round_number for round_number, _ in evaluated] + [final_round],
        personalized_local_test=Stats(
            **mean_and_std(values), per_client=values, rounds=[best[client][1] for client in clients]
        ),
        global_global_test=Best(value=global_best[0], round=global_best[1]),
    )


def _better(value: float, current: float) -> bool:
    """Whether `value` beats `current`; an undefined score (NaN: no test images) never does, and loses to any."""
    return not np.isnan(value) and (np.isnan(current) or value > current)
