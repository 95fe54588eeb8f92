"""Image files decoded once: every file converted, resized to a square and kept as one cached uint8 array.

Office-Home and CheXpert come as tens of thousands of large JPEGs, and decoding them is by far the slowest part
of loading. The decoded array is saved as ``$PERADAPT_HOME/cache/<name>-<size>px-<mode>-<key>.npy``, where the
key hashes every file's path, size and modification time: a changed, added or removed image makes a new entry,
and an unchanged dataset is memory-mapped back in seconds.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

from peradapt.backbones import peradapt_home
from peradapt.errors import DataError
from peradapt.progress import progress_display

CACHE_VERSION = 1  # part of the key: raise it when decoding changes, so that no older array is reused
_CHANNELS = {"L": 1, "RGB": 3}
# Pillow releases the GIL while it decodes and resizes, so threads use every core.
_WORKERS = min(8, os.cpu_count() or 1)


def decode_images(files: Sequence[Path], size: int, mode: str, *, name: str) -> torch.Tensor:
    """uint8 ``[N, C, size, size]``: each file converted to ``mode`` (``L``: C = 1, ``RGB``: C = 3) and resized.

    Read from the cache when the files are unchanged; otherwise decoded (with a progress bar) and cached.
    """
    shape = (len(files), _CHANNELS[mode], size, size)
    path = peradapt_home() / "cache" / f"{name}-{size}px-{mode}-{_content_key(files, size, mode)}.npy"
    cached = _read_cache(path, shape)
    if cached is not None:
        return torch.from_numpy(cached)
    images = np.empty(shape, dtype=np.uint8)
    console = Console(stderr=True)
    decode = functools.partial(_decode_file, size=size, mode=mode)
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


def _content_key(files: Sequence[Path], size: int, mode: str) -> str:
    digest = hashlib.sha256(f"v{CACHE_VERSION} {size} {mode}\n".encode())
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


def _decode_file(file: Path, *, size: int, mode: str) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError  # deferred: Pillow comes with torchvision, only decoding needs it

    try:
        with Image.open(file) as image:
            # JPEG decoders can scale down by 1/2 to 1/8 while decoding (never below `size`): much faster.
            image.draft(mode, (size, size))
            pixels = np.asarray(image.convert(mode).resize((size, size), Image.Resampling.BILINEAR), dtype=np.uint8)
    except (OSError, UnidentifiedImageError) as err:
        raise DataError(f"cannot decode image {file}: {err}; replace it with a good copy") from err
    return pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)
