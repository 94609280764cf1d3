"""Short causal depthwise convolution with SiLU: the frontend of every recurrent mixer.

    short_conv(x, weight, cache=None, *, activation="silu", backend="auto") -> (y, new_cache)

Backends: "naive" (one shifted product per tap: the definition, float64 when given float64),
"torch" (`ShortConvolution`'s PyTorch path: transposes and a grouped F.conv1d), "triton" (a
Triton kernel each way, SiLU fused: CUDA, or CPU under TRITON_INTERPRET=1; widths W <= 8).
"auto" picks "triton" on CUDA when Triton is installed and W <= 8, else "torch". README.md in
this folder has the math.
"""

from __future__ import annotations

import torch

from deltalab.ops._checks import (
    require_choice,
    require_float,
    require_rank,
    require_same_device,
    require_shape,
)
from deltalab.ops._triton import require_triton, triton_available
from deltalab.ops.short_conv.reference import conv_cache, short_conv_naive, short_conv_torch

__all__ = [
    "ACTIVATIONS",
    "BACKENDS",
    "conv_cache",
    "resolve_backend",
    "short_conv",
    "short_conv_naive",
    "short_conv_torch",
]

BACKENDS = ("auto", "naive", "torch", "triton")
ACTIVATIONS = ("silu", None)
# Widths the Triton kernels take: the backward unrolls W^2 shifted loads per tile at compile time.
MAX_TRITON_WIDTH = 8


def resolve_backend(backend: str, device: torch.device, width: int) -> str:
    """The backend that runs: "auto" is "triton" where it compiles (CUDA) for a width it takes,
    else "torch"."""
    if backend == "auto":
        fits = width <= MAX_TRITON_WIDTH
        return "triton" if fits and triton_available(device) else "torch"
    if backend == "triton":
        require_triton("backend", device)
        if width > MAX_TRITON_WIDTH:
            raise ValueError(
                f'backend="triton" takes kernel widths up to {MAX_TRITON_WIDTH}, got weight of '
                f"width W = {width}; use backend='torch'"
            )
    return backend


def _weight_matrix(weight: object, channels: int) -> torch.Tensor:
    """weight `[C, W]` or `[C, 1, W]` (ShortConvolution's) as `[C, W]`."""
    weight = require_float("weight", weight)
    require_rank("weight", weight, (2, 3), "[C, W] or [C, 1, W]")
    width = weight.shape[-1]
    if weight.dim() == 3:
        require_shape("weight", weight, (channels, 1, width), "[C, 1, W]", "(C = x.shape[-1])")
        weight = weight.reshape(channels, width)
    require_shape("weight", weight, (channels, width), "[C, W]", "(C = x.shape[-1])")
    if width == 0:
        raise ValueError("weight must hold at least one tap (W >= 1), got W = 0")
    return weight


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    cache: torch.Tensor | None = None,
    *,
    activation: str | None = "silu",
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise convolution over time, then the activation.

    y[b, t, c] = act(sum_{j < W} weight[c, j] * xpad[b, t + j, c]), xpad = [cache; x] along
    time: weight[c, W-1] multiplies the current token, as F.conv1d on the padded input does.

    Args:
        x: `[B, T, C]`, T >= 1, any float dtype.
        weight: `[C, W]` or `[C, 1, W]` (as ShortConvolution stores it).
        cache: the W-1 inputs before x, `[B, C, W-1]`, taken in x's dtype; None for zeros.
        activation: "silu" or None.
        backend: "auto", "naive", "torch" or "triton" (see the module docstring).

    Returns:
        y `[B, T, C]` in x's dtype ("triton" and "naive" compute in float32, or float64 for a
        float64 input; "torch" in x's dtype, as conv1d does), and the new cache `[B, C, W-1]`:
        the last W-1 inputs of [cache; x], in x's dtype.
    """
    x = require_float("x", x)
    require_rank("x", x, (3,), "[B, T, C]")
    batch, length, channels = x.shape
    if length == 0:
        raise ValueError("x must hold at least one token (T >= 1), got T = 0")
    weight = _weight_matrix(weight, channels)
    width = weight.shape[-1]
    if cache is not None:
        cache = require_float("cache", cache)
        require_shape("cache", cache, (batch, channels, width - 1), "[B, C, W-1]")
    require_same_device({"x": x, "weight": weight, "cache": cache})
    require_choice("activation", activation, ACTIVATIONS)
    require_choice("backend", backend, BACKENDS)
    backend = resolve_backend(backend, x.device, width)
    silu = activation == "silu"
    if backend == "naive":
        return short_conv_naive(x, weight, cache, silu)
    if backend == "torch":
        return short_conv_torch(x, weight, cache, silu)
    from deltalab.ops.short_conv.triton import short_conv_triton

    return short_conv_triton(x, weight, cache, silu)
