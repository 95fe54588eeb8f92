"""The seed phases (`peradapt.seeds`): each a distinct value, and the only phases any module of the package passes
to `derive_seed`, so that no two kinds of draw can share a random stream unnoticed."""

from __future__ import annotations

import ast

from peradapt import seeds

from .test_layers import modules

PHASES = {name: value for name, value in vars(seeds).items() if name.isupper() and isinstance(value, int)}


def foreign_phases(source: str) -> list[str]:
    """The arguments of `derive_seed` calls in `source` that are a phase not of `peradapt.seeds`: a number, or an
    upper-case name that is no phase there (a constant defined elsewhere)."""
    calls = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)]
    return [
        ast.unparse(argument)
        for call in calls
        if named(call.func) == "derive_seed"
        for argument in call.args
        if isinstance(argument, ast.Constant) or (named(argument).isupper() and named(argument) not in PHASES)
    ]


def named(node: ast.expr) -> str:
    """`x` of `x` or `a.x`; empty for any other expression."""
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def test_no_two_phases_share_a_value():
    assert len(set(PHASES.values())) == len(PHASES), PHASES


def test_every_module_draws_from_the_phases_of_seeds_only():
    found = {name: phases for name, path in modules().items() if (phases := foreign_phases(path.read_text()))}
    assert found == {}


def test_the_checker_sees_a_phase_of_its_own():
    assert foreign_phases("derive_seed(seed, 14)\nseeds.derive_seed(seed, round_index, OWN)") == ["14", "OWN"]
    assert foreign_phases("derive_seed(seed, client, seeds.LOCAL)\nderive_seed(seed, ALA)\nderive_seed(*seeds)") == []
