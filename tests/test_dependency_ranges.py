"""The command line under the lowest and the newest Typer that pyproject.toml admits (issue 34).

A user's `pip install peradapt` gets the newest Typer (0.26 and later vendor click and changed their internals); the
test extras pin an older one through Flower (`typer < 0.21`), so the rest of the suite runs on that alone. Here each
end of the declared range is installed by pip into a folder of its own (with what it requires, at the versions pip
picks for it: the newest click for the lowest Typer) that stands first on PYTHONPATH of a subprocess, which runs
every command's `--help`, a mistake, and `train` of one tiny round. pip reads the package registry (its cache spares
the download the next time). `.ci/run` runs the installed `peradapt` command itself, in a fresh venv.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib.metadata import requires
from pathlib import Path

import pytest
from packaging.version import Version  # pytest's own dependency

from peradapt.cli import app

from .test_cli import tiny_args

ROOT = Path(__file__).resolve().parents[1]


def declared_typer() -> str:
    """The Typer requirement of the base dependencies as installed from pyproject.toml, e.g. `typer>=0.16`."""
    return next(r for r in requires("peradapt") or () if re.match(r"typer\b", r) and ";" not in r)


def lowest_typer() -> str:
    match = re.fullmatch(r"typer\s*>=\s*([\d.]+)(,.*)?", declared_typer())
    assert match, f"the Typer requirement has no lower bound to test: {declared_typer()}"
    return match[1]


@pytest.fixture(scope="module", params=["lowest", "newest"])
def typer_folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """A folder holding one end of the declared Typer range and what it requires, and that Typer's version."""
    folder = tmp_path_factory.mktemp(f"typer-{request.param}")
    requirement = f"typer=={lowest_typer()}" if request.param == "lowest" else declared_typer()
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    installed = subprocess.run([*command, "--target", str(folder), requirement], capture_output=True, text=True)
    assert installed.returncode == 0, f"pip could not install {requirement}:\n{installed.stderr}"
    return requirement, folder


# Runs `peradapt.cli.main` on each command line given (a JSON list), in one process: [exit code, stdout, stderr] each.
COMMAND_LINES = """
import contextlib, io, json, sys
from peradapt.cli import main
results = []
for args in json.loads(sys.argv[1]):
    sys.argv, out, err = ["peradapt", *args], io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main()
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
    results.append([code, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


def peradapt(folder: Path, home: Path, *command_lines: list[str]) -> list[tuple[int, str, str]]:
    """Each command line's exit code, stdout and stderr, run in a Python that imports Typer from `folder`."""
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(ROOT)]), "PERADAPT_HOME": str(home)}
    environment["COLUMNS"] = "160"
    command = [sys.executable, "-c", COMMAND_LINES, json.dumps(command_lines)]
    finished = subprocess.run(command, capture_output=True, text=True, env=environment)
    assert finished.returncode == 0, finished.stderr
    return [tuple(result) for result in json.loads(finished.stdout)]


def typer_in(folder: Path) -> str:
    """The version of the Typer that a subprocess given `folder` imports."""
    code = "import typer, sys; print(typer.__version__); print(typer.__file__)"
    environment = {**os.environ, "PYTHONPATH": str(folder)}
    lines = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment).stdout
    version, path = lines.split()
    assert Path(path).is_relative_to(folder), f"Typer came from {path}, not from {folder}"
    return version


def test_every_command_runs_under_each_end_of_the_typer_range(typer_folder, tmp_path, fmnist_dir, pretrained_home):
    requirement, folder = typer_folder
    version = typer_in(folder)
    if requirement.startswith("typer=="):
        assert Version(version) == Version(lowest_typer())

    commands = [info.name or info.callback.__name__ for info in app.registered_commands]
    run = tmp_path / "run"
    one_round = tiny_args(fmnist_dir, run, "--rounds", "1", "--eval-every", "1", "--log", "none")
    helps = [[name, "--help"] for name in commands]
    overview, *helps, mistake, trained = peradapt(
        folder, pretrained_home, ["--help"], *helps, ["train", "--rounds", "two"], one_round
    )

    assert overview[0] == 0, f"typer {version}: {overview[2]}"
    for name, (code, out, err) in zip(commands, helps, strict=True):
        assert name in overview[1], f"typer {version}: `peradapt --help` does not list {name}"
        assert code == 0 and "--help" in out, f"typer {version}, {name} --help: {err}"
        assert "Traceback" not in out + err
    shown = dict(zip(commands, (out for _, out, _ in helps), strict=True))
    assert "--methods" in shown["compare"] and "--clients-per-round" in shown["compare"]  # train's settings too
    assert "needs peradapt[hf-data]" in shown["train"]  # help texts print as written, not as markup

    code, _, err = mistake
    assert code == 2 and err.startswith("error:") and "--rounds" in err, f"typer {version}: {err}"
    assert len(err.strip().splitlines()) == 1, err

    code, out, err = trained
    assert code == 0, f"typer {version}: {err}"
    report = json.loads((run / "report.json").read_text())
    assert report["rounds"] == 1 and len(report["clients"]) == 4
    assert "run directory:" in out
