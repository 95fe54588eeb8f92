"""The command line end to end on a tiny federation: train, eval, info, export, resume, and every user mistake."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import timm
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file

import peradapt.cli as cli
import peradapt.federation.rounds as rounds
from peradapt import api
from peradapt.cli import main
from peradapt.errors import ConfigError
from peradapt.federation.session import build_session
from peradapt.rundir.layout import read_partition, read_run_config

from .conftest import TINY_BACKBONE, thread_environment


def tiny_args(fmnist_dir: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train",
        *("--data", "fmnist", "--data-dir", str(fmnist_dir), "--backbone", TINY_BACKBONE),
        *("--clients", "4", "--clients-per-round", "2", "--rounds", "3", "--partition", "dir:0.5"),
        *("--local-epochs", "1", "--personal-epochs", "1", "--lr", "0.05", "--batch-size", "32"),
        *("--kd-steps", "4", "--kd-batch-size", "32", "--eval-every", "2", "--device", "cpu"),
        *("--out", str(out)),
        *extra,
    ]


def run_cli(args: list[str], capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["peradapt", *args])
    capsys.readouterr()
    try:
        main()
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def run_files(run: Path) -> dict[str, bytes]:
    """Every file a run leaves, by relative path (the results a user would compare), without what two runs of the
    same settings never share: seconds and peak memory (`timing`, see `without_timing`)."""
    return {
        str(p.relative_to(run)): without_timing(str(p.relative_to(run)), p.read_bytes())
        for p in sorted(run.rglob("*"))
        if p.is_file()
    }


def without_timing(name: str, data: bytes) -> bytes:
    """A run's file but for its `timing` entries: each round's in metrics.jsonl and in a checkpoint's metadata
    (whose tensors' bytes stay as they are), and the cost's in report.json. Everything else is compared as written."""

    def timeless(record: dict) -> dict:
        assert "timing" in record, record  # present, to be left out
        return {key: value for key, value in record.items() if key != "timing"}

    if name == "metrics.jsonl":
        return "".join(json.dumps(timeless(json.loads(line))) + "\n" for line in data.decode().splitlines()).encode()
    if name == "report.json":
        report = json.loads(data)
        report["cost"] = timeless(report["cost"])
        return json.dumps(report).encode()
    if name.startswith("checkpoints/") and name.endswith(".safetensors"):
        size = int.from_bytes(data[:8], "little")  # safetensors: the header's length, the JSON header, the tensors
        header = json.loads(data[8 : 8 + size])
        meta = json.loads(header["__metadata__"]["peradapt"])
        meta["metrics"] = [timeless(record) for record in meta["metrics"]]
        header["__metadata__"]["peradapt"] = meta
        return json.dumps(header).encode() + data[8 + size :]
    return data


def results(run: Path) -> dict[str, bytes]:
    """What `train` wrote, but for the run directory's own name in config.json."""
    files = {name: data for name, data in run_files(run).items() if name not in ("config.json", "eval.json")}
    config = json.loads((run / "config.json").read_text())
    config["config"]["out"] = None
    files["config.json"] = json.dumps(config).encode()
    return files


def run_main(args: list[str], home: Path | None = None) -> None:
    """`peradapt ARGS` for a module-scoped fixture (which has no function-scoped monkeypatch), with
    PERADAPT_HOME set to `home` when one is given."""
    with pytest.MonkeyPatch.context() as patch:
        if home is not None:
            patch.setenv("PERADAPT_HOME", str(home))
        patch.setattr(sys, "argv", ["peradapt", *args])
        main()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, pretrained_home, fmnist_dir):
    """One uninterrupted tiny PerAda run, shared by the tests that only read it."""
    run = tmp_path_factory.mktemp("runs") / "full"
    run_main(tiny_args(fmnist_dir, run), pretrained_home)
    return run


# ---------------------------------------------------------------- a run directory


def test_train_writes_a_complete_run_directory(finished_run):
    files = run_files(finished_run)
    for client in range(4):
        assert f"clients/{client}/adapter_config.json" in files
        assert f"clients/{client}/adapter_model.safetensors" in files
    assert {"global/adapter_model.safetensors", "config.json", "partition.json", "report.json"} <= files.keys()
    assert [name for name in files if name.startswith("checkpoints/")] == ["checkpoints/round-00003.safetensors"]

    saved = json.loads(files["config.json"])
    assert saved["config"]["federation"]["rounds"] == 3
    assert saved["config"]["seed"] == 0
    assert {"torch", "peft", "timm", "python"} <= saved["resolved"]["versions"].keys()
    assert saved["resolved"]["weights"].endswith(f"fmnist-{TINY_BACKBONE}.safetensors")
    # The code that made the numbers: this checkout's commit, "-dirty" while its tracked files differ from it
    checkout = Path(__file__).resolve().parents[1]
    describe = ["git", "-C", str(checkout), "describe", "--always", "--dirty", "--abbrev=12"]
    if (checkout / ".git").exists():
        expected = subprocess.run(describe, capture_output=True, text=True, check=True).stdout.strip()
        assert saved["resolved"]["versions"]["peradapt_source"] == expected

    metrics = [json.loads(line) for line in files["metrics.jsonl"].decode().splitlines()]
    assert [m["round"] for m in metrics] == [1, 2, 3]
    assert all(len(m["clients"]) == 2 and "kd_val_after" in m for m in metrics)
    assert "personalized_local_test" in metrics[1] and "personalized_local_test" not in metrics[0]

    report = json.loads(files["report.json"])
    assert report["clients"] == [0, 1, 2, 3]
    for adapter, metric in [("personalized", "local_test"), ("personalized", "global_test"), ("global", "local_test")]:
        entry = report[adapter][metric]
        assert len(entry["per_client"]) == 4
        assert entry["mean"] == pytest.approx(sum(entry["per_client"]) / 4)
    # The stripe task is easy: three short rounds already beat chance (10%) by far.
    assert report["summary"]["personalized_local_test"] > 0.5
    assert report["summary"]["global_global_test"] > 0.3


def test_partition_json_describes_the_clients(finished_run):
    partition = json.loads((finished_run / "partition.json").read_text())
    assert partition["spec"] == "dir:0.5"
    train = [i for client in partition["clients"] for i in client["train"]]
    assert len(train) == len(set(train))  # every pool image belongs to one client at most
    for client in partition["clients"]:
        assert sum(client["train_histogram"]) == len(client["train"])


def test_eval_recomputes_the_reported_accuracies(finished_run, capsys, monkeypatch, home):
    code, out, err = run_cli(["eval", "--run", str(finished_run)], capsys, monkeypatch)
    assert code == 0, err
    assert "local-test" in out and "global-test" in out and "validation" not in out
    evaluation = json.loads((finished_run / "eval.json").read_text())
    assert evaluation["eval_split"] == "test"
    report = json.loads((finished_run / "report.json").read_text())
    assert evaluation["personalized"]["local_test"] == pytest.approx(report["personalized"]["local_test"]["per_client"])
    assert evaluation["global"]["global_test"] == pytest.approx(report["global"]["global_test"])


def test_info_prints_config_partition_and_trainable_count(finished_run, capsys, monkeypatch, home):
    monkeypatch.setattr(cli.out_console, "width", 60)  # a narrow terminal: its lines are wrapped by it, not by rich
    code, out, err = run_cli(["info", "--run", str(finished_run)], capsys, monkeypatch)
    assert code == 0, err
    resolved = json.loads((finished_run / "config.json").read_text())["resolved"]
    assert f"trainable parameters: {resolved['trainable_parameters']:,}" in out
    line = next(line for line in out.splitlines() if line.startswith("trainable parameters:"))
    assert line.endswith(", scope: adapter"), out
    adapter = resolved["trainable_parameters"]
    counts = json.loads((finished_run / "report.json").read_text())["cost"]["parameters"]  # measured in the run
    assert counts["trained"] == 2 * adapter  # PerAda's v_m and theta_m
    assert counts["personalized"] == counts["communicated"] > adapter  # the adapter and its running statistics
    personalized, trained, communicated = counts["personalized"], counts["trained"], counts["communicated"]
    assert f"per client: {personalized:,} personalized, {trained:,} trained, {communicated:,} communicated" in out
    assert "label skew" in out and "dir:0.5" in out


def test_exported_client_loads_with_plain_peft_to_the_same_logits(finished_run, tmp_path, capsys, monkeypatch, home):
    code, _, err = run_cli(["export", "--run", str(finished_run), "--out", str(tmp_path / "x")], capsys, monkeypatch)
    assert code == 0, err
    backbone = timm.create_model(TINY_BACKBONE, num_classes=10, in_chans=1)
    backbone.load_state_dict(load_file(str(tmp_path / "x" / "backbone.safetensors")))
    plain = PeftModel.from_pretrained(backbone, str(tmp_path / "x" / "clients" / "2")).eval()

    config, _ = read_run_config(finished_run)
    session = build_session(config, read_partition(finished_run))
    state = session.model.load_pretrained(finished_run / "clients" / "2")
    images = session.data.clients[2].test.images[:16]
    expected = session.trainer.logits(state, session.data.clients[2].test.subset(torch.arange(16)))
    with torch.no_grad():
        actual = plain(session.trainer.inputs(images))
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_lora_adapters_and_perada_nokd_run_end_to_end(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    run = tmp_path / "lora"
    args = tiny_args(fmnist_dir, run, "--adapter", "lora", "--method", "perada-nokd", "--rounds", "1")
    code, out, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    assert "perada-nokd" in out
    adapter_config = json.loads((run / "clients" / "0" / "adapter_config.json").read_text())
    assert adapter_config["peft_type"] == "LORA" and adapter_config["init_lora_weights"] is True
    metrics = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert "kd_loss" not in metrics


def test_config_file_takes_the_flag_names_and_flags_win(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    config_file = tmp_path / "settings.yaml"
    config_file.write_text("rounds: 2\nclients-per-round: 1\nkd_steps: 2\n")
    run = tmp_path / "from-file"
    args = [*tiny_args(fmnist_dir, run, "--config", str(config_file)), "--rounds", "1"]
    args.remove("--clients-per-round")
    args.remove("2")
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    saved = json.loads((run / "config.json").read_text())["config"]
    assert saved["federation"]["rounds"] == 1  # the flag beats the file
    assert saved["federation"]["clients_per_round"] == 1  # from the file
    assert saved["distill"]["kd_steps"] == 4  # the flag again


# ---------------------------------------------------------------- resume


class Crash(Exception):
    pass


def crash_after_round(crash_round: int, args: list[str], capsys, monkeypatch) -> None:
    """`peradapt ARGS`, stopped by an exception right after the checkpoint of round `crash_round` is written."""
    save_round = rounds.save_round

    def save_then_crash(session, global_state, history, paths):
        save_round(session, global_state, history, paths)
        if len(history) == crash_round:
            raise Crash

    monkeypatch.setattr(rounds, "save_round", save_then_crash)
    with pytest.raises(Crash):
        run_cli(args, capsys, monkeypatch)
    monkeypatch.setattr(rounds, "save_round", save_round)


def test_resume_after_a_crash_ends_with_identical_files(finished_run, tmp_path, fmnist_dir, capsys, monkeypatch, home):
    run = tmp_path / "crashed"
    crash_after_round(2, tiny_args(fmnist_dir, run), capsys, monkeypatch)
    assert not (run / "report.json").exists()

    code, _, err = run_cli(tiny_args(fmnist_dir, run, "--resume"), capsys, monkeypatch)
    assert code == 0, err
    assert "resuming" in err and "after round 2" in err
    assert results(run) == results(finished_run)


def test_kill_9_then_resume_ends_with_identical_files(finished_run, tmp_path, fmnist_dir, home):
    run = tmp_path / "killed"
    command = [sys.executable, "-c", "from peradapt.cli import main; main()", *tiny_args(fmnist_dir, run)]
    # this process's thread count, with which finished_run was made (float sums differ with the threads)
    environment = {**os.environ, "PERADAPT_HOME": str(home), **thread_environment()}
    process = subprocess.Popen(command, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not (run / "checkpoints" / "round-00001.safetensors").exists() and process.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    resumed = subprocess.run(
        [*command, "--resume"], env=environment, capture_output=True, text=True, timeout=300, check=False
    )
    assert resumed.returncode == 0, resumed.stderr
    assert results(run) == results(finished_run)


def test_resume_refuses_changed_settings(finished_run, capsys, monkeypatch, home):
    args = ["train", "--out", str(finished_run), "--resume", "--lr", "0.5"]
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 2
    assert "lr" in err and "--resume" in err


# ---------------------------------------------------------------- user mistakes


def expect_user_error(args, capsys, monkeypatch, *needles: str) -> str:
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 2, err
    errors = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and err.strip().endswith(errors[0]), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    return err


def snapshot(path: Path) -> dict[str, bytes] | None:
    """Every file under `path` with its bytes (None: `path` does not exist), to show a refusal wrote nothing."""
    if not path.exists():
        return None
    if path.is_file():
        return {"": path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def expect_refusal(args, capsys, monkeypatch, *needles: str, untouched: Path) -> str:
    """`expect_user_error`, and the path `untouched` (a run directory, an output) is exactly as it was before:
    absent if it was absent, else the same files with the same bytes."""
    before = snapshot(untouched)
    err = expect_user_error(args, capsys, monkeypatch, *needles)
    assert snapshot(untouched) == before, f"{untouched} changed: {err}"
    return err


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--data", "mnist2"], ["mnist2", "fmnist"]),
        (["--method", "fedsomething"], ["fedsomething", "perada-nokd"]),
        (["--partition", "dir:abc"], ["dir:abc", "iid"]),
        (["--clients-per-round", "9"], ["--clients-per-round", "--clients"]),
        (["--clients", "5000", "--clients-per-round", "2"], ["--clients"]),
        (["--adapter", "prefix"], ["prefix"]),
        (["--backbone", "not_a_model"], ["not_a_model"]),
        (["--kd-data", "imagenet"], ["imagenet"]),
        (["--limit-samples", "0"], ["--limit-samples"]),
        (["--concurrent-clients", "0"], ["--concurrent-clients must be at least 1"]),
        (["--concurrent-clients", "many"], ["--concurrent-clients must be int or auto, got 'many'"]),
        (["--gpu-memory-fraction", "0"], ["--gpu-memory-fraction must be in (0, 1]"]),
        (["--gpu-memory-fraction", "1.5"], ["--gpu-memory-fraction must be in (0, 1]"]),
    ],
)
def test_bad_training_settings_exit_2_in_one_line_and_write_nothing(
    extra, needles, tmp_path, fmnist_dir, capsys, monkeypatch, home
):
    run = tmp_path / "run"
    expect_user_error(tiny_args(fmnist_dir, run, *extra), capsys, monkeypatch, *needles)
    assert not run.exists()


def test_missing_weights_say_to_run_pretrain(tmp_path, fmnist_dir, capsys, monkeypatch):
    monkeypatch.setenv("PERADAPT_HOME", str(tmp_path / "empty-home"))
    run = tmp_path / "run"
    expect_user_error(tiny_args(fmnist_dir, run), capsys, monkeypatch, "peradapt pretrain", "--weights")
    assert not run.exists()


def test_weights_of_another_backbone_are_refused(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    other = timm.create_model("resnet10_w8", num_classes=10, in_chans=1)
    save_file(other.state_dict(), str(tmp_path / "other.safetensors"))
    run = tmp_path / "run"
    args = tiny_args(fmnist_dir, run, "--weights", str(tmp_path / "other.safetensors"))
    expect_user_error(args, capsys, monkeypatch, "other.safetensors")
    assert not run.exists()


def test_a_pickle_is_never_loaded_as_weights(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    class Boom:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    torch.save({"conv1.weight": Boom()}, tmp_path / "weights.pt")
    run = tmp_path / "run"
    args = tiny_args(fmnist_dir, run, "--weights", str(tmp_path / "weights.pt"))
    expect_user_error(args, capsys, monkeypatch, "weights.pt", "safetensors")
    assert not (tmp_path / "pwned").exists()
    assert not run.exists()


def test_missing_data_says_where_to_get_it(tmp_path, capsys, monkeypatch, home):
    from peradapt.data import sources

    monkeypatch.setattr(sources, "DEBIAN_FMNIST_DIR", tmp_path / "not-installed")
    run = tmp_path / "run"
    expect_user_error(tiny_args(tmp_path / "nowhere", run), capsys, monkeypatch, "apt-get install", "--data-dir")
    assert not run.exists()


def test_existing_run_is_not_overwritten(finished_run, fmnist_dir, capsys, monkeypatch, home):
    before = run_files(finished_run)
    expect_user_error(tiny_args(fmnist_dir, finished_run), capsys, monkeypatch, "--resume")
    assert run_files(finished_run) == before


def test_resume_without_a_run(tmp_path, capsys, monkeypatch, home):
    expect_user_error(["train", "--out", str(tmp_path / "none"), "--resume"], capsys, monkeypatch, "config.json")
    expect_user_error(["train", "--resume"], capsys, monkeypatch, "--out")
    expect_user_error(["eval", "--run", str(tmp_path)], capsys, monkeypatch, "not a peradapt run")


def test_diverging_training_stops_with_advice(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    args = tiny_args(fmnist_dir, tmp_path / "run", "--lr", "1e12", "--rounds", "1")
    expect_user_error(args, capsys, monkeypatch, "--lr")


def test_an_unknown_flag_is_a_usage_error_not_a_traceback(capsys, monkeypatch):
    code, _, err = run_cli(["train", "--no-such-flag", "1"], capsys, monkeypatch)
    assert code == 2
    # click's wording varies with its version (typer >= 0.26 vendors its own; flwr pins typer < 0.21)
    assert "No such option" in err and "--no-such-flag" in err and "Traceback" not in err


def test_error_messages_with_markup_like_text_print_as_they_are(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    """A name such as 'a[/red]' is quoted verbatim in the one error line (rich would read it as markup)."""
    err = expect_user_error(tiny_args(fmnist_dir, tmp_path / "bad", "--method", "a[/red]"), capsys, monkeypatch)
    assert "a[/red]" in err
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--lr", "inf"),
        ("--lr", "nan"),
        ("--lam", "inf"),
        ("--server-lr", "nan"),
        ("--kd-temperature", "nan"),
        ("--personal-lr", "nan"),
        ("--seed", "-1"),
        ("--seed", "99999999999999999999"),
    ],
)
def test_non_finite_numbers_and_seeds_out_of_range_are_one_error_line(
    flag, value, tmp_path, fmnist_dir, capsys, monkeypatch, home
):
    expect_user_error(tiny_args(fmnist_dir, tmp_path / "bad", flag, value), capsys, monkeypatch, flag)
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("content", [b"1: x\n", b"null: x\n", b"true: x\n", b"rounds: 2\n\xff\xfe: 1\n"])
def test_config_files_with_keys_that_are_no_names_or_not_utf8_are_one_error_line(
    content, tmp_path, fmnist_dir, capsys, monkeypatch, home
):
    config = tmp_path / "bad.yaml"
    config.write_bytes(content)
    expect_user_error(tiny_args(fmnist_dir, tmp_path / "bad", "--config", str(config)), capsys, monkeypatch, "bad.yaml")
    assert not (tmp_path / "bad").exists()


def test_info_is_an_api_function_for_runs_and_presets(finished_run):
    shown = api.info(finished_run)
    assert shown.resolved.adapter == "residual" and shown.report is not None
    assert shown.partition["clients"] and 0 <= shown.label_skew <= 1
    preset = api.info(preset="perada-cifar10")
    assert preset.name == "perada-cifar10" and any(declared.name == "kd_steps" for declared, _, _ in preset.rows)
    with pytest.raises(ConfigError, match="info takes --run DIR or --preset NAME"):
        api.info(finished_run, preset="perada-cifar10")
