"""The layers' norm modules over `deltalab.ops.norms`: `RMSNorm`, `GatedRMSNorm` (the
delta-rule mixers' gated output norm), and the L2 normalization of q and k."""

from __future__ import annotations

import torch
from torch import nn

from deltalab.ops import norms
from deltalab.ops._checks import require_choice, require_positive_int
from deltalab.ops.norms import L2_EPS
from deltalab.ops.norms.reference import rms_norm_naive, rms_norm_torch

__all__ = ["GATE_ACTIVATIONS", "GatedRMSNorm", "RMSNorm", "l2_normalize"]

GATE_ACTIVATIONS = norms.ACTIVATIONS


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS, *, backend: str = "auto") -> torch.Tensor:
    """x / sqrt(||x||^2 + eps) over the last dim, computed in at least float32; x's dtype out
    (`deltalab.ops.norms.l2_normalize`: keeps its output and 1/norm per row for backward)."""
    return norms.l2_normalize(x, eps, backend=backend)


# The norm modules' torch path (`_dispatch_rms_norm` looks `rms_norm` up here on each call, so
# gate sensitivity can swap in the formula). `rms_norm_reference`: x / rms(x) * weight over the
# last dim, times activation(gate) when a gate is given, in at least float32, left to autograd
# (`deltalab.ops.norms`' "naive" backend); `rms_norm`: the same bit for bit, keeping less for
# backward (`_RMSNormFunction`, the "torch" backend).
rms_norm_reference = rms_norm_naive
rms_norm = rms_norm_torch


def _dispatch_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    gate: torch.Tensor | None,
    activation: str,
    backend: str,
) -> torch.Tensor:
    """The norm modules' path, x's dtype out: the Triton kernels or the formula when `backend`
    resolves to them (`norms.resolve_backend`), else this module's `rms_norm` (the torch path,
    looked up here so that tests can swap it for the formula)."""
    resolved = norms.resolve_backend(backend, x)
    if resolved == "torch":
        return rms_norm(x, weight, eps, gate, activation).to(x.dtype)
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
    """

    def __init__(self, dim: int, eps: float = 1e-5, activation: str = "sigmoid") -> None:
        super().__init__()
        self.dim = require_positive_int("dim", dim)
        self.eps = eps
        self.activation = require_choice("gate_activation", activation, GATE_ACTIVATIONS)
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(
        self, o: torch.Tensor, gate: torch.Tensor, *, backend: str = "auto"
    ) -> torch.Tensor:
        """backend: `deltalab.ops.norms`'; a mixer passes its delta rule's (`layer_backend`)."""
        return _dispatch_rms_norm(o, self.weight, self.eps, gate, self.activation, backend)
