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
``hf:NAME``): files or encoded bytes, grey when every picture is grey and RGB otherwise, at a given size or, by
default, at the most common size among them (the longer side of the most common width × height, at most
DECODED_IMAGE_SIZE), which it prints with how many pictures it resizes: a folder of 28 px PNGs with a few larger
JPEGs stays 28 px instead of being scaled up. Its entries are ``<name>-<size>px-<key>.npy`` or
``<name>-native-<key>.npy`` (``-center-crop`` before the key when cropped), the key hashing the way of fitting and
what the caller says identifies the pictures (which of a source's rows they are, with ``--limit-samples``).

Undecodable pictures are collected, never reported one at a time: the headers of all are read first (a picture
without a readable header stops the load before any is decoded), then every failure while decoding; one error
names how many, the first ten, and the file under ``$PERADAPT_HOME/bad-images/`` that lists them all with the
reason (there, since no run directory exists yet while data loads, and ``eval --ood`` writes none).
A picture over Pillow's decompression-bomb limit (twice ``PIL.Image.MAX_IMAGE_PIXELS``, kept) is one of them,
"too large"; one between once and twice the limit is decoded, without Pillow's warning (`large_pictures_quiet`).
Files are keyed by their paths' bytes, so names need not be UTF-8; where they are shown or listed, their other
bytes read as ``\\xNN`` (`printable`).
`find_bad_pictures` checks every picture of a source at once (its header, then its pixels decoded at the JPEG
decoder's smallest scale), for ``--skip-bad-images``: the sources leave those out before the fixed split, so the
split of a given set of files does not depend on which of them a run decodes. Its result is cached under the
same key as the pictures.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import os
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

from peradapt.errors import DataError
from peradapt.home import peradapt_home
from peradapt.progress import progress_display, text_console

if TYPE_CHECKING:
    import PIL.Image

CACHE_VERSION = 1  # part of the key: raise it when decoding changes, so that no older array is reused
# The same for `decode_pictures`' entries alone: 2 since its default size is the most common one.
PICTURES_VERSION = 2
RESIZES = ("squeeze", "center-crop")
_CHANNELS = {"L": 1, "RGB": 3}
# PIL modes whose pictures hold no colour: decoded as L (one channel) when every picture of a source has one.
GREY_MODES = frozenset({"1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "I;16N", "F"})
# A picture: an image file, or the encoded bytes of one (a PNG or JPEG in a Hugging Face dataset).
Picture = Path | bytes
# Pillow releases the GIL while it decodes and resizes, so threads use every core.
_WORKERS = min(8, os.cpu_count() or 1)
# Undecodable pictures named in an error message; the file it points to lists them all.
_NAMED_BAD = 10
# What to do about undecodable pictures: the sources whose loading can leave them out, and the others.
SKIP_REMEDY = "replace or remove them, or pass --skip-bad-images"
REPLACE_REMEDY = "replace or remove them"
_T = TypeVar("_T")


@dataclass(frozen=True)
class BadPicture:
    """A picture that cannot be decoded: its place among a source's pictures, its name in an error message (a
    file's folder and name, a dataset's row), its full name in the list of them (a file's path), and why."""

    index: int
    name: str
    full_name: str
    reason: str


class Undecodable(Exception):
    """A picture Pillow cannot read; the message says why."""


@contextlib.contextmanager
def pillow_errors() -> Iterator[None]:
    """Pillow's errors while it reads a picture raised as `Undecodable`, with the reason: a damaged file, or one
    over its decompression-bomb limit (twice ``PIL.Image.MAX_IMAGE_PIXELS``, kept as Pillow sets it: such a
    picture would take gigabytes to decode, whatever size it is fitted to)."""
    from PIL import Image, UnidentifiedImageError  # deferred: Pillow comes with torchvision, only decoding needs it

    try:
        yield
    except Image.DecompressionBombError as err:  # not an OSError
        raise Undecodable(f"too large, over Pillow's decompression-bomb limit ({_reason(err)})") from err
    except (OSError, UnidentifiedImageError, ValueError, SyntaxError) as err:
        raise Undecodable(_reason(err)) from err


@contextlib.contextmanager
def large_pictures_quiet() -> Iterator[None]:
    """Pillow's warning about each picture between once and twice its ``MAX_IMAGE_PIXELS`` silenced while pictures
    are read (by this thread or the pools it waits on): such a picture is decoded, as Pillow does, and fitted to
    the run's size like any other; one warning per picture would only bury the lines that matter."""
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        yield


def printable(name: str) -> str:
    """A name from the file system (a path, a file or folder name) as text that can be printed and written as
    UTF-8: the bytes of a name that is not UTF-8 (surrogates in Python's string) as ``\\xNN`` escapes."""
    return os.fsencode(name).decode("utf-8", "backslashreplace")


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
    images = np.empty(shape, dtype=np.uint8)
    bad = _decode_into(images, lambda index: decode(files[index]), name, lambda index: _names(files, index, None))
    if bad:
        raise bad_pictures_error(name, name, bad, REPLACE_REMEDY)
    return _cached(images, path)


def _decode_into(
    images: np.ndarray,
    decode: Callable[[int], np.ndarray],
    name: str,
    names: Callable[[int], tuple[str, str]],
) -> list[BadPicture]:
    """`images[i] = decode(i)` for every image, in threads with a progress bar; the pictures that failed."""
    console = text_console(stderr=True)
    description = f"decoding {len(images)} {name} images to {images.shape[-1]} px (once: they are cached)"
    if not console.is_terminal:  # logs get one line instead of a live bar
        console.print(description)
    bad: list[BadPicture] = []
    with large_pictures_quiet(), progress_display(console) as progress, ThreadPoolExecutor(_WORKERS) as pool:
        bar = progress.add_task(description, total=len(images))
        for index, pixels in enumerate(pool.map(_caught(decode), range(len(images)))):
            if isinstance(pixels, Undecodable):
                bad.append(BadPicture(index, *names(index), str(pixels)))
            else:
                images[index] = pixels
            progress.advance(bar)
    return bad


def _cached(images: np.ndarray, path: Path) -> torch.Tensor:
    """``images`` as a tensor, written to the cache at ``path`` first."""
    try:
        _write_atomic(path, images)
    except OSError as err:  # the cache only saves time: a full disk must not stop the run
        text_console(stderr=True).print(
            f"could not cache the decoded images in {path} ({err}); the next run decodes them again"
        )
    return torch.from_numpy(images)


def _caught(function: Callable[[int], _T]) -> Callable[[int], _T | Undecodable]:
    """``function``, returning rather than raising an undecodable picture's error (so that a pool goes on)."""

    def call(index: int) -> _T | Undecodable:
        try:
            return function(index)
        except Undecodable as err:
            return err

    return call


def decode_pictures(
    count: int,
    pictures: Callable[[], Sequence[Picture]],
    *,
    name: str,
    source: str,
    key: str,
    size: int | None,
    default_size: int,
    resize: str = "squeeze",
    where: Callable[[int], str] | None = None,
    remedy: str = SKIP_REMEDY,
) -> torch.Tensor:
    """uint8 ``[count, C, S, S]`` of ``count`` pictures of ``source`` (as the user named it, for messages), a
    source whose format is not known in advance.

    C is 1 when every picture is grey (a PIL mode in GREY_MODES), else 3 (grey pictures of a colour source are
    repeated). S is ``size``; ``None``: the most common size among the pictures, at most ``default_size`` (see the
    module's notes), printed. ``key`` identifies the pictures (their files' paths, sizes and times, a dataset's
    fingerprint and rows): the cache entry of an unchanged ``key`` is read without calling ``pictures()``, which
    gives the pictures otherwise. ``where(i)`` names picture ``i`` in errors about bytes (files name themselves).
    Undecodable pictures are one `bad_pictures_error`, which advises ``remedy``.
    """
    if resize not in RESIZES:
        raise ValueError(f"unknown resize {resize!r}: use {' or '.join(RESIZES)}")
    fitting = "" if resize == "squeeze" else f"-{resize}"
    # os.fsencode: a key may hold a path that is not UTF-8 (an hf: directory's).
    digest = hashlib.sha256(os.fsencode(f"v{PICTURES_VERSION} pictures {size} {resize}\n{key}")).hexdigest()[:20]
    path = peradapt_home() / "cache" / f"{name}-{f'{size}px' if size else 'native'}{fitting}-{digest}.npy"
    cached = _read_cache(path, None)
    if cached is not None and cached.shape[0] == count and (size is None or cached.shape[-1] == size):
        return torch.from_numpy(cached)
    items = pictures()
    if len(items) != count:
        raise ValueError(f"{count} pictures promised, {len(items)} given")
    if not items:
        return torch.empty((0, 3, size or default_size, size or default_size), dtype=torch.uint8)
    names = functools.partial(_names, items, where=where)
    headers, bad = _each_picture(items, _picture_header, names)
    if bad:  # before any picture is decoded
        raise bad_pictures_error(name, source, bad, remedy)
    mode = "L" if all(header[0] in GREY_MODES for header in headers) else "RGB"
    if size is None:
        size, note = common_size([header[1] for header in headers], default_size)
        text_console(stderr=True).print(f"{source}: {note}", soft_wrap=True)
    images = np.empty((count, _CHANNELS[mode], size, size), dtype=np.uint8)
    decode = functools.partial(_decode_file, size=size, mode=mode, resize=resize)
    bad = _decode_into(images, lambda index: decode(items[index]), name, names)
    if bad:
        raise bad_pictures_error(name, source, bad, remedy)
    return _cached(images, path)


def common_size(sizes: Sequence[tuple[int, int]], bound: int) -> tuple[int, str]:
    """The side to decode pictures of ``sizes`` (width, height) at by default, and a note saying why: the longer
    side of the most common size (the larger of those equally common), at most ``bound``."""
    counts = Counter(sizes)
    width, height = max(counts, key=lambda wh: (counts[wh], max(wh)))
    side = min(max(width, height), bound)
    resized = sum(count for wh, count in counts.items() if wh != (side, side))
    if len(counts) == 1 and not resized:
        why = "their size"
    elif max(width, height) > bound:
        why = f"their most common size, {width}x{height}, is more than {bound} px; {resized} resized"
    else:
        why = f"the most common size; {resized} resized"
    return side, f"{len(sizes)} images at {side} px ({why}; --image-size to choose)"


def find_bad_pictures(
    count: int, pictures: Callable[[], Sequence[Picture]], *, name: str, key: str, where: Callable[[int], str] | None
) -> list[BadPicture]:
    """Every picture of ``count`` that cannot be decoded, each read whole (`_check_picture`): what
    ``--skip-bad-images`` leaves out. Cached under ``key`` (as `decode_pictures`' ``key``), since the fixed split
    needs it on every run."""
    digest = hashlib.sha256(os.fsencode(f"v{PICTURES_VERSION} check\n{key}")).hexdigest()[:20]
    path = peradapt_home() / "cache" / f"{name}-checked-{digest}.json"
    try:
        return [BadPicture(**entry) for entry in json.loads(path.read_text(encoding="utf-8"))]
    except (OSError, ValueError, TypeError):
        pass  # not checked yet, or a damaged record: checked again
    items = pictures()
    if len(items) != count:
        raise ValueError(f"{count} pictures promised, {len(items)} given")
    _, bad = _each_picture(items, _check_picture, functools.partial(_names, items, where=where))
    with contextlib.suppress(OSError):  # the record only saves time
        _write_atomic(path, json.dumps([asdict(picture) for picture in bad]))
    return bad


def bad_pictures_error(name: str, source: str, bad: Sequence[BadPicture], remedy: str) -> DataError:
    """One error for the undecodable pictures of ``source`` (see `bad_pictures_note`), advising ``remedy``."""
    return DataError(f"{bad_pictures_note(name, source, bad)}; {remedy}")


def bad_pictures_note(name: str, source: str, bad: Sequence[BadPicture]) -> str:
    """What is wrong with the undecodable pictures of ``source``: how many, the first ten, and the file listing all
    of them with the reasons, ``$PERADAPT_HOME/bad-images/<name>-<hash>.txt`` (written here)."""
    listing = "".join(f"{picture.full_name}: {picture.reason}\n" for picture in bad)
    digest = hashlib.sha256(os.fsencode(f"{source}\n{listing}")).hexdigest()[:12]
    path = peradapt_home() / "bad-images" / f"{name}-{digest}.txt"
    try:
        _write_atomic(path, listing)
        where = f"; the full list is in {path}"
    except OSError as err:
        where = f"; the full list could not be written to {path} ({err.strerror})"
    named = ", ".join(picture.name for picture in bad[:_NAMED_BAD]) + (", ..." if len(bad) > _NAMED_BAD else "")
    images = "1 image cannot" if len(bad) == 1 else f"{len(bad)} images cannot"
    return f"{source}: {images} be decoded ({named}){where}"


def files_key(files: Sequence[Path]) -> str:
    """What identifies image files for `decode_pictures`: every file's path, size and modification time."""
    return _content_key(files, 0, "", "squeeze")


def _each_picture(
    items: Sequence[Picture], read: Callable[[Picture], _T], names: Callable[[int], tuple[str, str]]
) -> tuple[list[_T], list[BadPicture]]:
    """``read`` of every picture, in threads: the results of those it read, and those it could not."""
    with large_pictures_quiet(), ThreadPoolExecutor(_WORKERS) as pool:
        results = list(pool.map(_caught(lambda index: read(items[index])), range(len(items))))
    bad = [BadPicture(i, *names(i), str(result)) for i, result in enumerate(results) if isinstance(result, Undecodable)]
    return [result for result in results if not isinstance(result, Undecodable)], bad


def _names(items: Sequence[Picture], index: int, where: Callable[[int], str] | None) -> tuple[str, str]:
    """Picture ``index``'s short and full names: a file's folder and name, and its path; ``where(index)`` (or its
    index) for bytes."""
    item = items[index]
    if isinstance(item, Path):
        return file_names(item)
    named = where(index) if where is not None else f"picture {index}"
    return named, named


def file_names(file: Path) -> tuple[str, str]:
    """An image file's short and full names in messages and lists (`printable`): its folder and name, its path."""
    return printable("/".join(file.parts[-2:])), printable(str(file))


def _picture_header(picture: Picture) -> tuple[str, tuple[int, int]]:
    """The PIL mode and size of a picture, read from its header alone."""
    from PIL import Image

    with pillow_errors(), Image.open(_opened(picture)) as image:
        return image.mode, image.size


def _check_picture(picture: Picture) -> None:
    """Raise `Undecodable` unless the whole picture decodes: its header, then its pixels (a JPEG's at the
    decoder's smallest scale, which still reads all of its data: a truncated file fails)."""
    from PIL import Image

    with pillow_errors(), Image.open(_opened(picture)) as image:
        image.draft(None, (1, 1))
        image.load()


def _reason(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def _opened(picture: Picture) -> Path | io.BytesIO:
    return picture if isinstance(picture, Path) else io.BytesIO(picture)


def _content_key(files: Sequence[Path], size: int, mode: str, resize: str) -> str:
    fitting = "" if resize == "squeeze" else f" {resize}"
    digest = hashlib.sha256(f"v{CACHE_VERSION} {size} {mode}{fitting}\n".encode())
    for file in files:
        try:
            stat = file.stat()
        except OSError as err:
            raise DataError(f"cannot read image {printable(str(file))}: {err}; the dataset is incomplete") from err
        # The path's bytes: a name need not be UTF-8 (a UTF-8 one gives the same bytes as ever, so the same key).
        digest.update(os.fsencode(file.absolute()) + f"\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
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


def _write_atomic(path: Path, content: np.ndarray | str) -> None:
    """``content`` (an array as .npy, or UTF-8 text) written to ``path`` whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as handle:
            if isinstance(content, str):
                handle.write(content.encode())
            else:
                np.save(handle, content)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _decode_file(file: Picture, *, size: int, mode: str, resize: str) -> np.ndarray:
    from PIL import Image

    with pillow_errors(), Image.open(_opened(file)) as image:
        # JPEG decoders can scale down by 1/2 to 1/8 while decoding (never below `size` on either side): much
        # faster, and the shorter side still covers a center crop.
        image.draft(mode, (size, size))
        pixels = np.asarray(fit_picture(image.convert(mode), size, resize), dtype=np.uint8)
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
