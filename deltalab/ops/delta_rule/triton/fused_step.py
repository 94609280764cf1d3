"""A delta-rule layer's whole one-token recurrent step as one Triton kernel (two for Exact KDN).

Between the layer's two matrix products (its projections of x before, the output projection
after) a decoding step of every delta-rule mixer does the same few things per (sequence, head),
which are here one program of one kernel (Exact KDN's covariance: below):

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
                   P <- the Joseph form (`_covariance_rows`)  (Exact KDN; every KDN: b = k, u = v)

with r = r_min + softplus(raw_r) and q_noise = softplus(raw_q), or tied to the decay,
(1 - exp(2g)) p_inf (its mean over K for "kdn_iso"), p_inf = softplus(raw). The read gate rho is
1, exp(read_log) ("static") or exp(read_log) 2 sigmoid(raw) ("dynamic", Muir's).

Layout. Every gate input is a row of a `[B, width]` matrix (a column slice of one of the layer's
two projection products, read through its row stride); parameters are contiguous per head. A
program owns one (sequence, head): all K key rows and the V value columns in blocks of BV (the
card's launch table, `FusedStepLaunch`, by the number of programs). With
one block the output norm is taken in registers; with several the raw outputs go to the output
buffer first and are normalized in a second pass (a barrier between: other threads wrote them).
Caches and the state are read before they are written by the same program; a barrier separates
a cache's reads from its shifted write, which another thread of the program may make.

Exact KDN's K x K covariance is spread over programs, not held by the head's: a first kernel
(`_exact_predict_kernel`, one program per block of COVARIANCE_ROWS rows of P_bar,
`_predicted_rows`) computes P_bar k and k from the old P, reading only; then the step's grid
gets a second axis whose programs after the first update P's rows blocks in place
(`_covariance_rows`, from the same P_bar rows), each reading only its own rows and the first
kernel's P_bar k, while program 0 of the axis runs the head's step with the gain from the same
P_bar k. The step's program holds no K x K tile, so it runs at the table's blocks as the other
forms do. With the whole covariance in it (up to `fae8b0e`) the step was one 16-warp block a
head, the covariance's 64 KB read and written by that one program: 1.19 ms a token at one
sequence and 3.31 at 64 for the 340M model on an H100, against 1.04 and 3.09 now.

Both kernels are launched dependent where the card supports it (`dependent_launch`), as the
decoder's products are: each waits for the kernel ahead before any access.

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

from deltalab.ops._triton import dependent_launch, opaque_to_compiler
from deltalab.ops.launch_tables import LaunchRegistry
from deltalab.ops.log_decay.triton import _softplus_terms
from deltalab.ops.norms.triton import GATES, _gate_terms

__all__ = [
    "DECAYS",
    "LAUNCH",
    "LAUNCH_TABLES",
    "READS",
    "RULES",
    "FusedStepLaunch",
    "StepForm",
    "fused_layer_step",
    "table_launch",
]

DECAYS = ("none", "head", "channel")
RULES = ("beta", "erase_write", "kdn_iso", "kdn_diag", "kdn_exact")
READS = ("none", "static", "dynamic")
# Without a table (`launch`, as tests call it with block_v): the whole head in one block where
# it fits ONE_BLOCK_TILE values (its output norm then needs no second pass), else blocks of
# LOOP_TILE, over 32 float32 values a thread (4 to 16 warps). Compiled for sm_90: a 128 x 128
# head in one block of 16 warps spills nothing where K, V and the row strides are multiples of
# 16, 0 to 56 bytes a thread by the form otherwise (Exact KDN 288).
ONE_BLOCK_TILE = 16384
LOOP_TILE = 8192
VALUES_PER_WARP = 32 * 32
MIN_WARPS, MAX_WARPS = 4, 16
MIN_BLOCK = 16
# Exact KDN's covariance is read and updated in blocks of this many rows, each its own program
# (`_exact_predict_kernel`, `_covariance_rows`): 8 programs a 128-key head. 16: fastest on an
# H200 at one sequence (9.6 us a layer against 10.0 at 8 rows, 11.4 at 32, 13.0 at 64) and tied
# with 64 at 64 sequences (68.0 us; 8 rows 79.3).
COVARIANCE_ROWS = 16


@dataclass(frozen=True)
class FusedStepLaunch:
    """The fused step's launch on a card (`LAUNCH_TABLES`): blocks of `block_v` value columns
    over `num_warps`, and from `many_programs` programs (sequences x heads; None: never) blocks
    of `many_block_v` over `many_num_warps`. A head of at most a block's columns is one block.

    The default is the H100's measured table (`python -m benchmarks decode tune`; 8 heads of
    128 x 128, bf16, a layer's step as the decoder runs it, us a layer for the GDN-2 form and the
    Diagonal KDN one with tied process noise): 64 columns over 4 warps below 512 programs, 7.1 / 7.5 us at 1 sequence against
    12.2 / 13.0 for the whole head over 16 warps, 35.5 / 35.9 against 65.0 / 68.0 at 64. Small
    programs, several to an SM: one's reads overlap another's arithmetic, where a 16-warp
    program holds an SM alone and waits on each of its reads in turn. From 512 programs (64
    sequences) 32 columns over 2 warps, 34.3 / 34.9 us."""

    block_v: int = 64
    num_warps: int = 4
    many_programs: int | None = 512
    many_block_v: int = 32
    many_num_warps: int = 2


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
               SHIFT: tl.constexpr = True):  # fmt: skip
    """silu of one token's short convolution on channels `ch` of sequence b (float32), the
    cache `[B, C, W-1]` shifted in place to end with the token (with SHIFT; without it only
    read, as a kernel launched before the step's reads it)."""
    x = tl.load(X + b * stride_x + ch, mask=ch_ok, other=0.0)
    taps = tl.arange(0, BW)
    held = ch_ok[:, None] & (taps[None, :] < W - 1)
    at = CACHE + b * C * (W - 1) + ch[:, None] * (W - 1) + taps[None, :]
    cache = tl.load(at, mask=held, other=0.0).to(tl.float32)
    w = tl.load(WEIGHT + ch[:, None] * W + taps[None, :], mask=held, other=0.0).to(tl.float32)
    w_last = tl.load(WEIGHT + ch * W + (W - 1), mask=ch_ok, other=0.0).to(tl.float32)
    z = tl.sum(cache * w, axis=1) + w_last * x.to(tl.float32)
    if SHIFT:
        later = tl.load(at + 1, mask=held & (taps[None, :] < W - 2), other=0.0)
        shifted = tl.where(taps[None, :] == W - 2, x[:, None].to(later.dtype), later)
        tl.debug_barrier()
        tl.store(at, shifted, mask=held)
    return z * tl.sigmoid(z)


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
def _process_noise(g, NOISE, stride_noise, P_INF, b, h, kch, row_ok, K,
                   FILTER: tl.constexpr, TIED: tl.constexpr):  # fmt: skip
    """The KDN process noise of channels `kch` (g: their log decays): softplus of the given
    pre-activation, or tied to the decay, (1 - exp(2g)) p_inf; one per head (its mean over the
    head's K channels) for the isotropic filter (FILTER 0), else per channel."""
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
    return q_noise


@triton.jit
def _observation_noise(OBS, stride_obs, b, h, r_min):
    """r = r_min + softplus(raw_r), the head's observation-noise variance for sequence b."""
    sp_r, _ = _softplus_terms(tl.load(OBS + b * stride_obs + h).to(tl.float32))
    return r_min + sp_r


@triton.jit
def _kalman_gain(k, g, NOISE, stride_noise, OBS, stride_obs, P_INF, PRECISION, PREDICTED, b, h,
                 bh, kch, rows, row_ok, K, r_min, info_scale, FILTER: tl.constexpr,
                 TIED: tl.constexpr):  # fmt: skip
    """The KDN write direction a `[BK]` from the filter's state and the noise model (module
    docstring). FILTER: 0 isotropic (precision `[B, H]`), 1 diagonal (precision `[B, H, K]`),
    both updated in place; 2 exact, from `_exact_predict_kernel`'s P_bar k and k (PREDICTED)."""
    r = _observation_noise(OBS, stride_obs, b, h, r_min)
    if FILTER == 2:
        a, _, _ = _exact_terms(PREDICTED, bh, rows, row_ok, K, r)
    else:
        q_noise = _process_noise(g, NOISE, stride_noise, P_INF, b, h, kch, row_ok, K, FILTER,
                                 TIED)  # fmt: skip
        decay2 = tl.where(row_ok, tl.exp(2.0 * g), 0.0)
        if FILTER == 0:
            p_bar = tl.sum(decay2) / K / tl.load(PRECISION + bh) + q_noise
            norm2 = tl.sum(k * k)
            tl.store(PRECISION + bh, 1.0 / p_bar + info_scale * norm2 / (K * r))
            a = p_bar / (p_bar * norm2 + r) * k
        else:
            at = PRECISION + bh * K + rows
            p_bar = decay2 / tl.load(at, mask=row_ok, other=1.0) + q_noise
            weighted = tl.where(row_ok, p_bar * k, 0.0)
            predictive = tl.sum(weighted * k)
            tl.store(at, 1.0 / p_bar + info_scale * k * k / r, mask=row_ok)
            a = weighted / (predictive + r)
    return a


@triton.jit
def _exact_terms(PREDICTED, bh, rows, row_ok, K, r):
    """(gain, P_bar k, k^T P_bar k + r) of Exact KDN's head bh on rows `rows`, from P_bar k and
    k as `_exact_predict_kernel` left them in PREDICTED `[B*H, 2, K]`."""
    pk = tl.load(PREDICTED + bh * 2 * K + rows, mask=row_ok, other=0.0)
    k = tl.load(PREDICTED + bh * 2 * K + K + rows, mask=row_ok, other=0.0)
    denominator = tl.sum(pk * k) + r
    return pk / denominator, pk, denominator


@triton.jit
def _predicted_rows(start, DECAY_RAW, stride_decay, A_LOG, DT_BIAS, NOISE, stride_noise, P_INF,
                    COVARIANCE, b, h, bh, rows, row_ok, K, DECAY: tl.constexpr,
                    TIED: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr):  # fmt: skip
    """Rows start..start+BR of Exact KDN's predicted covariance P_bar = D P D + diag(q_noise)
    of head bh, from P's rows as they are: (P_bar's rows `[BR, BK]`, their pointers into P and
    mask, the rows' indices and mask)."""
    block = start + tl.arange(0, BR)
    block_ok = block < K
    g = _log_decay(DECAY_RAW, stride_decay, A_LOG, DT_BIAS, b, h, h * K + rows, row_ok, DECAY, BK)
    g_block = _log_decay(DECAY_RAW, stride_decay, A_LOG, DT_BIAS, b, h, h * K + block, block_ok,
                         DECAY, BR)  # fmt: skip
    q_block = _process_noise(g_block, NOISE, stride_noise, P_INF, b, h, h * K + block, block_ok,
                             K, 2, TIED)  # fmt: skip
    at = COVARIANCE + bh * K * K + block[:, None] * K + rows[None, :]
    tile_ok = block_ok[:, None] & row_ok[None, :]
    d = tl.where(row_ok, tl.exp(g), 0.0)
    p = tl.load(at, mask=tile_ok, other=0.0) * tl.exp(g_block)[:, None] * d[None, :]
    p = p + tl.where(block[:, None] == rows[None, :], q_block[:, None], 0.0)
    return p, at, tile_ok, block, block_ok


@triton.jit
def _exact_predict_kernel(
    K_IN, stride_k, WK, CK, DECAY_RAW, stride_decay, A_LOG, DT_BIAS, NOISE, stride_noise, P_INF,
    COVARIANCE, PREDICTED, H, K, l2_eps,
    W: tl.constexpr, BW: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, DECAY: tl.constexpr,
    TIED: tl.constexpr, DEPENDENT: tl.constexpr = False,
):  # fmt: skip
    """Exact KDN's first stage, program (head bh, rows block i): P_bar k on rows block i of the
    predicted covariance (`_predicted_rows`), and (block 0) k, into PREDICTED `[B*H, 2, K]`.
    It only reads (the k cache included): the step's kernel, launched after it, updates P."""
    if DEPENDENT:  # nothing read or written before the wait (`dependent_launch`)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    bh = tl.program_id(0).to(tl.int64)
    b = bh // H
    h = (bh % H).to(tl.int32)
    rows = tl.arange(0, BK)
    row_ok = rows < K
    k = _conv_silu(K_IN, stride_k, WK, CK, b, h * K + rows, row_ok, H * K, W, BW, SHIFT=False)
    k = k / tl.sqrt(tl.sum(k * k) + l2_eps)
    p, _, _, block, block_ok = _predicted_rows(
        tl.program_id(1) * BR, DECAY_RAW, stride_decay, A_LOG, DT_BIAS, NOISE, stride_noise,
        P_INF, COVARIANCE, b, h, bh, rows, row_ok, K, DECAY, TIED, BK, BR,
    )  # fmt: skip
    tl.store(PREDICTED + bh * 2 * K + block, tl.sum(p * k[None, :], axis=1), mask=block_ok)
    if tl.program_id(1) == 0:
        tl.store(PREDICTED + bh * 2 * K + K + rows, k, mask=row_ok)


@triton.jit
def _covariance_rows(start, DECAY_RAW, stride_decay, A_LOG, DT_BIAS, NOISE, stride_noise, OBS,
                     stride_obs, P_INF, COVARIANCE, PREDICTED, b, h, bh, rows, row_ok, K, r_min,
                     DECAY: tl.constexpr, TIED: tl.constexpr, BK: tl.constexpr,
                     BR: tl.constexpr):  # fmt: skip
    """Exact KDN's covariance on rows start..start+BR of head bh by the Joseph form, in place:
    P = P_bar - gain (P_bar k)^T - (P_bar k) gain^T + (k^T P_bar k + r) gain gain^T, every
    term symmetric, so P stays symmetric to rounding (P_ij and P_ji are rounded apart;
    `exact_gain` averages P and P^T, this does not). Only this block's rows of P are read:
    P_bar k and k come from PREDICTED."""
    r = _observation_noise(OBS, stride_obs, b, h, r_min)
    gain, pk, denominator = _exact_terms(PREDICTED, bh, rows, row_ok, K, r)
    p, at, tile_ok, block, block_ok = _predicted_rows(
        start, DECAY_RAW, stride_decay, A_LOG, DT_BIAS, NOISE, stride_noise, P_INF, COVARIANCE,
        b, h, bh, rows, row_ok, K, DECAY, TIED, BK, BR,
    )  # fmt: skip
    pk_block = tl.load(PREDICTED + bh * 2 * K + block, mask=block_ok, other=0.0)
    gain_block = pk_block / denominator
    p = (
        p
        + (denominator * gain_block[:, None] - pk_block[:, None]) * gain[None, :]
        - gain_block[:, None] * pk[None, :]
    )
    tl.store(at, p, mask=tile_ok)


@triton.jit
def _value_block(start, V_IN, stride_v, WV, CV, WRITE, stride_write, MEMORY, q, a, bk, decay,
                 OUT, b, h, bh, rows, row_ok, H, K, V, RULE: tl.constexpr, W: tl.constexpr,
                 BW: tl.constexpr, BV: tl.constexpr):  # fmt: skip
    """Value columns start..start+BV of the head: v's convolution (and write gate), the state
    tile's update in place; returns (cols, col_ok, o rounded to the output dtype, as float32)."""
    cols = start + tl.arange(0, BV)
    col_ok = cols < V
    vch = h * V + cols
    u = _conv_silu(V_IN, stride_v, WV, CV, b, vch, col_ok, H * V, W, BW)
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
def _fused_step_kernel(
    Q, K_IN, V_IN, stride_q, stride_k, stride_v, WQ, WK, WV, CQ, CK, CV,
    GATE, stride_gate, BETA, stride_beta, WRITE, stride_write,
    DECAY_RAW, stride_decay, A_LOG, DT_BIAS, READ, stride_read, READ_LOG,
    NOISE, stride_noise, OBS, stride_obs, P_INF, PRECISION, PREDICTED, MEMORY, NORM_W, OUT,
    H, K, V, scale, l2_eps, norm_eps, r_min, info_scale,
    W: tl.constexpr, BW: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DECAY: tl.constexpr, RULE: tl.constexpr, READ_FORM: tl.constexpr, TIED: tl.constexpr,
    GATE_ACT: tl.constexpr, ONE_BLOCK: tl.constexpr, BR: tl.constexpr,
    DEPENDENT: tl.constexpr = False,
):  # fmt: skip
    if DEPENDENT:  # nothing read or written before the wait (`dependent_launch`)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # 64-bit bases (a sequence's rows, a head's state) and 32-bit offsets within them: fewer
    # registers for the address tensors.
    bh = tl.program_id(0).to(tl.int64)
    b = bh // H
    h = (bh % H).to(tl.int32)
    rows = tl.arange(0, BK)
    row_ok = rows < K
    # Exact KDN's grid has a second axis: 0 the head's step, i > 0 its covariance's rows block
    # i - 1 (`_covariance_rows`), which the step does not read.
    covariance_rows = False
    if RULE == 4:
        covariance_rows = tl.program_id(1) > 0
    if covariance_rows:
        _covariance_rows((tl.program_id(1) - 1) * BR, DECAY_RAW, stride_decay, A_LOG, DT_BIAS,
                         NOISE, stride_noise, OBS, stride_obs, P_INF, PRECISION, PREDICTED, b, h,
                         bh, rows, row_ok, K, r_min, DECAY, TIED, BK, BR)  # fmt: skip
    else:
        kch = h * K + rows
        q = _conv_silu(Q, stride_q, WQ, CQ, b, kch, row_ok, H * K, W, BW)
        k = _conv_silu(K_IN, stride_k, WK, CK, b, kch, row_ok, H * K, W, BW)
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
            a = _kalman_gain(k, g, NOISE, stride_noise, OBS, stride_obs, P_INF, PRECISION,
                             PREDICTED, b, h, bh, kch, rows, row_ok, K, r_min, info_scale,
                             RULE - 2, TIED)  # fmt: skip
        decay = tl.exp(g)
        if ONE_BLOCK:
            cols, col_ok, o = _value_block(0, V_IN, stride_v, WV, CV, WRITE, stride_write,
                                           MEMORY, q, a, bk, decay, OUT, b, h, bh, rows, row_ok,
                                           H, K, V, RULE, W, BW, BV)  # fmt: skip
            _norm_out(o, tl.sum(o * o), cols, col_ok, GATE, stride_gate, NORM_W, OUT, b, h, bh, V,
                      norm_eps, GATE_ACT)  # fmt: skip
        else:
            sumsq = tl.sum(tl.zeros([BV], dtype=tl.float32))
            for start in tl.range(0, V, BV, num_stages=1):
                cols, col_ok, o = _value_block(start, V_IN, stride_v, WV, CV, WRITE,
                                               stride_write, MEMORY, q, a, bk, decay, OUT, b, h,
                                               bh, rows, row_ok, H, K, V, RULE, W, BW,
                                               BV)  # fmt: skip
                tl.store(OUT + bh * V + cols, o.to(OUT.dtype.element_ty), mask=col_ok)
                sumsq += tl.sum(o * o)
            tl.debug_barrier()
            for start in tl.range(0, V, BV, num_stages=1):
                cols = start + tl.arange(0, BV)
                col_ok = cols < V
                o = tl.load(OUT + bh * V + cols, mask=col_ok, other=0.0).to(tl.float32)
                _norm_out(o, sumsq, cols, col_ok, GATE, stride_gate, NORM_W, OUT, b, h, bh, V,
                          norm_eps, GATE_ACT)  # fmt: skip


def _row(x: torch.Tensor | None, fallback: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A `[B, width]` gate input and its row stride (unit column stride), or a placeholder
    pointer where the form reads none."""
    if x is None:
        return fallback, 0
    if x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"a gate input must be [B, width] with unit column stride, got {x.shape}")
    return x, x.stride(0)


def launch(
    key_dim: int, value_dim: int, block_v: int | None = None, num_warps: int | None = None
) -> tuple[int, int, int]:
    """(BK, BV, warps): all key rows; every value column at once where the state tile fits
    ONE_BLOCK_TILE, else blocks of LOOP_TILE (block_v, a power of two >= 16, overrides it, and
    is cut to the head); warps by the tile's size (num_warps overrides it)."""
    block_k = max(MIN_BLOCK, triton.next_power_of_2(key_dim))
    whole = max(MIN_BLOCK, triton.next_power_of_2(value_dim))
    if block_v is None:
        block_v = (
            whole if block_k * whole <= ONE_BLOCK_TILE else max(MIN_BLOCK, LOOP_TILE // block_k)
        )
    block_v = min(block_v, whole)
    if num_warps is None:
        num_warps = min(MAX_WARPS, max(MIN_WARPS, block_k * block_v // VALUES_PER_WARP))
    return block_k, block_v, num_warps


def table_launch(
    table: FusedStepLaunch, programs: int, key_dim: int, value_dim: int, aligned: bool = True
) -> tuple[int, int, int]:
    """(BK, BV, warps) of `programs` programs by `table`, where the table was measured: K and V
    multiples of 16 and every tensor's address a multiple of 16 bytes (`aligned`: what Triton's
    launcher declares to the compiler). Every form takes the same launch: the table was
    measured on the GDN-2 and Diagonal KDN forms, and Exact KDN's step holds no more than they
    do (its covariance is other programs' work). Elsewhere `launch`'s whole head: compiled for
    sm_90 at the table's 2-4 warps, other sizes or addresses spill 2.5-3.1 KB a thread (against
    0 to 56 bytes in one 16-warp block). The inputs' row strides change no spill."""
    if not aligned:
        return launch(key_dim, value_dim)
    if table.many_programs is not None and programs >= table.many_programs:
        return launch(key_dim, value_dim, table.many_block_v, table.many_num_warps)
    return launch(key_dim, value_dim, table.block_v, table.num_warps)


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
    none. block_v: the value columns a block holds, at `launch`'s warps (None: by `table`, the
    launch table, through `table_launch`; None: the card's, `LAUNCH_TABLES`). The kernels are
    launched dependent where the card supports it (`dependent_launch`).
    """
    batch, heads, key_dim, value_dim = memory.shape
    width = conv_weights[0].shape[-1]
    rows = {name: _row(gates.get(name), memory) for name in RULE_INPUTS}
    q, k, v = (_row(x, memory) for x in qkv)
    placeholder = {name: memory if params.get(name) is None else params[name] for name in PARAMS}
    if block_v is not None:
        if table is not None:
            raise ValueError(
                "block_v and table: give one of them (block_v launches without a table)"
            )
        block_k, block_v, warps = launch(key_dim, value_dim, block_v)
    else:
        table = LAUNCH_TABLES.launch_table_for(memory.device) if table is None else table
        tensors = [*qkv, *conv_weights, *caches, gate, norm_weight, out, memory,
                   *(x for x in gates.values() if x is not None), *placeholder.values()]  # fmt: skip
        aligned = key_dim % 16 == 0 and value_dim % 16 == 0
        aligned = aligned and all(t.data_ptr() % 16 == 0 for t in tensors)
        block_k, block_v, warps = table_launch(table, batch * heads, key_dim, value_dim, aligned)
    taps = max(1, triton.next_power_of_2(max(width - 1, 1)))
    constants = dict(W=width, BW=taps, BK=block_k, DECAY=DECAYS.index(form.decay), TIED=form.tied,
                     BR=COVARIANCE_ROWS)  # fmt: skip
    predicted, parts = memory, 1
    dependent = dependent_launch(memory.device)
    if form.rule == "kdn_exact":
        # P_bar k of the whole head first, over the rows of P: the step's second axis then
        # updates P's rows blocks in place while the head's step writes the memory.
        predicted = memory.new_empty(batch * heads, 2, key_dim)
        blocks = triton.cdiv(key_dim, COVARIANCE_ROWS)
        _exact_predict_kernel[(batch * heads, blocks)](
            k[0], k[1], conv_weights[1], caches[1], *rows["decay"], placeholder["A_log"],
            placeholder["dt_bias"], *rows["noise"], placeholder["p_inf_raw"],
            placeholder["precision"], predicted, heads, key_dim, float(l2_eps),
            **constants, DEPENDENT=dependent, num_warps=warps, launch_pdl=dependent,
        )  # fmt: skip
        parts += blocks
    _fused_step_kernel[(batch * heads, parts)](
        q[0], k[0], v[0], q[1], k[1], v[1], *conv_weights, *caches,
        *_row(gate, memory), *rows["beta"], *rows["write"], *rows["decay"],
        placeholder["A_log"], placeholder["dt_bias"], *rows["read"], placeholder["read_log"],
        *rows["noise"], *rows["obs"], placeholder["p_inf_raw"], placeholder["precision"],
        predicted, memory, norm_weight, out,
        heads, key_dim, value_dim, float(scale), float(l2_eps), float(norm_eps), float(r_min),
        float(info_scale), **constants, BV=block_v, RULE=RULES.index(form.rule),
        READ_FORM=READS.index(form.read), GATE_ACT=GATES[form.gate_activation],
        ONE_BLOCK=block_v >= value_dim, DEPENDENT=dependent, num_warps=warps,
        launch_pdl=dependent,
    )  # fmt: skip
    return out


RULE_INPUTS = ("beta", "write", "decay", "read", "noise", "obs")
PARAMS = ("A_log", "dt_bias", "read_log", "p_inf_raw", "precision")
