"""Packed variable-length sequences (`cu_seqlens`) <-> a zero-padded batch.

Zero padding is exact for the delta rule: a padded token has `a = b = u = q = 0` and `g = 0`, so it
neither decays, erases nor writes, and the state after the padding is the state after the last
real token.

`cu_seqlens` stays a tensor on the inputs' device (int64, as `check_cu_seqlens` returns it): the
moves are one gather or scatter each, with index tensors built on the device. The only value read
back to the host is the padded length (`max_seqlen`), once per call of a backend.
"""

from __future__ import annotations

import torch

from deltalab.ops import _checks


def max_seqlen(cu_seqlens: torch.Tensor, length: int) -> int:
    """The padded length: the longest sequence of the `length` packed tokens.

    Reads one number back to the host (a device sync). During a CUDA graph capture, where that
    is forbidden, it returns the longest any sequence can be, `T - N + 1` (every other sequence
    holds at least one token): more padding, the same result, and valid for any offsets a replay
    of the graph brings.
    """
    sequences = cu_seqlens.numel() - 1
    if _checks.capturing(cu_seqlens):
        return length - sequences + 1
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max())  # the one device -> host sync


def _places(cu_seqlens: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each packed token `[T]`: its sequence, and its position within that sequence."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    sequence = torch.arange(lengths.numel(), device=cu_seqlens.device)
    # output_size = T: the total is known, so repeat_interleave reads nothing back.
    sequence = sequence.repeat_interleave(lengths, output_size=length)
    position = torch.arange(length, device=cu_seqlens.device) - cu_seqlens[sequence]
    return sequence, position


def pad_packed(x: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int) -> torch.Tensor:
    """`[1, T, *rest]` packed along T -> `[N, max_len, *rest]`, zeros after each sequence's end.

    `max_len` is at least the longest sequence (`max_seqlen`); longer only adds zeros.
    """
    length = x.shape[1]
    sequence, position = _places(cu_seqlens, length)
    padded = x.new_zeros(cu_seqlens.numel() - 1, max_len, *x.shape[2:])
    return padded.index_put((sequence, position), x[0])


def unpad_packed(x: torch.Tensor, cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """`[N, T_max, *rest]` -> `[1, length, *rest]`, dropping each sequence's padding."""
    sequence, position = _places(cu_seqlens, length)
    return x[sequence, position].unsqueeze(0)
