"""`recomputed`: activation checkpointing of one small elementwise piece (the layers' and the
ops' torch paths share it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint


def recomputed(fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """fn(*args), keeping only args for backward: fn's intermediates are computed again when
    the backward needs them (non-reentrant activation checkpointing of one small piece). The
    autograd graph is the same, so gradients are the same bit for bit; what it costs is fn's
    forward once more in the backward, for elementwise pieces whose float32 intermediates would
    otherwise be kept per token (benchmarks/memory_audit.py). Without gradients, plain fn."""
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in args
    )
    if not needs_grad:
        return fn(*args)
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
