"""The PyTorch forms of RoPE: the definition and the attention layer's path before this op
existed.

    theta[t, i] = positions[t] * base^(-i / (K/2)),   i < K/2
    y[..., i]       = x[..., i] cos(theta) - x[..., i + K/2] sin(theta)
    y[..., i + K/2] = x[..., i + K/2] cos(theta) + x[..., i] sin(theta)

x `[B, T, H, K]`, positions `[T]`; the angles in at least float32 (`compute_dtype(x)`), the
result rounded once to x's dtype. "naive" is the definition written as the rotation of each pair
left to autograd (float64 when given float64: the tests' reference); "torch" is what
`deltalab.layers.attention.apply_rope` ran before this op existed, operation for operation (its
inverse frequencies from `inverse_frequencies`, the same call the Triton path makes), so the
layer switches to it without a change in a bit.
"""

from __future__ import annotations

import torch

from deltalab.ops.norms.reference import compute_dtype

__all__ = ["compute_dtype", "inverse_frequencies", "rope_naive", "rope_torch"]


def inverse_frequencies(
    half: int, base: float, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """base^(-i / half) for i < half, `[half]` in `dtype`: the attention layer's formula, one
    call shared by the torch path and the Triton kernels (so both rotate by the same angles)."""
    return base ** -(torch.arange(half, dtype=dtype, device=device) / half)


def rope_naive(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """The definition (module docstring) in `compute_dtype(x)`, left to autograd; x's dtype out."""
    dtype = compute_dtype(x)
    half = x.shape[-1] // 2
    exponent = torch.arange(0, 2 * half, 2, dtype=dtype, device=x.device) / (2 * half)
    theta = positions.to(dtype)[:, None, None] * base**-exponent  # [T, 1, K/2]
    pairs = x.to(dtype).unflatten(-1, (2, half))  # [..., 2, K/2]: (x_i, x_{i + K/2})
    first, second = pairs.unbind(-2)
    rotated = torch.stack(
        [
            first * theta.cos() - second * theta.sin(),
            first * theta.sin() + second * theta.cos(),
        ],
        dim=-2,
    )
    return rotated.flatten(-2).to(x.dtype)


def rope_torch(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """`deltalab.layers.attention.apply_rope` before this op existed, bit for bit."""
    dtype = compute_dtype(x)
    half = x.shape[-1] // 2
    inv_freq = inverse_frequencies(half, base, dtype, x.device)
    angles = positions.to(dtype)[:, None] * inv_freq  # [T, K/2]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]  # broadcast over heads
    x1, x2 = x.to(dtype).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
