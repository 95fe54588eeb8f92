"""peradapt.adapters.merge: adapters folded into one plain network whose eval logits are the adapted model's.

The residual adapter's fold is checked by hand on one block; every kind of model (residual, --frozen-bn train,
LoRA on a ResNet and a ViT, a FedRoD personal head, --scope full, a transformers backbone) is merged from a random
state and compared with the adapted model, and rebuilt from the returned architecture with timm alone."""

from __future__ import annotations

import json

import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from peradapt.adapters import AdaptedModel, AdapterState, inject_adapters
from peradapt.adapters.merge import (
    TIMM,
    TRANSFORMERS,
    MergedNetwork,
    merged_network,
    norm_after_each_conv,
    plain_timm_architecture,
)
from peradapt.backbones import create_backbone, freeze
from peradapt.errors import ConfigError, WeightsError

from .conftest import TINY_BACKBONE, TINY_VIT

CLASSES = 3
TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}  # merged against adapted logits, as issue 25 asks

pytestmark = pytest.mark.usefixtures("one_thread")


def adapted(
    backbone: str = TINY_BACKBONE,
    kind: str = "residual",
    *,
    scope: str = "adapter",
    frozen_bn: str = "eval",
    personal_head: bool = False,
    image_size: int | None = None,
) -> AdaptedModel:
    torch.manual_seed(0)
    network = freeze(create_backbone(backbone, num_classes=CLASSES, in_chans=1, image_size=image_size))
    model = inject_adapters(network, kind, dropout=0.3, lora_rank=2, scope=scope, frozen_bn=frozen_bn)
    if personal_head:
        model.add_personal_head()
    return model


def random_state(model: AdaptedModel, scale: float = 0.3, seed: int = 2) -> AdapterState:
    """Every floating-point entry of the state moved far from its initial value (the 1x1 projections' N(0, 1e-4) and
    the zero personal head included), running variances drawn from [0.5, 1.5]; step counters kept."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in model.state().items():
        if not tensor.is_floating_point():
            state[name] = tensor
        elif name.endswith("running_var"):
            state[name] = 0.5 + torch.rand(tensor.shape, generator=generator)
        else:
            state[name] = tensor + scale * torch.randn(tensor.shape, generator=generator)
    return state


def images(size: int = 16, count: int = 4, channels: int = 1, seed: int = 1) -> torch.Tensor:
    return torch.randn(count, channels, size, size, generator=torch.Generator().manual_seed(seed))


def logits(network: nn.Module, x: torch.Tensor) -> torch.Tensor:
    network.eval()
    with torch.no_grad():
        out = network(x)
    return out if isinstance(out, torch.Tensor) else out.logits


def adapted_logits(model: AdaptedModel, state: AdapterState, x: torch.Tensor) -> torch.Tensor:
    model.load_state(state)
    model.eval()
    with torch.no_grad():
        return model(x)


def assert_plain(network: nn.Module) -> None:
    """No module of peradapt or PEFT (no SmallInputConv2d, adapter, wrapper) and no hook (no personal head's)."""
    for module in network.modules():
        assert not type(module).__module__.startswith(("peradapt", "peft")), type(module)
        assert not module._forward_hooks and not module._forward_pre_hooks


def rebuilt_with_timm(merged: MergedNetwork) -> nn.Module:
    """The merged network as someone without peradapt builds it: the architecture and arguments through JSON, timm's
    own entry, the weights loaded strictly."""
    arguments = json.loads(json.dumps(merged.model_args))
    network = timm.create_model(merged.architecture, pretrained=False, **arguments)
    network.load_state_dict(merged.network.state_dict(), strict=True)
    return network


# ---------------------------------------------------------------- the residual fold by hand


def batch_norm(y: torch.Tensor, norm: dict[str, torch.Tensor], eps: float = 1e-5) -> torch.Tensor:
    """An eval-mode BatchNorm over the channels of [N, C, H, W] `y`, written out."""
    channels = (1, -1, 1, 1)
    normalised = (y - norm["running_mean"].view(channels)) / torch.sqrt(norm["running_var"].view(channels) + eps)
    return normalised * norm["weight"].view(channels) + norm["bias"].view(channels)


def test_residual_fold_of_one_block_by_hand():
    """layer1.0: conv K (64 -> 4, 3x3, no bias), the adapter (BN_a, 1x1 W) on its output, then bn1. With
    a = γ_a / √(σ²_a + ε), b = β_a − μ_a a: K' = (I + W diag(a)) K, μ' = μ − W b."""
    model = adapted()
    state = random_state(model)
    block = "base_model.model.layer1.0."
    roles = ("weight", "bias", "running_mean", "running_var")
    kernel = model.backbone_state()["layer1.0.conv1.weight"].clone()  # frozen: not in the state
    adapter_norm = {role: state[f"{block}conv1.lora_residual.default.0.{role}"] for role in roles}
    projection = state[f"{block}conv1.lora_residual.default.2.weight"]  # [4, 4, 1, 1]
    norm = {role: state[f"{block}bn1.modules_to_save.default.{role}"] for role in roles}
    assert projection.abs().mean() > 0.05  # far from the N(0, 1e-4) initialisation: the fold is exercised

    a = adapter_norm["weight"] / torch.sqrt(adapter_norm["running_var"] + 1e-5)
    b = adapter_norm["bias"] - adapter_norm["running_mean"] * a
    w = projection[:, :, 0, 0]
    mixing = torch.eye(4) + w * a[None, :]
    expected_kernel = torch.einsum("oj,jikl->oikl", mixing, kernel)
    expected_norm = {**norm, "running_mean": norm["running_mean"] - w @ b}

    merged = merged_network(model, state, TINY_BACKBONE).network.layer1[0]
    assert_close(merged.conv1.weight, expected_kernel, atol=1e-6, rtol=1e-5)
    assert_close(merged.bn1.running_mean, expected_norm["running_mean"], atol=1e-6, rtol=1e-5)
    for role in ("weight", "bias", "running_var"):  # the BatchNorm's other tensors are its trained copy's
        assert torch.equal(getattr(merged.bn1, role), norm[role])

    features = images(size=6, channels=kernel.shape[1], seed=5)  # the stem's 64 channels
    y = F.conv2d(features, kernel, padding=1)
    unmerged = batch_norm(y + F.conv2d(batch_norm(y, adapter_norm), projection), norm)
    by_formula = batch_norm(F.conv2d(features, expected_kernel, padding=1), expected_norm)
    with torch.no_grad():
        folded = merged.bn1(merged.conv1(features))
    assert_close(by_formula, unmerged, atol=1e-5, rtol=1e-5)
    assert_close(folded, unmerged, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(batch_norm(y, norm), unmerged, atol=1e-2)  # the adapter changes the block


# ---------------------------------------------------------------- every kind merges to the same logits

CASES = {
    "residual": {},
    "residual, --frozen-bn train": {"frozen_bn": "train"},
    "lora resnet": {"kind": "lora"},
    "lora vit": {"backbone": TINY_VIT, "kind": "lora"},
    "lora vit at 16 px": {"backbone": TINY_VIT, "kind": "lora", "image_size": 16},
    "residual with a personal head (FedRoD)": {"personal_head": True},
    "lora with a personal head": {"kind": "lora", "personal_head": True},
    "scope full, no adapter, personal head": {"kind": "none", "scope": "full", "personal_head": True},
    "scope full with residual adapters, --frozen-bn train": {"scope": "full", "frozen_bn": "train"},
    "scope full with lora": {"kind": "lora", "scope": "full"},
}


@pytest.mark.parametrize("case", CASES)
def test_merged_network_gives_the_adapted_logits_and_rebuilds_with_timm_alone(case):
    settings = CASES[case]
    backbone = settings.get("backbone", TINY_BACKBONE)
    model = adapted(**settings)
    # A whole network moved by 0.3 everywhere gives logits in the hundreds: smaller steps keep 1e-4 meaningful.
    state = random_state(model, scale=0.1 if settings.get("scope") == "full" else 0.3)
    x = images(size=settings.get("image_size") or (32 if backbone == TINY_VIT else 16))
    initial = adapted_logits(model, model.state(), x)

    merged = merged_network(model, state, backbone)
    expected = adapted_logits(model, state, x)
    assert not torch.allclose(expected, initial, atol=1e-2)  # the state changes the function
    assert merged.library == TIMM
    assert_close(logits(merged.network, x), expected, **TOLERANCE)
    assert_plain(merged.network)
    assert_close(logits(rebuilt_with_timm(merged), x), expected, **TOLERANCE)


def test_what_rebuilds_the_tiny_backbones():
    model = adapted(TINY_VIT, "lora", image_size=16)
    assert plain_timm_architecture(TINY_VIT, model.base_model) == (
        "vit_tiny_patch16_224",
        {"img_size": 16, "patch_size": 4, "embed_dim": 64, "depth": 4, "num_heads": 4, "num_classes": 3, "in_chans": 1},
    )
    model = adapted("resnet34_w8")
    assert plain_timm_architecture("resnet34_w8", model.base_model) == (
        "resnet18",
        {"layers": [3, 4, 6, 3], "channels": [8, 16, 32, 64], "num_classes": 3, "in_chans": 1},
    )
    resnet = create_backbone("resnet18", num_classes=5, in_chans=3)
    assert plain_timm_architecture("resnet18.tv_in1k", resnet) == ("resnet18", {"num_classes": 5, "in_chans": 3})


@pytest.mark.parametrize("depth", [10, 18, 34])
@pytest.mark.parametrize("width", [4, 8, 16, 32])
def test_narrow_resnets_are_timms_resnet18_with_their_layers_and_channels(depth, width):
    assert_same_tensors(f"resnet{depth}_w{width}", in_chans=1)


@pytest.mark.parametrize("image_size", [None, 16, 48])
def test_the_tiny_vit_is_timms_vit_tiny_with_its_sizes(image_size):
    assert_same_tensors(TINY_VIT, in_chans=3, image_size=image_size)


def assert_same_tensors(backbone: str, in_chans: int, image_size: int | None = None) -> None:
    """The plain architecture made from the arguments has the tensors (names and shapes) of peradapt's backbone."""
    with torch.device("meta"):
        ours = create_backbone(backbone, num_classes=7, in_chans=in_chans, image_size=image_size)
        architecture, arguments = plain_timm_architecture(backbone, ours)
        plain = timm.create_model(architecture, pretrained=False, **arguments)
    shapes = {name: tuple(tensor.shape) for name, tensor in ours.state_dict().items()}
    assert {name: tuple(tensor.shape) for name, tensor in plain.state_dict().items()} == shapes
    assert type(plain) is type(ours)


# ---------------------------------------------------------------- transformers backbones


@pytest.fixture(scope="module")
def hf_backbone(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny transformers ViT's config (no weights: the backbone is made randomly initialised)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(
        image_size=16,
        patch_size=4,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=5,
    )
    directory = tmp_path_factory.mktemp("hf-vit")
    config.save_pretrained(str(directory))
    return f"hf:{directory}"


@pytest.mark.parametrize(
    "settings",
    [{"kind": "lora"}, {"kind": "lora", "personal_head": True}, {"kind": "none", "scope": "full"}],
    ids=["lora", "lora with a personal head", "scope full"],
)
def test_transformers_backbone_merges_into_a_fresh_transformers_model(hf_backbone, settings, tmp_path):
    from transformers import AutoModelForImageClassification

    model = adapted(hf_backbone, **settings)
    state = random_state(model, scale=0.1 if settings.get("scope") == "full" else 0.3)
    x = images()
    merged = merged_network(model, state, hf_backbone)
    expected = adapted_logits(model, state, x)
    assert merged.library == TRANSFORMERS and merged.architecture == "ViTForImageClassification"
    assert merged.model_args == {}
    assert_close(logits(merged.network, x), expected, **TOLERANCE)
    assert_plain(merged.network)
    merged.network.save_pretrained(str(tmp_path / "merged"))
    reloaded = AutoModelForImageClassification.from_pretrained(str(tmp_path / "merged"))
    assert_close(logits(reloaded, x), expected, **TOLERANCE)


def test_a_transformers_vits_residual_adapters_are_refused(hf_backbone):
    model = adapted(hf_backbone, "residual")
    with pytest.raises(ConfigError, match="nonlinear") as error:
        merged_network(model, random_state(model), hf_backbone)
    assert "\n" not in str(error.value)


# ---------------------------------------------------------------- what is refused, what is left alone


def test_a_vits_residual_adapters_are_refused_in_one_line():
    model = adapted(TINY_VIT, "residual")
    with pytest.raises(ConfigError) as error:
        merged_network(model, random_state(model), TINY_VIT)
    message = str(error.value)
    assert "\n" not in message
    assert "nonlinear" in message and "--adapter lora" in message and "import peradapt" in message


def test_a_state_of_another_model_is_refused():
    model = adapted()
    state = random_state(adapted(kind="lora"))
    with pytest.raises(WeightsError, match="does not fit"):
        merged_network(model, state, TINY_BACKBONE)


def test_the_live_model_and_the_random_stream_are_left_as_they_were():
    model = adapted(personal_head=True)
    model.load_state(random_state(model, seed=7))
    before = {name: tensor.clone() for name, tensor in model.module.state_dict().items()}
    classes = [type(module) for module in model.module.modules()]
    generator = torch.random.get_rng_state()
    x = images()
    expected = logits_of_model(model, x)

    merged_network(model, random_state(model), TINY_BACKBONE)
    assert torch.equal(torch.random.get_rng_state(), generator)
    after = model.module.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert [type(module) for module in model.module.modules()] == classes
    assert torch.equal(logits_of_model(model, x), expected)  # the personal head's hook still adds its logits


def logits_of_model(model: AdaptedModel, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(x)


class _Flows(nn.Module):
    """conv_a -> bn_a (folds); conv_b -> relu -> bn_b (no); conv_c -> bn_c and to the output as well (no)."""

    def __init__(self) -> None:
        super().__init__()
        for name in "abc":
            self.add_module(f"conv_{name}", nn.Conv2d(2, 2, 3, padding=1, bias=False))
            self.add_module(f"bn_{name}", nn.BatchNorm2d(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.bn_a(self.conv_a(x))
        b = self.bn_b(torch.relu(self.conv_b(a)))
        c = self.conv_c(b)
        return self.bn_c(c) + c


def test_the_batchnorm_after_a_convolution_is_found_by_the_data_flow():
    assert norm_after_each_conv(_Flows()) == {"conv_a": "bn_a"}
    resnet = create_backbone(TINY_BACKBONE, num_classes=CLASSES, in_chans=1)
    follows = norm_after_each_conv(resnet)
    assert follows["layer1.0.conv1"] == "layer1.0.bn1" and follows["layer4.0.conv2"] == "layer4.0.bn2"
    assert follows["layer2.0.downsample.0"] == "layer2.0.downsample.1"


def test_merged_network_is_in_eval_mode_on_the_cpu():
    model = adapted()
    merged = merged_network(model, random_state(model), TINY_BACKBONE)
    assert not merged.network.training
    assert {tensor.device.type for tensor in merged.network.state_dict().values()} == {"cpu"}
    assert all(tensor.is_contiguous() for tensor in merged.network.state_dict().values())
