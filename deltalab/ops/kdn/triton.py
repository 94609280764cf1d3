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

Split over T (`split_plan`). With few lanes (Isotropic: one per sequence and head) one program
per lane block would walk all T steps while most SMs idle, so T is cut into chunks, a program
each. Forward: each chunk's maps composed into one (`_kdn_chunk_maps_kernel`), a carry pass
applying them chunk after chunk for p before each chunk (triton_carry.py, shared with the
Diagonal gain's chunks), then every chunk walked from its carry as above. Backward: nu's
recurrence is affine, nu_t = direct_t + m_t nu_{t+1}; each chunk's composition (slope, total)
(`_kdn_chunk_adjoints_kernel`), a carry pass from the end for nu after each chunk, then every
chunk walked back from it. The carries are the same numbers the single walk passes from tile
to tile, composed in another order: the map products stay normalized, the slopes in [0, 1].
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from deltalab.ops._triton import opaque_to_compiler
from deltalab.ops.kdn.triton_carry import _store_map, carry_ends, carry_starts
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
def _part_lane(lane, part, INNER, PARTS, WIDTH: tl.constexpr = 1):
    """Where a lane's (first) value for chunk `part` sits in a [N, PARTS, WIDTH, INNER] tensor
    (with PARTS = 1, part 0 and WIDTH 1, in [N, INNER]: the lane itself)."""
    return (lane // INNER * PARTS + part) * WIDTH * INNER + lane % INNER


@triton.jit
def _kdn_forward_kernel(
    DECAY,
    NOISE,
    EVIDENCE,
    R,
    P_START,
    P,
    OUT2,
    OUT3,
    T,
    INNER,
    LANES,
    E,
    CHUNK,
    PARTS,
    ISO: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    # Program (lanes, part) walks chunk `part` of T (CHUNK steps, a multiple of BLOCK_T) from
    # P_START, p before the chunk: the prior [N, INNER] when T is one chunk, else the carry
    # pass's [N, PARTS, INNER].
    lane, lane_ok, base = _lane_offsets(tl.program_id(0), T, INNER, LANES, BLOCK_L)
    part = tl.program_id(1)
    rows = tl.arange(0, BLOCK_T)
    p = tl.load(P_START + _part_lane(lane, part, INNER, PARTS), mask=lane_ok, other=1.0)
    for start in range(0, CHUNK, BLOCK_T):
        t = part * CHUNK + start + rows
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
def _kdn_chunk_maps_kernel(
    DECAY,
    NOISE,
    EVIDENCE,
    R,
    MAPS,
    T,
    INNER,
    LANES,
    E,
    CHUNK,
    PARTS,
    ISO: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    """MAPS [N, PARTS, 4, INNER]: the Mobius map of each chunk's steps composed in time order
    (normalized), which the carry pass applies to p chunk after chunk."""
    lane, lane_ok, base = _lane_offsets(tl.program_id(0), T, INNER, LANES, BLOCK_L)
    part = tl.program_id(1)
    rows = tl.arange(0, BLOCK_T)
    last = rows[:, None] == BLOCK_T - 1
    ma = tl.full([BLOCK_L], 1.0, dtype=tl.float32)
    mb = tl.zeros([BLOCK_L], dtype=tl.float32)
    mc = tl.zeros([BLOCK_L], dtype=tl.float32)
    md = tl.full([BLOCK_L], 1.0, dtype=tl.float32)
    for start in range(0, CHUNK, BLOCK_T):
        t = part * CHUNK + start + rows
        ok = (t < T)[:, None] & lane_ok[None, :]
        offsets = base[None, :] + t.to(tl.int64)[:, None] * INNER
        a, q, c, _, _ = _step_terms(DECAY, NOISE, EVIDENCE, R, offsets, ok, E, ISO)
        ta, tb, tc, td = _normalize(a, q, c * a, c * q + 1.0)
        ta, tb, tc, td = tl.associative_scan((ta, tb, tc, td), 0, _compose)
        ma, mb, mc, md = _compose(
            ma, mb, mc, md,
            tl.sum(tl.where(last, ta, 0.0), axis=0), tl.sum(tl.where(last, tb, 0.0), axis=0),
            tl.sum(tl.where(last, tc, 0.0), axis=0), tl.sum(tl.where(last, td, 0.0), axis=0),
        )  # fmt: skip
    at = _part_lane(lane, part, INNER, PARTS, 4)  # [N, PARTS, 4, INNER]
    _store_map(MAPS, at, INNER, ma, mb, mc, md, lane_ok)


@triton.jit
def _adjoint_steps(
    DECAY, NOISE, EVIDENCE, R, P, GP, G2, G3, p0, t, base, lane_ok, T, INNER, E,
    ISO: tl.constexpr, HAS_GP: tl.constexpr, HAS_G2: tl.constexpr, HAS_G3: tl.constexpr,
):  # fmt: skip
    """The backward's steps t (rows) of the lanes: (offsets, ok, p_t, p_{t-1}, m, direct) with
    nu_t = direct_t + m_t nu_{t+1}: direct holds dp_t and step t + 1's own outputs' gradients
    through p_t, m = a_{t+1} s_{t+1} (no step t + 1 past the end: no multiplier, nothing)."""
    ok = (t < T)[:, None] & lane_ok[None, :]
    has_next = (t + 1 < T)[:, None] & lane_ok[None, :]
    has_prev = (t > 0)[:, None] & ok
    offsets = base[None, :] + t.to(tl.int64)[:, None] * INNER
    p_t = tl.load(P + offsets, mask=ok, other=0.0)
    p_prev = tl.load(P + offsets - INNER, mask=has_prev, other=0.0)
    p_prev = tl.where(has_prev, p_prev, p0[None, :])
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
    return offsets, ok, p_t, p_prev, a_next * shrink_next * shrink_next, direct


@triton.jit
def _kdn_chunk_adjoints_kernel(
    DECAY,
    NOISE,
    EVIDENCE,
    R,
    P0,
    P,
    GP,
    G2,
    G3,
    MAPS,
    T,
    INNER,
    LANES,
    E,
    CHUNK,
    PARTS,
    ISO: tl.constexpr,
    HAS_GP: tl.constexpr,
    HAS_G2: tl.constexpr,
    HAS_G3: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    """MAPS [N, PARTS, 2, INNER]: each chunk's adjoint as (slope, total), nu at its first step
    = total + slope nu after its last, composed from its last step back, which the carry pass
    applies chunk after chunk from the end."""
    lane, lane_ok, base = _lane_offsets(tl.program_id(0), T, INNER, LANES, BLOCK_L)
    part = tl.program_id(1)
    rows = tl.arange(0, BLOCK_T)
    last = rows[:, None] == BLOCK_T - 1
    p0 = tl.load(P0 + lane, mask=lane_ok, other=0.0)
    slope_all = tl.full([BLOCK_L], 1.0, dtype=tl.float32)
    total_all = tl.zeros([BLOCK_L], dtype=tl.float32)
    for i in range(0, CHUNK, BLOCK_T):
        # Tiles from the chunk's last to its first; row 0 is the tile's last step.
        t = part * CHUNK + (CHUNK - BLOCK_T - i) + (BLOCK_T - 1) - rows
        _, _, _, _, m, direct = _adjoint_steps(
            DECAY, NOISE, EVIDENCE, R, P, GP, G2, G3, p0, t, base, lane_ok, T, INNER, E,
            ISO, HAS_GP, HAS_G2, HAS_G3,
        )  # fmt: skip
        slope, total = tl.associative_scan((m, direct), 0, _then_affine)
        slope = tl.sum(tl.where(last, slope, 0.0), axis=0)
        total_all = tl.sum(tl.where(last, total, 0.0), axis=0) + slope * total_all
        slope_all = slope * slope_all
    at = _part_lane(lane, part, INNER, PARTS, 2)  # [N, PARTS, 2, INNER]
    tl.store(MAPS + at, slope_all, mask=lane_ok)
    tl.store(MAPS + at + INNER, total_all, mask=lane_ok)


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
    NU_END,
    GDECAY,
    GNOISE,
    GEVIDENCE,
    GR,
    GP0,
    T,
    INNER,
    LANES,
    E,
    CHUNK,
    PARTS,
    ISO: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_GP: tl.constexpr,
    HAS_G2: tl.constexpr,
    HAS_G3: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    # Program (lanes, part) walks chunk `part` back from nu after it: 0 when T is one chunk,
    # else the carry pass's NU_END [N, PARTS, INNER]. Part 0's program also gives dp_0.
    lane, lane_ok, base = _lane_offsets(tl.program_id(0), T, INNER, LANES, BLOCK_L)
    part = tl.program_id(1)
    rows = tl.arange(0, BLOCK_T)
    p0 = tl.load(P0 + lane, mask=lane_ok, other=0.0)
    if SPLIT:  # nu at the first step after the chunk
        nu = tl.load(NU_END + _part_lane(lane, part, INNER, PARTS), mask=lane_ok, other=0.0)
    else:
        nu = tl.zeros([BLOCK_L], dtype=p0.dtype)
    for i in range(0, CHUNK, BLOCK_T):
        # Tiles from the chunk's last to its first; row 0 is the tile's last step.
        t = part * CHUNK + (CHUNK - BLOCK_T - i) + (BLOCK_T - 1) - rows
        offsets, ok, p_t, p_prev, m, direct = _adjoint_steps(
            DECAY, NOISE, EVIDENCE, R, P, GP, G2, G3, p0, t, base, lane_ok, T, INNER, E,
            ISO, HAS_GP, HAS_G2, HAS_G3,
        )  # fmt: skip
        slope, total = tl.associative_scan((m, direct), 0, _then_affine)
        nu_t = total + slope * nu[None, :]
        a, q, c, norm2, r = _step_terms(DECAY, NOISE, EVIDENCE, R, offsets, ok, E, ISO)
        pi, p_bar, g2, g3 = _p_bar_total(
            G2, G3, offsets, ok, p_prev, nu_t, a, q, c, norm2, r, ISO, HAS_G2, HAS_G3
        )
        tl.store(GDECAY + offsets, pi * p_prev, mask=ok)
        tl.store(GNOISE + offsets, pi, mask=ok)
        if ISO:
            # c = E ||k||^2 / r, beta = p_bar / den, predictive = p_bar ||k||^2. Through c,
            # dp/d||k||^2 = -p^2 E / r and dp/dr = p^2 c / r, written with den_c = r + E
            # ||k||^2 p_bar: p E / r = E p_bar / den_c and p c = E ||k||^2 p_bar / den_c (in
            # [0, 1]), so dp/dr = (p c) p_bar / den_c. As d_c E / r with d_c = -nu p^2, p^2
            # underflowed (r below ~1e-19) and c overflowed (0 * inf) in float32. beta's own
            # share, g2 beta / den, is formed as (g2 beta) / den: 0 when beta is unused.
            den = p_bar * norm2 + r
            beta = p_bar / den
            den_c = r + (E * norm2) * p_bar
            p_c = ((E * norm2) * p_bar) / den_c
            d_norm2 = -(nu_t * p_t) * ((E * p_bar) / den_c) + g3 * p_bar - g2 * beta * beta
            tl.store(GEVIDENCE + offsets, d_norm2, mask=ok)
            d_r = (nu_t * p_c) * p_bar / den_c - (g2 * beta) / den
            tl.store(GR + offsets, d_r, mask=ok)
        else:
            tl.store(GEVIDENCE + offsets, -(nu_t * p_t) * p_t, mask=ok)
        nu = tl.sum(tl.where(rows[:, None] == BLOCK_T - 1, nu_t, 0.0), axis=0)
    # In part 0's program nu is nu_1 (the first step) now: dp_0 = a_1 pi_1.
    first = lane_ok & (part + 0 * lane == 0)  # a vector mask (the interpreter refuses a scalar's)
    a, q, c, norm2, r = _step_terms(DECAY, NOISE, EVIDENCE, R, base, first, E, ISO)
    pi, _, _, _ = _p_bar_total(G2, G3, base, first, p0, nu, a, q, c, norm2, r, ISO, HAS_G2, HAS_G3)
    tl.store(GP0 + lane, a * pi, mask=first)


# Split over T below this many lane programs (an H200 has 132 SMs), into chunks of a power of 2
# tokens aiming at SPLIT_PROGRAMS programs in all: Isotropic KDN has one lane per (sequence,
# head), whose single programs each walk all T steps (at B=1 H=16 T=32768, 16 programs: 0.33 +
# 0.25 ms forward and backward on the H200). At B=1 T=32768 H=16 the split
# scan's kernels took 0.11 ms against the single walks' 0.58. At B=4 H=16 (64 programs, T=4096: 0.04 + 0.04 ms) the single walks stay:
# the split's extra launches cost the host more than they could save the device there. float32
# only: the carry passes compute in it.
SPLIT_BELOW_PROGRAMS = 64
SPLIT_PROGRAMS = 256


def split_plan(lanes, length, block_t, block_l, dtype, chunk=None) -> tuple[int, int]:
    """(CHUNK, PARTS): tokens per program, a multiple of block_t (`chunk` when given), and
    chunks per lane. One chunk (the tiles covering T) unless the lane programs are few."""
    whole = max(1, triton.cdiv(length, block_t)) * block_t
    if chunk is None:
        programs = triton.cdiv(lanes, block_l)
        chunk = whole
        if dtype == torch.float32 and programs < SPLIT_BELOW_PROGRAMS:
            parts = max(1, SPLIT_PROGRAMS // programs)
            chunk = min(whole, max(block_t, triton.next_power_of_2(triton.cdiv(length, parts))))
    elif chunk % block_t or (chunk < length and dtype != torch.float32):
        raise ValueError(
            f"chunk must be a multiple of BLOCK_T = {block_t} (and split float32 only), "
            f"got {chunk} for {dtype}"
        )
    return chunk, max(1, triton.cdiv(length, chunk))


def _scan_forward(decay2, noise, evidence, r, p_prior, evidence_scale, plan):
    """Launches the forward: (p, p_bar, None), or Isotropic's (p, beta, predictive) when r is
    given (then `evidence` holds ||k||^2). Inputs contiguous [N, T, R], p_prior [N, R].
    Split over T (`split_plan`): each chunk's composed map, a carry pass for p at each chunk's
    start, then every chunk walked at once from there."""
    n, length, inner = decay2.shape
    iso = r is not None
    if length == 0:  # nothing to scan (and no step 0 for the kernels to read)
        return (
            decay2.new_empty(decay2.shape),
            decay2.new_empty(decay2.shape),
            (decay2.new_empty(decay2.shape) if iso else None),
        )
    lanes = n * inner
    config, chunk, carry_block = plan
    block_t, block_l = config or launch_config(lanes, length)
    chunk, parts = split_plan(lanes, length, block_t, block_l, decay2.dtype, chunk)
    common = dict(ISO=iso, BLOCK_T=block_t, BLOCK_L=block_l)
    grid = (triton.cdiv(lanes, block_l), parts)
    gates = (decay2, noise, evidence, r if iso else decay2)
    start = p_prior
    if parts > 1:
        maps = decay2.new_empty(n, parts, 4, inner)
        _kdn_chunk_maps_kernel[grid](
            *gates, maps, length, inner, lanes, evidence_scale, chunk, parts, **common
        )
        start = carry_starts(maps, p_prior, carry_block)
    # Uninitialized: the kernel writes every element (the tests NaN-fill torch.empty*, the
    # poisoned_empty fixture, so an element left unwritten fails them).
    p, second = torch.empty_like(decay2), torch.empty_like(decay2)
    third = torch.empty_like(decay2) if iso else None
    _kdn_forward_kernel[grid](
        *gates, start, p, second, third if iso else p, length, inner, lanes, evidence_scale,
        chunk, parts, **common,
    )  # fmt: skip
    return p, second, third


def _scan_backward(saved, upstream, evidence_scale, plan):
    """Launches the backward on the forward's inputs and p (`saved`: decay2, noise, evidence,
    r or None, p_prior, p) for the outputs' gradients `upstream` (p's, then p_bar's, or beta's
    and predictive's; None where unused). Returns the gradients of decay2, noise, evidence,
    r (None without r) and p_prior, each in its input's dtype. Split over T as the forward:
    each chunk's adjoint map, a carry pass for nu after each chunk, every chunk at once."""
    decay2, noise, evidence, r, p_prior, p = saved
    n, length, inner = decay2.shape
    iso = r is not None
    if length == 0:  # no step: the prior reaches nothing
        empty = [torch.empty_like(x) for x in (decay2, noise, evidence)]
        return (*empty, torch.empty_like(r) if iso else None, torch.zeros_like(p_prior))
    lanes = n * inner
    config, chunk, carry_block = plan
    block_t, block_l = config or launch_config(lanes, length, tile=1024)
    chunk, parts = split_plan(lanes, length, block_t, block_l, decay2.dtype, chunk)
    present = [g is not None for g in upstream]
    upstream = [p if g is None else g.contiguous() for g in upstream]
    upstream += [p] * (3 - len(upstream))
    flags = dict(HAS_GP=present[0], HAS_G2=present[1], HAS_G3=len(present) > 2 and present[2])
    common = dict(ISO=iso, **flags, BLOCK_T=block_t, BLOCK_L=block_l)
    grid = (triton.cdiv(lanes, block_l), parts)
    gates = (decay2, noise, evidence, r if iso else decay2)
    nu_end = p_prior
    if parts > 1:
        maps = decay2.new_empty(n, parts, 2, inner)
        _kdn_chunk_adjoints_kernel[grid](
            *gates, p_prior, p, *upstream, maps, length, inner, lanes, evidence_scale, chunk,
            parts, **common,
        )  # fmt: skip
        nu_end = carry_ends(maps, carry_block)
    grads = [torch.empty_like(x) for x in (decay2, noise, evidence)]
    grad_r = torch.empty_like(r) if iso else None
    grad_p0 = torch.empty_like(p_prior)
    _kdn_backward_kernel[grid](
        *gates, p_prior, p, *upstream, nu_end, *grads, grad_r if iso else p, grad_p0, length,
        inner, lanes, evidence_scale, chunk, parts, SPLIT=parts > 1, **common,
    )  # fmt: skip
    return (*grads, grad_r, grad_p0)


class _KDNVarianceScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, decay2, noise, evidence, p_prior, plan):
        # decay2, noise, evidence: contiguous [N, T, R]; p_prior: contiguous [N, R].
        p, p_bar, _ = _scan_forward(decay2, noise, evidence, None, p_prior, 1.0, plan)
        ctx.save_for_backward(decay2, noise, evidence, p_prior, p)
        ctx.plan = plan
        ctx.set_materialize_grads(False)
        return p, p_bar

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_p, grad_p_bar):
        decay2, noise, evidence, p_prior, p = ctx.saved_tensors
        saved = (decay2, noise, evidence, None, p_prior, p)
        upstream = [grad_p, grad_p_bar]
        *grads, _, grad_p0 = _scan_backward(saved, upstream, 1.0, ctx.plan)
        return (*grads, grad_p0, None)


class _KDNIsoScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, decay2, norm2, noise, r, p_prior, evidence_scale, plan):
        # decay2, norm2 (float32), noise, r (any float dtype): contiguous [N, T, H];
        # p_prior: contiguous [N, H] float32.
        p, beta, predictive = _scan_forward(decay2, noise, norm2, r, p_prior, evidence_scale, plan)
        ctx.save_for_backward(decay2, noise, norm2, r, p_prior, p)
        ctx.evidence_scale, ctx.plan = evidence_scale, plan
        ctx.set_materialize_grads(False)
        return beta, p, predictive

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_beta, grad_p, grad_predictive):
        upstream = [grad_p, grad_beta, grad_predictive]
        d_decay2, d_noise, d_norm2, d_r, d_p0 = _scan_backward(
            ctx.saved_tensors, upstream, ctx.evidence_scale, ctx.plan
        )
        return d_decay2, d_norm2, d_noise, d_r, d_p0, None, None


@opaque_to_compiler
def kdn_variance_scan(
    decay2: torch.Tensor,
    q_noise: torch.Tensor,
    evidence: torch.Tensor,
    p_prior: torch.Tensor,
    config: tuple[int, int] | None = None,
    chunk: int | None = None,
    carry_block: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Posterior p_t and predicted p_bar_t `[N, T, *rest]` of KDN's variance recursion.

    decay2 (a = exp(2 g), in [0, 1]), q_noise (>= 0), evidence (c >= 0): `[N, T, *rest]`, one
    float dtype, validated; p_prior `[N, *rest]` (>= 0). `config` = (BLOCK_T, BLOCK_L)
    overrides `launch_config`, `chunk` (tokens per program, a multiple of BLOCK_T; float32
    to split) `split_plan`'s choice, `carry_block` the carry passes' (chunks, lanes) block
    (`triton_carry.carry_block`); tests and benchmarks set them.
    """
    shape = decay2.shape
    n, length = shape[0], shape[1]
    inner = math.prod(shape[2:])  # explicit: -1 is ambiguous when T = 0
    gates = [x.reshape(n, length, inner).contiguous() for x in (decay2, q_noise, evidence)]
    start = p_prior.reshape(n, -1).contiguous()
    p, p_bar = _KDNVarianceScan.apply(*gates, start, (config, chunk, carry_block))
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
    chunk: int | None = None,
    carry_block: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Isotropic KDN's scan from its terms: (beta, p, predictive) `[N, T, H]` float32, with
    the evidence c = evidence_scale ||k||^2 / r formed and beta = p_bar / (p_bar ||k||^2 + r),
    predictive = p_bar ||k||^2 written by the scan's kernel (and their adjoints by its
    backward): one launch each way (three where `split_plan` splits T: the chunks' maps, the
    carry pass, the walks) where the ops took a dozen, forward and backward.

    decay2 (a, in [0, 1]) and norm2 (||k||^2) float32, q_noise (>= 0) and r (> 0) in any float
    dtype (read as they are; their gradients come back in it): `[N, T, H]`, validated;
    p_prior `[N, H]` float32 (> 0); evidence_scale = s / K. `config`, `chunk` and
    `carry_block` as for `kdn_variance_scan`."""
    inputs = [x.contiguous() for x in (decay2, norm2, q_noise, r, p_prior)]
    return _KDNIsoScan.apply(*inputs, evidence_scale, (config, chunk, carry_block))
