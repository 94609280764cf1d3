"""The generation cache: every block's mixer state, nothing else."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["RecurrentCache"]


class RecurrentCache:
    """Per-block mixer states during generation.

    states[i]: the state returned by block i's mixer (`RecurrentState`: memory `[B, H, K, V]` and
    short-conv buffers, fixed size; `AttentionState`: keys/values `[B, S, H, *]`, S bounded by
    the window when sliding). seen_tokens: tokens consumed so far (prompt included).
    """

    def __init__(self, num_layers: int) -> None:
        self.states: list[Any] = [None] * num_layers
        self.seen_tokens = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache holds (states' gate traces excluded)."""
        found = []
        for state in self.states:
            if state is None:
                continue
            for field in dataclasses.fields(state):
                value = getattr(state, field.name)
                if field.name != "gates" and isinstance(value, torch.Tensor):
                    found.append(value)
                elif isinstance(value, tuple):
                    found.extend(v for v in value if isinstance(v, torch.Tensor))
        return found

    def nbytes(self) -> int:
        """Memory held by the cache's tensors, in bytes."""
        return sum(t.numel() * t.element_size() for t in self.tensors())
