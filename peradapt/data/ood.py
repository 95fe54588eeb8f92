"""Out-of-distribution test sets for `peradapt eval --ood NAME`, each cut into (corruption, severity) parts.

- ``fmnist-c``: corruptions of the Fashion-MNIST test set generated here, with the formulas and the five
  severity levels of Hendrycks & Dietterich's CIFAR-10-C (``make_cifar_c.py``, ICLR 2019), restricted to the
  types that make sense for grayscale images. Generated once per (source, seed, corruption, image count) and
  cached as ``.npz`` under ``$PERADAPT_HOME/ood/``.
- ``cifar10-c[:PATH]``: the published CIFAR-10-C files, ``<corruption>.npy`` (50,000 × 32 × 32 × 3 uint8:
  severities 1-5 stacked, 10,000 test images each) and ``labels.npy``, in PATH or in the run's data directory
  (``DATA_DIR/CIFAR-10-C/`` or ``DATA_DIR``).
- ``cifar10.1[:PATH]``: CIFAR-10.1 v6, ``cifar10.1_v6_data.npy`` and ``cifar10.1_v6_labels.npy``, in PATH or in
  ``DATA_DIR/CIFAR-10.1/`` (or its ``datasets/`` folder, as the authors' repository has it) or ``DATA_DIR``.
- ``imagefolder:PATH``: ``PATH/<class>/<image files>``, one sub-folder per class, named by the class index
  (``0``, ``1``, ...) or by the class name of the run's dataset (case and punctuation ignored: Fashion-MNIST's
  T-shirt/top, which no folder can be named, as ``T-shirt_top``).
- ``svhn[:PATH]``, ``stl10[:PATH]``: their test images, in torchvision's layout in PATH or the run's data
  directory (see `peradapt.data.svhn_stl10`).
- ``hf:NAME_OR_PATH[:CONFIG]``: the test split of a Hugging Face dataset (its training split if it has none), as
  `peradapt.data.hfdata` reads it; the run's --image-column and --label-column where the dataset has them.

Sets with class names of their own (svhn, stl10, hf) are matched to the run's classes by name (case and
punctuation ignored; CIFAR-10's automobile is STL-10's car); images of classes the run lacks are left out, and
the provenance says which.

Every part comes with the run's channels, stored for the run's image size (``fit_images``: arrays larger than the
model's input resized, smaller ones scaled up batch by batch; image files resized to it).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from peradapt.data.decode import (
    REPLACE_REMEDY,
    BadPicture,
    Undecodable,
    bad_pictures_error,
    file_names,
    large_pictures_quiet,
    pillow_errors,
    printable,
)
from peradapt.data.folders import IMAGE_SUFFIXES
from peradapt.data.hfdata import load_hf_split
from peradapt.data.images import ImageSet, fit_images, resize_images
from peradapt.data.sources import FMNIST_CLASSES, SourceSpec, load_source
from peradapt.data.svhn_stl10 import BY_HAND, missing_labeled
from peradapt.errors import ConfigError, DataError

OOD_NAMES = ("fmnist-c", "cifar10-c", "cifar10.1", "svhn[:PATH]", "stl10[:PATH]", "imagefolder:PATH", "hf:NAME")
SEVERITIES = (1, 2, 3, 4, 5)
# Bumped whenever a formula changes, so that stale cached sets are never served.
_CACHE_VERSION = 1
_IMAGE_SUFFIXES = IMAGE_SUFFIXES
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
CLASS_NAMES: dict[str, tuple[str, ...]] = {"fmnist": FMNIST_CLASSES, "cifar10": CIFAR10_CLASSES}
# Names of one class in different datasets, after `_normalized`.
_ALIASES = {"car": "automobile"}


@dataclass(frozen=True)
class OodPart:
    """One evaluation set: a corruption at one severity (``None`` for sets without severities)."""

    corruption: str
    severity: int | None
    images: ImageSet

    @property
    def key(self) -> str:
        return self.corruption if self.severity is None else f"{self.corruption}-{self.severity}"


@dataclass(frozen=True)
class OodSet:
    """An OOD set's parts, and where its images come from (files read, or how they were generated)."""

    name: str
    provenance: str
    parts: list[OodPart]


@dataclass(frozen=True)
class OodTarget:
    """What the run's models expect of images from outside the run: the source they were trained on (`SourceSpec`:
    its name, files, resizing and hf: columns, used for hf: sets that have them), their input size and channels, and
    their classes."""

    source: SourceSpec
    num_classes: int
    image_size: int
    channels: int
    classes: tuple[str, ...] = ()  # the run's class names (empty: CLASS_NAMES of its dataset, else "0", "1", ...)

    @property
    def data_dir(self) -> Path | None:
        """Where the run's dataset files are (--data-dir), where published OOD sets are looked for too."""
        return None if self.source.data_dir is None else Path(self.source.data_dir)


# ---------------------------------------------------------------- corruptions (Hendrycks & Dietterich)
# Each takes float images in [0, 1] of shape [N, H, W] (grayscale) and a severity 1..5, and returns the
# same shape, unclipped; the parameters are CIFAR-10-C's, whose 32 px images are closest to our 28 px ones.


def _gaussian_noise(x: np.ndarray, severity: int, rng: np.random.Generator) -> np.ndarray:
    c = (0.04, 0.06, 0.08, 0.09, 0.10)[severity - 1]
    return x + rng.normal(size=x.shape, scale=c)


def _shot_noise(x: np.ndarray, severity: int, rng: np.random.Generator) -> np.ndarray:
    c = (500, 250, 100, 75, 50)[severity - 1]
    return rng.poisson(x * c) / c


def _impulse_noise(x: np.ndarray, severity: int, rng: np.random.Generator) -> np.ndarray:
    # skimage.util.random_noise(mode="s&p", amount=c): a fraction c of the pixels, half set to 1, half to 0.
    c = (0.01, 0.02, 0.03, 0.05, 0.07)[severity - 1]
    flipped = rng.random(x.shape) <= c
    salted = rng.random(x.shape) <= 0.5
    out = x.copy()
    out[flipped & salted] = 1.0
    out[flipped & ~salted] = 0.0
    return out


def _speckle_noise(x: np.ndarray, severity: int, rng: np.random.Generator) -> np.ndarray:
    c = (0.06, 0.1, 0.12, 0.16, 0.2)[severity - 1]
    return x + x * rng.normal(size=x.shape, scale=c)


def _gaussian_blur(x: np.ndarray, severity: int, rng: np.random.Generator) -> np.ndarray:
    from scipy.ndimage import gaussian_filter  # deferred: only generation needs scipy (a scikit-learn dependency)

    c = (0.4, 0.6, 0.7, 0.8, 1.0)[severity - 1]
    # skimage.filters.gaussian's defaults: nearest-edge padding, kernel truncated at 4 sigma; no blur across images.
    return gaussian_filter(x, sigma=(0, c, c), mode="nearest", truncate=4.0)


def _contrast(x: np.ndarray, severity: int, rng: np.random.Generator) -> np.ndarray:
    c = (0.75, 0.5, 0.4, 0.3, 0.15)[severity - 1]
    means = x.mean(axis=(1, 2), keepdims=True)
    return (x - means) * c + means


def _brightness(x: np.ndarray, severity: int, rng: np.random.Generator) -> np.ndarray:
    # The reference adds c to the HSV value channel; for a grey pixel the value is the intensity itself.
    c = (0.05, 0.1, 0.15, 0.2, 0.3)[severity - 1]
    return x + c


def _pixelate(x: np.ndarray, severity: int, rng: np.random.Generator) -> np.ndarray:
    from PIL import Image  # deferred: Pillow comes with torchvision, and only generation needs it

    c = (0.95, 0.9, 0.85, 0.75, 0.65)[severity - 1]
    height, width = x.shape[1:]
    small = (int(width * c), int(height * c))
    out = np.empty_like(x)
    for i, image in enumerate(_to_uint8(x)):
        pil = Image.fromarray(image).resize(small, Image.Resampling.BOX).resize((width, height), Image.Resampling.BOX)
        out[i] = np.asarray(pil, dtype=np.float64) / 255.0
    return out


def _jpeg_compression(x: np.ndarray, severity: int, rng: np.random.Generator) -> np.ndarray:
    from PIL import Image  # deferred: Pillow comes with torchvision, and only generation needs it

    quality = (80, 65, 58, 50, 40)[severity - 1]
    out = np.empty_like(x)
    for i, image in enumerate(_to_uint8(x)):
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, "JPEG", quality=quality)
        buffer.seek(0)
        out[i] = np.asarray(Image.open(buffer), dtype=np.float64) / 255.0
    return out


def _zoom_blur(x: np.ndarray, severity: int, rng: np.random.Generator) -> np.ndarray:
    top_zoom = (1.06, 1.11, 1.16, 1.21, 1.26)[severity - 1]
    factors = np.arange(1, top_zoom, 0.01)
    out = np.zeros_like(x)
    for factor in factors:
        out += _clipped_zoom(x, float(factor))
    return (x + out) / (len(factors) + 1)


def _clipped_zoom(x: np.ndarray, factor: float) -> np.ndarray:
    """Zoom into the centre of every image by ``factor`` (bilinear), cropped back to the original size."""
    from scipy.ndimage import zoom  # deferred: only generation needs scipy (a scikit-learn dependency)

    size = x.shape[1]
    crop = int(np.ceil(size / factor))
    top = (size - crop) // 2
    zoomed = zoom(x[:, top : top + crop, top : top + crop], (1, factor, factor), order=1)
    trim = (zoomed.shape[1] - size) // 2
    return zoomed[:, trim : trim + size, trim : trim + size]


def _to_uint8(x: np.ndarray) -> np.ndarray:
    # The reference code stores np.uint8(image * 255), which truncates.
    return (np.clip(x, 0.0, 1.0) * 255).astype(np.uint8)


Corruption = Callable[[np.ndarray, int, np.random.Generator], np.ndarray]
# Colour-only types (saturate), and ones that need textures or masks we do not ship (frost, snow, fog,
# spatter, glass/motion/defocus blur, elastic transform), are left out.
GRAYSCALE_CORRUPTIONS: dict[str, Corruption] = {
    "gaussian_noise": _gaussian_noise,
    "shot_noise": _shot_noise,
    "impulse_noise": _impulse_noise,
    "speckle_noise": _speckle_noise,
    "gaussian_blur": _gaussian_blur,
    "zoom_blur": _zoom_blur,
    "contrast": _contrast,
    "brightness": _brightness,
    "pixelate": _pixelate,
    "jpeg_compression": _jpeg_compression,
}


def corrupt(images: np.ndarray, corruption: str, severity: int, seed: int) -> np.ndarray:
    """``images`` (uint8 ``[N, H, W]``, grayscale) with ``corruption`` at ``severity``, deterministic in ``seed``."""
    function = GRAYSCALE_CORRUPTIONS.get(corruption)
    if function is None:
        raise ConfigError(f"unknown corruption {corruption!r}: use one of {', '.join(GRAYSCALE_CORRUPTIONS)}")
    if severity not in SEVERITIES:
        raise ConfigError(f"corruption severity must be 1..5, got {severity}")
    if images.dtype != np.uint8 or images.ndim != 3:
        raise ValueError(f"images must be uint8 [N, H, W], got {images.dtype} {list(images.shape)}")
    # One independent stream per (seed, corruption, severity): a set never depends on which others were made.
    rng = np.random.default_rng([seed, list(GRAYSCALE_CORRUPTIONS).index(corruption), severity])
    return _to_uint8(function(images.astype(np.float64) / 255.0, severity, rng))


# ---------------------------------------------------------------- sources


def load_ood(
    name: str,
    target: OodTarget,
    *,
    limit: int | None = None,
    seed: int = 0,
    cache_dir: Path | None = None,
    on_generated: Callable[[int], None] | None = None,
) -> OodSet:
    """The parts of OOD set ``name`` in ``target``'s image format; ``limit`` keeps that many images per part.

    ``cache_dir`` is where generated sets are kept (``fmnist-c``, and ``cifar10-c`` without its files); ``None``
    generates them without caching. ``on_generated(k)`` is called as each of the ``k`` corruptions is ready.
    """
    if limit is not None and limit < 1:
        raise ConfigError(f"--ood-limit must be at least 1, got {limit}")
    kind, _, path_text = name.partition(":")
    path = Path(path_text).expanduser() if path_text else None
    if kind == "fmnist-c":
        if path is not None:
            raise ConfigError("fmnist-c is generated from the run's Fashion-MNIST: it takes no path")
        _check_dataset(name, target, "fmnist")
        return _fmnist_c(target, limit, seed, cache_dir, on_generated)
    if kind == "cifar10-c":
        _check_dataset(name, target, "cifar10")
        return _cifar10_c(target, path, limit, seed, cache_dir, on_generated)
    if kind == "cifar10.1":
        _check_dataset(name, target, "cifar10")
        return _cifar10_1(target, path, limit, seed)
    if kind == "imagefolder":
        if path is None:
            raise ConfigError("imagefolder needs a directory: --ood imagefolder:PATH")
        data = load_imagefolder(path, target, limit=limit, seed=seed)
        return OodSet(name, f"images read from {path}", [OodPart("imagefolder", None, data)])
    if kind in ("svhn", "stl10"):
        return _torchvision_set(kind, path, target, limit, seed)
    if kind == "hf":
        columns = {"image_col": target.source.image_column, "label_col": target.source.label_column}
        images, classes, split = load_hf_split(name, target.image_size, channels=target.channels, **columns)
        data, left_out = relabel(images, classes, target, name)
        data = data.subset(_subset_indices(len(data), limit, seed))
        provenance = f"split {split} of {name}{left_out}"
        return OodSet(name, provenance, [OodPart(split, None, _in_run_format(data.images, data.labels, target))])
    raise ConfigError(f"unknown OOD set {name!r}: use one of {', '.join(OOD_NAMES)}")


def _torchvision_set(kind: str, path: Path | None, target: OodTarget, limit: int | None, seed: int) -> OodSet:
    """The test images of svhn or stl10 (in PATH, else the run's data directory), in the run's classes."""
    directory = path or target.data_dir
    if directory is None:
        raise DataError(f"{kind} needs its files: pass --ood {kind}:PATH, or train with --data-dir DIR holding them")
    folder, missing = missing_labeled(kind, directory)  # said here: eval has no --download to offer
    if missing:
        raise DataError(
            f"{kind} not found: no {', '.join(missing)} in {folder}: {BY_HAND[kind].format(dir=directory)}, or pass "
            f"--ood {kind}:PATH holding them"
        )
    source = load_source(kind, directory)
    assert source.test is not None
    data, left_out = relabel(source.test, source.classes, target, kind)
    data = data.subset(_subset_indices(len(data), limit, seed))
    part = OodPart(kind, None, _in_run_format(data.images, data.labels, target))
    return OodSet(kind, f"{kind} test images in {directory}{left_out}", [part])


def run_classes(target: OodTarget) -> tuple[str, ...]:
    """The names of the run's classes: its own, those of its dataset, or its class indices as names."""
    return target.classes or CLASS_NAMES.get(target.source.name) or tuple(str(i) for i in range(target.num_classes))


def class_map(classes: tuple[str, ...], target: OodTarget) -> list[int | None]:
    """For each of a set's class names, the index of the run's class of that name (case and punctuation ignored,
    `_ALIASES` applied), or None."""
    run = [_ALIASES.get(_normalized(name), _normalized(name)) for name in run_classes(target)]
    wanted = [_ALIASES.get(_normalized(name), _normalized(name)) for name in classes]
    return [run.index(name) if name in run else None for name in wanted]


def relabel(
    data: ImageSet, classes: tuple[str, ...], target: OodTarget, name: str, *, strict: bool = False
) -> tuple[ImageSet, str]:
    """``data`` (labels indexing ``classes``) with the run's class indices, and a note naming the classes left out:
    those the run lacks (``strict``: refused)."""
    mapping = class_map(classes, target)
    run = ", ".join(run_classes(target))
    missing = [c for c, index in zip(classes, mapping, strict=True) if index is None]
    if strict and missing:
        raise DataError(f"{name}: class {missing[0]!r} is not a class of this run ({run})")
    if all(index is None for index in mapping):
        raise DataError(f"{name}: none of its classes ({', '.join(classes)}) is a class of this run ({run})")
    assert data.labels is not None
    lookup = torch.tensor([-1 if index is None else index for index in mapping], dtype=torch.int64)
    labels = lookup[data.labels]
    kept = torch.nonzero(labels >= 0).flatten()
    relabeled = ImageSet(data.images[kept], labels[kept], target.num_classes)
    note = (
        f" (left out: {len(data) - len(kept)} images of {', '.join(missing)}, not classes of the run)"
        if missing
        else ""
    )
    return relabeled, note


def _check_dataset(name: str, target: OodTarget, dataset: str) -> None:
    if target.source.name != dataset:
        raise ConfigError(
            f"{name} holds {dataset} classes, but this run was trained on {target.source.name}: "
            "use an OOD set of the run's own classes (e.g. imagefolder:PATH)"
        )


def _subset_indices(count: int, limit: int | None, seed: int) -> np.ndarray:
    """A random subset of ``limit`` of ``count`` images (all of them without a limit), in ascending order."""
    if limit is None or limit >= count:
        return np.arange(count)
    return np.sort(np.random.default_rng([seed, count]).permutation(count)[:limit])


def _in_run_format(images: torch.Tensor, labels: torch.Tensor, target: OodTarget) -> ImageSet:
    return ImageSet(
        images=fit_images(images, target.image_size, target.channels),
        labels=labels.to(torch.int64),
        num_classes=target.num_classes,
    )


def _fmnist_c(
    target: OodTarget,
    limit: int | None,
    seed: int,
    cache_dir: Path | None,
    on_generated: Callable[[int], None] | None,
) -> OodSet:
    test = load_source("fmnist", target.data_dir).test
    assert test is not None
    indices = _subset_indices(len(test), limit, seed)
    clean = test.images[indices, 0].numpy()
    key = _cache_key(f"fmnist-c-v{_CACHE_VERSION}", test.images, indices, seed)
    parts = []
    for corruption in GRAYSCALE_CORRUPTIONS:
        path = None if cache_dir is None else cache_dir / key / f"{corruption}.npz"
        stacked = _cached_corruptions(
            path, clean, lambda severity, corruption=corruption: corrupt(clean, corruption, severity, seed)
        )
        for severity, images in zip(SEVERITIES, stacked, strict=True):
            data = _in_run_format(torch.from_numpy(images).unsqueeze(1), test.labels[indices], target)
            parts.append(OodPart(corruption, severity, data))
        if on_generated is not None:
            on_generated(len(GRAYSCALE_CORRUPTIONS))
    provenance = (
        f"generated here from {len(indices)} Fashion-MNIST test images: {len(GRAYSCALE_CORRUPTIONS)} grayscale "
        "corruptions with CIFAR-10-C's formulas and severities (peradapt's own implementation)"
    )
    return OodSet("fmnist-c", provenance, parts)


def _cache_key(prefix: str, source_images: torch.Tensor, indices: np.ndarray, seed: int) -> str:
    # The key names the source by its content, so another --data-dir never gets this one's images.
    digest = hashlib.sha256()
    digest.update(source_images.numpy().tobytes())
    digest.update(indices.tobytes())
    return f"{prefix}-{digest.hexdigest()[:16]}-seed{seed}"


def _cached_corruptions(path: Path | None, clean: np.ndarray, generate: Callable[[int], np.ndarray]) -> np.ndarray:
    """uint8 ``[5, *clean.shape]``: ``generate(severity)`` for every severity, read from or written to ``path``."""
    expected = (len(SEVERITIES), *clean.shape)
    if path is not None and path.is_file():
        try:
            with np.load(path, allow_pickle=False) as stored:
                images = stored["images"]
            if images.shape == expected and images.dtype == np.uint8:
                return images
        except (OSError, ValueError, KeyError):
            pass  # a damaged cache file is regenerated below
    images = np.stack([generate(severity) for severity in SEVERITIES])
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with tmp.open("wb") as handle:
            np.savez_compressed(handle, images=images)
        os.replace(tmp, path)
    return images


def _search_dirs(path: Path | None, target: OodTarget, subdirs: tuple[str, ...], name: str) -> list[Path]:
    if path is not None:
        return [path, *(path / sub for sub in subdirs)]
    if target.data_dir is None:
        raise DataError(f"{name} needs its files: pass --ood {name}:PATH, or train with --data-dir DIR holding them")
    return [*(target.data_dir / sub for sub in subdirs), target.data_dir]


def _load_npy(path: Path, *, mmap: bool = False) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise DataError(f"cannot read {path}: {err}; replace it with a good copy") from err


def _cifar10_c(
    target: OodTarget,
    path: Path | None,
    limit: int | None,
    seed: int,
    cache_dir: Path | None,
    on_generated: Callable[[int], None] | None,
) -> OodSet:
    dirs = [] if path is None and target.data_dir is None else _search_dirs(path, target, ("CIFAR-10-C",), "cifar10-c")
    directory = next((d for d in dirs if (d / "labels.npy").is_file()), None)
    if directory is not None:
        return _cifar10_c_files(directory, target, limit, seed)
    if path is not None:  # the user named the files: generating something else instead would surprise
        raise DataError(
            f"CIFAR-10-C not found: no labels.npy in {', '.join(str(d) for d in dirs)}. Download CIFAR-10-C.tar "
            "from https://zenodo.org/records/2535967 and extract it there, or leave out the path to generate it "
            "from the CIFAR-10 test set"
        )
    return _generated_cifar10_c(target, limit, seed, cache_dir, on_generated)


def _cifar10_c_files(directory: Path, target: OodTarget, limit: int | None, seed: int) -> OodSet:
    files = sorted(p for p in directory.glob("*.npy") if p.name != "labels.npy")
    if not files:
        raise DataError(f"{directory} has labels.npy but no <corruption>.npy files; extract all of CIFAR-10-C there")
    labels = _load_npy(directory / "labels.npy")
    per_severity = len(labels) // len(SEVERITIES)
    if labels.ndim != 1 or per_severity == 0 or len(labels) % len(SEVERITIES):
        raise DataError(f"{directory / 'labels.npy'} should hold 5 stacked severities of labels, has {labels.shape}")
    indices = _subset_indices(per_severity, limit, seed)
    parts = []
    for file in files:
        stacked = _load_npy(file, mmap=True)
        if stacked.shape[:1] != labels.shape or stacked.ndim != 4 or stacked.shape[-1] != 3:
            raise DataError(
                f"{file} should hold {len(labels)} images [N, H, W, 3] to match labels.npy, has {list(stacked.shape)}"
            )
        for severity in SEVERITIES:
            chosen = (severity - 1) * per_severity + indices
            images = torch.from_numpy(np.ascontiguousarray(stacked[chosen], dtype=np.uint8)).permute(0, 3, 1, 2)
            data = _in_run_format(images, _labels(labels[chosen], target, file), target)
            parts.append(OodPart(file.stem, severity, data))
    return OodSet("cifar10-c", f"published CIFAR-10-C files in {directory}", parts)


def _generated_cifar10_c(
    target: OodTarget,
    limit: int | None,
    seed: int,
    cache_dir: Path | None,
    on_generated: Callable[[int], None] | None,
) -> OodSet:
    """The 15 + 4 CIFAR-10-C corruption types at 5 severities, made from the CIFAR-10 test set with imagecorruptions."""
    library = _imagecorruptions()
    test = load_source("cifar10", target.data_dir).test
    assert test is not None
    indices = _subset_indices(len(test), limit, seed)
    clean = test.images[indices].permute(0, 2, 3, 1).numpy()  # imagecorruptions takes [H, W, 3] images
    names = library.get_corruption_names("all")
    key = _cache_key(f"cifar10-c-imagecorruptions{library_version()}", test.images, indices, seed)
    parts = []
    for number, corruption in enumerate(names):
        path = None if cache_dir is None else cache_dir / key / f"{corruption}.npz"
        stacked = _cached_corruptions(
            path,
            clean,
            lambda severity, corruption=corruption, number=number: _library_corrupt(
                library, clean, corruption, severity, [seed, number, severity]
            ),
        )
        for severity, images in zip(SEVERITIES, stacked, strict=True):
            data = _in_run_format(torch.from_numpy(images).permute(0, 3, 1, 2), test.labels[indices], target)
            parts.append(OodPart(corruption, severity, data))
        if on_generated is not None:
            on_generated(len(names))
    provenance = (
        f"generated here from {len(indices)} CIFAR-10 test images with imagecorruptions {library_version()} "
        f"({len(names)} corruptions, ImageNet-C severities: harsher than the published CIFAR-10-C files, so "
        "compare such numbers only with each other)"
    )
    return OodSet("cifar10-c", provenance, parts)


def library_version() -> str:
    from importlib.metadata import version

    return version("imagecorruptions")


def _imagecorruptions():  # -> the imagecorruptions module
    """imagecorruptions, adapted to today's scikit-image and NumPy, and made reproducible.

    The PyPI release (1.1.2) still passes ``multichannel=`` to ``skimage.filters.gaussian`` (removed in
    scikit-image 0.21) and uses ``np.float_`` (removed in NumPy 2) in three corruptions; upstream fixed both in
    bethgelab/imagecorruptions#23 and #26 without a release. Its impulse noise calls ``skimage.util.random_noise``,
    which since scikit-image 0.19 draws from a fresh unseeded generator: here it gets one seeded from NumPy's
    global generator, like every other corruption of the library. These names are redirected inside that module
    only.
    """
    import warnings

    try:
        with warnings.catch_warnings():  # it imports pkg_resources, which warns on every import
            warnings.simplefilter("ignore")
            import imagecorruptions
            from imagecorruptions import corruptions
    except ImportError as err:
        raise DataError(  # its OpenCV also fails to import without the system's libGL: say what failed
            f"CIFAR-10-C files not found, and generating them needs imagecorruptions, which did not import ({err}): "
            "pip install 'peradapt[corruptions]' (or put the published files in --data-dir/CIFAR-10-C/)"
        ) from err
    import skimage
    from skimage.filters import gaussian

    def gaussian_with_multichannel(image: np.ndarray, sigma: float, multichannel: bool = False, **kwargs):
        return gaussian(image, sigma=sigma, channel_axis=-1 if multichannel else None, **kwargs)

    def seeded_random_noise(image: np.ndarray, **kwargs) -> np.ndarray:
        return skimage.util.random_noise(image, rng=int(np.random.randint(2**31)), **kwargs)

    corruptions.gaussian = gaussian_with_multichannel
    corruptions.np = _ModuleWith(np, float_=np.float64)
    corruptions.sk = _ModuleWith(skimage, util=_ModuleWith(skimage.util, random_noise=seeded_random_noise))
    return imagecorruptions


class _ModuleWith:
    """A module seen through a few replaced attributes."""

    def __init__(self, module: object, **replaced: object) -> None:
        self._module = module
        self.__dict__.update(replaced)

    def __getattr__(self, name: str) -> object:
        return getattr(self._module, name)


def _library_corrupt(library, images: np.ndarray, corruption: str, severity: int, seed: list[int]) -> np.ndarray:
    """imagecorruptions' ``corruption`` of every image, deterministic in ``seed``.

    The library draws from NumPy's global generator: it is seeded here and restored afterwards.
    """
    state = np.random.get_state()
    np.random.seed(np.random.SeedSequence(seed).generate_state(1))
    try:
        return np.stack([library.corrupt(image, severity=severity, corruption_name=corruption) for image in images])
    finally:
        np.random.set_state(state)


def _cifar10_1(target: OodTarget, path: Path | None, limit: int | None, seed: int) -> OodSet:
    dirs = _search_dirs(path, target, ("CIFAR-10.1", "CIFAR-10.1/datasets", "datasets"), "cifar10.1")
    data_name, labels_name = "cifar10.1_v6_data.npy", "cifar10.1_v6_labels.npy"
    directory = next((d for d in dirs if (d / data_name).is_file() and (d / labels_name).is_file()), None)
    if directory is None:
        raise DataError(
            f"CIFAR-10.1 not found: looked for {data_name} and {labels_name} in {', '.join(str(d) for d in dirs)}. "
            "Get them from https://github.com/modestyachts/CIFAR-10.1 (datasets/) and pass --ood cifar10.1:PATH "
            "(or put them in the run's --data-dir/CIFAR-10.1/)"
        )
    images = _load_npy(directory / data_name)
    labels = _load_npy(directory / labels_name)
    if images.ndim != 4 or images.shape[-1] != 3 or labels.shape != images.shape[:1]:
        raise DataError(
            f"{directory / data_name} should hold images [N, 32, 32, 3] and {labels_name} N labels; "
            f"found {list(images.shape)} and {list(labels.shape)}"
        )
    indices = _subset_indices(len(labels), limit, seed)
    tensor = torch.from_numpy(np.ascontiguousarray(images[indices], dtype=np.uint8)).permute(0, 3, 1, 2)
    data = _in_run_format(tensor, _labels(labels[indices], target, directory / labels_name), target)
    return OodSet("cifar10.1", f"CIFAR-10.1 v6 files in {directory}", [OodPart("cifar10.1", None, data)])


def _labels(values: np.ndarray, target: OodTarget, source: Path) -> torch.Tensor:
    labels = torch.from_numpy(np.asarray(values).astype(np.int64))
    if len(labels) and (labels.min() < 0 or labels.max() >= target.num_classes):
        raise DataError(f"{source} has label {int(labels.max())}, outside the run's 0..{target.num_classes - 1}")
    return labels


def _normalized(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _folder_name(class_name: str) -> str:
    """A class name as a folder can be named (matched with case and punctuation ignored): a ``/``, which no folder
    name can hold, as ``_`` (Fashion-MNIST's T-shirt/top as T-shirt_top)."""
    return class_name.replace("/", "_")


def _class_index(folder: str, target: OodTarget) -> int | None:
    if folder.isdigit():
        index = int(folder)
        return index if index < target.num_classes else None
    return class_map((folder,), target)[0]


def load_imagefolder(path: Path, target: OodTarget, *, limit: int | None = None, seed: int = 0) -> ImageSet:
    """``path/<class>/<image files>`` in ``target``'s format; ``limit`` keeps a random subset of that many images."""
    from PIL import Image  # deferred: Pillow comes with torchvision

    if not path.is_dir():
        raise DataError(f"imagefolder: {path} is not a directory; it should hold one sub-folder of images per class")
    known = target.classes or CLASS_NAMES.get(target.source.name)
    naming = f"0..{target.num_classes - 1}"
    if known:
        folders = ", ".join(_folder_name(name) for name in known)
        naming += f" or a class name ({folders}; case and punctuation ignored)"
    files: list[tuple[Path, int]] = []
    for folder in sorted(p for p in path.iterdir() if p.is_dir()):
        index = _class_index(folder.name, target)
        if index is None:
            raise DataError(
                f"imagefolder: sub-folder {printable(str(folder))} is not a class of this run: name it {naming}"
            )
        files += [(f, index) for f in sorted(folder.iterdir()) if f.suffix.lower() in _IMAGE_SUFFIXES]
    if not files:
        raise DataError(f"imagefolder: no images in {path}/<class>/ (sub-folders named {naming}, image files inside)")
    mode = "L" if target.channels == 1 else "RGB"
    chosen = _subset_indices(len(files), limit, seed)
    images, labels, bad = [], [], []
    for i in chosen:
        file, label = files[i]
        try:
            with large_pictures_quiet(), pillow_errors(), Image.open(file) as image:
                pixels = np.asarray(image.convert(mode), dtype=np.uint8)
        except Undecodable as err:
            bad.append(BadPicture(int(i), *file_names(file), str(err)))
            continue  # every undecodable file is named at once, below
        tensor = torch.from_numpy(pixels.reshape(*pixels.shape[:2], -1).copy()).permute(2, 0, 1).unsqueeze(0)
        images.append(resize_images(tensor, target.image_size, target.channels))
        labels.append(label)
    if bad:
        raise bad_pictures_error("imagefolder", f"imagefolder:{path}", bad, REPLACE_REMEDY)
    return ImageSet(torch.cat(images), torch.tensor(labels, dtype=torch.int64), target.num_classes)
