"""Token mixers, `[B, T, D] -> [B, T, D]`, all with
`forward(x, state=None, *, mask=None, return_gates=False) -> (y, state)`
(see `deltalab.layers.common`)."""

from deltalab.layers.attention import Attention
from deltalab.layers.delta_mixer import DeltaMixer
from deltalab.layers.deltanet import DeltaNet, GatedDeltaNet
from deltalab.layers.gdn2 import GatedDeltaNet2
from deltalab.layers.kda import KimiDeltaAttention
from deltalab.layers.kdn import DiagonalKDN, ExactKDN, IsotropicKDN, KDNState
from deltalab.layers.kdn_muir import KDNMuir, KDNMuirRanks
from deltalab.layers.muir import Muir, MuirRanks, muir_ffn_width
from deltalab.layers.norms import GatedRMSNorm, RMSNorm
from deltalab.layers.short_conv import ShortConvolution
from deltalab.layers.states import AttentionState, RecurrentState

__all__ = [
    "Attention",
    "AttentionState",
    "DeltaMixer",
    "DeltaNet",
    "DiagonalKDN",
    "ExactKDN",
    "GatedDeltaNet",
    "GatedDeltaNet2",
    "GatedRMSNorm",
    "IsotropicKDN",
    "KDNMuir",
    "KDNMuirRanks",
    "KDNState",
    "KimiDeltaAttention",
    "Muir",
    "MuirRanks",
    "RMSNorm",
    "RecurrentState",
    "ShortConvolution",
    "muir_ffn_width",
]
