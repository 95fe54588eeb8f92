"""Tests for peradapt.data: sources, fixed splits, client partitions, federations and batching."""

from __future__ import annotations

import gzip
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision

from peradapt.config import DataConfig
from peradapt.data import (
    SOURCE_NAMES,
    ImageSet,
    PartitionSpec,
    build_federation,
    fit_images,
    fixed_splits,
    iterate_minibatches,
    label_histograms,
    load_source,
    parse_partition,
    partition_labels,
    pretraining_split,
    random_crop_flip,
    resize_images,
    sources,
    split_test_like_train,
    to_model_input,
)
from peradapt.errors import ConfigError, DataError

from .conftest import idx_bytes

HAS_DEBIAN_FMNIST = (sources.DEBIAN_FMNIST_DIR / "train-images-idx3-ubyte.gz").is_file()
needs_fmnist = pytest.mark.skipif(not HAS_DEBIAN_FMNIST, reason="needs `apt-get install dataset-fashion-mnist`")


def skewed_labels(num_samples: int = 3000, num_classes: int = 10, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, num_classes, num_samples)


# ---------------------------------------------------------------- partition specs


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("dir:0.1", PartitionSpec("dir", 0.1)),
        ("DIR:10", PartitionSpec("dir", 10.0)),
        ("iid", PartitionSpec("iid")),
        ("classes:2", PartitionSpec("classes", 2)),
        ("domain", PartitionSpec("domain")),
    ],
)
def test_parse_partition_accepts_the_four_kinds(text: str, expected: PartitionSpec) -> None:
    spec = parse_partition(text)
    assert spec == expected
    assert parse_partition(str(spec)) == spec


@pytest.mark.parametrize(
    "text",
    ["xyz", "dir", "dir:", "dir:0", "dir:-1", "dir:nan", "dir:inf", "classes:0", "classes:1.5", "iid:3"],
)
def test_parse_partition_rejects_bad_specs(text: str) -> None:
    with pytest.raises(ConfigError, match=r"use dir:ALPHA \(e\.g\. dir:0\.1\), iid, classes:K or domain") as caught:
        parse_partition(text)
    assert f"bad --partition {text!r}" in str(caught.value)


# ---------------------------------------------------------------- partitions


@pytest.mark.parametrize("spec", ["dir:0.1", "dir:10", "iid", "classes:1", "classes:2", "classes:3"])
def test_every_sample_goes_to_exactly_one_client(spec: str) -> None:
    labels = skewed_labels()
    parts = partition_labels(labels, 7, parse_partition(spec), np.random.default_rng(1))
    assert len(parts) == 7
    assert all(len(part) > 0 and np.all(np.diff(part) > 0) for part in parts)
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(len(labels)))


def test_dirichlet_gives_every_client_the_minimum() -> None:
    parts = partition_labels(skewed_labels(), 20, parse_partition("dir:0.1"), np.random.default_rng(3), 25)
    assert min(len(part) for part in parts) >= 25


def test_label_skew_grows_as_alpha_falls() -> None:
    labels = skewed_labels(5000)

    def mean_max_class_share(alpha: float) -> float:
        shares = []
        for seed in range(3):
            parts = partition_labels(labels, 20, PartitionSpec("dir", alpha), np.random.default_rng(seed))
            shares += [max(hist) / sum(hist) for hist in label_histograms(labels, parts, 10)]
        return float(np.mean(shares))

    skews = [mean_max_class_share(alpha) for alpha in (10.0, 1.0, 0.1)]
    assert skews[0] < skews[1] < skews[2]
    assert skews[0] < 0.25 and skews[2] > 0.6


def test_classes_k_limits_the_classes_per_client() -> None:
    labels = skewed_labels()
    parts = partition_labels(labels, 5, parse_partition("classes:2"), np.random.default_rng(0))
    held = [set(labels[part].tolist()) for part in parts]
    assert all(len(classes) == 2 for classes in held)
    # 5 clients × 2 classes cover all 10 classes once, so each class stays whole.
    assert set().union(*held) == set(range(10))


def test_classes_k_still_assigns_classes_nobody_drew() -> None:
    labels = skewed_labels()
    parts = partition_labels(labels, 3, parse_partition("classes:1"), np.random.default_rng(0))
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(len(labels)))
    assert max(len(set(labels[part].tolist())) for part in parts) <= 4


def test_partition_is_deterministic_under_a_seed() -> None:
    labels = skewed_labels()
    first = partition_labels(labels, 6, parse_partition("dir:0.3"), np.random.default_rng(42))
    again = partition_labels(labels, 6, parse_partition("dir:0.3"), np.random.default_rng(42))
    other = partition_labels(labels, 6, parse_partition("dir:0.3"), np.random.default_rng(43))
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other, strict=True))


def test_partition_rejects_impossible_requests() -> None:
    labels = skewed_labels(50)
    with pytest.raises(ConfigError, match="at least 1"):
        partition_labels(labels, 0, parse_partition("iid"), np.random.default_rng(0))
    with pytest.raises(DataError, match="60 clients need at least 60 samples; there are 50"):
        partition_labels(labels, 60, parse_partition("iid"), np.random.default_rng(0))
    with pytest.raises(DataError, match="lower --clients or raise alpha"):
        partition_labels(skewed_labels(2000), 50, parse_partition("dir:0.001"), np.random.default_rng(0))


def test_test_split_mirrors_the_training_distribution() -> None:
    train_labels, test_labels = skewed_labels(4000, seed=1), skewed_labels(1000, seed=2)
    rng = np.random.default_rng(5)
    train_parts = partition_labels(train_labels, 8, parse_partition("dir:0.3"), rng)
    test_parts = split_test_like_train(test_labels, train_parts, train_labels, 10, rng)

    every = np.concatenate(test_parts)
    assert len(np.unique(every)) == len(every)  # disjoint
    np.testing.assert_array_equal(np.sort(every), np.arange(len(test_labels)))  # every class has a holder
    train_hist = np.array(label_histograms(train_labels, train_parts, 10))
    test_hist = np.array(label_histograms(test_labels, test_parts, 10))
    test_class_sizes = np.bincount(test_labels, minlength=10)
    expected = test_class_sizes * train_hist / train_hist.sum(axis=0)
    assert np.all(np.abs(test_hist - expected) < 1)  # largest-remainder rounding is off by less than one
    assert np.all(test_hist[train_hist == 0] == 0)


def test_test_split_skips_classes_nobody_trains_on() -> None:
    train_labels = np.array([0, 0, 1, 1])
    test_labels = np.array([0, 1, 2, 2, 0])
    test_parts = split_test_like_train(
        test_labels, [np.array([0, 1]), np.array([2, 3])], train_labels, 3, np.random.default_rng(0)
    )
    assert [part.tolist() for part in test_parts] == [[0, 4], [1]]


def test_label_histograms_are_plain_ints() -> None:
    hists = label_histograms(np.array([0, 1, 1, 2]), [np.array([0, 1]), np.array([2, 3])], 4)
    assert hists == [[1, 1, 0, 0], [0, 1, 1, 0]]
    assert all(type(count) is int for hist in hists for count in hist)


# ---------------------------------------------------------------- Fashion-MNIST IDX files


def write_idx_dir(directory: Path, *, gz: bool, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (12, 5, 5)),
        "train-labels-idx1-ubyte": rng.integers(0, 10, 12),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (6, 5, 5)),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, 6),
    }
    directory.mkdir(parents=True, exist_ok=True)
    for stem, array in arrays.items():
        if gz:
            (directory / f"{stem}.gz").write_bytes(gzip.compress(idx_bytes(array)))
        else:
            (directory / stem).write_bytes(idx_bytes(array))
    return arrays


@pytest.fixture
def no_debian_fmnist(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(sources, "DEBIAN_FMNIST_DIR", tmp_path / "not-installed")


@pytest.mark.usefixtures("no_debian_fmnist")
@pytest.mark.parametrize("gz", [True, False])
@pytest.mark.parametrize("layout", [".", "FashionMNIST/raw"])
def test_fmnist_reads_idx_files(tmp_path: Path, gz: bool, layout: str) -> None:
    arrays = write_idx_dir(tmp_path / "data" / layout, gz=gz)
    source = load_source("fmnist", tmp_path / "data")
    assert source.train.images.shape == (12, 1, 5, 5) and source.train.images.dtype == torch.uint8
    assert source.test.images.shape == (6, 1, 5, 5)
    np.testing.assert_array_equal(source.train.images[:, 0].numpy(), arrays["train-images-idx3-ubyte"])
    np.testing.assert_array_equal(source.test.labels.numpy(), arrays["t10k-labels-idx1-ubyte"])
    assert source.train.labels.dtype == torch.int64 and source.train.num_classes == 10
    assert source.mean == (0.2860,) and source.std == (0.3530,)


@pytest.mark.usefixtures("no_debian_fmnist")
@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda raw: raw[:-7], "is corrupt"),
        (lambda raw: b"\x00\x00\x0c\x03" + raw[4:], "bad magic number"),
        (lambda raw: gzip.compress(raw)[:40], "cannot read"),
    ],
)
def test_corrupt_idx_file_is_a_data_error_naming_it(tmp_path: Path, damage, message: str) -> None:
    write_idx_dir(tmp_path, gz=False)
    broken = tmp_path / "train-images-idx3-ubyte"
    damaged = damage(broken.read_bytes())
    if damaged[:2] == b"\x1f\x8b":  # gzip magic: the damaged copy must carry the .gz name to be unpacked
        broken.unlink()
        broken = broken.with_suffix(".gz")
    broken.write_bytes(damaged)
    with pytest.raises(DataError, match=message) as caught:
        load_source("fmnist", tmp_path)
    assert str(broken) in str(caught.value)


@pytest.mark.usefixtures("no_debian_fmnist")
def test_missing_fmnist_says_where_it_looked_and_how_to_get_it(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError) as caught:
        load_source("fmnist", empty)
    message = str(caught.value)
    for hint in (
        str(empty),
        str(sources.DEBIAN_FMNIST_DIR),
        "apt-get install dataset-fashion-mnist",
        "--data-dir",
    ):
        assert hint in message
    assert "--download" in message and "train-images-idx3-ubyte[.gz]" in message


def test_unknown_source_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="fmnist, cifar10, cifar100, digits, svhn, stl10, office-home, chexpert"):
        load_source("mnist", None)
    assert SOURCE_NAMES == ("fmnist", "cifar10", "cifar100", "digits", "svhn", "stl10", "office-home", "chexpert")


# ---------------------------------------------------------------- CIFAR on-disk layout


def write_cifar(root: Path, name: str, seed: int = 0, num_train: int = 30, num_test: int = 12) -> dict[str, np.ndarray]:
    """A tiny copy of torchvision's pickled CIFAR layout: 30 training and 12 test images by default."""
    rng = np.random.default_rng(seed)
    if name == "cifar10":
        folder, label_key, files = "cifar-10-batches-py", "labels", [f"data_batch_{i}" for i in range(1, 6)]
        test_file, meta_file, meta = (
            "test_batch",
            "batches.meta",
            {"label_names": [str(i) for i in range(10)]},
        )
        num_classes = 10
    else:
        folder, label_key, files = "cifar-100-python", "fine_labels", ["train"]
        test_file, meta_file, meta = "test", "meta", {"fine_label_names": [str(i) for i in range(100)]}
        num_classes = 100
    (root / folder).mkdir(parents=True)
    written: dict[str, list[np.ndarray]] = {"train": [], "test": []}
    per_file = num_train // len(files)
    for split, names, count in (("train", files, per_file), ("test", [test_file], num_test)):
        for file_name in names:
            data = rng.integers(0, 256, (count, 3072), dtype=np.uint8)
            labels = rng.integers(0, num_classes, count)
            with open(root / folder / file_name, "wb") as handle:
                pickle.dump({"data": data, label_key: labels.tolist()}, handle)
            written[split].append(data)
    with open(root / folder / meta_file, "wb") as handle:
        pickle.dump(meta, handle)
    return {split: np.concatenate(chunks) for split, chunks in written.items()}


@pytest.fixture
def skip_cifar_md5(monkeypatch: pytest.MonkeyPatch) -> None:
    # Fixtures cannot match the real md5 sums; batch and meta files are both checked through this function.
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *args, **kwargs: True)


@pytest.mark.usefixtures("skip_cifar_md5")
@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_loads_the_pickled_layout(tmp_path: Path, name: str) -> None:
    written = write_cifar(tmp_path, name)
    source = load_source(name, tmp_path)
    assert source.train.images.shape == (30, 3, 32, 32) and source.test.images.shape == (12, 3, 32, 32)
    # The pickles hold planes R, G, B of 32×32 each: CHW order after reshaping.
    np.testing.assert_array_equal(source.train.images.numpy(), written["train"].reshape(30, 3, 32, 32))
    assert source.train.num_classes == (10 if name == "cifar10" else 100)
    assert len(source.mean) == len(source.std) == 3


def test_cifar_missing_says_where_the_files_must_be(tmp_path: Path) -> None:
    with pytest.raises(DataError) as caught:
        load_source("cifar10", tmp_path)
    assert f"no cifar-10-batches-py/ in {tmp_path}" in str(caught.value) and "--download" in str(caught.value)
    with pytest.raises(DataError, match="--data-dir"):
        load_source("cifar100", None)


def test_cifar_keeps_the_md5_check_for_real_data(tmp_path: Path) -> None:
    write_cifar(tmp_path, "cifar10")
    with pytest.raises(DataError, match="not found or corrupted"):
        load_source("cifar10", tmp_path)


@pytest.mark.usefixtures("skip_cifar_md5")
def test_cifar_federation_distills_on_the_other_cifar(tmp_path: Path) -> None:
    write_cifar(tmp_path, "cifar10", seed=1)
    write_cifar(tmp_path, "cifar100", seed=2)
    fed = build_federation(DataConfig("cifar10", tmp_path, partition="iid"), num_clients=3, seed=0)
    assert (fed.num_classes, fed.channels, fed.image_size) == (10, 3, 32)
    assert len(fed.val) == 3 and sum(len(client.train) for client in fed.clients) == 27
    assert fed.kd.labels is None and fed.kd.images.shape == (30, 3, 32, 32)
    digits_kd = build_federation(
        DataConfig("cifar10", tmp_path, partition="iid", kd_data="digits"), num_clients=3, seed=0
    )
    assert digits_kd.kd.images.shape == (1797, 3, 8, 8)  # stored as small as they come, in the run's channels
    assert digits_kd.image_size == 32
    with pytest.raises(ConfigError, match="no unlabeled KD split"):
        build_federation(DataConfig("cifar10", tmp_path, partition="iid", kd_data="cifar10"), num_clients=3, seed=0)
    with pytest.raises(DataError, match="no pretraining split: pass --weights FILE"):
        pretraining_split("cifar10", tmp_path, limit_samples=None)


# ---------------------------------------------------------------- digits and resizing


def test_digits_are_real_uint8_images() -> None:
    source = load_source("digits", None)
    assert source.train.images.shape == (1797, 1, 8, 8) and source.train.images.dtype == torch.uint8
    assert int(source.train.images.min()) == 0 and int(source.train.images.max()) == 255
    assert sorted(source.train.labels.unique().tolist()) == list(range(10))
    assert source.test is None
    assert 0.2 < source.mean[0] < 0.4 and 0.3 < source.std[0] < 0.5


def test_resize_converts_size_and_channels() -> None:
    grey = torch.full((2, 1, 8, 8), 200, dtype=torch.uint8)
    colour = resize_images(grey, 28, 3)
    assert colour.shape == (2, 3, 28, 28) and colour.dtype == torch.uint8
    assert torch.all(colour == 200)  # a flat image stays flat through the resize
    red = torch.zeros((1, 3, 4, 4), dtype=torch.uint8)
    red[:, 0] = 255
    assert torch.all(resize_images(red, 4, 1) == round(0.299 * 255))
    with pytest.raises(ConfigError):
        resize_images(red, 4, 2)


def test_images_are_stored_no_larger_than_the_model_takes_them() -> None:
    """Larger images are resized for storage, smaller ones keep their size (and bytes) and get the channels."""
    images = torch.randint(0, 256, (3, 1, 12, 12), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(fit_images(images, 8, 3), resize_images(images, 8, 3))
    kept = fit_images(images, 224, 3)
    assert kept.shape == (3, 3, 12, 12) and torch.equal(kept, images.expand(-1, 3, -1, -1))
    assert fit_images(images, 12, 1) is images


def test_model_input_scales_small_images_as_stored_resizing_would() -> None:
    """The model sees a 12 px set at 28 px as if it had been resized up front, bar the rounding of stored bytes."""
    images = torch.randint(0, 256, (4, 3, 12, 12), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    scaled = to_model_input(images, mean, std, "cpu", size=28)
    stored = to_model_input(resize_images(images, 28, 3), mean, std, "cpu")
    assert scaled.shape == (4, 3, 28, 28) and scaled.is_contiguous(memory_format=torch.channels_last)
    half_a_byte = 0.5 / 255 / min(std)
    torch.testing.assert_close(scaled, stored, rtol=0, atol=half_a_byte * 1.001)
    assert torch.equal(to_model_input(images, mean, std, "cpu", size=12), to_model_input(images, mean, std, "cpu"))


@pytest.mark.usefixtures("skip_cifar_md5")
def test_cifar_for_a_224_px_model_is_stored_at_32_px(tmp_path: Path) -> None:
    """A ViT's 224 px: the run's image size says 224, the stored images keep CIFAR's 32 px (49x fewer bytes)."""
    write_cifar(tmp_path, "cifar10", seed=1)
    write_cifar(tmp_path, "cifar100", seed=2)
    fed = build_federation(DataConfig("cifar10", tmp_path, partition="iid", image_size=224), num_clients=3, seed=0)
    assert fed.image_size == 224
    stored = [fed.val, fed.kd, fed.global_test, *(client.train for client in fed.clients)]
    assert all(part.images.shape[1:] == (3, 32, 32) for part in stored)
    smaller = build_federation(DataConfig("cifar10", tmp_path, partition="iid", image_size=16), num_clients=3, seed=0)
    assert smaller.image_size == 16 and smaller.kd.images.shape[1:] == (3, 16, 16)


def test_image_set_subset_keeps_labels_aligned() -> None:
    images = torch.arange(5, dtype=torch.uint8).view(5, 1, 1, 1).expand(5, 1, 2, 2).contiguous()
    subset = ImageSet(images, torch.arange(5), 5).subset([4, 1])
    assert len(subset) == 2 and subset.labels.tolist() == [4, 1] and subset.images[:, 0, 0, 0].tolist() == [4, 1]
    assert ImageSet(images, None, 5).subset(torch.tensor([0])).labels is None


# ---------------------------------------------------------------- the Fashion-MNIST federation


@pytest.fixture(scope="module")
def fmnist_federation():
    return build_federation(DataConfig("fmnist", partition="dir:0.5", limit_samples=600), num_clients=5, seed=0)


@needs_fmnist
def test_fixed_splits_never_share_an_image() -> None:
    for limit in (None, 600):
        splits = fixed_splits("fmnist", 60_000, 10_000, limit_samples=limit)
        parts = [splits.pretrain, splits.val, splits.kd, splits.pool]
        every = np.concatenate(parts)
        assert len(np.unique(every)) == len(every)
    full = fixed_splits("fmnist", 60_000, 10_000, limit_samples=None)
    assert [len(full.pretrain), len(full.val), len(full.kd), len(full.pool)] == [
        20_000,
        5_000,
        10_000,
        25_000,
    ]
    limited = fixed_splits("fmnist", 60_000, 10_000, limit_samples=600)
    # A limit only thins each part: pretraining on all of it never touches a limited run's pool.
    assert not set(full.pretrain.tolist()) & set(limited.pool.tolist())
    assert set(limited.pool.tolist()) <= set(full.pool.tolist())


@needs_fmnist
def test_fmnist_federation_uses_the_pool_only(fmnist_federation) -> None:
    fed = fmnist_federation
    source = load_source("fmnist", None)
    splits = fixed_splits("fmnist", 60_000, 10_000, limit_samples=600)
    assert (fed.num_classes, fed.channels, fed.image_size) == (10, 1, 28)
    assert len(fed.clients) == 5 and len(fed.val) == 600 and len(fed.kd) == 600 and fed.kd.labels is None

    pool_positions = np.concatenate([client.train_indices for client in fed.clients])
    np.testing.assert_array_equal(np.sort(pool_positions), np.arange(600))
    for client in fed.clients:
        source_rows = splits.pool[client.train_indices]
        assert torch.equal(client.train.images, source.train.images[source_rows])
        assert not set(source_rows.tolist()) & set(splits.pretrain.tolist())

    pretrain, _ = pretraining_split("fmnist", None, limit_samples=600)
    assert torch.equal(pretrain.images, source.train.images[splits.pretrain])
    assert torch.equal(fed.val.images, source.train.images[splits.val])


@needs_fmnist
def test_global_test_is_the_union_of_client_tests(fmnist_federation) -> None:
    fed = fmnist_federation
    every = np.concatenate([client.test_indices for client in fed.clients])
    assert len(np.unique(every)) == len(every)
    assert len(fed.global_test) == len(every) > 590
    expected = torch.cat([client.test.labels for client in fed.clients]).bincount(minlength=10)
    assert torch.equal(fed.global_test.labels.bincount(minlength=10), expected)


@needs_fmnist
def test_saved_partition_round_trip_gives_identical_clients(fmnist_federation) -> None:
    fed = fmnist_federation
    saved = json.loads(json.dumps(fed.partition))
    assert saved["spec"] == "dir:0.5" and saved["num_clients"] == 5
    for record, client in zip(saved["clients"], fed.clients, strict=True):
        assert record["train_histogram"] == client.train.labels.bincount(minlength=10).tolist()
        assert record["test_histogram"] == client.test.labels.bincount(minlength=10).tolist()
    # A different seed and spec must not matter: the saved partition is reused as it is.
    iid = DataConfig("fmnist", partition="iid", limit_samples=600)
    again = build_federation(iid, num_clients=5, seed=9, saved_partition=saved)
    assert again.partition == fed.partition
    for before, after in zip(fed.clients, again.clients, strict=True):
        assert torch.equal(before.train.images, after.train.images)
        assert torch.equal(before.test.labels, after.test.labels)

    with pytest.raises(DataError, match="--clients is 4"):
        build_federation(iid, num_clients=4, seed=0, saved_partition=saved)
    saved["clients"][0]["train"].append(600)
    saved.pop("pool_size")
    with pytest.raises(DataError, match="outside"):
        build_federation(iid, num_clients=5, seed=0, saved_partition=saved)


@needs_fmnist
def test_fmnist_federation_errors_and_kd_choices() -> None:
    with pytest.raises(DataError, match=r"5 clients need at least 5 samples; the pool has 3 \(raise --limit-samples"):
        build_federation(DataConfig("fmnist", partition="iid", limit_samples=3), num_clients=5, seed=0)
    digits = build_federation(
        DataConfig("fmnist", partition="iid", kd_data="digits", limit_samples=50), num_clients=2, seed=0
    )
    assert digits.kd.images.shape == (50, 1, 8, 8) and digits.image_size == 28  # scaled up batch by batch
    with pytest.raises(ConfigError, match="unknown --kd-data"):
        build_federation(DataConfig("fmnist", partition="iid", kd_data="imagenet"), num_clients=2, seed=0)
    with pytest.raises(ConfigError, match="cannot be federated"):
        build_federation(DataConfig("digits", partition="iid"), num_clients=2, seed=0)


# ---------------------------------------------------------------- batches


def test_to_model_input_normalizes() -> None:
    images = torch.tensor([0, 51, 255], dtype=torch.uint8).view(1, 1, 1, 3)
    result = to_model_input(images, (0.2,), (0.5,), "cpu")
    assert result.dtype == torch.float32
    torch.testing.assert_close(result.flatten(), torch.tensor([-0.4, 0.0, 1.6]))


def test_to_model_input_is_channels_last() -> None:
    images = torch.randint(0, 256, (2, 3, 4, 5), dtype=torch.uint8)
    result = to_model_input(images, (0.2, 0.3, 0.4), (0.5, 0.5, 0.5), "cpu")
    assert result.is_contiguous(memory_format=torch.channels_last)
    expected = (images.float() / 255 - torch.tensor([0.2, 0.3, 0.4]).view(1, 3, 1, 1)) / 0.5
    torch.testing.assert_close(result, expected)


def test_iterate_minibatches_covers_every_index_once() -> None:
    generator = torch.Generator().manual_seed(0)
    batches = list(iterate_minibatches(10, 4, generator))
    assert [len(batch) for batch in batches] == [4, 4, 2]
    assert sorted(torch.cat(batches).tolist()) == list(range(10))
    assert [len(batch) for batch in iterate_minibatches(10, 4, generator, drop_last=True)] == [4, 4]
    ordered = list(iterate_minibatches(5, 2, generator, shuffle=False))
    assert [batch.tolist() for batch in ordered] == [[0, 1], [2, 3, 4]]  # no lone sample for BatchNorm
    assert [len(batch) for batch in iterate_minibatches(9, 4, generator)] == [4, 5]
    assert [len(batch) for batch in iterate_minibatches(1, 4, generator)] == [1]


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_random_crop_flip_keeps_shape_and_is_seeded(dtype: torch.dtype) -> None:
    images = torch.randint(1, 256, (16, 3, 8, 8), generator=torch.Generator().manual_seed(0)).to(dtype)
    first = random_crop_flip(images, torch.Generator().manual_seed(7))
    again = random_crop_flip(images, torch.Generator().manual_seed(7))
    assert first.shape == images.shape and first.dtype == dtype
    assert torch.equal(first, again)
    assert not torch.equal(first, images)


def test_random_crop_flip_crops_and_flips() -> None:
    images = torch.randint(1, 256, (64, 1, 6, 6), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    flipped_only = random_crop_flip(images, torch.Generator().manual_seed(1), padding=0)
    is_flip = [torch.equal(out, img.flip(-1)) for out, img in zip(flipped_only, images, strict=True)]
    is_same = [torch.equal(out, img) for out, img in zip(flipped_only, images, strict=True)]
    assert all(a or b for a, b in zip(is_flip, is_same, strict=True)) and any(is_flip) and any(is_same)
    # With padding, shifted crops bring in zero borders (the images themselves have no zeros).
    cropped = random_crop_flip(images, torch.Generator().manual_seed(1), padding=2)
    assert (cropped == 0).any()
