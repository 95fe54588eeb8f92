"""Methods from outside peradapt: `--method module:Class`, and entry points of group `peradapt.methods`.

A plugin is a `Method` subclass in a module of its own (docs/ADDING_A_METHOD.md). The registry
(`peradapt.config.METHODS`) asks the finder installed here for a name it does not know, and for the installed
packages' methods whenever it is listed; a plugin found is checked (a concrete `Method` subclass with a summary,
settings that clash with no other method's) and registered under the name it was asked by, which stays its
`--method` name in config.json, reports and model cards. A run's config.json names its plugin, so `--resume`,
`eval`, `export` and Flower's ClientApps (other processes, which inherit `sys.path` and PYTHONPATH) find it again.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from importlib.metadata import EntryPoint, entry_points

from peradapt.config import BUILT_IN, check_method_settings
from peradapt.errors import ConfigError
from peradapt.methods.base import METHODS, Method

ENTRY_POINT_GROUP = "peradapt.methods"
HOW_TO = "docs/ADDING_A_METHOD.md"


class PluginFinder:
    """Finds plugin methods for the registry: a `module:Class` name by importing it, any other among the installed
    packages' entry points (read once per `sys.path`: the registry is listed often)."""

    def __init__(self) -> None:
        self._read: tuple[tuple[str, ...], dict[str, EntryPoint]] | None = None

    def find(self, name: str) -> tuple[type[Method], str] | None:
        if ":" in name:
            what = f"--method {name}"
            return checked(import_class(name, what), what), f"module {name.partition(':')[0]}"
        entry = self.entry_points().get(name)
        if entry is None:
            return None
        source = f"entry point of {entry.dist.name} {entry.dist.version}" if entry.dist else "entry point"
        what = f"--method {name} ({source}: {entry.value})"
        return checked(import_class(entry.value, what), what), source

    def installed(self) -> list[str]:
        return list(self.entry_points())

    def entry_points(self) -> dict[str, EntryPoint]:
        """The methods installed packages declare, by name. One that takes a built-in method's name is refused."""
        path = tuple(sys.path)
        if self._read is None or self._read[0] != path:
            found = {entry.name: entry for entry in entry_points(group=ENTRY_POINT_GROUP)}
            loaded = METHODS.loaded()
            for name, entry in found.items():
                if name in loaded and METHODS.source(name) == BUILT_IN:
                    package = entry.dist.name if entry.dist else "an installed package"
                    raise ConfigError(
                        f"{package} declares a method '{name}' (entry point group {ENTRY_POINT_GROUP}), which is a "
                        "built-in method's name: rename its entry point"
                    )
            self._read = path, found
        return self._read[1]


def import_class(spec: str, what: str) -> object:
    """The object `module:attribute` names (the attribute may be dotted: `Outer.Inner`), imported."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute or ":" in attribute:
        raise ConfigError(f"{what}: give MODULE:CLASS, e.g. mypkg.fedavgm:FedAvgM ({HOW_TO})")
    try:
        found: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{what}: cannot import module '{module_name}' ({type(exc).__name__}: {exc})") from None
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise ConfigError(f"{what}: module '{module_name}' has no attribute '{attribute}'")
        found = getattr(found, part)
    return found


def checked(found: object, what: str) -> type[Method]:
    """`found` if it is a method peradapt can run: a subclass of `peradapt.Method` that defines every abstract
    method and a summary, whose settings clash with no shared setting and no other method's."""
    if not (isinstance(found, type) and issubclass(found, Method)):
        kind = f"the class {found.__name__}" if isinstance(found, type) else f"a {type(found).__name__}"
        raise ConfigError(f"{what}: that is {kind}, not a subclass of peradapt.Method ({HOW_TO})")
    if inspect.isabstract(found):
        missing = ", ".join(sorted(found.__abstractmethods__))
        raise ConfigError(f"{what}: {found.__name__} does not define {missing}, which every method must")
    if not isinstance(getattr(found, "summary", None), str):
        raise ConfigError(f"{what}: {found.__name__} has no summary (a line: the method and its paper)")
    try:
        check_method_settings(found.settings_class)
    except TypeError as exc:
        raise ConfigError(f"{what}: {exc}") from None
    return found


METHODS.finder = PluginFinder()
