"""Tests and benchmarks reach a code path by passing arguments: none sets an ALL_CAPS attribute
of a `deltalab.ops` module (a launch table's block size, a threshold) to choose one. Each op
keeps its launch table in one place, and the functions that launch its kernels take another
as an argument (`table=`), so a test passes a small table where it once patched a constant.
Spies on functions and faked environments (a failing save, no CUDA) are not constants.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OPS = "deltalab.ops"
CONSTANT = re.compile(r"^_?[A-Z][A-Z0-9_]*$")
# monkeypatch.setattr, setattr and mock.patch.object: (target, name, value).
SETTERS = {"setattr", "object"}


def _dotted(node: ast.expr) -> str | None:
    """`a.b.c` for a name or a chain of attributes, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _ops_names(tree: ast.AST) -> set[str]:
    """The names a file binds to `deltalab.ops` modules or to what they hold, anywhere in it."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(OPS):
            names |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            names |= {alias.asname for alias in node.names
                      if alias.asname and alias.name.startswith(OPS)}  # fmt: skip
    return names


def _is_ops(target: ast.expr, names: set[str]) -> bool:
    dotted = _dotted(target)
    return dotted is not None and (dotted.startswith(OPS) or dotted.split(".")[0] in names)


def _set_constant(node: ast.AST, names: set[str]) -> bool:
    """Whether `node` sets an ALL_CAPS attribute of a `deltalab.ops` module: a setter's call
    (by target and name, or by a dotted string) or an assignment to the attribute."""
    if isinstance(node, ast.Call) and node.args:
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if called not in SETTERS:
            return False
        first = node.args[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            module, _, name = first.value.rpartition(".")
            return module.startswith(OPS) and bool(CONSTANT.match(name))
        name = node.args[1] if len(node.args) > 1 else None
        named = isinstance(name, ast.Constant) and isinstance(name.value, str)
        return named and bool(CONSTANT.match(name.value)) and _is_ops(first, names)
    if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return any(
            isinstance(t, ast.Attribute) and CONSTANT.match(t.attr) and _is_ops(t.value, names)
            for t in targets
        )
    return False


def constant_settings(source: str) -> list[int]:
    """The lines of `source` that set an ALL_CAPS attribute of a `deltalab.ops` module."""
    tree = ast.parse(source)
    names = _ops_names(tree)
    return sorted(node.lineno for node in ast.walk(tree) if _set_constant(node, names))


SETTING = {
    "monkeypatch": 'from deltalab.ops.norms import triton as kernels\n\n'
                   'def test(monkeypatch):\n    monkeypatch.setattr(kernels, "BACKWARD_PROGRAMS", 3)\n',
    "a dotted string": 'def test(monkeypatch):\n'
                       '    monkeypatch.setattr("deltalab.ops.swiglu.triton.BLOCK_COLUMNS", 8)\n',
    "mock.patch.object": 'from unittest import mock\n'
                         'from deltalab.ops.delta_rule.triton import state_pass\n'
                         'with mock.patch.object(state_pass, "FUSED_PASS_MIN_PROGRAMS", 4):\n'
                         '    pass\n',
    "an assignment": "import deltalab.ops.short_conv.triton as kernels\n"
                     "kernels.BACKWARD_PROGRAMS = 8\n",
    "setattr": 'from deltalab.ops.rope import triton\nsetattr(triton, "MAX_BLOCK_D", 4)\n',
}  # fmt: skip
NOT_SETTING = {
    "a spy on a function": "from deltalab.ops.delta_rule.triton import chunk\n\n"
                           "def test(monkeypatch):\n"
                           '    monkeypatch.setattr(chunk, "delta_rule_triton", print)\n',
    "a faked environment": "import torch\n\ndef test(monkeypatch):\n"
                           '    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)\n',
    "a constant outside deltalab.ops": "import deltalab.train.loop as loop\n\n"
                                       "def test(monkeypatch):\n"
                                       '    monkeypatch.setattr(loop, "WARMUP_STEPS", 0)\n',
}  # fmt: skip


@pytest.mark.parametrize("source", SETTING.values(), ids=SETTING.keys())
def test_each_way_of_setting_an_ops_constant_is_found(source):
    (line,) = constant_settings(source)
    assert re.search(r"\b[A-Z][A-Z_]+\b", source.splitlines()[line - 1])


@pytest.mark.parametrize("source", NOT_SETTING.values(), ids=NOT_SETTING.keys())
def test_spies_and_faked_environments_are_not_taken_for_a_constant(source):
    assert constant_settings(source) == []


def test_no_test_or_benchmark_sets_a_constant_of_an_op_to_choose_a_code_path():
    files = sorted((ROOT / "tests").glob("*.py")) + sorted((ROOT / "benchmarks").rglob("*.py"))
    assert files
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in files
        for line in constant_settings(path.read_text())
    ]
    assert not found, f"pass the op's launch table or options as an argument instead: {found}"
