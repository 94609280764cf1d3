"""The PyTorch forms of the normed linear map: the definition and the unfused modules' path.

    h = x / sqrt(mean(x^2) + eps) * norm_weight       (when norm_weight is given; else h = x)
    y = h W^T + bias
    y = silu(gate) * up,  gate, up = y.chunk(2, -1)   (epilogue "swiglu")
    y = y + residual

"naive" is the formula with no rounding between its steps, in at least float32 (float64 when
given float64: the tests' reference). "torch" is what the unfused modules compute, rounding
where they do: the RMSNorm module's output in x's dtype, the product in weight's dtype (as
`F.linear` under autocast casts its input), then SwiGLU's gating in float32 on the rounded
product (the swiglu op's Triton numerics), the residual sum in the product's epilogue
(`torch.addmm`, one rounding) when there is no gating.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltalab.ops.norms.reference import rms_norm_torch
from deltalab.ops.swiglu.reference import swiglu_naive


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """At least float32, float64 when any input is float64."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def normed_linear_naive(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
    epilogue: str,
    residual: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """The definition, every step in the compute dtype (`compute_dtype` of x and weight), the
    result rounded once to weight's dtype."""
    dtype = compute_dtype(x, weight)
    h = x.to(dtype)
    if norm_weight is not None:
        h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps) * norm_weight.to(dtype)
    y = h @ weight.to(dtype).t()
    if bias is not None:
        y = y + bias.to(dtype)
    if epilogue == "swiglu":
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    if residual is not None:
        y = y + residual.to(dtype)
    return y.to(weight.dtype)


def normed_linear_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
    epilogue: str,
    residual: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """The unfused modules' operations (module docstring), weight's dtype out."""
    h = x if norm_weight is None else rms_norm_torch(x, norm_weight, eps).to(x.dtype)
    h = h.to(weight.dtype)
    if residual is not None and epilogue == "none":
        added = residual if bias is None else residual + bias
        return torch.addmm(added, h, weight.t())
    y = F.linear(h, weight, bias)
    if epilogue == "swiglu":
        y = swiglu_naive(y)
    return y if residual is None else residual + y
