"""The two PyTorch forms of the short causal convolution: the definition and the conv1d path.

    z[b, t, c] = sum_{j < W} weight[c, j] * xpad[b, t + j, c],    xpad = [cache; x] along time
    y = silu(z) (or z),    new cache = the last W - 1 rows of xpad, as [B, C, W-1]

Both take validated inputs: x `[B, T, C]`, weight `[C, W]`, cache `[B, C, W-1]` or None.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def conv_cache(x: torch.Tensor, cache: torch.Tensor | None, width: int) -> torch.Tensor:
    """The last `width - 1` inputs of [cache; x] (zeros for the cache when None): `[B, C, W-1]`,
    contiguous, in x's dtype. Only the tail of x is copied, never all of it."""
    batch, length, channels = x.shape
    keep = width - 1
    tail = x[:, max(length - keep, 0) :].transpose(1, 2)
    if length >= keep:
        return tail.contiguous()
    if cache is None:
        cache = x.new_zeros(batch, channels, keep)
    return torch.cat([cache.to(x.dtype)[..., length:], tail], dim=-1)


def short_conv_naive(
    x: torch.Tensor, weight: torch.Tensor, cache: torch.Tensor | None, silu: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, one shifted product per tap, in float64 when any input is float64, else
    float32 (autograd gives its gradients). The cache is taken in x's dtype, as ShortConvolution
    takes it. Returns (y `[B, T, C]` in x's dtype, new cache `[B, C, W-1]`)."""
    length = x.shape[1]
    width = weight.shape[-1]
    wide = torch.float64 if torch.float64 in (x.dtype, weight.dtype) else torch.float32
    if cache is None:
        head = x.new_zeros(x.shape[0], width - 1, x.shape[2])
    else:
        head = cache.to(x.dtype).transpose(1, 2)
    xpad = torch.cat([head, x], dim=1).to(wide)
    w = weight.to(wide)
    z = sum(w[:, j] * xpad[:, j : j + length] for j in range(width))
    y = F.silu(z) if silu else z
    return y.to(x.dtype), conv_cache(x, cache, width)


def short_conv_torch(
    x: torch.Tensor, weight: torch.Tensor, cache: torch.Tensor | None, silu: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch path of `deltalab.layers.short_conv.ShortConvolution`, operation for
    operation as the layer ran it before this op existed (the transposes, the concatenation, a
    grouped F.conv1d in x's dtype, the weight cast to it), so the layer's outputs are bit for
    bit what they were. Returns (y `[B, T, C]`, a
    transposed view; new cache `[B, C, W-1]`, a view of the padded input)."""
    batch, length, channels = x.shape
    width = weight.shape[-1]
    x_t = x.transpose(1, 2)
    if cache is None:
        cache = x_t.new_zeros(batch, channels, width - 1)
    padded = torch.cat([cache.to(x_t.dtype), x_t], dim=-1)
    z = F.conv1d(padded, weight.reshape(channels, 1, width).to(padded.dtype), groups=channels)
    y = F.silu(z) if silu else z
    return y.transpose(1, 2), padded[..., length:]
