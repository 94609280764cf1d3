"""The typed config parser that train, study and eval share (deltalab/config_parse.py)."""

from __future__ import annotations

from typing import Any

import pytest

from deltalab.config_parse import check_keys, coerce, read_value


def test_values_take_their_fields_types():
    assert coerce("x", 2, float) == 2.0 and isinstance(coerce("x", 2, float), float)
    assert coerce("x", "3e-3", float) == 3e-3  # PyYAML reads a dotless exponent as a string
    assert coerce("x", [[64, 4], [128, 8]], tuple[tuple[int, ...], ...]) == ((64, 4), (128, 8))
    assert coerce("x", [0.9, 0.99], tuple[float, float]) == (0.9, 0.99)
    assert coerce("x", None, int | None) is None
    assert coerce("x", {"a": (1, 2)}, dict[str, Any]) == {"a": [1, 2]}


@pytest.mark.parametrize(
    ("value", "hint", "message"),
    [
        ("x", int, "x must be an int, got str 'x'"),
        (True, int, "x must be an int, got bool True"),
        (float("nan"), float, "x must be a finite number, got float nan"),
        ([1, "b"], tuple[int, ...], "x[1] must be an int, got str 'b'"),
        ([0.9], tuple[float, float], "x must be a list of 2 numbers, got list [0.9]"),
        ("a", int | None, "x must be an int or null, got str 'a'"),
        ({1: 2}, dict[str, Any], "x keys must be strings, got 1"),
    ],
)
def test_a_wrong_value_is_one_line_naming_the_key_and_the_type(value, hint, message):
    with pytest.raises(TypeError) as caught:
        coerce("x", value, hint)
    assert str(caught.value) == message


def test_an_unknown_key_names_the_closest_and_the_known_ones():
    with pytest.raises(ValueError) as caught:
        check_keys({"stepz": 1}, ["steps", "seed"], "train.")
    assert str(caught.value) == (
        "unknown key 'train.stepz' (did you mean 'train.steps'?); the keys are ['steps', 'seed']"
    )
    check_keys({"seed": 1}, ["steps", "seed"])


def test_a_string_field_keeps_its_text_unless_quoted():
    assert read_value("k", "runs/exp #2", str) == "runs/exp #2"
    assert read_value("k", "2024", str) == "2024"
    assert read_value("k", "'def '", str) == "def "
    assert read_value("k", "[1, 2]", tuple[int, ...]) == [1, 2]
    with pytest.raises(ValueError, match=r"^k: cannot read '\[1,2' as YAML"):
        read_value("k", "[1,2", tuple[int, ...])
