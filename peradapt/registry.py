"""The method registry: every method's class by its `--method` name, built-in ones and plugins.

Its own module, below the config: the config reads each registered method's `settings_class` (flags, config keys,
checks), the methods register themselves in it, and neither imports the other for it.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, MutableMapping
from typing import Any, Protocol

from peradapt.errors import PluginError

BUILT_IN = "built-in"  # where a method registered by peradapt itself comes from (`MethodRegistry.source`)


class PluginFinder(Protocol):
    """What finds methods from outside peradapt (`peradapt.methods.plugins` installs it in `METHODS`)."""

    def find(self, name: str) -> tuple[Any, str] | None:
        """The class of plugin method `name` and where it comes from; None if no plugin has that name. A plugin
        that cannot be used is a ConfigError."""

    def installed(self) -> list[str]:
        """The names of the methods that installed packages declare."""

    def refused(self) -> dict[str, str]:
        """The methods that installed packages declare but may not, each with why (a built-in method's name)."""


class MethodRegistry(MutableMapping[str, Any]):
    """Every method's class by its `--method` name. `peradapt.methods.base.register` adds each built-in one as it
    is defined, when the registry is first read: it imports the package of the built-in methods (`built_in`), whose
    modules register them and install the plugin finder. Plugins (`module:Class` names, entry points of group
    `peradapt.methods`) are added by that finder when they are looked up, and every installed one when the registry
    is listed: an installed one that cannot be used is left out of the list (`broken` says why), so that one broken
    package fails only the commands that name its method. The config reads only their `settings_class` (a dataclass
    of `setting` fields), so flags, config files and config.json know the settings of whatever methods are registered
    when they are read."""

    def __init__(self, built_in: str | None = None) -> None:
        self._classes: dict[str, Any] = {}
        self._sources: dict[str, str] = {}
        self.finder: PluginFinder | None = None
        self.built_in = built_in

    def __getitem__(self, name: str) -> Any:
        self._find(name)
        return self._classes[name]

    def __iter__(self) -> Iterator[str]:
        self.broken()
        return iter(list(self._classes))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __setitem__(self, name: str, cls: Any) -> None:
        self.add(name, cls, BUILT_IN)

    def __delitem__(self, name: str) -> None:
        del self._classes[name], self._sources[name]

    def add(self, name: str, cls: Any, source: str) -> None:
        self._classes[name] = cls
        self._sources[name] = source

    def source(self, name: str) -> str:
        """Where method `name` comes from: built-in, a module, or an installed package's entry point."""
        self._find(name)
        return self._sources[name]

    def _find(self, name: str) -> None:
        """Register plugin `name` if the finder knows it and it is not registered yet."""
        self._import_built_in()
        if name not in self._classes and self.finder is not None and isinstance(name, str):
            found = self.finder.find(name)
            if found is not None:
                self.add(name, *found)

    def broken(self) -> dict[str, str]:
        """Register every method installed packages declare that can be used; the others by name, each with its
        one-line error."""
        self._import_built_in()
        if self.finder is None:
            return {}
        broken = self.finder.refused()
        for name in self.finder.installed():
            try:
                self._find(name)
            except PluginError as exc:
                broken[name] = str(exc)
        return broken

    def loaded(self) -> dict[str, Any]:
        """The methods registered so far, finding none: what a plugin being loaded is checked against."""
        self._import_built_in()
        return dict(self._classes)

    def _import_built_in(self) -> None:
        """Import the built-in methods' package, which registers them, at every read: once it is imported this is a
        look-up in `sys.modules`. While it is being imported, this thread (a built-in method's registration checks
        its settings against the methods registered so far) gets the methods registered so far, and any other thread
        waits for the import to finish."""
        if self.built_in is not None:
            importlib.import_module(self.built_in)


# The method registry: built-in methods and plugins (`MethodRegistry`). The built-in ones are imported when it is
# first read, not with the config: `import peradapt` and `peradapt --help` need no method's rules, nor the torch
# those import.
METHODS = MethodRegistry(built_in="peradapt.methods")
