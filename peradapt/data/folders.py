"""``--data imagefolder:PATH``: any image-classification data kept as one folder of images per class.

Layouts:

- ``PATH/<class>/<images>``: one folder. The fixed split (`peradapt.data.federation`) carves the test images from it,
  with the server's validation images and an unlabeled distillation split.
- ``PATH/train/<class>/`` with ``PATH/test/<class>/`` (or ``val/`` or ``validation/``): a train/test pair. The
  test folders' classes must be among the training folders'; a class may lack test images.

Class folders sorted by name give the class indices. Image files (.png, .jpg, ...) are read anywhere inside a class
folder; other files and hidden folders are skipped. As unlabeled distillation data (``--kd-data``), every image
under PATH counts (under ``PATH/train/`` for a pair), in class folders or not.

Images are decoded once and cached like Office-Home's (`peradapt.data.decode.decode_pictures`, keyed by every
file's path, size and modification time: a changed folder is decoded again): grey when every image is grey, else
RGB; at ``--image-size`` px, by default the images' own side when all are squares of one side up to 224 px, else
224 px; normalized with ImageNet's statistics, as the paper's backbones expect.
"""

from __future__ import annotations

from pathlib import Path

import torch

from peradapt.data.decode import decode_pictures, files_key
from peradapt.data.images import IMAGENET_MEAN, IMAGENET_STD, ImageSet, SourceData, channel_statistics, resize_images
from peradapt.errors import ConfigError, DataError

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


def load_image_folder(
    name: str, image_size: int | None, default_size: int, *, channels: int | None, resize: str, labeled: bool = True
) -> SourceData:
    """Source ``imagefolder:PATH`` decoded at ``image_size`` px (None: see the module's notes), with ``channels``
    channels (None: the images' own); ``labeled=False`` gives every image, unlabeled (distillation data)."""
    path = folder_path(name)
    train_root, test_root = folder_layout(path, name)
    if not labeled:
        files = image_files(train_root)
        if not files:
            raise DataError(f"{name}: no image files ({', '.join(sorted(IMAGE_SUFFIXES))}) under {train_root}")
        images = decode_files(files, image_size, default_size, resize)
        return decoded_source(name, (images, None), None, (), channels)
    classes = class_folders(train_root, name)
    train_files, train_labels = labeled_files(train_root, classes, name)
    train = decode_files(train_files, image_size, default_size, resize)
    test = None
    if test_root is not None:
        extra = sorted(set(class_folders(test_root, name, allow_empty=True)) - set(classes))
        if extra:
            raise DataError(
                f"{name}: {test_root} has class folder(s) {', '.join(extra)} that {train_root} lacks: the test "
                "classes must be among the training classes"
            )
        present = tuple(c for c in classes if (test_root / c).is_dir())
        test_files, test_labels = labeled_files(test_root, present, name, indices=[classes.index(c) for c in present])
        if test_files:  # decoded like the training images, so that both come at one size
            test = (decode_files(test_files, train.shape[-1], default_size, resize), test_labels)
    return decoded_source(name, (train, train_labels), test, classes, channels)


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
                f"{name}: class folder {root / folder} holds no image files ({', '.join(sorted(IMAGE_SUFFIXES))}); "
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


def decode_files(files: list[Path], size: int | None, default_size: int, resize: str) -> torch.Tensor:
    key = files_key(files)
    return decode_pictures(
        len(files), lambda: files, name="imagefolder", key=key, size=size, default_size=default_size, resize=resize
    )


def decoded_source(
    name: str,
    train: tuple[torch.Tensor, torch.Tensor | None],
    test: tuple[torch.Tensor, torch.Tensor] | None,
    classes: tuple[str, ...],
    channels: int | None,
) -> SourceData:
    """A source of decoded images (uint8 arrays with labels): both splits with ``channels`` channels (None: the
    training images' own), normalized with ImageNet's statistics; unlabeled when the training labels are None."""
    channels = channels or train[0].shape[1]

    def image_set(images: torch.Tensor, labels: torch.Tensor | None) -> ImageSet:
        return ImageSet(resize_images(images, None, channels), labels, len(classes))

    mean, std = channel_statistics(IMAGENET_MEAN, IMAGENET_STD, channels)
    test_set = None if test is None else image_set(*test)
    return SourceData(name, image_set(*train), test_set, mean, std, classes=classes)
