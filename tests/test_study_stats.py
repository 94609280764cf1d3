"""The statistics of a study report: Holm's correction, the wording an interval allows, the
seeds an effect would need, the paired t-test's p-value."""

from __future__ import annotations

import math
import random

import pytest

from deltalab.study.stats import (
    NOT_DISTINGUISHABLE,
    holm_adjusted,
    holm_levels,
    paired_difference,
    seeds_needed,
    verdict,
)


def test_holm_adjusted_p_values_and_levels_by_hand():
    # Sorted: 0.005 x 4 = 0.02, 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 = 0.04 -> 0.06.
    p = [0.01, 0.04, 0.03, 0.005]
    assert holm_adjusted(p) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    # 0.005 <= 0.05/4 and 0.01 <= 0.05/3 are rejected; 0.03 > 0.05/2 stops the procedure, and
    # 0.04 is tested at the level where it stopped.
    assert holm_levels(p, 0.05) == pytest.approx([0.05 / 3, 0.025, 0.025, 0.0125])


def test_an_interval_at_the_holm_level_excludes_zero_exactly_when_holm_rejects():
    rng = random.Random(0)
    for _ in range(50):
        pairs = [
            paired_difference(
                {s: rng.gauss(shift, 1.0) for s in range(4)}, {s: 0.0 for s in range(4)}
            )
            for shift in (rng.uniform(-3, 3) for _ in range(6))
        ]
        p = [pair.p_value for pair in pairs]
        for pair, level, adjusted in zip(pairs, holm_levels(p), holm_adjusted(p), strict=True):
            at = pair.at(1 - level)
            assert (at.low > 0 or at.high < 0) == (adjusted <= 0.05)


def test_the_paired_p_value_by_hand():
    # Differences 0.5, 0.6, 0.55: t = 0.55 / (0.05 / sqrt 3) = 19.053 on 2 degrees of freedom;
    # the two-sided p-value of t on 2 df is 1 - t / sqrt(t^2 + 2).
    paired = paired_difference({0: 1.5, 1: 2.6, 2: 3.55}, {0: 1.0, 1: 2.0, 2: 3.0})
    t = 0.55 / (0.05 / math.sqrt(3))
    assert paired.p_value == pytest.approx(1 - t / math.sqrt(t * t + 2))


def test_better_or_worse_only_when_the_interval_excludes_zero():
    rng = random.Random(1)
    for _ in range(500):
        low = rng.uniform(-1, 1)
        high = low + rng.uniform(0, 1)
        for higher_is in ("better", "worse", None):
            words = verdict(low, high, higher_is)
            if low <= 0 <= high:
                assert words.startswith(NOT_DISTINGUISHABLE) and f"[{low:+.4g}" in words
                assert not any(w in words for w in ("better", "worse", "higher", "lower"))
            else:
                assert words in ("better", "worse", "higher", "lower")
    assert verdict(0.1, 0.2, "worse") == "worse" and verdict(-0.2, -0.1, "worse") == "better"
    assert verdict(0.1, 0.2, "better") == "better" and verdict(0.1, 0.2, None) == "higher"


@pytest.mark.parametrize(("effect", "seeds"), [(0.5, 34), (1.0, 10), (2.0, 5)])
def test_seeds_needed_match_the_published_paired_t_sample_sizes(effect, seeds):
    # Paired t-test, two-sided alpha 0.05, power 0.8, effect in units of the differences' sd:
    # Cohen's tables (and G*Power) give 34, 10 and 5 pairs.
    assert seeds_needed(effect * 0.3, 0.3, 0.05, 0.8) == seeds


def test_seeds_needed_grow_with_a_stricter_level_and_say_none_beyond_reach():
    assert seeds_needed(1.0, 1.0, 0.05 / 10) > seeds_needed(1.0, 1.0, 0.05)
    assert seeds_needed(1e-4, 1.0, 0.05) is None and seeds_needed(0.0, 1.0, 0.05) is None
