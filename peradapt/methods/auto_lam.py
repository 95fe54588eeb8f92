"""`--lam auto`: the proximal strength λ chosen from the clients' statistical heterogeneity and sample size.

Yu, He, Sun, Xue & Li, "The Effect of Personalization in FedProx: A Fine-grained Analysis on Statistical
Accuracy and Communication Efficiency". Theorem 1 (n_i = n, p_i = 1/m) sets

    λ = ρ / (√n R)     if R ≤ n^(-1/2)
    λ = ρ² / (n R²)    if R > n^(-1/2)

where R bounds the heterogeneity of the true models, ||w*_i - w*_g||² ≤ R² for EVERY client i, with
w*_g := Σ_i p_i w*_i (Assumption 1 and the definition above it), ρ² bounds the gradient noise at the local
optima (Assumption 3) and n is the sample size ON EACH CLIENT (N = mn is the total). Little heterogeneity gives
a large λ (towards GlobalTrain, rate 1/(mn)); much gives λ → 0 (towards LocalTrain, rate 1/n). Table 1 names
three regimes: R ≤ 1/(m√n) (homogeneous, rate 1/(mn)), 1/(m√n) < R ≤ 1/√n (moderate, rate R/√n) and R > 1/√n
(heterogeneous, rate 1/n); the first two share the first branch. With ρ ≠ 1 the rule jumps at R = n^(-1/2),
from λ = ρ to ρ².

R² is estimated by fitting the optima Assumption 1 speaks of (the paper leaves the estimate open; its own
synthetic experiments know R by construction):
- w*_i minimizes client i's empirical risk L_i (mean loss over its training set), w*_g = Σ_i p_i w*_i with
  Theorem 1's p_i = 1/m (the paper defines the true global model as this mean, not as the pooled minimizer), and
  R² = max_i ||w*_i - w*_g||²: Assumption 1 bounds every client (the median is recorded for information). Over
  the trainable parameters only, with the model in eval mode: no dropout, no augmentation, BatchNorm on the
  running statistics of the initial state. The objective is then deterministic, as L-BFGS needs, and a function
  of the data and the initial state alone (on CUDA it runs under training's bf16 autocast, like every loss).
- Each minimizer is fitted by full-batch L-BFGS with strong-Wolfe line search (`fit_minimizer`), which sets its
  own step lengths: neither --lr nor --batch-size plays a part (the risk is summed over chunks of CHUNK images,
  so memory is that of one training step of that many). The client fits start from the minimizer of the pooled
  risk Σ_i p_i L_i, itself fitted from the initial state: where minimizers are not unique (non-convex or
  over-parameterized models) this picks, for each client, one near the shared model that FedProx's proximal
  term pulls towards.
- Assumption 2 (μ-strong convexity) is what makes each w*_i exist and be unique. Cross-entropy on classes the
  model separates has no minimizer (the loss falls towards 0 as the weights grow without bound), and a model
  with more parameters than samples has a set of them; an adapter on a few hundred images is often both. Every
  objective therefore carries a weak Gaussian prior centred on the initial state w0: client i minimizes
  L_i(w) + PRIOR / (2 n_i) ||w - w0||², the MAP estimate of w*_i under w ~ N(w0, I / PRIOR) (the prior counts
  like one sample: its weight falls as 1/n_i). It makes the objectives strongly convex wherever the loss is
  convex, so the minimizers exist, are unique and stay at finite margins; where the data determine w*_i it
  shifts it by O(1/n_i), below the O(d/n_i) sampling error the estimate carries anyway. Without it, on
  separable data the fits run the logits into float32 saturation (loss exactly 0 for every client) and R² came
  out 0 or whatever distance the budget reached.
- A fixed budget of EVALUATIONS risk evaluations per fit keeps the cost bounded and the estimate comparable
  between runs; each evaluation is a forward and backward pass over the fitted data. For a non-convex model the
  fits may still end on the budget rather than at a minimizer: the estimate is then fixed by these constants,
  the data and the initial state, never by the run's optimizer settings (though, as for any unfinished
  non-convex optimization, another machine's float rounding may move it).
- n is the mean per-client training-set size N / m (the paper's equal n_i = n); ρ = 2, the value of the
  paper's experiments (Section 6.1, found by grid search over [1, 10]).
- λ is capped at `lam_max` (the engine passes 1 / lr: a proximal SGD step lr·λ then never overshoots the
  global model); R = 0 would otherwise give λ = ∞ (GlobalTrain).
The fitted minimizers are those of n samples, not of the distributions: each carries an estimation error of
order d/n, so near-identical clients still give R > 0 (a smaller λ: more personalization than the truth asks).
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import torch

from peradapt.adapters import AdapterState
from peradapt.compute.trainer import LocalTrainer
from peradapt.data import ClientData
from peradapt.errors import TrainingDiverged

RHO = 2.0  # Section 6.1: "ρ set to 2"
EVALUATIONS = 25  # risk evaluations per fit; the last line search may add up to 24 more (torch's max_ls = 25)
HISTORY = 10  # L-BFGS curvature pairs (torch's default)
CHUNK = 128  # images per forward and backward pass: fixed, as chunks change the float rounding of the risk
PRIOR = 1.0  # precision of the N(w0, I / PRIOR) prior on the trainable parameters (module docstring)

# A full-batch risk: yields terms whose sum is the risk, each a chunk of the data (backpropagated one by one).
Risk = Callable[[], Iterable[torch.Tensor]]


class LamChoice(NamedTuple):
    lam: float
    regime: str  # homogeneous, moderate or heterogeneous (Table 1)
    explanation: str


class Heterogeneity(NamedTuple):
    r2: float  # max_i ||w*_i - w*_g||²
    r2_median: float


def choose_lam(r2: float, n: float, m: int, *, rho: float = RHO, lam_max: float = math.inf) -> LamChoice:
    """Theorem 1's λ for heterogeneity R², n samples per client and m clients."""
    if r2 < 0 or n <= 0 or m < 1 or rho <= 0:
        raise ValueError(f"choose_lam needs R^2 >= 0, n > 0, m >= 1, rho > 0; got {r2}, {n}, {m}, {rho}")
    r, threshold = math.sqrt(r2), 1 / math.sqrt(n)
    if r > threshold:
        regime, lam = "heterogeneous", rho**2 / (n * r2)
        rule = f"R={r:.4g} > 1/sqrt(n)={threshold:.4g}: lam = rho^2/(n R^2)"
    else:
        regime = "homogeneous" if r <= threshold / m else "moderate"
        lam = rho / (math.sqrt(n) * r) if r > 0 else math.inf
        rule = f"R={r:.4g} <= 1/sqrt(n)={threshold:.4g}: lam = rho/(sqrt(n) R)"
    explanation = f"{regime}: {rule} with rho={rho:g}, n={n:.4g}"
    if lam > lam_max:
        lam, explanation = lam_max, f"{explanation}, capped at {lam_max:.4g}"
    return LamChoice(float(lam), regime, explanation)


def fit_minimizer(parameters: Sequence[torch.Tensor], risk: Risk) -> list[torch.Tensor]:
    """Minimize `risk` over `parameters` (leaf tensors, changed in place) from their current values with
    full-batch L-BFGS and strong-Wolfe line search, within EVALUATIONS evaluations of the risk."""
    optimizer = torch.optim.LBFGS(
        parameters,
        lr=1.0,  # L-BFGS's natural step; the line search scales it
        max_iter=EVALUATIONS,
        max_eval=EVALUATIONS,
        history_size=HISTORY,
        line_search_fn="strong_wolfe",
    )

    def evaluate() -> torch.Tensor:
        optimizer.zero_grad()
        total = 0.0
        for term in risk():
            term.backward()
            total += float(term.detach())
        return torch.tensor(total, dtype=torch.float64)  # the line search compares these values

    optimizer.step(evaluate)
    for parameter in parameters:
        parameter.grad = None  # not left on the shared model
    return [parameter.detach().clone() for parameter in parameters]


def heterogeneity(
    parameters: Sequence[torch.Tensor], client_risks: Sequence[Risk], sizes: Sequence[int]
) -> Heterogeneity:
    """R² of Assumption 1 from the clients' empirical risks and training-set sizes (see the module docstring), the
    fits starting from the parameters' current values w0; p_i = 1/m. Client i's objective is its risk plus
    PRIOR / (2 n_i) ||w - w0||². Holds one copy of the parameters per client, on the CPU."""
    start = [parameter.detach().clone() for parameter in parameters]

    def objective(risk: Risk, size: int) -> Iterable[torch.Tensor]:
        yield from risk()
        yield PRIOR / (2 * size) * sum(torch.sum((w - w0) ** 2) for w, w0 in zip(parameters, start, strict=True))

    p = 1 / len(client_risks)
    objectives = [functools.partial(objective, risk, size) for risk, size in zip(client_risks, sizes, strict=True)]
    pooled = fit_minimizer(parameters, lambda: (p * term for objective in objectives for term in objective()))
    displacements = []  # w*_i - (pooled minimizer)
    for objective in objectives:
        with torch.no_grad():
            for parameter, value in zip(parameters, pooled, strict=True):
                parameter.copy_(value)
        fit = fit_minimizer(parameters, objective)
        displacements.append([(w - g).cpu() for w, g in zip(fit, pooled, strict=True)])
    center = [p * sum(tensors) for tensors in zip(*displacements, strict=True)]  # w*_g - (pooled minimizer)
    distances = [
        sum(float(torch.sum((d.double() - c.double()) ** 2)) for d, c in zip(ds, center, strict=True))
        for ds in displacements
    ]
    return Heterogeneity(max(distances), statistics.median(distances))


def client_risk(trainer: LocalTrainer, client: ClientData) -> Risk:
    """L_i: the mean of `trainer.loss` over the client's training set, one term per CHUNK unaugmented model
    inputs (with the model as it is loaded, here in eval mode)."""
    data = client.train
    assert data.labels is not None

    def terms() -> Iterable[torch.Tensor]:
        for begin in range(0, len(data), CHUNK):
            images = trainer.inputs(data.images[begin : begin + CHUNK])  # no generator: no augmentation
            labels = data.labels[begin : begin + CHUNK].to(trainer.inputs.device)
            # `lr` only names the step size in a divergence message; there is none here (see estimate_lam).
            yield trainer.loss(images, labels, math.nan, reduction="sum") / len(data)

    return terms


def estimate_lam(
    trainer: LocalTrainer,
    start: AdapterState,
    clients: Sequence[ClientData],
    *,
    lam_max: float = math.inf,
    num_clients: int | None = None,
) -> dict:
    """Fit the optima from `start`, estimate R² and choose λ; a record for the run's config (and its log line).

    `clients` may be a random sample of a federation of `num_clients` clients: R² is then the max over the sample
    and n its mean size; m is the federation's size. Default: `clients` is the whole federation. Clients without
    training data have no empirical risk and are left out of the fits.
    """
    model = trainer.model
    model.load_state(start)
    model.eval()
    fitted = [client for client in clients if len(client.train)]
    try:
        parameters = list(model.trainable_parameters().values())
        estimate = heterogeneity(parameters, [client_risk(trainer, c) for c in fitted], [len(c.train) for c in fitted])
    except TrainingDiverged as error:  # its message names --lr, which plays no part here
        raise TrainingDiverged(
            "--lam auto: the loss became non-finite fitting the clients' optima: pass a number"
        ) from error
    n = sum(len(client.train) for client in clients) / len(clients)
    m = num_clients or len(clients)
    choice = choose_lam(estimate.r2, n, m, lam_max=lam_max)
    return {**estimate._asdict(), "clients": len(fitted), "n": n, "m": m, "rho": RHO, **choice._asdict()}
