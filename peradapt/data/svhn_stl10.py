"""SVHN and STL-10 in torchvision's on-disk layout under ``--data-dir`` (``--download`` fetches them with torchvision).

- ``svhn`` (Netzer et al. 2011): ``DIR/train_32x32.mat`` and ``DIR/test_32x32.mat`` (73,257 and 26,032 digits,
  32 px RGB; the 531,131 ``extra`` images are not used). Label 10 is the digit 0, as torchvision reads it.
- ``stl10`` (Coates et al. 2011): ``DIR/stl10_binary/`` with ``train_X.bin``/``train_y.bin`` (5,000 labeled
  images), ``test_X.bin``/``test_y.bin`` (8,000) and ``unlabeled_X.bin`` (100,000 unlabeled images), 96 px RGB.
  Its unlabeled split is what the PerAda authors' code distills on: ``--kd-data stl10`` takes it (memory-mapped,
  so only the images a run uses are read).

torchvision's SVHN and STL10 classes verify the md5 of every file, which would make a file written by a test (or a
re-packed copy) unreadable: the files are read here directly, checked for shape and labels; torchvision only
downloads. Both are normalized with their own per-channel statistics, computed over the training images.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from peradapt.data.images import ImageSet, SourceData
from peradapt.data.missing import download_failed, not_found
from peradapt.errors import DataError

SVHN_FILES = {"train": "train_32x32.mat", "test": "test_32x32.mat"}
SVHN_CLASSES = tuple(str(digit) for digit in range(10))
STL10_FOLDER = "stl10_binary"
STL10_CLASSES = ("airplane", "bird", "car", "cat", "deer", "dog", "horse", "monkey", "ship", "truck")
_STL10_LABELED = ("train_X.bin", "train_y.bin", "test_X.bin", "test_y.bin")
LABELS = {"svhn": "SVHN", "stl10": "STL-10"}
# How to get each source's files into a directory `{dir}` without --download.
BY_HAND = {
    "svhn": "put them in {dir} (from http://ufldl.stanford.edu/housenumbers/)",
    "stl10": "extract stl10_binary.tar.gz from https://cs.stanford.edu/~acoates/stl10/ into {dir}",
}
_STL10_SIDE = 96
_STL10_IMAGE_BYTES = 3 * _STL10_SIDE * _STL10_SIDE
_STATS_CHUNK = 4096


def load_svhn(data_dir: Path | None, download: bool) -> SourceData:
    """SVHN's training and test digits, uint8 ``[N, 3, 32, 32]``, labels 0..9."""
    if data_dir is None:
        wanted = " and ".join(SVHN_FILES.values())
        raise not_found(LABELS["svhn"], wanted, None, by_hand=BY_HAND["svhn"], download=download)
    missing = [split for split, file in SVHN_FILES.items() if not (data_dir / file).is_file()]
    if missing and download:
        import torchvision  # deferred: importing torchvision costs start-up time that most commands never need

        for split in missing:
            _fetch(
                "svhn",
                data_dir,
                functools.partial(torchvision.datasets.SVHN, root=data_dir, split=split, download=True),
            )
    _, missing = missing_labeled("svhn", data_dir)
    if missing:
        raise not_found(LABELS["svhn"], " or ".join(missing), data_dir, by_hand=BY_HAND["svhn"])
    train, test = (_svhn_split(data_dir / SVHN_FILES[split]) for split in ("train", "test"))
    mean, std = channel_stats(train.images)
    return SourceData("svhn", train, test, mean, std, classes=SVHN_CLASSES)


def _svhn_split(path: Path) -> ImageSet:
    from scipy.io import loadmat  # deferred: only this source reads MATLAB files

    try:
        contents = loadmat(path, variable_names=["X", "y"])
    except (OSError, ValueError, TypeError, NotImplementedError) as err:
        raise DataError(
            f"cannot read {path} ({err}); replace it with a good copy (or delete it and add --download)"
        ) from err
    images, labels = contents.get("X"), contents.get("y")
    if images is None or labels is None or images.ndim != 4 or images.shape[2] != 3 or images.dtype != np.uint8:
        raise DataError(f"{path} is not an SVHN file (uint8 X [H, W, 3, N], y [N, 1]); replace it with a good copy")
    labels = np.asarray(labels).reshape(-1).astype(np.int64)
    if len(labels) != images.shape[3] or (len(labels) and (labels.min() < 1 or labels.max() > 10)):
        raise DataError(f"{path} should hold one label 1..10 per image; replace it with a good copy")
    # MATLAB's [H, W, C, N] as [N, C, H, W]; label 10 is the digit 0.
    pixels = torch.from_numpy(np.ascontiguousarray(images.transpose(3, 2, 0, 1)))
    return ImageSet(pixels, torch.from_numpy(labels % 10), len(SVHN_CLASSES))


def load_stl10(data_dir: Path | None, download: bool) -> SourceData:
    """STL-10's labeled training and test images, uint8 ``[N, 3, 96, 96]``, labels 0..9."""
    folder = _stl10_folder(data_dir, download, _STL10_LABELED)
    train, test = (_stl10_labeled(folder, split) for split in ("train", "test"))
    mean, std = channel_stats(train.images)
    return SourceData("stl10", train, test, mean, std, classes=_stl10_classes(folder))


def load_stl10_unlabeled(data_dir: Path | None, download: bool) -> SourceData:
    """STL-10's 100,000 unlabeled images as the training set of a source (labels None), memory-mapped, with the
    labeled training images' statistics."""
    folder = _stl10_folder(data_dir, download, ("train_X.bin", "unlabeled_X.bin"))
    images = _stl10_images(folder / "unlabeled_X.bin", mapped=True)
    mean, std = channel_stats(_stl10_images(folder / "train_X.bin"))
    return SourceData("stl10", ImageSet(images, None, 10), None, mean, std, classes=_stl10_classes(folder))


def _stl10_folder(data_dir: Path | None, download: bool, files: tuple[str, ...]) -> Path:
    if data_dir is None:
        raise not_found(LABELS["stl10"], f"{STL10_FOLDER}/", None, by_hand=BY_HAND["stl10"], download=download)
    folder = data_dir / STL10_FOLDER
    if download and not all((folder / file).is_file() for file in files):
        import torchvision  # deferred: importing torchvision costs start-up time that most commands never need

        _fetch(
            "stl10",
            data_dir,
            functools.partial(torchvision.datasets.STL10, root=data_dir, split="train", download=True),
        )
    missing = [file for file in files if not (folder / file).is_file()]
    if missing:
        raise not_found(LABELS["stl10"], ", ".join(missing), data_dir, [folder], by_hand=BY_HAND["stl10"])
    return folder


def missing_labeled(kind: str, data_dir: Path) -> tuple[Path, list[str]]:
    """Where source `kind` (svhn or stl10) reads its labeled training and test files under `data_dir`, and which of
    them are not there."""
    folder, files = (
        (data_dir, tuple(SVHN_FILES.values())) if kind == "svhn" else (data_dir / STL10_FOLDER, _STL10_LABELED)
    )
    return folder, [file for file in files if not (folder / file).is_file()]


def _fetch(name: str, data_dir: Path, download) -> None:
    try:
        download()
    except (RuntimeError, OSError) as err:
        raise download_failed(LABELS[name], data_dir, err, by_hand=BY_HAND[name]) from err


def _stl10_labeled(folder: Path, split: str) -> ImageSet:
    images = _stl10_images(folder / f"{split}_X.bin")
    path = folder / f"{split}_y.bin"
    try:
        labels = np.fromfile(path, dtype=np.uint8).astype(np.int64) - 1  # stored 1..10
    except OSError as err:
        raise DataError(f"cannot read {path} ({err}); replace it with a good copy") from err
    if len(labels) != len(images) or (len(labels) and (labels.min() < 0 or labels.max() > 9)):
        raise DataError(
            f"{path} should hold one label 1..10 for each of the {len(images)} images of {split}_X.bin; replace it "
            "with a good copy"
        )
    return ImageSet(images.contiguous(), torch.from_numpy(labels), len(STL10_CLASSES))


def _stl10_images(path: Path, *, mapped: bool = False) -> torch.Tensor:
    """uint8 ``[N, 3, 96, 96]`` of an STL-10 ``*_X.bin`` file (each image stored channel by channel, column-major)."""
    try:
        size = path.stat().st_size
        if size % _STL10_IMAGE_BYTES:
            raise DataError(
                f"{path} is not an STL-10 image file ({size} bytes, not a multiple of {_STL10_IMAGE_BYTES}); "
                "replace it with a good copy"
            )
        # Copy-on-write mapping: writable tensors, and only the images indexed are read from disk.
        raw = np.memmap(path, dtype=np.uint8, mode="c") if mapped and size else np.fromfile(path, dtype=np.uint8)
    except OSError as err:
        raise DataError(f"cannot read {path} ({err}); replace it with a good copy") from err
    images = raw.reshape(-1, 3, _STL10_SIDE, _STL10_SIDE).transpose(0, 1, 3, 2)
    return torch.from_numpy(images)


def _stl10_classes(folder: Path) -> tuple[str, ...]:
    try:
        names = tuple(line.strip() for line in (folder / "class_names.txt").read_text().splitlines() if line.strip())
    except (OSError, UnicodeDecodeError):
        return STL10_CLASSES
    return names if len(names) == len(STL10_CLASSES) else STL10_CLASSES


def channel_stats(images: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of uint8 ``[N, C, H, W]`` images, in 0..1."""
    channels = images.shape[1]
    total = torch.zeros(channels, dtype=torch.float64)
    squares = torch.zeros(channels, dtype=torch.float64)
    for chunk in images.split(_STATS_CHUNK):
        pixels = chunk.to(torch.float64) / 255.0
        total += pixels.sum(dim=(0, 2, 3))
        squares += (pixels * pixels).sum(dim=(0, 2, 3))
    count = max(1, images.numel() // max(1, channels))
    mean = total / count
    std = (squares / count - mean * mean).clamp_min(1e-12).sqrt()
    return tuple(float(m) for m in mean), tuple(float(s) for s in std)
