"""Scale: the disk client store (exact, crash-consistent, equal to the memory store), 10,000 clients through the
command line, and a round loop that copies no model and allocates nothing per client."""

from __future__ import annotations

import copy
import gc
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from peradapt.adapters import inject_adapters
from peradapt.backbones import create_backbone
from peradapt.cli import main
from peradapt.config import DISK_STORE_ABOVE, FederationConfig
from peradapt.data.partition import parse_partition, partition_labels
from peradapt.federation.rounds import FederatedRun
from peradapt.rundir import store as store_module
from peradapt.rundir.store import DiskClientStore

from .conftest import idx_bytes
from .test_cli import results, run_cli, run_main, tiny_args


class Crash(Exception):
    pass


def random_state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "layer.weight": torch.randn(3, 4, 1, 1, generator=generator),
        "layer.bias": torch.randn(4, generator=generator).to(torch.bfloat16),
        "bn.running_var": torch.rand(4, generator=generator, dtype=torch.float64),
        "bn.num_batches_tracked": torch.tensor(seed, dtype=torch.int64),
        "alpha": torch.tensor(0.1 + seed, dtype=torch.float64),  # 0-d, as APFL keeps its mixing weight
    }


def assert_bitwise_equal(actual: dict[str, torch.Tensor] | None, expected: dict[str, torch.Tensor]) -> None:
    assert actual is not None and actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype and actual[name].shape == tensor.shape, name
        assert actual[name].view(-1).view(torch.uint8).equal(tensor.view(-1).view(torch.uint8)), name


def store_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# ---------------------------------------------------------------- the disk store on its own


def test_disk_store_round_trips_client_states_bitwise(tmp_path):
    store = DiskClientStore(tmp_path / "client_store")
    store.restore({}, 0)
    assert store.get(3, "personal") is None  # never sampled: the method falls back to the initial state
    states = {(client, key): random_state(10 * client + len(key)) for client in (0, 3, 12) for key in ("personal", "a")}
    for (client, key), state in states.items():
        store.put(client, key, state)
    for slot, state in states.items():
        assert_bitwise_equal(store.get(*slot), state)
    store.commit(1)
    reopened = DiskClientStore(tmp_path / "client_store")  # a new process, resuming after round 1
    reopened.restore({}, 1)
    for slot, state in states.items():
        assert_bitwise_equal(reopened.get(*slot), state)
    assert reopened.checkpoint_tensors() == {}  # the files are the state, not the checkpoint
    assert len(store_files(tmp_path / "client_store")) == len(states)  # one file per (client, key)


def test_disk_store_keeps_the_previous_state_when_a_write_is_cut_short(tmp_path, monkeypatch):
    directory = tmp_path / "client_store"
    store = DiskClientStore(directory)
    before, after = random_state(1), random_state(2)
    store.put(5, "personal", before)
    store.commit(1)

    def replace_fails(source, target):
        raise Crash

    monkeypatch.setattr(store_module.os, "replace", replace_fails)
    with pytest.raises(Crash):
        store.put(5, "personal", after)  # round 2: the new version is written, but never put in place
    monkeypatch.undo()
    assert_bitwise_equal(store.get(5, "personal"), before)
    assert store_files(directory) == ["5.personal.r00001.safetensors", "5.personal.r00002.tmp"]

    resumed = DiskClientStore(directory)
    resumed.restore({}, 1)  # resume from the checkpoint of round 1
    assert store_files(directory) == ["5.personal.r00001.safetensors"]
    assert_bitwise_equal(resumed.get(5, "personal"), before)


def test_disk_store_follows_the_checkpoint_round(tmp_path):
    directory = tmp_path / "client_store"
    store = DiskClientStore(directory)
    round_1, round_2 = random_state(1), random_state(2)
    store.put(1, "personal", round_1)
    store.commit(1)
    store.put(1, "personal", round_2)
    store.put(2, "personal", round_2)
    assert_bitwise_equal(store.get(1, "personal"), round_2)  # the round being played sees its own writes
    both_versions = ["1.personal.r00001.safetensors", "1.personal.r00002.safetensors", "2.personal.r00002.safetensors"]
    assert store_files(directory) == both_versions  # the old version waits for round 2's checkpoint

    killed_before_checkpoint = DiskClientStore(directory)
    killed_before_checkpoint.restore({}, 1)  # round 2 never reached its checkpoint: its versions go
    assert store_files(directory) == ["1.personal.r00001.safetensors"]
    assert_bitwise_equal(killed_before_checkpoint.get(1, "personal"), round_1)
    assert killed_before_checkpoint.get(2, "personal") is None

    killed_before_checkpoint.put(1, "personal", round_2)  # round 2 again, then its checkpoint
    killed_in_commit = DiskClientStore(directory)
    killed_in_commit.restore({}, 2)  # the commit that deletes superseded versions never ran: restore does it
    assert store_files(directory) == ["1.personal.r00002.safetensors"]
    assert_bitwise_equal(killed_in_commit.get(1, "personal"), round_2)


# Rounds of 8 client states (1 MB each) with a checkpoint file and a commit after each round, until killed.
STORE_WRITER = """
import os, sys, torch
from pathlib import Path
from peradapt.rundir.store import DiskClientStore
directory = Path(sys.argv[1])
checkpoint = directory.parent / "checkpoint"
store = DiskClientStore(directory)
store.restore({}, 0)
for completed in range(1, 10_000):
    for client in range(8):
        store.put(client, "personal", {"w": torch.full((256, 1024), float(100 * completed + client))})
    (directory.parent / "checkpoint.tmp").write_text(str(completed))
    os.replace(directory.parent / "checkpoint.tmp", checkpoint)
    store.commit(completed)
"""


def test_disk_store_killed_at_any_moment_restores_its_checkpoint(tmp_path):
    directory = tmp_path / "client_store"
    process = subprocess.Popen([sys.executable, "-c", STORE_WRITER, str(directory)], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while process.poll() is None and not (tmp_path / "checkpoint").exists():
        assert time.monotonic() < deadline, "the writer checkpointed nothing"
        time.sleep(0.01)
    time.sleep(0.2)  # some rounds further: the kill lands in a write, between writes, or in a commit
    process.send_signal(signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL, process.stderr.read() if process.stderr else ""
    completed = int((tmp_path / "checkpoint").read_text())
    store = DiskClientStore(directory)
    store.restore({}, completed)
    assert store_files(directory) == [f"{client}.personal.r{completed:05d}.safetensors" for client in range(8)]
    for client in range(8):
        assert_bitwise_equal(store.get(client, "personal"), {"w": torch.full((256, 1024), 100.0 * completed + client)})


def test_auto_keeps_client_state_on_disk_above_the_threshold():
    assert FederationConfig(clients=DISK_STORE_ABOVE).store_kind() == "memory"
    assert FederationConfig(clients=DISK_STORE_ABOVE + 1).store_kind() == "disk"
    assert FederationConfig(clients=10_000, client_store="memory").store_kind() == "memory"
    assert FederationConfig(clients=4, client_store="disk").store_kind() == "disk"


def test_dirichlet_partition_of_10000_clients_gives_everyone_the_floor():
    labels = np.random.default_rng(0).integers(0, 10, 25_000)  # Fashion-MNIST's client pool

    class CountingDraws:
        """The generator, counting its Dirichlet draws."""

        def __init__(self) -> None:
            self.generator, self.dirichlet_draws = np.random.default_rng(0), 0

        def dirichlet(self, *args, **kwargs):
            self.dirichlet_draws += 1
            return self.generator.dirichlet(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.generator, name)

    rng = CountingDraws()
    parts = partition_labels(labels, 10_000, parse_partition("dir:0.1"), rng)
    assert 1 <= rng.dirichlet_draws <= 10  # a few draws, not 1000 hopeless ones (seconds each at this size)
    assert min(len(part) for part in parts) == 2  # the floor: the pool holds 2.5 images per client
    every = np.concatenate(parts)
    assert len(every) == len(labels) and len(np.unique(every)) == len(labels)


@pytest.mark.parametrize("kind", ["residual", "lora"])
def test_adapters_are_saved_with_the_bytes_peft_writes(kind, tmp_path):
    model = inject_adapters(create_backbone("resnet10_w4", 10, 1), kind, dropout=0.3, lora_rank=4)
    state = {
        name: tensor + 0.01 * torch.randn_like(tensor) if tensor.is_floating_point() else tensor + 1
        for name, tensor in model.state().items()
    }
    model.save_pretrained(tmp_path / "fast", state)  # from the state, without PEFT's save
    model.module.save_pretrained(str(tmp_path / "peft"))  # PEFT's own, from the model: save_pretrained loaded it
    # but PEFT's empty model-card template, the same for every adapter (`export` writes filled cards)
    assert store_files(tmp_path / "fast") == [name for name in store_files(tmp_path / "peft") if name != "README.md"]
    name = "adapter_model.safetensors"
    assert (tmp_path / "fast" / name).read_bytes() == (tmp_path / "peft" / name).read_bytes()
    fast, peft = (json.loads((tmp_path / d / "adapter_config.json").read_text()) for d in ("fast", "peft"))
    assert fast == {**peft, "target_modules": sorted(peft["target_modules"])}  # sorted: the same bytes every run


# ---------------------------------------------------------------- runs: disk store == memory store, crashes


def two_rounds(fmnist_dir: Path, run: Path, *extra: str) -> list[str]:
    """The tiny PerAda run of test_cli, two rounds (evaluated after the second)."""
    return tiny_args(fmnist_dir, run, "--rounds", "2", *extra)


@pytest.fixture(scope="module")
def memory_run(tmp_path_factory, pretrained_home, fmnist_dir):
    """The 4 clients' state in memory: `auto` below the threshold."""
    run = tmp_path_factory.mktemp("runs") / "memory"
    run_main(two_rounds(fmnist_dir, run), pretrained_home)
    assert json.loads((run / "config.json").read_text())["resolved"]["client_store"] == "memory"
    return run


def same_results_but_the_store(disk_run: Path, memory_run: Path) -> None:
    """Every file equal but where client state lives: disk files instead of checkpoint tensors."""

    def comparable(run: Path) -> dict[str, bytes]:
        files = {k: v for k, v in results(run).items() if not k.startswith(("checkpoints/", "client_store/"))}
        config = json.loads(files["config.json"])
        config["config"]["federation"]["client_store"] = config["resolved"]["client_store"] = None
        files["config.json"] = json.dumps(config).encode()
        return files

    assert comparable(disk_run) == comparable(memory_run)
    [disk_checkpoint] = (disk_run / "checkpoints").iterdir()
    [memory_checkpoint] = (memory_run / "checkpoints").iterdir()
    assert disk_checkpoint.name == memory_checkpoint.name
    in_checkpoint = load_file(str(memory_checkpoint))
    global_part = {k: v for k, v in in_checkpoint.items() if k.startswith("global/")}
    assert_bitwise_equal(load_file(str(disk_checkpoint)), global_part)
    client_states: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in in_checkpoint.items():
        if name.startswith("clients/"):
            _, client, key, tensor_name = name.split("/", 3)
            client_states.setdefault(f"{client}.{key}", {})[tensor_name] = tensor
    on_disk = {re.sub(r"\.r\d+\.safetensors$", "", p.name): p for p in (disk_run / "client_store").iterdir()}
    assert len(on_disk) == len(list((disk_run / "client_store").iterdir()))  # one version per state
    assert on_disk.keys() == client_states.keys()
    for slot, state in client_states.items():
        assert_bitwise_equal(load_file(str(on_disk[slot])), state)


def test_disk_store_run_crashed_in_a_commit_and_mid_write_resumes_to_the_memory_run(
    memory_run, tmp_path, fmnist_dir, capsys, monkeypatch, home
):
    run = tmp_path / "disk"
    args = two_rounds(fmnist_dir, run, "--client-store", "disk")
    commit = DiskClientStore.commit

    def commit_cut_short(self, completed_rounds):
        raise Crash  # round 1's checkpoint is written; the commit after it never runs

    monkeypatch.setattr(DiskClientStore, "commit", commit_cut_short)
    with pytest.raises(Crash):
        run_cli(args, capsys, monkeypatch)
    monkeypatch.setattr(DiskClientStore, "commit", commit)
    replace = os.replace

    def replace_fails_in_round_2(source, target):
        if str(target).endswith(".r00002.safetensors"):
            raise Crash
        replace(source, target)

    monkeypatch.setattr(store_module.os, "replace", replace_fails_in_round_2)
    with pytest.raises(Crash):
        run_cli([*args, "--resume"], capsys, monkeypatch)
    assert any(name.endswith(".r00002.tmp") for name in store_files(run / "client_store"))
    monkeypatch.setattr(store_module.os, "replace", replace)

    code, _, err = run_cli([*args, "--resume"], capsys, monkeypatch)
    assert code == 0, err
    assert "after round 1" in err
    same_results_but_the_store(run, memory_run)


# ---------------------------------------------------------------- 10,000 clients


def write_many_tiny_images(directory: Path, num_train: int, num_test: int, size: int = 16) -> Path:
    """Noise images of `size` px in IDX format: cheap, and enough for what the test checks (files, not accuracy)."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for prefix, count in (("train", num_train), ("t10k", num_test)):
        (directory / f"{prefix}-images-idx3-ubyte").write_bytes(idx_bytes(rng.integers(0, 256, (count, size, size))))
        (directory / f"{prefix}-labels-idx1-ubyte").write_bytes(idx_bytes(rng.integers(0, 10, count)))
    return directory


def no_deepcopy(self, memo):
    raise AssertionError(f"deepcopy of a {type(self).__name__} in the round loop")


def live_model_objects() -> tuple[int, int, int]:
    """Modules, parameters and parameter elements alive now."""
    gc.collect()
    objects = gc.get_objects()
    parameters = [o for o in objects if issubclass(type(o), nn.Parameter)]
    modules = sum(issubclass(type(o), nn.Module) for o in objects)  # type(): no attribute lookups on odd objects
    return modules, len(parameters), sum(p.numel() for p in parameters)


def train_guarded(args: list[str], patch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """`peradapt train` with every deepcopy of a module or parameter failing during the rounds, the final
    evaluation and the export; returns the live model objects after the rounds and after the export."""
    seen = []

    def guarded(function):
        def run(*call_args, **call_kwargs):
            with pytest.MonkeyPatch.context() as no_copies:
                no_copies.setattr(nn.Module, "__deepcopy__", no_deepcopy, raising=False)
                no_copies.setattr(nn.Parameter, "__deepcopy__", no_deepcopy)
                result = function(*call_args, **call_kwargs)
            seen.append(live_model_objects())
            return result

        return run

    patch.setattr(FederatedRun, "play_rounds", guarded(FederatedRun.play_rounds))
    patch.setattr(FederatedRun, "finish", guarded(FederatedRun.finish))
    patch.setattr(sys, "argv", ["peradapt", *args])
    main()
    assert copy.deepcopy({"a": 1}) == {"a": 1} and not hasattr(nn.Module, "__deepcopy__")  # the guard is gone
    return seen


def scale_args(data: Path, out: Path, clients: int, *extra: str) -> list[str]:
    return [
        *("train", "--data", "fmnist", "--data-dir", str(data), "--backbone", "resnet10_w4", "--method", "perada-nokd"),
        *("--clients", str(clients), "--clients-per-round", "4", "--rounds", "1", "--partition", "dir:0.5"),
        *("--local-epochs", "1", "--personal-epochs", "1", "--batch-size", "32", "--eval-every", "1"),
        *("--device", "cpu", "--out", str(out), *extra),
    ]


@pytest.fixture(scope="module")
def tiny_images(tmp_path_factory) -> Path:
    # 48,000 training images leave a client pool of 20,000: two images for each of 10,000 clients.
    return write_many_tiny_images(tmp_path_factory.mktemp("tiny-images"), 48_000, 400)


@pytest.fixture(scope="module")
def ten_thousand(tmp_path_factory, tiny_images, pretrained_home) -> tuple[Path, list[tuple[int, int, int]]]:
    """A one-round run of 10,000 clients through the command line, and the model objects alive in it."""
    run = tmp_path_factory.mktemp("runs") / "ten-thousand"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PERADAPT_HOME", str(pretrained_home))
        seen = train_guarded(scale_args(tiny_images, run, 10_000), patch)
    return run, seen


def test_ten_thousand_clients_train_eval_and_info_through_the_cli(ten_thousand, capsys, monkeypatch, home):
    run, _ = ten_thousand
    resolved = json.loads((run / "config.json").read_text())["resolved"]
    assert resolved["client_store"] == "disk"  # auto, above the threshold
    sampled = json.loads((run / "metrics.jsonl").read_text())["clients"]
    assert store_files(run / "client_store") == sorted(f"{c}.personal.r00001.safetensors" for c in sampled)
    [checkpoint] = (run / "checkpoints").iterdir()
    assert all(name.startswith("global/") for name in load_file(str(checkpoint)))  # no client tensors
    assert len(list((run / "clients").iterdir())) == 10_000

    report = json.loads((run / "report.json").read_text())
    assert report["clients"] == list(range(10_000))
    assert len(report["personalized"]["local_test"]["per_client"]) == 10_000
    global_test = report["personalized"]["global_test"]  # a seeded sample of clients, named in the report
    assert len(global_test["clients"]) == len(global_test["per_client"]) == 100
    assert set(global_test["clients"]) <= set(range(10_000))

    code, out, err = run_cli(["eval", "--run", str(run)], capsys, monkeypatch)
    assert code == 0, err
    evaluation = json.loads((run / "eval.json").read_text())
    assert evaluation["personalized"]["local_test"] == pytest.approx(
        report["personalized"]["local_test"]["per_client"], nan_ok=True
    )
    assert evaluation["global_test_clients"] == global_test["clients"]

    code, out, err = run_cli(["info", "--run", str(run)], capsys, monkeypatch)
    assert code == 0, err
    assert "9,900 more clients" in out and f"client state: disk ({run / 'client_store'})" in out


def test_the_round_loop_copies_no_model_and_allocates_nothing_per_client(ten_thousand, tiny_images, tmp_path, home):
    """The same modules and parameters are alive with 5 clients as with 10,000, and no deepcopy of a module or
    parameter happened in either run."""
    with pytest.MonkeyPatch.context() as patch:
        few = train_guarded(scale_args(tiny_images, tmp_path / "five", 5, "--limit-samples", "400"), patch)
    assert few == ten_thousand[1]
