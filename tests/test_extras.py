"""Messages that name an optional extra print it as the user must type it (`pip install 'peradapt[dp]'`), and
every extra they name exists."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10: flwr's dependency
    import tomli as tomllib

import peradapt

from .test_cli import expect_refusal, tiny_args

PACKAGE = Path(peradapt.__file__).parent
HINT = re.compile(r"pip install 'peradapt\[([\w,-]+)\]'")


def extras() -> set[str]:
    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]
    return set(project["optional-dependencies"])


def test_every_extra_a_message_names_exists():
    named = {
        (path.name, extra)
        for path in PACKAGE.rglob("*.py")
        for match in HINT.finditer(path.read_text())
        for extra in match[1].split(",")
    }
    assert named, "no message names an extra"
    assert {extra for _, extra in named} <= extras(), named


def block(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    """As if `modules` were not installed (and peradapt's modules that import them not yet imported)."""
    for name in list(sys.modules):
        if name.startswith("peradapt.flower") or any(name == m or name.startswith(m + ".") for m in modules):
            monkeypatch.delitem(sys.modules, name)
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ImportError


@pytest.mark.parametrize(
    ("extra", "modules", "flags"),
    [
        ("dp", ["opacus"], ["--dp-noise", "1.0", "--dp-clip", "1.0", "--adapter", "lora", "--method", "ditto"]),
        ("flower", ["flwr"], ["--engine", "flower"]),
        ("flower", ["ray"], ["--engine", "flower"]),
    ],
)
def test_a_missing_extra_is_named_in_the_one_error_line(
    extra, modules, flags, tmp_path, fmnist_dir, capsys, monkeypatch, home
):
    if "ray" in modules:  # Ray is looked for, not imported: hide it from importlib's search
        import importlib.util

        find_spec = importlib.util.find_spec
        monkeypatch.setattr(
            importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a)
        )
    block(monkeypatch, *modules)
    run = tmp_path / "run"
    expect_refusal(
        tiny_args(fmnist_dir, run, *flags), capsys, monkeypatch, f"pip install 'peradapt[{extra}]'", untouched=run
    )


def test_transformers_missing_names_the_hf_extra(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "vit"}')
    block(monkeypatch, "transformers")
    run = tmp_path / "run"
    args = tiny_args(fmnist_dir, run, "--backbone", f"hf:{model}")
    expect_refusal(args, capsys, monkeypatch, "pip install 'peradapt[hf]'", untouched=run)
