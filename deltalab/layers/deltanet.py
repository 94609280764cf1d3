"""DeltaNet and Gated DeltaNet: the delta rule with a per-head write strength beta.

DeltaNet: S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T
GDN:      the same after a per-head decay exp(g_t), g_t = -exp(A_log) softplus(W_a x + dt_bias)

docs/MATH.md sec. 4.1-4.2. Papers: "Parallelizing Linear Transformers with the Delta Rule over
Sequence Length" (arXiv:2406.06484); "Gated Delta Networks: Improving Mamba2 with Delta Rule"
(arXiv:2412.06464).
"""

from __future__ import annotations

import torch
from torch import nn

from deltalab.layers.common import DeltaMixer
from deltalab.layers.decay import ScalarDecay
from deltalab.ops.parametrize import DeltaRuleInputs, deltanet_inputs, gated_deltanet_inputs

__all__ = ["DeltaNet", "GatedDeltaNet"]


class DeltaNet(DeltaMixer):
    """DeltaNet: beta = sigmoid(W_b x) per head, no decay. Gates: beta `[B, T, H]`.

    Keyword arguments as `DeltaMixer` (output gate full rank, SiLU by default).
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        value_dim: int | None = None,
        conv_size: int = 4,
        chunk_size: int = 64,
        backend: str = "auto",
        gate_rank: int | None = None,
        gate_activation: str = "silu",
        norm_eps: float = 1e-5,
    ) -> None:
        super().__init__(
            hidden_size=hidden_size,
            num_heads=num_heads,
            head_dim=head_dim,
            value_dim=value_dim,
            conv_size=conv_size,
            chunk_size=chunk_size,
            backend=backend,
            gate_rank=gate_rank,
            gate_activation=gate_activation,
            norm_eps=norm_eps,
        )
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)

    def primitive_inputs(
        self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[DeltaRuleInputs, dict[str, torch.Tensor]]:
        beta = torch.sigmoid(self.b_proj(x))
        return deltanet_inputs(q, k, v, beta), {"beta": beta}


class GatedDeltaNet(DeltaNet):
    """Gated DeltaNet: DeltaNet with one log decay per head (`ScalarDecay`).

    Gates: beta `[B, T, H]`, g `[B, T, H]`. Keyword arguments as `DeltaMixer`.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        value_dim: int | None = None,
        conv_size: int = 4,
        chunk_size: int = 64,
        backend: str = "auto",
        gate_rank: int | None = None,
        gate_activation: str = "silu",
        norm_eps: float = 1e-5,
    ) -> None:
        super().__init__(
            hidden_size=hidden_size,
            num_heads=num_heads,
            head_dim=head_dim,
            value_dim=value_dim,
            conv_size=conv_size,
            chunk_size=chunk_size,
            backend=backend,
            gate_rank=gate_rank,
            gate_activation=gate_activation,
            norm_eps=norm_eps,
        )
        self.decay = ScalarDecay(hidden_size, num_heads)

    def primitive_inputs(
        self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[DeltaRuleInputs, dict[str, torch.Tensor]]:
        beta = torch.sigmoid(self.b_proj(x))
        g = self.decay(x)
        return gated_deltanet_inputs(q, k, v, beta, g), {"beta": beta, "g": g}
