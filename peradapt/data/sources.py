"""Named dataset sources, each loaded whole into memory as uint8 image tensors."""

from __future__ import annotations

import functools
import gzip
import re
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from peradapt.data import folders, hfdata
from peradapt.data.chexpert import load_chexpert
from peradapt.data.decode import RESIZES
from peradapt.data.images import ImageSet, Rows, ScannedSource, SourceData
from peradapt.data.missing import NEEDS_NETWORK, download_failed, download_needs_data_dir, either, not_found
from peradapt.data.officehome import load_office_home
from peradapt.data.svhn_stl10 import load_stl10, load_stl10_unlabeled, load_svhn
from peradapt.errors import ConfigError, DataError

if TYPE_CHECKING:
    from torchvision.datasets import CIFAR10

    from peradapt.config import DataConfig

# Where Debian's dataset-fashion-mnist package installs the IDX files (module-level so tests can redirect it).
DEBIAN_FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")

_FMNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
_IDX_UBYTE = 0x08
# Datasets decoded from image files come at this size unless --image-size says otherwise: the 224 px that
# ImageNet-pretrained ResNets (the paper's backbones) were trained at. (imagefolder:PATH and hf:NAME take their
# most common size, up to this: a 32 px set stays 32 px, whatever few larger images it holds.)
DECODED_IMAGE_SIZE = 224
# Sources named by a prefix and what follows it (see peradapt.data.folders and peradapt.data.hfdata).
SOURCE_PATTERNS = ("imagefolder:PATH", "hf:NAME_OR_PATH[:CONFIG]")
_PREFIXED = {"imagefolder": folders.PREFIX, "hf": hfdata.PREFIX}
FMNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)


@dataclass(frozen=True)
class SourceSpec:
    """A source as `load_source` reads it (see there): its name, where its files are, how its images are stored."""

    name: str
    data_dir: Path | str | None = None
    download: bool = False
    image_size: int | None = None
    channels: int | None = None
    resize: str = "squeeze"
    image_column: str | None = None
    label_column: str | None = None
    skip_bad: bool = False

    @classmethod
    def of(cls, data: DataConfig) -> SourceSpec:
        """The source of a run's data section (--data, --data-dir, --image-size, --channels, ...)."""
        options = {"channels": data.channels, "resize": data.resize, "skip_bad": data.skip_bad_images}
        columns = {"image_column": data.image_column, "label_column": data.label_column}
        return cls(data.data, data.data_dir, data.download, data.image_size, **options, **columns)


def load_source(
    name: str, data_dir: Path | str | None, download: bool = False, image_size: int | None = None, **options: Any
) -> SourceData:
    """Load the source called ``name`` (one of ``SOURCE_NAMES``, or ``imagefolder:PATH`` or ``hf:NAME``: see
    SOURCE_PATTERNS), its images stored for a model of ``image_size`` px if given: image files decoded at that
    size, arrays larger than it resized, smaller ones kept (see `fit_images`). Without ``image_size``, arrays keep
    their native size and image files are decoded at DECODED_IMAGE_SIZE (imagefolder and hf: see their modules).
    ``options`` are the other fields of `SourceSpec`: ``image_column`` and ``label_column`` choose an ``hf:``
    dataset's columns (None: detected).

    ``channels`` (None: the dataset's own) converts grey to RGB by repetition and RGB to grey by luma, with the
    normalization statistics to match (`channel_statistics`: ImageNet's per channel for Office-Home and CheXpert,
    the grey ones repeated for grey arrays). ``resize`` is how image files are fitted to the square: ``squeeze``
    (peradapt's default) or ``center-crop`` (the PerAda authors' CheXpert test transform; see
    `peradapt.data.decode`). Arrays are square already, so it leaves them alone. ``skip_bad``: imagefolder and hf
    leave their undecodable images out (``--skip-bad-images``).
    """
    return scan_source(SourceSpec(name, data_dir, download, image_size, **options)).decode(Rows())


def scan_source(spec: SourceSpec) -> ScannedSource:
    """The source of `load_source` before decoding: imagefolder and hf are listed, labeled and counted, to decode
    the rows asked for; the others are loaded whole."""
    name, image_size, channels, resize = spec.name, spec.image_size, spec.channels, spec.resize
    if resize not in RESIZES:
        raise ConfigError(f"unknown resize {resize!r}: use {' or '.join(RESIZES)}")
    kind = source_kind(name)
    if kind == "hf":
        options = {"channels": channels, "resize": resize, "skip_bad": spec.skip_bad}
        columns = {"image_col": spec.image_column, "label_col": spec.label_column}
        return hfdata.scan_hf(name, image_size, DECODED_IMAGE_SIZE, **options, **columns)
    if spec.image_column is not None or spec.label_column is not None:
        raise ConfigError(f"--image-column and --label-column choose the columns of an hf: dataset, not of {name}")
    if kind == "imagefolder":
        return folders.scan_image_folder(
            name, image_size, DECODED_IMAGE_SIZE, channels=channels, resize=resize, skip_bad=spec.skip_bad
        )
    path = None if spec.data_dir is None else Path(spec.data_dir)
    if path is not None and name in _FROM_FILES:
        _check_data_dir(name, path, download=spec.download and name in _LOADERS)
    decoder = _DECODED.get(name)
    if decoder is not None:
        return _whole(decoder(path, image_size or DECODED_IMAGE_SIZE, channels=channels, resize=resize))
    loader = _LOADERS.get(name)
    if loader is None:
        raise ConfigError(f"unknown dataset {name!r}: use one of {', '.join(SOURCE_NAMES + SOURCE_PATTERNS)}")
    source = loader(path, spec.download)
    return _whole(source if image_size is None and channels is None else source.fitted(image_size, channels))


def load_unlabeled(
    name: str, data_dir: Path | str | None, download: bool = False, image_size: int | None = None
) -> SourceData:
    """Every image of `scan_unlabeled`'s source."""
    return scan_unlabeled(name, data_dir, download, image_size).decode(Rows())


def scan_unlabeled(
    name: str,
    data_dir: Path | str | None,
    download: bool = False,
    image_size: int | None = None,
    *,
    skip_bad: bool = False,
) -> ScannedSource:
    """The source ``name`` as unlabeled distillation data, in its ``train`` (labels may be None): STL-10's
    unlabeled split; every image of ``imagefolder:PATH`` and the training split of ``hf:NAME`` without needing
    labels (decoded at ``image_size`` if given, the rows asked for); the training set of the others (see
    `load_source`)."""
    kind = source_kind(name)
    unlabeled = {"channels": None, "resize": "squeeze", "labeled": False, "skip_bad": skip_bad}
    if kind == "imagefolder":
        return folders.scan_image_folder(name, image_size, DECODED_IMAGE_SIZE, **unlabeled)
    if kind == "hf":
        return hfdata.scan_hf(name, image_size, DECODED_IMAGE_SIZE, **unlabeled)
    if name == "stl10":
        path = None if data_dir is None else Path(data_dir)
        if path is not None:
            _check_data_dir(name, path, download=download)
        return _whole(load_stl10_unlabeled(path, download))
    return scan_source(SourceSpec(name, data_dir, download))


def _whole(source: SourceData) -> ScannedSource:
    """A source loaded whole, as a scanned one (`ScannedSource.by_rows` False)."""
    num_test = 0 if source.test is None else len(source.test)
    return ScannedSource(len(source.train), num_test, lambda rows: source, False)


def source_kind(name: str) -> str:
    """``imagefolder`` or ``hf`` for a source named by a prefix (imagefolder:PATH, hf:NAME), else ``name``."""
    return next((kind for kind, prefix in _PREFIXED.items() if name.startswith(prefix)), name)


def is_source_name(name: str) -> bool:
    """Whether ``name`` names a source: one of SOURCE_NAMES, or a prefix of SOURCE_PATTERNS with what follows."""
    return name in SOURCE_NAMES or source_kind(name) != name


def dataset_label(name: str) -> str:
    """Source ``name`` as a part of a file name: a built-in name as it is; ``imagefolder-<folder>`` for
    imagefolder:PATH, ``hf-<name or folder>`` for hf:NAME."""
    kind = source_kind(name)
    if kind == name:
        return re.sub(r"[^A-Za-z0-9._-]+", "_", name)
    rest = name.removeprefix(_PREFIXED[kind]).rstrip("/")
    if kind == "imagefolder" or Path(rest).expanduser().exists():
        rest = Path(rest).expanduser().name
    return f"{kind}-" + (re.sub(r"[^A-Za-z0-9._-]+", "_", rest).strip("_") or "data")


def _check_data_dir(name: str, path: Path, *, download: bool) -> None:
    """A --data-dir must be a directory; one that does not exist yet only with --download, which fills it. (Never
    the system copy of a dataset instead: the user named another place.)"""
    if path.is_dir() or (download and not path.exists()):
        return
    if path.exists():
        raise DataError(f"--data-dir {path} is a file, not a directory: give the directory that holds {name}")
    advice = ["give the directory that holds its files"]
    if name == "fmnist":  # the one source with a system copy
        advice.append("drop --data-dir to use the system copy (`apt-get install dataset-fashion-mnist`)")
    if name in _LOADERS:  # the sources that --download fetches
        advice.append(f"add --download to fetch {name} into it {NEEDS_NETWORK}")
    raise DataError(f"--data-dir {path} does not exist: {either(*advice)}")


def read_idx(path: Path) -> np.ndarray:
    """Read an unsigned-byte IDX file (plain or gzip), as Fashion-MNIST ships; the result is read-only."""
    resolved = Path(path).resolve()
    stat = resolved.stat()
    # Keyed on size and mtime too, so a file replaced on disk is not served stale.
    return _read_idx_cached(resolved, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _read_idx_cached(path: Path, size: int, mtime_ns: int) -> np.ndarray:
    raw = _read_maybe_gzip(path)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != _IDX_UBYTE or raw[3] == 0:
        raise DataError(f"{path} is not an unsigned-byte IDX file (bad magic number); replace it with a good copy")
    ndim = raw[3]
    header_size = 4 + 4 * ndim
    if len(raw) < header_size:
        raise DataError(f"{path} is truncated (incomplete IDX header); replace it with a good copy")
    shape = struct.unpack(f">{ndim}I", raw[4:header_size])
    count = int(np.prod(shape))
    if len(raw) - header_size != count:
        raise DataError(
            f"{path} is corrupt: its header promises {count} bytes of data "
            f"but it holds {len(raw) - header_size}; replace it with a good copy"
        )
    array = np.frombuffer(raw, dtype=np.uint8, offset=header_size).reshape(shape)
    array.flags.writeable = False
    return array


def _read_maybe_gzip(path: Path) -> bytes:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as handle:
                return handle.read()
        return path.read_bytes()
    except (OSError, EOFError, zlib.error) as err:
        raise DataError(f"cannot read {path}: {err}; replace it with a good copy") from err


def _load_fmnist(data_dir: Path | None, download: bool) -> SourceData:
    search_dirs = _fmnist_search_dirs(data_dir)
    files = next((found for found in map(_find_idx_files, search_dirs) if found is not None), None)
    if files is None and download:
        files = _download_fmnist(data_dir)
    if files is None:
        wanted = ", ".join(f"{stem}[.gz]" for stem in _FMNIST_FILES.values())
        raise not_found(
            "Fashion-MNIST",
            wanted,
            data_dir,
            search_dirs,
            by_hand=_FMNIST_BY_HAND,
            alternative=_fmnist_system(data_dir),
        )
    train = _idx_image_set(files["train_images"], files["train_labels"])
    test = _idx_image_set(files["test_images"], files["test_labels"])
    return SourceData(name="fmnist", train=train, test=test, mean=(0.2860,), std=(0.3530,), classes=FMNIST_CLASSES)


def _fmnist_search_dirs(data_dir: Path | None) -> list[Path]:
    """Where Fashion-MNIST's files are looked for: a --data-dir given is the only place (the user named it: the
    system copy in its stead would train on other data without a word), else the system copy."""
    return [DEBIAN_FMNIST_DIR] if data_dir is None else [data_dir, data_dir / "FashionMNIST" / "raw"]


_FMNIST_BY_HAND = "put the four IDX files in {dir}"


def _fmnist_system(data_dir: Path | None) -> str:
    """The remedy of the system copy: installing it, or leaving out the --data-dir that overrides it."""
    if data_dir is None:
        return f"install them in {DEBIAN_FMNIST_DIR} with `apt-get install dataset-fashion-mnist`"
    return f"drop --data-dir to use the system copy in {DEBIAN_FMNIST_DIR} (`apt-get install dataset-fashion-mnist`)"


def _find_idx_files(directory: Path) -> dict[str, Path] | None:
    found = {}
    for key, stem in _FMNIST_FILES.items():
        # Plain files first: they skip decompression.
        candidates = [directory / stem, directory / f"{stem}.gz"]
        existing = [candidate for candidate in candidates if candidate.is_file()]
        if not existing:
            return None
        found[key] = existing[0]
    return found


def _download_fmnist(data_dir: Path | None) -> dict[str, Path] | None:
    if data_dir is None:
        raise download_needs_data_dir("Fashion-MNIST")
    import torchvision  # deferred: importing torchvision costs start-up time that most commands never need

    try:
        torchvision.datasets.FashionMNIST(root=data_dir, train=True, download=True)
    except (RuntimeError, OSError) as err:
        raise download_failed(
            "Fashion-MNIST", data_dir, err, by_hand=_FMNIST_BY_HAND, alternative=_fmnist_system(data_dir)
        ) from err
    return _find_idx_files(data_dir / "FashionMNIST" / "raw")


def _idx_image_set(images_path: Path, labels_path: Path) -> ImageSet:
    images = read_idx(images_path)
    labels = read_idx(labels_path)
    if images.ndim != 3:
        raise DataError(f"{images_path} should hold images [N, H, W], but has shape {list(images.shape)}")
    if labels.ndim != 1 or len(labels) != len(images):
        raise DataError(f"{labels_path} should hold {len(images)} labels to match {images_path}")
    if len(labels) and labels.max() >= 10:
        raise DataError(f"{labels_path} has label {labels.max()}; Fashion-MNIST labels are 0..9")
    # Copies, so that nobody can write through a tensor into the cached arrays.
    return ImageSet(
        images=torch.tensor(images).unsqueeze(1),
        labels=torch.tensor(labels, dtype=torch.int64),
        num_classes=10,
    )


@dataclass(frozen=True)
class _CifarKind:
    class_name: str
    folder: str
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]


_CIFAR_KINDS = {
    "cifar10": _CifarKind("CIFAR10", "cifar-10-batches-py", 10, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": _CifarKind("CIFAR100", "cifar-100-python", 100, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}
# The constants the PerAda authors normalize with where they differ from the data's own (datasets/prepare_data.py
# of NVlabs/PerAda, `_get_transform`): CIFAR-10's std to three decimals, CIFAR-100's mean and std off in the fourth,
# and STL-10 normalized with those CIFAR-100 constants. `--normalization-constants authors`.
_AUTHORS_CIFAR100 = ((0.5071, 0.4867, 0.4408), (0.2675, 0.2565, 0.2761))
_AUTHORS_STATISTICS = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.247, 0.243, 0.261)),
    "cifar100": _AUTHORS_CIFAR100,
    "stl10": _AUTHORS_CIFAR100,
}


def normalization_statistics(source: SourceData, constants: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The mean and std that ``source`` is normalized with: its own (``exact``), or with ``authors`` the PerAda
    authors' constants for the sources they normalize otherwise."""
    if constants == "authors" and source.name in _AUTHORS_STATISTICS:
        return _AUTHORS_STATISTICS[source.name]
    return source.mean, source.std


def _load_cifar(name: str, data_dir: Path | None, download: bool) -> SourceData:
    kind = _CIFAR_KINDS[name]
    import torchvision  # deferred: importing torchvision costs start-up time that most commands never need

    dataset_class = getattr(torchvision.datasets, kind.class_name)
    by_hand = f"extract {dataset_class.url} into {{dir}}"
    if data_dir is None or not (download or (data_dir / kind.folder).is_dir()):
        raise not_found(name, f"{kind.folder}/", data_dir, by_hand=by_hand, download=download)
    try:
        # torchvision verifies the md5 of every file, which protects runs from damaged user data.
        splits = [dataset_class(root=data_dir, train=train, download=download) for train in (True, False)]
    except (RuntimeError, OSError) as err:
        if download:
            raise download_failed(name, data_dir, err, by_hand=by_hand) from err
        raise DataError(
            f"{name} not found or corrupted in {data_dir / kind.folder}/ (a file is missing or fails its md5 "
            f"check): {by_hand.format(dir=f'--data-dir {data_dir}')} again, or delete {kind.folder}/ and add "
            f"--download to fetch {name} there {NEEDS_NETWORK}"
        ) from err
    train, test = (_cifar_image_set(split, kind.num_classes) for split in splits)
    classes = tuple(getattr(splits[0], "classes", ()))
    return SourceData(name=name, train=train, test=test, mean=kind.mean, std=kind.std, classes=classes)


def _cifar_image_set(dataset: CIFAR10, num_classes: int) -> ImageSet:
    images = torch.from_numpy(np.ascontiguousarray(dataset.data)).permute(0, 3, 1, 2).contiguous()
    labels = torch.tensor(dataset.targets, dtype=torch.int64)
    return ImageSet(images=images, labels=labels, num_classes=num_classes)


def _load_digits(data_dir: Path | None, download: bool) -> SourceData:
    from sklearn.datasets import (
        load_digits,
    )  # deferred: sklearn is slow to import and only this source needs it

    digits = load_digits()
    # Pixel values are 0..16; stretch them to the 0..255 range of every other source.
    pixels = np.rint(digits.images * (255.0 / 16.0)).astype(np.uint8)
    images = torch.from_numpy(pixels).unsqueeze(1)
    labels = torch.as_tensor(digits.target, dtype=torch.int64)
    scaled = pixels.astype(np.float64) / 255.0
    return SourceData(
        name="digits",
        train=ImageSet(images=images, labels=labels, num_classes=10),
        test=None,
        mean=(float(scaled.mean()),),
        std=(float(scaled.std()),),
        classes=tuple(str(digit) for digit in range(10)),
    )


_LOADERS: dict[str, Callable[[Path | None, bool], SourceData]] = {
    "fmnist": _load_fmnist,
    "cifar10": functools.partial(_load_cifar, "cifar10"),
    "cifar100": functools.partial(_load_cifar, "cifar100"),
    "digits": _load_digits,
    "svhn": load_svhn,
    "stl10": load_stl10,
}


class _Decoder(Protocol):
    def __call__(self, data_dir: Path | None, image_size: int, *, channels: int | None, resize: str) -> SourceData: ...


# Decoded from image files at a given size; no download: their loaders say where to get them.
_DECODED: dict[str, _Decoder] = {
    "office-home": load_office_home,
    "chexpert": load_chexpert,
}
SOURCE_NAMES: tuple[str, ...] = (*_LOADERS, *_DECODED)
# read from --data-dir (digits: sklearn's copy)
_FROM_FILES = ("fmnist", "cifar10", "cifar100", "svhn", "stl10", *_DECODED)
