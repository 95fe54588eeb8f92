"""timm backbones with published weights: pretrained tags, the local Hugging Face cache, fetching (through a stand-in
for the download: nothing here touches the network), offline mode, the errors, and which statistics normalize."""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path

import pytest
import timm
import timm.models._hub
import torch
from huggingface_hub import constants as hub_constants
from huggingface_hub.utils import LocalEntryNotFoundError
from safetensors.torch import save_file

from peradapt.backbones import DataFacts, create_backbone, fixed_image_size, load_backbone
from peradapt.config import BackboneConfig
from peradapt.errors import ConfigError, WeightsError

pytestmark = pytest.mark.usefixtures("one_thread")

# timm's smallest model with weights on the hub (470k parameters): timm/test_resnet.r160_in1k, mean/std 0.5.
NAME = "test_resnet.r160_in1k"
REPO = f"timm/{NAME}"
HUB_STATS = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
DATA_STATS = ((0.49, 0.48, 0.45), (0.25, 0.24, 0.26))  # CIFAR-10's
CIFAR10 = DataFacts("cifar10", 10, 3, 32, *DATA_STATS)  # 10 classes, 3 channels, 32 px
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache, online. huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE into its constants
    at import, so the constants are what a test sets."""
    cache = tmp_path / "hub"
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("PERADAPT_HOME", str(tmp_path / "peradapt"))  # no `peradapt pretrain` store
    return cache


def published_state(name: str = NAME) -> dict[str, torch.Tensor]:
    """A state dict of the published architecture, every tensor random (BatchNorm statistics too, so that a
    fresh model's defaults cannot pass for loaded weights)."""
    torch.manual_seed(0)
    state = timm.create_model(name).state_dict()
    return {k: torch.rand_like(v) + 0.5 if v.is_floating_point() else v for k, v in state.items()}


def cache_file(cache: Path, repo: str, filename: str, state: dict[str, torch.Tensor]) -> Path:
    """Lay out a file as huggingface_hub's cache holds it: refs/main names the snapshot holding it."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(COMMIT)
    path = folder / "snapshots" / COMMIT / filename
    path.parent.mkdir(parents=True, exist_ok=True)
    if filename.endswith(".bin"):
        torch.save(state, path)
    else:
        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return path


def load(name: str = NAME, **options):
    """`name` for CIFAR-10 (10 classes, 3 channels, 32 px) without a weights file."""
    return load_backbone(BackboneConfig(name, **options), CIFAR10)


class StandInDownload:
    """timm's `hf_hub_download` (timm.models._hub calls it to fetch hub weights): records what it was asked for and
    writes the file into the cache as the real one would, or raises `error`."""

    def __init__(self, cache: Path) -> None:
        self.cache, self.state = cache, published_state()
        self.asked: list[tuple[str, str, str | None]] = []
        self.error: Exception | None = None

    def __call__(self, repo_id: str, filename: str, revision: str | None = None, **kwargs) -> str:
        self.asked.append((repo_id, filename, revision))
        if self.error is not None:
            raise self.error
        return str(cache_file(self.cache, repo_id, filename, self.state))


@pytest.fixture
def download(hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> StandInDownload:
    stand_in = StandInDownload(hub_cache)
    monkeypatch.setattr(timm.models._hub, "hf_hub_download", stand_in)
    return stand_in


def assert_loaded(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    own = model.state_dict()
    kept = [k for k in state if not k.startswith("fc.")]  # the head is new: 10 classes, not ImageNet's 1000
    assert kept and all(torch.equal(own[k], state[k]) for k in kept)
    assert own["fc.weight"].shape[0] == 10


# ---------------------------------------------------------------- names


def test_tagged_names_are_backbones():
    assert fixed_image_size("resnet18.tv_in1k") is None
    assert fixed_image_size("vit_small_patch16_224.augreg_in21k_ft_in1k") == 224
    assert create_backbone("resnet18.tv_in1k", 10, 3).fc.out_features == 10
    assert fixed_image_size("resnet18_w16") is None and fixed_image_size("vit_tiny_p4_32") == 32  # peradapt's own


@pytest.mark.parametrize(
    ("name", "needles"),
    [
        ("resnet18.nope", ["unknown pretrained tag 'nope' for resnet18", "resnet18.tv_in1k"]),
        ("resnet18_w16.in1k", ["resnet18_w16 has no published weights"]),
        ("resnet18x.tv_in1k", ["unknown backbone 'resnet18x.tv_in1k'"]),
    ],
)
def test_a_bad_name_or_tag_is_a_one_line_config_error(name, needles, hub_cache):
    with pytest.raises(ConfigError) as error:
        create_backbone(name, 10, 3)
    message = str(error.value)
    assert "\n" not in message and all(needle in message for needle in needles)
    with pytest.raises(ConfigError, match=re.escape(needles[0])):  # before looking for weights
        load(name)


# ---------------------------------------------------------------- the cache, fetching and offline mode


def test_offline_weights_come_from_the_hub_cache(hub_cache, download):
    state = published_state()
    path = cache_file(hub_cache, REPO, "model.safetensors", state)
    model, info = load(offline=True)
    assert_loaded(model, state)
    assert not any(p.requires_grad for p in model.parameters())  # frozen
    assert REPO in info.source and str(path) in info.source
    assert download.asked == []  # the cache is read without the download function


def test_a_pickle_only_repository_is_read_from_the_cache_too(hub_cache, download):
    state = published_state()
    path = cache_file(hub_cache, REPO, "pytorch_model.bin", state)
    model, info = load(offline=True)
    assert_loaded(model, state)
    assert str(path) in info.source and download.asked == []


def test_weights_published_at_a_url_come_from_torch_hubs_cache(tmp_path, hub_cache, monkeypatch):
    name = "legacy_seresnet18.in1k"  # one of the few timm weights not on the Hugging Face Hub
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    state = published_state(name)
    url = timm.models.get_pretrained_cfg(name).url
    path = tmp_path / "torch" / "hub" / "checkpoints" / Path(url).name
    path.parent.mkdir(parents=True)
    torch.save(state, path)
    model, info = load(name, offline=True)
    own = model.state_dict()
    assert all(torch.equal(own[k], v) for k, v in state.items() if not k.startswith("last_linear."))
    assert url in info.source and str(path) in info.source


def test_an_augreg_vit_comes_from_the_cache_resized_with_its_own_statistics(hub_cache):
    # timm loads these weights' original release (.npz) with a custom loader; its hub file is a plain state dict.
    name = "vit_small_patch16_224.augreg_in21k_ft_in1k"
    state = published_state(name)
    cache_file(hub_cache, f"timm/{name}", "model.safetensors", state)
    model, info = load(name, offline=True)
    own = model.state_dict()
    assert torch.equal(own["blocks.0.attn.qkv.weight"], state["blocks.0.attn.qkv.weight"])
    assert own["pos_embed"].shape == (1, 1 + 2 * 2, 384)  # resampled from 14 x 14 patches to 2 x 2
    assert (info.mean, info.std) == HUB_STATS and info.image_size == 32


def test_weights_missing_from_the_cache_are_fetched_once(hub_cache, download, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    model, info = load()
    assert "HF_HUB_OFFLINE" not in os.environ  # fetching is not switched off behind the user's back
    # timm asks for the safetensors file of the tag's repository, at the default revision.
    assert download.asked == [(REPO, "model.safetensors", None)]
    assert_loaded(model, download.state)
    assert REPO in info.source and "fetched" in info.source
    again, info = load()
    assert download.asked == [(REPO, "model.safetensors", None)]  # the second load finds them in the cache
    assert_loaded(again, download.state)
    assert "cached file" in info.source


def test_offline_never_fetches_and_says_what_to_do(hub_cache, download):
    with pytest.raises(WeightsError) as error:
        load(offline=True)
    message = str(error.value)
    assert "\n" not in message and download.asked == []
    assert NAME in message and "not in the local cache" in message and "without --offline" in message
    assert "--weights" in message  # cifar10 has no pretraining split: the general advice


def test_hf_hub_offline_in_the_environment_means_offline(hub_cache, download, monkeypatch):
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)  # what HF_HUB_OFFLINE=1 sets at import
    with pytest.raises(WeightsError, match="HF_HUB_OFFLINE=1 forbids fetching"):
        load()
    assert download.asked == []


def test_no_network_is_a_one_line_weights_error(download):
    # What the installed huggingface_hub raises when the hub cannot be reached and nothing is cached.
    download.error = LocalEntryNotFoundError("An error happened while trying to locate the file on the Hub\nretry")
    with pytest.raises(WeightsError) as error:
        load()
    message = str(error.value)
    assert "\n" not in message and NAME in message and REPO in message
    assert "no network connection" in message and "connect" in message and "--weights" in message
    # timm tries the pickle after the safetensors file: the stand-in is asked for both.
    assert [filename for _, filename, _ in download.asked] == ["model.safetensors", "pytorch_model.bin"]


def test_any_other_fetch_failure_is_a_one_line_weights_error(download):
    download.error = OSError("No space left on device\nmore")
    with pytest.raises(WeightsError, match=r"OSError: No space left on device; retry") as error:
        load()
    assert "\n" not in str(error.value)


def test_a_corrupt_cached_file_is_a_weights_error(hub_cache):
    path = cache_file(hub_cache, REPO, "model.safetensors", {})
    path.write_bytes(b"not safetensors")
    with pytest.raises(WeightsError, match="delete the file to fetch it again"):
        load(offline=True)


# ---------------------------------------------------------------- normalization


@pytest.mark.parametrize(("normalization", "expected"), [("auto", HUB_STATS), ("data", DATA_STATS)])
def test_normalization_is_the_published_weights_or_the_data(hub_cache, normalization, expected):
    cache_file(hub_cache, REPO, "model.safetensors", published_state())
    _, info = load(offline=True, normalization=normalization)
    assert (info.mean, info.std) == expected


def test_data_normalization_overrides_a_weights_file_description(tmp_path, hub_cache):
    model = create_backbone("resnet10_w4", 10, 3)
    path = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    path.with_suffix(".json").write_text(
        '{"backbone": "resnet10_w4", "in_chans": 3, "image_size": 32, "mean": [0.1], "std": [0.2], "source": "x"}'
    )
    backbone = BackboneConfig("resnet10_w4", weights=str(path))
    _, auto = load_backbone(backbone, CIFAR10)
    _, data = load_backbone(replace(backbone, normalization="data"), CIFAR10)
    assert (auto.mean, auto.std) == ((0.1,), (0.2,)) and (data.mean, data.std) == DATA_STATS
    with pytest.raises(ConfigError, match="unknown --normalization 'imagenet'"):
        load_backbone(replace(backbone, normalization="imagenet"), CIFAR10)


def test_names_without_published_weights_still_stop_without_weights(hub_cache, download):
    with pytest.raises(WeightsError, match="no pretrained weights for resnet18_w16 on cifar10"):
        load("resnet18_w16")
    assert download.asked == []
