"""Kimi Delta Attention: the gated delta rule with a per-channel decay.

S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T
g_t = -exp(A_log[h]) * softplus(f_proj(x_t) + dt_bias[h, :]),  f_proj: D -> rank -> H*K

docs/MATH.md sec. 4.1-4.2. Paper: "Kimi Linear: An Expressive, Efficient Attention
Architecture" (arXiv:2510.26692).
"""

from __future__ import annotations

import torch
from torch import nn

from deltalab.layers.common import DeltaMixer
from deltalab.layers.decay import ChannelDecay
from deltalab.ops.parametrize import DeltaRuleInputs, kda_inputs

__all__ = ["KimiDeltaAttention"]


class KimiDeltaAttention(DeltaMixer):
    """KDA: beta = sigmoid(W_b x) per head, channel decay, low-rank sigmoid output gate.

    Gates: beta `[B, T, H]`, g `[B, T, H, K]`.

    Args (beyond `DeltaMixer`'s): decay_rank: rank of the decay projection (default head_dim);
    gate_rank: rank of the output gate (default value_dim), both as fla's KDA.
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
        decay_rank: int | None = None,
        gate_rank: int | None = None,
        gate_activation: str = "sigmoid",
        norm_eps: float = 1e-5,
    ) -> None:
        value_dim = head_dim if value_dim is None else value_dim
        super().__init__(
            hidden_size=hidden_size,
            num_heads=num_heads,
            head_dim=head_dim,
            value_dim=value_dim,
            conv_size=conv_size,
            chunk_size=chunk_size,
            backend=backend,
            gate_rank=value_dim if gate_rank is None else gate_rank,
            gate_activation=gate_activation,
            norm_eps=norm_eps,
        )
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        rank = head_dim if decay_rank is None else decay_rank
        self.decay = ChannelDecay(hidden_size, num_heads, head_dim, rank)

    def primitive_inputs(
        self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[DeltaRuleInputs, dict[str, torch.Tensor]]:
        beta = torch.sigmoid(self.b_proj(x))
        g = self.decay(x)
        return kda_inputs(q, k, v, beta, g), {"beta": beta, "g": g}
