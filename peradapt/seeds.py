"""Seeds derived from (run seed, round, client, phase), so that any round can be replayed exactly."""

from __future__ import annotations

import numpy as np

PERSONAL, LOCAL, SERVER, SAMPLING, EVALUATION, VALIDATION, TUNING = 1, 2, 3, 4, 5, 6, 7


def derive_seed(*parts: int) -> int:
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


def sample_clients(seed: int, round_index: int, num_clients: int, per_round: int) -> list[int]:
    """The C clients of round t out of M, uniformly without replacement (Algorithm 1, line 4)."""
    rng = np.random.default_rng(derive_seed(seed, round_index, SAMPLING))
    return sorted(int(c) for c in rng.choice(num_clients, size=per_round, replace=False))
