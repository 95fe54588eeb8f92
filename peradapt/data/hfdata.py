"""``--data hf:NAME_OR_PATH[:CONFIG]``: an image-classification dataset read with Hugging Face ``datasets``.

NAME_OR_PATH is a ``save_to_disk`` directory (``load_from_disk``), a parquet file, a directory of parquet files or
of class folders (``datasets`` picks its parquet or imagefolder builder, and the splits from the file and folder
names), or a dataset on the Hugging Face Hub (``load_dataset(NAME, CONFIG)``: a network the first time, then the
local Hugging Face cache serves it, also offline with ``HF_HUB_OFFLINE=1``). ``datasets`` is the optional extra
``peradapt[hf-data]``.

Columns: the images are the dataset's one Image feature (``--image-column`` names another, or a column of image
file paths or encoded bytes); the labels its one ClassLabel feature, else a column named label, labels,
fine_label, ... (``--label-column``: a ClassLabel, whole numbers 0..K-1, or strings, whose sorted values give the
class indices).

Splits: ``train`` (or the dataset's only split) trains; ``test``, else ``validation``, tests. Without a test split
the fixed split carves one, as for ``imagefolder:PATH``. The columns, labels and row counts are read before any
image is decoded (`scan_hf`), so that ``--limit-samples`` decodes only the rows a run uses. Images are decoded once,
as there (`peradapt.data.decode.decode_pictures`: the most common size by default, undecodable rows reported
together or left out with ``--skip-bad-images``), keyed by the dataset's fingerprint, split, image column and
decoded rows, and for a local dataset every file's path, size and modification time; nothing is read from
``datasets`` per batch. Inputs are normalized with the training images' own statistics where the backbone's
weights do not bring theirs.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from peradapt.data.decode import (
    REPLACE_REMEDY,
    SKIP_REMEDY,
    Picture,
    bad_pictures_note,
    decode_pictures,
    files_key,
    find_bad_pictures,
)
from peradapt.data.folders import decoded_source
from peradapt.data.images import ImageSet, Rows, ScannedSource, SourceData
from peradapt.errors import ConfigError, DataError
from peradapt.progress import text_console

PREFIX = "hf:"
INSTALL_HINT = "pip install 'peradapt[hf-data]'"
TEST_SPLITS = ("test", "validation", "valid", "val")
# Columns taken for labels without --label-column when no ClassLabel feature says which, in this order.
LABEL_NAMES = ("label", "labels", "fine_label", "fine_labels", "class", "target", "category", "y")
IMAGE_NAMES = ("image", "img", "images", "picture")  # preferred when a dataset has several Image features
_READ_ROWS = 1024  # image column rows read from arrow at a time


@dataclass(frozen=True)
class HfDataset:
    """An opened ``hf:`` dataset: its splits (``datasets.Dataset``) and what identifies its content."""

    name: str
    splits: dict[str, Any]
    key: str

    def split_names(self) -> tuple[str, str | None]:
        """The training split and the test split (None: carved by the fixed split)."""
        names = list(self.splits)
        train = "train" if "train" in self.splits else (names[0] if len(names) == 1 else None)
        if train is None:
            raise DataError(
                f"{self.name} has the splits {', '.join(names)} but none called train: peradapt trains on 'train' "
                "(or a dataset's only split)"
            )
        test = next((s for s in TEST_SPLITS if s in self.splits and s != train and len(self.splits[s])), None)
        return train, test


def datasets_module():  # -> the datasets module
    try:
        import datasets
    except ImportError as err:
        raise DataError(
            f"hf: datasets are read with Hugging Face `datasets`, which is not installed ({err}): {INSTALL_HINT}"
        ) from None
    return datasets


def open_hf(name: str) -> HfDataset:
    """The splits of ``hf:NAME_OR_PATH[:CONFIG]`` (see the module's notes), opened without decoding any image."""
    spec = name.removeprefix(PREFIX)
    if not spec:
        raise ConfigError("hf: needs a dataset: hf:NAME (on the Hub), hf:NAME:CONFIG or hf:PATH (local)")
    path = Path(spec).expanduser()
    if not path.exists():
        head, _, config = spec.rpartition(":")
        if head and Path(head).expanduser().exists():
            raise ConfigError(f"{name}: {head} is a local dataset, which has no configurations: drop ':{config}'")
        if looks_like_path(spec):
            raise DataError(
                f"{name}: {path} does not exist; give a save_to_disk directory, parquet file(s), a folder of class "
                "folders, or a dataset name on the Hugging Face Hub"
            )
    datasets = datasets_module()
    with _quiet(datasets):
        if path.exists():
            loaded = _open_local(datasets, path, name)
            key = f"local {path.resolve()}\n{files_key(_local_files(path))}"
        else:
            hub, _, config = spec.partition(":")
            loaded = _open_hub(datasets, hub, config or None, name)
            key = f"hub {hub} {config}"
    splits = dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
    if not isinstance(loaded, datasets.DatasetDict | datasets.Dataset) or not splits:
        raise DataError(f"{name} is not a dataset of rows (got {type(loaded).__name__}): give a map-style dataset")
    return HfDataset(name, splits, key)


def looks_like_path(spec: str) -> bool:
    """Whether `spec` (what follows hf:) names a local path rather than a Hub dataset, even where nothing is there."""
    return spec.startswith(("/", "~", ".")) or spec.count("/") > 1 or spec.endswith(".parquet")


@contextlib.contextmanager
def _quiet(datasets: Any) -> Iterator[None]:
    """``datasets``' progress bars off while peradapt reads: it shows its own."""
    enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if enabled:
            datasets.enable_progress_bars()


def _open_local(datasets: Any, path: Path, name: str) -> Any:
    try:
        if path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
            return datasets.load_from_disk(str(path))
        if path.is_file():
            if path.suffix.lower() != ".parquet":
                raise DataError(
                    f"{name}: {path} is not a parquet file; give a parquet file, a directory of them, a "
                    "save_to_disk directory or a folder of class folders"
                )
            return datasets.load_dataset("parquet", data_files=str(path))
        return datasets.load_dataset(str(path))
    except (OSError, ValueError, TypeError, datasets.exceptions.DatasetsError) as err:
        raise DataError(
            f"{name}: `datasets` cannot read {path} ({_one_line(err)}); give a save_to_disk directory, parquet "
            "file(s) or a folder of class folders"
        ) from None


def _open_hub(datasets: Any, hub: str, config: str | None, name: str) -> Any:
    try:
        return datasets.load_dataset(hub, config)
    except ConnectionError as err:
        raise DataError(
            f"{name}: cannot reach the Hugging Face Hub ({_one_line(err)}). A Hub dataset needs a network the first "
            "time (later the local Hugging Face cache serves it); offline, copy it here as a save_to_disk "
            "directory or its parquet files and pass hf:PATH"
        ) from None
    except datasets.exceptions.DatasetNotFoundError as err:
        raise DataError(f"{name}: no such dataset on the Hugging Face Hub ({_one_line(err)})") from None
    except (OSError, ValueError, TypeError, datasets.exceptions.DatasetsError) as err:
        raise DataError(f"{name}: `datasets` cannot load {hub} ({_one_line(err)})") from None


def _one_line(err: BaseException) -> str:
    return re.sub(r"\s+", " ", str(err)).strip() or type(err).__name__


def _local_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file() and ".cache" not in p.relative_to(path).parts)


# ---------------------------------------------------------------- columns


def image_column(dataset: HfDataset, split: str, given: str | None) -> str:
    """The column of ``split`` that holds the images: ``given`` (an Image feature, or file paths or encoded bytes),
    else the one Image feature (``image`` or ``img`` among several)."""
    datasets = datasets_module()
    features = dataset.splits[split].features
    if given is not None:
        _check_column(dataset, split, given, "--image-column")
        feature = features[given]
        kinds = ("string", "large_string", "binary", "large_binary")
        if not isinstance(feature, datasets.Image) and getattr(feature, "dtype", None) not in kinds:
            raise DataError(
                f"{dataset.name}: column {given!r} holds {feature}, not images (an Image feature, or image file "
                "paths or encoded bytes): name the image column with --image-column"
            )
        return given
    found = [column for column, feature in features.items() if isinstance(feature, datasets.Image)]
    if len(found) > 1:
        found = [column for column in found if column in IMAGE_NAMES][:1] or found
    if len(found) != 1:
        what = "no image column (Image feature)" if not found else f"several image columns ({', '.join(found)})"
        raise DataError(
            f"{dataset.name} has {what} among its columns {', '.join(features)}: name the one to use with "
            "--image-column"
        )
    return found[0]


def label_column(dataset: HfDataset, split: str, given: str | None) -> str:
    """The column of ``split`` that holds the labels: ``given``, else the one ClassLabel feature, else the first
    of LABEL_NAMES the dataset has."""
    datasets = datasets_module()
    features = dataset.splits[split].features
    if given is not None:
        _check_column(dataset, split, given, "--label-column")
        return given
    found = [column for column, feature in features.items() if isinstance(feature, datasets.ClassLabel)]
    if len(found) > 1:
        found = [column for column in LABEL_NAMES if column in found][:1] or found
    if len(found) == 1:
        return found[0]
    named = [column for column in LABEL_NAMES if column in features]
    if found or not named:
        what = f"several ClassLabel columns ({', '.join(found)})" if found else "no label column"
        raise DataError(
            f"{dataset.name} has {what} among its columns {', '.join(features)} (peradapt looks for a ClassLabel "
            f"or a column named {', '.join(LABEL_NAMES[:3])}, ...): name the one to use with --label-column"
        )
    return named[0]


def _check_column(dataset: HfDataset, split: str, column: str, flag: str) -> None:
    columns = dataset.splits[split].column_names
    if column not in columns:
        raise DataError(
            f"{flag} {column!r}: {dataset.name} (split {split}) has no such column; its columns: {', '.join(columns)}"
        )


def read_labels(dataset: HfDataset, splits: list[str], column: str) -> tuple[list[torch.Tensor], tuple[str, ...]]:
    """The labels of ``splits`` as class indices (-1: none, as a ClassLabel marks a row without one), and the class
    names: a ClassLabel's names, the sorted strings of a string column, or ``0``..``K-1`` for whole numbers."""
    datasets = datasets_module()
    feature = dataset.splits[splits[0]].features[column]
    values = []
    for split in splits:
        _check_column(dataset, split, column, "the label column")
        other = dataset.splits[split].features[column]
        if isinstance(feature, datasets.ClassLabel) and other != feature:
            raise DataError(f"{dataset.name}: the {column!r} classes of split {split} differ from {splits[0]}'s")
        values.append(dataset.splits[split].with_format("arrow")[column].to_pylist())
    every = [value for part in values for value in part if value is not None]
    if isinstance(feature, datasets.ClassLabel):
        names = tuple(feature.names)
    elif every and all(isinstance(value, str) for value in every):
        names = tuple(sorted(set(every)))
        index = {name: i for i, name in enumerate(names)}
        values = [[None if value is None else index[value] for value in part] for part in values]
    elif all(isinstance(value, int) and not isinstance(value, bool) for value in every):
        names = tuple(str(i) for i in range(max(every, default=-1) + 1))
    else:
        raise DataError(
            f"{dataset.name}: label column {column!r} holds {feature}, not one class per image (a ClassLabel, whole "
            "numbers or strings): name another with --label-column"
        )
    return [torch.tensor([-1 if v is None else v for v in part], dtype=torch.int64) for part in values], names


def _check_labeled(dataset: HfDataset, split: str, column: str, labels: torch.Tensor) -> None:
    if len(labels) and labels.min() < 0:
        row = int(torch.nonzero(labels < 0)[0])
        raise DataError(
            f"{dataset.name}: row {row} of split {split} has no label in column {column!r}: give every image a class"
        )


# ---------------------------------------------------------------- images


@dataclass(frozen=True)
class SplitRows:
    """The rows of a split that a source holds (``kept``; None: all ``size`` of them) and their labels (None:
    unlabeled)."""

    split: str
    size: int
    labels: torch.Tensor | None
    kept: np.ndarray | None = None

    def __len__(self) -> int:
        return self.size if self.kept is None else len(self.kept)

    def take(self, rows: np.ndarray | None) -> tuple[np.ndarray | None, torch.Tensor | None]:
        """The split's rows at the source's ``rows`` (None: all it holds), and their labels."""
        labels = self.labels if rows is None or self.labels is None else self.labels[torch.as_tensor(rows)]
        if rows is None:
            return self.kept, labels
        return (rows if self.kept is None else self.kept[rows]), labels


def decode_split(
    dataset: HfDataset,
    split: str,
    column: str,
    rows: np.ndarray | None,
    size: int | None,
    default_size: int,
    resize: str,
    remedy: str = SKIP_REMEDY,
) -> torch.Tensor:
    """uint8 images of ``split``'s ``column`` at ``rows`` (None: every row), decoded once (`decode_pictures`) and
    cached; ``remedy``: what its error about undecodable images advises."""
    chosen = "" if rows is None else f"\nchosen {hashlib.sha256(rows.astype(np.int64).tobytes()).hexdigest()}"
    row = (lambda index: index) if rows is None else (lambda index: int(rows[index]))
    return decode_pictures(
        len(dataset.splits[split]) if rows is None else len(rows),
        lambda: _pictures(dataset, split, column, rows),
        name="hf",
        source=dataset.name,
        key=_split_key(dataset, split, column) + chosen,
        size=size,
        default_size=default_size,
        resize=resize,
        where=lambda index: f"row {row(index)} of split {split}",
        remedy=remedy,
    )


def _split_key(dataset: HfDataset, split: str, column: str) -> str:
    data = dataset.splits[split]
    fingerprint = getattr(data, "_fingerprint", "")
    return f"{dataset.key}\nsplit {split} rows {len(data)} column {column} fingerprint {fingerprint}"


def _pictures(dataset: HfDataset, split: str, column: str, rows: np.ndarray | None) -> list[Picture]:
    view = dataset.splits[split].select_columns([column])
    view = (view if rows is None else view.select(rows)).with_format("arrow")
    pictures: list[Picture] = []
    for start in range(0, len(view), _READ_ROWS):
        for value in view[start : start + _READ_ROWS][column].to_pylist():
            if isinstance(value, dict):  # an Image feature's storage: encoded bytes, or a file's path
                value = value.get("bytes") or value.get("path")
            if not (isinstance(value, bytes | str) and value):
                row = len(pictures) if rows is None else int(rows[len(pictures)])
                raise DataError(f"{dataset.name}: row {row} of split {split} has no image")
            pictures.append(value if isinstance(value, bytes) else Path(value))
    return pictures


def _without_bad_rows(
    dataset: HfDataset, column: str, parts: list[SplitRows]
) -> tuple[list[SplitRows], tuple[str, ...]]:
    """``parts`` without their undecodable rows (`find_bad_pictures`), and those rows' names; a line says which
    were left out."""
    kept, skipped, every = [], [], []
    for part in parts:
        bad = find_bad_pictures(
            part.size,
            lambda part=part: _pictures(dataset, part.split, column, None),
            name="hf",
            key=_split_key(dataset, part.split, column),
            where=lambda row, part=part: f"row {row} of split {part.split}",
        )
        rows = np.setdiff1d(np.arange(part.size), [picture.index for picture in bad]) if bad else None
        labels = part.labels if rows is None or part.labels is None else part.labels[torch.as_tensor(rows)]
        kept.append(SplitRows(part.split, part.size, labels, rows))
        skipped += [picture.name for picture in bad]
        every += bad
    if every:
        text_console(stderr=True).print(
            f"{bad_pictures_note('hf', dataset.name, every)}; left out (--skip-bad-images)", soft_wrap=True
        )
    return kept, tuple(skipped)


def scan_hf(
    name: str,
    image_size: int | None,
    default_size: int,
    *,
    channels: int | None,
    resize: str,
    image_col: str | None = None,
    label_col: str | None = None,
    labeled: bool = True,
    hints: bool = False,
    skip_bad: bool = False,
) -> ScannedSource:
    """Source ``hf:NAME_OR_PATH[:CONFIG]`` opened, its columns found and labels read: its training split and test
    split (None: carved by the fixed split), to be decoded at ``image_size`` px (None: the most common size up to
    ``default_size``) with ``channels`` channels (None: the images' own); ``labeled=False`` gives the training
    split's images unlabeled (distillation data). ``hints``: ``image_col`` and ``label_col`` are taken only where
    the dataset has such columns (a run's columns for data from elsewhere, whose undecodable images only replacing
    them mends), detected otherwise. ``skip_bad``: undecodable rows are left out (and named in a printed line)."""
    dataset = open_hf(name)
    train, test = dataset.split_names()
    if hints:
        image_col, label_col = (_hinted(dataset, train, column) for column in (image_col, label_col))
    images = image_column(dataset, train, image_col)
    classes: tuple[str, ...] = ()
    parts = [SplitRows(train, len(dataset.splits[train]), None)]
    if labeled:
        labels_column = label_column(dataset, train, label_col)
        splits = [train] if test is None else [train, test]
        labels, classes = read_labels(dataset, splits, labels_column)
        if test is not None and len(labels[1]) and bool((labels[1] < 0).all()):
            test = None  # a test split without labels (a benchmark's hidden answers): carved from train instead
        _check_labeled(dataset, train, labels_column, labels[0])
        parts = [SplitRows(train, len(labels[0]), labels[0])]
        if test is not None:
            _check_column(dataset, test, images, "the image column")
            _check_labeled(dataset, test, labels_column, labels[1])
            parts.append(SplitRows(test, len(labels[1]), labels[1]))
    skipped: tuple[str, ...] = ()
    if skip_bad:
        parts, skipped = _without_bad_rows(dataset, images, parts)
    remedy = REPLACE_REMEDY if hints else SKIP_REMEDY

    def decode(rows: Rows) -> SourceData:
        train_rows, train_labels = parts[0].take(rows.train)
        decoded = decode_split(dataset, train, images, train_rows, image_size, default_size, resize, remedy)
        tested = None
        if len(parts) > 1:  # at the training images' size, so that both come at one size
            test_rows, test_labels = parts[1].take(rows.test)
            assert test is not None and test_labels is not None
            tested = (
                decode_split(dataset, test, images, test_rows, decoded.shape[-1], default_size, resize, remedy),
                test_labels,
            )
        return decoded_source(name, (decoded, train_labels), tested, classes, channels, skipped)

    return ScannedSource(len(parts[0]), len(parts[1]) if len(parts) > 1 else 0, decode, True, skipped)


def load_hf(
    name: str,
    image_size: int | None,
    default_size: int,
    *,
    channels: int | None,
    resize: str,
    image_col: str | None = None,
    label_col: str | None = None,
    labeled: bool = True,
    hints: bool = False,
) -> SourceData:
    """Every image of source ``hf:NAME_OR_PATH[:CONFIG]``, decoded (see `scan_hf`)."""
    options = {"image_col": image_col, "label_col": label_col, "labeled": labeled, "hints": hints}
    return scan_hf(name, image_size, default_size, channels=channels, resize=resize, **options).decode(Rows())


def load_hf_split(
    name: str,
    image_size: int,
    *,
    channels: int | None,
    image_col: str | None = None,
    label_col: str | None = None,
) -> tuple[ImageSet, tuple[str, ...], str]:
    """The test split of ``hf:NAME`` (its training split if it has none) at ``image_size`` px, labeled, with its
    class names and the split's name: data from outside a run (OOD sets). ``image_col``, ``label_col``: as the
    ``hints`` of `scan_hf`."""
    dataset = open_hf(name)
    train, test = dataset.split_names()
    split = test or train
    image_col, label_col = (_hinted(dataset, split, column) for column in (image_col, label_col))
    images, labels_column = image_column(dataset, split, image_col), label_column(dataset, split, label_col)
    [labels], classes = read_labels(dataset, [split], labels_column)
    _check_labeled(dataset, split, labels_column, labels)
    decoded = decode_split(dataset, split, images, None, image_size, image_size, "squeeze", REPLACE_REMEDY)
    source = decoded_source(name, (decoded, labels), None, classes, channels)
    return source.train, classes, split


def _hinted(dataset: HfDataset, split: str, column: str | None) -> str | None:
    return column if column in dataset.splits[split].column_names else None
