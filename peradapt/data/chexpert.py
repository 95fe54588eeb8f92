"""CheXpert (Irvin et al. 2019) as PerAda's 5-label task, and its meta-categories for label-skewed federations.

Layout: ``DIR/CheXpert-v1.0-small/train.csv`` (or the full-size ``DIR/CheXpert-v1.0/``), whose ``Path`` column
names each image relative to ``DIR``. Only train.csv is read: its 223,414 radiographs (frontal and lateral) are
what PerAda's Table 6 divides into 180,973 training, 20,099 test and 22,342 validation images, and the fixed
split carves test and validation images from it the same way. valid.csv's 234 images are too few to give
every client a test split and are not used.

Labels follow U-Ones (the paper, after Irvin et al.): uncertain (-1) counts as positive, blank (not mentioned)
as negative.

Images are decoded as grayscale and normalized with the mean of ImageNet's statistics, squeezed whole to the
model's square (peradapt's default). The PerAda authors' code (datasets/chexpert.py) instead opens every
radiograph as RGB (grey in three equal channels) normalized with ImageNet's per-channel statistics
(``channels=3``) at 64 px, resizes the shorter side and center-crops for testing (``resize="center-crop"``), and
trains on random resized crops with flips (``--augment resized-crop``, `peradapt.data.batches`).
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import torch

from peradapt.data.decode import decode_images
from peradapt.data.images import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    Grouping,
    ImageSet,
    SourceData,
    channel_statistics,
    resize_images,
)
from peradapt.errors import DataError

TASKS = ("Cardiomegaly", "Edema", "Consolidation", "Atelectasis", "Pleural Effusion")
# PerAda groups every label combination with fewer training images than this into one meta-category (19 in all).
RARE_COMBINATION_IMAGES = 2000
_FOLDERS = ("CheXpert-v1.0-small", "CheXpert-v1.0")
_LABEL_VALUES = {"": 0.0, "0": 0.0, "0.0": 0.0, "1": 1.0, "1.0": 1.0, "-1": 1.0, "-1.0": 1.0}
_WHERE = (
    "peradapt cannot download it: request CheXpert-v1.0-small from "
    "https://stanfordmlgroup.github.io/competitions/chexpert/ and extract it into DIR"
)


def load_chexpert(
    data_dir: Path | None, image_size: int, *, channels: int | None = None, resize: str = "squeeze"
) -> SourceData:
    """Every image of train.csv with its 5 U-Ones labels and meta-category (``test`` is ``None``), decoded at
    ``image_size`` px as ``resize`` says (see `peradapt.data.decode`), grey (``channels`` None or 1) or grey
    repeated in 3 channels."""
    train_csv = _find_train_csv(data_dir)
    paths, labels = read_labels(train_csv)
    root = train_csv.parent.parent  # the Path column starts with the dataset folder's own name
    grey = decode_images([root / path for path in paths], image_size, "L", name="chexpert", resize=resize)
    channels = channels or 1
    # Decoded grey either way (one cache entry, a third of the bytes): PIL's RGB of a grey radiograph is its grey
    # value in every channel, which is what repeating it gives.
    train = ImageSet(
        images=resize_images(grey, None, channels), labels=torch.from_numpy(labels), num_classes=len(TASKS)
    )
    mean, std = channel_statistics(IMAGENET_MEAN, IMAGENET_STD, channels)
    return SourceData(
        "chexpert",
        train,
        None,
        mean,
        std,
        categories=meta_categories(labels, RARE_COMBINATION_IMAGES),
        classes=TASKS,
    )


def read_labels(train_csv: Path) -> tuple[list[str], np.ndarray]:
    """The ``Path`` column and the float32 ``[N, 5]`` U-Ones labels of TASKS."""
    paths: list[str] = []
    rows: list[list[float]] = []
    try:
        with train_csv.open(newline="") as handle:
            reader = csv.DictReader(handle)
            missing = [column for column in ("Path", *TASKS) if column not in (reader.fieldnames or ())]
            if missing:
                raise DataError(f"{train_csv} lacks the column(s) {', '.join(missing)}: it is not CheXpert's train.csv")
            for line, row in enumerate(reader, start=2):
                paths.append(row["Path"])
                rows.append([_label(row[task], train_csv, line, task) for task in TASKS])
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise DataError(f"cannot read {train_csv}: {err}; replace it with a good copy") from err
    if not paths:
        raise DataError(f"{train_csv} lists no images")
    return paths, np.asarray(rows, dtype=np.float32)


def _label(value: str | None, train_csv: Path, line: int, task: str) -> float:
    label = _LABEL_VALUES.get((value or "").strip())
    if label is None:
        raise DataError(f"{train_csv} line {line}: {task} is {value!r}; CheXpert labels are 1, 0, -1 or blank")
    return label


def meta_categories(labels: np.ndarray, min_images: int) -> Grouping:
    """Each 5-label combination with at least ``min_images`` images is a meta-category (in lexicographic order
    of the combinations); all rarer combinations share one more, the last."""
    combinations, inverse, counts = np.unique(labels.astype(np.int64), axis=0, return_inverse=True, return_counts=True)
    frequent = counts >= min_images
    category = np.where(frequent, np.cumsum(frequent) - 1, frequent.sum())
    names = [_combination_name(combination) for combination in combinations[frequent]]
    if not frequent.all():
        names.append(f"other ({(~frequent).sum()} combinations with fewer than {min_images} images each)")
    return Grouping("meta-categories", category[inverse.reshape(-1)].astype(np.int64), tuple(names))


def _combination_name(combination: np.ndarray) -> str:
    return "+".join(task for task, positive in zip(TASKS, combination, strict=True) if positive) or "none"


def _find_train_csv(data_dir: Path | None) -> Path:
    if data_dir is None:
        raise DataError(f"chexpert needs --data-dir DIR holding CheXpert-v1.0-small/train.csv. {_WHERE}")
    candidates = [data_dir / folder / "train.csv" for folder in _FOLDERS]
    if data_dir.name in _FOLDERS:  # DIR may also be the dataset folder itself
        candidates.insert(0, data_dir / "train.csv")
    found = next((path for path in candidates if path.is_file()), None)
    if found is None:
        looked_for = ", ".join(str(path) for path in candidates)
        raise DataError(f"CheXpert not found: looked for {looked_for}. {_WHERE}")
    return found
