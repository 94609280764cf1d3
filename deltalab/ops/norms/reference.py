"""The PyTorch forms of the norms: the definitions and today's paths of the layers.

    rms_norm(x, w, eps, gate)  = x / sqrt(mean(x^2) + eps) * w  (* act(gate))
    l2_normalize(x, eps)       = x / sqrt(sum(x^2) + eps)

over the last dim, computed in at least float32 (`compute_dtype`). "naive" is the formula left
to autograd (float64 when given float64); "torch" is what `deltalab.layers.common` ran before
this op existed, operation for operation: `_RMSNormFunction` (a hand-written backward that keeps
x, the gate and one 1/rms per row) and the L2 formula under `recomputed` (activation
checkpointing), so the layers switch to these functions without a change in a bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltalab.ops._recompute import recomputed


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """At least float32: gate and norm arithmetic stays accurate under bf16 activations."""
    return torch.promote_types(x.dtype, torch.float32)


def rms_norm_naive(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    gate: torch.Tensor | None = None,
    activation: str = "sigmoid",
) -> torch.Tensor:
    """x / rms(x) * weight over the last dim, times activation(gate) when a gate is given, in
    at least float32; the result in that dtype. The formula the other backends compute (and
    are tested against), left to autograd."""
    y = x.to(compute_dtype(x))
    y = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + eps)
    y = y * weight.to(y.dtype)
    if gate is None:
        return y
    gate = gate.to(y.dtype)
    return y * (torch.sigmoid(gate) if activation == "sigmoid" else F.silu(gate))


def _activation_and_slope(gate: torch.Tensor, activation: str):
    """activation(gate) and its derivative, elementwise (for the adjoints; the forward takes
    torch's own sigmoid / silu, as the formula does)."""
    sig = torch.sigmoid(gate)
    if activation == "sigmoid":
        return sig, sig * (1 - sig)
    return gate * sig, sig * (1 + gate * (1 - sig))


class _RMSNormFunction(torch.autograd.Function):
    """`rms_norm_naive` with a hand-written backward that recomputes the normalized x (and
    the gate's activation) from what it saves: x and the gate in their own dtypes and one
    1/rms per row. Autograd through the formula keeps, per token, x's float32 copy, the
    normalized x, its product with the weight and the activation's output: at the 340M presets
    the block norms kept 8.2 KB per token and block where this keeps 4.1 KB, the gated output
    norm 20.7 KB where this keeps 4.1 KB (benchmarks/memory_audit.py). The forward computes
    the same operations in the same order as the formula, so outputs are identical.
    """

    @staticmethod
    def forward(ctx, x, weight, gate, eps: float, activation: str):
        xf = x.to(compute_dtype(x))
        rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
        y = xf * rstd * weight.to(xf.dtype)
        ctx.activation = activation
        ctx.save_for_backward(x, weight, gate, rstd)
        ctx.save_for_forward(x, weight, gate, rstd)
        if gate is None:
            return y
        gate = gate.to(y.dtype)
        return y * (torch.sigmoid(gate) if activation == "sigmoid" else F.silu(gate))

    @staticmethod
    def _normalized(ctx):
        """The saved tensors, then x / rms(x) and the weight in the compute dtype, recomputed."""
        x, weight, gate, rstd = ctx.saved_tensors
        return x, weight, gate, rstd, x.to(rstd.dtype) * rstd, weight.to(rstd.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, gate, rstd, xhat, w = _RMSNormFunction._normalized(ctx)
        d_gate = None
        if gate is not None:
            act, slope = _activation_and_slope(gate.to(rstd.dtype), ctx.activation)
            if ctx.needs_input_grad[2]:
                d_gate = (dy * xhat * w * slope).to(gate.dtype)
            dy = dy * act
        d_weight = None
        if ctx.needs_input_grad[1]:
            d_weight = (dy * xhat).flatten(0, -2).sum(0).to(weight.dtype)
        dx = None
        if ctx.needs_input_grad[0]:
            dn = dy * w
            # d(x r)/dx with r = rms(x)^-1: r (dn - xhat mean(xhat dn)).
            dx = (rstd * (dn - xhat * (dn * xhat).mean(-1, keepdim=True))).to(x.dtype)
        return dx, d_weight, d_gate, None, None

    @staticmethod
    def jvp(ctx, tx, tw, tg, _eps, _activation):
        """Forward-mode derivative (gate-sensitivity probes run through the norms with it)."""
        _, _, gate, rstd, xhat, w = _RMSNormFunction._normalized(ctx)
        t_out = torch.zeros_like(xhat)
        if tx is not None:
            txf = tx.to(rstd.dtype)
            t_out = t_out + rstd * (txf - xhat * (xhat * txf).mean(-1, keepdim=True)) * w
        if tw is not None:
            t_out = t_out + xhat * tw.to(rstd.dtype)
        if gate is None:
            return t_out
        act, slope = _activation_and_slope(gate.to(rstd.dtype), ctx.activation)
        t_out = t_out * act
        if tg is not None:
            t_out = t_out + xhat * w * slope * tg.to(rstd.dtype)
        return t_out


def rms_norm_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    gate: torch.Tensor | None = None,
    activation: str = "sigmoid",
) -> torch.Tensor:
    """What `rms_norm_naive` computes, bit for bit, keeping less for backward
    (`_RMSNormFunction`); the result in the compute dtype."""
    return _RMSNormFunction.apply(x, weight, gate, eps, activation)


def l2_normalize_naive(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(||x||^2 + eps) over the last dim, computed in at least float32; x's dtype out.
    The formula, left to autograd."""
    y = x.to(compute_dtype(x))
    return (y * torch.rsqrt(y.square().sum(-1, keepdim=True) + eps)).to(x.dtype)


def l2_normalize_torch(x: torch.Tensor, eps: float) -> torch.Tensor:
    """The formula keeping only x for backward (`recomputed`), not its float32 copies: its
    forward runs again in the backward."""
    return recomputed(l2_normalize_naive, x, eps)
