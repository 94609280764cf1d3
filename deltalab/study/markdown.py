"""study.md: the markdown text of a study report, rendered from `collect`'s data (what
study.json holds): the opening lines (spec, machine, budget, status), the learning rates chosen,
per size and per task the mean table and the paired tables (and per size the steps and time
to the baseline's loss), how the comparisons are read, the
gate sensitivities, the runs that did not complete and every run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from deltalab.study.compare import HELD_OUT
from deltalab.study.plan import StudyPlan, lr_text
from deltalab.study.stats import summarize

__all__ = ["render_markdown"]

# The two quantities the gate-sensitivity analysis measures a gate's effect on.
SENSITIVITY_OF = {"state": "final memory", "loss": "loss"}


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


def _header_lines(plan: StudyPlan, data: dict[str, Any]) -> list[str]:
    """The title, where and how the study ran, the budget of every run and the status counts."""
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
    return lines


def _run_lines(data: dict[str, Any]) -> list[str]:
    """The runs that did not complete, then every run with its size and results."""
    incomplete = [e for e in data["runs"] + data["tasks"] if e["status"] != "completed"]
    lines = ["", "## Runs that did not complete", ""]
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
    return lines


def _factor(summary: dict[str, Any] | None, reached: int, paired: int) -> str:
    if summary is None:
        return f"– ({reached}/{paired} reached)"
    spread = "" if summary["n"] < 2 else f" [{summary['min']:.2f}, {summary['max']:.2f}]"
    return f"{summary['geometric_mean']:.2f}{spread} ({reached}/{paired} reached)"


def _seed_cell(seed: str, row: dict[str, Any]) -> str:
    if row["status"] == "reached":
        return f"s{seed}: {row['steps']:.0f}"
    return f"s{seed}: {row['status']}"


def _to_loss_lines(plan: StudyPlan, group: dict[str, Any], speeds: dict[str, Any]) -> list[str]:
    """`to_loss.to_loss`'s table for one size: per variant its factors and each seed's steps,
    and its speed alone where the study measured it (`speeds`: variant -> throughput entry)."""
    found = group.get("to_loss") or {}
    baseline = plan.spec.baseline
    if not found:
        return []
    every = plan.runs[0].config.eval.every
    lines = [
        "",
        f"### Steps and time to {baseline}'s loss",
        "",
        f"Per seed, the target is {baseline}'s held-out loss at its last evaluation; each run's "
        "steps to it are read off its held-out curve, interpolated between evaluations "
        f"{f'{every} steps apart' if every else 'before and after training only'}, so a step "
        "count is known to within that spacing. A factor is the baseline's steps (or seconds) "
        "over the variant's; it exists only where the variant reaches the target within the "
        'budget, so a slower variant shows "not reached", not a factor below 1. Geometric '
        "mean [range] over the seeds, given only when every seed has a factor. "
        "Time is steps x seconds a step, both sides at their throughput runs' speeds (alone, one "
        "device), else at their own runs' where both trained alone. Descriptive: not among the "
        "corrected comparisons.",
        "",
    ]
    rows = []
    for variant, item in found.items():
        seeds = item["seeds"]
        cells = [_seed_cell(seed, row) for seed, row in seeds.items()]
        cells += [f"s{seed}: no {baseline} run" for seed in item["unpaired"]]
        speed = (speeds.get(variant) or {}).get("tokens_per_s")
        if variant == baseline:
            factors = ["1 (the baseline)", "1 (the baseline)"]
        else:
            time_cell = _factor(item["time_factor"], item["reached"], len(seeds))
            if item["no_time"]:
                reasons = "; ".join(item["no_time"])
                time_cell = f"– ({reasons}; {item['reached']}/{len(seeds)} reached)"
            factors = [_factor(item["steps_factor"], item["reached"], len(seeds)), time_cell]
        rows.append([variant, *factors, ", ".join(cells), _number(speed)])
    if baseline not in found:
        lines.append(f"No completed {baseline} run at its chosen rate: no target.")
        return lines
    header = ["variant", "steps factor", "time factor", "steps to loss", "tokens/s alone"]
    return lines + _table(header, rows)


def render_markdown(plan: StudyPlan, data: dict[str, Any], figures: list[str]) -> str:
    """The study's report: header, learning rates, each size's and task's tables, families,
    gate sensitivity, the runs, then the figures."""
    spec = plan.spec
    lines = _header_lines(plan, data)
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
        lines += _to_loss_lines(plan, group, (data.get("throughput") or {}).get(group["size"], {}))
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
    lines += _run_lines(data)
    if figures:
        lines += ["", "## Figures", ""]
        lines += [f"![{Path(f).stem}]({f})" for f in figures]
    return "\n".join(lines) + "\n"
