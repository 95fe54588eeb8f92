"""A run's end: the final evaluation of every client's personalized adapter and of the global one (each exported as
it is scored), and report.json (`build_report`) with the run's costs (`cost_report`)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path

from peradapt.adapters import AdaptedModel, AdapterState
from peradapt.adapters.model import write_files
from peradapt.compute.costs import SampleFlops, peak_memory
from peradapt.compute.privacy import privacy_report
from peradapt.data import ClientData
from peradapt.evaluation import evaluate_adapters, flat_scores, local_test_statistics, mean_and_std, select_on_test
from peradapt.federation.budget import budget_limit, budget_reached, personalization_reserve
from peradapt.federation.clients import Clients
from peradapt.federation.session import Session
from peradapt.rundir.records import (
    Budget,
    Cost,
    Global,
    Parameters,
    Personalized,
    Report,
    RoundCost,
    RoundRecord,
    Stats,
    Timing,
)


def sample_flops(session: Session) -> SampleFlops:
    """FLOPs per sample of a training step and of an inference pass (`LocalTrainer.sample_flops`), measured once per
    run, on a federated client's first training image twice: the rounds multiply them by the samples they count."""
    images = next(client.train.images[:1] for client in session.federated_clients if len(client.train))
    return session.trainer.sample_flops(images.repeat(2, 1, 1, 1))


def evaluate_models(
    session: Session,
    personalized: Callable[[int], AdapterState],
    global_state: dict,
    clients: Sequence[ClientData],
    **options,
) -> dict:
    """The clients' personalized adapters and the global adapter on the clients' test data."""
    return evaluate_adapters(
        session.trainer,
        personalized,
        global_state,
        clients,
        session.data.global_test,
        **options,
    )


def first_trained(history: list[RoundRecord]) -> int:
    """The first client that trained in the rounds of `history` (client 0 if none did)."""
    for record in history:
        answered = [c for c in record.clients if c not in (record.unanswered or [])]
        if answered:
            return answered[0]
    return 0


class OwnElements:
    """`personalized`, which also counts, for client `client`, the elements of its model that are its own
    (`Clients.own_elements`), as the final evaluation asks for it."""

    def __init__(
        self, clients: Clients, personalized: Callable[[int], AdapterState], global_state: AdapterState, client: int
    ) -> None:
        self.clients, self.personalized, self.global_state, self.client = clients, personalized, global_state, client
        self.counted = 0

    def __call__(self, client_id: int) -> AdapterState:
        state = self.personalized(client_id)
        if client_id == self.client:
            self.counted = self.clients.own_elements(client_id, state, self.global_state)
        return state


def exporting(
    model: AdaptedModel, personalized: Callable[[int], AdapterState], directory: Path
) -> Callable[[int], AdapterState]:
    """`personalized`, which also writes each client's adapter as it is asked for, in PEFT layout, to
    `directory/clients/<id>/`.

    Clients asked for in a row with the same state object (e.g. never-sampled ones: the initial adapter) share one
    serialization: with many clients, writing files is then all that is left to do for most of them.
    """
    last_state, files = None, {}

    def personalized_and_exported(client_id: int) -> AdapterState:
        nonlocal last_state, files
        state = personalized(client_id)
        if state is not last_state:
            last_state, files = state, model.saved_files(state)
        write_files(directory / "clients" / str(client_id), files)
        return state

    return personalized_and_exported


def build_report(
    session: Session,
    evaluation: dict,
    history: list[RoundRecord],
    flops: SampleFlops,
    *,
    personalized_elements: int,
    partition: Path,
) -> Report:
    test_sizes = [len(session.data.clients[client].test) for client in evaluation["clients"]]

    def local_test(values: list[float]) -> Stats:  # the clients' own test splits: also weighted and worst-10%
        return Stats(**mean_and_std(values), per_client=values, **local_test_statistics(values, test_sizes))

    config = session.config
    personalized = evaluation["personalized"]
    return Report(
        method=config.method.method,
        data=config.data.data,
        metric=evaluation["metric"],
        eval_split=config.data.eval_split,
        classes=list(session.class_names),
        rounds=len(history),
        seed=config.seed,
        clients=evaluation["clients"],
        personalized=Personalized(
            local_test=local_test(personalized["local_test"]),
            # a large federation scores a sample of personalized adapters on the global test set: which ones
            global_test=Stats(
                **mean_and_std(personalized["global_test"]),
                per_client=personalized["global_test"],
                clients=evaluation.get("global_test_clients"),
            ),
        ),
        global_=Global(
            local_test=local_test(evaluation["global"]["local_test"]),
            global_test=evaluation["global"]["global_test"],
        ),
        summary=flat_scores(evaluation),
        selected_on_test=select_on_test(history, len(history), evaluation),
        trainable_parameters=session.model.num_trainable(),
        backbone_parameters=session.model.num_backbone(),
        held_out_clients=[c.client_id for c in session.held_out_clients] or None,
        privacy=privacy_report(session.trainer.privacy, session.store, evaluation["clients"]),
        cost=cost_report(session, history, flops, personalized_elements),
        # The clients' data as scored: a table built from this report can be checked against the split it names.
        partition_sha256=hashlib.sha256(partition.read_bytes()).hexdigest(),
    )


def cost_report(session: Session, history: list[RoundRecord], flops: SampleFlops, personalized_elements: int) -> Cost:
    """report.json's `cost`: the rounds' costs (their records' `cost` and `timing`) in total, the final
    personalization's, with the method's parameter counts and the budget."""
    rounds = RoundCost.totals([record.cost for record in history])
    client_rounds = sum(len(record.bytes_up) for record in history)
    timings = [record.timing for record in history]
    now = peak_memory(session.device)  # the final evaluation's too
    rss = [*(t.peak_rss_bytes for t in timings), now["peak_rss_bytes"]]
    cuda = [peak for peak in (*(t.peak_cuda_bytes for t in timings), now.get("peak_cuda_bytes")) if peak is not None]
    counts = [record.parameter_counts for record in history if record.parameter_counts is not None]
    limit = budget_limit(session.config)
    personalization = personalization_reserve(session)
    return Cost(
        rounds_played=len(history),
        **{f"{key}_per_client_round": rounds[key] / max(client_rounds, 1) for key in ("bytes_down", "bytes_up")},
        **rounds,
        # the clients' models handed out after the rounds: what the method trains then (fine-tuning)
        personalization_samples=personalization,
        personalization_flops=personalization * flops.training,
        training_flops_per_sample=flops.training,
        inference_flops_per_sample=flops.inference,
        # per client, measured: its model's own elements (in the final evaluation), the most one client update
        # trained and sent (`parameter_counts` of the round records)
        parameters=Parameters(
            personalized=personalized_elements,
            trained=max((count.trained for count in counts), default=0),
            communicated=max((count.communicated for count in counts), default=0),
        ),
        budget=None
        if limit is None
        else Budget(
            client_samples=limit,
            spent=rounds["client_samples"] + personalization,
            reached=budget_reached(history, limit, personalization),
        ),
        timing=Timing(
            client_seconds=sum(t.client_seconds for t in timings),
            aggregation_seconds=sum(t.aggregation_seconds for t in timings),
            distillation_seconds=sum(t.distillation_seconds for t in timings),
            peak_rss_bytes=max(rss),
            peak_cuda_bytes=max(cuda, default=None),
        ),
    )
