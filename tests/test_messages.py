"""Messages that said something misleading (issue 27): each names what the user gave, where a value came from and
what to do, in one `error:` line."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import peradapt
from peradapt.config import TrainConfig
from peradapt.errors import ConfigError

from .conftest import TINY_BACKBONE
from .test_cli import expect_refusal, expect_user_error, run_cli, run_main, tiny_args

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def finished(tmp_path_factory, pretrained_home, fmnist_dir) -> tuple[Path, Path]:
    """A finished one-round run, and its pinned copy of the backbone in the home it was trained in."""
    run = tmp_path_factory.mktemp("runs") / "run"
    run_main(tiny_args(fmnist_dir, run, "--rounds", "1", "--holdout-clients", "1"), pretrained_home)
    fingerprint = json.loads((run / "config.json").read_text())["resolved"]["backbone_sha256"]
    return run, pretrained_home / "backbones" / "sha256" / f"{fingerprint}.safetensors"


def test_a_run_elsewhere_says_where_it_expects_its_backbone_and_takes_weights(finished, tmp_path, capsys, monkeypatch):
    run, pinned = finished
    monkeypatch.setenv("PERADAPT_HOME", str(tmp_path / "other-home"))
    expected = tmp_path / "other-home" / "backbones" / "sha256" / pinned.name
    err = expect_refusal(["eval", "--run", str(run)], capsys, monkeypatch, str(expected), "--weights", untouched=run)
    assert "pretrain" not in err  # a new pretrain would have another fingerprint
    code, _, err = run_cli(["eval", "--run", str(run), "--weights", str(pinned)], capsys, monkeypatch)
    assert code == 0, err
    exported = tmp_path / "export"
    code, _, err = run_cli(
        ["export", "--run", str(run), "--out", str(exported), "--weights", str(pinned)], capsys, monkeypatch
    )
    assert code == 0 and (exported / "README.md").is_file(), err
    code, _, err = run_cli(
        ["personalize", "--run", str(run), "--new-client", "3", "--weights", str(pinned)], capsys, monkeypatch
    )
    assert code == 0, err
    assert peradapt.evaluate(run, weights=pinned)["metric"]


def test_weights_given_to_a_finished_run_are_checked(finished, tmp_path, capsys, monkeypatch):
    run, pinned = finished
    monkeypatch.setenv("PERADAPT_HOME", str(tmp_path / "other-home"))
    other = load_file(str(pinned))
    first = next(iter(other))
    other[first] = other[first] + 1
    save_file(other, str(tmp_path / "other.safetensors"))
    for weights, needles in (
        (tmp_path / "other.safetensors", ["other.safetensors", "not the ones this run was trained on"]),
        (tmp_path / "missing.safetensors", ["--weights", "missing.safetensors", "not a file"]),
        (tmp_path, ["--weights", "not a file"]),
    ):
        for command in (["eval"], ["export", "--out", str(tmp_path / "export")], ["personalize", "--new-client", "3"]):
            args = [*command, "--run", str(run), "--weights", str(weights)]
            expect_refusal(args, capsys, monkeypatch, *needles, untouched=run)
    assert not (tmp_path / "export").exists()


def test_an_error_about_a_preset_value_says_it_came_from_the_preset(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    run = tmp_path / "run"
    base = ["train", "--preset", "perada-cifar10", "--data", "fmnist", "--data-dir", str(fmnist_dir)]
    base += ["--backbone", TINY_BACKBONE, "--out", str(run)]
    expect_refusal(
        base, capsys, monkeypatch, "--kd-data", "came from --preset perada-cifar10", "give --kd-data", untouched=run
    )
    err = expect_refusal([*base, "--kd-data", "cifar100"], capsys, monkeypatch, "--kd-data", untouched=run)
    assert "came from" not in err  # the user typed it
    err = expect_refusal([*base, "--clients", "4"], capsys, monkeypatch, "--clients-per-round", untouched=run)
    assert "--clients-per-round came from --preset perada-cifar10" in err and "--clients came" not in err
    config = tmp_path / "c.yaml"
    config.write_text("clients_per_round: 30\n")
    err = expect_user_error(["train", "--config", str(config), "--out", str(run)], capsys, monkeypatch)
    assert f"--clients-per-round came from --config {config}" in err


def test_a_switch_takes_a_boolean_only(tmp_path):
    for value in ("maybe", "2", 1, "0"):
        with pytest.raises(ConfigError, match="'download' must be true or false"):
            TrainConfig.from_flat({"download": value})
    for value, expected in ((True, True), ("yes", True), ("Off", False), ("false", False)):
        assert TrainConfig.from_flat({"download": value}).data.download is expected
    config = tmp_path / "c.yaml"
    config.write_text("download: maybe\n")
    with pytest.raises(ConfigError, match="must be true or false, got 'maybe'"):
        peradapt.training_config(config=config)


@pytest.mark.parametrize("left", ["partition.json", "partition.json.tmp"])
def test_a_run_killed_while_writing_its_start_says_so(left, tmp_path, capsys, monkeypatch, home):
    run = tmp_path / "run"
    run.mkdir()
    (run / left).write_text("{")
    for args in (["train", "--resume", "--out", str(run)], ["eval", "--run", str(run)]):
        err = expect_refusal(args, capsys, monkeypatch, "stopped while it wrote its start", untouched=run)
        assert "without --resume" in err.replace("no --resume", "without --resume")
        assert "not a peradapt run directory" not in err


def test_a_method_setting_given_to_another_method_is_refused(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    run = tmp_path / "run"
    args = tiny_args(fmnist_dir, run, "--feddyn-alpha", "0.1", "--method", "perada")
    expect_refusal(args, capsys, monkeypatch, "--feddyn-alpha", "feddyn", "--method perada", untouched=run)
    config = tmp_path / "c.yaml"
    config.write_text("method: fedavg\nfeddyn_alpha: 0.1\n")
    with pytest.raises(ConfigError, match="--feddyn-alpha is a setting of feddyn: --method fedavg"):
        peradapt.training_config(config=config)
    # What a preset sets for its own method is not the user's: another --method runs on the preset without it.
    baseline = peradapt.training_config(preset="perada-cifar10", method="ditto")
    assert baseline.method.method == "ditto" and baseline.data.kd_data == "cifar100"
    assert peradapt.training_config(preset="perada-cifar10").method_settings.frozen_bn_statistics == "local"
    # compare gives each method its own, and refuses a key no setting has rather than dropping it.
    config.write_text("kd_stepz: 3\n")
    with pytest.raises(ConfigError, match="unknown setting 'kd_stepz'"):
        peradapt.compare(["fedavg"], seeds=1, out=tmp_path / "compare", config=config, quiet=True)
    assert not (tmp_path / "compare").exists()
    # An old config.json holds every method's settings: they still load.
    saved = TrainConfig(method=TrainConfig().method).to_dict()
    saved["method"]["feddyn_alpha"] = 0.01
    assert TrainConfig.from_dict(saved).method.method == "perada"


@pytest.mark.parametrize(
    ("name", "text", "needles"),
    [
        ("bad.yaml", "a: [1,\nb: 2\n", ["bad.yaml: line 3, column 1: expected ',' or ']'"]),
        ("tab.yaml", "a:\n\t- 1\n", ["tab.yaml: line 2, column 1:"]),
        ("bad.json", '{"a": 1,}', ["bad.json: line 1, column 9: Expecting property name"]),
    ],
)
def test_a_config_file_error_is_one_line_with_its_place(name, text, needles, tmp_path, capsys, monkeypatch):
    path = tmp_path / name
    path.write_text(text)
    err = expect_user_error(["train", "--config", str(path)], capsys, monkeypatch, *needles)
    assert len(err.strip().splitlines()) == 1


def test_a_config_directory_is_called_one(tmp_path, capsys, monkeypatch):
    expect_user_error(["train", "--config", str(tmp_path)], capsys, monkeypatch, "is a directory")


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--budget", "client-samples:²"], ["--budget must be client-samples:N", "got 'client-samples:²'"]),
        (["--validation-fraction", "0.3"], ["--validation-fraction", "give --eval-split validation"]),
    ],
)
def test_values_that_would_fail_or_do_nothing_are_refused(extra, needles, tmp_path, fmnist_dir, capsys, monkeypatch):
    run = tmp_path / "run"
    expect_refusal(tiny_args(fmnist_dir, run, *extra), capsys, monkeypatch, *needles, untouched=run)


def test_a_config_files_value_of_the_wrong_type_names_the_file(tmp_path, fmnist_dir, capsys, monkeypatch):
    config = tmp_path / "c.yaml"
    config.write_text("lr: abc\n")
    run = tmp_path / "run"
    needles = ["setting 'lr' must be float, got 'abc'", f"--lr came from --config {config}"]
    expect_refusal(["train", "--config", str(config), "--out", str(run)], capsys, monkeypatch, *needles, untouched=run)
    compared = ["compare", "--methods", "fedavg", "--config", str(config), "--out", str(run)]
    expect_refusal(compared, capsys, monkeypatch, *needles, untouched=run)


def test_methods_of_an_unknown_name_speaks_of_the_method(capsys, monkeypatch):
    err = expect_user_error(["methods", "foo"], capsys, monkeypatch, "unknown method 'foo': use one of", "fedavg")
    assert "--method" not in err


def test_eval_of_a_validation_run_says_it_scores_validation_splits(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    run = tmp_path / "run"
    code, out, err = run_cli(
        tiny_args(fmnist_dir, run, "--rounds", "1", "--eval-split", "validation"), capsys, monkeypatch
    )
    assert code == 0, err
    for printed in (out, run_cli(["eval", "--run", str(run)], capsys, monkeypatch)[1]):
        assert "local-validation" in printed and "global-validation" in printed, printed
        assert "no test image" in " ".join(printed.split()) and "validation set" in printed  # the title wraps
        assert not any(word in printed for word in ("local-test", "global-test", "test set")), printed
    assert json.loads((run / "eval.json").read_text())["eval_split"] == "validation"


NO_TRANSFORMERS = textwrap.dedent(
    """
    import sys

    class NoTransformers:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] == "transformers":
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    sys.meta_path.insert(0, NoTransformers())
    """
)
TRANSFORMERS_HINT = (
    "peradapt needs transformers, which PEFT imports and this environment lacks: pip install 'peradapt[hf]'"
)


def without_transformers(code: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`code` run by a Python in which transformers cannot be imported."""
    script = NO_TRANSFORMERS + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=cwd)


def test_without_transformers_the_adapters_name_the_install():
    """`import peradapt` imports no adapter (nor PEFT, which imports transformers); the adapters, which every command
    that trains or loads a model imports, say what is missing, as an ImportError to Python code."""
    done = without_transformers(
        """
        import peradapt
        try:
            from peradapt import inject_adapters
        except ImportError as error:
            print(error)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == TRANSFORMERS_HINT and done.stderr == ""


@pytest.mark.parametrize("command", [["train", "--rounds", "1"], ["methods"], ["eval", "--run", "nowhere"]])
def test_without_transformers_a_command_prints_the_hint_as_its_one_error_line(command, tmp_path):
    done = without_transformers(
        f"""
        import sys
        sys.argv = ["peradapt", *{command!r}]
        from peradapt.cli import main
        main()
        """,
        cwd=tmp_path,
    )
    assert done.returncode == 2
    assert done.stderr == f"error: {TRANSFORMERS_HINT}\n", done.stderr
