"""The repository speaks of itself: its code, docs, READMEs and benchmarks state what is true and
why, never the diary of how it was made (work periods, numbered calls, the machines and time
budgets the measurements ran under). A figure carries its date, GPU, commit and command
(docs/PERFORMANCE.md), not the period it was measured in.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SUFFIXES = {".py", ".md", ".sh", ".toml", ".yaml", ".yml"}
THIS_FILE = Path(__file__).resolve().relative_to(ROOT).as_posix()

# What a diary says, by what it says it about.
DIARY = {
    "a work period": re.compile(r"\bsessions?\b", re.IGNORECASE),
    "a numbered call": re.compile(r"\bcalls? [0-9]+\b", re.IGNORECASE),
    "the machine a run got": re.compile(
        r"\b(fresh|warm) machine\b|\bdevice (calls?|time|budget|pool|tool)\b", re.IGNORECASE
    ),
    "a time budget": re.compile(r"\btime budget\b", re.IGNORECASE),
    "the remote runs' script": re.compile(r"\bh200_(suite|study)\b"),
    "the diary itself": re.compile(r"\bRESULTS\.md\b"),
}
# Uses of those words that are not a diary: pytest's fixture scope.
ALLOWED = re.compile(r"""scope=["']session["']""")


def tracked_text_files() -> list[str]:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are unknown")
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, text=True
    ).stdout.split("\0")
    return [
        name
        for name in listed
        if Path(name).suffix in SUFFIXES and name != THIS_FILE and (ROOT / name).is_file()
    ]


def diary_lines(text: str) -> list[tuple[int, str, str]]:
    """(line number, what it is about, the line) of each diary phrase in `text`."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        line_without_allowed = ALLOWED.sub("", line)
        found += [
            (number, about, line.strip())
            for about, pattern in DIARY.items()
            if pattern.search(line_without_allowed)
        ]
    return found


@pytest.mark.parametrize(
    "line",
    [
        "measured in the twenty-fourth session",
        "Call 3, on `1741126` (fresh machine)",
        "the device time ran out before the 16K run",
        "unused here to keep the time budget",
        "`bash benchmarks/h200_suite.sh time32k`",
        "(docs/RESULTS.md, 2026-12-02)",
        "two sessions before",
    ],
)
def test_each_kind_of_diary_phrase_is_found(line):
    assert diary_lines(line)


@pytest.mark.parametrize(
    "line",
    [
        '@pytest.fixture(scope="session")',
        "BV 32, 4 warps: fastest at H=8 on H100 and H200 (`python -m benchmarks tune`)",
        "one call per chunk; the backward recalls the forward's states",
        "a model.generate call decodes one token per step",
    ],
)
def test_the_projects_own_words_are_not_taken_for_a_diary(line):
    assert not diary_lines(line)


def test_no_tracked_file_speaks_of_how_it_was_made():
    offenders = [
        f"{name}:{number}: {about}: {line}"
        for name in tracked_text_files()
        for number, about, line in diary_lines((ROOT / name).read_text(encoding="utf-8"))
    ]
    assert not offenders, (
        "diary vocabulary (state the invariant and the decision; a figure's date, GPU, commit "
        "and command go in docs/PERFORMANCE.md):\n" + "\n".join(offenders)
    )
