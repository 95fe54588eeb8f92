"""--budget client-samples:N: refused where --rounds cannot reach it, the final personalization's samples set aside,
and the last round's clients cut to their share of what is left (the same rule `--dry-run` counts by)."""

from __future__ import annotations

from peradapt.config import TrainConfig, parse_budget
from peradapt.errors import ConfigError
from peradapt.federation.session import Session
from peradapt.progress import counted
from peradapt.rundir.records import RoundRecord


def budget_limit(config: TrainConfig) -> int | None:
    """--budget client-samples:N's N (None: no budget)."""
    budget = config.federation.budget
    return None if budget is None else parse_budget(budget)[1]


def check_budget(session: Session) -> None:
    """Refuse a --budget that the run cannot reach within --rounds, before anything is written: a round processes
    at most what the method's client update can (`Method.client_samples_bound`) on the clients with the most data,
    as many as a round trains, and the final personalization's samples are set aside first
    (`personalization_reserve`). Not checked where that is not known before the run: with --dp-noise (DP-SGD's
    Poisson batches have no largest size) or for a method that does not say."""
    limit, fed, method = budget_limit(session.config), session.config.federation, session.method
    if limit is None or session.trainer.privacy is not None:
        return
    reserve = personalization_reserve(session)
    if reserve >= limit:
        raise ConfigError(
            f"--budget {fed.budget} cannot be reached: --method {session.config.method.method}'s personalization "
            f"of every client after the rounds alone trains {reserve:,} samples; raise N"
        )
    bounds = [method.client_samples_bound(client) for client in session.federated_clients]
    known = [bound for bound in bounds if bound is not None]
    if len(known) < len(bounds):
        return
    federated = [client.client_id for client in session.federated_clients]
    trained = len(method.clients_to_train(federated[: fed.clients_per_round], federated))
    per_round = sum(sorted(known, reverse=True)[:trained])
    if per_round * fed.rounds < limit - reserve:
        needed = f"--rounds {-(-(limit - reserve) // per_round)}" if per_round else "clients with training data"
        set_aside = f" besides the {reserve:,} of the final personalization" if reserve else ""
        raise ConfigError(
            f"--budget {fed.budget} cannot be reached: --method {session.config.method.method} processes at most "
            f"{per_round:,} client training samples a round ({counted(trained, 'client')}), "
            f"{per_round * fed.rounds:,} in --rounds {fed.rounds}{set_aside}; lower N or give it {needed}"
        )


def personalization_reserve(session: Session) -> int:
    """The training samples of the federated clients' personalization when the run hands out their models
    (`Method.personalization_samples`: fedavg-ft's fine-tuning), which --budget counts and so sets aside."""
    return sum(session.method.personalization_samples(client) for client in session.federated_clients)


def budget_reached(history: list[RoundRecord], limit: int, reserve: int) -> bool:
    """Whether the rounds of `history` used up --budget client-samples:`limit` (less `reserve`): their samples
    reach it, or the last round trained only what was left of it (`budget_share`)."""
    return client_samples(history) + reserve >= limit or bool(history and history[-1].budget_share is not None)


def budget_share(session: Session, left: float, trained: list[int], shares: dict[int, float]) -> float | None:
    """The share of their work the clients `trained` (doing `shares` of it already: stragglers) do so that the
    round trains no more than `left`, what is left of --budget: None where all of it fits, or where the most a
    client trains is not known (`Method.client_samples_bound`; DP-SGD), and the budget is then met to within a
    round. Each SGD job of a client is cut to the share (`LocalTrainer.work_share`), so the round trains at most
    what is left, less under a sample per job. `--dry-run` counts a budget's last round by it too."""
    if session.trainer.privacy is not None:
        return None
    bounds = [session.method.client_samples_bound(session.data.clients[c]) for c in trained]
    if any(bound is None for bound in bounds):
        return None
    planned = sum(shares.get(c, 1.0) * bound for c, bound in zip(trained, bounds, strict=True))  # type: ignore[operator]
    return left / planned if planned > left else None


def client_samples(history: list[RoundRecord]) -> int:
    """The client training samples of the rounds of `history`, which --budget client-samples:N stops at."""
    return sum(record.cost.client_samples for record in history)
