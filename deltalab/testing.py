"""Comparison helpers for tests and self-checks: norm-wise relative error that fails on NaN."""

from __future__ import annotations

import torch

# Tolerances per dtype for a fast path against a float64 reference (norm-wise relative error).
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64; inf when either side is not finite."""
    # On the CPU in float64: a GPU result and a CPU reference compare without moving either first.
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    if actual.shape != expected.shape:
        raise ValueError(f"shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    if not (torch.isfinite(actual).all() and torch.isfinite(expected).all()):
        return float("inf")
    denominator = expected.norm().item()
    difference = (actual - expected).norm().item()
    if denominator == 0.0:
        return difference
    return difference / denominator


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str = "") -> None:
    """Fails when the relative error exceeds `tol` or any value is NaN/inf."""
    error = relative_error(actual, expected)
    label = f"{what}: " if what else ""
    assert error <= tol, f"{label}relative error {error:.3e} exceeds {tol:.1e}"


def forward_tangent(fn, primals: list[torch.Tensor], tangents: list[torch.Tensor]) -> torch.Tensor:
    """The forward-mode derivative (jvp) of `fn(*primals)` along `tangents`: the tangent of its
    one tensor output (what gate-sensitivity probes push through an op)."""
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        duals = [fwAD.make_dual(p, t) for p, t in zip(primals, tangents, strict=True)]
        return fwAD.unpack_dual(fn(*duals)).tangent
