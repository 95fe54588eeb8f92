"""Seeds derived from (run seed, round, client, phase), so that any round can be replayed exactly."""

from __future__ import annotations

import numpy as np

PERSONAL, LOCAL, SERVER, SAMPLING, EVALUATION, VALIDATION, TUNING = 1, 2, 3, 4, 5, 6, 7
PARTICIPATION, STRAGGLERS = 8, 9


def derive_seed(*parts: int) -> int:
    """A seed from integers (a seed, then phases: `derive_seed(seed, LOCAL)`), the same on every machine and
    run, independent of any other tuple's. The engine gives a client update derive_seed(run seed, round, client) and
    a server update derive_seed(run seed, round, SERVER); a method draws each random choice of its own from
    `derive_seed(seed, PHASE)`, with a phase that no other draw from the same seed uses: this module's phases and
    11 (fine-tuning at evaluation, `peradapt.methods.fedavg.FINETUNE`), 12 (a new client's personalization), 13
    (DP-SGD noise) and 21 (FedALA) are taken."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


def sample_clients(seed: int, round_index: int, num_clients: int, per_round: int) -> list[int]:
    """The C clients of round t out of M, uniformly without replacement (Algorithm 1, line 4)."""
    rng = np.random.default_rng(derive_seed(seed, round_index, SAMPLING))
    return sorted(int(c) for c in rng.choice(num_clients, size=per_round, replace=False))


def answering(seed: int, round_index: int, clients: list[int], participation: float) -> list[int]:
    """Those of `clients` that answer in round t, each with probability `participation` (--participation), drawn
    per (round, client): whether a client answers does not depend on which others were asked."""
    if participation >= 1:
        return clients
    draws = [
        np.random.default_rng(derive_seed(seed, round_index, client, PARTICIPATION)).random() for client in clients
    ]
    return [client for client, draw in zip(clients, draws, strict=True) if draw < participation]


def straggler_shares(seed: int, round_index: int, clients: list[int], fraction: float) -> dict[int, float]:
    """--stragglers F: round(F x |clients|) of round t's `clients`, drawn uniformly, each with the share of its local
    work it completes, uniform in [0, 1). The FedProx paper (Li et al. 2020, Sec. 5) draws a straggler's epochs
    uniformly from 1..E; a share of its minibatches is that for peradapt's default E = 1 too. The clients not
    listed do all of their work."""
    rng = np.random.default_rng(derive_seed(seed, round_index, STRAGGLERS))
    stragglers = rng.choice(len(clients), size=round(fraction * len(clients)), replace=False)
    return {clients[int(i)]: float(rng.random()) for i in sorted(stragglers)}
