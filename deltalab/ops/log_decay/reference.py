"""The PyTorch forms of the log decay: the definition and the layers' PyTorch path.

    g = -exp(A_log) * softplus(raw + dt_bias)  <= 0

computed in at least float32 (`compute_dtype(raw)`), the parameters broadcast against raw's
trailing dims. "naive" is the formula left to autograd (float64 when given float64); "torch" is
what `deltalab.layers.decay.log_decay` ran before this op existed, operation for operation: the
formula under `recomputed` (activation checkpointing: only raw and the parameters are kept, the
float32 intermediates computed again in the backward), so the layers switch to it without a
change in a bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltalab.ops._recompute import recomputed
from deltalab.ops.norms.reference import compute_dtype

__all__ = ["compute_dtype", "log_decay_naive", "log_decay_torch"]


def log_decay_naive(A_log: torch.Tensor, raw: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """-exp(A_log) * softplus(raw + dt_bias) in `compute_dtype(raw)`, left to autograd: the
    formula the other backends compute (and are tested against)."""
    dtype = compute_dtype(raw)
    rate = A_log.to(dtype).exp()
    return -rate * F.softplus(raw.to(dtype) + dt_bias.to(dtype))


def log_decay_torch(A_log: torch.Tensor, raw: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """`log_decay_naive`, bit for bit, keeping only raw (in its own dtype) and the parameters
    for backward (`recomputed`): its forward runs again in the backward."""
    return recomputed(log_decay_naive, A_log, raw, dt_bias)
