"""Scans of Mobius maps: x_t = (A_t x_{t-1} + B_t) / (C_t x_{t-1} + D_t), all t at once.

Backends: "sequential" (step loop, the definition), "parallel" (log-depth scan of renormalized
2x2 matrix products). "auto" picks "parallel". README.md in this folder has the math.
"""

from __future__ import annotations

import torch

from deltalab.ops._checks import (
    compute_dtype,
    require_choice,
    require_float,
    require_nonnegative,
    require_same_device,
    require_shape,
)
from deltalab.ops.mobius.parallel import mobius_scan_parallel
from deltalab.ops.mobius.sequential import mobius_scan_sequential

__all__ = ["BACKENDS", "mobius_scan", "mobius_scan_parallel", "mobius_scan_sequential"]

BACKENDS = ("auto", "sequential", "parallel")


def _check_determinant(A, B, C, D) -> None:
    # Products of two float32 numbers are exact in float64, so the sign is exact for float32
    # inputs (and correctly rounded for float64 ones).
    det = A.double() * D.double() - B.double() * C.double()
    if det.numel() and not bool((det > 0).all()):
        raise ValueError(
            "A * D - B * C must be > 0 at every step (an invertible, increasing map), "
            f"got a minimum of {det.min().item():.4g}"
        )


def mobius_scan(
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    x0: torch.Tensor,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Iterates the per-step maps x -> (A_t x + B_t) / (C_t x + D_t) from x0.

    Args:
        A, B, C, D: map coefficients `[..., T]`, T >= 1, entries >= 0, A * D - B * C > 0.
        x0: starting points `[...]` (the leading shape of A), >= 0.
        backend: "auto", "sequential" or "parallel".

    Returns:
        x_1..x_T `[..., T]`, in float64 when any input is float64, else float32.
    """
    for name, x in (("A", A), ("B", B), ("C", C), ("D", D), ("x0", x0)):
        require_float(name, x)
    if A.dim() == 0:
        raise ValueError("A must have rank >= 1 ([..., T]), got a 0-d tensor")
    if A.shape[-1] == 0:
        raise ValueError("A must hold at least one step (T >= 1), got T = 0")
    for name, x in (("B", B), ("C", C), ("D", D)):
        require_shape(name, x, A.shape, "[..., T]", "to match A")
    require_shape("x0", x0, A.shape[:-1], "[...]", "(the shape of A without its last axis)")
    require_same_device({"A": A, "B": B, "C": C, "D": D, "x0": x0})
    for name, x in (("A", A), ("B", B), ("C", C), ("D", D), ("x0", x0)):
        require_nonnegative(name, x, "Mobius scans are defined for non-negative maps")
    _check_determinant(A, B, C, D)
    require_choice("backend", backend, BACKENDS)

    dtype = compute_dtype(A, B, C, D, x0)
    inputs = [x.to(dtype) for x in (A, B, C, D, x0)]
    if backend == "sequential":
        return mobius_scan_sequential(*inputs)
    return mobius_scan_parallel(*inputs)
