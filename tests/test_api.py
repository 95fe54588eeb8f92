"""The Python API does what the commands do, and the package's import graph has no cycles."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

import peradapt
from peradapt.errors import ConfigError, RunError

from .test_cli import finished_run, results, run_cli, tiny_args  # noqa: F401  (finished_run: a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

PACKAGE = Path(peradapt.__file__).parent


def settings_of(args: list[str]) -> dict:
    """`train` flags as API settings: `--kd-steps 4` -> kd_steps="4"."""
    flags = args[1:]
    return {flag[2:].replace("-", "_"): value for flag, value in zip(flags[::2], flags[1::2], strict=True)}


def test_train_evaluate_export_as_the_commands_do(finished_run, tmp_path, fmnist_dir, capsys, monkeypatch, home):  # noqa: F811
    run = tmp_path / "api"
    report = peradapt.train(**settings_of(tiny_args(fmnist_dir, run)), quiet=True)
    assert report.to_json() == json.loads((run / "report.json").read_text())
    assert results(run) == results(finished_run)  # the command line's run, file for file

    evaluation = peradapt.evaluate(run)
    code, _, err = run_cli(["eval", "--run", str(finished_run)], capsys, monkeypatch)
    assert code == 0, err
    assert evaluation == json.loads((finished_run / "eval.json").read_text())

    out = peradapt.export(run, tmp_path / "adapters")
    assert sorted(p.name for p in (out / "clients").iterdir()) == ["0", "1", "2", "3"]
    assert (out / "backbone.safetensors").is_file()

    rows = peradapt.report([run], tmp_path / "report")
    assert any(path.name == "summary.json" for path in rows)


def test_a_train_config_or_settings_and_resume(tmp_path, fmnist_dir, home):
    config = peradapt.training_config(**settings_of(tiny_args(fmnist_dir, tmp_path / "r", "--rounds", "1")))
    assert isinstance(config, peradapt.TrainConfig) and config.federation.rounds == 1
    with pytest.raises(ConfigError, match="not both"):
        peradapt.train(config, rounds=2)
    peradapt.train(config, quiet=True)
    report = peradapt.train(resume=True, out=tmp_path / "r", rounds=2, quiet=True)  # one more round
    assert report.rounds == 2
    with pytest.raises(RunError, match="lr"):
        peradapt.training_config(resume=True, out=str(tmp_path / "r"), lr=0.5)


def test_mistakes_raise_the_command_lines_message_and_write_nothing(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    args = tiny_args(fmnist_dir, tmp_path / "bad", "--method", "nosuch")
    with pytest.raises(ConfigError) as raised:
        peradapt.train(**settings_of(args), quiet=True)
    _, _, err = run_cli(args, capsys, monkeypatch)
    assert err.strip() == f"error: {raised.value}"
    assert not (tmp_path / "bad").exists()
    with pytest.raises(ConfigError, match="unknown pretrain option 'epoch'"):
        peradapt.pretrain(epoch=1)
    with pytest.raises(RunError, match="not a peradapt run"):
        peradapt.personalize_new_client(tmp_path, "3")


def module_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The peradapt modules `path` imports anywhere (functions too), but under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    type_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
        for statement in block.body
        for node in ast.walk(statement)
    }
    names = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("peradapt"):
            # `from package import module` needs the module; `from module import name`, the module
            names.update(
                f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                for alias in node.names
            )
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names if alias.name.startswith("peradapt"))
    return names


def test_the_import_graph_has_no_cycles():
    modules = {
        ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): path
        for path in PACKAGE.rglob("*.py")
    }
    graph = {
        module: {name for name in module_imports(path, modules) if name in modules and name != module}
        for module, path in modules.items()
    }
    visiting, done, cycles = [], set(), []

    def visit(module: str) -> None:
        if module in done:
            return
        if module in visiting:
            cycles.append([*visiting[visiting.index(module) :], module])
            return
        visiting.append(module)
        for target in sorted(graph[module]):
            visit(target)
        visiting.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
    assert not cycles, "\n".join(" -> ".join(cycle) for cycle in cycles)
