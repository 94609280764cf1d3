"""Log-decay parametrizations shared by the gated mixers (GDN scalar, KDA per channel).

    g = -exp(A_log) * softplus(proj(x) + dt_bias)  <= 0

`A_log` is per head, `dt_bias` per head (scalar decay) or per head-channel (channel decay).
The formula runs in `deltalab.ops.log_decay` (the torch path, or one Triton kernel each way); the
modules take the backend at call time, their mixer's (`layer_backend(mixer.backend)`).
Initialization follows Mamba2 / fla's Gated DeltaNet: `A ~ U(1, 16)`, and
`dt ~ exp(U(log 1e-3, log 1e-1))` floored at 1e-4 with `dt_bias = softplus^-1(dt)`, so that
`softplus(dt_bias)` is the sampled step size when the projection is zero.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from deltalab.layers.common import no_weight_decay, require_positive_int
from deltalab.layers.shared_input import project
from deltalab.ops import log_decay as _op

__all__ = ["ChannelDecay", "ScalarDecay", "init_A_log", "init_dt_bias", "log_decay"]

# Mamba2 / Gated DeltaNet defaults.
A_INIT_RANGE = (1.0, 16.0)
DT_MIN, DT_MAX, DT_FLOOR = 1e-3, 1e-1, 1e-4


def init_A_log(num_heads: int) -> nn.Parameter:
    """log(A), A ~ U(1, 16) per head: `[H]`, excluded from weight decay."""
    a = torch.empty(num_heads).uniform_(*A_INIT_RANGE)
    return no_weight_decay(nn.Parameter(a.log()))


def init_dt_bias(*shape: int) -> nn.Parameter:
    """Inverse softplus of log-uniform step sizes in [1e-3, 1e-1]: `shape`, no weight decay."""
    log_dt = torch.rand(*shape) * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN)
    dt = log_dt.exp().clamp(min=DT_FLOOR)
    # softplus^-1(dt) = log(exp(dt) - 1) = dt + log(1 - exp(-dt)), stable for small dt.
    return no_weight_decay(nn.Parameter(dt + torch.log(-torch.expm1(-dt))))


def log_decay(
    A_log: torch.Tensor, raw: torch.Tensor, dt_bias: torch.Tensor, *, backend: str = "auto"
) -> torch.Tensor:
    """g = -exp(A_log) * softplus(raw + dt_bias) <= 0, in at least float32; A_log broadcast
    against raw (`[H]` for raw `[B, T, H]`, `[H, 1]` for `[B, T, H, K]`). Keeps only raw (in
    its own dtype) and the parameters for backward, not the float32 intermediates.

    backend: `deltalab.ops.log_decay`'s ("auto": the Triton kernels on CUDA, else the torch
    path, the formula under `recomputed`); a mixer passes its delta rule's (`layer_backend`)."""
    return _op.log_decay(A_log, raw, dt_bias, backend=backend)


class ScalarDecay(nn.Module):
    """Gated DeltaNet: one log decay per head and token, `x [B, T, D] -> g [B, T, H]`."""

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        require_positive_int("hidden_size", hidden_size)
        require_positive_int("num_heads", num_heads)
        self.a_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.A_log = init_A_log(num_heads)
        self.dt_bias = init_dt_bias(num_heads)

    def forward(self, x: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
        """backend: `log_decay`'s; a mixer passes its delta rule's (`layer_backend`)."""
        return log_decay(self.A_log, project(self.a_proj, x), self.dt_bias, backend=backend)


class ChannelDecay(nn.Module):
    """KDA: one log decay per key channel, `x [B, T, D] -> g [B, T, H, K]`.

    The projection is low rank, `hidden -> rank -> H*K` (fla KDA's `f_proj`, rank = head_dim).
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, rank: int) -> None:
        super().__init__()
        require_positive_int("hidden_size", hidden_size)
        self.num_heads = require_positive_int("num_heads", num_heads)
        self.head_dim = require_positive_int("head_dim", head_dim)
        rank = require_positive_int("decay_rank", rank)
        self.f_proj = nn.Sequential(
            nn.Linear(hidden_size, rank, bias=False),
            nn.Linear(rank, num_heads * head_dim, bias=False),
        )
        self.A_log = init_A_log(num_heads)
        self.dt_bias = init_dt_bias(num_heads, head_dim)

    def forward(self, x: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
        """backend: `log_decay`'s; a mixer passes its delta rule's (`layer_backend`)."""
        raw = project(self.f_proj, x).unflatten(-1, (self.num_heads, self.head_dim))
        return log_decay(self.A_log.unsqueeze(-1), raw, self.dt_bias, backend=backend)
