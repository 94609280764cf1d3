"""The aggregate of a study: `collect` gathers every run and task, what it measured, the
learning rate each variant is reported at, the per-seed statistics and paired differences against
the baseline (Holm-corrected t-intervals) and the gate sensitivities, as the data study.json
holds; `write_report` writes study.json, study.md (rendered by markdown.py) and the figures.

Nothing is dropped: a run that diverged or failed stays in study.json and in the markdown with
its error line; the means count the runs that completed (n is printed), and a paired difference
counts the seeds where both the variant and the baseline completed.
"""

from __future__ import annotations

import os
import platform
import time
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from deltalab.study.compare import (
    HELD_OUT,
    add_derived,
    choose_rates,
    compared,
    correct_family,
)
from deltalab.study.figures import loss_figure, scaling_figure, task_figure
from deltalab.study.markdown import render_markdown
from deltalab.study.plan import PlannedRun, PlannedTask, StudyPlan
from deltalab.study.records import recorded_devices, recorded_identities
from deltalab.study.runner import (
    RECORD_NAME,
    _read_json,
    _write_json,
    run_state,
    task_state,
    trained,
)
from deltalab.study.stats import paired_difference, summarize
from deltalab.study.to_loss import to_loss

__all__ = ["INVOCATIONS_NAME", "collect", "write_report"]

INVOCATIONS_NAME = "invocations.json"
# Listed last in the tables: how fast a run was says nothing of the model's quality.
SPEED = ("tokens_per_s",)
GATE_TASK = "gate-sensitivity"


def _numbers(summary: dict[str, Any], prefix: str, strip: str = "") -> dict[str, float]:
    found = {}
    for key, value in summary.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        name = key[len(strip) :] if strip and key.startswith(strip) else key
        found[f"{prefix}.{name}"] = float(value)
    return found


def _status(record: dict[str, Any], state: str) -> str:
    if state == "done":
        return "completed"
    if state == "diverged":
        return "diverged"
    status = record.get("status")
    if status in ("failed", "interrupted"):
        return status
    # "running" in the record of a study that was killed outright: it stopped with it.
    return "interrupted" if status == "running" else "pending"


def _run_entry(plan: StudyPlan, run: PlannedRun) -> dict[str, Any]:
    record = _read_json(run.directory / RECORD_NAME) or {}
    metrics = _read_json(run.directory / "metrics.json") or {}
    status = _status(record, run_state(run))
    entry: dict[str, Any] = {
        "name": run.name,
        "variant": run.variant.name,
        "mixer": run.variant.mixer,
        "options": run.variant.options,
        "size": run.size,
        "lr": run.lr,
        "seed": run.seed,
        "status": status,
        "error": record.get("error", "") if status != "completed" else "",
        "stage": record.get("stage", "") if status != "completed" else "",
        "params": run.params,
        "total_params": run.total_params,
        "ffn_width": run.ffn_width,
        "directory": os.path.relpath(run.directory, plan.spec.out_dir),
        "elapsed_s": record.get("elapsed_s"),
        "device_shared_by": record.get("device_shared_by"),
        # The device its trainer recorded ("cuda: NVIDIA H100 80GB HBM3"), None before records.
        "recorded_device": (record.get("provenance") or {}).get("device"),
        "device": ((metrics.get("config") or {}).get("train") or {}).get("device"),
        "steps_done": metrics.get("steps_done"),
        "skipped_steps": metrics.get("skipped_steps"),
        "metrics": {},
    }
    if metrics.get("status") == "completed":
        found = entry["metrics"]
        found[HELD_OUT] = metrics.get("final_eval_loss")
        if metrics.get("median_tokens_per_s") is not None:
            found["tokens_per_s"] = metrics["median_tokens_per_s"]
        for step in run.evals:
            results = _read_json(run.directory / step.out / "results.json")
            if results is not None:
                found.update(_numbers(results.get("summary") or {}, step.task))
        add_derived(found)
    return entry


def _task_entry(plan: StudyPlan, task: PlannedTask) -> dict[str, Any]:
    record = _read_json(task.directory / RECORD_NAME) or {}
    status = _status(record, task_state(task))
    entry: dict[str, Any] = {
        "name": task.name,
        "task": task.step.task,
        "variant": task.variant.name,
        "seed": task.seed,
        "status": status,
        "error": record.get("error", "") if status != "completed" else "",
        "directory": os.path.relpath(task.directory, plan.spec.out_dir),
        "elapsed_s": record.get("elapsed_s"),
        "metrics": {},
    }
    results = _read_json(task.directory / "results.json")
    if results is not None:
        entry["lrs"] = (results.get("settings") or {}).get("lrs")
    if status == "completed" and results is not None:
        # One mixer per job: "gdn2@64x4" is the setting "64x4".
        strip = f"{task.variant.mixer}@"
        entry["metrics"] = _numbers(results.get("summary") or {}, task.step.task, strip)
    return entry


def _by_variant(entries: Iterable[dict[str, Any]]) -> dict[str, dict[int, dict[str, float]]]:
    """variant -> seed -> metrics, completed entries only."""
    table: dict[str, dict[int, dict[str, float]]] = defaultdict(dict)
    for entry in entries:
        if entry["status"] == "completed":
            table[entry["variant"]][entry["seed"]] = entry["metrics"]
    return table


def _statistics(
    plan: StudyPlan, entries: list[dict[str, Any]], metrics: list[str]
) -> dict[str, Any]:
    """Per variant and metric: n, mean, sd; for a compared metric, the paired differences against
    the baseline (n, mean, sd, the t-test's p-value; `correct_family` adds the rest)."""
    table = _by_variant(entries)
    baseline = table.get(plan.spec.baseline, {})
    out: dict[str, Any] = {}
    for variant in (v.name for v in plan.spec.variants):
        seeds = table.get(variant, {})
        out[variant] = {}
        for metric in metrics:
            values = {s: m[metric] for s, m in seeds.items() if m.get(metric) is not None}
            summary = summarize(list(values.values()))
            item: dict[str, Any] = {"n": summary.n, "mean": summary.mean, "sd": summary.sd}
            if variant != plan.spec.baseline and compared(metric, metrics):
                base = {s: m[metric] for s, m in baseline.items() if m.get(metric) is not None}
                paired = paired_difference(values, base)
                item["paired"] = {
                    "n": paired.n,
                    "mean": paired.mean,
                    "sd": paired.sd,
                    "p": paired.p_value,
                    "verdict": "too few pairs for an interval",
                }
            out[variant][metric] = item
    return out


def _gate_results(run: PlannedRun) -> dict[str, Any] | None:
    """The metrics of the run's gate-sensitivity evaluation, if it has one and it finished."""
    for step in run.evals:
        if step.task == GATE_TASK:
            results = _read_json(run.directory / step.out / "results.json")
            if results is not None:
                return results.get("metrics")
    return None


def _gate_sensitivity(plan: StudyPlan, chosen: set[str]) -> list[dict[str, Any]]:
    """Per size and variant (its completed runs at its chosen rate, the names in `chosen`), the
    gate-sensitivity analysis layer by layer: the erase/write ratios (of the final memory's and
    of the loss's sensitivity) at initialization and after training, one value per seed; the
    same ratio over all layers, defined as the ratio of the summed sensitivities (the
    evaluation's own summary), one value per seed; and the ranks `allocate_ranks` gives the
    trained model's gates beside the layer's own. Only layers with both an erase and a write
    gate (the ratio's layers) count."""
    groups = []
    for size in plan.sizes:
        variants: dict[str, Any] = {}
        for run in plan.runs:
            if run.size != size or run.name not in chosen:
                continue
            metrics = _gate_results(run)
            if not metrics:
                continue
            variant = variants.setdefault(
                run.variant.name,
                {"lr": run.lr, "seeds": [], "layers": {}, "summed": {}, "ranks": {}},
            )
            variant["seeds"].append(run.seed)
            for phase in ("init", "trained"):
                summed = ((metrics.get(phase) or {}).get("mean") or {}).get("erase_write")
                for of, value in (summed or {}).items():
                    if value is not None:
                        variant["summed"].setdefault(f"{phase}_{of}", {})[str(run.seed)] = value
                layers = (metrics.get(phase) or {}).get("layers") or {}
                for name, layer in layers.items():
                    ratio = {
                        of: value
                        for of, value in (layer.get("erase_write") or {}).items()
                        if value is not None
                    }
                    if ratio:
                        slot = variant["layers"].setdefault(name, {})
                        for of, value in ratio.items():
                            # Keyed by the seed as a string, as study.json writes it.
                            slot.setdefault(f"{phase}_{of}", {})[str(run.seed)] = value
                    if phase != "trained":
                        continue
                    for of, allocation in (layer.get("ranks") or {}).items():
                        if not allocation:  # no budget to allocate (not a low-rank layer)
                            continue
                        ranks = variant["ranks"].setdefault(
                            of,
                            {
                                "reference": allocation["reference"],
                                "source": allocation.get("source", ""),
                                "allocated": [],
                            },
                        )
                        ranks["allocated"].append(allocation["allocated"])
        variants = {n: v for n, v in variants.items() if v["layers"] or v["ranks"]}
        if variants:
            groups.append({"size": size, "variants": variants})
    return groups


def _throughput(plan: StudyPlan) -> dict[str, dict[str, dict[str, Any]]]:
    """size -> variant -> the speed run's median tokens/s and device, for those completed."""
    found: dict[str, dict[str, dict[str, Any]]] = {}
    for job in plan.throughput:
        metrics = trained(job) or {}
        if metrics.get("median_tokens_per_s"):
            found.setdefault(job.size, {})[job.variant.name] = {
                "tokens_per_s": metrics["median_tokens_per_s"],
                "steps": metrics.get("steps_done"),
                "device": metrics.get("provenance", {}).get("device"),
            }
    return found


def _metric_names(entries: list[dict[str, Any]]) -> list[str]:
    names: list[str] = []
    for entry in entries:
        names += [m for m in entry["metrics"] if m not in names]
    # In the order the tasks report them (MQAR: its test settings as listed), speed last.
    last = [m for m in SPEED if m in names]
    return [m for m in names if m not in last] + last


def collect(plan: StudyPlan) -> dict[str, Any]:
    """Everything the report says, as JSON data (what study.json holds)."""
    runs = [_run_entry(plan, run) for run in plan.runs]
    tasks = [_task_entry(plan, task) for task in plan.tasks]
    speeds = _throughput(plan)
    groups = []
    for size in plan.sizes:
        members = [e for e in runs if e["size"] == size]
        rates = choose_rates(plan.spec, members, plan.lrs)
        # Each variant's runs at its chosen rate, paired with the baseline's at its own.
        chosen = [e for e in members if e["lr"] == rates[e["variant"]]["lr"]]
        metrics = _metric_names(chosen)
        first = plan.runs[0].config.train
        groups.append(
            {
                "size": size,
                "rates": rates,
                "metrics": metrics,
                "statistics": _statistics(plan, chosen, metrics),
                "to_loss": to_loss(
                    chosen,
                    plan.spec.baseline,
                    plan.spec.out_dir,
                    first.batch_size * first.seq_len,
                    speeds.get(size, {}),
                ),
            }
        )
    task_groups = []
    for name in dict.fromkeys(t["task"] for t in tasks):
        members = [t for t in tasks if t["task"] == name]
        metrics = _metric_names(members)
        task_groups.append(
            {"task": name, "metrics": metrics, "statistics": _statistics(plan, members, metrics)}
        )
    family = correct_family(groups + task_groups)
    spec = plan.spec
    first = plan.runs[0].config
    invocations = _read_json(spec.out_dir / INVOCATIONS_NAME) or {"invocations": []}
    chosen = {
        e["name"]
        for group in groups
        for e in runs
        if e["size"] == group["size"]
        and e["status"] == "completed"
        and e["lr"] == group["rates"][e["variant"]]["lr"]
    }
    gates = _gate_sensitivity(plan, chosen)
    return {
        "spec": str(spec.path) if spec.path else None,
        "out_dir": str(spec.out_dir),
        "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        # What the runs ran on, as their records say (the plan's guess only before any ran).
        # Records older than provenance name the device in their run config.
        "device": ", ".join(
            recorded_devices(plan) or sorted({e["device"] for e in runs if e.get("device")})
        )
        or plan.device,
        "code": list(recorded_identities(plan)),
        "parallel": spec.parallel,
        "threads_per_run": plan.threads,
        "baseline": spec.baseline,
        "selection": {
            "metric": spec.selection.metric,
            "goal": spec.selection.goal,
            "validation_fraction": spec.selection.validation_fraction,
            "lrs": plan.lrs,
        },
        "family": family,
        "params": {"match": spec.match, "tolerance": spec.tolerance, "targets": plan.targets},
        "budget": {
            "steps": first.train.steps,
            "batch_size": first.train.batch_size,
            "seq_len": first.train.seq_len,
            "tokens_per_run": plan.tokens_per_run,
            "data": first.data.to_dict(),
        },
        "variants": [
            {"name": v.name, "mixer": v.mixer, "options": v.options, "overrides": v.overrides}
            for v in spec.variants
        ],
        "evals": [{"task": e.task, "settings": e.settings} for e in spec.evals],
        "counts": {
            status: sum(1 for e in runs + tasks if e["status"] == status)
            for status in ("completed", "diverged", "failed", "interrupted", "pending")
        },
        "invocations": invocations["invocations"],
        "groups": groups,
        "task_groups": task_groups,
        "gate_sensitivity": gates,
        "throughput": speeds,
        "runs": runs,
        "tasks": tasks,
    }


def write_report(plan: StudyPlan, stem: str = "study") -> dict[str, Path]:
    """Writes STEM.json, STEM.md and the figures into the study directory; returns their
    paths by name. (`deltalab study --aggregate-only --baseline V` writes study_vs_V, the
    differences paired against V.)"""
    out = plan.spec.out_dir
    data = collect(plan)
    written: dict[str, Path] = {}
    figures = []
    loss = loss_figure(plan, data, out / "loss_curves.png")
    if loss is not None:
        written["loss_curves"] = loss
        figures.append(loss.name)
    for group in data["task_groups"]:
        name = "".join(c if c.isalnum() or c in "._-" else "_" for c in group["task"])
        figure = task_figure(plan, group, out / f"{name}.png")
        if figure is not None:
            written[group["task"]] = figure
            figures.append(figure.name)
    scaling = scaling_figure(plan, data, out / "perplexity_vs_params.png")
    if scaling is not None:
        written["perplexity_vs_params"] = scaling
        figures.append(scaling.name)
    data["figures"] = figures
    _write_json(out / f"{stem}.json", data)
    written["json"] = out / f"{stem}.json"
    markdown = out / f"{stem}.md"
    temporary = markdown.with_name(f".{markdown.name}.{os.getpid()}.tmp")
    temporary.write_text(render_markdown(plan, data, figures), encoding="utf-8")
    os.replace(temporary, markdown)
    written["markdown"] = markdown
    return written
