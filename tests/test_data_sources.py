"""Any image-classification data (issue 17): imagefolder:PATH, hf:NAME (Hugging Face `datasets`), svhn and stl10,
as --data, --kd-data, `eval --ood` and `personalize --new-client`: decoded once into uint8 tensors equal to the
source images, cached, split by the fixed seed, columns detected or named, every mistake one error line."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from peradapt.config import DataConfig
from peradapt.data import build_federation, fixed_splits, load_source, load_unlabeled
from peradapt.data import decode as decode_module
from peradapt.data.hfdata import INSTALL_HINT
from peradapt.data.ood import OodTarget, load_ood
from peradapt.data.sources import SourceSpec
from peradapt.errors import ConfigError, DataError

from .conftest import TINY_BACKBONE
from .test_cli import crash_after_round, expect_refusal, run_cli

datasets = pytest.importorskip("datasets")

pytestmark = pytest.mark.usefixtures("one_thread")

CLASSES = ("cat", "dog", "emu")  # sorted: the class indices
PER_CLASS = 16
SIDE = 16


def picture(label: int, index: int, grey: bool) -> np.ndarray:
    """A 16 px image whose class shows in its stripes, different in every image."""
    rng = np.random.default_rng([label, index, int(grey)])
    stripes = (np.arange(SIDE)[None, :] % (label + 2)) < 1
    base = rng.integers(0, 80, (SIDE, SIDE)) + 150 * stripes
    if grey:
        return base.clip(0, 255).astype(np.uint8)
    return np.stack([base, base[::-1], base.T], axis=-1).clip(0, 255).astype(np.uint8)


def write_folder(root: Path, per_class: int = PER_CLASS, grey: bool = True, classes=CLASSES) -> Path:
    for label, name in enumerate(classes):
        (root / name).mkdir(parents=True, exist_ok=True)
        for index in range(per_class):
            Image.fromarray(picture(label, index, grey)).save(root / name / f"{index:03d}.png")
    return root


def hf_dataset(rows: int, *, image: str = "picture", label: str = "kind", grey: bool = False):
    """A `datasets.Dataset` with an Image feature and a ClassLabel, ``rows`` rows cycling through the classes."""
    features = datasets.Features({image: datasets.Image(), label: datasets.ClassLabel(names=list(CLASSES))})
    images = [Image.fromarray(picture(i % 3, i, grey)) for i in range(rows)]
    return datasets.Dataset.from_dict({image: images, label: [i % 3 for i in range(rows)]}, features=features)


@pytest.fixture(autouse=True)
def quiet_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`datasets` caches local parquet and folders under the test's directory, and never reaches for the Hub."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


@pytest.fixture
def weights(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The tiny grey backbone pretrained on Fashion-MNIST, with PERADAPT_HOME (decode cache, pins) of this test."""
    path = home / "backbones" / f"fmnist-{TINY_BACKBONE}.safetensors"
    monkeypatch.setenv("PERADAPT_HOME", str(tmp_path / "home"))
    return path


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PERADAPT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_folder(tmp_path_factory.mktemp("imagefolder") / "pets")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pair") / "pair"
    write_folder(root / "train", per_class=6)
    write_folder(root / "test", per_class=2, classes=CLASSES[:2])  # a class without test images is fine
    return root


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """save_to_disk of train (36 rows) and test (12 rows) splits, RGB."""
    path = tmp_path_factory.mktemp("hf") / "saved"
    datasets.DatasetDict(train=hf_dataset(36), test=hf_dataset(12)).save_to_disk(str(path))
    return path


@pytest.fixture(scope="module")
def parquet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One parquet file (one split: its test split is carved) with a string label column and another Image name."""
    path = tmp_path_factory.mktemp("parquet") / "zoo.parquet"
    data = hf_dataset(45, image="photo", label="kind")
    data = data.add_column("species", [CLASSES[k] for k in data["kind"]]).remove_columns("kind")
    data.to_parquet(str(path))
    return path


def write_svhn(directory: Path, counts=(30, 12)) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    from scipy.io import savemat

    directory.mkdir(parents=True, exist_ok=True)
    written = {}
    for (split, count), seed in zip(zip(("train", "test"), counts, strict=True), (0, 1), strict=True):
        rng = np.random.default_rng(seed)
        images = rng.integers(0, 256, (count, 32, 32, 3), dtype=np.uint8)  # N, H, W, C
        labels = np.arange(count) % 10 + 1  # 1..10, 10 being the digit 0
        savemat(directory / f"{split}_32x32.mat", {"X": images.transpose(1, 2, 3, 0), "y": labels[:, None]})
        written[split] = (images, labels % 10)
    return written


def write_stl10(directory: Path, counts=(30, 12, 20)) -> dict[str, tuple[np.ndarray, np.ndarray | None]]:
    folder = directory / "stl10_binary"
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for (split, count), seed in zip(zip(("train", "test", "unlabeled"), counts, strict=True), range(3), strict=True):
        rng = np.random.default_rng(seed)
        images = rng.integers(0, 256, (count, 3, 96, 96), dtype=np.uint8)  # N, C, H, W
        # Stored as the binary files are: each channel column-major.
        images.transpose(0, 1, 3, 2).tofile(folder / f"{split}_X.bin")
        labels = None
        if split != "unlabeled":
            labels = np.arange(count) % 10
            (labels + 1).astype(np.uint8).tofile(folder / f"{split}_y.bin")
        written[split] = (images, labels)
    (folder / "class_names.txt").write_text(
        "\n".join(("airplane", "bird", "car", "cat", "deer", "dog", "horse", "monkey", "ship", "truck"))
    )
    return written


@pytest.fixture(scope="module")
def torchvision_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict]:
    directory = tmp_path_factory.mktemp("torchvision")
    return directory, write_svhn(directory), write_stl10(directory)


def counting_decodes(monkeypatch: pytest.MonkeyPatch) -> list:
    decoded: list = []
    decode_file = decode_module._decode_file

    def counting(picture, **options):
        decoded.append(picture)
        return decode_file(picture, **options)

    monkeypatch.setattr(decode_module, "_decode_file", counting)
    return decoded


def train_args(data: str, out: Path, weights: Path, *extra: str) -> list[str]:
    return [
        "train",
        *("--data", data, "--backbone", TINY_BACKBONE, "--weights", str(weights), "--image-size", str(SIDE)),
        *("--clients", "2", "--clients-per-round", "2", "--rounds", "1", "--partition", "iid"),
        *("--local-epochs", "1", "--personal-epochs", "1", "--batch-size", "8", "--lr", "0.05"),
        *("--kd-steps", "2", "--kd-batch-size", "16", "--eval-every", "0", "--device", "cpu", "--out", str(out)),
        *extra,
    ]


def written_images(root: Path) -> list[np.ndarray]:
    return [np.asarray(Image.open(p)) for c in sorted(root.iterdir()) for p in sorted(c.iterdir())]


# ---------------------------------------------------------------- imagefolder:PATH


def test_imagefolder_is_decoded_once_to_the_pixels_of_its_files(folder, cache_home, monkeypatch):
    decoded = counting_decodes(monkeypatch)
    source = load_source(f"imagefolder:{folder}", None)
    count = len(CLASSES) * PER_CLASS
    # Grey 16 px squares stay grey and 16 px; sorted class folders give the indices.
    assert source.train.images.shape == (count, 1, SIDE, SIDE) and source.test is None
    assert source.classes == CLASSES and source.train.num_classes == 3
    assert source.train.labels.tolist() == [label for label in range(3) for _ in range(PER_CLASS)]
    expected = np.stack(written_images(folder))[:, None]
    np.testing.assert_array_equal(source.train.images.numpy(), expected)
    assert len(decoded) == count and len(list((cache_home / "cache").glob("imagefolder-native-*.npy"))) == 1

    again = load_source(f"imagefolder:{folder}", None)  # the cache serves it: nothing decoded
    assert len(decoded) == count and torch.equal(again.train.images, source.train.images)
    load_source(f"imagefolder:{folder}", None, image_size=8, channels=3)  # another size: another entry
    assert len(decoded) == 2 * count

    changed = write_folder(cache_home.parent / "changed", per_class=4)
    load_source(f"imagefolder:{changed}", None)
    image = changed / "dog" / "001.png"
    Image.fromarray(np.zeros((SIDE, SIDE), dtype=np.uint8)).save(image)
    stat = image.stat()
    os.utime(image, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a changed file: decoded again
    before = len(decoded)
    reread = load_source(f"imagefolder:{changed}", None)
    assert len(decoded) == before + 12 and reread.train.images[5].sum() == 0


def test_imagefolder_splits_one_folder_by_the_fixed_seed_and_keeps_a_pair(folder, pair, cache_home):
    count = len(CLASSES) * PER_CLASS
    splits = fixed_splits(f"imagefolder:{folder}", count, 0, limit_samples=None)
    # 1/10 validation, 1/10 unlabeled KD, 1/5 test carved (no test folder), the rest the client pool.
    assert (len(splits.val), len(splits.kd), len(splits.test), len(splits.pretrain)) == (4, 4, 9, 0)
    parts = [splits.val, splits.kd, splits.test, splits.pool]
    assert sorted(np.concatenate(parts).tolist()) == list(range(count))
    assert fixed_splits(f"imagefolder:{folder}", count, 0, limit_samples=None).test.tolist() == splits.test.tolist()

    source = load_source(f"imagefolder:{pair}", None)
    assert len(source.train) == 18 and len(source.test) == 4 and source.classes == CLASSES
    assert source.test.labels.tolist() == [0, 0, 1, 1]
    np.testing.assert_array_equal(source.test.images[:, 0].numpy(), np.stack(written_images(pair / "test")))
    fed = build_federation(DataConfig(f"imagefolder:{pair}", partition="iid", kd_data="auto"), num_clients=2, seed=0)
    assert len(fed.global_test) == 4 and len(fed.val) == 1 and len(fed.kd) == 1 and fed.classes == CLASSES

    unlabeled = load_unlabeled(f"imagefolder:{pair}", None)  # as --kd-data: every training image, no labels
    assert unlabeled.train.labels is None and len(unlabeled.train) == 18


# ---------------------------------------------------------------- hf:NAME


def test_hf_save_to_disk_and_parquet_are_decoded_once_with_their_splits(
    saved, parquet, folder, cache_home, monkeypatch
):
    decoded = counting_decodes(monkeypatch)
    source = load_source(f"hf:{saved}", None)
    assert source.train.images.shape == (36, 3, SIDE, SIDE) and source.test.images.shape == (12, 3, SIDE, SIDE)
    assert source.classes == CLASSES and source.train.labels.tolist() == [i % 3 for i in range(36)]
    expected = np.stack([picture(i % 3, i, False) for i in range(36)]).transpose(0, 3, 1, 2)
    np.testing.assert_array_equal(source.train.images.numpy(), expected)
    assert len(decoded) == 48
    assert torch.equal(load_source(f"hf:{saved}", None).test.images, source.test.images) and len(decoded) == 48

    # One parquet file: no test split (carved); a string label column named with --label-column, sorted names.
    with pytest.raises(DataError, match=r"no label column .*--label-column"):
        load_source(f"hf:{parquet}", None)
    zoo = load_source(f"hf:{parquet}", None, image_size=8, channels=1, label_column="species")
    assert zoo.train.images.shape == (45, 1, 8, 8) and zoo.test is None and zoo.classes == CLASSES
    assert zoo.train.labels.tolist() == [i % 3 for i in range(45)]
    fed = build_federation(DataConfig(f"hf:{parquet}", partition="iid", label_column="species"), num_clients=2, seed=0)
    assert len(fed.global_test) == 9 and fed.num_classes == 3  # 1/5 of 45 carved

    # As --kd-data: the training split's images, at the run's size and channels, without labels.
    kd = f"hf:{saved}"
    fed = build_federation(
        DataConfig(f"imagefolder:{folder}", partition="iid", kd_data=kd, image_size=8), num_clients=2, seed=0
    )
    assert fed.kd.images.shape == (36, 1, 8, 8) and fed.kd.labels is None


def test_hf_columns_are_detected_or_named(tmp_path, cache_home):
    def saved_as(name: str, data) -> str:
        data.save_to_disk(str(tmp_path / name))
        return f"hf:{tmp_path / name}"

    # Two ClassLabels (CIFAR-100's fine and coarse labels): fine_label wins; an int column "label" without one.
    two = hf_dataset(9, image="img", label="fine_label")
    two = two.add_column("coarse_label", [0] * 9).cast_column("coarse_label", datasets.ClassLabel(names=["x"]))
    assert load_source(saved_as("two", two), None).classes == CLASSES
    plain = datasets.Dataset.from_dict({"image": [Image.fromarray(picture(0, i, True)) for i in range(6)]})
    plain = plain.cast_column("image", datasets.Image()).add_column("label", [0, 3, 1, 3, 0, 1])
    numbered = load_source(saved_as("plain", plain), None)
    assert numbered.classes == ("0", "1", "2", "3") and numbered.train.labels.tolist() == [0, 3, 1, 3, 0, 1]
    assert numbered.train.images.shape[1] == 1  # grey images stay grey

    features = datasets.Features(
        {"photo": datasets.Image(), "kind": datasets.ClassLabel(names=list(CLASSES)), "mask": datasets.Image()}
    )
    columns = {
        "photo": [Image.fromarray(picture(i % 3, i, False)) for i in range(6)],
        "kind": [i % 3 for i in range(6)],
        "mask": [Image.fromarray(picture(0, i, True)) for i in range(6)],
    }
    both = saved_as("both", datasets.Dataset.from_dict(columns, features=features))
    with pytest.raises(DataError, match=r"several image columns \(photo, mask\).*--image-column"):
        load_source(both, None)
    masks = load_source(both, None, image_column="mask")
    assert masks.train.images.shape[1] == 1
    assert torch.equal(masks.train.images[2, 0], torch.from_numpy(picture(0, 2, True)))
    with pytest.raises(DataError, match=r"--image-column 'pixels'.*its columns: photo, kind, mask"):
        load_source(both, None, image_column="pixels")
    with pytest.raises(DataError, match=r"column 'kind' holds ClassLabel.*not images"):
        load_source(both, None, image_column="kind")
    with pytest.raises(DataError, match="--label-column 'breed'"):
        load_source(both, None, image_column="mask", label_column="breed")
    no_images = saved_as("no-images", datasets.Dataset.from_dict({"x": [1, 2], "label": [0, 1]}))
    with pytest.raises(DataError, match="no image column"):
        load_source(no_images, None)
    with pytest.raises(ConfigError, match="hf: dataset"):
        load_source("fmnist", None, image_column="image")


def test_hf_hub_names_go_through_load_dataset(cache_home, monkeypatch):
    calls = []

    def stand_in(name, config=None, **kwargs):
        calls.append((name, config))
        return datasets.DatasetDict(train=hf_dataset(30), test=hf_dataset(6))

    monkeypatch.setattr(datasets, "load_dataset", stand_in)
    source = load_source("hf:someone/tiny-pets:small", None)
    assert calls == [("someone/tiny-pets", "small")] and len(source.train) == 30 and len(source.test) == 6

    def offline(name, config=None, **kwargs):
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match=r"cannot reach the Hugging Face Hub.*hf:PATH"):
        load_source("hf:someone/tiny-pets", None)


# ---------------------------------------------------------------- svhn, stl10


def test_svhn_and_stl10_read_torchvision_files_without_md5(torchvision_dir, cache_home):
    directory, svhn, stl10 = torchvision_dir
    source = load_source("svhn", directory)
    for split, data in (("train", source.train), ("test", source.test)):
        images, labels = svhn[split]
        np.testing.assert_array_equal(data.images.permute(0, 2, 3, 1).numpy(), images)
        assert data.labels.tolist() == labels.tolist()
    assert source.classes[0] == "0" and len(source.mean) == 3
    stl = load_source("stl10", directory)
    np.testing.assert_array_equal(stl.train.images.numpy(), stl10["train"][0])
    assert stl.test.labels.tolist() == stl10["test"][1].tolist() and stl.classes[2] == "car"
    unlabeled = load_unlabeled("stl10", directory)
    np.testing.assert_array_equal(unlabeled.train.images.numpy(), stl10["unlabeled"][0])
    assert unlabeled.train.labels is None

    # --kd-data stl10 distills on the unlabeled split: its 20 images, not the 30 labeled ones.
    fed = build_federation(
        DataConfig("svhn", directory, partition="iid", kd_data="stl10", image_size=SIDE), num_clients=2, seed=0
    )
    assert fed.kd.images.shape == (20, 3, SIDE, SIDE) and fed.classes[:2] == ("0", "1")
    own = build_federation(DataConfig("stl10", directory, partition="iid", image_size=SIDE), num_clients=2, seed=0)
    assert len(own.kd) == 20 and len(own.val) == 3 and len(own.global_test) == 12  # auto: the unlabeled split
    own_split = build_federation(DataConfig("svhn", directory, partition="iid"), num_clients=2, seed=0)
    assert len(own_split.kd) == 3  # own 1/10

    # An OOD set of its own classes: STL-10's car is CIFAR-10's automobile; monkey is left out.
    cifar = OodTarget(SourceSpec("cifar10", directory), 10, image_size=SIDE, channels=3)
    [part] = load_ood("stl10", cifar).parts
    kept = [label for label in stl10["test"][1] if label != 7]
    assert len(part.images) == len(kept) and part.images.labels.tolist()[:3] == [0, 2, 1]
    assert "monkey" in load_ood("stl10", cifar).provenance
    with pytest.raises(DataError, match="none of its classes"):
        load_ood(f"svhn:{directory}", cifar)


# ---------------------------------------------------------------- end to end through the CLI


def test_imagefolder_run_with_ood_sets_and_new_clients_from_every_source(
    folder, pair, saved, parquet, weights, tmp_path, capsys, monkeypatch
):
    run = tmp_path / "run"
    code, _, err = run_cli(train_args(f"imagefolder:{folder}", run, weights), capsys, monkeypatch)
    assert code == 0, err
    config = json.loads((run / "config.json").read_text())
    assert config["config"]["data"]["data"] == f"imagefolder:{folder}"
    assert config["resolved"]["num_classes"] == 3 and config["resolved"]["channels"] == 1
    partition = json.loads((run / "partition.json").read_text())
    assert partition["pool_size"] == 31 and partition["test_size"] == 9

    code, _, err = run_cli(["eval", "--run", str(run), "--ood", f"imagefolder:{pair / 'test'}"], capsys, monkeypatch)
    assert code == 0, err
    code, _, err = run_cli(["eval", "--run", str(run), "--ood", f"hf:{saved}"], capsys, monkeypatch)
    assert code == 0, err
    result = json.loads(next(run.glob("ood-hf_*.json")).read_text())
    assert result["parts"][0]["size"] == 12 and result["provenance"].startswith("split test of hf:")

    for spec, samples in ((f"imagefolder:{pair}", (18, 4)), (f"hf:{parquet}", None), (f"hf:{saved}", (36, 12))):
        if samples is None:  # a parquet with a string label column: the run's columns are hints only, and fail
            args = ["personalize", "--run", str(run), "--new-client", spec]
            expect_refusal(args, capsys, monkeypatch, "--label-column", untouched=run / "new_clients")
            continue
        code, _, err = run_cli(["personalize", "--run", str(run), "--new-client", spec], capsys, monkeypatch)
        assert code == 0, err
        [written] = [p for p in (run / "new_clients").iterdir() if p.name.endswith(Path(spec).name)]
        recorded = json.loads((written / "result.json").read_text())
        assert (recorded["train_samples"], recorded["test_samples"]) == samples


def test_resume_after_a_file_left_the_imagefolder_says_the_data_changed(weights, tmp_path, capsys, monkeypatch):
    images = write_folder(tmp_path / "pets")
    run = tmp_path / "run"
    args = train_args(f"imagefolder:{images}", run, weights)
    crash_after_round(1, args, capsys, monkeypatch)
    next((images / CLASSES[0]).iterdir()).unlink()
    err = expect_refusal(
        ["train", "--out", str(run), "--resume"],
        capsys,
        monkeypatch,
        f"the images of --data imagefolder:{images} changed since this run started",
        "pool_size 31, and the data has 30 now",
        "put the files back",
        untouched=run,
    )
    assert "--limit-samples" not in err


def test_hf_run_with_named_columns_and_imagefolder_distillation(
    parquet, folder, weights, tmp_path, capsys, monkeypatch
):
    run = tmp_path / "run"
    extra = ("--image-column", "photo", "--label-column", "species", "--channels", "1")
    args = train_args(f"hf:{parquet}", run, weights, "--kd-data", f"imagefolder:{folder}", *extra)
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    data = json.loads((run / "config.json").read_text())["config"]["data"]
    assert (data["image_column"], data["label_column"], data["kd_data"]) == (
        "photo",
        "species",
        f"imagefolder:{folder}",
    )
    # The run's columns are used for data from elsewhere that has them: its own parquet as a new client.
    code, _, err = run_cli(["personalize", "--run", str(run), "--new-client", f"hf:{parquet}"], capsys, monkeypatch)
    assert code == 0, err


def test_stl10_run_distills_on_its_unlabeled_split(torchvision_dir, weights, tmp_path, capsys, monkeypatch):
    directory, _, _ = torchvision_dir
    run = tmp_path / "run"
    args = train_args("stl10", run, weights, "--data-dir", str(directory), "--channels", "1")
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    code, _, err = run_cli(["eval", "--run", str(run), "--ood", "stl10"], capsys, monkeypatch)
    assert code == 0, err
    assert json.loads((run / "ood-stl10.json").read_text())["parts"][0]["size"] == 12
    expect_refusal(
        ["eval", "--run", str(run), "--ood", "svhn"], capsys, monkeypatch, "none of its classes", untouched=run
    )


def corrupt_folder(root: Path) -> Path:
    write_folder(root, per_class=4)
    (root / "dog" / "002.png").write_bytes(b"\x89PNG not really")
    return root


@pytest.mark.parametrize(
    ("data", "extra", "needles"),
    [
        ("imagefolder:{tmp}/missing", (), ["missing does not exist"]),
        ("imagefolder:{tmp}/empty", (), ["has no class folders"]),
        ("imagefolder:{tmp}/hollow", (), ["class folder", "hollow/emu holds no image files"]),
        ("imagefolder:{tmp}/corrupt", (), ["1 image cannot be decoded (dog/002.png)", "--skip-bad-images"]),
        ("imagefolder:", (), ["imagefolder needs a directory"]),
        ("hf:{tmp}/no-images", (), ["no image column", "--image-column"]),
        ("hf:{tmp}/pets", ("--image-column", "photo"), ["--image-column 'photo'", "its columns: picture, kind"]),
        ("hf:{tmp}/pets", ("--label-column", "breed"), ["--label-column 'breed'"]),
        ("hf:{tmp}/pets", ("--image-column", ""), ["--image-column"]),
        ("fmnist", ("--label-column", "kind"), ["--label-column", "hf:NAME"]),
        ("hf:{tmp}/nowhere", (), ["nowhere does not exist"]),
        ("hf:someone/pets", (), ["cannot reach the Hugging Face Hub"]),
        ("svhn", ("--data-dir", "{tmp}/empty"), ["SVHN not found", "--download"]),
        ("stl10", ("--data-dir", "{tmp}/stl-damaged"), ["not an STL-10 image file"]),
        ("imagefolder:{tmp}/pets-folder", ("--kd-data", "imagefolder:{tmp}/missing"), ["--kd-data", "missing"]),
        ("imagefolder:{tmp}/pets-folder", ("--kd-data", "svhn2"), ["unknown --kd-data", "hf:NAME"]),
    ],
)
def test_bad_inputs_are_one_error_line_and_write_nothing(data, extra, needles, weights, tmp_path, capsys, monkeypatch):
    (tmp_path / "empty").mkdir()
    (tmp_path / "hollow" / "emu").mkdir(parents=True)
    write_folder(tmp_path / "hollow", per_class=2, classes=CLASSES[:2])
    corrupt_folder(tmp_path / "corrupt")
    write_folder(tmp_path / "pets-folder", per_class=4)
    datasets.Dataset.from_dict({"x": [1, 2], "label": [0, 1]}).save_to_disk(str(tmp_path / "no-images"))
    hf_dataset(6).save_to_disk(str(tmp_path / "pets"))
    (tmp_path / "stl-damaged" / "stl10_binary").mkdir(parents=True)
    for file in ("train_X.bin", "train_y.bin", "test_X.bin", "test_y.bin"):
        (tmp_path / "stl-damaged" / "stl10_binary" / file).write_bytes(b"\0" * 100)
    run = tmp_path / "run"
    fill = [value.replace("{tmp}", str(tmp_path)) for value in (data, *extra)]
    args = train_args(fill[0], run, weights, *fill[1:])
    expect_refusal(args, capsys, monkeypatch, *needles, untouched=run)


def test_without_datasets_hf_names_the_extra_to_install(weights, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` fails as where it is not installed
    run = tmp_path / "run"
    args = train_args(f"hf:{tmp_path}", run, weights)
    expect_refusal(args, capsys, monkeypatch, INSTALL_HINT, untouched=run)
