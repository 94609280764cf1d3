"""The normed linear map of a decoding step: RMSNorm, matrix product and its epilogue in one op.

    normed_linear(x, weight, *, norm_weight=None, eps=1e-5, epilogue="none", residual=None,
                  bias=None, backend="auto", table=None)
        = [swiglu](rms_norm(x, norm_weight, eps) W^T + bias) + residual

x `[M, D]` (M rows: a decoding step's batch), weight `[N, D]` (nn.Linear's layout). With
epilogue "swiglu" weight holds the FFN's `gate_up`: the gate's N/2 rows, then up's, and the
result is silu(gate) * up `[M, N/2]` (`deltalab.ops.swiglu`'s layout). The result is in
weight's dtype, the product's: x's in a model without autocast, autocast's where the caller
keeps its weights in that dtype (x then stays the residual stream's dtype, as the RMSNorm
module's input does).

Backends: "naive" (the definition, no rounding between steps, in at least float32: float64 when
given float64), "torch" (the unfused modules' operations: the RMSNorm module, `F.linear`, the
swiglu op's float32 gating, `torch.addmm` for the residual), "triton" (one kernel: CUDA, or CPU
under TRITON_INTERPRET=1; forward only). "auto" picks "triton" on CUDA for inputs other than
float64 when no gradient is asked for, else "torch". README.md in this folder has the
numerics.

The static-cache decoder runs a block's norm and the projections after it with this op
(`deltalab.layers.decode_step`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deltalab.ops._checks import require_choice, require_float, require_same_device, require_shape
from deltalab.ops._triton import ELEMENTWISE_BACKENDS as BACKENDS
from deltalab.ops._triton import require_triton, triton_available
from deltalab.ops.normed_linear.reference import normed_linear_naive, normed_linear_torch

if TYPE_CHECKING:  # the kernel module imports Triton, which the other backends do without
    from deltalab.ops.normed_linear.triton import NormedLinearLaunch

__all__ = ["BACKENDS", "EPILOGUES", "normed_linear", "resolve_backend"]

EPILOGUES = ("none", "swiglu")


def _wants_grad(tensors: list[torch.Tensor | None]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def resolve_backend(backend: str, tensors: list[torch.Tensor | None]) -> str:
    """The backend that runs for the op's inputs `tensors` (x first): "auto" is "triton" on
    CUDA (compiled) when none is float64 and none asks for a gradient, else "torch"."""
    require_choice("backend", backend, BACKENDS)
    present = [t for t in tensors if t is not None]
    wide = any(t.dtype == torch.float64 for t in present)
    if backend == "auto":
        fits = not wide and not _wants_grad(present)
        return "triton" if fits and triton_available(present[0].device) else "torch"
    if backend == "triton":
        require_triton("backend", present[0].device)
        if wide:
            raise ValueError('backend="triton" computes in float32; float64 inputs take "torch"')
        if _wants_grad(present):
            raise ValueError(
                'backend="triton" computes no gradients: call it under torch.no_grad() or take '
                'backend="torch"'
            )
    return backend


def _validate(x, weight, norm_weight, epilogue, residual, bias) -> tuple[int, int]:
    """Checks every argument, naming it; (M, the output's width)."""
    x, weight = require_float("x", x), require_float("weight", weight)
    require_choice("epilogue", epilogue, EPILOGUES)
    if x.dim() != 2:
        raise ValueError(f"x must have shape [M, D], got {tuple(x.shape)}")
    rows, dim = x.shape
    if weight.dim() != 2 or weight.shape[1] != dim:
        raise ValueError(
            f"weight must have shape [N, D] with D = x.shape[1] = {dim}, got {tuple(weight.shape)}"
        )
    if epilogue == "swiglu" and weight.shape[0] % 2:
        raise ValueError(
            f"epilogue=\"swiglu\" needs weight [2F, D] (the gate's rows, then up's), got "
            f"{tuple(weight.shape)}"
        )
    width = weight.shape[0] // 2 if epilogue == "swiglu" else weight.shape[0]
    if norm_weight is not None:
        require_shape("norm_weight", require_float("norm_weight", norm_weight), (dim,), "[D]")
    if bias is not None:
        require_shape("bias", require_float("bias", bias), (weight.shape[0],), "[N]",
                      "(N = weight.shape[0])")  # fmt: skip
    if residual is not None:
        require_shape("residual", require_float("residual", residual), (rows, width),
                      "[M, N]", "(the output's shape)")  # fmt: skip
        if residual.dtype != weight.dtype:
            raise TypeError(
                f"residual must have weight's dtype {weight.dtype} (the output's), got "
                f"{residual.dtype}"
            )
    named = {"x": x, "weight": weight, "norm_weight": norm_weight, "residual": residual,
             "bias": bias}  # fmt: skip
    require_same_device(named)
    return rows, width


def normed_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-5,
    epilogue: str = "none",
    residual: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    backend: str = "auto",
    table: NormedLinearLaunch | None = None,
) -> torch.Tensor:
    """[swiglu](rms_norm(x) W^T + bias) + residual (module docstring).

    Args:
        x: `[M, D]`, any float dtype.
        weight: `[N, D]`; its dtype is the product's and the result's.
        norm_weight: `[D]`, the RMSNorm's weight; None: x enters the product as it is.
        eps: added to the mean square (the RMSNorm module's `eps`; its default).
        epilogue: "none", or "swiglu" (weight `[2F, D]`, the gate's rows then up's).
        residual: `[M, N]` (`[M, F]` with "swiglu") in weight's dtype, added to the result.
        bias: `[N]` (`[2F]`), added to the product, before the gating.
        backend: "auto", "naive", "torch" or "triton" (module docstring).
        table: the Triton kernel's launch table (`triton.NormedLinearLaunch`; None: the
            device's); the other backends take none.

    Returns `[M, N]` (`[M, F]`) in weight's dtype.
    """
    _validate(x, weight, norm_weight, epilogue, residual, bias)
    args = (x, weight, norm_weight, float(eps), epilogue, residual, bias)
    backend = resolve_backend(backend, [x, weight, norm_weight, residual, bias])
    if backend == "triton":
        from deltalab.ops.normed_linear.triton import normed_linear_triton

        return normed_linear_triton(*args, table=table)
    if table is not None:
        raise ValueError(f'table is the Triton kernel\'s; backend "{backend}" takes none')
    return normed_linear_naive(*args) if backend == "naive" else normed_linear_torch(*args)
