"""Triton log decay, forward and backward, one kernel each way.

    x = raw + b,  sp = softplus(x),  g = -exp(a) sp                    (a = A_log, b = dt_bias)
    d raw = dg (-exp(a)) sigmoid(x),  d b = sum over rows of d raw,  d a = sum over rows of dg g

Layout. raw (and dg) are taken as `[M, N]` rows, N = the parameters' span of raw's trailing dims
(H for the scalar decay, H * K for the channel decay), each row N contiguous elements with a row
stride (a view when the caller's tensor allows it: Muir's decay is a column slice of its fused
projection). a and b arrive expanded to `[N]` (autograd sums their gradients back to `[H]`,
`[H, 1]`, `[H, K]`). A program owns a tile of BM rows x BN columns; the grid is row blocks x
column blocks.

Forward traffic. One read of raw in its dtype (bfloat16 under autocast), one write of g in
float32 (the compute dtype); a and b are `[N]`. Backward: one read of raw and dg, one write of
d raw in raw's dtype, and the `[programs, N]` partial sums of d a and d b. Nothing is saved for
backward but raw and the parameters: softplus and exp are recomputed, as the torch path's
activation checkpointing does, without its float32 intermediates in memory.

Deterministic parameter gradients (no atomics), as the norms' dweight: a backward program walks
a contiguous run of row blocks of its column block, sums dg g and d raw over them in float32
registers `[BN]`, and writes them once to `[programs, N]` buffers that torch sums.

Numerics (float32 whatever raw's dtype): softplus in torch's threshold form, softplus(x) = x for
x > 20 and log1p(exp(x)) otherwise, its derivative sigmoid(x) = e / (1 + e) with e = exp(x)
(exactly 1 above the threshold, as torch's softplus_backward). log1p(e) is computed without a
log1p instruction as log(u) * e / (u - 1), u = 1 + e (Goldberg's form: exact where u rounds to 1,
where it is e itself; accurate to a few ulps elsewhere given an accurate log, `__nv_logf` on
CUDA, numpy's under the interpreter). exp is taken of min(x, 20): no overflow, so raw of any
finite size (tests: +-50 and beyond) gives finite g and gradients, g = -exp(a) x above the
threshold and ~ -exp(a) exp(x) (not 0 before it underflows) below.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deltalab.ops._triton import (
    RowLaunch,
    as_rows,
    opaque_to_compiler,
    row_stride,
    spread_row_blocks,
)
from deltalab.ops.launch_tables import LaunchRegistry
from deltalab.ops.log_decay.reference import compute_dtype

# torch's softplus threshold (beta = 1): above it softplus(x) = x.
THRESHOLD = 20.0
# Elements (BM rows x BN columns) a program holds, BN at most 1024, and the elements a
# thread holds (which sets the warps, at most 8). Compiled for sm_90 (ptxas, no GPU):
# the backward with float32 raw at N = 1024 put 8 bytes a thread on the stack at 8 warps (4096
# or 2048 elements), none at 2048 elements and 4 warps (16 a thread), bfloat16 none either way.
# First guesses otherwise; to be tuned on the GPU (python -m benchmarks small_ops --ops log_decay).
# The read gate's kernels (read_gate/triton.py) launch by this table too. Row blocks of a
# column block are spread over at most 1024 backward programs (each keeps two float32 rows
# `[BN]`): the partial sums are then at most 2 x 1024 x N x 4 bytes.
LAUNCH = RowLaunch(forward_elements=4096, backward_elements=2048, forward_per_thread=16,
                   backward_per_thread=16, max_warps=8, max_columns=1024,
                   backward_programs=1024)  # fmt: skip
# The table per card (`deltalab.ops.launch_tables`), for calls given none.
LAUNCH_TABLES = LaunchRegistry("log_decay", LAUNCH)


@triton.jit
def _softplus_terms(x):
    """softplus(x) and its derivative sigmoid(x), float32, in torch's threshold form (module
    docstring): x above 20 -> (x, 1); else (log1p(e), e / (1 + e)), e = exp(x), with log1p by
    Goldberg's form, stable for large |x| (no overflow, no 0/0)."""
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    tiny = u == 1.0
    log1p = tl.where(tiny, e, tl.log(u) * (e / tl.where(tiny, 1.0, u - 1.0)))
    above = x > 20.0
    return tl.where(above, x, log1p), tl.where(above, 1.0, e / u)


@triton.jit
def _log_decay_fwd(RAW, A, B, G, M, N, stride_raw,
                   BM: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    col_ok = cols < N
    mask = (rows < M)[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    raw = tl.load(RAW + rows64[:, None] * stride_raw + cols[None, :], mask=mask, other=0.0)
    a = tl.load(A + cols, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    sp, _ = _softplus_terms(raw.to(tl.float32) + b[None, :])
    g = -tl.exp(a)[None, :] * sp
    tl.store(G + rows64[:, None] * N + cols[None, :], g.to(G.dtype.element_ty), mask=mask)


@triton.jit
def _log_decay_bwd(RAW, A, B, DG, DRAW, DA, DB, M, N, stride_raw, stride_dg, BLOCKS,
                   BM: tl.constexpr, BN: tl.constexpr, WANT_DRAW: tl.constexpr,
                   WANT_DA: tl.constexpr, WANT_DB: tl.constexpr):  # fmt: skip
    # Program (pid, column block): row blocks pid * BLOCKS .. pid * BLOCKS + BLOCKS - 1 (past M:
    # masked off).
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    col_ok = cols < N
    a = tl.load(A + cols, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    rate = tl.exp(a)
    da = tl.zeros([BN], dtype=tl.float32)
    db = tl.zeros([BN], dtype=tl.float32)
    for i in range(BLOCKS):
        rows = (pid * BLOCKS + i) * BM + tl.arange(0, BM)
        mask = (rows < M)[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        raw = tl.load(RAW + rows64[:, None] * stride_raw + cols[None, :], mask=mask, other=0.0)
        dg = tl.load(DG + rows64[:, None] * stride_dg + cols[None, :], mask=mask, other=0.0)
        dg = dg.to(tl.float32)
        sp, slope = _softplus_terms(raw.to(tl.float32) + b[None, :])
        # Masked elements load dg = 0: they add nothing to the sums.
        draw = -rate[None, :] * slope * dg
        if WANT_DRAW:
            at = rows64[:, None] * N + cols[None, :]
            tl.store(DRAW + at, draw.to(DRAW.dtype.element_ty), mask=mask)
        if WANT_DA:
            da += tl.sum(-rate[None, :] * sp * dg, axis=0)
        if WANT_DB:
            db += tl.sum(draw, axis=0)
    at = pid.to(tl.int64) * N + cols
    if WANT_DA:
        tl.store(DA + at, da, mask=col_ok)
    if WANT_DB:
        tl.store(DB + at, db, mask=col_ok)


class Launch(NamedTuple):
    """A kernel's launch: the grid, (BM rows, BN columns, warps) of a program, and the row blocks
    each program walks (1 forward; backward, spread so that the column blocks have at most
    the table's `backward_programs` programs each, whose partial sums torch adds)."""

    grid: tuple[int, int]
    block_m: int
    block_n: int
    warps: int
    per_program: int


def launch(rows: int, width: int, kernel: str, table: RowLaunch = LAUNCH) -> Launch:
    """The launch of a `kernel` ("forward" or "backward") over M rows of N = width (`row_tiles`
    with `table`'s sizes)."""
    block_m, block_n, warps = table.tiles(rows, width, kernel)
    per_program, programs = 1, triton.cdiv(rows, block_m)
    if kernel == "backward":
        per_program, programs = spread_row_blocks(rows, block_m, table.backward_programs)
    return Launch((programs, triton.cdiv(width, block_n)), block_m, block_n, warps, per_program)


def _jvp_terms(raw: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
    """g, -exp(a) sigmoid(x) (d g / d raw = d g / d b) in float32 torch ops, for the jvp."""
    x = raw.float() + b.float()
    rate = a.float().exp()
    return -rate * torch.nn.functional.softplus(x), -rate * torch.sigmoid(x)


class _LogDecay(torch.autograd.Function):
    """The kernels on a `[N]`, raw `[M, N]` (unit column stride), b `[N]`; g `[M, N]` in
    `out_dtype`. Saves raw (its dtype) and the parameters; the jvp is computed with torch ops
    from those (gate-sensitivity probes switch the layers to the torch path anyway). `table`:
    the launch table."""

    @staticmethod
    def forward(ctx, a, raw, b, out_dtype, table):
        rows, width = raw.shape
        plan = launch(rows, width, "forward", table)
        g = torch.empty(rows, width, dtype=out_dtype, device=raw.device)
        _log_decay_fwd[plan.grid](
            raw, a, b, g, rows, width, row_stride(raw), BM=plan.block_m, BN=plan.block_n,
            num_warps=plan.warps,
        )  # fmt: skip
        ctx.out_dtype, ctx.table = out_dtype, table
        ctx.save_for_backward(a, raw, b)
        ctx.save_for_forward(a, raw, b)
        return g

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dg):
        a, raw, b = ctx.saved_tensors
        rows, width = raw.shape
        plan = launch(rows, width, "backward", ctx.table)
        dg = as_rows(dg)
        want_da, want_draw, want_db = ctx.needs_input_grad[:3]
        draw = torch.empty(rows, width, dtype=raw.dtype, device=raw.device) if want_draw else None

        def parts(wanted):
            f32 = torch.float32
            programs = plan.grid[0]
            return torch.empty(programs, width, dtype=f32, device=raw.device) if wanted else None

        da_parts, db_parts = parts(want_da), parts(want_db)
        _log_decay_bwd[plan.grid](
            raw, a, b, dg, draw, da_parts, db_parts, rows, width, row_stride(raw),
            row_stride(dg), plan.per_program, BM=plan.block_m, BN=plan.block_n,
            WANT_DRAW=want_draw, WANT_DA=want_da, WANT_DB=want_db, num_warps=plan.warps,
        )  # fmt: skip
        da = da_parts.sum(0).to(a.dtype) if want_da else None
        db = db_parts.sum(0).to(b.dtype) if want_db else None
        return da, draw, db, None, None

    @staticmethod
    def jvp(ctx, ta, traw, tb, *_):
        """Forward-mode derivative: tg = g ta + (-exp(a) sigmoid(x)) (traw + tb)."""
        a, raw, b = ctx.saved_tensors
        g, slope = _jvp_terms(raw, a, b)
        t_out = torch.zeros_like(g)
        if ta is not None:
            t_out = t_out + g * ta.float()
        if traw is not None:
            t_out = t_out + slope * traw.float()
        if tb is not None:
            t_out = t_out + slope * tb.float()
        return t_out.to(ctx.out_dtype)


@opaque_to_compiler
def log_decay_triton(
    a: torch.Tensor, raw: torch.Tensor, b: torch.Tensor, *, table: RowLaunch | None = None
) -> torch.Tensor:
    """-exp(a) softplus(raw + b) by the kernels, validated inputs: a, b `[N]` (the parameters
    expanded to raw's trailing dims and flattened), raw `[..., trailing dims]`; the result in
    raw's shape and `compute_dtype(raw)`, computed in float32. raw must hold an element (the
    dispatcher sends empty ones to the torch path). `table`: the launch table (None: raw's
    device's)."""
    table = LAUNCH_TABLES.launch_table_for(raw.device) if table is None else table
    width = a.shape[0]
    g = _LogDecay.apply(a, as_rows(raw.reshape(-1, width)), b, compute_dtype(raw), table)
    return g.view(raw.shape)
