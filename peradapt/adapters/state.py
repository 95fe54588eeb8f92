"""Adapter states (flat dicts of tensors) and arithmetic on them: torch alone, without PEFT, so that the methods, the
trainer and the client store that name them import without PEFT and timm."""

from __future__ import annotations

from collections.abc import Sequence

import torch

# A client's adapter: the PEFT model's trainable parameter and buffer names -> tensors (`peradapt.adapters.model`).
AdapterState = dict[str, torch.Tensor]


def average_states(states: Sequence[AdapterState], weights: Sequence[float] | None = None) -> AdapterState:
    """Weighted mean of floating-point entries; integer entries (BatchNorm step counters) come from the first."""
    if not states:
        raise ValueError("cannot average zero adapter states")
    if weights is None:
        weights = [1.0] * len(states)
    total = float(sum(weights))
    averaged: AdapterState = {}
    for name, first in states[0].items():
        if first.is_floating_point():
            averaged[name] = sum(w / total * s[name] for w, s in zip(weights, states, strict=True))
        else:
            averaged[name] = first.clone()
    return averaged


def state_to_cpu(state: AdapterState) -> AdapterState:
    return {name: tensor.detach().cpu().contiguous() for name, tensor in state.items()}


def state_to(state: AdapterState, device: torch.device) -> AdapterState:
    return {name: tensor.to(device) for name, tensor in state.items()}


def state_nbytes(state: AdapterState) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in state.values())
