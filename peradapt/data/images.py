"""In-memory image sets: whole datasets held as ready uint8 tensors, so training never decodes images.

Images are stored no larger than the model's input size, and never larger than they come: a set smaller than
the model's input (CIFAR-10 for a ViT at 224 px) keeps its own size and is scaled up batch by batch on the way
into the model (`peradapt.data.to_model_input`). Stored upsampled, CIFAR-10 and CIFAR-100 would take 49 times
their bytes (16 GB instead of 0.3 GB).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from peradapt.errors import ConfigError

# Normalization of the datasets decoded from photographs and radiographs: the statistics of ImageNet, which the
# paper's backbones were pretrained on (grayscale: their mean, as for grayscale data on an RGB backbone; grey
# repeated as RGB: all three, as the PerAda authors' code normalizes CheXpert opened as RGB).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# ITU-R 601-2 luma weights, the same that PIL's convert("L") uses.
_LUMA_WEIGHTS = (0.299, 0.587, 0.114)
# Resizing converts to float; chunking bounds that temporary copy for large sets such as CIFAR-100.
_RESIZE_CHUNK = 4096
# `pixel_statistics` measures at most this many images, spread evenly over a set: plenty for a mean and a std.
_STATISTICS_SAMPLE = 10_000
# The smallest std `pixel_statistics` gives: one grey level, so that a constant channel is not divided by zero.
_MIN_STD = 1 / 255


@dataclass(frozen=True)
class ImageSet:
    """Images as uint8 ``[N, C, H, W]`` with labels: int64 ``[N]`` class indices, float32 ``[N, L]`` multi-hot
    labels of a multi-label task (``num_classes`` = L), or ``None`` for unlabeled data."""

    images: torch.Tensor
    labels: torch.Tensor | None
    num_classes: int

    def __post_init__(self) -> None:
        if self.images.dtype != torch.uint8 or self.images.dim() != 4:
            raise ValueError(f"images must be uint8 [N, C, H, W], got {self.images.dtype} {list(self.images.shape)}")
        if self.labels is None:
            return
        count = len(self.images)
        single = self.labels.dtype == torch.int64 and self.labels.shape == (count,)
        multi = self.labels.dtype == torch.float32 and self.labels.shape == (count, self.num_classes)
        if not (single or multi):
            raise ValueError(
                f"labels must be int64 [{count}] or float32 [{count}, {self.num_classes}], "
                f"got {self.labels.dtype} {list(self.labels.shape)}"
            )
        if multi and not torch.all((self.labels == 0) | (self.labels == 1)):
            raise ValueError("multi-hot labels must be 0 or 1")

    def __len__(self) -> int:
        return len(self.images)

    @property
    def multilabel(self) -> bool:
        """Whether the labels are multi-hot (each image may carry several of the ``num_classes`` labels)."""
        return self.labels is not None and self.labels.dim() == 2

    def subset(self, indices: torch.Tensor | Sequence[int]) -> ImageSet:
        index = torch.as_tensor(indices, dtype=torch.int64)
        labels = None if self.labels is None else self.labels[index]
        return ImageSet(images=self.images[index], labels=labels, num_classes=self.num_classes)


@dataclass(frozen=True)
class Grouping:
    """A group id for every training image of a source, which partitions divide by and partition.json counts:
    CheXpert's meta-categories (label combinations) or Office-Home's domains."""

    kind: str  # what a group is, as partition.json names it: "meta-categories" or "domains"
    ids: np.ndarray  # int64, one per training image
    names: tuple[str, ...]  # one per group id


@dataclass(frozen=True)
class SourceData:
    """One dataset as loaded from disk: its training and test images and normalization statistics.

    Sources without a test set of their own (``test`` is ``None``) get one carved from ``train`` by the fixed
    split. ``categories`` replaces the labels where partitions need one label per image (multi-label data);
    ``domains`` is what ``--partition domain`` gives out, one domain per client. ``classes`` names the class
    indices (empty where unknown), which OOD sets and new clients' data are matched to.
    """

    name: str
    train: ImageSet
    test: ImageSet | None
    mean: tuple[float, ...]
    std: tuple[float, ...]
    categories: Grouping | None = None
    domains: Grouping | None = None
    classes: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()  # undecodable images left out (--skip-bad-images), as the source names them

    def fitted(self, size: int | None, channels: int | None = None) -> SourceData:
        """The same source with its images stored for a ``size`` px model (see `fit_images`; None: sizes kept) with
        ``channels`` channels (None: kept), and statistics to match (see `channel_statistics`)."""
        channels = channels or self.train.images.shape[1]

        def fit(data: ImageSet) -> ImageSet:
            images = fit_images(data.images, size, channels)
            return ImageSet(images=images, labels=data.labels, num_classes=data.num_classes)

        mean, std = channel_statistics(self.mean, self.std, channels)
        test = None if self.test is None else fit(self.test)
        return replace(self, train=fit(self.train), test=test, mean=mean, std=std)


@dataclass(frozen=True)
class Rows:
    """Which rows of a source's training and test sets to decode: sorted indices, or None for all of a set."""

    train: np.ndarray | None = None
    test: np.ndarray | None = None


@dataclass(frozen=True)
class ScannedSource:
    """A source as far as it is known before its images are decoded: how many training and test images it has (no
    test images: no test set of its own), and the undecodable images it left out (``--skip-bad-images``).

    ``decode(rows)`` gives its SourceData. Where ``by_rows`` (image files, counted and labeled without their
    pixels) it holds only those ``rows`` of each set, in order; else the whole source, whatever ``rows`` says
    (arrays, which are loaded whole to be counted).
    """

    num_train: int
    num_test: int
    decode: Callable[[Rows], SourceData]
    by_rows: bool
    skipped: tuple[str, ...] = ()


def pixel_statistics(images: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The per-channel mean and std of uint8 ``[N, C, H, W]`` images, in 0..1, measured on at most
    _STATISTICS_SAMPLE images spread evenly over the set, a chunk at a time."""
    sample = images[:: max(1, -(-len(images) // _STATISTICS_SAMPLE))]
    channels = images.shape[1]
    total, squares, count = torch.zeros(channels, dtype=torch.float64), torch.zeros(channels, dtype=torch.float64), 0
    for chunk in sample.split(_RESIZE_CHUNK):
        pixels = chunk.to(torch.float64).div_(255).transpose(0, 1).reshape(channels, -1)
        total += pixels.sum(dim=1)
        squares += pixels.square().sum(dim=1)
        count += pixels.shape[1]
    mean = total / max(count, 1)
    std = (squares / max(count, 1) - mean.square()).clamp_(min=0).sqrt_().clamp_(min=_MIN_STD)
    return tuple(round(value, 4) for value in mean.tolist()), tuple(round(value, 4) for value in std.tolist())


def channel_statistics(
    mean: Sequence[float], std: Sequence[float], channels: int
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel normalization statistics for images converted to ``channels`` channels by `resize_images`: the
    same when the count matches; one grey channel's repeated for grey shown as RGB (its channels are copies); RGB
    ones averaged for grey, as peradapt normalizes grey data with ImageNet's RGB statistics.

    ``channel_statistics(IMAGENET_MEAN, IMAGENET_STD, channels)`` is the normalization of the datasets decoded from
    files, for either channel count.
    """
    mean, std = tuple(mean), tuple(std)
    if len(mean) == channels:
        return mean, std
    if len(mean) == 1:
        return mean * channels, std * channels
    return (sum(mean) / len(mean),) * channels, (sum(std) / len(std),) * channels


def fit_images(images: torch.Tensor, size: int | None, channels: int) -> torch.Tensor:
    """uint8 ``[N, C, H, W]`` images with ``channels`` channels, as stored for a model taking ``size`` px: larger
    images resized to ``size``×``size``, smaller ones kept as they are (the model's inputs scale them up); ``None``:
    every size kept."""
    larger = size is not None and (images.shape[-2] > size or images.shape[-1] > size)
    return resize_images(images, size if larger else None, channels)


def resize_images(images: torch.Tensor, size: int | None, channels: int) -> torch.Tensor:
    """Resize uint8 ``[N, C, H, W]`` images to ``size``×``size`` (``None``: keep the size) with ``channels``
    channels (1 or 3)."""
    source_channels = images.shape[1]
    if (source_channels, channels) not in {(1, 1), (3, 3), (1, 3), (3, 1)}:
        raise ConfigError(f"cannot convert {source_channels}-channel images to {channels} channels (use 1 or 3)")
    if size is None or images.shape[2:] == (size, size):
        if source_channels == channels:
            return images
        if source_channels == 1:  # grey as RGB at its size: a copy per channel, no pass through floats
            return images.expand(-1, 3, -1, -1).contiguous()
    return torch.cat([_resize_chunk(chunk, size, channels) for chunk in images.split(_RESIZE_CHUNK)])


def scale_pixels(pixels: torch.Tensor, size: int) -> torch.Tensor:
    """Float ``[N, C, H, W]`` pixels at ``size``×``size`` (bilinear, antialiased when shrinking): how images are
    stored smaller and how the model's inputs are scaled up, so that both give one picture."""
    if pixels.shape[2:] == (size, size):
        return pixels
    return F.interpolate(pixels, size=(size, size), mode="bilinear", align_corners=False, antialias=True)


def _resize_chunk(images: torch.Tensor, size: int | None, channels: int) -> torch.Tensor:
    pixels = images.to(torch.float32)
    if pixels.shape[1] == 3 and channels == 1:
        weights = pixels.new_tensor(_LUMA_WEIGHTS).view(1, 3, 1, 1)
        pixels = (pixels * weights).sum(dim=1, keepdim=True)
    if size is not None:
        pixels = scale_pixels(pixels, size)
    resized = pixels.round_().clamp_(0, 255).to(torch.uint8)
    if resized.shape[1] == 1 and channels == 3:
        # Grey to colour by repetition: the backbone then sees the same intensity in every channel.
        resized = resized.expand(-1, 3, -1, -1).contiguous()
    return resized
