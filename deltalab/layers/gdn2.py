"""Gated DeltaNet-2 (docs/MATH.md sec. 4.3): decoupled channel-wise erase and write gates.

    S_t = (I - k_t (e_t * k_t)^T) diag(exp(g_t)) S_{t-1} + k_t (w_t * v_t)^T
    e_t = sigmoid(W_e x_t) in (0,1)^{H*K}, w_t = sigmoid(W_w x_t) in (0,1)^{H*V}, g_t as KDA.

Tying both gates to one scalar per head, e = w = beta, gives KDA.

Paper: "Gated DeltaNet-2: Decoupling Erase and Write in Linear Attention" (arXiv:2605.22791).
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
from deltalab.ops.parametrize import DeltaRuleInputs, gdn2_inputs

__all__ = ["GDN2_RANK", "GatedDeltaNet2"]

# Rank of the decay and output-gate projections in the GDN-2 paper's configurations.
GDN2_RANK = 128


class GatedDeltaNet2(DeltaMixer):
    """GDN-2: full-rank erase gate on keys, full-rank write gate on values, KDA decay.

    Gates: erase `[B, T, H, K]`, write `[B, T, H, V]`, g `[B, T, H, K]`.

    Args: options or the frontend keywords (`FrontendOptions`; output gate sigmoid by default);
    decay_rank, gate_rank: ranks of the decay and output-gate projections, default
    min(128, hidden_size).
    """

    default_gate_activation = "sigmoid"

    def __init__(
        self,
        options: FrontendOptions | None = None,
        *,
        decay_rank: int | None = None,
        gate_rank: int | None = None,
        **frontend: Unpack[FrontendKeywords],
    ) -> None:
        options = frontend_options(options, frontend, type(self))
        default_rank = min(GDN2_RANK, options.hidden_size)
        super().__init__(options, gate_rank=default_rank if gate_rank is None else gate_rank)
        hidden_size, heads, head_dim = self.hidden_size, self.num_heads, self.head_dim
        self.b_proj = nn.Linear(hidden_size, heads * head_dim, bias=False)
        self.w_proj = nn.Linear(hidden_size, heads * self.value_dim, bias=False)
        rank = default_rank if decay_rank is None else decay_rank
        self.decay = ChannelDecay(hidden_size, heads, head_dim, rank)

    def gate_projections(self) -> tuple[nn.Module, ...]:
        return (self.b_proj, self.w_proj, self.decay.f_proj)

    def gates(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        heads = self.num_heads
        erase = torch.sigmoid(project(self.b_proj, x)).unflatten(-1, (heads, self.head_dim))
        write = torch.sigmoid(project(self.w_proj, x)).unflatten(-1, (heads, self.value_dim))
        # The decay follows the delta rule's backend, as the norms (Triton or the torch path).
        g = self.decay(x, backend=layer_backend(self.backend))
        return {"erase": erase, "write": write, "g": g}

    def inputs_from_gates(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: dict[str, torch.Tensor]
    ) -> DeltaRuleInputs:
        return gdn2_inputs(q, k, v, gates["erase"], gates["write"], gates["g"])
