"""The task registry and typed task settings set from `name=value` words on the command line.

    deltalab eval runs/default/model --task passkey lengths=[1024,2048] depths=[0,0.5,1]

Each task declares a frozen dataclass of settings whose docstring has one `name: text` line per
field; a value is read as YAML and checked against the field's type, and every error names the
field, what was received and what was expected.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import types
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deltalab.errors import closest
from deltalab.eval.common import EvalError, LoadedCheckpoint

__all__ = [
    "Task",
    "TaskContext",
    "TaskOutcome",
    "field_docs",
    "get_task",
    "parse_settings",
    "register",
    "silenced_bars",
    "task_names",
]


@dataclass
class TaskContext:
    """What a task gets besides its settings."""

    checkpoint: LoadedCheckpoint | None
    seed: int
    device: str
    out_dir: Path
    long_context: str = "refuse"
    progress: bool | None = None  # tqdm's `disable` convention inverted: None = auto (a TTY)

    def bar(self, **kwargs: Any) -> Any:
        from tqdm.auto import tqdm

        disable = None if self.progress is None else not self.progress
        return tqdm(disable=disable, dynamic_ncols=True, leave=False, **kwargs)


@contextmanager
def silenced_bars(silence: bool = True) -> Iterator[None]:
    """While open (and `silence`), every tqdm bar is created disabled: deltalab's, and those of
    transformers (loading weights), datasets and lm-eval, which take no switch of ours. tqdm
    has no global off switch, so its constructor is wrapped and restored on exit."""
    if not silence:
        yield
        return
    from tqdm import std

    original = std.tqdm.__dict__["__init__"]

    def disabled(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["disable"] = True
        original.__get__(self, type(self))(*args, **kwargs)

    std.tqdm.__init__ = disabled  # type: ignore[method-assign]
    try:
        yield
    finally:
        std.tqdm.__init__ = original  # type: ignore[method-assign]


@dataclass
class TaskOutcome:
    """metrics: everything measured (results.json); summary: flat headline numbers (the
    --compare table); table: the markdown printed at the end; files: figures written."""

    metrics: dict[str, Any]
    summary: dict[str, Any]
    table: str
    files: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Task:
    name: str
    summary: str
    settings: type
    run: Callable[[Any, TaskContext], TaskOutcome]
    needs_checkpoint: bool = True


_TASKS: dict[str, Task] = {}


def register(task: Task) -> Task:
    _TASKS[task.name] = task
    return task


def _load_all() -> None:
    # Importing a task module registers it; kept lazy so `deltalab --help` stays fast.
    from deltalab.eval import (  # noqa: F401
        lm_eval_adapter,
        mqar,
        needles,
        perplexity,
        sensitivity,
        streaming,
    )


def task_names() -> list[str]:
    _load_all()
    return sorted(_TASKS)


def get_task(name: str) -> Task:
    """The task called `name` (`lm-eval:TASKS` is the lm-evaluation-harness adapter)."""
    _load_all()
    key = "lm-eval" if name.startswith("lm-eval:") else name
    if key not in _TASKS:
        hint = closest(name, list(_TASKS))
        # A prefix such as "mqar" or "niah" is too short for difflib but names a family.
        family = [t for t in sorted(_TASKS) if t.startswith(name)] if name else []
        if not hint and family:
            hint = f" (did you mean {' or '.join(map(repr, family))}?)"
        raise EvalError(f"--task: unknown task {name!r}{hint}; `deltalab eval --list` lists them")
    return _TASKS[key]


def field_docs(cls: type) -> dict[str, str]:
    """{field: description} from the `name: text` lines of the class docstring, and of its
    base classes' for the fields it does not describe (settings that extend `TextSource`)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass) and "__doc__" in vars(klass):
            docs |= _own_field_docs(klass)
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    docs: dict[str, str] = {}
    current = None
    for line in inspect.getdoc(cls).splitlines() if cls.__doc__ else []:
        match = re.match(r"^(\w+): (.*)$", line.strip())
        if match and match.group(1) in {f.name for f in dataclasses.fields(cls)}:
            current = match.group(1)
            docs[current] = match.group(2)
        elif current and line.startswith(" ") and line.strip():
            docs[current] += " " + line.strip()
        else:
            current = None
    return docs


def _describe(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        inner = [a for a in args if a is not type(None)]
        return " or ".join(_describe(a) for a in inner) + " or null"
    if origin is tuple:
        return f"a list of {_describe(args[0]).removeprefix('a ').removeprefix('an ')}s"
    if origin is dict:
        return "a mapping"
    return {bool: "a bool", int: "an int", float: "a number", str: "a string"}.get(hint, str(hint))


def _coerce(name: str, value: Any, hint: Any) -> Any:
    """`value` as type `hint` (int -> float, list -> tuple), or EvalError naming `name`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(name, value, inner)
    ok = False
    if hint is bool or hint is str:
        ok = isinstance(value, hint)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        # YAML 1.1 (PyYAML) reads `1e-3` without a dot as the string "1e-3".
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif origin is tuple and isinstance(value, list | tuple):
        item = args[0]
        return tuple(_coerce(f"{name}[{i}]", v, item) for i, v in enumerate(value))
    elif origin is dict:
        ok = isinstance(value, dict) and all(isinstance(key, str) for key in value)
    if not ok:
        raise EvalError(f"{name} must be {_describe(hint)}, got {value!r}")
    return value


def parse_settings(cls: type, words: list[str]) -> Any:
    """A `cls` instance from `name=value` words (values in YAML syntax)."""
    import yaml

    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    values: dict[str, Any] = {}
    given: dict[str, str] = {}
    for word in words:
        name, sep, text = word.partition("=")
        if not sep or not name:
            raise EvalError(f"task setting {word!r} must be name=value, e.g. seq_len=512")
        if name not in names:
            raise EvalError(
                f"unknown setting {name!r} for this task{closest(name, names)}; its settings "
                f"are {names}"
            )
        if name in given:
            raise EvalError(
                f"{name} is given twice ({given[name]} and {text}); give each setting once"
            )
        given[name] = text
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise EvalError(f"{name}: cannot read {text!r} as YAML: {error}") from error
        values[name] = _coerce(name, raw, hints[name])
    try:
        return cls(**values)
    except (TypeError, ValueError) as error:
        raise EvalError(str(error)) from error


def require(ok: bool, name: str, expected: str, value: Any) -> None:
    """EvalError `name must be <expected>, got <value>` unless `ok`."""
    if not ok:
        raise EvalError(f"{name} must be {expected}, got {value!r}")
