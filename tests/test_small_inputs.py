"""Frozen convolutions on feature maps smaller than their kernel are one matrix product
(peradapt.backbones.small_inputs)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from peradapt.adapters import inject_adapters
from peradapt.backbones import create_backbone, freeze
from peradapt.backbones.small_inputs import SmallInputConv2d, use_small_input_convolutions
from tests.conftest import TINY_BACKBONE


def frozen_pair(conv: nn.Conv2d) -> tuple[nn.Conv2d, SmallInputConv2d]:
    torch.manual_seed(0)
    for parameter in conv.parameters():
        nn.init.normal_(parameter)
        parameter.requires_grad_(False)
    small = use_small_input_convolutions(copy.deepcopy(conv))
    assert isinstance(small, SmallInputConv2d)
    return conv, small


def compare(conv: nn.Conv2d, small: SmallInputConv2d, inputs: torch.Tensor) -> None:
    """Same output and input gradient as the convolution."""
    expected_in = inputs.clone().requires_grad_()
    expected = conv(expected_in)
    given_in = inputs.clone().requires_grad_()
    given = small(given_in)
    torch.testing.assert_close(given, expected, rtol=1e-5, atol=1e-5)
    upstream = torch.randn_like(expected)
    expected.backward(upstream)
    given.backward(upstream)
    torch.testing.assert_close(given_in.grad, expected_in.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("conv", "size"),
    [
        (nn.Conv2d(8, 16, 3, padding=1, bias=False), 1),
        (nn.Conv2d(8, 16, 3, padding=1, bias=False), 2),
        (nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False), 2),  # a ResNet stage's first convolution
        (nn.Conv2d(6, 4, 3, padding=1, bias=True), 2),
        (nn.Conv2d(8, 8, 3, padding=1, groups=2), 1),
        (nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect"), 2),
        (nn.Conv2d(4, 6, (3, 5), padding=(1, 2), dilation=1), 2),
    ],
)
@pytest.mark.parametrize("channels_last", [True, False])
def test_dense_map_is_the_convolution(conv: nn.Conv2d, size: int, channels_last: bool) -> None:
    conv, small = frozen_pair(conv)
    inputs = torch.randn(5, conv.in_channels, size, size)
    if channels_last:
        inputs = inputs.contiguous(memory_format=torch.channels_last)
    compare(conv, small, inputs)
    assert small._dense_key is not None, "the matrix product was not used"


def test_one_pixel_is_the_centre_tap_by_hand() -> None:
    """On a 1x1 map with padding 1, a 3x3 convolution is its centre weights times the pixel's channels."""
    conv, small = frozen_pair(nn.Conv2d(3, 2, 3, padding=1, bias=True))
    pixel = torch.tensor([1.0, -2.0, 0.5])
    by_hand = conv.weight[:, :, 1, 1] @ pixel + conv.bias
    torch.testing.assert_close(small(pixel.view(1, 3, 1, 1)).flatten(), by_hand)


def test_larger_maps_and_trained_weights_use_the_convolution() -> None:
    conv, small = frozen_pair(nn.Conv2d(4, 4, 3, padding=1))
    compare(conv, small, torch.randn(2, 4, 3, 3))  # 9 pixels: the matrix would cost as much as the taps
    assert small._dense_key is None
    small.weight.requires_grad_(True)  # e.g. FedBN's full-network training: the weight gradient is needed
    small(torch.randn(2, 4, 1, 1)).sum().backward()
    assert small._dense_key is None and small.weight.grad is not None
    assert small.weight.grad[:, :, 0, 0].abs().sum() == 0  # padding only: the corner taps never met a pixel


def test_new_weights_rebuild_the_matrix() -> None:
    conv, small = frozen_pair(nn.Conv2d(4, 4, 3, padding=1, bias=False))
    inputs = torch.randn(2, 4, 2, 2)
    small(inputs)
    replacement = torch.randn_like(conv.weight)
    conv.weight.copy_(replacement)
    small.load_state_dict(conv.state_dict())
    compare(conv, small, inputs)


def test_matrix_built_in_inference_mode_serves_training() -> None:
    """Teachers' logits (inference) come before a training step; the matrix is saved for the input gradient."""
    conv, small = frozen_pair(nn.Conv2d(4, 4, 3, padding=1, bias=False))
    inputs = torch.randn(2, 4, 1, 1)
    with torch.inference_mode():
        small(inputs)
    compare(conv, small, inputs)


def test_frozen_resnet_at_32_px_is_the_same_function() -> None:
    """freeze() turns every convolution of a backbone into SmallInputConv2d (state dict unchanged); at 32 px its
    last stages take the matrix path and the adapted model's logits and gradients are timm's."""
    torch.manual_seed(0)
    plain = create_backbone(TINY_BACKBONE, 10, 1).eval()
    frozen = freeze(copy.deepcopy(plain))
    assert all(type(m) is SmallInputConv2d for m in frozen.modules() if isinstance(m, nn.Conv2d))
    assert frozen.state_dict().keys() == plain.state_dict().keys()
    images = torch.randn(4, 1, 32, 32).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        torch.testing.assert_close(frozen(images), plain(images), rtol=1e-5, atol=1e-5)
    assert any(m._dense_key is not None for m in frozen.modules() if isinstance(m, SmallInputConv2d))

    for parameter in plain.parameters():
        parameter.requires_grad_(False)
    gradients = []
    for backbone in (plain, frozen):
        torch.manual_seed(1)  # the same adapter weights for both
        model = inject_adapters(backbone, "residual", dropout=0.0, lora_rank=8)
        model.train()
        model(images).square().sum().backward()
        gradients.append({n: p.grad for n, p in model.trainable_parameters().items()})
    assert gradients[0].keys() == gradients[1].keys()
    for name, gradient in gradients[0].items():
        torch.testing.assert_close(gradients[1][name], gradient, rtol=1e-4, atol=1e-5)
