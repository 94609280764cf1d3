"""The statistics of a study report: mean and standard deviation over seeds, paired differences
against a baseline with Student-t intervals, Holm's correction over a family of comparisons,
the wording a corrected interval allows, and the seeds an effect would need.

Pure Python (no SciPy, which deltalab does not depend on): the t quantile is found by bisection
on the t distribution function, written with the regularized incomplete beta function.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

__all__ = [
    "NOT_DISTINGUISHABLE",
    "Paired",
    "Summary",
    "holm_adjusted",
    "holm_levels",
    "paired_difference",
    "seeds_needed",
    "summarize",
    "t_quantile",
    "verdict",
]

NOT_DISTINGUISHABLE = "not distinguishable at this budget"
# Above this many seeds `seeds_needed` says "more than" instead of searching on.
MAX_SEEDS = 10_000


def _incomplete_beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 500):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return result


def regularized_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, for a, b > 0 and x in [0, 1]."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _incomplete_beta_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _incomplete_beta_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    tail = 0.5 * regularized_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The `p` quantile of Student's t with `df` > 0 degrees of freedom (p in (0, 1))."""
    if not 0.0 < p < 1.0 or not df > 0:
        raise ValueError(f"t_quantile needs p in (0, 1) and df > 0, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        low, high = high, high * 2.0
    for _ in range(200):
        middle = 0.5 * (low + high)
        if t_cdf(middle, df) < p:
            low = middle
        else:
            high = middle
        if high - low <= 1e-13 * max(1.0, high):
            break
    return 0.5 * (low + high)


@dataclass(frozen=True)
class Summary:
    """Mean and sample standard deviation (n - 1 in the denominator; None for n < 2)."""

    n: int
    mean: float | None
    sd: float | None


def summarize(values: Sequence[float]) -> Summary:
    """The `Summary` of the finite values among `values`."""
    finite = [float(v) for v in values if v is not None and math.isfinite(v)]
    n = len(finite)
    if n == 0:
        return Summary(0, None, None)
    mean = sum(finite) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in finite) / (n - 1)) if n > 1 else None
    return Summary(n, mean, sd)


@dataclass(frozen=True)
class Paired:
    """Differences (variant - baseline) over the seeds both have: their mean, sample standard
    deviation, the two-sided p-value of the paired t-test of a zero mean, and the Student-t
    interval at `confidence` (interval and p-value None for fewer than two pairs; a p-value of 0
    when every difference is the same nonzero number)."""

    n: int
    mean: float | None
    sd: float | None
    low: float | None
    high: float | None
    p_value: float | None = None

    def at(self, confidence: float) -> Paired:
        """The same differences with the interval at `confidence`."""
        if self.n < 2 or self.sd is None or self.mean is None:
            return self
        half = t_quantile(0.5 + confidence / 2.0, self.n - 1) * self.sd / math.sqrt(self.n)
        return Paired(self.n, self.mean, self.sd, self.mean - half, self.mean + half, self.p_value)


def _p_value(mean: float, sd: float, n: int) -> float:
    if sd == 0:
        return 1.0 if mean == 0 else 0.0
    t = abs(mean) / (sd / math.sqrt(n))
    return min(1.0, 2.0 * (1.0 - t_cdf(t, n - 1)))


def paired_difference(
    variant: dict[int, float], baseline: dict[int, float], confidence: float = 0.95
) -> Paired:
    """Paired t-interval of variant - baseline; both map a seed to a value, and only the seeds
    where both values are finite count."""
    seeds = sorted(
        s
        for s in set(variant) & set(baseline)
        if variant[s] is not None
        and baseline[s] is not None
        and math.isfinite(variant[s])
        and math.isfinite(baseline[s])
    )
    differences = [variant[s] - baseline[s] for s in seeds]
    summary = summarize(differences)
    if summary.n < 2 or summary.sd is None:
        return Paired(summary.n, summary.mean, summary.sd, None, None)
    assert summary.mean is not None
    p_value = _p_value(summary.mean, summary.sd, summary.n)
    return Paired(summary.n, summary.mean, summary.sd, None, None, p_value).at(confidence)


def holm_adjusted(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given: sorted ascending, the i-th
    (from 0) of m is multiplied by m - i, capped at 1, and made non-decreasing."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[index]))
        adjusted[index] = running
    return adjusted


def holm_levels(p_values: Sequence[float], alpha: float = 0.05) -> list[float]:
    """Per comparison, the level at which Holm's step-down procedure tests it: alpha / (m - i)
    for the i-th smallest p-value (from 0) up to the first one not rejected, and that first
    one's level for it and every later one. An interval at confidence 1 - level excludes zero
    exactly when Holm rejects the comparison (its adjusted p-value is at most alpha)."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    levels = [alpha] * m
    stopped: float | None = None
    for rank, index in enumerate(order):
        level = alpha / (m - rank)
        if stopped is None and p_values[index] > level:
            stopped = level
        levels[index] = level if stopped is None else stopped
    return levels


def verdict(low: float | None, high: float | None, higher_is: str | None = None) -> str:
    """The words an interval of (variant - baseline) allows: with `higher_is` "better" or
    "worse", "better"/"worse" only when the interval excludes zero; a metric without a
    direction (`higher_is` None) reads "higher"/"lower"; an interval across zero reads
    NOT_DISTINGUISHABLE with the interval, never that the variant does not help."""
    if low is None or high is None:
        return "too few pairs for an interval"
    if low > 0 or high < 0:
        direction = "higher" if low > 0 else "lower"
        if higher_is is None:
            return direction
        return "better" if (direction == "higher") == (higher_is == "better") else "worse"
    return f"{NOT_DISTINGUISHABLE} (interval [{low:+.4g}, {high:+.4g}])"


def seeds_needed(effect: float, sd: float, alpha: float, power: float = 0.8) -> int | None:
    """The fewest seeds whose paired t-test at two-sided level `alpha` detects a true mean
    difference `effect` with probability about `power`, if the differences are normal with
    standard deviation `sd`: the smallest n >= 2 with t(1 - alpha/2, n-1) + t(power, n-1) <=
    |effect| sqrt(n) / sd (the usual approximation of the noncentral t). None above MAX_SEEDS
    or for a zero effect; 2 for a zero spread."""
    if effect == 0 or not math.isfinite(effect) or not math.isfinite(sd):
        return None
    if sd == 0:
        return 2
    # The normal quantiles' n is a lower bound (t quantiles exceed them): the search starts there.
    normal = NormalDist()
    z = normal.inv_cdf(1 - alpha / 2) + normal.inv_cdf(power)
    start = max(2, math.floor((z * sd / effect) ** 2))
    for n in range(start, MAX_SEEDS + 1):
        need = t_quantile(1 - alpha / 2, n - 1) + t_quantile(power, n - 1)
        if need <= abs(effect) * math.sqrt(n) / sd:
            return n
    return None
