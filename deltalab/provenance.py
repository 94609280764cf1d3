"""Where a result came from: the code's commit, the package versions, the device and the data.

    record = provenance(torch.device("cuda"), data={"train": manifest_fingerprint(train)})
    code_identity(record["code"])   # "3f2c1e0..." or "deltalab 0.1.0 (installed)"

The code is read with `git` when the imported `deltalab` package is the `deltalab/` folder of a
git work tree (a checkout, editable installs included): its HEAD commit, and whether its tracked
files differ from it ("dirty"; untracked files such as run directories do not count). A tree
written by `git archive` (a release tarball, or any unpacked export of a commit) has no `.git`,
but git wrote its commit into `deltalab/ARCHIVE_COMMIT` (`export-subst` in `.gitattributes`),
and the record takes it from there (`"from": "archive"`; whether its files were edited after that is
not known). Otherwise the installed distribution's version stands for the code, stated as such
(`"from": "installed"`).

`deltalab train` writes the record to its run directory as provenance.json (and into
metrics.json); `deltalab study` keeps each run's record in its study_run.json and refuses to mix
records of different code (`--allow-mixed-commits`).
"""

from __future__ import annotations

import functools
import json
import platform
import re
import subprocess
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from deltalab._files import write_text_atomically

__all__ = [
    "ARCHIVE_COMMIT",
    "DISTRIBUTIONS",
    "PACKAGES",
    "PROVENANCE_NAME",
    "archive_commit",
    "code_identity",
    "code_version",
    "device_name",
    "installed_version",
    "package_versions",
    "provenance",
    "read_json",
    "record_identities",
    "write_run_provenance",
]

PROVENANCE_NAME = "provenance.json"
# Holds `$Format:%H$` in the repository; `git archive` writes the commit in its place.
ARCHIVE_COMMIT = "ARCHIVE_COMMIT"
# The distributions a result depends on; absent ones are recorded as None.
PACKAGES = ("deltalab", "torch", "triton", "transformers", "tokenizers", "numpy", "lm_eval")
PACKAGE_DIR = Path(__file__).resolve().parent
# A package some distributions install under other names: PyTorch's own Triton builds (nightlies,
# ROCm, XPU) are `pytorch-triton*`, with a "+git<sha>" suffix on the version.
DISTRIBUTIONS = {
    "triton": ("triton", "pytorch-triton", "pytorch-triton-rocm", "pytorch-triton-xpu"),
}


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


@functools.cache
def code_version(package_dir: Path = PACKAGE_DIR) -> dict[str, Any]:
    """The code of `package_dir` (this `deltalab` package by default): `{"from": "git",
    "commit", "dirty"}` when it is the `deltalab/` folder of a git work tree, `{"from":
    "archive", "commit"}` when `git archive` stamped its commit into it (`archive_commit`), else
    `{"from": "installed", "version"}`. Cached: the code of a running process does not change."""
    top = _git(package_dir, "rev-parse", "--show-toplevel")
    # A package copied into site-packages inside some other repository is not that repository's.
    if top is not None and Path(top).resolve() / package_dir.name == package_dir.resolve():
        head = _git(package_dir, "rev-parse", "HEAD")
        if head:
            status = _git(Path(top), "status", "--porcelain", "--untracked-files=no")
            return {"from": "git", "commit": head, "dirty": bool(status)}
    stamped = archive_commit(package_dir)
    if stamped is not None:
        return {"from": "archive", "commit": stamped}
    return {"from": "installed", "version": installed_version("deltalab")}


def archive_commit(package_dir: Path = PACKAGE_DIR) -> str | None:
    """The commit `git archive` wrote into `package_dir / ARCHIVE_COMMIT` (40 hex digits); None
    where the file is absent or still holds its placeholder (a checkout, a build from one)."""
    try:
        text = (package_dir / ARCHIVE_COMMIT).read_text().strip()
    except OSError:
        return None
    return text if re.fullmatch(r"[0-9a-f]{40}", text) else None


def code_identity(code: dict[str, Any] | None) -> str:
    """What two records must share to count as the same code: the commit (of a checkout or of
    an archive of it, the same), or the installed version ("deltalab 0.1.0 (installed)");
    "unknown" for a record without one."""
    if not code:
        return "unknown"
    if code.get("from") in ("git", "archive") and code.get("commit"):
        return str(code["commit"])
    return f"deltalab {code.get('version')} (installed)"


def installed_version(name: str, distributions: tuple[str, ...] | None = None) -> str | None:
    """The installed version of package `name`, read without importing it from the metadata of
    the first installed one of `distributions`, the names it is distributed under (default
    `DISTRIBUTIONS[name]`, or `name` alone); None where none is."""
    if distributions is None:
        distributions = DISTRIBUTIONS.get(name, (name,))
    for distribution in distributions:
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return None


def package_versions(
    distributions: Mapping[str, tuple[str, ...]] = DISTRIBUTIONS,
) -> dict[str, str | None]:
    """Python's version and those of `PACKAGES` (None where one is not installed), each read from
    the first installed one of `distributions[package]` (default `DISTRIBUTIONS`; the package's
    own name where it has no entry)."""
    versions = {
        name: installed_version(name, distributions.get(name, (name,))) for name in PACKAGES
    }
    return {"python": platform.python_version(), **versions}


def device_name(device: Any) -> str:
    """`"cuda: NVIDIA H100 80GB HBM3"` for a CUDA device, else the device type (`"cpu"`)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    return device.type


def provenance(device: Any, data: dict[str, Any] | None = None) -> dict[str, Any]:
    """The record: code, package versions, device, and `data` (what the run read, by split)."""
    return {
        "code": code_version(),
        "versions": package_versions(),
        "device": device_name(device),
        "data": data or {},
    }


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`; None when it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def record_identities(record: dict[str, Any] | None) -> list[str]:
    """The code identities a provenance record names: its own and those of earlier starts."""
    if not record:
        return []
    codes = [record.get("code"), *(record.get("earlier_code") or [])]
    return list(dict.fromkeys(code_identity(code) for code in codes if code))


def write_run_provenance(out_dir: Path, device: Any, data: dict[str, Any]) -> dict[str, Any]:
    """Writes `out_dir/provenance.json` for a training that starts (or resumes) now and returns
    the record. A resumed run whose earlier starts ran other code keeps their `code` records
    under `earlier_code`, so that a mix of commits stays visible."""
    record = provenance(device, data)
    previous = read_json(out_dir / PROVENANCE_NAME)
    if previous is not None:
        earlier = [previous.get("code"), *(previous.get("earlier_code") or [])]
        identity = code_identity(record["code"])
        kept = [c for c in earlier if c and code_identity(c) != identity]
        if kept:
            record["earlier_code"] = list({code_identity(c): c for c in kept}.values())
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomically(out_dir / PROVENANCE_NAME, json.dumps(record, indent=2) + "\n")
    return record
