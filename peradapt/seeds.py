"""Seeds derived from (run seed, round, client, phase), so that any round can be replayed exactly."""

from __future__ import annotations

import numpy as np

# Every seed phase of the package: the last part of `derive_seed(seed, ..., PHASE)`, one per kind of draw, so that
# no two draws from the same seed share a stream. A new kind of draw takes a new value here (tests/test_seeds.py
# checks that they are distinct and that no module passes a phase of its own). The values are part of every result:
# changing one changes the numbers.
PERSONAL = 1  # a client's personal training (personal_job, the partial methods' personal part)
LOCAL = 2  # local training's minibatches, augmentation and dropout (local_job and every method's own local SGD)
SERVER = 3  # the server update's seed, derive_seed(run seed, round, SERVER), given by the engine
SAMPLING = 4  # the clients a round asks (sample_clients); the client whose norm statistics PerAda's mean takes
EVALUATION = 5  # the clients evaluated when there are more than Session.client_sample takes
VALIDATION = 6  # the order a client's validation share is cut from (with the client id after it)
TUNING = 7  # a study's TPE sampler
PARTICIPATION = 8  # whether a client answers in a round (answering)
STRAGGLERS = 9  # a round's stragglers and their shares of the work (straggler_shares)
FINETUNE = 11  # the local fine-tuning at evaluation (FedAvg+FT, FedBABU), of a federated or a new client
NEW_CLIENT = 12  # a new client's personalization, and the test share of a new client's image directory
NOISE = 13  # the DP-SGD noise, from the training call's own seed
ALA = 21  # FedALA's ALA: its data sample and its minibatches


def derive_seed(*parts: int) -> int:
    """A seed from integers (a seed, then phases: `derive_seed(seed, LOCAL)`), the same on every machine and
    run, independent of any other tuple's. The engine gives a client update derive_seed(run seed, round, client) and
    a server update derive_seed(run seed, round, SERVER); a method draws each random choice of its own from
    `derive_seed(seed, PHASE)`, with a phase that no other draw from the same seed uses: one of this module's, or,
    for a kind of draw of its own, a value that none of them has."""
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
