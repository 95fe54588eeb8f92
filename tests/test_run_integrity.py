"""A run directory is one consistent thing: its own backbone, one writer, no mixed rounds, Ctrl-C a clean stop.

Run directories here have brackets and slashes in their names ('r[/i]'): every message that quotes them must print
them as they are.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

import peradapt.federation.clients as client_side
import peradapt.federation.rounds as rounds
from peradapt.errors import ConfigError, DataError, Interrupted, RunError, TrainingDiverged, WeightsError
from peradapt.rundir.lock import RunLock, deferred_interrupts

from .conftest import TINY_BACKBONE, thread_environment
from .test_cli import crash_after_round, expect_refusal, results, run_cli, run_main, snapshot, tiny_args

pytestmark = pytest.mark.usefixtures("one_thread")

ODD_NAME = "r[/i] [red]x"  # rich markup, were it read as such


@pytest.fixture(scope="module")
def two_rounds(tmp_path_factory, pretrained_home, fmnist_dir) -> Path:
    """A finished 2-round run, copied by the tests that change it."""
    run = tmp_path_factory.mktemp("runs") / ODD_NAME
    run_main(tiny_args(fmnist_dir, run, "--rounds", "2"), pretrained_home)
    return run


@pytest.fixture(scope="module")
def three_rounds(tmp_path_factory, pretrained_home, fmnist_dir) -> Path:
    run = tmp_path_factory.mktemp("runs") / "three"
    run_main(tiny_args(fmnist_dir, run), pretrained_home)
    return run


def copy_of(run: Path, tmp_path: Path) -> Path:
    target = tmp_path / run.name
    shutil.copytree(run, target)
    return target


# ---------------------------------------------------------------- the backbone is the run's


@pytest.fixture
def own_home(pretrained_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A PERADAPT_HOME of the test's own (a copy of the pretrained one), which it may pretrain into."""
    home = tmp_path / "home"
    shutil.copytree(pretrained_home, home)
    monkeypatch.setenv("PERADAPT_HOME", str(home))
    return home


def test_pretrain_replacing_the_weights_leaves_runs_on_their_own(own_home, tmp_path, fmnist_dir, capsys, monkeypatch):
    run = tmp_path / ODD_NAME
    code, _, err = run_cli(tiny_args(fmnist_dir, run, "--rounds", "1"), capsys, monkeypatch)
    assert code == 0, err
    fingerprint = json.loads((run / "config.json").read_text())["resolved"]["backbone_sha256"]
    pinned = own_home / "backbones" / "sha256" / f"{fingerprint}.safetensors"
    stored = own_home / "backbones" / f"fmnist-{TINY_BACKBONE}.safetensors"
    assert load_file(pinned).keys() == load_file(stored).keys()
    code, _, err = run_cli(["eval", "--run", str(run)], capsys, monkeypatch)
    assert code == 0, err
    before = (run / "eval.json").read_bytes()

    # Other weights in the store, as a new `pretrain` leaves them; it says the runs keep theirs.
    args = ["pretrain", "--data", "fmnist", "--backbone", TINY_BACKBONE, "--epochs", "1", "--seed", "5"]
    code, out, err = run_cli([*args, "--data-dir", str(fmnist_dir), "--limit-samples", "600"], capsys, monkeypatch)
    assert code == 0, err
    assert "replaces" in out and "keep using them" in out
    assert load_file(stored)["conv1.weight"].ne(load_file(pinned)["conv1.weight"]).any()

    (run / "eval.json").unlink()
    code, _, err = run_cli(["eval", "--run", str(run)], capsys, monkeypatch)
    assert code == 0, err
    assert (run / "eval.json").read_bytes() == before  # the run's own backbone, not the new one
    exported = tmp_path / "export"
    code, _, err = run_cli(["export", "--run", str(run), "--out", str(exported)], capsys, monkeypatch)
    assert code == 0, err
    shipped = load_file(exported / "backbone.safetensors")
    assert shipped["conv1.weight"].equal(load_file(pinned)["conv1.weight"])

    # Without the pinned copy, the store's new weights are refused, naming the fingerprints; nothing is written.
    pinned.unlink()
    for command in (["eval", "--run", str(run)], ["train", "--out", str(run), "--resume", "--rounds", "2"]):
        expect_refusal(command, capsys, monkeypatch, "neither them nor the run's copy", fingerprint[:12], untouched=run)


# ---------------------------------------------------------------- one process at a time


def test_a_run_directory_in_use_is_refused(two_rounds, tmp_path, fmnist_dir, capsys, monkeypatch, home):
    new = tmp_path / "new"
    new.mkdir()
    with RunLock(new, exclusive=True):  # another `train` writing it, not yet as far as config.json
        expect_refusal(tiny_args(fmnist_dir, new), capsys, monkeypatch, "in use", "--out", untouched=new)
    run = copy_of(two_rounds, tmp_path)
    with RunLock(run, exclusive=True):
        expect_refusal(["eval", "--run", str(run)], capsys, monkeypatch, "being written", untouched=run)
        expect_refusal(
            ["export", "--run", str(run), "--out", str(tmp_path / "x")],
            capsys,
            monkeypatch,
            "being written",
            untouched=tmp_path / "x",
        )
    with RunLock(run, exclusive=False):  # an `eval` reading it
        expect_refusal(
            tiny_args(fmnist_dir, run, "--resume", "--rounds", "3"), capsys, monkeypatch, "in use", untouched=run
        )
    code, _, err = run_cli(["eval", "--run", str(run)], capsys, monkeypatch)  # free again
    assert code == 0, err


def test_report_refuses_a_run_that_a_train_is_writing(two_rounds, tmp_path, capsys, monkeypatch):
    finished = copy_of(two_rounds, tmp_path)
    writing = tmp_path / "writing" / ODD_NAME
    shutil.copytree(two_rounds, writing)
    (writing / "report.json").unlink()  # a train still in its rounds: no report.json yet
    reports = tmp_path / "reports"
    kept = snapshot(finished)
    with RunLock(writing, exclusive=True):
        # What eval, export and personalize say of it, not to --resume it: the train is running.
        err = expect_refusal(
            ["report", str(writing)], capsys, monkeypatch, f"{writing} is being written", untouched=writing
        )
        assert err.strip().endswith("wait for it to end") and "--resume" not in err, err
        # Among other runs: nothing is written, in --out or in the finished run.
        args = ["report", str(finished), str(writing), "--out", str(reports)]
        expect_refusal(args, capsys, monkeypatch, "being written", untouched=reports)
        assert snapshot(finished) == kept
    with RunLock(finished, exclusive=True):  # a finished run that a `train --resume` is rewriting
        expect_refusal(["report", str(finished)], capsys, monkeypatch, "being written", untouched=finished)
    with RunLock(finished, exclusive=False):  # an eval reading it: readers share a run
        code, _, err = run_cli(["report", str(finished), "--out", str(reports)], capsys, monkeypatch)
        assert code == 0, err
    # No train holds it any longer: a run stopped before its end is finished with --resume.
    expect_refusal(["report", str(writing)], capsys, monkeypatch, "has not finished", "--resume", untouched=writing)


# ---------------------------------------------------------------- rounds are never relabelled


def test_resume_with_fewer_rounds_than_done_is_refused(two_rounds, tmp_path, fmnist_dir, capsys, monkeypatch, home):
    run = copy_of(two_rounds, tmp_path)
    expect_refusal(
        tiny_args(fmnist_dir, run, "--resume", "--rounds", "1"),
        capsys,
        monkeypatch,
        "has done 2 rounds",
        "--rounds 2 or more",
        untouched=run,
    )
    code, _, err = run_cli(tiny_args(fmnist_dir, run, "--resume", "--rounds", "2"), capsys, monkeypatch)  # the advice
    assert code == 0, err
    assert results(run) == results(two_rounds)


def test_extending_a_finished_run_killed_in_its_export_is_refused_then_completed(
    two_rounds, three_rounds, tmp_path, fmnist_dir, capsys, monkeypatch, home
):
    run = copy_of(two_rounds, tmp_path)
    exporting = rounds.exporting

    def export_one_then_die(model, personalized, directory):
        export = exporting(model, personalized, directory)

        def first_only(client_id):
            if client_id > 0:
                raise SystemExit(137)  # as a kill: no clean-up runs in the engine but `finally`s
            return export(client_id)

        return first_only

    monkeypatch.setattr(rounds, "exporting", export_one_then_die)
    code, _, _ = run_cli(tiny_args(fmnist_dir, run, "--resume", "--rounds", "3"), capsys, monkeypatch)
    assert code == 137
    monkeypatch.setattr(rounds, "exporting", exporting)
    # clients/0 holds round 3, clients/1-3 round 2: no command may take this for a finished run.
    assert not (run / "report.json").exists()
    for command in (["eval", "--run", str(run)], ["export", "--run", str(run), "--out", str(tmp_path / "x")]):
        expect_refusal(command, capsys, monkeypatch, "not finished", f"--out {run} --resume", untouched=run)
    code, _, err = run_cli(["report", str(run)], capsys, monkeypatch)
    assert code == 2 and "not finished" in err, err

    code, _, err = run_cli(tiny_args(fmnist_dir, run, "--resume", "--rounds", "3"), capsys, monkeypatch)
    assert code == 0, err
    assert results(run) == results(three_rounds)  # as if it had been a 3-round run all along


# ---------------------------------------------------------------- failures and Ctrl-C


def interrupt_in_round(round_number: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while round `round_number` trains its clients (after the checkpoint of the round before)."""
    play = client_side.play_client

    def play_or_interrupt(session, client_id, payload, round_index, share=1.0):
        if round_index + 1 == round_number:
            raise KeyboardInterrupt
        return play(session, client_id, payload, round_index, share)

    monkeypatch.setattr(client_side, "play_client", play_or_interrupt)


def test_ctrl_c_says_how_to_resume_and_the_advice_works(three_rounds, tmp_path, fmnist_dir, capsys, monkeypatch, home):
    run = tmp_path / ODD_NAME
    with monkeypatch.context() as patch:
        interrupt_in_round(2, patch)
        code, _, err = run_cli(tiny_args(fmnist_dir, run), capsys, monkeypatch)
    assert code == 130
    assert err.strip().splitlines()[-1] == (
        f"interrupted: {run} holds rounds 1-1: continue it with `peradapt train --out {run} --resume`"
    )
    assert "Traceback" not in err
    command = err.strip().rpartition("`peradapt ")[2].rstrip("`").split(" ")
    assert command[:2] == ["train", "--out"] and command[-1] == "--resume"
    code, _, err = run_cli(tiny_args(fmnist_dir, run, "--resume"), capsys, monkeypatch)
    assert code == 0, err
    assert results(run) == results(three_rounds)


def test_ctrl_c_or_a_failure_in_round_1_of_a_new_run_leaves_nothing(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    run = tmp_path / ODD_NAME
    with monkeypatch.context() as patch:
        interrupt_in_round(1, patch)
        code, _, err = run_cli(tiny_args(fmnist_dir, run), capsys, monkeypatch)
    assert code == 130 and "nothing of it was kept" in err, err
    assert not run.exists()

    def diverge(*args, **kwargs):
        raise TrainingDiverged("the local loss became nan: lower --lr")

    existing = tmp_path / "existing"  # a directory the user made: emptied of the run, kept
    existing.mkdir()
    with monkeypatch.context() as patch:
        patch.setattr(client_side, "play_client", diverge)
        expect_refusal(tiny_args(fmnist_dir, run), capsys, monkeypatch, "--lr", untouched=run)
        expect_refusal(tiny_args(fmnist_dir, existing), capsys, monkeypatch, "--lr", untouched=existing)


def test_a_failure_after_round_1_leaves_a_run_that_resumes(
    three_rounds, tmp_path, fmnist_dir, capsys, monkeypatch, home
):
    run = tmp_path / "failed"
    crash_after_round(2, tiny_args(fmnist_dir, run), capsys, monkeypatch)
    assert (run / "checkpoints" / "round-00002.safetensors").is_file()
    code, _, err = run_cli(tiny_args(fmnist_dir, run, "--resume"), capsys, monkeypatch)
    assert code == 0, err
    assert results(run) == results(three_rounds)


def test_ctrl_c_outside_a_run_exits_130(two_rounds, capsys, monkeypatch, home):
    import peradapt.commands.finished_run

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(peradapt.commands.finished_run, "evaluate_run", interrupted)
    code, _, err = run_cli(["eval", "--run", str(two_rounds)], capsys, monkeypatch)
    assert code == 130 and "interrupted" in err and "Traceback" not in err


def test_sigint_to_a_real_training_stops_it_resumably(three_rounds, tmp_path, fmnist_dir, home):
    """The signal itself, in another process: exit 130, the advice printed, and following it ends the run."""
    run = tmp_path / "signalled"
    command = [sys.executable, "-c", "from peradapt.cli import main; main()", *tiny_args(fmnist_dir, run)]
    # this module's one thread, as its in-process runs (sums in another order differ in their last bits)
    environment = {**os.environ, "PERADAPT_HOME": str(home), **thread_environment()}
    process = subprocess.Popen(command, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (run / "checkpoints" / "round-00001.safetensors").exists() and process.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=300)
    if process.returncode == 0:  # the signal came after the last round: nothing to resume
        pytest.skip("the run ended before the signal arrived")
    assert process.returncode == 130, err
    assert f"continue it with `peradapt train --out {run} --resume`" in err and "Traceback" not in err
    resumed = subprocess.run(
        [*command, "--resume"], env=environment, capture_output=True, text=True, timeout=300, check=False
    )
    assert resumed.returncode == 0, resumed.stderr
    assert results(run) == results(three_rounds)


def test_interrupts_wait_for_the_end_of_a_protected_block():
    with pytest.raises(KeyboardInterrupt), deferred_interrupts():
        os.kill(os.getpid(), signal.SIGINT)
        written = True  # reached: the signal did not stop the block
    assert written


# ---------------------------------------------------------------- messages are text


@pytest.mark.parametrize("error", [ConfigError, DataError, WeightsError, RunError, TrainingDiverged, Interrupted])
def test_every_message_class_prints_brackets_and_slashes_verbatim(error, capsys, monkeypatch, home, tmp_path):
    import peradapt.commands.finished_run

    message = "w[/b] [red]x[/red] [bold] \\[y] a/b"

    def fail(*args, **kwargs):
        raise error(message)

    monkeypatch.setattr(peradapt.commands.finished_run, "evaluate_run", fail)
    code, _, err = run_cli(["eval", "--run", str(tmp_path)], capsys, monkeypatch)
    assert code == (130 if error is Interrupted else 2)
    assert err.strip().splitlines()[-1].endswith(message), err
    assert "Traceback" not in err
