"""Names a package imports when they are first used (PEP 562), so that `import peradapt` starts without the
training stack (torch, PEFT, timm): `peradapt --help` needs none of it.

Code that must run when a third-party package is imported (peradapt's adapter layers registered with PEFT, its
narrow ResNets and tiny ViTs with timm: `peradapt/__init__.py`) uses wrapt's post-import hooks, the maintained
implementation of that hook (OpenTelemetry's instrumentations rely on it), rather than a finder of our own.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable, Mapping
from typing import Any


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
