"""What a study report compares, and how: the learning rate each variant is reported at (chosen
on validation numbers), which metrics are compared against the baseline and in which direction
a difference is better, and Holm's correction over every comparison of one report.

The family. Every paired comparison a report prints (a row of its paired tables) is one
hypothesis of one family, corrected together with Holm's step-down procedure at level ALPHA: the
test loss in nats per byte of each variant at each size, and each other evaluation's numbers
(an MQAR accuracy per setting, a passkey score) of each variant. Numbers that only describe a
run (speed, gate sensitivities, the other spellings of the test loss: perplexity, bits per byte,
nats per token) are shown, not compared.
"""

from __future__ import annotations

import math
from typing import Any

from deltalab.study.stats import (
    Paired,
    holm_adjusted,
    holm_levels,
    seeds_needed,
    summarize,
    verdict,
)

__all__ = [
    "ALPHA",
    "NATS_PER_BYTE",
    "POWER",
    "add_derived",
    "choose_rates",
    "compared",
    "correct_family",
]

ALPHA = 0.05
POWER = 0.8
HELD_OUT = "held_out_loss"
NATS_PER_BYTE = "perplexity.nats_per_byte"
# Measured but not compared: the other spellings of the test loss, the validation numbers (they
# chose the rate), speed, and the gate sensitivities (a description of the trained gates).
DESCRIPTIVE_PREFIXES = ("gate-sensitivity.",)
DESCRIPTIVE = (
    "tokens_per_s",
    "perplexity.loss",
    "perplexity.perplexity",
    "perplexity.bits_per_byte",
    "perplexity.validation_loss",
    "perplexity.validation_bits_per_byte",
    "perplexity.validation_nats_per_byte",
    "mqar-train.lr",
    "mqar-train.validation",
)
# Which way is better, for the compared metrics that have one; the others read higher/lower.
HIGHER_IS = {NATS_PER_BYTE: "worse", HELD_OUT: "worse"}
HIGHER_IS_PREFIXES = {"mqar-train.": "better", "passkey.": "better", "niah-": "better"}


def add_derived(found: dict[str, float]) -> None:
    """Adds the test (and validation) loss in nats per byte beside the bits per byte the
    perplexity evaluation writes: the unit the report compares in."""
    for bits, nats in (
        ("perplexity.bits_per_byte", NATS_PER_BYTE),
        ("perplexity.validation_bits_per_byte", "perplexity.validation_nats_per_byte"),
    ):
        if found.get(bits) is not None:
            found[nats] = found[bits] * math.log(2)


def compared(metric: str, metrics: list[str]) -> bool:
    """Whether `metric` (of a group measuring `metrics`) is compared against the baseline: the
    training loop's held-out loss only where no perplexity evaluation measures the test loss."""
    if metric == HELD_OUT:
        return NATS_PER_BYTE not in metrics
    return metric not in DESCRIPTIVE and not metric.startswith(DESCRIPTIVE_PREFIXES)


def higher_is(metric: str) -> str | None:
    if metric in HIGHER_IS:
        return HIGHER_IS[metric]
    return next((w for p, w in HIGHER_IS_PREFIXES.items() if metric.startswith(p)), None)


def choose_rates(
    spec: Any, entries: list[dict[str, Any]], lrs: list[float]
) -> dict[str, dict[str, Any]]:
    """Per variant, the learning rate its results are reported at: the one of `lrs` whose
    completed runs have the best mean `spec.selection.metric` over seeds (the first of `lrs` on
    a tie), with that mean per rate. One rate: that rate, nothing chosen. None where no rate has
    a completed run with the metric."""
    selection = spec.selection
    out: dict[str, dict[str, Any]] = {}
    for variant in (v.name for v in spec.variants):
        if len(lrs) == 1:
            out[variant] = {"lr": lrs[0], "validation": {}}
            continue
        means = {}
        for lr in lrs:
            values = [
                e["metrics"].get(selection.metric)
                for e in entries
                if e["variant"] == variant and e["lr"] == lr and e["status"] == "completed"
            ]
            summary = summarize([v for v in values if v is not None])
            means[lr] = (summary.n, summary.mean)
        candidates = [lr for lr in lrs if means[lr][1] is not None]
        sign = 1 if selection.goal == "min" else -1
        best = min(candidates, key=lambda lr: sign * means[lr][1]) if candidates else None
        out[variant] = {
            "lr": best,
            "validation": {repr(lr): {"n": n, "mean": mean} for lr, (n, mean) in means.items()},
        }
    return out


def correct_family(groups: list[dict[str, Any]]) -> dict[str, Any]:
    """Holm's correction over every paired comparison in `groups` (each with "statistics":
    variant -> metric -> item, an item's "paired" holding "p" and its differences): each
    comparison gets its Holm-adjusted p-value, its interval at the level Holm tests it at, the
    wording that interval allows, and the seeds that would detect its mean difference. Returns
    the family's description."""
    items = [
        (metric, item["paired"])
        for group in groups
        for stats in group["statistics"].values()
        for metric, item in stats.items()
        if item.get("paired") is not None and item["paired"]["p"] is not None
    ]
    p_values = [paired["p"] for _, paired in items]
    adjusted = holm_adjusted(p_values)
    levels = holm_levels(p_values, ALPHA)
    strictest = ALPHA / len(items) if items else ALPHA
    for (metric, paired), p_holm, level in zip(items, adjusted, levels, strict=True):
        mean, sd, n = paired["mean"], paired["sd"], paired["n"]
        at = Paired(n, mean, sd, None, None, paired["p"]).at(1 - level)
        low, high = at.low, at.high
        paired.update(
            p_holm=p_holm,
            level=level,
            interval=[low, high],
            verdict=verdict(low, high, higher_is(metric)),
            seeds_needed=seeds_needed(mean, sd, strictest, POWER),
        )
    return {"size": len(items), "alpha": ALPHA, "power": POWER, "strictest_level": strictest}
