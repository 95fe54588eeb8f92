"""Frozen pretrained backbones: creation by timm name, weight resolution, and offline pretraining.

Weights come from, in order: `--weights FILE` (safetensors), the backbone store filled by `peradapt pretrain`
(`$PERADAPT_HOME/backbones/<data>-<backbone>.safetensors`, default `~/.cache/peradapt`), or timm's local
pretrained cache (never downloaded at run time). With none of them, training stops: a randomly initialised
backbone is never used silently.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import timm
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from timm.models import register_model
from timm.models.resnet import BasicBlock, ResNet
from torch import nn

from peradapt.errors import ConfigError, WeightsError

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
            if factory.__name__ not in timm.list_models(factory.__name__):
                register_model(factory)


_register_narrow_resnets()


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


def create_backbone(name: str, num_classes: int, in_chans: int) -> nn.Module:
    if name not in timm.list_models(name):
        raise ConfigError(
            f"unknown backbone '{name}': use a timm model name (resnet18, resnet34, resnet10t, ...) "
            f"or a narrow ResNet such as resnet18_w16"
        )
    return timm.create_model(name, pretrained=False, num_classes=num_classes, in_chans=in_chans)


def classifier_name(model: nn.Module) -> str:
    head = model.get_classifier()
    for name, module in model.named_modules():
        if module is head:
            return name
    raise ConfigError(f"{type(model).__name__} has no classifier module")


def freeze(model: nn.Module) -> nn.Module:
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model


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
    """A frozen backbone with a fresh `num_classes` head, and where its weights came from."""
    model = create_backbone(name, num_classes, in_chans)
    if weights is not None:
        path = Path(weights)
        _load_into(model, read_weights(path), str(path))
        info = _read_info(path) or BackboneInfo(name, in_chans, image_size, mean, std, str(path))
        info.source = str(path)
        return freeze(model), info
    stored = default_weights_path(data, name)
    if stored.is_file():
        _load_into(model, read_weights(stored), str(stored))
        info = _read_info(stored) or BackboneInfo(name, in_chans, image_size, mean, std, str(stored))
        info.source = str(stored)
        return freeze(model), info
    cached = _timm_cached_weights(name, num_classes, in_chans)
    if cached is not None:
        model = cached
        config = model.pretrained_cfg
        info = BackboneInfo(
            name, in_chans, image_size, tuple(config["mean"]), tuple(config["std"]), f"timm cache ({name})"
        )
        return freeze(model), info
    raise WeightsError(f"no pretrained weights for {name} on {data}: {_how_to_get_weights(name, data, stored)}")


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


def _timm_cached_weights(name: str, num_classes: int, in_chans: int) -> nn.Module | None:
    """ImageNet weights when timm/HF already has them on disk; nothing is downloaded here."""
    # timm hands out a randomly initialised model, with only a log warning, for names without pretrained weights.
    if not (timm.list_pretrained(name) or timm.list_pretrained(f"{name}.*")):
        return None
    previous = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        return timm.create_model(name, pretrained=True, num_classes=num_classes, in_chans=in_chans)
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
