"""Each baseline mixer's own inputs -> the primitive's `(q, a, b, u, g)` (docs/MATH.md sec. 1.2).

| mixer    | a              | b         | u         | g                     |
|----------|----------------|-----------|-----------|-----------------------|
| DeltaNet | beta `[B,T,H]` | k         | v         | 0                     |
| GDN      | beta `[B,T,H]` | k         | v         | one per head [B,T,H]  |
| KDA      | beta `[B,T,H]` | k         | v         | per channel [B,T,H,K] |
| GDN-2    | k              | erase * k | write * v | per channel [B,T,H,K] |

A per-token a is the write direction a_t b_t = beta_t k_t: the primitive takes beta as it is
(its Triton kernels multiply it in as they load k; the other backends form the product), so no
[B, T, H, K] product is written, kept for backward or differentiated by a kernel of its own.

GDN-2's gates are sigmoids of projections; `gdn2_inputs_from_logits` takes the logits and
multiplies each sigmoid in with one op (`deltalab.ops.read_gate.sigmoid_gate`), which neither
stores the sigmoid nor its gradient.

Shapes: q, k `[B, T, H, K]`, v `[B, T, H, V]`, beta `[B, T, H]`, erase `[B, T, H, K]`,
write `[B, T, H, V]`. The same functions serve one-token decoding (`[B, H, *]`, beta `[B, H]`).

GDN-2's gate products are marked `rebuildable`: a product's own backward keeps both factors,
so where the delta rule would keep the product (`rebuilt_in_backward`) it is made again.

k is made contiguous first: the layers' k is a strided view of the short convolution's output,
and both GDN-2's gate product (erase * k) and the Triton delta rule keep it for backward, the
kernel as its own contiguous copy: otherwise one k is kept twice. Same values, so no result
changes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from deltalab.ops._checks import require_float, require_shape
from deltalab.ops._recompute import rebuildable_product as _product
from deltalab.ops.read_gate import sigmoid_gate


class DeltaRuleInputs(NamedTuple):
    """Arguments of `deltalab.ops.delta_rule` in order: q, a, b, u, g."""

    q: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    u: torch.Tensor
    g: torch.Tensor


def _check_beta(k: torch.Tensor, beta: torch.Tensor) -> None:
    require_float("beta", beta)
    layout = "[B, T, H]" if k.dim() == 4 else "[B, H]"
    require_shape("beta", beta, k.shape[:-1], layout, "to match k")


def deltanet_inputs(q, k, v, beta) -> DeltaRuleInputs:
    """DeltaNet: S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T, no decay."""
    _check_beta(k, beta)
    return DeltaRuleInputs(q, beta, k, v, torch.zeros_like(beta))


def gated_deltanet_inputs(q, k, v, beta, g) -> DeltaRuleInputs:
    """Gated DeltaNet: DeltaNet with one log decay per head and token, g `[B, T, H]`."""
    _check_beta(k, beta)
    require_float("g", g)
    require_shape("g", g, k.shape[:-1], "[B, T, H]", "(one log decay per head)")
    return DeltaRuleInputs(q, beta, k, v, g)


def kda_inputs(q, k, v, beta, g) -> DeltaRuleInputs:
    """Kimi Delta Attention: DeltaNet with a per-channel log decay, g `[B, T, H, K]`."""
    _check_beta(k, beta)
    require_float("g", g)
    require_shape("g", g, k.shape, "[B, T, H, K]", "(one log decay per key channel)")
    return DeltaRuleInputs(q, beta, k, v, g)


def gdn2_inputs(q, k, v, erase, write, g) -> DeltaRuleInputs:
    """Gated DeltaNet-2: channel-wise erase gate on the key, write gate on the value.

    erase `[B, T, H, K]` and write `[B, T, H, V]` in (0, 1); g `[B, T, H, K]`.
    """
    _check_gdn2_gates(k, v, erase, write, g, ("erase", "write"))
    k = k.contiguous()  # one k for the gate product and the kernel (module docstring)
    return DeltaRuleInputs(q, k, _product(erase, k), _product(write, v), g)


def gdn2_inputs_from_logits(
    q, k, v, erase_logits, write_logits, g, *, backend: str = "auto"
) -> DeltaRuleInputs:
    """`gdn2_inputs` with erase = sigmoid(erase_logits) and write = sigmoid(write_logits), each
    multiplied in by `sigmoid_gate` on `backend` (its "auto", "torch", "naive" or "triton"):
    the same values up to the rounding of the product (the sigmoid in float32, one rounding to
    k's and v's dtype). Logits of the gates' shapes, any float dtype."""
    _check_gdn2_gates(k, v, erase_logits, write_logits, g, ("erase_logits", "write_logits"))
    k = k.contiguous()  # one k for the gate product and the kernel (module docstring)
    erased = sigmoid_gate(k, erase_logits, backend=backend)
    return DeltaRuleInputs(q, k, erased, sigmoid_gate(v, write_logits, backend=backend), g)


def _check_gdn2_gates(k, v, erase, write, g, names: tuple[str, str]) -> None:
    for name, x in ((names[0], erase), (names[1], write), ("g", g)):
        require_float(name, x)
    require_shape(names[0], erase, k.shape, "[B, T, H, K]", "to match k")
    require_shape(names[1], write, v.shape, "[B, T, H, V]", "to match v")
    require_shape("g", g, k.shape, "[B, T, H, K]", "(one log decay per key channel)")
