"""Token mixers, `[B, T, D] -> [B, T, D]`, all with
`forward(x, state=None, *, return_gates=False) -> (y, state)` (see `deltalab.layers.common`)."""

from deltalab.layers.attention import Attention
from deltalab.layers.common import (
    AttentionState,
    DeltaMixer,
    GatedRMSNorm,
    RecurrentState,
    RMSNorm,
    ShortConvolution,
)
from deltalab.layers.deltanet import DeltaNet, GatedDeltaNet
from deltalab.layers.gdn2 import GatedDeltaNet2
from deltalab.layers.kda import KimiDeltaAttention

__all__ = [
    "Attention",
    "AttentionState",
    "DeltaMixer",
    "DeltaNet",
    "GatedDeltaNet",
    "GatedDeltaNet2",
    "GatedRMSNorm",
    "KimiDeltaAttention",
    "RMSNorm",
    "RecurrentState",
    "ShortConvolution",
]
