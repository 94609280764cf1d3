"""A delta-rule layer's whole one-token recurrent step as one Triton kernel.

Between the layer's two matrix products (its projections of x before, the output projection
after) a decoding step of every delta-rule mixer does the same few things per (sequence, head),
which are here one program of one kernel:

    q, k, v  = silu(short convolution of the projected token with the cached ones)
               (each cache `[B, C, W-1]` shifted in place: the token enters, the oldest leaves)
    q, k     = q / sqrt(|q|^2 + eps), k / sqrt(|k|^2 + eps);   q <- scale * rho * q
    g        = -exp(A_log) softplus(raw + dt_bias)        (none, per head, or per key channel)
    a, b, u  = the mixer's write rule (below)
    S        = diag(exp(g)) S;   S += a (u - S^T b)^T;    o = S^T q      (S updated in place)
    y        = o / rms(o) * w * act(gate)                 (the gated output norm, per head)

Write rules (`RULES`), from the gates' pre-activations, by the formulas of
`deltalab.ops.parametrize` and `deltalab.ops.kdn.gains`:

    "beta"         a = sigmoid(beta) k,  b = k,  u = v          (DeltaNet, GDN, KDA)
    "erase_write"  a = k,  b = sigmoid(erase) * k,  u = sigmoid(write) * v   (GDN-2, Muir)
    "kdn_iso"      p_bar = mean(exp(2g)) / prec + q_noise,  a = p_bar k / (p_bar |k|^2 + r),
                   prec <- 1 / p_bar + s |k|^2 / (K r)                     (Isotropic KDN)
    "kdn_diag"     p_bar = exp(2g) / prec + q_noise,  a = p_bar k / (k^T (p_bar k) + r),
                   prec <- 1 / p_bar + s k^2 / r                    (Diagonal KDN, KDN-Muir)
    "kdn_exact"    P_bar = D P D + diag(q_noise),  a = P_bar k / (k^T P_bar k + r),
                   P <- the Joseph form (`_exact_gain`)       (Exact KDN; every KDN: b = k, u = v)

with r = r_min + softplus(raw_r) and q_noise = softplus(raw_q), or tied to the decay,
(1 - exp(2g)) p_inf (its mean over K for "kdn_iso"), p_inf = softplus(raw). The read gate rho is
1, exp(read_log) ("static") or exp(read_log) 2 sigmoid(raw) ("dynamic", Muir's).

Layout. Every gate input is a row of a `[B, width]` matrix (a column slice of one of the layer's
two projection products, read through its row stride); parameters are contiguous per head. A
program owns one (sequence, head): all K key rows and the V value columns in blocks of BV. With
one block the output norm is taken in registers; with several the raw outputs go to the output
buffer first and are normalized in a second pass (a barrier between: other threads wrote them).
Caches and the state are read before they are written by the same program; a barrier separates
a cache's reads from its shifted write, which another thread of the program may make.

Split (`FusedStepLaunch.programs_per_head` > 1): the grid is (B*H, NV), program j of a head
owning one block of BV value columns, NV = ceil(V / BV): every program computes q, k, the gates
and the write direction (K values, the same in all), its v columns' convolution (shifting its
own v cache columns), its state block's update in place, its raw outputs (to the output buffer)
and their sum of squares (to a workspace slot). The head's shared state, the q / k caches and
the KDN filter's state, is written by the last program of the head to finish (a per-head
counter in the workspace, incremented with acquire-release semantics), which also sums the NV
partial sums, normalizes all V outputs and resets the counter. One launch still; more programs
for SMs that one program per head leaves idle at small batches.

Numerics: float32 throughout (16-bit inputs widened at load), the raw output rounded to the
output's dtype before its norm, as the unfused step rounds the delta rule's output; the new
cache entries are the projected inputs as they came.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deltalab.ops._triton import opaque_to_compiler
from deltalab.ops.launch_tables import LaunchRegistry
from deltalab.ops.log_decay.triton import _softplus_terms
from deltalab.ops.norms.triton import GATES, _gate_terms

__all__ = [
    "DECAYS",
    "READS",
    "RULES",
    "FusedStepLaunch",
    "StepForm",
    "fused_layer_step",
    "split_launch",
    "split_workspace",
]

DECAYS = ("none", "head", "channel")
RULES = ("beta", "erase_write", "kdn_iso", "kdn_diag", "kdn_exact")
READS = ("none", "static", "dynamic")
# The state tile (rows x columns) one program holds at once: a head of up to ONE_BLOCK_TILE
# values in one block (so its output norm needs no second pass) over up to 16 warps, 32
# float32 values a thread; a larger head in blocks of LOOP_TILE over 8 warps, 32 a thread.
# Compiled for sm_90: a 128 x 128 head in one block of 16 warps spills nothing where K, V and
# the row strides are multiples of 16 (the 340M shapes, Exact KDN included), 0 to 48 bytes a
# thread by the form otherwise (Exact KDN 1248; the plain step's kernel 232 there), 200 to 400
# at 8 warps (sizes not multiples of 16, as the spills below); a V = 256 head in
# blocks of 128 x 64 spills 0 (beta) to 190 bytes, in blocks of 128 x 128 about 390. First
# choices, not yet timed on a GPU.
ONE_BLOCK_TILE = 16384
LOOP_TILE = 8192
VALUES_PER_WARP = 32 * 32
MIN_WARPS, MAX_WARPS = 4, 16
MIN_BLOCK = 16


@dataclass(frozen=True)
class FusedStepLaunch:
    """The fused step's launch table: each head's value columns split over at most
    `programs_per_head` programs (one block of V / programs_per_head columns each, warps by
    its tile: `launch`) where B * H <= `split_max_heads` (None: at any batch); 1: one program
    a head (its columns in `launch`'s blocks). The split fills SMs that one program per
    (sequence, head) leaves idle at small batches, for q, k and the gates computed in every
    program of a head. Default: no split, not yet timed on a GPU."""

    programs_per_head: int = 1
    split_max_heads: int | None = None


LAUNCH = FusedStepLaunch()
# The table per card (`deltalab.ops.launch_tables`), for calls given none.
LAUNCH_TABLES = LaunchRegistry("fused_step", LAUNCH)


class StepForm(NamedTuple):
    """A mixer's parametrization of the step: decay (`DECAYS`), rule (`RULES`), read (`READS`),
    tied (the KDN process noise follows the decay), gate_activation ("sigmoid" or "silu")."""

    decay: str
    rule: str
    read: str = "none"
    tied: bool = False
    gate_activation: str = "sigmoid"


@triton.jit
def _conv_silu(X, stride_x, WEIGHT, CACHE, b, ch, ch_ok, C, W: tl.constexpr, BW: tl.constexpr,
               SHIFT: tl.constexpr):  # fmt: skip
    """silu of one token's short convolution on channels `ch` of sequence b (float32); with
    SHIFT the cache `[B, C, W-1]` shifted in place to end with the token (`_shift_cache`)."""
    x = tl.load(X + b * stride_x + ch, mask=ch_ok, other=0.0)
    taps = tl.arange(0, BW)
    held = ch_ok[:, None] & (taps[None, :] < W - 1)
    at = CACHE + b * C * (W - 1) + ch[:, None] * (W - 1) + taps[None, :]
    cache = tl.load(at, mask=held, other=0.0).to(tl.float32)
    w = tl.load(WEIGHT + ch[:, None] * W + taps[None, :], mask=held, other=0.0).to(tl.float32)
    w_last = tl.load(WEIGHT + ch * W + (W - 1), mask=ch_ok, other=0.0).to(tl.float32)
    z = tl.sum(cache * w, axis=1) + w_last * x.to(tl.float32)
    if SHIFT:
        _shift_cache(x, CACHE, b, ch, ch_ok, C, W, BW)
    return z * tl.sigmoid(z)


@triton.jit
def _shift_cache(x, CACHE, b, ch, ch_ok, C, W: tl.constexpr, BW: tl.constexpr):
    """Shifts channels `ch` of sequence b's cache `[B, C, W-1]` in place to end with x: every
    read before the barrier, every write after it (another thread writes what one reads)."""
    taps = tl.arange(0, BW)
    held = ch_ok[:, None] & (taps[None, :] < W - 1)
    at = CACHE + b * C * (W - 1) + ch[:, None] * (W - 1) + taps[None, :]
    later = tl.load(at + 1, mask=held & (taps[None, :] < W - 2), other=0.0)
    shifted = tl.where(taps[None, :] == W - 2, x[:, None].to(later.dtype), later)
    tl.debug_barrier()
    tl.store(at, shifted, mask=held)


@triton.jit
def _expm1(x):
    """exp(x) - 1, float32, accurate near 0 (a series below |x| = 1e-2; Triton has no expm1)."""
    series = x * (1.0 + x * (0.5 + x * (1.0 / 6.0 + x * (1.0 / 24.0))))
    return tl.where(tl.abs(x) < 1e-2, series, tl.exp(x) - 1.0)


@triton.jit
def _log_decay(RAW, stride_raw, A_LOG, DT_BIAS, b, h, kch, row_ok, DECAY: tl.constexpr,
               BK: tl.constexpr):  # fmt: skip
    """g `[BK]` float32: zeros (DECAY 0), one per head broadcast (1) or per channel (2)."""
    if DECAY == 0:
        g = tl.zeros([BK], dtype=tl.float32)
    else:
        rate = tl.exp(tl.load(A_LOG + h).to(tl.float32))
        if DECAY == 1:
            raw = tl.load(RAW + b * stride_raw + h).to(tl.float32)
            raw = raw + tl.load(DT_BIAS + h).to(tl.float32)
            sp, _ = _softplus_terms(raw)
            g = tl.zeros([BK], dtype=tl.float32) - rate * sp
        else:
            raw = tl.load(RAW + b * stride_raw + kch, mask=row_ok, other=0.0).to(tl.float32)
            raw = raw + tl.load(DT_BIAS + kch, mask=row_ok, other=0.0).to(tl.float32)
            sp, _ = _softplus_terms(raw)
            g = tl.where(row_ok, -rate * sp, 0.0)
    return g


@triton.jit
def _kalman_gain(k, g, NOISE, stride_noise, OBS, stride_obs, P_INF, PRECISION, b, h, bh, kch,
                 rows, row_ok, K, r_min, info_scale, FILTER: tl.constexpr, TIED: tl.constexpr,
                 STORE: tl.constexpr):  # fmt: skip
    """The KDN write direction a `[BK]` from the filter's state (updated in place with STORE)
    and the noise model (module docstring). FILTER: 0 isotropic (precision `[B, H]`), 1
    diagonal (precision `[B, H, K]`), 2 exact (covariance `[B, H, K, K]`); the process noise is
    per channel but for the isotropic filter."""
    sp_r, _ = _softplus_terms(tl.load(OBS + b * stride_obs + h).to(tl.float32))
    r = r_min + sp_r
    decay2 = tl.where(row_ok, tl.exp(2.0 * g), 0.0)
    if TIED:
        p_inf, _ = _softplus_terms(tl.load(P_INF + h).to(tl.float32))
        restore = tl.where(row_ok, -_expm1(2.0 * g), 0.0)
        if FILTER == 0:
            q_noise = tl.sum(restore) / K * p_inf
        else:
            q_noise = restore * p_inf
    else:
        if FILTER == 0:
            raw = tl.load(NOISE + b * stride_noise + h)
        else:
            raw = tl.load(NOISE + b * stride_noise + kch, mask=row_ok, other=0.0)
        q_noise, _ = _softplus_terms(raw.to(tl.float32))
    if FILTER == 0:
        p_bar = tl.sum(decay2) / K / tl.load(PRECISION + bh) + q_noise
        norm2 = tl.sum(k * k)
        if STORE:
            tl.store(PRECISION + bh, 1.0 / p_bar + info_scale * norm2 / (K * r))
        a = p_bar / (p_bar * norm2 + r) * k
    elif FILTER == 1:
        at = PRECISION + bh * K + rows
        p_bar = decay2 / tl.load(at, mask=row_ok, other=1.0) + q_noise
        weighted = tl.where(row_ok, p_bar * k, 0.0)
        predictive = tl.sum(weighted * k)
        if STORE:
            tl.store(at, 1.0 / p_bar + info_scale * k * k / r, mask=row_ok)
        a = weighted / (predictive + r)
    else:
        a = _exact_gain(k, g, q_noise, r, PRECISION, bh, rows, row_ok, K, STORE)
    return a


@triton.jit
def _exact_gain(k, g, q_noise, r, COVARIANCE, bh, rows, row_ok, K, STORE: tl.constexpr):
    """Exact KDN's gain, its covariance P updated in place (with STORE) by the Joseph form
    (`exact_gain`):
    P_bar = D P D + diag(q_noise), P_bar k, gain = P_bar k / (k^T P_bar k + r), and
    P = P_bar - gain (P_bar k)^T - (P_bar k) gain^T + (k^T P_bar k + r) gain gain^T, symmetric
    term by term, as `exact_gain`'s average of P and P^T makes it."""
    head = COVARIANCE + bh * K * K
    tile = rows[:, None] * K + rows[None, :]
    tile_ok = row_ok[:, None] & row_ok[None, :]
    d = tl.where(row_ok, tl.exp(g), 0.0)
    p = tl.load(head + tile, mask=tile_ok, other=0.0) * d[:, None] * d[None, :]
    p = p + tl.where(rows[:, None] == rows[None, :], tl.where(row_ok, q_noise, 0.0)[:, None], 0.0)
    # P_bar is symmetric (P is, to rounding): one product serves as its rows' and columns'.
    pk = tl.sum(p * k[None, :], axis=1)
    denominator = tl.sum(pk * k) + r
    gain = pk / denominator
    if STORE:
        p = (
            p
            + (denominator * gain[:, None] - pk[:, None]) * gain[None, :]
            - gain[:, None] * pk[None, :]
        )
        tl.store(head + tile, p, mask=tile_ok)
        tl.debug_barrier()
    return gain


@triton.jit
def _value_block(start, V_IN, stride_v, WV, CV, WRITE, stride_write, MEMORY, q, a, bk, decay,
                 OUT, b, h, bh, rows, row_ok, H, K, V, RULE: tl.constexpr, W: tl.constexpr,
                 BW: tl.constexpr, BV: tl.constexpr):  # fmt: skip
    """Value columns start..start+BV of the head: v's convolution (and write gate), the state
    tile's update in place; returns (cols, col_ok, o rounded to the output dtype, as float32)."""
    cols = start + tl.arange(0, BV)
    col_ok = cols < V
    vch = h * V + cols
    u = _conv_silu(V_IN, stride_v, WV, CV, b, vch, col_ok, H * V, W, BW, True)
    if RULE == 1:
        write = tl.load(WRITE + b * stride_write + vch, mask=col_ok, other=0.0).to(tl.float32)
        u = u * tl.sigmoid(write)
    # The head's base pointer once, the tile's offsets in 32 bits (fewer registers than 64-bit
    # addresses; a head holds far fewer than 2^31 values).
    head = MEMORY + bh * K * V
    tile = rows[:, None] * V + cols[None, :]
    tile_ok = row_ok[:, None] & col_ok[None, :]
    s = tl.load(head + tile, mask=tile_ok, other=0.0) * decay[:, None]
    nu = u - tl.sum(bk[:, None] * s, axis=0)
    s = s + a[:, None] * nu[None, :]
    tl.store(head + tile, s, mask=tile_ok)
    o = tl.sum(q[:, None] * s, axis=0)
    return cols, col_ok, o.to(OUT.dtype.element_ty).to(tl.float32)


@triton.jit
def _norm_out(o, sumsq, cols, col_ok, GATE, stride_gate, NORM_W, OUT, b, h, bh, V, norm_eps,
              GATE_ACT: tl.constexpr):  # fmt: skip
    """The gated output norm of columns `cols` (sumsq: the head's sum of o^2), stored."""
    rstd = 1.0 / tl.sqrt(sumsq / V + norm_eps)
    gate = tl.load(GATE + b * stride_gate + h * V + cols, mask=col_ok, other=0.0)
    act, _ = _gate_terms(gate.to(tl.float32), GATE_ACT)
    w = tl.load(NORM_W + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = o * rstd * w * act
    tl.store(OUT + bh * V + cols, y.to(OUT.dtype.element_ty), mask=col_ok)


@triton.jit
def _norm_columns(OUT, sumsq, GATE, stride_gate, NORM_W, b, h, bh, V, norm_eps,
                  GATE_ACT: tl.constexpr, BV: tl.constexpr, CACHE: tl.constexpr):  # fmt: skip
    """The gated output norm of the head's raw outputs in OUT, all V columns in blocks of BV
    (CACHE: their loads' cache modifier)."""
    for start in tl.range(0, V, BV, num_stages=1):
        cols = start + tl.arange(0, BV)
        col_ok = cols < V
        o = tl.load(OUT + bh * V + cols, mask=col_ok, other=0.0, cache_modifier=CACHE)
        _norm_out(o.to(tl.float32), sumsq, cols, col_ok, GATE, stride_gate, NORM_W, OUT, b, h, bh,
                  V, norm_eps, GATE_ACT)  # fmt: skip


@triton.jit
def _finish_head(Q, stride_q, K_IN, stride_k, CQ, CK, k, g, NOISE, stride_noise, OBS, stride_obs,
                 P_INF, PRECISION, GATE, stride_gate, NORM_W, OUT, slot, b, h, bh, kch, rows,
                 row_ok, H, K, V, r_min, info_scale, norm_eps, W: tl.constexpr,
                 BW: tl.constexpr, BV: tl.constexpr, RULE: tl.constexpr, TIED: tl.constexpr,
                 GATE_ACT: tl.constexpr, NV: tl.constexpr):  # fmt: skip
    """The last program of a split head: the head's q / k caches shifted and its KDN filter
    state updated (as every program of the head computed them), the output norm of all V
    columns from the NV partial sums of squares at `slot` + 1, the counter at `slot` reset."""
    x = tl.load(Q + b * stride_q + kch, mask=row_ok, other=0.0)
    _shift_cache(x, CQ, b, kch, row_ok, H * K, W, BW)
    x = tl.load(K_IN + b * stride_k + kch, mask=row_ok, other=0.0)
    _shift_cache(x, CK, b, kch, row_ok, H * K, W, BW)
    if RULE >= 2:
        _kalman_gain(k, g, NOISE, stride_noise, OBS, stride_obs, P_INF, PRECISION, b, h, bh, kch,
                     rows, row_ok, K, r_min, info_scale, RULE - 2, TIED, True)  # fmt: skip
    # Summed in block order, as one program sums its blocks.
    sumsq = tl.sum(tl.zeros([BV], dtype=tl.float32))
    for i in tl.static_range(NV):
        sumsq += tl.load(slot + 1 + i, cache_modifier=".cg").to(tl.float32, bitcast=True)
    _norm_columns(OUT, sumsq, GATE, stride_gate, NORM_W, b, h, bh, V, norm_eps, GATE_ACT, BV,
                  ".cg")  # fmt: skip
    tl.atomic_xchg(slot, 0)


@triton.jit
def _fused_step_kernel(
    Q, K_IN, V_IN, stride_q, stride_k, stride_v, WQ, WK, WV, CQ, CK, CV,
    GATE, stride_gate, BETA, stride_beta, WRITE, stride_write,
    DECAY_RAW, stride_decay, A_LOG, DT_BIAS, READ, stride_read, READ_LOG,
    NOISE, stride_noise, OBS, stride_obs, P_INF, PRECISION, MEMORY, NORM_W, OUT,
    WORKSPACE, stride_workspace,
    H, K, V, scale, l2_eps, norm_eps, r_min, info_scale,
    W: tl.constexpr, BW: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DECAY: tl.constexpr, RULE: tl.constexpr, READ_FORM: tl.constexpr, TIED: tl.constexpr,
    GATE_ACT: tl.constexpr, ONE_BLOCK: tl.constexpr, NV: tl.constexpr,
):  # fmt: skip
    # 64-bit bases (a sequence's rows, a head's state) and 32-bit offsets within them: fewer
    # registers for the address tensors.
    bh = tl.program_id(0).to(tl.int64)
    b = bh // H
    h = (bh % H).to(tl.int32)
    rows = tl.arange(0, BK)
    row_ok = rows < K
    kch = h * K + rows
    # Split over NV programs, the head's q / k caches and KDN filter state are shifted and
    # updated by the last of them only (below); whole, by this program as it goes.
    q = _conv_silu(Q, stride_q, WQ, CQ, b, kch, row_ok, H * K, W, BW, NV == 1)
    k = _conv_silu(K_IN, stride_k, WK, CK, b, kch, row_ok, H * K, W, BW, NV == 1)
    q = q / tl.sqrt(tl.sum(q * q) + l2_eps)
    k = k / tl.sqrt(tl.sum(k * k) + l2_eps)
    if READ_FORM != 0:
        rho = tl.exp(tl.load(READ_LOG + kch, mask=row_ok, other=0.0).to(tl.float32))
        if READ_FORM == 2:
            raw = tl.load(READ + b * stride_read + kch, mask=row_ok, other=0.0)
            rho = rho * (2.0 * tl.sigmoid(raw.to(tl.float32)))
        q = q * rho
    q = q * scale
    g = _log_decay(DECAY_RAW, stride_decay, A_LOG, DT_BIAS, b, h, kch, row_ok, DECAY, BK)
    bk = k
    if RULE == 0:
        a = tl.sigmoid(tl.load(BETA + b * stride_beta + h).to(tl.float32)) * k
    elif RULE == 1:
        erase = tl.load(BETA + b * stride_beta + kch, mask=row_ok, other=0.0).to(tl.float32)
        a = k
        bk = tl.sigmoid(erase) * k
    else:
        a = _kalman_gain(k, g, NOISE, stride_noise, OBS, stride_obs, P_INF, PRECISION, b, h, bh,
                         kch, rows, row_ok, K, r_min, info_scale, RULE - 2, TIED,
                         NV == 1)  # fmt: skip
    decay = tl.exp(g)
    if NV > 1:
        # Program j of the head owns value columns j BV .. (j+1) BV: its state block, its v
        # cache columns and its raw outputs; the q / k caches and the filter state are the
        # head's, read by all NV programs. Race-free: each program reads them before its
        # barrier and acq_rel increment of the head's counter (which releases its writes: raw
        # outputs, partial sum), and only the program that sees NV - 1, after every other's
        # release, writes them (values it computes as the others did), then reads the raw
        # outputs (L2, past this SM's L1) and resets the counter for the next step (CUDA graph
        # replays included).
        j = tl.program_id(1)
        cols, col_ok, o = _value_block(j * BV, V_IN, stride_v, WV, CV, WRITE, stride_write, MEMORY,
                                       q, a, bk, decay, OUT, b, h, bh, rows, row_ok, H, K, V,
                                       RULE, W, BW, BV)  # fmt: skip
        tl.store(OUT + bh * V + cols, o.to(OUT.dtype.element_ty), mask=col_ok)
        slot = WORKSPACE + bh * stride_workspace
        tl.store(slot + 1 + j, tl.sum(o * o).to(tl.int32, bitcast=True))
        tl.debug_barrier()
        if tl.atomic_add(slot, 1, sem="acq_rel") == NV - 1:
            _finish_head(Q, stride_q, K_IN, stride_k, CQ, CK, k, g, NOISE, stride_noise, OBS,
                         stride_obs, P_INF, PRECISION, GATE, stride_gate, NORM_W, OUT, slot, b, h,
                         bh, kch, rows, row_ok, H, K, V, r_min, info_scale, norm_eps, W, BW, BV,
                         RULE, TIED, GATE_ACT, NV)  # fmt: skip
    elif ONE_BLOCK:
        cols, col_ok, o = _value_block(0, V_IN, stride_v, WV, CV, WRITE, stride_write, MEMORY, q,
                                       a, bk, decay, OUT, b, h, bh, rows, row_ok, H, K, V, RULE,
                                       W, BW, BV)  # fmt: skip
        _norm_out(o, tl.sum(o * o), cols, col_ok, GATE, stride_gate, NORM_W, OUT, b, h, bh, V,
                  norm_eps, GATE_ACT)  # fmt: skip
    else:
        sumsq = tl.sum(tl.zeros([BV], dtype=tl.float32))
        for start in tl.range(0, V, BV, num_stages=1):
            cols, col_ok, o = _value_block(start, V_IN, stride_v, WV, CV, WRITE, stride_write,
                                           MEMORY, q, a, bk, decay, OUT, b, h, bh, rows, row_ok, H,
                                           K, V, RULE, W, BW, BV)  # fmt: skip
            tl.store(OUT + bh * V + cols, o.to(OUT.dtype.element_ty), mask=col_ok)
            sumsq += tl.sum(o * o)
        tl.debug_barrier()
        _norm_columns(OUT, sumsq, GATE, stride_gate, NORM_W, b, h, bh, V, norm_eps, GATE_ACT, BV,
                      "")  # fmt: skip


def _row(x: torch.Tensor | None, fallback: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A `[B, width]` gate input and its row stride (unit column stride), or a placeholder
    pointer where the form reads none."""
    if x is None:
        return fallback, 0
    if x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"a gate input must be [B, width] with unit column stride, got {x.shape}")
    return x, x.stride(0)


def launch(
    key_dim: int, value_dim: int, block_v: int | None = None, programs: int = 1,
    covariance: bool = False,
) -> tuple[int, int, int]:  # fmt: skip
    """(BK, BV, warps): all key rows; every value column at once where the state tile fits
    ONE_BLOCK_TILE, else blocks of LOOP_TILE; split over `programs` programs a head, blocks of
    V / programs columns (a power of 2 >= 16); block_v, a power of two >= 16, overrides either;
    warps by the tile's size, split with a `covariance` (Exact KDN's K x K tile) by the larger
    tile: compiled for sm_90 at K = V = 128, 4 warps spilled 7.9 KB a thread there."""
    block_k = max(MIN_BLOCK, triton.next_power_of_2(key_dim))
    if block_v is None and programs > 1:
        block_v = max(MIN_BLOCK, triton.next_power_of_2(triton.cdiv(value_dim, programs)))
    if block_v is None:
        block_v = triton.next_power_of_2(value_dim)
        if block_k * block_v > ONE_BLOCK_TILE:
            block_v = max(MIN_BLOCK, LOOP_TILE // block_k)
    tile = block_k * max(block_v, block_k if covariance and programs > 1 else 0)
    warps = min(MAX_WARPS, max(MIN_WARPS, tile // VALUES_PER_WARP))
    return block_k, block_v, warps


def split_launch(
    memory: torch.Tensor, table: FusedStepLaunch | None = None, block_v: int | None = None,
    covariance: bool = False,
) -> tuple[int, int, int, int]:  # fmt: skip
    """(BK, BV, warps, NV) of the step on the state `memory` `[B, H, K, V]`: NV programs a head,
    each owning one block of BV value columns, where `table` (None: the one for memory's
    device) splits the heads at this batch; else NV = 1 (`launch`'s blocks in one program).
    covariance: the rule is Exact KDN's (`launch`)."""
    table = LAUNCH_TABLES.launch_table_for(memory.device) if table is None else table
    batch, heads, key_dim, value_dim = memory.shape
    most = table.split_max_heads
    programs = table.programs_per_head if most is None or batch * heads <= most else 1
    block_k, block_v, warps = launch(key_dim, value_dim, block_v, programs, covariance)
    split = triton.cdiv(value_dim, block_v) if programs > 1 else 1
    return block_k, block_v, warps, split


def split_workspace(
    memory: torch.Tensor, table: FusedStepLaunch | None = None, block_v: int | None = None
) -> torch.Tensor | None:
    """The zeroed workspace `fused_layer_step` needs where its launch splits heads
    (`split_launch`), None where it does not: int32 `[B*H, 1 + NV]`, per head a counter of its
    finished programs (back to 0 after every step) and their partial sums of squares of o
    (float32 bits). Its owner keeps it across steps (and CUDA graph replays)."""
    batch, heads = memory.shape[:2]
    programs = split_launch(memory, table, block_v)[3]
    if programs == 1:
        return None
    return torch.zeros(batch * heads, 1 + programs, dtype=torch.int32, device=memory.device)


def _checked_workspace(workspace: torch.Tensor | None, memory: torch.Tensor, programs: int):
    """The workspace (a placeholder pointer without a split), checked against the launch."""
    if programs == 1:
        return memory, 0
    shape = (memory.shape[0] * memory.shape[1], 1 + programs)
    if (
        workspace is None
        or workspace.dtype != torch.int32
        or tuple(workspace.shape) != shape
        or workspace.stride(1) != 1
        or workspace.device != memory.device
    ):
        got = None if workspace is None else (workspace.dtype, tuple(workspace.shape))
        raise ValueError(
            f"workspace: the launch splits each head over {programs} programs and needs an "
            f"int32 tensor {list(shape)} of zeros on {memory.device} (`split_workspace`), "
            f"got {got}"
        )
    return workspace, workspace.stride(0)


@opaque_to_compiler
def fused_layer_step(
    form: StepForm,
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    conv_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    caches: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    memory: torch.Tensor,
    gate: torch.Tensor,
    norm_weight: torch.Tensor,
    out: torch.Tensor,
    *,
    scale: float,
    l2_eps: float,
    norm_eps: float,
    gates: dict[str, torch.Tensor | None],
    params: dict[str, torch.Tensor | None],
    r_min: float = 0.0,
    info_scale: float = 1.0,
    block_v: int | None = None,
    table: FusedStepLaunch | None = None,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token of a delta-rule layer (module docstring), everything but its projections.

    qkv: the projected q, k `[B, H*K]` and v `[B, H*V]` (rows, unit column stride); their
    ShortConvolution weights `[C, 1, W]` and caches `[B, C, W-1]` (contiguous, updated in place);
    memory `[B, H, K, V]` float32 contiguous, updated in place; gate: the output gate's
    pre-activation `[B, H*V]`; norm_weight `[V]`; out `[B, H*V]`, written. gates: the form's
    pre-activations by name, `[B, width]` rows: "beta" (`[B, H]`; with "erase_write" the erase
    logits `[B, H*K]`), "write" `[B, H*V]`, "decay" (`[B, H]` or `[B, H*K]`), "read" `[B, H*K]`,
    "noise" (`[B, H]` kdn_iso, else `[B, H*K]`), "obs" `[B, H]`. params: "A_log" `[H]`,
    "dt_bias" (`[H]` or `[H, K]`), "read_log" `[H, K]`, "p_inf_raw" `[H]`, "precision" (the KDN
    filter's state: precision `[B, H]` or `[B, H, K]`, covariance `[B, H, K, K]`; float32,
    contiguous, updated in place). None where the form reads
    none. block_v: the value columns a block holds (None: `launch`'s). table: the launch table
    (`FusedStepLaunch`; None: the one for memory's device), which may split each head over
    programs (`split_launch`); workspace: then `split_workspace`'s, kept by the caller across
    steps (required where the launch splits).
    """
    batch, heads, key_dim, value_dim = memory.shape
    width = conv_weights[0].shape[-1]
    exact = form.rule == "kdn_exact"
    block_k, block_v, warps, programs = split_launch(memory, table, block_v, exact)
    workspace = _checked_workspace(workspace, memory, programs)
    rows = {name: _row(gates.get(name), memory) for name in RULE_INPUTS}
    q, k, v = (_row(x, memory) for x in qkv)
    placeholder = {name: memory if params.get(name) is None else params[name] for name in PARAMS}
    _fused_step_kernel[(batch * heads, programs)](
        q[0], k[0], v[0], q[1], k[1], v[1], *conv_weights, *caches,
        *_row(gate, memory), *rows["beta"], *rows["write"], *rows["decay"],
        placeholder["A_log"], placeholder["dt_bias"], *rows["read"], placeholder["read_log"],
        *rows["noise"], *rows["obs"], placeholder["p_inf_raw"], placeholder["precision"],
        memory, norm_weight, out, *workspace,
        heads, key_dim, value_dim, float(scale), float(l2_eps), float(norm_eps), float(r_min),
        float(info_scale),
        W=width, BW=max(1, triton.next_power_of_2(max(width - 1, 1))), BK=block_k, BV=block_v,
        DECAY=DECAYS.index(form.decay), RULE=RULES.index(form.rule),
        READ_FORM=READS.index(form.read), TIED=form.tied, GATE_ACT=GATES[form.gate_activation],
        ONE_BLOCK=block_v >= value_dim, NV=programs,
        num_warps=warps,
    )  # fmt: skip
    return out


RULE_INPUTS = ("beta", "write", "decay", "read", "noise", "obs")
PARAMS = ("A_log", "dt_bias", "read_log", "p_inf_raw", "precision")
