"""What a study's records say of their code and device (`deltalab.provenance`), and the check
that keeps one study to one commit.

Each job's study_run.json holds a `provenance` record: a training run's is the one its trainer
wrote (provenance.json in the run directory: code, packages, device, the fingerprints of the
train and held-out token streams); a task job's is the study's own, with the device it planned.
A study refuses to resume or extend a directory whose records name other code than the code
running, and to aggregate records that name more than one, unless `allow_mixed` is set
(`--allow-mixed-commits`): results of different code would be compared as if they were one. The
same holds for the token streams the runs trained and evaluated on (`check_data`,
`--allow-mixed-data`).
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

__all__ = [
    "UNPACKED_DIRECTORIES",
    "UNPACKED_SUFFIXES",
    "check_commits",
    "check_data",
    "job_provenance",
    "pack_records",
    "packed_files",
    "recorded_data",
    "recorded_devices",
    "recorded_identities",
]

RECORD_NAME = "study_run.json"


def _directories(plan: StudyPlan) -> list[tuple[str, Path]]:
    jobs = [*plan.throughput, *plan.runs, *plan.tasks]
    return [(job.name, job.directory) for job in jobs]


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


def _refuse_mixed(
    out_dir: Path, found: dict[str, list[str]], current: str | None, what: str, flag: str
) -> None:
    """One line naming the `what` (e.g. "commits") the records hold and their jobs: those
    other than `current` (what this study would add), or, with `current` None, all of them
    when there are several."""
    if current is not None:
        other = {key: names for key, names in found.items() if key != current}
        if other:
            raise ConfigError(
                f"{out_dir} holds records of other {what}, {_listing(other)}, than this study's "
                f"{_short(current)}; restore that, choose another out_dir, or pass {flag} to "
                "mix them"
            )
    elif len(found) > 1:
        raise ConfigError(
            f"{out_dir} holds records of {len(found)} different {what}: {_listing(found)}; "
            f"pass {flag} to report them together"
        )


def check_commits(plan: StudyPlan, *, aggregate: bool, allow_mixed: bool = False) -> None:
    """Refuse, in one line naming the commits, records of other code: when running (`aggregate`
    False), any record whose code is not the running code; when aggregating, records of more
    than one code. `allow_mixed` lets both through."""
    if not allow_mixed:
        current = None if aggregate else code_identity(code_version())
        found = recorded_identities(plan)
        _refuse_mixed(plan.spec.out_dir, found, current, "commits", "--allow-mixed-commits")


def _data_key(data: dict[str, Any]) -> str:
    """The data a record names, as one string: the SHA-256 of its train and held-out tokens."""
    hashes = [(data.get(split) or {}).get("tokens_sha256") for split in ("train", "held_out")]
    return "/".join(str(h)[:12] for h in hashes)


def recorded_data(plan: StudyPlan) -> dict[str, list[str]]:
    """Data key (the train and held-out tokens' SHA-256, 12 digits each) -> the runs whose
    trainer recorded it."""
    found: dict[str, list[str]] = {}
    for name, directory in _directories(plan):
        data = (read_json(directory / PROVENANCE_NAME) or {}).get("data")
        if data:
            found.setdefault(_data_key(data), []).append(name)
    return found


def check_data(
    plan: StudyPlan, current: dict[str, Any] | None = None, *, allow_mixed: bool = False
) -> None:
    """Refuse, in one line, runs trained on different token streams (the train or held-out
    split of one source differs between machines: the stdlib of another Python, an edited
    file), or on other data than `current` (what this study prepares now), unless
    `allow_mixed` (`--allow-mixed-data`)."""
    if not allow_mixed:
        key = None if current is None else _data_key(current)
        what = "data (train/held-out tokens sha256)"
        _refuse_mixed(plan.spec.out_dir, recorded_data(plan), key, what, "--allow-mixed-data")


def job_provenance(directory: Path, device: str) -> dict[str, Any]:
    """The record a job's study_run.json keeps: its trainer's provenance.json when there is one,
    else the study's own with the planned `device`."""
    trained = read_json(directory / PROVENANCE_NAME)
    return trained if trained is not None else provenance(device)


# What a packed study leaves out: checkpoints and exported models (large, and not needed to
# report or to skip a finished run), figures (rewritten from the records), TensorBoard's event
# files and the trainer's lock.
UNPACKED_DIRECTORIES = ("checkpoints", "model", "tb")
UNPACKED_SUFFIXES = (".png", ".lock")


def packed_files(plan: StudyPlan) -> list[Path]:
    """The records of the plan's jobs, relative to the study directory, in sorted order: every
    file under each job's directory but those `UNPACKED_DIRECTORIES` and `UNPACKED_SUFFIXES`
    name."""
    root = plan.spec.out_dir
    found = []
    for _, directory in _directories(plan):
        if not directory.is_dir():
            continue
        for path in directory.rglob("*"):
            relative = path.relative_to(directory)
            if not path.is_file() or path.is_symlink():
                continue
            if any(part in UNPACKED_DIRECTORIES for part in relative.parts[:-1]):
                continue
            if path.name.endswith(UNPACKED_SUFFIXES):
                continue
            found.append(path.relative_to(root))
    return sorted(found)


def pack_records(plan: StudyPlan, archive: Path) -> int:
    """Writes the plan's records (`packed_files`) to the gzipped tar `archive` and returns how
    many files it holds. Members carry no owner and a zero time, so the same records pack to
    the same bytes; unpacked into a study directory (`tar -xzf`), they rebuild the report with
    --aggregate-only, and a rerun of the spec counts their finished jobs as done."""
    import gzip
    import tarfile

    files = packed_files(plan)
    archive.parent.mkdir(parents=True, exist_ok=True)
    partial = archive.with_name(f".{archive.name}.partial")
    with (
        open(partial, "wb") as raw,
        gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as zipped,
    ):
        with tarfile.open(fileobj=zipped, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for relative in files:
                info = tar.gettarinfo(plan.spec.out_dir / relative, arcname=relative.as_posix())
                info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
                info.mode = 0o644
                with open(plan.spec.out_dir / relative, "rb") as data:
                    tar.addfile(info, data)
    partial.replace(archive)
    return len(files)
