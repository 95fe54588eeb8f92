"""Frozen convolutions on feature maps smaller than their kernel, computed as one matrix product.

On 32 px images a ResNet's last stages see 2x2 and 1x1 feature maps. A 3x3 convolution with padding 1 there
multiplies mostly zeros: on a 1x1 map only the centre tap meets an input pixel, on a 2x2 map each output pixel
meets 4 of the 9 taps. oneDNN and cuDNN compute all nine. A convolution is linear in its input, so on an H x W
input it is one matrix D of shape (Ho*Wo*C_out, H*W*C_in), which costs H*W / (k_h*k_w) of the convolution's
multiply-adds. When that is less than one (and the weights are frozen, so D stays valid), `SmallInputConv2d`
computes `y = D x` instead: the same function to float rounding, forward and input gradient, ResNet-18's CIFAR
inference about 1.3x faster (docs/BENCHMARKS.md).

D is built once per input size and weight version by running the convolution itself on the identity basis, so
stride, padding, padding mode, dilation and groups are handled by the convolution's own code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SmallInputConv2d(nn.Conv2d):
    """`nn.Conv2d` (same parameters, same state dict) whose frozen weights meet small inputs as a dense matrix."""

    _dense_key: tuple | None = None
    _dense: torch.Tensor | None = None
    _dense_size: tuple[int, int] = (0, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._dense_pays(x):
            return super().forward(x)
        batch, _, height, width = x.shape
        dense, out_height, out_width = self._dense_map(height, width, x.device)
        # [N, H, W, C] flattened: a view of channels-last inputs, which is what peradapt feeds its models.
        bias = None if self.bias is None else self.bias.repeat(out_height * out_width)  # one per output pixel
        flat = F.linear(x.permute(0, 2, 3, 1).reshape(batch, -1), dense, bias)
        return flat.view(batch, out_height, out_width, self.out_channels).permute(0, 3, 1, 2)

    def _dense_pays(self, x: torch.Tensor) -> bool:
        if self.weight.requires_grad or x.dim() != 4:  # trained weights need the convolution's weight gradient
            return False
        kernel_taps = self.kernel_size[0] * self.kernel_size[1]
        return x.shape[-2] * x.shape[-1] * self.groups < kernel_taps

    def _dense_map(self, height: int, width: int, device: torch.device) -> tuple[torch.Tensor, int, int]:
        weight = self.weight
        key = (height, width, device, weight.dtype, weight.data_ptr(), weight._version)
        if key != self._dense_key:
            inputs = height * width * self.in_channels
            # Not an inference tensor (it is saved for the input gradient) and not autocast: D is the weights.
            with torch.inference_mode(False), torch.no_grad(), torch.autocast(device.type, enabled=False):
                basis = torch.eye(inputs, dtype=weight.dtype, device=device)
                basis = basis.view(inputs, height, width, self.in_channels).permute(0, 3, 1, 2)
                response = self._conv_forward(basis, weight, None)  # [inputs, C_out, Ho, Wo]
                self._dense = response.permute(0, 2, 3, 1).reshape(inputs, -1).t().contiguous()
            self._dense_key, self._dense_size = key, (response.shape[-2], response.shape[-1])
        assert self._dense is not None
        return self._dense, *self._dense_size


def use_small_input_convolutions(model: nn.Module) -> nn.Module:
    """Make every plain `nn.Conv2d` of `model` a `SmallInputConv2d`, in place (parameters and state dict keep)."""
    for module in model.modules():
        if type(module) is nn.Conv2d:
            module.__class__ = SmallInputConv2d
    return model
