"""Rank allocation (docs/MATH.md sec. 4.4): a fused gate projection's total rank split across its
gates in proportion to their measured sensitivity (`deltalab.analysis.gate_sensitivity`), each
gate kept within its width, and the reference ranks a layer's allocation is compared with.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import fields
from fractions import Fraction
from typing import Any

from deltalab.layers.common import require_positive_int
from deltalab.layers.delta_mixer import DeltaMixer
from deltalab.layers.kdn import KalmanMixer
from deltalab.layers.kdn_muir import KDNMuirRanks
from deltalab.layers.muir import FusedGateMixer, GateRanks, MuirRanks

__all__ = ["RANK_FIELDS", "allocate_ranks", "gate_widths", "rank_allocation", "reference_ranks"]

# Gate names of the layers -> fields of MuirRanks and KDNMuirRanks, for `allocate_ranks`.
RANK_FIELDS = {
    "g": "decay",
    "erase": "erase",
    "write": "write",
    "read": "read",
    "q_noise": "process",
    "r": "observation",
}


def _bounded_quotas(
    shares: dict[str, Fraction], budget: int, minimum: int, maximum: dict[str, int]
) -> dict[str, Fraction]:
    """The exact quotas clamp(lam * share, minimum, maximum[gate]) that sum to `budget`: the
    proportional split with every gate kept within its bounds (water filling). Gates of share 0
    sit at the minimum unless every other gate is at its maximum; then they share the rest
    evenly. Needs minimum * gates <= budget <= the sum of the maxima."""
    positive = [k for k in shares if shares[k] > 0]
    zero = [k for k in shares if k not in positive]

    def clamp(key: str, lam: Fraction) -> Fraction:
        return min(max(lam * shares[key], Fraction(minimum)), Fraction(maximum[key]))

    def total(lam: Fraction) -> Fraction:
        return sum((clamp(k, lam) for k in positive), Fraction(minimum * len(zero)))

    # total(lam) is piecewise linear and nondecreasing, with kinks where a gate meets a bound.
    kinks = {Fraction(minimum) / shares[k] for k in positive}
    kinks |= {Fraction(maximum[k]) / shares[k] for k in positive}
    for left, right in itertools.pairwise([Fraction(0), *sorted(kinks)]):
        if total(right) >= budget:
            middle = (left + right) / 2
            free = [k for k in positive if minimum < middle * shares[k] < maximum[k]]
            slope = sum(shares[k] for k in free)
            lam = (budget - total(middle) + middle * slope) / slope if slope else right
            quota = {k: clamp(k, lam) for k in positive}
            return {k: quota.get(k, Fraction(minimum)) for k in shares}
    # Every gate with a share is at its maximum: the others take what is left.
    left = budget - sum(maximum[k] for k in positive)
    rest = _bounded_quotas(dict.fromkeys(zero, Fraction(1)), left, minimum, maximum)
    return {k: Fraction(maximum[k]) if k in positive else rest[k] for k in shares}


def allocate_ranks(
    sensitivity: Mapping[str, float],
    budget: int,
    *,
    minimum: int = 1,
    maximum: Mapping[str, int] | None = None,
    ranks: type[GateRanks] = MuirRanks,
) -> dict[str, int]:
    """Splits `budget` ranks across gates in proportion to `sensitivity`, each in
    [`minimum`, `maximum[gate]`].

    Keys are gate names ("g" or "decay", "erase", "write", "read"; for KDN-Muir "q_noise" or
    "process", "r" or "observation"); the result is keyed by the fields of `ranks` (`MuirRanks`
    by default, `KDNMuirRanks` for the KDN gates), e.g. `dataclasses.replace(MuirRanks.default(K),
    **allocate_ranks(...))`. Gates whose proportional share falls below `minimum` get `minimum`,
    those above their `maximum` (keyed like the result; e.g. a gate's width) get that, and the
    rest is shared again among the others; the shares are rounded by largest remainder (ties:
    input order), so the ranks sum exactly to `budget`. All-zero sensitivities split the budget
    evenly.

    Example: {"g": 6, "erase": 1, "write": 3}, budget 20 -> {"decay": 12, "erase": 2, "write": 6}.
    """
    rank_fields = {f.name for f in fields(ranks)}
    shares: dict[str, float] = {}
    for name, value in sensitivity.items():
        key = RANK_FIELDS.get(name, name)
        if key not in rank_fields:
            raise ValueError(
                f"sensitivity has gate {name!r}, which is not a {ranks.__name__} field"
            )
        if key in shares:
            raise ValueError(f"sensitivity names the gate {key!r} twice")
        value = float(value)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"sensitivity[{name!r}] must be finite and >= 0, got {value}")
        shares[key] = value
    minimum = require_positive_int("minimum", minimum)
    budget = require_positive_int("budget", budget)
    if budget < minimum * len(shares):
        raise ValueError(
            f"budget must be >= minimum * gates = {minimum} * {len(shares)}, got {budget}"
        )
    if not shares:
        raise ValueError("sensitivity is empty")
    limits = {key: budget for key in shares}
    for key, value in (maximum or {}).items():
        if key not in shares:
            raise ValueError(f"maximum has gate {key!r}, which the sensitivity does not name")
        limits[key] = require_positive_int(f"maximum[{key!r}]", value)
        if limits[key] < minimum:
            raise ValueError(f"maximum[{key!r}] must be >= minimum = {minimum}, got {value}")
    if budget > sum(limits.values()):
        raise ValueError(
            f"budget must be <= the sum of the maxima = {sum(limits.values())}, got {budget}"
        )
    if not any(shares.values()):
        shares = dict.fromkeys(shares, 1.0)
    # Exact rational quotas: equal remainders stay equal, so ties go by input order.
    exact = {k: Fraction(v) for k, v in shares.items()}
    quota = _bounded_quotas(exact, budget, minimum, limits)
    ranks_of = {k: math.floor(q) for k, q in quota.items()}
    order = sorted(shares, key=lambda k: quota[k] - ranks_of[k], reverse=True)
    for key in order[: budget - sum(ranks_of.values())]:
        ranks_of[key] += 1
    return {k: ranks_of[k] for k in shares}


def gate_widths(layer: DeltaMixer) -> dict[str, int]:
    """Per rank field (`MuirRanks`, `KDNMuirRanks`), the output width of that gate's map in
    `layer`: H*K for decay, erase, read and the process noise, H*V for write, H for the
    observation noise."""
    key_width, value_width = layer.num_heads * layer.head_dim, layer.num_heads * layer.value_dim
    return {
        "decay": key_width,
        "erase": key_width,
        "write": value_width,
        "read": key_width,
        "process": key_width,
        "observation": layer.num_heads,
    }


def reference_ranks(layer: DeltaMixer) -> tuple[GateRanks, frozenset[str], str]:
    """The ranks a rank allocation for `layer` is compared with: (ranks, the fields that share
    the fused projection, where they come from).

    A fused-gate layer (Muir, KDN-Muir) has its own ranks, of which its low-rank slices are
    allocated. Any other layer is compared with the defaults of the fused mixer of its family,
    which the presets use: `KDNMuirRanks` for a Kalman-gain layer (KDN), `MuirRanks` otherwise.
    """
    if isinstance(layer, FusedGateMixer):
        return layer.ranks, frozenset(layer.gate_proj.up), f"{type(layer).__name__} layer"
    if isinstance(layer, KalmanMixer):
        widths = {"observation": layer.num_heads}
        ranks: GateRanks = KDNMuirRanks.default(layer.head_dim, layer.hidden_size, widths=widths)
        return ranks, frozenset({"decay", "process", "observation", "read"}), "kdn_muir preset"
    ranks = MuirRanks.default(layer.head_dim, layer.hidden_size)
    return ranks, frozenset({"decay", "erase", "write", "read"}), "muir preset"


def rank_allocation(sensitivity: Mapping[str, float], layer: DeltaMixer) -> dict[str, Any] | None:
    """`allocate_ranks` of `sensitivity` (gate -> number) over the gates of `layer` that share
    its reference fused projection (`reference_ranks`), with that projection's total rank as
    the budget and each gate's width as its maximum; None unless two such gates were measured
    (a single one has nothing to share the budget with: Gated DeltaNet's beta has no rank).

    Returns {"source", "budget", "reference": {field: rank}, "allocated": {field: rank}}.
    """
    ranks, fused, source = reference_ranks(layer)
    by_field = {RANK_FIELDS.get(gate, gate): value for gate, value in sensitivity.items()}
    # In the order of the rank fields (the fused projection's slices).
    names = [f.name for f in fields(ranks) if f.name in fused and f.name in by_field]
    if len(names) < 2:
        return None
    chosen = {name: by_field[name] for name in names}
    reference = {name: getattr(ranks, name) for name in names}
    budget = sum(reference.values())
    widths = gate_widths(layer)
    maximum = {name: min(layer.hidden_size, widths[name]) for name in names}
    allocated = allocate_ranks(chosen, budget, maximum=maximum, ranks=type(ranks))
    return {"source": source, "budget": budget, "reference": reference, "allocated": allocated}
