"""A few rows through a linear map: the matrix products of a one-token decoding step.

    row_linear(x, weight, bias=None, residual=None, *, norm_weight=None, norm_eps=1e-5,
               swiglu=False, out=None, backend="auto")
        = residual + n(x) weight^T + bias       x `[M, K]`, weight `[N, K]` -> `[M, N]`

    n(x) = x / sqrt(mean(x^2) + norm_eps) * norm_weight, rounded to x's dtype (the `RMSNorm`
    module's output: a pre-norm block's norm and the product after it), or x (no norm_weight);
    with swiglu, x `[M, 2K]` holds SwiGLU's gate and up halves and n(x) = silu(gate) * up,
    rounded to x's dtype (`deltalab.ops.swiglu`'s output: the FFN's down projection).

At one row a product reads its whole weight once and does two flops a weight: its time is the
weight's bytes over the memory bandwidth the kernel reaches. cuBLAS's kernels for one row reach
0.4-1.7 TB/s on an H100 at a 340M layer's shapes (5376 x 1024 down to 2048 x 256); the Triton
kernel here streams each program's rows of the weight in wide blocks and measured 0.67-0.91x
cuBLAS's time at those shapes (docs/PERFORMANCE.md, "Where a decoded token's time goes").
Each row streams the whole weight again, where cuBLAS's tiles read it once for all rows, so
"auto" takes the kernel for at most `MAX_TRITON_ROWS` rows; `backend="triton"` runs it at any
number. At 64 rows no Triton product with `tl.dot` gained enough over cuBLAS to keep (the same
page, and its "Variants that lost").

Backends: "naive" (the definition in float64), "torch" (`torch.addmm` / `F.linear`, what
`nn.Linear` runs), "triton" (one kernel; CUDA, or CPU under TRITON_INTERPRET=1; float32
accumulation, rounded once to x's dtype), "auto" ("triton" on CUDA for at most MAX_TRITON_ROWS
rows of a 16-bit or float32 x, else "torch"). No autograd: a decoding step's products run
under `torch.no_grad`.

The norm in the kernel: each program first walks its row of x for the mean square (x is a
few KB, read from cache by every program), then scales each block of x as it streams the
weight. At one row a norm's own launch costs about 2 us on an H100 for a 1024-wide row, which
is 40% of the product after it.

SwiGLU in the kernel: each block of the product's input is silu of the gate's block times
up's block, K columns on, rounded to x's dtype; one launch fewer a layer, as for the norm.
The torch backend gates the same way (in float32, rounded once) before its product.

On NVIDIA cards of compute capability 9.0 and later, with Triton 3.5 or later, the kernel is
launched dependent (`deltalab.ops._triton.dependent_launch`): it waits for the kernel ahead of
it before touching memory and lets the next kernel start as soon as all its programs run, so
that consecutive launches of a decoding step overlap their starts.

`out` takes the result where the caller wants it; out = residual accumulates the product into
the residual in place. torch's addmm would otherwise copy the residual into a new output first
(one device-to-device copy a product: 48 a token of a 340M decoder at 64 sequences).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltalab.ops._checks import require_choice, require_float, require_same_device, require_shape
from deltalab.ops._triton import require_triton, triton_available
from deltalab.ops.norms.reference import rms_norm_naive, rms_norm_torch
from deltalab.ops.swiglu.reference import swiglu_formula, swiglu_naive

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
# for all rows, win.
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


def row_linear_naive(
    x, weight, bias=None, residual=None, norm_weight=None, norm_eps=1e-5, swiglu=False
) -> torch.Tensor:
    """The definition in float64, rounded to x's dtype once."""
    rows = x.double()
    if swiglu:
        rows = swiglu_formula(rows)
    if norm_weight is not None:
        rows = rms_norm_naive(rows, norm_weight.double(), norm_eps)
    y = rows @ weight.double().t()
    if bias is not None:
        y = y + bias.double()
    if residual is not None:
        y = y + residual.double()
    return y.to(x.dtype)


def _row_linear_torch(x, weight, bias, residual, out) -> torch.Tensor:
    """torch's products; into `out` where given (out is residual: accumulated in place by
    `addmm_`, which copies nothing)."""
    if out is None:
        if residual is None:
            return F.linear(x, weight, bias)
        if bias is None:
            return torch.addmm(residual, x, weight.t())
        return residual + F.linear(x, weight, bias)
    if residual is None:
        if bias is None:
            return torch.mm(x, weight.t(), out=out)
        return torch.addmm(bias, x, weight.t(), out=out)
    if _same_view(out, residual):
        out.addmm_(x, weight.t())
    else:
        torch.addmm(residual, x, weight.t(), out=out)
    return out if bias is None else out.add_(bias)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def _require_out(out, rows, outputs, x, residual, operands) -> None:
    """out: `[M, N]` of x's dtype and device, unit column stride, rows apart (no two outputs in
    one place); it may be the residual itself but no other view of its memory, and shares no
    memory with the other operands."""
    require_shape("out", out, (rows, outputs), "[M, N]", "(x's rows, weight's N)")
    if out.dtype != x.dtype or out.device != x.device:
        raise TypeError(f"out must have x's dtype and device, got {out.dtype} on {out.device}")
    if outputs > 1 and out.stride(1) != 1:
        raise ValueError(f"out must have unit column stride, got strides {out.stride()}")
    if rows > 1 and out.stride(0) < outputs:
        raise ValueError(f"out's rows overlap (row stride {out.stride(0)} < N = {outputs})")
    storage = out.untyped_storage().data_ptr()
    if residual is not None and residual.untyped_storage().data_ptr() == storage:
        if not _same_view(out, residual):
            raise ValueError("out shares memory with residual: give out = residual or new memory")
    for name, t in operands.items():
        if t is not None and t.untyped_storage().data_ptr() == storage:
            raise ValueError(f"out shares memory with {name}: give new memory")


def row_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-5,
    swiglu: bool = False,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """residual + n(x) weight^T + bias: x `[M, K]` (rows of unit column stride, any row stride:
    a column slice of a wider product), weight `[N, K]`, bias `[N]`, residual `[M, N]` (None:
    none), all of x's dtype -> `[M, N]` in x's dtype. n: x's RMS norm times norm_weight `[K]`
    (any float dtype) with norm_eps, rounded to x's dtype (None: x); swiglu: x `[M, 2K]` is
    SwiGLU's gate and up, n(x) = silu(gate) * up rounded to x's dtype (not with norm_weight).
    out: `[M, N]` to write and return (None: a new tensor); out = residual sums into the
    residual in place."""
    x = require_float("x", x)
    weight = require_float("weight", weight)
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K] rows, got shape {tuple(x.shape)}")
    if not isinstance(swiglu, bool):
        raise TypeError(f"swiglu must be a bool, got {swiglu!r}")
    rows, width = x.shape[0], x.shape[1] // 2 if swiglu else x.shape[1]
    if swiglu and x.shape[1] % 2:
        raise ValueError(f"swiglu: x must be [M, 2K] (gate, then up), got {tuple(x.shape)}")
    if swiglu and norm_weight is not None:
        raise ValueError("swiglu: the product gates x or normalizes it, give norm_weight=None")
    expected = "(K = x.shape[1] / 2)" if swiglu else "(K = x.shape[1])"
    require_shape("weight", weight, (weight.shape[0], width), "[N, K]", expected)
    outputs = weight.shape[0]
    if bias is not None:
        require_shape("bias", bias, (outputs,), "[N]", "(N = weight.shape[0])")
    if residual is not None:
        require_shape("residual", residual, (rows, outputs), "[M, N]", "(x's rows, weight's N)")
    if norm_weight is not None:
        norm_weight = require_float("norm_weight", norm_weight)
        require_shape("norm_weight", norm_weight, (width,), "[K]", "(K = x.shape[1])")
    require_same_device(
        {"x": x, "weight": weight, "bias": bias, "residual": residual, "norm_weight": norm_weight}
    )
    if out is not None:
        operands = {"x": x, "weight": weight, "bias": bias, "norm_weight": norm_weight}
        _require_out(out, rows, outputs, x, residual, operands)
    for name, t in {"weight": weight, "bias": bias, "residual": residual}.items():
        if t is not None and t.dtype != x.dtype:
            raise TypeError(f"{name} must have x's dtype {x.dtype}, got {t.dtype}")
    backend = resolve_backend(backend, x)
    if min(rows, width, outputs) == 0 and backend == "triton":
        backend = "torch"  # nothing to stream: torch's product makes the empty or zero result
    if backend == "naive":
        y = row_linear_naive(x, weight, bias, residual, norm_weight, norm_eps, swiglu)
        return y if out is None else out.copy_(y)
    if backend == "triton":
        from deltalab.ops.row_linear.triton import row_linear_triton

        return row_linear_triton(x, weight, bias, residual, norm_weight, norm_eps, out, swiglu)
    if swiglu:
        x = swiglu_naive(x)  # float32 for 16-bit x, rounded once, as the kernel gates
    if norm_weight is not None:
        x = rms_norm_torch(x, norm_weight, norm_eps).to(x.dtype)
    return _row_linear_torch(x, weight, bias, residual, out)
