"""Adapters injected into a frozen backbone through PEFT, and their flat state dicts."""

try:
    import peft  # noqa: F401  (imported first here, so that a broken environment says what to install)
except ModuleNotFoundError as missing:
    # PEFT imports transformers at once (and requires it: pip installs it with peradapt), so only an environment it
    # was removed from lacks it; without PEFT no adapter exists, so peradapt cannot start.
    if (missing.name or "").partition(".")[0] != "transformers":
        raise
    raise ImportError(
        "peradapt needs transformers, which PEFT imports and this environment lacks: pip install 'peradapt[hf]'"
    ) from None

from peradapt.adapters.model import (
    ADAPTER_KINDS,
    SCOPES,
    AdaptedModel,
    AdapterState,
    default_adapter_kind,
    inject_adapters,
)
from peradapt.adapters.residual import RESIDUAL_INIT, ResidualAdapterLayer
from peradapt.adapters.state import average_states, state_nbytes, state_to, state_to_cpu
from peradapt.adapters.vit import BottleneckAdapterLayer

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
