"""Triton matched-filter read, forward and backward, one kernel each way.

    s = sigmoid(raw),  rho = exp(r) 2 s  (rho = exp(r) without raw),  out = q rho     (r = read_log)
    dq = dout rho,  d raw = dout q rho (1 - s),  d r = sum over rows of dout q rho

Layout. q, raw and dout as `[M, N]` rows, N = the span of read_log over q's trailing dims (H K
for Muir's `[H, K]` vector), each row N contiguous elements with a row stride (a view when the
caller's tensor allows it: a query split from a wider projection). r arrives expanded to `[N]`
in float32, with its exp computed once by torch (`[N]`: the very numbers the layers' path
multiplies by). A program owns BM rows x BN columns; the grid is row blocks x column blocks.

Traffic. Forward: one read of q and raw in their dtypes (bfloat16 under autocast), one write of
the product in q's dtype; the float32 rho never reaches memory. Backward: one read of q, raw
and dout, one write of dq and d raw, and the `[programs, N]` partial sums of d r. Nothing is
saved but q, raw and read_log; sigmoid and rho are recomputed in the backward.

Deterministic d read_log (no atomics), as the log decay's parameters: a backward program walks a
contiguous run of row blocks of its column block, sums dout q rho over them in float32
registers `[BN]`, and writes them once to a `[programs, N]` buffer that torch sums.

Numerics (float32 whatever the inputs' dtypes; the product rounded once to q's dtype). With
e = exp(-|raw|) in (0, 1] nothing overflows: s = 1 / (1 + e) for raw >= 0 and e / (1 + e)
below, 1 - s the other one (no cancellation: torch's sigmoid backward takes (1 - s) s, which
loses the digits of 1 - s for large raw). read_log can be anything, so rho is taken in two
forms:
- direct, exp(r) * (2 s), the layers' operations in their order, where r <= 80 and raw >= -80:
  there exp(r) <= 5.5e34 and s >= 1.8e-35 are finite, normal floats and so is their product;
- in the log domain, exp(r + log 2 + min(raw, 0) - log(1 + e)), elsewhere: exp(r) alone would
  overflow (r > 88.7) or s lose its digits to subnormals (raw < -87) where rho itself is an
  ordinary number (r = 100, raw = -100 gives rho = 2.0). log(1 + e) enters an exponent, so its
  absolute error (~1e-7, e <= 1) is rho's relative error: no log1p needed.
So rho is finite wherever the exact rho is (it overflows only past ~3.4e38), and the product
and the gradients overflow only where they do themselves (or rho times q does). Without raw,
rho = exp(r) as torch computed it (inf beyond r = 88.7, as the layers' path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltalab.ops._triton import RowLaunch, as_rows, opaque_to_compiler, row_stride

# The launch table is the log decay's (the same rows of elementwise work; the backward holds q,
# raw and dout per element and keeps one float32 row `[BN]` a program): first guesses for
# both, to be tuned on the GPU (`python -m benchmarks small_ops --ops read_gate`).
from deltalab.ops.log_decay.triton import LAUNCH_TABLES, launch

# Where rho leaves the direct form for the log domain (module docstring): exp(80) and
# exp(-80) are normal float32 numbers with room to spare. (constexpr: the compiled kernels may
# read globals only so; the interpreter reads any.)
DIRECT_LIMIT = tl.constexpr(80.0)
LOG2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _rho(x, r, rate, HAS_RAW: tl.constexpr, SIGMOID: tl.constexpr):
    """rho and 1 - s (float32 tiles) from raw x `[BM, BN]`, r and rate = exp(r) `[BN]` (module
    docstring: direct form where it is exact, the log domain where exp(r) or s would not be).
    SIGMOID: rho = s, the read at the vector 1/2 (`sigmoid_gate`; r and rate unused)."""
    if HAS_RAW:
        e = tl.exp(-tl.abs(x))
        inv = 1.0 / (1.0 + e)
        above = x >= 0.0
        s = tl.where(above, inv, e * inv)
        s_c = tl.where(above, e * inv, inv)
        if SIGMOID:
            return s, s_c
        direct = rate[None, :] * (2.0 * s)
        log_rho = r[None, :] + LOG2 + tl.minimum(x, 0.0) - tl.log(1.0 + e)
        far = (r[None, :] > DIRECT_LIMIT) | (x < -DIRECT_LIMIT)
        # exp only where taken (elsewhere log_rho may exceed 88.7 without meaning anything).
        rho = tl.where(far, tl.exp(tl.where(far, log_rho, 0.0)), direct)
    else:
        rho = rate[None, :] + tl.zeros_like(x)
        s_c = tl.zeros_like(x)
    return rho, s_c


@triton.jit
def _load_read_vector(R, RATE, cols, col_ok, BN: tl.constexpr, SIGMOID: tl.constexpr):
    """The read vector and its rate at columns `cols`; zeros with SIGMOID (no read vector: R and
    RATE are not read)."""
    if SIGMOID:
        r = tl.zeros([BN], dtype=tl.float32)
        rate = r
    else:
        r = tl.load(R + cols, mask=col_ok, other=0.0)
        rate = tl.load(RATE + cols, mask=col_ok, other=0.0)
    return r, rate


@triton.jit
def _load_raw(RAW, rows64, cols, mask, stride_raw, BM: tl.constexpr, BN: tl.constexpr,
              HAS_RAW: tl.constexpr):  # fmt: skip
    """raw's tile `[BM, BN]` in float32 (rows `rows64`, columns `cols`); zeros without raw (RAW
    is not read)."""
    if HAS_RAW:
        x = tl.load(RAW + rows64[:, None] * stride_raw + cols[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
    else:
        x = tl.zeros([BM, BN], dtype=tl.float32)
    return x


@triton.jit
def _read_gate_fwd(Q, RAW, R, RATE, OUT, M, N, stride_q, stride_raw,
                   BM: tl.constexpr, BN: tl.constexpr, HAS_RAW: tl.constexpr,
                   SIGMOID: tl.constexpr = False):  # fmt: skip
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    col_ok = cols < N
    mask = (rows < M)[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    q = tl.load(Q + rows64[:, None] * stride_q + cols[None, :], mask=mask, other=0.0)
    r, rate = _load_read_vector(R, RATE, cols, col_ok, BN, SIGMOID)
    x = _load_raw(RAW, rows64, cols, mask, stride_raw, BM, BN, HAS_RAW)
    rho, _ = _rho(x, r, rate, HAS_RAW, SIGMOID)
    out = rho * q.to(tl.float32)
    tl.store(OUT + rows64[:, None] * N + cols[None, :], out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _read_gate_bwd(Q, RAW, R, RATE, DOUT, DQ, DRAW, DR, M, N, stride_q, stride_raw,
                   stride_dout, BLOCKS, BM: tl.constexpr, BN: tl.constexpr,
                   HAS_RAW: tl.constexpr, WANT_DQ: tl.constexpr, WANT_DRAW: tl.constexpr,
                   WANT_DR: tl.constexpr, SIGMOID: tl.constexpr = False):  # fmt: skip
    # Program (pid, column block): row blocks pid * BLOCKS .. pid * BLOCKS + BLOCKS - 1 (past M:
    # masked off).
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    col_ok = cols < N
    r, rate = _load_read_vector(R, RATE, cols, col_ok, BN, SIGMOID)
    dr = tl.zeros([BN], dtype=tl.float32)
    for i in range(BLOCKS):
        rows = (pid * BLOCKS + i) * BM + tl.arange(0, BM)
        mask = (rows < M)[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        q = tl.load(Q + rows64[:, None] * stride_q + cols[None, :], mask=mask, other=0.0)
        dout = tl.load(DOUT + rows64[:, None] * stride_dout + cols[None, :], mask=mask, other=0.0)
        dout = dout.to(tl.float32)
        x = _load_raw(RAW, rows64, cols, mask, stride_raw, BM, BN, HAS_RAW)
        rho, s_c = _rho(x, r, rate, HAS_RAW, SIGMOID)
        at = rows64[:, None] * N + cols[None, :]
        if WANT_DQ:
            tl.store(DQ + at, (dout * rho).to(DQ.dtype.element_ty), mask=mask)
        # Masked elements load q = dout = 0: they add nothing to the sums (and rho, finite
        # there for r <= 88.7, is not multiplied by an inf).
        g_rho = tl.where(mask, dout * q.to(tl.float32) * rho, 0.0)
        if HAS_RAW:
            if WANT_DRAW:
                tl.store(DRAW + at, (g_rho * s_c).to(DRAW.dtype.element_ty), mask=mask)
        if WANT_DR:
            dr += tl.sum(g_rho, axis=0)
    if WANT_DR:
        tl.store(DR + pid.to(tl.int64) * N + cols, dr, mask=col_ok)


def _jvp_terms(q: torch.Tensor, r: torch.Tensor, raw: torch.Tensor | None):
    """q rho (= d out / d r) and q rho (1 - s) (= d out / d raw) in float32 torch ops, and rho
    (= d out / d q), for the jvp."""
    s_c = None
    if r is None:  # rho = sigmoid(raw) (`sigmoid_gate`)
        rho, s_c = torch.sigmoid(raw.float()), torch.sigmoid(-raw.float())
    elif raw is None:
        rho = r.float().exp()
    else:
        s = torch.sigmoid(raw.float())
        rho, s_c = r.float().exp() * (2.0 * s), torch.sigmoid(-raw.float())
    q_rho = q.float() * rho
    return rho, q_rho, None if s_c is None else q_rho * s_c


def _read_vector(r: torch.Tensor | None):
    """r in float32 and exp(r) `[N]` for the kernels; for r None (rho = sigmoid(raw), which
    reads neither) None twice: the kernels' SIGMOID form takes no pointer there."""
    if r is None:
        return None, None
    r32 = r.float().contiguous()
    return r32, r32.exp()


class _ReadGate(torch.autograd.Function):
    """The kernels on q `[M, N]`, r `[N]` (read_log expanded and flattened) or None (rho =
    sigmoid(raw): `sigmoid_gate`, the read at the vector 1/2, with no vector to read, exp or
    sum), raw `[M, N]` or None (unit column strides); the product `[M, N]` in q's dtype. Saves
    q, raw (their dtypes) and r; the jvp is computed with torch ops from those
    (gate-sensitivity probes switch the layers to the torch path anyway). `table`: the launch
    table."""

    @staticmethod
    def forward(ctx, q, r, raw, table):
        rows, width = q.shape
        r32, rate = _read_vector(r)
        plan = launch(rows, width, "forward", table)
        out = torch.empty(rows, width, dtype=q.dtype, device=q.device)
        has_raw = raw is not None
        _read_gate_fwd[plan.grid](
            q, raw if has_raw else q, r32, rate, out, rows, width, row_stride(q),
            row_stride(raw) if has_raw else 0, BM=plan.block_m, BN=plan.block_n,
            HAS_RAW=has_raw, SIGMOID=r is None, num_warps=plan.warps,
        )  # fmt: skip
        ctx.save_for_backward(q, r, raw)
        ctx.save_for_forward(q, r, raw)
        ctx.table = table
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, r, raw = ctx.saved_tensors
        rows, width = q.shape
        r32, rate = _read_vector(r)
        plan = launch(rows, width, "backward", ctx.table)
        dout = as_rows(dout)
        has_raw = raw is not None
        want_dq, want_dr, want_draw = ctx.needs_input_grad[:3]
        want_draw = want_draw and has_raw
        dq = torch.empty(rows, width, dtype=q.dtype, device=q.device) if want_dq else None
        draw = torch.empty(rows, width, dtype=raw.dtype, device=q.device) if want_draw else None
        f32 = torch.float32
        dr_parts = torch.empty(plan.grid[0], width, dtype=f32, device=q.device) if want_dr else None
        _read_gate_bwd[plan.grid](
            q, raw if has_raw else q, r32, rate, dout, dq, draw, dr_parts, rows, width,
            row_stride(q), row_stride(raw) if has_raw else 0, row_stride(dout), plan.per_program,
            BM=plan.block_m, BN=plan.block_n, HAS_RAW=has_raw, WANT_DQ=want_dq,
            WANT_DRAW=want_draw, WANT_DR=want_dr, SIGMOID=r is None, num_warps=plan.warps,
        )  # fmt: skip
        dr = dr_parts.sum(0).to(r.dtype) if want_dr else None
        return dq, dr, draw, None

    @staticmethod
    def jvp(ctx, tq, tr, traw, _):
        """Forward-mode derivative: t_out = rho tq + q rho tr + q rho (1 - s) traw."""
        q, r, raw = ctx.saved_tensors
        rho, q_rho, q_rho_sc = _jvp_terms(q, r, raw)
        t_out = torch.zeros_like(q_rho)
        if tq is not None:
            t_out = t_out + rho * tq.float()
        if tr is not None:
            t_out = t_out + q_rho * tr.float()
        if traw is not None and raw is not None:
            t_out = t_out + q_rho_sc * traw.float()
        return t_out.to(q.dtype)


@opaque_to_compiler
def read_query_triton(
    q: torch.Tensor, r: torch.Tensor | None, raw: torch.Tensor | None, *,
    table: RowLaunch | None = None,
) -> torch.Tensor:  # fmt: skip
    """q * exp(r) (* 2 sigmoid(raw)) by the kernels, validated inputs: r `[N]` (read_log
    expanded to q's trailing dims and flattened; None: rho = sigmoid(raw), `sigmoid_gate_triton`
    with raw of q's shape), q and raw `[..., trailing dims]`; the result in q's shape and dtype,
    computed in float32. q must hold an element (the dispatcher sends empty ones to the torch
    path). `table`: the launch table (None: q's device's, the log decay's)."""
    table = LAUNCH_TABLES.launch_table_for(q.device) if table is None else table
    width = q.shape[-1] if r is None else r.shape[0]
    rows_raw = None if raw is None else as_rows(raw.reshape(-1, width))
    out = _ReadGate.apply(as_rows(q.reshape(-1, width)), r, rows_raw, table)
    return out.view(q.shape)


@opaque_to_compiler
def sigmoid_gate_triton(x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(logits) by the kernels with no read vector (`_ReadGate` with r None: the read
    at the vector 1/2 without its exp, load or sum), validated inputs of one shape; the result
    in x's shape and dtype, computed in float32. x must hold an element."""
    return read_query_triton(x, None, logits)
