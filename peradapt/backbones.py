"""Frozen pretrained backbones: creation by timm name or `hf:PATH_OR_ID`, weight resolution, offline pretraining.

Weights come from, in order: `--weights FILE` (safetensors), the backbone store filled by `peradapt pretrain`
(`$PERADAPT_HOME/backbones/<data>-<backbone>.safetensors`, default `~/.cache/peradapt`), or timm's local
pretrained cache (never downloaded at run time); a Hugging Face model brings its own (see `peradapt.hf`). With
none of them, training stops: a randomly initialised backbone is never used silently.

ViTs take one resolution, the one their position embeddings were trained at (timm's `fixed_input_size`, an HF
config's `image_size`): the data is resized to it unless `--image-size` asks otherwise, and a timm ViT then gets
its position embeddings resampled to the new patch grid, as timm does for its own weights.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import timm
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from timm.layers import resample_abs_pos_embed
from timm.models import build_model_with_cfg, generate_default_cfgs, get_pretrained_cfg, register_model
from timm.models.resnet import BasicBlock, ResNet
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from peradapt.errors import ConfigError, WeightsError
from peradapt.hf import (
    create_hf_model,
    hf_directory,
    hf_image_size,
    hf_normalization,
    hf_pretrained_weights,
    is_hf,
)
from peradapt.small_inputs import use_small_input_convolutions

# Narrow ResNets with the paper's block layout, for CPU-sized runs and tests. Registered with timm so that
# `timm.create_model("resnet18_w16")` works in any code that imported peradapt.
_NARROW_DEPTHS = {10: (1, 1, 1, 1), 18: (2, 2, 2, 2), 34: (3, 4, 6, 3)}
_NARROW_WIDTHS = (4, 8, 16, 32)
_HUB_KWARGS = ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir")


def _register_narrow_resnets() -> None:
    for depth, layers in _NARROW_DEPTHS.items():
        for width in _NARROW_WIDTHS:

            def factory(pretrained: bool = False, _layers=layers, _width=width, **kwargs) -> ResNet:
                channels = (_width, 2 * _width, 4 * _width, 8 * _width)
                # timm passes hub/cache settings that only matter for downloadable weights; these have none.
                model_kwargs = {k: v for k, v in kwargs.items() if k not in _HUB_KWARGS}
                return ResNet(BasicBlock, _layers, channels=channels, **model_kwargs)

            factory.__name__ = f"resnet{depth}_w{width}"
            _register(factory)


def _register(factory: Callable[..., nn.Module]) -> None:
    if factory.__name__ not in timm.list_models(factory.__name__):
        register_model(factory)


# ViTs with timm's layout (patch embedding, class token, pre-norm blocks) small enough to pretrain on Fashion-MNIST
# and to test on a CPU: 32 px in 4 px patches (64 patches + the class token), 64 dimensions, 4 blocks of 4 heads.
TINY_VITS = {"vit_tiny_p4_32": {"img_size": 32, "patch_size": 4, "embed_dim": 64, "depth": 4, "num_heads": 4}}
# timm's register_model takes a model's pretrained config from its module's `default_cfgs`: with the input size
# marked fixed, the data follows these ViTs as it follows timm's own. They have no published weights.
default_cfgs = generate_default_cfgs(
    {
        name: {
            "input_size": (3, args["img_size"], args["img_size"]),
            "fixed_input_size": True,
            "first_conv": "patch_embed.proj",
            "classifier": "head",
        }
        for name, args in TINY_VITS.items()
    }
)


def _register_tiny_vits() -> None:
    for name, args in TINY_VITS.items():

        def factory(pretrained: bool = False, _name=name, _args=args, **kwargs) -> VisionTransformer:
            return build_model_with_cfg(VisionTransformer, _name, pretrained, **{**_args, **kwargs})

        factory.__name__ = name
        _register(factory)


_register_narrow_resnets()
_register_tiny_vits()


def peradapt_home() -> Path:
    return Path(os.environ.get("PERADAPT_HOME", Path.home() / ".cache" / "peradapt"))


def default_weights_path(data: str, backbone: str) -> Path:
    return peradapt_home() / "backbones" / f"{data}-{backbone}.safetensors"


@dataclass
class BackboneInfo:
    """What a backbone weights file was made for; stored as JSON beside the safetensors file."""

    backbone: str
    in_chans: int
    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    source: str  # where the weights came from, for the user and the run's config.json

    def save(self, weights_path: Path) -> None:
        weights_path.with_suffix(".json").write_text(json.dumps(asdict(self), indent=2))


def fixed_image_size(name: str) -> int | None:
    """The one resolution backbone `name` takes (ViTs), or None where any size works (ResNets)."""
    if is_hf(name):
        return hf_image_size(name)
    _check_timm_name(name)
    config = get_pretrained_cfg(name)
    return config.input_size[-1] if config is not None and config.fixed_input_size else None


def create_backbone(name: str, num_classes: int, in_chans: int, image_size: int | None = None) -> nn.Module:
    """A randomly initialised backbone with a `num_classes` head; a ViT made for `image_size` px if given."""
    if is_hf(name):
        return create_hf_model(name, num_classes, in_chans, image_size)
    return timm.create_model(
        name, pretrained=False, num_classes=num_classes, in_chans=in_chans, **_resized(name, image_size)
    )


def _resized(name: str, image_size: int | None) -> dict[str, int]:
    """timm's argument that makes a fixed-size model (ViT) for another resolution; none for the others."""
    native = fixed_image_size(name)
    return {"img_size": image_size} if native is not None and image_size not in (None, native) else {}


def _check_timm_name(name: str) -> None:
    if name not in timm.list_models(name):
        raise ConfigError(
            f"unknown backbone '{name}': use a timm model name (resnet18, resnet34, vit_small_patch16_224, ...), "
            "a narrow ResNet such as resnet18_w16, the tiny ViT vit_tiny_p4_32, or hf:PATH_OR_ID for a "
            "transformers image classifier"
        )


def classifier_name(model: nn.Module) -> str:
    # timm models hand out their head; transformers image classifiers name it `classifier`.
    head = model.get_classifier() if hasattr(model, "get_classifier") else getattr(model, "classifier", None)
    for name, module in model.named_modules():
        if head is not None and module is head:
            return name
    raise ConfigError(f"{type(model).__name__} has no classifier module")


def freeze(model: nn.Module) -> nn.Module:
    """No parameter of `model` trains; its frozen convolutions compute small feature maps as a matrix product."""
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return use_small_input_convolutions(model)


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise WeightsError(f"weights file {path} does not exist: run `peradapt pretrain` or pass --weights FILE")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise WeightsError(f"cannot read weights {path} ({exc}): pass a safetensors file") from None


def _load_into(model: nn.Module, weights: dict[str, torch.Tensor], origin: str) -> None:
    """Load everything but the classifier, which is new for every task (as when starting from ImageNet)."""
    head = classifier_name(model) + "."
    own = {k: v for k, v in model.state_dict().items() if not k.startswith(head)}
    given = {k: v for k, v in weights.items() if not k.startswith(head)}
    stem = _stem_conv_key(own)
    if stem in given and given[stem].shape[1] != own[stem].shape[1]:
        from timm.models import adapt_input_conv

        given[stem] = adapt_input_conv(own[stem].shape[1], given[stem])
    _fit_position_embedding(model, own, given)
    missing = sorted(set(own) - set(given))
    unexpected = sorted(set(given) - set(own))
    wrong_shape = [k for k in own.keys() & given.keys() if own[k].shape != given[k].shape]
    if missing or unexpected or wrong_shape:
        detail = (missing or unexpected or wrong_shape)[:3]
        raise WeightsError(
            f"weights from {origin} do not fit {type(model).__name__}: "
            f"{len(missing)} missing, {len(unexpected)} unexpected, {len(wrong_shape)} of the wrong shape "
            f"(e.g. {', '.join(detail)}); pass weights made for this --backbone"
        )
    model.load_state_dict(given, strict=False)


def _stem_conv_key(state: dict[str, torch.Tensor]) -> str:
    return next(k for k, v in state.items() if v.ndim == 4)


def _fit_position_embedding(model: nn.Module, own: dict[str, torch.Tensor], given: dict[str, torch.Tensor]) -> None:
    """A timm ViT made for another --image-size: resample the position embeddings to its patch grid."""
    key = "pos_embed"
    if isinstance(model, VisionTransformer) and key in given and given[key].shape != own[key].shape:
        given[key] = resample_abs_pos_embed(
            given[key],
            new_size=list(model.patch_embed.grid_size),
            num_prefix_tokens=0 if model.no_embed_class else model.num_prefix_tokens,
        )


def load_backbone(
    name: str,
    *,
    data: str,
    num_classes: int,
    in_chans: int,
    weights: str | None,
    mean: tuple[float, ...],
    std: tuple[float, ...],
    image_size: int,
) -> tuple[nn.Module, BackboneInfo]:
    """A frozen backbone with a fresh `num_classes` head, made for `image_size` px, and where its weights came from.

    Inputs are normalized with `mean`/`std` (the data's statistics) unless the weights say otherwise: the JSON
    beside a weights file, or the pretrained config of a ViT with published weights (see `_own_normalization`).
    """
    model = create_backbone(name, num_classes, in_chans, image_size)
    normalization = _own_normalization(name) or (mean, std)
    stored = default_weights_path(data, name)
    if weights is not None or (not is_hf(name) and stored.is_file()):
        path = Path(weights) if weights is not None else stored
        _load_into(model, read_weights(path), str(path))
        info = _read_info(path) or BackboneInfo(name, in_chans, image_size, *normalization, str(path))
        info.source = str(path)
        return freeze(model), info
    if is_hf(name):
        source = str(hf_directory(name))
        _load_into(model, hf_pretrained_weights(name), source)
        return freeze(model), BackboneInfo(name, in_chans, image_size, *normalization, source)
    cached = _timm_cached_weights(name, num_classes, in_chans, image_size)
    if cached is not None:
        config = cached.pretrained_cfg
        info = BackboneInfo(
            name, in_chans, image_size, tuple(config["mean"]), tuple(config["std"]), f"timm cache ({name})"
        )
        return freeze(cached), info
    raise WeightsError(f"no pretrained weights for {name} on {data}: {_how_to_get_weights(name, data, stored)}")


def _own_normalization(name: str) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """The mean and std a ViT's published weights were trained with (timm's pretrained config, an HF image
    processor's): such weights are only meaningful with them (e.g. 0.5/0.5 for timm's augreg ViTs). ResNets keep
    the data's statistics, the default of every ResNet run so far."""
    if is_hf(name):
        return hf_normalization(name)
    if fixed_image_size(name) is None or not _has_published_weights(name):
        return None
    config = get_pretrained_cfg(name)
    assert config is not None  # published weights come with a config
    return tuple(config.mean), tuple(config.std)


def _has_published_weights(name: str) -> bool:
    return bool(timm.list_pretrained(name) or timm.list_pretrained(f"{name}.*"))


def _how_to_get_weights(name: str, data: str, stored: Path) -> str:
    from peradapt.data import has_pretraining_split  # deferred: the data package imports this module

    if has_pretraining_split(data):
        return f"run `peradapt pretrain --data {data} --backbone {name}` (writes {stored}) or pass --weights FILE"
    return (
        f"{data} has no split for `peradapt pretrain`, so pass --weights FILE.safetensors (e.g. ImageNet weights "
        f"for {name} saved with safetensors) or use a timm --backbone whose ImageNet weights are in the local "
        "timm/Hugging Face cache (e.g. resnet18)"
    )


def _read_info(weights_path: Path) -> BackboneInfo | None:
    meta = weights_path.with_suffix(".json")
    if not meta.is_file():
        return None
    try:
        values = json.loads(meta.read_text())
        values["mean"], values["std"] = tuple(values["mean"]), tuple(values["std"])
        return BackboneInfo(**values)
    except (ValueError, TypeError, KeyError) as exc:
        raise WeightsError(f"cannot read {meta} ({exc}): delete it or re-run `peradapt pretrain`") from None


def _timm_cached_weights(name: str, num_classes: int, in_chans: int, image_size: int) -> nn.Module | None:
    """ImageNet weights when timm/HF already has them on disk; nothing is downloaded here."""
    # timm hands out a randomly initialised model, with only a log warning, for names without pretrained weights.
    if not _has_published_weights(name):
        return None
    previous = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        # timm resamples a ViT's position embeddings itself when they were trained at another size.
        return timm.create_model(
            name, pretrained=True, num_classes=num_classes, in_chans=in_chans, **_resized(name, image_size)
        )
    except Exception:  # any failure means "not cached": the caller explains what to do instead
        return None
    finally:
        if previous is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = previous


def save_backbone(state: dict[str, torch.Tensor], info: BackboneInfo, path: Path) -> None:
    """Write weights and their description atomically, so an interrupted pretrain leaves no half file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(tmp))
    os.replace(tmp, path)
    info.save(path)
