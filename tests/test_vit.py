"""ViT backbones: the tiny timm ViT, Hugging Face image classifiers (`hf:DIR`), LoRA and the residual bottleneck
adapter, exports that plain PEFT loads to the same logits, the input size, weights, partial parts, every method."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import timm
import torch
from peft import PeftModel
from safetensors.torch import load_file
from torch.testing import assert_close

from peradapt.adapters import BottleneckAdapterLayer, inject_adapters
from peradapt.backbones import DataFacts, create_backbone, fixed_image_size, freeze, load_backbone
from peradapt.compute.trainer import InputPipeline, LocalTrainer
from peradapt.config import BackboneConfig, MethodConfig
from peradapt.errors import ConfigError
from peradapt.federation.session import build_session
from peradapt.methods import METHODS, MethodContext
from peradapt.methods.partial import personal_keys
from peradapt.rundir.layout import read_partition, read_run_config
from peradapt.rundir.store import ClientStore

from .conftest import TINY_VIT
from .test_cli import expect_user_error, run_cli

VIT = TINY_VIT
DEPTH, WIDTH, RANK = 4, 64, 4
HF_MEAN, HF_STD = (0.25, 0.5, 0.75), (0.5, 0.25, 0.125)  # distinct per channel, to see where they come from


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny randomly initialised transformers ViTForImageClassification for RGB images, saved as on the hub."""
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(
        image_size=32,
        patch_size=4,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=5,
    )
    torch.manual_seed(1)
    directory = tmp_path_factory.mktemp("hf-vit")
    transformers.ViTForImageClassification(config).save_pretrained(str(directory))
    processor = {"image_mean": HF_MEAN, "image_std": HF_STD, "size": {"height": 32, "width": 32}}
    (directory / "preprocessor_config.json").write_text(json.dumps(processor))
    return directory


def tiny_vit(seed: int = 0) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    backbone = freeze(create_backbone(VIT, num_classes=3, in_chans=1))
    return backbone, {k: v.clone() for k, v in backbone.state_dict().items()}


def hf_vit(hf_dir: Path) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    backbone, _ = load_backbone(BackboneConfig(f"hf:{hf_dir}"), DataFacts("fmnist", 3, 1, 32, (0.3,), (0.3,)))
    return backbone, {k: v.clone() for k, v in backbone.state_dict().items()}


def inputs(count: int = 4, size: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randn(count, 1, size, size, generator=torch.Generator().manual_seed(seed))


def logits(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    module.eval()
    with torch.no_grad():
        out = module(x)
    return out if isinstance(out, torch.Tensor) else out.logits


# ---------------------------------------------------------------- the tiny ViT and input sizes


def test_tiny_vit_is_a_timm_vit_with_a_fixed_input_size():
    model = timm.create_model(VIT, num_classes=7, in_chans=1)
    assert model.patch_embed.grid_size == (8, 8) and model.embed_dim == WIDTH and len(model.blocks) == DEPTH
    assert model(inputs(2)).shape == (2, 7)
    assert fixed_image_size(VIT) == 32
    assert fixed_image_size("vit_small_patch16_224") == 224  # from timm's pretrained config, nothing downloaded
    assert fixed_image_size("resnet18") is None and fixed_image_size("resnet10_w4") is None


def test_a_vit_for_another_image_size_gets_its_position_embeddings_resampled(vit_weights):
    facts = DataFacts("fmnist", 10, 1, 28, (0.3,), (0.4,))
    model, info = load_backbone(BackboneConfig(VIT, weights=str(vit_weights)), facts)
    assert model.pos_embed.shape == (1, 1 + 7 * 7, WIDTH)
    assert model(inputs(2, size=28)).shape == (2, 10)
    saved = load_file(str(vit_weights))
    assert torch.equal(model.pos_embed[:, 0], saved["pos_embed"][:, 0])  # the class token's is kept as it is
    assert (info.mean, info.std, info.image_size) == ((0.3,), (0.4,), 28)  # a file without JSON: the data's


# ---------------------------------------------------------------- adapters


@pytest.mark.parametrize("kind", ["lora", "residual"])
def test_adapters_go_on_the_blocks_and_start_as_the_backbone(kind):
    backbone, _ = tiny_vit()
    x = inputs()
    expected = logits(backbone, x)
    model = inject_adapters(backbone, kind, dropout=0.3, lora_rank=RANK)
    config = model.module.peft_config["default"]
    blocks = range(DEPTH)
    if kind == "lora":
        layers = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
        assert set(config.target_modules) == {f"blocks.{i}.{layer}" for i in blocks for layer in layers}
        assert config.modules_to_save == ["head"]
        lora_b = [p for name, p in model.trainable_parameters().items() if ".lora_B." in name]
        assert len(lora_b) == DEPTH * len(layers) and not any(p.any() for p in lora_b)  # B = 0: exactly the identity
        # The logits are the backbone's to float rounding, not bit for bit: the adapted model keeps its weights
        # channels-last, and where oneDNN has no AVX-512 (DNNL_MAX_CPU_ISA=AVX2 shows it) the patch embedding's
        # convolution then runs another kernel, which sums in another order: the logits move by ~1.3e-7. A B drawn
        # with std 1e-4, as small as the residual adapter's up projection, moves them by ~4e-4, 40 times the
        # tolerance: a LoRA that does not start as the identity fails, as the check below shows.
        tolerance = {"atol": 1e-5, "rtol": 0.0}
        assert_close(logits(model, x), expected, **tolerance)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in lora_b:
                p.copy_(1e-4 * torch.randn(p.shape, generator=generator))
        assert not torch.allclose(logits(model, x), expected, **tolerance)
        return
    assert set(config.target_modules) == {f"blocks.{i}.mlp.fc2" for i in blocks}
    assert config.modules_to_save == ["norm1", "norm2", "head"]
    # Per block: down (64 -> 4) and up (4 -> 64) with biases, two LayerNorms; and the head for 3 classes.
    per_block = (WIDTH * RANK + RANK) + (RANK * WIDTH + WIDTH) + 2 * 2 * WIDTH
    assert model.num_trainable() == DEPTH * per_block + WIDTH * 3 + 3
    layer = dict(model.module.named_modules())["base_model.model.blocks.0.mlp.fc2"]
    assert isinstance(layer, BottleneckAdapterLayer)
    up = torch.cat([p.flatten() for n, p in model.trainable_parameters().items() if n.endswith("default.3.weight")])
    assert up.std().item() == pytest.approx(1e-4, rel=0.2)
    assert_close(logits(model, x), expected, atol=1e-3, rtol=1e-3)


def perturbed_state(model, seed: int = 2) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    state = model.state()
    for name in model.trainable_parameters():
        state[name] = state[name] + 0.1 * torch.randn(state[name].shape, generator=generator)
    return state


@pytest.mark.parametrize("source", ["timm", "hf"])
@pytest.mark.parametrize("kind", ["lora", "residual"])
def test_export_reloads_with_plain_peft_to_the_same_logits(kind, source, tmp_path, request):
    make = tiny_vit if source == "timm" else lambda: hf_vit(request.getfixturevalue("hf_dir"))
    backbone, weights = make()
    model = inject_adapters(backbone, kind, dropout=0.3, lora_rank=RANK)
    x = inputs()
    state = perturbed_state(model)
    model.save_pretrained(tmp_path / "c0", state)
    expected = logits(model, x)

    fresh, _ = make()  # the same backbone, built again
    reloaded = PeftModel.from_pretrained(fresh, str(tmp_path / "c0"))
    assert_close(logits(reloaded, x), expected, atol=1e-5, rtol=1e-5)
    plain, _ = make()
    assert not torch.allclose(logits(plain, x), expected, atol=1e-3)  # the adapter changed the function
    assert all(torch.equal(v, weights[k]) for k, v in plain.state_dict().items())


# ---------------------------------------------------------------- Hugging Face backbones


def test_hf_backbone_comes_from_its_directory_with_its_own_normalization(hf_dir):
    from transformers import ViTForImageClassification

    saved = ViTForImageClassification.from_pretrained(str(hf_dir)).state_dict()
    model, info = load_backbone(BackboneConfig(f"hf:{hf_dir}"), DataFacts("fmnist", 10, 1, 32, (0.3,), (0.3,)))
    assert fixed_image_size(f"hf:{hf_dir}") == 32
    assert model.classifier.out_features == 10 and model.config.num_channels == 1
    assert not any(p.requires_grad for p in model.parameters())
    key = "vit.embeddings.patch_embeddings.projection.weight"
    assert_close(model.state_dict()[key], saved[key].sum(dim=1, keepdim=True))  # grayscale: channels summed
    assert (info.mean, info.std, info.source) == (HF_MEAN, HF_STD, str(hf_dir))
    with pytest.raises(ConfigError, match="takes 32 px"):
        create_backbone(f"hf:{hf_dir}", 10, 1, image_size=28)


def test_hf_run_exports_a_model_directory_that_plain_peft_loads(hf_dir, fmnist_dir, tmp_path, capsys, monkeypatch):
    from transformers import AutoModelForImageClassification

    from .test_model_cards import text_files

    run = tmp_path / "run"
    args = run_args(fmnist_dir, run, "--backbone", f"hf:{hf_dir}", "--method", "perada-nokd")
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    resolved = json.loads((run / "config.json").read_text())["resolved"]
    assert (resolved["adapter"], resolved["image_size"], resolved["weights"]) == ("lora", 32, str(hf_dir))
    code, stdout, err = run_cli(["export", "--run", str(run), "--out", str(tmp_path / "x")], capsys, monkeypatch)
    assert code == 0, err
    assert "README.md" in stdout  # the cards say how to load: a transformers backbone with its own class
    assert "AutoModelForImageClassification" in (tmp_path / "x" / "README.md").read_text()
    for path, text in text_files(tmp_path / "x").items():  # the backbone's directory is named, not given
        assert str(hf_dir) not in text and str(run) not in text, path

    backbone = AutoModelForImageClassification.from_pretrained(str(tmp_path / "x" / "backbone"))
    plain = PeftModel.from_pretrained(backbone, str(tmp_path / "x" / "clients" / "1")).eval()
    config, _ = read_run_config(run)
    session = build_session(config, read_partition(run))
    test = session.data.clients[1].test
    expected = session.trainer.logits(session.model.load_pretrained(run / "clients" / "1"), test)
    with torch.no_grad():
        actual = plain(session.trainer.inputs(test.images)).logits
    assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    info = json.loads((tmp_path / "x" / "backbone.json").read_text())
    # The processor's RGB statistics for grayscale data: their means, as the run normalized with.
    assert_close(torch.tensor(info["mean"] + info["std"]), torch.tensor([sum(HF_MEAN) / 3, sum(HF_STD) / 3]))


def test_a_merged_hf_export_loads_with_transformers_alone_and_its_pipeline_names_the_classes(
    hf_dir, fmnist_dir, tmp_path, capsys, monkeypatch
):
    from .test_model_cards import run_without_peradapt, snippet, text_files

    run, out = tmp_path / "run", tmp_path / "merged"
    args = run_args(fmnist_dir, run, "--backbone", f"hf:{hf_dir}", "--method", "perada-nokd", "--channels", "3")
    assert run_cli(args, capsys, monkeypatch)[0] == 0
    code, _, err = run_cli(["export", "--run", str(run), "--out", str(out), "--merge"], capsys, monkeypatch)
    assert code == 0, err
    for path, text in text_files(out).items():
        assert str(hf_dir) not in text and str(run) not in text, path
    target = out / "clients" / "1"
    assert {"config.json", "model.safetensors", "preprocessor_config.json", "README.md"} <= {
        p.name for p in target.iterdir()
    }
    config, resolved = read_run_config(run)
    session = build_session(config, read_partition(run))
    test = session.data.clients[1].test.subset(torch.arange(8))
    expected = session.trainer.logits(session.model.load_pretrained(run / "clients" / "1"), test)
    torch.save(session.trainer.inputs(test.images).contiguous(), tmp_path / "inputs.pt")
    body = (target / "README.md").read_text()
    check = f"""
{snippet(body)}
import json

from PIL import Image
from transformers import pipeline

inputs = torch.load({str(tmp_path / "inputs.pt")!r})
with torch.no_grad():
    logits = model(pixel_values=inputs).logits
labels = [answer["label"] for answer in pipeline("image-classification", model=root)(Image.new("RGB", (40, 30)))]
assert "peradapt" not in sys.modules
print(json.dumps([logits.tolist(), labels, model.config.id2label]))
"""
    logits, labels, id2label = json.loads(run_without_peradapt(check, target))
    assert_close(torch.tensor(logits), expected, atol=1e-4, rtol=1e-4)
    assert id2label == {str(i): name for i, name in enumerate(resolved.classes)}
    assert set(labels) <= set(resolved.classes) and labels


def test_hf_mistakes_are_one_line_errors(hf_dir, fmnist_dir, tmp_path, capsys, monkeypatch):
    missing = tmp_path / "nowhere"
    args = run_args(fmnist_dir, tmp_path / "run", "--backbone", f"hf:{missing}")
    expect_user_error(args, capsys, monkeypatch, "neither a directory nor a model in the local Hugging Face cache")
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text((hf_dir / "config.json").read_text())
    args = run_args(fmnist_dir, tmp_path / "run", "--backbone", f"hf:{config_only}")
    expect_user_error(args, capsys, monkeypatch, "no safetensors weights", "--weights")
    pretrain = ["pretrain", "--data", "fmnist", "--data-dir", str(fmnist_dir), "--backbone", f"hf:{hf_dir}"]
    expect_user_error(pretrain, capsys, monkeypatch, "brings its own weights")
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- weights and pretraining


def test_pretrained_tiny_vit_is_found_by_train(fmnist_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PERADAPT_HOME", str(tmp_path / "home"))
    args = run_args(fmnist_dir, tmp_path / "run", "--backbone", VIT, "--adapter", "residual")
    expect_user_error(args, capsys, monkeypatch, f"peradapt pretrain --data fmnist --backbone {VIT}")
    pretrain = ["pretrain", "--data", "fmnist", "--data-dir", str(fmnist_dir), "--backbone", VIT]
    pretrain += ["--epochs", "1", "--limit-samples", "64", "--batch-size", "32", "--device", "cpu"]
    code, stdout, err = run_cli(pretrain, capsys, monkeypatch)
    assert code == 0, err
    stored = tmp_path / "home" / "backbones" / f"fmnist-{VIT}.safetensors"
    assert str(stored) in stdout.replace("\n", "")
    assert json.loads(stored.with_suffix(".json").read_text())["image_size"] == 32  # 28 px images resized
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    resolved = json.loads((tmp_path / "run" / "config.json").read_text())["resolved"]
    assert (resolved["weights"], resolved["image_size"], resolved["adapter"]) == (str(stored), 32, "residual")
    adapter_config = json.loads((tmp_path / "run" / "clients" / "0" / "adapter_config.json").read_text())
    assert adapter_config["init_lora_weights"] == "residual_adapter" and adapter_config["r"] == 4


# ---------------------------------------------------------------- partial-model parts


def test_personal_parts_of_a_vit():
    backbone, _ = tiny_vit()
    model = inject_adapters(backbone, "none", dropout=0.0, lora_rank=RANK, scope="full")
    norms = {f"blocks.{i}.norm{j}" for i in range(DEPTH) for j in (1, 2)} | {"norm"}
    assert set(personal_keys(model, "bn")) == {f"{n}.{p}" for n in norms for p in ("weight", "bias")}
    assert set(personal_keys(model, "input")) == {
        "patch_embed.proj.weight",
        "patch_embed.proj.bias",
        "cls_token",
        "pos_embed",
    }
    assert set(personal_keys(model, "output")) == {"head.weight", "head.bias"}

    lora = inject_adapters(tiny_vit()[0], "lora", dropout=0.0, lora_rank=RANK)
    trainer = LocalTrainer(lora, InputPipeline((0.5,), (0.5,), torch.device("cpu")), batch_size=8)
    context = MethodContext(MethodConfig(method="fedbn"), trainer, ClientStore(), lora.state(), distiller=None)
    with pytest.raises(ConfigError, match="frozen with --scope adapter"):
        METHODS["fedbn"](context)


# ---------------------------------------------------------------- every method, end to end


def run_args(fmnist_dir: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train",
        *("--data", "fmnist", "--data-dir", str(fmnist_dir), "--limit-samples", "90"),
        *("--clients", "3", "--clients-per-round", "2", "--rounds", "1", "--partition", "dir:1"),
        *("--local-epochs", "1", "--personal-epochs", "1", "--batch-size", "16", "--lora-rank", "4"),
        *("--kd-steps", "2", "--kd-batch-size", "16", "--eval-every", "0", "--device", "cpu"),
        *("--out", str(out)),
        *extra,
    ]


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_trains_on_the_tiny_vit(method, vit_weights, fmnist_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / method
    args = run_args(fmnist_dir, out, "--backbone", VIT, "--weights", str(vit_weights), "--method", method)
    code, stdout, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    assert "accuracy %" in stdout
    report = json.loads((out / "report.json").read_text())
    for value in report["personalized"]["local_test"]["per_client"] + [report["global"]["global_test"]]:
        assert math.isnan(value) or 0.0 <= value <= 1.0
    resolved = json.loads((out / "config.json").read_text())["resolved"]
    assert resolved["image_size"] == 32  # Fashion-MNIST's 28 px resized to the ViT's input size
