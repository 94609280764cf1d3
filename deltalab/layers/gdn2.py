"""Gated DeltaNet-2 (docs/MATH.md sec. 4.3): decoupled channel-wise erase and write gates.

    S_t = (I - k_t (e_t * k_t)^T) diag(exp(g_t)) S_{t-1} + k_t (w_t * v_t)^T
    e_t = sigmoid(W_e x_t) in (0,1)^{H*K}, w_t = sigmoid(W_w x_t) in (0,1)^{H*V}, g_t as KDA.

Tying both gates to one scalar per head, e = w = beta, gives KDA.

Paper: "Gated DeltaNet-2: Decoupling Erase and Write in Linear Attention" (arXiv:2605.22791).
"""

from __future__ import annotations

import torch
from torch import nn

from deltalab.layers.common import DeltaMixer, require_positive_int
from deltalab.layers.decay import ChannelDecay
from deltalab.ops.parametrize import DeltaRuleInputs, gdn2_inputs

__all__ = ["GDN2_RANK", "GatedDeltaNet2"]

# Rank of the decay and output-gate projections in the GDN-2 paper's configurations.
GDN2_RANK = 128


class GatedDeltaNet2(DeltaMixer):
    """GDN-2: full-rank erase gate on keys, full-rank write gate on values, KDA decay.

    Gates: erase `[B, T, H, K]`, write `[B, T, H, V]`, g `[B, T, H, K]`.

    Args (beyond `DeltaMixer`'s): decay_rank, gate_rank: ranks of the decay and output-gate
    projections, default min(128, hidden_size).
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
        default_rank = min(GDN2_RANK, require_positive_int("hidden_size", hidden_size))
        super().__init__(
            hidden_size=hidden_size,
            num_heads=num_heads,
            head_dim=head_dim,
            value_dim=value_dim,
            conv_size=conv_size,
            chunk_size=chunk_size,
            backend=backend,
            gate_rank=default_rank if gate_rank is None else gate_rank,
            gate_activation=gate_activation,
            norm_eps=norm_eps,
        )
        self.b_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.w_proj = nn.Linear(hidden_size, num_heads * self.value_dim, bias=False)
        rank = default_rank if decay_rank is None else decay_rank
        self.decay = ChannelDecay(hidden_size, num_heads, head_dim, rank)

    def primitive_inputs(
        self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[DeltaRuleInputs, dict[str, torch.Tensor]]:
        erase = torch.sigmoid(self.b_proj(x)).unflatten(-1, k.shape[-2:])
        write = torch.sigmoid(self.w_proj(x)).unflatten(-1, v.shape[-2:])
        g = self.decay(x)
        return gdn2_inputs(q, k, v, erase, write, g), {"erase": erase, "write": write, "g": g}
