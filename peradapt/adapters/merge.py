"""A client's adapted model as one plain network: its adapters folded into the backbone's weights.

`merged_network(model, state, backbone)` returns a fresh timm (or transformers) model, with no PEFT wrapper and no
peradapt module, whose eval-mode logits are those of `model` with `state` loaded, and the timm architecture and
arguments that rebuild it without peradapt. What folds, and how (eval mode throughout: every BatchNorm applies its
running statistics, every dropout is the identity):

- **Residual adapter (ResNet)**, PerAda Sec. 4 / Rebuffi et al. 2017's series adapter after a bias-free convolution
  K whose output y = K * x feeds a BatchNorm (BN) alone. The branch is BN_a, dropout, a bias-free 1x1 convolution W
  (C x C). In eval mode BN_a(y) = a ⊙ y + b with a = γ_a / √(σ²_a + ε_a), b = β_a − μ_a ⊙ a, so the adapted output
  is affine in y:

      y' = y + W (a ⊙ y + b) = M y + c,    M = I + W diag(a),    c = W b.

  A convolution is linear in its kernel, so M y = (M K) * x with (M K)[o] = Σ_j M[o, j] K[j]: the kernel becomes
  K' = M K. The constant c moves into the next BatchNorm, which subtracts its running mean first:
  BN(y') = BN'(K' * x) with μ' = μ − c (γ, β, σ² unchanged). (In training mode the BatchNorms normalise with batch
  statistics and the adapter is no affine map: the merged network is the adapted model in eval mode only.)
- **LoRA**: merged by PEFT's own `merge_and_unload` (W' = W + s B A), on a fresh copy of the model.
- **Trained copies** (PEFT's `modules_to_save`: BatchNorms, LayerNorms, the head) replace the frozen originals;
  the frozen BatchNorms' running statistics of a `--frozen-bn train` state go in as they are; a `--scope full`
  state is the whole network.
- **Personal head** (FedRoD: logits = generic(h) + personal(h), both linear in h): one linear classifier with
  W = W_g + W_p, b = b_g + b_p.

The ViT's residual bottleneck adapter, up(GELU(down(y))), is not affine and does not fold: `merged_network`
refuses it with a `ConfigError`.

The network is built where peradapt is not needed: `timm.create_model(architecture, **model_args)` (the narrow
ResNets as timm's `resnet18` with their `layers` and `channels`, the tiny ViT as `vit_tiny_patch16_224` with its
sizes), or the transformers model's own class from its config. Nothing of the live model is changed, and building
fresh modules draws nothing from the run's random generator.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import timm
import torch
import torch.fx
from peft import PeftModel, get_peft_model
from timm.models import split_model_name_tag
from timm.models.resnet import ResNet
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from peradapt.adapters.model import AdaptedModel, AdapterState
from peradapt.adapters.residual import ResidualAdapterLayer
from peradapt.adapters.vit import BottleneckAdapterLayer
from peradapt.backbones import TINY_VITS, classifier_name
from peradapt.backbones.hf import is_hf
from peradapt.errors import ConfigError

TIMM = "timm"
TRANSFORMERS = "transformers"
# timm's own entries that build peradapt's registered backbones from arguments (see `plain_timm_architecture`).
NARROW_RESNET_ARCHITECTURE = "resnet18"  # passes `layers` and `channels` on to ResNet
TINY_VIT_ARCHITECTURE = "vit_tiny_patch16_224"  # a plain VisionTransformer: sizes as arguments
_NARROW_RESNET = re.compile(r"resnet\d+_w(?P<width>\d+)")  # stage widths w, 2w, 4w, 8w
_UNMERGEABLE_VIT = (
    "residual adapters of a ViT (up(GELU(down(y)))) are nonlinear and cannot be merged into the backbone: "
    "train with --adapter lora for a merged model, or load the adapter export after `import peradapt`"
)


@dataclass(frozen=True)
class MergedNetwork:
    """A plain network with a client's adapters folded in, and how to build it without peradapt."""

    network: nn.Module  # a timm or transformers model in eval mode, on the CPU
    library: str  # TIMM or TRANSFORMERS
    # timm: the `timm.create_model` name; transformers: the model's class (its config, `network.config`, says all).
    architecture: str
    # timm: the keyword arguments of `timm.create_model` (JSON values); transformers: none.
    model_args: dict[str, Any] = field(default_factory=dict)


def merged_network(model: AdaptedModel, state: AdapterState, backbone: str) -> MergedNetwork:
    """`model` (made from backbone `backbone`, a timm name or `hf:...`) with `state` loaded, as one plain network
    whose eval-mode logits are the adapted model's (see the module docstring). `model` itself is left as it is.

    Raises ConfigError for what does not fold (a ViT's residual adapters) and WeightsError for a state of another
    model."""
    _check_mergeable(model, state)
    # Fresh modules are randomly initialised before the weights replace their values: from a forked generator, so
    # that the run's random stream is where it was.
    with torch.random.fork_rng(devices=[]):
        library, architecture, model_args, build = _plain_recipe(model.base_model, backbone)
        fresh = build()
        norms = norm_after_each_conv(fresh) if model.kind == "residual" else {}
        folded = _folded(_replica(model, state, fresh), model.kind, norms)
        _fold_personal_head(folded, model, state)
        network = build()
    _load_exactly(network, folded.state_dict(), architecture)
    return MergedNetwork(network.eval(), library, architecture, model_args)


def _check_mergeable(model: AdaptedModel, state: AdapterState) -> None:
    if any(isinstance(layer, BottleneckAdapterLayer) for layer in model.module.modules()):
        raise ConfigError(_UNMERGEABLE_VIT)
    model.check_fits(state)


# ---------------------------------------------------------------- the plain architecture


def plain_timm_architecture(backbone: str, network: nn.Module) -> tuple[str, dict[str, Any]]:
    """The timm entry and `timm.create_model` arguments (JSON values) that build `network`, made from timm backbone
    `backbone`, with timm alone: peradapt's narrow ResNets as timm's `resnet18` with their `layers` and `channels`,
    its tiny ViTs as `vit_tiny_patch16_224` with their sizes, any other name without its pretrained tag; always
    `num_classes` and `in_chans`, and a ViT's `img_size` (the resolution it was made for)."""
    architecture = split_model_name_tag(backbone)[0]
    args: dict[str, Any] = {}
    if architecture in TINY_VITS:
        args = dict(TINY_VITS[architecture])
        architecture = TINY_VIT_ARCHITECTURE
    elif (narrow := _NARROW_RESNET.fullmatch(architecture)) and isinstance(network, ResNet):
        width = int(narrow["width"])
        stages = [network.layer1, network.layer2, network.layer3, network.layer4]
        args = {"layers": [len(stage) for stage in stages], "channels": [width, 2 * width, 4 * width, 8 * width]}
        architecture = NARROW_RESNET_ARCHITECTURE
    args["num_classes"] = network.num_classes
    args["in_chans"] = _input_channels(network)
    image_size = getattr(getattr(network, "patch_embed", None), "img_size", None)
    if image_size is not None:
        height, width = image_size
        args["img_size"] = height if height == width else [height, width]
    return architecture, args


def _input_channels(network: nn.Module) -> int:
    """The channels of the network's first convolution (a ResNet's stem, a ViT's patch embedding)."""
    first = next((m for n, m in network.named_modules() if isinstance(m, nn.Conv2d) and "lora_" not in n), None)
    if first is None:
        raise ConfigError(f"{type(network).__name__} has no convolution that says its input channels")
    return first.in_channels


def _plain_recipe(network: nn.Module, backbone: str) -> tuple[str, str, dict[str, Any], Callable[[], nn.Module]]:
    """(library, architecture, arguments, a function making a fresh plain network of that architecture)."""
    if is_hf(backbone):
        import transformers  # there is an hf: backbone, so transformers is installed

        config = copy.deepcopy(network.config)
        return (
            TRANSFORMERS,
            type(network).__name__,
            {},
            lambda: transformers.AutoModelForImageClassification.from_config(copy.deepcopy(config)),
        )
    architecture, args = plain_timm_architecture(backbone, network)
    return TIMM, architecture, args, lambda: timm.create_model(architecture, pretrained=False, **args)


# ---------------------------------------------------------------- a fresh copy of the adapted model


def _replica(model: AdaptedModel, state: AdapterState, fresh: nn.Module) -> nn.Module:
    """`fresh` with `model`'s adapters injected again (same PEFT config) and every tensor of `model` with `state`
    loaded: the live model's function on modules of its own. A personal head is left out (folded later)."""
    personal = set(model.personal_head_keys)
    tensors = {name: tensor for name, tensor in model.module.state_dict().items() if name not in personal}
    tensors.update({name: tensor for name, tensor in state.items() if name not in personal})
    replica = fresh
    if isinstance(model.module, PeftModel):
        (config,) = model.module.peft_config.values()
        replica = get_peft_model(fresh, copy.deepcopy(config))
    _load_exactly(replica, tensors, type(fresh).__name__)
    return replica.eval()


def _load_exactly(network: nn.Module, tensors: dict[str, torch.Tensor], architecture: str) -> None:
    try:
        network.load_state_dict(tensors, strict=True)
    except RuntimeError as exc:  # keys or shapes of another network: the plain architecture is not the backbone's
        detail = str(exc).strip().splitlines()[-1].strip()
        raise ConfigError(f"the plain {architecture} does not hold this model's weights ({detail})") from None


def _folded(replica: nn.Module, kind: str, norms: dict[str, str]) -> nn.Module:
    """The replica's plain network with its adapters folded into its weights."""
    if kind == "lora":
        return replica.merge_and_unload()
    if kind == "none":
        return replica
    # Branches first: unloading takes them out of the network and puts the trained copies in place of the originals.
    branches = {
        name: layer.lora_residual[layer.active_adapters[0]]
        for name, layer in replica.get_base_model().named_modules()
        if isinstance(layer, ResidualAdapterLayer)
    }
    plain = replica.unload()
    for conv_name, branch in branches.items():
        if conv_name not in norms:
            raise ConfigError(
                f"the residual adapter on {conv_name} does not feed a BatchNorm alone: its shift has nowhere to go, "
                "so it cannot be merged"
            )
        fold_residual_adapter(plain.get_submodule(conv_name), branch, plain.get_submodule(norms[conv_name]))
    return plain


# ---------------------------------------------------------------- the residual adapter's fold


def norm_after_each_conv(network: nn.Module) -> dict[str, str]:
    """Convolution name -> BatchNorm name, for every convolution of `network` whose output is used by one BatchNorm
    and nothing else, each called once (read from the traced forward pass: the data flow, not the names)."""
    try:
        graph = torch.fx.symbolic_trace(network).graph
    except Exception as exc:  # tracing fails in many ways on code it cannot follow
        raise ConfigError(
            f"cannot trace {type(network).__name__} to find the BatchNorm after each adapted convolution ({exc})"
        ) from None
    modules = dict(network.named_modules())
    calls: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    found = {}
    for node in graph.nodes:
        if node.op != "call_module" or not isinstance(modules[node.target], nn.Conv2d) or len(node.users) != 1:
            continue
        (user,) = node.users
        feeds_norm = user.op == "call_module" and isinstance(modules[user.target], _BatchNorm) and len(user.args) == 1
        if feeds_norm and calls[node.target] == 1 and calls[user.target] == 1:
            found[node.target] = user.target
    return found


@torch.no_grad()
def fold_residual_adapter(conv: nn.Module, branch: nn.Sequential, norm: nn.Module) -> None:
    """Fold the eval-mode residual branch (BN_a, dropout, 1x1 W) into the bias-free `conv` before it and the
    BatchNorm `norm` after it, in place: K' = (I + W diag(a)) K, μ' = μ − W b (module docstring)."""
    branch_norm, _dropout, projection = branch  # dropout: the identity in eval mode
    if not isinstance(conv, nn.Conv2d) or conv.bias is not None:
        raise ConfigError("a residual adapter merges only after a convolution without bias")
    if not isinstance(norm, _BatchNorm) or norm.running_mean is None:
        raise ConfigError("a residual adapter merges only before a BatchNorm with running statistics")
    scale, shift = batchnorm_affine(branch_norm)
    projection_matrix = projection.weight.flatten(1)  # [C, C, 1, 1] -> [C, C]
    kernel = conv.weight.flatten(1)  # [C, C_in * k_h * k_w]: output channel o's filter in row o
    # K' = (I + W diag(a)) K = K + (W diag(a)) K: the identity's part stays exact. W diag(a) scales W's columns.
    conv.weight.copy_(torch.addmm(kernel, projection_matrix * scale, kernel).view_as(conv.weight))
    norm.running_mean.sub_(projection_matrix @ shift)


def batchnorm_affine(norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b) of an eval-mode BatchNorm: BN(y) = a ⊙ y + b per channel."""
    if not isinstance(norm, _BatchNorm) or norm.running_mean is None or norm.running_var is None:
        raise ConfigError("a residual adapter merges only with a BatchNorm that keeps running statistics")
    scale = (norm.running_var + norm.eps).rsqrt()
    if norm.weight is not None:
        scale = scale * norm.weight
    shift = -norm.running_mean * scale
    if norm.bias is not None:
        shift = shift + norm.bias
    return scale, shift


# ---------------------------------------------------------------- the personal head


@torch.no_grad()
def _fold_personal_head(network: nn.Module, model: AdaptedModel, state: AdapterState) -> None:
    """Add the personal head's weights (from `state`) to the classifier's: W_g h + b_g + W_p h + b_p."""
    if not model.personal_head_keys:
        return
    name = classifier_name(network)
    classifier = network.get_submodule(name)
    if not isinstance(classifier, nn.Linear):
        raise ConfigError(f"a personal head merges only into a linear classifier, and {name} is none")
    for key in model.personal_head_keys:
        role = key.rpartition(".")[2]  # weight or bias
        generic = getattr(classifier, role)
        if generic is None:
            raise ConfigError(f"the personal head has a {role}, the classifier {name} none: they cannot be merged")
        generic.add_(state[key].to(generic.device, generic.dtype))
