"""Input checks shared by the KDN ops (on top of deltalab.ops._checks)."""

from __future__ import annotations

import torch

from deltalab.ops._checks import (
    require_float,
    require_nonnegative_finite,
    require_nonpositive,
    require_positive,
    require_positive_finite,
    require_positive_number,
    require_rank,
    require_shape,
)


def check_keys(k: object, leading: str) -> torch.Tensor:
    """k `[<leading>, K]` with at least one token when `leading` has a T axis."""
    k = require_float("k", k)
    require_rank("k", k, (leading.count(",") + 2,), f"[{leading}, K]")
    if "T" in leading and k.shape[1] == 0:
        raise ValueError("k must hold at least one token (T >= 1), got T = 0")
    if k.shape[-1] == 0:
        raise ValueError(f"k must have K >= 1 (last axis of [{leading}, K]), got {tuple(k.shape)}")
    return k


def check_decay(g: object, k: torch.Tensor, leading: str) -> torch.Tensor:
    """g: one log decay per head `[<leading>]` or per channel `[<leading>, K]`, all <= 0.
    Returns g contiguous, checked as such: the gains' kernels take g contiguous and hand it on
    to the delta rule, which checks it again and must find this check (a copy made after it
    would be another tensor, checked again behind the work: `_checks.send_answers`)."""
    g = require_float("g", g).contiguous()
    require_rank("g", g, (k.dim() - 1, k.dim()), f"[{leading}] or [{leading}, K]")
    per_channel = g.dim() == k.dim()
    expected = k.shape if per_channel else k.shape[:-1]
    layout = f"[{leading}, K]" if per_channel else f"[{leading}]"
    require_shape("g", g, expected, layout, "to match k")
    require_nonpositive("g", g, "a log decay")
    return g


def check_noise(
    q_noise: object, r: object, k: torch.Tensor, leading: str, per_channel_process: bool
) -> None:
    """Process noise q_noise (>= 0) and observation noise r `[<leading>]` (> 0), both finite.

    Infinite variances are refused because floating point cannot take their limits: inf q_noise
    makes the gain inf / inf, inf r makes the exact filter's Joseph update 0 * inf, and either
    gives NaN outputs. A very large r (1e30) is the way to say "no evidence".
    """
    q_noise = require_float("q_noise", q_noise)
    if per_channel_process:
        require_shape("q_noise", q_noise, k.shape, f"[{leading}, K]", "to match k")
    else:
        require_shape("q_noise", q_noise, k.shape[:-1], f"[{leading}]", "to match k")
    require_nonnegative_finite("q_noise", q_noise, "a process-noise variance")
    r = require_float("r", r)
    require_shape("r", r, k.shape[:-1], f"[{leading}]", "(one observation noise per head)")
    require_positive_finite("r", r, "an observation-noise variance")


def check_info_scale(info_scale: object, key_dim: int) -> float:
    """The information scale s of docs/MATH.md sec. 3.3; None means K (the reference's choice)."""
    if info_scale is None:
        return float(key_dim)
    return require_positive_number("info_scale", info_scale)


def prior_variance(
    p0: object,
    initial_precision: object,
    batch: int,
    tail: tuple[int, ...],
    names: tuple[str, str] = ("p0", "initial_precision"),
    per_head: bool = False,
) -> torch.Tensor:
    """The variance each sequence starts from `[N, *tail]`.

    p0 is shared (`tail`) or per sequence (`[N, *tail]`), or with `per_head` (diagonal only) one
    per head `[H]`, the same for every channel; initial_precision, when given, is `[N, *tail]`
    (the precision 1/p of an earlier call) and takes precedence. `tail` is `(H,)` (isotropic)
    or `(H, K)` (diagonal).
    """
    p0_name, precision_name = names
    p0 = require_float(p0_name, p0)
    axes = ", ".join("H" if i == 0 else "K" for i in range(len(tail)))
    if per_head:
        require_rank(p0_name, p0, (1, len(tail), len(tail) + 1), f"[H], [{axes}] or [N, {axes}]")
    else:
        require_rank(p0_name, p0, (len(tail), len(tail) + 1), f"[{axes}] or [N, {axes}]")
    if p0.dim() == 1 and len(tail) > 1:
        require_shape(p0_name, p0, tail[:1], "[H]", "(one prior per head)")
        p0 = p0.reshape(-1, *(1,) * (len(tail) - 1)).expand(tail)
    elif p0.dim() == len(tail):
        require_shape(p0_name, p0, tail, f"[{axes}]", "(shared by all sequences)")
    else:
        require_shape(p0_name, p0, (batch, *tail), f"[N, {axes}]", "(one prior per sequence)")
    require_positive_finite(p0_name, p0, "a prior variance")
    if initial_precision is None:
        return p0.expand(batch, *tail)
    precision = require_float(precision_name, initial_precision)
    require_shape(precision_name, precision, (batch, *tail), f"[N, {axes}]", "(1 / p per sequence)")
    # +inf is a legal precision (certainty, p = 0): the scan reaches it when decay underflows.
    require_positive(precision_name, precision, "a precision 1 / p")
    return 1.0 / precision


def split_state(state: object, name: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A `(memory, uncertainty)` pair, or None for both."""
    if state is None:
        return None, None
    if not isinstance(state, (tuple, list)) or len(state) != 2:
        raise TypeError(
            f"{name} must be None or a pair (memory, uncertainty), got {type(state).__name__}"
            + (f" of length {len(state)}" if isinstance(state, (tuple, list)) else "")
        )
    return state[0], state[1]


def check_query_value(q: object, v: object, k: torch.Tensor, leading: str) -> None:
    """q `[<leading>, K]` like k, v `[<leading>, V]`."""
    q = require_float("q", q)
    require_shape("q", q, k.shape, f"[{leading}, K]", "to match k")
    v = require_float("v", v)
    require_rank("v", v, (k.dim(),), f"[{leading}, V]")
    require_shape("v", v, (*k.shape[:-1], v.shape[-1]), f"[{leading}, V]", "to match k")
    if v.shape[-1] == 0:
        raise ValueError(f"v must have V >= 1 (last axis of [{leading}, V]), got {tuple(v.shape)}")
