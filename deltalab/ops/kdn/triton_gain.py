"""KDN's gains in Triton around the variance scan: Diagonal KDN's whole gain, k, g, q_noise, r,
p_prior -> gain, p, predictive, one kernel each way (docs/MATH.md sec. 3; gains.py has the
formulas), and Isotropic KDN's terms (at the end of this file). Diagonal:

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
gradient (and a per-head g's) needs no atomics and no partial sums. One program per (sequence,
head) walking all of T is too few programs (32 at the 340M preset, B = 4, H = 8; measured on the
H200, the fused forward then took twice the separate ops' time), so T is split: the kernels run
on a grid of (B H, chunks), a chunk of T per program, each from its chunk's boundary value, which
two small passes give: the chunk's composed maps (one per channel), then a carry across the
chunks per head (the section "Split over T" below). Every gradient but dp_prior is per token
(dr, and a per-head dg, reduce over K only), so the split needs no partial sums; dp_prior comes
from the first chunk's program.

Two walks of a chunk (`GAIN_WALK`). "tokens" (the default): a program walks its chunk one token
at a time on one warp, every vector one token's K channels, so nothing crosses threads but the
sums over K and the recurrences are the definition's own float32 steps (the section "Token by
token" below). "tiles": a program walks its chunk in tiles of BLOCK_T tokens, scanning each tile
over its tokens with `tl.associative_scan`, as `_kdn_forward_kernel` (triton.py) walks its
lanes; the forward and backward below describe it.

Forward. The scan runs in p_bar: row t's map is step t - 1's update followed by step t's
prediction, p_bar_{t-1} -> p_bar_t = a_t / (c_{t-1} + 1 / p_bar_{t-1}) + q_t, the matrix

    [[a_t, q_t], [0, 1]] @ [[1, 0], [c_{t-1}, 1]] = [[a_t + q_t c_{t-1}, q_t], [c_{t-1}, 1]]

(row 0's c_{t-1} = 0: its carry is p_{t-1}, already updated), so the tile's inclusive scan applied
to the carried p gives p_bar_t itself, and only the shifted rows of k and r are read again
(mostly cache hits) where a scan over whole steps, which gives p_{t-1}, needs step t - 1's a and
q too. The entries are non-negative with det = a_t >= 0, as for whole steps: normalized by
their sum (mobius/triton.py: entries in [0, 1], no overflow whatever the evidence), the same
error bounds hold. p_t = 1 / (c + 1 / p_bar) has no cancellation and is right at both ends
(p_bar = 0 gives 0; c = 0 gives p_bar). The predictive sums non-negative terms; the gain divides
by predictive + r >= r > 0, so r = 1e30 (no evidence) gives gain ~ 0 and c ~ 0, and g = -inf
gives a = 0 (a reset: p_bar = q) without NaN. The chunk maps (the split below) compose whole
steps [[a, q], [c a, c q + 1]] (update after prediction), whose product over a chunk maps p
before it to p at its last step, the carry.

Backward. The gain's adjoint at token t (den = predictive + r):

    dden = -sum_K(dgain gain) / den          (not dgain w / den^2: den^2 overflows at r = 1e30)
    dpred = dpredictive + dden,   dw = dgain / den + dpred k
    dp_bar (direct) = dw k,   dk = dw p_bar + dpred w,   dr = dden

Then the scan's adjoint in pi_t = dL/dp_bar_t and nu_t = dL/dp_t (totals), s_t = dp_t / dp_bar_t
= 1 / (c_t p_bar_t + 1)^2:

    pi_t = [dp_bar_t + s_t dp_t] + s_t a_{t+1} pi_{t+1},    nu_t = dp_t + a_{t+1} pi_{t+1}

triton.py scans nu, whose step needs dp_bar_{t+1}: here that would be the gain's adjoint (two sums
over K) of the next row too. Scanned in pi, a row needs only its own terms and a_{t+1} (one shifted
load of g); nu_t is the same affine map's second output, so the scan's elements are the maps
(pi, nu) <- (e + x pi', f + y pi') of pi' = pi_{t+1}, composed by `_pi_nu_then`. x = s a <= 1 and
y = a <= 1: as in triton.py, a positive combination whose products only shrink (their underflow
to 0 is the true limit), no cancellation of its own. From pi and nu:

    da_t = pi_t p_{t-1},   dq_t = pi_t,   dc_t = -nu_t p_t^2,   dp_prior = a_1 pi_1,
    dg = 2 a da,   dk += (dc / r) 2 s k,   dr += -dc c / r = (nu p_t)(p_t c) / r

ordered so nothing overflows where the result does not: p_t c = c / (c + 1 / p_bar) is in
[0, 1], and dc / r <= nu r / (s k^2)^2 (p_t <= 1 / c) before it meets 2 s k, which overflows
alone at tiny r (the PyTorch path divides by r^2, which overflows first at r = 1e30).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltalab.ops._triton import opaque_to_compiler
from deltalab.ops.kdn.triton import kdn_iso_scan
from deltalab.ops.mobius.triton import _compose, _normalize, _then_affine

# (elements of a tile, most tokens in it, warps) per kernel: a tile is BLOCK_T tokens x BLOCK_K
# channels. Small tiles on few warps: each thread then holds a column of the tile's tokens for
# its channels, and the scan over them runs in registers, where larger tiles spread the tokens
# over warps and cross them through shared memory and barriers. Measured on the H200 (B=4
# T=4096 H=16 K=128, bf16 inputs, split over T; `h200_suite.sh gain_launch`, 2026-12-03, one
# kernel's launch at a time, the others at the defaults of the sweep; ms forward / forward and
# backward). First sweep, from 16 tokens on 8 warps everywhere (1.67 / 3.03): the chunk maps at
# 8 on 2 1.00 / 2.35 (8 on 8: 2.13 / 3.52), the forward at 8 on 4 1.46 / 2.82, the backward's
# two kernels within 0.3 ms of each other. Second sweep, from the first's (0.86 / 2.17; two
# runs of one launch differ by up to ~0.15 ms): the backward at 4 on 2 1.82 (4 on 1, 8 on 1:
# 1.80-1.81; 16 on 1: 3.52), the chunk maps at 8 on 1 0.73 forward (spills at K = 256, so 8 on
# 2 stays), the rest within the spread. Every launch here compiles for sm_90 without spills at
# K = 64..256, with dp too (tests/test_triton_compile.py): 8 on 4 and 16 on 4 for the backward
# spill 8-16 bytes with dp.
LAUNCH = {
    "chunk_maps": (1024, 8, 2),
    "forward": (1024, 8, 4),
    "chunk_adjoints": (1024, 8, 4),
    "backward": (512, 4, 2),
}


@triton.jit
def _pi_nu_then(x1, y1, e1, f1, x2, y2, e2, f2):
    """The adjoint step 2 after step 1 (associative): (pi, nu) <- (e + x pi', f + y pi')."""
    return x2 * x1, y2 * x1, e2 + x2 * e1, f2 + y2 * e1


@triton.jit
def _terms(K_, G, NOISE, R, at, head_at, ok, row_ok, scale, G_HEAD: tl.constexpr):
    """a = exp(2 g), q, c = s k^2 / r and k at the [BLOCK_T, BLOCK_K] offsets `at`, and r
    [BLOCK_T] (with a per-head g) at `head_at`; masked elements are the identity map (a = 1,
    q = c = 0) with k = 0 and r = 1."""
    k = tl.load(K_ + at, mask=ok, other=0.0).to(tl.float32)
    q = tl.load(NOISE + at, mask=ok, other=0.0).to(tl.float32)
    r = tl.load(R + head_at, mask=row_ok, other=1.0).to(tl.float32)
    if G_HEAD:
        g = tl.broadcast_to(
            tl.load(G + head_at, mask=row_ok, other=0.0).to(tl.float32)[:, None], k.shape
        )
    else:
        g = tl.load(G + at, mask=ok, other=0.0).to(tl.float32)
    return tl.exp(2.0 * g), q, scale * k * k / r[:, None], k, r


@triton.jit
def _apply_map(a, b, c, d, p):
    """The normalized map (a, b, c, d) applied to p >= 0 as (p / s, 1 / s), s = max(p, 1), so a
    huge p cannot overflow it."""
    size = tl.maximum(p, 1.0)
    v0 = p / size
    v1 = 1.0 / size
    return (a * v0 + b * v1) / (c * v0 + d * v1)


@triton.jit
def _chunk_program(T, H, KD, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """Where a program of the gain's (B H, chunks) grid works: (pid, part, the channels and
    their mask, the rows of a tile, the offset of its head's first token in the [B, T, H, K]
    tensors and in the per-head [B, T, H] ones)."""
    pid = tl.program_id(0)
    part = tl.program_id(1)
    ch = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, BLOCK_T)
    base = (pid // H).to(tl.int64) * T * (H * KD) + (pid % H) * KD
    head_base = (pid // H).to(tl.int64) * T * H + pid % H
    return pid, part, ch, ch < KD, rows, base, head_base


@triton.jit
def _kdn_diag_gain_forward_kernel(
    K_,
    G,
    NOISE,
    R,
    P_START,
    GAIN,
    P,
    PRED,
    T,
    H,
    KD,
    scale,
    CHUNK,
    G_HEAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Program (pid, part): head pid % H of sequence pid // H, tokens [part CHUNK, (part + 1)
    # CHUNK) in tiles of BLOCK_T, from p at the chunk's start, P_START[pid, part] (p_prior
    # itself with one chunk, CHUNK >= T: the one-program kernel).
    pid, part, ch, ch_ok, rows, base, head_base = _chunk_program(T, H, KD, BLOCK_T, BLOCK_K)
    stride = H * KD  # one token
    start_at = (pid.to(tl.int64) * tl.num_programs(1) + part) * KD
    p = tl.load(P_START + start_at + ch, mask=ch_ok, other=1.0)
    for start in range(0, CHUNK, BLOCK_T):
        t = part * CHUNK + start + rows
        row_ok = t < T
        ok = row_ok[:, None] & ch_ok[None, :]
        at = base + t.to(tl.int64)[:, None] * stride + ch[None, :]
        head_at = head_base + t.to(tl.int64) * H
        a, q, c, k, r = _terms(K_, G, NOISE, R, at, head_at, ok, row_ok, scale, G_HEAD)
        # Step t - 1's evidence on row t (0 on row 0, whose carry p_{t-1} is updated already).
        before = row_ok & (rows > 0)
        k_before = tl.load(K_ + at - stride, mask=before[:, None] & ch_ok[None, :], other=0.0)
        r_before = tl.load(R + head_at - H, mask=before, other=1.0).to(tl.float32)
        k_before = k_before.to(tl.float32)
        c_before = scale * k_before * k_before / r_before[:, None]
        # Row t's map p_bar_{t-1} -> p_bar_t, scanned: p_bar at every row from the carry.
        ma, mb, mc, md = _normalize(a + q * c_before, q, c_before, 1.0 + 0.0 * c_before)
        ma, mb, mc, md = tl.associative_scan((ma, mb, mc, md), 0, _compose)
        p_bar = _apply_map(ma, mb, mc, md, p[None, :])
        p_t = 1.0 / (c + 1.0 / p_bar)
        weighted = p_bar * k
        predictive = tl.sum(weighted * k, axis=1)
        tl.store(
            GAIN + at, (weighted / (predictive + r)[:, None]).to(GAIN.dtype.element_ty), mask=ok
        )
        tl.store(P + at, p_t, mask=ok)
        tl.store(PRED + head_at, predictive, mask=row_ok)
        p = tl.sum(tl.where(rows[:, None] == BLOCK_T - 1, p_t, 0.0), axis=0)


@triton.jit
def _adjoint_rows(
    K_, G, NOISE, R, P, PRED, DGAIN, DP, DPRED, p0, t, ch, ch_ok, base, head_base, T, H, KD,
    scale, G_HEAD: tl.constexpr, HAS_DP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The backward's per-row terms at tokens t `[BLOCK_T]`: the gain's adjoint (from the
    recomputed p_bar, w and den) and the scan's adjoint maps (pi, nu) <- (e + x pi', f + y pi')
    of pi' = pi_{t+1}; the rows past T are zero maps (x = y = e = f = 0)."""
    stride = H * KD
    row_ok = t < T
    ok = row_ok[:, None] & ch_ok[None, :]
    at = base + t.to(tl.int64)[:, None] * stride + ch[None, :]
    head_at = head_base + t.to(tl.int64) * H
    has_prev = ok & (t > 0)[:, None]
    p_prev = tl.load(P + at - stride, mask=has_prev, other=0.0)
    p_prev = tl.where(has_prev, p_prev, p0[None, :])
    a, q, c, k, r = _terms(K_, G, NOISE, R, at, head_at, ok, row_ok, scale, G_HEAD)
    # a_{t+1} (0 past the end: no step follows, no multiplier).
    after = (t + 1 < T)[:, None] & ch_ok[None, :]
    if G_HEAD:
        g_next = tl.load(G + head_at + H, mask=t + 1 < T, other=0.0).to(tl.float32)
        g_next = tl.broadcast_to(g_next[:, None], k.shape)
    else:
        g_next = tl.load(G + at + stride, mask=after, other=0.0).to(tl.float32)
    a_next = tl.where(after, tl.exp(2.0 * g_next), 0.0)
    # The gain's adjoint, from the recomputed p_bar, w and den.
    p_bar = a * p_prev + q
    weighted = p_bar * k
    # The forward's predictive, kept: no sum over K here.
    den = tl.load(PRED + head_at, mask=row_ok, other=0.0) + r
    d_gain = tl.load(DGAIN + at, mask=ok, other=0.0).to(tl.float32)
    d_den = -tl.sum(d_gain * (weighted / den[:, None]), axis=1) / den
    d_pred = (tl.load(DPRED + head_at, mask=row_ok, other=0.0) + d_den)[:, None]
    d_weighted = d_gain / den[:, None] + d_pred * k
    d_k = d_weighted * p_bar + d_pred * weighted
    # The scan's adjoint: the maps (pi, nu) <- (e + x pi', f + y pi'), pi' = pi_{t+1}.
    shrink = 1.0 / (c * p_bar + 1.0)
    slope = shrink * shrink
    if HAS_DP:
        d_p = tl.load(DP + at, mask=ok, other=0.0).to(tl.float32)
    else:
        d_p = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    x, e = slope * a_next, d_weighted * k + slope * d_p
    return ok, row_ok, at, head_at, a, c, k, r, p_prev, p_bar, d_den, d_k, x, a_next, e, d_p


@triton.jit
def _kdn_diag_gain_backward_kernel(
    K_,
    G,
    NOISE,
    R,
    P0,
    P,
    PRED,
    DGAIN,
    DP,
    DPRED,
    PI_END,
    DK_IN,
    DG_IN,
    DK,
    DG,
    DNOISE,
    DR,
    DP0,
    T,
    H,
    KD,
    scale,
    CHUNK,
    G_HEAD: tl.constexpr,
    HAS_DP: tl.constexpr,
    HAS_DK_IN: tl.constexpr,
    HAS_DG_IN: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Program (pid, part): tokens [part CHUNK, (part + 1) CHUNK) of head pid, from pi at the
    # first step after the chunk, PI_END[pid, part] (zeros with one chunk, CHUNK >= T). DK_IN,
    # DG_IN: the delta rule's gradients of k and g routed through this node, added before the
    # one write of dk and dg (see _KDNDiagGain).
    pid, part, ch, ch_ok, rows, base, head_base = _chunk_program(T, H, KD, BLOCK_T, BLOCK_K)
    p0 = tl.load(P0 + pid * KD + ch, mask=ch_ok, other=0.0)
    end_at = (pid.to(tl.int64) * tl.num_programs(1) + part) * KD
    pi_after = tl.load(PI_END + end_at + ch, mask=ch_ok, other=0.0)
    for i in range(0, CHUNK, BLOCK_T):
        # Tiles from the chunk's last to its first; row 0 is the tile's last step.
        t = part * CHUNK + (CHUNK - BLOCK_T - i) + (BLOCK_T - 1) - rows
        ok, row_ok, at, head_at, a, c, k, r, p_prev, p_bar, d_den, d_k, x, y, e, f = (
            _adjoint_rows(
                K_, G, NOISE, R, P, PRED, DGAIN, DP, DPRED, p0, t, ch, ch_ok, base, head_base, T,
                H, KD, scale, G_HEAD, HAS_DP, BLOCK_T, BLOCK_K,
            )
        )  # fmt: skip
        x, y, e, f = tl.associative_scan((x, y, e, f), 0, _pi_nu_then)
        pi = e + x * pi_after[None, :]
        nu = f + y * pi_after[None, :]
        p_t = 1.0 / (c + 1.0 / p_bar)
        nu_p = nu * p_t
        d_c = -nu_p * p_t
        d_g = 2.0 * a * (pi * p_prev)
        d_k += (d_c / r[:, None]) * (2.0 * scale * k)
        if HAS_DK_IN:
            d_k += tl.load(DK_IN + at, mask=ok, other=0.0).to(tl.float32)
        tl.store(DK + at, d_k.to(DK.dtype.element_ty), mask=ok)
        tl.store(DNOISE + at, pi.to(DNOISE.dtype.element_ty), mask=ok)
        if G_HEAD:
            d_g_head = tl.sum(tl.where(ok, d_g, 0.0), axis=1)
            if HAS_DG_IN:
                d_g_head += tl.load(DG_IN + head_at, mask=row_ok, other=0.0).to(tl.float32)
            tl.store(DG + head_at, d_g_head.to(DG.dtype.element_ty), mask=row_ok)
        else:
            if HAS_DG_IN:
                d_g += tl.load(DG_IN + at, mask=ok, other=0.0).to(tl.float32)
            tl.store(DG + at, d_g.to(DG.dtype.element_ty), mask=ok)
        d_r = d_den + tl.sum(tl.where(ok, nu_p * (p_t * c), 0.0), axis=1) / r
        tl.store(DR + head_at, d_r.to(DR.dtype.element_ty), mask=row_ok)
        pi_after = tl.sum(tl.where(rows[:, None] == BLOCK_T - 1, pi, 0.0), axis=0)
    # In the first chunk pi_after is pi_1 (the first step) now: dp_prior = a_1 pi_1.
    if G_HEAD:
        g0 = tl.load(G + head_base + 0 * ch, mask=ch_ok, other=0.0).to(tl.float32)
    else:
        g0 = tl.load(G + base + ch, mask=ch_ok, other=0.0).to(tl.float32)
    first = ch_ok & (part + 0 * ch == 0)  # a vector mask (the interpreter refuses a scalar's)
    tl.store(
        DP0 + pid * KD + ch, (tl.exp(2.0 * g0) * pi_after).to(DP0.dtype.element_ty), mask=first
    )


# --- Split over T: the chunks' composed maps and the carries across chunks ---------------------
#
# With the kernels above on a grid of (B H, chunks), each chunk of CHUNK tokens (a multiple of
# BLOCK_T) needs the scan's value at its boundary: p at its first step forward, pi after its
# last step backward. Two small passes give them. (1) A program per (head, chunk) composes its
# chunk's maps per channel, tile by tile (the tile's prefix scan, as the kernels above run it,
# then the running product times its last row), and writes the composed map: forward the
# normalized Mobius matrix (A, B, C, D) `[B H, chunks, 4, K]`, backward the pi part (X, E)
# `[B H, chunks, 2, K]` of the adjoint's affine maps (nu does not cross tiles or chunks). (2) A
# program per head and block of BLOCK_C channels scans those maps in order (forward) or in
# reverse (backward), BLOCK_P chunks at a time: `tl.associative_scan` over a block of maps each
# shifted by one chunk (a row holds its predecessor's map forward, its successor's backward;
# the identity on the block's first row), applied to the scalar carried in, gives every chunk's
# boundary value (an exclusive scan); the block's last chunk's own map carries it into the next
# block. The arithmetic of a tile above, on maps instead of steps. (A walk of one chunk per step
# waits on a dependent load per chunk, ~1 us: 0.13 ms at 128 chunks, a cost that grows as the
# chunks shrink; scanned, T / (chunk BLOCK_P) steps on B H K / BLOCK_C programs.) Then the
# kernels above rescan each chunk from its carry, as one program per head would have.
#
# Precision across chunks. Forward, the composed map is a product of the chunk's normalized
# non-negative matrices, renormalized after every product (mobius/triton.py's `_compose`): its
# entries stay in [0, 1] and sum to 1 whatever the evidence, and with nothing to cancel each
# entry keeps a relative error of ~4 eps per product on its path (log2 BLOCK_T within a tile,
# then one per tile of the chunk). It is applied to the carried p as (p / s, 1 / s),
# s = max(p, 1), as inside the kernels, so no p overflows it; and since the map's
# |d log f / d log p| <= 1 (det = prod a >= 0), a relative error of the carry is passed on
# unchanged at worst (shrunk by decay and evidence): the carries' errors add over the chunks,
# as the tiles' errors do in the one-program kernel. A reset (g = -inf, a = 0) makes A = C = 0:
# the composed map is then constant (B / D), as the carry ignores p, exactly. Backward, X is a
# product of x = s a <= 1 (only shrinks; its underflow to 0 is the true limit) and E a
# positive combination of the rows' e (their own signs, as in the float64 reference): no
# cancellation beyond the reference's, no overflow, the same arithmetic as inside a tile.


@triton.jit
def _kdn_diag_gain_chunk_maps_kernel(
    K_,
    G,
    NOISE,
    R,
    MAPS,
    T,
    H,
    KD,
    scale,
    CHUNK,
    G_HEAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """MAPS[pid, part] = the normalized product of the maps of chunk `part`'s steps."""
    pid, part, ch, ch_ok, rows, base, head_base = _chunk_program(T, H, KD, BLOCK_T, BLOCK_K)
    stride = H * KD  # one token
    last = rows[:, None] == BLOCK_T - 1
    # The identity; steps past T load the identity too (a = 1, q = c = 0).
    ma = tl.full([BLOCK_K], 1.0, tl.float32)
    mb = tl.zeros([BLOCK_K], dtype=tl.float32)
    mc = tl.zeros([BLOCK_K], dtype=tl.float32)
    md = tl.full([BLOCK_K], 1.0, tl.float32)
    for start in range(0, CHUNK, BLOCK_T):
        t = part * CHUNK + start + rows
        row_ok = t < T
        ok = row_ok[:, None] & ch_ok[None, :]
        at = base + t.to(tl.int64)[:, None] * stride + ch[None, :]
        head_at = head_base + t.to(tl.int64) * H
        a, q, c, _, _ = _terms(K_, G, NOISE, R, at, head_at, ok, row_ok, scale, G_HEAD)
        ta, tb, tc, td = _normalize(a, q, c * a, c * q + 1.0)
        ta, tb, tc, td = tl.associative_scan((ta, tb, tc, td), 0, _compose)
        ma, mb, mc, md = _compose(
            ma, mb, mc, md,
            tl.sum(tl.where(last, ta, 0.0), axis=0), tl.sum(tl.where(last, tb, 0.0), axis=0),
            tl.sum(tl.where(last, tc, 0.0), axis=0), tl.sum(tl.where(last, td, 0.0), axis=0),
        )  # fmt: skip
    at = (pid.to(tl.int64) * tl.num_programs(1) + part) * 4 * KD + ch
    tl.store(MAPS + at, ma, mask=ch_ok)
    tl.store(MAPS + at + KD, mb, mask=ch_ok)
    tl.store(MAPS + at + 2 * KD, mc, mask=ch_ok)
    tl.store(MAPS + at + 3 * KD, md, mask=ch_ok)


@triton.jit
def _carry_program(KD, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """(head pid, its channels and their mask, the rows of a block) of a carry pass's program."""
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    return tl.program_id(0), ch, ch < KD, tl.arange(0, BLOCK_P)


@triton.jit
def _kdn_diag_gain_chunk_starts_kernel(
    MAPS, P0, P_START, PARTS, KD, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr
):  # fmt: skip
    """P_START[pid, part] = p before chunk `part`: p_prior, then each chunk's map applied."""
    pid, ch, ch_ok, rows = _carry_program(KD, BLOCK_P, BLOCK_C)
    first = pid.to(tl.int64) * PARTS  # the head's first chunk
    p = tl.load(P0 + pid * KD + ch, mask=ch_ok, other=1.0)
    for start in range(0, PARTS, BLOCK_P):
        part = start + rows
        # Row i holds the map of chunk part - 1 (the identity on the block's row 0).
        before = ((part < PARTS) & (rows > 0))[:, None] & ch_ok[None, :]
        at = (first + part - 1)[:, None] * 4 * KD + ch[None, :]
        ma = tl.load(MAPS + at, mask=before, other=1.0)
        mb = tl.load(MAPS + at + KD, mask=before, other=0.0)
        mc = tl.load(MAPS + at + 2 * KD, mask=before, other=0.0)
        md = tl.load(MAPS + at + 3 * KD, mask=before, other=1.0)
        ma, mb, mc, md = tl.associative_scan((ma, mb, mc, md), 0, _compose)
        p_start = _apply_map(ma, mb, mc, md, p[None, :])
        ok = (part < PARTS)[:, None] & ch_ok[None, :]
        tl.store(P_START + (first + part)[:, None] * KD + ch[None, :], p_start, mask=ok)
        # Into the next block (if any): the block's last chunk after its start.
        end = start + BLOCK_P - 1
        at = (first + end) * 4 * KD + ch
        ok = ch_ok & (end + 0 * ch < PARTS)  # a vector mask (the interpreter refuses a scalar's)
        p_end = tl.sum(tl.where(rows[:, None] == BLOCK_P - 1, p_start, 0.0), axis=0)
        p = _apply_map(
            tl.load(MAPS + at, mask=ok, other=1.0), tl.load(MAPS + at + KD, mask=ok, other=0.0),
            tl.load(MAPS + at + 2 * KD, mask=ok, other=0.0),
            tl.load(MAPS + at + 3 * KD, mask=ok, other=1.0), p_end,
        )  # fmt: skip


@triton.jit
def _kdn_diag_gain_chunk_adjoints_kernel(
    K_,
    G,
    NOISE,
    R,
    P0,
    P,
    PRED,
    DGAIN,
    DP,
    DPRED,
    MAPS,
    T,
    H,
    KD,
    scale,
    CHUNK,
    G_HEAD: tl.constexpr,
    HAS_DP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """MAPS[pid, part] = (X, E): pi at chunk `part`'s first step is E + X pi', pi' = pi after
    its last step."""
    pid, part, ch, ch_ok, rows, base, head_base = _chunk_program(T, H, KD, BLOCK_T, BLOCK_K)
    p0 = tl.load(P0 + pid * KD + ch, mask=ch_ok, other=0.0)
    last = rows[:, None] == BLOCK_T - 1
    slope = tl.full([BLOCK_K], 1.0, tl.float32)  # the identity pi -> 0 + 1 pi
    total = tl.zeros([BLOCK_K], dtype=tl.float32)
    for i in range(0, CHUNK, BLOCK_T):
        t = part * CHUNK + (CHUNK - BLOCK_T - i) + (BLOCK_T - 1) - rows
        _, _, _, _, _, _, _, _, _, _, _, _, x, _, e, _ = _adjoint_rows(
            K_, G, NOISE, R, P, PRED, DGAIN, DP, DPRED, p0, t, ch, ch_ok, base, head_base, T, H, KD,
            scale, G_HEAD, HAS_DP, BLOCK_T, BLOCK_K,
        )  # fmt: skip
        x, e = tl.associative_scan((x, e), 0, _then_affine)
        # This tile (earlier in time) after the running map of the later tiles.
        slope, total = _then_affine(
            slope, total, tl.sum(tl.where(last, x, 0.0), axis=0),
            tl.sum(tl.where(last, e, 0.0), axis=0),
        )  # fmt: skip
    at = (pid.to(tl.int64) * tl.num_programs(1) + part) * 2 * KD + ch
    tl.store(MAPS + at, slope, mask=ch_ok)
    tl.store(MAPS + at + KD, total, mask=ch_ok)


@triton.jit
def _kdn_diag_gain_chunk_ends_kernel(
    MAPS, PI_END, PARTS, KD, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr
):  # fmt: skip
    """PI_END[pid, part] = pi after chunk `part`: 0 after the last, then back chunk by chunk."""
    pid, ch, ch_ok, rows = _carry_program(KD, BLOCK_P, BLOCK_C)
    first = pid.to(tl.int64) * PARTS
    pi = tl.zeros([BLOCK_C], dtype=tl.float32)
    for i in range(0, PARTS, BLOCK_P):
        part = PARTS - 1 - i - rows  # row 0: the block's last chunk in time
        # Row r holds the map of chunk part + 1 (the identity on row 0).
        after = ((part >= 0) & (rows > 0))[:, None] & ch_ok[None, :]
        at = (first + part + 1)[:, None] * 2 * KD + ch[None, :]
        slope = tl.load(MAPS + at, mask=after, other=1.0)
        total = tl.load(MAPS + at + KD, mask=after, other=0.0)
        slope, total = tl.associative_scan((slope, total), 0, _then_affine)
        pi_end = total + slope * pi[None, :]
        ok = (part >= 0)[:, None] & ch_ok[None, :]
        tl.store(PI_END + (first + part)[:, None] * KD + ch[None, :], pi_end, mask=ok)
        # Into the next block (if any): pi before the block's first chunk in time.
        end = PARTS - i - BLOCK_P
        at = (first + end) * 2 * KD + ch
        ok = ch_ok & (end + 0 * ch >= 0)  # a vector mask (the interpreter refuses a scalar's)
        pi_first = tl.sum(tl.where(rows[:, None] == BLOCK_P - 1, pi_end, 0.0), axis=0)
        pi = (
            tl.load(MAPS + at + KD, mask=ok, other=0.0)
            + tl.load(MAPS + at, mask=ok, other=1.0) * pi_first
        )


# --- Token by token: the same gain with the tiles' scans replaced by a walk over the tokens ----
#
# Measured with Nsight Compute on the H200 (`h200_suite.sh ncu_gain`, 2026-12-03, B=4 T=4096
# H=16 K=128 bf16), the tile kernels above are held back by their scans across threads, not by
# memory: the chunk maps' L1 throughput at 81% (the adjoints' at 92%: the scans' and layout
# conversions' shared-memory traffic) against 16-22% of DRAM's, 25% occupancy (128 registers),
# 30-56% of the issue slots busy. Here a program walks its chunk one token at a time: every
# vector is one token's K channels spread over the program's warps, nothing crosses threads
# but the sums over K (a warp's shuffles at K = 128 on one warp), and the recurrence is the
# definition's own float32 step (forward p_bar = a p + q, p = 1 / (c + 1 / p_bar); backward
# pi = e + x pi', nu = f + y pi'), exact without a Mobius normalization; only the chunk maps still
# compose (and normalize) whole steps, now one at a time. BLOCK_T tokens are unrolled per
# step of the loop (their loads issued together); a chunk of 64 tokens is a short walk, and the
# split's thousands of programs hide its latency.


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
    one token at a time (as `_kdn_diag_gain_chunk_maps_kernel`)."""
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
    tl.store(MAPS + at, ma, mask=ch_ok)
    tl.store(MAPS + at + KD, mb, mask=ch_ok)
    tl.store(MAPS + at + 2 * KD, mc, mask=ch_ok)
    tl.store(MAPS + at + 3 * KD, md, mask=ch_ok)


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
    pi' = pi_{t+1}, given a_next = a_{t+1} (0 past the end), as `_adjoint_rows` for one token."""
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


# Which kernels run the diagonal gain: "tokens" (the token walks above) or "tiles" (the tile
# scans before them). Measured on the H200 (`h200_suite.sh gain_chunks`, 2026-12-03, bf16
# inputs, chunk 64, ms forward and backward of the gain alone, tokens / tiles): B=4 T=4096 H=16
# 1.21 / 1.78, H=8 (the 340M preset) 1.00 / 1.23, B=1 T=32768 H=16 1.62 / 3.16; the four token
# kernels take 0.64 ms of kernel time at the first shape, the tiles' 1.44.
GAIN_WALK = "tokens"
GAIN_WALKS = ("tokens", "tiles")
# (tokens unrolled per step at K <= 128, warps) of each token walk: one warp, so that a sum over
# K is a warp's shuffles; wider keys unroll fewer tokens (at K = 256 the chunk adjoints spill
# 80 bytes a thread at 4 tokens). The backward unrolls 2: measured on the H200 (`h200_suite.sh
# ncu_walks32k`, 2026-12-04, B=1 T=32768 H=16 K=128, bf16, the routed k and g's gradients
# added) at 4 it took 110 registers a thread, so 16 one-warp programs an SM (25% occupancy), and
# waited on its loads (58.6% of cycles with no warp eligible, 44% of DRAM's bandwidth);
# `walk_launch32k` (the gain alone, forward and backward, each kernel's launch in turn) 2.62 ms
# with the backward at 2 tokens, 2.64 at 1, 2.82 at 4 (the other kernels' rows 2.79-2.92 but
# the chunk adjoints at (8, 2), 3.13). Measured at K = 128 only: at K = 64 the two unrolls take
# about the same registers (70 / 72, sm_90 compile), and at K = 256 the backward now unrolls 1
# token where it unrolled 2 (192 / 199 registers, the same occupancy), untimed. Two walks a
# program instead (a `[2, BLOCK_K]` block on two warps) was slower (`2864f56`).
TOKEN_LAUNCH = {
    "chunk_maps": (4, 1),
    "forward": (4, 1),
    "chunk_adjoints": (4, 1),
    "backward": (2, 1),
}


def _kernels(walk: str) -> dict:
    """The diagonal gain's kernels of `walk` by role."""
    if walk == "tokens":
        return {
            "chunk_maps": _kdn_diag_gain_token_maps_kernel,
            "forward": _kdn_diag_gain_token_forward_kernel,
            "chunk_adjoints": _kdn_diag_gain_token_adjoints_kernel,
            "backward": _kdn_diag_gain_token_backward_kernel,
        }
    return {
        "chunk_maps": _kdn_diag_gain_chunk_maps_kernel,
        "forward": _kdn_diag_gain_forward_kernel,
        "chunk_adjoints": _kdn_diag_gain_chunk_adjoints_kernel,
        "backward": _kdn_diag_gain_backward_kernel,
    }


def launch(key_dim: int, length: int, kernel: str) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_K, warps) of `kernel` (a key of LAUNCH): every channel of a head, and as
    many tokens as fill its tile (the tiles: at least 2, at most its row limit and T rounded up
    to a power of 2), or (the token walks) TOKEN_LAUNCH's tokens times 128 / BLOCK_K at wider
    keys, at least 1 and at most T rounded up to a power of 2."""
    block_k = triton.next_power_of_2(key_dim)
    if GAIN_WALK == "tokens":
        tokens, warps = TOKEN_LAUNCH[kernel]
        tokens = max(1, tokens * 128 // max(block_k, 128))
        return max(1, min(tokens, triton.next_power_of_2(length))), block_k, warps
    tile, rows, warps = LAUNCH[kernel]
    block_t = max(2, min(tile // block_k, rows, triton.next_power_of_2(length)))
    return block_t, block_k, warps


# Splitting T. The split kernels re-read a chunk's inputs once more each way (for the chunk's
# composed map: forward k, g, q_noise, r; backward those, p, dgain, dp) and add two tiny passes,
# ~1.6x the one-program kernel's traffic forward (8 [B, T, H, K] tensors for its 5) and ~1.7x
# backward (15 for 9, with dp), for B H chunks programs instead of B H. Measured on the H200 before the split (bench_kdn_triton.py, float32, T=4096, K=128,
# forward / forward+backward ms): the one-program kernel at 32 (sequence, head) programs (the
# 340M preset) 2.15 / 3.97 against 1.04 / 2.84 for the separate ops around the Triton scan, at
# 64 programs 2.24 / 4.23 against 1.53 / 4.57, at 16 programs and T=32768 16.7 / 30.9 against
# 4.15 / 11.0; the memory floor at 340M is ~0.2 / ~0.6 ms. One program per head streams at one
# SM's bandwidth, so `kdn_diag_gain` splits T below SPLIT_GAIN_BELOW_PROGRAMS (two per SM of an
# H200's 132) and keeps one program per head from there, where the split's extra traffic would
# cost more than its parallelism gains. Not yet measured: bench_kdn_triton.py times both
# (`split=True` / `split=False`) beside the separate ops, to set this. In a whole training
# step the split fused gain beats the separate ops at 32 programs (gains.FUSED_GAIN_MIN_PROGRAMS).
SPLIT_GAIN_BELOW_PROGRAMS = 264
# The split's chunk (tokens per program): a power of 2 giving about SPLIT_GAIN_PROGRAMS programs,
# at least SPLIT_GAIN_MIN_CHUNK tokens and a tile: 64 tokens at every shape measured. Measured on
# the H200 (`h200_suite.sh gain_chunks`, 2026-12-03, bf16 inputs, scanned carries; ms forward
# and backward of the gain alone, chunks 16 / 32 / 64 / 128 / 256 / 512): B=4 T=4096 H=16 1.73 /
# 1.69 / 1.70 / 1.75 / 1.68 / 2.04, H=8 (the 340M preset) 1.04 / 1.01 / **0.94** / 0.99 /
# 1.09 / 1.64, B=1 T=32768 H=16 3.31 / 3.25 / **3.11** / 3.18 / 3.30 / 3.28: flat from 16 to
# 256 at 64 heads, 64 best where the heads are fewer (the earlier default, ~1024 programs,
# took 128 and 512 there). The token walks, in the same sweep a session later: 1.17 / 1.20 /
# 1.21 / 1.36 / 1.29 / 2.07, 1.05 / 0.85 / 1.00 / 1.03 / 1.40 / 2.00 and 1.74 / 1.87 / 1.62 /
# 1.57 / 1.73 / 2.33: 64 within the spread of 16 to 128 at every shape.
SPLIT_GAIN_PROGRAMS = 8192
SPLIT_GAIN_MIN_CHUNK = 64
# The carry passes: (chunks, channels) of a program's block and its warps (see "Split over T").
CARRY_BLOCK = (64, 16)
CARRY_WARPS = 4


def split_gain(batch_heads: int) -> bool:
    """Whether `kdn_diag_gain` splits T for B H (sequence, head) pairs by default: always for
    the token walk (a program walking all T tokens one by one is a serial chain of T steps)."""
    return GAIN_WALK == "tokens" or batch_heads < SPLIT_GAIN_BELOW_PROGRAMS


def chunk_tokens(batch_heads: int, length: int, block_t: int) -> int:
    """The split's default tokens per program (a power of 2 and a multiple of block_t)."""
    want = triton.next_power_of_2(triton.cdiv(batch_heads * length, SPLIT_GAIN_PROGRAMS))
    return max(want, SPLIT_GAIN_MIN_CHUNK, block_t)


def carry_block(parts: int) -> tuple[int, int]:
    """(BLOCK_P, BLOCK_C) of the carry passes over `parts` chunks."""
    block_p, block_c = CARRY_BLOCK
    return min(block_p, max(2, triton.next_power_of_2(parts))), block_c


def carry_grid(batch_heads: int, parts: int, key_dim: int) -> tuple[int, int]:
    """The carry passes' grid: (head, block of channels)."""
    return batch_heads, triton.cdiv(key_dim, carry_block(parts)[1])


def _plan(
    batch_heads: int,
    length: int,
    key_dim: int,
    kernels: tuple[str, str],
    block_t: int | None,
    split: bool,
    chunk: int | None,
) -> tuple[tuple[int, int], int, tuple[int, int], int, int]:
    """One direction's launches: ((BLOCK_T of each of `kernels`: the rescan, then the chunks'
    composed maps), BLOCK_K, (their warps), CHUNK, chunks). `block_t` overrides both tiles. One
    chunk of T (rounded up to the rescan's tile) without the split, or when T fits a chunk;
    split, the chunk is a multiple of both tiles (powers of 2, each at most the chunk)."""
    launches = [launch(key_dim, length, kernel) for kernel in kernels]
    tiles = [block_t or t for t, _, _ in launches]
    warps = (launches[0][2], launches[1][2])
    block_k = launches[0][1]
    if split:
        chunk = chunk or chunk_tokens(batch_heads, length, max(tiles))
        tiles = [min(t, chunk) for t in tiles]
        if chunk < length:
            return (tiles[0], tiles[1]), block_k, warps, chunk, triton.cdiv(length, chunk)
    whole = triton.cdiv(length, tiles[0]) * tiles[0]
    return (tiles[0], tiles[1]), block_k, warps, whole, 1


class _KDNDiagGain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k, g, q_noise, r, p_prior, scale, block_t, split, chunk, gain_dtype):
        # k, q_noise: contiguous [B, T, H, K]; g: [B, T, H, K] or [B, T, H]; r: [B, T, H], each
        # in its own float dtype (read into float32); p_prior: [B, H, K] float32; validated.
        batch, length, heads, key_dim = k.shape
        bh = batch * heads
        (tile_t, maps_t), block_k, (warps, maps_warps), chunk_t, parts = _plan(
            bh, length, key_dim, ("forward", "chunk_maps"), block_t, split, chunk
        )
        g_head = g.dim() == 3
        kernels = _kernels(GAIN_WALK)
        # Every element is written by the kernel: no fill pass.
        gain = torch.empty_like(k, dtype=gain_dtype)
        p = torch.empty_like(k, dtype=torch.float32)
        predictive = k.new_empty(batch, length, heads, dtype=torch.float32)
        starts = p_prior  # p at each chunk's start, [B H, chunks, K]
        if k.numel() and parts > 1:
            maps = p.new_empty(bh, parts, 4, key_dim)
            kernels["chunk_maps"][(bh, parts)](
                k, g, q_noise, r, maps, length, heads, key_dim, scale, chunk_t, G_HEAD=g_head,
                BLOCK_T=maps_t, BLOCK_K=block_k, num_warps=maps_warps,
            )  # fmt: skip
            starts = p.new_empty(bh, parts, key_dim)
            _kdn_diag_gain_chunk_starts_kernel[carry_grid(bh, parts, key_dim)](
                maps, p_prior, starts, parts, key_dim, *carry_block(parts), num_warps=CARRY_WARPS
            )
        if k.numel():
            kernels["forward"][(bh, parts)](
                k, g, q_noise, r, starts, gain, p, predictive, length, heads, key_dim, scale,
                chunk_t, G_HEAD=g_head, BLOCK_T=tile_t, BLOCK_K=block_k, num_warps=warps,
            )  # fmt: skip
        ctx.save_for_backward(k, g, q_noise, r, p_prior, p, predictive)
        ctx.scale, ctx.block_t, ctx.split, ctx.chunk = scale, block_t, split, chunk
        ctx.walk = GAIN_WALK
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
        (tile_t, adj_t), block_k, (warps, adj_warps), chunk_t, parts = _plan(
            bh, length, key_dim, ("backward", "chunk_adjoints"), ctx.block_t, ctx.split, ctx.chunk
        )
        g_head = g.dim() == 3
        kernels = _kernels(ctx.walk)
        d_gain = torch.zeros_like(k) if d_gain is None else d_gain.contiguous()
        d_pred = p.new_zeros(r.shape) if d_pred is None else d_pred.contiguous()
        grads = [torch.empty_like(x) for x in (k, g, q_noise, r, p_prior)]
        # Without dp, HAS_DP=False never reads DP: dgain stands in for the pointer.
        has_dp = d_p is not None
        d_p = d_p.contiguous() if has_dp else d_gain
        if not k.numel():
            return (*grads, None, None, None, None, None)
        # pi after each chunk's last step, [B H, chunks, K] (0 after the last chunk).
        if parts > 1:
            maps = p.new_empty(bh, parts, 2, key_dim)
            kernels["chunk_adjoints"][(bh, parts)](
                k, g, q_noise, r, p_prior, p, predictive, d_gain, d_p, d_pred, maps, length, heads,
                key_dim, ctx.scale, chunk_t, G_HEAD=g_head, HAS_DP=has_dp, BLOCK_T=adj_t,
                BLOCK_K=block_k, num_warps=adj_warps,
            )  # fmt: skip
            ends = p.new_empty(bh, parts, key_dim)
            _kdn_diag_gain_chunk_ends_kernel[carry_grid(bh, parts, key_dim)](
                maps, ends, parts, key_dim, *carry_block(parts), num_warps=CARRY_WARPS
            )
        else:
            ends = p.new_zeros(bh, 1, key_dim)
        # An absent routed gradient is never read (its flag is off); k and g stand in for it.
        kernels["backward"][(bh, parts)](
            k, g, q_noise, r, p_prior, p, predictive, d_gain, d_p, d_pred, ends,
            k if dk_in is None else dk_in.contiguous(), g if dg_in is None else dg_in.contiguous(),
            *grads, length, heads, key_dim, ctx.scale, chunk_t, G_HEAD=g_head, HAS_DP=has_dp,
            HAS_DK_IN=dk_in is not None, HAS_DG_IN=dg_in is not None, BLOCK_T=tile_t,
            BLOCK_K=block_k, num_warps=warps,
        )  # fmt: skip
        return (*grads, None, None, None, None, None)


@opaque_to_compiler
def kdn_diag_gain(
    k: torch.Tensor,
    g: torch.Tensor,
    q_noise: torch.Tensor,
    r: torch.Tensor,
    p_prior: torch.Tensor,
    info_scale: float,
    block_t: int | None = None,
    split: bool | None = None,
    chunk: int | None = None,
    gain_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gain `[B, T, H, K]` in `gain_dtype`, p `[B, T, H, K]` and predictive `[B, T, H]` in
    float32, then k and g routed through the gain's node for the delta rule: see `Gains.k`) of
    Diagonal KDN, as `gains.diag_gain`: k, q_noise `[B, T, H, K]`, g
    `[B, T, H(, K)]`, r `[B, T, H]`, validated, each in its own float dtype (bf16, fp16 or fp32:
    the kernels read them into float32 and write their gradients back in it, so 16-bit inputs
    need no float32 copies), p_prior `[B, H, K]` float32. `block_t` (a power of 2 >= 2) overrides the tokens per tile
    of both kernels (tests, tuning). `split`: T split into chunks of `chunk` tokens (a power of
    2 >= 2; default `chunk_tokens`), one program each, with the carry passes (True), or one
    program per (sequence, head) walking all T (False); None: `split_gain(B H)`."""
    if split is None:
        split = split_gain(k.shape[0] * k.shape[2])
    if chunk is not None and (chunk < 2 or chunk & (chunk - 1)):
        raise ValueError(f"chunk must be a power of 2 >= 2, got {chunk}")
    inputs = [x.contiguous() for x in (k, g, q_noise, r, p_prior)]
    return _KDNDiagGain.apply(*inputs, float(info_scale), block_t, bool(split), chunk, gain_dtype)


# --- Isotropic KDN: the pre-scan terms -------------------------------------------------------
#
# Isotropic KDN scans one variance per head (`[B, T, H]`, triton.py's kernel); its only
# `[B, T, H, K]` work is the terms' reductions over K, a = mean_K exp(2 g) and ||k||^2, and their
# gradients (a separate exp, product, mean and sum each way in PyTorch). One kernel each way
# reads k (and a per-channel g) and writes the two `[B, T, H]` terms, resp. dk and dg; the rest
# (the evidence, the scan, beta) is `[B, T, H]`, K times smaller, and stays as it is. The
# tokens are independent here, so a program takes a block of (token, head) rows with all their
# channels, over the whole GPU. a = mean exp(2 g) is in [0, 1] (g = -inf adds 0); every term is
# a sum of non-negative numbers, and the gradients are products (no cancellation).

# (rows, warps) of a program: BLOCK_R (token, head) rows x BLOCK_K channels of about 4096
# elements, 16 a thread.
ISO_TILE, ISO_WARPS = 4096, 8


@triton.jit
def _kdn_iso_terms_forward_kernel(
    K_,
    G,
    DECAY,
    NORM2,
    ROWS,
    KD,
    G_HEAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ch = tl.arange(0, BLOCK_K)
    row_ok = row < ROWS
    ok = row_ok[:, None] & (ch < KD)[None, :]
    at = row.to(tl.int64)[:, None] * KD + ch[None, :]
    k = tl.load(K_ + at, mask=ok, other=0.0).to(tl.float32)
    tl.store(NORM2 + row, tl.sum(k * k, axis=1), mask=row_ok)
    if G_HEAD:
        decay = tl.exp(2.0 * tl.load(G + row, mask=row_ok, other=0.0).to(tl.float32))
    else:
        g = tl.load(G + at, mask=ok, other=0.0).to(tl.float32)
        decay = tl.sum(tl.where(ok, tl.exp(2.0 * g), 0.0), axis=1) / KD
    tl.store(DECAY + row, decay, mask=row_ok)


@triton.jit
def _kdn_iso_terms_backward_kernel(
    K_,
    G,
    DDECAY,
    DNORM2,
    DK_IN,
    DG_IN,
    DK,
    DG,
    ROWS,
    KD,
    G_HEAD: tl.constexpr,
    HAS_DK_IN: tl.constexpr,
    HAS_DG_IN: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # DK_IN, DG_IN: the gradients of k and g from the delta rule that took them through this
    # node (see _KDNIsoTerms), added to the terms' own shares in float32 before the
    # one write in k's and g's dtypes (absent: the flags off, the pointers unread).
    row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ch = tl.arange(0, BLOCK_K)
    row_ok = row < ROWS
    ok = row_ok[:, None] & (ch < KD)[None, :]
    at = row.to(tl.int64)[:, None] * KD + ch[None, :]
    k = tl.load(K_ + at, mask=ok, other=0.0).to(tl.float32)
    d_norm2 = tl.load(DNORM2 + row, mask=row_ok, other=0.0)
    d_k = (2.0 * k) * d_norm2[:, None]
    if HAS_DK_IN:
        d_k += tl.load(DK_IN + at, mask=ok, other=0.0).to(tl.float32)
    tl.store(DK + at, d_k.to(DK.dtype.element_ty), mask=ok)
    d_decay = tl.load(DDECAY + row, mask=row_ok, other=0.0)
    if G_HEAD:
        g = tl.load(G + row, mask=row_ok, other=0.0).to(tl.float32)
        d_g = 2.0 * tl.exp(2.0 * g) * d_decay
        if HAS_DG_IN:
            d_g += tl.load(DG_IN + row, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(DG + row, d_g.to(DG.dtype.element_ty), mask=row_ok)
    else:
        g = tl.load(G + at, mask=ok, other=0.0).to(tl.float32)
        d_g = tl.exp(2.0 * g) * (2.0 * d_decay / KD)[:, None]
        if HAS_DG_IN:
            d_g += tl.load(DG_IN + at, mask=ok, other=0.0).to(tl.float32)
        tl.store(DG + at, d_g.to(DG.dtype.element_ty), mask=ok)


def iso_launch(key_dim: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_K, warps) of the isotropic terms' kernels."""
    block_k = triton.next_power_of_2(key_dim)
    return max(1, ISO_TILE // block_k), block_k, ISO_WARPS


class _KDNIsoTerms(torch.autograd.Function):
    """(a, ||k||^2, k, g): the terms, and k and g themselves routed through this node.

    The delta rule that the gain feeds takes k and g too, so each gets two gradients, which
    autograd would sum in a kernel of its own after both are written: for bf16 `[B, T, H, K]` k
    and g, two more reads and a write of each. Handed the node's k and g, the delta rule's
    gradients arrive here with the terms' own, and the backward kernel adds them in float32
    before its one write (on the H200 the separate sums took 0.10 ms of Isotropic KDN's 5.2 at
    B=4 T=4096 H=16, 0.19 ms at B=1 T=32768; docs/RESULTS.md, twenty-second session). Unused,
    the routed outputs cost nothing but two views.
    """

    @staticmethod
    def forward(ctx, k, g):
        # k: contiguous [B, T, H, K]; g: contiguous [B, T, H, K] or [B, T, H]; float32.
        key_dim = k.shape[-1]
        rows = k.numel() // key_dim
        decay, norm2 = (k.new_empty(k.shape[:-1], dtype=torch.float32) for _ in range(2))
        block_r, block_k, warps = iso_launch(key_dim)
        if rows:
            _kdn_iso_terms_forward_kernel[(triton.cdiv(rows, block_r),)](
                k, g, decay, norm2, rows, key_dim, G_HEAD=g.dim() < k.dim(),
                BLOCK_R=block_r, BLOCK_K=block_k, num_warps=warps,
            )  # fmt: skip
        ctx.save_for_backward(k, g)
        ctx.set_materialize_grads(False)
        # Returned as they came, autograd hands them back as views of k and g whose gradients
        # come to backward below.
        return decay, norm2, k, g

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_decay, d_norm2, dk_in, dg_in):
        k, g = ctx.saved_tensors
        key_dim = k.shape[-1]
        rows = k.numel() // key_dim
        # Either may be unused ([B, T, H]: a zero fill is K times smaller than the outputs).
        d_decay, d_norm2 = (
            k.new_zeros(k.shape[:-1], dtype=torch.float32) if d is None else d.contiguous()
            for d in (d_decay, d_norm2)
        )
        dk, dg = torch.empty_like(k), torch.empty_like(g)
        block_r, block_k, warps = iso_launch(key_dim)
        if rows:
            # An absent gradient is never read (its flag is off); k and g stand in for its
            # pointer.
            _kdn_iso_terms_backward_kernel[(triton.cdiv(rows, block_r),)](
                k, g, d_decay, d_norm2,
                k if dk_in is None else dk_in.contiguous(),
                g if dg_in is None else dg_in.contiguous(),
                dk, dg, rows, key_dim, G_HEAD=g.dim() < k.dim(),
                HAS_DK_IN=dk_in is not None, HAS_DG_IN=dg_in is not None,
                BLOCK_R=block_r, BLOCK_K=block_k, num_warps=warps,
            )  # fmt: skip
        return dk, dg


@opaque_to_compiler
def kdn_iso_gain(
    k: torch.Tensor,
    g: torch.Tensor,
    q_noise: torch.Tensor,
    r: torch.Tensor,
    p_prior: torch.Tensor,
    info_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`gains.iso_gain` on two stages each way: the terms' reductions over K above (a and
    ||k||^2 per token and head), then the scan with the evidence and beta inside it
    (`triton.kdn_iso_scan`). Returns (beta, p, predictive) `[B, T, H]` float32, then k and g
    routed through the terms' node, for the delta rule the gain feeds: its gradients of them are
    then summed with the terms' own by the terms' backward kernel (`_KDNIsoTerms`). k
    `[B, T, H, K]`, g `[B, T, H(, K)]`, q_noise and r `[B, T, H]` in their own float dtypes
    (read as they are, their gradients written back in them), p_prior `[B, H]` float32; all
    validated."""
    decay2, norm2, k, g = _KDNIsoTerms.apply(k.contiguous(), g.contiguous())
    scan = kdn_iso_scan(decay2, norm2, q_noise, r, p_prior, info_scale / k.shape[-1])
    return (*scan, k, g)
