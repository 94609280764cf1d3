"""DeltaNet and Gated DeltaNet: the delta rule with a per-head write strength beta.

DeltaNet: S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T
GDN:      the same after a per-head decay exp(g_t), g_t = -exp(A_log) softplus(W_a x + dt_bias)

docs/MATH.md sec. 4.1-4.2. Papers: "Parallelizing Linear Transformers with the Delta Rule over
Sequence Length" (arXiv:2406.06484); "Gated Delta Networks: Improving Mamba2 with Delta Rule"
(arXiv:2412.06464).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Unpack

import torch
from torch import nn

from deltalab.layers.decay import ScalarDecay
from deltalab.layers.delta_mixer import DeltaMixer
from deltalab.layers.frontend import FrontendKeywords, FrontendOptions
from deltalab.layers.shared_input import project
from deltalab.ops.log_decay import layer_backend
from deltalab.ops.parametrize import DeltaRuleInputs, deltanet_inputs, gated_deltanet_inputs

__all__ = ["DeltaNet", "GatedDeltaNet"]


class DeltaNet(DeltaMixer):
    """DeltaNet: beta = sigmoid(W_b x) per head, no decay. Gates: beta `[B, T, H]`.

    Args: options or the frontend keywords (`FrontendOptions`; output gate SiLU by default);
    gate_rank: rank of the output gate, None for full rank.
    """

    def __init__(
        self,
        options: FrontendOptions | None = None,
        *,
        gate_rank: int | None = None,
        **frontend: Unpack[FrontendKeywords],
    ) -> None:
        super().__init__(options, gate_rank=gate_rank, **frontend)
        self.b_proj = nn.Linear(self.hidden_size, self.num_heads, bias=False)
        self._init_decay()

    def _init_decay(self) -> None:
        """The decay module of a subclass (`GatedDeltaNet`), made after `b_proj`; none here."""

    def gate_projections(self) -> tuple[nn.Module, ...]:
        return (self.b_proj,)

    def gates(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"beta": torch.sigmoid(project(self.b_proj, x))}

    def inputs_from_gates(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: dict[str, torch.Tensor]
    ) -> DeltaRuleInputs:
        return deltanet_inputs(q, k, v, gates["beta"])


class DecayedBetaGates:
    """The gates of GDN and KDA: beta = sigmoid(W_b x) per head (`b_proj`) and the log decay of
    the layer's `decay` module (per head or per channel), as `{"beta", "g"}`; the primitive's
    inputs from them by the class's `parametrize` (`deltalab.ops.parametrize`)."""

    parametrize: ClassVar[Callable[..., DeltaRuleInputs]]

    def gates(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        # The decay follows the delta rule's backend, as the norms (Triton or the torch path).
        g = self.decay(x, backend=layer_backend(self.backend))
        return {"beta": torch.sigmoid(project(self.b_proj, x)), "g": g}

    def inputs_from_gates(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: dict[str, torch.Tensor]
    ) -> DeltaRuleInputs:
        return self.parametrize(q, k, v, gates["beta"], gates["g"])


class GatedDeltaNet(DecayedBetaGates, DeltaNet):
    """Gated DeltaNet: DeltaNet with one log decay per head (`ScalarDecay`).

    Gates: beta `[B, T, H]`, g `[B, T, H]`. Arguments as `DeltaNet`.
    """

    parametrize = staticmethod(gated_deltanet_inputs)

    def _init_decay(self) -> None:
        self.decay = ScalarDecay(self.hidden_size, self.num_heads)

    def gate_projections(self) -> tuple[nn.Module, ...]:
        return (self.b_proj, self.decay.a_proj)
