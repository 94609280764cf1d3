"""Triton SwiGLU, forward and backward, one elementwise kernel each way.

    gate, up = gate_up[..., :F], gate_up[..., F:]
    s = sigmoid(gate),   h = gate s up
    d gate = dh up s (1 + gate (1 - s)),   d up = dh gate s

Layout. gate_up (and dh) are taken as rows `[M, 2F]` (`[M, F]`), each row's elements contiguous
with a row stride (a view when the caller's tensor allows it, else a copy). A program owns a
tile of BM rows x BF columns of h: it reads those columns of the gate and, F elements further
on, of up. The columns are split in blocks of at most 256 (F = 2400 in the 340M GDN-2
model: 10 blocks of 256 cover it with 6% masked, where a power-of-2 row would mask 41%; 3232 in
the Transformer: 3%), the rows in blocks of BM so that a tile holds a fixed number of elements
(`LAUNCH`).

Traffic. Forward: one read of gate_up, one write of h in gate_up's dtype; only gate_up is saved
for the backward (as the torch path's activation checkpointing keeps it). Backward: one read of
gate_up and of dh, one write of d(gate_up) `[M, 2F]`: both halves stored in place, no
concatenation, and no second forward. Everything in between is float32 registers.

Precision: README.md in this folder.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltalab.ops._triton import RowLaunch, as_rows, opaque_to_compiler, row_stride
from deltalab.ops.launch_tables import LaunchRegistry
from deltalab.ops.swiglu.reference import swiglu_naive

# Elements (BM rows x BF columns) a program holds in its tile, and the elements a thread holds
# (which sets the warps, at most 16), per kernel; the widest column block. First guesses
# for a bandwidth-bound elementwise kernel, to be tuned on the GPU
# (python -m benchmarks small_ops --ops swiglu).
LAUNCH = RowLaunch(forward_elements=4096, backward_elements=2048, forward_per_thread=16,
                   backward_per_thread=8, max_warps=16, max_columns=256)  # fmt: skip
# The table per card (`deltalab.ops.launch_tables`), for calls given none.
LAUNCH_TABLES = LaunchRegistry("swiglu", LAUNCH)


@triton.jit
def _gate_up_tile(GU, M, F, stride_gu, BM: tl.constexpr, BF: tl.constexpr):
    """A program's tile: its rows (int64) and columns, their mask, and the gate and up halves
    `[BM, BF]` of gate_up in float32 (0 where masked)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BF + tl.arange(0, BF)
    mask = (rows < M)[:, None] & (cols < F)[None, :]
    rows64 = rows.to(tl.int64)
    at = rows64[:, None] * stride_gu + cols[None, :]
    g = tl.load(GU + at, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + at + F, mask=mask, other=0.0).to(tl.float32)
    return rows64, cols, mask, g, u


@triton.jit
def _swiglu_fwd(GU, H, M, F, stride_gu, BM: tl.constexpr, BF: tl.constexpr):
    rows64, cols, mask, g, u = _gate_up_tile(GU, M, F, stride_gu, BM, BF)
    # sigmoid(g) = 1 / (1 + exp(-g)) is 0 once exp overflows (g < -88): h = g * 0 * u, finite.
    h = g * tl.sigmoid(g) * u
    tl.store(H + rows64[:, None] * F + cols[None, :], h.to(H.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(GU, DH, DGU, M, F, stride_gu, stride_dh, BM: tl.constexpr, BF: tl.constexpr):
    rows64, cols, mask, g, u = _gate_up_tile(GU, M, F, stride_gu, BM, BF)
    dh = tl.load(DH + rows64[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0)
    dh = dh.to(tl.float32)
    s = tl.sigmoid(g)
    # silu'(g) = s (1 + g (1 - s)): 0 where s is 0 (g < -88), s where 1 - s is 0; no inf * 0.
    dg = dh * u * (s * (1.0 + g * (1.0 - s)))
    du = dh * (g * s)
    out = rows64[:, None] * (2 * F) + cols[None, :]
    tl.store(DGU + out, dg.to(DGU.dtype.element_ty), mask=mask)
    tl.store(DGU + out + F, du.to(DGU.dtype.element_ty), mask=mask)


def launch(rows: int, width: int, kernel: str, table: RowLaunch = LAUNCH) -> tuple[int, int, int]:
    """(BM rows, BF columns, warps) of a `kernel` ("forward" or "backward") program for M rows
    of h's F = width columns (`row_tiles` with `table`'s sizes)."""
    return table.tiles(rows, width, kernel)


def _grid(rows: int, width: int, block_m: int, block_f: int) -> tuple[int, int]:
    return triton.cdiv(rows, block_m), triton.cdiv(width, block_f)


class _SwiGLU(torch.autograd.Function):
    """The kernels on rows gate_up `[M, 2F]` -> h `[M, F]` in gate_up's dtype. Saves gate_up
    only; the jvp is computed with torch ops from it. `table`: the launch table."""

    @staticmethod
    def forward(ctx, gate_up, table):
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        block_m, block_f, warps = launch(rows, width, "forward", table)
        h = torch.empty(rows, width, dtype=gate_up.dtype, device=gate_up.device)
        _swiglu_fwd[_grid(rows, width, block_m, block_f)](
            gate_up, h, rows, width, row_stride(gate_up), BM=block_m, BF=block_f,
            num_warps=warps,
        )  # fmt: skip
        ctx.save_for_backward(gate_up)
        ctx.save_for_forward(gate_up)
        ctx.table = table
        return h

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dh):
        (gate_up,) = ctx.saved_tensors
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        block_m, block_f, warps = launch(rows, width, "backward", ctx.table)
        dh = as_rows(dh)
        d_gate_up = torch.empty(rows, 2 * width, dtype=gate_up.dtype, device=gate_up.device)
        _swiglu_bwd[_grid(rows, width, block_m, block_f)](
            gate_up, dh, d_gate_up, rows, width, row_stride(gate_up), row_stride(dh),
            BM=block_m, BF=block_f, num_warps=warps,
        )  # fmt: skip
        return d_gate_up, None

    @staticmethod
    def jvp(ctx, t_gate_up, _):
        """Forward-mode derivative, in float32 torch ops from the saved gate_up:
        t_h = t_gate up silu'(gate) + t_up silu(gate)."""
        (gate_up,) = ctx.saved_tensors
        gate, up = gate_up.float().chunk(2, dim=-1)
        t_gate, t_up = t_gate_up.float().chunk(2, dim=-1)
        s = torch.sigmoid(gate)
        t_h = t_gate * up * (s * (1 + gate * (1 - s))) + t_up * (gate * s)
        return t_h.to(gate_up.dtype)


@opaque_to_compiler
def swiglu_triton(gate_up: torch.Tensor, *, table: RowLaunch | None = None) -> torch.Tensor:
    """silu(gate) * up by the kernels, validated gate_up `[..., 2F]`; `[..., F]` in gate_up's
    dtype, computed in float32. `table`: the launch table (None: gate_up's device's)."""
    table = LAUNCH_TABLES.launch_table_for(gate_up.device) if table is None else table
    if gate_up.numel() == 0:
        return swiglu_naive(gate_up)
    h = _SwiGLU.apply(as_rows(gate_up), table)
    return h.view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
