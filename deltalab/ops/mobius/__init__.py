"""Scans of Mobius maps: x_t = (A_t x_{t-1} + B_t) / (C_t x_{t-1} + D_t), all t at once.

Backends: "sequential" (step loop, the definition), "parallel" (log-depth scan of renormalized
2x2 matrix products), "triton" (a Triton kernel, forward and backward: CUDA, or CPU under
TRITON_INTERPRET=1). "auto" picks "triton" on CUDA when Triton is installed, else "parallel".
README.md in this folder has the math.
"""

from __future__ import annotations

import torch

from deltalab.ops._checks import (
    require_choice,
    require_float,
    require_nonnegative,
    require_same_device,
    require_shape,
    state_dtype,
    values_checkable,
)
from deltalab.ops._triton import require_triton, triton_available
from deltalab.ops.mobius.parallel import mobius_scan_parallel
from deltalab.ops.mobius.sequential import mobius_scan_sequential

__all__ = [
    "BACKENDS",
    "mobius_scan",
    "mobius_scan_parallel",
    "mobius_scan_sequential",
    "resolve_backend",
    "scan_along_time",
]

BACKENDS = ("auto", "sequential", "parallel", "triton")


def resolve_backend(backend: str, device: torch.device, name: str = "backend") -> str:
    """The scan that runs: "auto" is "triton" where it compiles (CUDA), else "parallel"."""
    if backend == "auto":
        return "triton" if triton_available(device) else "parallel"
    if backend == "triton":
        require_triton(name, device)
    return backend


def scan_along_time(
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    x0: torch.Tensor,
    backend: str,
) -> torch.Tensor:
    """The scan along axis 1 of `[N, T, *rest]` maps from x0 `[N, *rest]` (validated, one dtype),
    by a resolved backend ("sequential", "parallel" or "triton"). KDN's gates are laid out this
    way; the Triton kernel reads them in place."""
    if backend == "triton":
        from deltalab.ops.mobius.triton import mobius_scan_lanes

        return mobius_scan_lanes(A, B, C, D, x0)
    scan = mobius_scan_sequential if backend == "sequential" else mobius_scan_parallel
    maps = [x.movedim(1, -1) for x in (A, B, C, D)]
    return scan(*maps, x0).movedim(-1, 1)


def _check_determinant(A, B, C, D) -> None:
    # Products of two float32 numbers are exact in float64, so the sign is exact for float32
    # inputs (and correctly rounded for float64 ones).
    if not values_checkable(A):
        return  # nothing may be read back while a CUDA graph records
    det = A.double() * D.double() - B.double() * C.double()
    if not bool((det > 0).all()):
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
        backend: "auto", "sequential", "parallel" or "triton" (see the module docstring).

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
    backend = resolve_backend(backend, A.device)

    dtype = state_dtype(A, B, C, D, x0)
    inputs = [x.to(dtype) for x in (A, B, C, D, x0)]
    if backend == "sequential":
        return mobius_scan_sequential(*inputs)
    if backend == "triton":
        from deltalab.ops.mobius.triton import mobius_scan_triton

        return mobius_scan_triton(*inputs)
    return mobius_scan_parallel(*inputs)
