"""The round loop, written once for every method and both engines (`FederatedRun`): sample, client updates,
server update, evaluate, checkpoint; then the final evaluation and export.

Every random draw is derived from (seed, round, client, phase), so a resumed run ends with exactly the numbers an
uninterrupted one gives; nothing in the loop grows with the number of clients M beyond the data (one model serves
every client, a disk store holds the states, and in federations of more than CLIENT_SAMPLE clients the evaluations
use the session's seeded `client_sample`)."""

from __future__ import annotations

import time

import numpy as np
from rich.console import Console

from peradapt.compute.costs import elements, peak_memory
from peradapt.compute.privacy import round_epsilons
from peradapt.evaluation import flat_scores, per_client_record
from peradapt.federation.budget import (
    budget_limit,
    budget_reached,
    budget_share,
    client_samples,
    personalization_reserve,
)
from peradapt.federation.checkpoints import save_round
from peradapt.federation.clients import Clients, RoundTask
from peradapt.federation.finish import (
    OwnElements,
    build_report,
    evaluate_models,
    exporting,
    first_trained,
    sample_flops,
)
from peradapt.federation.lifecycle import PreparedRun
from peradapt.federation.progress import RoundProgress
from peradapt.rundir.checkpoint import write_json_atomic
from peradapt.rundir.lock import deferred_interrupts
from peradapt.rundir.records import ParameterCounts, Report, RoundCost, RoundRecord, RoundTiming
from peradapt.seeds import SERVER, answering, derive_seed, sample_clients, straggler_shares


class FederatedRun:
    """A prepared run directory's rounds and its end (Algorithm 1), the same on every engine: only where the
    clients train differs (`clients`). `play` plays the rounds left, each sampled, trained, aggregated, evaluated
    every --eval-every and checkpointed, then the final evaluation and export (`federation.finish`); what a user
    sees of it is `events`' (`RoundEvents`), and the server's work is what the method says it is."""

    def __init__(self, run: PreparedRun, clients: Clients, console: Console) -> None:
        self.session, self.paths, self.history, self.tracking = run.session, run.paths, run.history, run.tracking
        self.global_state, self.clients, self.console = run.global_state, clients, console
        self.flops = sample_flops(self.session)
        fed = self.session.config.federation
        train_sizes = [len(client.train) for client in self.session.data.clients]
        self.events = RoundProgress(console, fed.rounds, len(self.history), train_sizes.__getitem__)

    def play(self) -> Report:
        with self.events:
            self.play_rounds()
            return self.finish()

    def play_rounds(self) -> None:
        """The rounds left, up to --rounds or until --budget is reached."""
        session, history = self.session, self.history
        fed = session.config.federation
        limit = budget_limit(session.config)
        reserve = personalization_reserve(session) if limit is not None else 0
        for round_index in range(len(history), fed.rounds):
            if limit is not None and budget_reached(history, limit, reserve):
                set_aside = f" and {reserve:,} set aside for the final personalization" if reserve else ""
                self.console.print(
                    f"--budget {fed.budget}: reached after round {round_index} "
                    f"({client_samples(history):,} client training samples{set_aside}); no more rounds"
                )
                break
            left = None if limit is None else limit - reserve - client_samples(history)
            record = self.play_round(round_index, left)
            with deferred_interrupts():  # Ctrl-C: after the round's checkpoint, not between its files
                history.append(record)
                save_round(session, self.global_state, history, self.paths)
            if self.tracking is not None:  # once the round is kept: a crash before this logs it on --resume
                self.tracking.log_round(record)
            self.events.round_finished(record)

    def play_round(self, round_index: int, left: int | None) -> RoundRecord:
        """Round `round_index` (from 0), `left` client samples before --budget (None: no budget): the global state
        moves on, and the round's record is returned."""
        session, clients, flops = self.session, self.clients, self.flops
        config, method = session.config, session.method
        fed, seed = config.federation, config.seed
        federated = fed.clients - fed.holdout_clients  # held-out clients are the last ids: never sampled
        sampled = sample_clients(seed, round_index, federated, fed.clients_per_round)
        # --participation: the clients that do not answer neither train nor are aggregated
        asked = method.clients_to_train(sampled, list(range(federated)))  # pFedMe, pFedBreD: every client trains
        trained = answering(seed, round_index, asked, fed.participation)
        answered = set(trained)
        aggregated = [client_id for client_id in sampled if client_id in answered]
        shares = straggler_shares(seed, round_index, trained, fed.stragglers) if fed.stragglers else {}
        stragglers = dict(shares)
        cut = None if left is None else budget_share(session, left, trained, shares)
        if cut is not None:  # the last round of --budget: every client does its part of what is left
            shares = {client_id: shares.get(client_id, 1.0) * cut for client_id in trained}
        payloads = {client_id: method.payload(client_id, self.global_state) for client_id in trained}
        on_client = self.events.clients_started(round_index, len(trained))
        updates = clients.train(RoundTask(round_index, trained, payloads, shares), on_client)
        self.events.clients_finished()
        by_client = {update.client_id: update for update in updates}
        on_step = self.events.server_started(round_index, method.server_steps(round_index))
        server_started, server_before = time.perf_counter(), method.server_work()
        server_metrics: dict[str, float] = {}
        if aggregated:  # a round that no sampled client answered keeps the global model
            self.global_state, server_metrics = method.server_update(
                self.global_state,
                [by_client[client_id] for client_id in aggregated],  # the sample is aggregated, whoever trained
                derive_seed(seed, round_index, SERVER),
                round_index,
                on_step=on_step,
            )
        server_seconds = time.perf_counter() - server_started
        server = method.server_work() - server_before
        self.events.server_finished()
        epsilons = round_epsilons(session.trainer.privacy, session.store, aggregated)
        scores, evaluation_samples = {}, 0
        if fed.eval_every and (round_index + 1) % fed.eval_every == 0:
            evaluated = session.client_sample  # after this round, whose checkpoint is not written yet
            personalized = clients.personalized(
                evaluated, self.global_state, played=round_index + 1, checkpointed=round_index
            )
            evaluation = evaluate_models(session, personalized, self.global_state, evaluated)
            # with each client's scores, for the authors' selection on test data
            scores = {**flat_scores(evaluation), "per_client": per_client_record(evaluation)}
            evaluation_samples = sum(method.personalization_samples(client) for client in evaluated)
        traffic = clients.traffic()
        samples = [update.work.samples for update in updates]  # `updates` are in the order of `trained`
        counts = None  # what a client trains and sends, as measured (`ClientWork.trained`, `costs.elements`)
        if updates:
            counts = ParameterCounts(
                trained=max(update.work.trained for update in updates),
                communicated=max(elements(update.upload) for update in updates),
            )
        return RoundRecord(
            round=round_index + 1,
            clients=sampled,
            metrics={**_mean_client_metrics(updates), **server_metrics},
            trained_clients=len(trained) if trained != sampled else None,
            unanswered=[c for c in asked if c not in answered] if len(trained) < len(asked) else None,
            stragglers={str(client_id): share for client_id, share in stragglers.items()} or None,
            budget_share=cut,
            **epsilons,
            **scores,
            **traffic,
            parameter_counts=counts,
            client_samples=samples,
            cost=RoundCost(
                bytes_down=sum(traffic["bytes_down"]),
                bytes_up=sum(traffic["bytes_up"]),
                client_samples=sum(samples),
                client_flops=sum(samples) * flops.training,
                server_samples=server.samples_trained,
                server_flops=server.samples_trained * flops.training + server.samples_inferred * flops.inference,
                # what --eval-every costs, apart from the method's own training
                evaluation_samples=evaluation_samples,
                evaluation_flops=evaluation_samples * flops.training,
            ),
            timing=RoundTiming(
                client_seconds=sum(update.work.seconds for update in updates),
                aggregation_seconds=server_seconds - server.seconds,
                distillation_seconds=server.seconds,
                **peak_memory(session.device),
            ),
        )

    def finish(self) -> Report:
        """The final evaluation, each client's adapter exported as it is scored, the global adapter, report.json."""
        session, history, paths, clients = self.session, self.history, self.paths, self.clients
        federated, played = session.federated_clients, len(history)  # fewer than --rounds if --budget stopped it
        on_client = self.events.final_started(len(federated))
        # Each personalized adapter is asked for once (under Flower, fetched from its node once): scored and saved.
        personalized = clients.personalized(federated, self.global_state, played=played, checkpointed=played)
        own = OwnElements(clients, personalized, self.global_state, first_trained(history))
        evaluation = evaluate_models(
            session,
            exporting(session.model, own, paths.root),
            self.global_state,
            federated,
            global_test_clients={c.client_id for c in session.client_sample},
            on_client=on_client,
        )
        session.model.save_pretrained(paths.global_adapter, self.global_state)
        self.events.final_finished()
        report = build_report(
            session, evaluation, history, self.flops, personalized_elements=own.counted, partition=paths.partition
        )
        write_json_atomic(paths.report, report.to_json())
        if self.tracking is not None:
            self.tracking.finish(report)
        return report


def _mean_client_metrics(updates: list) -> dict[str, float]:
    names = updates[0].metrics.keys() if updates else []
    return {name: float(np.mean([u.metrics[name] for u in updates])) for name in names}
