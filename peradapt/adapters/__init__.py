"""Adapters injected into a frozen backbone through PEFT, and their flat state dicts.

The states and their arithmetic (`peradapt.adapters.state`) need torch alone and are imported at once: the methods,
the trainer and the client store name them, and `peradapt methods` and `peradapt train --help` import the methods
without PEFT and timm. The rest (PEFT's layers, `AdaptedModel`, `inject_adapters`) is imported when first used.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from peradapt.adapters.state import AdapterState, average_states, state_nbytes, state_to, state_to_cpu
from peradapt.errors import MissingDependency
from peradapt.imports import imported_when_used

if TYPE_CHECKING:
    from peradapt.adapters.model import ADAPTER_KINDS, SCOPES, AdaptedModel, default_adapter_kind, inject_adapters
    from peradapt.adapters.residual import RESIDUAL_INIT, ResidualAdapterLayer
    from peradapt.adapters.vit import BottleneckAdapterLayer

# PEFT imports transformers at once (and requires it: pip installs it with peradapt), so only an environment it was
# removed from lacks it; without PEFT no adapter exists. Looked for (not imported) here, so that such an environment
# says what to install rather than failing inside PEFT.
try:
    _TRANSFORMERS = importlib.util.find_spec("transformers")
except ModuleNotFoundError:  # an import hook that refuses it
    _TRANSFORMERS = None
if _TRANSFORMERS is None:
    raise MissingDependency(
        "peradapt needs transformers, which PEFT imports and this environment lacks: pip install 'peradapt[hf]'"
    )

# The names of the modules that import PEFT, by the module that defines them.
_LAZY = {
    "ADAPTER_KINDS": "model",
    "SCOPES": "model",
    "AdaptedModel": "model",
    "default_adapter_kind": "model",
    "inject_adapters": "model",
    "RESIDUAL_INIT": "residual",
    "ResidualAdapterLayer": "residual",
    "BottleneckAdapterLayer": "vit",
}

__all__ = [
    "ADAPTER_KINDS",
    "RESIDUAL_INIT",
    "SCOPES",
    "AdaptedModel",
    "AdapterState",
    "BottleneckAdapterLayer",
    "ResidualAdapterLayer",
    "average_states",
    "default_adapter_kind",
    "inject_adapters",
    "state_nbytes",
    "state_to",
    "state_to_cpu",
]


# The names whose modules import PEFT (and timm), imported when first used.
__getattr__, __dir__ = imported_when_used(__name__, _LAZY, __all__)
