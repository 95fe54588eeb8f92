"""Property tests: any value of any numeric setting either is refused in one `error:` line (exit 2, no traceback,
nothing written) or gets as far as the run directory with every input checked. Hypothesis draws the values:
huge, tiny, negative, non-finite, not numbers at all.

To stay fast a valid value stops where the run directory would be made (a stand-in for its lock), after the session
(data, partition, backbone, method) is built: what any value can break before then, it has broken.
"""

from __future__ import annotations

import inspect
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import peradapt.federation.lifecycle as lifecycle
from peradapt.cli import add_setting_flags, app
from peradapt.config import listed_settings, setting_owners

from .test_cli import run_cli, tiny_args

pytestmark = pytest.mark.usefixtures("one_thread")


class ReachedTheRunDirectory(Exception):
    """Every input was valid: the run directory is about to be made."""


class StopAtTheRunDirectory:
    def __init__(self, run_dir, *, exclusive):
        self.run_dir = run_dir

    def __enter__(self):
        raise ReachedTheRunDirectory

    def __exit__(self, *exc_info):
        return False


def numeric_flags(command: str) -> list[str]:
    """The flags of `peradapt COMMAND` that take a number, read as Typer reads them: from the parameters of the
    command's function (the same on every Typer release, whether or not it vendors click)."""
    add_setting_flags()  # as `main` does before it runs train or compare
    function = next(info.callback for info in app.registered_commands if info.callback.__name__ == command)
    flags = []
    for parameter in inspect.signature(function, eval_str=True).parameters.values():
        value, option = typing.get_args(parameter.annotation)
        numbers = {int, float} & {value, *typing.get_args(value)}
        # In `Annotated[..., typer.Option("--name")]` the first name stands where a default would
        names = [name for name in (option.default, *(option.param_decls or ())) if str(name).startswith("--")]
        if numbers:
            flags.append(names[0] if names else "--" + parameter.name.replace("_", "-"))
    return sorted(flags)


def numeric_settings() -> dict[str, list[str]]:
    """The `train` flags of the settings declared with a number type, each with the arguments under which it
    counts: for a method's own setting, a --method that takes it (any other method refuses it by name)."""
    flags = {}
    for declared, _ in listed_settings():
        # lam and concurrent_clients take a word too (`auto`): NUMBER_IN_STRING
        if declared.flag and declared.base_type in ("int", "float") and not (declared.auto or declared.none_word):
            owners = setting_owners(declared.name)
            flags[declared.flag_name] = ["--method", owners[0]] if owners else []
    return flags


def test_every_numeric_flag_is_a_numeric_setting():
    assert sorted(numeric_settings()) == numeric_flags("train")


NUMBERS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["0", "1", "2", "-1", "1e400", "-1e400", "1e-300", "100000000", "nan", "inf", "-inf", "1.5"]),
    st.text(alphabet="0123456789.-+eE_xaninf", max_size=6),
)
# string settings that hold a number
NUMBER_IN_STRING = {
    "--lam": "{}",
    "--concurrent-clients": "{}",
    "--partition": "dir:{}",
    "--partition ": "classes:{}",
    "--partition  ": "dir-balanced:{}",
}


def outcome(args, capsys, monkeypatch) -> str:
    """'refused' after checking the refusal's form, or 'valid'."""
    try:
        code, _, err = run_cli(args, capsys, monkeypatch)
    except ReachedTheRunDirectory:
        return "valid"
    assert code == 2, err
    errors = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and err.strip().endswith(errors[0]), err
    assert "Traceback" not in err
    return "refused"


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_any_number_for_any_train_setting(data, tmp_path, fmnist_dir, capsys, monkeypatch, home):
    monkeypatch.setattr(lifecycle, "RunLock", StopAtTheRunDirectory)
    numeric = numeric_settings()
    flag = data.draw(st.sampled_from([*numeric, *NUMBER_IN_STRING]), label="flag")
    value = data.draw(NUMBERS, label="value")
    if flag in NUMBER_IN_STRING:
        value = NUMBER_IN_STRING[flag].format(value)
    out = tmp_path / "run"
    outcome(tiny_args(fmnist_dir, out, *numeric.get(flag, []), flag.strip(), value), capsys, monkeypatch)
    assert not out.exists()
