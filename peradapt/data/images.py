"""In-memory image sets: whole datasets held as ready uint8 tensors, so training never decodes images."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from peradapt.errors import ConfigError

# ITU-R 601-2 luma weights, the same that PIL's convert("L") uses.
_LUMA_WEIGHTS = (0.299, 0.587, 0.114)
# Resizing converts to float; chunking bounds that temporary copy for large sets such as CIFAR-100.
_RESIZE_CHUNK = 4096


@dataclass(frozen=True)
class ImageSet:
    """Images as uint8 ``[N, C, H, W]`` with int64 labels ``[N]`` (``None`` for unlabeled data)."""

    images: torch.Tensor
    labels: torch.Tensor | None
    num_classes: int

    def __post_init__(self) -> None:
        if self.images.dtype != torch.uint8 or self.images.dim() != 4:
            raise ValueError(f"images must be uint8 [N, C, H, W], got {self.images.dtype} {list(self.images.shape)}")
        if self.labels is not None and (self.labels.dtype != torch.int64 or self.labels.shape != (len(self.images),)):
            raise ValueError(
                f"labels must be int64 [{len(self.images)}], got {self.labels.dtype} {list(self.labels.shape)}"
            )

    def __len__(self) -> int:
        return len(self.images)

    def subset(self, indices: torch.Tensor | Sequence[int]) -> ImageSet:
        index = torch.as_tensor(indices, dtype=torch.int64)
        labels = None if self.labels is None else self.labels[index]
        return ImageSet(images=self.images[index], labels=labels, num_classes=self.num_classes)


def resize_images(images: torch.Tensor, size: int, channels: int) -> torch.Tensor:
    """Resize uint8 ``[N, C, H, W]`` images to ``size``×``size`` with ``channels`` channels (1 or 3)."""
    source_channels = images.shape[1]
    if (source_channels, channels) not in {(1, 1), (3, 3), (1, 3), (3, 1)}:
        raise ConfigError(f"cannot convert {source_channels}-channel images to {channels} channels (use 1 or 3)")
    if images.shape[2:] == (size, size) and source_channels == channels:
        return images
    return torch.cat([_resize_chunk(chunk, size, channels) for chunk in images.split(_RESIZE_CHUNK)])


def _resize_chunk(images: torch.Tensor, size: int, channels: int) -> torch.Tensor:
    pixels = images.to(torch.float32)
    if pixels.shape[1] == 3 and channels == 1:
        weights = pixels.new_tensor(_LUMA_WEIGHTS).view(1, 3, 1, 1)
        pixels = (pixels * weights).sum(dim=1, keepdim=True)
    if pixels.shape[2:] != (size, size):
        pixels = F.interpolate(pixels, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
    resized = pixels.round_().clamp_(0, 255).to(torch.uint8)
    if resized.shape[1] == 1 and channels == 3:
        # Grey to colour by repetition: the backbone then sees the same intensity in every channel.
        resized = resized.expand(-1, 3, -1, -1).contiguous()
    return resized
