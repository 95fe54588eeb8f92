"""Image files decoded once: every file converted, fitted to a square and kept as one cached uint8 array.

Office-Home and CheXpert come as tens of thousands of large JPEGs, and decoding them is by far the slowest part
of loading. The decoded array is saved as ``$PERADAPT_HOME/cache/<name>-<size>px-<mode>-<key>.npy`` (squeezed)
or ``<name>-<size>px-center-crop-<mode>-<key>.npy`` (center-cropped), where the key hashes the way of fitting
and every file's path, size and modification time: a changed, added or removed image makes a new entry, and an
unchanged dataset is memory-mapped back in seconds.

Two ways to fit an image to the square (``resize``):

- ``squeeze``: the whole image resized to ``size``×``size``, its aspect ratio given up. peradapt's default, and
  how the PerAda authors' code feeds Office-Home to the model (a fixed 224×224 resize).
- ``center-crop``: the shorter side resized to ``size`` (aspect kept), then the central ``size``×``size``
  square: torchvision's ``Resize(size)`` + ``CenterCrop(size)``, which is how the PerAda authors' code
  (datasets/chexpert.py) prepares CheXpert test images.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from peradapt.backbones import peradapt_home
from peradapt.errors import DataError
from peradapt.progress import progress_display, text_console

if TYPE_CHECKING:
    import PIL.Image

CACHE_VERSION = 1  # part of the key: raise it when decoding changes, so that no older array is reused
RESIZES = ("squeeze", "center-crop")
_CHANNELS = {"L": 1, "RGB": 3}
# Pillow releases the GIL while it decodes and resizes, so threads use every core.
_WORKERS = min(8, os.cpu_count() or 1)


def decode_images(files: Sequence[Path], size: int, mode: str, *, name: str, resize: str = "squeeze") -> torch.Tensor:
    """uint8 ``[N, C, size, size]``: each file converted to ``mode`` (``L``: C = 1, ``RGB``: C = 3) and fitted to
    the square as ``resize`` says (``squeeze`` or ``center-crop``, see the module's notes).

    Read from the cache when the files are unchanged; otherwise decoded (with a progress bar) and cached.
    """
    if resize not in RESIZES:
        raise ValueError(f"unknown resize {resize!r}: use {' or '.join(RESIZES)}")
    shape = (len(files), _CHANNELS[mode], size, size)
    # Squeezed entries keep the names and keys they had before center-cropping existed.
    stem = f"{name}-{size}px-{mode}" if resize == "squeeze" else f"{name}-{size}px-{resize}-{mode}"
    path = peradapt_home() / "cache" / f"{stem}-{_content_key(files, size, mode, resize)}.npy"
    cached = _read_cache(path, shape)
    if cached is not None:
        return torch.from_numpy(cached)
    images = np.empty(shape, dtype=np.uint8)
    console = text_console(stderr=True)
    decode = functools.partial(_decode_file, size=size, mode=mode, resize=resize)
    description = f"decoding {len(files)} {name} images to {size} px (once: they are cached)"
    if not console.is_terminal:  # logs get one line instead of a live bar
        console.print(description)
    with progress_display(console) as progress, ThreadPoolExecutor(_WORKERS) as pool:
        bar = progress.add_task(description, total=len(files))
        for index, pixels in enumerate(pool.map(decode, files)):
            images[index] = pixels
            progress.advance(bar)
    try:
        _write_atomic(path, images)
    except OSError as err:  # the cache only saves time: a full disk must not stop the run
        console.print(f"could not cache the decoded images in {path} ({err}); the next run decodes them again")
    return torch.from_numpy(images)


def _content_key(files: Sequence[Path], size: int, mode: str, resize: str) -> str:
    fitting = "" if resize == "squeeze" else f" {resize}"
    digest = hashlib.sha256(f"v{CACHE_VERSION} {size} {mode}{fitting}\n".encode())
    for file in files:
        try:
            stat = file.stat()
        except OSError as err:
            raise DataError(f"cannot read image {file}: {err}; the dataset is incomplete") from err
        digest.update(f"{file.absolute()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:20]


def _read_cache(path: Path, shape: tuple[int, ...]) -> np.ndarray | None:
    if not path.is_file():
        return None
    try:
        # Copy-on-write mapping: only the images a run uses are read from disk, and tensors may still be written.
        array = np.load(path, mmap_mode="c", allow_pickle=False)
    except (OSError, ValueError):
        return None  # damaged: decoded and written again
    return array if array.shape == shape and array.dtype == np.uint8 else None


def _write_atomic(path: Path, images: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as handle:
            np.save(handle, images)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _decode_file(file: Path, *, size: int, mode: str, resize: str) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError  # deferred: Pillow comes with torchvision, only decoding needs it

    try:
        with Image.open(file) as image:
            # JPEG decoders can scale down by 1/2 to 1/8 while decoding (never below `size` on either side): much
            # faster, and the shorter side still covers a center crop.
            image.draft(mode, (size, size))
            pixels = np.asarray(fit_picture(image.convert(mode), size, resize), dtype=np.uint8)
    except (OSError, UnidentifiedImageError) as err:
        raise DataError(f"cannot decode image {file}: {err}; replace it with a good copy") from err
    return pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)


def fit_picture(image: PIL.Image.Image, size: int, resize: str) -> PIL.Image.Image:
    """``image`` as a ``size``×``size`` picture, squeezed or center-cropped (``resize``), resampled bilinearly."""
    from PIL import Image

    if resize == "squeeze":
        return image.resize((size, size), Image.Resampling.BILINEAR)
    width, height = image.size
    # torchvision's Resize(int): the shorter side becomes `size`, the longer is scaled by as much and truncated.
    scaled = (size, int(size * height / width)) if width <= height else (int(size * width / height), size)
    if scaled != image.size:  # torchvision leaves an image of the right size as it is
        image = image.resize(scaled, Image.Resampling.BILINEAR)
    # torchvision's CenterCrop: offsets rounded half to even, as Python's round does.
    left, top = round((scaled[0] - size) / 2), round((scaled[1] - size) / 2)
    return image.crop((left, top, left + size, top + size))
