"""Kalman Delta Networks as token mixers (docs/MATH.md sec. 2, 3, 5).

Each value column of the memory is a Gaussian state observed through the key; the layer learns
the filter's noise model and the `deltalab.ops.kdn` gains turn it into the write direction of the
one primitive, `S_t = D_t S_{t-1} + gain_t (v_t - (D_t S_{t-1})^T k_t)^T`. Per token and head:

    g_t   = -exp(A_log) * softplus(f_proj(x_t) + dt_bias)        per channel, as KDA
    r_t   = r_min + softplus(w_r^T x_t + b_r)                      observation noise, per head
    eta_t = softplus(w_q^T x_t + b_q)                              process noise, per head (Iso)
          = softplus(up(down(x_t)) + b_q)                          per head-channel, `up` zero-
                                                                   initialized (Diagonal, Exact)
    1/p_0 = 0.1 + softplus(rho)                                    prior precision, per head

so r > 0, eta >= 0 and 0 < p_0 <= 10 hold for every parameter value (eta floored at 0, as the
reference; eta is `q_noise` in the gates, q the query).
With `process_noise="tied"` the process noise follows the decay instead, `eta_t = (1 - exp(2 g_t))
* p_inf` with a learned `p_inf = softplus(.) >= 0` per head: forgetting restores the variance
towards p_inf. The isotropic variant projects this by the trace, `eta_t = (1 - a_t) p_inf` with
`a_t = mean_i exp(2 g_t,i)`, the same contraction its variance scan uses.

Paper: "Kalman Delta Networks: uncertainty-aware associative memory" (no arXiv identifier known;
docs/MATH.md sec. 6). "The reference" is the implementation released with it.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple, Unpack

import torch
import torch.nn.functional as F
from torch import nn

from deltalab.layers.common import compute_dtype, no_weight_decay, require_positive_int
from deltalab.layers.decay import ChannelDecay
from deltalab.layers.delta_mixer import DeltaMixer
from deltalab.layers.frontend import FrontendKeywords, FrontendOptions, frontend_options
from deltalab.layers.recurrence import identity_at_padding, run_delta_rule, zero_at_padding
from deltalab.layers.shared_input import project
from deltalab.layers.states import RecurrentState
from deltalab.ops import _checks
from deltalab.ops._recompute import rebuilt_in_backward
from deltalab.ops.context_parallel import context_group, kdn_span_maps, kdn_start_prior
from deltalab.ops.kdn import kdn_gain_diag, kdn_gain_iso, scan_backend
from deltalab.ops.kdn.exact import exact_gain
from deltalab.ops.kdn.gains import write_dtype
from deltalab.ops.log_decay import layer_backend
from deltalab.ops.parametrize import DeltaRuleInputs

__all__ = [
    "KALMAN_GATES",
    "PROCESS_NOISE_MODES",
    "DiagonalKDN",
    "ExactKDN",
    "FreeProcessNoise",
    "IsotropicKDN",
    "KDNMixer",
    "KDNState",
    "KalmanMixer",
    "ScanFilter",
    "TiedProcessNoise",
    "observation_noise",
]

PROCESS_NOISE_MODES = ("free", "tied")
# The noise model `KDNMixer.kalman_gates` returns, in its order: the gates of a KDN layer.
KALMAN_GATES = ("g", "q_noise", "r")
# Floors of docs/MATH.md sec. 3.5 (the reference implementation's): r >= 0.01, 1/p_0 >= 0.1.
R_MIN = 0.01
PRECISION_FLOOR = 0.1
# Choice: with p_0 = 1 and r = 1 at initialization, a unit key's first write strength is
# p_0 / (p_0 + r) = 0.5, KDA's sigmoid(0).
PRIOR_PRECISION_INIT = 1.0
R_INIT = 1.0
# Choice: stationary variance sqrt(q r) ~ 0.3 for slow decays, so writes stay well away from 0.
Q_INIT = 0.1
# Choice: the tied mode restores the variance towards the prior's at initialization.
P_INF_INIT = 1.0


def inverse_softplus(y: float) -> float:
    """softplus^-1(y) = log(exp(y) - 1) for y > 0, written stably for small y."""
    return y + math.log(-math.expm1(-y))


# The biases of the noise model's last maps: softplus starts at Q_INIT (the process noise), and at
# R_INIT - R_MIN, so that r = R_INIT at the default floor (any r_min > 0 works).
Q_BIAS_INIT = inverse_softplus(Q_INIT)
R_BIAS_INIT = inverse_softplus(R_INIT - R_MIN)


def _finite_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def observation_noise(raw: torch.Tensor, r_min: float) -> torch.Tensor:
    """r = r_min + softplus(raw) `[B, T, H]` > 0, in at least float32 (docs/MATH.md sec. 3.5)."""
    return r_min + F.softplus(raw.to(compute_dtype(raw)))


class FreeProcessNoise(nn.Module):
    """q = softplus(proj(x)): per head `hidden -> H` (Isotropic), or per head-channel through a
    low-rank `hidden -> rank -> H*K` whose second factor starts at zero (docs/MATH.md sec. 3.5), so
    every channel starts from q = softplus(bias) (Q_INIT at the default `bias`, Q_BIAS_INIT)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        channel: bool,
        rank: int,
        bias_init: float = Q_BIAS_INIT,
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.channel = num_heads, head_dim, channel
        if channel:
            rank = require_positive_int("noise_rank", rank)
            up = nn.Linear(rank, num_heads * head_dim)
            nn.init.zeros_(up.weight)
            self.proj: nn.Module = nn.Sequential(nn.Linear(hidden_size, rank, bias=False), up)
            bias = up.bias
        else:
            linear = nn.Linear(hidden_size, num_heads)
            self.proj, bias = linear, linear.bias
        nn.init.constant_(no_weight_decay(bias), bias_init)

    def forward(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """x `[B, T, D]`, g (unused) -> q `[B, T, H, K]` (channel) or `[B, T, H]`, >= 0."""
        raw = project(self.proj, x).to(compute_dtype(x))
        if self.channel:
            raw = raw.unflatten(-1, (self.num_heads, self.head_dim))
        return F.softplus(raw)


class TiedProcessNoise(nn.Module):
    """q = (1 - exp(2 g)) * p_inf, p_inf = softplus(.) per head: per head-channel (channel), or
    `(1 - mean_i exp(2 g_i)) * p_inf` per head, the isotropic projection of the same."""

    def __init__(self, num_heads: int, channel: bool) -> None:
        super().__init__()
        self.channel = channel
        p_inf = torch.full((num_heads,), inverse_softplus(P_INF_INIT))
        self.p_inf_raw = no_weight_decay(nn.Parameter(p_inf))

    def p_inf(self) -> torch.Tensor:
        """`[H]`, >= 0."""
        return F.softplus(self.p_inf_raw)

    def forward(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """x (unused), g `[B, T, H, K]` -> q `[B, T, H, K]` (channel) or `[B, T, H]`, >= 0."""
        # 1 - exp(2g) in [0, 1]: the share of the variance a decay of g removes.
        restore = -torch.expm1(2 * g)
        p_inf = self.p_inf().to(restore.dtype)
        if self.channel:
            return restore * p_inf.unsqueeze(-1)
        return restore.mean(dim=-1) * p_inf


@dataclass
class KDNState(RecurrentState):
    """`RecurrentState` plus the filter's uncertainty about the memory after the last token.

    uncertainty: precision 1/p `[B, H]` (IsotropicKDN), `[B, H, K]` (DiagonalKDN), or the
        covariance P `[B, H, K, K]` (ExactKDN); float32, or float64 for float64 inputs.
    gates (with `return_gates=True`): g `[B, T, H, K]`, r `[B, T, H]`, q_noise `[B, T, H]`
        (Isotropic) or `[B, T, H, K]`, the write strength beta `[B, T, H]` (Isotropic, gain =
        beta k) or the gain `[B, T, H, K]`, the posterior variance p_t `[B, T, H]` (Isotropic)
        or `[B, T, H, K]` (Diagonal; Exact: the diagonal of P_t), and `predictive`
        `[B, T, H]`, the predicted variance of the observation before the update,
        `k_t^T P_bar_t k_t` with `P_bar_t = D_t P_{t-1} D_t + Q_t` (r_t excluded): the gain is
        `P_bar_t k_t / (predictive + r_t)`.
    """

    uncertainty: torch.Tensor = field(kw_only=True)


class NoiseModel(NamedTuple):
    """The filter's inputs among the gates (`KALMAN_GATES`): g `[B, T, H, K]` <= 0, q_noise
    `[B, T, H(, K)]` >= 0, r `[B, T, H]` >= r_min."""

    g: torch.Tensor
    q_noise: torch.Tensor
    r: torch.Tensor

    @classmethod
    def of(cls, gates: Mapping[str, torch.Tensor]) -> NoiseModel:
        return cls(*(gates[name] for name in KALMAN_GATES))


class Filtered(NamedTuple):
    """A filter's result: the delta rule's a (a write direction `[B, T, H, K]`, Diagonal, or
    strength `[B, T, H]`, Isotropic), the uncertainty after the last token, the gain gates (with
    p and predictive when traced), and the k and g the delta rule takes: routed through the
    gain's autograd node where its backward adds the delta rule's gradients of them to its own
    (`deltalab.ops.kdn.gains.routed_inputs`), else the filter's k and g."""

    write: torch.Tensor
    uncertainty: torch.Tensor
    gates: dict[str, torch.Tensor]
    k: torch.Tensor
    g: torch.Tensor


class KalmanMixer(DeltaMixer):
    """Base of every layer whose write direction is a Kalman gain (the KDN variants, KDN-Muir):
    the prior p_0, the state with uncertainty, and the path gates -> noise model -> gains ->
    primitive (docs/MATH.md sec. 2, 3).

    A subclass computes `gates(x)`, which hold at least the noise model `KALMAN_GATES` (g
    `[B, T, H, K]`, q_noise, r `[B, T, H]` >= r_min), defines `filter` (the gains from the noise
    model), calls `_init_prior()` in its constructor and sets `r_min` (and `info_scale` when the
    filter scales the evidence). `read_query` may reweight the query by its other gates. Shapes:
    x `[B, T, D]`, q/k `[B, T, H, K]`, v/o `[B, T, H, V]`, memory `[B, H, K, V]`.
    """

    default_gate_activation = "sigmoid"
    # Process noise per head-channel (Diagonal, Exact), else per head (Isotropic).
    channel_noise: ClassVar[bool] = True
    # Whether the filter scales the evidence (the scans) or is exact.
    has_info_scale: ClassVar[bool] = True
    r_min: float
    info_scale: float

    def _init_prior(self) -> None:
        """The prior precision's parameter, 1/p_0 = 0.1 + softplus(rho) per head."""
        precision = inverse_softplus(PRIOR_PRECISION_INIT - PRECISION_FLOOR)
        self.prior_precision_raw = no_weight_decay(
            nn.Parameter(torch.full((self.num_heads,), precision))
        )

    def prior_variance(self) -> torch.Tensor:
        """p_0 `[H]`, in (0, 10]: 1 / (0.1 + softplus(rho))."""
        return 1.0 / (PRECISION_FLOOR + F.softplus(self.prior_precision_raw))

    @abc.abstractmethod
    def filter(
        self, k: torch.Tensor, noise: NoiseModel, uncertainty: torch.Tensor | None, trace: bool
    ) -> Filtered:
        """Gains over the tokens: k `[B, T, H, K]`, the noise model of `gates`, the incoming
        uncertainty (None: the prior) -> `Filtered`."""

    def read_query(self, q: torch.Tensor, gates: dict[str, torch.Tensor]) -> torch.Tensor:
        """The query the primitive reads with: q itself (KDN-Muir: rho * q)."""
        return q

    def inputs_from_gates(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: dict[str, torch.Tensor]
    ) -> DeltaRuleInputs:
        """The primitive's `(q, gain, k, v, g)` of a sequence that starts with these tokens
        (prior p_0), from the noise model of `gates`."""
        filtered = self.filter(k, NoiseModel.of(gates), None, False)
        return DeltaRuleInputs(self.read_query(q, gates), filtered.write, filtered.k, v, filtered.g)

    def _filtered(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        uncertainty: torch.Tensor | None,
        trace: bool,
        mask: torch.Tensor | None = None,
    ) -> tuple[DeltaRuleInputs, torch.Tensor, dict[str, torch.Tensor]]:
        gates = dict(self.hooked_gates(x))
        if mask is not None:
            # Padding tokens carry k = 0 (no evidence); with no decay and no process noise
            # either, the uncertainty passes them unchanged.
            for name in ("g", "q_noise"):
                gates[name] = zero_at_padding(gates[name], mask)
        # The gain's backward keeps g as the delta rule's does: both rebuild it instead
        # (`rebuildable`), or one keeping it would make the other's rebuild a cost, not a saving.
        with rebuilt_in_backward():
            filtered = self.filter(k, NoiseModel.of(gates), uncertainty, trace)
        inputs = DeltaRuleInputs(
            self.read_query(q, gates), filtered.write, filtered.k, v, filtered.g
        )
        return inputs, filtered.uncertainty, gates | filtered.gates

    def primitive_inputs(
        self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[DeltaRuleInputs, dict[str, torch.Tensor]]:
        """The primitive's `(q, gain, k, v, g)` and all gates (with the uncertainty trace) for
        a sequence that starts with these tokens (zero memory, prior p_0)."""
        inputs, _, gates = self._filtered(x, q, k, v, None, trace=True)
        return inputs, self.reported_gates(gates)

    def recurrence(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        state: RecurrentState | None,
        conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        return_gates: bool,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, KDNState]:
        """As `DeltaMixer.recurrence`, the filter continuing from the state's uncertainty."""
        if state is not None and not isinstance(state, KDNState):
            raise TypeError(f"state must be a KDNState or None, got {type(state).__name__}")
        uncertainty = None if state is None else state.uncertainty
        inputs, uncertainty, gates = self._filtered(x, q, k, v, uncertainty, return_gates, mask)
        if mask is not None:
            inputs = identity_at_padding(inputs, mask)
        memory, in_place = (None, False) if state is None else (state.memory, state.in_place)
        o, memory = run_delta_rule(
            inputs, memory, chunk_size=self.chunk_size, backend=self.backend, in_place=in_place,
            options=self.kernel_options,
        )  # fmt: skip
        new_state = KDNState(
            memory,
            *conv,
            self.reported_gates(gates) if return_gates else None,
            uncertainty=uncertainty,
        )
        return o, new_state


class KDNMixer(KalmanMixer):
    """Shared by the KDN variants: the noise model from its own projections (sec. 3.5), the
    prior, the state with uncertainty (`KalmanMixer`).

    Subclasses define `filter`, the gains from the noise model. Shapes: x `[B, T, D]`, q/k
    `[B, T, H, K]`, v/o `[B, T, H, V]`, memory `[B, H, K, V]`.

    Args: options or the frontend keywords (`FrontendOptions`; output gate sigmoid by default);
    decay_rank: rank of the decay projection (default head_dim); gate_rank: rank of the output
    gate (default value_dim), both as KDA; noise_rank: rank of the per-channel process-noise
    projection (default head_dim; not for `IsotropicKDN`, whose noise is per head);
    process_noise: "free" or "tied"; info_scale: evidence scale s > 0 (default K, as the
    reference; not for `ExactKDN`, which is exact, s = 1); r_min: floor of the observation
    noise (> 0); r_bias, q_bias: initial biases of the observation- and (free) process-noise
    projections, before their softplus (None: R_BIAS_INIT and Q_BIAS_INIT, r = 1 and q = 0.1
    for a zero input; the reference's are 0, r = r_min + ln 2 and q = ln 2: the
    `kdn-authors-1.3B` preset, docs/MATH.md sec. 3.6).
    """

    @classmethod
    def refused_options(cls) -> frozenset[str]:
        """Keyword arguments of the shared constructor that this variant refuses."""
        refused = set()
        if not cls.channel_noise:
            refused.add("noise_rank")
        if not cls.has_info_scale:
            refused.add("info_scale")
        return frozenset(refused)

    def __init__(
        self,
        options: FrontendOptions | None = None,
        *,
        decay_rank: int | None = None,
        gate_rank: int | None = None,
        noise_rank: int | None = None,
        process_noise: str = "free",
        info_scale: float | None = None,
        r_min: float = R_MIN,
        r_bias: float | None = None,
        q_bias: float | None = None,
        **frontend: Unpack[FrontendKeywords],
    ) -> None:
        options = frontend_options(options, frontend, type(self))
        name = type(self).__name__
        if q_bias is not None and process_noise == "tied":
            raise TypeError(f"{name} got q_bias, but process_noise='tied' has no projection")
        # Refused by name rather than ignored: the option has no meaning for this variant.
        if noise_rank is not None and not self.channel_noise:
            raise TypeError(f"{name} got noise_rank, but its process noise is per head (no rank)")
        if info_scale is not None and not self.has_info_scale:
            raise TypeError(f"{name} got info_scale, but it is exact (no information scale)")
        super().__init__(options, gate_rank=options.value_dim if gate_rank is None else gate_rank)
        hidden_size, num_heads, head_dim = self.hidden_size, self.num_heads, self.head_dim
        _checks.require_choice("process_noise", process_noise, PROCESS_NOISE_MODES)
        # Checked in every mode, so a bad value never goes unnoticed until a mode switch.
        noise_rank = require_positive_int(
            "noise_rank", head_dim if noise_rank is None else noise_rank
        )
        self.r_min = _checks.require_positive_number("r_min", r_min)
        rank = head_dim if decay_rank is None else decay_rank
        self.decay = ChannelDecay(hidden_size, num_heads, head_dim, rank)
        self.r_proj = nn.Linear(hidden_size, num_heads)
        r_bias = R_BIAS_INIT if r_bias is None else _finite_number("r_bias", r_bias)
        nn.init.constant_(no_weight_decay(self.r_proj.bias), r_bias)
        self._init_prior()
        self.process: FreeProcessNoise | TiedProcessNoise
        if process_noise == "tied":
            self.process = TiedProcessNoise(num_heads, self.channel_noise)
        else:
            q_bias = Q_BIAS_INIT if q_bias is None else _finite_number("q_bias", q_bias)
            self.process = FreeProcessNoise(
                hidden_size, num_heads, head_dim, self.channel_noise, noise_rank, q_bias
            )
        if self.has_info_scale:
            scale = float(head_dim) if info_scale is None else info_scale
            self.info_scale = _checks.require_positive_number("info_scale", scale)

    def gate_projections(self) -> tuple[nn.Module, ...]:
        free = isinstance(self.process, FreeProcessNoise)
        return (self.decay.f_proj, self.r_proj, *((self.process.proj,) if free else ()))

    def kalman_gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x `[B, T, D]` -> (g `[B, T, H, K]` <= 0, q_noise `[B, T, H(, K)]` >= 0, r `[B, T, H]`
        >= r_min), in at least float32."""
        # The decay follows the delta rule's backend, as the norms (Triton or the torch path).
        g = self.decay(x, backend=layer_backend(self.backend))
        r = observation_noise(project(self.r_proj, x), self.r_min)
        return g, self.process(x, g), r

    def gates(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The noise model by name, g, q_noise and r (`kalman_gates`): the gates a hook may
        move; the gains the filter derives from them (beta, gain, p, predictive) follow."""
        return dict(zip(KALMAN_GATES, self.kalman_gates(x), strict=True))


class ScanFilter(KalmanMixer):
    """The gains by an uncertainty scan of `deltalab.ops.kdn`, which also returns the trace
    (p, predictive): Isotropic and Diagonal KDN, KDN-Muir (diagonal)."""

    # The op's gain: beta `[B, T, H]` (write = beta k) when False, the gain itself when True.
    diagonal_gain: ClassVar[bool]

    def filter(
        self, k: torch.Tensor, noise: NoiseModel, uncertainty: torch.Tensor | None, trace: bool
    ) -> Filtered:
        g, q_noise, r = noise
        # The prior p_0 `[H]`: kdn_gain_diag takes it per head for every channel too.
        prior = self.prior_variance()
        # The scan that goes with the memory's backend, as the kdn_iso/kdn_diag ops pair them.
        backend = scan_backend(self.backend, k.device)
        # Diagonal's write in k's dtype on the Triton route, as the kdn_diag op passes it.
        dtype = _checks.state_dtype(k, g, q_noise, r, prior, uncertainty)
        group = context_group()
        if group is not None and uncertainty is None:
            # This rank's piece of a sequence split over the group: the variance at its start,
            # per sequence, from the earlier ranks' composed variance maps.
            spans = kdn_span_maps(k, g, q_noise, r, self.info_scale, self.diagonal_gain, dtype)
            per_lane = prior.unsqueeze(-1) if self.diagonal_gain else prior
            prior = kdn_start_prior(per_lane, spans, group)
        written = write_dtype(backend, k, dtype)
        scan = kdn_gain_diag if self.diagonal_gain else kdn_gain_iso
        options = {"gain_dtype": written} if self.diagonal_gain else {}
        gain, p, precision, predictive, k_rule, g_rule = scan(
            k,
            g,
            q_noise,
            r,
            prior,
            info_scale=self.info_scale,
            initial_precision=uncertainty,
            output_predictive=True,
            backend=backend,
            route_inputs=True,
            **options,
        )
        gains = {"gain" if self.diagonal_gain else "beta": gain}
        if trace:
            gains |= {"p": p, "predictive": predictive}
        # Diagonal: the write direction; Isotropic: the write's strength per token, beta
        # [B, T, H], which the delta rule multiplies with k itself.
        return Filtered(gain, precision, gains, k_rule, g_rule)


class IsotropicKDN(ScanFilter, KDNMixer):
    """Isotropic KDN: `P = p I` per head, KDA whose beta comes from a variance scan.

    Gates: g `[B, T, H, K]`; r, q_noise, beta, p, predictive `[B, T, H]` (see `KDNState`).
    State uncertainty: precision `[B, H]`. Arguments as `KDNMixer`, without noise_rank.
    """

    channel_noise = False
    diagonal_gain = False


class DiagonalKDN(ScanFilter, KDNMixer):
    """Diagonal KDN: `P = diag(p)` per head, a variance scan per key channel.

    Gates: g, q_noise, gain, p `[B, T, H, K]`; r, predictive `[B, T, H]` (see `KDNState`).
    State uncertainty: precision `[B, H, K]`. Arguments as `KDNMixer`.
    """

    diagonal_gain = True


class ExactKDN(KDNMixer):
    """Exact KDN: the Kalman filter with a dense `P [K, K]` per head (a token loop, O(K^3)).

    Gates: g, q_noise, gain, p (the diagonal of P_t) `[B, T, H, K]`; r, predictive `[B, T, H]`
    (see `KDNState`). State uncertainty: covariance `[B, H, K, K]`. The prior is `p_0 I`.
    Exact KDN has no information scale (it is exact, s = 1).

    Arguments as `KDNMixer`, without info_scale.
    """

    has_info_scale = False

    def filter(
        self, k: torch.Tensor, noise: NoiseModel, uncertainty: torch.Tensor | None, trace: bool
    ) -> Filtered:
        if context_group() is not None:
            raise ValueError(
                "ExactKDN does not run under context parallelism (train.context_parallel > 1): "
                "its covariance map over a span is not formed"
            )
        g, q_noise, r = noise
        batch, _, heads, key_dim = k.shape
        dtype = _checks.state_dtype(k, g, q_noise, r, uncertainty)
        given = (k, g)
        k, g, q_noise, r = (t.to(dtype) for t in (k, g, q_noise, r))
        if uncertainty is None:
            eye = torch.eye(key_dim, dtype=dtype, device=k.device)
            P = (self.prior_variance().to(dtype)[:, None, None] * eye).expand(batch, -1, -1, -1)
        else:
            shape = (batch, heads, key_dim, key_dim)
            _checks.require_shape("state.uncertainty", uncertainty, shape, "[B, H, K, K]")
            P = uncertainty.to(dtype)
        gain, P, traced = exact_gain(k, g, q_noise, r, P, trace=trace)
        named = {"gain": gain}
        if traced is not None:
            named |= {"p": traced.p, "predictive": traced.predictive}
        return Filtered(gain, P, named, *given)
