"""Settings declared once: a dataclass field made by `setting(...)` carries everything peradapt says about it.

A setting's flat key is its field name (the flag is `--the-name-with-dashes`, the config-file key the name with
either), its type the field's annotation (bool, int, float, str or Path, optionally `| None`), its default the
field's (`REQUIRED`: none, the option must be given).
`setting()` adds the rest in the field's metadata: the help text, the help panel (`group`), inclusive or exclusive
bounds or a list of choices, why a bound is where it is, a metavar, what a `None` default means, the paper's
symbol, and the range `compare --tune` searches it over (`Search`). From that one declaration come every command's
flags and their help panels (`peradapt.cli`), the keys of config files and of a run's config.json and their checks
(`peradapt.config`), the commands' own options objects and their checks (`peradapt.options`), the search spaces of
`peradapt.commands.tuning`, `peradapt info --preset`, `peradapt methods` and the tables in docs/SETTINGS.md.

Why dataclasses and click (through Typer) rather than pydantic: the configs already are dataclasses that library
code reads as plain attributes (`config.method.lam`), and `field(metadata=...)` is the standard library's place for
what a field means; a method's settings are one more small dataclass in the method's own file. Validation here is a
handful of kinds (a finite float32 number, bounds, choices, a setting's own check), each with one message; pydantic
would add a dependency and its own error wording, which the one-line `error: --flag ...` messages would have to
translate back. Typer reads a command's options from its function's signature, which `peradapt.cli` makes from the
declarations of whatever methods are registered when the command line is read.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peradapt.errors import ConfigError

# Settings reach torch as float32, which holds no larger magnitude (torch refuses to convert one).
FLOAT32_MAX = 3.4028234663852886e38
TYPES = ("bool", "int", "float", "str", "Path")
REQUIRED: Any = dataclasses.MISSING  # the default of an option that must be given (`peradapt compare --methods`)
_METADATA_KEY = "peradapt.setting"


@dataclass(frozen=True)
class Search:
    """The values `compare --tune` tries for a setting: a range of numbers, uniform or log-uniform (`log`, `uniform`),
    a range of whole numbers (`integers`) or a list of values (`choices`). `peradapt.commands.tuning` hands it to
    Optuna's sampler as the matching distribution; the declaration checks that it lies within the setting's own
    bounds."""

    low: float | None = None
    high: float | None = None
    log_scale: bool = False  # sampled uniformly in log space: learning rates, strengths spanning decades
    integer: bool = False
    values: tuple[Any, ...] = ()  # a list to choose from (then no low and high)

    @classmethod
    def log(cls, low: float, high: float) -> Search:
        """Log-uniform in [low, high] (0 < low < high): learning rates, strengths spanning decades."""
        return cls(low, high, log_scale=True)

    @classmethod
    def uniform(cls, low: float, high: float) -> Search:
        """Uniform in [low, high]."""
        return cls(low, high)

    @classmethod
    def integers(cls, low: int, high: int) -> Search:
        """The whole numbers low, ..., high, for an int setting."""
        return cls(low, high, integer=True)

    @classmethod
    def choices(cls, *values: Any) -> Search:
        """One of `values` (the settings a paper sweeps), of the setting's type."""
        return cls(values=values)

    def text(self) -> str:
        """As a table shows it: "log [0.0005, 0.05]", "[0.1, 0.7]", "1, 2, ... 5", "one of 0.7, 0.9"."""
        if self.values:
            return "one of " + ", ".join(map(str, self.values))
        assert self.low is not None and self.high is not None
        if self.integer:
            return f"{_number(self.low)}, ..., {_number(self.high)}"
        return f"{'log ' if self.log_scale else ''}[{_number(self.low)}, {_number(self.high)}]"

    def ends(self) -> tuple[Any, ...]:
        """The values that bound it: both ends of a range, every value of a list."""
        return self.values or (self.low, self.high)


@dataclass(frozen=True)
class Setting:
    """One setting as declared (`setting`), with the name, type and default of its field."""

    help: str  # may hold `{choices}`: the choices at the time the text is shown (e.g. the registered methods)
    group: str | None  # the help panel; None for a method's settings, shown under the methods that take them
    minimum: float | None = None  # the least value taken (None: no bound)
    maximum: float | None = None  # the greatest value taken (None: no bound)
    exclusive_minimum: bool = False  # `minimum` itself is refused: a value must be more than it ("> 0")
    exclusive_maximum: bool = False  # `maximum` itself is refused: a value must be less than it ("[0, 1)")
    choices: Collection[Any] = ()  # may be a live collection, e.g. the method registry's keys
    why: str = ""  # said after a refused value: what a value outside the bounds would break
    metavar: str | None = None  # the value's name in help ("N"; default: the type's)
    shown_default: str | None = None  # the default as help shows it; for a None default, what None means
    symbol: str = ""  # the paper's symbol (α, λ, K, ...)
    flag: bool = True  # False: a config key without a flag of its own (lam_auto, set by `--lam auto`)
    repeatable: bool = False  # the flag may be given several times; a list is joined with commas
    auto: str | None = None  # the value may be the word `auto`, which sets this bool setting instead
    none_word: str | None = None  # a word that flags and files may give for None (`--concurrent-clients auto`)
    check: Callable[[Any], object] | None = None  # a rule of this setting's own that bounds/choices cannot say
    search: Search | None = None  # what `compare --tune` tries; None: the setting is not tuned
    # False: no result depends on it (where a run writes, on which device, what it logs, how fast it goes), so that
    # `--resume`, the trials of one study and `compare`'s reuse of a run all let it differ
    outcome: bool = True
    name: str = ""
    type: str = ""  # "int", "float | None", ...
    default: Any = None

    @property
    def flag_name(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def base_type(self) -> str:
        return self.type.removesuffix(" | None")

    @property
    def optional(self) -> bool:
        return self.type.endswith(" | None")

    @property
    def required(self) -> bool:
        """It has no default: the flag must be given."""
        return self.default is REQUIRED

    def help_text(self) -> str:
        """The help with `{choices}` filled in from the choices as they are now."""
        return self.help.replace("{choices}", " | ".join(map(str, self.choices)))

    def default_text(self) -> str:
        """The default in words: what the declaration says it is, `on`/`off` for a switch, else the value."""
        if self.shown_default is not None:
            return self.shown_default
        if self.required:
            return "required"
        if self.default is None and self.none_word is not None:
            return self.none_word
        if self.base_type == "bool":
            return "on" if self.default else "off"
        return "none" if self.default is None else str(self.default)

    def requirement(self) -> str:
        """What the bounds ask, as an error says it: "be at least 1", "not be negative", "be in [0, 1)"."""
        low, high = self.minimum, self.maximum
        if low is not None and high is not None:
            if self.base_type == "int":  # a range of whole numbers, both ends included
                return f"be between {_number(low)} and {_number(high)}"
            left, right = "(" if self.exclusive_minimum else "[", ")" if self.exclusive_maximum else "]"
            return f"be in {left}{_number(low)}, {_number(high)}{right}"
        if low is not None:
            if self.exclusive_minimum:
                return "be positive" if low == 0 else f"be more than {_number(low)}"
            return "not be negative" if low == 0 else f"be at least {_number(low)}"
        if high is not None:
            return f"be less than {_number(high)}" if self.exclusive_maximum else f"be at most {_number(high)}"
        return ""

    def allowed(self) -> str:
        """The values it takes, as a table shows them: "≥ 1", "> 0", "[0, 1)", "eval, train"."""
        if self.choices:
            return ", ".join(map(str, self.choices))
        low, high = self.minimum, self.maximum
        if low is not None and high is not None:
            left, right = "(" if self.exclusive_minimum else "[", ")" if self.exclusive_maximum else "]"
            return f"{left}{_number(low)}, {_number(high)}{right}"
        if low is not None:
            return f"{'>' if self.exclusive_minimum else '≥'} {_number(low)}"
        if high is not None:
            return f"{'<' if self.exclusive_maximum else '≤'} {_number(high)}"
        return ""

    def validate(self, value: Any) -> None:
        """Refuse `value` (of the setting's type, or None) in one line naming the flag: a float that torch cannot
        hold, a value out of bounds or not among the choices, or one the setting's own `check` refuses."""
        if value is None:
            return
        flag = self.flag_name
        if isinstance(value, float) and not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
            raise ConfigError(
                f"{flag} must be a finite number no larger than {FLOAT32_MAX:.4g} in size (training computes in "
                f"float32), got {value}"
            )
        if self.minimum is not None or self.maximum is not None:
            low_ok = self.minimum is None or (value > self.minimum if self.exclusive_minimum else value >= self.minimum)
            high_ok = self.maximum is None or (
                value < self.maximum if self.exclusive_maximum else value <= self.maximum
            )
            if not (low_ok and high_ok):
                why = f": {self.why}" if self.why else ""
                raise ConfigError(f"{flag} must {self.requirement()}, got {value}{why}")
        if self.choices and value not in self.choices:
            allowed = [str(choice) for choice in self.choices]
            if self.base_type == "str":
                raise ConfigError(f"unknown {flag} '{value}': use {', '.join(allowed)}")
            raise ConfigError(f"{flag} must be {' or '.join(allowed)}, got {value}")
        if self.check is not None:
            self.check(value)

    def coerce(self, value: Any) -> Any:
        """`value` as read from a flag or a YAML/JSON file, turned into the setting's type."""
        key = self.name
        if self.none_word is not None and isinstance(value, str) and value.strip().lower() == self.none_word:
            value = None
        if value is None:
            if not self.optional:
                raise ConfigError(f"setting '{key}' may not be empty")
            return None
        if self.repeatable and isinstance(value, (list, tuple)):  # `--log a --log b`, or a list in a config file
            value = ",".join(map(str, value))
        base = self.base_type
        try:
            if base == "bool":
                return _boolean(value)
            if base == "int":
                if isinstance(value, float) and not value.is_integer():
                    raise ValueError
                return int(value)
            if base == "float":
                return float(value)
            if base == "Path":
                if isinstance(value, (bool, int, float)) or not str(value):  # `run: 3` in a file is no path
                    raise ValueError(value)
                return Path(value)
            return str(value)
        except (TypeError, ValueError):
            kind = {"bool": "true or false", "Path": "a path"}.get(base, base)
            word = self.none_word or ("auto" if self.auto else None)
            if word is not None:  # a flag that takes a word is read as text: the flag names the mistake
                raise ConfigError(f"{self.flag_name} must be {kind} or {word}, got {value!r}") from None
            raise ConfigError(f"setting '{key}' must be {kind}, got {value!r}") from None

    def is_json_type(self, value: Any) -> bool:
        """Whether `value`, read from JSON, is of this setting's type as config.json holds it (a float setting takes
        a whole number too; bools are no numbers)."""
        if value is None:
            return self.optional
        base = self.base_type
        if base == "bool" or isinstance(value, bool):
            return base == "bool" and isinstance(value, bool)
        kinds = {"int": int, "float": (int, float), "str": str, "Path": str}
        return isinstance(value, kinds[base])


@dataclass
class NoSettings:
    """The settings of a method that has none of its own."""


def setting(
    default: Any,
    *,
    help: str,
    group: str | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: bool = False,
    exclusive_maximum: bool = False,
    choices: Collection[Any] = (),
    why: str = "",
    metavar: str | None = None,
    shown_default: str | None = None,
    symbol: str = "",
    flag: bool = True,
    repeatable: bool = False,
    auto: str | None = None,
    none_word: str | None = None,
    check: Callable[[Any], object] | None = None,
    search: Search | None = None,
    outcome: bool = True,
) -> Any:
    """A dataclass field that declares a setting (see `Setting` for what each argument means)."""
    declaration = Setting(
        help=help,
        group=group,
        minimum=minimum,
        maximum=maximum,
        exclusive_minimum=exclusive_minimum,
        exclusive_maximum=exclusive_maximum,
        choices=choices,
        why=why,
        metavar=metavar,
        shown_default=shown_default,
        symbol=symbol,
        flag=flag,
        repeatable=repeatable,
        auto=auto,
        none_word=none_word,
        check=check,
        search=search,
        outcome=outcome,
    )
    return dataclasses.field(default=default, metadata={_METADATA_KEY: declaration})


@functools.cache  # a class's fields do not change; flags, config files and checks ask often
def declared_settings(cls: type) -> tuple[Setting, ...]:
    """The settings a dataclass declares, inherited ones first, in field order."""
    hints = typing.get_type_hints(cls)
    found = []
    for field in dataclasses.fields(cls):
        declaration = field.metadata.get(_METADATA_KEY)
        if declaration is None:
            continue
        kind = _type_name(hints[field.name])
        if kind.removesuffix(" | None") not in TYPES:
            raise TypeError(f"setting {cls.__name__}.{field.name}: type {kind} is not one of {', '.join(TYPES)}")
        declared = dataclasses.replace(declaration, name=field.name, type=kind, default=field.default)
        check_search(declared, f"setting {cls.__name__}.{field.name}")
        found.append(declared)
    return tuple(found)


def check_search(declared: Setting, where: str) -> None:
    """Refuse a search that `declared` cannot take (TypeError, a mistake of the declaration, said where it is): a
    range for a setting that is no number, real numbers for an int setting, a log range reaching 0, an empty range,
    or an end or value outside the setting's bounds and choices."""
    search = declared.search
    if search is None:
        return
    kind = declared.base_type
    if not search.values:
        takes = {"int": "Search.integers", "float": "Search.log or Search.uniform"}.get(kind, "Search.choices")
        if kind not in ("int", "float") or (kind == "int") != search.integer:
            raise TypeError(f"{where}: {declared.type} settings are searched with {takes}")
        assert search.low is not None and search.high is not None
        if not search.low < search.high or (search.log_scale and search.low <= 0):
            raise TypeError(f"{where}: the search range {search.text()} is empty or reaches 0 on a log scale")
    for value in search.ends():
        try:
            declared.validate(declared.coerce(value))
        except ConfigError as error:
            raise TypeError(f"{where}: the search {search.text()} leaves the setting's own values: {error}") from None


def validate_settings(instance: Any) -> None:
    """Check every declared setting of a settings dataclass instance (bounds, choices, its own check)."""
    for declared in declared_settings(type(instance)):
        declared.validate(getattr(instance, declared.name))


def markdown_table(rows: Iterable[tuple[Setting, str]]) -> str:
    """A Markdown table of settings with the help panel each is shown in: flag, type, default, values taken, what
    `compare --tune` tries, panel, help, symbol."""
    lines = [
        "| flag | type | default | values | tuned over | panel | help | symbol |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for d, panel in rows:
        cells = [f"`{d.flag_name}`" if d.flag else f"(`{d.name}`, no flag)"]
        cells += [d.type, d.default_text(), d.allowed(), d.search.text() if d.search else "", panel, d.help_text()]
        cells.append(d.symbol)
        lines.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    """Text in a Markdown table cell: no column breaks, and `<class>` shown, not read as HTML."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace("\n", " ")


# The words a bool setting takes as text (an API call's string, a quoted YAML value): YAML 1.1's own booleans.
# Anything else (`maybe`, `2`, `0`) is refused: read as false, a typo would silently turn a switch off.
BOOLEAN_WORDS = {"true": True, "yes": True, "on": True, "false": False, "no": False, "off": False}


def _boolean(value: Any) -> bool:
    """`value` as a bool setting: a bool, or one of `BOOLEAN_WORDS` in any case; ValueError for anything else."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in BOOLEAN_WORDS:
        return BOOLEAN_WORDS[value.strip().lower()]
    raise ValueError(value)


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def _type_name(hint: Any) -> str:
    """`int`, `float | None`, ... for an annotation (`Optional[int]` and `int | None` alike)."""
    arguments = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in arguments:
        others = [argument for argument in arguments if argument is not type(None)]
        return " | ".join(_type_name(other) for other in others) + " | None"
    return getattr(hint, "__name__", str(hint))
