"""Triton stage 2 of the chunkwise delta rule: the unit-lower-triangular solve and its adjoint.

Per chunk, with L [C, C] strictly lower triangular (stage 1) and a right-hand side R [C, N]
(`exp(G) * B` for the erase operator, U for the target), stage 2 is X = (I + L)^-1 R. The
PyTorch twin (`chunk.py`) forms the inverse by doubling and multiplies; here no inverse of the
whole chunk is formed. Rows are solved by blocks of BT = 16 tokens in order (forward
substitution):

    X_i = (I + L_ii)^-1 (R_i - sum_{j < i} L_ij X_j)

with the 16 x 16 inverse of the diagonal block built row by row in registers (each row of the
inverse is e_r minus L's row r times the rows above it: exact float32 arithmetic, no products of
large powers of L). Columns of X never mix, so a program owns one chunk and BN columns, and
reads back the X_j it stored earlier (a barrier makes them visible to every thread).

Adjoint, given dX: dR = (I + L)^-T dX solves the transposed system by blocks in reverse
(back substitution), and dL = -dR X^T on the strictly lower triangle, summed over the columns of
both right-hand sides (`_lower_grad`, one program per chunk).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltalab.ops.delta_rule.triton.intra import (
    SUB_BLOCK,
    TileLaunch,
    Tokens,
    _token_offset,
    chunk_count,
    key_block,
)

# Columns per program: a [16, 128] float32 tile of X and its right-hand side per row block.
# Measured on the H200 at K = V = 128 (benchmarks/tune_triton.py): 128 columns 0.20 ms per
# solve, 64 columns 0.28 ms (each program rebuilds the diagonal inverses), 32 columns 0.45 ms.
# Two warps for the solve, its adjoint and dL: a program's tiles are 16-row blocks. Measured on
# the H200 (`tune_triton.py`, B=4 T=4096 H=16 K=128, chunk 64, 128 columns, 2026-12-01): solve
# 0.122 ms against 0.197 with 4 warps and 0.322 with 8; its adjoint and dL 0.363 against 0.522.
LAUNCH = TileLaunch(block=128, num_warps=2)


@triton.jit
def _inverse_diag(lower, C: tl.constexpr, BT: tl.constexpr):
    """(I + L_ii)^-1 [BT, BT] of the diagonal block whose top-left element `lower` points at."""
    rt = tl.arange(0, BT)
    inv = tl.where(rt[:, None] == rt[None, :], 1.0, 0.0)
    for r in range(1, BT):
        # Row r of the inverse: e_r - sum_{c < r} L_rc (row c of the inverse), rows c < r final.
        l_r = tl.load(lower + r * C + rt, mask=rt < r, other=0.0)
        update = tl.sum(l_r[:, None] * inv, axis=0)
        inv = tl.where(rt[:, None] == r, inv - update[None, :], inv)
    return inv


@triton.jit
def _solve_fwd(
    lower, rhs, out, n_chunks, H, T, CS,
    N: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """rhs: token-major [B, T, H, N] (`intra.Tokens`; chunked is its one-chunk case) in any
    float dtype; lower chunked float32; out chunked, float32 or the operators' 16-bit dtype
    (the rows solved before are read back from it as stored: the state pass sees those
    values)."""
    chunk = tl.program_id(0).to(tl.int64)
    offset, valid = _token_offset(chunk, n_chunks, H, T, CS, N)
    lower += chunk * C * C
    rhs += offset
    out += chunk * C * N
    rt = tl.arange(0, BT)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    mn = rn[None, :] < N
    for i in range(C // BT):
        rows = i * BT
        tile = (rows + rt)[:, None] * N + rn[None, :]
        present = ((rows + rt) < valid)[:, None] & mn
        acc = tl.load(rhs + (rows + rt)[:, None] * (H * N) + rn[None, :], mask=present, other=0.0)
        acc = acc.to(tl.float32)
        for j in range(i):
            l_ij = tl.load(lower + (rows + rt)[:, None] * C + j * BT + rt[None, :])
            x_j = tl.load(out + (j * BT + rt)[:, None] * N + rn[None, :], mask=mn, other=0.0)
            acc -= tl.dot(l_ij, x_j.to(tl.float32), input_precision=PRECISION)
        inv = _inverse_diag(lower + rows * C + rows, C, BT)
        x_i = tl.dot(inv, acc, input_precision=PRECISION)
        tl.store(out + tile, x_i.to(out.dtype.element_ty), mask=mn)
        tl.debug_barrier()


@triton.jit
def _solve_bwd(
    lower, d_out, d_rhs, d_rhs_tokens, n_chunks, H, T, CS,
    N: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
    PRECISION: tl.constexpr, TOKENS: tl.constexpr,
):  # fmt: skip
    """d_rhs: chunked float32 (read back by the substitution); with TOKENS, also written
    token-major [B, T, H, N] into d_rhs_tokens in its dtype (the gradient of a token-major rhs)."""
    chunk = tl.program_id(0).to(tl.int64)
    offset, valid = _token_offset(chunk, n_chunks, H, T, CS, N)
    d_rhs_tokens += offset
    lower += chunk * C * C
    d_out += chunk * C * N
    d_rhs += chunk * C * N
    rt = tl.arange(0, BT)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    mn = rn[None, :] < N
    for ii in range(C // BT):
        rows = (C // BT - 1 - ii) * BT
        tile = (rows + rt)[:, None] * N + rn[None, :]
        acc = tl.load(d_out + tile, mask=mn, other=0.0)
        for r in range(rows + BT, C, BT):
            l_ri = tl.load(lower + (r + rt)[:, None] * C + rows + rt[None, :])
            dr_r = tl.load(d_rhs + (r + rt)[:, None] * N + rn[None, :], mask=mn, other=0.0)
            acc -= tl.dot(tl.trans(l_ri), dr_r, input_precision=PRECISION)
        inv = _inverse_diag(lower + rows * C + rows, C, BT)
        dr = tl.dot(tl.trans(inv), acc, input_precision=PRECISION)
        tl.store(d_rhs + tile, dr, mask=mn)
        if TOKENS:
            present = ((rows + rt) < valid)[:, None] & mn
            tokens = (rows + rt)[:, None] * (H * N) + rn[None, :]
            tl.store(d_rhs_tokens + tokens, dr.to(d_rhs_tokens.dtype.element_ty), mask=present)
        tl.debug_barrier()


@triton.jit
def _accumulate_outer(acc, d, x, rows, cols, N: tl.constexpr, BT: tl.constexpr,
                      BN: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """acc + d[rows] x[cols]^T over all N columns, BN at a time: [BT, BT]."""
    rt = tl.arange(0, BT)
    for nb in range(0, N, BN):
        rn = nb + tl.arange(0, BN)
        mn = rn[None, :] < N
        d_i = tl.load(d + (rows + rt)[:, None] * N + rn[None, :], mask=mn, other=0.0)
        x_j = tl.load(x + (cols + rt)[:, None] * N + rn[None, :], mask=mn, other=0.0)
        acc += tl.dot(d_i, tl.trans(x_j.to(tl.float32)), input_precision=PRECISION)
    return acc


@triton.jit
def _lower_grad(
    d_erase_rhs, erase, d_target_rhs, target, d_lower,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    chunk = tl.program_id(0).to(tl.int64)
    d_erase_rhs += chunk * C * K
    erase += chunk * C * K
    d_target_rhs += chunk * C * V
    target += chunk * C * V
    d_lower += chunk * C * C
    rt = tl.arange(0, BT)
    strict = rt[:, None] > rt[None, :]
    for i in range(C // BT):
        for j in range(i + 1):
            acc = tl.zeros([BT, BT], dtype=tl.float32)
            acc = _accumulate_outer(acc, d_erase_rhs, erase, i * BT, j * BT, K, BT, BK, PRECISION)
            acc = _accumulate_outer(acc, d_target_rhs, target, i * BT, j * BT, V, BT, BV,
                                    PRECISION)  # fmt: skip
            if j == i:
                acc = tl.where(strict, acc, 0.0)
            tl.store(d_lower + (i * BT + rt)[:, None] * C + j * BT + rt[None, :], -acc)


def _grid(lower: torch.Tensor, columns: int, table: TileLaunch):
    chunks = chunk_count(lower)
    block = min(table.block, key_block(columns))
    return (chunks, triton.cdiv(columns, block)), block


def solve_triton(lower: torch.Tensor, rhs: torch.Tensor, precision: str = "ieee",
                 tokens: Tokens | None = None, dtype: torch.dtype = torch.float32,
                 table: TileLaunch = LAUNCH) -> torch.Tensor:  # fmt: skip
    """(I + L)^-1 R per chunk: lower [..., C, C] float32 (strictly lower; the upper triangle is
    not read), rhs chunked [..., C, N] (tokens=None) or token-major [B, T, H, N] as `tokens`
    maps it, in any float dtype. Returns X like lower's chunks, [..., C, N] in `dtype`
    (`KernelOptions.operator_dtype`; the substitution itself is float32). Twin of
    `unit_lower_inverse(L) @ R`. `table`: the launch table."""
    size, columns = lower.shape[-1], rhs.shape[-1]
    tokens = Tokens.of_chunks(rhs) if tokens is None else tokens
    out = lower.new_empty(*lower.shape[:-1], columns, dtype=dtype)
    grid, block = _grid(lower, columns, table)
    _solve_fwd[grid](lower, rhs, out, *tokens.args(), N=columns, C=size, BT=SUB_BLOCK, BN=block,
                     PRECISION=precision, **table.options)  # fmt: skip
    return out


def solve_triton_backward(lower: torch.Tensor, d_out: torch.Tensor, precision: str = "ieee",
                          tokens_like: torch.Tensor | None = None,
                          tokens: Tokens | None = None, table: TileLaunch = LAUNCH):  # fmt: skip
    """dR = (I + L)^-T dX per chunk (the gradient of `solve_triton` with respect to R), chunked
    float32 like d_out; with `tokens_like` (a token-major rhs), also (dR, dR laid out and typed
    as `tokens_like`). `table`: the launch table."""
    size, columns = lower.shape[-1], d_out.shape[-1]
    d_rhs = torch.empty_like(d_out)
    grid, block = _grid(lower, columns, table)
    as_tokens = tokens_like is not None
    d_tokens = torch.empty_like(tokens_like) if as_tokens else d_rhs
    tokens = tokens if as_tokens else Tokens.of_chunks(d_out)
    _solve_bwd[grid](lower, d_out, d_rhs, d_tokens, *tokens.args(), N=columns, C=size,
                     BT=SUB_BLOCK, BN=block, PRECISION=precision, TOKENS=as_tokens,
                     **table.options)  # fmt: skip
    return (d_rhs, d_tokens) if as_tokens else d_rhs


def lower_grad_triton(d_erase_rhs, erase, d_target_rhs, target, precision: str = "ieee",
                      table: TileLaunch = LAUNCH):  # fmt: skip
    """dL = -(dR_b X_b^T + dR_u X_u^T) on the strict lower triangle of each chunk's [C, C]
    (blocks above the diagonal are left unwritten: nothing reads them), float32 whatever the
    dtype the solve stored X in. `table`: the launch table (the solve's)."""
    *lead, size, key_dim = erase.shape
    value_dim = target.shape[-1]
    d_lower = erase.new_empty(*lead, size, size, dtype=torch.float32)
    chunks = chunk_count(erase)
    _lower_grad[(chunks,)](
        d_erase_rhs, erase, d_target_rhs, target, d_lower, K=key_dim, V=value_dim, C=size,
        BT=SUB_BLOCK, BK=min(table.block, key_block(key_dim)),
        BV=min(table.block, key_block(value_dim)), PRECISION=precision, **table.options,
    )  # fmt: skip
    return d_lower
