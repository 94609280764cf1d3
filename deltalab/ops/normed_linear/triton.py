"""The normed linear map in one Triton kernel: RMSNorm prologue, product, SwiGLU / bias /
residual epilogue, for the few rows of a decoding step.

    r = 1 / sqrt(mean(x^2) + eps)                    (per row, when the norm is asked for)
    h = round_x(x r norm_weight)                     (the RMSNorm module's output, x's dtype)
    acc = round_w(h) W^T  (+ bias)                   (float32 accumulation)
    y = silu(g) u,  g, u = round_y(acc[:, :F]), round_y(acc[:, F:])      (epilogue "swiglu")
    y = round_y(y + residual)

round_x, round_w, round_y: rounding to x's, weight's and the output's (= weight's) dtype, where
the unfused modules round (README.md in this folder).

Layout. x `[M, D]` and W `[N, D]` (nn.Linear's layout) with unit column stride. A program owns
BM rows and BN output columns (with "swiglu", BN columns of h: the gate rows c and the up rows
F + c of W). It first walks its rows of x once for their sums of squares (D ~ 1024-2304 values
a row: a few KB, from L2 after the first program), then walks D in steps of BK: loads its rows
of x, normalizes and rounds them, loads the `[BN, BK]` tile of W (each row BK contiguous
elements: whole sectors) and accumulates. W is read once over all programs when M <= BM.

The product: at M < `dot_rows` a broadcast multiply and sum, `[BM, BN, BK]` products in
registers then `tl.sum` over BK; from `dot_rows` on `tl.dot`, whose operands must be at least
16 in every dim (M padded to BM >= 16). At M = 1 padding to 16 would spend 15/16 of the tensor
core's work and of the x tile's registers on zeros, and a GEMV is bound by the bytes of W, not
by its flops: the broadcast keeps every lane on a useful product. At M = 64 the broadcast's
`[64, BN, BK]` tile would not fit in registers: tl.dot is what keeps W read once. The
broadcast's BK shrinks as BM grows (`launch`), so its tile stays BN x BK products.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deltalab.ops._triton import opaque_to_compiler
from deltalab.ops.launch_tables import LaunchRegistry
from deltalab.ops.normed_linear.reference import normed_linear_naive


@dataclass(frozen=True)
class ProductLaunch:
    """One form of the product's launch: output columns a program, the reduction step, warps,
    pipeline stages of the loop over D."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class NormedLinearLaunch:
    """The kernel's launch table: the row count from which the product is a `tl.dot`
    (`dot_rows`), the rows a tl.dot program owns at most (`block_m`, at least 16: M = 64 in one
    block reads W once), and each form's `ProductLaunch`."""

    dot_rows: int
    block_m: int
    broadcast: ProductLaunch
    dot: ProductLaunch


# First choices, not yet timed on a GPU (python -m benchmarks small_ops --ops normed_linear).
# M = 1: 16 columns a program, so that the 340M projections (N = 2400 to 32000 columns) give
# 150 to 2000 programs for the 132 SMs; BK = 256 bfloat16 = 512 bytes of each row of W a step.
# M >= 8: tl.dot on 32 columns, BK 64, M up to 64 in one program, 8 warps: compiled for sm_90
# (ptxas, no GPU) at 4 warps it spilled 176-304 bytes a thread with the SwiGLU epilogue, at 8
# it takes 128-186 registers and spills nothing; the broadcast at M = 1 takes 56 (no gating)
# and 148 (SwiGLU) registers (tests/test_normed_linear.py compiles them).
LAUNCH = NormedLinearLaunch(
    dot_rows=8,
    block_m=64,
    broadcast=ProductLaunch(block_n=16, block_k=256, num_warps=4, num_stages=2),
    dot=ProductLaunch(block_n=32, block_k=64, num_warps=8, num_stages=3),
)
# The table per card (`deltalab.ops.launch_tables`), for calls given none.
LAUNCH_TABLES = LaunchRegistry("normed_linear", LAUNCH)


def _power_of_2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def launch(rows: int, table: NormedLinearLaunch = LAUNCH) -> tuple[int, ProductLaunch, bool]:
    """(BM rows a program, the product's launch with its effective BK, whether it is a tl.dot)
    for M = `rows`."""
    if rows >= table.dot_rows:
        dot = table.dot
        if min(table.block_m, dot.block_n, dot.block_k) < 16:
            raise ValueError(
                "table: tl.dot needs block_m, dot.block_n and dot.block_k >= 16, got "
                f"{table.block_m}, {dot.block_n}, {dot.block_k}"
            )
        return min(table.block_m, max(16, _power_of_2_at_least(rows))), dot, True
    block_m = _power_of_2_at_least(rows)
    wide = table.broadcast
    block_k = max(16, wide.block_k // block_m)
    return block_m, ProductLaunch(wide.block_n, block_k, wide.num_warps, wide.num_stages), False


@triton.jit
def _row_rstd(X, x_at, row_ok, D, eps, BM: tl.constexpr, BK: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) of each row `[BM]` (x_at: the rows' first elements' offsets
    from X), float32, as the norms' kernel computes it."""
    ks = tl.arange(0, BK)
    ss = tl.zeros([BM], dtype=tl.float32)
    for k0 in range(0, D, BK):
        k = k0 + ks
        xk = tl.load(X + x_at + k[None, :], mask=row_ok[:, None] & (k < D)[None, :], other=0.0)
        xk = xk.to(tl.float32)
        ss += tl.sum(xk * xk, axis=1)
    return 1.0 / tl.sqrt(ss / D + eps)


@triton.jit
def _accumulate(acc, x, w, DOT: tl.constexpr, IEEE: tl.constexpr):
    """acc + x w^T: x `[BM, BK]` and w `[BN, BK]` in weight's dtype, acc `[BM, BN]` float32.
    IEEE: float32 operands multiplied in float32 (not TF32), as torch's float32 matmul."""
    if DOT:
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    else:
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    return acc


# N not specialized: Triton makes an int argument equal to 1 a constant, which has no `.to`.
@triton.jit(do_not_specialize=["N"])
def _normed_linear(X, NORM_W, W, BIAS, RES, Y, M, N, D, stride_x, stride_w, stride_r, eps,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                   SWIGLU: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    # N: the output's columns (h's F with SWIGLU: W has 2N rows, the gate's then up's).
    # The program's first row of x and of W by int64 scalars, the offsets within its tiles int32
    # (BM or 2 BN rows of D: half the registers of int64 addresses).
    first_row = tl.program_id(1) * BM
    first_col = tl.program_id(0) * BN
    X += first_row.to(tl.int64) * stride_x
    W += first_col.to(tl.int64) * stride_w
    W_UP = W + N.to(tl.int64) * stride_w  # the up half's rows (SWIGLU)
    lane_m = tl.arange(0, BM)
    lane_n = tl.arange(0, BN)
    rows = first_row + lane_m
    cols = first_col + lane_n
    row_ok = rows < M
    col_ok = cols < N
    # int64: x may be a view of a longer sequence (x[:, -1] of [B, T, D]), rows T*D apart.
    x_at = lane_m[:, None].to(tl.int64) * stride_x
    w_at = lane_n[:, None] * stride_w
    if HAS_NORM:
        rstd = _row_rstd(X, x_at, row_ok, D, eps, BM, BK)
    ks = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    acc_up = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, D, BK):
        k = k0 + ks
        k_ok = k < D
        xk = tl.load(X + x_at + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if HAS_NORM:
            nw = tl.load(NORM_W + k, mask=k_ok, other=0.0).to(tl.float32)
            # (x r) w, in the norm's order, rounded to x's dtype as the module returns it.
            xk = ((xk.to(tl.float32) * rstd[:, None]) * nw[None, :]).to(X.dtype.element_ty)
        xk = xk.to(W.dtype.element_ty)
        w_mask = col_ok[:, None] & k_ok[None, :]
        w = tl.load(W + w_at + k[None, :], mask=w_mask, other=0.0)
        acc = _accumulate(acc, xk, w, DOT, IEEE)
        if SWIGLU:
            wu = tl.load(W_UP + w_at + k[None, :], mask=w_mask, other=0.0)
            acc_up = _accumulate(acc_up, xk, wu, DOT, IEEE)
    if HAS_BIAS:
        acc += tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if SWIGLU:
            acc_up += tl.load(BIAS + N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if SWIGLU:
        # The unfused path stores gate_up in the output's dtype before the gating reads it.
        g = acc.to(Y.dtype.element_ty).to(tl.float32)
        u = acc_up.to(Y.dtype.element_ty).to(tl.float32)
        # sigmoid(g) is 0 once exp(-g) overflows (g < -88): h = g * 0 * u, finite.
        acc = g * tl.sigmoid(g) * u
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    if HAS_RES:
        res = tl.load(RES + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        acc += res.to(tl.float32)
    tl.store(Y + rows64[:, None] * N + cols[None, :], acc.to(Y.dtype.element_ty), mask=mask)


def _unit_columns(t: torch.Tensor | None) -> torch.Tensor | None:
    """t `[rows, n]` (or `[n]`) with unit stride in its last dim (a copy only when it has
    another)."""
    return t if t is None or t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


@opaque_to_compiler
def normed_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
    epilogue: str,
    residual: torch.Tensor | None,
    bias: torch.Tensor | None,
    *,
    table: NormedLinearLaunch | None = None,
) -> torch.Tensor:
    """The kernel on validated inputs (`deltalab.ops.normed_linear.normed_linear`); the result
    `[M, N]` (`[M, N / 2]` with "swiglu") in weight's dtype. `table`: the launch table (None:
    x's device's)."""
    table = LAUNCH_TABLES.launch_table_for(x.device) if table is None else table
    swiglu = epilogue == "swiglu"
    rows, dim = x.shape
    width = weight.shape[0] // 2 if swiglu else weight.shape[0]
    if rows == 0 or width == 0 or dim == 0:
        return normed_linear_naive(x, weight, norm_weight, eps, epilogue, residual, bias)
    x, weight, residual = _unit_columns(x), _unit_columns(weight), _unit_columns(residual)
    norm_weight, bias = _unit_columns(norm_weight), _unit_columns(bias)
    y = torch.empty(rows, width, dtype=weight.dtype, device=x.device)
    block_m, product, dot = launch(rows, table)
    grid = (triton.cdiv(width, product.block_n), triton.cdiv(rows, block_m))
    _normed_linear[grid](
        x, norm_weight, weight, bias, residual, y, rows, width, dim,
        x.stride(0), weight.stride(0), 0 if residual is None else residual.stride(0), float(eps),
        BM=block_m, BN=product.block_n, BK=product.block_k, HAS_NORM=norm_weight is not None,
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, SWIGLU=swiglu, DOT=dot,
        IEEE=weight.dtype == torch.float32, num_warps=product.num_warps,
        num_stages=product.num_stages,
    )  # fmt: skip
    return y
