"""results.json: what one run measured and everything needed to trust or redo it; and the
markdown table `deltalab eval --compare` prints across runs."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from deltalab.eval.common import EvalError
from deltalab.provenance import package_versions

__all__ = ["RESULTS_NAME", "compare_table", "load_results", "package_versions", "write_results"]

RESULTS_NAME = "results.json"


def write_results(
    out_dir: Path,
    *,
    task: str,
    settings: dict[str, Any],
    metrics: dict[str, Any],
    summary: dict[str, Any],
    seed: int,
    checkpoint: dict[str, Any] | None,
    elapsed_s: float,
) -> Path:
    """Writes `out_dir/results.json` (atomically) and returns its path.

    summary: the headline numbers (flat name -> number or string) that `--compare` tabulates.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "task": task,
        "settings": settings,
        "metrics": metrics,
        "summary": summary,
        "seed": seed,
        "checkpoint": checkpoint,
        "elapsed_s": round(elapsed_s, 3),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "command": sys.argv,
        "versions": package_versions(),
    }
    path = out_dir / RESULTS_NAME
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2, default=_plain))
    os.replace(tmp, path)
    return path


def _plain(value: Any) -> Any:
    if isinstance(value, tuple | set):
        return list(value)
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} to results.json")


def load_results(path: str | Path) -> dict[str, Any]:
    """The record of a results directory (or of a results.json file itself)."""
    path = Path(path)
    file = path / RESULTS_NAME if path.is_dir() else path
    if not file.is_file():
        raise EvalError(f"--compare: {str(path)!r} holds no {RESULTS_NAME}")
    try:
        record = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise EvalError(f"--compare: {file} is not valid JSON: {error}") from error
    if not isinstance(record, dict) or "task" not in record or "summary" not in record:
        raise EvalError(f"--compare: {file} is not a deltalab eval results.json")
    return record


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def _settings(record: dict[str, Any]) -> dict[str, str]:
    """A run's settings and seed, each as the text a table cell shows."""
    values = {**(record.get("settings") or {}), "seed": record.get("seed")}
    return {
        name: json.dumps(value) if isinstance(value, list | dict) else _format(value)
        for name, value in values.items()
    }


def compare_table(records: list[tuple[str, dict[str, Any]]]) -> str:
    """One markdown table: a row per run (its directory, task, checkpoint), a column per
    setting whose value differs between the runs (the seed included), then one per summary
    metric found in any run (blank where a run does not have it)."""
    settings = [_settings(record) for _, record in records]
    differing: list[str] = []
    for values in settings:
        differing += [
            name
            for name in values
            if name not in differing and len({s.get(name, "") for s in settings}) > 1
        ]
    columns: list[str] = []
    for _, record in records:
        columns += [name for name in record["summary"] if name not in columns]
    header = ["run", "task", "checkpoint", *differing, *columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (name, record), values in zip(records, settings, strict=True):
        checkpoint = (record.get("checkpoint") or {}).get("path", "")
        cells = [name, record["task"], checkpoint]
        cells += [values.get(setting, "") for setting in differing]
        cells += [_format(record["summary"].get(column)) for column in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
