"""A prompt read into a cache in segments: the memory of a long prefill stays that of one segment.

A recurrent model's forward over T tokens holds activations and chunk-start states in
proportion to T (a 340M preset at 1M tokens asks for more than an 80 GB card holds); read in
segments, each continuing the cache of the one before, it holds one segment's worth and reaches
the same cache and last logits to rounding. An attention model's cache grows with the prompt
either way; segments bound only its activations.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["PREFILL_SEGMENT", "prefill", "segments"]

# Tokens read per forward: at 64K the 340M presets prefill at their full forward speed on an
# H100, and a segment's transient memory (chunk-start states, activations) stays a few GiB.
PREFILL_SEGMENT = 65536


def segments(length: int, segment_len: int) -> list[tuple[int, int]]:
    """The (start, stop) of consecutive spans of at most `segment_len` covering `length`."""
    if isinstance(segment_len, bool) or not isinstance(segment_len, int) or segment_len < 1:
        raise ValueError(f"segment_len must be a positive int, got {segment_len!r}")
    return [(s, min(s + segment_len, length)) for s in range(0, length, segment_len)]


@torch.no_grad()
def prefill(
    model: Any,
    ids: torch.Tensor,
    segment_len: int = PREFILL_SEGMENT,
    *,
    attention_mask: torch.Tensor | None = None,
) -> tuple[Any, torch.Tensor]:
    """Reads `ids [B, T]` (left-padded where `attention_mask` is False) in segments of
    `segment_len` tokens -> (cache, logits of the last position `[B, vocab]`)."""
    from deltalab.models.cache import RecurrentCache

    if ids.shape[1] < 1:
        raise ValueError("ids must hold at least one token")
    device = next(model.parameters()).device
    cache = RecurrentCache(len(model.model.blocks))
    last = None
    for start, stop in segments(ids.shape[1], segment_len):
        mask = None if attention_mask is None else attention_mask[:, start:stop].to(device)
        out = model(
            input_ids=ids[:, start:stop].to(device),
            attention_mask=mask,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        last = out.logits[:, -1]
    return cache, last
