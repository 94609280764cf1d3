"""`row_linear`'s kernel: each program owns BN outputs (BN rows of the weight) of one row of x
and walks K in blocks of BK, keeping a `[BN, BK]` float32 partial sum it reduces once at the
end; x's block is read once a program and broadcast over the weight's rows.

Launch (H100, 2026-12-07, bf16, a 340M layer's five one-row products, 24 distinct weights in
one CUDA graph; the sweep of 8 to 32 rows, blocks of 512 or 1024, 1 or 2 pipeline stages, 4 or
8 warps): 8 rows a program over 4 warps, 2 stages, blocks of 512 where K <= 1024 and of 1024
above (5.9 us at 5376 x 1024 against cuBLAS's 6.5; 5.0 at 1024 x 2400 against 6.2). Many small
programs keep enough reads in flight on every SM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltalab.ops._triton import dependent_launch, opaque_to_compiler

BLOCK_N = 8
NUM_WARPS = 4
NUM_STAGES = 2


def block_k(width: int) -> int:
    """The columns a step of the walk reads: 512 up to K = 1024, else 1024 (fewer steps)."""
    return min(512 if width <= 1024 else 1024, triton.next_power_of_2(width))


@triton.jit
def _input_block(X, row, stride_x, k, k_ok, K, SWIGLU: tl.constexpr):
    """Columns k of the row's input, float32: x's, or with SWIGLU silu(gate) * up of x's
    halves (gate at k, up at K + k) rounded to x's dtype, as `swiglu`'s kernel writes it."""
    x = tl.load(X + row * stride_x + k, mask=k_ok, other=0.0).to(tl.float32)
    if SWIGLU:
        up = tl.load(X + row * stride_x + K + k, mask=k_ok, other=0.0).to(tl.float32)
        x = (x * tl.sigmoid(x) * up).to(X.dtype.element_ty).to(tl.float32)
    return x


@triton.jit
def _row_linear_kernel(X, W, B, R, NORM_W, Y, N, K, stride_x, stride_r, stride_y, norm_eps,
                       HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_NORM: tl.constexpr,
                       BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                       SWIGLU: tl.constexpr = False, DEPENDENT: tl.constexpr = False):  # fmt: skip
    tl.static_assert(not (HAS_NORM and SWIGLU), "the norm or SwiGLU's gating, not both")
    if DEPENDENT:  # nothing read or written before the wait (`dependent_launch`)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
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
        x = _input_block(X, row, stride_x, k, k_ok, K, SWIGLU)
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


@opaque_to_compiler
def row_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-5,
    out: torch.Tensor | None = None,
    swiglu: bool = False,
    dependent: bool | None = None,
) -> torch.Tensor:
    """`row_linear` by the kernel, validated inputs (the module docstring of the op). out may
    be residual itself: each output is read from it and written back by one program.
    dependent: launched to start before the kernel ahead of it ends (`dependent_launch`; None:
    where the card supports it)."""
    rows, width = x.shape[0], weight.shape[1]
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
    grid = (triton.cdiv(outputs, BLOCK_N), rows)
    dependent = dependent_launch(x.device, dependent, "dependent")
    _row_linear_kernel[grid](
        x, weight, bias, residual, norm_weight, y, outputs, width, x.stride(0),
        0 if residual is None else residual.stride(0), y.stride(0), float(norm_eps),
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        HAS_NORM=norm_weight is not None, SWIGLU=swiglu, BN=BLOCK_N, BK=block_k(width),
        STAGES=NUM_STAGES, DEPENDENT=dependent, num_warps=NUM_WARPS, launch_pdl=dependent,
    )  # fmt: skip
    return y
