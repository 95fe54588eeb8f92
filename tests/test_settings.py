"""Every setting declared once (issue 24): flags, help panels, config keys, checks, `peradapt methods` and
docs/SETTINGS.md all come from the declarations; a method owns its settings, and the other methods refuse them."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from peradapt.config import (
    METHODS,
    TrainConfig,
    check_method_settings,
    find_setting,
    listed_settings,
)
from peradapt.errors import ConfigError
from peradapt.methods.fedavg import FedAvg
from peradapt.methods.feddyn import FedDynSettings
from peradapt.options import settings_markdown
from peradapt.settings import Setting, declared_settings, setting

from .test_cli import crash_after_round, expect_refusal, results, run_cli, tiny_args

pytestmark = pytest.mark.usefixtures("one_thread")

SETTINGS_DOC = Path(__file__).resolve().parents[1] / "docs" / "SETTINGS.md"
BOX = re.compile(r"[│╭╮╰╯─]+")


def help_words(capsys, monkeypatch, *command: str) -> str:
    """`peradapt COMMAND --help` as one line of words: rich wraps the help texts inside framed panels."""
    code, out, err = run_cli([*command, "--help"], capsys, monkeypatch)
    assert code == 0, err
    return " ".join(BOX.sub(" ", out).split())


def words(text: str) -> str:
    return " ".join(text.split())


# ---------------------------------------------------------------- declarations, flags, help


def test_the_settings_table_is_the_generated_one():
    assert SETTINGS_DOC.read_text(encoding="utf-8") == settings_markdown(), "run `make settings-doc`"


def test_every_help_text_prints_as_written_with_its_default_in_its_panel(capsys, monkeypatch):
    shown = help_words(capsys, monkeypatch, "train")
    for declared, panel in listed_settings():
        if not declared.flag:
            continue
        text = words(declared.help_text())
        shown_default = declared.default is not None or declared.shown_default or declared.none_word
        if declared.base_type != "bool" and shown_default:
            text += f" [default: {words(declared.default_text())}]"
        assert text in shown, declared.name
        assert f" {panel} " in shown
    # rich markup would eat these brackets
    for bracketed in ("needs peradapt[hf-data])", "'peradapt[tensorboard]', 'peradapt[wandb]'", "[default: --lr]"):
        assert bracketed in shown
    assert "[default: 0.05 (SGD); ViTs: 0.001 (AdamW)]" in help_words(capsys, monkeypatch, "pretrain")


def test_the_panels_come_in_order_and_a_methods_own_settings_under_its_name(capsys, monkeypatch):
    shown = help_words(capsys, monkeypatch, "train")
    panels = ["Data", "Backbone and adapters", "Federation", "Method", "Distillation", "Authors'-code settings"]
    panels += ["Privacy", "Output and logging", "Method: feddyn", "Method: pfedme, pfedbred", "Method: pfedbred"]
    at = [shown.index(f" {panel} --") for panel in panels]
    assert at == sorted(at)
    feddyn = shown[shown.index(" Method: feddyn ") :]
    assert feddyn.index("--feddyn-alpha") < feddyn.index("--feddyn-client-alpha") < feddyn.index(" Method: ", 5)
    authors = shown[shown.index(" Authors'-code settings ") :]
    for flag in ("--kd-mode", "--kd-rounds", "--frozen-bn", "--resize", "--normalization", "--kd-normalization"):
        assert flag in authors[: authors.index(" Privacy ")]


def test_bounds_and_choices_are_refused_in_one_message_per_kind():
    def refusal(value, **declared) -> str:
        check = Setting(help="", group=None, name="x", type=declared.pop("type", "float"), **declared)
        with pytest.raises(ConfigError) as caught:
            check.validate(value)
        return str(caught.value)

    assert refusal(0, type="int", minimum=1) == "--x must be at least 1, got 0"
    assert refusal(-1.0, minimum=0.0) == "--x must not be negative, got -1.0"
    assert refusal(0.0, minimum=0.0, exclusive_minimum=True) == "--x must be positive, got 0.0"
    assert refusal(1.0, minimum=0.0, maximum=1.0, exclusive_maximum=True) == "--x must be in [0, 1), got 1.0"
    assert refusal(9, type="int", minimum=1, maximum=8, why="no more") == "--x must be between 1 and 8, got 9: no more"
    assert refusal("y", type="str", choices=("a", "b")) == "unknown --x 'y': use a, b"
    assert refusal(2, type="int", choices=(1, 3)) == "--x must be 1 or 3, got 2"
    assert "finite" in refusal(float("inf"))
    Setting(help="", group=None, name="x", type="float | None", minimum=1.0).validate(None)  # None: the default


# ---------------------------------------------------------------- a method owns its settings


def test_a_method_takes_its_own_settings_and_saves_them_in_its_section():
    config = TrainConfig.from_flat({"method": "feddyn", "feddyn-alpha": 0.1})
    assert config.method_settings == FedDynSettings(feddyn_alpha=0.1)
    saved = config.to_dict()
    assert saved["method"]["feddyn_alpha"] == 0.1 and "mu" not in saved["method"]
    assert TrainConfig.from_dict(json.loads(json.dumps(saved))).to_flat() == config.to_flat()
    assert "feddyn_alpha" not in TrainConfig.from_flat({"method": "ditto"}).to_flat()


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--feddyn-alpha", "0.1", "--method", "ditto"], "--feddyn-alpha is a setting of feddyn: --method ditto does"),
        (["--inner-steps", "2"], "--inner-steps is a setting of pfedme, pfedbred: --method perada does not take it"),
        (["--beta", "2", "--method", "fedavg"], "--beta is a setting of pfedme, pfedbred: --method fedavg does"),
        (["--beta", "2", "--method", "fedprox"], "--beta is no setting of --method fedprox any more: use --fedprox-"),
        (["--personal-part", "bn", "--method", "perada"], "--personal-part is a setting of fedalt, fedsim"),
        (["--feddyn-alpha", "0", "--method", "ditto"], "--feddyn-alpha must be positive, got 0.0"),  # value first
    ],
)
def test_a_setting_the_method_does_not_take_is_refused_by_name(
    extra, needle, tmp_path, fmnist_dir, capsys, monkeypatch, home
):
    run = tmp_path / "run"
    expect_refusal(tiny_args(fmnist_dir, run, *extra), capsys, monkeypatch, needle, untouched=run)


def test_a_config_file_with_another_methods_setting_is_refused(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    config = tmp_path / "settings.yaml"
    config.write_text("method: ditto\nmu: 0.5\n")
    run = tmp_path / "run"
    needle = "--mu is a setting of fedprox-li: --method ditto does not take it"
    expect_refusal(tiny_args(fmnist_dir, run, "--config", str(config)), capsys, monkeypatch, needle, untouched=run)


@dataclass
class MomentumSettings:
    server_momentum: float = setting(0.9, help="FedAvgM: server momentum β.", minimum=0.0, maximum=1.0, symbol="β")


class FedAvgM(FedAvg):
    """A method registered after the built-in ones (as a plugin's will be)."""

    name = "fedavgm-test"
    summary = "FedAvg with server momentum (Hsu et al. 2019)"
    settings_class = MomentumSettings


@pytest.fixture
def late_method(monkeypatch):
    check_method_settings(MomentumSettings)
    monkeypatch.setitem(METHODS, FedAvgM.name, FedAvgM)


def test_a_method_registered_later_brings_its_flags_keys_and_description(late_method, capsys, monkeypatch):
    shown = help_words(capsys, monkeypatch, "train")
    assert "Method: fedavgm-test --server-momentum FLOAT FedAvgM: server momentum β. [default: 0.9]" in shown
    config = TrainConfig.from_flat({"method": FedAvgM.name, "server_momentum": 0.5})
    assert config.method_settings == MomentumSettings(server_momentum=0.5)
    with pytest.raises(ConfigError, match="--server-momentum is a setting of fedavgm-test: --method fedavg does"):
        TrainConfig.from_flat({"method": "fedavg", "server_momentum": 0.5})
    with pytest.raises(ConfigError, match=r"--server-momentum must be in \[0, 1\], got 2.0"):
        TrainConfig.from_flat({"method": FedAvgM.name, "server_momentum": 2})
    code, out, err = run_cli(["methods"], capsys, monkeypatch)
    assert code == 0 and FedAvgM.name in out and "--server-momentum (β) [0.9]" in out, err


def test_a_method_setting_may_not_reuse_a_key():
    @dataclass
    class Clashing:
        lr: float = setting(0.1, help="a second --lr")

    @dataclass
    class Twice:
        feddyn_alpha: float = setting(0.5, help="a second --feddyn-alpha")

    for settings_class in (Clashing, Twice):
        with pytest.raises(TypeError, match="key"):
            check_method_settings(settings_class)


# ---------------------------------------------------------------- peradapt methods, info --preset


def test_methods_lists_every_method_and_one_in_full(capsys, monkeypatch):
    code, out, err = run_cli(["methods"], capsys, monkeypatch)
    assert code == 0, err
    text = " ".join(out.split())
    for name, cls in METHODS.items():
        assert name in out and cls.default_scope in out
        for declared in declared_settings(cls.settings_class):
            assert declared.flag_name in text
    assert "--feddyn-alpha (α) [0.01]" in text
    code, out, err = run_cli(["methods", "pfedbred"], capsys, monkeypatch)
    assert code == 0, err
    for needle in ("Shi et al.", "--prior", "lg, meg, mh, mh-code", "--inner-steps", "K", "--beta", "β", "server mean"):
        assert needle in out
    code, _, err = run_cli(["methods", "fedsomething"], capsys, monkeypatch)
    assert code == 2 and "fedsomething" in err and "perada-nokd" in err


def test_info_shows_a_presets_settings_with_their_help_and_symbols(capsys, monkeypatch):
    code, out, err = run_cli(["info", "--preset", "perada-cifar10"], capsys, monkeypatch)
    assert code == 0, err
    text = " ".join(out.split())
    assert "--lam (λ)" in text and "Proximal strength" in text and find_setting("kd_rounds") is not None


# ---------------------------------------------------------------- runs written before methods owned their settings

# `TrainConfig().to_dict()["method"]` before this change: all 35 settings of every method, in one section.
OLD_METHOD_SECTION = {
    "method": "perada",
    "scope": None,
    "personal_part": None,
    "local_epochs": 10,
    "local_steps": None,
    "personal_epochs": 10,
    "body_epochs": 1,
    "lam": 1.0,
    "lam_auto": False,
    "lr": 0.01,
    "personal_lr": None,
    "batch_size": 64,
    "ft_epochs": None,
    "inner_steps": 3,
    "beta": 1.0,
    "mu": 1.0,
    "aggregation": None,
    "am": False,
    "train_clients": None,
    "prior": "mh",
    "prior_lr": 0.01,
    "prior_eta": 0.05,
    "apfl_alpha": 0.5,
    "alpha_lr": None,
    "ft_steps": None,
    "feddyn_alpha": 0.01,
    "feddyn_client_alpha": "uniform",
    "perfedavg_variant": "hf",
    "perfedavg_delta": 0.001,
    "ala_sample": 80.0,
    "ala_layers": 1,
    "ala_lr": 1.0,
    "mtl_omega": "mean",
    "personal_head_init": "zero",
    "frozen_bn": "eval",
}


def in_the_old_shape(run: Path) -> None:
    """Rewrite the run's config.json as runs wrote it before: every method's settings in the `method` section."""
    path = run / "config.json"
    saved = json.loads(path.read_text())
    saved["config"]["method"] = {**OLD_METHOD_SECTION, **saved["config"]["method"]}
    assert len(saved["config"]["method"]) == 35
    path.write_text(json.dumps(saved, indent=2))


def test_a_run_saved_in_the_old_shape_resumes_evaluates_and_exports(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    """A run of fedprox-li (μ = 0.5) whose config.json holds every method's settings, as before, resumes to the
    files of an uninterrupted run; the other methods' settings are ignored, as they always were."""
    args = ["--method", "fedprox-li", "--mu", "0.5", "--rounds", "2", "--limit-samples", "400", "--eval-every", "1"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    code, _, err = run_cli(tiny_args(fmnist_dir, whole, *args), capsys, monkeypatch)
    assert code == 0, err
    crash_after_round(1, tiny_args(fmnist_dir, resumed, *args), capsys, monkeypatch)
    in_the_old_shape(resumed)
    assert TrainConfig.from_dict(json.loads((resumed / "config.json").read_text())["config"]).method_settings.mu == 0.5
    code, _, err = run_cli(["train", "--out", str(resumed), "--resume"], capsys, monkeypatch)
    assert code == 0, err
    finished = results(resumed)
    assert {name: data for name, data in finished.items() if name != "config.json"} == {
        name: data for name, data in results(whole).items() if name != "config.json"
    }
    in_the_old_shape(resumed)  # the finished run's files, as an old finished run has them
    for run in (whole, resumed):
        code, _, err = run_cli(["eval", "--run", str(run)], capsys, monkeypatch)
        assert code == 0, err
    assert (resumed / "eval.json").read_bytes() == (whole / "eval.json").read_bytes()
    code, _, err = run_cli(["export", "--run", str(resumed), "--out", str(tmp_path / "export")], capsys, monkeypatch)
    assert code == 0, err
    assert (tmp_path / "export" / "global").is_dir()
