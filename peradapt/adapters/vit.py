"""Adapters for ViT blocks: the residual bottleneck adapter as a PEFT layer, and where adapters go in a ViT.

The residual bottleneck adapter (Houlsby et al. 2019; Rebuffi et al.'s series adapter for transformers) wraps the
second linear layer of every block's MLP and computes y = fc2(x), then y + up(GELU(down(dropout(y)))): it adapts
the MLP's output before the block adds it to the residual stream. `down` maps the width d to r (`--lora-rank`),
`up` maps back with weights N(0, 1e-4) and a zero bias, so an injected model starts out as the backbone. It is the
ResNet residual adapter's counterpart for linear layers, registered with PEFT the same way (see
`peradapt.adapters.residual`), so a plain `PeftModel.from_pretrained` rebuilds it after `import peradapt`. Like
PerAda's ResNet adapter trains the BatchNorms beside it, this one trains the blocks' LayerNorms (as Houlsby et al.
do; the final LayerNorm's affine map folds into the head, which trains too).

The MLP's output layer is `mlp.fc2` in timm's ViTs and in transformers ≥ 5 (`output.dense` before). LoRA
(`--adapter lora`) goes on every linear layer of a ViT but the head: the attention projections (timm `qkv`,
`proj`; transformers `q_proj`/`k_proj`/`v_proj`/`o_proj`, before 5 `query`/`key`/`value`/`dense`) and the MLP's.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from peradapt.adapters.branch import AdapterDropout
from peradapt.adapters.residual import ADAPTER_INIT_STD, ADAPTER_LAYERS, ResidualAdapterLayer

# The MLP's output layer of a transformer block: `mlp.fc2`, or transformers' pre-5 `output.dense` (not the
# attention's own `attention.output.dense`).
_MLP_OUTPUT = re.compile(r"(^|\.)mlp\.fc2$|(^|\.)(?<!attention\.)output\.dense$")


class BottleneckAdapterLayer(ResidualAdapterLayer):
    """A linear layer followed by the residual bottleneck adapter: y + up(GELU(down(dropout(y))))."""

    def adapter_module(self, dropout: float, *, r: int, **kwargs: Any) -> nn.Module:
        width = self.get_base_layer().out_features
        up = nn.Linear(r, width)
        nn.init.normal_(up.weight, mean=0.0, std=ADAPTER_INIT_STD)
        nn.init.zeros_(up.bias)
        # The ResNet adapter's dropout (adapters/branch.py): nn.Dropout's layout, cheaper masks on CPU.
        return nn.Sequential(AdapterDropout(dropout), nn.Linear(width, r), nn.GELU(), up)


ADAPTER_LAYERS[nn.Linear] = BottleneckAdapterLayer


def is_vit(model: nn.Module) -> bool:
    """Whether `model` is built of transformer blocks, recognised by their MLPs (ViTs, and other transformers)."""
    return bool(mlp_outputs(model))


def mlp_outputs(backbone: nn.Module) -> list[str]:
    """Names of every transformer block's MLP output layer, where the residual bottleneck adapter goes."""
    return [n for n, m in backbone.named_modules() if isinstance(m, nn.Linear) and _MLP_OUTPUT.search(n)]


def block_layer_norms(backbone: nn.Module) -> list[str]:
    """The transformer blocks' LayerNorms, by the last part of their names (PEFT's `modules_to_save` matches the
    end of a name: `norm1`, `norm2`). The final LayerNorm stays frozen: its affine map folds into the head."""
    blocks = tuple(_MLP_OUTPUT.sub("", name) + "." for name in mlp_outputs(backbone))
    norms = (n for n, m in backbone.named_modules() if isinstance(m, nn.LayerNorm) and n.startswith(blocks))
    return sorted({n.rpartition(".")[2] for n in norms})


def linear_layers(backbone: nn.Module, head: str) -> list[str]:
    """Every linear layer but the head: a ViT's attention and MLP projections, where LoRA goes."""
    return [n for n, m in backbone.named_modules() if isinstance(m, nn.Linear) and n != head]
