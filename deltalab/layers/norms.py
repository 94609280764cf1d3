"""The layers' norm modules over `deltalab.ops.norms`: `RMSNorm`, `GatedRMSNorm` (the
delta-rule mixers' gated output norm), and the L2 normalization of q and k."""

from __future__ import annotations

import torch
from torch import nn

from deltalab.ops import norms
from deltalab.ops._checks import require_choice, require_positive_int
from deltalab.ops.norms import L2_EPS
from deltalab.ops.norms.reference import rms_norm_torch

__all__ = ["GATE_ACTIVATIONS", "GatedRMSNorm", "RMSNorm", "l2_normalize"]

GATE_ACTIVATIONS = norms.ACTIVATIONS


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS, *, backend: str = "auto") -> torch.Tensor:
    """x / sqrt(||x||^2 + eps) over the last dim, computed in at least float32; x's dtype out
    (`deltalab.ops.norms.l2_normalize`: keeps its output and 1/norm per row for backward)."""
    return norms.l2_normalize(x, eps, backend=backend)


def _dispatch_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    gate: torch.Tensor | None,
    activation: str,
    backend: str,
) -> torch.Tensor:
    """The norm modules' path, x's dtype out: `backend` as `norms.resolve_backend` resolves
    it; the torch path called directly (the module's eager forward, without the op's checks)."""
    resolved = norms.resolve_backend(backend, x)
    if resolved == "torch":
        return rms_norm_torch(x, weight, eps, gate, activation).to(x.dtype)
    return norms.rms_norm(x, weight, eps, gate, activation, out_dtype=x.dtype, backend=resolved)


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dim `[..., dim]`, computed in at least float32.

    backend: `deltalab.ops.norms`' ("auto": the Triton kernels on CUDA, else the torch path).
    """

    def __init__(self, dim: int, eps: float = 1e-5, *, backend: str = "auto") -> None:
        super().__init__()
        self.dim = require_positive_int("dim", dim)
        self.eps = eps
        self.backend = require_choice("backend", backend, norms.BACKENDS)
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _dispatch_rms_norm(x, self.weight, self.eps, None, "sigmoid", self.backend)


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm of `o [..., dim]` multiplied by `activation(gate [..., dim])`.

    One weight `[dim]` shared by the heads (fla's `FusedRMSNormGated`).

    backend: `deltalab.ops.norms`' for this norm whatever its caller passes; None (the default)
    takes the caller's (a mixer passes its delta rule's, `layer_backend`). "naive" runs the
    formula under autograd, whose gradients round as a reference's do.
    """

    def __init__(
        self,
        dim: int,
        eps: float = 1e-5,
        activation: str = "sigmoid",
        *,
        backend: str | None = None,
    ) -> None:
        super().__init__()
        self.dim = require_positive_int("dim", dim)
        self.eps = eps
        self.activation = require_choice("gate_activation", activation, GATE_ACTIVATIONS)
        self.backend = (
            None if backend is None else require_choice("backend", backend, norms.BACKENDS)
        )
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(
        self, o: torch.Tensor, gate: torch.Tensor, *, backend: str = "auto"
    ) -> torch.Tensor:
        """backend: the caller's, used unless the module has its own (`self.backend`)."""
        chosen = backend if self.backend is None else self.backend
        return _dispatch_rms_norm(o, self.weight, self.eps, gate, self.activation, chosen)
