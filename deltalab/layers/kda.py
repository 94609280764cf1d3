"""Kimi Delta Attention: the gated delta rule with a per-channel decay.

S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T
g_t = -exp(A_log[h]) * softplus(f_proj(x_t) + dt_bias[h, :]),  f_proj: D -> rank -> H*K

docs/MATH.md sec. 4.1-4.2. Paper: "Kimi Linear: An Expressive, Efficient Attention
Architecture" (arXiv:2510.26692).
"""

from __future__ import annotations

import abc
from typing import Unpack, cast

from torch import nn

from deltalab.layers.decay import ChannelDecay
from deltalab.layers.delta_mixer import DeltaMixer
from deltalab.layers.deltanet import DecayedBetaGates
from deltalab.layers.frontend import FrontendKeywords, FrontendOptions, frontend_options
from deltalab.ops.parametrize import kda_inputs

__all__ = ["KimiDeltaAttention"]


class ChannelDecayMixer(DeltaMixer):
    """The constructor KDA and GDN-2 share: the frontend with the output gate's rank, the
    layer's own gate projections (`_init_gate_projections`), then the per-channel decay
    (`ChannelDecay`), in that order. Each class gives its default ranks (`default_ranks`).

    Args: options or the frontend keywords (`FrontendOptions`); decay_rank: rank of the decay
    projection; gate_rank: rank of the output gate.
    """

    def __init__(
        self,
        options: FrontendOptions | None = None,
        *,
        decay_rank: int | None = None,
        gate_rank: int | None = None,
        **frontend: Unpack[FrontendKeywords],
    ) -> None:
        options = frontend_options(options, frontend, type(self))
        default_decay_rank, default_gate_rank = self.default_ranks(options)
        super().__init__(options, gate_rank=default_gate_rank if gate_rank is None else gate_rank)
        self._init_gate_projections()
        rank = default_decay_rank if decay_rank is None else decay_rank
        self.decay = ChannelDecay(self.hidden_size, self.num_heads, self.head_dim, rank)

    @classmethod
    @abc.abstractmethod
    def default_ranks(cls, options: FrontendOptions) -> tuple[int, int]:
        """(decay_rank, gate_rank) when not given."""

    @abc.abstractmethod
    def _init_gate_projections(self) -> None:
        """The projections of x into the layer's gates other than the decay."""


class KimiDeltaAttention(DecayedBetaGates, ChannelDecayMixer):
    """KDA: beta = sigmoid(W_b x) per head, channel decay, low-rank sigmoid output gate.

    Gates: beta `[B, T, H]`, g `[B, T, H, K]`.

    Args: options or the frontend keywords (`FrontendOptions`; output gate sigmoid by default);
    decay_rank: rank of the decay projection (default head_dim); gate_rank: rank of the output
    gate (default value_dim), both as fla's KDA.
    """

    default_gate_activation = "sigmoid"
    parametrize = staticmethod(kda_inputs)

    @classmethod
    def default_ranks(cls, options: FrontendOptions) -> tuple[int, int]:
        return options.head_dim, cast(int, options.value_dim)

    def _init_gate_projections(self) -> None:
        self.b_proj = nn.Linear(self.hidden_size, self.num_heads, bias=False)

    def gate_projections(self) -> tuple[nn.Module, ...]:
        return (self.b_proj, self.decay.f_proj)
