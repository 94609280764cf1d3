"""Diagonal KDN's whole gain in Triton: k, g, q_noise, r, p_prior -> gain, p, predictive, one
walk each way (docs/MATH.md sec. 3; gains.py has the formulas):

    a_t = exp(2 g_t),   c_t = s k_t^2 / r_t                       (the pre-scan terms)
    p_bar_t = a_t p_{t-1} + q_t,   p_t = 1 / (c_t + 1 / p_bar_t)   (the variance scan)
    w_t = p_bar_t k_t,   predictive_t = sum_K w_t k_t,   gain_t = w_t / (predictive_t + r_t)

The PyTorch path runs these as separate ops, each a float32 `[B, T, H, K]` round trip through
memory (exp(2g), the evidence, p_bar, w, their gradients and gradient sums); here a, c, p_bar and w
live in registers only. Forward traffic: reads k, g, q_noise (and r, per head), writes gain, p and
predictive. Backward: reads k, g, q_noise, p, dgain (and dp, when the loss reaches p), writes
dk, dg, dq_noise, dr (per head) and dp_prior; a, c, p_bar, w and the gain are recomputed, not
saved.

Layout. k, q_noise, gain, p (and per-channel g) are contiguous `[B, T, H, K]`; r, predictive (and
per-head g) `[B, T, H]`. A program owns one head of one sequence, all K channels (BLOCK_K, a power
of 2 >= K, the rest masked as identity maps), since the predictive sums over K per token, so r's
gradient (and a per-head g's) needs no atomics and no partial sums.

Token by token. A program walks its tokens one at a time on one warp: every vector is one token's
K channels, nothing crosses threads but the sums over K (a warp's shuffles at K = 128), and the
recurrence is the definition's own float32 step (forward p_bar = a p + q, p = 1 / (c + 1 / p_bar);
backward the adjoint step below), exact without a Mobius normalization. BLOCK_T tokens are
unrolled per step of the loop (their loads issued together). An earlier walk scanned tiles of
tokens with `tl.associative_scan` (commit 9dc4393 has it): measured with Nsight Compute on the
H200 (B=4 T=4096 H=16 K=128 bf16, 2026-12-03) its scans across threads saturated the L1/shared
memory pipe (81-92% against 16-22% of DRAM's bandwidth), and the token walks took 0.68x its
forward+backward time there and 0.51x at B=1 T=32768 H=16.

Split over T. One program per (sequence, head) walking all of T is a serial chain of T steps on
too few programs (32 at the 340M preset, B = 4, H = 8), so the kernels run on a grid of (B H,
chunks), a chunk of T per program (`chunk_tokens`: 64 tokens at every shape measured), each from
its chunk's boundary value, which two small passes give: the chunk's composed maps (one per
channel, `_kdn_diag_gain_token_maps_kernel` forward, `_kdn_diag_gain_token_adjoints_kernel`
backward), then a carry across the chunks per head (triton_carry.py). The composed maps are
whole steps [[a, q], [c a, c q + 1]] (update after prediction), normalized, whose product over a
chunk maps p before it to p at its last step. Every gradient but dp_prior is per token (dr, and a
per-head dg, reduce over K only), so the split needs no partial sums; dp_prior comes from the
first chunk's program.

Forward. p_t = 1 / (c + 1 / p_bar) has no cancellation and is right at both ends (p_bar = 0
gives 0; c = 0 gives p_bar). The predictive sums non-negative terms; the gain divides by
predictive + r >= r > 0, so r = 1e30 (no evidence) gives gain ~ 0 and c ~ 0, and g = -inf gives
a = 0 (a reset: p_bar = q) without NaN.

Backward. The gain's adjoint at token t (den = predictive + r):

    dden = -sum_K(dgain gain) / den          (not dgain w / den^2: den^2 overflows at r = 1e30)
    dpred = dpredictive + dden,   dw = dgain / den + dpred k
    dp_bar (direct) = dw k,   dk = dw p_bar + dpred w,   dr = dden

Then the scan's adjoint in pi_t = dL/dp_bar_t and nu_t = dL/dp_t (totals), s_t = dp_t / dp_bar_t
= 1 / (c_t p_bar_t + 1)^2:

    pi_t = [dp_bar_t + s_t dp_t] + s_t a_{t+1} pi_{t+1},    nu_t = dp_t + a_{t+1} pi_{t+1}

Walked in pi, a token needs only its own terms and a_{t+1}: the maps (pi, nu) <- (e + x pi',
f + y pi') of pi' = pi_{t+1}, x = s a <= 1 and y = a <= 1 (a chunk's composition needs only
the pi part, (X, E)): a positive combination whose products only shrink (their underflow to 0 is
the true limit), no cancellation of its own. From pi and nu:

    da_t = pi_t p_{t-1},   dq_t = pi_t,   dc_t = -nu_t p_t^2,   dp_prior = a_1 pi_1,
    dg = 2 a da,   dk += (dc / r) 2 s k,   dr += -dc c / r = (nu p_t)(p_t c) / r

ordered so nothing overflows where the result does not: p_t c = c / (c + 1 / p_bar) is in
[0, 1], and dc / r <= nu r / (s k^2)^2 (p_t <= 1 / c) before it meets 2 s k, which overflows
alone at tiny r (the PyTorch path divides by r^2, which overflows first at r = 1e30).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deltalab.ops._triton import opaque_to_compiler
from deltalab.ops.kdn.triton_carry import _store_map, carry_ends, carry_starts
from deltalab.ops.mobius.triton import _compose, _normalize, _then_affine


@triton.jit
def _token_program(T, H, KD, BLOCK_K: tl.constexpr):
    """Where a program of the token walks works: (pid, part, the channels and their mask, the
    offset of its head's first token in the [B, T, H, K] tensors and in the [B, T, H] ones)."""
    pid = tl.program_id(0)
    part = tl.program_id(1)
    ch = tl.arange(0, BLOCK_K)
    base = (pid // H).to(tl.int64) * T * (H * KD) + (pid % H) * KD
    head_base = (pid // H).to(tl.int64) * T * H + pid % H
    return pid, part, ch, ch < KD, base, head_base


@triton.jit
def _token_terms(K_, G, NOISE, R, t, ch, ch_ok, base, head_base, T, H, KD, scale,
                 G_HEAD: tl.constexpr):  # fmt: skip
    """Token t's a = exp(2 g), q, c = s k^2 / r, k and r (r broadcast over the channels), its
    offsets and mask: `[BLOCK_K]` vectors; channels past K and tokens past T are the identity
    (a = 1, q = c = 0) with k = 0 and r = 1."""
    ok = ch_ok & (t + 0 * ch < T)  # a vector mask (the interpreter refuses a scalar's)
    at = base + t.to(tl.int64) * (H * KD) + ch
    head_at = head_base + t.to(tl.int64) * H + 0 * ch
    k = tl.load(K_ + at, mask=ok, other=0.0).to(tl.float32)
    q = tl.load(NOISE + at, mask=ok, other=0.0).to(tl.float32)
    r = tl.load(R + head_at, mask=ok, other=1.0).to(tl.float32)
    if G_HEAD:
        g = tl.load(G + head_at, mask=ok, other=0.0).to(tl.float32)
    else:
        g = tl.load(G + at, mask=ok, other=0.0).to(tl.float32)
    return tl.exp(2.0 * g), q, scale * k * k / r, k, r, ok, at, head_at


@triton.jit
def _kdn_diag_gain_token_maps_kernel(
    K_, G, NOISE, R, MAPS, T, H, KD, scale, CHUNK,
    G_HEAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """MAPS[pid, part] = the normalized product of the maps of chunk `part`'s steps, composed
    one token at a time."""
    pid, part, ch, ch_ok, base, head_base = _token_program(T, H, KD, BLOCK_K)
    ma = tl.full([BLOCK_K], 1.0, tl.float32)
    mb = tl.zeros([BLOCK_K], dtype=tl.float32)
    mc = tl.zeros([BLOCK_K], dtype=tl.float32)
    md = tl.full([BLOCK_K], 1.0, tl.float32)
    for start in range(0, CHUNK, BLOCK_T):
        for j in tl.static_range(BLOCK_T):
            t = part * CHUNK + start + j
            a, q, c, _, _, _, _, _ = _token_terms(
                K_, G, NOISE, R, t, ch, ch_ok, base, head_base, T, H, KD, scale, G_HEAD
            )
            sa, sb, sc, sd = _normalize(a, q, c * a, c * q + 1.0)
            ma, mb, mc, md = _compose(ma, mb, mc, md, sa, sb, sc, sd)
    at = (pid.to(tl.int64) * tl.num_programs(1) + part) * 4 * KD + ch
    _store_map(MAPS, at, KD, ma, mb, mc, md, ch_ok)


@triton.jit
def _kdn_diag_gain_token_forward_kernel(
    K_, G, NOISE, R, P_START, GAIN, P, PRED, T, H, KD, scale, CHUNK,
    G_HEAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # Program (pid, part): tokens [part CHUNK, (part + 1) CHUNK) of head pid, one at a time,
    # from p at the chunk's start, P_START[pid, part] (p_prior with one chunk).
    pid, part, ch, ch_ok, base, head_base = _token_program(T, H, KD, BLOCK_K)
    start_at = (pid.to(tl.int64) * tl.num_programs(1) + part) * KD
    p = tl.load(P_START + start_at + ch, mask=ch_ok, other=1.0)
    for start in range(0, CHUNK, BLOCK_T):
        for j in tl.static_range(BLOCK_T):
            t = part * CHUNK + start + j
            a, q, c, k, r, ok, at, head_at = _token_terms(
                K_, G, NOISE, R, t, ch, ch_ok, base, head_base, T, H, KD, scale, G_HEAD
            )
            p_bar = a * p + q
            p = 1.0 / (c + 1.0 / p_bar)  # tokens past T leave p as it is (a = 1, q = c = 0)
            weighted = p_bar * k
            predictive = tl.sum(weighted * k, axis=0)
            tl.store(GAIN + at, (weighted / (predictive + r)).to(GAIN.dtype.element_ty), mask=ok)
            tl.store(P + at, p, mask=ok)
            tl.store(PRED + head_at, predictive + 0.0 * r, mask=ok & (ch == 0))


@triton.jit
def _token_adjoint(
    K_, G, NOISE, R, P, PRED, DGAIN, DP, DPRED, p0, a_next, t, ch, ch_ok, base, head_base, T,
    H, KD, scale, G_HEAD: tl.constexpr, HAS_DP: tl.constexpr,
):  # fmt: skip
    """Token t's gain adjoint and its adjoint map (pi, nu) <- (e + x pi', f + y pi') of
    pi' = pi_{t+1}, given a_next = a_{t+1} (0 past the end)."""
    a, q, c, k, r, ok, at, head_at = _token_terms(
        K_, G, NOISE, R, t, ch, ch_ok, base, head_base, T, H, KD, scale, G_HEAD
    )
    has_prev = ok & (t + 0 * ch > 0)
    p_prev = tl.load(P + at - H * KD, mask=has_prev, other=0.0)
    p_prev = tl.where(has_prev, p_prev, p0)
    p_bar = a * p_prev + q
    weighted = p_bar * k
    # The forward's predictive, kept: no sum over K for the denominator.
    den = tl.load(PRED + head_at, mask=ok, other=0.0) + r
    d_gain = tl.load(DGAIN + at, mask=ok, other=0.0).to(tl.float32)
    d_den = -tl.sum(d_gain * (weighted / den), axis=0) / den
    d_pred = tl.load(DPRED + head_at, mask=ok, other=0.0) + d_den
    d_weighted = d_gain / den + d_pred * k
    d_k = d_weighted * p_bar + d_pred * weighted
    shrink = 1.0 / (c * p_bar + 1.0)
    slope = shrink * shrink
    if HAS_DP:
        d_p = tl.load(DP + at, mask=ok, other=0.0).to(tl.float32)
    else:
        d_p = tl.zeros_like(k)
    x, e = slope * a_next, d_weighted * k + slope * d_p
    return ok, at, head_at, a, c, k, r, p_prev, p_bar, d_den, d_k, x, e, d_p


@triton.jit
def _next_decay(G, t, ch, ch_ok, base, head_base, T, H, KD, G_HEAD: tl.constexpr):
    """a_{t} = exp(2 g_t) for the token after a chunk (0 at and past T: no step follows)."""
    ok = ch_ok & (t + 0 * ch < T)
    if G_HEAD:
        g = tl.load(G + head_base + t.to(tl.int64) * H + 0 * ch, mask=ok, other=0.0)
    else:
        g = tl.load(G + base + t.to(tl.int64) * (H * KD) + ch, mask=ok, other=0.0)
    return tl.where(ok, tl.exp(2.0 * g.to(tl.float32)), 0.0)


@triton.jit
def _kdn_diag_gain_token_adjoints_kernel(
    K_, G, NOISE, R, P0, P, PRED, DGAIN, DP, DPRED, MAPS, T, H, KD, scale, CHUNK,
    G_HEAD: tl.constexpr, HAS_DP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """MAPS[pid, part] = (X, E): pi at chunk `part`'s first step is E + X pi', pi' = pi after
    its last step; composed one token at a time, from the last."""
    pid, part, ch, ch_ok, base, head_base = _token_program(T, H, KD, BLOCK_K)
    p0 = tl.load(P0 + pid * KD + ch, mask=ch_ok, other=0.0)
    a_next = _next_decay(G, part * CHUNK + CHUNK, ch, ch_ok, base, head_base, T, H, KD, G_HEAD)
    slope = tl.full([BLOCK_K], 1.0, tl.float32)
    total = tl.zeros([BLOCK_K], dtype=tl.float32)
    for i in range(0, CHUNK, BLOCK_T):
        for j in tl.static_range(BLOCK_T):
            t = part * CHUNK + CHUNK - 1 - (i + j)
            _, _, _, a, _, _, _, _, _, _, _, x, e, _ = _token_adjoint(
                K_, G, NOISE, R, P, PRED, DGAIN, DP, DPRED, p0, a_next, t, ch, ch_ok, base,
                head_base, T, H, KD, scale, G_HEAD, HAS_DP,
            )  # fmt: skip
            # This token (earlier in time) after the running map of the later ones.
            slope, total = _then_affine(slope, total, x, e)
            a_next = tl.where(t + 0 * ch < T, a, 0.0)
    at = (pid.to(tl.int64) * tl.num_programs(1) + part) * 2 * KD + ch
    tl.store(MAPS + at, slope, mask=ch_ok)
    tl.store(MAPS + at + KD, total, mask=ch_ok)


@triton.jit
def _kdn_diag_gain_token_backward_kernel(
    K_, G, NOISE, R, P0, P, PRED, DGAIN, DP, DPRED, PI_END, DK_IN, DG_IN, DK, DG, DNOISE, DR,
    DP0, T, H, KD, scale, CHUNK, G_HEAD: tl.constexpr, HAS_DP: tl.constexpr,
    HAS_DK_IN: tl.constexpr, HAS_DG_IN: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    # Program (pid, part): tokens [part CHUNK, (part + 1) CHUNK) of head pid from the last, from
    # pi after the chunk, PI_END[pid, part] (zeros with one chunk).
    pid, part, ch, ch_ok, base, head_base = _token_program(T, H, KD, BLOCK_K)
    p0 = tl.load(P0 + pid * KD + ch, mask=ch_ok, other=0.0)
    end_at = (pid.to(tl.int64) * tl.num_programs(1) + part) * KD
    pi_after = tl.load(PI_END + end_at + ch, mask=ch_ok, other=0.0)
    a_next = _next_decay(G, part * CHUNK + CHUNK, ch, ch_ok, base, head_base, T, H, KD, G_HEAD)
    for i in range(0, CHUNK, BLOCK_T):
        for j in tl.static_range(BLOCK_T):
            t = part * CHUNK + CHUNK - 1 - (i + j)
            ok, at, head_at, a, c, k, r, p_prev, p_bar, d_den, d_k, x, e, d_p = _token_adjoint(
                K_, G, NOISE, R, P, PRED, DGAIN, DP, DPRED, p0, a_next, t, ch, ch_ok, base,
                head_base, T, H, KD, scale, G_HEAD, HAS_DP,
            )  # fmt: skip
            # Tokens past T are zero maps: pi stays 0 after the last step.
            pi = tl.where(ok, e + x * pi_after, pi_after)
            nu = d_p + a_next * pi_after
            p_t = 1.0 / (c + 1.0 / p_bar)
            nu_p = nu * p_t
            d_c = -nu_p * p_t
            d_g = 2.0 * a * (pi * p_prev)
            d_k += (d_c / r) * (2.0 * scale * k)
            if HAS_DK_IN:
                d_k += tl.load(DK_IN + at, mask=ok, other=0.0).to(tl.float32)
            tl.store(DK + at, d_k.to(DK.dtype.element_ty), mask=ok)
            tl.store(DNOISE + at, pi.to(DNOISE.dtype.element_ty), mask=ok)
            if G_HEAD:
                d_g_head = tl.sum(tl.where(ok, d_g, 0.0), axis=0) + 0.0 * r
                if HAS_DG_IN:
                    # Channel 0 carries the head's gradient (the only lane stored).
                    d_g_in = tl.load(DG_IN + head_at + 0 * ch, mask=ok & (ch == 0), other=0.0)
                    d_g_head += d_g_in.to(tl.float32)
                tl.store(DG + head_at, d_g_head.to(DG.dtype.element_ty), mask=ok & (ch == 0))
            else:
                if HAS_DG_IN:
                    d_g += tl.load(DG_IN + at, mask=ok, other=0.0).to(tl.float32)
                tl.store(DG + at, d_g.to(DG.dtype.element_ty), mask=ok)
            d_r = d_den + tl.sum(tl.where(ok, nu_p * (p_t * c), 0.0), axis=0) / r
            tl.store(DR + head_at, d_r.to(DR.dtype.element_ty), mask=ok & (ch == 0))
            pi_after = pi
            a_next = tl.where(t + 0 * ch < T, a, 0.0)
    # pi_after is pi_1 (the first step) in the first chunk now: dp_prior = a_1 pi_1.
    a_first = _next_decay(G, 0 * part, ch, ch_ok, base, head_base, T, H, KD, G_HEAD)
    first = ch_ok & (part + 0 * ch == 0)
    tl.store(DP0 + pid * KD + ch, (a_first * pi_after).to(DP0.dtype.element_ty), mask=first)


# (tokens unrolled per step at K <= 128, warps) of each token walk: one warp, so that a sum over
# K is a warp's shuffles; wider keys unroll fewer tokens (at K = 256 the chunk adjoints spill
# 80 bytes a thread at 4 tokens). The backward unrolls 2: measured on the H200 (Nsight Compute,
# 2026-12-04, B=1 T=32768 H=16 K=128, bf16, the routed k and g's gradients added) at 4 it took
# 110 registers a thread, so 16 one-warp programs an SM (25% occupancy), and waited on its loads
# (58.6% of cycles with no warp eligible, 44% of DRAM's bandwidth); the gain alone, forward and
# backward, each kernel's launch in turn (bench_kdn_triton.py --gain-launches): 2.62 ms with the
# backward at 2 tokens, 2.64 at 1, 2.82 at 4 (the other kernels' rows 2.79-2.92 but the chunk
# adjoints at (8, 2), 3.13). Measured at K = 128 only: at K = 64 the two unrolls take about the
# same registers (70 / 72, sm_90 compile), and at K = 256 the backward unrolls 1 token (192
# registers against 199 at 2, the same occupancy), untimed. Two walks a program instead (a
# `[2, BLOCK_K]` block on two warps) was slower (`2864f56`).
TOKEN_LAUNCH = {
    "chunk_maps": (4, 1),
    "forward": (4, 1),
    "chunk_adjoints": (4, 1),
    "backward": (2, 1),
}


def launch(
    key_dim: int, length: int, kernel: str, table: Mapping[str, tuple[int, int]] | None = None
) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_K, warps) of `kernel` (a key of TOKEN_LAUNCH; `table` overrides its
    entries, for the benchmark's launch sweep): every channel of a head, and the table's tokens
    times 128 / BLOCK_K at wider keys, at least 1 and at most T rounded up to a power of 2."""
    block_k = triton.next_power_of_2(key_dim)
    tokens, warps = {**TOKEN_LAUNCH, **(table or {})}[kernel]
    tokens = max(1, tokens * 128 // max(block_k, 128))
    return max(1, min(tokens, triton.next_power_of_2(length))), block_k, warps


# The split's chunk (tokens per program): a power of 2 giving about SPLIT_GAIN_PROGRAMS programs,
# at least SPLIT_GAIN_MIN_CHUNK tokens and the kernels' tokens: 64 tokens at every shape measured.
# Measured on the H200 (bench_kdn_triton.py --gain-chunks, 2026-12-03, bf16 inputs; ms forward
# and backward of the gain alone, chunks 16 / 32 / 64 / 128 / 256 / 512), the token walks: B=4
# T=4096 H=16 1.17 / 1.20 / 1.21 / 1.36 / 1.29 / 2.07, H=8 (the 340M preset) 1.05 / 0.85 / 1.00 /
# 1.03 / 1.40 / 2.00, B=1 T=32768 H=16 1.74 / 1.87 / 1.62 / 1.57 / 1.73 / 2.33: 64 within the
# spread of 16 to 128 at every shape (as for the tile walk before them, 9dc4393).
SPLIT_GAIN_PROGRAMS = 8192
SPLIT_GAIN_MIN_CHUNK = 64


def chunk_tokens(batch_heads: int, length: int, block_t: int) -> int:
    """The split's default tokens per program (a power of 2 and a multiple of block_t)."""
    want = triton.next_power_of_2(triton.cdiv(batch_heads * length, SPLIT_GAIN_PROGRAMS))
    return max(want, SPLIT_GAIN_MIN_CHUNK, block_t)


def _plan(
    batch_heads: int,
    length: int,
    key_dim: int,
    kernels: tuple[str, str],
    block_t: int | None,
    chunk: int | None,
    table: Mapping[str, tuple[int, int]] | None = None,
) -> tuple[tuple[int, int], int, tuple[int, int], int, int]:
    """One direction's launches: ((BLOCK_T of each of `kernels`: the walk, then the chunks'
    composed maps), BLOCK_K, (their warps), CHUNK, chunks). `block_t` overrides both kernels'
    tokens, `chunk` `chunk_tokens`. One chunk (T rounded up to the walk's tokens) when T fits a
    chunk; split, the chunk is a multiple of both kernels' tokens (powers of 2, each at most the
    chunk)."""
    launches = [launch(key_dim, length, kernel, table) for kernel in kernels]
    tiles = [block_t or t for t, _, _ in launches]
    warps = (launches[0][2], launches[1][2])
    block_k = launches[0][1]
    chunk = chunk or chunk_tokens(batch_heads, length, max(tiles))
    tiles = [min(t, chunk) for t in tiles]
    if chunk < length:
        return (tiles[0], tiles[1]), block_k, warps, chunk, triton.cdiv(length, chunk)
    whole = triton.cdiv(length, tiles[0]) * tiles[0]
    return (tiles[0], tiles[1]), block_k, warps, whole, 1


class _Tuning(NamedTuple):
    """Overrides of the launch plan (tests, benchmarks): the tokens of both kernels of a direction
    (`block_t`), the split's chunk, the carry passes' block, TOKEN_LAUNCH's entries."""

    block_t: int | None = None
    chunk: int | None = None
    carry_block: tuple[int, int] | None = None
    launches: Mapping[str, tuple[int, int]] | None = None


class _KDNDiagGain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k, g, q_noise, r, p_prior, scale, gain_dtype, tuning):
        # k, q_noise: contiguous [B, T, H, K]; g: [B, T, H, K] or [B, T, H]; r: [B, T, H], each
        # in its own float dtype (read into float32); p_prior: [B, H, K] float32; validated.
        batch, length, heads, key_dim = k.shape
        bh = batch * heads
        (tile_t, maps_t), block_k, (warps, maps_warps), chunk_t, parts = _plan(
            bh, length, key_dim, ("forward", "chunk_maps"), tuning.block_t, tuning.chunk,
            tuning.launches,
        )  # fmt: skip
        g_head = g.dim() == 3
        # Every element is written by the kernel: no fill pass.
        gain = torch.empty_like(k, dtype=gain_dtype)
        p = torch.empty_like(k, dtype=torch.float32)
        predictive = k.new_empty(batch, length, heads, dtype=torch.float32)
        starts = p_prior  # p at each chunk's start, [B H, chunks, K]
        if k.numel() and parts > 1:
            maps = p.new_empty(bh, parts, 4, key_dim)
            _kdn_diag_gain_token_maps_kernel[(bh, parts)](
                k, g, q_noise, r, maps, length, heads, key_dim, scale, chunk_t, G_HEAD=g_head,
                BLOCK_T=maps_t, BLOCK_K=block_k, num_warps=maps_warps,
            )  # fmt: skip
            starts = carry_starts(maps, p_prior, tuning.carry_block)
        if k.numel():
            _kdn_diag_gain_token_forward_kernel[(bh, parts)](
                k, g, q_noise, r, starts, gain, p, predictive, length, heads, key_dim, scale,
                chunk_t, G_HEAD=g_head, BLOCK_T=tile_t, BLOCK_K=block_k, num_warps=warps,
            )  # fmt: skip
        ctx.save_for_backward(k, g, q_noise, r, p_prior, p, predictive)
        ctx.scale, ctx.tuning = scale, tuning
        # An output the loss does not reach comes back as None, not as zeros: p in training (the
        # layers keep only its last step, as their state's precision).
        ctx.set_materialize_grads(False)
        # k and g handed back as they came (autograd makes them views of themselves): the delta
        # rule the gain feeds takes them from here, so their gradients from it come to backward
        # below with the gain's, which the kernel adds before its one write of dk and dg (as
        # _KDNIsoTerms does, whose docstring has the reason).
        return gain, p, predictive, k, g

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_gain, d_p, d_pred, dk_in, dg_in):
        k, g, q_noise, r, p_prior, p, predictive = ctx.saved_tensors
        batch, length, heads, key_dim = k.shape
        bh = batch * heads
        tuning = ctx.tuning
        (tile_t, adj_t), block_k, (warps, adj_warps), chunk_t, parts = _plan(
            bh, length, key_dim, ("backward", "chunk_adjoints"), tuning.block_t, tuning.chunk,
            tuning.launches,
        )  # fmt: skip
        g_head = g.dim() == 3
        d_gain = torch.zeros_like(k) if d_gain is None else d_gain.contiguous()
        d_pred = p.new_zeros(r.shape) if d_pred is None else d_pred.contiguous()
        grads = [torch.empty_like(x) for x in (k, g, q_noise, r, p_prior)]
        # Without dp, HAS_DP=False never reads DP: dgain stands in for the pointer.
        has_dp = d_p is not None
        d_p = d_p.contiguous() if has_dp else d_gain
        if not k.numel():
            return (*grads, None, None, None)
        # pi after each chunk's last step, [B H, chunks, K] (0 after the last chunk).
        if parts > 1:
            maps = p.new_empty(bh, parts, 2, key_dim)
            _kdn_diag_gain_token_adjoints_kernel[(bh, parts)](
                k, g, q_noise, r, p_prior, p, predictive, d_gain, d_p, d_pred, maps, length, heads,
                key_dim, ctx.scale, chunk_t, G_HEAD=g_head, HAS_DP=has_dp, BLOCK_T=adj_t,
                BLOCK_K=block_k, num_warps=adj_warps,
            )  # fmt: skip
            ends = carry_ends(maps, tuning.carry_block)
        else:
            ends = p.new_zeros(bh, 1, key_dim)
        # An absent routed gradient is never read (its flag is off); k and g stand in for it.
        _kdn_diag_gain_token_backward_kernel[(bh, parts)](
            k, g, q_noise, r, p_prior, p, predictive, d_gain, d_p, d_pred, ends,
            k if dk_in is None else dk_in.contiguous(), g if dg_in is None else dg_in.contiguous(),
            *grads, length, heads, key_dim, ctx.scale, chunk_t, G_HEAD=g_head, HAS_DP=has_dp,
            HAS_DK_IN=dk_in is not None, HAS_DG_IN=dg_in is not None, BLOCK_T=tile_t,
            BLOCK_K=block_k, num_warps=warps,
        )  # fmt: skip
        return (*grads, None, None, None)


@opaque_to_compiler
def kdn_diag_gain(
    k: torch.Tensor,
    g: torch.Tensor,
    q_noise: torch.Tensor,
    r: torch.Tensor,
    p_prior: torch.Tensor,
    info_scale: float,
    gain_dtype: torch.dtype = torch.float32,
    *,
    block_t: int | None = None,
    chunk: int | None = None,
    carry_block: tuple[int, int] | None = None,
    launches: Mapping[str, tuple[int, int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gain `[B, T, H, K]` in `gain_dtype`, p `[B, T, H, K]` and predictive `[B, T, H]` in
    float32, then k and g routed through the gain's node for the delta rule: see `Gains.k`) of
    Diagonal KDN, as `gains.diag_gain`: k, q_noise `[B, T, H, K]`, g `[B, T, H(, K)]`, r
    `[B, T, H]`, validated, each in its own float dtype (bf16, fp16 or fp32: the kernels read
    them into float32 and write their gradients back in it, so 16-bit inputs need no float32
    copies), p_prior `[B, H, K]` float32.

    The launch plan's overrides, for tests and benchmarks: `block_t` (a power of 2) the tokens
    every kernel unrolls, `chunk` (a power of 2 >= 2; default `chunk_tokens`) the tokens per
    program, one chunk (no carries) when it covers T, `carry_block` the carry passes' (chunks,
    channels) block, `launches` TOKEN_LAUNCH's entries."""
    if chunk is not None and (chunk < 2 or chunk & (chunk - 1)):
        raise ValueError(f"chunk must be a power of 2 >= 2, got {chunk}")
    inputs = [x.contiguous() for x in (k, g, q_noise, r, p_prior)]
    tuning = _Tuning(block_t, chunk, carry_block, launches)
    return _KDNDiagGain.apply(*inputs, float(info_scale), gain_dtype, tuning)
