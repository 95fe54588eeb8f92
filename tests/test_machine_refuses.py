"""When the machine says no (issue 27): a read-only place, a full disk, a tracker server that does not answer, Ctrl-C
while the command starts. Each is one `error:` line naming the place and the remedy, exit 2 (Ctrl-C: 130), never a
traceback; and a new run that fails before its first checkpoint leaves nothing.

Read-only and full places are real: a small tmpfs, remounted read-only where needed (root cannot be kept out by
chmod). Where this process cannot mount (not root, no CAP_SYS_ADMIN), those tests are skipped. A full disk in the
middle of the final export, which a tmpfs cannot aim at, is a patched write that raises ENOSPC.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

import peradapt
from peradapt.errors import MachineError
from tests.conftest import TINY_BACKBONE
from tests.test_cli import results, run_cli, run_main

pytestmark = pytest.mark.usefixtures("one_thread")

Mount = Callable[..., Path]


def small_args(fmnist_dir: Path, out: Path, *extra: str) -> list[str]:
    """A tiny PerAda run of two rounds: three clients, the last held out for `personalize`."""
    return [
        "train",
        *("--data", "fmnist", "--data-dir", str(fmnist_dir), "--backbone", TINY_BACKBONE, "--limit-samples", "400"),
        *("--clients", "3", "--holdout-clients", "1", "--clients-per-round", "2", "--rounds", "2"),
        *("--partition", "dir:0.5", "--local-epochs", "1", "--personal-epochs", "1", "--lr", "0.05"),
        *("--batch-size", "32", "--kd-steps", "2", "--kd-batch-size", "32", "--eval-every", "0", "--device", "cpu"),
        *("--out", str(out)),
        *extra,
    ]


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory, pretrained_home: Path, fmnist_dir: Path) -> Path:
    run = tmp_path_factory.mktemp("runs") / "finished"
    run_main(small_args(fmnist_dir, run), pretrained_home)
    return run


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Mount]:
    """`tmpfs(path, size="1m", copy=None, read_only=False)`: a tmpfs of `size` at `path`, holding a copy of the
    directory `copy`, remounted read-only if asked; unmounted after the test."""
    mounted: list[Path] = []

    def mount(path: Path, size: str = "1m", copy: Path | None = None, read_only: bool = False) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(path)
        if copy is not None:
            shutil.copytree(copy, path, dirs_exist_ok=True)
        if read_only:
            subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
        return path

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], check=False)


def refused(args: list[str], capsys, monkeypatch, *needles: str) -> str:
    """Run `peradapt ARGS`, which must end in one `error:` line holding every needle, exit 2, no traceback."""
    code, _, err = run_cli(args, capsys, monkeypatch)
    lines = err.strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and lines[-1] == errors[0] and "Traceback" not in err, err
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


# ---------------------------------------------------------------- read-only places


def test_train_into_a_read_only_place(tmpfs, tmp_path, fmnist_dir, home, capsys, monkeypatch):
    place = tmpfs(tmp_path / "ro", read_only=True)
    refused(small_args(fmnist_dir, place / "run"), capsys, monkeypatch, f"{place / 'run'}", "read-only", "--out")
    assert not (place / "run").exists()


def test_pretrain_into_a_read_only_place(tmpfs, tmp_path, fmnist_dir, home, capsys, monkeypatch):
    place = tmpfs(tmp_path / "ro", read_only=True)
    weights = place / "weights.safetensors"
    args = ["pretrain", "--data", "fmnist", "--data-dir", str(fmnist_dir), "--backbone", TINY_BACKBONE]
    args += ["--epochs", "1", "--limit-samples", "200", "--device", "cpu", "--out", str(weights)]
    refused(args, capsys, monkeypatch, f"cannot write {weights}:", "read-only")


def test_export_and_report_into_a_read_only_place(finished, tmpfs, tmp_path, home, capsys, monkeypatch):
    place = tmpfs(tmp_path / "ro", read_only=True)
    refused(["export", "--run", str(finished), "--out", str(place / "export")], capsys, monkeypatch, str(place))
    refused(["report", str(finished), "--out", str(place / "report")], capsys, monkeypatch, str(place / "report"))
    with pytest.raises(MachineError, match="read-only"):  # the Python API: a PeradaptError
        peradapt.export(finished, place / "export")
    assert list(place.iterdir()) == []


@pytest.mark.parametrize(
    "command",
    [
        ["eval", "--run", "{run}"],
        ["report", "{run}"],
        ["personalize", "--run", "{run}", "--new-client", "2"],
        ["train", "--out", "{run}", "--resume", "--rounds", "3"],
    ],
    ids=["eval", "report", "personalize", "resume"],
)
def test_commands_on_a_read_only_run(command, finished, tmpfs, tmp_path, home, capsys, monkeypatch):
    run = tmpfs(tmp_path / "run", size="4m", copy=finished, read_only=True)
    line = refused([part.format(run=run) for part in command], capsys, monkeypatch, str(run), "read-only")
    if command[0] == "train":  # what of the run is kept, and how to go on
        assert "holds rounds 1-2" in line and "--resume" in line


def test_a_read_only_home_at_the_pinning(tmpfs, tmp_path, pretrained_home, fmnist_dir, capsys, monkeypatch):
    weights_only = tmp_path / "weights"  # the pretrained backbone, no pinned copy yet
    shutil.copytree(pretrained_home / "backbones", weights_only / "backbones", ignore=shutil.ignore_patterns("sha256"))
    home = tmpfs(tmp_path / "home", copy=weights_only, read_only=True)
    monkeypatch.setenv("PERADAPT_HOME", str(home))
    run = tmp_path / "run"
    refused(small_args(fmnist_dir, run), capsys, monkeypatch, str(home / "backbones"), "$PERADAPT_HOME", "nothing")
    assert not run.exists()


# ---------------------------------------------------------------- full disks


def test_a_full_home_at_the_pinning(tmpfs, tmp_path, pretrained_home, fmnist_dir, capsys, monkeypatch):
    home = tmpfs(tmp_path / "home", size="16k")
    monkeypatch.setenv("PERADAPT_HOME", str(home))
    weights = pretrained_home / "backbones" / f"fmnist-{TINY_BACKBONE}.safetensors"  # on another file system
    run = tmp_path / "run"
    args = small_args(fmnist_dir, run, "--weights", str(weights))
    refused(args, capsys, monkeypatch, str(home / "backbones" / "sha256"), "no space left", "nothing")
    assert not run.exists()


def full_disk_at(suffix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Writing a file whose name ends in `suffix` fails half-way as a full disk does: `write()` raises ENOSPC, an
    OSError that names no file."""
    write_text, copyfile = Path.write_text, shutil.copyfile

    def full() -> OSError:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def text(path: Path, data: str, *args, **kwargs) -> int:
        if path.name.endswith(suffix):
            write_text(path, data[: len(data) // 2], *args, **kwargs)
            raise full()
        return write_text(path, data, *args, **kwargs)

    def copy(source, target, *args, **kwargs):
        if str(source).endswith(suffix):
            Path(target).write_bytes(b"half")
            raise full()
        return copyfile(source, target, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", text)
    monkeypatch.setattr(shutil, "copyfile", copy)


def test_a_full_home_at_the_pinning_leaves_no_part_of_the_copy(
    tmp_path, pretrained_home, fmnist_dir, capsys, monkeypatch
):
    from peradapt import backbones

    home = tmp_path / "home"
    monkeypatch.setenv("PERADAPT_HOME", str(home))
    weights = pretrained_home / "backbones" / f"fmnist-{TINY_BACKBONE}.safetensors"
    run = tmp_path / "run"

    def no_link(source, target):  # another file system: the weights are copied, the description first
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(source), str(target))

    with monkeypatch.context() as patch:
        patch.setattr(backbones.os, "link", no_link)
        full_disk_at(".safetensors", patch)
        line = refused(small_args(fmnist_dir, run, "--weights", str(weights)), capsys, monkeypatch, "no space left")
    pinned = home / "backbones" / "sha256"
    assert f"cannot write {pinned}" in line and line.split(":")[1].strip().endswith(".safetensors"), line
    assert list(pinned.iterdir()) == []  # neither <fp>.tmp nor <fp>.json without its weights
    assert not run.exists()


def test_a_full_out_names_the_file_it_could_not_write(finished, tmp_path, fmnist_dir, home, capsys, monkeypatch):
    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        full_disk_at("partition.json.tmp", patch)
        line = refused(small_args(fmnist_dir, run), capsys, monkeypatch, "no space left")
    assert f"cannot write {run / 'partition.json'}: no space left" in line
    assert "a file peradapt writes" not in line
    out = tmp_path / "export"
    with monkeypatch.context() as patch:
        full_disk_at("README.md", patch)
        line = refused(["export", "--run", str(finished), "--out", str(out)], capsys, monkeypatch, "no space left")
    assert f"cannot write {out}: no space left" in line
    assert not out.exists() and list(tmp_path.glob(".export*")) == []


def test_a_full_disk_at_round_1s_checkpoint_leaves_no_run(tmpfs, tmp_path, fmnist_dir, home, capsys, monkeypatch):
    place = tmpfs(tmp_path / "full", size="48k")  # the run's record fits, its first checkpoint does not
    refused(small_args(fmnist_dir, place), capsys, monkeypatch, str(place / "checkpoints"), "no space left", "nothing")
    assert list(place.iterdir()) == []  # the directory was there before: it stays, empty


def test_export_onto_a_full_disk(finished, tmpfs, tmp_path, home, capsys, monkeypatch):
    place = tmpfs(tmp_path / "full", size="64k")  # the adapters do not fit
    refused(["export", "--run", str(finished), "--out", str(place / "export")], capsys, monkeypatch, "no space left")
    assert list(place.iterdir()) == []  # no staging directory left


def test_a_full_disk_at_the_export_of_adapters_then_resume(finished, tmp_path, fmnist_dir, home, capsys, monkeypatch):
    """ENOSPC writing the clients' adapters after the last round: one line that says how to go on, and `--resume`
    (with space again) ends with the files of the uninterrupted run."""
    from peradapt.federation import finish

    def full(directory: Path, files: dict[str, bytes]) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory / "adapter_model.safetensors"))

    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(finish, "write_files", full)
        refused(small_args(fmnist_dir, run), capsys, monkeypatch, "no space left", "holds rounds 1-2", "--resume")
    code, _, err = run_cli([*small_args(fmnist_dir, run), "--resume"], capsys, monkeypatch)
    assert code == 0, err
    assert results(run) == results(finished)


# ---------------------------------------------------------------- a dead tracker server, Ctrl-C at start


def test_a_dead_mlflow_server(tmp_path, fmnist_dir, home, capsys, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # the discard port: nothing answers
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    run = tmp_path / "run"
    refused(small_args(fmnist_dir, run, "--log", "mlflow"), capsys, monkeypatch, "--log mlflow", "nothing")
    assert not run.exists()


def test_a_tracker_server_that_dies_during_the_run(tmp_path):
    from peradapt.federation.tracking import Tracking

    class DeadServer:
        def log_round(self, record) -> None:
            raise ConnectionError("Max retries exceeded\n  (Caused by NewConnectionError: refused)")

    tracking = Tracking(tmp_path, {})
    tracking.trackers["mlflow"], tracking.rounds["mlflow"] = DeadServer(), 0
    said = r"--log mlflow could not log round 1: Max retries exceeded \(Caused"
    with pytest.raises(MachineError, match=said) as error:
        tracking.log_round(SimpleNamespace(round=1))  # a round's record, of which `Tracking` reads the number
    assert "\n" not in str(error.value)


def test_ctrl_c_while_the_command_starts():
    """SIGINT while the command imports torch (`-X importtime` tells, module by module): `peradapt methods` imports
    the methods, and torch with them, once it runs (`peradapt --help` imports neither)."""
    command = [sys.executable, "-X", "importtime", "-m", "peradapt", "methods"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert process.stderr is not None
    lines = []
    for line in process.stderr:
        lines.append(line)
        if line.split("|")[-1].strip() == "torch":
            process.send_signal(signal.SIGINT)
            break
    lines += process.stderr.readlines()
    assert process.wait(timeout=60) == 130
    told = [line for line in lines if not line.startswith("import time:")]
    assert told == ["interrupted: nothing was written\n"], "".join(told)
