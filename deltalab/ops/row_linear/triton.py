"""`row_linear`'s kernels. The rows' kernel (`_row_linear_kernel`, up to DOT_ROWS rows): each
program owns BN outputs (BN rows of the weight) of one row of x and walks K in blocks of BK,
keeping a `[BN, BK]` float32 partial sum it reduces once at the end; x's block is read once a
program and broadcast over the weight's rows. The tiles' kernel (`_rows_dot_kernel`, from
DOT_ROWS rows): each program multiplies a tile of rows by a tile of outputs with `tl.dot`, so
that a block of the weight is read once for the tile's rows, not once a row.

Launch (H100, 2026-12-07, bf16, a 340M layer's five one-row products, 24 distinct weights in
one CUDA graph; the sweep of 8 to 32 rows, blocks of 512 or 1024, 1 or 2 pipeline stages, 4 or
8 warps): 8 rows a program over 4 warps, 2 stages, blocks of 512 where K <= 1024 and of 1024
above (5.9 us at 5376 x 1024 against cuBLAS's 6.5; 5.0 at 1024 x 2400 against 6.2). Many small
programs keep enough reads in flight on every SM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deltalab.ops._triton import opaque_to_compiler

BLOCK_N = 8
NUM_WARPS = 4
NUM_STAGES = 2
# From this many rows a program multiplies a tile of rows by `tl.dot` (`_rows_dot_kernel`).
DOT_ROWS = 16


@dataclass(frozen=True)
class DotLaunch:
    """The tiles' kernel's launch: rows and outputs a program (block_m, block_n; block_m is
    cut to the rows), the columns a step of its walk reads (block_k), pipeline stages, warps."""

    block_m: int = 64
    block_n: int = 32
    block_k: int = 128
    stages: int = 3
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of 2 >= 16 (tl.dot's tile), got {value}")
        if self.stages < 1 or self.num_warps < 1:
            raise ValueError(
                f"stages and num_warps must be >= 1, got {self.stages}, {self.num_warps}"
            )


DOT_LAUNCH = DotLaunch()


def block_k(width: int) -> int:
    """The columns a step of the walk reads: 512 up to K = 1024, else 1024 (fewer steps)."""
    return min(512 if width <= 1024 else 1024, triton.next_power_of_2(width))


@triton.jit
def _row_linear_kernel(X, W, B, R, NORM_W, Y, N, K, stride_x, stride_r, stride_y, norm_eps,
                       HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_NORM: tl.constexpr,
                       BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    row = tl.program_id(1).to(tl.int64)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    n_ok = n < N
    cols = tl.arange(0, BK)
    if HAS_NORM:
        # The row's mean square first (`_norm_fwd`'s float32 formula), then each block of x
        # normalized and rounded to x's dtype as the norm module's output is.
        squares = tl.zeros([BK], dtype=tl.float32)
        for start in tl.range(0, K, BK, num_stages=1):
            x = tl.load(X + row * stride_x + start + cols, mask=start + cols < K, other=0.0)
            x = x.to(tl.float32)
            squares += x * x
        rstd = 1.0 / tl.sqrt(tl.sum(squares) / K + norm_eps)
    partial = tl.zeros([BN, BK], dtype=tl.float32)
    for start in tl.range(0, K, BK, num_stages=STAGES):
        k = start + cols
        k_ok = k < K
        x = tl.load(X + row * stride_x + k, mask=k_ok, other=0.0).to(tl.float32)
        if HAS_NORM:
            scale = tl.load(NORM_W + k, mask=k_ok, other=0.0).to(tl.float32)
            x = (x * rstd * scale).to(X.dtype.element_ty).to(tl.float32)
        w = tl.load(W + n[:, None].to(tl.int64) * K + k[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        partial += w.to(tl.float32) * x[None, :]
    y = tl.sum(partial, axis=1)
    if HAS_BIAS:
        y += tl.load(B + n, mask=n_ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        y += tl.load(R + row * stride_r + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + n, y.to(Y.dtype.element_ty), mask=n_ok)


@triton.jit
def _rows_dot_kernel(X, W, B, R, NORM_W, Y, M, N, K, stride_x, stride_r, stride_y, norm_eps,
                     HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_NORM: tl.constexpr,
                     PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    """A tile of BM rows x BN outputs by `tl.dot`: each block of the weight is read once for
    all BM rows (the row kernel above reads it again for every row)."""
    m = tl.program_id(1) * BM + tl.arange(0, BM)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    m_ok, n_ok = m < M, n < N
    cols = tl.arange(0, BK)
    x_rows = X + m[:, None].to(tl.int64) * stride_x
    if HAS_NORM:
        # Each row's mean square first (x's rows are a few KB each, read again from cache).
        squares = tl.zeros([BM, BK], dtype=tl.float32)
        for start in tl.range(0, K, BK, num_stages=1):
            k = start + cols
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
            x = x.to(tl.float32)
            squares += x * x
        rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=1) / K + norm_eps)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for start in tl.range(0, K, BK, num_stages=STAGES):
        k = start + cols
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if HAS_NORM:
            scale = tl.load(NORM_W + k, mask=k_ok, other=0.0).to(tl.float32)
            x = (x.to(tl.float32) * rstd[:, None] * scale[None, :]).to(X.dtype.element_ty)
        w = tl.load(W + n[None, :].to(tl.int64) * K + k[:, None],
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # fmt: skip
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(B + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ok = m_ok[:, None] & n_ok[None, :]
    if HAS_RESIDUAL:
        r = tl.load(R + m[:, None].to(tl.int64) * stride_r + n[None, :], mask=out_ok, other=0.0)
        acc += r.to(tl.float32)
    tl.store(Y + m[:, None].to(tl.int64) * stride_y + n[None, :], acc.to(Y.dtype.element_ty),
             mask=out_ok)  # fmt: skip


@opaque_to_compiler
def row_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-5,
    out: torch.Tensor | None = None,
    launch: DotLaunch | None = None,
) -> torch.Tensor:
    """`row_linear` by a kernel, validated inputs (the module docstring of the op): from
    DOT_ROWS rows the tiles' kernel (at `launch`, None: DOT_LAUNCH), else the rows'. out may be
    residual itself: each output is read from it and written back by one program."""
    rows, width = x.shape
    outputs = weight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    # The kernel reads the weight's rows and the bias as packed (the decoder's always are: a
    # module's parameters, or its concatenation of them); anything else is packed first.
    weight = weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    norm_weight = None if norm_weight is None else norm_weight.contiguous()
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    y = torch.empty(rows, outputs, dtype=x.dtype, device=x.device) if out is None else out
    # float64 (the naive backend's dtype, reachable by an explicit backend) takes the rows'
    # kernel, which computes in float32: tl.dot's float32 accumulator does not take it.
    if rows >= DOT_ROWS and x.dtype != torch.float64:
        _rows_dot(x, weight, bias, residual, norm_weight, norm_eps, y, launch)
        return y
    grid = (triton.cdiv(outputs, BLOCK_N), rows)
    _row_linear_kernel[grid](
        x, weight, bias, residual, norm_weight, y, outputs, width, x.stride(0),
        0 if residual is None else residual.stride(0), y.stride(0), float(norm_eps),
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        HAS_NORM=norm_weight is not None, BN=BLOCK_N, BK=block_k(width), STAGES=NUM_STAGES,
        num_warps=NUM_WARPS,
    )  # fmt: skip
    return y


def _rows_dot(x, weight, bias, residual, norm_weight, norm_eps, y, launch) -> None:
    launch = DOT_LAUNCH if launch is None else launch
    rows, width = x.shape
    outputs = weight.shape[0]
    block_m = max(16, min(launch.block_m, triton.next_power_of_2(rows)))
    block_k = max(16, min(launch.block_k, triton.next_power_of_2(width)))
    grid = (triton.cdiv(outputs, launch.block_n), triton.cdiv(rows, block_m))
    _rows_dot_kernel[grid](
        x, weight, bias, residual, norm_weight, y, rows, outputs, width, x.stride(0),
        0 if residual is None else residual.stride(0), y.stride(0), float(norm_eps),
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        HAS_NORM=norm_weight is not None,
        # float32 rows multiply in full precision (tf32 would round them to 10 mantissa
        # bits); for 16-bit rows the setting is moot.
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BM=block_m,
        BN=launch.block_n, BK=block_k, STAGES=launch.stages, num_warps=launch.num_warps,
    )  # fmt: skip
