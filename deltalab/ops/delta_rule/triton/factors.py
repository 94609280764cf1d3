"""Triton decay factors of the chunkwise delta rule and the adjoint that closes the backward.

Per chunk, with the inclusive cumulative log decay G_t = sum_{j <= t} g_j (per channel), the
operators of `chunk.py`'s `chunk_operators` scale the inputs elementwise:

    read  = exp(G_t) q_t        rhs of erase = exp(G_t) b_t        (from the chunk start)
    write = exp(sum_{j > t} g_j) a_t                                (to the chunk end)
    decay = exp(sum_j g_j)                                          (the whole chunk)

A kernel of its own rather than a part of stage 1's forward, which reads the same rows: written
into stage 1's one-warp programs (an experiment, 2026-12-02) the factors made the forward
0.7-0.8 ms slower at B=4 T=4096 H=16 (2026-12-02), more than the reads
they saved. One program owns a chunk and BKD channels; the inputs are read where they lie,
token-major (`intra.Tokens`), and the adjoint writes the final gradients there too: every
exponent is a cumulative sum of log decays (never a difference of two, never positive), the
one to the chunk end taken over the rows shifted by one, so g = -inf gives exact zeros as in
stage 1.

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

With `qk_l2norm` the q and b rows are made unit-norm as they are loaded, by the inverse norms
r = 1 / sqrt(|x|^2 + eps) that stage 1's forward wrote (it loads whole rows; these kernels load
channel blocks). The adjoint above is then that of the unit rows x' = r x, and closes the
chain here: dx = r (dx' - x' (x' . dx')), a dot product over the whole row, so with unit rows
a program owns a whole chunk and walks its channel blocks twice: the first walk keeps dx' in
stage 1's float32 buffers and sums x' . dx', the second writes dx. (One block of all K
channels spilled 10.7 KB a thread to local memory at K = 128, compiled for sm_90.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltalab.ops.delta_rule.chunk import padded_chunk_size
from deltalab.ops.delta_rule.triton.intra import (
    TileLaunch,
    Tokens,
    _a_layout,
    _a_row,
    _g_head,
    _key_layout,
    _load_g_rows,
    _load_per_row,
    _load_rows,
    _norm_args,
    _norm_layout,
    _token_layout,
    _unit_rows,
    key_block,
)

# Channels per program of both kernels, 4 warps.
LAUNCH = TileLaunch(block=32, num_warps=4)


@triton.jit
def _chunk_decays(g, n_chunks, H, T, CS, kb, K: tl.constexpr, C: tl.constexpr,
                  BKD: tl.constexpr, G_HEAD: tl.constexpr):  # fmt: skip
    """This program's [C, BKD] tile of one chunk, channel block `kb`: the chunk, its token
    offset and token count, the row stride of a, the tile's channels and their mask, then
    exp(G_t), exp(sum_{j > t} g_j) and the g tile."""
    chunk = tl.program_id(0).to(tl.int64)
    offset, valid, rs, g_offset, grs = _token_layout(chunk, n_chunks, H, T, CS, K, G_HEAD)
    rc = tl.arange(0, C)
    rk = kb * BKD + tl.arange(0, BKD)
    mk = rk < K
    g_t = _load_g_rows(g + g_offset, rc, grs, rk, valid, mk, G_HEAD)
    g_after = _load_g_rows(g + g_offset, rc + 1, grs, rk, valid, mk, G_HEAD)
    from_start = tl.exp(tl.cumsum(g_t, axis=0))
    to_end = tl.exp(tl.cumsum(g_after, axis=0, reverse=True))
    return chunk, offset, valid, rs, rc, rk, mk, from_start, to_end, g_t


@triton.jit
def _load_a_beside(a, b_t, chunk, n_chunks, H, T, CS, offset, rs, rc, rk, valid, mk,
                   A_ROW: tl.constexpr):  # fmt: skip
    """This program's a tile beside its b tile `b_t`: with A_ROW the rows' strengths times b_t
    (`intra._load_a`, without loading b again); also a's offset and row stride."""
    a_offset, ars = _a_layout(chunk, n_chunks, H, T, CS, offset, rs, A_ROW)
    if A_ROW:
        a_t = b_t * _load_per_row(a + a_offset, rc, ars, valid)[:, None]
    else:
        a_t = _load_rows(a + a_offset, rc, ars, rk, 1, valid, mk)
    return a_t, a_offset, ars


@triton.jit
def _factors_fwd(
    q, a, b, g, q_norm, b_norm, read, rhs, write, decay, n_chunks, H, T, CS, scale, GROUP,
    K: tl.constexpr, C: tl.constexpr, BKD: tl.constexpr, G_HEAD: tl.constexpr,
    A_ROW: tl.constexpr, UNIT: tl.constexpr,
):  # fmt: skip
    chunk, offset, valid, rs, rc, rk, mk, from_start, to_end, g_t = _chunk_decays(
        g, n_chunks, H, T, CS, tl.program_id(1), K, C, BKD, G_HEAD
    )
    out = chunk * C * K + rc[:, None] * K + rk[None, :]
    mask = mk[None, :]
    qn, bn, nrs = _norm_layout(q_norm, b_norm, chunk, n_chunks, H, T, CS)
    key_offset, krs = _key_layout(chunk, n_chunks, H, T, CS, K, GROUP)
    q_t = _load_rows(q + key_offset, rc, krs, rk, 1, valid, mk)
    q_t = _unit_rows(q_t, qn, rc, nrs, valid, UNIT, False) * scale
    b_t = _load_rows(b + key_offset, rc, krs, rk, 1, valid, mk)
    b_t = _unit_rows(b_t, bn, rc, nrs, valid, UNIT, False)
    a_t, _, _ = _load_a_beside(a, b_t, chunk, n_chunks, H, T, CS, offset, rs, rc, rk, valid, mk,
                               A_ROW)  # fmt: skip
    tl.store(read + out, (from_start * q_t).to(read.dtype.element_ty), mask=mask)
    tl.store(rhs + out, (from_start * b_t).to(rhs.dtype.element_ty), mask=mask)
    tl.store(write + out, (to_end * a_t).to(write.dtype.element_ty), mask=mask)
    tl.store(decay + chunk * K + rk, tl.exp(tl.sum(g_t, axis=0)), mask=mk)


@triton.jit
def _factors_bwd(
    q, a, b, g, q_norm, b_norm, d_read, d_rhs, d_write, d_decay, dq1, da1, db1, dq, da, db, dg,
    n_chunks, H, T, CS, scale, GROUP, a_parts,
    K: tl.constexpr, C: tl.constexpr, BKD: tl.constexpr, G_HEAD: tl.constexpr,
    A_ROW: tl.constexpr, UNIT: tl.constexpr,
):  # fmt: skip
    """dq1, da1, db1: stage 1's gradients, chunked [chunks, C, K] (dq1 that of the scaled q).
    dq, da, db, dg: the totals, laid out as q (dg per channel), in their tensors' dtypes; dq
    of the unscaled q. Rows past the chunk's tokens are not written. With A_ROW (a_t = beta_t
    b_t) the gradient of the direction, da', splits: db gains beta da', and da holds each
    channel block's share of d beta = sum_k b da', float32, `a_parts` elements after the
    share of the block before. A program owns a chunk and channel block program_id(1); with
    UNIT, a chunk: it walks the channel blocks twice, first keeping the unit rows' gradients
    in dq1, db1 and summing their dot products with the unit rows, then closing the chain
    (module docstring)."""
    if UNIT:
        along_q = tl.zeros([C], dtype=tl.float32)
        along_b = tl.zeros([C], dtype=tl.float32)
        for kb in range((K + BKD - 1) // BKD):
            dot_q, dot_b = _factor_grads(
                q, a, b, g, q_norm, b_norm, d_read, d_rhs, d_write, d_decay, dq1, da1, db1, dq,
                da, db, dg, n_chunks, H, T, CS, scale, GROUP, a_parts, kb,
                K, C, BKD, G_HEAD, A_ROW, UNIT,
            )  # fmt: skip
            along_q += dot_q
            along_b += dot_b
        chunk = tl.program_id(0).to(tl.int64)
        offset, valid, rs, _, _ = _token_layout(chunk, n_chunks, H, T, CS, K, G_HEAD)
        key_offset, krs = _key_layout(chunk, n_chunks, H, T, CS, K, GROUP)
        qn, bn, nrs = _norm_layout(q_norm, b_norm, chunk, n_chunks, H, T, CS)
        for kb in range((K + BKD - 1) // BKD):
            _unit_adjoint(q, qn, dq1, dq, along_q, chunk, offset, valid, rs, key_offset, krs, nrs,
                          kb, K, C, BKD)  # fmt: skip
            _unit_adjoint(b, bn, db1, db, along_b, chunk, offset, valid, rs, key_offset, krs, nrs,
                          kb, K, C, BKD)  # fmt: skip
    else:
        _factor_grads(
            q, a, b, g, q_norm, b_norm, d_read, d_rhs, d_write, d_decay, dq1, da1, db1, dq, da,
            db, dg, n_chunks, H, T, CS, scale, GROUP, a_parts, tl.program_id(1),
            K, C, BKD, G_HEAD, A_ROW, UNIT,
        )  # fmt: skip


@triton.jit
def _factor_grads(
    q, a, b, g, q_norm, b_norm, d_read, d_rhs, d_write, d_decay, dq1, da1, db1, dq, da, db, dg,
    n_chunks, H, T, CS, scale, GROUP, a_parts, kb,
    K: tl.constexpr, C: tl.constexpr, BKD: tl.constexpr, G_HEAD: tl.constexpr,
    A_ROW: tl.constexpr, UNIT: tl.constexpr,
):  # fmt: skip
    """`_factors_bwd` on channel block `kb`: writes dg and da (d beta's share); dq, db, or
    with UNIT the gradients of the unit rows over dq1, db1 (float32), returning their dot
    products with the unit rows over the block's channels, [C] each."""
    chunk, offset, valid, rs, rc, rk, mk, from_start, to_end, g_t = _chunk_decays(
        g, n_chunks, H, T, CS, kb, K, C, BKD, G_HEAD
    )
    inner = chunk * C * K + rc[:, None] * K + rk[None, :]
    mask = mk[None, :]
    qn, bn, nrs = _norm_layout(q_norm, b_norm, chunk, n_chunks, H, T, CS)
    key_offset, krs = _key_layout(chunk, n_chunks, H, T, CS, K, GROUP)
    q_u = _load_rows(q + key_offset, rc, krs, rk, 1, valid, mk)
    q_u = _unit_rows(q_u, qn, rc, nrs, valid, UNIT, False)
    q_t = q_u * scale
    b_t = _load_rows(b + key_offset, rc, krs, rk, 1, valid, mk)
    b_t = _unit_rows(b_t, bn, rc, nrs, valid, UNIT, False)
    a_t, a_offset, ars = _load_a_beside(a, b_t, chunk, n_chunks, H, T, CS, offset, rs, rc, rk,
                                        valid, mk, A_ROW)  # fmt: skip
    dq_t = tl.load(dq1 + inner, mask=mask, other=0.0)
    da_t = tl.load(da1 + inner, mask=mask, other=0.0)
    db_t = tl.load(db1 + inner, mask=mask, other=0.0)
    dr_t = tl.load(d_read + inner, mask=mask, other=0.0)
    dh_t = tl.load(d_rhs + inner, mask=mask, other=0.0)
    dw_t = tl.load(d_write + inner, mask=mask, other=0.0)
    written = to_end * a_t * dw_t
    terms = q_t * dq_t + b_t * db_t - a_t * da_t + from_start * (q_t * dr_t + b_t * dh_t) - written
    total = tl.sum(written, axis=0)
    total += tl.exp(tl.sum(g_t, axis=0)) * tl.load(d_decay + chunk * K + rk, mask=mk, other=0.0)
    outer = offset + rc[:, None] * rs + rk[None, :]
    present = (rc < valid)[:, None] & mask
    dg_t = tl.cumsum(terms, axis=0, reverse=True) + total[None, :]
    tl.store(dg + outer, dg_t.to(dg.dtype.element_ty), mask=present)
    dq_t = (dq_t + from_start * dr_t) * scale
    db_t += from_start * dh_t
    da_t += to_end * dw_t
    if A_ROW:
        strength = _load_per_row(a + a_offset, rc, ars, valid)
        db_t += strength[:, None] * da_t
        share = da + (tl.zeros([], dtype=tl.int64) + kb) * a_parts + a_offset + rc * ars
        tl.store(share, tl.sum(b_t * da_t, axis=1), mask=rc < valid)
    else:
        tl.store(da + outer, da_t.to(da.dtype.element_ty), mask=present)
    if UNIT:
        tl.store(dq1 + inner, dq_t, mask=mask)
        tl.store(db1 + inner, db_t, mask=mask)
    else:
        tl.store(dq + outer, dq_t.to(dq.dtype.element_ty), mask=present)
        tl.store(db + outer, db_t.to(db.dtype.element_ty), mask=present)
    return tl.sum(q_u * dq_t, axis=1), tl.sum(b_t * db_t, axis=1)


@triton.jit
def _unit_adjoint(x, norms, d_unit, d_x, along, chunk, offset, valid, rs, key_offset, krs, nrs,
                  kb, K: tl.constexpr, C: tl.constexpr, BKD: tl.constexpr):  # fmt: skip
    """Channel block `kb` of the gradient of rows x from that of their unit rows x' = r x
    (`d_unit`, chunked float32) and `along` = x' . d_unit over whole rows:
    r (d_unit - x' along), written to d_x (laid out as u's heads)."""
    rc = tl.arange(0, C)
    rk = kb * BKD + tl.arange(0, BKD)
    mk = rk < K
    r = _load_per_row(norms, rc, nrs, valid)
    unit = _load_rows(x + key_offset, rc, krs, rk, 1, valid, mk) * r[:, None]
    d = tl.load(d_unit + chunk * C * K + rc[:, None] * K + rk[None, :], mask=mk[None, :], other=0.0)
    present = (rc < valid)[:, None] & mk[None, :]
    d_rows = (d - unit * along[:, None]) * r[:, None]
    tl.store(d_x + offset + rc[:, None] * rs + rk[None, :], d_rows.to(d_x.dtype.element_ty),
             mask=present)  # fmt: skip


def _grid(q: torch.Tensor, tokens: Tokens, table: TileLaunch, whole_rows: bool = False):
    """The factor kernels' grid (chunks, channel blocks), channels per block, and the number of
    channel blocks: with `whole_rows` (the adjoint of unit rows) a program walks them all."""
    key_dim = q.shape[-1]
    block = min(table.block, key_block(key_dim))
    blocks = triton.cdiv(key_dim, block)
    return (tokens.programs(q), 1 if whole_rows else blocks), block, blocks


def factors_triton(q, a, b, g, tokens: Tokens | None = None, scale: float = 1.0,
                   dtype: torch.dtype = torch.float32,
                   norms: tuple[torch.Tensor, torch.Tensor] | None = None,
                   table: TileLaunch = LAUNCH):  # fmt: skip
    """(read, exp(G) b, write [chunks, C, K] in `dtype`, decay [chunks, K] float32) of
    token-major inputs as `tokens` maps them (see `intra.Tokens`; read of q times `scale`), or,
    with tokens=None, of chunked inputs [..., C, K] (g per channel), shaped [..., C, K] and
    [..., K]. Formed in float32, stored in `dtype` (`KernelOptions.operator_dtype`). The twin of the
    factor lines of `chunk.chunk_operators`. With `norms` (written by `intra.intra_triton`), of
    the unit-norm q and b rows (`qk_l2norm`). `table`: the launch table."""
    chunked = tokens is None
    tokens = Tokens.of_chunks(q) if chunked else tokens
    size, key_dim = padded_chunk_size(tokens.chunk_size), q.shape[-1]
    grid, block, _ = _grid(q, tokens, table)
    read, rhs, write = (q.new_empty(grid[0], size, key_dim, dtype=dtype) for _ in "rhw")
    decay = q.new_empty(grid[0], key_dim, dtype=torch.float32)
    q_norm, b_norm, unit = _norm_args(q, b, norms)
    _factors_fwd[grid](
        q, a, b, g, q_norm, b_norm, read, rhs, write, decay, *tokens.args(), scale, tokens.group,
        K=key_dim, C=size, BKD=block, G_HEAD=_g_head(q, g), A_ROW=_a_row(q, a), UNIT=unit,
        **table.options,
    )  # fmt: skip
    if chunked:
        return (*(x.view(q.shape) for x in (read, rhs, write)), decay.view(*q.shape[:-2], key_dim))
    return read, rhs, write, decay


def factors_triton_backward(q, a, b, g, d_read, d_rhs, d_write, d_decay, dq1, da1, db1,
                            tokens: Tokens | None = None, scale: float = 1.0,
                            norms: tuple[torch.Tensor, torch.Tensor] | None = None,
                            table: TileLaunch = LAUNCH):  # fmt: skip
    """(dq, da, db, dg): the gradients of q, a, b, g through the factors and, given stage 1's
    dq1, da1, db1 (chunked float32; dq1 that of the scaled q, da1 that of the write direction),
    through stage 1 too. Laid out and typed as q, a, b and g are (dg of a per-head g summed over
    channels, da of a per-token a over channels); dq of the unscaled q. With `norms`, stage 1's
    gradients are those of the unit rows (dq1 and db1 are overwritten), and dq, db those of the
    raw q, b. With grouped value heads (`tokens.group` G > 1) each head writes its share of dq
    and db, float32, summed over the G heads of a group below. `table`: the launch table."""
    tokens = Tokens.of_chunks(q) if tokens is None else tokens
    size = padded_chunk_size(tokens.chunk_size)
    head = _g_head(q, g)
    row = _a_row(q, a)
    q_norm, b_norm, unit = _norm_args(q, b, norms)
    grid, block, blocks = _grid(q, tokens, table, whole_rows=unit)
    group = tokens.group
    # Per head of u: q's layout with G heads for each of q's.
    shape = (*q.shape[:-2], q.shape[-2] * group, q.shape[-1])
    if group == 1:
        dq, db = torch.empty_like(q), torch.empty_like(b)
    else:
        dq, db = (q.new_empty(shape, dtype=torch.float32) for _ in "qb")
    # A per-token a: each channel block's share of its gradient, summed below (as dg's channels
    # for a per-head g): a deterministic sum, where atomic additions would not be.
    da = a.new_empty(blocks, *a.shape, dtype=torch.float32) if row else torch.empty_like(a)
    dg = q.new_empty(shape, dtype=torch.float32) if head else torch.empty_like(g)
    _factors_bwd[grid](
        q, a, b, g, q_norm, b_norm, d_read, d_rhs, d_write, d_decay, dq1, da1, db1, dq, da, db,
        dg, *tokens.args(), scale, group, a.numel(), K=q.shape[-1], C=size, BKD=block,
        G_HEAD=head, A_ROW=row, UNIT=unit, **table.options,
    )  # fmt: skip
    if group > 1:
        dq, db = (d.unflatten(-2, (-1, group)).sum(-2).to(q.dtype) for d in (dq, db))
    da = da.sum(dim=0).to(a.dtype) if row else da
    return dq, da, db, (dg.sum(dim=-1).to(g.dtype) if head else dg)
