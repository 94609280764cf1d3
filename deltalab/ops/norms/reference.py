"""The PyTorch forms of the norms: the definitions and the layers' PyTorch paths.

    rms_norm(x, w, eps, gate)  = x / sqrt(mean(x^2) + eps) * w  (* act(gate))
    l2_normalize(x, eps)       = x / sqrt(sum(x^2) + eps)

over the last dim, computed in at least float32 (`compute_dtype`). "naive" is the formula left
to autograd (float64 when given float64); "torch" keeps less for backward: `_RMSNormFunction`
(what the layers' RMSNorm ran before this op existed, operation for operation: a
hand-written backward that keeps x, the gate and one 1/rms per row) and `_L2NormFunction` (the
L2 formula's forward, operation for operation, keeping its output and 1/norm per row).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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

    Written with `setup_context` and a generated vmap rule, so that torch.func's transforms go
    through it (gate sensitivity's batched probes vmap over forward-mode derivatives); 1/rms is
    a second output for that (the Function saves only what it returns or was given), with its
    own derivative, d(1/rms)/dx = -x / (N rms^3).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x, weight, gate, eps: float, activation: str):
        xf = x.to(compute_dtype(x))
        rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
        y = xf * rstd * weight.to(xf.dtype)
        if gate is not None:
            gate = gate.to(y.dtype)
            y = y * (torch.sigmoid(gate) if activation == "sigmoid" else F.silu(gate))
        return y, rstd

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, weight, gate, _eps, activation = inputs
        ctx.activation = activation
        # An output nothing differentiates reaches backward as None, not zeros: the layers use
        # y alone, and 1/rms's adjoint is then skipped.
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, weight, gate, output[1])
        ctx.save_for_forward(x, weight, gate, output[1])

    @staticmethod
    def _normalized(ctx):
        """The saved tensors, then x / rms(x) and the weight in the compute dtype, recomputed."""
        x, weight, gate, rstd = ctx.saved_tensors
        return x, weight, gate, rstd, x.to(rstd.dtype) * rstd, weight.to(rstd.dtype)

    @staticmethod
    def backward(ctx, dy, drstd):
        x, weight, gate, rstd, xhat, w = _RMSNormFunction._normalized(ctx)
        d_gate = d_weight = dx = None
        if dy is not None:
            if gate is not None:
                act, slope = _activation_and_slope(gate.to(rstd.dtype), ctx.activation)
                if ctx.needs_input_grad[2]:
                    d_gate = (dy * xhat * w * slope).to(gate.dtype)
                dy = dy * act
            if ctx.needs_input_grad[1]:
                d_weight = (dy * xhat).flatten(0, -2).sum(0).to(weight.dtype)
            if ctx.needs_input_grad[0]:
                dn = dy * w
                # d(x r)/dx with r = rms(x)^-1: r (dn - xhat mean(xhat dn)).
                dx = rstd * (dn - xhat * (dn * xhat).mean(-1, keepdim=True))
        if drstd is not None and ctx.needs_input_grad[0]:
            dr = -(rstd * rstd) * xhat * drstd / x.shape[-1]
            dx = dr if dx is None else dx + dr
        return (None if dx is None else dx.to(x.dtype)), d_weight, d_gate, None, None

    @staticmethod
    def jvp(ctx, tx, tw, tg, _eps, _activation):
        """Forward-mode derivative (gate-sensitivity probes run through the norms with it)."""
        _, _, gate, rstd, xhat, w = _RMSNormFunction._normalized(ctx)
        t_out = torch.zeros_like(xhat)
        t_rstd = torch.zeros_like(rstd)
        if tx is not None:
            txf = tx.to(rstd.dtype)
            along = (xhat * txf).mean(-1, keepdim=True)
            t_out = t_out + rstd * (txf - xhat * along) * w
            t_rstd = -(rstd * rstd) * along
        if tw is not None:
            t_out = t_out + xhat * tw.to(rstd.dtype)
        if gate is not None:
            act, slope = _activation_and_slope(gate.to(rstd.dtype), ctx.activation)
            t_out = t_out * act
            if tg is not None:
                t_out = t_out + xhat * w * slope * tg.to(rstd.dtype)
        return t_out, t_rstd


def rms_norm_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    gate: torch.Tensor | None = None,
    activation: str = "sigmoid",
) -> torch.Tensor:
    """What `rms_norm_naive` computes, bit for bit, keeping less for backward
    (`_RMSNormFunction`); the result in the compute dtype."""
    return _RMSNormFunction.apply(x, weight, gate, eps, activation)[0]


def l2_normalize_naive(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(||x||^2 + eps) over the last dim, computed in at least float32; x's dtype out.
    The formula, left to autograd."""
    y = x.to(compute_dtype(x))
    return (y * torch.rsqrt(y.square().sum(-1, keepdim=True) + eps)).to(x.dtype)


def l2_adjoint(
    y: torch.Tensor, rnorm: torch.Tensor, dy: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The L2 normalization's adjoint from its output y = x r (r = rnorm, one per row): with
    y the unit row, d(x r)/dx applied to dy is r (dy - y (y . dy)). Computed in r's dtype and
    returned in `dtype`; it is also the tangent of a tangent dy (the map is symmetric)."""
    yf, dyf = y.to(rnorm.dtype), dy.to(rnorm.dtype)
    return (rnorm * (dyf - yf * (yf * dyf).sum(-1, keepdim=True))).to(dtype)


class _L2NormFunction(torch.autograd.Function):
    """`l2_normalize_naive` (the same operations, so the same output) keeping its output y, in
    x's dtype, and one 1/norm per row for the backward, not x.

    Why the output: the layers normalize q and k, and the delta rule keeps the normalized q and
    k (the same tensors) anyway, while x (the short convolution's output) is kept by nothing
    else: keeping x cost 2 bytes per channel of q and of k, 4 KB per token and block of a 340M
    GDN-2 (benchmarks/memory_audit.py). The backward reads y where it would recompute x r from
    x: from a bfloat16 y the adjoint carries bfloat16's rounding of y (relative 2^-9), the
    size of the rounding of its own bfloat16 result.

    Written with `setup_context` and a generated vmap rule, so that torch.func's transforms go
    through it (gate sensitivity's batched probes vmap over forward-mode derivatives). Both
    outputs are differentiable (r = (|x|^2 + eps)^-1/2, dr/dx = -r^2 y), and the backward and
    the jvp are torch ops on them, so derivatives of any order follow.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        xf = x.to(compute_dtype(x))
        rnorm = torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)
        # Contiguous whatever x's layout (the conv1d path's output is a transposed view), as
        # the kernel writes it: the delta rule then keeps this y, not a contiguous copy of it.
        return (xf * rnorm).to(x.dtype).contiguous(), rnorm

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        y, rnorm = output
        ctx.x_dtype = inputs[0].dtype
        # An output nothing differentiates reaches backward as None, not zeros (the layers use
        # y alone, and 1/norm's adjoint is then skipped).
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(y, rnorm)
        ctx.save_for_forward(y, rnorm)

    @staticmethod
    def backward(ctx, dy: torch.Tensor | None, drnorm: torch.Tensor | None):
        y, rnorm = ctx.saved_tensors
        dx = None if dy is None else l2_adjoint(y, rnorm, dy, rnorm.dtype)
        if drnorm is not None:  # a caller of the Function itself (the layers use y alone)
            dr = -(rnorm * rnorm) * y.to(rnorm.dtype) * drnorm
            dx = dr if dx is None else dx + dr
        return (None if dx is None else dx.to(ctx.x_dtype)), None

    @staticmethod
    def jvp(ctx, tx: torch.Tensor, _eps) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward-mode derivative (gate-sensitivity probes run through the norms with it)."""
        y, rnorm = ctx.saved_tensors
        t_rnorm = -(rnorm * rnorm) * (y.to(rnorm.dtype) * tx.to(rnorm.dtype)).sum(-1, keepdim=True)
        return l2_adjoint(y, rnorm, tx, ctx.x_dtype), t_rnorm


def l2_normalize_torch(x: torch.Tensor, eps: float) -> torch.Tensor:
    """The formula keeping its output and 1/norm per row for backward (`_L2NormFunction`), not
    x or its float32 copies."""
    return _L2NormFunction.apply(x, eps)[0]
