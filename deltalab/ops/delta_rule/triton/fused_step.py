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
program owns one (sequence, head): all K key rows and the V value columns in blocks of BV (the
card's launch table, `FusedStepLaunch`, by the number of programs). With
one block the output norm is taken in registers; with several the raw outputs go to the output
buffer first and are normalized in a second pass (a barrier between: other threads wrote them).
Caches and the state are read before they are written by the same program; a barrier separates
a cache's reads from its shifted write, which another thread of the program may make.

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
# 16, 0 to 48 bytes a thread by the form otherwise (Exact KDN 1248).
ONE_BLOCK_TILE = 16384
LOOP_TILE = 8192
VALUES_PER_WARP = 32 * 32
MIN_WARPS, MAX_WARPS = 4, 16
MIN_BLOCK = 16


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
def _conv_silu(X, stride_x, WEIGHT, CACHE, b, ch, ch_ok, C, W: tl.constexpr, BW: tl.constexpr):
    """silu of one token's short convolution on channels `ch` of sequence b (float32), the
    cache `[B, C, W-1]` shifted in place to end with the token."""
    x = tl.load(X + b * stride_x + ch, mask=ch_ok, other=0.0)
    taps = tl.arange(0, BW)
    held = ch_ok[:, None] & (taps[None, :] < W - 1)
    at = CACHE + b * C * (W - 1) + ch[:, None] * (W - 1) + taps[None, :]
    cache = tl.load(at, mask=held, other=0.0).to(tl.float32)
    w = tl.load(WEIGHT + ch[:, None] * W + taps[None, :], mask=held, other=0.0).to(tl.float32)
    w_last = tl.load(WEIGHT + ch * W + (W - 1), mask=ch_ok, other=0.0).to(tl.float32)
    z = tl.sum(cache * w, axis=1) + w_last * x.to(tl.float32)
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
def _kalman_gain(k, g, NOISE, stride_noise, OBS, stride_obs, P_INF, PRECISION, b, h, bh, kch,
                 rows, row_ok, K, r_min, info_scale, FILTER: tl.constexpr,
                 TIED: tl.constexpr):  # fmt: skip
    """The KDN write direction a `[BK]` from the filter's state (updated in place) and the noise
    model (module docstring). FILTER: 0 isotropic (precision `[B, H]`), 1 diagonal (precision
    `[B, H, K]`), 2 exact (covariance `[B, H, K, K]`); the process noise is per channel but
    for the isotropic filter."""
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
        tl.store(PRECISION + bh, 1.0 / p_bar + info_scale * norm2 / (K * r))
        a = p_bar / (p_bar * norm2 + r) * k
    elif FILTER == 1:
        at = PRECISION + bh * K + rows
        p_bar = decay2 / tl.load(at, mask=row_ok, other=1.0) + q_noise
        weighted = tl.where(row_ok, p_bar * k, 0.0)
        predictive = tl.sum(weighted * k)
        tl.store(at, 1.0 / p_bar + info_scale * k * k / r, mask=row_ok)
        a = weighted / (predictive + r)
    else:
        a = _exact_gain(k, g, q_noise, r, PRECISION, bh, rows, row_ok, K)
    return a


@triton.jit
def _exact_gain(k, g, q_noise, r, COVARIANCE, bh, rows, row_ok, K):
    """Exact KDN's gain, its covariance P updated in place by the Joseph form (`exact_gain`):
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
    p = (
        p
        + (denominator * gain[:, None] - pk[:, None]) * gain[None, :]
        - gain[:, None] * pk[None, :]
    )
    tl.store(head + tile, p, mask=tile_ok)
    tl.debug_barrier()
    return gain


@triton.jit
def _state_tile(MEMORY, bh, rows, row_ok, start, K, V, BV: tl.constexpr):
    """The state's value columns start..start+BV of the head (zeros past V: a block past the
    head loads nothing)."""
    # The head's base pointer once, the tile's offsets in 32 bits (fewer registers than 64-bit
    # addresses; a head holds far fewer than 2^31 values).
    cols = start + tl.arange(0, BV)
    tile = rows[:, None] * V + cols[None, :]
    return tl.load(MEMORY + bh * K * V + tile, mask=row_ok[:, None] & (cols < V)[None, :],
                   other=0.0)  # fmt: skip


@triton.jit
def _value_block(start, s, V_IN, stride_v, WV, CV, WRITE, stride_write, MEMORY, q, a, bk,
                 decay, OUT, b, h, bh, rows, row_ok, H, K, V, RULE: tl.constexpr,
                 W: tl.constexpr, BW: tl.constexpr, BV: tl.constexpr):  # fmt: skip
    """Value columns start..start+BV of the head, their state tile s (`_state_tile`): v's
    convolution (and write gate), the tile's update stored in place; returns (cols, col_ok, o
    rounded to the output dtype, as float32)."""
    cols = start + tl.arange(0, BV)
    col_ok = cols < V
    vch = h * V + cols
    u = _conv_silu(V_IN, stride_v, WV, CV, b, vch, col_ok, H * V, W, BW)
    if RULE == 1:
        write = tl.load(WRITE + b * stride_write + vch, mask=col_ok, other=0.0).to(tl.float32)
        u = u * tl.sigmoid(write)
    head = MEMORY + bh * K * V
    tile = rows[:, None] * V + cols[None, :]
    tile_ok = row_ok[:, None] & col_ok[None, :]
    s = s * decay[:, None]
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
    NOISE, stride_noise, OBS, stride_obs, P_INF, PRECISION, MEMORY, NORM_W, OUT,
    H, K, V, scale, l2_eps, norm_eps, r_min, info_scale,
    W: tl.constexpr, BW: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DECAY: tl.constexpr, RULE: tl.constexpr, READ_FORM: tl.constexpr, TIED: tl.constexpr,
    GATE_ACT: tl.constexpr, ONE_BLOCK: tl.constexpr,
):  # fmt: skip
    # 64-bit bases (a sequence's rows, a head's state) and 32-bit offsets within them: fewer
    # registers for the address tensors.
    bh = tl.program_id(0).to(tl.int64)
    b = bh // H
    h = (bh % H).to(tl.int32)
    rows = tl.arange(0, BK)
    row_ok = rows < K
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
        a = _kalman_gain(k, g, NOISE, stride_noise, OBS, stride_obs, P_INF, PRECISION, b, h, bh,
                         kch, rows, row_ok, K, r_min, info_scale, RULE - 2, TIED)  # fmt: skip
    decay = tl.exp(g)
    if ONE_BLOCK:
        s = _state_tile(MEMORY, bh, rows, row_ok, 0, K, V, BV)
        cols, col_ok, o = _value_block(0, s, V_IN, stride_v, WV, CV, WRITE, stride_write, MEMORY,
                                       q, a, bk, decay, OUT, b, h, bh, rows, row_ok, H, K, V,
                                       RULE, W, BW, BV)  # fmt: skip
        _norm_out(o, tl.sum(o * o), cols, col_ok, GATE, stride_gate, NORM_W, OUT, b, h, bh, V,
                  norm_eps, GATE_ACT)  # fmt: skip
    else:
        sumsq = tl.sum(tl.zeros([BV], dtype=tl.float32))
        # Each block's state tile is loaded one block ahead: the next tile's read is in flight
        # while this one is updated (Triton does not pipeline this walk by num_stages).
        ahead = _state_tile(MEMORY, bh, rows, row_ok, 0, K, V, BV)
        for start in tl.range(0, V, BV, num_stages=1):
            s = ahead
            ahead = _state_tile(MEMORY, bh, rows, row_ok, start + BV, K, V, BV)
            cols, col_ok, o = _value_block(start, s, V_IN, stride_v, WV, CV, WRITE, stride_write,
                                           MEMORY, q, a, bk, decay, OUT, b, h, bh, rows, row_ok, H,
                                           K, V, RULE, W, BW, BV)  # fmt: skip
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
    table: FusedStepLaunch, rule: str, programs: int, key_dim: int, value_dim: int,
    aligned: bool = True,
) -> tuple[int, int, int]:  # fmt: skip
    """(BK, BV, warps) of `programs` programs by `table`, where the table was measured: a form
    whose state is the memory alone, K and V multiples of 16 and every tensor's address a
    multiple of 16 bytes (`aligned`: what Triton's launcher declares to the compiler). Elsewhere
    `launch`'s whole head: compiled for sm_90 at the table's 2-4 warps, Exact KDN's K x K
    covariance spills 0.1-2 KB a thread, other sizes or addresses 2.5-3.1 KB (against 0 to 48
    bytes in one 16-warp block). The inputs' row strides change no spill."""
    if rule == "kdn_exact" or not aligned:
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
    launch table, through `table_launch`; None: the card's, `LAUNCH_TABLES`).
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
        block_k, block_v, warps = table_launch(table, form.rule, batch * heads, key_dim,
                                               value_dim, aligned)  # fmt: skip
    _fused_step_kernel[(batch * heads,)](
        q[0], k[0], v[0], q[1], k[1], v[1], *conv_weights, *caches,
        *_row(gate, memory), *rows["beta"], *rows["write"], *rows["decay"],
        placeholder["A_log"], placeholder["dt_bias"], *rows["read"], placeholder["read_log"],
        *rows["noise"], *rows["obs"], placeholder["p_inf_raw"], placeholder["precision"],
        memory, norm_weight, out,
        heads, key_dim, value_dim, float(scale), float(l2_eps), float(norm_eps), float(r_min),
        float(info_scale),
        W=width, BW=max(1, triton.next_power_of_2(max(width - 1, 1))), BK=block_k, BV=block_v,
        DECAY=DECAYS.index(form.decay), RULE=RULES.index(form.rule),
        READ_FORM=READS.index(form.read), TIED=form.tied, GATE_ACT=GATES[form.gate_activation],
        ONE_BLOCK=block_v >= value_dim,
        num_warps=warps,
    )  # fmt: skip
    return out


RULE_INPUTS = ("beta", "write", "decay", "read", "noise", "obs")
PARAMS = ("A_log", "dt_bias", "read_log", "p_inf_raw", "precision")
