"""The PyTorch forms of Muir's matched-filter read: the definition and the layers' path.

    read_query(q, read_log, raw) = q * rho,   rho = exp(read_log) * 2 sigmoid(raw)   ("dynamic")
                                              rho = exp(read_log)                    (raw None)

rho is computed in at least float32 (`compute_dtype(q)`), the product rounded once to q's dtype;
read_log broadcasts against q's trailing dims, raw has q's shape. "naive" is the formula left to
autograd (float64 when given float64); "torch" is what `FusedGateMixer.read_from` and
`muir.read_query` compute, operation for operation, so the two are bit for bit the layers' path.
"""

from __future__ import annotations

import torch

from deltalab.ops.norms.reference import compute_dtype

__all__ = ["compute_dtype", "read_query_naive", "read_query_torch"]


def read_query_naive(
    q: torch.Tensor, read_log: torch.Tensor, raw: torch.Tensor | None
) -> torch.Tensor:
    """q * exp(read_log) * 2 sigmoid(raw) in `compute_dtype(q)`, q's dtype out, left to autograd:
    the formula the other backends compute (and are tested against)."""
    dtype = compute_dtype(q)
    rho = read_log.to(dtype).exp()
    if raw is not None:
        rho = rho * 2.0 * torch.sigmoid(raw.to(dtype))
    return (q.to(dtype) * rho).to(q.dtype)


def read_query_torch(
    q: torch.Tensor, read_log: torch.Tensor, raw: torch.Tensor | None
) -> torch.Tensor:
    """The layers' read before this op existed, operation for operation: rho as
    `FusedGateMixer.read_from` builds it (the static vector exp(read_log), times 2 sigmoid(raw)
    when dynamic), then `muir.read_query`'s (rho * q).to(q.dtype). Autograd keeps rho and the
    float32 intermediates."""
    dtype = compute_dtype(q)
    read = read_log.to(dtype).exp()
    if raw is not None:
        read = read * (2.0 * torch.sigmoid(raw.to(dtype)))
    return (read * q).to(q.dtype)
