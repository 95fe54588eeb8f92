"""Frozen pretrained backbones: creation by timm name or `hf:PATH_OR_ID`, weight resolution, offline pretraining.

A timm name may carry one of timm's pretrained tags (`resnet18.tv_in1k`: torchvision's ImageNet weights); without
one, timm's default tag applies. Weights come from, in order: `--weights FILE` (safetensors), the backbone store
filled by `peradapt pretrain` (`$PERADAPT_HOME/backbones/<data>-<backbone>.safetensors`, default
`~/.cache/peradapt`), or the weights timm publishes for the name: taken from the local Hugging Face cache
(`HF_HUB_CACHE`; torch hub's for the few hosted elsewhere) when a previous run left them there, else fetched once
into it. Offline (`offline=True`, or `HF_HUB_OFFLINE=1` in the environment) only the cache is read. A Hugging Face
model brings its own (see `peradapt.backbones.hf`). With none of them, training stops: a randomly initialised
backbone is never used silently.

Inputs are normalized with the weights' own statistics where known (`normalization="auto"`: the JSON beside a
weights file, a ViT's or timm's published pretrained config) or always with the data's (`normalization="data"`).

ViTs take one resolution, the one their position embeddings were trained at (timm's `fixed_input_size`, an HF
config's `image_size`): the data is resized to it unless `--image-size` asks otherwise, and a timm ViT then gets
its position embeddings resampled to the new patch grid, as timm does for its own weights.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.error import HTTPError, URLError
from urllib.parse import urlparse

import timm
import torch
from huggingface_hub import constants as hub_constants
from huggingface_hub import try_to_load_from_cache
from huggingface_hub.utils import (
    EntryNotFoundError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from timm.layers import resample_abs_pos_embed
from timm.models import (
    PretrainedCfg,
    build_model_with_cfg,
    generate_default_cfgs,
    get_pretrained_cfg,
    register_model,
    split_model_name_tag,
)
from timm.models.resnet import BasicBlock, ResNet
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from peradapt.backbones.checks import check_finite, check_statistics
from peradapt.backbones.hf import (
    create_hf_model,
    hf_directory,
    hf_image_size,
    hf_normalization,
    hf_pretrained_weights,
    is_hf,
)
from peradapt.backbones.small_inputs import use_small_input_convolutions
from peradapt.config import NORMALIZATIONS, BackboneConfig
from peradapt.errors import ConfigError, WeightsError, writing
from peradapt.home import peradapt_home

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
    # The names of the head's classes, in the order of its logits (an export's backbone.json; empty elsewhere)
    classes: tuple[str, ...] = ()

    def save(self, weights_path: Path) -> None:
        weights_path.with_suffix(".json").write_text(json.dumps(asdict(self), indent=2))


@dataclass(frozen=True)
class DataFacts:
    """What `load_backbone` makes a backbone for: the dataset (whose name finds the weights `pretrain` stored for
    it), its classes, channels and input size, and its statistics (the inputs' under `normalization="data"`)."""

    dataset: str
    num_classes: int
    channels: int
    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]


def fixed_image_size(name: str) -> int | None:
    """The one resolution backbone `name` takes (ViTs), or None where any size works (ResNets)."""
    if is_hf(name):
        return hf_image_size(name)
    _check_timm_name(name)
    config = get_pretrained_cfg(name)
    return config.input_size[-1] if config is not None and config.fixed_input_size else None


def check_input_sizes(name: str, image_size: int | None, kd_image_size: int | None) -> None:
    """A backbone made for one resolution (a ViT) takes --image-size px of at least one patch, and distills at its
    input size. (ResNets take any size.)"""
    if image_size is None and kd_image_size is None:
        return
    native = fixed_image_size(name)
    if native is None:
        return
    size = image_size or native
    patch = _patch_size(name)
    if patch is not None and size < patch:
        raise ConfigError(
            f"--image-size {size} is smaller than one {patch} px patch of {name}: give at least {patch} "
            f"(it was made for {native} px)"
        )
    if kd_image_size is not None and kd_image_size != size:
        raise ConfigError(
            f"--kd-image-size {kd_image_size}: {name} takes images of its input size only ({size} px), "
            f"distillation images too: drop --kd-image-size or pass {size}"
        )


@functools.lru_cache(maxsize=8)
def _patch_size(name: str) -> int | None:
    """The patch size of a timm backbone with a patch embedding (ViTs), from a model made on no device; None for
    others and for transformers models (whose --image-size must be their own)."""
    if is_hf(name):
        return None
    with torch.device("meta"):
        model = timm.create_model(name, pretrained=False)
    patch = getattr(getattr(model, "patch_embed", None), "patch_size", None)
    return max(patch) if isinstance(patch, tuple) else patch


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


_TAGS_SHOWN = 8  # of an architecture's published tags, in a message about an unknown one


def _check_timm_name(name: str) -> None:
    architecture, tag = split_model_name_tag(name)
    if architecture not in timm.list_models(architecture):
        raise ConfigError(
            f"unknown backbone '{name}': use a timm model name (resnet18, resnet18.tv_in1k, vit_small_patch16_224, "
            "...), a narrow ResNet such as resnet18_w16, the tiny ViT vit_tiny_p4_32, or hf:PATH_OR_ID for a "
            "transformers image classifier"
        )
    # timm.list_models does not list tagged names; the published tags are timm's pretrained names.
    if tag and name not in timm.list_pretrained(name):
        raise ConfigError(_unknown_tag(architecture, tag))


def _unknown_tag(architecture: str, tag: str) -> str:
    tags = [published.partition(".")[2] for published in timm.list_pretrained(f"{architecture}.*")]
    if not tags:
        return f"{architecture} has no published weights, so no pretrained tag '{tag}': use --backbone {architecture}"
    shown = ", ".join(f"{architecture}.{known}" for known in tags[:_TAGS_SHOWN])
    if len(tags) > _TAGS_SHOWN:
        shown += f" or one of {len(tags) - _TAGS_SHOWN} more (timm.list_pretrained('{architecture}.*'))"
    return f"unknown pretrained tag '{tag}' for {architecture}: use {shown}"


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
    _check_weights_file(path)
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise WeightsError(f"cannot read weights {path} ({exc}): pass a safetensors file") from None


def _check_weights_file(path: Path) -> None:
    if not path.is_file():
        raise WeightsError(f"weights file {path} does not exist: run `peradapt pretrain` or pass --weights FILE")


def _load_into(model: nn.Module, weights: dict[str, torch.Tensor], origin: str) -> None:
    """Load everything but the classifier, which is new for every task (as when starting from ImageNet)."""
    head = classifier_name(model) + "."
    own = {k: v for k, v in model.state_dict().items() if not k.startswith(head)}
    given = {k: v for k, v in weights.items() if not k.startswith(head)}
    check_finite(given, origin)
    stem = _stem_conv_key(own)
    if stem in given and given[stem].shape[1] != own[stem].shape[1]:
        _check_stem_channels(given[stem].shape[1], own[stem].shape[1], origin)
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


def _check_stem_channels(weights_channels: int, data_channels: int, origin: str) -> None:
    """Refuse colour data on weights made for grey images (`peradapt pretrain --data fmnist`): their stem has
    filters for one channel, which timm's adapt_input_conv leaves as they are. (Grey data on colour weights is
    fine: it sums the stem's filters over the channels.) Repeating the grey filters would feed the backbone each
    image's channel mean, a grey it was never shown, so the user chooses the grey conversion instead."""
    if weights_channels != 1 or data_channels == 1:
        return
    made = _read_info(Path(origin)) if Path(origin).is_file() else None
    size = f" and --image-size {made.image_size}, the size they were made for" if made is not None else ""
    raise WeightsError(
        f"weights from {origin} were made for grey (1-channel) images, but the data has {data_channels} channels: "
        f"pass --channels 1 to train on the images in grey{size}"
    )


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
    backbone: BackboneConfig, data: DataFacts, *, pretrainable: bool = False
) -> tuple[nn.Module, BackboneInfo]:
    """A frozen ``backbone.backbone`` with a fresh head for `data`'s classes, made for its image size, and where its
    weights came from (``backbone.weights``, else as the module docstring says).

    Published timm weights missing from the local cache are fetched unless ``backbone.offline`` (or
    `HF_HUB_OFFLINE=1`). Inputs are normalized with `data`'s mean and std under ``backbone.normalization`` "data";
    under "auto" too, unless the weights say otherwise: the JSON beside a weights file, the pretrained config of a ViT
    with published weights (see `_own_normalization`), or timm's config of the published weights loaded.
    `pretrainable`: whether `peradapt pretrain` can make weights for the dataset (the advice when none are found
    says so).
    """
    if backbone.normalization not in NORMALIZATIONS:
        raise ConfigError(f"unknown --normalization '{backbone.normalization}': use {', '.join(NORMALIZATIONS)}")
    offline_by = _offline_by(backbone.offline)
    model, info = _pretrained_backbone(backbone.backbone, data, backbone.weights, offline_by, pretrainable)
    if backbone.normalization == "data":
        info.mean, info.std = data.mean, data.std
    return freeze(model), info


def check_weights(backbone: BackboneConfig, *, data: str, pretrainable: bool = False) -> None:
    """Refuse, without reading any weights or data, what `load_backbone` would refuse for want of weights: an
    unknown timm name, a missing --weights file, a timm backbone with no weights to be found (none stored by
    `pretrain`, none published, or published but neither cached nor to be fetched). Run before the data is loaded,
    which may take minutes."""
    name, weights = backbone.backbone, backbone.weights
    if weights is not None:
        _check_weights_file(Path(weights))
    if is_hf(name):  # a Hugging Face model brings its own weights, found as it is created
        return
    _check_timm_name(name)
    if weights is None and not default_weights_path(data, name).is_file():
        _published_weights(name, data, _offline_by(backbone.offline), pretrainable)


def _offline_by(offline: bool) -> str | None:
    """The setting that forbids fetching weights, if any."""
    # huggingface_hub reads HF_HUB_OFFLINE once, at import: its constant is the user's setting.
    return "--offline" if offline else "HF_HUB_OFFLINE=1" if hub_constants.HF_HUB_OFFLINE else None


def _pretrained_backbone(
    name: str, data: DataFacts, weights: str | None, offline_by: str | None, pretrainable: bool
) -> tuple[nn.Module, BackboneInfo]:
    """The backbone with the first weights that apply, in the module docstring's order, and their description;
    `offline_by` names the setting that forbids fetching weights, if any."""
    stored = default_weights_path(data.dataset, name)
    if weights is not None or (not is_hf(name) and stored.is_file()):
        path = Path(weights) if weights is not None else stored
        model = create_backbone(name, data.num_classes, data.channels, data.image_size)
        _load_into(model, read_weights(path), str(path))
        normalization = _own_normalization(name) or (data.mean, data.std)
        info = _read_info(path) or BackboneInfo(name, data.channels, data.image_size, *normalization, str(path))
        info.source = str(path)
        return model, info
    if is_hf(name):
        model = create_backbone(name, data.num_classes, data.channels, data.image_size)
        source = str(hf_directory(name))
        _load_into(model, hf_pretrained_weights(name), source)
        normalization = _own_normalization(name) or (data.mean, data.std)
        return model, BackboneInfo(name, data.channels, data.image_size, *normalization, source)
    _check_timm_name(name)
    config, cached = _published_weights(name, data.dataset, offline_by, pretrainable)
    model, source = _published_backbone(name, config, cached, data)
    return model, BackboneInfo(name, data.channels, data.image_size, tuple(config.mean), tuple(config.std), source)


def _published_weights(
    name: str, data: str, offline_by: str | None, pretrainable: bool
) -> tuple[PretrainedCfg, Path | None]:
    """timm's config of the weights published for `name`, and their file where the local cache has it (None: to be
    fetched); refused where none are published, or where they are not cached and `offline_by` forbids fetching."""
    # timm hands out a randomly initialised model, with only a log warning, for names without published weights.
    if not _has_published_weights(name):
        raise WeightsError(
            f"no pretrained weights for {name} on {data}: {_how_to_get_weights(name, data, pretrainable)}"
        )
    config = get_pretrained_cfg(name)
    assert config is not None  # published weights come with a config
    cached = _cached_weights_file(config)
    if cached is None and offline_by is not None:
        raise WeightsError(
            f"the pretrained weights of {name} ({_origin(config)}) are not in the local cache and {offline_by} "
            f"forbids fetching them: run once without {offline_by} to fetch them, or "
            f"{_how_to_get_weights(name, data, pretrainable)}"
        )
    return config, cached


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
    """Whether timm has weights to load for `name` (its default tag's if untagged), from the hub or a URL."""
    config = get_pretrained_cfg(name)
    return config is not None and bool(config.hf_hub_id or config.url)


def _how_to_get_weights(name: str, data: str, pretrainable: bool) -> str:
    """Where weights for `name` on `data` can come from, naming those `pretrain` already stored for other data."""
    if pretrainable:
        stored = default_weights_path(data, name)
        advice = f"run `peradapt pretrain --data {data} --backbone {name}` (writes {stored}) or pass --weights FILE"
    else:
        advice = (
            f"{data} has no split for `peradapt pretrain`, so pass --weights FILE.safetensors (e.g. ImageNet weights "
            f"for {name} saved with safetensors) or use a timm --backbone with published ImageNet weights (e.g. "
            "resnet18.tv_in1k), fetched once into the local Hugging Face cache"
        )
    pattern = default_weights_path("*", name)
    pretrained = sorted(pattern.parent.glob(pattern.name))
    if pretrained:
        names = ", ".join(path.name for path in pretrained)
        advice += (
            f"; `peradapt pretrain` already stored {name} backbones pretrained on other data in "
            f"{pretrained[0].parent} ({names}): --weights PATH uses one, e.g. --weights {pretrained[0]}"
        )
    return advice


def _read_info(weights_path: Path) -> BackboneInfo | None:
    meta = weights_path.with_suffix(".json")
    if not meta.is_file():
        return None
    remedy = "delete it or re-run `peradapt pretrain`"
    try:
        values = json.loads(meta.read_text())
        values["mean"], values["std"] = tuple(values["mean"]), tuple(values["std"])
        values["classes"] = tuple(values.get("classes", ()))
        info = BackboneInfo(**values)
        check_statistics(info.mean, info.std, info.in_chans, str(meta), remedy)
    except (ValueError, TypeError, KeyError) as exc:
        raise WeightsError(f"cannot read {meta} ({exc}): {remedy}") from None
    return info


# timm asks the hub for model.safetensors and falls back to the pickle where a repository has no safetensors file.
_HUB_FILES = ("model.safetensors", "pytorch_model.bin")
# huggingface_hub reports an unreachable hub, with nothing cached, as a missing local entry; urllib (weights at a
# URL) as a URLError, except that an HTTPError is a URLError carrying the server's answer.
_UNREACHABLE = (LocalEntryNotFoundError, ConnectionError, TimeoutError, URLError)
_NOT_PUBLISHED = (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError)


def _published_backbone(
    name: str, config: PretrainedCfg, cached: Path | None, data: DataFacts
) -> tuple[nn.Module, str]:
    """timm's published weights for `name` (`config`) from the `cached` file, else fetched; and where they came
    from. timm adapts them: a fresh head, the stem summed for grayscale, a ViT's position embeddings resampled."""
    arguments = {"num_classes": data.num_classes, "in_chans": data.channels, **_resized(name, data.image_size)}
    if cached is None:
        try:
            # timm fetches through huggingface_hub (torch hub for URLs) into the cache `_cached_weights_file` reads.
            return timm.create_model(name, pretrained=True, **arguments), f"{_origin(config)} (fetched)"
        except Exception as exc:  # network, hub and storage failures come from several libraries
            raise WeightsError(_fetch_failure(name, config, exc)) from None
    # Loaded as a local file, so that nothing goes to the network once the weights are here. Hub files hold plain
    # state dicts even where the original release, the file at a URL, needs a custom loader (augreg ViTs' .npz);
    # said explicitly, as older timm versions keep a config's custom_load for a file given instead.
    overlay = {"file": str(cached), "custom_load": False if config.hf_hub_id else config.custom_load}
    try:
        model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, **arguments)
    except Exception as exc:  # a truncated or foreign file: timm's loaders raise many kinds
        raise WeightsError(
            f"cannot load the cached weights {cached} of {name} ({_first_line(exc)}): delete the file to fetch it "
            "again, or pass --weights FILE.safetensors"
        ) from None
    return model, f"{_origin(config)} (cached file {cached})"


def _origin(config: PretrainedCfg) -> str:
    return f"Hugging Face Hub {config.hf_hub_id}" if config.hf_hub_id else str(config.url)


def _cached_weights_file(config: PretrainedCfg) -> Path | None:
    """The file timm would fetch for `config`, when an earlier fetch left it in the local cache."""
    if config.hf_hub_id:
        repo_id, _, revision = config.hf_hub_id.partition("@")
        for filename in (config.hf_hub_filename,) if config.hf_hub_filename else _HUB_FILES:
            found = try_to_load_from_cache(repo_id, filename, revision=revision or None)
            if isinstance(found, str):  # else None (not cached) or a marker for "known to be absent"
                return Path(found)
        return None
    # torch hub's download directory, where timm's URL loads go.
    path = Path(torch.hub.get_dir()) / "checkpoints" / Path(urlparse(config.url).path).name
    return path if path.is_file() else None


def _fetch_failure(name: str, config: PretrainedCfg, exc: Exception) -> str:
    """One line: why fetching the weights of `name` failed, and what to do."""
    if isinstance(exc, _UNREACHABLE) and not isinstance(exc, HTTPError):
        why, action = "cannot reach it (no network connection?)", "connect (the weights are fetched once, then cached)"
    elif isinstance(exc, _NOT_PUBLISHED):
        architecture = split_model_name_tag(name)[0]
        why, action = "not found there", f"use another pretrained tag (timm.list_pretrained('{architecture}.*'))"
    else:
        why, action = _first_line(exc), "retry"
    return (
        f"cannot fetch the pretrained weights of {name} from {_origin(config)}: {why}; {action}, "
        "or pass --weights FILE.safetensors"
    )


def _first_line(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def weights_fingerprint(model: nn.Module, info: BackboneInfo) -> str:
    """SHA-256 of a loaded backbone: every tensor but the task's new classifier, and the input normalization.

    A run records it, so that a run reopened later (eval, export, --resume) refuses other weights than its own."""
    head = classifier_name(model) + "."
    digest = hashlib.sha256(repr((info.mean, info.std)).encode())
    for name, tensor in sorted(model.state_dict().items()):
        if name.startswith(head):
            continue
        values = tensor.detach().cpu().contiguous().reshape(-1)  # 1-d: a 0-d tensor has no byte view
        digest.update(f"{name}:{values.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(values.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def pinned_weights_path(fingerprint: str) -> Path:
    """Where a run's weights file is kept under its fingerprint (see `pin_weights`)."""
    return peradapt_home() / "backbones" / "sha256" / f"{fingerprint}.safetensors"


def pin_weights(path: Path, fingerprint: str) -> Path:
    """Keep weights file `path` (and its description) under `fingerprint`, where `pretrain` never writes, so that
    the runs trained on it keep it after a new `pretrain` replaces the file. A hard link where possible (`pretrain`
    replaces files, so the link keeps the old content), else a copy; written atomically."""
    pinned = pinned_weights_path(fingerprint)
    if pinned.is_file():
        return pinned
    pinned.parent.mkdir(parents=True, exist_ok=True)
    tmp = pinned.with_suffix(".tmp")
    written: list[Path] = []
    try:
        for source, target in ((path.with_suffix(".json"), pinned.with_suffix(".json")), (path, pinned)):
            if not source.is_file():
                continue
            tmp.unlink(missing_ok=True)
            try:
                os.link(source, tmp)
            except OSError:  # another file system, or links not allowed
                with writing(target):
                    shutil.copyfile(source, tmp)
            os.replace(tmp, target)
            written.append(target)
    except BaseException:  # a full disk, Ctrl-C: no half copy, and no description without its weights
        for leftover in (tmp, *written):
            leftover.unlink(missing_ok=True)
        raise
    return pinned


def save_backbone(state: dict[str, torch.Tensor], info: BackboneInfo, path: Path) -> None:
    """Write weights and their description atomically, so an interrupted pretrain leaves no half file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with writing(path):
        save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(tmp))
    os.replace(tmp, path)
    info.save(path)
