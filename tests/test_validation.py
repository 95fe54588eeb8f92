"""Bad inputs are refused at the edge (issue 16, robustness): one `error:` line, exit code 2, no traceback, and
nothing written. Every refusal here comes before any training, from the settings alone or from the data's sizes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from peradapt.commands.finished_run import export_run
from peradapt.config import TrainConfig

from .conftest import TINY_BACKBONE, TINY_VIT
from .test_cli import expect_refusal, run_cli, run_files, run_main, snapshot, tiny_args

pytestmark = pytest.mark.usefixtures("one_thread")

# The tiny Fashion-MNIST stand-in (conftest) has a client pool of 750 images and a test set of 600.
TRAIN_CASES = [
    # differential privacy
    (["--dp-noise", "1e-300", "--dp-clip", "1"], ["--dp-noise", "at least 1e-70", "accountant"]),
    (["--dp-noise", "1", "--dp-clip", "inf"], ["--dp-clip", "finite"]),
    (["--dp-noise", "1", "--dp-clip", "nan"], ["--dp-clip", "finite"]),
    (["--dp-noise", "1", "--dp-clip", "0"], ["--dp-clip", "positive"]),
    (["--dp-noise", "1", "--dp-clip", "-1"], ["--dp-clip", "positive"]),
    (["--dp-noise", "1", "--dp-clip", "1", "--dp-delta", "1"], ["--dp-delta"]),
    # whole numbers
    (["--lora-rank", "0"], ["--lora-rank", "at least 1"]),
    (["--lora-rank", "-2"], ["--lora-rank", "at least 1"]),
    (["--batch-size", "1"], ["--batch-size", "at least 2", "BatchNorm"]),
    (["--batch-size", "0"], ["--batch-size", "at least 2"]),
    (["--image-size", "0"], ["--image-size", "between 1 and 4096"]),
    (["--image-size", "-3"], ["--image-size", "between 1 and 4096"]),
    (["--image-size", "100000"], ["--image-size", "between 1 and 4096", "in memory"]),
    (["--kd-image-size", "0"], ["--kd-image-size", "between 1 and 4096"]),
    (["--kd-image-size", "99999"], ["--kd-image-size", "between 1 and 4096"]),
    (["--kd-eval-every", "-1"], ["--kd-eval-every"]),
    (["--kd-patience", "-1"], ["--kd-patience"]),
    (["--kd-rounds", "-1"], ["--kd-rounds"]),
    (["--kd-batch-size", "0"], ["--kd-batch-size", "at least 1"]),
    (["--kd-batch-size", "1", "--kd-mode", "train"], ["--kd-batch-size", "at least 2", "--kd-mode train"]),
    (["--rounds", "-1"], ["--rounds", "negative"]),
    (["--clients", "0"], ["--clients", "at least 1"]),
    (["--clients-per-round", "0"], ["--clients-per-round", "at least 1"]),
    (["--concurrent-clients", "0"], ["--concurrent-clients", "at least 1"]),
    (["--concurrent-clients", "-4"], ["--concurrent-clients", "at least 1"]),
    (["--concurrent-clients", "two"], ["--concurrent-clients", "two"]),
    (["--local-epochs", "-1"], ["--local-epochs", "negative"]),
    (["--local-steps", "0"], ["--local-steps", "at least 1"]),
    (["--personal-epochs", "-1"], ["--personal-epochs", "negative"]),
    (["--body-epochs", "0"], ["--body-epochs", "at least 1"]),
    (["--inner-steps", "0"], ["--inner-steps", "at least 1"]),
    (["--kd-steps", "-1"], ["--kd-steps", "negative"]),
    (["--eval-every", "-1"], ["--eval-every", "negative"]),
    (["--holdout-clients", "-1"], ["--holdout-clients"]),
    (["--holdout-clients", "4"], ["--holdout-clients", "less than --clients 4"]),
    (["--ft-epochs", "-1"], ["--ft-epochs", "negative"]),
    (["--ft-steps", "-1"], ["--ft-steps", "negative"]),
    (["--ala-layers", "-1"], ["--ala-layers", "negative"]),
    (["--limit-samples", "0"], ["--limit-samples", "at least 1"]),
    (["--channels", "2"], ["--channels", "1 or 3"]),
    # real numbers
    (["--lr", "0"], ["--lr", "positive"]),
    (["--lr", "-1"], ["--lr", "positive"]),
    (["--lr", "1e300"], ["--lr", "float32"]),
    (["--lam", "1e39"], ["--lam", "float32"]),
    (["--lam", "-1"], ["--lam", "negative"]),
    (["--personal-lr", "0"], ["--personal-lr"]),
    (["--server-lr", "0"], ["--server-lr", "positive"]),
    (["--beta", "0"], ["--beta", "positive"]),
    (["--fedprox-server-step", "0"], ["--fedprox-server-step", "positive"]),
    (["--mu", "-1"], ["--mu", "negative"]),
    (["--kd-temperature", "0"], ["--kd-temperature", "at least 1e-18"]),
    (["--kd-temperature", "1e-300"], ["--kd-temperature", "at least 1e-18"]),
    (["--adapter-dropout", "1"], ["--adapter-dropout", "[0, 1)"]),
    (["--apfl-alpha", "1.5"], ["--apfl-alpha", "[0, 1]"]),
    (["--alpha-lr", "-1"], ["--alpha-lr", "negative"]),
    (["--ala-sample", "0"], ["--ala-sample", "(0, 100]"]),
    (["--ala-sample", "101"], ["--ala-sample", "(0, 100]"]),
    (["--ala-lr", "0"], ["--ala-lr", "positive"]),
    (["--feddyn-alpha", "0"], ["--feddyn-alpha", "positive"]),
    (["--perfedavg-delta", "0"], ["--perfedavg-delta", "positive"]),
    (["--prior-lr", "-1"], ["--prior-lr", "negative"]),
    (["--prior-eta", "-1"], ["--prior-eta", "negative"]),
    # partitions that cannot fill the clients
    (["--clients", "500", "--clients-per-round", "2"], ["500 clients", "2 training samples", "--clients 375"]),
    (
        ["--clients", "500", "--clients-per-round", "2", "--limit-samples", "600"],
        ["--clients 300 or fewer", "--limit-samples to 1000"],
    ),
    (
        ["--clients", "150", "--clients-per-round", "2", "--limit-samples", "300", "--partition", "classes:1"],
        ["client"],
    ),
    (["--partition", "classes:20"], ["classes:20", "at most 10"]),
    (["--partition", "classes:0"], ["classes:0"]),
    (["--partition", "dir:0"], ["dir:0", "dir:ALPHA"]),
    (["--partition", "dir:-1"], ["dir:-1"]),
    (["--partition", "dir:inf"], ["dir:inf"]),
    (["--partition", "dir:nan"], ["dir:nan"]),
    (["--partition", "dir-balanced:0.5", "--limit-samples", "50"], ["dir-balanced", "--clients", "--limit-samples"]),
]


@pytest.mark.parametrize(("extra", "needles"), TRAIN_CASES, ids=[" ".join(extra) for extra, _ in TRAIN_CASES])
def test_bad_train_settings_are_refused_before_anything_is_written(
    extra, needles, tmp_path, fmnist_dir, capsys, monkeypatch, home
):
    run = tmp_path / "run"
    expect_refusal(tiny_args(fmnist_dir, run, *extra), capsys, monkeypatch, *needles, untouched=run)


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--image-size", "3"], ["--image-size 3", "4 px patch", "at least 4"]),  # no patch fits: an empty grid
        (["--kd-image-size", "16"], ["--kd-image-size 16", "32 px"]),  # a ViT takes its own size only
        (["--adapter", "lora", "--lora-rank", "100000000"], ["--lora-rank 100000000", "at most 256"]),
        (["--adapter", "residual", "--lora-rank", "100000"], ["--lora-rank 100000", "at most 256"]),
        (["--image-size", "8", "--kd-image-size", "16"], ["--kd-image-size 16", "8 px"]),
    ],
)
def test_image_sizes_and_ranks_a_vit_cannot_take_are_refused(
    extra, needles, vit_weights, tmp_path, fmnist_dir, capsys, monkeypatch, home
):
    run = tmp_path / "run"
    args = tiny_args(fmnist_dir, run, "--backbone", TINY_VIT, "--weights", str(vit_weights), *extra)
    expect_refusal(args, capsys, monkeypatch, *needles, untouched=run)


@pytest.mark.parametrize(
    "settings",
    [
        {"batch_size": 2, "kd_batch_size": 1},
        {"kd_batch_size": 2, "kd_mode": "train"},
        {"dp_noise": 1e-70, "dp_clip": 1.0, "adapter": "lora"},
        {"kd_temperature": 1e-18},
        {"lr": 3.4e38, "lam": 0.0, "lora_rank": 1},
        # a method's own settings, with a method that takes them
        {"method": "fedprox-li", "mu": 0.0},
        {"method": "apfl", "alpha_lr": 0.0, "apfl_alpha": 1.0},
        {"method": "pfedbred", "prior_lr": 0.0, "prior_eta": 0.0, "inner_steps": 1},
        {"method": "fedala", "ala_sample": 100.0, "ala_layers": 0},
        {"backbone": TINY_VIT, "image_size": 4},  # one patch
        {"backbone": TINY_VIT, "image_size": 6, "kd_image_size": 6},  # one patch, 2 px left over: timm takes it
        {"backbone": TINY_BACKBONE, "image_size": 1, "kd_image_size": 1},  # ResNets take any size
    ],
)
def test_boundary_values_are_accepted(settings):
    config = TrainConfig.from_flat(settings)
    assert all(config.to_flat()[key] == value for key, value in settings.items())


def test_a_missing_or_file_data_dir_is_refused_not_replaced_by_the_system_copy(
    tmp_path, fmnist_dir, capsys, monkeypatch, home
):
    run = tmp_path / "run"
    missing = tmp_path / "no-such-dir"
    args = tiny_args(fmnist_dir, run, "--data-dir", str(missing))
    expect_refusal(args, capsys, monkeypatch, f"--data-dir {missing} does not exist", untouched=run)
    (tmp_path / "a-file").write_text("not a dataset")
    args = tiny_args(fmnist_dir, run, "--data-dir", str(tmp_path / "a-file"))
    expect_refusal(args, capsys, monkeypatch, "is a file, not a directory", untouched=run)


def test_weights_whose_description_is_garbage_leave_no_run_directory(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    weights = tmp_path / "weights.safetensors"
    shutil.copyfile(home / "backbones" / f"fmnist-{TINY_BACKBONE}.safetensors", weights)
    weights.with_suffix(".json").write_text("{garbage")
    run = tmp_path / "run"
    args = tiny_args(fmnist_dir, run, "--weights", str(weights))
    expect_refusal(args, capsys, monkeypatch, "weights.json", untouched=run)


def test_train_out_must_be_a_directory_path(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    file = tmp_path / "somefile"
    file.write_text("mine")
    args = tiny_args(fmnist_dir, file)
    expect_refusal(args, capsys, monkeypatch, f"--out {file} is a file", untouched=file)
    args = tiny_args(fmnist_dir, file / "run")
    expect_refusal(args, capsys, monkeypatch, f"is under {file}, which is a file", untouched=file)


# ---------------------------------------------------------------- pretrain


def pretrain_args(fmnist_dir: Path, out: Path, *extra: str) -> list[str]:
    return [
        "pretrain",
        *("--data", "fmnist", "--data-dir", str(fmnist_dir), "--backbone", TINY_BACKBONE, "--epochs", "1"),
        *("--limit-samples", "50", "--batch-size", "16", "--device", "cpu", "--out", str(out), *extra),
    ]


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--lr", "1e400"], ["--lr", "finite"]),
        (["--lr", "inf"], ["--lr", "finite"]),
        (["--lr", "nan"], ["--lr", "finite"]),
        (["--lr", "1e300"], ["--lr", "float32"]),
        (["--lr", "0"], ["--lr", "positive"]),
        (["--lr", "-1"], ["--lr", "positive"]),
        (["--limit-samples", "2"], ["--limit-samples", "at least 3", "held out"]),
        (["--limit-samples", "0"], ["--limit-samples", "at least 3"]),
        (["--epochs", "0"], ["--epochs", "at least 1"]),
        (["--batch-size", "0"], ["--batch-size", "at least 2"]),
        (["--batch-size", "1"], ["--batch-size", "at least 2", "BatchNorm"]),
        (["--seed", "-1"], ["--seed"]),
        (["--device", "gpu"], ["--device"]),
    ],
)
def test_bad_pretrain_settings_are_refused(extra, needles, tmp_path, fmnist_dir, capsys, monkeypatch, home):
    out = tmp_path / "weights.safetensors"
    expect_refusal(pretrain_args(fmnist_dir, out, *extra), capsys, monkeypatch, *needles, untouched=out)


def test_pretrain_out_must_be_a_file_path_and_data_dir_must_exist(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    directory = tmp_path / "a-dir"
    directory.mkdir()
    expect_refusal(pretrain_args(fmnist_dir, directory), capsys, monkeypatch, "is a directory", untouched=directory)
    file = tmp_path / "a-file"
    file.write_text("mine")
    args = pretrain_args(fmnist_dir, file / "w.safetensors")
    expect_refusal(args, capsys, monkeypatch, f"is under {file}", untouched=file)
    out = tmp_path / "w.json"  # its description would overwrite it
    expect_refusal(pretrain_args(fmnist_dir, out), capsys, monkeypatch, ".json", untouched=out)
    out = tmp_path / "w.safetensors"
    args = pretrain_args(fmnist_dir, out, "--data-dir", str(tmp_path / "nowhere"))
    expect_refusal(args, capsys, monkeypatch, "--data-dir", "does not exist", untouched=out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-dir", "a-file"]  # no .tmp left anywhere


def test_pretrain_takes_the_smallest_limit(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    out = tmp_path / "w.safetensors"
    code, _, err = run_cli(
        pretrain_args(fmnist_dir, out, "--limit-samples", "3", "--batch-size", "2"), capsys, monkeypatch
    )
    assert code == 0, err
    assert out.is_file() and json.loads(out.with_suffix(".json").read_text())["backbone"] == TINY_BACKBONE


# ---------------------------------------------------------------- a finished run: export and resume


@pytest.fixture(scope="module")
def one_round_run(tmp_path_factory, pretrained_home, fmnist_dir):
    run = tmp_path_factory.mktemp("runs") / "one-round"
    run_main(tiny_args(fmnist_dir, run, "--rounds", "1"), pretrained_home)
    return run


def test_export_refuses_targets_it_cannot_or_must_not_write(one_round_run, tmp_path, capsys, monkeypatch, home):
    run = one_round_run
    file = tmp_path / "a-file"
    file.write_text("mine")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    for out, needle, untouched in [
        (file, "is a file", file),
        (file / "export", f"is under {file}", file),
        (run, "is the run directory", run),
        (run / "export", "inside the run directory", run),
        (mine, "no peradapt export", mine),
    ]:
        args = ["export", "--run", str(run), "--out", str(out)]
        expect_refusal(args, capsys, monkeypatch, needle, untouched=untouched)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "mine"]  # no staging directory left


def test_export_replaces_an_earlier_export_whole(one_round_run, tmp_path, capsys, monkeypatch, home):
    out = tmp_path / "export"
    code, _, err = run_cli(["export", "--run", str(one_round_run), "--out", str(out)], capsys, monkeypatch)
    assert code == 0, err
    first = run_files(out)
    for client in ("4", "5"):  # as an export of a 6-client run would have left
        shutil.copytree(out / "clients" / "0", out / "clients" / client)
    code, _, err = run_cli(["export", "--run", str(one_round_run), "--out", str(out)], capsys, monkeypatch)
    assert code == 0, err
    assert sorted(p.name for p in (out / "clients").iterdir()) == ["0", "1", "2", "3"]
    assert run_files(out) == first
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run_cli(["export", "--run", str(one_round_run), "--out", str(empty)], capsys, monkeypatch)
    assert code == 0, err
    assert run_files(empty) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "export"]


def test_a_failed_export_leaves_the_earlier_one_as_it_was(one_round_run, tmp_path, monkeypatch, home):
    import peradapt.commands.finished_run as runs

    out = tmp_path / "nested" / "export"
    export_run(one_round_run, out)
    before = snapshot(out)

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(runs, "save_backbone", fail)
    with pytest.raises(OSError, match="disk full"):
        export_run(one_round_run, out)
    assert snapshot(out) == before
    assert [p.name for p in out.parent.iterdir()] == ["export"]
    with pytest.raises(OSError, match="disk full"):  # a new place: the directories made for it go too
        export_run(one_round_run, tmp_path / "new" / "deeper" / "export")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nested"]


def test_resume_compares_parsed_values(one_round_run, tmp_path, capsys, monkeypatch, home):
    run = tmp_path / "copy"
    shutil.copytree(one_round_run, run)
    code, _, err = run_cli(["train", "--out", str(run), "--resume", "--lam", "1"], capsys, monkeypatch)
    assert code == 0, err  # saved as 1.0
    expect_refusal(["train", "--out", str(run), "--resume", "--lam", "2"], capsys, monkeypatch, "lam", untouched=run)
    args = ["train", "--out", str(run), "--resume", "--lam", "auto"]
    expect_refusal(args, capsys, monkeypatch, "these differ: lam", untouched=run)
