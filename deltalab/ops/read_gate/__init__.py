"""Muir's matched-filter read gate applied to the query, elementwise with a broadcast vector:

    read_query(q, read_log, raw=None, *, backend="auto") = q * rho,
    rho = exp(read_log) * 2 sigmoid(raw)   (raw given: Muir's "dynamic" read gate)
    rho = exp(read_log)                    (raw None: the "static" read gate)
    sigmoid_gate(x, logits) = read_query(x, log 1/2, logits) = x * sigmoid(logits)
                                           (GDN-2's and Muir's gate products, erase * k)

read_log broadcasts against q's trailing dims (`[H, K]` for q `[..., H, K]`, as Muir's and
KDN-Muir's static read vector); raw, the read gate's pre-activation (a slice of the fused gate
projection, bfloat16 under autocast), has q's shape. rho is computed in at least float32
(`compute_dtype(q)`) and the product rounded once to q's dtype.

Backends: "naive" (the formula left to autograd, float64 when given float64), "torch" (the
layers' path before this op existed, bit for bit: rho as `FusedGateMixer.read_from` built it,
then `muir.read_query`), "triton" (one kernel each way: CUDA, or CPU under TRITON_INTERPRET=1;
the float32 rho never reaches memory). "auto" picks "triton" on CUDA for float32 and narrower
q, else "torch". README.md in this folder has the math and the precision.

The layers pick the backend from their delta rule's (`layer_backend`, as the norms): "auto" and
"triton" as they are, "chunk" and "naive" (the PyTorch paths of the delta rule) take "torch",
where the layers keep rho among their gates (`FusedGateMixer.matched_read`).
"""

from __future__ import annotations

import math

import torch

from deltalab.ops._checks import require_float, require_same_device
from deltalab.ops._recompute import rebuildable_call
from deltalab.ops._triton import ELEMENTWISE_BACKENDS as BACKENDS
from deltalab.ops._triton import elementwise_backend as resolve_backend
from deltalab.ops.norms import layer_backend
from deltalab.ops.read_gate.reference import compute_dtype, read_query_naive, read_query_torch

__all__ = [
    "BACKENDS",
    "LOG_HALF",
    "compute_dtype",
    "layer_backend",
    "read_query",
    "resolve_backend",
    "sigmoid_gate",
]


def _vector_shape(q: torch.Tensor, read_log: torch.Tensor, raw: torch.Tensor | None):
    """q's trailing dims that read_log spans; refuses a read_log that does not broadcast to q
    (or would broadcast q to a larger shape) and a raw of another shape than q's."""
    if raw is not None and raw.shape != q.shape:
        raise ValueError(
            f"raw must have q's shape {tuple(q.shape)} (the read gate's pre-activation, one per "
            f"query element), got {tuple(raw.shape)}"
        )
    try:
        out = torch.broadcast_shapes(read_log.shape, q.shape)
    except RuntimeError:
        out = None
    if out != q.shape or read_log.dim() > q.dim():
        raise ValueError(
            "read_log must broadcast against q's trailing dims ([H, K] for q [..., H, K]), got "
            f"read_log {tuple(read_log.shape)}, q {tuple(q.shape)}"
        )
    return q.shape[q.dim() - read_log.dim() :]


def read_query(
    q: torch.Tensor,
    read_log: torch.Tensor,
    raw: torch.Tensor | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """q * exp(read_log) * (2 sigmoid(raw) if raw is given else 1), in q's dtype.

    Args:
        q: the query `[..., H, K]`, any float dtype (bfloat16 under autocast); a view with a
            row stride (a split of a wider projection) is read in place by the kernels.
        read_log: log of the static read vector, broadcast against q's trailing dims (`[H, K]`).
        raw: None ("static"), or the read gate's pre-activation of q's shape ("dynamic").
        backend: "auto", "naive", "torch" or "triton" (see the module docstring).

    Returns q's shape and dtype; rho computed in `compute_dtype(q)` (float32, float64 for
    float64 q), the product rounded once. The gradients reach q and raw in their dtypes and
    read_log summed over the broadcast dims.
    """
    q = require_float("q", q)
    read_log = require_float("read_log", read_log)
    if raw is not None:
        raw = require_float("raw", raw)
    require_same_device({"q": q, "read_log": read_log, "raw": raw})
    shape = _vector_shape(q, read_log, raw)
    # Its backward keeps q, read_log and raw: the read query is made again from them where the
    # delta rule would keep it (`rebuilt_in_backward`).
    backend = resolve_backend(backend, q)
    return rebuildable_call(_read_query, q, read_log, raw, shape=shape, backend=backend)


def _read_query(q, read_log, raw, shape, backend: str) -> torch.Tensor:
    """`read_query` of checked inputs on a resolved backend (`shape`: read_log's span of q)."""
    if backend == "triton" and q.numel() > 0:
        from deltalab.ops.read_gate.triton import read_query_triton

        return read_query_triton(q, read_log.expand(shape).reshape(math.prod(shape)), raw)
    if backend == "naive":
        return read_query_naive(q, read_log, raw)
    return read_query_torch(q, read_log, raw)


# log(1/2): at this static vector the read gate is exp(log 1/2) * 2 sigmoid(raw) = sigmoid(raw).
# Rounded to float32 (-0.69314718...) or float64, its exp rounds back to exactly 0.5, so rho is
# sigmoid(raw) to the op's own rounding.
LOG_HALF = -math.log(2.0)


def sigmoid_gate(x: torch.Tensor, logits: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """x * sigmoid(logits) in x's dtype: `read_query` at the static vector 1/2 (the sigmoid in
    at least float32, the product rounded once). GDN-2's and Muir's gate products (erase * k,
    write * v) are this op: Muir's read with other inputs. On Triton, the read gate's kernels
    without a vector to load (one kernel each way; the sigmoid never stored); elsewhere
    `read_query` itself, with read_log = `LOG_HALF`.

    logits has x's shape; the gradients reach x and logits in their dtypes. On Triton it saves
    x and logits (the sigmoid is recomputed in the backward), where torch.sigmoid followed by
    a product saves the sigmoid and x; the torch path saves what `read_query_torch` does.
    """
    x = require_float("x", x)
    logits = require_float("logits", logits)
    require_same_device({"x": x, "logits": logits})
    if logits.shape != x.shape:
        raise ValueError(
            f"logits must have x's shape {tuple(x.shape)} (one gate per element), got "
            f"{tuple(logits.shape)}"
        )
    # Its backward keeps x and logits: the product is made again from them where the delta
    # rule would keep it (`rebuilt_in_backward`).
    return rebuildable_call(_sigmoid_gate, x, logits, backend=resolve_backend(backend, x))


def _sigmoid_gate(x, logits, backend: str) -> torch.Tensor:
    """`sigmoid_gate` of checked inputs on a resolved backend."""
    if backend == "triton" and x.numel() > 0:
        from deltalab.ops.read_gate.triton import sigmoid_gate_triton

        return sigmoid_gate_triton(x, logits)
    half = torch.full(x.shape[-1:], LOG_HALF, dtype=compute_dtype(x), device=x.device)
    shape = x.shape[-1:]
    return _read_query(x, half, logits, shape, "naive" if backend == "naive" else "torch")
