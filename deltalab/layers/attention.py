"""Softmax attention with rotary position embeddings, optional sliding window and a KV cache.

A query at position p attends to the keys at positions (p - window, p] (all of [0, p] when
window is None), so the cache only needs the last `window - 1` keys and values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deltalab.layers.common import check_hidden, check_mask, check_state_batch, require_positive_int
from deltalab.layers.shared_input import project, sharing_autocast_input
from deltalab.layers.states import AttentionState
from deltalab.ops._checks import require_choice
from deltalab.ops.context_parallel import (
    context_group,
    gather_ranks,
    group_rank,
    require_fresh_sequences,
)
from deltalab.ops.rope import BACKENDS as ROPE_BACKENDS
from deltalab.ops.rope import ROPE_BASE, rope

__all__ = ["ROPE_BASE", "Attention", "sliding_window_mask"]


def sliding_window_mask(
    query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None
) -> torch.Tensor:
    """Boolean `[T, S]`, True where the query at `query_positions [T]` may see the key at
    `key_positions [S]`: causal, and within the last `window` positions when window is set."""
    gap = query_positions[:, None] - key_positions[None, :]
    allowed = gap >= 0
    if window is not None:
        allowed = allowed & (gap < window)
    return allowed


class Attention(nn.Module):
    """Multi-head softmax attention with RoPE (SDPA), `[B, T, D] -> [B, T, D]`.

    State: `AttentionState` with the rotated keys `[B, S, H, K]`, values `[B, S, H, V]` and the
    position of the next token. Softmax attention has no gates: `return_gates=True` gives an
    empty `state.gates`.

    Args:
        hidden_size: D. num_heads: H. head_dim: K (even, for RoPE). value_dim: V (defaults to K).
        window: keys attended per query, itself included; None for full causal attention.
        rope_base: base of the rotary frequencies.
        backend: the rotary embedding's (`deltalab.ops.rope`): "auto" (Triton on CUDA), "torch",
            "triton" or "naive"; the models pass their config's through `layer_backend`, as to
            their norms and FFNs ("chunk" and "naive" -> "torch").
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        value_dim: int | None = None,
        window: int | None = None,
        rope_base: float = ROPE_BASE,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self.hidden_size = require_positive_int("hidden_size", hidden_size)
        self.num_heads = require_positive_int("num_heads", num_heads)
        self.head_dim = require_positive_int("head_dim", head_dim)
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")
        self.value_dim = require_positive_int(
            "value_dim", head_dim if value_dim is None else value_dim
        )
        self.window = None if window is None else require_positive_int("window", window)
        if not rope_base > 1.0:
            raise ValueError(f"rope_base must be > 1, got {rope_base}")
        self.rope_base = float(rope_base)
        self.backend = require_choice("backend", backend, ROPE_BACKENDS)
        key_width, value_width = num_heads * head_dim, num_heads * self.value_dim
        self.q_proj = nn.Linear(hidden_size, key_width, bias=False)
        self.k_proj = nn.Linear(hidden_size, key_width, bias=False)
        self.v_proj = nn.Linear(hidden_size, value_width, bias=False)
        self.o_proj = nn.Linear(value_width, hidden_size, bias=False)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """RoPE of queries or keys `[B, T, H, K]` at `positions [T]` on this layer's backend."""
        return rope(x, positions, base=self.rope_base, backend=self.backend)

    def forward(
        self,
        x: torch.Tensor,
        state: AttentionState | None = None,
        *,
        mask: torch.Tensor | None = None,
        return_gates: bool = False,
    ) -> tuple[torch.Tensor, AttentionState]:
        """x `[B, T, D]`, state from a previous call or None, mask `[B, T]` (False at padding
        tokens, which no query sees) -> (y `[B, T, D]`, new state)."""
        check_hidden(x, self.hidden_size)
        if state is not None and not isinstance(state, AttentionState):
            raise TypeError(f"state must be an AttentionState or None, got {type(state).__name__}")
        if state is not None:
            check_state_batch("state.key", state.key, x, "[B, S, H, K]")
        mask = check_mask(mask, x)
        length = x.shape[1]
        offset = 0 if state is None else state.offset
        group = context_group()
        if group is not None:
            # This rank's piece of sequences split over the group: its queries attend to the
            # keys of every earlier rank's piece and its own (all-gathered).
            require_fresh_sequences(state, mask)
            rank, _ = group_rank(group)
            offset = rank * length
        positions = torch.arange(offset, offset + length, device=x.device)
        key_shape = (self.num_heads, self.head_dim)
        # One autocast copy of x kept for the three projections, instead of one by each, and one
        # matrix product for their input gradient (`deltalab.layers.projections`).
        with sharing_autocast_input(x, (self.q_proj, self.k_proj, self.v_proj)):
            q = self.rotate(project(self.q_proj, x).unflatten(-1, key_shape), positions)
            k = self.rotate(project(self.k_proj, x).unflatten(-1, key_shape), positions)
            v = project(self.v_proj, x).unflatten(-1, (self.num_heads, self.value_dim))
        key_mask = mask
        if group is not None:
            # All of them, the later ranks' hidden by the causal mask: every rank builds the
            # same graph (`gather_ranks`).
            k, v = (gather_ranks(t, group).movedim(0, 1).flatten(1, 2) for t in (k, v))
        if state is not None:
            k = torch.cat([state.key.to(k.dtype), k], dim=1)
            v = torch.cat([state.value.to(v.dtype), v], dim=1)
            if state.key_mask is not None or mask is not None:
                old = state.key_mask if state.key_mask is not None else _ones(state.key)
                key_mask = torch.cat([old, mask if mask is not None else _ones(x)], dim=1)
        attn_mask = None
        if (
            state is not None
            or group is not None
            or self.window is not None
            or key_mask is not None
        ):
            cached = k.shape[1]
            # The cached keys end at the last query; the gathered ones start at 0.
            first = 0 if group is not None else offset + length - cached
            key_positions = torch.arange(first, first + cached, device=x.device)
            attn_mask = sliding_window_mask(positions, key_positions, self.window)
            if key_mask is not None:
                # Padding keys are hidden; a padding query still sees itself, so that no row
                # of the softmax is empty (its output is never read by a real token).
                itself = positions[:, None] == key_positions[None, :]
                attn_mask = (attn_mask & key_mask[:, None, None, :]) | itself
        # SDPA takes [B, H, T, *]; without a cache, window or padding its causal fast path applies.
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=attn_mask,
            is_causal=attn_mask is None,
        )
        y = self.o_proj(o.transpose(1, 2).flatten(-2))
        keep = k.shape[1] if self.window is None else min(self.window - 1, k.shape[1])
        new_state = AttentionState(
            key=k[:, k.shape[1] - keep :],
            value=v[:, v.shape[1] - keep :],
            offset=offset + length,
            gates={} if return_gates else None,
            key_mask=None if key_mask is None else key_mask[:, key_mask.shape[1] - keep :],
        )
        return y, new_state


def _ones(x: torch.Tensor) -> torch.Tensor:
    return torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
