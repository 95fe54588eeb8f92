"""``--data imagefolder:PATH``: any image-classification data kept as one folder of images per class.

Layouts:

- ``PATH/<class>/<images>``: one folder. The fixed split (`peradapt.data.federation`) carves the test images from it,
  with the server's validation images and an unlabeled distillation split.
- ``PATH/train/<class>/`` with ``PATH/test/<class>/`` (or ``val/`` or ``validation/``): a train/test pair. The
  test folders' classes must be among the training folders'; a class may lack test images.

Class folders sorted by name give the class indices and names (a folder name that is not UTF-8 with its other
bytes as ``\\xNN``: `peradapt.data.decode.printable`). Image files (.png, .jpg, ...) are read anywhere inside a
class folder; other files and hidden folders are skipped. As unlabeled distillation data (``--kd-data``), every
image under PATH counts (under ``PATH/train/`` for a pair), in class folders or not.

The files are listed, labeled and counted before any is decoded (`scan_image_folder`), so that checks which need no
pixels come first and ``--limit-samples`` decodes only the images the run uses. Images are decoded once and cached
like Office-Home's (`peradapt.data.decode.decode_pictures`, keyed by every decoded file's path, size and
modification time: a changed folder is decoded again): grey when every image is grey, else RGB; at
``--image-size`` px, by default the most common size among them up to 224 px (printed, with how many it resizes).
Undecodable files are reported together; ``--skip-bad-images`` leaves them out instead, before the fixed split.
Inputs are normalized with the training images' own statistics (`pixel_statistics`) where the backbone's weights
do not bring theirs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from peradapt.data.decode import bad_pictures_note, decode_pictures, files_key, find_bad_pictures, printable
from peradapt.data.images import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ImageSet,
    Rows,
    ScannedSource,
    SourceData,
    channel_statistics,
    pixel_statistics,
    resize_images,
)
from peradapt.errors import ConfigError, DataError
from peradapt.progress import text_console

PREFIX = "imagefolder:"
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm"})
TEST_FOLDERS = ("test", "val", "validation")
_LAYOUTS = "PATH/<class>/<images>, or PATH/train/<class>/ and PATH/test/<class>/"


def folder_path(name: str) -> Path:
    """The directory of source ``imagefolder:PATH``."""
    text = name.removeprefix(PREFIX)
    if not text:
        raise ConfigError(f"imagefolder needs a directory: imagefolder:PATH, with {_LAYOUTS}")
    return Path(text).expanduser()


@dataclass(frozen=True)
class LabeledFiles:
    """Image files with their class indices (None: unlabeled)."""

    files: list[Path]
    labels: torch.Tensor | None

    def take(self, rows: np.ndarray | None) -> LabeledFiles:
        """The files (and labels) at ``rows`` (None: all)."""
        if rows is None:
            return self
        labels = None if self.labels is None else self.labels[torch.as_tensor(rows, dtype=torch.int64)]
        return LabeledFiles([self.files[row] for row in rows], labels)


def scan_image_folder(
    name: str,
    image_size: int | None,
    default_size: int,
    *,
    channels: int | None,
    resize: str,
    labeled: bool = True,
    skip_bad: bool = False,
) -> ScannedSource:
    """Source ``imagefolder:PATH`` listed, labeled and checked, to be decoded at ``image_size`` px (None: see the
    module's notes) with ``channels`` channels (None: the images' own); ``labeled=False`` gives every image,
    unlabeled (distillation data). ``skip_bad``: undecodable files are left out (and named in a printed line)."""
    path = folder_path(name)
    train_root, test_root = folder_layout(path, name)
    classes: tuple[str, ...] = ()
    test = None
    if labeled:
        classes = class_folders(train_root, name)
        train = LabeledFiles(*labeled_files(train_root, classes, name))
        if test_root is not None:
            test = pair_test_files(test_root, train_root, classes, name)
    else:
        train = LabeledFiles(image_files(train_root), None)
        if not train.files:
            raise DataError(f"{name}: no image files ({', '.join(sorted(IMAGE_SUFFIXES))}) under {train_root}")
    skipped: tuple[str, ...] = ()
    if skip_bad:
        train, test, skipped = _without_bad_files(name, path, train, test)

    # The folders' names as printable text (they need not be UTF-8), for config.json, reports and cards.
    class_names = tuple(printable(folder) for folder in classes)

    def decode(rows: Rows) -> SourceData:
        chosen = train.take(rows.train)
        images = decode_files(name, chosen.files, image_size, default_size, resize)
        test_part = None
        if test is not None:  # decoded like the training images, so that both come at one size
            tested = test.take(rows.test)
            test_part = (decode_files(name, tested.files, images.shape[-1], default_size, resize), tested.labels)
        return decoded_source(name, (images, chosen.labels), test_part, class_names, channels, skipped)

    return ScannedSource(len(train.files), 0 if test is None else len(test.files), decode, True, skipped)


def pair_test_files(test_root: Path, train_root: Path, classes: tuple[str, ...], name: str) -> LabeledFiles | None:
    """The test images of a train/test pair with the training classes' indices (None: it holds none)."""
    extra = sorted(set(class_folders(test_root, name, allow_empty=True)) - set(classes))
    if extra:
        raise DataError(
            f"{name}: {test_root} has class folder(s) {printable(', '.join(extra))} that {train_root} lacks: the test "
            "classes must be among the training classes"
        )
    present = tuple(c for c in classes if (test_root / c).is_dir())
    files, labels = labeled_files(test_root, present, name, indices=[classes.index(c) for c in present])
    return LabeledFiles(files, labels) if files else None


def _without_bad_files(
    name: str, path: Path, train: LabeledFiles, test: LabeledFiles | None
) -> tuple[LabeledFiles, LabeledFiles | None, tuple[str, ...]]:
    """``train`` and ``test`` without their undecodable files (`find_bad_pictures`), and those files' paths
    relative to ``path``; a line says which were left out."""
    sets = [train] if test is None else [train, test]
    bad = [
        find_bad_pictures(
            len(files.files),
            lambda files=files: files.files,
            name="imagefolder",
            key=files_key(files.files),
            where=None,
        )
        for files in sets
    ]
    every = [picture for found in bad for picture in found]
    if not every:
        return train, test, ()
    text_console(stderr=True).print(
        f"{bad_pictures_note('imagefolder', name, every)}; left out (--skip-bad-images)", soft_wrap=True
    )
    kept = [
        files.take(np.setdiff1d(np.arange(len(files.files)), [picture.index for picture in found]))
        for files, found in zip(sets, bad, strict=True)
    ]
    skipped = tuple(
        printable(str(files.files[picture.index].relative_to(path)))
        for files, found in zip(sets, bad, strict=True)
        for picture in found
    )
    return kept[0], (kept[1] if test is not None else None), skipped


def folder_layout(path: Path, name: str) -> tuple[Path, Path | None]:
    """The training images' folder and the test images' (None: one folder, its test images carved)."""
    if not path.exists():
        raise DataError(f"{name}: {path} does not exist; give a directory holding {_LAYOUTS}")
    if not path.is_dir():
        raise DataError(f"{name}: {path} is a file, not a directory; give a directory holding {_LAYOUTS}")
    test = next((path / folder for folder in TEST_FOLDERS if (path / folder).is_dir()), None)
    if (path / "train").is_dir() and test is not None:
        return path / "train", test
    return path, None


def class_folders(root: Path, name: str, *, allow_empty: bool = False) -> tuple[str, ...]:
    try:
        classes = tuple(sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")))
    except OSError as err:
        raise DataError(f"{name}: cannot list {root}: {err}") from err
    if not classes and not allow_empty:
        raise DataError(f"{name}: {root} has no class folders; put each class's images in {_LAYOUTS}")
    return classes


def labeled_files(
    root: Path, classes: tuple[str, ...], name: str, indices: list[int] | None = None
) -> tuple[list[Path], torch.Tensor]:
    """Every image file of ``root/<class>/`` in class order, and its class index (``indices``: of each class)."""
    files: list[Path] = []
    labels: list[int] = []
    for position, folder in enumerate(classes):
        found = image_files(root / folder)
        if not found:
            raise DataError(
                f"{name}: class folder {printable(str(root / folder))} holds no image files "
                f"({', '.join(sorted(IMAGE_SUFFIXES))}); "
                "add its images or remove the folder"
            )
        files += found
        labels += [position if indices is None else indices[position]] * len(found)
    return files, torch.tensor(labels, dtype=torch.int64)


def image_files(folder: Path) -> list[Path]:
    """The image files anywhere under ``folder`` (hidden folders skipped), sorted by path."""
    try:
        return sorted(
            p
            for p in folder.rglob("*")
            if p.suffix.lower() in IMAGE_SUFFIXES
            and not any(part.startswith(".") for part in p.relative_to(folder).parts)
            and p.is_file()
        )
    except OSError as err:
        raise DataError(f"cannot list {folder}: {err}") from err


def decode_files(name: str, files: list[Path], size: int | None, default_size: int, resize: str) -> torch.Tensor:
    """The image files of source ``name``, decoded (`decode_pictures`)."""
    key = files_key(files)
    return decode_pictures(
        len(files),
        lambda: files,
        name="imagefolder",
        source=name,
        key=key,
        size=size,
        default_size=default_size,
        resize=resize,
    )


def decoded_source(
    name: str,
    train: tuple[torch.Tensor, torch.Tensor | None],
    test: tuple[torch.Tensor, torch.Tensor] | None,
    classes: tuple[str, ...],
    channels: int | None,
    skipped: tuple[str, ...] = (),
) -> SourceData:
    """A source of decoded images (uint8 arrays with labels): both splits with ``channels`` channels (None: the
    training images' own), with the training images' own statistics (ImageNet's where there are none);
    unlabeled when the training labels are None. ``skipped``: the undecodable images left out."""
    channels = channels or train[0].shape[1]

    def image_set(images: torch.Tensor, labels: torch.Tensor | None) -> ImageSet:
        return ImageSet(resize_images(images, None, channels), labels, len(classes))

    train_set = image_set(*train)
    if len(train_set):
        mean, std = pixel_statistics(train_set.images)
    else:
        mean, std = channel_statistics(IMAGENET_MEAN, IMAGENET_STD, channels)
    test_set = None if test is None else image_set(*test)
    return SourceData(name, train_set, test_set, mean, std, classes=classes, skipped=skipped)
