"""Methods from outside peradapt (issue 24, item 4): the FedAvgM of docs/ADDING_A_METHOD.md, a small package in
tests/plugin/, as `--method peradapt_fedavgm:FedAvgM` and as an installed distribution's entry point, through the
command line end to end (train, resume, export, compare, --concurrent-clients, Flower), and the errors of a plugin
that cannot be used."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.testing import assert_close

from peradapt.methods import METHODS, MethodContext
from peradapt.rundir.store import ClientStore

from .conftest import method_config
from .test_cli import crash_after_round, expect_refusal, expect_user_error, results, run_cli, tiny_args
from .test_perada import TOL, tiny_trainer
from .test_pfedme_pfedbred import names_of, server_problem

PLUGIN_DIR = Path(__file__).resolve().parent / "plugin"
PLUGIN = "peradapt_fedavgm:FedAvgM"
BETA = 0.5

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def plugin_on_path(monkeypatch):
    """The plugin's directory on sys.path (and PYTHONPATH, for Flower's Ray workers); the registry forgets the
    plugins a test found, so that other tests see the built-in methods only."""
    monkeypatch.syspath_prepend(str(PLUGIN_DIR))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(PLUGIN_DIR), os.environ.get("PYTHONPATH")])))
    before = set(METHODS.loaded())
    yield
    for name in set(METHODS.loaded()) - before:
        del METHODS[name]


def plugin_args(fmnist_dir: Path, out: Path, *extra: str) -> list[str]:
    return tiny_args(fmnist_dir, out, "--method", PLUGIN, "--fedavgm-beta", str(BETA), *extra)


@pytest.fixture(scope="module")
def plugin_run(tmp_path_factory, pretrained_home, fmnist_dir):
    """One uninterrupted tiny FedAvgM run through the command line (3 rounds)."""
    run = tmp_path_factory.mktemp("runs") / "fedavgm"
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(PLUGIN_DIR))
        patch.setenv("PERADAPT_HOME", str(pretrained_home))
        patch.setattr(sys, "argv", ["peradapt", *plugin_args(fmnist_dir, run)])
        before = set(METHODS.loaded())
        from peradapt.cli import main

        main()
        for name in set(METHODS.loaded()) - before:
            del METHODS[name]
    return run


# ---------------------------------------------------------------- the update rule by hand


def test_fedavgm_server_update_is_momentum_on_the_mean_by_hand():
    cls = METHODS[PLUGIN]
    trainer = tiny_trainer()
    names = names_of(trainer)

    def make():
        shared, own = method_config(cls, fedavgm_beta=BETA)
        return cls(MethodContext(shared, trainer, ClientStore(), trainer.model.state(), None, (), 0, None, own))

    w_0, uploads, updates, floats, _ = server_problem(trainer, seeds=(1, 2, 3), sizes=(1, 50))
    method = make()
    assert method.server_state() == {}
    w_1, info = method.server_update(w_0, updates, seed=0, round_index=0)

    def mean(ups):  # the sample-weighted mean of two uploads of 1 and 50 samples
        return {k: (1 * ups[0][k] + 50 * ups[1][k]) / 51 for k in ups[0] if ups[0][k].is_floating_point()}

    mean_1 = mean(uploads)
    v_1 = {n: w_0[n] - mean_1[n] for n in names}  # v = 0·β + Δ
    assert info == {} and w_1.keys() == w_0.keys()
    for n in names:
        assert_close(w_1[n], w_0[n] - v_1[n], **TOL)  # the first round is FedAvg's
    for key in floats:  # running statistics: the mean, no momentum
        assert_close(w_1[key], mean_1[key], **TOL)
    assert_close(method.server_state(), v_1, **TOL)

    _, uploads_2, updates_2, _, _ = server_problem(trainer, seeds=(1, 8, 9), sizes=(1, 50))
    w_2, _ = method.server_update(w_1, updates_2, seed=0, round_index=1)
    mean_2 = mean(uploads_2)
    v_2 = {n: BETA * v_1[n] + (w_1[n] - mean_2[n]) for n in names}
    for n in names:
        assert_close(w_2[n], w_1[n] - v_2[n], **TOL)
        assert not torch.allclose(w_2[n], mean_2[n])  # the momentum carries the first round's step on
    # A server restored from the saved v continues exactly (--resume); a fresh one is FedAvg's mean again.
    restored = make()
    restored.load_server_state(v_1)
    assert_close(restored.server_update(w_1, updates_2, seed=0, round_index=1)[0], w_2, **TOL)
    fresh, _ = make().server_update(w_1, updates_2, seed=0, round_index=1)
    assert_close({n: fresh[n] for n in names}, {n: mean_2[n] for n in names}, **TOL)


def test_the_walk_through_shows_the_tested_plugin():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "ADDING_A_METHOD.md").read_text(encoding="utf-8")
    assert (PLUGIN_DIR / "peradapt_fedavgm" / "__init__.py").read_text(encoding="utf-8") in doc


# ---------------------------------------------------------------- module:Class through the command line


def test_a_plugin_trains_under_its_module_class_name(plugin_run):
    saved = json.loads((plugin_run / "config.json").read_text())["config"]
    assert saved["method"]["method"] == PLUGIN and saved["method"]["fedavgm_beta"] == BETA
    report = json.loads((plugin_run / "report.json").read_text())
    assert report["method"] == PLUGIN and report["summary"]["global_global_test"] > 0.2
    checkpoint = load_file(plugin_run / "checkpoints" / "round-00003.safetensors")
    assert any(key.startswith("server/") for key in checkpoint)  # v, for --resume


def test_a_plugin_run_killed_after_a_round_resumes_to_the_same_files(
    plugin_run, tmp_path, fmnist_dir, capsys, monkeypatch, home
):
    run = tmp_path / "crashed"
    crash_after_round(2, plugin_args(fmnist_dir, run), capsys, monkeypatch)
    assert not (run / "report.json").exists()
    del METHODS[PLUGIN]  # as a new process: --resume finds the plugin from config.json alone
    code, _, err = run_cli(["train", "--out", str(run), "--resume"], capsys, monkeypatch)
    assert code == 0, err
    assert results(run) == results(plugin_run)


def test_a_plugin_run_exports_with_model_cards(plugin_run, tmp_path, capsys, monkeypatch, home):
    out = tmp_path / "export"
    code, _, err = run_cli(["export", "--run", str(plugin_run), "--out", str(out)], capsys, monkeypatch)
    assert code == 0, err
    for card in (out / "README.md", out / "global" / "README.md", out / "clients" / "0" / "README.md"):
        text = card.read_text()
        assert PLUGIN in text, card
    assert "server momentum" in (out / "README.md").read_text()  # the plugin's summary


def test_concurrent_clients_train_a_plugin_together_to_the_same_numbers(
    plugin_run, tmp_path, fmnist_dir, capsys, monkeypatch, home
):
    run = tmp_path / "concurrent"
    code, _, err = run_cli(plugin_args(fmnist_dir, run, "--concurrent-clients", "2"), capsys, monkeypatch)
    assert code == 0, err
    assert "one after another" not in err
    expected = json.loads((plugin_run / "report.json").read_text())["summary"]
    summary = json.loads((run / "report.json").read_text())["summary"]
    assert summary == pytest.approx(expected, abs=1e-4)


def test_help_and_methods_show_the_plugin_and_its_setting(capsys, monkeypatch):
    code, out, err = run_cli(["train", "--method", PLUGIN, "--help"], capsys, monkeypatch)
    assert code == 0, err
    panel = out[out.index(f"Method: {PLUGIN}") :]
    assert "--fedavgm-beta" in panel.split("╰")[0]
    code, out, _ = run_cli(["methods", PLUGIN], capsys, monkeypatch)
    assert code == 0
    assert "source: module peradapt_fedavgm" in out and "--fedavgm-beta" in out and "[0, 1)" in out
    assert "--concurrent-clients: yes" in out


@pytest.mark.parametrize(
    ("method", "needles"),
    [
        ("no_such_plugin.sub:Cls", ["cannot import module 'no_such_plugin.sub'", "No module named 'no_such_plugin'"]),
        ("peradapt_fedavgm:FedAvgN", ["module 'peradapt_fedavgm' has no attribute 'FedAvgN'"]),
        ("peradapt_fedavgm:FedAvgMSettings", ["the class FedAvgMSettings, not a subclass of peradapt.Method"]),
        ("peradapt_fedavgm:setting", ["a function, not a subclass of peradapt.Method"]),
        ("peradapt.methods.base:LocalSGDMethod", ["does not define client_steps, personalized"]),
        ("peradapt_fedavgm:", ["give MODULE:CLASS"]),
    ],
)
def test_a_plugin_that_cannot_be_used_is_one_error_line(method, needles, tmp_path, fmnist_dir, capsys, monkeypatch):
    run = tmp_path / "run"
    expect_user_error(
        tiny_args(fmnist_dir, run, "--method", method), capsys, monkeypatch, f"--method {method}", *needles
    )
    assert not run.exists()


BROKEN_MODULES = {  # a plugin module's code, and what the one error line says of it
    "raising": ('raise RuntimeError("no GPU\\nfound")\n', ["RuntimeError: no GPU found", "fix the module"]),
    "syntax": ("def f(:\n", ["SyntaxError", "fix the module", 'python -c "import broken_syntax"']),
    "exiting": ("import sys\nsys.exit(0)\n", ["SystemExit: 0", "fix the module"]),
    "needy": ("import no_such_dependency\n", ["install 'no_such_dependency', which it imports"]),
}


@pytest.mark.parametrize("kind", BROKEN_MODULES)
def test_a_plugin_module_failing_at_import_is_one_error_line_in_every_command(
    kind, tmp_path, fmnist_dir, capsys, monkeypatch
):
    code, needles = BROKEN_MODULES[kind]
    (tmp_path / f"broken_{kind}.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    method = f"broken_{kind}:Method"
    needles = [f"--method {method}", f"cannot import module 'broken_{kind}'", *needles]
    run = tmp_path / "run"
    expect_refusal(tiny_args(fmnist_dir, run, "--method", method), capsys, monkeypatch, *needles, untouched=run)
    expect_user_error(["methods", method], capsys, monkeypatch, *needles)
    compared = ["compare", "--methods", f"fedavg,{method}", "--out", str(run)]
    expect_refusal(compared, capsys, monkeypatch, *needles, untouched=run)


def test_a_plugin_not_on_the_path_says_to_put_it_there(tmp_path, fmnist_dir, capsys, monkeypatch):
    expect_user_error(
        tiny_args(fmnist_dir, tmp_path / "run", "--method", "nowhere_plugin:Method"),
        capsys,
        monkeypatch,
        "cannot import module 'nowhere_plugin'",
        "PYTHONPATH",
        "pip install",
    )


def test_a_finished_plugin_run_without_its_plugin_says_how_to_find_it(plugin_run, capsys, monkeypatch, home):
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry != str(PLUGIN_DIR)])
    for module in [name for name in sys.modules if name.startswith("peradapt_fedavgm")]:
        monkeypatch.delitem(sys.modules, module)
    if PLUGIN in METHODS.loaded():
        del METHODS[PLUGIN]
    for command in (["eval"], ["info"], ["train", "--resume", "--out"]):
        err = expect_refusal(
            [*command, *([] if "--out" in command else ["--run"]), str(plugin_run)],
            capsys,
            monkeypatch,
            f"{plugin_run} was trained with a method that cannot be loaded here",
            f"--method {PLUGIN}: cannot import module 'peradapt_fedavgm'",
            "PYTHONPATH",
            untouched=plugin_run,
        )
        assert "damaged" not in err and "put back" not in err


def test_a_plugin_whose_setting_clashes_is_refused(tmp_path, capsys, monkeypatch):
    module = tmp_path / "clashing_plugin.py"
    module.write_text(
        "from dataclasses import dataclass\n"
        "from peradapt.settings import setting\n"
        "from peradapt_fedavgm import FedAvgM\n\n"
        "@dataclass\nclass Settings:\n    feddyn_alpha: float = setting(0.5, help='Another α.')\n\n"
        "class Clashing(FedAvgM):\n    settings_class = Settings\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    expect_user_error(["methods", "clashing_plugin:Clashing"], capsys, monkeypatch, "method feddyn declares that key")


# ---------------------------------------------------------------- an installed package's entry point


def declare(site: Path, package: str, entry_points: str) -> None:
    """An installed distribution `package` in `site` that declares `entry_points` (lines `name = module:Class`)."""
    info = site / f"{package}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[peradapt.methods]\n{entry_points}\n")


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """The plugin as an installed distribution, without pip: the package and its .dist-info in a directory on
    sys.path, which importlib.metadata reads."""
    site = tmp_path / "site-packages"
    shutil.copytree(PLUGIN_DIR / "peradapt_fedavgm", site / "peradapt_fedavgm")
    declare(site, "peradapt_fedavgm", f"fedavgm = {PLUGIN}")
    monkeypatch.syspath_prepend(str(site))
    return site


def test_an_entry_point_is_a_method_by_its_name(installed, tmp_path, fmnist_dir, capsys, monkeypatch, home):
    code, out, _ = run_cli(["methods"], capsys, monkeypatch)
    assert code == 0
    assert "fedavgm" in out and "entry point of peradapt_fedavgm 0.1" in out
    expect_user_error(  # an installed method's setting is a flag, and refused by the other methods
        tiny_args(fmnist_dir, tmp_path / "refused", "--method", "fedavg", "--fedavgm-beta", "0.5"),
        capsys,
        monkeypatch,
        "--fedavgm-beta is a setting of fedavgm: --method fedavg does not take it",
    )
    run = tmp_path / "run"
    code, _, err = run_cli(
        tiny_args(fmnist_dir, run, "--method", "fedavgm", "--fedavgm-beta", "0.5", "--rounds", "1"), capsys, monkeypatch
    )
    assert code == 0, err
    assert json.loads((run / "config.json").read_text())["config"]["method"]["method"] == "fedavgm"
    assert json.loads((run / "report.json").read_text())["method"] == "fedavgm"


def test_a_broken_entry_point_breaks_only_the_commands_that_name_it(
    installed, tmp_path, fmnist_dir, capsys, monkeypatch, home
):
    (installed / "broken_plugin.py").write_text('raise RuntimeError("half-installed")\n')
    declare(installed, "brokenpkg", "brokenm = broken_plugin:Method\nfedavg = broken_plugin:Method")
    code, out, err = run_cli(["methods"], capsys, monkeypatch)
    assert code == 0, err
    assert "entry point of peradapt_fedavgm 0.1" in out  # the working one is listed as ever
    assert "broken: brokenm: --method brokenm (entry point of brokenpkg 0.1: broken_plugin:Method): cannot " in out
    assert "RuntimeError: half-installed" in out
    assert "broken: fedavg: brokenpkg declares a method 'fedavg'" in out and "rename its entry point" in out
    run = tmp_path / "run"
    code, _, err = run_cli(tiny_args(fmnist_dir, run, "--method", "fedavg", "--rounds", "1"), capsys, monkeypatch)
    assert code == 0, err
    assert json.loads((run / "report.json").read_text())["method"] == "fedavg"  # the built-in one, not the clash
    err = expect_user_error(
        tiny_args(fmnist_dir, tmp_path / "nosuch", "--method", "nosuch"), capsys, monkeypatch, "unknown --method"
    )
    assert "brokenm" not in err and "half-installed" not in err
    expect_refusal(
        tiny_args(fmnist_dir, tmp_path / "broken", "--method", "brokenm"),
        capsys,
        monkeypatch,
        "--method brokenm (entry point of brokenpkg 0.1",
        "RuntimeError: half-installed",
        untouched=tmp_path / "broken",
    )


def test_a_run_of_an_entry_point_no_longer_installed_says_to_install_it(
    installed, tmp_path, fmnist_dir, capsys, monkeypatch, home
):
    run = tmp_path / "run"
    args = tiny_args(fmnist_dir, run, "--method", "fedavgm", "--rounds", "1")
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry != str(installed)])
    del METHODS["fedavgm"]
    err = expect_refusal(
        ["eval", "--run", str(run)],
        capsys,
        monkeypatch,
        "was trained with a method that cannot be loaded here: --method fedavgm is no built-in method",
        "pip install",
        untouched=run,
    )
    assert "damaged" not in err


# ---------------------------------------------------------------- compare and Flower


def test_compare_runs_a_plugin_beside_a_built_in_method(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    out = tmp_path / "compare"
    flags = tiny_args(fmnist_dir, tmp_path / "unused")[1:-2]  # train's flags but --out
    args = ["compare", "--methods", f"fedavg,{PLUGIN}", "--seeds", "1", "--out", str(out), "--no-anchors", *flags]
    code, printed, err = run_cli([*args, "--rounds", "1", "--fedavgm-beta", "0.5"], capsys, monkeypatch)
    assert code == 0, err
    rows = {row["method"]: row for row in json.loads((out / "compare.json").read_text())["rows"]}
    assert set(rows) == {"fedavg", PLUGIN}
    assert PLUGIN in printed
    plugin_run = out / "peradapt_fedavgm.FedAvgM-seed0"  # a file name without the colon
    assert json.loads((plugin_run / "config.json").read_text())["config"]["method"]["fedavgm_beta"] == 0.5
    score = json.loads((plugin_run / "report.json").read_text())["summary"]["global_global_test"]
    assert rows[PLUGIN]["global_test"]["seeds"] == [100 * score]


def test_flower_simulation_runs_a_plugin(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    pytest.importorskip("flwr.simulation")
    pytest.importorskip("ray")
    run = tmp_path / "flower"
    code, printed, err = run_cli(
        plugin_args(fmnist_dir, run, "--engine", "flower", "--rounds", "1"), capsys, monkeypatch
    )
    assert code == 0, err
    assert f"{PLUGIN} on fmnist, 4 clients, 1 round" in printed
    report = json.loads((run / "report.json").read_text())
    assert report["method"] == PLUGIN and 0 <= report["summary"]["personalized_local_test"] <= 1
