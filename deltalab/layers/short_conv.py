"""The short causal depthwise convolution with SiLU of the delta-rule frontend
(`ShortConvolution`, over `deltalab.ops.short_conv`), with its cache for decoding, and the
backend it takes from the layer's delta rule (`short_conv_backend`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from deltalab.layers.projections import concatenated_parameters
from deltalab.ops._checks import require_choice, require_positive_int, require_shape
from deltalab.ops._recompute import recomputed
from deltalab.ops.norms import layer_backend
from deltalab.ops.short_conv import BACKENDS as SHORT_CONV_BACKENDS
from deltalab.ops.short_conv import resolve_backend as resolve_short_conv_backend
from deltalab.ops.short_conv import short_conv

__all__ = ["ShortConvolution", "short_conv_backend"]


class ShortConvolution(nn.Module):
    """Causal depthwise conv1d followed by SiLU, with a cache of the last `kernel_size - 1` inputs.

    The cache makes decoding exact: the convolution over `[cache, x]` is the one the full sequence
    would have seen, for any number of new tokens. The weight is stored `[C, 1, W]`, as
    nn.Conv1d's, whichever backend runs it.
    """

    def __init__(self, channels: int, kernel_size: int = 4) -> None:
        super().__init__()
        self.channels = require_positive_int("channels", channels)
        self.kernel_size = require_positive_int("conv_size", kernel_size)
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        # Same initialization as nn.Conv1d.
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(
        self, x: torch.Tensor, cache: torch.Tensor | None = None, *, backend: str = "torch"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[B, T, C]`, cache `[B, C, W-1]` (zeros when None) -> (y `[B, T, C]`, new cache).

        backend: `short_conv`'s ("auto", "naive", "torch", "triton"; a mixer passes
        `short_conv_backend(its backend)`). "torch" is the grouped conv1d path, whose
        intermediates are computed again in the backward rather than kept (`recomputed`);
        the others run `short_conv`.
        """
        batch, _, channels = x.shape
        if cache is not None:
            width = self.kernel_size - 1
            require_shape("conv cache", cache, (batch, channels, width), "[B, C, W-1]")
        return convolve(x, self.weight, cache, backend)


def convolve(
    x: torch.Tensor, weight: torch.Tensor, cache: torch.Tensor | None, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ShortConvolution.forward` with its weight `[C, 1, W]` given: x `[B, T, C]`, cache
    `[B, C, W-1]` or None -> (y `[B, T, C]`, new cache)."""
    batch, length, channels = x.shape
    kernel_size = weight.shape[-1]
    require_choice("backend", backend, SHORT_CONV_BACKENDS)
    if resolve_short_conv_backend(backend, x.device, kernel_size) != "torch":
        # short_conv takes the cache: decoding steps (T = 1) run on the same kernels.
        return short_conv(x, weight, cache, backend=backend)
    x_t = x.transpose(1, 2)
    if cache is None:
        cache = x_t.new_zeros(batch, channels, kernel_size - 1)
    padded = torch.cat([cache.to(x_t.dtype), x_t], dim=-1)
    # Keeps the padded input for backward, not the convolution's output (`recomputed`).
    y = recomputed(_conv_silu, padded, weight)
    return y.transpose(1, 2), padded[..., length:]


def convolve_together(
    convs: Sequence[ShortConvolution],
    xs: Sequence[torch.Tensor],
    caches: Sequence[torch.Tensor],
    store: dict,
    backend: str,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`conv(x, cache)` for each (conv, x `[B, T, C_i]`, cache `[B, C_i, W-1]`) as one depthwise
    convolution over their channels concatenated (the convolution is per channel, so the same
    numbers), the weights concatenated once into `store` (`concatenated_weights`) -> (the ys
    concatenated `[B, T, sum C_i]`, the new caches, views of one tensor)."""
    weights = [conv.weight for conv in convs]
    weight = concatenated_parameters(store, weights, weights[0].dtype)
    widths = [conv.channels for conv in convs]
    y, cache = convolve(torch.cat(list(xs), -1), weight, torch.cat(list(caches), 1), backend)
    return y, list(cache.split(widths, dim=1))


def short_conv_backend(backend: str, dtype: torch.dtype) -> str:
    """The short convolutions' backend for a mixer whose delta rule runs on `backend`, with
    inputs of `dtype`: the convolutions take the same kind of path as the delta rule.

    "triton" -> "triton" (the kernels: CUDA, or CPU under TRITON_INTERPRET=1). "auto" -> "auto"
    (Triton on CUDA, conv1d elsewhere; `short_conv`), except float64, which stays in PyTorch as
    the delta rule's "auto" keeps it (the kernels compute in float32). "chunk", "naive" ->
    "torch": the PyTorch paths stay PyTorch end to end, which forward-mode AD needs (gate
    sensitivity switches layers to "chunk" for that; the Triton Function defines no jvp).
    """
    # The norms' mapping (`layer_backend`), with short_conv's "auto" kept off float64.
    follow = layer_backend(backend)
    return "torch" if follow == "auto" and dtype == torch.float64 else follow


def _conv_silu(padded: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SiLU of the depthwise causal convolution of `padded [B, C, W-1+T]`: `[B, C, T]`."""
    return F.silu(F.conv1d(padded, weight.to(padded.dtype), groups=padded.shape[1]))
