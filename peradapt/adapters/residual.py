"""The PerAda / Rebuffi series residual adapter as a PEFT LoRA custom layer.

Wrapping a convolution `conv`, the layer computes `y = conv(x)`, then `y + conv1x1(dropout(BN(y)))`
(Rebuffi et al. 2017, "series" adapter; PerAda Sec. 4 places one after `conv1` and one after `conv2` of every
basic block). The 1x1 convolution has no bias and starts at N(0, 1e-4), so an injected model starts out as the
backbone.

PEFT knows custom layers only through `LoraConfig._register_custom_module`, which is not saved in
`adapter_config.json`. Our configs therefore carry `init_lora_weights="residual_adapter"`, and importing peradapt
makes every LoraConfig with that value register the layers of `ADAPTER_LAYERS` (this one for convolutions, the ViT
blocks' bottleneck adapter of `peradapt.adapters.vit` for linear layers). That is what lets a plain
`PeftModel.from_pretrained(backbone, exported_dir)` rebuild the adapter after `import peradapt`.

The adapter's modules are stored under `lora_residual`, not `lora_A`/`lora_B`: they are not a low-rank pair,
and PEFT's save-time shape check (which expects 2-D `lora_A`/`lora_B` matrices and warns about unsharded
weights otherwise) must not mistake the adapter's BatchNorm vectors for truncated LoRA matrices.
"""

from __future__ import annotations

from typing import Any

import torch
from peft import LoraConfig
from peft.tuners.lora.layer import LoraLayer
from torch import nn

from peradapt.adapters.branch import AdapterDropout, ChannelProjection

RESIDUAL_INIT = "residual_adapter"
ADAPTER_INIT_STD = 1e-4


class ResidualAdapterLayer(nn.Module, LoraLayer):
    adapter_layer_names = ("lora_residual",)
    other_param_names = ("lora_dropout_p",)

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: LoraConfig, **kwargs: Any) -> None:
        super().__init__()
        LoraLayer.__init__(self, base_layer)
        self.lora_residual = nn.ModuleDict()
        self.lora_dropout_p: dict[str, float] = {}
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, config.lora_dropout, r=config.r)

    def update_layer(self, adapter_name: str, lora_dropout: float, **kwargs: Any) -> None:
        self.lora_residual[adapter_name] = self.adapter_module(lora_dropout, **kwargs)
        self.lora_dropout_p[adapter_name] = lora_dropout
        self._move_adapter_to_device_of_base_layer(adapter_name)
        self.set_adapter(self.active_adapters)

    def adapter_module(self, dropout: float, **kwargs: Any) -> nn.Module:
        """The residual branch added to the base layer's output: BN, dropout, 1x1 convolution."""
        channels = self.get_base_layer().out_channels
        projection = ChannelProjection(channels)
        nn.init.normal_(projection.weight, mean=0.0, std=ADAPTER_INIT_STD)
        return nn.Sequential(nn.BatchNorm2d(channels), AdapterDropout(dropout), projection)

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        raise NotImplementedError(
            "residual adapters are nonlinear branches kept separate from the backbone; use the PeftModel as it is"
        )

    def unmerge(self) -> None:
        raise NotImplementedError("residual adapters are never merged")

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        y = self.base_layer(x, *args, **kwargs)
        if self.disable_adapters:
            return y
        for name in self.active_adapters:
            if name in self.lora_residual:
                y = y + self.lora_residual[name](y)
        return y

    def __repr__(self) -> str:
        return "residual_adapter." + super().__repr__()


# The adapter layer for each kind of base layer that a residual-adapter config targets.
ADAPTER_LAYERS: dict[type[nn.Module], type[ResidualAdapterLayer]] = {nn.Conv2d: ResidualAdapterLayer}


def _install_registration_hook() -> None:
    original_post_init = LoraConfig.__post_init__
    if getattr(original_post_init, "_peradapt_hook", False):
        return

    def __post_init__(self: LoraConfig) -> None:
        original_post_init(self)
        if self.init_lora_weights == RESIDUAL_INIT:
            self._register_custom_module(dict(ADAPTER_LAYERS))

    __post_init__._peradapt_hook = True  # type: ignore[attr-defined]
    LoraConfig.__post_init__ = __post_init__


_install_registration_hook()
