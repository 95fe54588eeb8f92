"""Methods from outside peradapt: `--method module:Class`, and entry points of group `peradapt.methods`.

A plugin is a `Method` subclass in a module of its own (docs/ADDING_A_METHOD.md). The registry
(`peradapt.registry.METHODS`) asks the finder installed here for a name it does not know, and for the installed
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

from peradapt.config import check_method_settings
from peradapt.errors import PluginError
from peradapt.methods.base import Method
from peradapt.registry import BUILT_IN, METHODS

ENTRY_POINT_GROUP = "peradapt.methods"
HOW_TO = "docs/ADDING_A_METHOD.md"


class PluginFinder:
    """Finds plugin methods for the registry: a `module:Class` name by importing it, any other among the installed
    packages' entry points (read once per `sys.path`: the registry is listed often, and an entry point that failed
    is not imported again until the path changes)."""

    def __init__(self) -> None:
        self._read: tuple[tuple[str, ...], dict[str, EntryPoint], dict[str, str]] | None = None
        self._failed: dict[str, str] = {}  # entry point name -> its PluginError's message, for this `sys.path`

    def find(self, name: str) -> tuple[type[Method], str] | None:
        if ":" in name:
            what = f"--method {name}"
            return checked(import_class(name, what), what), f"module {name.partition(':')[0]}"
        entry = self.entry_points().get(name)
        if entry is None:
            return None
        if name in self._failed:
            raise PluginError(self._failed[name])
        source = f"entry point of {entry.dist.name} {entry.dist.version}" if entry.dist else "entry point"
        what = f"--method {name} ({source}: {entry.value})"
        try:
            return checked(import_class(entry.value, what), what), source
        except PluginError as exc:
            self._failed[name] = str(exc)
            raise

    def installed(self) -> list[str]:
        return list(self.entry_points())

    def refused(self) -> dict[str, str]:
        self.entry_points()
        assert self._read is not None
        return dict(self._read[2])

    def entry_points(self) -> dict[str, EntryPoint]:
        """The methods installed packages declare, by name, but those that take a built-in method's name, which
        `refused` gives with why."""
        path = tuple(sys.path)
        if self._read is None or self._read[0] != path:
            found = {entry.name: entry for entry in entry_points(group=ENTRY_POINT_GROUP)}
            loaded = METHODS.loaded()
            refused = {
                name: f"{entry.dist.name if entry.dist else 'an installed package'} declares a method '{name}' "
                f"(entry point group {ENTRY_POINT_GROUP}), which is a built-in method's name: rename its entry point"
                for name, entry in found.items()
                if name in loaded and METHODS.source(name) == BUILT_IN
            }
            self._read = path, {name: entry for name, entry in found.items() if name not in refused}, refused
            self._failed = {}
        return self._read[1]


def import_class(spec: str, what: str) -> object:
    """The object `module:attribute` names (the attribute may be dotted: `Outer.Inner`), imported. Whatever
    importing the module raises, `SystemExit` included, is one PluginError naming the module and the remedy."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute or ":" in attribute:
        raise PluginError(f"{what}: give MODULE:CLASS, e.g. mypkg.fedavgm:FedAvgM ({HOW_TO})")
    try:
        found: object = importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:  # a plugin's own code runs here: anything it raises is its failure
        raise PluginError(f"{what}: {import_failure(module_name, exc)}") from None
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise PluginError(f"{what}: module '{module_name}' has no attribute '{attribute}'")
        found = getattr(found, part)
    return found


def import_failure(module_name: str, exc: BaseException) -> str:
    """Why module `module_name` did not import, and the remedy: not on the path, a package it needs missing, or
    its own code failing."""
    raised = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
    if missing is not None and (module_name == missing or module_name.startswith(f"{missing}.")):
        return (
            f"cannot import module '{module_name}' ({raised}): put the directory that holds it on PYTHONPATH, or "
            "pip install the package that provides it"
        )
    if missing is not None:
        return f"cannot import module '{module_name}' ({raised}): install '{missing}', which it imports"
    return (
        f"cannot import module '{module_name}': importing it raised {raised}; fix the module "
        f'(`python -c "import {module_name}"` shows where)'
    )


def checked(found: object, what: str) -> type[Method]:
    """`found` if it is a method peradapt can run: a subclass of `peradapt.Method` that defines every abstract
    method and a summary, whose settings clash with no shared setting and no other method's."""
    if not (isinstance(found, type) and issubclass(found, Method)):
        kind = f"the class {found.__name__}" if isinstance(found, type) else f"a {type(found).__name__}"
        raise PluginError(f"{what}: that is {kind}, not a subclass of peradapt.Method ({HOW_TO})")
    if inspect.isabstract(found):
        missing = ", ".join(sorted(found.__abstractmethods__))
        raise PluginError(f"{what}: {found.__name__} does not define {missing}, which every method must")
    if not isinstance(getattr(found, "summary", None), str):
        raise PluginError(f"{what}: {found.__name__} has no summary (a line: the method and its paper)")
    try:
        check_method_settings(found.settings_class)
    except TypeError as exc:
        raise PluginError(f"{what}: {exc}") from None
    return found


METHODS.finder = PluginFinder()
