"""Mini-batching of in-memory image tensors: index streams, normalization and batched augmentation."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F

from peradapt.data.images import scale_pixels

# Training-batch augmentations: none (peradapt's default for all but CIFAR-10/100), crop-flip (its CIFAR
# augmentation) and resized-crop (the PerAda authors' CheXpert augmentation).
AUGMENTATIONS = ("none", "crop-flip", "resized-crop")
# torchvision's RandomResizedCrop tries this many random boxes before it falls back to a central one.
CROP_ATTEMPTS = 10
# Per image: CROP_ATTEMPTS area fractions, CROP_ATTEMPTS log aspect ratios, the box's top and left, the flip.
_RESIZED_CROP_UNIFORMS = 2 * CROP_ATTEMPTS + 3


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


# An augmentation's random draws for a batch (`draw_augmentation`), made where its generator is: crop-flip's
# (row offsets [N, 1], column offsets [N, 1], flips [N, 1]), resized-crop's (boxes [N, 4], flips [N]). The draws of
# several batches concatenate along the first axis into those of one batch (concurrent clients' inputs).
AugmentationDraws = tuple[torch.Tensor, ...]


def augment_batch(images: torch.Tensor, augmentation: str, generator: torch.Generator, size: int) -> torch.Tensor:
    """uint8 ``[N, C, H, W]`` images augmented as ``augmentation`` (one of AUGMENTATIONS) says, with draws from
    ``generator``: crop-flip keeps their size, resized-crop gives ``size``×``size`` (the model's input size)."""
    draws = draw_augmentation(augmentation, len(images), images.shape[2], images.shape[3], generator)
    return apply_augmentation(images, augmentation, draws, size)


def draw_augmentation(
    augmentation: str, count: int, height: int, width: int, generator: torch.Generator
) -> AugmentationDraws:
    """The random draws of ``augmentation`` for ``count`` images of ``height``×``width``, from ``generator``."""
    if augmentation == "crop-flip":
        return random_crop_flip_draws(count, generator)
    if augmentation == "resized-crop":
        return random_resized_crop_draws(count, height, width, generator)
    if augmentation == "none":
        return ()
    raise ValueError(f"unknown augmentation {augmentation!r}: use {', '.join(AUGMENTATIONS)}")


def apply_augmentation(images: torch.Tensor, augmentation: str, draws: AugmentationDraws, size: int) -> torch.Tensor:
    """``augmentation`` of uint8 ``[N, C, H, W]`` images by its ``draws`` (`draw_augmentation`), in one batch."""
    if augmentation == "crop-flip":
        return crop_flip(images, *draws)
    if augmentation == "resized-crop":
        boxes, flips = draws
        return resized_crops(images, boxes, size, flips)
    if augmentation == "none":
        return images
    raise ValueError(f"unknown augmentation {augmentation!r}: use {', '.join(AUGMENTATIONS)}")


def neutral_augmentation_draws(augmentation: str, count: int, height: int, width: int) -> AugmentationDraws:
    """Draws of ``augmentation`` that leave ``count`` images as they are (the centred crop of crop-flip, the
    whole image as resized-crop's box, no flip): the rows that pad a batch (concurrent clients' padded steps)."""
    if augmentation == "crop-flip":
        offsets = torch.full((count, 1), CROP_PADDING, dtype=torch.int64)
        return offsets, offsets.clone(), torch.zeros((count, 1), dtype=torch.bool)
    if augmentation == "resized-crop":
        boxes = torch.tensor([[0, 0, height, width]], dtype=torch.int64).expand(count, 4)
        return boxes, torch.zeros(count, dtype=torch.bool)
    if augmentation == "none":
        return ()
    raise ValueError(f"unknown augmentation {augmentation!r}: use {', '.join(AUGMENTATIONS)}")


CROP_PADDING = 4  # crop-flip: pixels of zeros around the image, so a crop shifts it by up to this many


def random_crop_flip(images: torch.Tensor, generator: torch.Generator, padding: int = CROP_PADDING) -> torch.Tensor:
    """Random crop of the zero-padded images and random horizontal flip, as one gather for the batch."""
    return crop_flip(images, *random_crop_flip_draws(len(images), generator, padding), padding=padding)


def random_crop_flip_draws(count: int, generator: torch.Generator, padding: int = CROP_PADDING) -> AugmentationDraws:
    """crop-flip's draws: each image's row and column offset into the padded image, and whether it flips."""
    draw_device = generator.device
    row_offsets = torch.randint(0, 2 * padding + 1, (count, 1), generator=generator, device=draw_device)
    col_offsets = torch.randint(0, 2 * padding + 1, (count, 1), generator=generator, device=draw_device)
    flips = torch.rand((count, 1), generator=generator, device=draw_device) < 0.5
    return row_offsets, col_offsets, flips


def crop_flip(
    images: torch.Tensor,
    row_offsets: torch.Tensor,
    col_offsets: torch.Tensor,
    flips: torch.Tensor,
    padding: int = CROP_PADDING,
) -> torch.Tensor:
    """Each image cropped from its zero-padded self at its offsets and flipped where ``flips`` says: one gather."""
    count, channels, height, width = images.shape
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


def random_resized_crop_flip(
    images: torch.Tensor,
    generator: torch.Generator,
    size: int,
    scale: tuple[float, float] = (0.05, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> torch.Tensor:
    """torchvision's ``RandomResizedCrop(size, scale, ratio)`` then ``RandomHorizontalFlip()`` on every image of a
    uint8 ``[N, C, H, W]`` batch: uint8 ``[N, C, size, size]``, on the images' device.

    A box covering a random fraction (in ``scale``) of the image's area with a random aspect ratio (log-uniform in
    ``ratio``) is resized to ``size``×``size`` (bilinear, antialiased: `resized_crops`) and flipped with
    probability 1/2. With the default scale this is the PerAda authors' CheXpert training augmentation (their
    code, datasets/chexpert.py). The random draws come from ``generator`` alone, so a seed gives one batch.
    """
    count, _, height, width = images.shape
    boxes, flips = random_resized_crop_draws(count, height, width, generator, scale, ratio)
    return resized_crops(images, boxes, size, flips)


def random_resized_crop_draws(
    count: int,
    height: int,
    width: int,
    generator: torch.Generator,
    scale: tuple[float, float] = (0.05, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> AugmentationDraws:
    """resized-crop's draws: each image's box (`resized_crop_boxes`) and whether it flips."""
    uniforms = torch.rand(
        (count, _RESIZED_CROP_UNIFORMS), generator=generator, device=generator.device, dtype=torch.float64
    ).cpu()
    return resized_crop_boxes(height, width, uniforms[:, :-1], scale, ratio), uniforms[:, -1] < 0.5


def resized_crop_boxes(
    height: int, width: int, uniforms: torch.Tensor, scale: tuple[float, float], ratio: tuple[float, float]
) -> torch.Tensor:
    """int64 ``[N, 4]`` boxes (top, left, height, width) in a ``height``×``width`` image, chosen by the rule of
    torchvision's ``RandomResizedCrop.get_params`` from float64 uniforms in [0, 1), ``[N, 2 * CROP_ATTEMPTS + 2]``.

    Attempt k draws an area fraction uniform in ``scale`` (column k) and a log aspect ratio uniform in
    log ``ratio`` (column ``CROP_ATTEMPTS + k``), rounds the box's sides, and keeps the first attempt whose box
    fits, placed uniformly (the last two columns). If none fits, the box is central: the whole image, or its
    widest/tallest part whose aspect ratio is within ``ratio``.
    """
    area_uniforms, ratio_uniforms, place = uniforms.split([CROP_ATTEMPTS, CROP_ATTEMPTS, 2], dim=1)
    target_area = height * width * (scale[0] + (scale[1] - scale[0]) * area_uniforms)
    log_low, log_high = math.log(ratio[0]), math.log(ratio[1])
    aspect = torch.exp(log_low + (log_high - log_low) * ratio_uniforms)
    # Rounded half to even, as Python's round() in torchvision.
    box_w = torch.sqrt(target_area * aspect).round().long()
    box_h = torch.sqrt(target_area / aspect).round().long()
    fits = (box_w > 0) & (box_w <= width) & (box_h > 0) & (box_h <= height)
    first = fits.to(torch.uint8).argmax(dim=1, keepdim=True)  # the first attempt that fits (0 when none does)
    found = fits.any(dim=1)
    central_h, central_w = _central_crop_size(height, width, ratio)
    box_h = torch.where(found, box_h.gather(1, first).squeeze(1), central_h)
    box_w = torch.where(found, box_w.gather(1, first).squeeze(1), central_w)
    # torch.randint(0, n + 1) is uniform over 0..n: the floor of a uniform in [0, n + 1).
    top = torch.where(found, (place[:, 0] * (height - box_h + 1)).floor().long(), (height - box_h) // 2)
    left = torch.where(found, (place[:, 1] * (width - box_w + 1)).floor().long(), (width - box_w) // 2)
    return torch.stack([top, left, box_h, box_w], dim=1)


def _central_crop_size(height: int, width: int, ratio: tuple[float, float]) -> tuple[int, int]:
    in_ratio = width / height
    if in_ratio < min(ratio):
        return round(width / min(ratio)), width
    if in_ratio > max(ratio):
        return height, round(height * max(ratio))
    return height, width


def resized_crops(
    images: torch.Tensor, boxes: torch.Tensor, size: int, flips: torch.Tensor | None = None
) -> torch.Tensor:
    """Each image's box (top, left, height, width: int64 ``[N, 4]``) resized to ``size``×``size`` and flipped
    left to right where ``flips`` (bool ``[N]``) says: uint8 ``[N, C, size, size]`` on the images' device.

    The resampling is torch's bilinear interpolation with antialiasing (what torchvision's resized_crop does to
    tensors by default), written as one matrix per axis and image, so that crops of different sizes make two
    batched matrix products instead of one interpolation per image.
    """
    boxes = boxes.to(images.device)
    top, left, box_h, box_w = boxes.unbind(dim=1)
    rows = _interpolation_matrices(top, box_h, images.shape[2], size)
    cols = _interpolation_matrices(left, box_w, images.shape[3], size)
    if flips is not None:
        # A flipped image's output column j is the unflipped one's size - 1 - j.
        cols = torch.where(flips.to(images.device).view(-1, 1, 1), cols.flip(1), cols)
    pixels = rows.unsqueeze(1) @ images.to(torch.float32) @ cols.transpose(1, 2).unsqueeze(1)
    return pixels.round_().clamp_(0, 255).to(torch.uint8)


def _interpolation_matrices(start: torch.Tensor, length: torch.Tensor, extent: int, size: int) -> torch.Tensor:
    """float32 ``[N, size, extent]``: row i weighs the input pixels that output pixel i of the span
    ``[start, start + length)`` resized to ``size`` takes, as torch's antialiased bilinear interpolation does.

    Output pixel i is centred at ``s * (i + 0.5)`` in the span (s = length / size) and weighs the span's pixels by
    a triangle of half-width max(s, 1) around it, the weights normalized to sum to 1.
    """
    device = start.device
    span = length.to(torch.float64).view(-1, 1, 1)
    step = span / size
    widen = step.clamp(min=1.0)  # shrinking widens the triangle to cover every input pixel: the antialiasing
    centres = step * (torch.arange(size, device=device, dtype=torch.float64).view(1, -1, 1) + 0.5)
    position = torch.arange(extent, device=device, dtype=torch.float64).view(1, 1, -1) - start.view(-1, 1, 1)
    weights = (1 - (position + 0.5 - centres).abs() / widen).clamp_(min=0)
    weights = weights * ((position >= 0) & (position < span))
    return (weights / weights.sum(dim=2, keepdim=True)).to(torch.float32)
