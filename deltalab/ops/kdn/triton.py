"""KDN's variance scan in Triton: p_t and p_bar_t from (decay, process noise, evidence) directly.

    p_bar_t = a_t p_{t-1} + q_t,        p_t = 1 / (c_t + 1 / p_bar_t)

is the Mobius map p -> (a p + q) / (c a p + c q + 1) (gains.py). Scanned by
`deltalab.ops.mobius.triton`'s kernel it would need the map's four coefficients materialized
(two more [B, T, H, K] tensors, and their backward) and p_bar recomputed from a shifted copy of
p; this kernel reads a, q, c and writes p and p_bar, forward and backward, on the same layout
and the same tiles (mobius/triton.py has the layout, the range and the accuracy argument).

Forward. In a tile, the scan runs over the maps of the steps *before* each row (the identity on
row 0): applied to the p carried in, its prefix products give p_{t-1} on every row; p_bar_t and
p_t then follow by one step each, so both outputs come from one scan. p_t = 1 / (c + 1 / p_bar)
has no cancellation and is right at both ends (p_bar = 0 gives 0; c = 0 gives p_bar).

Backward. With nu_t = dL/dp_t in total and pi_t = dL/dp_bar_t in total:

    pi_t = dp_bar_t + s_t nu_t,    s_t = dp_t / dp_bar_t = 1 / (c_t p_bar_t + 1)^2
    nu_t = [dp_t + a_{t+1} dp_bar_{t+1}] + a_{t+1} s_{t+1} nu_{t+1}
    da_t = pi_t p_{t-1},   dq_t = pi_t,   dc_t = -nu_t p_t^2,   dp_0 = a_1 pi_1.

nu is the reverse first-order linear recurrence of the Mobius backward with its multiplier
m = a s = det / (C p + D)^2 written out (det = a exactly: no cancellation of A D - B C), and
0 <= m <= a <= 1: a positive combination whose products only shrink (their underflow to 0 is
the true limit: no influence across a stretch of strong decay or evidence).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltalab.ops._triton import opaque_to_compiler
from deltalab.ops.mobius.triton import (
    _compose,
    _lane_offsets,
    _normalize,
    _then_affine,
    launch_config,
)


@triton.jit
def _kdn_forward_kernel(
    DECAY,
    NOISE,
    EVIDENCE,
    P0,
    P,
    PBAR,
    T,
    INNER,
    LANES,
    BLOCK_T: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    lane, lane_ok, base = _lane_offsets(tl.program_id(0), T, INNER, LANES, BLOCK_L)
    rows = tl.arange(0, BLOCK_T)
    p = tl.load(P0 + lane, mask=lane_ok, other=1.0)
    for start in range(0, T, BLOCK_T):
        t = start + rows
        ok = (t < T)[:, None] & lane_ok[None, :]
        offsets = base[None, :] + t.to(tl.int64)[:, None] * INNER
        # The map of step t - 1 on row t (the identity on row 0, whose p_{t-1} is the carry).
        before = ok & (rows > 0)[:, None]
        a = tl.load(DECAY + offsets - INNER, mask=before, other=1.0)
        q = tl.load(NOISE + offsets - INNER, mask=before, other=0.0)
        c = tl.load(EVIDENCE + offsets - INNER, mask=before, other=0.0)
        ma, mb, mc, md = _normalize(a, q, c * a, c * q + 1.0)
        ma, mb, mc, md = tl.associative_scan((ma, mb, mc, md), 0, _compose)
        size = tl.maximum(p, 1.0)
        v0 = (p / size)[None, :]
        v1 = (1.0 / size)[None, :]
        p_prev = (ma * v0 + mb * v1) / (mc * v0 + md * v1)
        a = tl.load(DECAY + offsets, mask=ok, other=1.0)
        q = tl.load(NOISE + offsets, mask=ok, other=0.0)
        c = tl.load(EVIDENCE + offsets, mask=ok, other=0.0)
        p_bar = a * p_prev + q
        p_t = 1.0 / (c + 1.0 / p_bar)
        tl.store(P + offsets, p_t, mask=ok)
        tl.store(PBAR + offsets, p_bar, mask=ok)
        p = tl.sum(tl.where(rows[:, None] == BLOCK_T - 1, p_t, 0.0), axis=0)


@triton.jit
def _kdn_backward_kernel(
    DECAY,
    NOISE,
    EVIDENCE,
    P0,
    P,
    GP,
    GPBAR,
    GDECAY,
    GNOISE,
    GEVIDENCE,
    GP0,
    T,
    INNER,
    LANES,
    BLOCK_T: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    lane, lane_ok, base = _lane_offsets(tl.program_id(0), T, INNER, LANES, BLOCK_L)
    rows = tl.arange(0, BLOCK_T)
    p0 = tl.load(P0 + lane, mask=lane_ok, other=0.0)
    nu = tl.zeros([BLOCK_L], dtype=p0.dtype)  # nu at the first step after the tile
    last_start = (T - 1) // BLOCK_T * BLOCK_T
    for i in range(0, T, BLOCK_T):
        # Tiles from the last to the first; row 0 is the tile's last step.
        t = (last_start - i) + (BLOCK_T - 1) - rows
        ok = (t < T)[:, None] & lane_ok[None, :]
        has_next = (t + 1 < T)[:, None] & lane_ok[None, :]
        has_prev = (t > 0)[:, None] & ok
        offsets = base[None, :] + t.to(tl.int64)[:, None] * INNER
        p_t = tl.load(P + offsets, mask=ok, other=0.0)
        p_prev = tl.load(P + offsets - INNER, mask=has_prev, other=0.0)
        p_prev = tl.where(has_prev, p_prev, p0[None, :])
        # Step t + 1 seen from p_t (a = 0 past the end: no multiplier, no contribution).
        nxt = offsets + INNER
        a_next = tl.load(DECAY + nxt, mask=has_next, other=0.0)
        q_next = tl.load(NOISE + nxt, mask=has_next, other=0.0)
        c_next = tl.load(EVIDENCE + nxt, mask=has_next, other=0.0)
        shrink_next = 1.0 / (c_next * (a_next * p_t + q_next) + 1.0)
        direct = tl.load(GP + offsets, mask=ok, other=0.0)
        direct += a_next * tl.load(GPBAR + nxt, mask=has_next, other=0.0)
        slope, total = tl.associative_scan(
            (a_next * shrink_next * shrink_next, direct), 0, _then_affine
        )
        nu_t = total + slope * nu[None, :]
        a = tl.load(DECAY + offsets, mask=ok, other=0.0)
        q = tl.load(NOISE + offsets, mask=ok, other=0.0)
        c = tl.load(EVIDENCE + offsets, mask=ok, other=0.0)
        shrink = 1.0 / (c * (a * p_prev + q) + 1.0)
        pi = tl.load(GPBAR + offsets, mask=ok, other=0.0) + nu_t * shrink * shrink
        tl.store(GDECAY + offsets, pi * p_prev, mask=ok)
        tl.store(GNOISE + offsets, pi, mask=ok)
        tl.store(GEVIDENCE + offsets, -(nu_t * p_t) * p_t, mask=ok)
        nu = tl.sum(tl.where(rows[:, None] == BLOCK_T - 1, nu_t, 0.0), axis=0)
    # nu is nu_1 (the first step) now: dp_0 = a_1 pi_1.
    a = tl.load(DECAY + base, mask=lane_ok, other=0.0)
    q = tl.load(NOISE + base, mask=lane_ok, other=0.0)
    c = tl.load(EVIDENCE + base, mask=lane_ok, other=0.0)
    shrink = 1.0 / (c * (a * p0 + q) + 1.0)
    pi = tl.load(GPBAR + base, mask=lane_ok, other=0.0) + nu * shrink * shrink
    tl.store(GP0 + lane, a * pi, mask=lane_ok)


class _KDNVarianceScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, decay2, noise, evidence, p_prior, config):
        # decay2, noise, evidence: contiguous [N, T, R]; p_prior: contiguous [N, R].
        n, length, inner = decay2.shape
        lanes = n * inner
        block_t, block_l = config or launch_config(lanes, length)
        # Uninitialized: the kernel writes every element (the tests NaN-fill torch.empty*, the
        # poisoned_empty fixture, so an element left unwritten fails them).
        p = torch.empty_like(decay2)
        p_bar = torch.empty_like(decay2)
        _kdn_forward_kernel[(triton.cdiv(lanes, block_l),)](
            decay2,
            noise,
            evidence,
            p_prior,
            p,
            p_bar,
            length,
            inner,
            lanes,
            BLOCK_T=block_t,
            BLOCK_L=block_l,
        )
        ctx.save_for_backward(decay2, noise, evidence, p_prior, p)
        ctx.config = config
        return p, p_bar

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_p, grad_p_bar):
        decay2, noise, evidence, p_prior, p = ctx.saved_tensors
        n, length, inner = decay2.shape
        lanes = n * inner
        block_t, block_l = ctx.config or launch_config(lanes, length, tile=1024)
        upstream = [
            torch.zeros_like(p) if g is None else g.contiguous() for g in (grad_p, grad_p_bar)
        ]
        grads = [torch.empty_like(decay2) for _ in range(3)]
        grad_p0 = torch.empty_like(p_prior)
        _kdn_backward_kernel[(triton.cdiv(lanes, block_l),)](
            decay2,
            noise,
            evidence,
            p_prior,
            p,
            *upstream,
            *grads,
            grad_p0,
            length,
            inner,
            lanes,
            BLOCK_T=block_t,
            BLOCK_L=block_l,
        )
        return (*grads, grad_p0, None)


@opaque_to_compiler
def kdn_variance_scan(
    decay2: torch.Tensor,
    q_noise: torch.Tensor,
    evidence: torch.Tensor,
    p_prior: torch.Tensor,
    config: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Posterior p_t and predicted p_bar_t `[N, T, *rest]` of KDN's variance recursion.

    decay2 (a = exp(2 g), in [0, 1]), q_noise (>= 0), evidence (c >= 0): `[N, T, *rest]`, one
    float dtype, validated; p_prior `[N, *rest]` (>= 0). `config` = (BLOCK_T, BLOCK_L)
    overrides `launch_config`.
    """
    shape = decay2.shape
    n, length = shape[0], shape[1]
    gates = [x.reshape(n, length, -1).contiguous() for x in (decay2, q_noise, evidence)]
    start = p_prior.reshape(n, -1).contiguous()
    p, p_bar = _KDNVarianceScan.apply(*gates, start, config)
    return p.reshape(shape), p_bar.reshape(shape)
