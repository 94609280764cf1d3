"""Gated DeltaNet-2 (docs/MATH.md sec. 4.3): decoupled channel-wise erase and write gates.

    S_t = (I - k_t (e_t * k_t)^T) diag(exp(g_t)) S_{t-1} + k_t (w_t * v_t)^T
    e_t = sigmoid(W_e x_t) in (0,1)^{H*K}, w_t = sigmoid(W_w x_t) in (0,1)^{H*V}, g_t as KDA.

Tying both gates to one scalar per head, e = w = beta, gives KDA.

Paper: "Gated DeltaNet-2: Decoupling Erase and Write in Linear Attention" (arXiv:2605.22791).
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

from deltalab.layers.frontend import FrontendOptions
from deltalab.layers.kda import ChannelDecayMixer
from deltalab.layers.shared_input import project
from deltalab.ops import read_gate
from deltalab.ops.log_decay import layer_backend
from deltalab.ops.parametrize import DeltaRuleInputs, gdn2_inputs, gdn2_inputs_from_logits

__all__ = ["ERASE_LOGITS", "GDN2_RANK", "WRITE_LOGITS", "GatedDeltaNet2"]

# Rank of the decay and output-gate projections in the GDN-2 paper's configurations.
GDN2_RANK = 128
# The gates' entries holding the erase and write logits, where the products are fused.
ERASE_LOGITS, WRITE_LOGITS = "erase_logits", "write_logits"


def products_fuse(backend: str, x: torch.Tensor) -> bool:
    """Whether a layer on the delta-rule `backend` multiplies its erase and write gates in as
    `sigmoid_gate` (their logits in the gates): where that op takes its Triton kernels. On the
    torch path the two are the same torch ops either way, so the gates stay the sigmoids
    (what gate sensitivity and `return_gates` report)."""
    return read_gate.resolve_backend(layer_backend(backend), x) == "triton"


@functools.cache
def gates_take(cls: type, *keywords: str) -> bool:
    """Whether `cls.gates` takes these keywords (`logits`, Muir's `fused_read`): a subclass that
    overrides `gates(self, x)` without them keeps the plain gates (nothing fused) rather than
    failing on Triton."""
    parameters = inspect.signature(cls.gates).parameters
    return all(keyword in parameters for keyword in keywords)


def erase_write_gates(
    erase: torch.Tensor, write: torch.Tensor, logits: bool
) -> dict[str, torch.Tensor]:
    """The erase and write gates from their projections: the sigmoids, or with `logits` the
    projections themselves as `ERASE_LOGITS` and `WRITE_LOGITS` (`products_fuse`)."""
    if logits:
        return {ERASE_LOGITS: erase, WRITE_LOGITS: write}
    return {"erase": torch.sigmoid(erase), "write": torch.sigmoid(write)}


def gates_from_logits(gates: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The gates with the erase and write sigmoids in place of their logits (as given when
    they hold the sigmoids already)."""
    if ERASE_LOGITS not in gates:
        return gates
    rest = {
        name: value for name, value in gates.items() if name not in (ERASE_LOGITS, WRITE_LOGITS)
    }
    sigmoids = {
        "erase": torch.sigmoid(gates[ERASE_LOGITS]),
        "write": torch.sigmoid(gates[WRITE_LOGITS]),
    }
    return sigmoids | rest


def gdn2_inputs_of(q, k, v, gates: dict[str, torch.Tensor], backend: str) -> DeltaRuleInputs:
    """GDN-2's primitive inputs from gates holding the erase and write sigmoids or their logits
    (`products_fuse`), the products on the delta rule's `backend` as the norms'."""
    if ERASE_LOGITS in gates:
        return gdn2_inputs_from_logits(
            q, k, v, gates[ERASE_LOGITS], gates[WRITE_LOGITS], gates["g"],
            backend=layer_backend(backend),
        )  # fmt: skip
    return gdn2_inputs(q, k, v, gates["erase"], gates["write"], gates["g"])


class GatedDeltaNet2(ChannelDecayMixer):
    """GDN-2: full-rank erase gate on keys, full-rank write gate on values, KDA decay.

    Gates: erase `[B, T, H, K]`, write `[B, T, H, V]`, g `[B, T, H, K]`.

    Args: options or the frontend keywords (`FrontendOptions`; output gate sigmoid by default);
    decay_rank, gate_rank: ranks of the decay and output-gate projections, default
    min(128, hidden_size).
    """

    default_gate_activation = "sigmoid"

    @classmethod
    def default_ranks(cls, options: FrontendOptions) -> tuple[int, int]:
        rank = min(GDN2_RANK, options.hidden_size)
        return rank, rank

    def _init_gate_projections(self) -> None:
        hidden_size, heads = self.hidden_size, self.num_heads
        self.b_proj = nn.Linear(hidden_size, heads * self.head_dim, bias=False)
        self.w_proj = nn.Linear(hidden_size, heads * self.value_dim, bias=False)

    def gate_projections(self) -> tuple[nn.Module, ...]:
        return (self.b_proj, self.w_proj, self.decay.f_proj)

    def gates(self, x: torch.Tensor, *, logits: bool = False) -> dict[str, torch.Tensor]:
        """x `[B, T, D]` -> erase, write, g (class docstring); with `logits` the erase and write
        gates' pre-activations in their place, as `ERASE_LOGITS` and `WRITE_LOGITS`."""
        heads = self.num_heads
        erase = project(self.b_proj, x).unflatten(-1, (heads, self.head_dim))
        write = project(self.w_proj, x).unflatten(-1, (heads, self.value_dim))
        # The decay follows the delta rule's backend, as the norms (Triton or the torch path).
        g = self.decay(x, backend=layer_backend(self.backend))
        return erase_write_gates(erase, write, logits) | {"g": g}

    def hooked_gates(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """As `DeltaMixer.hooked_gates`; but where nothing can see the erase and write gates
        (no gate hooks) and the gate products run on Triton (`products_fuse`), the gates hold
        their logits and `inputs_from_gates` multiplies each sigmoid in with one kernel
        (`sigmoid_gate`). A hook always gets the gates, and so does `return_gates=True`
        (`reported_gates`)."""
        if (
            self._gate_hooks
            or not products_fuse(self.backend, x)
            or not gates_take(type(self), "logits")
        ):
            return super().hooked_gates(x)
        return self.gates(x, logits=True)

    def reported_gates(self, gates: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return gates_from_logits(gates)

    def inputs_from_gates(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: dict[str, torch.Tensor]
    ) -> DeltaRuleInputs:
        return gdn2_inputs_of(q, k, v, gates, self.backend)
