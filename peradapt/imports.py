"""Code that runs when a third-party package is first imported (a post-import hook).

peradapt registers its adapter layers with PEFT and its narrow ResNets and tiny ViTs with timm this way
(`peradapt/__init__.py`): `import peradapt` then imports neither (nor torch and transformers behind them, seconds
that `peradapt --help` and `peradapt methods` do not need), while `import peradapt, peft` and `import peradapt, timm`
still load what peradapt exported, as the model cards say.

The hook is a finder at the front of `sys.meta_path`. For a watched top-level name it takes the spec that the finders
after it give and wraps that spec's loader; once the module's code has run, the callbacks run with the module. Only
importlib's public protocol is used (`find_spec`, `create_module`, `exec_module`), and the module keeps its own loader
in `__loader__` and `__spec__.loader` (importlib.resources and inspect read it there), as wrapt's post-import hooks
do. A module that is imported already gets its callbacks at once.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

Callback = Callable[[ModuleType], None]


class _Searching(threading.local):
    """The names this thread is asking the other finders for."""

    def __init__(self) -> None:
        self.names: set[str] = set()


class _Watcher(MetaPathFinder):
    """The finder that wraps the loaders of watched modules; it finds nothing itself."""

    def __init__(self) -> None:
        self.callbacks: dict[str, list[Callback]] = {}
        self.lock = threading.Lock()
        self._searching = _Searching()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        searching = self._searching.names
        if fullname not in self.callbacks or fullname in searching:
            return None
        searching.add(fullname)  # a finder after this one that asks importlib again must not come back here
        try:
            spec = _spec_from_others(self, fullname, path, target)
        finally:
            searching.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec  # not found (importlib says so), or a namespace package: imported without the hook
        spec.loader = _CallingLoader(spec.loader, self)
        return spec

    def loaded(self, module: ModuleType) -> None:
        """Run and forget the callbacks of `module`, which has just been imported."""
        with self.lock:
            callbacks = self.callbacks.pop(module.__name__, [])
        for callback in callbacks:
            callback(module)


def _spec_from_others(
    watcher: _Watcher, fullname: str, path: Sequence[str] | None, target: ModuleType | None
) -> ModuleSpec | None:
    for finder in list(sys.meta_path):
        find_spec = getattr(finder, "find_spec", None)
        if finder is watcher or find_spec is None:
            continue
        spec = find_spec(fullname, path, target)
        if spec is not None:
            return spec
    return None


class _CallingLoader(Loader):
    """A module's own loader, followed by the watcher's callbacks."""

    def __init__(self, loader: Loader, watcher: _Watcher) -> None:
        self.loader = loader
        self.watcher = watcher

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        if getattr(module.__spec__, "loader", None) is self:
            module.__spec__.loader = self.loader  # type: ignore[union-attr]
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self.loader
        self.loader.exec_module(module)
        self.watcher.loaded(module)  # only once its code ran without an error: a failed import may be tried again


_WATCHER = _Watcher()


def when_imported(name: str, callback: Callback) -> None:
    """Run `callback(module)` once top-level module `name` is imported: now if it is, else right after its import,
    in the importing thread. An exception the callback raises is the import's."""
    if "." in name:
        raise ValueError(f"when_imported watches top-level modules, not {name}")
    with _WATCHER.lock:
        module = sys.modules.get(name)
        if module is None:
            _WATCHER.callbacks.setdefault(name, []).append(callback)
            if _WATCHER not in sys.meta_path:
                sys.meta_path.insert(0, _WATCHER)
            return
    callback(module)


def imported_when_used(package: str, homes: Mapping[str, str], listed: Iterable[str]) -> tuple[Any, Any]:
    """A package's module `__getattr__` and `__dir__` (PEP 562) for names imported when first used: each name of
    `homes` from the submodule it names, kept in the package once found; `listed` (its `__all__`) shows in dir()."""

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{homes[name]}"), name)
        setattr(sys.modules[package], name, value)  # found without this function from now on
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *listed})

    return __getattr__, __dir__
