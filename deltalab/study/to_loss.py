"""How soon each variant reaches the baseline's loss: steps to loss and wall-clock to loss.

For seed s, the target is the baseline's held-out loss at its last evaluation at s. A run's
steps to it are read off its held-out curve (the trainer's evaluations: before training, every
`eval.every` steps, at the end; at least `MIN_EVALUATIONS`): the first evaluation at or below
the target, the step interpolated linearly between it and the evaluation before, so a step is
known to within the evaluations' spacing. The baseline reaches its own target at its last
evaluation or before (a curve that dipped there earlier reaches it there).

    steps factor = baseline's steps to loss / the variant's     (> 1: the variant is sooner)
    time factor  = baseline's seconds to loss / the variant's

Seconds to loss = steps to loss x seconds a step. Both sides of a pair are timed at their
throughput runs' median tokens/s (the spec's `throughput`: one short run per variant alone on
its device before the grid starts) when both variants have one on one device; else at their own
runs' tokens/s when both trained alone (`device_shared_by` 1 in study_run.json); else the pair
has no time factor, and the report says why. A seed that never reaches the target within the
budget is "not reached"; a variant's factors are summarized (geometric mean and range) only
when every paired seed has one, since leaving out a seed that never got there would raise the
mean.

These numbers describe the runs (like tokens/s): they are not in the report's corrected family
of comparisons. They read the held-out split the trainer evaluates on, not the study's
validation windows, and they choose nothing.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

__all__ = ["MIN_EVALUATIONS", "held_out_curve", "steps_to_loss", "to_loss"]

# Before training, one evaluation between and at the end: with two, a step to the target would
# be the interpolation of a straight line from the first loss to the last.
MIN_EVALUATIONS = 3


def held_out_curve(run_dir: Path) -> list[tuple[int, float]]:
    """A completed run's held-out evaluations as (step, loss), in step order, from the history
    in its metrics.json (before training, every `eval.every` steps, at the end); [] where the
    file or its history is missing."""
    try:
        history = json.loads((run_dir / "metrics.json").read_text())["history"]["eval"]
        return sorted((int(e["step"]), float(e["loss"])) for e in history)
    except (OSError, ValueError, KeyError, TypeError):
        return []


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


def _seconds_a_step(
    variant: str,
    baseline: str,
    pair: tuple[dict[str, Any], dict[str, Any]],
    speeds: dict[str, dict[str, Any]],
    tokens_per_step: int,
) -> tuple[float, float] | str:
    """Both sides' seconds a step (the variant's, the baseline's), or why there are none: at
    the speed runs' tokens/s when both variants have one, on one device; else at the pair's own
    runs' where both trained alone on the same kind of device."""
    if variant in speeds and baseline in speeds:
        if len({speeds[v].get("device") for v in (variant, baseline)}) > 1:
            return "speed runs on different devices"
        rates = [speeds[v].get("tokens_per_s") for v in (variant, baseline)]
    else:
        shared = [e.get("device_shared_by") for e in pair]
        if None in shared:
            return "device sharing not recorded"
        if shared != [1, 1]:
            return "shared a device"
        if len({e.get("recorded_device") for e in pair}) > 1:
            return "trained on different devices"
        rates = [e["metrics"].get("tokens_per_s") for e in pair]
    if not all(rates):
        return "no speed recorded"
    return tokens_per_step / rates[0], tokens_per_step / rates[1]


def _pair_row(
    curve: list[tuple[int, float]],
    base_curve: list[tuple[int, float]],
    timing: tuple[float, float] | str,
) -> dict[str, Any]:
    """One seed of a variant against the baseline's run of that seed; `timing` as
    `_seconds_a_step` gives it."""
    row: dict[str, Any] = {"steps": None, "steps_factor": None, "time_factor": None}
    if min(len(curve), len(base_curve)) < MIN_EVALUATIONS:
        return row | {"status": "too few evaluations"}
    target = base_curve[-1][1]
    base_steps = steps_to_loss(base_curve, target)
    steps = steps_to_loss(curve, target)
    row.update(target=target, steps=steps, baseline_steps=base_steps)
    if not base_steps:  # the baseline's loss before training is at or below its last
        return row | {"status": "baseline did not improve"}
    if steps is None:
        return row | {"status": "not reached"}
    if steps == 0:  # at the target before training: no number of steps to compare
        return row | {"status": "at the target from the start"}
    row["status"] = "reached"
    row["steps_factor"] = base_steps / steps
    if isinstance(timing, str):
        return row | {"no_time": timing}
    seconds, base_seconds = timing
    row["time_factor"] = base_steps * base_seconds / (steps * seconds)
    return row


def _summary(rows: dict[str, dict[str, Any]], factor: str) -> dict[str, Any] | None:
    """The geometric mean and range of a factor over the seeds, only when every paired seed has
    one: a seed that never reached the target would otherwise be dropped from a mean it would
    lower."""
    values = [r[factor] for r in rows.values()]
    if not values or any(v is None for v in values):
        return None
    return {
        "n": len(values),
        "geometric_mean": statistics.geometric_mean(values),
        "min": min(values),
        "max": max(values),
    }


def to_loss(
    entries: list[dict[str, Any]],
    baseline: str,
    out_dir: Path,
    tokens_per_step: int,
    speeds: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Per variant (its completed `entries` at its chosen rate, as `report.collect` builds them),
    per seed paired with the baseline's run of that seed: the target, the steps to it, the
    status ("reached", "not reached", "at the target from the start", "too few evaluations",
    "baseline did not improve") and both factors; over the seeds, each factor's geometric mean
    and range where every paired seed has one.

    `speeds`: variant -> {"tokens_per_s", "device"} of its throughput run (trained alone). Both
    sides of a pair are timed at their throughput runs' speeds when both have one on one device,
    else at their own runs' tokens/s when both trained alone, else not timed."""
    speeds = speeds or {}
    runs = {(e["variant"], e["seed"]): e for e in entries if e["status"] == "completed"}
    curves = {key: held_out_curve(out_dir / e["directory"]) for key, e in runs.items()}
    out: dict[str, Any] = {}
    # The baseline first, then the variants in the order `entries` lists them (the spec's).
    order = {e["variant"]: i for i, e in reversed(list(enumerate(entries)))} | {baseline: -1}
    for variant, seed in sorted(runs, key=lambda key: (order[key[0]], key[1])):
        item = out.setdefault(variant, {"seeds": {}, "unpaired": []})
        base = runs.get((baseline, seed))
        if base is None:
            item["unpaired"].append(seed)
            continue
        pair = (runs[(variant, seed)], base)
        timing = _seconds_a_step(variant, baseline, pair, speeds, tokens_per_step)
        item["seeds"][str(seed)] = _pair_row(
            curves[(variant, seed)], curves[(baseline, seed)], timing
        )
    for item in out.values():
        rows = item["seeds"]
        item["reached"] = sum(r["status"] == "reached" for r in rows.values())
        item["steps_factor"] = _summary(rows, "steps_factor")
        item["time_factor"] = _summary(rows, "time_factor")
        item["no_time"] = sorted({r["no_time"] for r in rows.values() if r.get("no_time")})
    return out
