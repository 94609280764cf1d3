"""The states a mixer returns and takes back to continue a sequence: `RecurrentState` (the
delta-rule mixers) and `AttentionState` (softmax attention)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["AttentionState", "RecurrentState"]


@dataclass
class RecurrentState:
    """What a delta-rule mixer needs to continue a sequence.

    memory: `[B, H, K, V]`, float32 (float64 for float64 inputs) whatever the activations' dtype.
    conv_q, conv_k: `[B, H*K, W-1]`; conv_v: `[B, H*V, W-1]`: the last W-1 projected inputs.
    gates: the mixer's gates over the tokens of this call when asked for (`return_gates=True`),
        e.g. beta `[B, T, H]`, g `[B, T, H]` or `[B, T, H, K]`, erase `[B, T, H, K]`.
    in_place: a one-token step writes the new memory into `memory` instead of a new tensor
        (the returned state holds the same tensor). Set by the static-cache decoder on its own
        buffers, which a captured CUDA graph reads at fixed addresses; False everywhere else,
        so a state passed to a mixer is never modified.
    """

    memory: torch.Tensor
    conv_q: torch.Tensor
    conv_k: torch.Tensor
    conv_v: torch.Tensor
    gates: dict[str, torch.Tensor] | None = None
    in_place: bool = False


@dataclass
class AttentionState:
    """What softmax attention needs to continue a sequence.

    key: `[B, S, H, K]` (RoPE already applied), value: `[B, S, H, V]`: the cached tokens, the
        last `window - 1` of them under a sliding window; offset: the position of the next token.
    gates: empty dict when asked for (softmax attention has no gates), else None.
    key_mask: `[B, S]`, False at cached padding tokens; None when no padding was seen.
    """

    key: torch.Tensor
    value: torch.Tensor
    offset: int
    gates: dict[str, torch.Tensor] | None = None
    key_mask: torch.Tensor | None = None
