"""Differential privacy: DP-SGD through opacus on every client training step, and each client's ε accounted across
rounds, checkpoints and resumes; BatchNorm and methods with their own update rules refused."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from opacus.accountants import RDPAccountant
from safetensors.torch import save_file

from peradapt.adapters import inject_adapters
from peradapt.backbones import create_backbone, freeze
from peradapt.compute.privacy import PoissonBatches, PrivateTraining, epsilon, private_training
from peradapt.compute.trainer import InputPipeline, LocalTrainer, SGDJob
from peradapt.config import PrivacyConfig, TrainConfig
from peradapt.data import ImageSet
from peradapt.errors import ConfigError

from .conftest import TINY_VIT
from .test_cli import crash_after_round, expect_user_error, results, run_cli, run_main

VIT = TINY_VIT
SIGMA, CLIP, DELTA, BATCH = 1.0, 1.0, 1e-5, 16


pytestmark = pytest.mark.usefixtures("one_thread")


def dp_args(fmnist_dir: Path, weights: Path, out: Path, *extra: str) -> list[str]:
    """A tiny PerAda run under DP: 4 clients, the last held out, 2 of 3 per round, a client store on disk."""
    return [
        "train",
        *("--data", "fmnist", "--data-dir", str(fmnist_dir), "--limit-samples", "90", "--partition", "dir:1"),
        *("--clients", "4", "--holdout-clients", "1", "--clients-per-round", "2", "--rounds", "2"),
        *("--local-epochs", "1", "--personal-epochs", "1", "--batch-size", str(BATCH), "--lora-rank", "4"),
        *("--kd-steps", "2", "--kd-batch-size", "16", "--eval-every", "0", "--device", "cpu"),
        *("--backbone", VIT, "--weights", str(weights), "--client-store", "disk"),
        *("--dp-noise", str(SIGMA), "--dp-clip", str(CLIP), "--out", str(out)),
        *extra,
    ]


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory, fmnist_dir, vit_weights) -> Path:
    """One uninterrupted DP run, shared by the tests that read it."""
    run = tmp_path_factory.mktemp("dp") / "run"
    run_main(dp_args(fmnist_dir, vit_weights, run))
    return run


def expected_history(run: Path, client: int, rounds: list[dict], epochs_per_round: int = 2) -> tuple:
    """By hand: each round a client plays, personal and local training take epochs of ceil(n / B) Poisson steps at
    q = 1 / ceil(n / B) each; the server's distillation on public data adds nothing."""
    partition = json.loads((run / "partition.json").read_text())
    steps_per_epoch = math.ceil(len(partition["clients"][client]["train"]) / BATCH)
    played = sum(client in record["clients"] for record in rounds)
    return ((SIGMA, 1 / steps_per_epoch, played * epochs_per_round * steps_per_epoch),) if played else ()


# ---------------------------------------------------------------- accounting


def test_epsilon_is_the_rdp_bound_of_the_gaussian_mechanism_and_grows_with_steps():
    # q = 1: each step is the Gaussian mechanism, of RDP alpha / (2 sigma^2) at order alpha (Mironov 2017), and T
    # steps add up; Balle et al. (2020, Thm. 21) turn it into epsilon at delta, minimized over opacus' orders.
    sigma, steps, delta = 2.0, 5, 1e-5
    alphas = np.array(RDPAccountant.DEFAULT_ALPHAS, dtype=float)
    rdp = steps * alphas / (2 * sigma**2)
    by_hand = np.min(rdp - (np.log(delta) + np.log(alphas)) / (alphas - 1) + np.log((alphas - 1) / alphas))
    assert epsilon(((sigma, 1.0, steps),), delta) == pytest.approx(by_hand, rel=1e-9)

    history = lambda steps, sigma=1.0: ((sigma, 0.25, steps),)  # noqa: E731
    assert epsilon((), delta) == 0.0
    assert epsilon(history(10), delta) < epsilon(history(20), delta) < epsilon(history(40), delta)
    assert epsilon(history(40, sigma=0.8), delta) > epsilon(history(40), delta) > epsilon(history(40, 1.5), delta)
    assert epsilon(history(40), 1e-3) < epsilon(history(40), delta)  # a looser delta, a smaller epsilon


def test_poisson_batches_take_each_sample_once_per_epoch_on_average():
    batches = PrivateTraining.batches(45, 16, epochs=2)
    assert (batches.steps, batches.sample_rate, batches.expected_size) == (6, pytest.approx(1 / 3), pytest.approx(15))
    drawn = list(batches.draw(torch.Generator().manual_seed(3)))
    assert len(drawn) == 6 and all(torch.equal(b, torch.unique(b)) and (b < 45).all() for b in drawn)
    again = list(batches.draw(torch.Generator().manual_seed(3)))
    assert all(torch.equal(a, b) for a, b in zip(drawn, again, strict=True))  # seeded: a replayed round redraws them
    many = PoissonBatches(45, 1 / 3, 3000).draw(torch.Generator().manual_seed(0))
    assert np.mean([len(b) for b in many]) == pytest.approx(15, abs=0.3)  # sd of the mean: 0.06
    small = PrivateTraining.batches(10, 16, epochs=3)  # fewer samples than a batch: the whole set, every step
    assert (small.steps, small.sample_rate) == (3, 1.0)
    assert all(len(b) == 10 for b in small.draw(torch.Generator().manual_seed(0)))


# ---------------------------------------------------------------- one DP-SGD step, by hand


def tiny_model(backbone: str, kind: str, scope: str = "adapter"):
    torch.manual_seed(0)
    model = inject_adapters(freeze(create_backbone(backbone, 3, 1)), kind, dropout=0.0, lora_rank=4, scope=scope)
    generator = torch.Generator().manual_seed(1)
    start = model.state()
    for name, parameter in model.trainable_parameters().items():  # LoRA's B starts at 0: move off the origin
        start[name] = parameter.detach() + 0.1 * torch.randn(parameter.shape, generator=generator)
    return model, start


def tiny_data(count: int, size: int, seed: int = 0) -> ImageSet:
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (count, 1, size, size), generator=generator, dtype=torch.uint8)
    return ImageSet(images, torch.randint(0, 3, (count,), generator=generator), 3)


def private_trainer(model, batch_size: int, sigma: float, clip: float) -> LocalTrainer:
    inputs = InputPipeline((0.5,), (0.25,), torch.device("cpu"))
    return LocalTrainer(model, inputs, batch_size, privacy=PrivateTraining(PrivacyConfig(sigma, clip)))


@pytest.mark.parametrize(
    ("backbone", "kind", "scope"),
    [
        (VIT, "lora", "adapter"),  # LoRA linears and the head: opacus' Linear rule
        (VIT, "residual", "adapter"),  # bottleneck adapters, the blocks' LayerNorms (timm's: functorch) and the head
        (VIT, "none", "full"),  # the whole ViT, class token and position embeddings included (functorch)
        ("resnet10_w4", "lora", "adapter"),  # LoRA convolutions on a ResNet whose BatchNorms stay frozen
    ],
)
def test_a_dp_step_clips_every_sample_gradient_as_by_hand(backbone, kind, scope):
    model, start = tiny_model(backbone, kind, scope)
    size = 32 if backbone == VIT else 28
    data, lr, lam = tiny_data(6, size), 0.5, 0.3
    anchor = {name: tensor + 0.05 for name, tensor in start.items()}
    parameters = model.trainable_parameters()
    model.load_state(start)
    model.train()
    images = InputPipeline((0.5,), (0.25,), torch.device("cpu"))(data.images)
    per_sample = []
    for i in range(len(data)):
        loss = F.cross_entropy(model(images[i : i + 1]), data.labels[i : i + 1])
        per_sample.append(torch.autograd.grad(loss, list(parameters.values())))
    norms = torch.stack([torch.sqrt(sum(g.pow(2).sum() for g in grads)) for grads in per_sample])
    clip = norms.sort().values[2:4].mean().item()  # between the middle two: three samples are clipped, three not
    factors = (clip / (norms + 1e-6)).clamp(max=1.0)
    assert (factors < 1).sum() == 3 and (factors == 1).sum() == 3

    # batch size 6 of 6 samples: q = 1, one step on all of them; sigma so small that the noise is below tolerance
    # with a gradient correction (SCAFFOLD's c - c_i): a fixed term of the step, not clipped
    correction = {name: 0.02 * torch.ones_like(parameter) for name, parameter in parameters.items()}
    trainer = private_trainer(model, batch_size=6, sigma=1e-9, clip=clip)
    job = SGDJob(start, data, epochs=1, lr=lr, seed=0, anchor=anchor, lam=lam, correction=correction)
    result, _ = trainer.run(job)
    for index, (name, parameter) in enumerate(parameters.items()):
        clipped_mean = sum(f * grads[index] for f, grads in zip(factors, per_sample, strict=True)) / len(data)
        expected = start[name] - lr * (clipped_mean + lam * (start[name] - anchor[name]) + correction[name])
        torch.testing.assert_close(result[name], expected, atol=1e-6, rtol=1e-4, msg=name)
        assert not hasattr(parameter, "grad_sample")  # opacus' hooks are gone: distillation trains the plain model
    assert trainer.privacy.spent == [(1e-9, 1.0, 1)]


def test_the_noise_has_std_sigma_c_over_the_expected_batch_and_follows_the_seed():
    model, start = tiny_model(VIT, "lora")
    sigma, clip, lr = 1e4, 1.0, 1.0
    trainer = private_trainer(model, batch_size=6, sigma=sigma, clip=clip)
    data = tiny_data(6, 32)
    result, _ = trainer.sgd(start, data, epochs=1, lr=lr, seed=7)
    steps = torch.cat([(start[n] - result[n]).flatten() for n in model.trainable_parameters()])
    # the clipped gradients' mean is at most C = 1 in norm, against noise of norm ~ sigma C / 6 * sqrt(17,034)
    assert (steps * len(data) / (lr * sigma * clip)).std().item() == pytest.approx(1.0, abs=0.03)
    same, _ = trainer.sgd(start, data, epochs=1, lr=lr, seed=7)
    other, _ = trainer.sgd(start, data, epochs=1, lr=lr, seed=8)
    assert all(torch.equal(result[n], same[n]) for n in result)
    assert not torch.equal(
        result["base_model.model.head.modules_to_save.default.weight"],
        other["base_model.model.head.modules_to_save.default.weight"],
    )


def test_a_poisson_draw_of_no_sample_is_a_noise_only_step():
    model, start = tiny_model(VIT, "none", "full")  # the whole ViT: opacus' functorch path cannot run on 0 samples
    data, seed = tiny_data(2, 32), 5
    trainer = private_trainer(model, batch_size=1, sigma=1.0, clip=1.0)  # q = 1/2: a quarter of the draws are empty
    batches = trainer.privacy.batches(len(data), 1, epochs=10)
    assert sum(len(b) == 0 for b in batches.draw(torch.Generator().manual_seed(seed))) > 0  # as sgd will draw them
    result, loss = trainer.sgd(start, data, epochs=10, lr=0.01, seed=seed)
    assert math.isfinite(loss) and all(torch.isfinite(t).all() for t in result.values())
    assert trainer.privacy.spent == [(1.0, 0.5, 20)]  # empty draws are steps too, and are accounted


# ---------------------------------------------------------------- what is refused


def test_batchnorm_that_trains_is_refused_and_frozen_batchnorm_is_not():
    config = TrainConfig.from_flat({"dp_noise": 1.0, "dp_clip": 1.0})
    for kind, scope in [("residual", "adapter"), ("lora", "full")]:
        model, _ = tiny_model("resnet10_w4", kind, scope)
        with pytest.raises(ConfigError, match="BatchNorm") as error:
            private_training(config, model)
        assert "--backbone vit_tiny_p4_32" in str(error.value) and "\n" not in str(error.value)
    model, _ = tiny_model("resnet10_w4", "lora", "adapter")
    assert isinstance(private_training(config, model), PrivateTraining)
    assert private_training(TrainConfig(), model) is None  # no --dp-noise, no DP


def test_opacus_is_imported_for_dp_runs_only(monkeypatch):
    modules = "peradapt.cli, peradapt.federation.engine, peradapt.commands.newclients"
    plain = f"import sys, {modules}; print('opacus' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", plain], capture_output=True, text=True, check=True).stdout == "False\n"
    monkeypatch.setitem(sys.modules, "opacus", None)  # as if it were not installed
    model, _ = tiny_model(VIT, "lora")
    with pytest.raises(ConfigError, match=r"pip install 'peradapt\[dp\]'"):
        private_training(TrainConfig.from_flat({"dp_noise": 1.0, "dp_clip": 1.0}), model)


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--backbone", "resnet10_w4"], ["BatchNorm", "vit_tiny_p4_32", "--adapter lora"]),
        (["--method", "apfl"], ["apfl", "perada, perada-nokd", "ditto"]),
        (["--method", "fedavg-ft"], ["fedavg-ft", "--dp-noise"]),
        (["--lam", "auto"], ["--lam auto"]),
        (["--dp-noise", "0"], ["--dp-noise", "positive"]),
        (["--dp-delta", "1"], ["--dp-delta"]),
    ],
)
def test_dp_mistakes_exit_2_in_one_line_and_write_nothing(
    extra, needles, fmnist_dir, vit_weights, tmp_path, capsys, monkeypatch
):
    run = tmp_path / "run"
    args = dp_args(fmnist_dir, vit_weights, run, *extra)
    if "resnet10_w4" in extra:  # a random ResNet: the refusal comes before any training
        weights = tmp_path / "resnet.safetensors"
        save_file(
            {k: v.contiguous() for k, v in create_backbone("resnet10_w4", 10, 1).state_dict().items()}, str(weights)
        )
        args[args.index("--weights") + 1] = str(weights)
    expect_user_error(args, capsys, monkeypatch, *needles)
    assert not run.exists()
    args = dp_args(fmnist_dir, vit_weights, run)
    clip_alone = args[: args.index("--dp-noise")] + args[args.index("--dp-noise") + 2 :]
    expect_user_error(clip_alone, capsys, monkeypatch, "--dp-noise", "--dp-clip")


# ---------------------------------------------------------------- a DP run through the CLI


def test_a_dp_run_records_each_clients_epsilon_as_accounted_by_hand(dp_run):
    run = dp_run
    rounds = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    report = json.loads((run / "report.json").read_text())
    privacy = report["privacy"]
    assert report["clients"] == [0, 1, 2] and report["held_out_clients"] == [3]
    assert (privacy["noise_multiplier"], privacy["max_grad_norm"], privacy["delta"]) == (SIGMA, CLIP, DELTA)
    expected = [epsilon(expected_history(run, c, rounds), DELTA) for c in report["clients"]]
    assert privacy["epsilon"]["per_client"] == pytest.approx(expected, rel=1e-12)
    assert privacy["epsilon"]["mean"] == pytest.approx(np.mean(expected))
    assert privacy["epsilon"]["max"] == pytest.approx(max(expected))
    assert privacy["steps"] == [sum(h[2] for h in expected_history(run, c, rounds)) for c in report["clients"]]
    # each round records the epsilon its clients have spent so far; a client playing both rounds (4 places, 3
    # clients) spends more in the second
    for index, record in enumerate(rounds):
        so_far = [epsilon(expected_history(run, c, rounds[: index + 1]), DELTA) for c in record["clients"]]
        assert record["dp_epsilon"] == pytest.approx(so_far, rel=1e-12)
    twice = set(rounds[0]["clients"]) & set(rounds[1]["clients"])
    for client in twice:
        first, second = (r["dp_epsilon"][r["clients"].index(client)] for r in rounds)
        assert 0 < first < second


def test_train_and_info_show_the_epsilons(dp_run, capsys, monkeypatch):
    report = json.loads((dp_run / "report.json").read_text())
    mean, std = report["privacy"]["epsilon"]["mean"], report["privacy"]["epsilon"]["std"]
    code, out, err = run_cli(["info", "--run", str(dp_run)], capsys, monkeypatch)
    assert code == 0, err
    assert "differential privacy: DP-SGD with noise multiplier 1, clipping norm 1, δ = 1e-05" in out
    assert f"ε per client {mean:.2f} ± {std:.2f} on average" in out
    epsilon_column = [line.split("│")[4].strip() for line in out.splitlines() if line.startswith("│")]
    per_client = report["privacy"]["epsilon"]["per_client"]
    assert epsilon_column == [f"{value:.2f}" for value in per_client] + ["-"]  # the held-out client spent nothing


def test_report_tables_the_epsilons(dp_run, tmp_path, capsys, monkeypatch):
    code, _, err = run_cli(["report", str(dp_run), "--out", str(tmp_path)], capsys, monkeypatch)
    assert code == 0, err
    spent = json.loads((dp_run / "report.json").read_text())["privacy"]["epsilon"]
    summary = (tmp_path / "summary.md").read_text()
    assert "DP ε: mean ± std (max)" in summary
    assert f"{spent['mean']:.2f} ± {spent['std']:.2f} ({spent['max']:.2f})" in summary
    assert json.loads((tmp_path / "summary.json").read_text())["rows"][0]["dp_epsilon"] == spent


def test_a_larger_noise_multiplier_spends_less_in_a_real_run(
    dp_run, fmnist_dir, vit_weights, tmp_path, capsys, monkeypatch
):
    run = tmp_path / "noisier"
    args = dp_args(fmnist_dir, vit_weights, run, "--rounds", "1", "--dp-noise", "2", "--client-store", "memory")
    code, out, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    report = json.loads((run / "report.json").read_text())
    assert f"DP ε = {report['privacy']['epsilon']['mean']:.2f} ± " in out  # the result table's title
    noisier = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    reference = json.loads((dp_run / "metrics.jsonl").read_text().splitlines()[0])
    assert noisier["clients"] == reference["clients"]  # the same seed samples the same clients
    assert all(0 < a < b for a, b in zip(noisier["dp_epsilon"], reference["dp_epsilon"], strict=True))


def test_a_dp_run_resumed_after_a_crash_ends_with_identical_files(
    dp_run, fmnist_dir, vit_weights, tmp_path, capsys, monkeypatch
):
    run = tmp_path / "crashed"
    crash_after_round(1, dp_args(fmnist_dir, vit_weights, run), capsys, monkeypatch)
    code, _, err = run_cli(dp_args(fmnist_dir, vit_weights, run, "--resume"), capsys, monkeypatch)
    assert code == 0, err
    assert "after round 1" in err
    # the noise, the Poisson draws and every client's accountant history are those of the uninterrupted run
    made_later = ("new_clients/",)  # by the personalize test, on the shared run

    def compared(files):
        return {name: data for name, data in files.items() if not name.startswith(made_later)}

    assert compared(results(run)) == compared(results(dp_run))


def test_a_new_client_is_personalized_with_dp_sgd_and_told_its_epsilon(dp_run, capsys, monkeypatch):
    code, out, err = run_cli(["personalize", "--run", str(dp_run), "--new-client", "3"], capsys, monkeypatch)
    assert code == 0, err
    result = json.loads((dp_run / "new_clients" / "3" / "result.json").read_text())
    # PerAda personalizes a new client with S = --personal-epochs epochs of the proximal update from w
    history = expected_history(dp_run, 3, [{"clients": [3]}], epochs_per_round=1)
    assert result["privacy"]["epsilon"] == pytest.approx(epsilon(history, DELTA), rel=1e-12)
    assert result["privacy"]["epsilon"] > 0
    assert result["privacy"]["steps"] == history[0][2]
    assert f"differential privacy: ε = {result['privacy']['epsilon']:.2f} at δ = 1e-05" in out
