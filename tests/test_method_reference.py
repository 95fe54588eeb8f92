"""docs/METHOD_API.md, the reference of what a method may use, is generated from the code and current; every class
attribute and hook of `Method` is in it; docs/ADDING_A_METHOD.md quotes SCAFFOLD as its code is (issue 37, item 3)."""

from __future__ import annotations

import inspect
import io
import re
import tokenize
from pathlib import Path

from peradapt.methods import Method
from peradapt.methods.reference import reference_markdown

ROOT = Path(__file__).resolve().parents[1]
API_DOC = ROOT / "docs" / "METHOD_API.md"
GUIDE = ROOT / "docs" / "ADDING_A_METHOD.md"
SCAFFOLD = ROOT / "peradapt" / "methods" / "scaffold.py"
CODE_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)
SIGNIFICANT = (tokenize.NAME, tokenize.OP, tokenize.STRING, tokenize.NUMBER, tokenize.COMMENT)


def tokens(code: str) -> list[str]:
    """The code's names, operators, literals and comments in order: its text up to layout (the excerpts are
    dedented, and ruff formats Markdown's code blocks as their own modules)."""
    return [t.string for t in tokenize.generate_tokens(io.StringIO(code).readline) if t.type in SIGNIFICANT]


def test_the_method_api_doc_is_current():
    assert API_DOC.read_text(encoding="utf-8") == reference_markdown(), "run `make method-api-doc`"


def test_every_class_attribute_and_hook_of_a_method_is_described():
    reference = reference_markdown()
    section = reference[reference.index("### `Method`") : reference.index("### `LocalSGDMethod`")]
    for name in Method.__annotations__:  # the ClassVars: name, summary, settings_class, default_scope, ...
        assert re.search(rf"^- `{name}` \(`[^`]+`, [^)]+\): \S", section, re.MULTILINE), name
    hooks = [name for name, value in vars(Method).items() if inspect.isfunction(value) and not name.startswith("_")]
    assert {"client_update", "server_update", "payload", "server_state", "local_job"} <= set(hooks)
    for name in hooks:
        assert f"#### `Method.{name}`\n\n```python\n" in section, name


def test_the_reference_gives_signatures_and_import_paths():
    reference = reference_markdown()
    assert "def client_update(self, client: ClientData, global_state: AdapterState, seed: int) -> ClientUpdate" in (
        reference
    )
    assert "`from peradapt.compute.trainer import Objective`" in reference
    assert "- `correction` (`AdapterState | None`, default `None`): " in reference
    assert "- `exclusive_minimum` (`bool`, default `False`): " in reference
    assert "def get(self, client_id: int, key: str) -> AdapterState | None" in reference


def test_the_scaffold_walk_through_quotes_its_code_as_it_is():
    guide = GUIDE.read_text(encoding="utf-8")
    walk_through = guide[guide.index("## A stateful method: SCAFFOLD") : guide.index("## Reference")]
    excerpts = CODE_BLOCK.findall(walk_through)
    assert len(excerpts) >= 6
    code = tokens(SCAFFOLD.read_text(encoding="utf-8"))
    for excerpt in map(tokens, excerpts):
        assert any(code[i : i + len(excerpt)] == excerpt for i in range(len(code))), " ".join(excerpt)
    assert "(METHOD_API.md)" in guide
