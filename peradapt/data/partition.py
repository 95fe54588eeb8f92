"""How a pool of labeled samples is divided among clients: pure functions of labels and a numpy Generator."""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

import numpy as np

from peradapt.errors import ConfigError, DataError

# Dirichlet draws that starve a client (below the floor) are redrawn, up to this many times, and within a budget of
# this many client proportions drawn in all. Up to 100 clients, 1000 starving draws mean that alpha is too small for
# the request: an error says so. With thousands of clients nearly every draw starves someone, whatever alpha: after
# a few draws (one at 100,000 clients) the last is kept and the starved clients get their floor from the richest.
_MAX_DIRICHLET_TRIES = 1000
_DIRICHLET_BUDGET = 100_000
# dir-balanced, after the PerAda authors' code (datasets/prepare_data.py, cifar_noniid, their _lst_sample): samples
# of every class reserved for every client before the Dirichlet split, so that no client lacks a class.
RESERVED_PER_CLASS = 2


@dataclass(frozen=True)
class PartitionSpec:
    """A parsed ``--partition``: ``dir`` or ``dir-balanced`` (``value`` = alpha), ``iid``, ``classes`` (``value`` =
    K), ``domain`` or ``file`` (``value`` = the path, as given)."""

    kind: Literal["dir", "dir-balanced", "iid", "classes", "domain", "file"]
    value: float | int | str | None = None

    def __str__(self) -> str:
        return self.kind if self.value is None else f"{self.kind}:{self.value}"


def parse_partition(spec: str) -> PartitionSpec:
    """Parse ``dir:ALPHA`` or ``dir-balanced:ALPHA`` (ALPHA > 0), ``iid``, ``classes:K`` (K >= 1), ``domain`` or
    ``file:PATH``; kinds in any case, the path as given."""
    kind, colon, value = spec.strip().partition(":")
    kind = kind.lower()
    try:
        if kind in ("iid", "domain") and not colon:
            return PartitionSpec(kind)
        if kind == "file" and value:
            return PartitionSpec("file", value)
        if kind in ("dir", "dir-balanced") and math.isfinite(alpha := float(value)) and alpha > 0:
            return PartitionSpec(kind, alpha)
        if kind == "classes" and (classes := int(value)) >= 1:
            return PartitionSpec("classes", classes)
    except ValueError:
        pass
    raise ConfigError(
        f"bad --partition {spec!r}: use dir:ALPHA (e.g. dir:0.1), iid, classes:K or domain, "
        "dir-balanced:ALPHA (the PerAda authors' split) or file:PATH (a partition JSON file)"
    )


def partition_labels(
    labels: np.ndarray,
    num_clients: int,
    spec: PartitionSpec,
    rng: np.random.Generator,
    min_samples: int = 10,
) -> list[np.ndarray]:
    """Divide sample indices among clients; every index goes to exactly one client, each list sorted.

    ``labels`` are what the partition divides by: classes, meta-categories, or for ``domain`` the domain index
    (client i gets domain i). ``min_samples`` is the ``dir`` floor per client, lowered to what the pool can
    give every client. ``file`` partitions are read, not computed: see ``peradapt.data.build_federation``.
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
    elif spec.kind == "dir-balanced":
        proportions = class_proportions(int(labels.max()) + 1, num_clients, float(spec.value), rng)
        parts = balanced_dirichlet_parts(labels, proportions, rng)
    elif spec.kind == "classes":
        present = len(np.unique(labels))
        if int(spec.value) > present:
            raise DataError(
                f"--partition {spec} gives each client {spec.value} classes, but the client pool holds {present}: "
                f"use classes:K with K at most {present} (classes:{present} gives every client all of them)"
            )
        parts = _class_shard_parts(labels, num_clients, int(spec.value), rng)
    else:
        raise ConfigError(f"--partition {spec} is read from its file, not computed from labels")
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
    holders: dict[int, list[int]] = {int(label): [] for label in classes}
    # Walking the shuffled classes cyclically gives each client distinct classes and each class
    # an almost equal number of holders.
    for client in range(num_clients):
        for slot in range(classes_per_client):
            holders[int(classes[(client * classes_per_client + slot) % len(classes)])].append(client)
    # With fewer slots than classes, the classes nobody drew still need holders so that every sample is used.
    for position, label in enumerate(classes[num_clients * classes_per_client :]):
        holders[int(label)].append(position % num_clients)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for label, clients in holders.items():
        members = rng.permutation(np.flatnonzero(labels == label))
        for client, shard in zip(clients, np.array_split(members, len(clients)), strict=True):
            parts[client].append(shard)
    return [np.concatenate(part) for part in parts]


def class_proportions(num_classes: int, num_clients: int, alpha: float, rng: np.random.Generator) -> np.ndarray:
    """``[num_classes, num_clients]``: each class's shares for the clients, drawn from Dir(alpha) once per class."""
    return rng.dirichlet(np.full(num_clients, alpha), size=num_classes)


def balanced_dirichlet_split(
    train_labels: np.ndarray,
    test_labels: np.ndarray,
    num_clients: int,
    num_classes: int,
    alpha: float,
    rng: np.random.Generator,
    *,
    train_total: int | None = None,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``dir-balanced:ALPHA``: training and test parts cut by `balanced_dirichlet_parts` with the same per-class
    proportions, as the PerAda authors' code (datasets/read_data.py) reuses the training proportions for the test
    set. ``rng`` draws the proportions (`class_proportions`), then the training parts, then the test parts.
    ``train_total``: the N of the training split's balance gate (default: its number of labels); the authors'
    is the whole training set, the server's validation share included."""
    proportions = class_proportions(num_classes, num_clients, alpha, rng)
    train_parts = balanced_dirichlet_parts(train_labels, proportions, rng, where="the client pool", total=train_total)
    return train_parts, balanced_dirichlet_parts(test_labels, proportions, rng, where="the test set")


def balanced_dirichlet_parts(
    labels: np.ndarray,
    proportions: np.ndarray,
    rng: np.random.Generator,
    *,
    where: str = "the labels",
    total: int | None = None,
) -> list[np.ndarray]:
    """The PerAda authors' Dirichlet split (datasets/prepare_data.py, cifar_noniid, method "dir") of the indices
    of ``labels`` (0 .. C-1) among M clients, ``proportions`` ``[C, M]`` giving each class's shares; each client's
    list sorted.

    First every client gets RESERVED_PER_CLASS samples of every class: for class k = 0 .. C-1 in turn,
    ``rng.choice`` of its indices (ascending), 2M of them without replacement, client j taking the (2j, 2j+1)-th.
    Then for each class k in turn, its other samples (ascending, then shuffled by ``rng.permutation``) are cut
    among the clients: a client that already took N/M or more samples from the classes cut before (N = ``total``,
    default ``len(labels)``, reserved ones included; its own reserved ones not counted) gets share 0, the shares are
    renormalised, and client j takes the samples between cuts j and j+1 of ``floor(cumsum(shares) * n_k)``
    (see `_balanced_cuts`).
    """
    labels = np.asarray(labels)
    num_classes, num_clients = proportions.shape
    members = [np.flatnonzero(labels == label) for label in range(num_classes)]
    _check_reserve(members, num_clients, where)
    reserve = RESERVED_PER_CLASS * num_clients
    reserved = [rng.choice(indices, reserve, replace=False) for indices in members]
    parts: list[list[np.ndarray]] = [
        [class_reserve[RESERVED_PER_CLASS * client : RESERVED_PER_CLASS * (client + 1)] for class_reserve in reserved]
        for client in range(num_clients)
    ]
    held = np.zeros(num_clients, dtype=np.int64)
    for class_members, class_reserve, class_shares in zip(members, reserved, proportions, strict=True):
        rest = rng.permutation(np.setdiff1d(class_members, class_reserve))
        # The authors' balance gate: clients at or past an even share of all samples take no more.
        shares = _gated_shares(class_shares, held * num_clients < (total or len(labels)))
        cuts = _balanced_cuts(shares, len(rest))
        for client in range(num_clients):
            parts[client].append(rest[cuts[client] : cuts[client + 1]])
        held += np.diff(cuts)
    return [np.sort(np.concatenate(part)).astype(np.int64) for part in parts]


def _check_reserve(members: Sequence[np.ndarray], num_clients: int, where: str) -> None:
    reserve = RESERVED_PER_CLASS * num_clients
    fit = min(len(indices) for indices in members) // RESERVED_PER_CLASS  # the most clients every class can serve
    for label, indices in enumerate(members):
        if len(indices) < reserve:
            raise DataError(
                f"dir-balanced gives each of the {num_clients} clients {RESERVED_PER_CLASS} samples of every class, "
                f"but class {label} has {len(indices)} in {where} (needs {reserve}): lower --clients or use dir:ALPHA "
                f"(every class holds enough for {fit} client(s) at most; or give it more data, e.g. a larger "
                "--limit-samples)"
            )


def _gated_shares(shares: np.ndarray, has_room: np.ndarray) -> np.ndarray:
    gated = np.where(has_room, shares, 0.0)
    if gated.sum() == 0:
        # At tiny alpha a draw holds exact zeros; when every client with room drew one, they share the class evenly
        # (the authors' code would divide by zero here). Some client always has room: the reserve counts in N.
        gated = has_room.astype(np.float64)
    return gated / gated.sum()


def _balanced_cuts(shares: np.ndarray, size: int) -> np.ndarray:
    """``[0, cut_1, ..., size]``: client j takes the samples between cuts j and j+1."""
    cumulative = np.cumsum(shares)
    # Exactly 1 from the last client with a share on: a sum a hair under 1 must not leak a sample to gated clients.
    cumulative[np.flatnonzero(shares)[-1] :] = 1.0
    return np.concatenate([[0], np.floor(cumulative * size).astype(np.int64)])


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


def split_off_test(rows: np.ndarray, share: Fraction, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One client's rows as (train, test), each sorted: ``rng.choice`` picks ``floor(share * len(rows))`` positions
    for test, as the PerAda authors' code (datasets/chexpert.py, get_non_iid_data_train_test_val) does."""
    is_test = np.zeros(len(rows), dtype=bool)
    is_test[rng.choice(len(rows), int(share * len(rows)), replace=False)] = True
    return np.sort(rows[~is_test]), np.sort(rows[is_test])


def label_histograms(labels: np.ndarray, parts: Sequence[np.ndarray], num_classes: int) -> list[list[int]]:
    """Per client, how many of its samples carry each label (plain ints, ready for JSON)."""
    labels = np.asarray(labels)
    return [np.bincount(labels[np.asarray(part, dtype=np.int64)], minlength=num_classes).tolist() for part in parts]
