"""Rotary position embeddings (RoPE) of the attention layer's queries and keys.

    rope(x, positions, *, base=ROPE_BASE, backend="auto")

rotates the channel pairs (i, i + K/2) of x `[B, T, H, K]` by positions[t] * base^(-i / (K/2)),
i < K/2, for the token at t (positions `[T]`, integers: a decoding step continues at the
cache's offset); the angles in at least float32, the result in x's dtype.

Backends: "naive" (the rotation of each pair as defined, left to autograd, in at least float32:
float64 when given float64), "torch" (the attention layer's path before this op existed, bit for
bit), "triton" (one kernel, run once each way: the forward reads x and positions and writes the
result, the backward is the inverse rotation of the output gradient; nothing saved but
positions; CUDA, or CPU under TRITON_INTERPRET=1). "auto" picks "triton" on CUDA for inputs
other than float64, else "torch". README.md in this folder has the math and the precision.

The attention layer (`deltalab.layers.Attention`) takes the model config's backend as the block
norms and the FFN do (`deltalab.ops.norms.layer_backend`: "chunk" and "naive" -> "torch").
"""

from __future__ import annotations

import torch

from deltalab.ops._checks import require_float, require_rank, require_tensor
from deltalab.ops._triton import ELEMENTWISE_BACKENDS as BACKENDS
from deltalab.ops._triton import elementwise_backend as resolve_backend
from deltalab.ops.rope.reference import (
    compute_dtype,
    inverse_frequencies,
    rope_naive,
    rope_torch,
)

__all__ = [
    "BACKENDS",
    "ROPE_BASE",
    "compute_dtype",
    "inverse_frequencies",
    "resolve_backend",
    "rope",
    "rope_naive",
    "rope_torch",
]

# Rotary base of the original RoPE paper and Llama 1/2.
ROPE_BASE = 10000.0


def _require_positions(positions: object, x: torch.Tensor) -> torch.Tensor:
    positions = require_tensor("positions", positions)
    if (
        positions.dtype.is_floating_point
        or positions.dtype.is_complex
        or positions.dtype == (torch.bool)
    ):
        raise TypeError(f"positions must be an integer tensor, got dtype {positions.dtype}")
    if tuple(positions.shape) != (x.shape[1],):
        raise ValueError(
            f"positions must have shape [T] = ({x.shape[1]},) (one per token of x [B, T, H, K]), "
            f"got {tuple(positions.shape)}"
        )
    if positions.device != x.device:
        raise ValueError(f"positions is on {positions.device} but x is on {x.device}")
    return positions


def rope(
    x: torch.Tensor, positions: torch.Tensor, *, base: float = ROPE_BASE, backend: str = "auto"
) -> torch.Tensor:
    """x `[B, T, H, K]` (K even; any float dtype, any strides) rotated by the angles
    positions `[T]` (integers) * base^(-i / (K/2)) -> `[B, T, H, K]` in x's dtype.

    Every backend computes the angles, cosines and sines in float32 (float64 for float64 x on
    "naive" and "torch") and rounds the result once; no gradient reaches positions."""
    x = require_float("x", x)
    require_rank("x", x, (4,), "[B, T, H, K]")
    if x.shape[-1] % 2:
        raise ValueError(
            f"x must have an even last dim K (channel pairs (i, i + K/2)), got {tuple(x.shape)}"
        )
    positions = _require_positions(positions, x)
    if not base > 1.0:
        raise ValueError(f"base must be > 1, got {base}")
    backend = resolve_backend(backend, x)
    if backend == "triton" and x.numel() > 0:
        from deltalab.ops.rope.triton import rope_triton

        freq = inverse_frequencies(x.shape[-1] // 2, base, torch.float32, x.device)
        return rope_triton(x, positions, freq)
    if backend == "naive":
        return rope_naive(x, positions, base)
    return rope_torch(x, positions, base)
