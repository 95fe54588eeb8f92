"""`train --log`: TensorBoard, W&B (offline, the real package) and MLflow (a file store in the run) get every round
once, the settings and the final summary; `--resume` continues the same tracker runs; results never change."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from peradapt.federation.tracking import MLFLOW_DIR, TENSORBOARD_DIR, TRACKERS_FILE

from .test_cli import crash_after_round, expect_refusal, run_cli, run_files, run_main, tiny_args

pytestmark = pytest.mark.usefixtures("one_thread")

TRACKER_FILES = (TRACKERS_FILE, TENSORBOARD_DIR, MLFLOW_DIR)


def two_rounds(fmnist_dir: Path, run: Path, *extra: str) -> list[str]:
    return tiny_args(fmnist_dir, run, "--rounds", "2", "--eval-every", "1", *extra)


@pytest.fixture(autouse=True)
def tracker_env(tmp_path, monkeypatch):
    """W&B offline with its files in tmp; MLflow at its default (the run's own file store), switch unset."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb-dir").mkdir()
    for name in ("WANDB_PROJECT", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.setenv(name, "")  # recorded, so that the delete below is undone (and what the run sets, too)
        monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pretrained_home, fmnist_dir) -> tuple[Path, Path]:
    """The same tiny run with --log tensorboard and without."""
    root = tmp_path_factory.mktemp("tracking")
    run_main(two_rounds(fmnist_dir, root / "tracked", "--log", "tensorboard"), pretrained_home)
    run_main(two_rounds(fmnist_dir, root / "plain"), pretrained_home)
    return root / "tracked", root / "plain"


def results(run: Path) -> dict[str, bytes]:
    """What the run wrote but the trackers' files, with --out and --log taken out of config.json."""
    files = {name: data for name, data in run_files(run).items() if name.split("/")[0] not in TRACKER_FILES}
    config = json.loads(files["config.json"])
    config["config"]["out"] = config["config"]["log"] = None
    files["config.json"] = json.dumps(config).encode()
    return files


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def numbers(record: dict) -> dict[str, float]:
    """The record's numbers, those of its objects (a round's cost and timing) named `object/key`."""
    flat = {k: v for k, v in record.items() if not isinstance(v, dict)}
    flat.update(
        {f"{k}/{key}": v for k, entries in record.items() if isinstance(entries, dict) for key, v in entries.items()}
    )
    return {k: v for k, v in flat.items() if k != "round" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def tensorboard_events(run: Path) -> EventAccumulator:
    events = EventAccumulator(str(run / TENSORBOARD_DIR), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def test_tracking_changes_no_result(runs):
    tracked, plain = runs
    assert results(tracked) == results(plain)
    assert json.loads((tracked / "config.json").read_text())["config"]["log"] == "tensorboard"


def test_tensorboard_holds_every_round_the_settings_and_the_summary(runs):
    tracked, _ = runs
    events = tensorboard_events(tracked)
    logged = records(tracked)
    assert [r["round"] for r in logged] == [1, 2] and "personalized_local_test" in logged[0]
    assert {"cost/bytes_up", "cost/client_flops", "timing/client_seconds", "timing/peak_rss_bytes"} <= set(
        numbers(logged[0])
    )
    for key in {k for record in logged for k in numbers(record)}:
        scalars = events.Scalars(key)
        expected = [(r["round"], numbers(r)[key]) for r in logged if key in numbers(r)]
        assert [s.step for s in scalars] == [step for step, _ in expected], key
        assert [s.value for s in scalars] == pytest.approx([value for _, value in expected], rel=1e-6), key

    summary = json.loads((tracked / "report.json").read_text())["summary"]
    for key, value in summary.items():
        [scalar] = events.Scalars(f"summary/{key}")
        assert (scalar.step, scalar.value) == (2, pytest.approx(value, rel=1e-6))

    hparams = events.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(hparams["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["rounds"].number_value == 2 and start.hparams["method"].string_value == "perada"
    assert start.hparams["resolved/adapter"].string_value == "residual"
    assert "_hparams_/session_end_info" in hparams  # the run finished
    text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "kd_steps: 4" in text and "resolved/versions/torch" in text


def test_a_resumed_run_continues_each_tracker_run_and_logs_every_round_once(
    tmp_path, fmnist_dir, capsys, monkeypatch, home
):
    import wandb
    from mlflow.tracking import MlflowClient

    inits = spy_on_wandb(monkeypatch, wandb)
    run = tmp_path / "run"
    args = tiny_args(fmnist_dir, run, "--log", "tensorboard", "--log", "wandb,mlflow")  # 3 rounds
    crash_after_round(2, args, capsys, monkeypatch)
    saved = json.loads((run / TRACKERS_FILE).read_text())
    assert {name: state["round"] for name, state in saved.items()} == {"tensorboard": 1, "wandb": 1, "mlflow": 1}
    assert inits[0]["exit_code"] == 1  # the crash ended the W&B run as failed, to be resumed

    code, _, err = run_cli(tiny_args(fmnist_dir, run, "--resume"), capsys, monkeypatch)  # --log as saved
    assert code == 0, err
    logged = records(run)
    assert [r["round"] for r in logged] == [1, 2, 3]
    summary = json.loads((run / "report.json").read_text())["summary"]

    # TensorBoard: the same directory, round 2 (checkpointed, not logged before the crash) logged on resume
    events = tensorboard_events(run)
    assert [s.step for s in events.Scalars("local_loss")] == [1, 2, 3]
    assert [s.value for s in events.Scalars("local_loss")] == pytest.approx([r["local_loss"] for r in logged])
    assert [s.step for s in events.Scalars("personalized_local_test")] == [2]
    assert {"_hparams_/session_start_info", "_hparams_/session_end_info"} <= events.PluginTagToContent("hparams").keys()

    # W&B: the resumed init names the saved run id with resume="allow"; each round logged once, at its step
    first, second = inits
    assert "id" not in first["kwargs"] and second["kwargs"]["id"] == first["id"] == saved["wandb"]["id"]
    assert second["kwargs"]["resume"] == "allow" and second["exit_code"] is None
    assert [step for step, _ in first["logged"] + second["logged"]] == [1, 2, 3]
    assert [values for _, values in first["logged"] + second["logged"]] == [numbers(r) for r in logged]
    cost = json.loads((run / "report.json").read_text())["cost"]
    assert second["summary"]["run_cost/client_samples"] == cost["client_samples"]
    assert second["summary"]["run_cost/timing/client_seconds"] == cost["timing"]["client_seconds"]
    assert {k: v for k, v in second["summary"].items() if k.startswith("summary/")} == {
        f"summary/{k}": v for k, v in summary.items()
    }
    assert second["config"]["rounds"] == 3 and second["config"]["resolved/client_store"] == "memory"
    offline_runs = sorted(p.name for p in (tmp_path / "wandb-dir" / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 2 and all(first["id"] in name for name in offline_runs)

    # MLflow: the run's own file store, one run, finished, every round once and the summary
    client = MlflowClient(tracking_uri=(run / MLFLOW_DIR).as_uri())
    run_id = json.loads((run / TRACKERS_FILE).read_text())["mlflow"]["run_id"]
    assert run_id == saved["mlflow"]["run_id"]
    [experiment] = client.search_experiments(filter_string="name = 'peradapt'")
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run_id]
    assert client.get_run(run_id).info.status == "FINISHED"
    for key in numbers(logged[1]):
        history = client.get_metric_history(run_id, key)
        expected = [(r["round"], numbers(r)[key]) for r in logged if key in numbers(r)]
        assert sorted((m.step, m.value) for m in history) == expected, key
    for key, value in summary.items():
        [metric] = client.get_metric_history(run_id, f"summary/{key}")
        assert (metric.step, metric.value) == (3, value)
    params = client.get_run(run_id).data.params
    assert params["method"] == "perada" and params["resolved/adapter"] == "residual"
    assert json.loads((run / TRACKERS_FILE).read_text())["mlflow"]["round"] == 3


def spy_on_wandb(monkeypatch, wandb) -> list[dict]:
    """The real `wandb.init` (offline), recording its arguments and what each run is sent."""
    inits: list[dict] = []
    real_init = wandb.init

    def init(**kwargs):
        run = real_init(**kwargs)
        inits.append({"kwargs": kwargs, "id": run.id, "logged": [], "summary": {}, "config": {}, "exit_code": None})
        return RunSpy(run, inits[-1])

    monkeypatch.setattr(wandb, "init", init)
    return inits


class RunSpy:
    def __init__(self, run, record: dict) -> None:
        self._run, self._record = run, record
        self.summary = self  # summary.update

    def log(self, values, step):
        self._record["logged"].append((step, values))
        self._run.log(values, step=step)

    def update(self, values):
        self._record["summary"].update(values)
        self._run.summary.update(values)

    def finish(self, exit_code=None):
        self._record["config"], self._record["exit_code"] = dict(self._run.config), exit_code
        self._run.finish(exit_code=exit_code)

    def __getattr__(self, name):
        return getattr(self._run, name)


def test_unknown_trackers_and_missing_packages_are_refused_before_anything_is_written(
    tmp_path, fmnist_dir, capsys, monkeypatch, home
):
    run = tmp_path / "run"
    args = two_rounds(fmnist_dir, run, "--log", "tensorboard,nosuch")
    expect_refusal(args, capsys, monkeypatch, "nosuch", "tensorboard, wandb, mlflow", untouched=run)
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: `import wandb` fails
    args = two_rounds(fmnist_dir, run, "--log", "tensorboard", "--log", "wandb")
    expect_refusal(args, capsys, monkeypatch, "pip install 'peradapt[wandb]'", untouched=run)


def test_resume_refuses_a_missing_package_and_a_damaged_trackers_file(runs, tmp_path, capsys, monkeypatch, home):
    run = tmp_path / "run"
    shutil.copytree(runs[0], run)
    resume = ["train", "--out", str(run), "--resume", "--rounds", "3"]
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "tensorboard", None)
        expect_refusal(resume, capsys, monkeypatch, "pip install 'peradapt[tensorboard]'", "--log none", untouched=run)
    (run / TRACKERS_FILE).write_text('{"tensorboard": {"round": "two"}}')
    expect_refusal(resume, capsys, monkeypatch, str(run / TRACKERS_FILE), "delete it", untouched=run)


def test_a_new_run_that_fails_in_its_first_round_leaves_no_tracker_files(
    tmp_path, fmnist_dir, capsys, monkeypatch, home
):
    import peradapt.federation.rounds as rounds

    class Failed(Exception):
        pass

    def fail(*args):
        raise Failed

    run = tmp_path / "existing"
    run.mkdir()  # a directory the run did not make: only the run's files go
    monkeypatch.setattr(rounds, "save_round", fail)
    with pytest.raises(Failed):
        run_cli(two_rounds(fmnist_dir, run, "--log", "tensorboard,mlflow"), capsys, monkeypatch)
    assert list(run.iterdir()) == []
