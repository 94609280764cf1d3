"""Packed variable-length sequences (`cu_seqlens`) <-> a zero-padded batch.

Zero padding is exact for the delta rule: a padded token has `a = b = u = q = 0` and `g = 0`, so it
neither decays, erases nor writes, and the state after the padding is the state after the last
real token.
"""

from __future__ import annotations

import itertools

import torch


def pad_packed(x: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """`[1, T, *rest]` packed along T -> `[N, T_max, *rest]`, zeros after each sequence's end."""
    lengths = [end - start for start, end in itertools.pairwise(offsets)]
    t_max = max(lengths)
    pieces = [x[0, start:end] for start, end in itertools.pairwise(offsets)]
    padded = [
        torch.nn.functional.pad(p, (0, 0) * (p.dim() - 1) + (0, t_max - p.shape[0])) for p in pieces
    ]
    return torch.stack(padded, dim=0)


def unpad_packed(x: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """`[N, T_max, *rest]` -> `[1, T, *rest]`, dropping each sequence's padding."""
    lengths = [end - start for start, end in itertools.pairwise(offsets)]
    return torch.cat([x[i, :n] for i, n in enumerate(lengths)], dim=0).unsqueeze(0)
