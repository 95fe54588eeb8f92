"""The PerAda authors' input pipeline as options: RandomResizedCrop + flip on training batches, shorter-side resize +
center crop when decoding, grey repeated as RGB; each checked against torchvision or a hand-written reference."""

from __future__ import annotations

import csv
import hashlib
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms as T
from PIL import Image
from torchvision.transforms.v2 import functional as TF

from peradapt.compute.trainer import InputPipeline
from peradapt.data import decode as decode_module
from peradapt.data import load_source, resize_images, to_model_input
from peradapt.data.batches import (
    CROP_ATTEMPTS,
    random_crop_flip,
    random_resized_crop_flip,
    resized_crop_boxes,
    resized_crops,
)
from peradapt.data.chexpert import TASKS
from peradapt.data.decode import decode_images, fit_picture
from peradapt.data.images import IMAGENET_MEAN, IMAGENET_STD, channel_statistics

from .conftest import write_fmnist_like

pytestmark = pytest.mark.usefixtures("one_thread")

AUTHORS_SCALE = (0.05, 1.0)
RATIO = (3 / 4, 4 / 3)


def reference_box(
    height: int, width: int, uniforms: list[float], scale: tuple[float, float], ratio: tuple[float, float]
) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params, one image at a time, its random numbers taken from `uniforms`
    (area fractions, log aspect ratios, then top and left) instead of torch's global generator."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for attempt in range(CROP_ATTEMPTS):
        target_area = area * (scale[0] + (scale[1] - scale[0]) * uniforms[attempt])
        aspect_ratio = math.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * uniforms[CROP_ATTEMPTS + attempt])
        w = round(math.sqrt(target_area * aspect_ratio))
        h = round(math.sqrt(target_area / aspect_ratio))
        if 0 < w <= width and 0 < h <= height:
            top = int(uniforms[2 * CROP_ATTEMPTS] * (height - h + 1))
            left = int(uniforms[2 * CROP_ATTEMPTS + 1] * (width - w + 1))
            return top, left, h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, round(width / min(ratio))
    elif in_ratio > max(ratio):
        h, w = height, round(height * max(ratio))
    else:
        h, w = height, width
    return (height - h) // 2, (width - w) // 2, h, w


@pytest.mark.parametrize(
    ("height", "width", "scale"),
    [
        (64, 64, AUTHORS_SCALE),
        (30, 40, AUTHORS_SCALE),
        (40, 13, AUTHORS_SCALE),
        (32, 32, (0.9, 1.0)),  # often no fit in ten attempts: some boxes (24 of 500) fall back
        (30, 40, (2.0, 3.0)),  # never fits: always the fallback
    ],
)
def test_crop_boxes_follow_torchvisions_rule(height: int, width: int, scale: tuple[float, float]) -> None:
    generator = torch.Generator().manual_seed(height * width)
    uniforms = torch.rand((500, 2 * CROP_ATTEMPTS + 2), generator=generator, dtype=torch.float64)
    boxes = resized_crop_boxes(height, width, uniforms, scale, RATIO)
    expected = [reference_box(height, width, row, scale, RATIO) for row in uniforms.tolist()]
    assert boxes.dtype == torch.int64 and boxes.tolist() == [list(box) for box in expected]


@pytest.mark.parametrize(("height", "width"), [(30, 40), (40, 30), (20, 50), (50, 20), (33, 33)])
def test_fallback_box_is_torchvisions(height: int, width: int) -> None:
    never_fits = (2.0, 3.0)
    torchvision_box = T.RandomResizedCrop.get_params(torch.empty(1, height, width), list(never_fits), list(RATIO))
    boxes = resized_crop_boxes(
        height, width, torch.rand(3, 2 * CROP_ATTEMPTS + 2, dtype=torch.float64), never_fits, RATIO
    )
    assert boxes.tolist() == [list(torchvision_box)] * 3


@pytest.mark.parametrize(("fraction", "aspect"), [(0.3, 1.0), (0.5, 0.8), (0.77, 1.25), (0.1, 0.9)])
def test_box_sizes_of_a_fixed_scale_and_ratio_are_torchvisions(fraction: float, aspect: float) -> None:
    # With one area fraction and one aspect ratio only the placement is random: the box's size must agree.
    scale, ratio = (fraction, fraction), (aspect, aspect)
    torch.manual_seed(0)
    _, _, h, w = T.RandomResizedCrop.get_params(torch.empty(1, 48, 64), list(scale), list(ratio))
    boxes = resized_crop_boxes(48, 64, torch.rand(50, 2 * CROP_ATTEMPTS + 2, dtype=torch.float64), scale, ratio)
    assert set(map(tuple, boxes[:, 2:].tolist())) == {(h, w)}
    assert boxes[:, 0].min() >= 0 and boxes[:, 0].max() <= 48 - h and boxes[:, 1].max() <= 64 - w
    assert len(set(boxes[:, 0].tolist())) > 1  # placed at random


@pytest.mark.parametrize("size", [16, 48])
def test_resized_crop_is_torchvisions_within_one_grey_level(size: int) -> None:
    images = torch.randint(0, 256, (4, 3, 30, 40), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    # Shrunk, enlarged, a thin sliver and the whole image.
    boxes = torch.tensor([[2, 3, 25, 33], [10, 12, 7, 9], [0, 5, 30, 2], [0, 0, 30, 40]])
    crops = resized_crops(images, boxes, size)
    assert crops.dtype == torch.uint8 and crops.shape == (4, 3, size, size)
    for image, box, crop in zip(images, boxes.tolist(), crops, strict=True):
        expected = TF.resized_crop(image, *box, size=[size, size], antialias=True)
        assert (crop.int() - expected.int()).abs().max() <= 1
    flipped = resized_crops(images, boxes, size, flips=torch.tensor([True, False, True, False]))
    assert torch.equal(flipped[[0, 2]], crops[[0, 2]].flip(-1)) and torch.equal(flipped[[1, 3]], crops[[1, 3]])


def test_random_resized_crops_are_reproducible_and_flip_half() -> None:
    images = torch.randint(0, 256, (64, 1, 20, 20), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))

    def augmented(seed: int) -> torch.Tensor:
        return random_resized_crop_flip(images, torch.Generator().manual_seed(seed), 12)

    first = augmented(5)
    assert first.shape == (64, 1, 12, 12) and first.dtype == torch.uint8
    assert torch.equal(first, augmented(5)) and not torch.equal(first, augmented(6))
    # The same draws, taken apart: boxes by the rule, then a flip where the last uniform is below 1/2.
    uniforms = torch.rand((64, 2 * CROP_ATTEMPTS + 3), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    boxes = resized_crop_boxes(20, 20, uniforms[:, :-1], AUTHORS_SCALE, RATIO)
    flips = uniforms[:, -1] < 0.5
    assert torch.equal(first, resized_crops(images, boxes, 12, flips))
    assert 16 < flips.sum() < 48


def test_input_pipeline_augments_training_batches_only() -> None:
    images = torch.randint(0, 256, (8, 3, 20, 20), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    mean, std, cpu = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3), torch.device("cpu")
    resized = InputPipeline(mean, std, cpu, augment="resized-crop", image_size=16)
    expected = to_model_input(random_resized_crop_flip(images, torch.Generator().manual_seed(3), 16), mean, std, cpu)
    assert torch.equal(resized(images, torch.Generator().manual_seed(3)), expected)
    assert torch.equal(resized(images), to_model_input(images, mean, std, cpu, 16))  # evaluation: no augmentation
    stored_size = InputPipeline(mean, std, cpu, augment="resized-crop")  # no model size: the stored one
    assert stored_size(images, torch.Generator().manual_seed(3)).shape == (8, 3, 20, 20)
    cropped = InputPipeline(mean, std, cpu, augment="crop-flip", image_size=16)
    expected = to_model_input(random_crop_flip(images, torch.Generator().manual_seed(4)), mean, std, cpu, 16)
    assert torch.equal(cropped(images, torch.Generator().manual_seed(4)), expected)
    plain = InputPipeline(mean, std, cpu)
    assert plain.augment == "none"
    assert torch.equal(plain(images, torch.Generator().manual_seed(4)), to_model_input(images, mean, std, cpu))
    for wrong in ("flip", True):
        with pytest.raises(ValueError, match="unknown augmentation"):
            InputPipeline(mean, std, cpu, augment=wrong)


# ---------------------------------------------------------------- decoding: center crop and channels


@pytest.mark.parametrize(("width", "height", "mode"), [(40, 30, "L"), (30, 47, "RGB"), (17, 50, "L"), (64, 64, "RGB")])
@pytest.mark.parametrize("size", [12, 21])
def test_center_crop_is_torchvisions_resize_and_center_crop(width: int, height: int, mode: str, size: int) -> None:
    rng = np.random.default_rng(width * height)
    shape = (height, width) if mode == "L" else (height, width, 3)
    image = Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode)
    expected = T.CenterCrop(size)(T.Resize(size)(image))
    assert np.array_equal(np.asarray(fit_picture(image, size, "center-crop")), np.asarray(expected))
    squeezed = image.resize((size, size), Image.Resampling.BILINEAR)  # as peradapt decoded before
    assert np.array_equal(np.asarray(fit_picture(image, size, "squeeze")), np.asarray(squeezed))


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PERADAPT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def write_tiny_chexpert(parent: Path, rows: int = 6) -> list[Path]:
    """CheXpert-v1.0-small/train.csv with the five tasks' columns and grey JPEGs of two shapes."""
    rng = np.random.default_rng(3)
    folder = parent / "CheXpert-v1.0-small"
    files, records = [], []
    for index in range(rows):
        relative = f"CheXpert-v1.0-small/train/patient{index:05d}/study1/view1_frontal.jpg"
        shape = (40, 30) if index % 2 else (30, 47)
        (parent / relative).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(parent / relative)
        files.append(parent / relative)
        records.append({"Path": relative, **dict.fromkeys(TASKS, "1.0" if index % 3 else "")})
    with (folder / "train.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, ["Path", *TASKS])
        writer.writeheader()
        writer.writerows(records)
    return files


def authors_pixels(file: Path, size: int, mode: str) -> np.ndarray:
    """The authors' test transform (Resize + CenterCrop) on the file as peradapt opens it (JPEG draft mode)."""
    with Image.open(file) as image:
        image.draft(mode, (size, size))
        return np.asarray(T.CenterCrop(size)(T.Resize(size)(image.convert(mode))))


@pytest.mark.usefixtures("cache_home")
def test_chexpert_decodes_grey_or_as_rgb_squeezed_or_center_cropped(tmp_path: Path) -> None:
    files = write_tiny_chexpert(tmp_path)
    grey = load_source("chexpert", tmp_path, image_size=12)
    assert grey.train.images.shape == (6, 1, 12, 12) and len(grey.mean) == len(grey.std) == 1
    rgb = load_source("chexpert", tmp_path, image_size=12, channels=3)
    assert rgb.train.images.shape == (6, 3, 12, 12) and (rgb.mean, rgb.std) == (IMAGENET_MEAN, IMAGENET_STD)
    assert torch.equal(rgb.train.images, grey.train.images.expand(-1, 3, -1, -1))
    assert torch.equal(rgb.train.labels, grey.train.labels)
    cropped = load_source("chexpert", tmp_path, image_size=12, channels=3, resize="center-crop")
    assert cropped.train.images.shape == (6, 3, 12, 12) and not torch.equal(cropped.train.images, rgb.train.images)
    for file, image in zip(files, cropped.train.images, strict=True):
        expected = authors_pixels(file, 12, "L")
        assert all(np.array_equal(channel.numpy(), expected) for channel in image)


def test_cache_keeps_the_squeezed_entries_and_names_apart_center_crops(tmp_path: Path, cache_home: Path) -> None:
    files = write_tiny_chexpert(tmp_path, rows=3)
    squeezed = decode_images(files, 10, "L", name="chexpert")
    cropped = decode_images(files, 10, "L", name="chexpert", resize="center-crop")
    assert not torch.equal(squeezed, cropped)
    # A squeezed entry keeps the name and key it had before center crops, so caches made then are still read.
    digest = hashlib.sha256(f"v{decode_module.CACHE_VERSION} 10 L\n".encode())
    for file in files:
        stat = file.stat()
        digest.update(f"{file.absolute()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    cache = cache_home / "cache"
    assert sorted(path.name for path in cache.glob("chexpert-10px-L-*.npy")) == [
        f"chexpert-10px-L-{digest.hexdigest()[:20]}.npy"
    ]
    assert len(list(cache.glob("chexpert-10px-center-crop-L-*.npy"))) == 1
    assert torch.equal(decode_images(files, 10, "L", name="chexpert", resize="center-crop"), cropped)
    with pytest.raises(ValueError, match="unknown resize"):
        decode_images(files, 10, "L", name="chexpert", resize="crop")


def test_channel_conversions_keep_statistics_in_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert channel_statistics((0.3,), (0.2,), 3) == ((0.3,) * 3, (0.2,) * 3)
    assert channel_statistics(IMAGENET_MEAN, IMAGENET_STD, 1) == ((sum(IMAGENET_MEAN) / 3,), (sum(IMAGENET_STD) / 3,))
    assert channel_statistics(IMAGENET_MEAN, IMAGENET_STD, 3) == (IMAGENET_MEAN, IMAGENET_STD)
    monkeypatch.setattr("peradapt.data.sources.DEBIAN_FMNIST_DIR", tmp_path / "absent")
    data = write_fmnist_like(tmp_path / "fmnist", num_train=20, num_test=10)
    grey = load_source("fmnist", data)
    rgb = load_source("fmnist", data, channels=3)
    assert rgb.mean == grey.mean * 3 and rgb.std == grey.std * 3  # grey data: its own statistics, repeated
    assert torch.equal(rgb.train.images, grey.train.images.expand(-1, 3, -1, -1))
    assert rgb.test is not None and rgb.test.images.shape == (10, 3, 28, 28)
    assert load_source("fmnist", data, image_size=14, channels=3).train.images.shape == (20, 3, 14, 14)


@pytest.mark.usefixtures("cache_home")
def test_office_home_as_grey_is_the_luma_of_its_rgb(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    for domain in ("Art", "Clipart", "Product", "Real_World"):
        for name in ("Mug", "Pen"):
            (tmp_path / domain / name).mkdir(parents=True)
            Image.fromarray(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)).save(tmp_path / domain / name / "a.png")
    rgb = load_source("office-home", tmp_path, image_size=8, resize="center-crop")
    grey = load_source("office-home", tmp_path, image_size=8, channels=1, resize="center-crop")
    assert (rgb.mean, rgb.std) == (IMAGENET_MEAN, IMAGENET_STD) and len(grey.mean) == 1
    assert torch.equal(grey.train.images, resize_images(rgb.train.images, None, 1))
