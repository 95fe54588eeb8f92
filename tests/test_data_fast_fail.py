"""Image files that fail fast and decode no more than a run uses (issue 25): --limit-samples decodes only the rows a
run uses (with the same split), the default size is the most common one, undecodable files are reported together
or left out with --skip-bad-images, checks that need no pixels come before decoding, grey weights on colour data
name --channels, and imagefolder/hf inputs are normalized with their own statistics."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from peradapt.backbones import BackboneInfo, DataFacts, create_backbone, load_backbone
from peradapt.config import BackboneConfig, DataConfig
from peradapt.data import build_federation, fixed_splits, load_source
from peradapt.data import decode as decode_module
from peradapt.data.decode import common_size
from peradapt.data.ood import OodTarget, load_ood
from peradapt.data.sources import SourceSpec
from peradapt.errors import DataError, WeightsError
from peradapt.federation.session import open_session

from .conftest import TINY_BACKBONE
from .test_cli import expect_refusal, run_cli
from .test_data_sources import counting_decodes

pytestmark = pytest.mark.usefixtures("one_thread")

CLASSES = ("ant", "bee", "cow")
SIDE = 8


def write_folder(root: Path, per_class: int = 10, *, rgb: bool = False, classes=CLASSES) -> Path:
    """``per_class`` small PNGs per class, each different; grey unless ``rgb``."""
    for label, name in enumerate(classes):
        (root / name).mkdir(parents=True, exist_ok=True)
        for index in range(per_class):
            rng = np.random.default_rng([label, index])
            shape = (SIDE, SIDE, 3) if rgb else (SIDE, SIDE)
            Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(root / name / f"{index:03d}.png")
    return root


def cut_jpeg() -> bytes:
    """A JPEG cut short: its header reads, its pixels do not."""
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buffer, "JPEG")
    return buffer.getvalue()[: len(buffer.getvalue()) // 2]


def spoil(root: Path) -> list[Path]:
    """Two files without an image header (random bytes named .jpg), in two classes."""
    spoiled = [root / "ant" / "zz-noise.jpg", root / "cow" / "zz-junk.jpg"]
    for seed, path in enumerate(spoiled):
        path.write_bytes(np.random.default_rng(seed).bytes(200))
    return spoiled


@pytest.fixture
def weights(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The tiny grey backbone pretrained on Fashion-MNIST (28 px), with PERADAPT_HOME (decode cache) of this test."""
    monkeypatch.setenv("PERADAPT_HOME", str(tmp_path / "home"))
    return home / "backbones" / f"fmnist-{TINY_BACKBONE}.safetensors"


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PERADAPT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def federation(data: str, **options):
    return build_federation(DataConfig(data, partition="iid", **options), num_clients=2, seed=0)


def assert_same_federation(limited, full, splits) -> None:
    """``limited`` (decoded by rows) holds exactly the images that ``full``'s source gives at ``splits``."""
    pool = full.train.subset(splits.pool)
    for client in limited.clients:
        assert torch.equal(client.train.images, pool.images[client.train_indices])
        assert torch.equal(client.train.labels, pool.labels[client.train_indices])
    test = (full.train if full.test is None else full.test).subset(splits.test)
    assert torch.equal(
        limited.global_test.images, test.images[np.sort(np.concatenate([c.test_indices for c in limited.clients]))]
    )
    assert torch.equal(limited.val.images, full.train.images[splits.val])
    assert torch.equal(limited.kd.images, full.train.images[splits.kd])


# ---------------------------------------------------------------- --limit-samples


def test_limit_samples_decodes_only_the_rows_a_run_uses_and_splits_as_before(tmp_path, cache_home, monkeypatch):
    folder = write_folder(tmp_path / "pets", per_class=20)
    decoded = counting_decodes(monkeypatch)
    limited = federation(f"imagefolder:{folder}", limit_samples=4)
    splits = fixed_splits(f"imagefolder:{folder}", 60, 0, limit_samples=4)
    assert [len(part) for part in (splits.val, splits.kd, splits.test, splits.pool)] == [4, 4, 4, 4]
    assert len(decoded) == 16  # val, kd, carved test and pool, not 60
    assert limited.partition["pool_size"] == 4 and limited.partition["test_size"] == 4

    full = load_source(f"imagefolder:{folder}", None)
    assert len(decoded) == 16 + 60
    assert_same_federation(limited, full, splits)
    federation(f"imagefolder:{folder}", limit_samples=4)  # the same rows: read from the cache
    federation(f"imagefolder:{folder}", limit_samples=5)  # other rows: another cache entry
    assert len(decoded) == 16 + 60 + 20


def test_limit_samples_decodes_only_the_hf_rows_a_run_uses(tmp_path, cache_home, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=list(CLASSES))})
    rng = np.random.default_rng(0)

    def split(rows: int):
        images = [Image.fromarray(rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)) for _ in range(rows)]
        return datasets.Dataset.from_dict({"image": images, "label": [i % 3 for i in range(rows)]}, features=features)

    path = tmp_path / "saved"
    datasets.DatasetDict(train=split(40), test=split(20)).save_to_disk(str(path))
    decoded = counting_decodes(monkeypatch)
    limited = federation(f"hf:{path}", limit_samples=4)
    assert len(decoded) == 16  # val, kd, pool of train and 4 test rows, not 60
    splits = fixed_splits(f"hf:{path}", 40, 20, limit_samples=4)
    assert_same_federation(limited, load_source(f"hf:{path}", None), splits)


# ---------------------------------------------------------------- the default size


def test_the_default_size_is_the_most_common_and_said(tmp_path, cache_home, capsys):
    folder = write_folder(tmp_path / "mixed", per_class=4)
    Image.new("L", (40, 28)).save(folder / "ant" / "wide.png")
    Image.new("RGB", (64, 64)).save(folder / "bee" / "big.jpg")
    capsys.readouterr()
    source = load_source(f"imagefolder:{folder}", None)
    assert source.train.images.shape[1:] == (3, SIDE, SIDE)  # never scaled up to 224 for a few larger images
    err = capsys.readouterr().err
    assert f"imagefolder:{folder}: 14 images at {SIDE} px (the most common size; 2 resized; --image-size" in err

    assert common_size([(500, 375)] * 3 + [(32, 32)], 224) == (
        224,
        "4 images at 224 px (their most common size, 500x375, is more than 224 px; 4 resized; --image-size to choose)",
    )
    assert common_size([(16, 16)] * 2, 224) == (16, "2 images at 16 px (their size; --image-size to choose)")
    assert common_size([(28, 28), (28, 28), (40, 40), (40, 40)], 224)[0] == 40  # a tie: the larger, never shrunk


# ---------------------------------------------------------------- bad images


def test_undecodable_files_are_reported_together_in_one_line_and_listed(tmp_path, cache_home, monkeypatch):
    folder = write_folder(tmp_path / "pets")
    spoiled = spoil(folder)
    decoded = counting_decodes(monkeypatch)
    with pytest.raises(DataError) as caught:
        load_source(f"imagefolder:{folder}", None)
    message = str(caught.value)
    assert message.startswith(f"imagefolder:{folder}: 2 images cannot be decoded (ant/zz-noise.jpg, cow/zz-junk.jpg)")
    assert message.endswith("; replace or remove them, or pass --skip-bad-images") and not decoded  # headers first
    listed = Path(message.split("the full list is in ")[1].split(";")[0])
    assert listed.parent == cache_home / "bad-images"
    assert [line.split(": ")[0] for line in listed.read_text().splitlines()] == [str(path) for path in spoiled]

    # A file whose header reads but whose data is cut short fails while decoding: all such come together too.
    for path in spoiled:
        path.write_bytes(cut_jpeg())
    with pytest.raises(DataError, match=r"2 images cannot be decoded \(ant/zz-noise.jpg, cow/zz-junk.jpg\)"):
        load_source(f"imagefolder:{folder}", None)
    assert len(decoded) == 32


def test_eval_ood_imagefolder_reports_its_bad_images_the_same_way(tmp_path, cache_home):
    folder = write_folder(tmp_path / "ood", per_class=2, classes=("0", "1"))
    (folder / "0" / "a.png").write_bytes(b"not a png")
    (folder / "1" / "b.jpg").write_bytes(cut_jpeg())
    target = OodTarget(SourceSpec("imagefolder:x"), 2, image_size=SIDE, channels=1)
    with pytest.raises(
        DataError,
        match=r"imagefolder:.*ood: 2 images cannot be decoded \(0/a.png, 1/b.jpg\); "
        r"the full list is in .*; replace or remove them$",
    ):
        load_ood(f"imagefolder:{folder}", target)


def test_skip_bad_images_leaves_them_out_before_the_split_and_records_them(weights, tmp_path, capsys, monkeypatch):
    folder = write_folder(tmp_path / "pets", per_class=8)
    spoil(folder)
    (folder / "bee" / "cut.jpg").write_bytes(cut_jpeg())  # its header reads, its data does not
    run = tmp_path / "run"
    args = [
        "train",
        *("--data", f"imagefolder:{folder}", "--backbone", TINY_BACKBONE, "--weights", str(weights)),
        *("--clients", "2", "--clients-per-round", "2", "--rounds", "1", "--partition", "iid", "--local-epochs", "1"),
        *("--personal-epochs", "1", "--batch-size", "8", "--kd-steps", "1", "--eval-every", "0", "--device", "cpu"),
        *("--out", str(run), "--skip-bad-images"),
    ]
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    assert "3 images cannot be decoded (ant/zz-noise.jpg, bee/cut.jpg, cow/zz-junk.jpg)" in err and "left out" in err
    resolved = json.loads((run / "config.json").read_text())["resolved"]
    assert resolved["skipped_images"] == ["ant/zz-noise.jpg", "bee/cut.jpg", "cow/zz-junk.jpg"]
    assert json.loads((run / "config.json").read_text())["config"]["data"]["skip_bad_images"] is True
    # The 24 good files split as 24 files would: the bad ones are gone before the fixed split.
    splits = fixed_splits(f"imagefolder:{folder}", 24, 0, limit_samples=None)
    assert json.loads((run / "partition.json").read_text())["pool_size"] == len(splits.pool)
    # A run reopened later keeps the size it resolved, whatever another peradapt would choose for these images (one
    # before the most-common-size rule decoded mixed folders at 224 px): as if this run had resolved 12 px.
    saved = json.loads((run / "config.json").read_text())
    saved["resolved"]["image_size"] = 12
    (run / "config.json").write_text(json.dumps(saved))
    session = open_session(run)
    assert session.data.image_size == 12 and session.data.clients[0].train.images.shape[-1] == 12


def test_skip_bad_images_leaves_out_hf_rows_and_names_them(tmp_path, cache_home, monkeypatch, capsys):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=list(CLASSES))})
    good = io.BytesIO()
    Image.new("RGB", (SIDE, SIDE), (9, 99, 199)).save(good, "PNG")
    pictures = [{"bytes": good.getvalue(), "path": None}] * 30
    pictures[7] = pictures[21] = {"bytes": b"no image here", "path": None}
    rows = {"image": pictures, "label": [i % 3 for i in range(30)]}
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(DataError, match=r"2 images cannot be decoded \(row 7 of split train, row 21 of split train\)"):
        load_source(f"hf:{tmp_path / 'saved'}", None)
    source = load_source(f"hf:{tmp_path / 'saved'}", None, skip_bad=True)
    assert len(source.train) == 28 and source.skipped == ("row 7 of split train", "row 21 of split train")
    assert source.train.labels.tolist() == [i % 3 for i in range(30) if i not in (7, 21)]
    assert "left out (--skip-bad-images)" in capsys.readouterr().err


# ---------------------------------------------------------------- checks before decoding


def test_checks_that_need_no_pixels_come_before_any_decoding(tmp_path, cache_home, monkeypatch):
    def refuse(picture):
        raise AssertionError(f"{picture} was read before the checks")

    monkeypatch.setattr(decode_module, "_picture_header", refuse)
    folder = write_folder(tmp_path / "pets", per_class=4)
    write_folder(tmp_path / "pets2", per_class=8)
    with pytest.raises(DataError, match="the client pool has"):
        build_federation(DataConfig(f"imagefolder:{folder}", partition="iid"), num_clients=5, seed=0)
    with pytest.raises(DataError, match="pool has 2"):
        build_federation(DataConfig(f"imagefolder:{folder}", partition="iid", limit_samples=2), num_clients=3, seed=0)
    (folder / "dog").mkdir()
    with pytest.raises(DataError, match="dog holds no image files"):
        federation(f"imagefolder:{folder}")
    pair = write_folder(tmp_path / "pair" / "train", per_class=4).parent
    write_folder(pair / "test", per_class=1, classes=("ant", "emu"))
    with pytest.raises(DataError, match=r"class folder.*emu"):
        federation(f"imagefolder:{pair}")
    record = {"layout": "fixed-split", "pool_size": 99, "clients": [{"train": [], "test": []}] * 2}
    (tmp_path / "partition.json").write_text(json.dumps(record))
    partition = f"file:{tmp_path / 'partition.json'}"
    with pytest.raises(DataError, match="pool_size 99"):
        build_federation(
            DataConfig(f"imagefolder:{folder.parent / 'pets2'}", partition=partition), num_clients=2, seed=0
        )


# ---------------------------------------------------------------- weights and statistics


def test_grey_weights_on_colour_data_name_channels_and_image_size(tmp_path):
    grey = create_backbone(TINY_BACKBONE, 10, 1, 28)
    path = tmp_path / "grey.safetensors"
    save_file({key: value.contiguous() for key, value in grey.state_dict().items()}, str(path))
    BackboneInfo(TINY_BACKBONE, 1, 28, (0.3,), (0.3,), "test").save(path)
    backbone = BackboneConfig(TINY_BACKBONE, weights=str(path))
    with pytest.raises(
        WeightsError,
        match=r"made for grey \(1-channel\) images, but the data has 3 channels: pass "
        r"--channels 1 to train on the images in grey and --image-size 28",
    ):
        load_backbone(backbone, DataFacts("imagefolder:x", 3, 3, 32, (0.5,) * 3, (0.2,) * 3))
    model, _ = load_backbone(backbone, DataFacts("imagefolder:x", 3, 1, 32, (0.5,), (0.2,)))
    assert model is not None


def test_imagefolder_inputs_are_normalized_with_their_own_statistics(tmp_path, cache_home):
    folder = write_folder(tmp_path / "pets", rgb=True)
    source = load_source(f"imagefolder:{folder}", None)
    pixels = source.train.images.double().div(255)
    expected_mean = pixels.mean(dim=(0, 2, 3)).tolist()
    expected_std = pixels.std(dim=(0, 2, 3), unbiased=False).tolist()
    np.testing.assert_allclose(source.mean, expected_mean, atol=1e-4)
    np.testing.assert_allclose(source.std, expected_std, atol=1e-4)
    # A backbone whose weights bring no statistics normalizes with the data's.
    bare = create_backbone(TINY_BACKBONE, 3, 3, SIDE)
    path = tmp_path / "bare.safetensors"
    save_file({key: value.contiguous() for key, value in bare.state_dict().items()}, str(path))
    fed = federation(f"imagefolder:{folder}")
    facts = DataFacts("x", 3, 3, 8, fed.mean, fed.std)
    _, info = load_backbone(BackboneConfig(TINY_BACKBONE, weights=str(path)), facts)
    assert info.mean == fed.mean and fed.mean != (0.485, 0.456, 0.406)


def test_colour_data_on_the_grey_pretrained_backbone_is_one_line_naming_channels(
    weights, tmp_path, capsys, monkeypatch
):
    folder = write_folder(tmp_path / "colour", per_class=8, rgb=True)
    run = tmp_path / "run"
    args = [
        "train",
        *("--data", f"imagefolder:{folder}", "--backbone", TINY_BACKBONE, "--weights", str(weights)),
        *("--clients", "2", "--clients-per-round", "2", "--rounds", "1", "--device", "cpu", "--out", str(run)),
    ]
    expect_refusal(args, capsys, monkeypatch, "--channels 1", "--image-size 28", untouched=run)
