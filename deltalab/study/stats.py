"""The statistics of a study report: mean and standard deviation over seeds, and paired
differences against a baseline with Student-t intervals.

Pure Python (no SciPy, which deltalab does not depend on): the t quantile is found by bisection
on the t distribution function, written with the regularized incomplete beta function.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["NO_DIFFERENCE", "Paired", "Summary", "paired_difference", "summarize", "t_quantile"]

NO_DIFFERENCE = "no difference detected"


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
    deviation and 95% Student-t interval (None for fewer than two pairs)."""

    n: int
    mean: float | None
    sd: float | None
    low: float | None
    high: float | None

    @property
    def verdict(self) -> str:
        """Verdict: "higher" or "lower" when the interval excludes zero, else NO_DIFFERENCE (and "too
        few pairs" without an interval)."""
        if self.low is None or self.high is None:
            return "too few pairs for an interval"
        if self.low > 0:
            return "higher"
        if self.high < 0:
            return "lower"
        return NO_DIFFERENCE


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
    half = t_quantile(0.5 + confidence / 2.0, summary.n - 1) * summary.sd / math.sqrt(summary.n)
    assert summary.mean is not None
    return Paired(summary.n, summary.mean, summary.sd, summary.mean - half, summary.mean + half)
