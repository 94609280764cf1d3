"""Errors that are the user's to fix, as opposed to bugs.

The `deltalab` command prints a `UserError` as one line on stderr and exits with status 2; any
other exception keeps its traceback, since it points at a bug. Each class also derives from the
built-in exception that code catching the library's errors expects (`ValueError`, `TypeError`),
so callers of the Python API see no change.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

__all__ = [
    "CheckpointError",
    "ConfigError",
    "ConfigTypeError",
    "DataError",
    "DivergenceError",
    "EvalError",
    "UserError",
    "closest",
    "one_line",
]


def closest(name: str, choices: Sequence[str]) -> str:
    """' (did you mean X?)' for the closest valid name, or '' when nothing is close."""
    match = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


def one_line(error: BaseException) -> str:
    """The error's message on one line: messages quoting other libraries (a YAML parser's
    "while parsing ... in <unicode string>, line 1" block) keep their words, not their breaks."""
    return " ".join(str(error).split())


class UserError(Exception):
    """A problem with what the user asked for or pointed at: a config, data, a checkpoint, an
    argument. The message names the field or file, what was found and what was expected."""


class ConfigError(UserError, ValueError):
    """A run or model configuration value that cannot be used."""


class ConfigTypeError(ConfigError, TypeError):
    """A configuration value of the wrong type."""


class EvalError(UserError, ValueError):
    """A problem with the input of `deltalab eval` (task, settings, checkpoint, data)."""


class DataError(UserError, ValueError):
    """A data source, tokenizer or token cache that cannot be used as configured."""


class CheckpointError(UserError, ValueError):
    """Checkpoints that cannot be resumed from, or a run directory that cannot be written."""


class DivergenceError(UserError, FloatingPointError):
    """Training produced a non-finite loss, gradient or activation under train.nan_policy=stop;
    the message names the step and what to change (usually a lower learning rate)."""
