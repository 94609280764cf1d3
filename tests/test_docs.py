"""The documentation the repository carries: every reference resolves inside the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MATH = ROOT / "docs" / "MATH.md"
TEXT_SUFFIXES = {".py", ".md", ".txt", ".yaml", ".yml", ".toml", ".json", ".cfg"}
# Where users read: the package, its docs and the README (a user has nothing beside the checkout).
SHIPPED = ("deltalab", "docs", "README.md")
# Everything that may cite docs/MATH.md by section.
CITING = (*SHIPPED, "tests", "benchmarks")
OUTSIDE = re.compile(r"\.\./shared|shared/spec")
# "docs/MATH.md sec. 4.4-4.6", "`docs/MATH.md` sec. 1", "docs/MATH.md sec. 2, 3, 5".
CITATION = re.compile(r"(\S*)MATH\.md`? sec\. ([0-9][0-9.]*(?:(?:, |-)[0-9][0-9.]*)*)")
# Inside docs/MATH.md itself: "(sec. 3.2)", "sec. 1.3-1.5".
INTERNAL = re.compile(r"\bsec\. ([0-9][0-9.]*(?:(?:, |-)[0-9][0-9.]*)*)")
HEADING = re.compile(r"^#{2,3} ([0-9]+(?:\.[0-9]+)?)\.? ", re.MULTILINE)


def text_files(*roots: str) -> list[Path]:
    files = []
    for name in roots:
        path = ROOT / name
        candidates = [path] if path.is_file() else sorted(path.rglob("*"))
        files += [
            p
            for p in candidates
            if p.is_file() and p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts
        ]
    return files


def section_numbers(group: str) -> list[str]:
    return [n.rstrip(".") for n in re.split(r", |-", group)]


@pytest.fixture(scope="module")
def math_sections() -> set[str]:
    return set(HEADING.findall(MATH.read_text(encoding="utf-8")))


def test_no_shipped_file_points_outside_the_repository():
    offenders = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in text_files(*SHIPPED)
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not offenders, "references to files users do not have:\n" + "\n".join(offenders)


def test_math_md_has_the_sections_the_repository_cites(math_sections):
    assert {"1", "1.3", "1.4", "1.5", "2", "3", "3.4", "4", "4.4", "4.5", "5", "6"} <= math_sections
    problems = []
    for path in text_files(*CITING):
        for prefix, group in CITATION.findall(path.read_text(encoding="utf-8")):
            where = path.relative_to(ROOT)
            if not prefix.lstrip("`(").endswith("docs/"):
                problems.append(f"{where}: 'MATH.md sec. {group}' must say docs/MATH.md")
            problems += [
                f"{where}: docs/MATH.md has no sec. {n}"
                for n in section_numbers(group)
                if n not in math_sections
            ]
    for group in INTERNAL.findall(MATH.read_text(encoding="utf-8")):
        problems += [
            f"docs/MATH.md: no sec. {n}" for n in section_numbers(group) if n not in math_sections
        ]
    assert not problems, "\n".join(problems)


# "`DeltaLabConfig.kernel_options`": a config or options class named with one of its fields.
CLASS_FIELD = re.compile(r"`([A-Z][A-Za-z0-9]*(?:Config|Options))\.[a-z_]+")


def test_config_classes_the_docs_name_with_a_field_exist():
    defined = set()
    for path in text_files("deltalab"):
        defined |= set(re.findall(r"^class (\w+)", path.read_text(encoding="utf-8"), re.M))
    named = {
        (path.relative_to(ROOT).as_posix(), name)
        for path in text_files(*SHIPPED)
        for name in CLASS_FIELD.findall(path.read_text(encoding="utf-8"))
    }
    assert named, "the docs name config fields by class"
    assert sorted((where, name) for where, name in named if name not in defined) == []
