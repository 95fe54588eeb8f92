"""`compare --tune N` (issue 28, items 1 and 7): search spaces declared with the settings, `commands.tuning.tune`'s
trials on validation splits, pruning by stages, a sweep that resumes after a kill, and several workers sharing one
study (two processes on one SQLite database and on one journal file)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest

import peradapt.commands.tuning as tuning
from peradapt.config import _SHARED, search_space
from peradapt.errors import ConfigError
from peradapt.registry import METHODS
from peradapt.settings import Search, declared_settings, setting

from .conftest import settings

pytestmark = pytest.mark.usefixtures("one_thread")

METHOD = "ditto"  # searches --lr, --lam and --personal-lr
TRIALS = 3
PLUGIN_DIR = Path(__file__).resolve().parent / "plugin"


def tiny(fmnist_dir: Path, **overrides: object) -> dict:
    """compare's settings for a tiny run (2 rounds, so trials play 2 stages): the train settings but --out, and
    --lr unless given (it is searched)."""
    values = settings(fmnist_dir, Path("unused"), eval_every=0)
    del values["out"], values["lr"]
    return {**values, **overrides}


def within(value: float, search: Search) -> bool:
    return search.low <= value <= search.high


def read(path: Path) -> dict:
    return json.loads(path.read_text())


# ---------------------------------------------------------------- search spaces


def test_every_search_lies_within_its_settings_bounds_and_every_method_has_one():
    declared = [declared for _, declared in _SHARED.values()]
    for method, cls in METHODS.items():
        declared += declared_settings(cls.settings_class)
        space = search_space(method)  # checks each method's own ranges of shared settings
        assert "lr" in space and all(d.search is not None for d in space.values())
        assert "lam" in space or not cls.uses_proximal, method  # a proximal strength is tuned where it is read
    for d in declared:
        if d.search is not None:
            for end in d.search.ends():
                d.validate(d.coerce(end))
    assert search_space("pfedbred")["lam"].search == Search.uniform(15.0, 60.0)  # its paper's, not the shared one


def test_a_search_outside_its_settings_bounds_is_refused_where_it_is_declared():
    @dataclass
    class Outside:
        share: float = setting(0.5, help="A share.", minimum=0.0, maximum=1.0, search=Search.uniform(0.5, 2.0))

    @dataclass
    class WholeNumbers:
        count: int = setting(2, help="A count.", minimum=1, search=Search.log(1.0, 8.0))

    with pytest.raises(TypeError, match=r"Outside.share: the search \[0.5, 2\] leaves the setting's own values"):
        declared_settings(Outside)
    with pytest.raises(TypeError, match=r"WholeNumbers.count: int settings are searched with Search\.integers"):
        declared_settings(WholeNumbers)


def test_search_spaces_hold_what_each_method_reads_and_nothing_else():
    assert set(search_space("perada")) == {"lr", "lam", "personal_lr", "server_lr", "kd_temperature"}
    assert set(search_space("perada-nokd")) == {"lr", "lam", "personal_lr"}  # no distillation
    assert set(search_space("ditto")) == {"lr", "lam", "personal_lr"}
    assert set(search_space("fedavg")) == {"lr"}  # no λ, no personal steps
    assert set(search_space("fedprox")) == {"lr", "lam"}  # its one SGD job runs at --personal-lr or else --lr
    assert set(search_space("fedprox-li")) == {"lr", "mu"}
    assert set(search_space("apfl")) == {"lr", "apfl_alpha"}
    with pytest.raises(ConfigError, match="unknown --method 'nosuch'"):
        search_space("nosuch")


def test_a_plugin_declares_its_own_search(tmp_path, monkeypatch):
    module = tmp_path / "searching_plugin.py"
    module.write_text(
        "from dataclasses import dataclass\n"
        "from peradapt.settings import Search, setting\n"
        "from peradapt_fedavgm import FedAvgM\n\n"
        "@dataclass\nclass Settings:\n"
        "    plugin_gamma: float = setting(0.5, help='γ.', minimum=0.0, search=Search.log(0.01, 1.0))\n\n"
        "class Searching(FedAvgM):\n    settings_class = Settings\n    tunes = {'personal_lr': None}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(PLUGIN_DIR))
    before = set(METHODS.loaded())
    try:
        space = search_space("searching_plugin:Searching")
        assert {key: d.search for key, d in space.items()} == {
            "lr": search_space("fedavg")["lr"].search,
            "personal_lr": search_space("ditto")["personal_lr"].search,
            "plugin_gamma": Search.log(0.01, 1.0),
        }
        assert "fedavgm_beta" in search_space("peradapt_fedavgm:FedAvgM")  # the walk-through's plugin
    finally:
        for name in set(METHODS.loaded()) - before:
            del METHODS[name]


# ---------------------------------------------------------------- trials


@pytest.fixture(scope="module")
def tuned(tmp_path_factory, pretrained_home, fmnist_dir):
    """ditto tuned with 3 trials in a fresh SQLite study; the result and the comparison's directory."""
    out = tmp_path_factory.mktemp("tuned")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PERADAPT_HOME", str(pretrained_home))
        sampler = optuna.samplers.RandomSampler(seed=0)
        result = tuning.tune(METHOD, tiny(fmnist_dir), trials=TRIALS, out=out, sampler=sampler)
    return result, out


def test_tune_runs_its_trials_on_validation_splits_and_reports_the_best(tuned):
    result, out = tuned
    assert (out / "tuning.db").is_file()
    trials = result["trials"]
    assert [t["number"] for t in trials] == [0, 1, 2] and {t["state"] for t in trials} == {"COMPLETE"}
    space = search_space(METHOD)
    for trial in trials:
        assert set(trial["params"]) == {"lr", "lam", "personal_lr"}
        assert all(within(value, space[key].search) for key, value in trial["params"].items())
        assert list(trial["intermediate_values"]) == ["1", "2"]  # a stage at half the rounds, then all of them
        assert trial["value"] == trial["intermediate_values"]["2"]
        run = Path(trial["run_dir"])
        saved = read(run / "config.json")["config"]
        assert saved["data"]["eval_split"] == "validation"
        assert {key: saved["method"][key] for key in trial["params"]} == trial["params"]
        assert read(run / "report.json")["summary"][tuning.OBJECTIVE] == trial["value"]
    best = max(trials, key=lambda trial: trial["value"])
    assert (result["best_trial"], result["best_value"], result["best_params"]) == (
        best["number"],
        best["value"],
        best["params"],
    )
    assert read(Path(trials[0]["run_dir"]).parent / "trials.json") == result


def test_a_second_call_trains_nothing_and_returns_the_same_best(tuned, fmnist_dir, monkeypatch, home):
    result, out = tuned
    calls = []
    monkeypatch.setattr(tuning, "train", lambda *args, **kwargs: calls.append(args))
    assert tuning.tune(METHOD, tiny(fmnist_dir), trials=TRIALS, out=out) == result
    assert calls == []


def test_other_fixed_settings_are_another_study(tuned, fmnist_dir, monkeypatch, home):
    result, out = tuned
    monkeypatch.setattr(tuning, "train", lambda *args, **kwargs: SimpleNamespace(summary={tuning.OBJECTIVE: 50.0}))
    other = tuning.tune(METHOD, tiny(fmnist_dir, lam=0.5), trials=1, out=out)  # λ fixed: not searched
    assert other["study"] != result["study"] and set(other["searched"]) == {"lr", "personal_lr"}
    assert [t["params"].keys() for t in other["trials"]] == [{"lr", "personal_lr"}]


def test_a_sweep_run_again_makes_the_same_trials_and_a_resumed_one_draws_new_values(
    tmp_path, fmnist_dir, monkeypatch, home
):
    """The default sampler of a study the comparison holds alone is seeded from --seed and the trials it holds: the
    same trials from scratch (the scores being the same), and no replay of the first draws after a resume."""

    def score(config, **kwargs):  # a made-up score of the trial's values, as deterministic as training on a CPU
        return SimpleNamespace(summary={tuning.OBJECTIVE: -abs(config.method.lr - 0.01) - abs(config.method.lam - 1)})

    monkeypatch.setattr(tuning, "train", score)

    def params(out: Path, trials: int) -> list[dict]:
        return [trial["params"] for trial in tuning.tune(METHOD, tiny(fmnist_dir), trials=trials, out=out)["trials"]]

    first = params(tmp_path / "a", 4)
    assert params(tmp_path / "b", 4) == first
    assert len({json.dumps(values, sort_keys=True) for values in first}) == 4
    params(tmp_path / "c", 2)
    resumed = params(tmp_path / "c", 4)
    assert resumed[:2] == first[:2] and resumed[2] not in first[:2] and resumed[3] not in first[:2]


def test_a_pruned_trial_stops_its_run_at_the_stage(tmp_path, fmnist_dir, home):
    result = tuning.tune(
        "fedavg", tiny(fmnist_dir), trials=1, out=tmp_path, pruner=optuna.pruners.ThresholdPruner(lower=101.0)
    )
    (trial,) = result["trials"]
    assert trial["state"] == "PRUNED" and list(trial["intermediate_values"]) == ["1"]
    assert read(Path(trial["run_dir"]) / "config.json")["config"]["federation"]["rounds"] == 1
    assert result["best_params"] == {} and result["best_value"] is None


def test_a_method_with_nothing_left_to_tune_says_so_and_writes_nothing(tmp_path, fmnist_dir, capsys, home):
    result = tuning.tune("fedavg", tiny(fmnist_dir, lr=0.05), trials=2, out=tmp_path / "out")  # --lr: fixed
    assert result["trials"] == [] and result["best_params"] == {}
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("storage", "needle"),
    [
        ("nosuch://host/db", "--storage nosuch://host/db: use sqlite:///FILE"),
        ("sqlite:////nonexistent-dir/tuning.db", "/nonexistent-dir is no directory"),
        ("journal:/nonexistent-dir/journal.log", "/nonexistent-dir is no directory"),
        ("postgresql://user:secret@127.0.0.1:9/db", "--storage postgresql://user:***@127.0.0.1:9/db"),
        ("sqlite://t.db", "--storage sqlite://t.db: a SQLite URL is sqlite:///FILE, three slashes"),
        ("sqlite+pysqlite://t.db", "a SQLite URL is sqlite:///FILE"),
    ],
)
def test_a_storage_that_cannot_be_opened_is_one_error_and_nothing_written(storage, needle, tmp_path, fmnist_dir):
    out = tmp_path / "out"
    with pytest.raises(ConfigError) as refused:
        tuning.tune(METHOD, tiny(fmnist_dir), trials=1, out=out, storage=storage)
    assert needle in str(refused.value) and "\n" not in str(refused.value)
    assert not out.exists()


def test_a_missing_optuna_names_the_extra(tmp_path, fmnist_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "optuna", None)
    with pytest.raises(ConfigError, match=r"pip install 'peradapt\[tune\]'"):
        tuning.tune(METHOD, tiny(fmnist_dir), trials=1, out=tmp_path)


# ---------------------------------------------------------------- killed workers, several workers


def worker(
    fmnist_dir: Path, out: Path, storage: str, trials: int, *, die_after_a_stage: bool = False, heartbeat_s: int = 1
) -> str:
    """A `python -c` worker calling `tune` (optionally killed by os._exit right after its first stage's run), which
    prints its result as JSON."""
    die = (
        "real = tuning.train\n"
        "def train(*args, **kwargs):\n    real(*args, **kwargs)\n    os._exit(9)\n"
        "tuning.train = train\n"
        if die_after_a_stage
        else ""
    )
    arguments = json.dumps([METHOD, tiny(fmnist_dir), trials, str(out), storage, heartbeat_s])
    return (
        "import json, os, sys, torch\nimport peradapt.commands.tuning as tuning\ntorch.set_num_threads(1)\n"
        f"{die}method, values, trials, out, storage, heartbeat_s = json.loads(sys.argv[1])\n"
        "from pathlib import Path\n"
        "result = tuning.tune(method, values, trials=trials, out=Path(out), storage=storage, heartbeat_s=heartbeat_s)\n"
        "print(json.dumps(result))\n",
        arguments,
    )


def start(script: tuple[str, str], home: Path) -> subprocess.Popen:
    env = {**os.environ, "PERADAPT_HOME": str(home)}
    return subprocess.Popen([sys.executable, "-c", *script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


STORAGES = {"sqlite": lambda out: f"sqlite:///{out / 'study.db'}", "journal": lambda out: f"journal:{out / 'j.log'}"}


@pytest.mark.parametrize("kind", list(STORAGES))
def test_a_trial_left_running_by_a_killed_worker_resumes_its_run(kind, tmp_path, fmnist_dir, monkeypatch, home):
    storage = STORAGES[kind](tmp_path)
    killed = start(worker(fmnist_dir, tmp_path, storage, 1, die_after_a_stage=True), home)
    assert killed.wait(timeout=300) == 9, killed.stderr.read().decode()
    time.sleep(tuning.GRACE_PERIODS + 1)  # the dead worker's heartbeat (1 s) is stale
    calls = []
    real = tuning.train

    def counted_train(config, *, resume=False, console=None):
        calls.append((config.federation.rounds, resume))
        return real(config, resume=resume, console=console)

    monkeypatch.setattr(tuning, "train", counted_train)
    result = tuning.tune(METHOD, tiny(fmnist_dir), trials=1, out=tmp_path, storage=storage, heartbeat_s=1)
    killed_trial, retry = result["trials"]
    assert (killed_trial["state"], retry["state"], retry["retry_of"]) == ("FAIL", "COMPLETE", 0)
    assert retry["run_dir"] == killed_trial["run_dir"] and retry["params"] == killed_trial["params"]
    assert calls == [(2, True)]  # stage 1's finished run was read, stage 2 resumed it
    assert list(retry["intermediate_values"]) == ["1", "2"] and result["best_trial"] == 1


@pytest.mark.parametrize("kind", list(STORAGES))
def test_two_workers_share_one_study(kind, tmp_path, fmnist_dir, home):
    storage = STORAGES[kind](tmp_path)
    # No worker dies here, so no heartbeat needs to go stale soon: with 1 s, a live worker whose heartbeat thread a
    # loaded machine held up for 3 s (GRACE_PERIODS) would have its trial failed and retried by the other. With 5 s
    # that takes a 15 s stall; a worker waiting for the other's last trial looks every 5 s.
    workers = [
        start(worker(fmnist_dir, tmp_path / f"worker{i}", storage, TRIALS, heartbeat_s=5), home) for i in range(2)
    ]
    outputs = [process.communicate(timeout=600) for process in workers]
    assert [process.returncode for process in workers] == [0, 0], outputs[0][1].decode() + outputs[1][1].decode()
    results = [json.loads(stdout.decode().strip().splitlines()[-1]) for stdout, _ in outputs]
    numbers = [trial["number"] for trial in results[0]["trials"]]
    assert len(numbers) == TRIALS and len(set(numbers)) == TRIALS
    assert {trial["state"] for trial in results[0]["trials"]} <= {"COMPLETE", "PRUNED"}
    assert [trial["number"] for trial in results[1]["trials"]] == numbers
    ran = [{path.name for path in (tmp_path / f"worker{i}" / "tuning").glob("*/trial-*")} for i in range(2)]
    assert not ran[0] & ran[1] and len(ran[0] | ran[1]) == TRIALS  # each trial run by one worker
    best = [{key: r[key] for key in ("best_params", "best_value", "best_trial")} for r in results]
    assert best[0] == best[1]


def _open_at_once(url: str, out: Path, barrier) -> str:
    barrier.wait()
    try:
        tuning._storage(url, out, heartbeat_s=60)
    except ConfigError as error:
        return str(error)
    return ""


def test_workers_opening_a_fresh_sqlite_storage_together_all_open_it(tmp_path):
    # Eight processes open a fresh database at one instant, three times over: each opener creates Optuna's tables,
    # and SQLite tells the late ones "table ... already exists" (OperationalError), not an IntegrityError.
    import multiprocessing

    context = multiprocessing.get_context("fork")  # spawn would import torch eight times
    with context.Manager() as manager, context.Pool(8) as pool:
        for attempt in range(3):
            url = f"sqlite:///{tmp_path / f'race{attempt}.db'}"
            barrier = manager.Barrier(8)
            errors = pool.starmap(_open_at_once, [(url, tmp_path, barrier)] * 8)
            assert errors == [""] * 8


def test_of_trials_with_the_same_best_score_the_first_wins_and_the_others_are_named(tmp_path):
    study = optuna.create_study(direction="maximize")
    lr = optuna.distributions.FloatDistribution(1e-4, 1e-1, log=True)
    for value, chosen in ((0.5, 0.01), (0.7, 0.02), (0.7, 0.03), (0.6, 0.04)):
        study.add_trial(optuna.trial.create_trial(params={"lr": chosen}, distributions={"lr": lr}, value=value))
    with warnings.catch_warnings():  # as `tune` calls it: Optuna's retry look-up is marked experimental
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        result = tuning._result(study, "ditto", {}, tmp_path)
    assert (result["best_trial"], result["best_params"], result["tied_with"]) == (1, {"lr": 0.02}, [2])
    assert result["tie_rule"] == tuning.TIE_RULE


def test_methods_draw_their_own_first_trials():
    """TPE's first trials are random: each study's stream comes from its name too, so two methods tuning the same
    setting from the same --seed do not draw the same values."""
    lr = optuna.distributions.FloatDistribution(1e-4, 1e-1, log=True)

    def first_draw(study_name: str) -> float:
        study = optuna.create_study(direction="maximize", sampler=tuning._sampler(0, 0, study_name, shared=False))
        return study.ask({"lr": lr}).params["lr"]

    assert first_draw("fedavg-abc") == first_draw("fedavg-abc")
    assert first_draw("fedavg-abc") != first_draw("ditto-abc")
