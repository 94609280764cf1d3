"""The checks every token mixer makes of its arguments: the input x, a state's batch, the
padding mask; and the mark of parameters kept out of weight decay.

Protocol of every mixer: `forward(x [B, T, D], state=None, *, return_gates=False) -> (y [B, T, D],
state)`. Passing the returned state back in with the next tokens (any number of them) continues
the sequence exactly as one forward over the whole sequence would. With `return_gates=True` the
returned state also carries the mixer's intermediate gates in `state.gates` (name -> tensor).
The states are in `deltalab.layers.states`; the delta-rule mixers' shared frontend is
`deltalab.layers.delta_mixer.DeltaMixer`.
"""

from __future__ import annotations

import torch
from torch import nn

from deltalab.ops._checks import require_positive_int, require_rank, require_shape
from deltalab.ops.norms.reference import compute_dtype

__all__ = [
    "check_hidden",
    "check_mask",
    "check_state_batch",
    "compute_dtype",
    "no_weight_decay",
    "require_positive_int",
]


def check_hidden(x: object, hidden_size: int) -> torch.Tensor:
    """Checks a mixer input `x [B, T, D]` with D = hidden_size and T >= 1."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a floating-point torch.Tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        # The usual mistake: token ids given to a mixer; say where they should go.
        raise TypeError(
            f"x must be floating-point hidden states [B, T, D], got a tensor of dtype {x.dtype}; "
            "token ids go through the model's embedding first (CausalLM, or an nn.Embedding)"
        )
    require_rank("x", x, (3,), "[B, T, D]")
    require_shape("x", x, (*x.shape[:2], hidden_size), "[B, T, D]", "(D = hidden_size)")
    if x.shape[1] == 0:
        raise ValueError("x must hold at least one token (T >= 1), got T = 0")
    return x


def check_state_batch(name: str, cached: torch.Tensor, x: torch.Tensor, layout: str) -> None:
    """A cached tensor of a state (`layout` starts with B) must belong to x's batch `[B, T, D]`.

    Without this the mismatch surfaces deep inside a concatenation or the recurrence, naming
    neither the state nor the batch.
    """
    if cached.shape[0] != x.shape[0]:
        raise ValueError(
            f"{name} must be for x's batch of B = {x.shape[0]}, got one for {cached.shape[0]} "
            f"({layout} = {tuple(cached.shape)}); a state continues the batch it was returned for"
        )


def check_mask(mask: object, x: torch.Tensor) -> torch.Tensor | None:
    """A left-padding mask `[B, T]` for `x [B, T, D]` as bool (True at real tokens), or None.

    Only left padding is taken (padding before a row's first real token, as decoder-only
    generation pads): there a padding token is exactly a token that never happened. Padding
    after real tokens would still have to leave the short-convolution caches and the KDN
    uncertainty as they were, which the mixers do not attempt, so it is refused.
    """
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
    require_shape("mask", mask, x.shape[:2], "[B, T]", "to match x")
    mask = mask.bool()
    if mask.shape[1] > 1 and bool((mask[:, :-1] & ~mask[:, 1:]).any()):
        raise ValueError(
            "mask must be left padding (False only before each row's first True); got a False "
            "after a True"
        )
    return mask


def no_weight_decay(param: nn.Parameter) -> nn.Parameter:
    """Marks a parameter (decay rates, biases of gates) for the optimizer's no-decay group."""
    param._no_weight_decay = True  # type: ignore[attr-defined]
    return param
