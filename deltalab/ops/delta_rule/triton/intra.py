"""Triton stage 1 of the chunkwise delta rule: the intra-chunk matrices L and M, and their adjoint.

For chunked inputs q, a, b, g [B, H, n, C, K] (per-channel log decays; one per head is expanded
to K channels by the caller), per chunk

    L_ts = sum_k b_tk a_sk exp(G_tk - G_sk)   (s < t)      M_ts = same with q_t   (s <= t)

with G the cumulative log decay. This is `chunk.py`'s `intra_chunk` (its PyTorch twin, which the
tests compare it with) written as one program per chunk.

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

Adjoint: with c_tsk the contribution of one (t, s, k) term,
    dq_t = sum_s dM_ts a_s * f_ts,   db_t = sum_s dL_ts a_s * f_ts,
    da_s = sum_t (dM_ts q_t + dL_ts b_t) * f_ts,
and since d f_ts / d g_j = f_ts for s < j <= t,
    dg_j = sum_{t >= j} (q_t dq_t + b_t db_t) - sum_{s >= j} a_s da_s   (per channel, in the chunk),
a reverse cumulative sum: every pair (t, s) with s, t >= j appears in both sums and cancels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tokens per sub-block: the smallest tile of a tensor-core product, and the number of rows a
# diagonal sub-block walks one at a time.
SUB_BLOCK = 16
# Channels per program of the adjoint.
BLOCK_KD = 32
# One pipeline stage: the loops are short and their tiles change every iteration.
LAUNCH = {"num_warps": 4, "num_stages": 1}


def chunk_count(x: torch.Tensor) -> int:
    """The number of chunks of a chunked tensor [..., C, *]: one program each."""
    return x.numel() // (x.shape[-1] * x.shape[-2])


def key_block(key_dim: int) -> int:
    """K padded to a power of two of at least 16 (tl.dot needs an inner dimension of 8 or more
    on NVIDIA GPUs; 16 fills a tensor-core tile). The padded channels are masked to zero."""
    return max(16, triton.next_power_of_2(key_dim))


@triton.jit
def _next_segment(seg, g, row, rt, rk, mk, t, K: tl.constexpr):
    """Row t's segment sums sum_{s < j <= t} g_j over the sub-block's columns s: [BT(s), BK].

    Built from row t - 1's by adding g_t (s < t), 0 at s = t, -inf above (s > t): a running sum,
    never a difference, so g = -inf gives exact zeros and no exponent is positive."""
    g_t = tl.load(g + row * K + rk, mask=mk, other=0.0)
    return tl.where(rt[:, None] == t, 0.0, seg + g_t[None, :])


@triton.jit
def _diag_fwd(q, a, b, g, lower, attend, rows, K: tl.constexpr, C: tl.constexpr,
              BK: tl.constexpr, BT: tl.constexpr):  # fmt: skip
    """L and M of diagonal sub-block `rows`, one row t at a time with exact pairwise factors."""
    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    mk = rk < K
    a_d = tl.load(a + (rows + rt)[:, None] * K + rk[None, :], mask=mk[None, :], other=0.0)
    seg = tl.full([BT, BK], float("-inf"), dtype=tl.float32)
    for t in range(BT):
        row = rows + t
        seg = _next_segment(seg, g, row, rt, rk, mk, t, K)
        a_f = tl.exp(seg) * a_d
        b_t = tl.load(b + row * K + rk, mask=mk, other=0.0)
        q_t = tl.load(q + row * K + rk, mask=mk, other=0.0)
        l_t = tl.where(rt < t, tl.sum(a_f * b_t[None, :], axis=1), 0.0)
        m_t = tl.sum(a_f * q_t[None, :], axis=1)
        tl.store(lower + row * C + rows + rt, l_t)
        tl.store(attend + row * C + rows + rt, m_t)


@triton.jit
def _diag_bwd(q, a, b, g, d_lower, d_attend, rows, rkd, mkd, K: tl.constexpr, C: tl.constexpr,
              BKD: tl.constexpr, BT: tl.constexpr):  # fmt: skip
    """The diagonal sub-block's share of (dq, db, da) [BT, BKD] for channels rkd."""
    rt = tl.arange(0, BT)
    tile = (rows + rt)[:, None] * K + rkd[None, :]
    a_d = tl.load(a + tile, mask=mkd[None, :], other=0.0)
    seg = tl.full([BT, BKD], float("-inf"), dtype=tl.float32)
    dq_d = tl.zeros([BT, BKD], dtype=tl.float32)
    db_d = tl.zeros([BT, BKD], dtype=tl.float32)
    da_d = tl.zeros([BT, BKD], dtype=tl.float32)
    for t in range(BT):
        row = rows + t
        seg = _next_segment(seg, g, row, rt, rkd, mkd, t, K)
        f = tl.exp(seg)
        dm_t = tl.load(d_attend + row * C + rows + rt, mask=rt <= t, other=0.0)
        dl_t = tl.load(d_lower + row * C + rows + rt, mask=rt < t, other=0.0)
        q_t = tl.load(q + row * K + rkd, mask=mkd, other=0.0)
        b_t = tl.load(b + row * K + rkd, mask=mkd, other=0.0)
        a_f = f * a_d
        at_t = rt[:, None] == t
        dq_d = tl.where(at_t, tl.sum(dm_t[:, None] * a_f, axis=0)[None, :], dq_d)
        db_d = tl.where(at_t, tl.sum(dl_t[:, None] * a_f, axis=0)[None, :], db_d)
        da_d += (dm_t[:, None] * q_t[None, :] + dl_t[:, None] * b_t[None, :]) * f
    return dq_d, db_d, da_d


@triton.jit
def _column_factor(g, cols, rt, rk, mk, between, K: tl.constexpr, BT: tl.constexpr):
    """exp(sum of g from the token after s to the end of its sub-block + `between`): [BT, BK]."""
    after = rt + 1
    g_after = tl.load(
        g + (cols + after)[:, None] * K + rk[None, :],
        mask=(after < BT)[:, None] & mk[None, :],
        other=0.0,
    )
    return tl.exp(tl.cumsum(g_after, axis=0, reverse=True) + between[None, :])


@triton.jit
def _intra_fwd(
    q, a, b, g, lower, attend,
    K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    chunk = tl.program_id(0).to(tl.int64)
    q += chunk * C * K
    a += chunk * C * K
    b += chunk * C * K
    g += chunk * C * K
    lower += chunk * C * C
    attend += chunk * C * C
    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    mk = rk < K
    tile = rt[:, None] * C + rt[None, :]
    for i in range(C // BT):
        rows = i * BT
        rows_k = (rows + rt)[:, None] * K + rk[None, :]
        g_i = tl.load(g + rows_k, mask=mk[None, :], other=0.0)
        row_f = tl.exp(tl.cumsum(g_i, axis=0))
        b_i = tl.load(b + rows_k, mask=mk[None, :], other=0.0) * row_f
        q_i = tl.load(q + rows_k, mask=mk[None, :], other=0.0) * row_f
        between = tl.zeros([BK], dtype=tl.float32)
        for jj in range(i):
            cols = (i - 1 - jj) * BT
            cols_k = (cols + rt)[:, None] * K + rk[None, :]
            a_j = tl.load(a + cols_k, mask=mk[None, :], other=0.0)
            a_j *= _column_factor(g, cols, rt, rk, mk, between, K, BT)
            l_ij = tl.dot(b_i, tl.trans(a_j), input_precision=PRECISION)
            m_ij = tl.dot(q_i, tl.trans(a_j), input_precision=PRECISION)
            tl.store(lower + rows * C + cols + tile, l_ij)
            tl.store(attend + rows * C + cols + tile, m_ij)
            between += tl.sum(tl.load(g + cols_k, mask=mk[None, :], other=0.0), axis=0)
        _diag_fwd(q, a, b, g, lower, attend, rows, K, C, BK, BT)
        zero = tl.zeros([BT, BT], dtype=tl.float32)
        for j in range(i + 1, C // BT):
            tl.store(lower + rows * C + j * BT + tile, zero)
            tl.store(attend + rows * C + j * BT + tile, zero)


@triton.jit
def _intra_bwd(
    q, a, b, g, d_lower, d_attend, dq, da, db,
    K: tl.constexpr, C: tl.constexpr, BKD: tl.constexpr, BT: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    chunk = tl.program_id(0).to(tl.int64)
    kb = tl.program_id(1)
    q += chunk * C * K
    a += chunk * C * K
    b += chunk * C * K
    g += chunk * C * K
    dq += chunk * C * K
    da += chunk * C * K
    db += chunk * C * K
    d_lower += chunk * C * C
    d_attend += chunk * C * C
    rt = tl.arange(0, BT)
    rkd = kb * BKD + tl.arange(0, BKD)
    mkd = rkd < K
    tile = rt[:, None] * C + rt[None, :]
    # Rows: dq and db of sub-block i from the columns s <= t.
    for i in range(C // BT):
        rows = i * BT
        rows_k = (rows + rt)[:, None] * K + rkd[None, :]
        row_f = tl.exp(tl.cumsum(tl.load(g + rows_k, mask=mkd[None, :], other=0.0), axis=0))
        acc_q = tl.zeros([BT, BKD], dtype=tl.float32)
        acc_b = tl.zeros([BT, BKD], dtype=tl.float32)
        between = tl.zeros([BKD], dtype=tl.float32)
        for jj in range(i):
            cols = (i - 1 - jj) * BT
            cols_k = (cols + rt)[:, None] * K + rkd[None, :]
            a_j = tl.load(a + cols_k, mask=mkd[None, :], other=0.0)
            a_j *= _column_factor(g, cols, rt, rkd, mkd, between, K, BT)
            dm = tl.load(d_attend + rows * C + cols + tile)
            dl = tl.load(d_lower + rows * C + cols + tile)
            acc_q += tl.dot(dm, a_j, input_precision=PRECISION)
            acc_b += tl.dot(dl, a_j, input_precision=PRECISION)
            between += tl.sum(tl.load(g + cols_k, mask=mkd[None, :], other=0.0), axis=0)
        dq_d, db_d, _ = _diag_bwd(q, a, b, g, d_lower, d_attend, rows, rkd, mkd, K, C, BKD, BT)
        dq_i = acc_q * row_f + dq_d
        db_i = acc_b * row_f + db_d
        tl.store(dq + rows_k, dq_i, mask=mkd[None, :])
        tl.store(db + rows_k, db_i, mask=mkd[None, :])
    # Columns: da of sub-block j from the rows t >= s.
    for j in range(C // BT):
        cols = j * BT
        cols_k = (cols + rt)[:, None] * K + rkd[None, :]
        acc_a = tl.zeros([BT, BKD], dtype=tl.float32)
        between = tl.zeros([BKD], dtype=tl.float32)
        for i in range(j + 1, C // BT):
            rows = i * BT
            rows_k = (rows + rt)[:, None] * K + rkd[None, :]
            g_i = tl.load(g + rows_k, mask=mkd[None, :], other=0.0)
            row_f = tl.exp(tl.cumsum(g_i, axis=0))
            q_i = tl.load(q + rows_k, mask=mkd[None, :], other=0.0) * row_f
            b_i = tl.load(b + rows_k, mask=mkd[None, :], other=0.0) * row_f
            dm = tl.load(d_attend + rows * C + cols + tile)
            dl = tl.load(d_lower + rows * C + cols + tile)
            part = tl.dot(tl.trans(dm), q_i, input_precision=PRECISION)
            part += tl.dot(tl.trans(dl), b_i, input_precision=PRECISION)
            acc_a += part * _column_factor(g, cols, rt, rkd, mkd, between, K, BT)
            between += tl.sum(g_i, axis=0)
        _, _, da_d = _diag_bwd(q, a, b, g, d_lower, d_attend, cols, rkd, mkd, K, C, BKD, BT)
        da_j = acc_a + da_d
        tl.store(da + cols_k, da_j, mask=mkd[None, :])


def intra_triton(q, a, b, g, precision: str = "ieee"):
    """(L, M) [..., C, C] of contiguous float32 chunked inputs [..., C, K] (g per channel)."""
    *lead, size, key_dim = q.shape
    chunks = chunk_count(q)
    lower = q.new_empty(*lead, size, size)
    attend = q.new_empty(*lead, size, size)
    block_k = key_block(key_dim)
    _intra_fwd[(chunks,)](
        q, a, b, g, lower, attend, K=key_dim, C=size, BK=block_k, BT=SUB_BLOCK,
        PRECISION=precision, **LAUNCH,
    )  # fmt: skip
    return lower, attend


def intra_triton_backward(q, a, b, g, d_lower, d_attend, precision: str = "ieee"):
    """(dq, da, db) through L and M (the log decays' share is formed by the caller: see the
    module docstring). Only the blocks on and below the diagonal of d_lower, d_attend are read."""
    *_, size, key_dim = q.shape
    chunks = chunk_count(q)
    dq, da, db = (torch.empty_like(q) for _ in range(3))
    block_kd = min(BLOCK_KD, key_block(key_dim))
    _intra_bwd[(chunks, triton.cdiv(key_dim, block_kd))](
        q, a, b, g, d_lower, d_attend, dq, da, db, K=key_dim, C=size, BKD=block_kd,
        BT=SUB_BLOCK, PRECISION=precision, **LAUNCH,
    )  # fmt: skip
    return dq, da, db


class IntraChunk(torch.autograd.Function):
    """(q, a, b, g) [..., C, K] float32 -> (L, M) [..., C, C], forward and adjoint in Triton."""

    @staticmethod
    def forward(ctx, q, a, b, g, precision):
        q, a, b, g = (x.contiguous() for x in (q, a, b, g))
        ctx.save_for_backward(q, a, b, g)
        ctx.precision = precision
        return intra_triton(q, a, b, g, precision)

    @staticmethod
    def backward(ctx, d_lower, d_attend):
        q, a, b, g = ctx.saved_tensors
        d_lower = torch.zeros_like(d_lower) if d_lower is None else d_lower.contiguous()
        d_attend = torch.zeros_like(d_attend) if d_attend is None else d_attend.contiguous()
        dq, da, db = intra_triton_backward(q, a, b, g, d_lower, d_attend, ctx.precision)
        # dg_j = reverse cumulative sum over the chunk of q dq + b db - a da (module docstring).
        dg = (q * dq + b * db - a * da).flip(-2).cumsum(-2).flip(-2)
        return dq, da, db, dg, None


def intra_chunk_triton(q, a, b, g, precision: str = "ieee"):
    """Stage 1 in Triton, same contract as `chunk.intra_chunk`: L (strict) and M (inclusive)
    [..., C, C] of chunked float32 inputs; g per channel [..., C, K] or per head [..., C]."""
    if g.dim() == q.dim() - 1:
        g = g.unsqueeze(-1).expand(q.shape)
    return IntraChunk.apply(q, a, b, g, precision)
