"""The PerAda authors' partitions: ``--partition dir-balanced:ALPHA`` and ``--partition file:PATH`` (peradapt's own
partition.json, or the authors' {"0": rows, ..., "-1": rows} layout), on label arrays and a synthetic
Fashion-MNIST stand-in."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from peradapt.config import DataConfig
from peradapt.data import (
    FederatedData,
    PartitionSpec,
    build_federation,
    fixed_splits,
    label_histograms,
    load_source,
    parse_partition,
    partition_labels,
)
from peradapt.data.partition import balanced_dirichlet_split
from peradapt.errors import ConfigError, DataError

from .conftest import write_fmnist_like

NUM_TRAIN, NUM_TEST = 1800, 600  # the stand-in's sizes; its fixed split: 600 pretrain, 150 val, 300 KD, 750 pool


def uneven_labels(count: int, num_classes: int = 10, seed: int = 0) -> np.ndarray:
    """Labels whose classes range from rare to three times as common, so that the balance gate has work to do."""
    weights = np.linspace(1, 3, num_classes)
    return np.random.default_rng(seed).choice(num_classes, count, p=weights / weights.sum())


# ---------------------------------------------------------------- the authors' rule, written out independently


def reference_parts(labels: np.ndarray, proportions: np.ndarray, rng: np.random.Generator) -> tuple[list, bool]:
    """The authors' dir split as described, loop by loop: a reserve of 2 per class per client, then each class cut
    by its proportions among the clients still under N/M. Also says whether a class found every client with room
    holding an exact zero proportion (then those clients share it evenly)."""
    num_classes, num_clients = proportions.shape
    total = len(labels)
    reserved: list[list[int]] = [[] for _ in range(num_clients)]
    for label in range(num_classes):
        members = np.array([index for index in range(total) if labels[index] == label])
        chosen = rng.choice(members, 2 * num_clients, replace=False)
        for client in range(num_clients):
            reserved[client] += [int(chosen[2 * client]), int(chosen[2 * client + 1])]
    taken = {index for client in reserved for index in client}
    divided: list[list[int]] = [[] for _ in range(num_clients)]
    all_closed_at_zero = False
    for label in range(num_classes):
        rest = np.array([index for index in range(total) if labels[index] == label and index not in taken])
        rest = rng.permutation(rest)
        open_clients = [len(divided[client]) < total / num_clients for client in range(num_clients)]
        shares = np.array(
            [share if open_ else 0.0 for share, open_ in zip(proportions[label], open_clients, strict=True)]
        )
        if shares.sum() == 0:
            all_closed_at_zero = True
            shares = np.array([1.0 if open_ else 0.0 for open_ in open_clients])
        shares = shares / shares.sum()
        last_with_share = max(client for client in range(num_clients) if shares[client] > 0)
        start, cumulative = 0, 0.0
        for client in range(num_clients):
            cumulative += shares[client]
            end = len(rest) if client >= last_with_share else int(np.floor(cumulative * len(rest)))
            divided[client] += rest[start:end].tolist()
            start = end
    return [sorted(divided[client] + reserved[client]) for client in range(num_clients)], all_closed_at_zero


def reference_split(
    train_labels: np.ndarray, test_labels: np.ndarray, num_clients: int, num_classes: int, alpha: float, seed: int
) -> tuple[list, list, bool]:
    rng = np.random.default_rng(seed)
    proportions = rng.dirichlet([alpha] * num_clients, size=num_classes)  # drawn once, for train and test
    train, train_zero = reference_parts(train_labels, proportions, rng)
    test, test_zero = reference_parts(test_labels, proportions, rng)
    return train, test, train_zero or test_zero


# ---------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("dir-balanced:0.3", PartitionSpec("dir-balanced", 0.3)),
        ("DIR-Balanced:1", PartitionSpec("dir-balanced", 1.0)),
        ("file:/Data/CheXpert Partition.json", PartitionSpec("file", "/Data/CheXpert Partition.json")),
        ("File:rel/p.json", PartitionSpec("file", "rel/p.json")),
    ],
)
def test_parse_partition_accepts_the_authors_kinds_and_keeps_the_path(text: str, expected: PartitionSpec) -> None:
    spec = parse_partition(text)
    assert spec == expected
    assert parse_partition(str(spec)) == spec


@pytest.mark.parametrize("text", ["dir-balanced", "dir-balanced:0", "dir-balanced:-2", "dir-balanced:inf", "file:"])
def test_parse_partition_lists_every_form(text: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_partition(text)
    message = str(caught.value)
    for form in ("dir:ALPHA", "iid", "classes:K", "domain", "dir-balanced:ALPHA", "file:PATH"):
        assert form in message
    assert "\n" not in message


# ---------------------------------------------------------------- dir-balanced on label arrays


@pytest.mark.parametrize(
    ("alpha", "seed", "num_clients"),
    # alpha 0.001, seed 0 reaches a class whose clients with room all drew an exact zero proportion.
    [(0.3, 0, 7), (0.1, 1, 8), (10.0, 2, 5), (0.001, 0, 8)],
)
def test_dir_balanced_matches_the_authors_rule_written_out(alpha: float, seed: int, num_clients: int) -> None:
    train_labels, test_labels = uneven_labels(3000, seed=seed), uneven_labels(800, seed=seed + 100)
    train, test = balanced_dirichlet_split(
        train_labels, test_labels, num_clients, 10, alpha, np.random.default_rng(seed)
    )
    expected_train, expected_test, all_closed_at_zero = reference_split(
        train_labels, test_labels, num_clients, 10, alpha, seed
    )
    assert [part.tolist() for part in train] == expected_train  # each list sorted
    assert [part.tolist() for part in test] == expected_test
    assert all_closed_at_zero == (alpha == 0.001)
    # partition_labels draws the proportions, then the training parts, from its generator the same way.
    alone = partition_labels(
        train_labels, num_clients, PartitionSpec("dir-balanced", alpha), np.random.default_rng(seed)
    )
    assert [part.tolist() for part in alone] == expected_train


def test_dir_balanced_reserves_every_class_and_stops_clients_at_an_even_share() -> None:
    labels, test_labels = uneven_labels(5000, seed=3), uneven_labels(1500, seed=4)
    num_clients = 8
    train, test = balanced_dirichlet_split(labels, test_labels, num_clients, 10, 0.1, np.random.default_rng(3))
    for parts, these in ((train, labels), (test, test_labels)):
        np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(len(these)))  # each sample once
        histograms = np.array(label_histograms(these, parts, 10))
        assert histograms.min() >= 2
        # Past the reserve, a client takes nothing more once it holds N/M: it only crosses within one class.
        divided = np.cumsum(histograms - 2, axis=1)
        crossed = divided * num_clients >= len(these)
        grew_after = (histograms[:, 1:] - 2 > 0) & crossed[:, :-1]
        assert not grew_after.any()
        assert crossed[:, :-1].any()  # the gate did close on someone before the last class
    # The plain Dirichlet split of the same labels leaves clients without some classes.
    plain = partition_labels(labels, num_clients, parse_partition("dir:0.1"), np.random.default_rng(3))
    assert (np.array(label_histograms(labels, plain, 10)) == 0).any()


def test_dir_balanced_refuses_a_class_too_small_for_the_reserve() -> None:
    labels = np.repeat(np.arange(4), [30, 20, 30, 30])
    without_class_0 = labels[labels != 0]
    with pytest.raises(DataError, match=r"class 0 has 0 in the test set \(needs 8\): lower --clients or use dir:ALPHA"):
        balanced_dirichlet_split(labels, without_class_0, 4, 4, 0.5, np.random.default_rng(0))
    with pytest.raises(
        DataError,
        match=r"each of the 11 clients 2 samples of every class, but class 1 has 20 in the "
        r"client pool \(needs 22\)",
    ) as caught:
        balanced_dirichlet_split(labels, labels, 11, 4, 0.5, np.random.default_rng(0))
    assert "\n" not in str(caught.value)


# ---------------------------------------------------------------- federations of the Fashion-MNIST stand-in


@pytest.fixture(scope="module")
def fmnist_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fmnist_like(tmp_path_factory.mktemp("fmnist-authors"), NUM_TRAIN, NUM_TEST)


@pytest.fixture(scope="module")
def splits():
    return fixed_splits("fmnist", NUM_TRAIN, NUM_TEST, limit_samples=None)


def federate(fmnist_dir: Path, partition: str, limit_samples: int | None = None, **options: Any) -> FederatedData:
    data = DataConfig("fmnist", fmnist_dir, partition=partition, limit_samples=limit_samples)
    return build_federation(data, **{"num_clients": 3, "seed": 0, **options})


def assert_same_clients(first: FederatedData, second: FederatedData) -> None:
    for before, after in zip(first.clients, second.clients, strict=True):
        np.testing.assert_array_equal(before.train_indices, after.train_indices)
        np.testing.assert_array_equal(before.test_indices, after.test_indices)
        assert torch.equal(before.train.images, after.train.images)
    assert torch.equal(first.val.images, second.val.images)
    assert torch.equal(first.global_test.labels, second.global_test.labels)


def test_dir_balanced_federation_splits_test_with_the_training_proportions(fmnist_dir: Path, splits) -> None:
    fed = federate(fmnist_dir, "dir-balanced:0.3", seed=4)
    source = load_source("fmnist", fmnist_dir)
    pool_labels = source.train.labels.numpy()[splits.pool]
    test_labels = source.test.labels.numpy()[splits.test]
    expected_train, expected_test, _ = reference_split(pool_labels, test_labels, 3, 10, 0.3, 4)
    assert [client.train_indices.tolist() for client in fed.clients] == expected_train
    assert [client.test_indices.tolist() for client in fed.clients] == expected_test
    assert min(min(c["train_histogram"]) for c in fed.partition["clients"]) >= 2
    assert min(min(c["test_histogram"]) for c in fed.partition["clients"]) >= 2
    assert fed.partition["spec"] == "dir-balanced:0.3" and fed.partition["layout"] == "fixed-split"
    again = federate(fmnist_dir, "iid", seed=9, saved_partition=json.loads(json.dumps(fed.partition)))
    assert again.partition == fed.partition
    assert_same_clients(fed, again)
    with pytest.raises(DataError, match="lower --clients or use dir:ALPHA"):
        federate(fmnist_dir, "dir-balanced:0.3", num_clients=40)


def write_json(path: Path, content: Any) -> Path:
    path.write_text(json.dumps(content))
    return path


def test_file_in_peradapt_layout_gives_the_listed_indices(fmnist_dir: Path, tmp_path: Path) -> None:
    made = federate(fmnist_dir, "dir:0.5", seed=1, limit_samples=400)
    path = write_json(tmp_path / "partition.json", made.partition)
    fed = federate(fmnist_dir, f"file:{path}", seed=7, limit_samples=400)
    assert_same_clients(made, fed)
    assert fed.partition["spec"] == f"file:{path}" and fed.partition["seed"] == 1
    resumed = federate(fmnist_dir, f"file:{path}", seed=3, limit_samples=400, saved_partition=fed.partition)
    assert resumed.partition == fed.partition
    with pytest.raises(DataError, match="was made for pool_size 400, but this data has 750"):
        federate(fmnist_dir, f"file:{path}")


def authors_mapping(splits, *, with_val: bool = True) -> dict[str, list[int]]:
    """Rows of the whole training set for 3 clients (and the server), none in the pretraining or KD split."""
    free = np.setdiff1d(np.arange(NUM_TRAIN), np.concatenate([splits.pretrain, splits.kd]))
    if not with_val:
        free = np.setdiff1d(free, splits.val)
    rows = np.random.default_rng(11).permutation(free).tolist()
    mapping = {"0": rows[:95], "1": rows[95:255], "2": rows[255:300]}
    return {**mapping, "-1": rows[300:360]} if with_val else mapping


def test_file_in_the_authors_layout_splits_each_client_90_10(fmnist_dir: Path, tmp_path: Path, splits) -> None:
    mapping = authors_mapping(splits)
    path = write_json(tmp_path / "chexpert_partition_0.3.json", mapping)
    fed = federate(fmnist_dir, f"file:{path}", seed=5)
    source = load_source("fmnist", fmnist_dir)
    rng = np.random.default_rng(5)
    for client in fed.clients:
        rows = np.array(mapping[str(client.client_id)])
        test = np.sort(rows[rng.choice(len(rows), len(rows) // 10, replace=False)])
        np.testing.assert_array_equal(client.test_indices, test)
        np.testing.assert_array_equal(client.train_indices, np.setdiff1d(rows, test))
        assert torch.equal(client.train.images, source.train.images[client.train_indices])  # rows, not positions
        assert torch.equal(client.test.labels, source.train.labels[client.test_indices])
    assert [(len(c.train), len(c.test)) for c in fed.clients] == [(86, 9), (144, 16), (41, 4)]
    assert torch.equal(fed.val.images, source.train.images[mapping["-1"]])
    every_test = np.sort(np.concatenate([client.test_indices for client in fed.clients]))
    assert torch.equal(fed.global_test.images, source.train.images[every_test])
    assert len(fed.kd) == len(splits.kd) and fed.kd.labels is None

    record = fed.partition
    assert (record["spec"], record["seed"], record["layout"]) == (f"file:{path}", 5, "train-rows")
    assert (record["pool_size"], record["test_size"], record["val"]) == (NUM_TRAIN, NUM_TRAIN, mapping["-1"])
    path.unlink()  # --resume needs only partition.json
    resumed = federate(fmnist_dir, f"file:{path}", seed=8, saved_partition=json.loads(json.dumps(record)))
    assert resumed.partition == record
    assert_same_clients(fed, resumed)
    with pytest.raises(ConfigError, match="--limit-samples cannot apply to the saved partition"):
        federate(fmnist_dir, f"file:{path}", limit_samples=100, saved_partition=record)


def test_authors_file_without_a_validation_list_uses_the_fixed_one(fmnist_dir, tmp_path, splits) -> None:
    path = write_json(tmp_path / "p.json", authors_mapping(splits, with_val=False))
    fed = federate(fmnist_dir, f"file:{path}")
    source = load_source("fmnist", fmnist_dir)
    assert torch.equal(fed.val.images, source.train.images[splits.val])
    assert fed.partition["val"] == splits.val.tolist()
    clashing = authors_mapping(splits, with_val=False)
    clashing["1"].append(int(splits.val[3]))
    path = write_json(tmp_path / "clash.json", clashing)
    with pytest.raises(DataError, match=rf'no "-1" list.*client 1 lists row {splits.val[3]} of them: add a "-1"'):
        federate(fmnist_dir, f"file:{path}")


def test_authors_file_refuses_limit_samples(fmnist_dir: Path, tmp_path: Path, splits) -> None:
    path = write_json(tmp_path / "p.json", authors_mapping(splits))
    with pytest.raises(ConfigError, match=r"--limit-samples cannot apply to --partition file:.*drop --limit-samples"):
        federate(fmnist_dir, f"file:{path}", limit_samples=300)


def changed(splits, change) -> dict[str, Any]:
    mapping = authors_mapping(splits)
    change(mapping)
    return mapping


BAD_AUTHORS_FILES = [
    (lambda s: changed(s, lambda m: m.update(x=[1])), "has key 'x'"),
    (lambda s: changed(s, lambda m: m.pop("1")), 'has no key "1"'),
    (lambda s: changed(s, lambda m: m.update({"3": [1]})), "lists 4 clients, but --clients is 3: use --clients 4"),
    (lambda s: changed(s, lambda m: m["2"].append(2.5)), "client 2's list holds 2.5, not a whole-number index"),
    (lambda s: changed(s, lambda m: m["0"].append("7")), "client 0's list holds '7', not a whole-number index"),
    (lambda s: changed(s, lambda m: m["0"].append(True)), "client 0's list holds True"),
    (lambda s: changed(s, lambda m: m.update({"1": 5})), "client 1's list is not a list of indices"),
    (lambda s: changed(s, lambda m: m.update({"1": []})), "lists no rows for client 1"),
    (
        lambda s: changed(s, lambda m: m["1"].append(NUM_TRAIN)),
        rf"gives client 1 training-set index {NUM_TRAIN}, outside 0\.\.{NUM_TRAIN - 1}",
    ),
    (lambda s: changed(s, lambda m: m["2"].append(m["0"][0])), "to both client 0 and client 2"),
    (lambda s: changed(s, lambda m: m["-1"].append(m["1"][0])), "to both client 1 and the server's validation rows"),
    (lambda s: changed(s, lambda m: m["1"].append(int(s.pretrain[0]))), "to both client 1 and the pretraining split"),
    (lambda s: changed(s, lambda m: m["0"].append(int(s.kd[0]))), "to both client 0 and the unlabeled KD split"),
    (lambda s: [1, 2], "is not a JSON object at the top level"),
]


@pytest.mark.parametrize(("content", "message"), BAD_AUTHORS_FILES)
def test_bad_authors_files_are_one_line_errors(fmnist_dir, tmp_path, splits, content, message) -> None:
    path = write_json(tmp_path / "bad.json", content(splits))
    with pytest.raises(DataError, match=message) as caught:
        federate(fmnist_dir, f"file:{path}")
    assert f"--partition file:{path}" in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("raw", "message"),
    [(None, "no such file"), (b"\xff\xfe{}", "is not UTF-8"), (b'{"0": [1,', "is not JSON")],
)
def test_unreadable_partition_files_are_one_line_errors(fmnist_dir, tmp_path, raw, message) -> None:
    path = tmp_path / "partition.json"
    if raw is not None:
        path.write_bytes(raw)
    with pytest.raises(DataError, match=message) as caught:
        federate(fmnist_dir, f"file:{path}")
    assert "\n" not in str(caught.value)


@pytest.fixture(scope="module")
def peradapt_record(fmnist_dir: Path) -> dict[str, Any]:
    return federate(fmnist_dir, "dir:1", seed=2).partition


def edited(record: dict[str, Any], change) -> dict[str, Any]:
    copy = json.loads(json.dumps(record))
    change(copy)
    return copy


BAD_PERADAPT_FILES = [
    (lambda r: edited(r, lambda c: c["clients"].pop()), "has 2 clients, but --clients is 3: use --clients 2"),
    (lambda r: edited(r, lambda c: c["clients"][1]["train"].append(1.5)), "client 1's train list holds 1.5"),
    (lambda r: edited(r, lambda c: c["clients"][2]["test"].append(600)), r"client 2 test-set index 600, outside"),
    (
        lambda r: edited(r, lambda c: c["clients"][0]["train"].append(c["clients"][2]["train"][0])),
        "to both client 0 and client 2",
    ),
    (lambda r: edited(r, lambda c: c.update(dataset="cifar10")), "was made for dataset 'cifar10'"),
    (lambda r: edited(r, lambda c: c.update(layout="mine")), "has layout 'mine', not fixed-split or train-rows"),
    (lambda r: edited(r, lambda c: c.update(clients={})), '"clients" is not a list'),
]


@pytest.mark.parametrize(("content", "message"), BAD_PERADAPT_FILES)
def test_bad_peradapt_files_are_one_line_errors(fmnist_dir, tmp_path, peradapt_record, content, message) -> None:
    path = write_json(tmp_path / "bad.json", content(peradapt_record))
    with pytest.raises(DataError, match=message) as caught:
        federate(fmnist_dir, f"file:{path}")
    assert "\n" not in str(caught.value)
