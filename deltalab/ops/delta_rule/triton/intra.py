"""Triton stage 1 of the chunkwise delta rule: the intra-chunk matrices L and M, and their adjoint.

For inputs q, a, b [B, T, H, K] (a also [B, T, H]: a strength per token, a_t b_t, multiplied in
on load) and g [B, T, H, K] (per channel) or [B, T, H] (per head), read
in place (`Tokens` below: no copy into chunks, any float dtype, q scaled on load), per chunk

    L_ts = sum_k b_tk a_sk exp(G_tk - G_sk)   (s < t)      M_ts = same with q_t   (s <= t)

with G the cumulative log decay. This is `chunk.py`'s `intra_chunk` (its PyTorch twin, which the
tests compare it with) written as one program per row sub-block of a chunk (the adjoint: per
sub-block and block of channels).

Stability, as in `chunk.py`: no exponent is a difference of prefix sums and none is positive.
The chunk is cut into sub-blocks of BT = 16 tokens. For a row sub-block I and an earlier column
sub-block J the factor splits at the start of I:

    exp(G_t - G_s) = exp(sum_{start(I) <= j <= t} g_j)                  row factor    <= 1
                   * exp(sum_{s < j < start(I)} g_j)                     column factor <= 1

the row factor a cumulative sum inside I, the column factor a reverse cumulative sum inside J
(from the token after s) plus the totals of the sub-blocks strictly between, accumulated as sums.
Inside a diagonal sub-block the factors are pairwise: the rows t are walked in order with the
segment sums sum_{s < j <= t} g_j of every column s in a [BT, channels] tile, each row's from
the previous row's plus g_t (`_next_segment`): exact running sums, no cumulative scan over a
three-dimensional tile (which spilled registers and cost most of the kernel's time). Every exponent is a sum of log decays, so g = -inf (a full reset) gives
exact zeros and strong decays mixed with weak ones keep float32 precision.

That walk is serial (16 dependent steps per sub-block) and cost most of the stage's time on an
H200 (0.6 of 1.1 ms forward, 2.9 of 3.8 ms adjoint, B=4 T=4096 H=16 K=128). So a diagonal
sub-block whose decays are mild takes the factored form instead, two tensor-core products:

    exp(G_t - G_s) = exp(c_t - m) * exp(m - c_s),   c the cumulative sum of g inside the
                                                     sub-block, m the middle of c's range,

per channel, taken only when every |c| of the sub-block (every channel of the program) is below
`DIAGONAL_FACTOR_BOUND` = 80, a runtime test per sub-block. c falls from g_first <= 0 to -depth
across the sub-block (g <= 0), so the midpoint m keeps both exponents within depth / 2 < 40: no
factor exceeds e^40 ~ 2e17 (float32 holds 3e38, with room for |a| |b| K). A masked pair s > t
has exp(c_t - c_s) up to e^80 ~ 6e34 per channel; times sum_k |b_tk a_sk| it overflows only for
inputs far larger than unit keys give, and even then the mask selects (tl.where) rather than
multiplies, so nothing of it reaches an output; the adjoint zeroes the masked pairs before its
products. Without the shift (m = 0) the column factor alone reaches e^depth, which allowed only
half the depth. The price is precision: c_t and c_s are rounded separately, each a running sum
of up to 16 log decays that reaches up to 80 in magnitude, so a factor is off by ~1e-6
relative, typically, and up to ~1e-5 (measured under the interpreter at depths 60-80; the walk's
own running sums err as much over long segments, less over the short ones that dominate), far
below the TF32 products' 1e-3 that bf16 inputs get anyway. A sub-block with stronger decays (a mean
log decay below -5 per token in one channel, or a reset at -inf) keeps the exact walk, so the
stability argument above holds everywhere. On an H200 the walk cost 2x the factored forward and
4.6x its adjoint (bf16, g in [-8, 0] against [-0.1, 0]), and a tree of masked
products in its place was no faster (reverted: `005e794`).

Adjoint: with c_tsk the contribution of one (t, s, k) term,
    dq_t = sum_s dM_ts a_s * f_ts,   db_t = sum_s dL_ts a_s * f_ts,
    da_s = sum_t (dM_ts q_t + dL_ts b_t) * f_ts,
and since d f_ts / d g_j = f_ts for s < j <= t,
    dg_j = sum_{t >= j} (q_t dq_t + b_t db_t) - sum_{s >= j} a_s da_s   (per channel, in the chunk),
a reverse cumulative sum: every pair (t, s) with s, t >= j appears in both sums and cancels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deltalab.ops.delta_rule.chunk import padded_chunk_size
from deltalab.ops.norms import L2_EPS

# Tokens per sub-block: the smallest tile of a tensor-core product, and the number of rows a
# diagonal sub-block walks one at a time.
SUB_BLOCK = 16
# Largest |cumulative log decay| inside a diagonal sub-block for which it is factored (module
# docstring); 0 forces the walk everywhere (the tests run both).
DIAGONAL_FACTOR_BOUND = 80.0


@dataclass(frozen=True)
class TileLaunch:
    """The launch table of a kernel of stages 1-2 (stage 1, the factors, the solve): its block
    (channels or columns per program) and its options. Each such module keeps one, private,
    `LAUNCH`; its launch functions take another as an argument (`tune_triton.py` sweeps them,
    tests reach at tiny shapes the blocks of large ones)."""

    block: int
    num_warps: int
    # One pipeline stage: the loops are short and their tiles change every iteration.
    num_stages: int = 1

    @property
    def options(self) -> dict[str, int]:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


# Stage 1's launch: one warp, and the adjoint with 64 channels per program (the
# sub-block tiles are 16 rows: more warps only split them thinner). Measured on the H200
# (`tune_triton.py`, B=4 T=4096 H=16 K=128, chunk 64, mild decays, 2026-12-01): forward 0.357 ms
# with 1 warp against 0.487 with 2 and 0.773 with 4 (whatever the channel block); adjoint 0.850
# ms at 64 channels with 1 warp against 0.944 at 128 with 2 (the setting before), 1.175 at 64 with
# 2 and 1.856 at 128 with 1.
LAUNCH = TileLaunch(block=64, num_warps=1)
# eps inside the square root of q's and b's norms with `qk_l2norm` (`deltalab.ops.norms.l2_normalize`).
UNIT_EPS: tl.constexpr = tl.constexpr(L2_EPS)
# Stage 1's products widen every operand to float32 (TF32 or IEEE products). Products in the
# inputs' 16-bit dtype (79df509) were measured on the H200 and deleted: the GDN-2 form's forward
# and backward 5.66 -> 5.61 ms at B=4 T=4096 H=16, within the spread of two runs of one setting
# (2026-12-02).


def chunk_count(x: torch.Tensor) -> int:
    """The number of chunks of a chunked tensor [..., C, *]: one program each."""
    return x.numel() // (x.shape[-1] * x.shape[-2])


class Tokens(NamedTuple):
    """How the kernels find chunk `i` (ordered batch, head, chunk, as the chunked intermediates
    [B, H, n, C, *] are) in token-major inputs [B, T, H, *]: chunk i = (b, h, j) holds the tokens
    j * chunk_size ... of sequence b, head h, its rows past `chunk_size` or past T read as zero.

    A chunked tensor [..., C, *] is the case of one chunk per "sequence" (`Tokens.of_chunks`),
    which is how the stage twins are tested on chunked inputs."""

    chunks: int  # n: chunks per (sequence, head)
    heads: int  # H
    length: int  # T
    chunk_size: int  # tokens per chunk (<= the tile's C, which is padded to 16 * 2^m)
    # G: heads per head of q and b (grouped value heads: q, b [B, T, H / G, K], head h reading
    # their head h // G; a, u, g have H heads).
    group: int = 1

    @classmethod
    def of_chunks(cls, x: torch.Tensor) -> Tokens:
        return cls(1, 1, x.shape[-2], x.shape[-2])

    def programs(self, q: torch.Tensor) -> int:
        """Chunks in all, one program each (q: [B, T, H / G, K], or chunked [..., C, K])."""
        return q.numel() // (self.length * q.shape[-1]) * self.chunks * self.group

    def args(self) -> tuple[int, int, int, int]:
        """The kernels' runtime arguments n_chunks, H, T, CS."""
        return self.chunks, self.heads, self.length, self.chunk_size


@triton.jit
def _token_offset(chunk, n_chunks, H, T, CS, X: tl.constexpr):
    """Where chunk `chunk` (ordered b, h, j) starts in a [B, T, H, X] tensor, and how many of its
    rows are tokens (min(CS, T - j * CS)); its rows are H * X elements apart."""
    j = chunk % n_chunks
    bh = chunk // n_chunks
    first = j * CS
    return ((bh // H) * T + first) * H * X + (bh % H) * X, tl.minimum(CS, T - first)


@triton.jit
def _key_layout(chunk, n_chunks, H, T, CS, K: tl.constexpr, GROUP):
    """Where chunk `chunk` (ordered b, h, j over the H heads of u) starts in q, b
    [B, T, H / GROUP, K], whose head h // GROUP head h reads, and their row stride."""
    j = chunk % n_chunks
    bh = chunk // n_chunks
    heads = H // GROUP
    return ((bh // H) * T + j * CS) * heads * K + ((bh % H) // GROUP) * K, heads * K


@triton.jit
def _token_layout(chunk, n_chunks, H, T, CS, K: tl.constexpr, G_HEAD: tl.constexpr):
    """Chunk `chunk`'s offsets in q, b [B, T, H, K] (a: `_a_layout`) and in g ([B, T, H]
    when G_HEAD, one log decay per head, read by `_load_g_rows` once per token), its tokens,
    and the row strides of both."""
    offset, valid = _token_offset(chunk, n_chunks, H, T, CS, K)
    if G_HEAD:
        g_offset, _ = _token_offset(chunk, n_chunks, H, T, CS, 1)
        return offset, valid, H * K, g_offset, H
    return offset, valid, H * K, offset, H * K


@triton.jit
def _load_rows(x, rows, rs, cols, cs, valid, mk):
    """x[rows, cols] as float32 [len(rows), len(cols)], zero past the chunk's tokens and K."""
    mask = (rows < valid)[:, None] & mk[None, :]
    return tl.load(x + rows[:, None] * rs + cols[None, :] * cs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _load_per_row(x, rows, rs, valid):
    """x[rows] [len(rows)] as float32 of a tensor with one value per token and head [B, T, H]
    (a per-head log decay, a write strength), zero past the chunk's tokens."""
    return tl.load(x + rows * rs, mask=rows < valid, other=0.0).to(tl.float32)


@triton.jit
def _load_g_rows(g, rows, grs, cols, valid, mk, G_HEAD: tl.constexpr):
    """The log decays g[rows, cols] as float32 [len(rows), len(cols)], zero past the chunk's
    tokens and K. A per-head g (G_HEAD) is read once per row and broadcast over the channels:
    a tile of loads at channel stride 0 cannot be vectorized and made stage 1 of the per-head
    form 2.4x slower than the per-channel one (H200, B=1 T=32768 H=16;
    2026-12-04)."""
    if G_HEAD:
        return tl.where(mk[None, :], _load_per_row(g, rows, grs, valid)[:, None], 0.0)
    return _load_rows(g, rows, grs, cols, 1, valid, mk)


@triton.jit
def _load_g_row(g, row, grs, cols, valid, mk, G_HEAD: tl.constexpr):
    """The log decays g[row, cols] as float32, zero past the chunk's tokens and K (a per-head
    g read once, as in `_load_g_rows`)."""
    if G_HEAD:
        present = mk & ((cols * 0 + row) < valid)
        per_row = tl.load(g + row * grs, mask=row < valid, other=0.0).to(tl.float32)
        return tl.where(present, per_row, 0.0)
    return _load_row(g, row, grs, cols, 1, valid, mk)


@triton.jit
def _load_row(x, row, rs, cols, cs, valid, mk):
    """x[row, cols] as float32, zero past the chunk's tokens and K."""
    # The row test is made a vector: Triton's interpreter refuses a vector mask and'ed with a
    # scalar one (compiled, both are the same predicate).
    present = mk & ((cols * 0 + row) < valid)
    return tl.load(x + row * rs + cols * cs, mask=present, other=0.0).to(tl.float32)


@triton.jit
def _a_layout(chunk, n_chunks, H, T, CS, offset, rs, A_ROW: tl.constexpr):
    """Chunk `chunk`'s offset in a and a's row stride: those of q (`offset`, `rs`) for a
    [B, T, H, K]; with A_ROW, a is one write strength per token [B, T, H] (a_t = a_t b_t, the
    DeltaNet family's beta), laid out as a per-head log decay."""
    if A_ROW:
        a_offset, _ = _token_offset(chunk, n_chunks, H, T, CS, 1)
        return a_offset, H
    return offset, rs


@triton.jit
def _chunk_inputs(q, a, b, g, chunk, n_chunks, H, T, CS, GROUP, K: tl.constexpr,
                  G_HEAD: tl.constexpr, A_ROW: tl.constexpr):  # fmt: skip
    """q, a, b and g moved to chunk `chunk`'s first token (`_key_layout`, `_token_layout`,
    `_a_layout`), its tokens, and the row strides of q and b, of a and of g."""
    offset, valid, rs, g_offset, grs = _token_layout(chunk, n_chunks, H, T, CS, K, G_HEAD)
    a_offset, ars = _a_layout(chunk, n_chunks, H, T, CS, offset, rs, A_ROW)
    key_offset, krs = _key_layout(chunk, n_chunks, H, T, CS, K, GROUP)
    return q + key_offset, a + a_offset, b + key_offset, g + g_offset, valid, krs, ars, grs


@triton.jit
def _load_a(a, b, rows, ars, rs, cols, valid, mk, A_ROW: tl.constexpr, b_norm, nrs,
            UNIT: tl.constexpr, WHOLE: tl.constexpr):  # fmt: skip
    """a[rows, cols] as float32 [len(rows), len(cols)], zero past the chunk's tokens and K; with
    A_ROW formed on load as each row's strength times b's row (b offset as a's rows are; made
    unit-norm with UNIT, `_unit_rows`): the product a = beta b is never written to memory, and
    its gradient splits into b's and beta's where the adjoint ends (`factors._factors_bwd`)."""
    if A_ROW:
        strength = _load_per_row(a, rows, ars, valid)
        b_rows = _load_rows(b, rows, rs, cols, 1, valid, mk)
        return _unit_rows(b_rows, b_norm, rows, nrs, valid, UNIT, WHOLE) * strength[:, None]
    return _load_rows(a, rows, ars, cols, 1, valid, mk)


@triton.jit
def _inverse_norms(x):
    """1 / sqrt(|x_r|^2 + eps) of every row r of x [R, channels] (whole rows)."""
    return tl.rsqrt(tl.sum(x * x, axis=1) + UNIT_EPS)


@triton.jit
def _unit_rows(x, norms, rows, nrs, valid, UNIT: tl.constexpr, WHOLE: tl.constexpr):
    """Rows of q or b x [R, channels] made unit-norm when UNIT (`qk_l2norm`): with WHOLE, x
    holds whole rows and their inverse norms are formed from it; else read from `norms`, one
    float32 per token at row stride `nrs` (stage 1's forward wrote them)."""
    if UNIT:
        if WHOLE:
            x = x * _inverse_norms(x)[:, None]
        else:
            x = x * _load_per_row(norms, rows, nrs, valid)[:, None]
    return x


@triton.jit
def _unit_row(x, norms, row, nrs, valid, UNIT: tl.constexpr, WHOLE: tl.constexpr):
    """One row x [channels] of q or b as `_unit_rows` makes it."""
    if UNIT:
        if WHOLE:
            x = x * tl.rsqrt(tl.sum(x * x, axis=0) + UNIT_EPS)
        else:
            x = x * tl.load(norms + row * nrs, mask=row < valid, other=0.0)
    return x


@triton.jit
def _norm_layout(q_norm, b_norm, chunk, n_chunks, H, T, CS):
    """The inverse norms of q and b (one float32 per token [B, T, H], `qk_l2norm`) moved to
    chunk `chunk`'s first token, and their row stride."""
    offset, _ = _token_offset(chunk, n_chunks, H, T, CS, 1)
    return q_norm + offset, b_norm + offset, H


def key_block(key_dim: int) -> int:
    """K padded to a power of two of at least 16 (tl.dot needs an inner dimension of 8 or more
    on NVIDIA GPUs; 16 fills a tensor-core tile). The padded channels are masked to zero."""
    return max(16, triton.next_power_of_2(key_dim))


@triton.jit
def _operand(x, like, LOW_DOTS: tl.constexpr):
    """x as a product's operand: in the dtype `like` points to with LOW_DOTS (16-bit products,
    float32 accumulators: the state pass's 16-bit operators as stored), else in float32 (TF32
    or IEEE products)."""
    if LOW_DOTS:
        x = x.to(like.dtype.element_ty)
    else:
        x = x.to(tl.float32)
    return x


@triton.jit
def _next_segment(seg, g, row, rt, rk, mk, t, grs, valid, G_HEAD: tl.constexpr):
    """Row t's segment sums sum_{s < j <= t} g_j over the sub-block's columns s: [BT(s), BK].

    Built from row t - 1's by adding g_t (s < t), 0 at s = t, -inf above (s > t): a running sum,
    never a difference, so g = -inf gives exact zeros and no exponent is positive."""
    g_t = _load_g_row(g, row, grs, rk, valid, mk, G_HEAD)
    return tl.where(rt[:, None] == t, 0.0, seg + g_t[None, :])


@triton.jit
def _diag_fwd(q, a, b, g, lower, attend, rows, rs, ars, grs, valid, scale, K: tl.constexpr,
              C: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, A_ROW: tl.constexpr,
              G_HEAD: tl.constexpr, UNIT: tl.constexpr):  # fmt: skip
    """L and M of diagonal sub-block `rows`, one row t at a time with exact pairwise factors
    (whole rows: with UNIT, q and b are made unit-norm from them)."""
    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    mk = rk < K
    a_d = _load_a(a, b, rows + rt, ars, rs, rk, valid, mk, A_ROW, b, 0, UNIT, True)
    seg = tl.full([BT, BK], float("-inf"), dtype=tl.float32)
    for t in range(BT):
        row = rows + t
        seg = _next_segment(seg, g, row, rt, rk, mk, t, grs, valid, G_HEAD)
        a_f = tl.exp(seg) * a_d
        b_t = _unit_row(_load_row(b, row, rs, rk, 1, valid, mk), b, row, 0, valid, UNIT, True)
        q_t = _unit_row(_load_row(q, row, rs, rk, 1, valid, mk), q, row, 0, valid, UNIT, True)
        q_t *= scale
        l_t = tl.where(rt < t, tl.sum(a_f * b_t[None, :], axis=1), 0.0)
        m_t = tl.sum(a_f * q_t[None, :], axis=1)
        tl.store(lower + row * C + rows + rt, l_t)
        tl.store(attend + row * C + rows + rt, m_t.to(attend.dtype.element_ty))


@triton.jit
def _diag_bwd(q, a, b, g, qn, bn, nrs, d_lower, d_attend, rows, rkd, mkd, rs, ars, grs, valid,
              scale, C: tl.constexpr, BKD: tl.constexpr, BT: tl.constexpr, A_ROW: tl.constexpr,
              G_HEAD: tl.constexpr, UNIT: tl.constexpr):  # fmt: skip
    """The diagonal sub-block's share of (dq, db, da) [BT, BKD] for channels rkd (with UNIT,
    of the unit-norm q and b, their inverse norms read from qn, bn)."""
    rt = tl.arange(0, BT)
    a_d = _load_a(a, b, rows + rt, ars, rs, rkd, valid, mkd, A_ROW, bn, nrs, UNIT, False)
    seg = tl.full([BT, BKD], float("-inf"), dtype=tl.float32)
    dq_d = tl.zeros([BT, BKD], dtype=tl.float32)
    db_d = tl.zeros([BT, BKD], dtype=tl.float32)
    da_d = tl.zeros([BT, BKD], dtype=tl.float32)
    for t in range(BT):
        row = rows + t
        seg = _next_segment(seg, g, row, rt, rkd, mkd, t, grs, valid, G_HEAD)
        f = tl.exp(seg)
        dm_t = tl.load(d_attend + row * C + rows + rt, mask=rt <= t, other=0.0)
        dl_t = tl.load(d_lower + row * C + rows + rt, mask=rt < t, other=0.0)
        q_t = _unit_row(_load_row(q, row, rs, rkd, 1, valid, mkd), qn, row, nrs, valid, UNIT,
                        False) * scale  # fmt: skip
        b_t = _unit_row(_load_row(b, row, rs, rkd, 1, valid, mkd), bn, row, nrs, valid, UNIT,
                        False)  # fmt: skip
        a_f = f * a_d
        at_t = rt[:, None] == t
        dq_d = tl.where(at_t, tl.sum(dm_t[:, None] * a_f, axis=0)[None, :], dq_d)
        db_d = tl.where(at_t, tl.sum(dl_t[:, None] * a_f, axis=0)[None, :], db_d)
        da_d += (dm_t[:, None] * q_t[None, :] + dl_t[:, None] * b_t[None, :]) * f
    return dq_d, db_d, da_d


@triton.jit
def _midpoint_factors(cum):
    """The factored diagonal's row and column factors exp(c_t - m), exp(m - c_s) [BT, BK], with
    m the middle of c's range over the sub-block, per channel: both exponents stay within half
    that range (module docstring). With g <= 0 the range is [c_last, g_first], inside
    [-depth, 0]; for inputs outside that contract (g > 0) the exponents still stay below the
    bound, so the factors stay finite."""
    mid = 0.5 * (tl.max(cum, axis=0) + tl.min(cum, axis=0))
    return tl.exp(cum - mid[None, :]), tl.exp(mid[None, :] - cum)


@triton.jit
def _column_tail(g, cols, rt, rk, mk, grs, valid, BT: tl.constexpr, G_HEAD: tl.constexpr):
    """Sum of g from the token after s to the end of its sub-block, for every s: [BT, BK]."""
    after = rt + 1
    # Rows past the sub-block read as zero through the token bound.
    g_after = _load_g_rows(g, cols + after, grs, rk, tl.minimum(valid, cols + BT), mk, G_HEAD)
    return tl.cumsum(g_after, axis=0, reverse=True)


@triton.jit
def _column_factor(g, cols, rt, rk, mk, between, grs, valid, BT: tl.constexpr,
                   G_HEAD: tl.constexpr):  # fmt: skip
    """exp(_column_tail + `between`): [BT, BK]."""
    return tl.exp(_column_tail(g, cols, rt, rk, mk, grs, valid, BT, G_HEAD) + between[None, :])


@triton.jit
def _intra_fwd(
    q, a, b, g, q_norm, b_norm, lower, attend, n_chunks, H, T, CS, scale, GROUP,
    K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, G_HEAD: tl.constexpr,
    PRECISION: tl.constexpr, BOUND: tl.constexpr, A_ROW: tl.constexpr, UNIT: tl.constexpr,
):  # fmt: skip
    """Row sub-block i = program_id(1) of L and M: its blocks left of, on and right of (zeros)
    the diagonal. One program per sub-block rather than per chunk: four times the programs,
    each a quarter of the serial chain (chunk 64). With UNIT (`qk_l2norm`) every q and b row is
    made unit-norm as it is loaded (whole rows: the norms are formed here), and the program
    writes the inverse norms of its rows to q_norm, b_norm for the kernels that load rows in
    channel blocks."""
    chunk = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    q, a, b, g, valid, rs, ars, grs = _chunk_inputs(
        q, a, b, g, chunk, n_chunks, H, T, CS, GROUP, K, G_HEAD, A_ROW
    )
    rows = i * BT
    lower += chunk * C * C + rows * C
    attend += chunk * C * C + rows * C
    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    mk = rk < K
    tile = rt[:, None] * C + rt[None, :]
    cum = tl.cumsum(_load_g_rows(g, rows + rt, grs, rk, valid, mk, G_HEAD), axis=0)
    row_f = tl.exp(cum)
    b_i = _load_rows(b, rows + rt, rs, rk, 1, valid, mk)
    q_i = _load_rows(q, rows + rt, rs, rk, 1, valid, mk)
    if UNIT:
        qn, bn, nrs = _norm_layout(q_norm, b_norm, chunk, n_chunks, H, T, CS)
        q_r, b_r = _inverse_norms(q_i), _inverse_norms(b_i)
        tl.store(qn + (rows + rt) * nrs, q_r, mask=rows + rt < valid)
        tl.store(bn + (rows + rt) * nrs, b_r, mask=rows + rt < valid)
        q_i *= q_r[:, None]
        b_i *= b_r[:, None]
    b_i *= row_f
    q_i *= row_f * scale
    between = tl.zeros([BK], dtype=tl.float32)
    for jj in range(i):
        cols = (i - 1 - jj) * BT
        a_j = _load_a(a, b, cols + rt, ars, rs, rk, valid, mk, A_ROW, b, 0, UNIT, True)
        a_j *= _column_factor(g, cols, rt, rk, mk, between, grs, valid, BT, G_HEAD)
        tl.store(lower + cols + tile, tl.dot(b_i, tl.trans(a_j), input_precision=PRECISION))
        m_ij = tl.dot(q_i, tl.trans(a_j), input_precision=PRECISION)
        tl.store(attend + cols + tile, m_ij.to(attend.dtype.element_ty))
        between += tl.sum(_load_g_rows(g, cols + rt, grs, rk, valid, mk, G_HEAD), axis=0)
    if tl.max(tl.abs(cum)) < BOUND:  # mild decays: the factored diagonal (docstring)
        up, down = _midpoint_factors(cum)
        a_i = _load_a(a, b, rows + rt, ars, rs, rk, valid, mk, A_ROW, b, 0, UNIT, True) * down
        b_d = _unit_rows(_load_rows(b, rows + rt, rs, rk, 1, valid, mk), b, rows, 0, valid, UNIT,
                         True) * up  # fmt: skip
        q_d = _unit_rows(_load_rows(q, rows + rt, rs, rk, 1, valid, mk), q, rows, 0, valid, UNIT,
                         True) * (up * scale)  # fmt: skip
        l_ii = tl.dot(b_d, tl.trans(a_i), input_precision=PRECISION)
        m_ii = tl.dot(q_d, tl.trans(a_i), input_precision=PRECISION)
        tl.store(lower + rows + tile, tl.where(rt[:, None] > rt[None, :], l_ii, 0.0))
        m_ii = tl.where(rt[:, None] >= rt[None, :], m_ii, 0.0)
        tl.store(attend + rows + tile, m_ii.to(attend.dtype.element_ty))
    else:
        _diag_fwd(q, a, b, g, lower - rows * C, attend - rows * C, rows, rs, ars, grs,
                  valid, scale, K, C, BK, BT, A_ROW, G_HEAD, UNIT)  # fmt: skip
    zero = tl.zeros([BT, BT], dtype=tl.float32)
    for j in range(i + 1, C // BT):
        tl.store(lower + j * BT + tile, zero)
        tl.store(attend + j * BT + tile, zero.to(attend.dtype.element_ty))


@triton.jit
def _intra_bwd(
    q, a, b, g, q_norm, b_norm, d_lower, d_attend, dq, da, db, n_chunks, H, T, CS, scale, GROUP,
    K: tl.constexpr, C: tl.constexpr, BKD: tl.constexpr, BT: tl.constexpr, G_HEAD: tl.constexpr,
    PRECISION: tl.constexpr, BOUND: tl.constexpr, A_ROW: tl.constexpr, UNIT: tl.constexpr,
):  # fmt: skip
    """dq, da, db [chunks, C, K] float32, chunked (what `_factors_bwd` adds its share to), of
    sub-block i = program_id(2) and channels program_id(1): dq, db of its rows (columns s <= t)
    and da of its columns (rows t >= s), the diagonal block shared by both. dq is the gradient
    of the scaled q (the caller applies the scale once, at the end). With UNIT, q and b rows
    are made unit-norm on load from the inverse norms the forward wrote, and the gradients are
    those of the unit-norm rows (`factors._factors_bwd` closes the chain)."""
    chunk = tl.program_id(0).to(tl.int64)
    kb = tl.program_id(1)
    i = tl.program_id(2)
    q, a, b, g, valid, rs, ars, grs = _chunk_inputs(
        q, a, b, g, chunk, n_chunks, H, T, CS, GROUP, K, G_HEAD, A_ROW
    )
    qn, bn, nrs = _norm_layout(q_norm, b_norm, chunk, n_chunks, H, T, CS)
    d_lower += chunk * C * C
    d_attend += chunk * C * C
    rt = tl.arange(0, BT)
    rkd = kb * BKD + tl.arange(0, BKD)
    mkd = rkd < K
    tile = rt[:, None] * C + rt[None, :]
    rows = i * BT
    cum = tl.cumsum(_load_g_rows(g, rows + rt, grs, rkd, valid, mkd, G_HEAD), axis=0)
    row_f = tl.exp(cum)
    # Rows: dq and db of sub-block i from the columns s < start(i).
    acc_q = tl.zeros([BT, BKD], dtype=tl.float32)
    acc_b = tl.zeros([BT, BKD], dtype=tl.float32)
    between = tl.zeros([BKD], dtype=tl.float32)
    for jj in range(i):
        cols = (i - 1 - jj) * BT
        a_j = _load_a(a, b, cols + rt, ars, rs, rkd, valid, mkd, A_ROW, bn, nrs, UNIT, False)
        a_j *= _column_factor(g, cols, rt, rkd, mkd, between, grs, valid, BT, G_HEAD)
        dm = tl.load(d_attend + rows * C + cols + tile)
        dl = tl.load(d_lower + rows * C + cols + tile)
        acc_q += tl.dot(dm, a_j, input_precision=PRECISION)
        acc_b += tl.dot(dl, a_j, input_precision=PRECISION)
        between += tl.sum(_load_g_rows(g, cols + rt, grs, rkd, valid, mkd, G_HEAD), axis=0)
    # The diagonal block: its share of all three.
    if tl.max(tl.abs(cum)) < BOUND:  # mild decays: the factored diagonal (docstring)
        up, down = _midpoint_factors(cum)
        a_i = _load_a(a, b, rows + rt, ars, rs, rkd, valid, mkd, A_ROW, bn, nrs, UNIT, False)
        a_i *= down
        q_i = _unit_rows(_load_rows(q, rows + rt, rs, rkd, 1, valid, mkd), qn, rows + rt, nrs,
                         valid, UNIT, False) * (up * scale)  # fmt: skip
        b_i = _unit_rows(_load_rows(b, rows + rt, rs, rkd, 1, valid, mkd), bn, rows + rt, nrs,
                         valid, UNIT, False) * up  # fmt: skip
        d_diag = rows * C + rows + tile
        dm = tl.where(rt[:, None] >= rt[None, :], tl.load(d_attend + d_diag), 0.0)
        dl = tl.where(rt[:, None] > rt[None, :], tl.load(d_lower + d_diag), 0.0)
        acc_a = tl.dot(tl.trans(dm), q_i, input_precision=PRECISION)
        acc_a += tl.dot(tl.trans(dl), b_i, input_precision=PRECISION)
        acc_a *= down
        dq_i = acc_q * row_f + up * tl.dot(dm, a_i, input_precision=PRECISION)
        db_i = acc_b * row_f + up * tl.dot(dl, a_i, input_precision=PRECISION)
    else:
        dq_d, db_d, acc_a = _diag_bwd(q, a, b, g, qn, bn, nrs, d_lower, d_attend, rows, rkd, mkd,
                                      rs, ars, grs, valid, scale, C, BKD, BT, A_ROW, G_HEAD,
                                      UNIT)  # fmt: skip
        dq_i = acc_q * row_f + dq_d
        db_i = acc_b * row_f + db_d
    # Columns: da of sub-block i from the rows t >= start(i + 1).
    tail = _column_tail(g, rows, rt, rkd, mkd, grs, valid, BT, G_HEAD)
    between = tl.zeros([BKD], dtype=tl.float32)
    for r in range(i + 1, C // BT):
        later = r * BT
        g_r = _load_g_rows(g, later + rt, grs, rkd, valid, mkd, G_HEAD)
        later_f = tl.exp(tl.cumsum(g_r, axis=0))
        q_r = _unit_rows(_load_rows(q, later + rt, rs, rkd, 1, valid, mkd), qn, later + rt, nrs,
                         valid, UNIT, False) * (later_f * scale)  # fmt: skip
        b_r = _unit_rows(_load_rows(b, later + rt, rs, rkd, 1, valid, mkd), bn, later + rt, nrs,
                         valid, UNIT, False) * later_f  # fmt: skip
        dm = tl.load(d_attend + later * C + rows + tile)
        dl = tl.load(d_lower + later * C + rows + tile)
        part = tl.dot(tl.trans(dm), q_r, input_precision=PRECISION)
        part += tl.dot(tl.trans(dl), b_r, input_precision=PRECISION)
        acc_a += part * tl.exp(tail + between[None, :])
        between += tl.sum(g_r, axis=0)
    rows_k = chunk * C * K + (rows + rt)[:, None] * K + rkd[None, :]
    tl.store(dq + rows_k, dq_i, mask=mkd[None, :])
    tl.store(db + rows_k, db_i, mask=mkd[None, :])
    tl.store(da + rows_k, acc_a, mask=mkd[None, :])


def _g_head(q: torch.Tensor, g: torch.Tensor) -> bool:
    """One log decay per head (g [B, T, H] beside q [B, T, H, K]) rather than per channel."""
    return g.dim() == q.dim() - 1


def _a_row(q: torch.Tensor, a: torch.Tensor) -> bool:
    """One write strength per token (a [B, T, H] beside q [B, T, H, K], a_t = a_t b_t) rather
    than a write direction per token."""
    return a.dim() == q.dim() - 1


def unit_norms(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Buffers for the inverse norms of q's and b's rows (`qk_l2norm`): one float32 per token
    and head of u [B, T, H, V] (with grouped value heads each head has its own copy)."""
    return tuple(u.new_empty(u.shape[:-1], dtype=torch.float32) for _ in "qb")


def _norm_args(q, b, norms):
    """The kernels' (q_norm, b_norm) pointers and UNIT: placeholders when there are none."""
    return (q, b, False) if norms is None else (*norms, True)


def intra_triton(q, a, b, g, precision: str = "ieee", tokens: Tokens | None = None,
                 scale: float = 1.0, factor_bound: float = DIAGONAL_FACTOR_BOUND,
                 attend_dtype: torch.dtype = torch.float32,
                 norms: tuple[torch.Tensor, torch.Tensor] | None = None,
                 table: TileLaunch = LAUNCH):  # fmt: skip
    """(L, M) [chunks, C, C]: of token-major inputs q, b [B, T, H / G, K], a [B, T, H, K] or
    [B, T, H] (a per-token strength: a_t = a_t b_t) and g ([B, T, H, K] or [B, T, H]) as `tokens`
    maps them into chunks of C = the padded chunk size (G = `tokens.group`), q times `scale`;
    or, with tokens=None,
    of chunked inputs [..., C, K] (a also [..., C], g per channel),
    returned as [..., C, C]. `factor_bound`: see DIAGONAL_FACTOR_BOUND. L is float32 (the
    solve's matrix); M is formed in float32 and stored in `attend_dtype` (the state pass's
    operators, `KernelOptions.operator_dtype`). With `norms` (`unit_norms(u)`), q and b are made
    unit-norm on load (`qk_l2norm`) and their rows' inverse norms written there. `table`: the
    launch table."""
    chunked = tokens is None
    tokens = Tokens.of_chunks(q) if chunked else tokens
    size = padded_chunk_size(tokens.chunk_size)
    key_dim = q.shape[-1]
    chunks = tokens.programs(q)
    lower = q.new_empty(chunks, size, size, dtype=torch.float32)
    attend = q.new_empty(chunks, size, size, dtype=attend_dtype)
    q_norm, b_norm, unit = _norm_args(q, b, norms)
    _intra_fwd[(chunks, size // SUB_BLOCK)](
        q, a, b, g, q_norm, b_norm, lower, attend, *tokens.args(), scale, tokens.group,
        K=key_dim, C=size, BK=key_block(key_dim), BT=SUB_BLOCK, G_HEAD=_g_head(q, g),
        PRECISION=precision, BOUND=factor_bound, A_ROW=_a_row(q, a), UNIT=unit, **table.options,
    )  # fmt: skip
    # Chunked inputs: their own leading shape. (Not told by one chunk of one head: token-major
    # inputs of one head and T <= C are that too, and were reshaped as chunks.)
    if chunked:
        lead = q.shape[:-2]
        return lower.view(*lead, size, size), attend.view(*lead, size, size)
    return lower, attend


def intra_triton_backward(q, a, b, g, d_lower, d_attend, precision: str = "ieee",
                          tokens: Tokens | None = None, scale: float = 1.0,
                          factor_bound: float = DIAGONAL_FACTOR_BOUND,
                          norms: tuple[torch.Tensor, torch.Tensor] | None = None,
                          table: TileLaunch = LAUNCH):  # fmt: skip
    """(dq, da, db) [chunks, C, K] float32 through L and M (the log decays' share is formed by
    the caller: see the module docstring); dq is the gradient of the scaled q, da that of the
    write direction a_t (b_t times its strength when a is one per token). Only the blocks
    on and below the diagonal of d_lower, d_attend are read. With `norms` (those the forward
    wrote), the gradients of the unit-norm q and b rows. `table`: the launch table (its block:
    channels per program)."""
    tokens = Tokens.of_chunks(q) if tokens is None else tokens
    size = padded_chunk_size(tokens.chunk_size)
    key_dim = q.shape[-1]
    chunks = tokens.programs(q)
    dq, da, db = (q.new_empty(chunks, size, key_dim, dtype=torch.float32) for _ in range(3))
    block_kd = min(table.block, key_block(key_dim))
    q_norm, b_norm, unit = _norm_args(q, b, norms)
    _intra_bwd[(chunks, triton.cdiv(key_dim, block_kd), size // SUB_BLOCK)](
        q, a, b, g, q_norm, b_norm, d_lower, d_attend, dq, da, db, *tokens.args(), scale,
        tokens.group, K=key_dim, C=size, BKD=block_kd, BT=SUB_BLOCK, G_HEAD=_g_head(q, g),
        PRECISION=precision, BOUND=factor_bound, A_ROW=_a_row(q, a), UNIT=unit, **table.options,
    )  # fmt: skip
    return dq, da, db
