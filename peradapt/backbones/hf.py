"""Hugging Face `transformers` image classifiers as backbones: `--backbone hf:PATH_OR_ID`.

PATH is a directory written by `save_pretrained` (config.json + model.safetensors); an ID
(`google/vit-base-patch16-224`) is looked up in the local Hugging Face cache only, never downloaded. The model is
rebuilt from its config with the task's classes and channels, then given the pretrained weights by the same rules
as a timm backbone (fresh head, input projection summed over channels for grayscale data). Only safetensors
weights are read, never pickles.

transformers comes with PEFT, but hf: backbones need 4.40 or later (`pip install 'peradapt[hf]'`); it is imported
here only when an `hf:` backbone is used.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from peradapt.backbones.checks import check_statistics
from peradapt.errors import ConfigError, WeightsError

HF_PREFIX = "hf:"
_TRANSFORMERS_HINT = "--backbone hf:... needs transformers: pip install 'peradapt[hf]' (transformers>=4.40)"


def is_hf(name: str) -> bool:
    return name.startswith(HF_PREFIX)


@functools.lru_cache(maxsize=8)
def hf_directory(name: str) -> Path:
    """The local directory of `hf:PATH_OR_ID`: PATH itself, or the ID's snapshot in the Hugging Face cache."""
    spec = name.removeprefix(HF_PREFIX)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"{path} holds no config.json: pass a directory written by a model's save_pretrained")
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(spec, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        raise WeightsError(
            f"hf:{spec} is neither a directory nor a model in the local Hugging Face cache: download it where there "
            f"is a network (`hf download {spec}`) or pass hf:DIR, a directory written by save_pretrained"
        ) from None


@functools.lru_cache(maxsize=8)
def _config(name: str) -> Any:
    transformers = _transformers()
    directory = hf_directory(name)
    try:
        return transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"cannot read the model config in {directory} ({exc})") from None


def hf_image_size(name: str) -> int | None:
    """The resolution the model's position embeddings are made for (its config's image_size), if it has one."""
    size = getattr(_config(name), "image_size", None)
    return size if isinstance(size, int) else None


def hf_normalization(name: str) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """Mean and std from the model's image-processor config (preprocessor_config.json), if it ships one; refused
    where they cannot normalize the model's inputs (`check_statistics`)."""
    path = hf_directory(name) / "preprocessor_config.json"
    if not path.is_file():
        return None
    try:
        processor = json.loads(path.read_text())
        mean, std = tuple(map(float, processor["image_mean"])), tuple(map(float, processor["image_std"]))
    except (ValueError, KeyError, TypeError):
        return None  # a processor without normalization: the data's statistics apply
    channels = getattr(_config(name), "num_channels", 3)
    remedy = "correct its image_mean and image_std, or delete them to normalize with the data's statistics"
    check_statistics(mean, std, channels, str(path), remedy)
    return mean, std


def create_hf_model(name: str, num_classes: int, in_chans: int, image_size: int | None) -> nn.Module:
    """The model of `name`'s config with `num_classes` outputs and `in_chans` input channels, randomly initialised."""
    native = hf_image_size(name)
    if image_size is not None and native is not None and image_size != native:
        raise ConfigError(
            f"{name} takes {native} px images (its config's image_size): drop --image-size or pass {native}"
        )
    config = copy.deepcopy(_config(name))
    config.num_labels = num_classes
    if hasattr(config, "num_channels"):
        config.num_channels = in_chans
    elif in_chans != 3:
        raise ConfigError(f"{name} does not say how many input channels it takes: use RGB data")
    transformers = _transformers()
    try:
        return transformers.AutoModelForImageClassification.from_config(config)
    except ValueError as exc:  # a config of no image-classification architecture
        raise ConfigError(f"{name} is no transformers image classifier ({str(exc).splitlines()[0]})") from None


def hf_pretrained_weights(name: str) -> dict[str, torch.Tensor]:
    """The weights in `name`'s directory, under the image-classification model's names.

    transformers' own loader reads them, so sharded checkpoints, base-model checkpoints (no classifier) and
    renamed modules of older checkpoints all come out in today's names.
    """
    transformers = _transformers()
    directory = hf_directory(name)
    try:
        with _quiet(transformers):
            model = transformers.AutoModelForImageClassification.from_pretrained(
                str(directory), local_files_only=True, use_safetensors=True
            )
    except (OSError, ValueError) as exc:
        raise WeightsError(
            f"no safetensors weights in {directory} ({str(exc).splitlines()[0]}): pickled .bin checkpoints are not "
            "read; save the model with save_pretrained (safetensors is its default) or pass --weights FILE"
        ) from None
    return model.state_dict()


@contextlib.contextmanager
def _quiet(transformers: Any) -> Iterator[None]:
    """transformers logs that a checkpoint without (or with another) classifier gets a new one: ours is always
    new, so that message would only mislead. Its progress bar over a few tensors would only clutter the output."""
    logging = transformers.utils.logging
    level, bar = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(level)
        if bar:
            logging.enable_progress_bar()


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError(_TRANSFORMERS_HINT) from None
    # PEFT asks every model it wraps whether it checkpoints activations, under a name transformers 5 deprecated:
    # the answer is right, the FutureWarning on every run only noise.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated", category=FutureWarning)
    return transformers
