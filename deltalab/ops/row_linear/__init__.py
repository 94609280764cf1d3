"""A few rows through a linear map: the matrix products of a one-token decoding step.

    row_linear(x, weight, bias=None, residual=None, *, backend="auto")
        = residual + x weight^T + bias          x `[M, K]`, weight `[N, K]` -> `[M, N]`

At one row a product reads its whole weight once and does two flops a weight: its time is the
weight's bytes over the memory bandwidth the kernel reaches. cuBLAS's kernels for one row reach
0.4-1.7 TB/s on an H100 at a 340M layer's shapes (5376 x 1024 down to 2048 x 256); the Triton
kernel here streams each program's rows of the weight in wide blocks and measured 0.67-0.91x
cuBLAS's time at those shapes (docs/PERFORMANCE.md, "Where a decoded token's time goes"). At
64 rows it has no gain over cuBLAS and is not offered: `MAX_TRITON_ROWS`.

Backends: "naive" (the definition in float64), "torch" (`torch.addmm` / `F.linear`, what
`nn.Linear` runs), "triton" (one kernel; CUDA, or CPU under TRITON_INTERPRET=1; float32
accumulation, rounded once to x's dtype), "auto" ("triton" on CUDA for at most MAX_TRITON_ROWS
rows of a 16-bit or float32 x, else "torch"). No autograd: a decoding step's products run
under `torch.no_grad`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltalab.ops._checks import require_choice, require_float, require_same_device, require_shape
from deltalab.ops._triton import require_triton, triton_available

__all__ = [
    "BACKENDS",
    "MAX_TRITON_ROWS",
    "products_backend",
    "resolve_backend",
    "row_linear",
    "row_linear_naive",
]

BACKENDS = ("auto", "naive", "torch", "triton")
# Each row streams the whole weight again: past a few rows cuBLAS's tiles, which read it once
# for every row, win (at 64 rows it is 0.82-1.09x this kernel's time with `tl.dot`).
MAX_TRITON_ROWS = 4


def resolve_backend(backend: str, x: torch.Tensor) -> str:
    require_choice("backend", backend, BACKENDS)
    if backend == "auto":
        fits = x.dtype != torch.float64 and x.shape[0] <= MAX_TRITON_ROWS
        return "triton" if fits and triton_available(x.device) else "torch"
    if backend == "triton":
        require_triton("backend", x.device)
    return backend


def products_backend(layer_backend: str, x: torch.Tensor) -> str:
    """The backend of a decoding step's products of x `[M, K]` in a layer on `layer_backend` (a
    layer's: "auto", "triton", "chunk", "torch" or "naive"): the kernel where the layer asks for
    Triton and the op offers it (at most MAX_TRITON_ROWS rows, not float64; how the
    interpreter's tests reach it on CPU), torch's product where the layer asks for a PyTorch
    path (the product `nn.Linear` runs, not the float64 definition), else "auto"."""
    if layer_backend in ("chunk", "torch", "naive"):
        return "torch"
    few = x.shape[0] <= MAX_TRITON_ROWS and x.dtype != torch.float64
    return "triton" if layer_backend == "triton" and few else "auto"


def row_linear_naive(x, weight, bias=None, residual=None) -> torch.Tensor:
    """The definition in float64, rounded to x's dtype."""
    y = x.double() @ weight.double().t()
    if bias is not None:
        y = y + bias.double()
    if residual is not None:
        y = y + residual.double()
    return y.to(x.dtype)


def _row_linear_torch(x, weight, bias, residual) -> torch.Tensor:
    if residual is None:
        return F.linear(x, weight, bias)
    if bias is None:
        return torch.addmm(residual, x, weight.t())
    return residual + F.linear(x, weight, bias)


def row_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """residual + x weight^T + bias: x `[M, K]` (rows of unit column stride, any row stride: a
    column slice of a wider product), weight `[N, K]`, bias `[N]`, residual `[M, N]` (None:
    none), all of x's dtype -> `[M, N]` in x's dtype."""
    x = require_float("x", x)
    weight = require_float("weight", weight)
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K] rows, got shape {tuple(x.shape)}")
    rows, width = x.shape
    require_shape("weight", weight, (weight.shape[0], width), "[N, K]", "(K = x.shape[1])")
    outputs = weight.shape[0]
    if bias is not None:
        require_shape("bias", bias, (outputs,), "[N]", "(N = weight.shape[0])")
    if residual is not None:
        require_shape("residual", residual, (rows, outputs), "[M, N]", "(x's rows, weight's N)")
    require_same_device({"x": x, "weight": weight, "bias": bias, "residual": residual})
    for name, t in {"weight": weight, "bias": bias, "residual": residual}.items():
        if t is not None and t.dtype != x.dtype:
            raise TypeError(f"{name} must have x's dtype {x.dtype}, got {t.dtype}")
    backend = resolve_backend(backend, x)
    if min(rows, width, outputs) == 0 and backend == "triton":
        backend = "torch"  # nothing to stream: torch's product makes the empty or zero result
    if backend == "naive":
        return row_linear_naive(x, weight, bias, residual)
    if backend == "triton":
        from deltalab.ops.row_linear.triton import row_linear_triton

        return row_linear_triton(x, weight, bias, residual)
    return _row_linear_torch(x, weight, bias, residual)
