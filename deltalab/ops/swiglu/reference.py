"""The PyTorch forms of SwiGLU: the definition and the FFN's path before this op existed.

    swiglu(gate_up) = silu(gate) * up,   gate, up = gate_up.chunk(2, dim=-1)

"naive" is the formula left to autograd, computed in at least float32 (float64 when given
float64) and rounded once to gate_up's dtype; "torch" is what `deltalab.models.lm.SwiGLU` ran
before this op existed, operation for operation: the formula in gate_up's dtype under
`recomputed` (activation checkpointing: only gate_up is kept, the forward runs again in the
backward), so the FFN switches to it without a change in a bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltalab.ops._recompute import recomputed


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """At least float32."""
    return torch.promote_types(x.dtype, torch.float32)


def swiglu_formula(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in gate_up's dtype: the FFN's `_swiglu`, unchanged."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_naive(gate_up: torch.Tensor) -> torch.Tensor:
    """The formula in at least float32, left to autograd; gate_up's dtype out (the reference
    the other backends are tested against: float64 when given float64)."""
    return swiglu_formula(gate_up.to(compute_dtype(gate_up))).to(gate_up.dtype)


def swiglu_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """The FFN's path before this op existed, bit for bit: the formula keeping only gate_up for
    backward (`recomputed`)."""
    return recomputed(swiglu_formula, gate_up)
