"""`--lam auto`: the proximal strength λ chosen from the clients' statistical heterogeneity and sample size.

Yu, He, Sun, Xue & Li, "The Effect of Personalization in FedProx: A Fine-grained Analysis on Statistical
Accuracy and Communication Efficiency". Theorem 1 (n_i = n, p_i = 1/m) sets

    λ = ρ / (√n R)     if R ≤ n^(-1/2)
    λ = ρ² / (n R²)    if R > n^(-1/2)

where R bounds the heterogeneity ||w*_i - w*_g||² ≤ R² (Assumption 1), ρ² bounds the gradient noise at the
local optima (Assumption 3) and n is the sample size ON EACH CLIENT (N = mn is the total). Little
heterogeneity gives a large λ (towards GlobalTrain, rate 1/(mn)); much gives λ → 0 (towards LocalTrain,
rate 1/n). Table 1 names three regimes: R ≤ 1/(m√n) (homogeneous, rate 1/(mn)), 1/(m√n) < R ≤ 1/√n
(moderate, rate R/√n) and R > 1/√n (heterogeneous, rate 1/n); the first two share the first branch.

Choices made here, where the paper leaves them open:
- R² is estimated as H = Σ_i p_i ||w_i - w_g||², w_g = Σ_i p_i w_i, p_i = n_i / N: the heterogeneity estimator
  of Lemma 1 (eq. 3), with w_i the trainable parameters after a short warm-up of plain local SGD from the
  initial global state on every client (LocalTrain, the λ → 0 end, so the estimate does not depend on λ).
  BatchNorm running statistics are not parameters and are left out.
- n is the mean per-client training-set size N / m (the paper's equal n_i = n).
- ρ = 2, the value the paper's experiments use (Section 6.1, found by grid search over [1, 10]).
- λ is capped at `lam_max` (the engine passes 1 / lr: a proximal SGD step lr·λ then never overshoots the
  global model); R = 0 would otherwise give λ = ∞ (GlobalTrain).
Note that with ρ ≠ 1 the rule is discontinuous at R = n^(-1/2): λ jumps from ρ to ρ² there.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

from peradapt.adapters import AdapterState, average_states
from peradapt.data import ClientData
from peradapt.federation.local import LocalTrainer
from peradapt.federation.seeds import derive_seed

RHO = 2.0  # Section 6.1: "ρ set to 2"
WARMUP_EPOCHS = 1
WARMUP = 11  # seed phase of the warm-up training (the engine's phases are 1-4)


class LamChoice(NamedTuple):
    lam: float
    regime: str  # homogeneous, moderate or heterogeneous (Table 1)
    explanation: str


def choose_lam(h_hat: float, n: float, m: int, *, rho: float = RHO, lam_max: float = math.inf) -> LamChoice:
    """Theorem 1's λ for heterogeneity H ≈ R² (so R = √H), n samples per client and m clients."""
    if h_hat < 0 or n <= 0 or m < 1 or rho <= 0:
        raise ValueError(f"choose_lam needs H >= 0, n > 0, m >= 1, rho > 0; got {h_hat}, {n}, {m}, {rho}")
    r, threshold = math.sqrt(h_hat), 1 / math.sqrt(n)
    if r > threshold:
        regime, lam = "heterogeneous", rho**2 / (n * h_hat)
        rule = f"R={r:.4g} > 1/sqrt(n)={threshold:.4g}: lam = rho^2/(n R^2)"
    else:
        regime = "homogeneous" if r <= threshold / m else "moderate"
        lam = rho / (math.sqrt(n) * r) if r > 0 else math.inf
        rule = f"R={r:.4g} <= 1/sqrt(n)={threshold:.4g}: lam = rho/(sqrt(n) R)"
    explanation = f"{regime}: {rule} with rho={rho:g}, n={n:.4g}"
    if lam > lam_max:
        lam, explanation = lam_max, f"{explanation}, capped at {lam_max:.4g}"
    return LamChoice(float(lam), regime, explanation)


def heterogeneity(states: Sequence[AdapterState], weights: Sequence[float], keys: Iterable[str]) -> float:
    """H = Σ_i p_i ||w_i - w_g||² over the entries `keys`, with p_i = weights / Σ weights, w_g = Σ_i p_i w_i."""
    keys = list(keys)
    total = float(sum(weights))
    center = average_states([{k: s[k] for k in keys} for s in states], weights)
    spread = 0.0
    for state, weight in zip(states, weights, strict=True):
        squared = sum(torch.sum((state[k].double() - center[k].double()) ** 2) for k in keys)
        spread += weight / total * float(squared)
    return spread


def warmup_states(
    trainer: LocalTrainer, start: AdapterState, clients: Sequence[ClientData], *, lr: float, seed: int
) -> list[AdapterState]:
    """Every client's state after WARMUP_EPOCHS of plain local SGD from `start` (seeded per client)."""
    seeds = [derive_seed(seed, WARMUP, client.client_id) for client in clients]
    return [
        trainer.sgd(start, client.train, epochs=WARMUP_EPOCHS, lr=lr, seed=client_seed)[0]
        for client, client_seed in zip(clients, seeds, strict=True)
    ]


def estimate_lam(
    trainer: LocalTrainer,
    start: AdapterState,
    clients: Sequence[ClientData],
    *,
    lr: float,
    seed: int,
    lam_max: float = math.inf,
    num_clients: int | None = None,
) -> dict:
    """Warm up every client, estimate H and choose λ; a record for the run's config (and its log line).

    `clients` may be a random sample of a federation of `num_clients` clients (H and n are means over clients, so
    the sample estimates them; m is the federation's size). Default: `clients` is the whole federation.
    """
    states = warmup_states(trainer, start, clients, lr=lr, seed=seed)
    sizes = [len(client.train) for client in clients]
    h_hat = heterogeneity(states, sizes, trainer.model.trainable_parameters().keys())
    n = sum(sizes) / len(clients)
    m = num_clients or len(clients)
    choice = choose_lam(h_hat, n, m, lam_max=lam_max)
    return {"h_hat": h_hat, "n": n, "m": m, "rho": RHO, **choice._asdict()}
