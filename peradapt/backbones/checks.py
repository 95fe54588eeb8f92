"""Checks of what a backbone is loaded with: weights that are finite numbers, normalization statistics that can
normalize. Either kind of damage would otherwise surface rounds later as a NaN loss, which training can only blame
on the learning rate."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from peradapt.errors import WeightsError


def check_finite(weights: Mapping[str, torch.Tensor], origin: str) -> None:
    """Refuse weights (from ``origin``, a file or directory) with a NaN or an infinity in any tensor. One vectorized
    test per tensor: milliseconds even for a large backbone."""
    for key, tensor in weights.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            value = "NaN" if bool(torch.isnan(tensor).any()) else "an infinite value"
            raise WeightsError(
                f"{origin} holds {value} in {key}: the weights are damaged; re-run `peradapt pretrain` (for weights "
                "it made) or pass other weights"
            )


def check_statistics(mean: Sequence[float], std: Sequence[float], channels: int, where: str, remedy: str) -> None:
    """Refuse normalization statistics (read from ``where``) that cannot normalize images of ``channels``
    channels: one value for all channels or one per channel, a finite mean, a positive finite std (inputs are
    divided by it). ``remedy``: what to do about the file. A value that is no number raises TypeError."""
    if len(mean) != len(std) or len(mean) not in (1, channels):
        problem = (
            f"mean and std hold {len(mean)} and {len(std)} values; each must hold one value for every channel, or "
            f"one per channel of the {channels}-channel weights"
        )
    elif not all(math.isfinite(value) for value in mean):
        problem = f"its mean {list(mean)} is not all finite numbers"
    elif not all(math.isfinite(value) and value > 0 for value in std):
        problem = f"its std {list(std)} is not all positive finite numbers (inputs are divided by it)"
    else:
        return
    raise WeightsError(f"{where}: {problem}; {remedy}")
