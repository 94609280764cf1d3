"""What a study's records say of their code and device (`deltalab.provenance`), and the check
that keeps one study to one commit.

Each job's study_run.json holds a `provenance` record: a training run's is the one its trainer
wrote (provenance.json in the run directory: code, packages, device, the fingerprints of the
train and held-out token streams); a task job's is the study's own, with the device it planned.
A study refuses to resume or extend a directory whose records name other code than the code
running, and to aggregate records that name more than one, unless `allow_mixed` is set
(`--allow-mixed-commits`): results of different code would be compared as if they were one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deltalab.errors import ConfigError
from deltalab.provenance import (
    PROVENANCE_NAME,
    code_identity,
    code_version,
    provenance,
    read_json,
    record_identities,
)
from deltalab.study.plan import StudyPlan

__all__ = ["check_commits", "job_provenance", "recorded_devices", "recorded_identities"]

RECORD_NAME = "study_run.json"


def _directories(plan: StudyPlan) -> list[tuple[str, Path]]:
    return [(r.name, r.directory) for r in plan.runs] + [(t.name, t.directory) for t in plan.tasks]


def _records(directory: Path) -> list[dict[str, Any]]:
    """The provenance records of one job: its trainer's, and the one in its study_run.json."""
    found = [read_json(directory / PROVENANCE_NAME)]
    found.append((read_json(directory / RECORD_NAME) or {}).get("provenance"))
    return [record for record in found if isinstance(record, dict)]


def recorded_identities(plan: StudyPlan) -> dict[str, list[str]]:
    """Code identity (`code_identity`) -> the names of the jobs whose records name it."""
    found: dict[str, list[str]] = {}
    for name, directory in _directories(plan):
        identities = [i for record in _records(directory) for i in record_identities(record)]
        for identity in dict.fromkeys(identities):
            found.setdefault(identity, []).append(name)
    return found


def recorded_devices(plan: StudyPlan) -> list[str]:
    """The devices the records name ("cuda: NVIDIA H100 80GB HBM3", "cpu"), in job order."""
    devices = [
        str(record["device"])
        for _, directory in _directories(plan)
        for record in _records(directory)[-1:]
        if record.get("device")
    ]
    return list(dict.fromkeys(devices))


def _short(identity: str) -> str:
    return identity[:12] if len(identity) == 40 and " " not in identity else identity


def _listing(found: dict[str, list[str]]) -> str:
    parts = []
    for identity, names in found.items():
        more = f" and {len(names) - 2} more" if len(names) > 2 else ""
        parts.append(f"{_short(identity)} ({', '.join(names[:2])}{more})")
    return ", ".join(parts)


def check_commits(plan: StudyPlan, *, aggregate: bool, allow_mixed: bool = False) -> None:
    """Refuse, in one line naming the commits, records of other code: when running (`aggregate`
    False), any record whose code is not the running code; when aggregating, records of more
    than one code. `allow_mixed` lets both through."""
    if allow_mixed:
        return
    found = recorded_identities(plan)
    out_dir = plan.spec.out_dir
    if aggregate:
        if len(found) > 1:
            raise ConfigError(
                f"{out_dir} holds records of {len(found)} different commits: {_listing(found)}; "
                "rerun them at one commit, or pass --allow-mixed-commits to report them together"
            )
        return
    current = code_identity(code_version())
    other = {identity: names for identity, names in found.items() if identity != current}
    if other:
        raise ConfigError(
            f"{out_dir} holds records of commit {_listing(other)}, this code is "
            f"{_short(current)}; check out that commit, choose another out_dir, or pass "
            "--allow-mixed-commits to mix them"
        )


def job_provenance(directory: Path, device: str) -> dict[str, Any]:
    """The record a job's study_run.json keeps: its trainer's provenance.json when there is one,
    else the study's own with the planned `device`."""
    trained = read_json(directory / PROVENANCE_NAME)
    return trained if trained is not None else provenance(device)
