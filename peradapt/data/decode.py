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

`decode_pictures` does the same for sources whose format peradapt does not know in advance (``imagefolder:PATH``,
``hf:NAME``): files or encoded bytes, grey when every picture is grey and RGB otherwise, at a given size or at the
pictures' own. Its entries are ``<name>-<size>px-<key>.npy`` or ``<name>-native-<key>.npy`` (``-center-crop``
before the key when cropped), the key hashing the way of fitting and what the caller says identifies the pictures.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from peradapt.errors import DataError
from peradapt.home import peradapt_home
from peradapt.progress import progress_display, text_console

if TYPE_CHECKING:
    import PIL.Image

CACHE_VERSION = 1  # part of the key: raise it when decoding changes, so that no older array is reused
RESIZES = ("squeeze", "center-crop")
_CHANNELS = {"L": 1, "RGB": 3}
# PIL modes whose pictures hold no colour: decoded as L (one channel) when every picture of a source has one.
GREY_MODES = frozenset({"1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "I;16N", "F"})
# A picture: an image file, or the encoded bytes of one (a PNG or JPEG in a Hugging Face dataset).
Picture = Path | bytes
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
    decode = functools.partial(_decode_file, size=size, mode=mode, resize=resize)
    return _decode_and_cache(np.empty(shape, dtype=np.uint8), lambda index: decode(files[index]), name, path)


def _decode_and_cache(images: np.ndarray, decode: Callable[[int], np.ndarray], name: str, path: Path) -> torch.Tensor:
    """`images[i] = decode(i)` for every image, in threads with a progress bar, then cached at `path`."""
    console = text_console(stderr=True)
    description = f"decoding {len(images)} {name} images to {images.shape[-1]} px (once: they are cached)"
    if not console.is_terminal:  # logs get one line instead of a live bar
        console.print(description)
    with progress_display(console) as progress, ThreadPoolExecutor(_WORKERS) as pool:
        bar = progress.add_task(description, total=len(images))
        for index, pixels in enumerate(pool.map(decode, range(len(images)))):
            images[index] = pixels
            progress.advance(bar)
    try:
        _write_atomic(path, images)
    except OSError as err:  # the cache only saves time: a full disk must not stop the run
        console.print(f"could not cache the decoded images in {path} ({err}); the next run decodes them again")
    return torch.from_numpy(images)


def decode_pictures(
    count: int,
    pictures: Callable[[], Sequence[Picture]],
    *,
    name: str,
    key: str,
    size: int | None,
    default_size: int,
    resize: str = "squeeze",
    where: Callable[[int], str] | None = None,
) -> torch.Tensor:
    """uint8 ``[count, C, S, S]`` of ``count`` pictures of a source whose format is not known in advance.

    C is 1 when every picture is grey (a PIL mode in GREY_MODES), else 3 (grey pictures of a colour source are
    repeated). S is ``size``; ``None``: the pictures' own side when all are squares of one side no larger than
    ``default_size`` (a 32 px set stays 32 px), else ``default_size``. ``key`` identifies the pictures (their
    files' paths, sizes and times, a dataset's fingerprint): the cache entry of an unchanged ``key`` is read
    without calling ``pictures()``, which gives the pictures otherwise. ``where(i)`` names picture ``i`` in errors
    about bytes (files name themselves).
    """
    if resize not in RESIZES:
        raise ValueError(f"unknown resize {resize!r}: use {' or '.join(RESIZES)}")
    fitting = "" if resize == "squeeze" else f"-{resize}"
    digest = hashlib.sha256(f"v{CACHE_VERSION} pictures {size} {resize}\n{key}".encode()).hexdigest()[:20]
    path = peradapt_home() / "cache" / f"{name}-{f'{size}px' if size else 'native'}{fitting}-{digest}.npy"
    cached = _read_cache(path, None)
    if cached is not None and cached.shape[0] == count and (size is None or cached.shape[-1] == size):
        return torch.from_numpy(cached)
    items = pictures()
    if len(items) != count:
        raise ValueError(f"{count} pictures promised, {len(items)} given")
    if not items:
        return torch.empty((0, 3, size or default_size, size or default_size), dtype=torch.uint8)
    describe = where or (lambda index: f"picture {index}")

    def located(index: int, function: Callable[[], np.ndarray]) -> np.ndarray:
        try:
            return function()
        except DataError as err:
            if isinstance(items[index], Path):
                raise
            raise DataError(f"{describe(index)}: {err}") from err.__cause__

    with ThreadPoolExecutor(_WORKERS) as pool:
        headers = list(pool.map(lambda i: located(i, lambda: _picture_header(items[i])), range(count)))
    mode = "L" if all(header[0] in GREY_MODES for header in headers) else "RGB"
    sides = {header[1] for header in headers}
    if size is None:
        (width, height), *others = sides
        size = width if not others and width == height and width <= default_size else default_size
    images = np.empty((count, _CHANNELS[mode], size, size), dtype=np.uint8)

    def decode(index: int) -> np.ndarray:
        return located(index, lambda: _decode_file(items[index], size=size, mode=mode, resize=resize))

    return _decode_and_cache(images, decode, name, path)


def files_key(files: Sequence[Path]) -> str:
    """What identifies image files for `decode_pictures`: every file's path, size and modification time."""
    return _content_key(files, 0, "", "squeeze")


def _picture_header(picture: Picture) -> tuple[str, tuple[int, int]]:
    """The PIL mode and size of a picture, read from its header alone."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(_opened(picture)) as image:
            return image.mode, image.size
    except (OSError, UnidentifiedImageError, ValueError, SyntaxError) as err:
        raise DataError(f"cannot decode image {_named(picture)}: {err}; replace it with a good copy") from err


def _opened(picture: Picture) -> Path | io.BytesIO:
    return picture if isinstance(picture, Path) else io.BytesIO(picture)


def _named(picture: Picture) -> str:
    return str(picture) if isinstance(picture, Path) else f"({len(picture)} bytes)"


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


def _read_cache(path: Path, shape: tuple[int, ...] | None) -> np.ndarray | None:
    """The cached array at ``path`` if it has ``shape`` (``None``: any ``[N, 1 or 3, S, S]``), else ``None``."""
    if not path.is_file():
        return None
    try:
        # Copy-on-write mapping: only the images a run uses are read from disk, and tensors may still be written.
        array = np.load(path, mmap_mode="c", allow_pickle=False)
    except (OSError, ValueError):
        return None  # damaged: decoded and written again
    if array.dtype != np.uint8:
        return None
    if shape is None:
        return array if array.ndim == 4 and array.shape[1] in (1, 3) and array.shape[2] == array.shape[3] else None
    return array if array.shape == shape else None


def _write_atomic(path: Path, images: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as handle:
            np.save(handle, images)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _decode_file(file: Picture, *, size: int, mode: str, resize: str) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError  # deferred: Pillow comes with torchvision, only decoding needs it

    try:
        with Image.open(_opened(file)) as image:
            # JPEG decoders can scale down by 1/2 to 1/8 while decoding (never below `size` on either side): much
            # faster, and the shorter side still covers a center crop.
            image.draft(mode, (size, size))
            pixels = np.asarray(fit_picture(image.convert(mode), size, resize), dtype=np.uint8)
    except (OSError, UnidentifiedImageError, ValueError, SyntaxError) as err:
        raise DataError(f"cannot decode image {_named(file)}: {err}; replace it with a good copy") from err
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
