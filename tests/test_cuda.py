"""The CUDA path (bf16 autocast, channels-last, non-blocking copies, DP noise on the device, Flower with GPU
resources, resume), on a GPU only: these tests are marked `cuda`, skipped without one (CI), and run by
`make gpu-check`.

PERADAPT_CHECK_DEVICE=cpu runs them on the CPU instead (`gpu_check.py --device cpu`, which tests/test_bench.py
drives): their logic is then checked everywhere, and only the CUDA kernels wait for a GPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

import pytest
import torch

from peradapt.compute.concurrent import ConcurrentSGD
from peradapt.compute.trainer import InputPipeline, SGDJob
from peradapt.config import TrainConfig
from peradapt.federation.session import build_session

from .conftest import settings
from .test_cli import crash_after_round, results, run_cli, tiny_args

pytestmark = pytest.mark.cuda
DEVICE = os.environ.get("PERADAPT_CHECK_DEVICE", "cuda")

# bf16 keeps 8 bits of mantissa: logits of a tiny model differ from fp32 by about 1% of their spread, so nearly
# every prediction agrees.
AGREEMENT = 0.95
RELATIVE_LOGIT_ERROR = 0.05


def tiny_session(fmnist_dir: Path, out: Path, device: str):
    config = TrainConfig.from_flat(settings(fmnist_dir, out, device=device))
    return build_session(config)


def test_bf16_on_the_gpu_predicts_as_fp32_on_the_cpu(tmp_path, fmnist_dir, home):
    cpu, gpu = tiny_session(fmnist_dir, tmp_path / "a", "cpu"), tiny_session(fmnist_dir, tmp_path / "b", DEVICE)
    assert gpu.device.type == DEVICE
    test = cpu.data.global_test
    reference = cpu.trainer.logits(cpu.initial, test).float().cpu()
    state = {name: tensor.to(gpu.device) for name, tensor in cpu.initial.items()}
    on_gpu = gpu.trainer.logits(state, gpu.data.global_test).float().cpu()
    agreement = (reference.argmax(1) == on_gpu.argmax(1)).float().mean().item()
    error = (reference - on_gpu).abs().max().item() / (reference.max() - reference.min()).item()
    assert agreement >= AGREEMENT, agreement
    assert error <= RELATIVE_LOGIT_ERROR, error


def test_the_frozen_backbone_is_channels_last_on_the_gpu(tmp_path, fmnist_dir, home):
    if DEVICE != "cuda":
        pytest.skip("channels-last is the layout peradapt picks on a GPU only")
    session = tiny_session(fmnist_dir, tmp_path / "a", DEVICE)
    convolutions = [p for p in session.model.module.parameters() if p.ndim == 4 and not p.requires_grad]
    assert convolutions and all(p.is_cuda for p in convolutions)
    assert all(p.is_contiguous(memory_format=torch.channels_last) for p in convolutions)


def test_a_gpu_run_resumed_after_a_crash_is_bit_identical_to_itself(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    whole, crashed = tmp_path / "whole", tmp_path / "crashed"
    code, _, err = run_cli(tiny_args(fmnist_dir, whole, "--device", DEVICE), capsys, monkeypatch)
    assert code == 0, err
    crash_after_round(2, tiny_args(fmnist_dir, crashed, "--device", DEVICE), capsys, monkeypatch)
    code, _, err = run_cli(tiny_args(fmnist_dir, crashed, "--device", DEVICE, "--resume"), capsys, monkeypatch)
    assert code == 0, err
    assert results(crashed) == results(whole)
    assert json.loads((whole / "config.json").read_text())["resolved"]["device"].startswith(DEVICE)
    peak = json.loads((whole / "report.json").read_text())["cost"]["timing"]["peak_cuda_bytes"]
    assert (peak > 0) if DEVICE == "cuda" else peak is None  # the device's own peak, beside the process's RSS


def test_the_flops_of_a_training_step_are_the_cpus_under_bf16_autocast(tmp_path, fmnist_dir, home):
    cpu, gpu = tiny_session(fmnist_dir, tmp_path / "a", "cpu"), tiny_session(fmnist_dir, tmp_path / "b", DEVICE)
    images = cpu.data.clients[0].train.images[:2]
    flops = cpu.trainer.sample_flops(images)
    assert gpu.trainer.sample_flops(images) == flops and flops.training > flops.inference > 0  # counted, not timed


def test_dp_noise_on_the_gpu_is_seeded(tmp_path, fmnist_dir, vit_weights, capsys, monkeypatch, home):
    """Two DP runs with the same seed draw the same noise on the device: identical files."""
    pytest.importorskip("opacus")  # the dp extra, absent from a bare GPU image
    from .test_dp import dp_args

    runs = [tmp_path / "one", tmp_path / "two"]
    for run in runs:
        code, _, err = run_cli(dp_args(fmnist_dir, vit_weights, run, "--device", DEVICE), capsys, monkeypatch)
        assert code == 0, err
    assert results(runs[0]) == results(runs[1])


def test_flower_simulation_gives_its_clients_the_gpu(tmp_path, fmnist_dir, home):
    pytest.importorskip("flwr.simulation")  # the flower extra, absent from a bare GPU image
    pytest.importorskip("ray")
    from rich.console import Console

    import peradapt.commands.training as training

    values = settings(fmnist_dir, tmp_path / "flower", engine="flower", device=DEVICE, rounds=1)
    report = training.train(TrainConfig.from_flat(values), console=Console(stderr=True, quiet=True))
    assert report.rounds == 1
    resolved = json.loads((tmp_path / "flower" / "config.json").read_text())["resolved"]
    assert resolved["device"].startswith(DEVICE)


def test_concurrent_clients_on_the_gpu_agree_with_one_after_another_and_resume_bit_identically(
    tmp_path, fmnist_dir, capsys, monkeypatch, home
):
    """2 clients at once on the GPU, in bf16: without dropout (whose masks a GPU draws otherwise concurrently) the
    reports agree with one client after another; with the default dropout 0.3 a crashed concurrent run resumes to
    the very files of an uninterrupted one."""
    alone, together = tmp_path / "alone", tmp_path / "together"
    no_dropout = ("--device", DEVICE, "--adapter-dropout", "0")
    assert run_cli(tiny_args(fmnist_dir, alone, *no_dropout, "--concurrent-clients", "1"), capsys, monkeypatch)[0] == 0
    code, _, err = run_cli(
        tiny_args(fmnist_dir, together, *no_dropout, "--concurrent-clients", "2"), capsys, monkeypatch
    )
    assert code == 0, err
    assert "one after another" not in err
    expected = json.loads((alone / "report.json").read_text())["summary"]
    summary = json.loads((together / "report.json").read_text())["summary"]
    for key, value in expected.items():
        assert summary[key] == pytest.approx(value, abs=0.05), key

    whole, crashed = tmp_path / "whole", tmp_path / "crashed"
    concurrent = ("--device", DEVICE, "--concurrent-clients", "2")
    assert run_cli(tiny_args(fmnist_dir, whole, *concurrent), capsys, monkeypatch)[0] == 0
    crash_after_round(2, tiny_args(fmnist_dir, crashed, *concurrent), capsys, monkeypatch)
    code, _, err = run_cli(tiny_args(fmnist_dir, crashed, *concurrent, "--resume"), capsys, monkeypatch)
    assert code == 0, err
    assert results(crashed) == results(whole)


def test_concurrent_clients_auto_trains_a_rounds_clients_together_on_the_gpu(
    tmp_path, fmnist_dir, capsys, monkeypatch, home
):
    """The default --concurrent-clients auto: on a GPU as many clients at once as fit (all of the tiny run's), on a
    CPU one after another, saying nothing."""
    code, _, err = run_cli(tiny_args(fmnist_dir, tmp_path / "auto", "--device", DEVICE), capsys, monkeypatch)
    assert code == 0, err
    chosen = re.search(r"--concurrent-clients auto: (\d+) clients at once", err)
    assert (int(chosen.group(1)) if chosen else 1) > 1 if DEVICE == "cuda" else chosen is None, err


def test_fused_steps_replayed_from_cuda_graphs_train_as_one_after_another_on_the_device(monkeypatch):
    """Equal clients, so that their steps are captured and replayed (`_replayed`), no dropout, in float32 (no
    autocast, no TF32 convolutions): each client's adapter after 8 steps is the one training one after another on
    the same device gives it, to float rounding. (In bf16 the two round differently at every step; the run-level
    test above compares them.)"""
    from .test_concurrent import images, perturbed, trainer

    monkeypatch.setattr(InputPipeline, "autocast", lambda self: contextlib.nullcontext())
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    trainer_ = trainer()
    trainer_.model.module.to(DEVICE)
    trainer_.inputs.device = torch.device(DEVICE)
    w = perturbed(trainer_, seed=7)
    jobs = [
        SGDJob(perturbed(trainer_, k), images(32, k), epochs=2, lr=0.05, seed=k, anchor=w, lam=lam)
        for k, lam in ((1, 1.0), (2, 0.0), (3, 0.3))
    ]
    alone = [trainer_.run(job) for job in jobs]
    concurrent = ConcurrentSGD(trainer_)
    assert concurrent.fused is not None and concurrent.graphs == (DEVICE == "cuda")
    names = list(trainer_.model.trainable_parameters())
    for job, (state, _), (expected, _) in zip(jobs, concurrent.run(jobs), alone, strict=True):
        difference = max((state[n] - expected[n]).abs().max() for n in names)
        moved = max((expected[n] - job.start[n]).abs().max() for n in names)
        assert difference < 1e-3 * moved, (difference, moved)
