"""Norms over the last dim: the (gated) RMS norm and the L2 normalization of q and k.

    rms_norm(x, weight, eps, gate=None, activation="sigmoid", *, out_dtype=None, backend="auto")
        = x / sqrt(mean(x^2) + eps) * weight  (* activation(gate))
    l2_normalize(x, eps=1e-6, *, backend="auto") = x / sqrt(sum(x^2) + eps)

Backends: "naive" (the formula left to autograd, in at least float32: float64 when given
float64), "torch" (`_RMSNormFunction`, the layers' RMS norm before this op existed, bit for
bit, with its hand-written backward; `_L2NormFunction`, the L2 formula's forward keeping its
output for a hand-written backward), "triton" (one kernel each
way for both norms: CUDA, or CPU under TRITON_INTERPRET=1; rows up to MAX_TRITON_DIM). "auto"
picks "triton" on CUDA for float32 and narrower inputs, else "torch". README.md in this folder
has the math and the precision.

The layers pick the backend from their delta rule's (`layer_backend`): "auto" and "triton" are
the same here, "chunk" and "naive" (the PyTorch paths of the delta rule) take "torch".
"""

from __future__ import annotations

import torch

from deltalab.ops._checks import require_choice, require_float, require_same_device, require_shape
from deltalab.ops._triton import ELEMENTWISE_BACKENDS as BACKENDS
from deltalab.ops._triton import require_triton, triton_available
from deltalab.ops.norms.reference import (
    compute_dtype,
    l2_normalize_naive,
    l2_normalize_torch,
    rms_norm_naive,
    rms_norm_torch,
)

__all__ = [
    "ACTIVATIONS",
    "BACKENDS",
    "L2_EPS",
    "MAX_TRITON_DIM",
    "compute_dtype",
    "l2_normalize",
    "layer_backend",
    "resolve_backend",
    "rms_norm",
]

ACTIVATIONS = ("sigmoid", "silu")
# eps inside the square root of the L2 norm, as fla's `l2norm`: keeps an all-zero key finite.
L2_EPS = 1e-6
# The widest row the Triton kernels take: a program holds a whole row in registers (64 float32
# values a thread at 8 warps); wider rows take the torch path under "auto".
MAX_TRITON_DIM = 16384


def layer_backend(delta_rule_backend: str) -> str:
    """The norms' backend in a layer or model whose delta rule runs on `delta_rule_backend`:
    "auto" and "triton" as they are, the PyTorch paths ("chunk", "naive") "torch". So a layer
    switched to "chunk" (forward-mode gate-sensitivity probes) takes the torch norms too."""
    return delta_rule_backend if delta_rule_backend in ("auto", "triton") else "torch"


def resolve_backend(backend: str, x: torch.Tensor) -> str:
    """The backend that runs for x `[..., N]`: "auto" is "triton" on CUDA (compiled) for
    float32 or narrower x and N <= MAX_TRITON_DIM, else "torch" (the kernels compute in float32:
    float64 references and gradient checks stay in PyTorch)."""
    require_choice("backend", backend, BACKENDS)
    dim = x.shape[-1] if x.dim() else 1
    if backend == "auto":
        fits = x.dtype != torch.float64 and dim <= MAX_TRITON_DIM
        return "triton" if fits and triton_available(x.device) else "torch"
    if backend == "triton":
        require_triton("backend", x.device)
        if dim > MAX_TRITON_DIM:
            raise ValueError(
                f'backend="triton" takes rows of up to {MAX_TRITON_DIM} elements, got '
                f"x.shape[-1] = {dim}; use backend='torch'"
            )
    return backend


def _require_input(x: object) -> torch.Tensor:
    x = require_float("x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least one dim (the normalized last dim), got a scalar")
    return x


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    gate: torch.Tensor | None = None,
    activation: str = "sigmoid",
    *,
    out_dtype: torch.dtype | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, times activation(gate) when a gate
    is given.

    Args:
        x: `[..., N]`, any float dtype, any strides.
        weight: `[N]`.
        eps: added to the mean square.
        gate: `[..., N]` like x, or None.
        activation: of the gate, "sigmoid" or "silu".
        out_dtype: the result's dtype; None for the compute dtype (at least float32), which the
            torch path returns. The layers ask for x's dtype: "torch" and "naive" then round
            their result to it, "triton" writes it so directly.
        backend: "auto", "naive", "torch" or "triton" (see the module docstring).

    Returns `[..., N]`, computed in at least float32 ("triton": float32).
    """
    x = _require_input(x)
    weight = require_float("weight", weight)
    require_shape("weight", weight, (x.shape[-1],), "[N]", "(N = x.shape[-1])")
    if gate is not None:
        gate = require_float("gate", gate)
        require_shape("gate", gate, x.shape, "[..., N]", "(x's shape)")
    require_same_device({"x": x, "weight": weight, "gate": gate})
    require_choice("activation", activation, ACTIVATIONS)
    backend = resolve_backend(backend, x)
    if backend == "triton":
        from deltalab.ops.norms.triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps, gate, activation, out_dtype)
    norm = rms_norm_naive if backend == "naive" else rms_norm_torch
    y = norm(x, weight, eps, gate, activation)
    return y if out_dtype is None else y.to(out_dtype)


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS, *, backend: str = "auto") -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim of x `[..., N]`, computed in at least float32
    ("triton": float32); x's dtype out. Both "torch" and "triton" keep the output y (the
    delta rule keeps the normalized q and k anyway) and 4 bytes per row for backward, not x
    (`reference._L2NormFunction`)."""
    x = _require_input(x)
    backend = resolve_backend(backend, x)
    if backend == "triton":
        from deltalab.ops.norms.triton import l2_normalize_triton

        return l2_normalize_triton(x, eps)
    return l2_normalize_naive(x, eps) if backend == "naive" else l2_normalize_torch(x, eps)
