"""The definition of the Mobius scan: a step loop.

x_t = (A_t x_{t-1} + B_t) / (C_t x_{t-1} + D_t),    t = 1..T
"""

from __future__ import annotations

import torch


def mobius_scan_sequential(
    A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, x0: torch.Tensor
) -> torch.Tensor:
    """All iterates of the per-step maps, one step at a time.

    A, B, C, D: `[..., T]` (validated, one dtype); x0: `[...]`. Returns x_1..x_T `[..., T]`.
    """
    x = x0
    iterates = []
    for t in range(A.shape[-1]):
        x = (A[..., t] * x + B[..., t]) / (C[..., t] * x + D[..., t])
        iterates.append(x)
    return torch.stack(iterates, dim=-1)
