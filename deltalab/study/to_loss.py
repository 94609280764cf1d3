"""How soon each variant reaches the baseline's loss: steps to loss and wall-clock to loss.

For seed s, the target is the baseline's final held-out loss at s (its last evaluation during
training). A run's steps to that loss are read off its held-out curve (the trainer's evaluations:
before training, every `eval.every` steps, at the end): the first evaluation at or below the
target, the step interpolated linearly between it and the evaluation before. The baseline reaches its own target
at its last evaluation or before (a curve that dipped there earlier reaches it there).

    steps factor = baseline's steps to loss / the variant's     (> 1: the variant is sooner)
    time factor  = baseline's seconds to loss / the variant's

Seconds to loss = steps to loss x seconds a step. A second a step is the variant's speed alone:
its throughput run's median tokens/s (the spec's `throughput`, one short run alone on its
device before the grid starts), else its own run's where that run trained alone. A run that
shared its device (`device_shared_by` > 1 in its study_run.json: the study's `parallel` over
the devices) and has no throughput run gets no time factor, and the report says why. A run that never reaches the target within
its budget has no factor; it is listed as "not reached", which is slower than any factor.

These numbers describe the runs (like tokens/s): they are not in the report's corrected family
of comparisons. They read the held-out split the trainer evaluates on, not the study's
validation windows, and they choose nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from deltalab.study.stats import summarize

__all__ = ["held_out_curve", "steps_to_loss", "to_loss"]


def held_out_curve(run_dir: Path) -> list[tuple[int, float]]:
    """A completed run's (step, held-out loss) curve, in step order: the loss before training
    (step 0) and at the end from its metrics.json, the evaluations between from its log.jsonl
    (the last of several at one step, as a resumed run evaluates again); [] without both."""
    try:
        metrics = json.loads((run_dir / "metrics.json").read_text())
        lines = (run_dir / "log.jsonl").read_text(errors="replace").splitlines()
    except (OSError, ValueError):
        return []
    points: dict[int, float] = {}
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("kind") == "eval":
            points[int(entry["step"])] = float(entry["loss"])
    try:
        points[0] = float(metrics["initial_eval_loss"])
        points[int(metrics["steps_done"])] = float(metrics["final_eval_loss"])
    except (KeyError, TypeError, ValueError):
        return []
    return sorted(points.items())


def steps_to_loss(curve: list[tuple[int, float]], target: float) -> float | None:
    """The step at which `curve` first reaches `target` (loss <= target), interpolated linearly
    between the evaluation that reaches it and the one before; None where none does. A first
    evaluation that already reaches it gives its own step."""
    for i, (step, loss) in enumerate(curve):
        if loss <= target:
            if i == 0:
                return float(step)
            before_step, before_loss = curve[i - 1]
            # before_loss > target >= loss, so the fraction is in (0, 1].
            fraction = (before_loss - target) / (before_loss - loss)
            return before_step + fraction * (step - before_step)
    return None


def _seconds_per_step(entry: dict[str, Any], tokens_per_step: int) -> float | None:
    speed = entry["metrics"].get("tokens_per_s")
    return tokens_per_step / speed if speed else None


def to_loss(
    entries: list[dict[str, Any]],
    baseline: str,
    out_dir: Path,
    tokens_per_step: int,
    speeds: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Per variant (its completed `entries` at its chosen rate, as `report.collect` builds them),
    per seed paired with the baseline's run of that seed: the target, the steps and seconds to
    it, both factors; and the mean and sd of each factor over the seeds that have one.

    `speeds`: tokens/s per variant measured alone (the study's throughput runs); a variant
    without one is timed at its own run's tokens/s where that run trained alone."""
    speeds = speeds or {}
    runs = {(e["variant"], e["seed"]): e for e in entries if e["status"] == "completed"}
    curves = {key: held_out_curve(out_dir / e["directory"]) for key, e in runs.items()}
    out: dict[str, Any] = {}
    # The baseline first, then the variants in the order `entries` lists them (the spec's).
    order = {e["variant"]: i for i, e in reversed(list(enumerate(entries)))} | {baseline: -1}
    for (variant, seed), entry in sorted(
        runs.items(), key=lambda item: (order[item[0][0]], item[0][1])
    ):
        base = runs.get((baseline, seed))
        if base is None or not curves[(baseline, seed)] or not curves[(variant, seed)]:
            continue
        target = curves[(baseline, seed)][-1][1]
        base_steps = steps_to_loss(curves[(baseline, seed)], target)
        steps = steps_to_loss(curves[(variant, seed)], target)
        row: dict[str, Any] = {"target": target, "steps": steps, "baseline_steps": base_steps}
        row["steps_factor"] = base_steps / steps if steps and base_steps else None
        if variant in speeds and baseline in speeds:
            shared = [1, 1]  # the throughput runs trained alone
            per_step = tokens_per_step / speeds[variant]
            base_per_step = tokens_per_step / speeds[baseline]
        else:
            shared = [e.get("device_shared_by") for e in (entry, base)]
            per_step = _seconds_per_step(entry, tokens_per_step)
            base_per_step = _seconds_per_step(base, tokens_per_step)
        alone = shared == [1, 1]
        # Records from before the study kept `device_shared_by` say nothing: "unknown".
        row["alone"] = alone if None not in shared else None
        row["seconds"] = steps * per_step if steps is not None and per_step else None
        row["time_factor"] = None
        if alone and row["seconds"] and base_steps is not None and base_per_step:
            row["time_factor"] = base_steps * base_per_step / row["seconds"]
        out.setdefault(variant, {"seeds": {}})["seeds"][str(seed)] = row
    for variant in out.values():
        for factor in ("steps_factor", "time_factor"):
            values = [r[factor] for r in variant["seeds"].values() if r[factor] is not None]
            summary = summarize(values)
            variant[factor] = {"n": summary.n, "mean": summary.mean, "sd": summary.sd}
        variant["not_reached"] = sum(r["steps"] is None for r in variant["seeds"].values())
        variant["shared"] = sum(r["alone"] is False for r in variant["seeds"].values())
        variant["unrecorded"] = sum(r["alone"] is None for r in variant["seeds"].values())
    return out
