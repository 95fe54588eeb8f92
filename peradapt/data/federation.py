"""The federated view of one dataset: fixed source splits, client partitions, server and KD data."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from peradapt.data.images import ImageSet, SourceData, fit_images
from peradapt.data.officehome import DOMAINS as OFFICE_HOME_DOMAINS
from peradapt.data.partition import (
    PartitionSpec,
    label_histograms,
    parse_partition,
    partition_labels,
    split_test_like_train,
)
from peradapt.data.sources import SOURCE_NAMES, load_source
from peradapt.errors import ConfigError, DataError

# Fixed, and independent of --seed: `pretrain` and every `train --seed S` must agree on which training
# images were pretrained on, so that those never reach a client.
SPLIT_SEED = 20_240_611

# Shares of a source's training images set aside before the client pool (which gets the rest); a "test" share
# carves the test images of a source without a test set of its own.
# Fashion-MNIST: 20k pretrain / 5k server validation / 10k unlabeled KD / 25k pool of its 60k;
# CIFAR: the paper's 9:1 pool/validation split. Office-Home and CheXpert: the proportions of PerAda's Table 6
# (test 1656 and validation 1391 of 15,588; validation 22,342 and test 20,099 of 223,414).
_SPLIT_SHARES: dict[str, dict[str, Fraction]] = {
    "fmnist": {"pretrain": Fraction(1, 3), "val": Fraction(1, 12), "kd": Fraction(1, 6)},
    "cifar10": {"val": Fraction(1, 10)},
    "cifar100": {"val": Fraction(1, 10)},
    "office-home": {"val": Fraction(9, 100), "test": Fraction(1, 10)},
    "chexpert": {"val": Fraction(1, 10), "test": Fraction(9, 100)},
}
# The paper distills CIFAR-10 models on CIFAR-100, and the others (CIFAR-100, Office-Home, CheXpert) on CIFAR-10.
_AUTO_KD_SOURCE = {"cifar10": "cifar100", "cifar100": "cifar10", "office-home": "cifar10", "chexpert": "cifar10"}
# What --partition domain gives out, one domain per client; known before loading, to check --clients early.
_DOMAINS = {"office-home": OFFICE_HOME_DOMAINS}
# Independent random streams under SPLIT_SEED, one per thing they choose.
_TRAIN_STREAM, _TEST_STREAM, _KD_STREAM = 0, 1, 2


@dataclass(frozen=True)
class ClientData:
    client_id: int
    train: ImageSet
    test: ImageSet
    train_indices: np.ndarray  # into the dataset's client pool
    test_indices: np.ndarray  # into the (limited) test set


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
    global_test: ImageSet  # union of all clients' test splits
    partition: dict[str, Any]  # JSON-ready record of the partition, as written to partition.json


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
    """The split of ``dataset`` under SPLIT_SEED; ``limit_samples`` cuts every part to a random subset."""
    shares = _split_shares(dataset)
    carved = "test" in shares
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
    dataset: str,
    data_dir: Path | str | None,
    *,
    num_clients: int,
    partition: str,
    seed: int,
    kd_data: str = "auto",
    limit_samples: int | None = None,
    image_size: int | None = None,
    download: bool = False,
    saved_partition: dict[str, Any] | None = None,
) -> FederatedData:
    """Load ``dataset`` and divide its client pool among ``num_clients`` clients.

    ``image_size`` is the model's input size (default: see ``load_source``). ``saved_partition`` (a previous
    ``FederatedData.partition``) is reused instead of partitioning anew.
    """
    spec = parse_partition(partition)
    _check_limit(limit_samples)
    if num_clients < 1:
        raise ConfigError(f"--clients must be at least 1, got {num_clients}")
    kd_source = _kd_source_name(dataset, kd_data)
    if spec.kind == "domain":
        _check_domain_clients(dataset, num_clients)
    source = load_source(dataset, data_dir, download, image_size)
    image_size = image_size or source.train.images.shape[-1]
    splits = _source_splits(source, limit_samples)
    pool = source.train.subset(splits.pool)
    test = (source.train if source.test is None else source.test).subset(splits.test)
    if len(pool) < num_clients:
        raise DataError(
            f"{num_clients} clients need at least {num_clients} samples; the pool has {len(pool)} "
            "(raise --limit-samples or lower --clients)"
        )
    groups = _partition_groups(source, spec, splits, pool, test)
    pool_labels, test_labels = groups.pool, groups.test
    if saved_partition is None:
        rng = np.random.default_rng(seed)
        train_parts = partition_labels(pool_labels, num_clients, spec, rng)
        test_parts = split_test_like_train(test_labels, train_parts, pool_labels, groups.count, rng)
        spec_text, partition_seed = str(spec), seed
    else:
        # --resume: the saved record wins over the flags, so the clients keep their data.
        train_parts, test_parts = _saved_parts(saved_partition, dataset, num_clients, len(pool), len(test))
        spec_text, partition_seed = saved_partition.get("spec", str(spec)), saved_partition.get("seed", seed)
    clients = [
        ClientData(client, pool.subset(train_part), test.subset(test_part), train_part, test_part)
        for client, (train_part, test_part) in enumerate(zip(train_parts, test_parts, strict=True))
    ]
    record = {
        "spec": spec_text,
        "seed": partition_seed,
        "dataset": dataset,
        "num_clients": num_clients,
        "pool_size": len(pool),
        "test_size": len(test),
        "histograms_of": groups.kind,
        **({"groups": list(groups.names)} if groups.names else {}),
        "clients": [_client_record(client, pool_labels, test_labels, groups.count) for client in clients],
    }
    return FederatedData(
        dataset=dataset,
        num_classes=pool.num_classes,
        channels=source.train.images.shape[1],
        image_size=image_size,
        mean=source.mean,
        std=source.std,
        clients=clients,
        val=source.train.subset(splits.val),
        kd=_kd_images(kd_source, source, image_size, splits, data_dir, download, limit_samples),
        global_test=test.subset(np.sort(np.concatenate(test_parts))),
        partition=record,
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
    source: SourceData, spec: PartitionSpec, splits: FixedSplits, pool: ImageSet, test: ImageSet
) -> _PartitionGroups:
    grouping = source.domains if spec.kind == "domain" else source.categories
    if grouping is None:
        return _PartitionGroups("classes", pool.labels.numpy(), test.labels.numpy(), pool.num_classes)
    # Sources with groups carve their test images from the training images, which the group ids cover.
    pool_ids, test_ids = grouping.ids[splits.pool], grouping.ids[splits.test]
    return _PartitionGroups(grouping.kind, pool_ids, test_ids, len(grouping.names), grouping.names)


def _split_shares(dataset: str) -> dict[str, Fraction]:
    shares = _SPLIT_SHARES.get(dataset)
    if shares is None:
        if dataset in SOURCE_NAMES:
            raise ConfigError(f"{dataset} cannot be federated (no test split); use one of {', '.join(_SPLIT_SHARES)}")
        raise ConfigError(f"unknown dataset {dataset!r}: use one of {', '.join(_SPLIT_SHARES)}")
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
    has_own_split = "kd" in _split_shares(dataset)
    if kd_data == "auto":
        return dataset if has_own_split else _AUTO_KD_SOURCE[dataset]
    if kd_data == dataset and not has_own_split:
        raise ConfigError(
            f"{dataset} has no unlabeled KD split: use --kd-data {_AUTO_KD_SOURCE[dataset]}, digits or auto"
        )
    if kd_data not in SOURCE_NAMES:
        raise ConfigError(f"unknown --kd-data {kd_data!r}: use auto or one of {', '.join(SOURCE_NAMES)}")
    return kd_data


def _kd_images(
    kd_source: str,
    source: SourceData,
    image_size: int,
    splits: FixedSplits,
    data_dir: Path | str | None,
    download: bool,
    limit_samples: int | None,
) -> ImageSet:
    if kd_source == source.name:
        images = source.train.images[splits.kd]
    else:
        try:
            other = load_source(kd_source, data_dir, download).train
        except DataError as err:  # the default distillation data of some datasets is another dataset
            raise DataError(f"--kd-data {kd_source}: {err}; or distill on other data, e.g. --kd-data digits") from err
        order = np.random.default_rng([SPLIT_SEED, _KD_STREAM]).permutation(len(other))
        images = other.images[_head_sorted(order, limit_samples)]
    channels = source.train.images.shape[1]
    return ImageSet(images=fit_images(images, image_size, channels), labels=None, num_classes=source.train.num_classes)


def _client_record(client: ClientData, pool_labels: np.ndarray, test_labels: np.ndarray, num_classes: int) -> dict:
    return {
        "id": client.client_id,
        "train": client.train_indices.tolist(),
        "test": client.test_indices.tolist(),
        "train_histogram": label_histograms(pool_labels, [client.train_indices], num_classes)[0],
        "test_histogram": label_histograms(test_labels, [client.test_indices], num_classes)[0],
    }


def _saved_parts(
    saved: dict[str, Any], dataset: str, num_clients: int, pool_size: int, test_size: int
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The client index lists of a saved partition, after checking they fit this data."""
    expected = {"dataset": dataset, "pool_size": pool_size, "test_size": test_size}
    for key, value in expected.items():
        if key in saved and saved[key] != value:
            raise DataError(
                f"the saved partition was made for {key} {saved[key]!r}, but this data has {value!r} "
                "(use the run's original --data and --limit-samples)"
            )
    try:
        clients = saved["clients"]
        train_parts = [np.asarray(client["train"], dtype=np.int64) for client in clients]
        test_parts = [np.asarray(client["test"], dtype=np.int64) for client in clients]
    except (KeyError, TypeError, ValueError) as err:
        raise DataError(f"the saved partition is malformed ({err!r}); delete partition.json to start anew") from err
    if len(clients) != num_clients:
        raise DataError(f"the saved partition has {len(clients)} clients, but --clients is {num_clients}")
    _check_saved_indices(train_parts, pool_size, "train")
    _check_saved_indices(test_parts, test_size, "test")
    return train_parts, test_parts


def _check_saved_indices(parts: list[np.ndarray], size: int, kind: str) -> None:
    every = np.concatenate(parts) if parts else np.empty(0, np.int64)
    if every.size and (every.min() < 0 or every.max() >= size):
        raise DataError(f"the saved partition has {kind} indices outside 0..{size - 1}: it belongs to other data")
    if len(np.unique(every)) != len(every):
        raise DataError(f"the saved partition gives some {kind} samples to more than one client")
