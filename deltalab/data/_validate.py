"""Argument checks of the data layer, in the error style of `deltalab.ops._checks`.

Every error names the argument, what was received and what was expected. The data layer keeps its
own copy of these few lines so that it depends on neither the ops nor the model code.
"""

from __future__ import annotations

from collections.abc import Sequence


def require_int(name: str, value: object, *, minimum: int) -> int:
    """`value` as an int >= minimum; bools are refused although Python counts them as ints."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def require_fraction(name: str, value: object) -> float:
    """`value` as a float in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number in [0, 1), got {type(value).__name__}")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value}")
    return float(value)


def require_choice(name: str, value: object, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return str(value)
