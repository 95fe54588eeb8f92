"""Score curves of a comparison (issue 36, item 3): how fast a method gets there, not only where it ends.

A run's curve is its personalized local-test at each evaluated round (`--eval-every`), the last point its final
evaluation, each with the client work and bytes spent by then. Per method the seeds' curves are summed up as their
mean with the seeds' range (min to max: with the few seeds of a comparison, a t interval per point would be wider
than the data and say little more); from it the first evaluated round that reaches a target score, and per seed the
area under the curve over its rounds.

Pure functions over percentages; no point is invented: a round nobody evaluated has none.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Evaluation:
    """One run's score (percent) after `round` rounds, and what its clients had spent by then: training samples and
    bytes, down and up."""

    round: int
    score: float
    client_samples: int
    bytes: int


@dataclass(frozen=True)
class CurvePoint:
    """A method's curve at one evaluation: round and costs are the seeds' means (seeds can differ in work per round
    and, under --budget, in rounds played), `mean` the seeds' mean score and `low`/`high` their range."""

    round: float
    client_samples: float
    bytes: float
    mean: float
    low: float
    high: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _point(evaluations: Sequence[Evaluation]) -> CurvePoint:
    """The seeds' evaluations at one point of the curve."""
    scores = [evaluation.score for evaluation in evaluations]
    return CurvePoint(
        round=float(np.mean([evaluation.round for evaluation in evaluations])),
        client_samples=float(np.mean([evaluation.client_samples for evaluation in evaluations])),
        bytes=float(np.mean([evaluation.bytes for evaluation in evaluations])),
        mean=float(np.mean(scores)),
        low=min(scores),
        high=max(scores),
    )


def mean_curve(runs: Sequence[Sequence[Evaluation]]) -> list[CurvePoint]:
    """The seeds' curve of a method from each seed's evaluations in round order, its final evaluation last: a point
    at each round that every seed evaluated before the earliest seed's end, then the end, where each seed has its
    final evaluation (at the rounds it played: the same for all unless --budget stopped them apart)."""
    ends = [run[-1] for run in runs]
    last = min(end.round for end in ends)
    by_round = [{evaluation.round: evaluation for evaluation in run[:-1]} for run in runs]
    shared = sorted(set.intersection(*(set(rounds) for rounds in by_round)))
    return [_point([rounds[r] for rounds in by_round]) for r in shared if r < last] + [_point(ends)]


def first_reaching(curve: Sequence[CurvePoint], target: float) -> CurvePoint | None:
    """The first point of the curve whose mean score is at least `target`; None where none is (not reached)."""
    return next((point for point in curve if point.mean >= target), None)


def area_per_round(evaluations: Sequence[Evaluation]) -> float:
    """The area under a run's score-against-rounds curve (trapezoid rule) divided by the rounds it spans, from its
    first evaluation to its last: its mean score over those rounds. NaN with a single evaluation (--eval-every 0),
    which has no area: the statistics over seeds leave it out."""
    if len(evaluations) < 2:
        return math.nan
    area = sum(
        (before.score + after.score) / 2 * (after.round - before.round)
        for before, after in itertools.pairwise(evaluations)
    )
    return area / (evaluations[-1].round - evaluations[0].round)
