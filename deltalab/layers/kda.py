"""Kimi Delta Attention: the gated delta rule with a per-channel decay.

S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T
g_t = -exp(A_log[h]) * softplus(f_proj(x_t) + dt_bias[h, :]),  f_proj: D -> rank -> H*K

docs/MATH.md sec. 4.1-4.2. Paper: "Kimi Linear: An Expressive, Efficient Attention
Architecture" (arXiv:2510.26692).
"""

from __future__ import annotations

from typing import Unpack

import torch
from torch import nn

from deltalab.layers.common import (
    DeltaMixer,
    FrontendKeywords,
    FrontendOptions,
    frontend_options,
    project,
)
from deltalab.layers.decay import ChannelDecay
from deltalab.ops.log_decay import layer_backend
from deltalab.ops.parametrize import DeltaRuleInputs, kda_inputs

__all__ = ["KimiDeltaAttention"]


class KimiDeltaAttention(DeltaMixer):
    """KDA: beta = sigmoid(W_b x) per head, channel decay, low-rank sigmoid output gate.

    Gates: beta `[B, T, H]`, g `[B, T, H, K]`.

    Args: options or the frontend keywords (`FrontendOptions`; output gate sigmoid by default);
    decay_rank: rank of the decay projection (default head_dim); gate_rank: rank of the output
    gate (default value_dim), both as fla's KDA.
    """

    default_gate_activation = "sigmoid"
    # q and k are the rule's q and b as they are: it normalizes them.
    normalizes_in_rule = True

    def __init__(
        self,
        options: FrontendOptions | None = None,
        *,
        decay_rank: int | None = None,
        gate_rank: int | None = None,
        **frontend: Unpack[FrontendKeywords],
    ) -> None:
        options = frontend_options(options, frontend, type(self))
        super().__init__(options, gate_rank=options.value_dim if gate_rank is None else gate_rank)
        heads, head_dim = self.num_heads, self.head_dim
        self.b_proj = nn.Linear(self.hidden_size, heads, bias=False)
        rank = head_dim if decay_rank is None else decay_rank
        self.decay = ChannelDecay(self.hidden_size, heads, head_dim, rank)

    def gate_projections(self) -> tuple[nn.Module, ...]:
        return (self.b_proj, self.decay.f_proj)

    def gates(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        # The decay follows the delta rule's backend, as the norms (Triton or the torch path).
        g = self.decay(x, backend=layer_backend(self.backend))
        return {"beta": torch.sigmoid(project(self.b_proj, x)), "g": g}

    def inputs_from_gates(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: dict[str, torch.Tensor]
    ) -> DeltaRuleInputs:
        return kda_inputs(q, k, v, gates["beta"], gates["g"])
