"""What the files of a run directory must hold, and the one-line RunError that names a damaged one and its remedy.

Every reader of a run's JSON files (config.json, partition.json) checks the structure it relies on here, where the
file is read, so that a truncated, edited or foreign file is refused with its path and what to do, instead of a
KeyError or TypeError deep inside a command; report.json, metrics.jsonl's rounds and a checkpoint's metadata are
typed records (`records.Report`, `RoundRecord`, `CheckpointMeta`), whose fields are their structure.

A structure is written as a Python value: a type (`float` takes whole numbers too; neither `int` nor `float` takes
a bool), `[item]` (a list of items), `{key: value}` (an object with those keys; a key ending in `?` may be absent)
or `{str: value}` (an object with any keys).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from peradapt.errors import RunError

# partition.json (see `data.federation.build_federation`): what `info` and a reopened session read
PARTITION = {
    "spec": str,
    "seed": int,
    "dataset?": str,
    "num_clients?": int,
    "layout?": str,
    "histograms_of?": str,
    "val?": [int],
    "clients": [{"id": int, "train": [int], "test": [int], "train_histogram": [int], "test_histogram?": [int]}],
}


def first_missing(path: Path) -> Path | None:
    """The outermost of `path` and its parents that does not exist: what making `path` creates (None: nothing)."""
    return next((p for p in reversed([path, *path.parents]) if not p.exists()), None)


def damaged(path: Path, problem: str, remedy: str) -> RunError:
    return RunError(f"{path} is damaged ({problem}): {remedy}")


def read_text(path: Path, remedy: str) -> str:
    """The text in `path`; a file that cannot be read or is not UTF-8 is a RunError."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise damaged(path, "not UTF-8 text", remedy) from None
    except OSError as exc:
        raise RunError(f"{path} cannot be read ({exc.strerror or exc}): {remedy}") from None


def read_json(path: Path, remedy: str) -> Any:
    """The JSON value in `path`; a file that cannot be read, is not UTF-8 or not JSON is a RunError."""
    text = read_text(path, remedy)
    try:
        return json.loads(text)
    except ValueError as exc:
        raise damaged(path, f"not JSON: {exc}", remedy) from None


def check(value: Any, structure: Any, path: Path, remedy: str, where: str = "") -> None:
    """Refuse `value`, read from `path`, unless it has `structure` (see the module docstring)."""
    problem = mismatch(value, structure, where)
    if problem is not None:
        raise damaged(path, problem, remedy)


def mismatch(value: Any, structure: Any, where: str = "") -> str | None:
    """What in `value` departs from `structure`, said with where it is (`where`: its place in the file), or None."""
    place = where or "its content"
    if isinstance(structure, dict):
        if not isinstance(value, dict):
            return f"{place} is {described(value)}, not an object"
        if set(structure) == {str}:
            items = [(key, structure[str]) for key in value]
        else:
            items = [(key.rstrip("?"), sub) for key, sub in structure.items() if key.rstrip("?") in value]
            missing = next((key for key in structure if not key.endswith("?") and key not in value), None)
            if missing is not None:
                return f'{place} has no "{missing}"'
        for key, sub in items:
            problem = mismatch(value[key], sub, f"{where}.{key}" if where else key)
            if problem is not None:
                return problem
        return None
    if isinstance(structure, list):
        if not isinstance(value, list):
            return f"{place} is {described(value)}, not a list"
        item = structure[0]
        if item in (int, float):  # long lists of numbers (a partition's indices): one pass, no recursion
            bad = next((i for i, v in enumerate(value) if not is_number(v, item)), None)
            return None if bad is None else f"{where}[{bad}] is {described(value[bad])}, not {type_name(item)}"
        for index, entry in enumerate(value):
            problem = mismatch(entry, item, f"{where}[{index}]")
            if problem is not None:
                return problem
        return None
    if structure in (int, float):
        return None if is_number(value, structure) else f"{place} is {described(value)}, not {type_name(structure)}"
    return None if isinstance(value, structure) else f"{place} is {described(value)}, not {type_name(structure)}"


def is_number(value: Any, kind: type) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) if kind is int else isinstance(value, (int, float))


def type_name(kind: type) -> str:
    names = {int: "a whole number", float: "a number", str: "a string", bool: "true or false", dict: "an object"}
    return names.get(kind, kind.__name__)


def described(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true or false"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {value[:20]!r}" if len(value) <= 20 else "a string"
    return {list: "a list", dict: "an object"}.get(type(value), type(value).__name__)
