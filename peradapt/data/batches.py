"""Mini-batching of in-memory image tensors: index streams, normalization and batched augmentation."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F

from peradapt.data.images import scale_pixels


def to_model_input(
    images_uint8: torch.Tensor,
    mean: Sequence[float],
    std: Sequence[float],
    device: torch.device | str,
    size: int | None = None,
) -> torch.Tensor:
    """``(x / 255 - mean) / std`` as float32 on ``device``, in channels-last memory order, scaled to
    ``size``×``size`` if given (images are stored no larger than the model takes them: `peradapt.data.images`).

    Channels-last is the layout oneDNN and cuDNN convolve fastest, and the one the residual adapters' 1x1
    projections multiply in place (`peradapt.adapters.branch`); convolutions keep it from layer to layer.
    """
    if images_uint8.dtype != torch.uint8:
        raise ValueError(f"expected uint8 images, got {images_uint8.dtype}")
    if len(mean) != images_uint8.shape[1] or len(std) != images_uint8.shape[1]:
        raise ValueError(f"{images_uint8.shape[1]}-channel images need that many mean/std values, got {mean}/{std}")
    device = torch.device(device)
    scale, shift = _affine_normalization(tuple(mean), tuple(std), device)
    # Moving uint8 before converting sends a quarter of the bytes to the device.
    pixels = images_uint8.to(device, non_blocking=True).to(torch.float32, memory_format=torch.channels_last)
    if size is not None and pixels.shape[2:] != (size, size):
        # As `resize_images` would have stored them, on the device and without rounding to bytes in between.
        pixels = scale_pixels(pixels, size).contiguous(memory_format=torch.channels_last)
    return torch.addcmul(shift, pixels, scale)


@functools.lru_cache(maxsize=32)
def _affine_normalization(
    mean: tuple[float, ...], std: tuple[float, ...], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    # (x/255 - m)/s == x * (1/(255 s)) + (-m/s): one fused multiply-add per batch, constants made once.
    std_tensor = torch.tensor(std, dtype=torch.float32)
    scale = (1.0 / (255.0 * std_tensor)).view(1, -1, 1, 1)
    shift = (-torch.tensor(mean, dtype=torch.float32) / std_tensor).view(1, -1, 1, 1)
    return scale.to(device), shift.to(device)


def iterate_minibatches(
    num_samples: int,
    batch_size: int,
    generator: torch.Generator,
    *,
    shuffle: bool = True,
    drop_last: bool = False,
) -> Iterator[torch.Tensor]:
    """Yield index tensors covering ``range(num_samples)`` in batches, reshuffled on every call.

    A last batch of a single sample joins the one before: BatchNorm cannot train on one sample.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    order = torch.randperm(num_samples, generator=generator) if shuffle else torch.arange(num_samples)
    stop = num_samples - num_samples % batch_size if drop_last else num_samples
    starts = list(range(0, stop, batch_size))
    if len(starts) > 1 and stop - starts[-1] == 1:
        starts.pop()
    for start, end in zip(starts, [*starts[1:], stop], strict=True):
        yield order[start:end]


def random_crop_flip(images: torch.Tensor, generator: torch.Generator, padding: int = 4) -> torch.Tensor:
    """Random crop of the zero-padded images and random horizontal flip, as one gather for the batch."""
    count, channels, height, width = images.shape
    draw_device = generator.device
    row_offsets = torch.randint(0, 2 * padding + 1, (count, 1), generator=generator, device=draw_device)
    col_offsets = torch.randint(0, 2 * padding + 1, (count, 1), generator=generator, device=draw_device)
    flips = torch.rand((count, 1), generator=generator, device=draw_device) < 0.5
    row_offsets, col_offsets, flips = (t.to(images.device) for t in (row_offsets, col_offsets, flips))
    rows = row_offsets + torch.arange(height, device=images.device)
    columns = torch.arange(width, device=images.device)
    # A flip reads the crop's columns right to left.
    cols = col_offsets + torch.where(flips, columns.flip(0), columns)
    padded = F.pad(images, (padding, padding, padding, padding))
    return padded[
        torch.arange(count, device=images.device).view(-1, 1, 1, 1),
        torch.arange(channels, device=images.device).view(1, -1, 1, 1),
        rows.view(count, 1, height, 1),
        cols.view(count, 1, 1, width),
    ]
