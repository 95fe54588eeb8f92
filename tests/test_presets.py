"""The paper presets: shipped in the package, shown by `info --preset`, and each run end to end (2 rounds) on synthetic
stand-ins of its datasets, with the tiny backbone instead of ResNet-18 and small sizes; every other preset setting
(the authors' distillation, frozen-BN mode, split, pipeline) runs as the preset sets it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import peradapt
from peradapt.config import TrainConfig
from peradapt.data import chexpert as chexpert_module
from peradapt.federation.session import build_session
from peradapt.presets import PRESETS, preset_settings

from .conftest import TINY_BACKBONE
from .test_cli import expect_user_error, run_cli, tiny_args
from .test_data import write_cifar
from .test_officehome_chexpert import write_chexpert, write_office_home

pytestmark = pytest.mark.usefixtures("one_thread", "skip_cifar_md5")


@pytest.fixture
def skip_cifar_md5(monkeypatch: pytest.MonkeyPatch) -> None:
    import torchvision

    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *args, **kwargs: True)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """CIFAR-10 and CIFAR-100 (enough images per class for the authors' reserve of 2 per class and client),
    Office-Home and CheXpert, side by side as --data-dir holds them."""
    root = tmp_path_factory.mktemp("paper-data")
    write_cifar(root, "cifar10", num_train=400, num_test=100)
    write_cifar(root, "cifar100", seed=1, num_train=100, num_test=10)
    write_office_home(root / "OfficeHomeDataset_10072016")
    write_chexpert(root, rows=300)
    return root


@pytest.fixture
def rgb_weights(home: Path, tmp_path: Path) -> Path:
    """The tiny backbone pretrained on grayscale data, its stem filter shared by three channels."""
    weights = load_file(str(home / "backbones" / f"fmnist-{TINY_BACKBONE}.safetensors"))
    weights["conv1.weight"] = weights["conv1.weight"].repeat(1, 3, 1, 1) / 3
    save_file(weights, str(tmp_path / "rgb.safetensors"))
    return tmp_path / "rgb.safetensors"


def test_every_preset_is_a_valid_config_that_differs_from_the_defaults():
    defaults = TrainConfig().to_flat()
    for name in PRESETS:
        settings = preset_settings(name)
        TrainConfig.from_flat(settings)  # every key known, every value valid
        authors = {
            "kd_mode": "train",
            "frozen_bn": "train",
            "frozen_bn_statistics": "local",
            "kd_normalization": "own",
            "normalization_constants": "authors",
            "kd_batches": "epochs",
            "kd_teacher_statistics": "authors",
        }
        for key, value in authors.items():
            assert settings[key] == value != defaults[key], (name, key)
    # the authors' lambda on lambda * ||v - w||^2 is half of peradapt's
    assert [preset_settings(name)["lam"] for name in PRESETS] == [2.0, 0.2, 2.0]


def test_the_presets_ablation_and_distilling_baseline_run_without_perada_teachers():
    """PerAda w/o KD (REPRODUCING.md's command) and FedDF on a preset: no teachers of perada's to move."""
    for method in ("perada-nokd", "feddf"):
        config = peradapt.training_config(preset="perada-cifar10", method=method)
        assert "kd_teacher_statistics" not in config.to_flat() and config.distill.kd_mode == "train"
    assert peradapt.training_config(preset="perada-cifar10").method_settings.kd_teacher_statistics == "authors"


def test_info_prints_what_a_preset_sets(capsys, monkeypatch):
    code, out, err = run_cli(["info", "--preset", "perada-cifar10"], capsys, monkeypatch)
    assert code == 0, err
    for needle in ("--kd-rounds", "30", "--frozen-bn", "train", "dir-balanced:0.1", "resnet18.tv_in1k", "--lam"):
        assert needle in out
    code, _, err = run_cli(["info", "--preset", "perada-imagenet"], capsys, monkeypatch)
    assert code == 2 and err.startswith("error:") and "perada-cifar10" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli(["info"], capsys, monkeypatch)
    assert code == 2 and "--run DIR or --preset NAME" in err


SMALL = ("--rounds", "2", "--local-epochs", "1", "--personal-epochs", "1", "--batch-size", "16")
SMALL_KD = ("--kd-steps", "2", "--kd-batch-size", "16", "--device", "cpu")
PRESET_RUNS = {
    "perada-cifar10": ("--clients", "2", "--clients-per-round", "2", "--kd-rounds", "1"),
    "perada-office-home": ("--image-size", "16"),
    "perada-chexpert": ("--clients", "2", "--clients-per-round", "2", "--image-size", "16", "--eval-every", "1"),
}


@pytest.mark.parametrize("preset", PRESETS)
def test_each_preset_trains_end_to_end(preset, data_dir, rgb_weights, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(chexpert_module, "RARE_COMBINATION_IMAGES", 40)  # few meta-categories in 300 rows
    out = tmp_path / preset
    args = [
        "train",
        *("--preset", preset, "--data-dir", str(data_dir), "--out", str(out)),
        *("--backbone", TINY_BACKBONE, "--weights", str(rgb_weights)),
        *SMALL,
        *SMALL_KD,
        *PRESET_RUNS[preset],
    ]
    code, stdout, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    assert "(selected on test)" in stdout

    saved = json.loads((out / "config.json").read_text())
    flat = TrainConfig.from_dict(saved["config"]).to_flat()
    expected = {**preset_settings(preset), "backbone": TINY_BACKBONE}  # flags win over the preset ...
    expected.update({"rounds": 2, "kd_steps": 2, "batch_size": 16})
    for key in ("kd_mode", "frozen_bn", "kd_normalization", "kd_augment", "partition", "lam", "server_lr", "data"):
        assert flat[key] == expected[key], key  # ... and the rest is the preset's
    for key in ("normalization_constants", "kd_batches", "frozen_bn_statistics", "kd_teacher_statistics"):
        assert flat[key] == expected[key], key
    report = json.loads((out / "report.json").read_text())
    selected = report["selected_on_test"]
    assert selected["rounds_evaluated"][-1] == 2
    assert len(selected["personalized_local_test"]["per_client"]) == len(report["clients"])
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in metrics if "per_client" in m] == ([2] if preset != "perada-chexpert" else [1, 2])
    if preset == "perada-cifar10":  # --kd-rounds 1: the second round only averages
        assert "kd_loss" in metrics[0] and "kd_loss" not in metrics[1]
        partition = json.loads((out / "partition.json").read_text())
        assert partition["spec"] == "dir-balanced:0.1"
        assert all(min(client["train_histogram"]) >= 2 for client in partition["clients"])
    # --frozen-bn train: each client's adapter carries its frozen BatchNorms' statistics
    assert (out / "clients" / str(report["clients"][0]) / "frozen_bn_statistics.safetensors").is_file()


def test_the_cifar10_preset_normalizes_with_the_authors_constants(data_dir, rgb_weights, tmp_path):
    """datasets/prepare_data.py: CIFAR-10 with std (0.247, 0.243, 0.261), the CIFAR-100 distillation images with
    mean (0.5071, 0.4867, 0.4408) and std (0.2675, 0.2565, 0.2761)."""
    tiny = {"backbone": TINY_BACKBONE, "weights": str(rgb_weights), "clients": 2, "clients_per_round": 2}
    places = {"data_dir": str(data_dir), "device": "cpu", "out": str(tmp_path / "run")}
    session = build_session(TrainConfig.from_flat({**preset_settings("perada-cifar10"), **tiny, **places}))
    assert (session.trainer.inputs.mean, session.trainer.inputs.std) == (
        (0.4914, 0.4822, 0.4465),
        (0.247, 0.243, 0.261),
    )
    distiller = session.method.context.distiller
    assert distiller is not None and distiller.inputs is not None
    assert (distiller.inputs.mean, distiller.inputs.std) == ((0.5071, 0.4867, 0.4408), (0.2675, 0.2565, 0.2761))


def test_resume_refuses_a_preset(tmp_path, capsys, monkeypatch):
    code, _, err = run_cli(
        ["train", "--out", str(tmp_path), "--resume", "--preset", "perada-cifar10"], capsys, monkeypatch
    )
    assert code == 2 and "--preset" in err


def test_train_help_lists_the_authors_settings(capsys, monkeypatch):
    code, out, err = run_cli(["train", "--help"], capsys, monkeypatch)
    assert code == 0, err
    for flag in ("--preset", "--kd-rounds", "--kd-mode", "--frozen-bn", "--augment", "--offline", "--normalization"):
        assert flag in out


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--kd-rounds", "-1"], ["--kd-rounds"]),
        (["--kd-mode", "half"], ["--kd-mode", "eval, train"]),
        (["--kd-augment", "mixup"], ["--kd-augment"]),
        (["--kd-loss", "mse"], ["--kd-loss", "softmax"]),
        (["--kd-image-size", "0"], ["--kd-image-size"]),
        (["--kd-normalization", "imagenet"], ["--kd-normalization"]),
        (["--kd-eval-every", "-2"], ["--kd-eval-every"]),
        (["--frozen-bn", "frozen"], ["--frozen-bn"]),
        (["--frozen-bn-statistics", "first"], ["--frozen-bn-statistics", "averaged, local"]),
        (["--frozen-bn-statistics", "local"], ["--frozen-bn-statistics local", "--frozen-bn train"]),
        (["--kd-batches", "shuffled"], ["--kd-batches", "independent, epochs"]),
        (["--normalization-constants", "rounded"], ["--normalization-constants", "exact, authors"]),
        (["--augment", "cutout"], ["--augment", "resized-crop"]),
        (["--channels", "2"], ["--channels"]),
        (["--resize", "pad"], ["--resize"]),
        (["--normalization", "imagenet"], ["--normalization"]),
        (["--preset", "perada-mnist"], ["perada-cifar10"]),
        (["--backbone", "resnet18.nope"], ["resnet18.tv_in1k"]),
        (["--partition", "dir-balanced:0"], ["dir-balanced:ALPHA"]),
        (["--partition", "file:/nonexistent/partition.json"], ["/nonexistent/partition.json"]),
    ],
)
def test_bad_authors_settings_are_one_line_errors_and_write_nothing(
    extra, needles, fmnist_dir, home, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "run"
    expect_user_error(tiny_args(fmnist_dir, out, *extra), capsys, monkeypatch, *needles)
    assert not out.exists()


def test_offline_may_change_on_resume(fmnist_dir, home, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    code, _, err = run_cli(tiny_args(fmnist_dir, out, "--rounds", "1"), capsys, monkeypatch)
    assert code == 0, err
    code, _, err = run_cli(["train", "--out", str(out), "--resume", "--rounds", "2", "--offline"], capsys, monkeypatch)
    assert code == 0, err
