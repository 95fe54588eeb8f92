"""docs/METHOD_API.md, the reference of what a method may use: generated from the code's docstrings, signatures and
the comments beside its attributes (`make method-api-doc` writes it; a test checks that it is current).

Each entry names an object by the module a method imports it from; the text is the object's own: a function's
signature and docstring, a class's docstring, its attributes (type and default from the declaration, meaning from
the comment beside or above it, or a setting's help) and its methods. An attribute or function without a
description is an error, so the reference has none.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import textwrap
import tokenize
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from peradapt import adapters, config, data, methods, seeds, settings
from peradapt.adapters import state
from peradapt.compute import trainer
from peradapt.methods import base
from peradapt.rundir import store


@dataclass(frozen=True)
class Entry:
    """One object of the reference: `name` as `module` exports it (the import path shown). For a class, `members`
    are the attributes and methods shown, in that order; None: every attribute declared in its body and every public
    function defined there, in source order. `source`: the module that defines a type alias (its comment is there).
    `arguments`: a class whose attributes' comments describe a function's keyword arguments (`setting`'s are
    `Setting`'s)."""

    module: ModuleType
    name: str
    members: tuple[str, ...] | None = None
    source: ModuleType | None = None
    arguments: type | None = None


@dataclass(frozen=True)
class Section:
    title: str
    intro: str
    entries: tuple[Entry, ...]


@dataclass(frozen=True)
class Attribute:
    """An attribute as its class's body declares it."""

    name: str
    annotation: str
    value: str | None  # the default's source text; None: none
    comment: str


SECTIONS = (
    Section(
        "The method class",
        "A method subclasses `Method`, or `LocalSGDMethod` when its client update is a few runs of local SGD, or a "
        "built-in method's class (`method_class`).",
        (
            Entry(methods, "Method"),
            Entry(methods, "LocalSGDMethod", ("client_steps",)),
            Entry(base, "ClientSteps", source=base),
            Entry(methods, "register"),
            Entry(methods, "method_class"),
        ),
    ),
    Section(
        "What a method is given and returns",
        "",
        (
            Entry(methods, "MethodContext"),
            Entry(
                config,
                "MethodConfig",
                (
                    "lr",
                    "local_epochs",
                    "local_steps",
                    "personal_epochs",
                    "personal_lr",
                    "lam",
                    "batch_size",
                    "aggregation",
                    "train_clients",
                    "scope",
                ),
            ),
            Entry(methods, "ClientUpdate"),
            Entry(data, "ClientData", ("client_id", "train", "test")),
            Entry(adapters, "AdapterState", source=state),
            Entry(adapters, "average_states"),
        ),
    ),
    Section(
        "Local training",
        "Every training step on client data goes through one loop, `LocalTrainer.descend`; `run` is it on the task "
        "loss, or DP-SGD under --dp-noise.",
        (
            Entry(
                trainer,
                "SGDJob",
                ("start", "data", "epochs", "lr", "seed", "anchor", "lam", "steps", "groups", "correction"),
            ),
            Entry(trainer, "ParameterGroup"),
            Entry(trainer, "SGDResult", source=trainer),
            Entry(trainer, "Objective"),
            Entry(
                trainer,
                "LocalTrainer",
                (
                    "model",
                    "batch_size",
                    "samples_trained",
                    "elements_trained",
                    "count_trained",
                    "run",
                    "run_steps",
                    "sgd",
                    "descend",
                    "steps_of",
                    "minibatches",
                    "loss",
                    "unchecked_loss",
                    "logits",
                    "score",
                ),
            ),
        ),
    ),
    Section(
        "The model",
        "",
        (Entry(adapters, "AdaptedModel", ("trainable_parameters", "num_trainable", "state", "load_state")),),
    ),
    Section("Client state", "", (Entry(store, "ClientStore", ("get", "put")),)),
    Section(
        "Settings",
        "",
        (
            Entry(settings, "setting", arguments=settings.Setting),
            Entry(settings, "Search", ("log", "uniform", "integers", "choices")),
        ),
    ),
    Section("Seeds", "", (Entry(seeds, "derive_seed"),)),
)


def reference_markdown() -> str:
    """docs/METHOD_API.md: every hook and helper a method may use (`make method-api-doc` writes it)."""
    intro = (
        "# The method API\n\n"
        "Generated from the code's docstrings and signatures by `make method-api-doc` "
        "(`peradapt/methods/reference.py`): do not edit by hand. Every hook a method defines and every helper it may "
        "call, with its import path, its signature and what it returns. [ADDING_A_METHOD.md](ADDING_A_METHOD.md) "
        "shows them at work in two methods; [SETTINGS.md](SETTINGS.md) lists the shared settings.\n\n"
    )
    contents = "".join(f"- [{s.title}](#{s.title.lower().replace(' ', '-')})\n" for s in SECTIONS)
    parts = [intro + contents]
    for section in SECTIONS:
        parts.append(f"## {section.title}\n\n" + (f"{section.intro}\n\n" if section.intro else ""))
        parts += [_entry(entry) for entry in section.entries]
    parts.append(_seed_phases())
    return "\n".join(part.rstrip("\n") + "\n" for part in parts)


def _entry(entry: Entry) -> str:
    obj = getattr(entry.module, entry.name)
    where = f"`from {entry.module.__name__} import {entry.name}`"
    if entry.source is not None:
        alias = _module_attributes(entry.source)[entry.name]
        return f"### `{entry.name}`\n\n{where}\n\n```python\n{entry.name} = {alias.value}\n```\n\n{alias.comment}\n"
    if inspect.isclass(obj):
        return _class(obj, where, entry.members)
    text = f"### `{entry.name}`\n\n{where}\n\n{_function(obj, entry.name)}"
    if entry.arguments is not None:  # each keyword argument as the signature declares it, meant as the class says
        described = _class_attributes(entry.arguments)
        text += "\n" + "".join(
            _bullet(
                Attribute(
                    p.name, p.annotation, None if p.default is p.empty else repr(p.default), described[p.name].comment
                ),
                entry.arguments.__name__,
            )
            for p in inspect.signature(obj).parameters.values()
            if p.kind is p.KEYWORD_ONLY
        )
    return text


def _class(cls: type, where: str, members: tuple[str, ...] | None) -> str:
    attributes = _class_attributes(cls)
    names = members or (*attributes, *(n for n, f in vars(cls).items() if _is_public_function(n, f)))
    shown = [attributes[n] for n in names if n in attributes]
    lines = [f"### `{cls.__name__}`\n\n{where}\n\n{_docstring(cls, cls.__name__)}\n"]
    if shown:
        lines.append("\n" + "".join(_bullet(attribute, cls.__name__) for attribute in shown))
    for name in names:
        if name not in attributes:
            lines.append(f"\n#### `{cls.__name__}.{name}`\n\n{_function(getattr(cls, name), name)}")
    return "".join(lines)


def _function(function: Callable[..., Any], name: str) -> str:
    """A function's signature as its source writes it, marked abstract or a classmethod, and its docstring."""
    decorators = "@abstractmethod\n" if getattr(function, "__isabstractmethod__", False) else ""
    if inspect.ismethod(function):  # bound to its class: a classmethod
        decorators += "@classmethod\n"
    return f"```python\n{decorators}def {name}{_signature(function)}\n```\n\n{_docstring(function, name)}\n"


def _signature(function: Callable[..., Any]) -> str:
    """`(a: int, *, b: str = 'x') -> T`, each annotation as written (they are strings: `from __future__ import
    annotations`), not quoted as `inspect.Signature` shows them."""
    signature = inspect.signature(function)
    parts, starred = [], False
    for parameter in signature.parameters.values():
        if parameter.kind is parameter.KEYWORD_ONLY and not starred:
            parts.append("*")
        starred = starred or parameter.kind in (parameter.KEYWORD_ONLY, parameter.VAR_POSITIONAL)
        prefix = {parameter.VAR_POSITIONAL: "*", parameter.VAR_KEYWORD: "**"}.get(parameter.kind, "")
        text = prefix + parameter.name
        if parameter.annotation is not parameter.empty:
            text += f": {parameter.annotation}"
        if parameter.default is not parameter.empty:
            text += f" = {parameter.default!r}"
        parts.append(text)
    returned = "" if signature.return_annotation is signature.empty else f" -> {signature.return_annotation}"
    return f"({', '.join(parts)}){returned}"


def _docstring(obj: Any, name: str) -> str:
    """Its own docstring (not a base class's, nor the one dataclasses make up from the fields)."""
    doc = obj.__doc__
    if doc is None or (inspect.isclass(obj) and doc.startswith(f"{obj.__name__}(")):
        raise ValueError(f"{name} has no docstring: the method reference needs one")
    return inspect.cleandoc(doc)


def _bullet(attribute: Attribute, owner: str) -> str:
    """One attribute of class `owner`: its name, type, default and meaning."""
    if not attribute.comment:
        raise ValueError(f"{owner}.{attribute.name} has no comment: the method reference needs one")
    default = "required" if attribute.value is None else f"default `{attribute.value}`"
    return f"- `{attribute.name}` (`{attribute.annotation}`, {default}): {attribute.comment}\n"


def _is_public_function(name: str, value: Any) -> bool:
    return inspect.isfunction(value) and not name.startswith("_")


def _class_attributes(cls: type) -> dict[str, Attribute]:
    """The attributes `cls`'s own body declares (`name: T` or `name: T = value`), by name in source order; a
    dataclass field's default as the dataclass holds it, a setting's meaning its help."""
    fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
    holds_settings = any(f.metadata for f in fields.values())  # `setting` fields (whose types need not resolve)
    declared = {d.name: d for d in settings.declared_settings(cls)} if holds_settings else {}
    found = {}
    for attribute in _declarations(textwrap.dedent(inspect.getsource(cls))):
        field = fields.get(attribute.name)
        value = attribute.value if field is None else _field_default(field)
        comment = declared[attribute.name].help_text() if attribute.name in declared else attribute.comment
        found[attribute.name] = dataclasses.replace(attribute, value=value, comment=comment)
    return found


@functools.cache
def _module_attributes(module: ModuleType) -> dict[str, Attribute]:
    """The names a module's top level assigns, with their comments."""
    return {a.name: a for a in _declarations(inspect.getsource(module))}


def _field_default(field: dataclasses.Field) -> str | None:
    if field.default is not dataclasses.MISSING:
        return repr(field.default)
    if field.default_factory is not dataclasses.MISSING:
        return f"{field.default_factory.__name__}()"
    return None


def _declarations(source: str) -> Iterator[Attribute]:
    """The assignments of the body of `source`'s class (or of the module, if it is no class), each with the comment
    lines right above it and the comment at the end of its first line."""
    tree = ast.parse(source)
    body = tree.body[0].body if isinstance(tree.body[0], ast.ClassDef) else tree.body
    comments = _comments(source)
    for node in body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name, annotation = node.target.id, node.annotation
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name, annotation = node.targets[0].id, None
        else:
            continue
        if isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value) == "ClassVar":
            annotation = annotation.slice
        above, row = [], node.lineno - 1
        while row in comments and comments[row][1]:
            above.insert(0, comments[row][0])
            row -= 1
        after = [comments[node.lineno][0]] if node.lineno in comments and not comments[node.lineno][1] else []
        value = ast.unparse(node.value) if node.value is not None else None
        text = "" if annotation is None else ast.unparse(annotation)
        yield Attribute(name, text, value, " ".join([*above, *after]))


def _comments(source: str) -> dict[int, tuple[str, bool]]:
    """By line number: the comment on it, and whether the line holds nothing else."""
    lines = source.splitlines()
    found = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            row, column = token.start
            found[row] = (token.string.lstrip("#").strip(), not lines[row - 1][:column].strip())
    return found


def _seed_phases() -> str:
    """The seed phases `peradapt.seeds` defines, by value."""
    phases = sorted((v, n) for n, v in vars(seeds).items() if n.isupper() and isinstance(v, int))
    listed = ", ".join(f"`{name}` = {value}" for value, name in phases)
    return f"The phases `{seeds.__name__}` defines: {listed}.\n"
