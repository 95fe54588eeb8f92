"""--engine flower: the builtin engine's numbers through Flower, clients' private state on their nodes, only
adapters on the wire. One test starts Flower's Ray simulation; the others run the same ServerApp side
(`FlowerClients`) and ClientApp (`client.app`) with the nodes in this process (`InProcessGrid`), which is fast."""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from uuid import uuid4

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

pytest.importorskip("flwr.simulation")  # the test extra installs flwr[simulation]: Flower and Ray
pytest.importorskip("ray")

from flwr.app import Context, Message, RecordDict
from flwr.common.config import validate_config
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

import peradapt.commands.training as training
import peradapt.federation.engine as engine
import peradapt.federation.lifecycle as lifecycle
import peradapt.federation.rounds as rounds
from peradapt.cli import main
from peradapt.commands.finished_run import open_run
from peradapt.config import TrainConfig
from peradapt.errors import ConfigError, RunError
from peradapt.flower import simulation
from peradapt.flower.client import app as client_app
from peradapt.flower.server import FlowerClients, deployed_config
from peradapt.rundir.records import Report
from peradapt.rundir.store import DiskClientStore

from .conftest import settings

ROOT = Path(__file__).resolve().parents[1]
BYTES_KEYS = {"bytes_down", "bytes_up", "bytes_full_model", "bytes_evaluation"}


def cli_args(values: dict) -> list[str]:
    return ["train", *(part for key, value in values.items() for part in (f"--{key.replace('_', '-')}", str(value)))]


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def leaves(value: object, path: str = "") -> Iterator[tuple[str, object]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from leaves(item, f"{path}/{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from leaves(item, f"{path}[{index}]")
    else:
        yield path, value


def assert_close(expected: object, actual: object) -> None:
    """Same structure, same values: numbers to float tolerance (another process may use other thread counts)."""
    expected_leaves, actual_leaves = dict(leaves(expected)), dict(leaves(actual))
    assert expected_leaves.keys() == actual_leaves.keys()
    for path, value in expected_leaves.items():
        if isinstance(value, float):
            assert actual_leaves[path] == pytest.approx(value, rel=1e-4, abs=1e-5, nan_ok=True), path
        else:
            assert actual_leaves[path] == value, path


def without_bytes(record: dict) -> dict:
    """A round record or report.json but for what differs between the engines by design: the bytes (Flower counts its
    messages' serialized arrays and their names, the builtin engine the tensors' bytes) and the timing."""
    kept = {key: value for key, value in record.items() if key not in BYTES_KEYS | {"timing"}}
    if "cost" in kept:
        kept["cost"] = without_bytes({k: v for k, v in kept["cost"].items() if not k.startswith("bytes_")})
    return kept


def assert_same_results(builtin: Path, flower: Path) -> None:
    """metrics.jsonl and report.json (but for the byte counts, a little more under Flower, and the timing), and every
    exported adapter agree."""
    builtin_records, flower_records = metrics(builtin), metrics(flower)
    assert len(flower_records) == len(builtin_records)
    for expected, actual in zip(builtin_records, flower_records, strict=True):
        assert set(actual) - set(expected) <= BYTES_KEYS
        assert_close(without_bytes(expected), without_bytes(actual))
        for key in ("bytes_down", "bytes_up"):  # the same arrays, each with a .npy header and its name
            assert all(b < f < b + 200 * 100 for b, f in zip(expected[key], actual[key], strict=True)), key
    builtin_report, flower_report = (json.loads((run / "report.json").read_text()) for run in (builtin, flower))
    assert_close(without_bytes(builtin_report), without_bytes(flower_report))
    adapters = sorted(path.relative_to(builtin) for path in exported(builtin))
    assert adapters == sorted(path.relative_to(flower) for path in exported(flower))
    assert len(adapters) == 4 + 1  # every client and the global adapter (or model, for full-model methods)
    for relative in adapters:
        expected, actual = load_file(builtin / relative), load_file(flower / relative)
        assert expected.keys() == actual.keys()
        for name, tensor in expected.items():
            torch.testing.assert_close(actual[name], tensor, rtol=1e-4, atol=1e-4, msg=f"{relative}: {name}")


def exported(run: Path) -> list[Path]:
    return [*run.glob("clients/*/*.safetensors"), *run.glob("global/*.safetensors")]


def store_states(directory: Path) -> dict[tuple[int, str], list[int]]:
    """(client, state name) -> the round versions of its files in a disk client store."""
    states: dict[tuple[int, str], list[int]] = {}
    for path in sorted(directory.iterdir()) if directory.is_dir() else []:
        client, key, version = re.fullmatch(r"(\d+)\.(\w+)\.r(\d+)\.safetensors", path.name).groups()
        states.setdefault((int(client), key), []).append(int(version))
    return states


# ---------------------------------------------------------------- Flower's simulation runtime (Ray)


def test_flower_simulation_gives_the_builtin_numbers_and_sends_only_adapters(
    tmp_path, fmnist_dir, monkeypatch, capsys, home
):
    values = settings(fmnist_dir, tmp_path / "builtin")
    flower = tmp_path / "flower"
    # Both runs on one thread, whatever the cores: the builtin run and the Flower run's ServerApp side (aggregation,
    # PerAda's distillation) in this process, and the Ray workers that play the clients (Ray sets a worker's
    # OMP_NUM_THREADS to the CPUs it gets, half the cores for 2 clients a round, unless the environment it inherits
    # sets it). Sums in another order differ in their last bits; after training, an accuracy may then differ by a
    # whole test image, far beyond the float tolerance of `assert_same_results`.
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(name, "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        monkeypatch.setattr(sys, "argv", ["peradapt", *cli_args(values)])
        main()
        monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # restored after Flower rewrites it for Ray
        monkeypatch.setattr(sys, "argv", ["peradapt", *cli_args({**values, "out": flower, "engine": "flower"})])
        main()
    finally:
        torch.set_num_threads(threads)
    assert "perada on fmnist, 4 clients, 2 rounds" in capsys.readouterr().out  # the results table, as builtin
    assert_same_results(tmp_path / "builtin", flower)

    # PerAda's personalized adapters stayed in the run's client store, one file per sampled client, as of its
    # last round; the server's config says where.
    records = metrics(flower)
    last_round = {client: record["round"] for record in records for client in record["clients"]}
    assert store_states(flower / "client_store") == {(c, "personal"): [r] for c, r in last_round.items()}
    assert json.loads((flower / "config.json").read_text())["resolved"]["client_store"] == "disk"

    # Bytes: the adapter state down and up for every client of a round, a fraction of the full model; for
    # evaluation, the global adapter to each of the 4 clients and back the personalized adapters of the clients
    # sampled so far (the others answer that they hold the initial adapter).
    session = open_run(flower)
    adapter_values = sum(tensor.numel() for tensor in session.initial.values())
    sampled_so_far: set[int] = set()
    for record in records:
        sampled_so_far |= set(record["clients"])
        adapter = record["bytes_down"][0]
        assert 4 * adapter_values <= adapter < 4 * adapter_values + 200 * len(session.initial)  # float32 + headers
        assert record["bytes_down"] == record["bytes_up"] == [adapter] * 2
        assert record["bytes_evaluation"] == (4 + len(sampled_so_far)) * adapter
        assert record["bytes_full_model"] >= 4 * session.model.num_backbone() > adapter


# ---------------------------------------------------------------- the same apps, nodes in this process


class InProcessGrid(Grid):
    """Flower's Grid with SuperNodes in this process: the ClientApp answers each message as it is pushed."""

    def __init__(self, node_configs: list[dict]) -> None:
        self.contexts = {
            node_id: Context(run_id=1, node_id=node_id, node_config=config, state=RecordDict(), run_config={})
            for node_id, config in enumerate(node_configs, start=101)
        }
        self.replies: dict[str, Message] = {}
        self._run = None

    def set_run(self, run) -> None:  # type: ignore[no-untyped-def]
        self._run = run

    @property
    def run(self):  # type: ignore[no-untyped-def]
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None) -> Message:  # type: ignore[no-untyped-def]
        return Message(content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id, ttl=ttl)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = message_id = uuid4().hex  # as Flower's in-memory grid does
            self.replies[message_id] = client_app(message, self.contexts[message.metadata.dst_node_id])
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))


@pytest.fixture
def server_identity(monkeypatch):
    """The process identity Flower's runtime gives a ServerApp, which messages are created under."""
    for name, value in (("_run_id", 1), ("_task_id", 1), ("_node_id", 0)):
        monkeypatch.setattr(TaskIdentity, name, value)


def two_supernodes(tmp_path: Path) -> list[dict]:
    """Two SuperNodes as docs/DEPLOY.md starts them, each with a run directory of its own."""
    return [{"partition-id": k, "num-partitions": 2, "run-dir": str(tmp_path / f"node{k}")} for k in range(2)]


def train_on_grid(values: dict, grid: Grid, *, resume: bool = False) -> Report:
    config = lifecycle.resume_config(Path(values["out"]), values) if resume else TrainConfig.from_flat(values)
    console = Console(stderr=True, quiet=True)
    with lifecycle.opened_run(config, resume=resume, console=console) as run:
        return rounds.FederatedRun(run, FlowerClients(grid, run), console).play()


def test_supernodes_keep_their_own_clients_state_apfl(tmp_path, fmnist_dir, server_identity, home):
    # with stragglers: a node's client does the share of its work the server's message says, as the builtin engine's
    values = settings(fmnist_dir, tmp_path / "builtin", method="apfl", scope="adapter", stragglers=0.5)
    engine.train(TrainConfig.from_flat(values), console=Console(stderr=True, quiet=True))
    flower = tmp_path / "flower"
    train_on_grid({**values, "out": str(flower), "engine": "flower"}, InProcessGrid(two_supernodes(tmp_path)))
    assert_same_results(tmp_path / "builtin", flower)
    assert all(len(record["stragglers"]) == 1 for record in metrics(flower))  # 1 of each round's 2 clients

    # Node k got the run's files and holds APFL's v_m and α_m for its clients c (c mod 2 = k), nobody else's;
    # the server's run directory holds no client state at all.
    sampled = {client for record in metrics(flower) for client in record["clients"]}
    for k in range(2):
        node = tmp_path / f"node{k}"
        assert (node / "config.json").read_text() == (flower / "config.json").read_text()
        assert (node / "partition.json").read_text() == (flower / "partition.json").read_text()
        states = store_states(node / "client_store")
        assert set(states) == {(c, key) for c in sampled if c % 2 == k for key in ("local", "alpha")}
        assert all(len(versions) == 1 for versions in states.values())
    assert not (flower / "client_store").exists()


class Crash(Exception):
    pass


def test_a_crash_between_client_writes_and_the_checkpoint_resumes_to_the_same_numbers_pfedbred(
    tmp_path, fmnist_dir, monkeypatch, server_identity, home
):
    values = settings(fmnist_dir, tmp_path / "builtin", method="pfedbred", scope="adapter", rounds=3, inner_steps=1)
    engine.train(TrainConfig.from_flat(values), console=Console(stderr=True, quiet=True))
    flower = {**values, "out": str(tmp_path / "flower"), "engine": "flower"}
    nodes = two_supernodes(tmp_path)
    save_round = rounds.save_round

    def crash_before_checkpoint_2(session, global_state, history, paths):
        if len(history) == 2:
            raise Crash
        save_round(session, global_state, history, paths)

    monkeypatch.setattr(rounds, "save_round", crash_before_checkpoint_2)
    with pytest.raises(Crash):
        train_on_grid(flower, InProcessGrid(nodes))
    assert len(metrics(tmp_path / "builtin")[1]["clients"]) == 2  # 2 sampled and aggregated ...
    stores = [store_states(Path(node["run-dir"]) / "client_store") for node in nodes]
    written = {client for states in stores for (client, _), versions in states.items() if 2 in versions}
    assert written == set(range(4))  # ... all 4 trained (Algorithm 1) and wrote their states; no checkpoint says so

    monkeypatch.setattr(rounds, "save_round", save_round)
    train_on_grid(flower, InProcessGrid(nodes), resume=True)  # nodes drop round 2's versions and replay it
    assert_same_results(tmp_path / "builtin", tmp_path / "flower")
    for node in nodes:
        states = store_states(Path(node["run-dir"]) / "client_store")
        assert states and all(len(versions) == 1 for versions in states.values())
        assert {key for _, key in states} == {"personal", "memory"}  # θ_i and the memorized w_i of pFedBreD


# ---------------------------------------------------------------- pieces


def test_open_client_keeps_what_the_checkpoint_needs_and_touches_no_other_client(tmp_path):
    directory = tmp_path / "client_store"
    writer = DiskClientStore(directory)
    for version, value in ((1, 1.0), (2, 2.0), (3, 3.0)):  # client 3 in rounds 1, 2 and 3; client 31 in round 3
        writer.restore({}, version - 1)
        writer.put(3, "personal", {"v": torch.tensor([value])})
    writer.put(31, "personal", {"v": torch.tensor([31.0])})
    (directory / "3.personal.r00004.tmp").write_bytes(b"cut short")
    (directory / "31.personal.r00004.tmp").write_bytes(b"someone else's write in progress")
    everything = sorted(p.name for p in directory.iterdir())

    store = DiskClientStore(directory)
    # Evaluated after round 3, before its checkpoint: v3 is read, v2 stays (a resume from checkpoint 2 needs it),
    # v1 is superseded by v2, which a checkpoint covers; the interrupted write goes. Client 31 is left alone.
    store.open_client(3, played=3, checkpointed=2)
    assert store.get(3, "personal")["v"].item() == 3.0
    assert store.get(31, "personal") is None  # only the client opened is served
    names = sorted(p.name for p in directory.iterdir())
    assert names == sorted(set(everything) - {"3.personal.r00001.safetensors", "3.personal.r00004.tmp"})

    # The server died before checkpoint 3 and replays round 3: v3 was never recorded, v2 is the state.
    store.open_client(3, played=2, checkpointed=2)
    assert store.get(3, "personal")["v"].item() == 2.0
    store.put(3, "personal", {"v": torch.tensor([30.0])})
    assert (directory / "3.personal.r00003.safetensors").is_file()
    assert {p.name for p in directory.iterdir() if p.name.startswith("31.")} == {
        "31.personal.r00003.safetensors",
        "31.personal.r00004.tmp",
    }


def test_engine_settings_are_checked(tmp_path):
    assert TrainConfig.from_flat({"engine": "flower"}).federation.store_kind() == "disk"
    assert TrainConfig.from_flat({"engine": "flower", "client_store": "disk"}).federation.store_kind() == "disk"
    assert TrainConfig.from_flat({}).federation.store_kind() == "memory"
    with pytest.raises(ConfigError, match="--client-store disk or auto"):
        TrainConfig.from_flat({"engine": "flower", "client_store": "memory"})
    with pytest.raises(ConfigError, match="unknown --engine 'grpc': use builtin, flower"):
        TrainConfig.from_flat({"engine": "grpc"})
    with pytest.raises(ConfigError, match="--engine builtin"):  # ε is accounted in the server's client store
        TrainConfig.from_flat({"engine": "flower", "dp_noise": 1.0, "dp_clip": 1.0})


def test_a_failing_simulation_runtime_is_one_clear_error(tmp_path, fmnist_dir, monkeypatch, home):
    def ray_cannot_start(**_: object) -> None:
        raise RuntimeError("Unable to start Ray: no /dev/shm\nTraceback of the raylet ...")

    monkeypatch.setattr(simulation, "run_simulation", ray_cannot_start)
    values = settings(fmnist_dir, tmp_path / "run", engine="flower")
    failed = r"Flower's simulation failed \(RuntimeError: Unable to start Ray.*--engine builtin"
    with pytest.raises(RunError, match=failed) as error:
        training.train(TrainConfig.from_flat(values), console=Console(stderr=True, quiet=True))
    assert "\n" not in str(error.value)  # the CLI prints it as one line


def test_the_deployed_app_loads_and_reads_its_run_config(tmp_path, fmnist_dir):
    import tomli  # a dependency of flwr (Python 3.10 has no tomllib)

    app_dir = ROOT / "examples" / "flower-app"
    project = tomli.loads((app_dir / "pyproject.toml").read_text())
    valid, errors, _ = validate_config(project, check_module=True, project_dir=app_dir)  # imports the components
    assert valid, errors
    components = project["tool"]["flwr"]["app"]["components"]
    assert components == {"serverapp": "peradapt.flower.server:app", "clientapp": "peradapt.flower.client:app"}

    config_file = tmp_path / "train.yaml"
    config_file.write_text(f"data: fmnist\ndata_dir: {fmnist_dir}\nclients: 6\nclients_per_round: 3\n")
    config, resume = deployed_config({"config": str(config_file), "out": str(tmp_path / "run"), "resume": False})
    assert (config.federation.engine, config.federation.clients, config.out, resume) == (
        "flower",
        6,
        str(tmp_path / "run"),
        False,
    )
    with pytest.raises(ConfigError, match="out = RUN_DIRECTORY"):
        deployed_config({"config": str(config_file), "out": ""})
