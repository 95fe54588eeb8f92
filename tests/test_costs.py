"""Cost accounting (issue 28): bytes sent, client training samples and FLOPs, seconds and memory in every run, and
--budget client-samples:N, checked against hand counts on tiny models and runs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from peradapt.compute.costs import (
    inference_flops,
    peak_memory,
    sgd_samples,
    shared_sizes,
    state_bytes,
    training_flops,
)
from peradapt.evaluation.plots import plot_accuracy_vs_cost
from peradapt.evaluation.report import cost_summary
from peradapt.federation.session import build_session
from peradapt.federation.tracking import numeric
from peradapt.rundir.layout import read_partition, read_report, read_run_config

from .test_cli import crash_after_round, expect_refusal, results, run_cli, run_main, tiny_args

ROUNDS = 2
METHODS = ("perada", "fedrep", "apfl", "pfedme", "fedavg", "fedavg-ft")


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def report(run: Path) -> dict:
    return json.loads((run / "report.json").read_text())


def session_of(run: Path):
    config, _ = read_run_config(run)
    return build_session(config, read_partition(run))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pretrained_home, fmnist_dir) -> dict[str, Path]:
    """A tiny run of each method, of --rounds 2; perada once more with --concurrent-clients 2."""
    root = tmp_path_factory.mktemp("costs")
    made = {}
    for name, extra in [*((m, ("--method", m)) for m in METHODS), ("concurrent", ("--concurrent-clients", "2"))]:
        made[name] = root / name
        run_main(tiny_args(fmnist_dir, made[name], "--rounds", str(ROUNDS), *extra), pretrained_home)
    return made


# ---------------------------------------------------------------- the counting functions, by hand


def test_sgd_samples_are_epochs_of_the_data_or_the_batches_of_the_steps():
    assert sgd_samples(10, 4, epochs=3) == 30
    # 9 samples in batches of 4: [4, 5] (a last batch of one joins the one before); 3 steps: 4 + 5, then 4
    assert sgd_samples(9, 4, epochs=1, steps=3) == 13
    assert sgd_samples(8, 4, epochs=1, steps=5) == 20
    assert sgd_samples(0, 4, epochs=2, steps=3) == 0


def test_state_bytes_are_each_tensors_elements_times_their_size():
    state = {
        "a": torch.zeros(3, 4),  # float32: 12 × 4
        "b": torch.zeros(5, dtype=torch.float16),  # 5 × 2
        "n": torch.tensor(7),  # an int64 counter: 8
    }
    assert state_bytes(state) == 48 + 10 + 8


def test_training_flops_of_linear_layers_are_the_hand_count():
    torch.manual_seed(0)
    inputs = torch.randn(2, 6)
    linear = nn.Linear(6, 5)
    # forward 2·in·out a sample, the weight's gradient as much again; no input gradient (the input does not train)
    assert training_flops(linear, inputs, linear.parameters()) == 4 * 6 * 5
    frozen_first = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 3))
    frozen_first[0].requires_grad_(False)
    # the frozen layer runs forward only: no weight gradient, and nothing below the trained layer needs a gradient
    assert training_flops(frozen_first, inputs, frozen_first.parameters()) == 2 * 6 * 4 + 4 * 4 * 3
    trained_first = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 3))
    trained_first[2].requires_grad_(False)
    # the frozen top layer passes the gradient down (2·4·3) to the trained first one
    assert training_flops(trained_first, inputs, trained_first.parameters()) == 4 * 6 * 4 + 2 * 4 * 3 + 2 * 4 * 3


def test_training_flops_of_a_convolution_are_the_hand_count():
    conv = nn.Conv2d(3, 4, kernel_size=3)  # 8×8 in, 6×6 out: 2·(3·3·3)·4 per output pixel, both ways
    inputs = torch.randn(2, 3, 8, 8)
    assert training_flops(conv, inputs, conv.parameters()) == 2 * (2 * 27 * 4 * 36)


# ---------------------------------------------------------------- what a run records


def test_bytes_are_the_tensors_each_method_sends(runs, home):
    for name in ("perada", "fedrep"):
        session = session_of(runs[name])
        full = sum(t.numel() * t.element_size() for t in session.initial.values())  # the global adapter
        shared = getattr(session.method, "shared", session.initial)  # fedrep sends its body only
        sent = sum(session.initial[k].numel() * session.initial[k].element_size() for k in shared)
        for record in records(runs[name]):
            assert record["bytes_down"] == [full] * len(record["clients"])
            assert record["bytes_up"] == [sent] * len(record["clients"])
            assert record["cost"]["bytes_down"] == full * len(record["clients"])
            assert record["cost"]["bytes_up"] == sent * len(record["clients"])
    fedrep_up = records(runs["fedrep"])[0]["bytes_up"][0]
    assert fedrep_up < records(runs["fedrep"])[0]["bytes_down"][0]  # the head stays on the client
    cost = report(runs["fedrep"])["cost"]
    assert cost["bytes_up"] == ROUNDS * 2 * fedrep_up and cost["bytes_up_per_client_round"] == fedrep_up
    # per client, measured: the body and its statistics sent, the head the client's own, every parameter trained
    # (the head's job, then the body's)
    session = session_of(runs["fedrep"])
    body = {k: t for k, t in session.initial.items() if k in session.method.shared and t.is_floating_point()}
    head = {k: t for k, t in session.initial.items() if k not in session.method.shared and t.is_floating_point()}
    assert cost["parameters"] == {
        "personalized": sum(t.numel() for t in head.values()),
        "trained": session.model.num_trainable(),
        "communicated": sum(t.numel() for t in body.values()),
    }
    for record in records(runs["fedrep"]):
        assert record["parameter_counts"] == {
            "trained": session.model.num_trainable(),
            **{"communicated": cost["parameters"]["communicated"]},
        }


def test_client_samples_are_the_hand_count_and_the_bound_is_exact(runs, home):
    # (personal + local) epochs for perada, head then body for fedrep, w and the mixed model for apfl, K = 3 inner
    # steps per minibatch for pfedme: each a pass over the client's training images (1 epoch each here)
    passes = {"perada": 2, "fedrep": 2, "apfl": 2, "pfedme": 3, "fedavg": 1}
    for name, count in passes.items():
        session = session_of(runs[name])
        for record in records(runs[name]):
            trained = list(range(4)) if "trained_clients" in record else record["clients"]  # pfedme: every client
            sizes = [len(session.data.clients[c].train) for c in trained]
            assert record["client_samples"] == [count * size for size in sizes], name
            bounds = [session.method.client_samples_bound(session.data.clients[c]) for c in trained]
            assert record["client_samples"] == bounds, name
            assert record["cost"]["client_samples"] == sum(record["client_samples"])
        cost = report(runs[name])["cost"]
        assert cost["client_samples"] == sum(sum(r["client_samples"]) for r in records(runs[name]))
        assert cost["client_flops"] == cost["client_samples"] * cost["training_flops_per_sample"] > 0


def test_the_flops_per_sample_do_not_depend_on_what_ran_before(runs, home):
    session = session_of(runs["perada"])  # its frozen small-map convolutions have built no dense matrix yet
    images = session.federated_clients[0].train.images[:1].repeat(2, 1, 1, 1)
    first = session.trainer.sample_flops(images)
    assert session.trainer.sample_flops(images) == first
    assert first.training == report(runs["perada"])["cost"]["training_flops_per_sample"]
    assert first.inference == report(runs["perada"])["cost"]["inference_flops_per_sample"]
    assert 0 < first.inference < first.training


def test_clients_trained_together_count_the_same_work(runs):
    alone, together = records(runs["perada"]), records(runs["concurrent"])
    for one, other in zip(alone, together, strict=True):
        assert other["client_samples"] == one["client_samples"]
        assert other["cost"] == one["cost"]


def test_seconds_and_memory_are_recorded_apart_from_the_counts(runs):
    for record in records(runs["perada"]):
        timing = record["timing"]
        assert set(timing) == {"client_seconds", "aggregation_seconds", "distillation_seconds", "peak_rss_bytes"}
        assert all(value >= 0 for value in timing.values())
        assert timing["distillation_seconds"] > 0 and timing["peak_rss_bytes"] > 0  # perada distills every round
    assert all(r["timing"]["distillation_seconds"] == 0 for r in records(runs["fedavg"]))
    cost = report(runs["perada"])["cost"]
    assert cost["rounds_played"] == ROUNDS and cost["budget"] is None
    assert cost["timing"]["peak_cuda_bytes"] is None  # on CPU
    assert cost["timing"]["client_seconds"] == pytest.approx(
        sum(r["timing"]["client_seconds"] for r in records(runs["perada"]))
    )


def test_trackers_get_the_rounds_costs_and_timing_flattened():
    record = {
        "round": 2,
        "local_loss": 0.5,
        "bytes_up": [10, 20],  # per client: left to metrics.jsonl
        "cost": {"bytes_up": 30, "client_flops": 1000},
        "timing": {"client_seconds": 1.5, "peak_rss_bytes": 4096},
    }
    assert numeric(record) == {
        "local_loss": 0.5,
        "cost/bytes_up": 30.0,
        "cost/client_flops": 1000.0,
        "timing/client_seconds": 1.5,
        "timing/peak_rss_bytes": 4096.0,
    }


# ---------------------------------------------------------------- --budget client-samples:N


def cut(size: int, batch_size: int, share: float) -> int:
    """By hand: the samples one epoch of `size` samples in batches of `batch_size` trains at `share` of its work:
    the first floor(share x size) samples, unless that leaves a cut batch of one sample (then one less)."""
    allowed = int(share * size)
    return allowed - 1 if allowed % batch_size == 1 and allowed < size else allowed


def test_a_share_of_the_work_is_its_first_samples_in_the_same_batches():
    # 10 samples in batches of 4: [4, 4, 2]; half: the first 5 samples, the last batch cut to 1, which is left out
    assert shared_sizes([4, 4, 2], 0.5) == [4]
    assert shared_sizes([4, 4, 2], 0.7) == [4, 3]
    assert shared_sizes([4, 4, 2], 0.0) == []
    assert shared_sizes([4, 4, 2], 1.0) == [4, 4, 2]
    assert sgd_samples(10, 4, epochs=2, share=0.5) == 10  # [4, 4, 2, 4, 4, 2]: the first 10
    assert sgd_samples(10, 4, epochs=1, steps=5, share=0.3) == 4  # [4, 4, 2, 4, 4]: the first 5 are [4, 1]: 4


def test_a_share_trains_the_first_batches_of_the_whole_work(runs, home):
    session = session_of(runs["fedavg"])
    trainer = session.trainer
    whole = [batch.tolist() for batch, _ in trainer.index_batches(70, epochs=2, seed=5)]
    with trainer.sharing(0.6):
        part = [batch.tolist() for batch, _ in trainer.index_batches(70, epochs=2, seed=5)]
    assert sum(map(len, part)) == 84 and part[:-1] == whole[: len(part) - 1]
    assert part[-1] == whole[len(part) - 1][: len(part[-1])]
    assert trainer.work_share == 1.0  # after the block


def test_inference_flops_of_a_linear_layer_are_the_hand_count():
    assert inference_flops(nn.Linear(6, 5), torch.randn(3, 6)) == 2 * 6 * 5


def test_distillation_is_counted_in_samples_and_flops(runs, home):
    session = session_of(runs["perada"])
    distiller = session.method.context.distiller
    kd, val = len(distiller.kd_data), len(distiller.val_data)
    cost = report(runs["perada"])["cost"]
    for record in records(runs["perada"]):
        # 4 Adam steps of batch 32; inference: the 2 teachers' logits once (kd-mode eval), the start and 4 checks
        trained, inferred = 4 * min(32, kd), 2 * kd + 5 * val
        assert record["cost"]["server_samples"] == trained
        assert record["cost"]["server_flops"] == (
            trained * cost["training_flops_per_sample"] + inferred * cost["inference_flops_per_sample"]
        )
    assert cost["server_flops"] == sum(r["cost"]["server_flops"] for r in records(runs["perada"])) > 0
    assert all(r["cost"]["server_flops"] == 0 for r in records(runs["fedavg"]))
    assert f"server {cost['server_samples']:,} distillation samples" in cost_summary(read_report(runs["perada"]).cost)
    assert "distillation samples" not in cost_summary(read_report(runs["fedavg"]).cost)


def test_fine_tuning_at_evaluation_is_counted(runs, home):
    session = session_of(runs["fedavg-ft"])
    sizes = {client.client_id: len(client.train) for client in session.federated_clients}
    cost = report(runs["fedavg-ft"])["cost"]
    # one epoch of fine-tuning of every client's model after the rounds, and of the evaluated ones at round 2
    assert cost["personalization_samples"] == sum(sizes.values())
    assert cost["personalization_flops"] == sum(sizes.values()) * cost["training_flops_per_sample"]
    evaluated = records(runs["fedavg-ft"])[1]
    assert evaluated["cost"]["evaluation_samples"] == sum(sizes[c] for c in evaluated["per_client"]["clients"])
    assert records(runs["fedavg-ft"])[0]["cost"]["evaluation_samples"] == 0  # --eval-every 2
    assert report(runs["perada"])["cost"]["personalization_samples"] == 0  # hands out the stored v_m


def test_the_samples_declared_for_personalization_are_those_trained(runs, home):
    for name in ("fedavg-ft", "perada"):
        session = session_of(runs[name])
        for client in session.federated_clients:
            before = session.trainer.samples_trained
            session.method.personalized(client.client_id, session.initial)
            assert session.trainer.samples_trained - before == session.method.personalization_samples(client)


@pytest.fixture(scope="module")
def budget(runs) -> int:
    """A budget that fedavg's round 1 does not reach and round 2 would pass halfway."""
    full = records(runs["fedavg"])
    return full[0]["cost"]["client_samples"] + full[1]["cost"]["client_samples"] // 2


def test_the_last_round_of_a_budget_trains_what_is_left(budget, runs, tmp_path, fmnist_dir, capsys, monkeypatch, home):
    run = tmp_path / "budget"
    args = tiny_args(fmnist_dir, run, "--method", "fedavg", "--budget", f"client-samples:{budget}")  # --rounds 3
    code, out, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    assert "reached after round 2" in err
    assert [r["round"] for r in records(run)] == [1, 2]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["round-00002.safetensors"]
    full, last = records(runs["fedavg"]), records(run)[1]
    left = budget - full[0]["cost"]["client_samples"]
    assert last["budget_share"] == pytest.approx(left / full[1]["cost"]["client_samples"])
    # each client trains the first part of its epoch: the same share of its samples, the last batch cut short
    assert last["client_samples"] == [cut(n, 32, last["budget_share"]) for n in full[1]["client_samples"]]
    finished = report(run)
    spent = finished["cost"]["client_samples"]
    assert budget * 0.99 <= spent <= budget  # within 1%
    assert finished["cost"]["budget"] == {"client_samples": budget, "spent": spent, "reached": True}
    assert finished["rounds"] == 2 and "fedavg on fmnist, 4 clients, 2 rounds" in out
    assert f"--budget client-samples:{budget} reached in 2 rounds" in out and "client training samples" in out

    # killed after the round that reached the budget, before report.json: --resume ends with the same files
    crashed = tmp_path / "crashed"
    crash_after_round(
        2,
        tiny_args(fmnist_dir, crashed, "--method", "fedavg", "--budget", f"client-samples:{budget}"),
        capsys,
        monkeypatch,
    )
    assert not (crashed / "report.json").exists()
    code, _, err = run_cli(tiny_args(fmnist_dir, crashed, "--resume"), capsys, monkeypatch)
    assert code == 0, err
    assert results(crashed) == results(run)


def test_a_budget_sets_the_final_fine_tuning_aside(runs, tmp_path, fmnist_dir, capsys, monkeypatch, home):
    full = report(runs["fedavg-ft"])["cost"]
    rounds = records(runs["fedavg-ft"])
    limit = full["personalization_samples"] + rounds[0]["cost"]["client_samples"] + 40
    run = tmp_path / "ft"
    args = tiny_args(fmnist_dir, run, "--method", "fedavg-ft", "--budget", f"client-samples:{limit}")
    code, out, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    cost = report(run)["cost"]
    assert f"(and {cost['personalization_samples']:,} personalizing the clients' models)" in out.replace("\n", " ")
    spent = cost["client_samples"] + cost["personalization_samples"]
    assert cost["budget"]["spent"] == spent and limit * 0.99 <= spent <= limit
    assert cost["personalization_samples"] == full["personalization_samples"]
    # what the final fine-tuning alone trains cannot be a budget
    never = tmp_path / "never"
    args = tiny_args(
        fmnist_dir, never, "--method", "fedavg-ft", "--budget", f"client-samples:{full['personalization_samples']}"
    )
    expect_refusal(args, capsys, monkeypatch, "personalization of every client", "raise N", untouched=never)


def test_a_budget_no_round_can_reach_is_refused_before_anything_is_written(
    tmp_path, fmnist_dir, capsys, monkeypatch, home
):
    run = tmp_path / "never"
    # fedavg on the 2 largest of 4 clients, 1 epoch, 3 rounds: far fewer than a million samples
    args = tiny_args(fmnist_dir, run, "--method", "fedavg", "--budget", "client-samples:1000000")
    expect_refusal(
        args, capsys, monkeypatch, "--budget client-samples:1000000 cannot be reached", "--rounds", untouched=run
    )


# ---------------------------------------------------------------- peradapt report


def test_report_plots_accuracy_against_cost(runs, tmp_path, capsys, monkeypatch, home):
    out = tmp_path / "reports"
    code, printed, err = run_cli(
        ["report", str(runs["perada"]), str(runs["fedrep"]), "--out", str(out)], capsys, monkeypatch
    )
    assert code == 0, err
    assert f"written {out / 'accuracy_vs_cost.png'}" in printed.replace("\n", "")
    with Image.open(out / "accuracy_vs_cost.png") as image:
        assert image.format == "PNG" and image.size == (1300, 480)
        drawn = np.asarray(image.convert("RGB"))
    for colour in ((0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)):  # a point of each method's colour
        assert (np.abs(drawn.astype(int) - colour).sum(axis=2) < 30).any()


def test_the_cost_plot_takes_plain_points(tmp_path):
    panels = [("bytes", [("a", 1e3, 50.0), ("b", 1e6, 60.0)]), ("samples", [("a", 0.0, 50.0), ("b", 5.0, 60.0)])]
    path = plot_accuracy_vs_cost(panels, "accuracy %", tmp_path / "cost.png")
    with Image.open(path) as image:
        assert image.format == "PNG"


def touched(megabytes: int) -> np.ndarray:
    """An array of `megabytes` MB whose pages are all resident."""
    array = np.empty(megabytes * 2**20, dtype=np.uint8)
    array.fill(1)
    return array


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="resets the peak on Linux only")
def test_a_runs_peak_memory_is_its_own_not_the_processs(tmp_path, fmnist_dir, home):
    """Runs made one after another in one process (compare, the API) each report their own peak resident memory:
    a 1.5 GB spike between two runs is not in the second's report."""
    from rich.console import Console

    from peradapt.config import TrainConfig
    from peradapt.federation.engine import train

    from .conftest import settings

    quiet = Console(quiet=True)
    first = train(TrainConfig.from_flat(settings(fmnist_dir, tmp_path / "one")), console=quiet)
    spike = touched(1536)
    spiked = peak_memory(torch.device("cpu"))["peak_rss_bytes"]
    del spike
    second = train(TrainConfig.from_flat(settings(fmnist_dir, tmp_path / "two")), console=quiet)
    peaks = [run.cost.timing.peak_rss_bytes for run in (first, second)]
    assert spiked > peaks[0] + 2**30, (peaks, spiked)  # the spike counted while it lasted
    assert 0 < peaks[1] < spiked - 2**30, (peaks, spiked)
