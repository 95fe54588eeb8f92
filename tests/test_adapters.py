"""Tests for peradapt.adapters: residual/LoRA injection, adapter states, PEFT export and averaging."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from peft import PeftModel
from peft.utils.warning import PeftWarning
from torch import nn

from peradapt.adapters import average_states, inject_adapters
from peradapt.adapters.branch import AdapterDropout, ChannelProjection, keep_mask
from peradapt.backbones import create_backbone, freeze
from peradapt.errors import ConfigError, WeightsError

TINY = "resnet10_w4"


def tiny_backbone(seed=0):
    torch.manual_seed(seed)
    return freeze(create_backbone(TINY, num_classes=3, in_chans=1))


def tiny_model(kind="residual", dropout=0.0, seed=0):
    """An injected tiny model and a copy of its backbone's weights taken before injection."""
    backbone = tiny_backbone(seed)
    weights = {k: v.clone() for k, v in backbone.state_dict().items()}
    return inject_adapters(backbone, kind, dropout=dropout, lora_rank=2), weights


def inputs(count=4, size=16, seed=1):
    return torch.randn(count, 1, size, size, generator=torch.Generator().manual_seed(seed))


def perturbed(model, scale=0.1, seed=2):
    """The model's state with noise on every trainable parameter (BatchNorm statistics untouched)."""
    generator = torch.Generator().manual_seed(seed)
    state = model.state()
    for name in model.trainable_parameters():
        state[name] = state[name] + scale * torch.randn(state[name].shape, generator=generator)
    return state


def eval_logits(model, x):
    model.eval()
    with torch.no_grad():
        return model(x)


# ---------------------------------------------------------------- injection


def test_residual_adapters_on_resnet18_match_the_papers_parameter_count():
    model = inject_adapters(freeze(create_backbone("resnet18", 10, 3)), "residual", dropout=0.3, lora_rank=8)
    # 16 adapters (1x1 conv C^2 + BN 2C), block BNs and stem BN (2C each), fc 512*10+10.
    assert model.num_trainable() == 1_413_258
    assert model.num_backbone() == 11_181_642
    assert sum(p.numel() for p in model.trainable_parameters().values()) == 1_413_258


def test_injected_model_starts_as_the_backbone():
    backbone = tiny_backbone()
    x = inputs()
    backbone.eval()
    with torch.no_grad():
        expected = backbone(x)
    model = inject_adapters(backbone, "residual", dropout=0.3, lora_rank=8)
    actual = eval_logits(model, x)
    assert torch.allclose(actual, expected, rtol=1e-3, atol=1e-3 * expected.abs().max().item())
    convs = [p for n, p in model.trainable_parameters().items() if "lora_residual" in n and p.dim() == 4]
    assert len(convs) == 8  # conv1 and conv2 of the 4 basic blocks
    weights = torch.cat([p.detach().flatten() for p in convs])
    assert weights.std().item() == pytest.approx(1e-4, rel=0.1)
    assert abs(weights.mean().item()) < 1e-5


def test_frozen_batchnorm_keeps_its_statistics_in_training_mode():
    model, _ = tiny_model(dropout=0.3)
    modules = dict(model.module.named_modules())
    frozen = modules["base_model.model.layer2.0.downsample.1"]
    trainable = modules["base_model.model.bn1.modules_to_save.default"]
    assert not any(p.requires_grad for p in frozen.parameters())
    frozen_before = (frozen.running_mean.clone(), frozen.running_var.clone())
    trainable_before = trainable.running_mean.clone()
    model.train()
    model(inputs(8))
    assert torch.equal(frozen.running_mean, frozen_before[0])
    assert torch.equal(frozen.running_var, frozen_before[1])
    assert not torch.allclose(trainable.running_mean, trainable_before)


def test_unknown_adapter_kind_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown --adapter"):
        inject_adapters(tiny_backbone(), "prefix", dropout=0.0, lora_rank=2)


def test_unknown_backbone_is_a_config_error():
    with pytest.raises(ConfigError, match="not_a_model"):
        create_backbone("not_a_model", 3, 1)


# ---------------------------------------------------------------- state


def test_state_returns_clones():
    model, _ = tiny_model()
    x = inputs()
    before = eval_logits(model, x)
    state = model.state()
    for tensor in state.values():
        if tensor.is_floating_point():
            tensor.add_(1.0)
    assert torch.equal(eval_logits(model, x), before)
    # The state holds the trainable parameters and the trainable BatchNorms' statistics, nothing frozen.
    assert set(model.trainable_parameters()) < set(state)
    assert "base_model.model.bn1.modules_to_save.default.running_var" in state
    assert not any("original_module" in name or "base_layer" in name for name in state)


def test_load_state_changes_logits_and_original_restores_them():
    model, _ = tiny_model()
    x = inputs()
    original = model.state()
    before = eval_logits(model, x)
    model.load_state(perturbed(model))
    assert not torch.allclose(eval_logits(model, x), before)
    model.load_state(original)
    assert torch.equal(eval_logits(model, x), before)


def test_load_state_with_a_wrong_key_is_a_weights_error():
    model, _ = tiny_model()
    state = model.state()
    name = next(iter(state))
    state["not." + name] = state.pop(name)
    with pytest.raises(WeightsError):
        model.load_state(state)
    state = model.state()
    state.pop(name)
    with pytest.raises(WeightsError):
        model.load_state(state)


# ---------------------------------------------------------------- PEFT export


@pytest.mark.parametrize("kind", ["residual", "lora"])
def test_export_reloads_with_plain_peft_to_the_same_logits(kind, tmp_path):
    model, backbone_weights = tiny_model(kind, dropout=0.3)
    x = inputs()
    model.load_state(perturbed(model))
    model.train()
    model(inputs(8, seed=5))  # moves the trainable BatchNorms' running statistics
    state = model.state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.save_pretrained(tmp_path / "c0", state)
    assert not [w for w in caught if issubclass(w.category, PeftWarning) or "shards" in str(w.message)]
    expected = eval_logits(model, x)

    fresh = create_backbone(TINY, num_classes=3, in_chans=1)
    fresh.load_state_dict(backbone_weights)
    reloaded = PeftModel.from_pretrained(fresh, str(tmp_path / "c0"))
    reloaded.eval()
    with torch.no_grad():
        actual = reloaded(x)
    assert torch.allclose(actual, expected, rtol=1e-5, atol=1e-5)
    # Meaningful only if the adapter changed the function: the plain backbone gives other logits.
    plain = create_backbone(TINY, num_classes=3, in_chans=1).eval()
    plain.load_state_dict(backbone_weights)
    with torch.no_grad():
        assert not torch.allclose(plain(x), expected, atol=1e-3)


def test_load_pretrained_returns_the_saved_state(tmp_path):
    model, _ = tiny_model()
    saved = perturbed(model)
    model.save_pretrained(tmp_path / "c0", saved)
    model.load_state(perturbed(model, seed=9))
    loaded = model.load_pretrained(tmp_path / "c0")
    assert loaded.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name


def test_load_pretrained_from_an_empty_directory_is_a_weights_error(tmp_path):
    model, _ = tiny_model()
    with pytest.raises(WeightsError):
        model.load_pretrained(tmp_path)


# ---------------------------------------------------------------- averaging


def test_average_states_is_the_weighted_mean():
    first = {"w": torch.tensor([1.0, 2.0]), "steps": torch.tensor(3)}
    second = {"w": torch.tensor([4.0, 8.0]), "steps": torch.tensor(7)}
    averaged = average_states([first, second], weights=[1.0, 2.0])
    # (1*[1, 2] + 2*[4, 8]) / 3 = [3, 6]
    assert torch.allclose(averaged["w"], torch.tensor([3.0, 6.0]))
    assert averaged["steps"].dtype == torch.int64
    assert averaged["steps"].item() == 3
    uniform = average_states([first, second])
    assert torch.allclose(uniform["w"], torch.tensor([2.5, 5.0]))


def test_average_states_leaves_its_inputs_alone():
    first = {"w": torch.tensor([1.0]), "steps": torch.tensor(3)}
    averaged = average_states([first, {"w": torch.tensor([3.0]), "steps": torch.tensor(5)}])
    averaged["steps"].add_(1)
    assert first["steps"].item() == 3
    assert first["w"].item() == 1.0


def test_average_of_zero_states_is_an_error():
    with pytest.raises(ValueError):
        average_states([])


def test_adapter_layers_are_not_mergeable():
    model, _ = tiny_model()
    layer = dict(model.module.named_modules())["base_model.model.layer1.0.conv1"]
    assert isinstance(layer.lora_residual["default"][2], nn.Conv2d)
    with pytest.raises(NotImplementedError):
        layer.merge()


# ---------------------------------------------------------------- the residual branch's dropout and projection


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_channel_projection_is_the_1x1_convolution(memory_format):
    projection = ChannelProjection(6)
    x = torch.randn(4, 6, 3, 5).contiguous(memory_format=memory_format).requires_grad_(True)
    actual = projection(x)
    expected = F.conv2d(x, projection.weight)
    torch.testing.assert_close(actual, expected)
    grad = torch.randn_like(expected)
    actual_grads = torch.autograd.grad(actual, (x, projection.weight), grad)
    expected_grads = torch.autograd.grad(expected, (x, projection.weight), grad)
    for got, want in zip(actual_grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_adapter_dropout_keeps_1_minus_p_of_the_elements_scaled_and_follows_the_seed(memory_format):
    dropout = AdapterDropout(0.3)
    x = torch.rand(8, 16, 12, 12).add_(1).contiguous(memory_format=memory_format)  # no zeros of its own
    torch.manual_seed(5)
    first = dropout(x)
    torch.manual_seed(5)
    assert torch.equal(dropout(x), first)
    kept = first != 0
    assert kept.float().mean().item() == pytest.approx(0.7, abs=0.01)
    torch.testing.assert_close(first[kept], x[kept] / 0.7)
    dropout.eval()
    assert torch.equal(dropout(x), x)


def test_adapter_dropout_draws_every_mask_element_independently():
    # Neighbours in memory come from the same 64-bit draw: they must still be independent of each other.
    mask = keep_mask(torch.empty(400_000), 0.5).view(-1, 4)
    assert set(mask.unique().tolist()) == {0.0, 1.0}
    pairs = torch.corrcoef(mask.T)
    assert (pairs - torch.eye(4)).abs().max().item() < 0.01
