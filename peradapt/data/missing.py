"""What a source that `--download` can fetch (fmnist, cifar10, cifar100, svhn, stl10) says when its files are not
there or its download fails, in one wording for all: what is missing and where it looked, then the remedies, its
files in `--data-dir DIR` or `--download` (needs a network). Sources that cannot be downloaded (office-home,
chexpert, the OOD sets read from files) say where to get their files and never mention --download."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from peradapt.errors import DataError

NEEDS_NETWORK = "(needs a network)"


def not_found(
    label: str,
    wanted: str,
    data_dir: Path | None,
    looked_in: Sequence[Path] = (),
    *,
    by_hand: str,
    alternative: str | None = None,
    download: bool = False,
) -> DataError:
    """Source `label` without its files `wanted`, looked for in `looked_in` (default: `data_dir`; nowhere without
    one). `by_hand`: how to get them into a directory `{dir}` (for example "extract URL into {dir}"); `alternative`:
    one more remedy, before --download. With `download` but no `data_dir`: --download needs one."""
    if data_dir is None and download:
        return download_needs_data_dir(label)
    looked_in = list(looked_in) or ([data_dir] if data_dir is not None else [])
    if looked_in:
        missing = f"no {wanted} in {', '.join(str(directory) for directory in looked_in)}"
    else:
        missing = f"no --data-dir given (the directory to hold {wanted})"
    place = "--data-dir DIR" if data_dir is None else f"--data-dir {data_dir}"
    remedies = [by_hand.format(dir=place), *([alternative] if alternative else [])]
    fetch = f"add {'--data-dir DIR ' if data_dir is None else ''}--download to fetch {label} there {NEEDS_NETWORK}"
    return DataError(f"{label} not found: {missing}: {either(*remedies, fetch)}")


def download_needs_data_dir(label: str) -> DataError:
    return DataError(f"--download needs --data-dir DIR to save {label} into: add --data-dir DIR")


def download_failed(
    label: str, data_dir: Path, error: BaseException, *, by_hand: str, alternative: str | None = None
) -> DataError:
    """--download of source `label` into `data_dir` failed with `error` (no network, most often); `by_hand` and
    `alternative` as for `not_found`."""
    reason = " ".join(str(error).split()) or type(error).__name__  # one line
    remedies = [by_hand.format(dir=f"--data-dir {data_dir}"), *([alternative] if alternative else [])]
    return DataError(f"could not download {label} into {data_dir} ({reason}): without a network, {either(*remedies)}")


def either(*remedies: str) -> str:
    """Remedies as a message lists them: "a", "a, or b", "a, b, or c"."""
    return remedies[0] if len(remedies) == 1 else f"{', '.join(remedies[:-1])}, or {remedies[-1]}"
