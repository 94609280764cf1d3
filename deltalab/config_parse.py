"""Typed configuration from YAML data: the one parser behind the run config (`deltalab train`),
the study spec (`deltalab study`) and the task settings (`deltalab eval`).

A configuration is a frozen dataclass whose fields are typed with bool, int, float, str,
`X | None`, `tuple[X, ...]` (a list of any length), `tuple[X, Y]` (a list of that length),
`dict[str, Any]` (a mapping with string keys, kept as YAML data) and `Any` (taken as it is). A value comes from a file or
from a `name=value` word, the value read as YAML; `coerce` checks it against its field's type
(an int where a float is expected becomes a float, a list becomes a tuple) and every error is
one line naming the dotted key, what was expected and what was given. An unknown key is refused
with the closest valid one (`check_keys`).

Written here rather than taken from pydantic or tyro: the three users need exactly these types,
their range checks stay the dataclasses' own, and importing this module loads only PyYAML (the
commands' help and error paths must not wait for anything heavy).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import re
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

from deltalab.errors import closest

__all__ = [
    "check_keys",
    "coerce",
    "describe",
    "field_docs",
    "plain",
    "read_value",
    "require",
    "require_choice",
    "type_hints",
]


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    """The resolved field types of the dataclass `cls`."""
    return typing.get_type_hints(cls)


def describe(hint: Any) -> str:
    """What a value of type `hint` looks like, for error messages ("an int or null")."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        inner = [a for a in args if a is not type(None)]
        return " or ".join(describe(a) for a in inner) + " or null"
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {_plural(args[0])}"
        return f"a list of {len(args)} {_plural(args[0])}"
    if origin is dict:
        return "a mapping with string keys"
    names = {bool: "a bool", int: "an int", float: "a finite number", str: "a string"}
    return names.get(hint, str(hint))


def _plural(hint: Any) -> str:
    plurals = {bool: "bools", int: "ints", float: "numbers", str: "strings"}
    return plurals.get(hint, describe(hint).removeprefix("a ") + "s")


def plain(key: str, value: Any) -> Any:
    """A deep copy of `value` as YAML/JSON data (tuples become lists); TypeError naming `key`
    for anything else (a mapping with a key that is not a string, an object)."""
    if isinstance(value, Mapping):
        for name in value:
            if not isinstance(name, str):
                raise TypeError(f"{key} keys must be strings, got {name!r}")
        return {name: plain(f"{key}.{name}", item) for name, item in value.items()}
    if isinstance(value, list | tuple):
        return [plain(f"{key}[{i}]", item) for i, item in enumerate(value)]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"{key} must hold YAML data, got {type(value).__name__} {value!r}")


def coerce(key: str, value: Any, hint: Any) -> Any:
    """`value` as the type `hint` (an int as a float, a list as a tuple), or a TypeError
    `<key> must be <describe(hint)>, got <type> <value>`; an item of a list is named
    `key[i]`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        try:
            return coerce(key, value, inner)
        except TypeError:
            if typing.get_origin(inner) is tuple and isinstance(value, list | tuple):
                raise  # names the item at fault; otherwise the error names null too
    elif hint is bool or hint is str:
        if isinstance(value, hint):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        # YAML 1.1 (PyYAML) reads `3e-3` without a dot as the string "3e-3".
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    elif origin is tuple:
        if isinstance(value, list | tuple):
            items = args[:1] * len(value) if args[1:] == (Ellipsis,) else args
            if len(items) == len(value):
                return tuple(
                    coerce(f"{key}[{i}]", v, a)
                    for i, (v, a) in enumerate(zip(value, items, strict=True))
                )
    elif origin is dict:
        if isinstance(value, Mapping):
            return plain(key, value)
    else:
        raise TypeError(f"{key} has an unsupported type {hint!r}")
    raise TypeError(f"{key} must be {describe(hint)}, got {type(value).__name__} {value!r}")


def require(ok: bool, key: str, requirement: str, value: Any) -> None:
    """ValueError `<key> must be <requirement>, got <value>` unless `ok`."""
    if not ok:
        raise ValueError(f"{key} must be {requirement}, got {value!r}")


def require_choice(key: str, value: Any, choices: Iterable[str]) -> None:
    """ValueError naming `key`, the choices and the closest one unless `value` is a choice."""
    choices = list(choices)
    if value not in choices:
        raise ValueError(
            f"{key} must be one of {choices}, got {value!r}{closest(str(value), choices)}"
        )


def check_keys(
    data: Mapping[str, Any],
    known: Iterable[str],
    prefix: str = "",
    what: str = "key",
    where: str = "",
    listing: str | None = None,
) -> None:
    """ValueError for the first key of `data` not in `known`: `unknown <what> '<prefix><key>'
    <where> (did you mean '<prefix><closest>'?); <listing> [...known]`, the listing by default
    `the <what>s are`."""
    known = list(known)
    for name in data:
        if name not in known:
            dotted = f"{prefix}{name}"
            suggestion = closest(dotted, [f"{prefix}{k}" for k in known])
            listing = listing or f"the {what}s are"
            raise ValueError(f"unknown {what} {dotted!r}{where}{suggestion}; {listing} {known}")


def read_value(key: str, text: str, hint: Any) -> Any:
    """The value of a `key=text` word, read as YAML; a string field (`str`) takes the text as
    written unless quoted (YAML would cut `runs/exp #2` at the comment or read `2024` as a
    number). ValueError naming `key` for text that is not YAML."""
    import yaml

    stripped = text.strip()
    if hint is str and stripped[:1] not in ("'", '"'):
        return stripped
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ValueError(f"{key}: cannot read {text!r} as YAML: {error}") from error


def field_docs(cls: type) -> dict[str, str]:
    """{field: description} from the `name: text` lines of the dataclass's docstring (a text
    continued on indented lines), and of its base classes' for the fields it does not
    describe."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass) and "__doc__" in vars(klass):
            docs |= _own_field_docs(klass)
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    names = {f.name for f in dataclasses.fields(cls)}
    docs: dict[str, str] = {}
    current = None
    for line in inspect.cleandoc(cls.__doc__ or "").splitlines():
        match = re.match(r"(\w+): (.*)", line)
        if match and match[1] in names:
            current = match[1]
            docs[current] = match[2].strip()
        elif current and line.startswith(" ") and line.strip():
            docs[current] += " " + line.strip()
        else:
            current = None
    return docs
