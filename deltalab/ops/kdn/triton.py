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

Isotropic mode (ISO, `kdn_iso_scan`). Isotropic KDN's gain is the scan plus a few operations per
token on [B, T, H]: c = E ||k||^2 / r (E = s / K), beta = p_bar / (p_bar ||k||^2 + r) and
predictive = p_bar ||k||^2. As PyTorch ops around the scan they were a dozen launches and
autograd nodes each way, which took the host longer than the device; in this mode the same
kernels read ||k||^2 and r in place of c, form c as they load a step, write beta and
predictive in place of p_bar, and the backward takes beta's and predictive's gradients in
place of p_bar's (dL/dp_bar = dbeta (r / den) / den + dpred ||k||^2, den = p_bar ||k||^2 + r,
written without den^2, which overflows float32 for r past 1e19) and gives ||k||^2's and r's
through c, beta and predictive. An output whose gradient is None is skipped, not zero-filled.
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
def _step_terms(DECAY, NOISE, EVIDENCE, R, at, mask, E, ISO: tl.constexpr):
    """(a, q, c, ||k||^2, r) of the steps at `at` in the carry's float dtype; masked steps are
    the identity (a = 1, q = c = 0). Isotropic (ISO): EVIDENCE holds ||k||^2 and c = E ||k||^2
    / r is formed here (E = s / K), from q_noise and r in their own dtypes; otherwise EVIDENCE
    holds c and the last two are unused (c, 1)."""
    dtype = DECAY.dtype.element_ty
    a = tl.load(DECAY + at, mask=mask, other=1.0)
    q = tl.load(NOISE + at, mask=mask, other=0.0).to(dtype)
    if ISO:
        norm2 = tl.load(EVIDENCE + at, mask=mask, other=0.0)
        r = tl.load(R + at, mask=mask, other=1.0).to(dtype)
        return a, q, (E * norm2) / r, norm2, r
    c = tl.load(EVIDENCE + at, mask=mask, other=0.0)
    return a, q, c, c, c + 1.0


@triton.jit
def _upstream(G, at, mask, PRESENT: tl.constexpr, like):
    """An output's gradient at `at` in like's dtype, zero when the output was unused."""
    if PRESENT:
        return tl.load(G + at, mask=mask, other=0.0).to(like.dtype)
    return tl.zeros_like(like)


@triton.jit
def _p_bar_grad(g2, g3, p_bar, norm2, r, ISO: tl.constexpr):
    """dL/dp_bar through the step's own outputs: p_bar itself (g2), or Isotropic's beta = p_bar /
    (p_bar ||k||^2 + r) (g2) and predictive = p_bar ||k||^2 (g3). dbeta/dp_bar = (r / den) /
    den: no den^2, which overflows float32 for r past 1e19."""
    if ISO:
        den = p_bar * norm2 + r
        return g2 * ((r / den) / den) + g3 * norm2
    return g2


@triton.jit
def _p_bar_total(G2, G3, at, mask, p_prev, nu, a, q, c, norm2, r, ISO, HAS_G2, HAS_G3):
    """(pi, p_bar, g2, g3) of the steps at `at`: pi = dL/dp_bar in total, the step's outputs'
    own gradients (g2, g3) plus nu = dL/dp through p = p_bar / (c p_bar + 1)."""
    p_bar = a * p_prev + q
    shrink = 1.0 / (c * p_bar + 1.0)
    g2 = _upstream(G2, at, mask, HAS_G2, p_bar)
    g3 = _upstream(G3, at, mask, HAS_G3, p_bar)
    return _p_bar_grad(g2, g3, p_bar, norm2, r, ISO) + nu * shrink * shrink, p_bar, g2, g3


@triton.jit
def _kdn_forward_kernel(
    DECAY,
    NOISE,
    EVIDENCE,
    R,
    P0,
    P,
    OUT2,
    OUT3,
    T,
    INNER,
    LANES,
    E,
    ISO: tl.constexpr,
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
        a, q, c, _, _ = _step_terms(DECAY, NOISE, EVIDENCE, R, offsets - INNER, before, E, ISO)
        ma, mb, mc, md = _normalize(a, q, c * a, c * q + 1.0)
        ma, mb, mc, md = tl.associative_scan((ma, mb, mc, md), 0, _compose)
        size = tl.maximum(p, 1.0)
        v0 = (p / size)[None, :]
        v1 = (1.0 / size)[None, :]
        p_prev = (ma * v0 + mb * v1) / (mc * v0 + md * v1)
        a, q, c, norm2, r = _step_terms(DECAY, NOISE, EVIDENCE, R, offsets, ok, E, ISO)
        p_bar = a * p_prev + q
        p_t = 1.0 / (c + 1.0 / p_bar)
        tl.store(P + offsets, p_t, mask=ok)
        if ISO:
            predictive = p_bar * norm2
            tl.store(OUT2 + offsets, p_bar / (predictive + r), mask=ok)
            tl.store(OUT3 + offsets, predictive, mask=ok)
        else:
            tl.store(OUT2 + offsets, p_bar, mask=ok)
        p = tl.sum(tl.where(rows[:, None] == BLOCK_T - 1, p_t, 0.0), axis=0)


@triton.jit
def _kdn_backward_kernel(
    DECAY,
    NOISE,
    EVIDENCE,
    R,
    P0,
    P,
    GP,
    G2,
    G3,
    GDECAY,
    GNOISE,
    GEVIDENCE,
    GR,
    GP0,
    T,
    INNER,
    LANES,
    E,
    ISO: tl.constexpr,
    HAS_GP: tl.constexpr,
    HAS_G2: tl.constexpr,
    HAS_G3: tl.constexpr,
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
        a_next, q_next, c_next, norm2_next, r_next = _step_terms(
            DECAY, NOISE, EVIDENCE, R, nxt, has_next, E, ISO
        )
        a_next = tl.where(has_next, a_next, 0.0)
        p_bar_next = a_next * p_t + q_next
        shrink_next = 1.0 / (c_next * p_bar_next + 1.0)
        direct = _upstream(GP, offsets, ok, HAS_GP, p_t)
        g2_next = _upstream(G2, nxt, has_next, HAS_G2, p_t)
        g3_next = _upstream(G3, nxt, has_next, HAS_G3, p_t)
        direct += a_next * _p_bar_grad(g2_next, g3_next, p_bar_next, norm2_next, r_next, ISO)
        slope, total = tl.associative_scan(
            (a_next * shrink_next * shrink_next, direct), 0, _then_affine
        )
        nu_t = total + slope * nu[None, :]
        a, q, c, norm2, r = _step_terms(DECAY, NOISE, EVIDENCE, R, offsets, ok, E, ISO)
        pi, p_bar, g2, g3 = _p_bar_total(
            G2, G3, offsets, ok, p_prev, nu_t, a, q, c, norm2, r, ISO, HAS_G2, HAS_G3
        )
        tl.store(GDECAY + offsets, pi * p_prev, mask=ok)
        tl.store(GNOISE + offsets, pi, mask=ok)
        d_c = -(nu_t * p_t) * p_t
        if ISO:
            # c = E ||k||^2 / r, beta = p_bar / den, predictive = p_bar ||k||^2.
            den = p_bar * norm2 + r
            beta = p_bar / den
            d_norm2 = d_c * (E / r) + g3 * p_bar - g2 * beta * beta
            tl.store(GEVIDENCE + offsets, d_norm2, mask=ok)
            tl.store(GR + offsets, -(d_c * c) / r - g2 * (beta / den), mask=ok)
        else:
            tl.store(GEVIDENCE + offsets, d_c, mask=ok)
        nu = tl.sum(tl.where(rows[:, None] == BLOCK_T - 1, nu_t, 0.0), axis=0)
    # nu is nu_1 (the first step) now: dp_0 = a_1 pi_1.
    a, q, c, norm2, r = _step_terms(DECAY, NOISE, EVIDENCE, R, base, lane_ok, E, ISO)
    pi, _, _, _ = _p_bar_total(
        G2, G3, base, lane_ok, p0, nu, a, q, c, norm2, r, ISO, HAS_G2, HAS_G3
    )
    tl.store(GP0 + lane, a * pi, mask=lane_ok)


def _scan_forward(decay2, noise, evidence, r, p_prior, evidence_scale, config):
    """Launches the forward: (p, p_bar, None), or Isotropic's (p, beta, predictive) when r is
    given (then `evidence` holds ||k||^2). Inputs contiguous [N, T, R], p_prior [N, R]."""
    n, length, inner = decay2.shape
    lanes = n * inner
    block_t, block_l = config or launch_config(lanes, length)
    iso = r is not None
    # Uninitialized: the kernel writes every element (the tests NaN-fill torch.empty*, the
    # poisoned_empty fixture, so an element left unwritten fails them).
    p, second = torch.empty_like(decay2), torch.empty_like(decay2)
    third = torch.empty_like(decay2) if iso else None
    _kdn_forward_kernel[(triton.cdiv(lanes, block_l),)](
        decay2, noise, evidence, r if iso else p, p_prior, p, second,
        third if iso else p, length, inner, lanes, evidence_scale, ISO=iso,
        BLOCK_T=block_t, BLOCK_L=block_l,
    )  # fmt: skip
    return p, second, third


def _scan_backward(saved, upstream, evidence_scale, config):
    """Launches the backward on the forward's inputs and p (`saved`: decay2, noise, evidence,
    r or None, p_prior, p) for the outputs' gradients `upstream` (p's, then p_bar's, or beta's
    and predictive's; None where unused). Returns the gradients of decay2, noise, evidence,
    r (None without r) and p_prior, each in its input's dtype."""
    decay2, noise, evidence, r, p_prior, p = saved
    n, length, inner = decay2.shape
    lanes = n * inner
    block_t, block_l = config or launch_config(lanes, length, tile=1024)
    iso = r is not None
    present = [g is not None for g in upstream]
    upstream = [p if g is None else g.contiguous() for g in upstream]
    upstream += [p] * (3 - len(upstream))
    grads = [torch.empty_like(x) for x in (decay2, noise, evidence)]
    grad_r = torch.empty_like(r) if iso else None
    grad_p0 = torch.empty_like(p_prior)
    _kdn_backward_kernel[(triton.cdiv(lanes, block_l),)](
        decay2, noise, evidence, r if iso else p, p_prior, p, *upstream, *grads,
        grad_r if iso else p, grad_p0, length, inner, lanes, evidence_scale, ISO=iso,
        HAS_GP=present[0], HAS_G2=present[1], HAS_G3=len(present) > 2 and present[2],
        BLOCK_T=block_t, BLOCK_L=block_l,
    )  # fmt: skip
    return (*grads, grad_r, grad_p0)


class _KDNVarianceScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, decay2, noise, evidence, p_prior, config):
        # decay2, noise, evidence: contiguous [N, T, R]; p_prior: contiguous [N, R].
        p, p_bar, _ = _scan_forward(decay2, noise, evidence, None, p_prior, 1.0, config)
        ctx.save_for_backward(decay2, noise, evidence, p_prior, p)
        ctx.config = config
        ctx.set_materialize_grads(False)
        return p, p_bar

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_p, grad_p_bar):
        decay2, noise, evidence, p_prior, p = ctx.saved_tensors
        saved = (decay2, noise, evidence, None, p_prior, p)
        *grads, _, grad_p0 = _scan_backward(saved, [grad_p, grad_p_bar], 1.0, ctx.config)
        return (*grads, grad_p0, None)


class _KDNIsoScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, decay2, norm2, noise, r, p_prior, evidence_scale, config):
        # decay2, norm2 (float32), noise, r (any float dtype): contiguous [N, T, H];
        # p_prior: contiguous [N, H] float32.
        p, beta, predictive = _scan_forward(
            decay2, noise, norm2, r, p_prior, evidence_scale, config
        )
        ctx.save_for_backward(decay2, noise, norm2, r, p_prior, p)
        ctx.evidence_scale, ctx.config = evidence_scale, config
        ctx.set_materialize_grads(False)
        return beta, p, predictive

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_beta, grad_p, grad_predictive):
        upstream = [grad_p, grad_beta, grad_predictive]
        d_decay2, d_noise, d_norm2, d_r, d_p0 = _scan_backward(
            ctx.saved_tensors, upstream, ctx.evidence_scale, ctx.config
        )
        return d_decay2, d_norm2, d_noise, d_r, d_p0, None, None


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


@opaque_to_compiler
def kdn_iso_scan(
    decay2: torch.Tensor,
    norm2: torch.Tensor,
    q_noise: torch.Tensor,
    r: torch.Tensor,
    p_prior: torch.Tensor,
    evidence_scale: float,
    config: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Isotropic KDN's scan from its terms: (beta, p, predictive) `[N, T, H]` float32, with
    the evidence c = evidence_scale ||k||^2 / r formed and beta = p_bar / (p_bar ||k||^2 + r),
    predictive = p_bar ||k||^2 written by the scan's kernel (and their adjoints by its
    backward): one launch each way where the ops would take a dozen, forward and backward.

    decay2 (a, in [0, 1]) and norm2 (||k||^2) float32, q_noise (>= 0) and r (> 0) in any float
    dtype (read as they are; their gradients come back in it): `[N, T, H]`, validated;
    p_prior `[N, H]` float32 (> 0); evidence_scale = s / K. `config` as for
    `kdn_variance_scan`."""
    inputs = [x.contiguous() for x in (decay2, norm2, q_noise, r, p_prior)]
    return _KDNIsoScan.apply(*inputs, evidence_scale, config)
