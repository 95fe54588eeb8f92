"""The federated view of one dataset: fixed source splits, client partitions, server and KD data."""

from __future__ import annotations

import json
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from peradapt.config import MIN_BATCH_SIZE
from peradapt.data.images import ImageSet, Rows, ScannedSource, SourceData, channel_statistics, fit_images
from peradapt.data.officehome import DOMAINS as OFFICE_HOME_DOMAINS
from peradapt.data.partition import (
    PartitionSpec,
    balanced_dirichlet_split,
    label_histograms,
    parse_partition,
    partition_labels,
    split_off_test,
    split_test_like_train,
)
from peradapt.data.sources import (
    SOURCE_NAMES,
    SOURCE_PATTERNS,
    SourceSpec,
    is_source_name,
    load_source,
    normalization_statistics,
    scan_source,
    scan_unlabeled,
    source_kind,
)
from peradapt.errors import ConfigError, DataError
from peradapt.seeds import VALIDATION, derive_seed

if TYPE_CHECKING:
    from peradapt.config import DataConfig

# Fixed, and independent of --seed: `pretrain` and every `train --seed S` must agree on which training
# images were pretrained on, so that those never reach a client.
SPLIT_SEED = 20_240_611

# Shares of a source's training images set aside before the client pool (which gets the rest); a "test" share
# carves the test images of a source without a test set of its own.
# Fashion-MNIST: 20k pretrain / 5k server validation / 10k unlabeled KD / 25k pool of its 60k;
# CIFAR: the paper's 9:1 pool/validation split. Office-Home and CheXpert: the proportions of PerAda's Table 6
# (test 1656 and validation 1391 of 15,588; validation 22,342 and test 20,099 of 223,414). SVHN: CIFAR's 9:1, and
# an unlabeled KD split of its own as Fashion-MNIST's (no paper distills SVHN models); STL-10: 9:1, distilling on
# its own unlabeled split (`_UNLABELED_SPLIT`).
_SPLIT_SHARES: dict[str, dict[str, Fraction]] = {
    "fmnist": {"pretrain": Fraction(1, 3), "val": Fraction(1, 12), "kd": Fraction(1, 6)},
    "cifar10": {"val": Fraction(1, 10)},
    "cifar100": {"val": Fraction(1, 10)},
    "office-home": {"val": Fraction(9, 100), "test": Fraction(1, 10)},
    "chexpert": {"val": Fraction(1, 10), "test": Fraction(9, 100)},
    "svhn": {"val": Fraction(1, 10), "kd": Fraction(1, 10)},
    "stl10": {"val": Fraction(1, 10)},
}
# imagefolder:PATH and hf:NAME, whatever they hold: 1/10 server validation, 1/10 unlabeled KD (so that PerAda runs on
# the data alone), and 1/5 test carved only when the data has no test split of its own; no pretraining split.
_GENERIC_SHARES = {"val": Fraction(1, 10), "kd": Fraction(1, 10), "test": Fraction(1, 5)}
# The paper distills CIFAR-10 models on CIFAR-100, and the others (CIFAR-100, Office-Home, CheXpert) on CIFAR-10.
_AUTO_KD_SOURCE = {
    "cifar10": "cifar100",
    "cifar100": "cifar10",
    "office-home": "cifar10",
    "chexpert": "cifar10",
    "stl10": "stl10",
}
# Sources with an unlabeled split, which they distill on as --kd-data (`load_unlabeled`).
_UNLABELED_SPLIT = ("stl10",)
# What --partition domain gives out, one domain per client; known before loading, to check --clients early.
_DOMAINS = {"office-home": OFFICE_HOME_DOMAINS}
# Independent random streams under SPLIT_SEED, one per thing they choose.
_TRAIN_STREAM, _TEST_STREAM, _KD_STREAM = 0, 1, 2
# What a partition record's indices point into. fixed-split: client train indices into the fixed split's client
# pool, test indices into its test set (both after --limit-samples). train-rows: client train and test indices and
# the record's "val" are rows of the dataset's whole training set, as in the PerAda authors' partition files.
_FIXED_SPLIT, _TRAIN_ROWS = "fixed-split", "train-rows"
# The PerAda authors' partition files (datasets/chexpert.py): each client's rows lose this share to its local test
# split (their test_ratio), and the list under this key holds the server's validation rows.
_AUTHORS_TEST_SHARE = Fraction(1, 10)
_AUTHORS_VAL_KEY = "-1"
# The training samples every client of a new partition (or a file's) must get: a minibatch that BatchNorm can train
# on. (A client may lack test samples: its score is undefined, NaN, and left out of means, as at scale.)
MIN_CLIENT_TRAIN = MIN_BATCH_SIZE


@dataclass(frozen=True)
class ClientData:
    """One client's data: what a method's hooks are given as `client`."""

    client_id: int  # its id, 0 .. N-1 for the federated clients (the --holdout-clients after them)
    train: ImageSet  # its training split, the data its updates train on; `len(client.train)`: its n_m
    test: ImageSet  # its local test split, which the engine evaluates its personalized model on
    # Into the dataset's client pool and its (limited) test set; both rows of the whole training set for a
    # partition of layout train-rows (the PerAda authors' partition files).
    train_indices: np.ndarray
    test_indices: np.ndarray


@dataclass(frozen=True)
class FederatedData:
    dataset: str
    num_classes: int
    channels: int
    image_size: int  # the model's input size; sets smaller than it are stored smaller (see data.images)
    mean: tuple[float, ...]
    std: tuple[float, ...]
    clients: list[ClientData]
    val: ImageSet  # labeled server validation split: selects the distilled global adapter
    kd: ImageSet  # unlabeled distillation data, stored for image_size and with the source's channels
    kd_mean: tuple[float, ...]  # the distillation set's own statistics (`--kd-normalization own`), per channel
    kd_std: tuple[float, ...]
    global_test: ImageSet  # union of all clients' test splits
    partition: dict[str, Any]  # JSON-ready record of the partition, as written to partition.json
    classes: tuple[str, ...] = ()  # the class names, where the source knows them (OOD sets are matched to them)
    skipped_images: tuple[str, ...] = ()  # undecodable training and test images left out (--skip-bad-images)


@dataclass(frozen=True)
class _Origin:
    """Where given client indices come from, as error messages name it, and what to do when they are wrong."""

    name: str
    remedy: str


_SAVED = _Origin(
    "the saved partition (partition.json)",
    "start a new run with the run's settings and another --out (the same --seed and --partition give the same split)",
)


@dataclass(frozen=True)
class _Given:
    """A partition to reuse rather than draw: a saved record (--resume) or a file:PATH's JSON object."""

    record: dict[str, Any]
    origin: _Origin


@dataclass(frozen=True)
class _Parts:
    """Client index lists; ``val`` holds the server's validation rows of a train-rows partition (else ``None``:
    the fixed split's)."""

    train: list[np.ndarray]
    test: list[np.ndarray]
    val: np.ndarray | None = None


@dataclass(frozen=True)
class _PartitionGroups:
    """What the partition divides and partition.json counts, per pool and per test image: class labels, or for
    multi-label data meta-categories, or domains (``--partition domain``)."""

    kind: str
    pool: np.ndarray
    test: np.ndarray
    count: int
    names: tuple[str, ...] = ()  # none for classes


@dataclass(frozen=True)
class FixedSplits:
    """Disjoint indices into a source's training set (pretrain, val, kd, pool) and into its test set (into the
    training set too, disjoint from the rest, for a source whose test images are carved from it)."""

    pretrain: np.ndarray
    val: np.ndarray
    kd: np.ndarray
    pool: np.ndarray
    test: np.ndarray


def fixed_splits(dataset: str, num_train: int, num_test: int, *, limit_samples: int | None) -> FixedSplits:
    """The split of ``dataset`` under SPLIT_SEED; ``limit_samples`` cuts every part to a random subset. A source's
    "test" share carves its test images from the training images when it has none (``num_test`` 0)."""
    shares = _split_shares(dataset)
    carved = "test" in shares and num_test == 0
    order = np.random.default_rng([SPLIT_SEED, _TRAIN_STREAM]).permutation(num_train)
    parts: dict[str, np.ndarray] = {}
    start = 0
    for name in ("pretrain", "val", "kd", "test") if carved else ("pretrain", "val", "kd"):
        size = int(shares.get(name, 0) * num_train)
        parts[name] = order[start : start + size]
        start += size
    parts["pool"] = order[start:]
    if not carved:
        parts["test"] = np.random.default_rng([SPLIT_SEED, _TEST_STREAM]).permutation(num_test)
    # Each part is in random order, so its head is a random subset; one limit cannot move an image
    # from one part into another.
    return FixedSplits(**{name: _head_sorted(indices, limit_samples) for name, indices in parts.items()})


def has_pretraining_split(dataset: str) -> bool:
    """Whether ``peradapt pretrain`` can make a backbone from ``dataset`` (a split the clients never see)."""
    return "pretrain" in _split_shares(dataset)


def pretraining_split(
    dataset: str,
    data_dir: Path | str | None,
    *,
    limit_samples: int | None,
    download: bool = False,
    image_size: int | None = None,
) -> tuple[ImageSet, SourceData]:
    """The labeled images reserved for ``peradapt pretrain`` (never given to clients), and their source, resized
    to ``image_size`` if given."""
    _check_limit(limit_samples)
    if not has_pretraining_split(dataset):
        raise DataError(f"{dataset} has no pretraining split: pass --weights FILE (e.g. ImageNet weights) to train")
    source = load_source(dataset, data_dir, download, image_size)
    splits = _source_splits(source, limit_samples)
    return source.train.subset(splits.pretrain), source


def build_federation(
    data: DataConfig,
    *,
    num_clients: int,
    seed: int,
    saved_partition: dict[str, Any] | None = None,
    normalization_constants: str = "exact",
) -> FederatedData:
    """Load the dataset of ``data`` (a run's data section) and divide its client pool among ``num_clients`` clients.

    ``data.image_size`` is the model's input size (default: see ``load_source``). ``saved_partition`` (a previous
    ``FederatedData.partition``) is reused instead of partitioning anew; so is a ``file:PATH`` partition's file:
    peradapt's own partition.json, or the PerAda authors' layout (see `_authors_record`). ``data.skip_bad_images``
    leaves out the undecodable images of imagefolder and hf data (and of such --kd-data) before the fixed split.
    ``normalization_constants``: the statistics of both sources, exact or the authors' (`normalization_statistics`).
    Under ``data.eval_split`` validation, each client's test split is instead a ``data.validation_fraction`` of its
    training images, held out of its training (`_validation_clients`), and the global test set their union; the
    partition (and partition.json) is the one the test split gives, so trials tuned on it and the final runs share
    their clients, and no test image reaches the model.

    Image files (imagefolder, hf) are counted and labeled first, so that every check that needs no pixels (the
    pool's size against --clients, a given partition's sizes and indices) comes before decoding, and with
    ``data.limit_samples`` only the images the run uses are decoded (`_decode_used`): the split is the same either way.
    """
    dataset, limit_samples, spec = data.data, data.limit_samples, parse_partition(data.partition)
    _check_limit(limit_samples)
    if num_clients < 1:
        raise ConfigError(f"--clients must be at least 1, got {num_clients}")
    kd_source = _kd_source_name(dataset, data.kd_data)
    if spec.kind == "domain":
        _check_domain_clients(dataset, num_clients)
    given = _given_partition(spec, saved_partition, num_clients, limit_samples)  # checked before the slow loading
    layout = _FIXED_SPLIT if given is None else _layout(given.record)
    scanned = scan_source(SourceSpec.of(data))
    splits = fixed_splits(dataset, scanned.num_train, scanned.num_test, limit_samples=limit_samples)
    pool_size, test_size = _client_set_sizes(scanned, splits, layout)
    if pool_size < num_clients:
        raise DataError(
            f"{num_clients} clients need at least {num_clients} samples; the pool has {pool_size} "
            "(raise --limit-samples or lower --clients)"
        )
    if given is None:
        remedy = _check_room(num_clients, pool_size, limit_samples)
    else:
        reused = given.record
        if _is_authors_layout(reused):
            reused = _authors_record(reused, given.origin, num_clients, seed, splits.val)
        reserved = _reserved_rows(splits, own_kd=kd_source == dataset)
        parts = _given_parts(reused, given.origin, dataset, num_clients, pool_size, test_size, reserved)
        if given.origin is not _SAVED:  # a run's own partition trained before: --resume keeps its clients
            _check_filled(parts, given.origin.name, given.origin.remedy)
    own_kd = kd_source == dataset and "kd" in _split_shares(dataset)
    source, splits = _decode_used(scanned, splits, own_kd=own_kd, limited=limit_samples is not None)
    image_size = data.image_size or source.train.images.shape[-1]
    pool, test, pool_rows, test_rows = _client_sets(source, splits, layout)
    groups = _partition_groups(source, spec, pool_rows, test_rows, pool, test)
    if given is None:
        parts = _new_parts(spec, groups, num_clients, seed, len(splits.pool) + len(splits.val))
        _check_filled(parts, f"--partition {spec}", remedy)
    clients = [
        ClientData(client, pool.subset(train_part), test.subset(test_part), train_part, test_part)
        for client, (train_part, test_part) in enumerate(zip(parts.train, parts.test, strict=True))
    ]
    record = {
        # --resume: the saved record wins over the flags, so the clients keep their data.
        "spec": str(spec) if saved_partition is None else saved_partition.get("spec", str(spec)),
        "seed": seed if given is None else given.record.get("seed", seed),
        "dataset": dataset,
        "num_clients": num_clients,
        "layout": layout,
        "pool_size": len(pool),
        "test_size": len(test),
        **({"val": parts.val.tolist()} if parts.val is not None else {}),
        "histograms_of": groups.kind,
        **({"groups": list(groups.names)} if groups.names else {}),
        "clients": [_client_record(client, groups.pool, groups.test, groups.count) for client in clients],
    }
    global_test = test.subset(np.sort(np.concatenate(parts.test)))
    if data.eval_split == "validation":
        clients = _validation_clients(clients, pool, data.validation_fraction, seed)
        global_test = pool.subset(np.sort(np.concatenate([client.test_indices for client in clients])))
    kd, kd_mean, kd_std = _kd_images(kd_source, source, image_size, splits, data, normalization_constants)
    mean, std = normalization_statistics(source, normalization_constants)
    return FederatedData(
        dataset=dataset,
        num_classes=pool.num_classes,
        channels=source.train.images.shape[1],
        image_size=image_size,
        mean=mean,
        std=std,
        clients=clients,
        val=source.train.subset(splits.val if parts.val is None else parts.val),
        kd=kd,
        kd_mean=kd_mean,
        kd_std=kd_std,
        global_test=global_test,
        partition=record,
        classes=source.classes,
        skipped_images=source.skipped,
    )


def _validation_clients(clients: list[ClientData], pool: ImageSet, fraction: float, seed: int) -> list[ClientData]:
    """Each client with a random `fraction` of its training images (at least one, and at least MIN_CLIENT_TRAIN
    left to train on) as its test split instead, drawn from (seed, VALIDATION, client): its validation split. Its
    indices are then both into the client pool."""
    held_out = []
    for client in clients:
        size = len(client.train_indices)
        count = min(max(1, round(fraction * size)), size - MIN_CLIENT_TRAIN)
        if count < 1:
            raise DataError(
                f"--eval-split validation: client {client.client_id} has {size} training images, too few to hold "
                f"one out and keep {MIN_CLIENT_TRAIN} to train on: lower --clients or raise --limit-samples"
            )
        order = np.random.default_rng(derive_seed(seed, VALIDATION, client.client_id)).permutation(size)
        kept, validation = np.sort(client.train_indices[order[count:]]), np.sort(client.train_indices[order[:count]])
        held_out.append(ClientData(client.client_id, pool.subset(kept), pool.subset(validation), kept, validation))
    return held_out


def _client_set_sizes(scanned: ScannedSource, splits: FixedSplits, layout: str) -> tuple[int, int]:
    """How many images client train and test indices point into (see `_client_sets`), known before decoding."""
    if layout == _TRAIN_ROWS:
        return scanned.num_train, scanned.num_train
    return len(splits.pool), len(splits.test)


def _decode_used(
    scanned: ScannedSource, splits: FixedSplits, *, own_kd: bool, limited: bool
) -> tuple[SourceData, FixedSplits]:
    """The source decoded, with the fixed split's indices into what was decoded. Where --limit-samples cut the
    split and the source decodes by rows, only the rows the run uses are decoded: the validation images, the
    client pool, the test images and, when the run distills on it, the KD split (the pretraining split is never a
    client's, so it comes back empty)."""
    if not (limited and scanned.by_rows):
        return scanned.decode(Rows()), splits
    carved = scanned.num_test == 0  # sources decoded by rows carve their test images when they have none
    used = [splits.val, splits.pool, *([splits.kd] if own_kd else []), *([splits.test] if carved else [])]
    train_rows = np.unique(np.concatenate(used))
    source = scanned.decode(Rows(train=train_rows, test=None if carved else splits.test))

    def within(indices: np.ndarray) -> np.ndarray:
        return np.searchsorted(train_rows, indices).astype(np.int64)

    empty = np.empty(0, dtype=np.int64)
    test = within(splits.test) if carved else np.arange(len(splits.test), dtype=np.int64)
    kd = within(splits.kd) if own_kd else empty
    return source, FixedSplits(pretrain=empty, val=within(splits.val), kd=kd, pool=within(splits.pool), test=test)


def _client_sets(
    source: SourceData, splits: FixedSplits, layout: str
) -> tuple[ImageSet, ImageSet, np.ndarray, np.ndarray]:
    """The images that client train and test indices point into, and their rows in the source's training set
    (its test set for the test images of a source with one)."""
    if layout == _TRAIN_ROWS:
        rows = np.arange(len(source.train))
        return source.train, source.train, rows, rows
    test = (source.train if source.test is None else source.test).subset(splits.test)
    return source.train.subset(splits.pool), test, splits.pool, splits.test


def _new_parts(spec: PartitionSpec, groups: _PartitionGroups, num_clients: int, seed: int, divided: int) -> _Parts:
    """``divided``: the images the authors' code divides between the clients and the server's validation split,
    whose number sets their balance gate (N / M) for the training split."""
    rng = np.random.default_rng(seed)
    if spec.kind == "dir-balanced":
        # The PerAda authors' test split follows the training proportions, not each client's training counts.
        alpha = float(spec.value)
        return _Parts(
            *balanced_dirichlet_split(
                groups.pool, groups.test, num_clients, groups.count, alpha, rng, train_total=divided
            )
        )
    train_parts = partition_labels(groups.pool, num_clients, spec, rng)
    return _Parts(train_parts, split_test_like_train(groups.test, train_parts, groups.pool, groups.count, rng))


def _check_room(num_clients: int, pool_size: int, limit_samples: int | None) -> str:
    """Refuse more clients than the client pool holds MIN_CLIENT_TRAIN samples for; else return what to do should a
    drawn partition still leave a client short."""
    fit = pool_size // MIN_CLIENT_TRAIN
    if num_clients > fit:
        more = f", or raise --limit-samples to {num_clients * MIN_CLIENT_TRAIN} or more" if limit_samples else ""
        raise DataError(
            f"{num_clients} clients need at least {MIN_CLIENT_TRAIN} training samples each, but the client pool has "
            f"{pool_size}: use --clients {fit} or fewer{more}"
        )
    more = ", raise --limit-samples" if limit_samples else ""
    return f"lower --clients{more} or use a partition that spreads the samples more evenly (iid, a larger ALPHA)"


def _check_filled(parts: _Parts, name: str, remedy: str) -> None:
    """Every client of `parts` holds MIN_CLIENT_TRAIN training samples."""
    for client, train in enumerate(parts.train):
        if len(train) < MIN_CLIENT_TRAIN:
            raise DataError(
                f"{name} gives client {client} {len(train)} training sample(s); every client needs at least "
                f"{MIN_CLIENT_TRAIN} (BatchNorm trains on batches of {MIN_CLIENT_TRAIN} or more): {remedy}"
            )


def _check_domain_clients(dataset: str, num_clients: int) -> None:
    domains = _DOMAINS.get(dataset)
    if domains is None:
        raise ConfigError(
            f"--partition domain needs a dataset made of domains ({', '.join(_DOMAINS)}); {dataset} has none: "
            "use dir:ALPHA, iid or classes:K"
        )
    if num_clients != len(domains):
        raise ConfigError(
            f"--partition domain gives each of the {len(domains)} domains of {dataset} ({', '.join(domains)}) "
            f"to its own client: use --clients {len(domains)}, not {num_clients}"
        )


def _partition_groups(
    source: SourceData,
    spec: PartitionSpec,
    pool_rows: np.ndarray,
    test_rows: np.ndarray,
    pool: ImageSet,
    test: ImageSet,
) -> _PartitionGroups:
    grouping = source.domains if spec.kind == "domain" else source.categories
    if grouping is None:
        return _PartitionGroups("classes", pool.labels.numpy(), test.labels.numpy(), pool.num_classes)
    # Sources with groups carve their test images from the training images, which the group ids cover.
    pool_ids, test_ids = grouping.ids[pool_rows], grouping.ids[test_rows]
    return _PartitionGroups(grouping.kind, pool_ids, test_ids, len(grouping.names), grouping.names)


def _split_shares(dataset: str) -> dict[str, Fraction]:
    if source_kind(dataset) != dataset:  # imagefolder:PATH, hf:NAME
        return _GENERIC_SHARES
    shares = _SPLIT_SHARES.get(dataset)
    if shares is None:
        federable = ", ".join((*_SPLIT_SHARES, *SOURCE_PATTERNS))
        if dataset in SOURCE_NAMES:
            raise ConfigError(f"{dataset} cannot be federated (no test split); use one of {federable}")
        raise ConfigError(f"unknown dataset {dataset!r}: use one of {federable}")
    return shares


def _source_splits(source: SourceData, limit_samples: int | None) -> FixedSplits:
    num_test = 0 if source.test is None else len(source.test)
    return fixed_splits(source.name, len(source.train), num_test, limit_samples=limit_samples)


def _check_limit(limit_samples: int | None) -> None:
    if limit_samples is not None and limit_samples < 1:
        raise ConfigError(f"--limit-samples must be at least 1, got {limit_samples}")


def _head_sorted(indices: np.ndarray, limit: int | None) -> np.ndarray:
    return np.sort(indices[:limit]).astype(np.int64)


def _kd_source_name(dataset: str, kd_data: str) -> str:
    has_own_split = "kd" in _split_shares(dataset) or dataset in _UNLABELED_SPLIT
    if kd_data == "auto":
        return dataset if has_own_split else _AUTO_KD_SOURCE[dataset]
    if kd_data == dataset and not has_own_split:
        raise ConfigError(
            f"{dataset} has no unlabeled KD split: use --kd-data {_AUTO_KD_SOURCE[dataset]}, digits or auto"
        )
    if not is_source_name(kd_data):
        names = ", ".join((*SOURCE_NAMES, *SOURCE_PATTERNS))
        raise ConfigError(f"unknown --kd-data {kd_data!r}: use auto or one of {names}")
    return kd_data


def _kd_images(
    kd_source: str, source: SourceData, image_size: int, splits: FixedSplits, data: DataConfig, constants: str
) -> tuple[ImageSet, tuple[float, ...], tuple[float, ...]]:
    """The unlabeled distillation images, stored for ``image_size`` with the clients' channels, and the mean and
    std of their own source for those channels, exact or the authors' (``constants``: `normalization_statistics`):
    the source's own KD split, or another source's unlabeled data (`scan_unlabeled`: STL-10's unlabeled split, the
    training images of the others, from ``data``'s --data-dir; of image files only the --limit-samples drawn are
    decoded)."""
    if kd_source == source.name and "kd" in _split_shares(source.name):
        kd_source_data, images = source, source.train.images[splits.kd]
    else:
        try:
            # imagefolder:PATH and hf:NAME are decoded at the model's size; arrays are resized below.
            size = image_size if source_kind(kd_source) != kd_source else None
            scanned = scan_unlabeled(kd_source, data.data_dir, data.download, size, skip_bad=data.skip_bad_images)
            order = np.random.default_rng([SPLIT_SEED, _KD_STREAM]).permutation(scanned.num_train)
            chosen = _head_sorted(order, data.limit_samples)
            if scanned.by_rows and data.limit_samples is not None:
                kd_source_data = scanned.decode(Rows(train=chosen))
                images = kd_source_data.train.images
            else:
                kd_source_data = scanned.decode(Rows())
                images = kd_source_data.train.images[chosen].contiguous()
        except DataError as err:  # the default distillation data of some datasets is another dataset
            raise DataError(f"--kd-data {kd_source}: {err}; or distill on other data, e.g. --kd-data digits") from err
    channels = source.train.images.shape[1]
    kd = ImageSet(images=fit_images(images, image_size, channels), labels=None, num_classes=source.train.num_classes)
    return kd, *channel_statistics(*normalization_statistics(kd_source_data, constants), channels)


def _client_record(client: ClientData, pool_labels: np.ndarray, test_labels: np.ndarray, num_classes: int) -> dict:
    return {
        "id": client.client_id,
        "train": client.train_indices.tolist(),
        "test": client.test_indices.tolist(),
        "train_histogram": label_histograms(pool_labels, [client.train_indices], num_classes)[0],
        "test_histogram": label_histograms(test_labels, [client.test_indices], num_classes)[0],
    }


def _given_partition(
    spec: PartitionSpec, saved_partition: Any, num_clients: int, limit_samples: int | None
) -> _Given | None:
    """The partition to reuse, if any: the saved one (--resume) before a file:PATH's; checked as far as can be
    without the data."""
    if saved_partition is not None:
        given, origin = saved_partition, _SAVED
    elif spec.kind == "file":
        origin = _Origin(f"--partition {spec}", "fix the file or give another")
        given = _read_partition_file(Path(str(spec.value)), origin)
    else:
        return None
    if not isinstance(given, dict):
        raise DataError(
            f"{origin.name} is not a JSON object at the top level: give peradapt's partition.json or the PerAda "
            'authors\' {"0": [rows], ..., "-1": [rows]}'
        )
    _check_given_clients(given, origin, num_clients)
    if _layout(given) == _TRAIN_ROWS and limit_samples is not None:
        raise ConfigError(
            f"--limit-samples cannot apply to {origin.name}: its indices are rows of the whole training set; "
            "drop --limit-samples"
        )
    return _Given(given, origin)


def _read_partition_file(path: Path, origin: _Origin) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{origin.name}: no such file; give the path of a partition JSON file") from None
    except UnicodeDecodeError:
        raise DataError(f"{origin.name} is not UTF-8 text: give a partition JSON file") from None
    except OSError as err:
        raise DataError(f"{origin.name} cannot be read ({err.strerror}): give a readable partition JSON file") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"{origin.name} is not JSON ({err}): give a partition JSON file") from None


def _is_authors_layout(given: dict[str, Any]) -> bool:
    return "clients" not in given


def _layout(given: dict[str, Any]) -> str:
    return _TRAIN_ROWS if _is_authors_layout(given) else given.get("layout", _FIXED_SPLIT)


def _check_given_clients(given: dict[str, Any], origin: _Origin, num_clients: int) -> None:
    """What can be checked before loading the data: the layout, and that the file has --clients clients."""
    if _is_authors_layout(given):
        if origin is _SAVED:  # peradapt writes its own layout only
            raise DataError(f'{origin.name} is malformed (no "clients" list): {origin.remedy}')
        _check_authors_keys(given, origin, num_clients)
        return
    if not isinstance(given["clients"], list):
        raise DataError(f'{origin.name} is malformed (its "clients" is not a list): {origin.remedy}')
    if _layout(given) not in (_FIXED_SPLIT, _TRAIN_ROWS):
        raise DataError(
            f"{origin.name} has layout {_layout(given)!r}, not {_FIXED_SPLIT} or {_TRAIN_ROWS}: {origin.remedy}"
        )
    if len(given["clients"]) != num_clients:
        count = len(given["clients"])
        raise DataError(f"{origin.name} has {count} clients, but --clients is {num_clients}: use --clients {count}")


def _check_authors_keys(given: dict[str, Any], origin: _Origin, num_clients: int) -> None:
    client_keys = [key for key in given if key != _AUTHORS_VAL_KEY]
    count = len(client_keys)
    if set(client_keys) == {str(client) for client in range(count)}:
        if count != num_clients:
            raise DataError(
                f"{origin.name} lists {count} clients, but --clients is {num_clients}: use --clients {count}"
            )
        return
    layouts = (
        f'the PerAda authors\' layout has keys "0".."{num_clients - 1}" for --clients {num_clients} '
        f'(and "-1" for the server\'s validation rows); peradapt\'s partition.json has a "clients" list'
    )
    expected = {str(client) for client in range(num_clients)}
    unexpected = next((key for key in client_keys if key not in expected), None)
    if unexpected is not None:
        raise DataError(f"{origin.name} has key {unexpected!r}: {layouts}")
    missing = next(client for client in range(num_clients) if str(client) not in given)
    raise DataError(f'{origin.name} has no key "{missing}": {layouts}')


def _authors_record(
    given: dict[str, Any], origin: _Origin, num_clients: int, seed: int, fixed_val: np.ndarray
) -> dict[str, Any]:
    """A train-rows record from the PerAda authors' partition file (datasets/chexpert.py,
    get_non_iid_data_train_test_val): {"0": rows, ..., "M-1": rows, "-1": the server's validation rows}.

    Client i's rows lose a seeded 10% to its local test split (`split_off_test`, clients in order, one
    Generator of ``seed``); without "-1" the server validates on the fixed split's validation rows, which no
    client may list. Ranges and repeats are checked with the record (`_given_parts`).
    """
    listed = [_index_array(given[str(client)], f"client {client}'s list", origin) for client in range(num_clients)]
    empty = next((client for client, rows in enumerate(listed) if not rows.size), None)
    if empty is not None:
        raise DataError(f"{origin.name} lists no rows for client {empty}: give every client some")
    if _AUTHORS_VAL_KEY not in given:
        _check_apart_from_fixed_val(listed, fixed_val, origin)
    rng = np.random.default_rng(seed)
    # The authors' code takes the CSV rows at the drawn positions inside a client's list, not the rows that the
    # list names (so every client gets rows from the head of train.csv); we use the listed rows.
    parts = [split_off_test(rows, _AUTHORS_TEST_SHARE, rng) for rows in listed]
    return {
        "layout": _TRAIN_ROWS,
        "val": given.get(_AUTHORS_VAL_KEY, fixed_val.tolist()),
        "clients": [
            {"id": client, "train": train.tolist(), "test": test.tolist()} for client, (train, test) in enumerate(parts)
        ],
    }


def _check_apart_from_fixed_val(listed: list[np.ndarray], fixed_val: np.ndarray, origin: _Origin) -> None:
    for client, rows in enumerate(listed):
        clash = np.intersect1d(rows, fixed_val)
        if clash.size:
            raise DataError(
                f'{origin.name} has no "-1" list, so the server validates on the fixed split\'s validation rows, '
                f'but client {client} lists row {clash[0]} of them: add a "-1" list or leave those rows out'
            )


def _reserved_rows(splits: FixedSplits, *, own_kd: bool) -> list[tuple[str, np.ndarray]]:
    """Training rows that a train-rows partition must leave alone: those the backbone may be pretrained on, and the
    unlabeled KD split when the run distills on it."""
    reserved = [("the pretraining split (never given to clients)", splits.pretrain)]
    return [*reserved, ("the unlabeled KD split", splits.kd)] if own_kd else reserved


def _given_parts(
    given: dict[str, Any],
    origin: _Origin,
    dataset: str,
    num_clients: int,
    pool_size: int,
    test_size: int,
    reserved: list[tuple[str, np.ndarray]],
) -> _Parts:
    """The client index lists of a given partition record, after checking they fit this data (a train-rows
    record's lists and validation rows must not meet each other or ``reserved`` either)."""
    expected = {"dataset": dataset, "pool_size": pool_size, "test_size": test_size}
    for key, value in expected.items():
        if key in given and given[key] != value and origin is _SAVED and key != "dataset":
            # --resume holds --data and --limit-samples to the run's: the files themselves changed
            raise DataError(
                f"the images of --data {dataset} changed since this run started: {origin.name} was made for "
                f"{key} {given[key]}, and the data has {value} now (files added or removed): put the files back "
                f"as they were, or {origin.remedy}"
            )
        if key in given and given[key] != value:
            raise DataError(
                f"{origin.name} was made for {key} {given[key]!r}, but this data has {value!r} "
                "(use the --data and --limit-samples it was made with)"
            )
    try:
        train_lists = _client_lists(given["clients"], "train", origin)
        test_lists = _client_lists(given["clients"], "test", origin)
        val = _index_array(given["val"], 'the "val" list', origin) if _layout(given) == _TRAIN_ROWS else None
    except (KeyError, TypeError) as err:
        raise DataError(f"{origin.name} is malformed ({err!r}): {origin.remedy}") from None
    if val is None:
        _check_indices(train_lists, pool_size, "client-pool", origin)
        _check_indices(test_lists, test_size, "test-set", origin)
    else:  # all are rows of one training set, so no row may come twice
        lists = [*train_lists, *test_lists, ("the server's validation rows", val), *reserved]
        _check_indices(lists, pool_size, "training-set", origin)
    return _Parts([part for _, part in train_lists], [part for _, part in test_lists], val)


def _client_lists(clients: list[Any], key: str, origin: _Origin) -> list[tuple[str, np.ndarray]]:
    """Each client's ``key`` list of indices, named for error messages."""
    return [
        (f"client {client}", _index_array(entry[key], f"client {client}'s {key} list", origin))
        for client, entry in enumerate(clients)
    ]


def _index_array(values: Any, owner: str, origin: _Origin) -> np.ndarray:
    """``values``, a JSON list of whole numbers, as int64."""
    if not isinstance(values, list):
        raise DataError(f"{origin.name}: {owner} is not a list of indices: {origin.remedy}")
    # bool is an int to Python, but not an index to anyone.
    bad = next((value for value in values if type(value) is not int), None)
    if bad is not None:
        raise DataError(f"{origin.name}: {owner} holds {bad!r}, not a whole-number index: {origin.remedy}")
    try:
        return np.array(values, dtype=np.int64)
    except OverflowError:
        raise DataError(f"{origin.name}: {owner} holds an index beyond any dataset: {origin.remedy}") from None


def _check_indices(lists: list[tuple[str, np.ndarray]], size: int, space: str, origin: _Origin) -> None:
    """Every index in 0..size-1, and none in two lists or twice in one; errors name the lists."""
    for owner, indices in lists:
        outside = indices[(indices < 0) | (indices >= size)]
        if outside.size:
            raise DataError(
                f"{origin.name} gives {owner} {space} index {outside[0]}, outside 0..{size - 1}: {origin.remedy}"
            )
    every = np.concatenate([indices for _, indices in lists])
    owner_of = np.repeat(np.arange(len(lists)), [len(indices) for _, indices in lists])
    order = np.argsort(every, kind="stable")
    repeats = np.flatnonzero(np.diff(every[order]) == 0)
    if repeats.size:
        first, second = (lists[owner_of[order[repeats[0] + step]]][0] for step in (0, 1))
        places = f"twice to {first}" if first == second else f"to both {first} and {second}"
        raise DataError(f"{origin.name} gives {space} sample {every[order[repeats[0]]]} {places}: {origin.remedy}")
