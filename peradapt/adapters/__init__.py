"""Adapters injected into a frozen backbone through PEFT, and their flat state dicts."""

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
