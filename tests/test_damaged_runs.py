"""Damaged run directories: every command that reads one refuses it in one error line that names the damaged file
and says how to recover, writes nothing, and the advice works when followed (issue 16, run-directory family)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from peradapt.errors import RunError
from peradapt.rundir.store import DiskClientStore

from .test_cli import expect_refusal, results, run_cli, run_main, tiny_args

pytestmark = pytest.mark.usefixtures("one_thread")

HELD_OUT = "3"  # the runs hold out their last client, for `personalize`
CHECKPOINT = "checkpoints/round-00001.safetensors"


def run_args(fmnist_dir: Path, out: Path, *extra: str) -> list[str]:
    return tiny_args(fmnist_dir, out, "--rounds", "1", "--holdout-clients", "1", *extra)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pretrained_home, fmnist_dir) -> dict[str, Path]:
    """Finished tiny runs, copied by each test before it damages one: `memory` (client states in the checkpoint),
    `disk` (--client-store disk), and `lora` (no rounds: only another kind of adapter to copy from)."""
    root = tmp_path_factory.mktemp("damaged")
    made = {"memory": root / "memory", "disk": root / "disk", "lora": root / "lora"}
    run_main(run_args(fmnist_dir, made["memory"]), pretrained_home)
    run_main(run_args(fmnist_dir, made["disk"], "--client-store", "disk"), pretrained_home)
    run_main(tiny_args(fmnist_dir, made["lora"], "--rounds", "0", "--adapter", "lora"), pretrained_home)
    return made


def copy_of(runs: dict[str, Path], kind: str, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(runs[kind], run)
    return run


# ---------------------------------------------------------------- damages


def truncated(name: str) -> Callable[[Path], None]:
    def damage(run: Path) -> None:
        content = (run / name).read_bytes()
        (run / name).write_bytes(content[: len(content) // 2])

    return damage


def replaced(name: str, content: bytes) -> Callable[[Path], None]:
    def damage(run: Path) -> None:
        (run / name).write_bytes(content)

    return damage


def edited(name: str, edit: Callable[[dict], object]) -> Callable[[Path], None]:
    """Damage: the JSON file `name` changed by `edit` (which changes it in place, or returns what replaces it)."""

    def damage(run: Path) -> None:
        value = json.loads((run / name).read_text())
        changed = edit(value)
        (run / name).write_text(json.dumps(value if changed is None else changed))

    return damage


def set_in(path: str, value: object) -> Callable[[dict], None]:
    """An `edited` edit: the entry at dotted `path` (`clients.1.train`) set to `value` (`DELETE`: removed)."""

    def edit(record: dict) -> None:
        *parents, last = path.split(".")
        for key in parents:
            record = record[int(key)] if isinstance(record, list) else record[key]
        if value is DELETE:
            del record[int(last) if isinstance(record, list) else last]
        else:
            record[int(last) if isinstance(record, list) else last] = value

    return edit


DELETE = object()


def copied_from_lora(name: str) -> Callable[[Path], None]:
    """Damage: the adapter directory `name` replaced by the LoRA run's (an adapter of another kind)."""

    def damage(run: Path) -> None:
        lora = run.parent.parent / "lora"  # see `damaged_copy`
        shutil.rmtree(run / name)
        shutil.copytree(lora / name, run / name)

    return damage


def reshaped_adapter(name: str) -> Callable[[Path], None]:
    """Damage: an adapter whose first tensor has another shape, as an adapter of a wider backbone has."""

    def damage(run: Path) -> None:
        path = run / name / "adapter_model.safetensors"
        tensors = load_file(str(path))
        first = sorted(tensors)[0]
        tensors[first] = torch.zeros(2 * tensors[first].shape[0], *tensors[first].shape[1:])
        save_file(tensors, str(path), metadata={"format": "pt"})

    return damage


def checkpoint_rewritten(change: Callable[[dict, dict], dict[str, str] | None]) -> Callable[[Path], None]:
    """Damage: the checkpoint written again with `change(tensors, metadata)` applied (it returns the metadata to
    write, or None for none at all)."""

    def damage(run: Path) -> None:
        path = run / CHECKPOINT
        with safe_open(str(path), framework="pt") as handle:
            metadata = dict(handle.metadata())
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
        save_file(tensors, str(path), metadata=change(tensors, metadata))

    return damage


def metadata_as(text: str) -> Callable[[dict, dict], dict[str, str]]:
    return lambda tensors, metadata: {"peradapt": text}


def global_tensor(change: Callable[[dict[str, torch.Tensor], str], None]) -> Callable[[dict, dict], dict[str, str]]:
    def rewrite(tensors: dict, metadata: dict) -> dict[str, str]:
        change(tensors, sorted(name for name in tensors if name.startswith("global/"))[0])
        return metadata

    return rewrite


def added_tensor(name: str) -> Callable[[dict, dict], dict[str, str]]:
    def rewrite(tensors: dict, metadata: dict) -> dict[str, str]:
        tensors[name] = torch.zeros(3)
        return metadata

    return rewrite


# ---------------------------------------------------------------- commands


def command(name: str, run: Path, tmp_path: Path, fmnist_dir: Path) -> list[str]:
    if name == "compare":  # compare finds the run as its perada-seed0 and reads its files
        train = run_args(fmnist_dir, run)[1:]
        flags = [flag for index, flag in enumerate(train) if "--out" not in (flag, train[index - 1])]
        return ["compare", "--methods", "perada", "--seeds", "1", "--out", str(run.parent), *flags]
    return {
        "info": ["info", "--run", str(run)],
        "eval": ["eval", "--run", str(run)],
        "ood": ["eval", "--run", str(run), "--ood", "fmnist-c", "--ood-limit", "2"],
        "export": ["export", "--run", str(run), "--out", str(tmp_path / "exported")],
        "report": ["report", str(run)],
        "personalize": ["personalize", "--run", str(run), "--new-client", HELD_OUT],
        "resume": ["train", "--out", str(run), "--resume"],
    }[name]


def damaged_copy(runs: dict[str, Path], kind: str, tmp_path: Path, damage: Callable[[Path], None]) -> Path:
    """A copy of the `kind` run, damaged; it lies at TMP/compare/perada-seed0 (where `compare` looks for it), next
    to a copy of the LoRA run (where `copied_from_lora` takes adapters)."""
    run = tmp_path / "compare" / "perada-seed0"
    shutil.copytree(runs[kind], run)
    shutil.copytree(runs["lora"], tmp_path / "lora")
    damage(run)
    return run


CONFIG_ADVICE = "start a new run with the settings it was trained with"
PARTITION_ADVICE = "start a new run with the settings in"
REPORT_ADVICE = "--resume`, which redoes the final evaluation and export"
METRICS_ADVICE = "write it again from the run's newest checkpoint"
ADAPTER_ADVICE = "export the run's adapters again with `peradapt train --out"
CHECKPOINT_ADVICE = "to redo the run from round 1"

# (case, run, damage, command, what the one error line says besides the run's path)
CASES = [
    ("config-truncated", "memory", truncated("config.json"), "info", ["config.json", "not JSON", CONFIG_ADVICE]),
    ("config-list", "memory", replaced("config.json", b"[]"), "eval", ["config.json", "a list", CONFIG_ADVICE]),
    ("config-null", "memory", replaced("config.json", b"null"), "export", ["config.json", "null", CONFIG_ADVICE]),
    ("config-number", "memory", replaced("config.json", b"5"), "report", ["config.json", "number 5", CONFIG_ADVICE]),
    ("config-config-5", "memory", edited("config.json", lambda c: {"config": 5}), "personalize", ["config.json"]),
    (
        "config-rounds-x",
        "memory",
        edited("config.json", set_in("config.federation.rounds", "x")),
        "resume",
        ["config.json", "'rounds'", "'x'", CONFIG_ADVICE],
    ),
    (
        "config-lr-bool",
        "memory",
        edited("config.json", set_in("config.method.lr", True)),
        "ood",
        ["config.json", "'lr'", CONFIG_ADVICE],
    ),
    (
        "config-section-missing",
        "memory",
        edited("config.json", set_in("config.method", DELETE)),
        "eval",
        ["config.json", "'method'", CONFIG_ADVICE],
    ),
    (
        "config-section-list",
        "memory",
        edited("config.json", set_in("config.data", [])),
        "info",
        ["config.json", "'data'", CONFIG_ADVICE],
    ),
    (
        "config-not-utf8",
        "memory",
        replaced("config.json", b'{"config": "\xff\xfe"}'),
        "info",
        ["config.json", "not UTF-8", CONFIG_ADVICE],
    ),
    (
        "config-resolved-list",
        "memory",
        edited("config.json", set_in("resolved", [])),
        "info",
        ["config.json", "resolved", CONFIG_ADVICE],
    ),
    (
        "config-resolved-counts",
        "memory",
        edited("config.json", set_in("resolved.trainable_parameters", "many")),
        "info",
        ["config.json", "resolved.trainable_parameters", CONFIG_ADVICE],
    ),
    ("config-compare", "memory", truncated("config.json"), "compare", ["config.json", CONFIG_ADVICE]),
    ("partition-truncated", "memory", truncated("partition.json"), "info", ["partition.json", PARTITION_ADVICE]),
    ("partition-list", "memory", replaced("partition.json", b"[]"), "eval", ["partition.json", PARTITION_ADVICE]),
    ("partition-null", "memory", replaced("partition.json", b"null"), "personalize", ["partition.json"]),
    ("partition-number", "memory", replaced("partition.json", b"7"), "resume", ["partition.json", PARTITION_ADVICE]),
    ("partition-not-utf8", "memory", replaced("partition.json", b"\xff\x00"), "export", ["partition.json"]),
    (
        "partition-clients-string",
        "memory",
        edited("partition.json", set_in("clients", "x")),
        "info",
        ["partition.json", "clients", PARTITION_ADVICE],
    ),
    (
        "partition-client-without-train",
        "memory",
        edited("partition.json", set_in("clients.1.train", DELETE)),
        "eval",
        ["partition.json", 'clients[1] has no "train"', PARTITION_ADVICE],
    ),
    (
        "partition-index-string",
        "memory",
        edited("partition.json", set_in("clients.0.test.2", "7")),
        "resume",
        ["partition.json", "clients[0].test[2]", PARTITION_ADVICE],
    ),
    (
        "partition-histogram",
        "memory",
        edited("partition.json", set_in("clients.2.train_histogram", [1, 2])),
        "info",
        ["partition.json", "clients[2].train_histogram", PARTITION_ADVICE],
    ),
    (
        "partition-client-missing",
        "memory",
        edited("partition.json", set_in("clients.3", DELETE)),
        "export",
        ["partition.json", "3 clients", PARTITION_ADVICE],
    ),
    (
        "partition-spec-missing",
        "memory",
        edited("partition.json", set_in("spec", DELETE)),
        "info",
        ["partition.json", '"spec"', PARTITION_ADVICE],
    ),
    ("report-truncated", "memory", truncated("report.json"), "info", ["report.json", REPORT_ADVICE]),
    ("report-list", "memory", replaced("report.json", b"[1]"), "report", ["report.json", REPORT_ADVICE]),
    ("report-null", "memory", replaced("report.json", b"null"), "info", ["report.json", REPORT_ADVICE]),
    ("report-number", "memory", replaced("report.json", b"3"), "compare", ["report.json", REPORT_ADVICE]),
    (
        "report-per-client",
        "memory",
        edited("report.json", set_in("personalized.local_test.per_client", "x")),
        "report",
        ["report.json", "personalized.local_test.per_client", REPORT_ADVICE],
    ),
    (
        "report-clients-missing",
        "memory",
        edited("report.json", set_in("clients", DELETE)),
        "report",
        ["report.json", '"clients"', REPORT_ADVICE],
    ),
    (
        "report-rounds-string",
        "memory",
        edited("report.json", set_in("rounds", "1")),
        "report",
        ["report.json", "rounds", REPORT_ADVICE],
    ),
    (
        "metrics-binary",
        "memory",
        replaced("metrics.jsonl", b"\x00\xff\xfe\x9c garbage"),
        "report",
        ["metrics.jsonl", "not UTF-8", METRICS_ADVICE],
    ),
    (
        "metrics-not-a-record",
        "memory",
        replaced("metrics.jsonl", b'5\n{"round": 1}\n'),
        "report",
        ["metrics.jsonl", "line 1", METRICS_ADVICE],
    ),
    ("metrics-truncated-line", "memory", truncated("metrics.jsonl"), "report", ["metrics.jsonl", METRICS_ADVICE]),
    (
        "metrics-round-string",
        "memory",
        replaced("metrics.jsonl", b'{"round": "one"}\n'),
        "report",
        ["metrics.jsonl", "line 1.round", METRICS_ADVICE],
    ),
    (
        "adapter-client-lora",
        "memory",
        copied_from_lora("clients/1"),
        "eval",
        ["clients/1/adapter_config.json", "another adapter", ADAPTER_ADVICE],
    ),
    (
        "adapter-global-lora",
        "memory",
        copied_from_lora("global"),
        "personalize",
        ["global/adapter_config.json", ADAPTER_ADVICE],
    ),
    ("adapter-global-lora-ood", "memory", copied_from_lora("global"), "ood", ["global/", ADAPTER_ADVICE]),
    ("adapter-client-lora-export", "memory", copied_from_lora("clients/2"), "export", ["clients/2/", ADAPTER_ADVICE]),
    (
        "adapter-lora-weights-only",
        "memory",
        lambda run: shutil.copy(run.parent.parent / "lora/clients/1/adapter_model.safetensors", run / "clients/1"),
        "eval",
        ["clients/1/adapter_model.safetensors", "another kind", ADAPTER_ADVICE],
    ),
    (
        "adapter-truncated",
        "memory",
        truncated("clients/1/adapter_model.safetensors"),
        "eval",
        ["clients/1/adapter_model.safetensors", ADAPTER_ADVICE],
    ),
    (
        "adapter-truncated-export",
        "memory",
        truncated("clients/0/adapter_model.safetensors"),
        "export",
        ["clients/0/adapter_model.safetensors", ADAPTER_ADVICE],
    ),
    (
        "adapter-reshaped",
        "memory",
        reshaped_adapter("clients/2"),
        "eval",
        ["clients/2/adapter_model.safetensors", "shape", ADAPTER_ADVICE],
    ),
    (
        "adapter-reshaped-export",
        "memory",
        reshaped_adapter("clients/2"),
        "export",
        ["clients/2/adapter_model.safetensors", ADAPTER_ADVICE],
    ),
    (
        "adapter-config-garbage-export",
        "memory",
        replaced("clients/1/adapter_config.json", b"garbage"),
        "export",
        ["clients/1/adapter_config.json", ADAPTER_ADVICE],
    ),
    (
        "adapter-config-garbage-eval",
        "memory",
        replaced("global/adapter_config.json", b"\xff"),
        "eval",
        ["global/adapter_config.json", ADAPTER_ADVICE],
    ),
    (
        "adapter-config-list",
        "memory",
        replaced("clients/0/adapter_config.json", b"[]"),
        "eval",
        ["clients/0/adapter_config.json", ADAPTER_ADVICE],
    ),
    ("checkpoint-truncated", "memory", truncated(CHECKPOINT), "resume", [CHECKPOINT, CHECKPOINT_ADVICE]),
    ("checkpoint-empty", "disk", replaced(CHECKPOINT, b""), "resume", [CHECKPOINT, CHECKPOINT_ADVICE]),
    (
        "checkpoint-no-metadata",
        "memory",
        checkpoint_rewritten(lambda tensors, metadata: None),
        "resume",
        [CHECKPOINT, "metadata", CHECKPOINT_ADVICE],
    ),
    (
        "checkpoint-metadata-not-json",
        "memory",
        checkpoint_rewritten(metadata_as("{'metrics'")),
        "resume",
        [CHECKPOINT, "not JSON", CHECKPOINT_ADVICE],
    ),
    (
        "checkpoint-metrics-number",
        "memory",
        checkpoint_rewritten(metadata_as('{"metrics": 5}')),
        "resume",
        [CHECKPOINT, "metadata.metrics", CHECKPOINT_ADVICE],
    ),
    (
        "checkpoint-metrics-not-records",
        "memory",
        checkpoint_rewritten(metadata_as('{"metrics": [1]}')),
        "resume",
        [CHECKPOINT, "metadata.metrics[0]", CHECKPOINT_ADVICE],
    ),
    (
        "checkpoint-metrics-count",
        "memory",
        checkpoint_rewritten(metadata_as('{"metrics": []}')),
        "resume",
        [CHECKPOINT, "0 rounds", CHECKPOINT_ADVICE],
    ),
    (
        "checkpoint-global-reshaped",
        "memory",
        checkpoint_rewritten(global_tensor(lambda tensors, name: tensors.update({name: torch.zeros(7)}))),
        "resume",
        [CHECKPOINT, "global adapter", CHECKPOINT_ADVICE],
    ),
    (
        "checkpoint-global-missing",
        "disk",
        checkpoint_rewritten(global_tensor(lambda tensors, name: tensors.pop(name))),
        "resume",
        [CHECKPOINT, "global adapter", CHECKPOINT_ADVICE],
    ),
    (
        "checkpoint-server-foreign",
        "memory",
        checkpoint_rewritten(added_tensor("server/omega")),
        "resume",
        [CHECKPOINT, "server state", CHECKPOINT_ADVICE],
    ),
    (
        "checkpoint-unknown-tensor",
        "memory",
        checkpoint_rewritten(added_tensor("weights")),
        "resume",
        [CHECKPOINT, "'weights'", CHECKPOINT_ADVICE],
    ),
    (
        "store-truncated",
        "disk",
        truncated("client_store/0.personal.r00001.safetensors"),
        "resume",
        ["client_store/0.personal.r00001.safetensors", "client_store and", CHECKPOINT_ADVICE],
    ),
    (
        "store-directory",
        "disk",
        lambda run: (run / "client_store" / "notes").mkdir(),
        "resume",
        ["client_store/notes", "is a directory", "move it out"],
    ),
]


@pytest.mark.parametrize(
    ("kind", "damage", "name", "needles"), [case[1:] for case in CASES], ids=[case[0] for case in CASES]
)
def test_a_damaged_file_is_one_error_line_naming_it_and_nothing_is_written(
    kind, damage, name, needles, runs, tmp_path, fmnist_dir, capsys, monkeypatch, home
):
    run = damaged_copy(runs, kind, tmp_path, damage)
    args = command(name, run, tmp_path, fmnist_dir)
    expect_refusal(args, capsys, monkeypatch, *needles, untouched=run)
    assert not (tmp_path / "exported").exists()  # export refused before writing its output


# ---------------------------------------------------------------- the advice works


def expect_resume_restores(run: Path, original: Path, capsys, monkeypatch) -> None:
    """`peradapt train --out RUN --resume` succeeds and leaves the results of the undamaged run."""
    code, _, err = run_cli(["train", "--out", str(run), "--resume"], capsys, monkeypatch)
    assert code == 0, err
    assert results(run) == results(original)


def test_resume_writes_damaged_results_again(runs, tmp_path, capsys, monkeypatch, home):
    """report.json, metrics.jsonl and the exported adapters come back as they were from `--resume` of a finished
    run, which redoes the final evaluation and export (and writes metrics.jsonl from the checkpoint)."""
    run = damaged_copy(runs, "memory", tmp_path, truncated("report.json"))
    for damage in (
        truncated("metrics.jsonl"),
        copied_from_lora("clients/1"),
        truncated("global/adapter_model.safetensors"),
        replaced("clients/2/adapter_config.json", b"garbage"),
    ):
        damage(run)
    expect_resume_restores(run, runs["memory"], capsys, monkeypatch)
    monkeypatch.chdir(tmp_path)
    for args in (["report", str(run)], ["eval", "--run", str(run)], ["export", "--run", str(run), "--out", "x"]):
        code, _, err = run_cli(args, capsys, monkeypatch)
        assert code == 0, err


def test_a_run_without_its_checkpoint_is_redone_from_round_1_to_the_same_results(
    runs, tmp_path, capsys, monkeypatch, home
):
    """The advice for a damaged checkpoint: delete it and resume, which redoes every round (a disk store's too: see
    the next test)."""
    run = copy_of(runs, "memory", tmp_path)
    (run / CHECKPOINT).write_bytes(b"")
    err = expect_refusal(["train", "--out", str(run), "--resume"], capsys, monkeypatch, CHECKPOINT, untouched=run)
    assert f"delete {run / 'checkpoints'} and run `peradapt train --out {run} --resume`" in err
    shutil.rmtree(run / "checkpoints")
    expect_resume_restores(run, runs["memory"], capsys, monkeypatch)


def test_a_truncated_client_store_file_is_redone_from_round_1_as_advised(runs, tmp_path, capsys, monkeypatch, home):
    run = copy_of(runs, "disk", tmp_path)
    truncated("client_store/2.personal.r00001.safetensors")(run)
    err = expect_refusal(["train", "--out", str(run), "--resume"], capsys, monkeypatch, untouched=run)
    assert f"delete {run / 'client_store'} and {run / 'checkpoints'} and run" in err
    shutil.rmtree(run / "client_store")
    shutil.rmtree(run / "checkpoints")
    expect_resume_restores(run, runs["disk"], capsys, monkeypatch)


def test_a_directory_in_the_client_store_is_kept_and_a_foreign_file_deleted(runs, tmp_path, capsys, monkeypatch, home):
    """The client store's directory belongs to the store: a stray file there goes on --resume (as interrupted
    writes do), a directory is never deleted but refused until it is moved out."""
    run = copy_of(runs, "disk", tmp_path)
    (run / "client_store" / "notes").mkdir()
    (run / "client_store" / "notes" / "mine.txt").write_text("keep me")
    (run / "client_store" / "stray.bin").write_bytes(b"x")
    expect_refusal(["train", "--out", str(run), "--resume"], capsys, monkeypatch, "notes", untouched=run)
    (run / "client_store" / "notes").rename(tmp_path / "notes")
    expect_resume_restores(run, runs["disk"], capsys, monkeypatch)
    assert not (run / "client_store" / "stray.bin").exists()
    assert (tmp_path / "notes" / "mine.txt").read_text() == "keep me"


def test_a_new_run_with_the_same_settings_gives_the_same_partition(
    runs, tmp_path, fmnist_dir, capsys, monkeypatch, home
):
    """The advice for a damaged partition.json: a new run with the run's settings and another --out."""
    run = copy_of(runs, "memory", tmp_path)
    (run / "partition.json").write_text("{")
    expect_refusal(["eval", "--run", str(run)], capsys, monkeypatch, PARTITION_ADVICE, untouched=run)
    code, _, err = run_cli(run_args(fmnist_dir, tmp_path / "again"), capsys, monkeypatch)
    assert code == 0, err
    assert (tmp_path / "again" / "partition.json").read_bytes() == (runs["memory"] / "partition.json").read_bytes()


def test_a_stale_older_checkpoint_is_deleted_once_the_newest_loads(runs, tmp_path, capsys, monkeypatch, home):
    """A run killed between writing a checkpoint and deleting the one before leaves both: --resume continues from
    the newest and deletes the older (here not even a checkpoint any more)."""
    run = copy_of(runs, "memory", tmp_path)
    stale = run / "checkpoints" / "round-00000.safetensors"
    stale.write_bytes(b"stale")
    expect_resume_restores(run, runs["memory"], capsys, monkeypatch)
    assert not stale.exists()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["round-00001.safetensors"]


def test_a_client_state_damaged_after_restore_is_a_run_error(runs, tmp_path):
    """A state file that goes bad while a run is under way (after `restore` checked it) is refused when read."""
    store = DiskClientStore(copy_of(runs, "disk", tmp_path) / "client_store")
    store.restore({}, 1)
    assert store.get(0, "personal") is not None
    path = store.path(0, "personal", 1)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(RunError, match=r"0\.personal\.r00001\.safetensors is damaged"):
        store.get(0, "personal")
