"""Hostile files (issue 27): a picture over Pillow's decompression-bomb limit, file and folder names that are not
UTF-8, a --data-dir without the files, class names that cannot be folder names, and weights or statistics that are
not finite numbers. Each is one `error:` line naming the file and what to do; bad pictures can be left out with
--skip-bad-images."""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from peradapt.backbones import DataFacts, create_backbone, load_backbone
from peradapt.config import BackboneConfig
from peradapt.data import sources
from peradapt.data.images import Rows
from peradapt.data.ood import OodTarget, load_ood
from peradapt.data.sources import SourceSpec, load_source, scan_unlabeled
from peradapt.errors import DataError, WeightsError

from .conftest import TINY_BACKBONE
from .test_cli import expect_user_error, run_cli
from .test_data_fast_fail import CLASSES, SIDE, cut_jpeg, write_folder

pytestmark = pytest.mark.usefixtures("one_thread")

# Pillow's limit lowered for the tests, so that a 100 px picture stands for a 20000 px one: above twice the limit
# Pillow refuses to open a picture (DecompressionBombError), above the limit it warns (DecompressionBombWarning).
PIXEL_LIMIT = 1000
BOMB_SIDE = 100  # 10000 pixels: more than twice the limit
LARGE_SIDE = 40  # 1600 pixels: over the limit, under twice it


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PERADAPT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def low_pixel_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", PIXEL_LIMIT)


def bytes_path(directory: Path, name: bytes) -> Path:
    """``directory/name`` for a name that is not UTF-8, as Python sees such a file: its bytes as surrogates."""
    return Path(os.fsdecode(os.fsencode(directory) + b"/" + name))


def save_grey(path: Path, side: int = SIDE, shade: int = 99) -> Path:
    Image.new("L", (side, side), shade).save(path, "PNG")
    return path


def listed_file(message: str) -> Path:
    """The file under $PERADAPT_HOME/bad-images/ that a bad-images message points to."""
    return Path(message.split("the full list is in ")[1].split(";")[0])


# ---------------------------------------------------------------- pictures over Pillow's limit


def test_a_picture_over_pillows_limit_is_one_bad_image_that_skip_leaves_out(tmp_path, cache_home, low_pixel_limit):
    folder = write_folder(tmp_path / "pets", per_class=4)
    save_grey(folder / "bee" / "huge.png", BOMB_SIDE)
    with pytest.raises(DataError) as caught:
        load_source(f"imagefolder:{folder}", None)
    message = str(caught.value)
    assert "1 image cannot be decoded (bee/huge.png)" in message and "--skip-bad-images" in message
    reason = listed_file(message).read_text()
    assert "too large" in reason and "decompression-bomb limit" in reason
    source = load_source(f"imagefolder:{folder}", None, skip_bad=True)
    assert len(source.train) == 12 and source.skipped == ("bee/huge.png",)
    assert Image.MAX_IMAGE_PIXELS == PIXEL_LIMIT  # the limit is Pillow's, never raised


def test_eval_ood_imagefolder_reports_a_picture_over_pillows_limit_as_bad(tmp_path, cache_home, low_pixel_limit):
    folder = write_folder(tmp_path / "ood", per_class=2, classes=("0", "1"))
    save_grey(folder / "1" / "huge.png", BOMB_SIDE)
    target = OodTarget(SourceSpec("imagefolder:x"), 2, image_size=SIDE, channels=1)
    with pytest.raises(DataError, match=r"1 image cannot be decoded \(1/huge.png\)") as caught:
        load_ood(f"imagefolder:{folder}", target)
    assert "too large" in listed_file(str(caught.value)).read_text()


def test_a_picture_between_once_and_twice_the_limit_decodes_without_a_warning(tmp_path, cache_home, low_pixel_limit):
    folder = write_folder(tmp_path / "pets", per_class=4)
    save_grey(folder / "bee" / "large.png", LARGE_SIDE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning, Pillow's DecompressionBombWarning among them, fails
        source = load_source(f"imagefolder:{folder}", None)
        assert len(source.train) == 13 and source.train.images.shape[-1] == SIDE
        ood = load_ood(
            f"imagefolder:{folder}",
            OodTarget(SourceSpec("imagefolder:x"), 3, image_size=SIDE, channels=1, classes=CLASSES),
        )
        assert len(ood.parts[0].images) == 13


# ---------------------------------------------------------------- names that are not UTF-8


def non_utf8_folder(root: Path) -> Path:
    """Classes ant, bee and b'caf\\xe9' (Latin-1 for café), and in ant a file named b'\\xff.png'."""
    folder = write_folder(root, per_class=4)
    cafe = bytes_path(folder, b"caf\xe9")
    cafe.mkdir()
    for index in range(4):
        save_grey(cafe / f"{index}.png", shade=40 * index)
    save_grey(bytes_path(folder / "ant", b"\xff.png"), shade=7)
    shutil.rmtree(folder / "cow")
    return folder


def test_names_that_are_not_utf8_are_read_and_shown_escaped(tmp_path, cache_home):
    folder = non_utf8_folder(tmp_path / "pets")
    source = load_source(f"imagefolder:{folder}", None)
    assert len(source.train) == 13 and source.classes == ("ant", "bee", "caf\\xe9")
    assert len(scan_unlabeled(f"imagefolder:{folder}", None, image_size=SIDE).decode(Rows()).train) == 13
    load_source(f"imagefolder:{folder}", None)  # read back from the cache


def test_a_bad_picture_with_a_name_that_is_not_utf8_is_named_escaped(tmp_path, cache_home):
    folder = non_utf8_folder(tmp_path / "pets")
    bytes_path(folder / "bee", b"\xfe.jpg").write_bytes(cut_jpeg())
    with pytest.raises(DataError, match=r"1 image cannot be decoded \(bee/\\xfe.jpg\)") as caught:
        load_source(f"imagefolder:{folder}", None)
    assert listed_file(str(caught.value)).read_text(encoding="utf-8").startswith(f"{folder}/bee/\\xfe.jpg: ")
    source = load_source(f"imagefolder:{folder}", None, skip_bad=True)
    assert source.skipped == ("bee/\\xfe.jpg",)


@pytest.fixture
def weights(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The tiny grey backbone pretrained on Fashion-MNIST, with PERADAPT_HOME (decode cache) of this test."""
    monkeypatch.setenv("PERADAPT_HOME", str(tmp_path / "home"))
    return home / "backbones" / f"fmnist-{TINY_BACKBONE}.safetensors"


def train_args(data: Path, weights: Path, run: Path, *extra: str) -> list[str]:
    return [
        "train",
        *("--data", f"imagefolder:{data}", "--kd-data", f"imagefolder:{data}"),
        *("--backbone", TINY_BACKBONE, "--weights", str(weights), "--clients", "2", "--clients-per-round", "2"),
        *("--rounds", "1", "--partition", "iid", "--local-epochs", "1", "--personal-epochs", "1"),
        *("--batch-size", "8", "--kd-steps", "1", "--eval-every", "0", "--device", "cpu", "--out", str(run), *extra),
    ]


def test_a_run_on_names_that_are_not_utf8_records_them_escaped(weights, tmp_path, low_pixel_limit, capsys, monkeypatch):
    folder = non_utf8_folder(tmp_path / "pets")
    bytes_path(folder / "bee", b"\xfe.jpg").write_bytes(cut_jpeg())
    save_grey(folder / "ant" / "huge.png", BOMB_SIDE)
    run = tmp_path / "run"
    expect_user_error(
        train_args(folder, weights, run),
        capsys,
        monkeypatch,
        "2 images cannot be decoded (ant/huge.png, bee/\\xfe.jpg)",
    )
    code, _, err = run_cli(train_args(folder, weights, run, "--skip-bad-images"), capsys, monkeypatch)
    assert code == 0, err
    config = json.loads((run / "config.json").read_text(encoding="utf-8"))
    assert config["resolved"]["skipped_images"] == ["ant/huge.png", "bee/\\xfe.jpg"]
    assert json.loads((run / "report.json").read_text(encoding="utf-8"))["classes"] == ["ant", "bee", "caf\\xe9"]
    code, _, err = run_cli(["export", "--run", str(run), "--out", str(tmp_path / "export")], capsys, monkeypatch)
    assert code == 0, err
    assert "caf\\xe9" in (tmp_path / "export" / "README.md").read_text(encoding="utf-8")


# ---------------------------------------------------------------- --data-dir


@pytest.mark.parametrize("holding", ["nothing", "directories named like the files"])
def test_a_data_dir_without_the_idx_files_is_refused_not_replaced_by_the_system_copy(
    holding, tmp_path, fmnist_dir, monkeypatch
):
    monkeypatch.setattr(sources, "DEBIAN_FMNIST_DIR", fmnist_dir)  # a system copy that must not be used
    given = tmp_path / "mine"
    given.mkdir()
    if holding != "nothing":
        for file in fmnist_dir.iterdir():
            (given / file.name).mkdir()
            (given / file.name.removesuffix(".gz")).mkdir()
    with pytest.raises(DataError) as caught:
        load_source("fmnist", given)
    message = str(caught.value)
    assert "not found: no train-images-idx3-ubyte[.gz]" in message
    assert f"in {given}, {given}/FashionMNIST/raw: put the four IDX files in --data-dir {given}" in message
    assert f"drop --data-dir to use the system copy in {fmnist_dir}" in message
    load_source("fmnist", None)  # without --data-dir, the system copy


# ---------------------------------------------------------------- class names as folder names


def test_the_ood_folder_hint_names_folders_that_can_exist(tmp_path, cache_home):
    target = OodTarget(SourceSpec("fmnist"), 10, image_size=SIDE, channels=1)
    folder = write_folder(tmp_path / "ood", per_class=2, classes=("Trouser", "Shirtt"))
    with pytest.raises(DataError) as caught:
        load_ood(f"imagefolder:{folder}", target)
    message = str(caught.value)
    assert "Shirtt is not a class of this run" in message and "T-shirt/top" not in message
    assert "T-shirt_top" in message
    shutil.rmtree(folder / "Shirtt")
    write_folder(folder, per_class=2, classes=("T-shirt_top",))
    labels = load_ood(f"imagefolder:{folder}", target).parts[0].images.labels
    assert sorted(labels.tolist()) == [0, 0, 1, 1]


# ---------------------------------------------------------------- weights and their statistics


def tiny_weights(path: Path, *, nan_in: str | None = None, **info: object) -> Path:
    """The tiny backbone's random weights at ``path`` (``nan_in``: that tensor NaN), with a JSON of ``info``."""
    torch.manual_seed(0)
    state = create_backbone(TINY_BACKBONE, 10, 1).state_dict()
    if nan_in is not None:
        state[nan_in][0] = float("nan")
    save_file({key: value.contiguous() for key, value in state.items()}, str(path))
    if info:
        described = {"backbone": TINY_BACKBONE, "in_chans": 1, "image_size": 28, "source": "test", **info}
        path.with_suffix(".json").write_text(json.dumps(described))
    return path


def load(weights: Path):
    facts = DataFacts("fmnist", 10, 1, 28, (0.5,), (0.5,))
    return load_backbone(BackboneConfig(TINY_BACKBONE, weights=str(weights)), facts)


def test_weights_holding_nan_are_refused_naming_the_tensor(tmp_path):
    path = tiny_weights(tmp_path / "nan.safetensors", nan_in="conv1.weight")
    with pytest.raises(WeightsError, match=rf"{path} holds NaN in conv1.weight: the weights are damaged"):
        load(path)


@pytest.mark.parametrize(
    ("mean", "std", "wrong"),
    [
        ((0.5,), (0.0,), "std"),
        ((0.5,), (-0.2,), "std"),
        ((0.5,), (float("inf"),), "std"),
        ((float("nan"),), (0.5,), "mean"),
        ((0.5, 0.5), (0.5, 0.5), "2 values"),
        ((0.5,), (0.5, 0.5, 0.5), "std"),
    ],
)
def test_statistics_that_cannot_normalize_are_refused_naming_the_file(mean, std, wrong, tmp_path):
    path = tiny_weights(tmp_path / "w.safetensors", mean=mean, std=std)
    with pytest.raises(WeightsError) as caught:
        load(path)
    message = str(caught.value)
    assert str(path.with_suffix(".json")) in message and wrong in message


def test_a_run_on_nan_weights_is_one_error_line_naming_the_file(fmnist_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PERADAPT_HOME", str(tmp_path / "home"))
    path = tiny_weights(tmp_path / "nan.safetensors", nan_in="layer1.0.conv1.weight")
    args = [
        "train",
        *("--data", "fmnist", "--data-dir", str(fmnist_dir), "--limit-samples", "300"),
        *("--backbone", TINY_BACKBONE, "--weights", str(path), "--clients", "2", "--clients-per-round", "2"),
        *("--rounds", "1", "--batch-size", "8", "--kd-steps", "1"),
        *("--device", "cpu", "--out", str(tmp_path / "run")),
    ]
    expect_user_error(args, capsys, monkeypatch, f"{path} holds NaN in layer1.0.conv1.weight")


def test_an_hf_processor_with_a_zero_std_is_refused(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(
        image_size=32,
        patch_size=8,
        num_channels=3,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
    )
    transformers.ViTForImageClassification(config).save_pretrained(str(tmp_path / "vit"))
    processor = tmp_path / "vit" / "preprocessor_config.json"
    processor.write_text(json.dumps({"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.0, 0.5]}))
    with pytest.raises(WeightsError, match=rf"{processor}.*std"):
        load_backbone(BackboneConfig(f"hf:{tmp_path / 'vit'}"), DataFacts("x", 2, 3, 32, (0.5,) * 3, (0.5,) * 3))
