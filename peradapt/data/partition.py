"""How a pool of labeled samples is divided among clients: pure functions of labels and a numpy Generator."""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from peradapt.errors import ConfigError, DataError

# Dirichlet draws that starve a client (below the floor) are redrawn, up to this many times, and within a budget of
# this many client proportions drawn in all. Up to 100 clients, 1000 starving draws mean that alpha is too small for
# the request: an error says so. With thousands of clients nearly every draw starves someone, whatever alpha: after
# a few draws (one at 100,000 clients) the last is kept and the starved clients get their floor from the richest.
_MAX_DIRICHLET_TRIES = 1000
_DIRICHLET_BUDGET = 100_000


@dataclass(frozen=True)
class PartitionSpec:
    """A parsed ``--partition``: ``dir`` (``value`` = alpha), ``iid``, ``classes`` (``value`` = K) or ``domain``."""

    kind: Literal["dir", "iid", "classes", "domain"]
    value: float | int | None = None

    def __str__(self) -> str:
        return self.kind if self.value is None else f"{self.kind}:{self.value}"


def parse_partition(spec: str) -> PartitionSpec:
    """Parse ``dir:ALPHA`` (ALPHA > 0), ``iid``, ``classes:K`` (K >= 1) or ``domain``."""
    text = spec.strip().lower()
    kind, _, value = text.partition(":")
    try:
        if text == "iid":
            return PartitionSpec("iid")
        if text == "domain":
            return PartitionSpec("domain")
        if kind == "dir" and math.isfinite(alpha := float(value)) and alpha > 0:
            return PartitionSpec("dir", alpha)
        if kind == "classes" and (classes := int(value)) >= 1:
            return PartitionSpec("classes", classes)
    except ValueError:
        pass
    raise ConfigError(f"bad --partition {spec!r}: use dir:ALPHA (e.g. dir:0.1), iid, classes:K or domain")


def partition_labels(
    labels: np.ndarray,
    num_clients: int,
    spec: PartitionSpec,
    rng: np.random.Generator,
    min_samples: int = 10,
) -> list[np.ndarray]:
    """Divide sample indices among clients; every index goes to exactly one client, each list sorted.

    ``labels`` are what the partition divides by: classes, meta-categories, or for ``domain`` the domain index
    (client i gets domain i). ``min_samples`` is the Dirichlet floor per client, lowered to what the pool can
    give every client.
    """
    labels = np.asarray(labels)
    if num_clients < 1:
        raise ConfigError(f"--clients must be at least 1, got {num_clients}")
    if len(labels) < num_clients:
        raise DataError(
            f"{num_clients} clients need at least {num_clients} samples; there are {len(labels)} (lower --clients)"
        )
    if spec.kind == "iid":
        parts = np.array_split(rng.permutation(len(labels)), num_clients)
    elif spec.kind == "domain":
        parts = [np.flatnonzero(labels == client) for client in range(num_clients)]
    elif spec.kind == "dir":
        floor = min(min_samples, len(labels) // num_clients)
        parts = _dirichlet_parts(labels, num_clients, float(spec.value), floor, rng)
    else:
        parts = _class_shard_parts(labels, num_clients, int(spec.value), rng)
    empty = [client for client, part in enumerate(parts) if len(part) == 0]
    if empty:
        raise DataError(
            f"partition {spec} left {len(empty)} of {num_clients} clients without samples (lower --clients)"
        )
    return [np.sort(part).astype(np.int64) for part in parts]


def _dirichlet_parts(
    labels: np.ndarray, num_clients: int, alpha: float, floor: int, rng: np.random.Generator
) -> list[np.ndarray]:
    classes = np.unique(labels)
    class_sizes = np.array([np.count_nonzero(labels == label) for label in classes])
    tries = max(1, min(_MAX_DIRICHLET_TRIES, _DIRICHLET_BUDGET // num_clients))
    for _ in range(tries):
        proportions = rng.dirichlet(np.full(num_clients, alpha), size=len(classes))
        counts = np.diff(_split_bounds(class_sizes, proportions), axis=1)
        if counts.sum(axis=0).min() >= floor:
            break
    else:
        if tries == _MAX_DIRICHLET_TRIES:
            raise DataError(
                f"dir:{alpha} could not give each of {num_clients} clients {floor} samples in "
                f"{_MAX_DIRICHLET_TRIES} draws: lower --clients or raise alpha"
            )
        counts = _lift_to_floor(counts, floor)
    bounds = np.concatenate([np.zeros((len(classes), 1), dtype=np.int64), np.cumsum(counts, axis=1)], axis=1)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for label, class_bounds in zip(classes, bounds, strict=True):
        members = rng.permutation(np.flatnonzero(labels == label))
        for client in range(num_clients):
            parts[client].append(members[class_bounds[client] : class_bounds[client + 1]])
    return [np.concatenate(part) for part in parts]


def _lift_to_floor(counts: np.ndarray, floor: int) -> np.ndarray:
    """Per-class, per-client sample counts with every client raised to `floor`: each missing sample moves from the
    client with the most samples, out of its largest class (so donors keep their skew). The pool holds at least
    `floor` samples per client, so donors never run out."""
    counts = counts.copy()
    totals = counts.sum(axis=0)
    donors = [(-int(total), client) for client, total in enumerate(totals) if total > floor]
    heapq.heapify(donors)
    for client in np.flatnonzero(totals < floor):
        for _ in range(floor - int(totals[client])):
            negative_total, donor = heapq.heappop(donors)
            label = int(counts[:, donor].argmax())
            counts[label, donor] -= 1
            counts[label, client] += 1
            if -negative_total - 1 > floor:
                heapq.heappush(donors, (negative_total + 1, donor))
    return counts


def _split_bounds(class_sizes: np.ndarray, proportions: np.ndarray) -> np.ndarray:
    """Per class, the cut points ``[0, ..., size]`` that divide its samples in the given proportions."""
    cuts = np.floor(np.cumsum(proportions, axis=1) * class_sizes[:, None]).astype(np.int64)
    # Rounding can leave the cumulative sum a hair under 1; the last client must end at the class size.
    cuts[:, -1] = class_sizes
    return np.concatenate([np.zeros((len(class_sizes), 1), dtype=np.int64), cuts], axis=1)


def _class_shard_parts(
    labels: np.ndarray, num_clients: int, classes_per_client: int, rng: np.random.Generator
) -> list[np.ndarray]:
    classes = rng.permutation(np.unique(labels))
    per_client = min(classes_per_client, len(classes))
    holders: dict[int, list[int]] = {int(label): [] for label in classes}
    # Walking the shuffled classes cyclically gives each client distinct classes and each class
    # an almost equal number of holders.
    for client in range(num_clients):
        for slot in range(per_client):
            holders[int(classes[(client * per_client + slot) % len(classes)])].append(client)
    # With fewer slots than classes, the classes nobody drew still need holders so that every sample is used.
    for position, label in enumerate(classes[num_clients * per_client :]):
        holders[int(label)].append(position % num_clients)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for label, clients in holders.items():
        members = rng.permutation(np.flatnonzero(labels == label))
        for client, shard in zip(clients, np.array_split(members, len(clients)), strict=True):
            parts[client].append(shard)
    return [np.concatenate(part) for part in parts]


def split_test_like_train(
    test_labels: np.ndarray,
    train_parts: Sequence[np.ndarray],
    train_labels: np.ndarray,
    num_classes: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Give each client a disjoint test split whose label distribution follows its training split.

    Class c's test samples are shared out in proportion to the clients' class-c training counts
    (largest remainders get the leftovers), so each is used once unless no client trains on class c.
    """
    test_labels = np.asarray(test_labels)
    train_counts = np.array(label_histograms(train_labels, train_parts, num_classes), dtype=np.int64)
    parts: list[list[np.ndarray]] = [[] for _ in train_parts]
    for label in range(num_classes):
        members = rng.permutation(np.flatnonzero(test_labels == label))
        weights = train_counts[:, label]
        if weights.sum() == 0 or len(members) == 0:
            continue
        bounds = np.concatenate([[0], np.cumsum(_largest_remainder_quotas(len(members), weights))])
        for client in range(len(train_parts)):
            parts[client].append(members[bounds[client] : bounds[client + 1]])
    return [np.sort(np.concatenate(part)).astype(np.int64) if part else np.empty(0, np.int64) for part in parts]


def _largest_remainder_quotas(total: int, weights: np.ndarray) -> np.ndarray:
    # Integer arithmetic keeps the quotas exact, so they always sum to ``total``.
    quotas, remainders = np.divmod(total * weights, weights.sum())
    leftover = total - int(quotas.sum())
    quotas[np.argsort(-remainders, kind="stable")[:leftover]] += 1
    return quotas


def label_histograms(labels: np.ndarray, parts: Sequence[np.ndarray], num_classes: int) -> list[list[int]]:
    """Per client, how many of its samples carry each label (plain ints, ready for JSON)."""
    labels = np.asarray(labels)
    return [np.bincount(labels[np.asarray(part, dtype=np.int64)], minlength=num_classes).tolist() for part in parts]
