"""SwiGLU's gating: the elementwise middle of the FFN, between its two projections.

    swiglu(gate_up, *, backend="auto") = silu(gate) * up,  gate, up = gate_up.chunk(2, dim=-1)

gate_up `[..., 2F]` (the gate first, then up, as the fused projection writes them) -> `[..., F]`
in gate_up's dtype.

Backends: "naive" (the formula left to autograd, in at least float32: float64 when given
float64), "torch" (the FFN's path before this op existed, bit for bit: the formula in gate_up's
dtype under activation checkpointing), "triton" (one kernel each way: the forward reads gate_up
and writes the output, saving only gate_up; the backward reads gate_up and dh and writes
d(gate_up) `[..., 2F]` directly; CUDA, or CPU under TRITON_INTERPRET=1). "auto" picks "triton"
on CUDA for inputs other than float64, else "torch". README.md in this folder has the math and
the precision.

The FFN (`deltalab.models.lm.SwiGLU`) takes the model config's backend as the block norms do
(`deltalab.ops.norms.layer_backend`: "chunk" and "naive" -> "torch").
"""

from __future__ import annotations

import torch

from deltalab.ops._checks import require_float
from deltalab.ops._triton import ELEMENTWISE_BACKENDS as BACKENDS
from deltalab.ops._triton import elementwise_backend as resolve_backend
from deltalab.ops.swiglu.reference import swiglu_formula, swiglu_naive, swiglu_torch

__all__ = [
    "BACKENDS",
    "resolve_backend",
    "swiglu",
    "swiglu_formula",
    "swiglu_naive",
    "swiglu_torch",
]


def swiglu(gate_up: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """silu(gate) * up of gate_up `[..., 2F]` (gate = the first F of the last dim, up = the
    last F), any float dtype, any strides -> `[..., F]` in gate_up's dtype.

    "torch" computes in gate_up's dtype (rounding silu(gate) before the product, as the FFN
    did); "naive" and "triton" compute in float32 (float64 for float64 on "naive") and round
    once."""
    gate_up = require_float("gate_up", gate_up)
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        shape = tuple(gate_up.shape)
        raise ValueError(
            f"gate_up must have shape [..., 2F] (gate, then up, in the last dim), got {shape}"
        )
    backend = resolve_backend(backend, gate_up)
    if backend == "triton":
        from deltalab.ops.swiglu.triton import swiglu_triton

        return swiglu_triton(gate_up)
    return swiglu_naive(gate_up) if backend == "naive" else swiglu_torch(gate_up)
