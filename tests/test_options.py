"""Every command's options are declared settings (peradapt.options): their flags, API keywords and checks come from
one declaration each."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer.main

import peradapt
from peradapt import cli
from peradapt.errors import ConfigError
from peradapt.options import (
    COMMAND_OPTIONS,
    CompareOptions,
    EvalOptions,
    ExportOptions,
    InfoOptions,
    PretrainOptions,
    TrainOptions,
)


def command_flags(name: str) -> set[str]:
    """The flags the command line gives command `name`, as click holds them."""
    cli.add_setting_flags()
    group = typer.main.get_command(cli.app)
    command = group.commands[name]  # type: ignore[attr-defined]
    return {flag for parameter in command.params for flag in [*parameter.opts, *parameter.secondary_opts]}


@pytest.mark.parametrize("options_class", COMMAND_OPTIONS, ids=lambda options: options.command)
def test_every_declared_option_is_a_flag_of_its_command(options_class):
    flags = command_flags(options_class.command)
    declared = {declared.flag_name for declared in options_class.declared()}
    assert declared and declared <= flags, declared - flags


def test_a_switch_on_by_default_is_turned_off_by_its_no_flag():
    assert "--no-anchors" in command_flags("compare")
    assert CompareOptions(methods="a", anchors="no").anchors is False


def test_values_are_turned_into_their_types_and_checked_when_made(tmp_path):
    options = EvalOptions(run=str(tmp_path), ood_limit="3", ood="fmnist-c")
    assert options.run == tmp_path and options.ood_limit == 3
    with pytest.raises(ConfigError, match="--ood-limit must be at least 1, got 0"):
        EvalOptions(run=tmp_path, ood="fmnist-c", ood_limit=0)
    with pytest.raises(ConfigError, match="--ood-limit needs --ood NAME"):
        EvalOptions(run=tmp_path, ood_limit=5)
    with pytest.raises(ConfigError, match="setting 'run' must be a path, got 3"):
        EvalOptions(run=3)
    with pytest.raises(ConfigError, match="unknown --test 'anova': use t, wilcoxon"):
        CompareOptions(methods="fedavg", test="anova")
    with pytest.raises(ConfigError, match="--clients and --private choose what --push-to-hub uploads"):
        ExportOptions(run=tmp_path, out=tmp_path / "x", private=True)
    with pytest.raises(ConfigError, match="info takes --run DIR or --preset NAME"):
        InfoOptions()
    with pytest.raises(ConfigError, match="unknown --preset 'nosuch'"):
        InfoOptions(preset="nosuch")
    with pytest.raises(ConfigError, match="--resume continues with the run's saved settings"):
        TrainOptions(resume=True, preset="perada-cifar10")


def test_from_values_refuses_unknown_and_missing_options(tmp_path):
    with pytest.raises(ConfigError, match="unknown eval option 'odd': use ood, ood_limit, run, weights"):
        EvalOptions.from_values({"run": tmp_path, "odd": 1})
    with pytest.raises(ConfigError, match="export needs --out"):
        ExportOptions.from_values({"run": tmp_path})
    assert ExportOptions.from_values({"run": tmp_path, "out": "x", "push-to-hub": "a/b"}).push_to_hub == "a/b"


def test_a_repeatable_option_joins_a_list():
    assert CompareOptions(methods=["fedavg", "ditto"]).method_names == ["fedavg", "ditto"]
    assert ExportOptions(run="r", out="o", push_to_hub="a/b", clients=[0, 3]).clients == "0,3"


def test_split_keeps_the_options_and_hands_on_the_settings():
    options, settings = CompareOptions.split(None, {"methods": "fedavg", "seeds": 2, "rounds": 3, "out": "x"})
    assert (options.seeds, options.out, settings) == (2, Path("x"), {"rounds": 3})
    given = CompareOptions(methods="fedavg")
    assert CompareOptions.split(given, {"rounds": 3}) == (given, {"rounds": 3})


def test_an_api_function_takes_the_options_object_or_its_fields_not_both(tmp_path):
    options = EvalOptions(run=tmp_path)
    with pytest.raises(ConfigError, match="eval takes EvalOptions or options, not both"):
        peradapt.evaluate(options, ood="fmnist-c")


def test_pretrain_options_are_checked_before_anything_is_read(tmp_path):
    with pytest.raises(ConfigError, match="--batch-size must be at least 2, got 1: the backbone's BatchNorm"):
        PretrainOptions(batch_size=1)
    with pytest.raises(ConfigError, match="--limit-samples must be at least 3"):
        PretrainOptions(limit_samples=2)
    with pytest.raises(ConfigError, match="--weight-decay must not be negative"):
        PretrainOptions(weight_decay=-1.0)
    with pytest.raises(ConfigError, match=r"give the weights a \.safetensors name"):
        PretrainOptions(out=tmp_path / "w.json")
    with pytest.raises(ConfigError, match=r"--out .* is a directory"):
        PretrainOptions(out=tmp_path)
    with pytest.raises(ConfigError, match="makes timm backbones"):
        peradapt.pretrain(backbone="hf:some/model", out=tmp_path / "w.safetensors", quiet=True)
    assert not list(tmp_path.iterdir())


def test_the_command_line_says_the_same_as_the_api(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["peradapt", "pretrain", "--weight-decay", "-1", "--out", str(tmp_path / "w")])
    with pytest.raises(SystemExit) as exited:
        cli.main()
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    with pytest.raises(ConfigError) as raised:
        peradapt.pretrain(weight_decay=-1, out=tmp_path / "w", quiet=True)
    assert err == f"error: {raised.value}"
    assert not list(tmp_path.iterdir())
