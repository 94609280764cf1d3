"""The gated mixers' log decay, elementwise with broadcast parameters:

    log_decay(A_log, raw, dt_bias, *, backend="auto") = -exp(A_log) * softplus(raw + dt_bias)

A_log and dt_bias broadcast against raw's trailing dims: `[H]` and `[H]` for raw `[..., H]`
(GDN's scalar decay), `[H, 1]` and `[H, K]` for raw `[..., H, K]` (KDA's, GDN-2's, Muir's and
KDN's channel decay). The result has raw's shape, in at least float32 (`compute_dtype(raw)`).

Backends: "naive" (the formula left to autograd, float64 when given float64), "torch" (the
layers' path before this op existed, bit for bit: the formula under activation checkpointing),
"triton" (one kernel each way: CUDA, or CPU under TRITON_INTERPRET=1). "auto" picks "triton" on
CUDA for float32 and narrower inputs, else "torch". README.md in this folder has the math and
the precision.

The layers pick the backend from their delta rule's (`layer_backend`, as the norms): "auto" and
"triton" as they are, "chunk" and "naive" (the PyTorch paths of the delta rule) take "torch".
"""

from __future__ import annotations

import math

import torch

from deltalab.ops._checks import require_float, require_same_device
from deltalab.ops._recompute import rebuildable_call
from deltalab.ops._triton import ELEMENTWISE_BACKENDS as BACKENDS
from deltalab.ops._triton import elementwise_backend as resolve_backend
from deltalab.ops.log_decay.reference import compute_dtype, log_decay_naive, log_decay_torch
from deltalab.ops.norms import layer_backend

__all__ = ["BACKENDS", "compute_dtype", "layer_backend", "log_decay", "resolve_backend"]


def _parameter_shape(A_log: torch.Tensor, raw: torch.Tensor, dt_bias: torch.Tensor):
    """raw's trailing dims that the parameters span (`[H]` or `[H, K]`); refuses parameters
    that do not broadcast to raw or would broadcast raw to a larger shape."""
    span = max(A_log.dim(), dt_bias.dim())
    try:
        out = torch.broadcast_shapes(A_log.shape, raw.shape, dt_bias.shape)
    except RuntimeError:
        out = None
    if out != raw.shape or span > raw.dim():
        raise ValueError(
            "A_log and dt_bias must broadcast against raw's trailing dims (A_log [H] and dt_bias "
            "[H] for raw [..., H]; A_log [H, 1] and dt_bias [H, K] for raw [..., H, K]), got "
            f"A_log {tuple(A_log.shape)}, raw {tuple(raw.shape)}, dt_bias {tuple(dt_bias.shape)}"
        )
    return raw.shape[raw.dim() - span :]


def log_decay(
    A_log: torch.Tensor, raw: torch.Tensor, dt_bias: torch.Tensor, *, backend: str = "auto"
) -> torch.Tensor:
    """g = -exp(A_log) * softplus(raw + dt_bias) <= 0.

    Args:
        A_log: the per-head log rate, `[H]` (raw `[..., H]`) or `[H, 1]` (raw `[..., H, K]`).
        raw: the decay projection's output, any float dtype (bfloat16 under autocast).
        dt_bias: `[H]` or `[H, K]`, broadcast against raw's trailing dims.
        backend: "auto", "naive", "torch" or "triton" (see the module docstring).

    Returns raw's shape in `compute_dtype(raw)` (float32, float64 for float64 raw); the
    gradients reach raw in its dtype and the parameters summed over the broadcast dims.
    """
    raw = require_float("raw", raw)
    A_log = require_float("A_log", A_log)
    dt_bias = require_float("dt_bias", dt_bias)
    require_same_device({"raw": raw, "A_log": A_log, "dt_bias": dt_bias})
    shape = _parameter_shape(A_log, raw, dt_bias)
    # Its backward keeps raw and the parameters: g (float32) is made again from them where the
    # delta rule would keep it (`rebuilt_in_backward`).
    backend = resolve_backend(backend, raw)
    return rebuildable_call(_log_decay, A_log, raw, dt_bias, shape=shape, backend=backend)


def _log_decay(A_log, raw, dt_bias, shape, backend: str) -> torch.Tensor:
    """`log_decay` of checked inputs on a resolved backend (`shape`: the parameters' own)."""
    if backend == "triton" and raw.numel() > 0:
        from deltalab.ops.log_decay.triton import log_decay_triton

        width = math.prod(shape)
        return log_decay_triton(
            A_log.expand(shape).reshape(width), raw, dt_bias.expand(shape).reshape(width)
        )
    if backend == "naive":
        return log_decay_naive(A_log, raw, dt_bias)
    return log_decay_torch(A_log, raw, dt_bias)
