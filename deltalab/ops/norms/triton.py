"""Triton norms over the last dim, forward and backward, one kernel each way for both norms.

    r = 1 / sqrt(s + eps),  s = mean(x^2) (RMS norm) or sum(x^2) (L2),  xhat = x r
    y = xhat * w (RMS norm; L2 has no weight)  * act(gate) (gated RMS norm; act sigmoid or SiLU)

Layout. x (and the gate, dy) are taken as `[M, N]` rows, each row N contiguous elements with a
row stride (a view when the caller's tensor allows it, else a copy). A program owns BM rows of
BN = next_power_of_2(N) columns, the whole row: the row's sum of squares is one `tl.sum` in
registers, no second pass over memory. BM grows as N shrinks (a fixed number of elements a program, `LAUNCH`),
so a head_dim-128 row and a 1024-wide row keep the same number of loads in flight (the
backward, which holds more per element, at half the tile).

Forward traffic. One read of x (and of the gate), one write of y in the output dtype, and 4
bytes per row of 1/rms (r, kept for the backward). Everything in between is float32 registers.

Backward. With dz = dy act(gate) (dz = dy without a gate) and dn = dz w:

    dgate = dy xhat w act'(gate)
    dx    = r (dn - xhat c),  c = mean(dn xhat) (RMS norm) or sum(dn xhat) (L2)
    dw    = sum over rows of dz xhat

xhat and act(gate) are recomputed from x, the gate and r: the backward reads x, the gate, dy and
r and writes dx and dgate, nothing else of size `[M, N]`. The L2 normalization keeps its output
y = xhat instead of x (XHAT_GIVEN; `reference._L2NormFunction` says why) and reads it as xhat.

dw is reduced over rows without atomics, so it is deterministic: a program walks a contiguous
run of row blocks, sums dz xhat over them in one float32 row of registers, and writes it once to
a partial-sum buffer `[programs, N]` that torch sums. The programs are at most
`LAUNCH.backward_programs`, so the buffer stays small against the rows.

Precision: README.md in this folder.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltalab.ops._recompute import rebuildable_as
from deltalab.ops._triton import (
    RowLaunch,
    as_rows,
    opaque_to_compiler,
    row_stride,
    spread_row_blocks,
)
from deltalab.ops.launch_tables import LaunchRegistry
from deltalab.ops.norms.reference import compute_dtype, l2_normalize_naive, rms_norm_naive

# Elements (BM rows x BN columns) a program holds in its tile, and the elements a thread holds
# (which sets the warps, at most 16), per kernel. Compiled for sm_90 (ptxas, no GPU): the
# forward at 16 a thread takes 64-80 registers; the backward at 16 took 159-209 (head_dim 128,
# gated, bfloat16: one program of 8 warps an SM), at 8 it takes 74-105, no spills. To be tuned
# on the GPU (python -m benchmarks small_ops --ops norms).
# Row blocks are spread over at most 1024 backward programs (each keeps a float32 dw row):
# about 8 programs of 8 warps an SM on an H200's 132 SMs, one wave; the partial-sum buffer is
# then 1024 x N x 4 bytes (4 MiB at N = 1024). BN covers the whole row.
LAUNCH = RowLaunch(forward_elements=4096, backward_elements=2048, forward_per_thread=16,
                   backward_per_thread=8, max_warps=16, backward_programs=1024)  # fmt: skip
# The table per card (`deltalab.ops.launch_tables`), for calls given none.
LAUNCH_TABLES = LaunchRegistry("norms", LAUNCH)
# The gate's activation, a constexpr of the kernels.
NO_GATE, SIGMOID, SILU = 0, 1, 2
GATES = {None: NO_GATE, "sigmoid": SIGMOID, "silu": SILU}


@triton.jit
def _gate_terms(g, GATE_ACT: tl.constexpr):
    """act(g) and act'(g), float32. sigmoid(g) = 1 / (1 + exp(-g)) is 0 once exp overflows
    (g < -88), where SiLU is g * 0 = -0 and both slopes are 0: the float64 limits, no inf * 0."""
    s = tl.sigmoid(g)
    if GATE_ACT == 1:
        act = s
        slope = s * (1.0 - s)
    else:
        act = g * s
        slope = s * (1.0 + g * (1.0 - s))
    return act, slope


@triton.jit
def _norm_fwd(X, WEIGHT, GATE, Y, RSTD, M, N, stride_x, stride_g, eps,
              BM: tl.constexpr, BN: tl.constexpr, MEAN: tl.constexpr,
              HAS_WEIGHT: tl.constexpr, GATE_ACT: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.arange(0, BN)
    row_ok = rows < M
    col_ok = cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    ss = tl.sum(x * x, axis=1)
    if MEAN:
        ss = ss / N
    rstd = 1.0 / tl.sqrt(ss + eps)
    tl.store(RSTD + rows, rstd, mask=row_ok)
    y = x * rstd[:, None]
    if HAS_WEIGHT:
        w = tl.load(WEIGHT + cols, mask=col_ok, other=0.0).to(tl.float32)
        y = y * w[None, :]
    if GATE_ACT != 0:
        g = tl.load(GATE + rows64[:, None] * stride_g + cols[None, :], mask=mask, other=0.0)
        act, _ = _gate_terms(g.to(tl.float32), GATE_ACT)
        y = y * act
    tl.store(Y + rows64[:, None] * N + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd(X, WEIGHT, GATE, RSTD, DY, DX, DGATE, DW, M, N, stride_x, stride_g, stride_dy,
              BLOCKS, BM: tl.constexpr, BN: tl.constexpr, MEAN: tl.constexpr,
              HAS_WEIGHT: tl.constexpr, GATE_ACT: tl.constexpr, WANT_DGATE: tl.constexpr,
              WANT_DW: tl.constexpr, XHAT_GIVEN: tl.constexpr):  # fmt: skip
    # Program pid: row blocks pid * BLOCKS .. pid * BLOCKS + BLOCKS - 1 (past M: masked off).
    pid = tl.program_id(0)
    cols = tl.arange(0, BN)
    col_ok = cols < N
    if HAS_WEIGHT:
        w = tl.load(WEIGHT + cols, mask=col_ok, other=0.0).to(tl.float32)
    else:
        w = tl.full([BN], 1.0, tl.float32)
    dw = tl.zeros([BN], dtype=tl.float32)
    for i in range(BLOCKS):
        rows = (pid * BLOCKS + i) * BM + tl.arange(0, BM)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        if XHAT_GIVEN:  # X holds the forward's output x r (the L2 normalization)
            xhat = x.to(tl.float32)
        else:
            xhat = x.to(tl.float32) * rstd[:, None]
        dz = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
        dz = dz.to(tl.float32)
        if GATE_ACT != 0:
            at = rows64[:, None] * stride_g + cols[None, :]
            g = tl.load(GATE + at, mask=mask, other=0.0).to(tl.float32)
            act, slope = _gate_terms(g, GATE_ACT)
            if WANT_DGATE:
                dg = dz * xhat * w[None, :] * slope
                tl.store(DGATE + at, dg.to(DGATE.dtype.element_ty), mask=mask)
            dz = dz * act
        if WANT_DW:
            dw += tl.sum(dz * xhat, axis=0)
        dn = dz * w[None, :]
        c = tl.sum(dn * xhat, axis=1)
        if MEAN:
            c = c / N
        dx = rstd[:, None] * (dn - xhat * c[:, None])
        tl.store(DX + rows64[:, None] * N + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    if WANT_DW:
        tl.store(DW + pid.to(tl.int64) * N + cols, dw, mask=col_ok)


def launch(rows: int, dim: int, kernel: str, table: RowLaunch = LAUNCH) -> tuple[int, int, int]:
    """(BM rows, BN columns, warps) of a `kernel` ("forward" or "backward") program for M rows
    of N = dim (`row_tiles` with `table`'s sizes; BN covers the whole row)."""
    return table.tiles(rows, dim, kernel)


class _Norm(torch.autograd.Function):
    """The kernels on rows `[M, N]`: x, the gate (or None) and the weight `[N]` (or None) as
    given; y `[M, N]` in `out_dtype`. Saves x and the gate in their own dtypes and 1/rms per
    row (float32), or with `keep_output` (no weight, no gate: the L2 normalization) y in place
    of x; the jvp is computed with torch ops from those. `table`: the launch table."""

    @staticmethod
    def forward(ctx, x, weight, gate, eps: float, mean: bool, activation, out_dtype, keep_output,
                table):  # fmt: skip
        rows, dim = x.shape
        block_m, block_n, warps = launch(rows, dim, "forward", table)
        y = torch.empty(rows, dim, dtype=out_dtype, device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        gate_act = GATES[activation if gate is not None else None]
        _norm_fwd[(triton.cdiv(rows, block_m),)](
            x, weight, gate, y, rstd, rows, dim,
            row_stride(x), 0 if gate is None else row_stride(gate), eps,
            BM=block_m, BN=block_n, MEAN=mean, HAS_WEIGHT=weight is not None, GATE_ACT=gate_act,
            num_warps=warps,
        )  # fmt: skip
        ctx.mean, ctx.gate_act, ctx.out_dtype = mean, gate_act, out_dtype
        ctx.keep_output, ctx.x_dtype, ctx.table = keep_output, x.dtype, table
        kept = y if keep_output else x
        ctx.save_for_backward(kept, weight, gate, rstd)
        ctx.save_for_forward(kept, weight, gate, rstd)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, weight, gate, rstd = ctx.saved_tensors  # x: y with keep_output
        rows, dim = x.shape
        block_m, block_n, warps = launch(rows, dim, "backward", ctx.table)
        per_program, programs = spread_row_blocks(rows, block_m, ctx.table.backward_programs)
        dy = as_rows(dy)
        dx = torch.empty(rows, dim, dtype=ctx.x_dtype, device=x.device)
        want_dgate = gate is not None and ctx.needs_input_grad[2]
        dgate = torch.empty_like(gate) if want_dgate else None
        want_dw = weight is not None and ctx.needs_input_grad[1]
        dw_parts = (
            torch.empty(programs, dim, dtype=torch.float32, device=x.device) if want_dw else None
        )
        _norm_bwd[(programs,)](
            x, weight, gate, rstd, dy, dx, dgate, dw_parts, rows, dim, row_stride(x),
            0 if gate is None else row_stride(gate), row_stride(dy), per_program,
            BM=block_m, BN=block_n, MEAN=ctx.mean, HAS_WEIGHT=weight is not None,
            GATE_ACT=ctx.gate_act, WANT_DGATE=want_dgate, WANT_DW=want_dw,
            XHAT_GIVEN=ctx.keep_output, num_warps=warps,
        )  # fmt: skip
        dw = dw_parts.sum(0).to(weight.dtype) if want_dw else None
        return dx, dw, dgate, None, None, None, None, None, None

    @staticmethod
    def jvp(ctx, tx, tw, tg, *_):
        """Forward-mode derivative (gate-sensitivity probes run through the norms with it), in
        float32 torch ops from the saved tensors, as `_RMSNormFunction.jvp`."""
        x, weight, gate, rstd = ctx.saved_tensors
        r = rstd.unsqueeze(-1)
        xhat = x.float() if ctx.keep_output else x.float() * r
        w = 1.0 if weight is None else weight.float()
        t_out = torch.zeros_like(xhat)
        if tx is not None:
            txf = tx.float()
            c = (xhat * txf).mean(-1, keepdim=True) if ctx.mean else (xhat * txf).sum(-1, True)
            t_out = t_out + r * (txf - xhat * c) * w
        if tw is not None:
            t_out = t_out + xhat * tw.float()
        if gate is not None:
            g = gate.float()
            s = torch.sigmoid(g)
            if ctx.gate_act == SIGMOID:
                act, slope = s, s * (1 - s)
            else:
                act, slope = g * s, s * (1 + g * (1 - s))
            t_out = t_out * act
            if tg is not None:
                t_out = t_out + xhat * w * slope * tg.float()
        return t_out.to(ctx.out_dtype)


@opaque_to_compiler
def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    gate: torch.Tensor | None,
    activation: str,
    out_dtype: torch.dtype | None,
    *,
    table: RowLaunch | None = None,
) -> torch.Tensor:
    """The RMS norm (gated when `gate` is given) by the kernels, validated inputs: x and gate
    `[..., N]`, weight `[N]`; the result `[..., N]` in `out_dtype` (None: the compute dtype,
    as the torch path returns), computed in float32. `table`: the launch table (None: x's
    device's)."""
    table = LAUNCH_TABLES.launch_table_for(x.device) if table is None else table
    out_dtype = compute_dtype(x) if out_dtype is None else out_dtype
    if x.numel() == 0:
        return rms_norm_naive(x, weight, eps, gate, activation).to(out_dtype)
    x2 = as_rows(x)
    # Contiguous (as the layers' gates are already): dgate is written in the same layout. A
    # gate the backward makes again stays so in rows (`rebuildable_as`).
    gate2 = None if gate is None else rebuildable_as(as_rows(gate).contiguous(), gate)
    y = _Norm.apply(x2, weight, gate2, float(eps), True, activation, out_dtype, False, table)
    return y.view(x.shape)


@opaque_to_compiler
def l2_normalize_triton(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(||x||^2 + eps) over the last dim by the kernels, computed in float32; x's
    dtype out. Keeps y, not x, for the backward (`reference._L2NormFunction` says why)."""
    if x.numel() == 0:
        return l2_normalize_naive(x, eps)
    table = LAUNCH_TABLES.launch_table_for(x.device)
    y = _Norm.apply(as_rows(x), None, None, float(eps), False, None, x.dtype, True, table)
    return y.view(x.shape)
