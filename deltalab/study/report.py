"""The aggregate of a study: `study.json` (every run and what it measured), `study.md` (each
variant's chosen learning rate, mean and standard deviation over seeds at it, paired differences
against the baseline with Holm-corrected t-intervals, every run that did not complete) and the
figures.

Nothing is dropped: a run that diverged or failed stays in study.json and in the markdown with
its error line; the means count the runs that completed (n is printed), and a paired difference
counts the seeds where both the variant and the baseline completed.
"""

from __future__ import annotations

import math
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
from deltalab.study.plan import PlannedRun, PlannedTask, StudyPlan, lr_text
from deltalab.study.records import recorded_devices, recorded_identities
from deltalab.study.runner import RECORD_NAME, _read_json, _write_json, run_state, task_state
from deltalab.study.stats import paired_difference, summarize

__all__ = ["INVOCATIONS_NAME", "collect", "write_report"]

INVOCATIONS_NAME = "invocations.json"
# Listed last in the tables: how fast a run was says nothing of the model's quality.
SPEED = ("tokens_per_s",)
GATE_TASK = "gate-sensitivity"
# The two quantities the gate-sensitivity analysis measures a gate's effect on.
SENSITIVITY_OF = {"state": "final memory", "loss": "loss"}


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
    groups = []
    for size in plan.sizes:
        members = [e for e in runs if e["size"] == size]
        rates = choose_rates(plan.spec, members, plan.lrs)
        # Each variant's runs at its chosen rate, paired with the baseline's at its own.
        chosen = [e for e in members if e["lr"] == rates[e["variant"]]["lr"]]
        metrics = _metric_names(chosen)
        groups.append(
            {
                "size": size,
                "rates": rates,
                "metrics": metrics,
                "statistics": _statistics(plan, chosen, metrics),
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
        "runs": runs,
        "tasks": tasks,
    }


# --- markdown -----------------------------------------------------------------------------------


def _number(value: float | None, signed: bool = False) -> str:
    if value is None or not math.isfinite(value):
        return "–"
    if abs(value) >= 1000:
        return f"{value:+,.0f}" if signed else f"{value:,.0f}"
    return f"{value:+.4g}" if signed else f"{value:.4g}"


def _label(metric: str) -> str:
    return "held-out loss (end of training)" if metric == HELD_OUT else metric


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _mean_table(plan: StudyPlan, group: dict[str, Any], params: dict[str, int] | None) -> list[str]:
    metrics = group["metrics"]
    header = ["variant", *(["non-embedding params"] if params else []), "n"]
    header += [_label(m) for m in metrics]
    rows = []
    for variant, stats in group["statistics"].items():
        n = max((item["n"] for item in stats.values()), default=0)
        cells = [variant + (" (baseline)" if variant == plan.spec.baseline else "")]
        if params:
            cells.append(f"{params[variant]:,}")
        cells.append(f"{n}/{len(plan.spec.seeds)}")
        for metric in metrics:
            item = stats[metric]
            cell = _number(item["mean"])
            if item["sd"] is not None:
                cell += f" ± {_number(item['sd'])}"
            cells.append(cell)
        rows.append(cells)
    return _table(header, rows)


def _p_text(p: float | None) -> str:
    if p is None:
        return "–"
    return "< 0.0001" if p < 1e-4 else f"{p:.3g}"


def _paired_tables(plan: StudyPlan, group: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for metric in group["metrics"]:
        rows = []
        for variant, stats in group["statistics"].items():
            paired = stats[metric].get("paired")
            if paired is None or paired["n"] == 0:
                continue  # the baseline, a metric not compared, or one the variant lacks
            interval = paired.get("interval")
            seeds = paired.get("seeds_needed")
            rows.append(
                [
                    variant,
                    str(paired["n"]),
                    _number(paired["mean"], signed=True),
                    "–"
                    if interval is None
                    else f"[{_number(interval[0], True)}, {_number(interval[1], True)}] "
                    f"({1 - paired['level']:.4g})",
                    _p_text(paired.get("p_holm")),
                    "–" if interval is None else (f"{seeds}" if seeds else "more than 10,000"),
                    paired["verdict"],
                ]
            )
        if rows:
            lines += ["", f"**{_label(metric)}**, variant − {plan.spec.baseline}:", ""]
            lines += _table(
                [
                    "variant",
                    "pairs",
                    "mean difference",
                    "Holm-corrected interval (confidence)",
                    "Holm p",
                    "seeds for 80% power",
                    "reading",
                ],
                rows,
            )
    return lines


def _family_lines(data: dict[str, Any]) -> list[str]:
    """What the paired tables' intervals, p-values, seed counts and words mean."""
    family = data["family"]
    if not family["size"]:
        return []
    return [
        "",
        "## How the comparisons are read",
        "",
        f"Each paired table row is variant − {data['baseline']} over the seeds both completed "
        "(same seed: same initialization seed and the same data in the same order). The "
        f"family is every row of this report's paired tables, {family['size']} comparisons: "
        "the test loss in nats per byte of each variant (at its chosen learning rate) and "
        "each other evaluation's numbers of each variant. Speed, gate sensitivities and the "
        "other spellings of the test loss are described, not compared. Holm's step-down "
        f"procedure corrects the family at level {family['alpha']}: each row's interval is "
        "the Student-t interval at the level Holm tests that row at, so it excludes 0 exactly "
        "when Holm rejects no difference (the intervals of the rejected rows are not "
        'simultaneous confidence intervals); "Holm p" is the adjusted p-value of the '
        'paired t-test. "better"/"worse" (or "higher"/"lower" for a number '
        'without a direction) only when that interval excludes 0; otherwise "not '
        'distinguishable at this budget" with the interval, which leaves every effect inside '
        "it possible.",
        "",
        '"Seeds for 80% power": the seeds at which a paired t-test at level '
        f"{family['strictest_level']:.3g} (the family's strictest Holm level, "
        f"{family['alpha']} / {family['size']}) would detect the row's observed mean "
        f"difference with probability {family['power']:.0%}, if that were the true difference, "
        "the differences were normal with the observed standard deviation, and the family "
        "kept its size (the noncentral t approximated by t quantiles).",
    ]


def _finite(values: Iterable[float | None]) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def _mean_sd(values: Iterable[float | None]) -> str:
    summary = summarize(_finite(values))
    if summary.n == 0:
        return "–"
    return _number(summary.mean) + ("" if summary.n < 2 else f" ± {_number(summary.sd)}")


def _ratio_cells(slots: Iterable[dict[str, Any]]) -> list[str]:
    """The cells of one row of `_gate_lines` from the layer slots it pools (one layer's, or every
    layer's): per quantity, the mean ± sd at initialization and after training, and how many
    trained ratios are below 1."""
    slots = list(slots)
    cells = []
    for of in SENSITIVITY_OF:
        init = [v for slot in slots for v in slot.get(f"init_{of}", {}).values()]
        trained = _finite(v for slot in slots for v in slot.get(f"trained_{of}", {}).values())
        below = sum(1 for v in trained if v < 1)
        cells += [_mean_sd(init), _mean_sd(trained), f"{below}/{len(trained)}"]
    return cells


def _gate_lines(group: dict[str, Any]) -> list[str]:
    """The markdown of `_gate_sensitivity`'s group: per variant, a row per layer, then the
    ranks."""
    lines = ["", f"## Gate sensitivity: size {group['size']}"]
    if any(found["layers"] for found in group["variants"].values()):
        lines += [
            "",
            "Erase/write: the erase gate's sensitivity over the write gate's, of the final memory "
            "and of the loss, mean ± sd over seeds at initialization and after training, per "
            'layer and, on the "all layers" row, as the ratio of the sensitivities summed over '
            "layers (one ratio per seed; the one definition of a ratio over layers in this "
            'report and in the evaluation\'s summary); "erase < write" counts the seeds whose '
            "trained ratio is below 1. Described, not compared.",
        ]
    for variant, found in group["variants"].items():
        layers = found["layers"]
        rows = [[layer, *_ratio_cells([slot])] for layer, slot in layers.items()]
        if len(rows) > 1 and found.get("summed"):
            rows.append(["all layers", *_ratio_cells([found["summed"]])])
        header = ["layer"]
        for of in SENSITIVITY_OF.values():
            header += [f"{of}: init", f"{of}: trained", f"{of}: erase < write"]
        lines += ["", f"**{variant}** (lr {lr_text(found['lr'])}, seeds {sorted(found['seeds'])}):"]
        if rows:
            lines += ["", *_table(header, rows)]
        if found["ranks"]:
            gates = list(next(iter(found["ranks"].values()))["reference"])
            rank_rows = []
            for of, ranks in found["ranks"].items():
                allocated = ranks["allocated"]
                rank_rows.append(
                    [f"by the {SENSITIVITY_OF.get(of, of)}'s sensitivity"]
                    + [
                        f"{_mean_sd(a.get(g) for a in allocated)} ({ranks['reference'][g]})"
                        for g in gates
                    ]
                )
            source = next(iter(found["ranks"].values()))["source"]
            lines += [
                "",
                f"Ranks `allocate_ranks` gives the trained {variant}'s gates within the "
                f"reference's budget, mean ± sd over layers and seeds (in parentheses the "
                f"reference: the {source}'s):",
                "",
            ]
            lines += _table(["allocated", *gates], rank_rows)
    return lines


def _rate_lines(plan: StudyPlan, data: dict[str, Any]) -> list[str]:
    """The learning rate each variant is reported at, and how it was chosen."""
    selection = data["selection"]
    lines = ["", "## Learning rates", ""]
    if len(selection["lrs"]) == 1:
        lines.append(
            f"One learning rate for every variant, {lr_text(selection['lrs'][0])}: nothing is "
            "chosen, and every perplexity number is the test windows'."
        )
    else:
        lines += [
            f"Each variant trained at {', '.join(lr_text(lr) for lr in selection['lrs'])}; its "
            f"results are given at the rate with the {'lowest' if selection['goal'] == 'min' else 'highest'} "
            f"mean {selection['metric']} over seeds, measured on the first "
            f"{selection['validation_fraction']:.0%} of the perplexity windows (validation); "
            "the test numbers are the other windows'. Validation means per rate:",
            "",
        ]
        for group in data["groups"]:
            header = ["variant", "size", "chosen", *(lr_text(lr) for lr in selection["lrs"])]
            rows = []
            for variant, rate in group["rates"].items():
                cells = [variant, group["size"], "–" if rate["lr"] is None else lr_text(rate["lr"])]
                for lr in selection["lrs"]:
                    found = rate["validation"].get(repr(lr)) or {}
                    cells.append(
                        "–"
                        if found.get("mean") is None
                        else f"{found['mean']:.4g} (n={found['n']})"
                    )
                rows.append(cells)
            lines += _table(header, rows)
            unchosen = [v for v, rate in group["rates"].items() if rate["lr"] is None]
            if unchosen:
                lines += [
                    "",
                    f"{', '.join(unchosen)} (size {group['size']}): no rate chosen, no completed "
                    f"run measured {selection['metric']}; no results are given for them.",
                ]
    for group in data["task_groups"]:
        lines += _task_rate_lines(plan, data, group["task"])
    return lines


def _task_rate_lines(plan: StudyPlan, data: dict[str, Any], task: str) -> list[str]:
    """The rate a task that sweeps its own (mqar-train) chose per variant and seed."""
    chosen: dict[str, dict[str, list[int]]] = {}
    legacy = False
    for entry in data["tasks"]:
        if entry["task"] != task or entry["status"] != "completed":
            continue
        lr = entry["metrics"].get(f"{task}.lr")
        lrs = entry.get("lrs") or []
        if lr is None and len(lrs) == 1:
            lr = lrs[0]  # one rate: nothing to choose, in records of any age
        if lr is None:
            legacy = True
            continue
        chosen.setdefault(entry["variant"], {}).setdefault(lr_text(lr), []).append(entry["seed"])
    if legacy:
        return [
            "",
            f"{task}: these records predate the validation examples: each test setting reports "
            "the better of the task's learning rates on the test examples themselves, a choice "
            "that favors every variant by the test examples' noise. Rerun the task to choose on "
            "validation examples.",
        ]
    if not chosen:
        return []
    rows = [
        [variant, "; ".join(f"{lr} (seeds {seeds})" for lr, seeds in rates.items())]
        for variant, rates in chosen.items()
    ]
    return [
        "",
        f"{task} trains its own models at each of its rates and chooses one per job on "
        "validation examples generated apart from the test ones (with one rate, that rate):",
        "",
        *_table(["variant", f"{task} rate chosen (seeds)"], rows),
    ]


def _markdown(plan: StudyPlan, data: dict[str, Any], figures: list[str]) -> str:
    spec = plan.spec
    budget = data["budget"]
    spec_name = data["spec"] or "(given as data)"
    lines = [
        f"# Study: {Path(spec_name).name}",
        "",
        f"Spec `{spec_name}`, run with `deltalab study {spec_name}`; written {data['written']} on "
        f"{data['machine']['platform']} ({data['machine']['cpus']} CPUs); the runs trained on "
        f"{data['device']} (their records), {spec.parallel} run(s) at a time; "
        f"code {', '.join(data['code']) or 'not recorded'}.",
    ]
    for invocation in data["invocations"]:
        lines.append(
            f"Invocation {invocation['started']}: {invocation.get('wall_s', 0):.0f} s wall, "
            f"{invocation.get('launched', 0)} command(s) launched."
        )
    lines += [
        "",
        f"Every run: {budget['steps']} steps x {budget['batch_size']} sequences x "
        f"{budget['seq_len']} tokens = {budget['tokens_per_run']:,} training tokens, the same "
        f"data in the same order for every variant at a given seed (data.source="
        f"{budget['data']['source']!r}, held-out fraction {budget['data']['held_out_fraction']}). "
        f"Seeds {list(spec.seeds)}. Non-embedding parameters matched to {spec.match}'s "
        f"({', '.join(f'{s}: {t:,}' for s, t in plan.targets.items())}) within "
        f"{spec.tolerance:.0%} by the FFN width.",
        "",
        "Status: "
        + ", ".join(f"{count} {status}" for status, count in data["counts"].items() if count)
        + ".",
    ]
    lines += _rate_lines(plan, data)
    for group in data["groups"]:
        if not group["metrics"]:
            continue  # no variant has a chosen rate (said under "Learning rates")
        sized = {r.variant.name: r.params for r in plan.runs if r.size == group["size"]}
        lines += [
            "",
            f"## Language modeling: size {group['size']}",
            "",
            "Each variant at its chosen learning rate: mean ± standard deviation over the seeds "
            f"that completed (n of {len(spec.seeds)}); perplexity numbers are the test "
            "windows'. Paired differences in nats per byte of test text (for a byte-level "
            "tokenizer, nats per token).",
            "",
        ]
        lines += _mean_table(plan, group, sized)
        lines += _paired_tables(plan, group)
    for group in data["task_groups"]:
        lines += [
            "",
            f"## {group['task']} (its own models, one per variant and seed)",
            "",
            "Mean ± standard deviation over seeds.",
            "",
        ]
        lines += _mean_table(plan, group, None)
        lines += _paired_tables(plan, group)
    lines += _family_lines(data)
    for group in data["gate_sensitivity"]:
        lines += _gate_lines(group)
    incomplete = [e for e in data["runs"] + data["tasks"] if e["status"] != "completed"]
    lines += ["", "## Runs that did not complete", ""]
    if incomplete:
        lines += _table(
            ["run", "status", "stage", "error"],
            [[e["name"], e["status"], e.get("stage", ""), e["error"] or "–"] for e in incomplete],
        )
    else:
        lines.append("None: every run completed.")
    lines += ["", "## Every run", ""]
    rows = []
    for entry in data["runs"]:
        metrics = entry["metrics"]
        rows.append(
            [
                entry["name"],
                entry["status"],
                f"{entry['params']:,}",
                str(entry["ffn_width"]),
                _number(metrics.get(HELD_OUT)),
                _number(metrics.get("perplexity.perplexity")),
                _number(entry["elapsed_s"]),
            ]
        )
    lines += _table(
        ["run", "status", "params", "ffn", "held-out loss", "perplexity", "wall s"], rows
    )
    if figures:
        lines += ["", "## Figures", ""]
        lines += [f"![{Path(f).stem}]({f})" for f in figures]
    return "\n".join(lines) + "\n"


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
    temporary.write_text(_markdown(plan, data, figures), encoding="utf-8")
    os.replace(temporary, markdown)
    written["markdown"] = markdown
    return written
