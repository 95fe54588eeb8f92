"""The residual adapter's dropout and 1x1 projection, written for the training step's speed on CPU.

Both keep the state-dict layout of `nn.Dropout` and `nn.Conv2d` (they subclass them), so adapters saved before and
after load alike; only how the same function is computed differs:

- `AdapterDropout`: on CPU, `nn.Dropout` draws one 32-bit number per element from the serial generator
  (`bernoulli_`), the most expensive operation of an adapter step after the convolutions. Here each element gets 16
  random bits (four per 64-bit draw), so the keep probability is 1 - p rounded to 1/65536. The mask is made with
  float arithmetic, not a comparison: CPU kernels on bool tensors (comparison results, `where`, `masked_fill`, bool
  to float) run several times slower than plain float ones. Other devices keep `nn.Dropout`, whose fused kernel is
  already cheap.
- `ChannelProjection`: a 1x1 convolution is a matrix product over channels. On channels-last inputs (what
  `peradapt.data.to_model_input` gives) that product runs on the tensor as it lies in memory, several times faster
  than oneDNN's 1x1 convolution for the adapters' small spatial sizes, forward and backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_LANE_VALUES = 2**16  # a 16-bit lane takes this many values, from -2**15 up
_LANES_PER_DRAW = 4  # 16-bit lanes in one 64-bit draw


def keep_mask(like: torch.Tensor, p: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Floats laid out as `like` (a dense tensor, e.g. a BatchNorm output), each 1 with probability 1 - p, else 0;
    drawn from `generator` (default: the global one)."""
    count = like.numel()
    draws = torch.empty(-(-count // _LANES_PER_DRAW), dtype=torch.int64, device=like.device)
    draws.random_(-(2**63), None, generator=generator)  # every bit uniform: the full int64 range
    lanes = draws.view(torch.int16)[:count].as_strided(like.shape, like.stride())
    lowest_kept = -(_LANE_VALUES // 2) + round(p * _LANE_VALUES)
    # Lanes are integers, exact as floats: lane - (lowest_kept - 1) is at least 1 for a kept lane, at most 0 otherwise.
    return lanes.to(like.dtype).sub_(lowest_kept - 1).clamp_(0, 1)


class AdapterDropout(nn.Dropout):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0 or x.device.type != "cpu":
            return super().forward(x)
        # As F.dropout: kept elements scaled by 1 / (1 - p), so the expected output is the input.
        return x * keep_mask(x, self.p).div_(1 - self.p)


class ChannelProjection(nn.Conv2d):
    """A bias-free 1x1 convolution from `channels` to `channels`."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels, channels, kernel_size=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_contiguous(memory_format=torch.channels_last):
            return super().forward(x)
        return self.channel_product(x)

    def channel_product(self, x: torch.Tensor) -> torch.Tensor:
        """The projection as a matrix product over the channels of `x` (any layout; fastest in channels-last)."""
        # [N, H, W, C] is a plain view of channels-last memory; the product's result is channels-last again.
        return F.linear(x.permute(0, 2, 3, 1), self.weight.flatten(1)).permute(0, 3, 1, 2)
