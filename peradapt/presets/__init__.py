"""Paper presets: every setting the PerAda authors' scripts set for a table of the paper, shipped in the package.

A preset is a YAML file beside this module: `settings` (flat `train` keys, λ in peradapt's convention), `notes`
(why a value is what it is, for `peradapt info --preset`), and a `description`. `train --preset NAME` starts from
its settings; `--config` and flags win over it.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from typing import Any

import yaml

from peradapt.config import find_setting
from peradapt.errors import ConfigError
from peradapt.settings import Setting

PRESETS = ("perada-cifar10", "perada-office-home", "perada-chexpert")


def read_preset(name: str) -> dict[str, Any]:
    """The preset's whole record: description, settings, notes."""
    if name not in PRESETS:
        raise ConfigError(f"unknown --preset '{name}': use one of {', '.join(PRESETS)}")
    text = resources.files(__package__).joinpath(f"{name}.yaml").read_text(encoding="utf-8")
    return yaml.safe_load(text)


def preset_settings(name: str) -> dict[str, Any]:
    """The flat `train` settings preset `name` sets."""
    return dict(read_preset(name)["settings"])


@dataclass(frozen=True)
class PresetInfo:
    """What `peradapt info --preset NAME` shows: the preset's description, where in the authors' code its values
    come from, and (the setting's declaration, its preset value, the note why) for every setting it sets."""

    name: str
    description: str
    source: str
    rows: list[tuple[Setting, Any, str]]


def preset_info(name: str) -> PresetInfo:
    record = read_preset(name)
    notes = record.get("notes", {})
    rows = []
    for key, value in record["settings"].items():
        declared = find_setting(key)
        assert declared is not None, f"preset {name} sets {key}, which no setting has"  # tests load every preset
        rows.append((declared, value, notes.get(key, "")))
    return PresetInfo(name, record["description"], record["source"], rows)
