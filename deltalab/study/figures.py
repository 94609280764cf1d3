"""The figures of a study report: training loss per variant (each at its chosen learning rate),
a task's numbers per setting, perplexity against parameters across sizes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from deltalab.study.compare import HELD_OUT
from deltalab.study.plan import PlannedRun, StudyPlan, lr_text

__all__ = ["loss_figure", "scaling_figure", "task_figure"]


def _group_label(plan: StudyPlan, group: dict[str, Any]) -> str:
    if len(plan.lrs) == 1:
        return f"size {group['size']}, lr {lr_text(plan.lrs[0])}"
    return f"size {group['size']}, each variant at its chosen learning rate"


def _at_chosen_rate(plan: StudyPlan, group: dict[str, Any], variant: str) -> list[PlannedRun]:
    """The runs of `variant` in the size `group` at the variant's chosen learning rate."""
    lr = group["rates"][variant]["lr"]
    return [r for r in plan.runs if r.variant.name == variant and r.group == (group["size"], lr)]


def _curve(run_dir: Path, kind: str) -> tuple[list[int], list[float]]:
    """(steps, losses) of a run's `log.jsonl` records of `kind` ("train" or "eval")."""
    steps, losses = [], []
    try:
        lines = (run_dir / "log.jsonl").read_text(errors="replace").splitlines()
    except OSError:
        return steps, losses
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("kind") == kind:
            steps.append(int(record["step"]))
            losses.append(float(record["loss"]))
    return steps, losses


def _smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _colors(plan: StudyPlan) -> dict[str, Any]:
    from matplotlib import colormaps

    palette = colormaps["tab10" if len(plan.spec.variants) <= 10 else "tab20"]
    return {v.name: palette(i % palette.N) for i, v in enumerate(plan.spec.variants)}


def loss_figure(plan: StudyPlan, data: dict[str, Any], path: Path) -> Path | None:
    from deltalab.analysis._plot import new_figure, save_figure

    groups = data["groups"]
    if not groups:
        return None
    colors = _colors(plan)
    figure = new_figure(figsize=(7.5, 4.5 * len(groups)))
    entries = {e["name"]: e for e in data["runs"]}
    for index, group in enumerate(groups):
        axes = figure.add_subplot(len(groups), 1, index + 1)
        shown = []
        for variant in plan.spec.variants:
            runs = _at_chosen_rate(plan, group, variant.name)
            shown += runs
            curves = []
            for run in runs:
                steps, losses = _curve(run.directory, "train")
                if not steps:
                    continue
                window = max(1, run.config.train.steps // 20)
                if entries[run.name]["status"] == "completed":
                    curves.append((steps, _smooth(losses, window)))
                else:
                    # A run that did not complete is drawn alone, dashed, to where it stopped.
                    axes.plot(
                        steps, _smooth(losses, window), "--", color=colors[variant.name], lw=0.8
                    )
                    axes.plot(
                        steps[-1:], _smooth(losses, window)[-1:], "x", color=colors[variant.name]
                    )
            if not curves:
                continue
            length = min(len(c[0]) for c in curves)
            steps = curves[0][0][:length]
            columns = list(zip(*(c[1][:length] for c in curves), strict=True))
            mean = [sum(c) / len(c) for c in columns]
            axes.plot(
                steps,
                mean,
                color=colors[variant.name],
                lw=1.4,
                label=f"{variant.name} ({len(curves)})",
            )
            if len(curves) > 1:
                axes.fill_between(
                    steps, [min(c) for c in columns], [max(c) for c in columns],
                    color=colors[variant.name], alpha=0.18, lw=0,
                )  # fmt: skip
        axes.set_title(
            f"training loss, mean over seeds (band: min to max), {_group_label(plan, group)}"
        )
        axes.set_xlabel("step")
        axes.set_ylabel("loss (nats / token), moving average")
        axes.grid(alpha=0.3)
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize=7, ncols=2)
        tops = [
            _smooth(_curve(r.directory, "train")[1], max(1, r.config.train.steps // 20))
            for r in shown
        ]
        ends = [t[len(t) // 4] for t in tops if t and math.isfinite(t[len(t) // 4])]
        lows = [min(x for x in t if math.isfinite(x)) for t in tops if any(map(math.isfinite, t))]
        if ends and lows and max(ends) > min(lows):
            # The first quarter is the steep descent every model shares; the comparison is below.
            axes.set_ylim(min(lows) - 0.05 * (max(ends) - min(lows)), max(ends))
    return save_figure(figure, path)


def task_figure(plan: StudyPlan, group: dict[str, Any], path: Path) -> Path | None:
    from deltalab.analysis._plot import new_figure, save_figure

    metrics = group["metrics"]
    if not metrics:
        return None
    colors = _colors(plan)
    variants = [v.name for v in plan.spec.variants]
    figure = new_figure(figsize=(max(6.0, 1.2 * len(metrics) + 2), 4.0))
    axes = figure.add_subplot(1, 1, 1)
    width = 0.8 / len(variants)
    for i, variant in enumerate(variants):
        stats = group["statistics"][variant]
        means = [stats[m]["mean"] if stats[m]["mean"] is not None else 0.0 for m in metrics]
        errors = [stats[m]["sd"] or 0.0 for m in metrics]
        positions = [j + (i - (len(variants) - 1) / 2) * width for j in range(len(metrics))]
        axes.bar(
            positions, means, width, yerr=errors, color=colors[variant], label=variant, capsize=2
        )
    prefix = f"{group['task']}."
    axes.set_xticks(range(len(metrics)), [m.removeprefix(prefix) for m in metrics])
    axes.set_ylabel(f"{group['task']} (mean over seeds, bar: sd)")
    axes.set_xlabel("setting")
    axes.grid(alpha=0.3, axis="y")
    axes.legend(fontsize=7, ncols=2)
    return save_figure(figure, path)


def scaling_figure(plan: StudyPlan, data: dict[str, Any], path: Path) -> Path | None:
    from deltalab.analysis._plot import finish_figure, new_figure

    if len(plan.sizes) < 2:
        return None
    colors = _colors(plan)
    figure = new_figure(figsize=(6.5, 4.5))
    axes = figure.add_subplot(1, 1, 1)
    for variant in plan.spec.variants:
        xs, ys, errors = [], [], []
        for group in data["groups"]:
            stats = group["statistics"][variant.name]
            metric = "perplexity.perplexity" if "perplexity.perplexity" in stats else HELD_OUT
            item = stats.get(metric)
            runs = _at_chosen_rate(plan, group, variant.name)
            if item is None or item["mean"] is None or not runs:
                continue
            xs.append(runs[0].params)
            value = item["mean"] if metric != HELD_OUT else math.exp(item["mean"])
            ys.append(value)
            errors.append((item["sd"] or 0.0) if metric != HELD_OUT else 0.0)
        if xs:
            axes.errorbar(
                xs, ys, yerr=errors, marker="o", color=colors[variant.name], label=variant.name,
                capsize=2,
            )  # fmt: skip
    axes.set_xscale("log")
    axes.set_xlabel("non-embedding parameters")
    axes.set_ylabel("test perplexity (mean over seeds, each variant at its chosen rate)")
    return finish_figure(figure, axes, path, legend_size=7)
