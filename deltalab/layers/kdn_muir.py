"""KDN-Muir (docs/MATH.md sec. 4.7): Diagonal KDN's Kalman gain under Muir's fused gates.

Muir's one fused, sensitivity-allocated low-rank projection computes the Diagonal KDN noise model
and Muir's read gate; the write direction is the Kalman gain of the per-channel variance scan,
as in `DiagonalKDN`. Per token and head:

    z_t   = W_down x_t                     one projection of rank R = r_decay + r_process
                                           + r_observation (+ r_read), sliced per gate
    g_t   = -exp(A_log) * softplus(U_decay z_decay + dt_bias)           [H, K]  (KDA decay)
    eta_t = softplus(U_process z_process + c_process)                   [H, K]  process noise
    r_t   = r_min + softplus(U_observation z_observation + c_obs)       [H]     observation noise
    rho_t = exp(read_log) * 2 sigmoid(U_read z_read + c_read)  ("dynamic")   [H, K] read gate
    gain_t from the diagonal variance scan (sec. 3.1) of (g, eta, r) and the key
    S_t   = (I - gain_t k_t^T) diag(exp(g_t)) S_{t-1} + gain_t v_t^T,   o_t = S_t^T (rho_t * q_t)

The primitive's inputs are Diagonal KDN's, `(rho * q, gain, k, v, g)`: Muir's erase and write
gates are gone, their job done by the gain. The output gate keeps its own projection of rank
`ranks.outgate`, as in Muir. Initialization: the noise model starts where `DiagonalKDN`'s does
(eta = 0.1 for every channel, r = 1, p_0 = 1), the read gate at the matched filter of the
writes the gain makes from the initial decays (docs/MATH.md sec. 4.8): Muir's matched filter
(1 - exp(2 g0)) divided by the stationary predicted variance p_bar of each channel. (eta is
the process noise, `q_noise` in the gates; q is the query.)

No paper has this mixer: it is deltalab's own (docs/MATH.md sec. 4.7).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Unpack

import torch
import torch.nn.functional as F
from torch import nn

from deltalab.layers.common import compute_dtype
from deltalab.layers.frontend import FrontendKeywords, FrontendOptions, frontend_options
from deltalab.layers.kdn import (
    Q_BIAS_INIT,
    R_BIAS_INIT,
    R_MIN,
    ScanFilter,
    observation_noise,
)
from deltalab.layers.muir import (
    READ_GATES,
    FusedGateMixer,
    GateRanks,
    initial_log_decay,
    matched_filter,
    read_weights,
)
from deltalab.ops import _checks

__all__ = [
    "KDN_MUIR_RANK_DIVISORS",
    "READ_INITS",
    "KDNMuir",
    "KDNMuirRanks",
    "kalman_matched_filter",
    "stationary_predicted_variance",
]

# Default rank of each gate as head_dim // divisor (at least 1, at most the gate's width: the
# observation noise has one number per head, so its rank is the number of heads).
# docs/MATH.md sec. 4.7 gives the measurement behind them (gate sensitivity of a trained tiny
# Diagonal KDN).
KDN_MUIR_RANK_DIVISORS = {"decay": 1, "process": 4, "observation": 1, "read": 4, "outgate": 1}
# Where the static read vector starts (docs/MATH.md sec. 4.8): "kalman", the matched filter of
# the gain-weighted writes the filter makes at initialization; "unit", Muir's matched filter,
# which assumes writes of unit variance in every channel (sec. 4.5).
READ_INITS = ("kalman", "unit")


def stationary_predicted_variance(
    decay: torch.Tensor, process: torch.Tensor, evidence: torch.Tensor
) -> torch.Tensor:
    """The fixed point p_bar of the diagonal variance scan (docs/MATH.md sec. 3.1, 4.8) under a
    constant squared decay `decay` = exp(2 g) in [0, 1], process noise `process` > 0 and
    evidence per token `evidence` = s k_i^2 / r > 0 (broadcast together): the positive root of
    c p_bar^2 + (1 - a - eta c) p_bar - eta = 0 (a: `decay`, eta: `process`, c: `evidence`),
    written without cancellation."""
    b = 1.0 - decay - process * evidence
    return 2.0 * process / (b + torch.sqrt(b * b + 4.0 * evidence * process))


def kalman_matched_filter(
    A_log: torch.Tensor, dt_bias: torch.Tensor, process: torch.Tensor, evidence: torch.Tensor
) -> torch.Tensor:
    """The read weights `[H, K]` matched to the state Diagonal KDN's gain writes at the
    initial decays g0 (docs/MATH.md sec. 4.8): (1 - exp(2 g0)) / p_bar, with p_bar the
    stationary predicted variance under process noise `process` `[H, K]` and evidence per token
    `evidence` `[H, 1]` (s E[k_i^2] / r = s / (K r) for unit keys); mean 1 per head."""
    g0 = initial_log_decay(A_log, dt_bias)
    p_bar = stationary_predicted_variance(torch.exp(2.0 * g0), process, evidence)
    return read_weights(-torch.expm1(2.0 * g0) / p_bar)


@dataclass(frozen=True)
class KDNMuirRanks(GateRanks):
    """Rank of each gate's projection of `KDNMuir`; None means a full-rank, unfused
    `nn.Linear(D, width)` (with a bias, except for the decay, whose bias is dt_bias).

    decay, process (q, `H*K` wide), observation (r, `H` wide), read: slices of the fused
    down-projection (read only with `read_gate="dynamic"`); outgate: the frontend's output-gate
    projection, as in `MuirRanks`. `KDNMuirRanks.default(head_dim, hidden_size, widths=
    {"observation": num_heads})`: head_dim // KDN_MUIR_RANK_DIVISORS[gate], at least 1, at most
    hidden_size and the width.
    """

    divisors: ClassVar[Mapping[str, int]] = KDN_MUIR_RANK_DIVISORS

    decay: int | None
    process: int | None
    observation: int | None
    read: int | None
    outgate: int | None


class KDNMuir(ScanFilter, FusedGateMixer):
    """KDN-Muir: the Diagonal KDN filter whose noise model and read gate come from Muir's fused
    low-rank gate projection.

    Gates: g, q_noise, read (rho > 0; a broadcast view for "static" and "none") `[B, T, H, K]`;
    r `[B, T, H]`; with `return_gates=True` also the filter's gain, p `[B, T, H, K]` and
    predictive `[B, T, H]` (see `KDNState`). State: `KDNState`, uncertainty = precision
    `[B, H, K]`, as `DiagonalKDN`.

    Args: options or the frontend keywords (`FrontendOptions`; output gate sigmoid by default);
    ranks: `KDNMuirRanks` (or the same as a mapping), default `KDNMuirRanks.default`;
    read_gate: "dynamic", "static" or "none", as Muir's; read_init: where the static read
    vector starts, "kalman" (default: the matched filter of the Kalman gain's writes,
    `kalman_matched_filter`) or "unit" (Muir's `matched_filter`, which assumes unit-variance
    writes; docs/MATH.md sec. 4.8); info_scale: evidence scale s > 0 (default K, as the KDN
    reference); r_min: floor of the observation noise (> 0).
    """

    diagonal_gain = True
    ranks: KDNMuirRanks

    def __init__(
        self,
        options: FrontendOptions | None = None,
        *,
        ranks: KDNMuirRanks | Mapping[str, int | None] | None = None,
        read_gate: str = "dynamic",
        read_init: str = "kalman",
        info_scale: float | None = None,
        r_min: float = R_MIN,
        **frontend: Unpack[FrontendKeywords],
    ) -> None:
        options = frontend_options(options, frontend, type(self))
        head_dim, heads = options.head_dim, options.num_heads
        ranks = KDNMuirRanks.resolve(
            ranks,
            lambda: KDNMuirRanks.default(
                head_dim, options.hidden_size, widths={"observation": heads}
            ),
        )
        read_gate = _checks.require_choice("read_gate", read_gate, READ_GATES)
        self.read_init = _checks.require_choice("read_init", read_init, READ_INITS)
        super().__init__(options, gate_rank=ranks.outgate)
        self.r_min = _checks.require_positive_number("r_min", r_min)
        scale = float(head_dim) if info_scale is None else info_scale
        self.info_scale = _checks.require_positive_number("info_scale", scale)
        own = {"process": heads * head_dim, "observation": heads}
        self._init_fused_gates(ranks, read_gate, own, biased=frozenset(own))
        # Where DiagonalKDN's noise model starts: eta = Q_INIT on every channel (a zero last map,
        # as its low-rank process noise), r = R_INIT.
        process = self.gate_proj.projection("process")
        nn.init.zeros_(process.weight)
        nn.init.constant_(process.bias, Q_BIAS_INIT)
        nn.init.constant_(self.gate_proj.projection("observation").bias, R_BIAS_INIT)
        self._init_prior()
        # The read gate's matched filter depends on the noise model just set.
        self.reset_read_gate()

    def initial_read_weights(self) -> torch.Tensor:
        """The static read vector `[H, K]` (float64) `reset_read_gate` sets: with `read_init=
        "kalman"` the matched filter of the gain's writes at the current decays and the noise
        model for a zero gate input (eta = softplus of the process bias, r = r_min + softplus of
        the observation bias, evidence s / (K r)); with "unit" Muir's matched filter."""
        A_log, dt_bias = self.A_log.double(), self.dt_bias.double()
        if self.read_init == "unit":
            return matched_filter(A_log, dt_bias)
        process_bias = self.gate_proj.projection("process").bias.double()
        observation_bias = self.gate_proj.projection("observation").bias.double()
        process = F.softplus(process_bias).view(self.num_heads, self.head_dim)
        r = self.r_min + F.softplus(observation_bias)
        evidence = (self.info_scale / (self.head_dim * r)).unsqueeze(-1)
        return kalman_matched_filter(A_log, dt_bias, process, evidence)

    def gates(self, x: torch.Tensor, *, fused_read: bool = False) -> dict[str, torch.Tensor]:
        """x `[B, T, D]` -> the noise model g, q_noise, r (at least float32) and the read gate
        (x's dtype), all from one pass of the fused projection; with `fused_read` the read
        gate's pre-activation in place of rho (`FusedGateMixer.read_gates`)."""
        raw = self.gate_proj(x)
        process = raw["process"].to(compute_dtype(x)).unflatten(-1, (self.num_heads, -1))
        gates = {
            "g": self.decay_from(raw),
            "q_noise": F.softplus(process),
            "r": observation_noise(raw["observation"], self.r_min),
        }
        return gates | self.read_gates(raw, x, fused_read)

    def read_query(self, q: torch.Tensor, gates: dict[str, torch.Tensor]) -> torch.Tensor:
        """Muir's matched-filter read: rho * q, in q's dtype (`FusedGateMixer.matched_read`)."""
        return self.matched_read(q, gates)
