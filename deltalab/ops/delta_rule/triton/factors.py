"""Triton decay factors of the chunkwise delta rule and the adjoint that closes the backward.

Per chunk, with the inclusive cumulative log decay G_t = sum_{j <= t} g_j (per channel), the
operators of `chunk.py`'s `chunk_operators` scale the inputs elementwise:

    read  = exp(G_t) q_t        rhs of erase = exp(G_t) b_t        (from the chunk start)
    write = exp(sum_{j > t} g_j) a_t                                (to the chunk end)
    decay = exp(sum_j g_j)                                          (the whole chunk)

One program owns a chunk and BKD channels: every exponent is a cumulative sum of log decays
(never a difference of two, never positive), the one to the chunk end taken over the rows
shifted by one, so g = -inf gives exact zeros as in stage 1.

Adjoint (`_factors_bwd`), which also finishes stage 1's: with dq', da', db' the gradients that
reach q, a, b through L and M (stage 1's adjoint) and d_read, d_rhs, d_write, d_decay those of
the operators above,

    dq = dq' + exp(G) d_read      db = db' + exp(G) d_rhs      da = da' + exp(G_C - G) d_write

and, since exp(G_t) depends on g_j for j <= t, exp(sum_{j > t} g) on g_j for j > t, and
stage 1's factors as in `intra.py`'s docstring,

    dg_j = sum_{t >= j} (q dq' + b db' - a da' + exp(G) (q d_read + b d_rhs) - w d_write)_t
           + sum_t (w d_write)_t + decay * d_decay,          w = exp(G_C - G) a,

a reverse cumulative sum plus per-chunk totals (the write term's sum over t < j written as the
total minus the sum over t >= j).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltalab.ops.delta_rule.triton.intra import BLOCK_KD, LAUNCH, chunk_count, key_block


@triton.jit
def _chunk_decays(g, K: tl.constexpr, C: tl.constexpr, BKD: tl.constexpr):
    """This program's [C, BKD] tile of one chunk: its offsets and mask, the offsets of its
    channels in the chunk's [K] decay row and their mask, then exp(G_t), exp(sum_{j > t} g_j)
    and the g tile."""
    chunk = tl.program_id(0).to(tl.int64)
    rc = tl.arange(0, C)
    rk = tl.program_id(1) * BKD + tl.arange(0, BKD)
    mk = rk < K
    offs = chunk * C * K + rc[:, None] * K + rk[None, :]
    mask = mk[None, :]
    g_t = tl.load(g + offs, mask=mask, other=0.0)
    g_after = tl.load(g + offs + K, mask=mask & (rc < C - 1)[:, None], other=0.0)
    from_start = tl.exp(tl.cumsum(g_t, axis=0))
    to_end = tl.exp(tl.cumsum(g_after, axis=0, reverse=True))
    return offs, mask, chunk * K + rk, mk, from_start, to_end, g_t


@triton.jit
def _factors_fwd(
    q, a, b, g, read, rhs, write, decay,
    K: tl.constexpr, C: tl.constexpr, BKD: tl.constexpr,
):  # fmt: skip
    offs, mask, row, mk, from_start, to_end, g_t = _chunk_decays(g, K, C, BKD)
    tl.store(read + offs, from_start * tl.load(q + offs, mask=mask), mask=mask)
    tl.store(rhs + offs, from_start * tl.load(b + offs, mask=mask), mask=mask)
    tl.store(write + offs, to_end * tl.load(a + offs, mask=mask), mask=mask)
    tl.store(decay + row, tl.exp(tl.sum(g_t, axis=0)), mask=mk)


@triton.jit
def _factors_bwd(
    q, a, b, g, d_read, d_rhs, d_write, d_decay, dq, da, db, dg,
    K: tl.constexpr, C: tl.constexpr, BKD: tl.constexpr,
):  # fmt: skip
    """dq, da, db hold stage 1's gradients on entry and the totals on exit."""
    offs, mask, row, mk, from_start, to_end, g_t = _chunk_decays(g, K, C, BKD)
    q_t = tl.load(q + offs, mask=mask, other=0.0)
    a_t = tl.load(a + offs, mask=mask, other=0.0)
    b_t = tl.load(b + offs, mask=mask, other=0.0)
    dq_t = tl.load(dq + offs, mask=mask, other=0.0)
    da_t = tl.load(da + offs, mask=mask, other=0.0)
    db_t = tl.load(db + offs, mask=mask, other=0.0)
    dr_t = tl.load(d_read + offs, mask=mask, other=0.0)
    dh_t = tl.load(d_rhs + offs, mask=mask, other=0.0)
    dw_t = tl.load(d_write + offs, mask=mask, other=0.0)
    written = to_end * a_t * dw_t
    terms = q_t * dq_t + b_t * db_t - a_t * da_t + from_start * (q_t * dr_t + b_t * dh_t) - written
    total = tl.sum(written, axis=0)
    total += tl.exp(tl.sum(g_t, axis=0)) * tl.load(d_decay + row, mask=mk, other=0.0)
    tl.store(dg + offs, tl.cumsum(terms, axis=0, reverse=True) + total[None, :], mask=mask)
    tl.store(dq + offs, dq_t + from_start * dr_t, mask=mask)
    tl.store(db + offs, db_t + from_start * dh_t, mask=mask)
    tl.store(da + offs, da_t + to_end * dw_t, mask=mask)


def _grid(q: torch.Tensor):
    key_dim = q.shape[-1]
    block = min(BLOCK_KD, key_block(key_dim))
    return (chunk_count(q), triton.cdiv(key_dim, block)), block


def factors_triton(q, a, b, g):
    """(read, exp(G) b, write [..., C, K], decay [..., K]) of contiguous float32 chunked inputs
    [..., C, K] (g per channel); the twin of the factor lines of `chunk.chunk_operators`."""
    *lead, size, key_dim = q.shape
    read, rhs, write = (torch.empty_like(q) for _ in range(3))
    decay = q.new_empty(*lead, key_dim)
    grid, block = _grid(q)
    _factors_fwd[grid](q, a, b, g, read, rhs, write, decay, K=key_dim, C=size, BKD=block,
                       **LAUNCH)  # fmt: skip
    return read, rhs, write, decay


def factors_triton_backward(q, a, b, g, d_read, d_rhs, d_write, d_decay, dq, da, db):
    """(dq, da, db, dg): the gradients of q, a, b, g through the factors and, given stage 1's
    dq, da, db (updated in place), through stage 1 too."""
    dg = torch.empty_like(g)
    grid, block = _grid(q)
    _factors_bwd[grid](
        q, a, b, g, d_read, d_rhs, d_write, d_decay, dq, da, db, dg, K=q.shape[-1],
        C=q.shape[-2], BKD=block, **LAUNCH,
    )  # fmt: skip
    return dq, da, db, dg
