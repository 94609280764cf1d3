"""The study records kept in studies/results/ rebuild the reports kept beside them.

`records.tar.gz` holds a study's `runs/` and `tasks/`; unpacked into a directory,
`deltalab study SPEC --aggregate-only --out DIR` writes `study.md` there. It must equal the kept
report but for the header lines that say when and where a report was written and which
invocations ran the study (studies/results/README.md).
"""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from deltalab.cli import main

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "studies" / "results"
HEADER_PREFIXES = ("Spec `", "Invocation ")


def _body(report: str) -> list[str]:
    return [line for line in report.splitlines() if not line.startswith(HEADER_PREFIXES)]


@pytest.mark.parametrize(
    ("spec", "kept"),
    [("studies/gpu.yaml", "gpu"), ("studies/cpu_tiny.yaml", "cpu_tiny/rerun")],
)
def test_archived_records_rebuild_the_kept_report(spec, kept, tmp_path, capsys):
    with tarfile.open(RESULTS / kept / "records.tar.gz") as archive:
        archive.extractall(tmp_path, filter="data")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs", "tasks"]
    assert main(["study", str(ROOT / spec), "--aggregate-only", "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    rebuilt = (tmp_path / "study.md").read_text()
    assert _body(rebuilt) == _body((RESULTS / kept / "study.md").read_text())
