"""Muir (docs/MATH.md sec. 4.4-4.6): GDN-2 with fused low-rank gates and a matched-filter read.

    z_t   = W_down x_t                    one projection of rank R = r_decay + r_erase + r_write
                                          (+ r_read), sliced per gate
    g_t   = -exp(A_log) * softplus(U_decay z_decay + dt_bias)          [H, K]  (KDA decay)
    e_t   = sigmoid(U_erase z_erase + c_erase)                         [H, K]  erase gate
    w_t   = sigmoid(U_write z_write + c_write)                         [H, V]  write gate
    rho_t = exp(r) * 2 sigmoid(U_read z_read + c_read)   ("dynamic")   [H, K]  read gate
            exp(r)                                       ("static")
            1                                            ("none")
    S_t   = (I - k_t (e_t * k_t)^T) diag(exp(g_t)) S_{t-1} + k_t (w_t * v_t)^T
    o_t   = S_t^T (rho_t * q_t)

`exp(r)` is the static read vector `[H, K]`, initialized to the matched filter of the initial
decays. A gate of rank None skips the fused projection and gets a full-rank `nn.Linear(D, width)`
without bias: with erase and write full rank and `read_gate="none"`, Muir is GDN-2
(`Muir.from_gdn2` copies a GDN-2 layer exactly).

Paper: "Muir: linear attention with sensitivity-allocated gating and matched-filter readout"
(no arXiv identifier known; docs/MATH.md sec. 6).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import ClassVar, Self, Unpack

import torch
import torch.nn.functional as F
from torch import nn

from deltalab.layers.common import compute_dtype, no_weight_decay, require_positive_int
from deltalab.layers.decay import init_A_log, init_dt_bias, log_decay
from deltalab.layers.delta_mixer import DeltaMixer
from deltalab.layers.frontend import FrontendKeywords, FrontendOptions, frontend_options
from deltalab.layers.gdn2 import (
    GatedDeltaNet2,
    erase_write_gates,
    gates_from_logits,
    gates_take,
    gdn2_inputs_of,
    products_fuse,
)
from deltalab.layers.shared_input import project
from deltalab.ops import read_gate
from deltalab.ops._checks import require_choice
from deltalab.ops.log_decay import layer_backend
from deltalab.ops.parametrize import DeltaRuleInputs

__all__ = [
    "DEFAULT_RANK_DIVISORS",
    "READ_GATES",
    "FusedGateMixer",
    "FusedGateProjection",
    "GateRanks",
    "Muir",
    "MuirRanks",
    "matched_filter",
    "muir_ffn_width",
]

READ_GATES = ("dynamic", "static", "none")
# Default rank of each gate as head_dim // divisor (at least 1). docs/MATH.md sec. 4.4: the state
# is far less sensitive to erasure than to writes. Keys are L2-normalized after a SiLU, so their
# energy sits on a few channels and a change of the erase gate on the others barely moves the
# state (its effect is e_i * k_i^2), while the write gate scales every value channel of the
# written row: erase gets the lowest rank, write a middle one. The read gate never touches the
# state (only the output), and around a learned static matched filter it needs little more than
# a modulation. Decay and output gate keep GDN-2's rank (128 at its head_dim 128).
DEFAULT_RANK_DIVISORS = {"decay": 1, "erase": 8, "write": 2, "read": 4, "outgate": 1}
# Floor of the static read weight relative to its head mean: keeps log(weight) finite when a
# channel starts without decay (1 - exp(2 g0) = 0).
READ_WEIGHT_FLOOR = 1e-4
# SwiGLU feed-forward: gate, up and down matrices of hidden x width each.
SWIGLU_MATRICES = 3
# The gates' entry that stands for the read gate where it is fused with the query
# (`FusedGateMixer.hooked_gates`): its pre-activation `[B, T, H, K]` ("dynamic" only).
FUSED_READ = "read_raw"


@dataclass(frozen=True)
class GateRanks:
    """Base of the rank sets of the fused-gate mixers (`MuirRanks`, `KDNMuirRanks`): one field
    per gate, an int rank or None (a full-rank, unfused `nn.Linear(D, width)`). Subclasses name
    their gates as fields and give `divisors`, the default rank of each as head_dim // divisor.
    A rank may not exceed min(hidden, width) of the map it factors.
    """

    divisors: ClassVar[Mapping[str, int]] = {}

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if value is not None:
                require_positive_int(f"ranks.{field.name}", value)

    @classmethod
    def default(
        cls,
        head_dim: int,
        hidden_size: int | None = None,
        *,
        widths: Mapping[str, int] | None = None,
    ) -> Self:
        """head_dim // divisors[gate], at least 1, at most hidden_size and the gate's width in
        `widths` (for gates narrower than head_dim)."""
        head_dim = require_positive_int("head_dim", head_dim)
        limit = (
            head_dim if hidden_size is None else require_positive_int("hidden_size", hidden_size)
        )
        widths = widths or {}
        return cls(
            **{
                name: min(limit, widths.get(name, limit), max(1, head_dim // divisor))
                for name, divisor in cls.divisors.items()
            }
        )

    @classmethod
    def resolve(cls, ranks: object, default: Callable[[], Self]) -> Self:
        """`ranks` as this class: None gives `default()`; a mapping (configuration files and
        config.json carry the ranks so) must name exactly the fields."""
        if ranks is None:
            return default()
        if isinstance(ranks, Mapping):
            gates = {f.name for f in fields(cls)}
            if set(ranks) != gates:
                raise ValueError(
                    f"ranks has unknown gates {sorted(set(ranks) - gates)} and lacks "
                    f"{sorted(gates - set(ranks))}; it needs exactly {sorted(gates)}"
                )
            return cls(**ranks)
        if not isinstance(ranks, cls):
            raise TypeError(
                f"ranks must be a {cls.__name__}, a mapping or None, got {type(ranks).__name__}"
            )
        return ranks

    def check_widths(self, hidden_size: int, widths: dict[str, int]) -> None:
        """Refuses a rank above min(hidden_size, width) for the gates named in `widths`."""
        for name, width in widths.items():
            rank = getattr(self, name)
            if rank is not None and rank > min(hidden_size, width):
                raise ValueError(
                    f"ranks.{name} must be <= min(hidden_size, width) = "
                    f"min({hidden_size}, {width}), got {rank}"
                )


@dataclass(frozen=True)
class MuirRanks(GateRanks):
    """Rank of each gate's projection; None means a full-rank, unfused `nn.Linear(D, width)`.

    decay, erase, write, read: slices of the fused down-projection (read only with
    `read_gate="dynamic"`; validated but unused otherwise). outgate: rank of the output-gate
    projection, which stays the frontend's own `hidden -> rank -> H*V` projection
    (`DeltaMixer.g_proj`): the frontend computes it outside `primitive_inputs`, and the R of
    docs/MATH.md sec. 4.4 counts the four delta-rule gates only. A rank may not exceed
    min(hidden, width) of the map it factors. `MuirRanks.default(head_dim, hidden_size)`:
    head_dim // DEFAULT_RANK_DIVISORS[gate], at least 1, at most hidden_size.
    """

    divisors: ClassVar[Mapping[str, int]] = DEFAULT_RANK_DIVISORS

    decay: int | None
    erase: int | None
    write: int | None
    read: int | None
    outgate: int | None


class FusedGateProjection(nn.Module):
    """x `[B, T, D]` -> each gate's pre-activation `[B, T, width]`, by name.

    Gates with a rank share one down-projection `down: D -> R` (R = the sum of their ranks, one
    matrix product for all of them), sliced per gate in `names` order and up-projected by
    `up[name]: rank -> width`. Gates of rank None get `full[name]: D -> width`.

    Args:
        hidden_size: D. widths: output width per gate. ranks: rank per gate (None: full rank).
        biased: gates whose last map (up-projection or full-rank map) has a bias.
    """

    def __init__(
        self,
        hidden_size: int,
        widths: dict[str, int],
        ranks: dict[str, int | None],
        biased: frozenset[str],
    ) -> None:
        super().__init__()
        self.names = tuple(widths)
        low_rank = {name: rank for name in self.names if (rank := ranks[name]) is not None}
        self.split_sizes = list(low_rank.values())
        total = sum(self.split_sizes)
        self.down = nn.Linear(hidden_size, total, bias=False) if total else None
        self.up = nn.ModuleDict(
            {
                name: nn.Linear(rank, widths[name], bias=name in biased)
                for name, rank in low_rank.items()
            }
        )
        self.full = nn.ModuleDict(
            {
                name: nn.Linear(hidden_size, widths[name], bias=name in biased)
                for name in self.names
                if ranks[name] is None
            }
        )
        for module in (*self.up.values(), *self.full.values()):
            if module.bias is not None:
                no_weight_decay(module.bias)

    def projection(self, name: str) -> nn.Linear:
        """The last linear map of gate `name` (its up-projection, or its full-rank map)."""
        return self.up[name] if name in self.up else self.full[name]

    def input_linears(self) -> list[nn.Linear]:
        """The maps that take x: the shared down-projection and the full-rank maps (a mixer
        lists this module among its projections of x, `DeltaMixer.gate_projections`)."""
        return [*([self.down] if self.down is not None else []), *self.full.values()]

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        # Through `project`: inside the mixer's forward the maps of x come from its shared
        # products (`sharing_autocast_input`).
        raw: dict[str, torch.Tensor] = {}
        if self.down is not None:
            pieces = project(self.down, x).split(self.split_sizes, dim=-1)
            for name, z in zip(self.up.keys(), pieces, strict=True):
                raw[name] = self.up[name](z)
        for name, proj in self.full.items():
            raw[name] = project(proj, x)
        return raw


def matched_filter(A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """The read weights matched to the initial decays: `[H, K]`, mean 1 per head.

    A row with decay alpha = exp(g0) collects interference of variance ~ 1 / (1 - alpha^2), so
    the matched filter weighs it by 1 - alpha^2 = 1 - exp(2 g0), with the input-independent
    decay g0 = -exp(A_log) * softplus(dt_bias) (A_log `[H]`, dt_bias `[H, K]`).
    """
    return read_weights(-torch.expm1(2.0 * initial_log_decay(A_log, dt_bias)))


def initial_log_decay(A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """g0 = -exp(A_log) * softplus(dt_bias) `[H, K]`: the log decay for a zero gate input."""
    return -A_log.exp().unsqueeze(-1) * F.softplus(dt_bias)


def read_weights(weight: torch.Tensor) -> torch.Tensor:
    """Unnormalized read weights `[H, K]` > 0 -> the static read vector: mean 1 per head,
    floored at READ_WEIGHT_FLOOR (so that its log is finite)."""
    weight = weight / weight.mean(dim=-1, keepdim=True)
    return weight.clamp_min(READ_WEIGHT_FLOOR)


def read_query(read: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The matched-filter read rho * q, in q's dtype. Under autocast rho is float32 (x's dtype)
    and q bf16: a float32 product would send the Triton kernels a float32 query, and with it
    their IEEE float32 products (measured on an H200: a 340M Muir trained at 14.4K tokens/s
    that way at 4K context, 33.2K in q's dtype)."""
    return (read * q).to(q.dtype)


class FusedGateMixer(DeltaMixer):
    """Base of the mixers whose gates come from one fused low-rank projection (Muir, KDN-Muir):
    the projection `gate_proj`, the KDA log decay from its "decay" slice (`A_log`, `dt_bias`)
    and the matched-filter read gate (docs/MATH.md sec. 4.4, 4.5).

    A subclass resolves its `GateRanks`, builds the frontend with the output-gate rank
    (`DeltaMixer.__init__`), then calls `_init_fused_gates` with the widths of its own gates;
    its `gates(x)` reads `self.gate_proj(x)` through `decay_from` and `read_from`.
    """

    default_gate_activation = "sigmoid"
    ranks: GateRanks
    read_gate: str

    def gate_projections(self) -> tuple[nn.Module, ...]:
        return (self.gate_proj,)

    def _init_fused_gates(
        self, ranks: GateRanks, read_gate: str, widths: dict[str, int], biased: frozenset[str]
    ) -> None:
        """The fused projection with the slices decay, then `widths` (the subclass's own gates,
        in order), then read (with `read_gate="dynamic"`); A_log, dt_bias; the static read
        vector. biased: the gates of `widths` whose last map has a bias (the read gate's has
        one when it is low rank)."""
        hidden_size, num_heads, head_dim = self.hidden_size, self.num_heads, self.head_dim
        key_width = num_heads * head_dim
        self.ranks, self.read_gate = ranks, read_gate
        all_widths = {"decay": key_width, **widths}
        if read_gate == "dynamic":
            all_widths["read"] = key_width
        outgate = num_heads * self.value_dim
        ranks.check_widths(hidden_size, {**all_widths, "read": key_width, "outgate": outgate})
        rank_of = {name: getattr(ranks, name) for name in all_widths}
        if rank_of.get("read") is not None:
            biased = biased | {"read"}
        # The decay's bias is dt_bias, as in KDA; a low-rank read gate gets a bias so that each
        # channel keeps its own resting level whatever the rank.
        self.gate_proj = FusedGateProjection(hidden_size, all_widths, rank_of, biased)
        self.A_log = init_A_log(num_heads)
        self.dt_bias = init_dt_bias(num_heads, head_dim)
        if read_gate != "none":
            # log of the static read vector: positive by construction, updates are relative.
            self.read_log = no_weight_decay(nn.Parameter(torch.empty(num_heads, head_dim)))
            self.reset_read_gate()
        if read_gate == "dynamic":
            # Zero up-projection: 2 * sigmoid(0) = 1, so at init rho is the static matched filter
            # and the dynamic part is learned as a modulation in (0, 2) around it.
            read_proj = self.gate_proj.projection("read")
            nn.init.zeros_(read_proj.weight)
            if read_proj.bias is not None:
                nn.init.zeros_(read_proj.bias)

    def initial_read_weights(self) -> torch.Tensor:
        """The static read vector `[H, K]` (float64) `reset_read_gate` sets: the matched filter
        of the current A_log, dt_bias (docs/MATH.md sec. 4.5); KDN-Muir weighs in its gain."""
        return matched_filter(self.A_log.double(), self.dt_bias.double())

    @torch.no_grad()
    def reset_read_gate(self) -> None:
        """Sets the static read vector to `initial_read_weights()`."""
        if self.read_gate != "none":
            # In float64 whatever the parameters' dtype: the weights span orders of magnitude.
            self.read_log.copy_(self.initial_read_weights().log())

    def decay_from(self, raw: dict[str, torch.Tensor]) -> torch.Tensor:
        """g `[B, T, H, K]` (at least float32) from the fused projection's output `raw`."""
        decay_raw = raw["decay"].unflatten(-1, (self.num_heads, self.head_dim))
        # The decay follows the delta rule's backend, as the norms (Triton or the torch path).
        backend = layer_backend(self.backend)
        return log_decay(self.A_log.unsqueeze(-1), decay_raw, self.dt_bias, backend=backend)

    def read_from(self, raw: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """The read gate rho `[B, T, H, K]` > 0 in x's dtype (a broadcast view unless
        dynamic), from the fused projection's output `raw` on x `[B, T, D]`."""
        heads, key_dim = self.num_heads, self.head_dim
        shape = (*x.shape[:2], heads, key_dim)
        if self.read_gate == "none":
            return x.new_ones(()).expand(shape)
        dtype = compute_dtype(x)
        read = self.read_log.to(dtype).exp()
        if self.read_gate == "dynamic":
            modulation = torch.sigmoid(raw["read"].unflatten(-1, (heads, key_dim)).to(dtype))
            read = read * (2.0 * modulation)
        return read.to(x.dtype).expand(shape)

    def read_fuses(self, x: torch.Tensor) -> bool:
        """Whether a forward on x without gate hooks multiplies the read gate into the query in
        one op (`deltalab.ops.read_gate` on its Triton path) instead of building rho: a read
        gate to apply, x float32 (rho in x's dtype is then the op's float32 rho: the same
        numbers up to float32 rounding), and the op's backend for the delta rule's resolving to
        "triton"."""
        if self.read_gate == "none" or x.dtype != torch.float32:
            return False
        return products_fuse(self.backend, x)  # the same op's backend as the gate products'

    def read_gates(
        self, raw: dict[str, torch.Tensor], x: torch.Tensor, fused: bool
    ) -> dict[str, torch.Tensor]:
        """The read gate's entries of `gates(x)`: {"read": rho} (`read_from`), or with `fused`
        only what the fused op reads besides the parameter read_log: {FUSED_READ: the
        pre-activation `[B, T, H, K]`} ("dynamic"), nothing ("static")."""
        if not fused:
            return {"read": self.read_from(raw, x)}
        if self.read_gate != "dynamic":
            return {}
        return {FUSED_READ: raw["read"].unflatten(-1, (self.num_heads, self.head_dim))}

    def hooked_gates(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """As `DeltaMixer.hooked_gates`; but where nothing can see rho (no gate hooks, and
        `read_fuses(x)`), the gates hold the read gate's pre-activation instead of rho and
        `matched_read` fuses rho into the query (traffic: the float32 rho `[B, T, H, K]` and
        its gradient never reach memory). A hook (gate sensitivity's `perturb_gate`, which
        perturbs rho) always gets rho, and so do `gates(x)` and the gates a forward reports
        (`reported_gates`)."""
        if self._gate_hooks or not self.read_fuses(x) or not gates_take(type(self), "fused_read"):
            return super().hooked_gates(x)
        return self.gates(x, fused_read=True)

    def matched_read(self, q: torch.Tensor, gates: dict[str, torch.Tensor]) -> torch.Tensor:
        """rho * q in q's dtype: `read_query(gates["read"], q)` when the gates hold rho, else
        the fused op (`deltalab.ops.read_gate.read_query`) on the delta rule's backend."""
        if "read" in gates:
            return read_query(gates["read"], q)
        backend = layer_backend(self.backend)
        return read_gate.read_query(q, self.read_log, gates.get(FUSED_READ), backend=backend)

    def reported_gates(self, gates: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The gates with rho in place of the fused read gate's pre-activation: what
        `return_gates=True` reports whichever path the forward took."""
        if "read" in gates:
            return gates
        reported = {name: value for name, value in gates.items() if name != FUSED_READ}
        shape = gates["g"].shape
        rho = self.read_log.float().exp()
        if FUSED_READ in gates:
            rho = rho * (2.0 * torch.sigmoid(gates[FUSED_READ].float()))
        return reported | {"read": rho.expand(shape)}


class Muir(FusedGateMixer):
    """Muir: GDN-2 whose gates come from one fused low-rank projection, plus a read gate.

    Gates: erase `[B, T, H, K]`, write `[B, T, H, V]`, g `[B, T, H, K]`, read (rho, > 0)
    `[B, T, H, K]` (a broadcast view for "static" and "none").

    Args: options or the frontend keywords (`FrontendOptions`; output gate sigmoid by default);
    ranks: `MuirRanks` (or the same as a mapping), default `MuirRanks.default(head_dim,
    hidden_size)`; read_gate: "dynamic" (rho from the fused projection around the static
    vector), "static" (a learned input-independent `[H, K]` vector) or "none" (rho = 1).
    """

    ranks: MuirRanks

    def __init__(
        self,
        options: FrontendOptions | None = None,
        *,
        ranks: MuirRanks | Mapping[str, int | None] | None = None,
        read_gate: str = "dynamic",
        **frontend: Unpack[FrontendKeywords],
    ) -> None:
        options = frontend_options(options, frontend, type(self))
        ranks = MuirRanks.resolve(
            ranks, lambda: MuirRanks.default(options.head_dim, options.hidden_size)
        )
        read_gate = require_choice("read_gate", read_gate, READ_GATES)
        super().__init__(options, gate_rank=ranks.outgate)
        key_width, value_width = self.num_heads * self.head_dim, self.num_heads * self.value_dim
        # A low-rank erase or write gate gets a bias, so that each channel keeps its own resting
        # level whatever the rank; a full-rank one is GDN-2's projection, without.
        own = {"erase": key_width, "write": value_width}
        biased = frozenset(name for name in own if getattr(ranks, name) is not None)
        self._init_fused_gates(ranks, read_gate, own, biased)

    def gates(
        self, x: torch.Tensor, *, fused_read: bool = False, logits: bool = False
    ) -> dict[str, torch.Tensor]:
        """x `[B, T, D]` -> erase, write, g, read (shapes in the class docstring); with
        `fused_read` the read gate's pre-activation in place of rho (`read_gates`), with
        `logits` the erase and write logits in place of their sigmoids (as GDN-2's)."""
        heads, key_dim, value_dim = self.num_heads, self.head_dim, self.value_dim
        raw = self.gate_proj(x)
        erase = raw["erase"].unflatten(-1, (heads, key_dim))
        write = raw["write"].unflatten(-1, (heads, value_dim))
        gates = erase_write_gates(erase, write, logits)
        gates["g"] = self.decay_from(raw)
        return gates | self.read_gates(raw, x, fused_read)

    def hooked_gates(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """`FusedGateMixer.hooked_gates`, and where no hook sees the gates and the products run
        on Triton (`products_fuse`), the erase and write logits in place of their sigmoids, as
        GDN-2's (`GatedDeltaNet2.hooked_gates`)."""
        if (
            self._gate_hooks
            or not products_fuse(self.backend, x)
            or not gates_take(type(self), "logits", "fused_read")
        ):
            return super().hooked_gates(x)
        return self.gates(x, fused_read=self.read_fuses(x), logits=True)

    def reported_gates(self, gates: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return super().reported_gates(gates_from_logits(gates))

    def inputs_from_gates(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: dict[str, torch.Tensor]
    ) -> DeltaRuleInputs:
        """The primitive's inputs from the gates: GDN-2's, with the query read as rho * q."""
        inputs = gdn2_inputs_of(q, k, v, gates, self.backend)
        return inputs._replace(q=self.matched_read(q, gates))

    # The name `gates` had before every mixer had one; kept for callers of the old name.
    gate_values = gates

    @classmethod
    def from_gdn2(
        cls, layer: GatedDeltaNet2, *, read_gate: str = "none", read_rank: int | None = None
    ) -> Muir:
        """A Muir layer computing what `layer` computes (exactly, with `read_gate="none"`).

        Erase and write become full-rank unfused gates holding GDN-2's `b_proj`, `w_proj`; the
        decay projection becomes the fused projection's decay slice and its up-projection; the
        frontend is copied as is. With a read gate, the static vector is the matched filter of
        the copied decays and the dynamic part (rank `read_rank`, default head_dim // 4) starts
        at zero, so the layer differs from GDN-2 only by that reweighting of the query.
        """
        if not isinstance(layer, GatedDeltaNet2):
            raise TypeError(f"layer must be a GatedDeltaNet2, got {type(layer).__name__}")
        decay_rank = layer.decay.f_proj[0].out_features
        outgate = layer.g_proj[0].out_features if isinstance(layer.g_proj, nn.Sequential) else None
        if read_rank is None:
            read_rank = max(1, layer.head_dim // DEFAULT_RANK_DIVISORS["read"])
        ranks = MuirRanks(decay=decay_rank, erase=None, write=None, read=read_rank, outgate=outgate)
        reference = next(layer.parameters())
        muir = cls(layer.options, ranks=ranks, read_gate=read_gate).to(
            device=reference.device, dtype=reference.dtype
        )
        source = layer.state_dict()
        target = muir.state_dict()
        renamed = {
            "decay.A_log": "A_log",
            "decay.dt_bias": "dt_bias",
            "decay.f_proj.1.weight": "gate_proj.up.decay.weight",
            "b_proj.weight": "gate_proj.full.erase.weight",
            "w_proj.weight": "gate_proj.full.write.weight",
        }
        for name, tensor in source.items():
            if name == "decay.f_proj.0.weight":
                # The decay slice comes first in the fused down-projection.
                target["gate_proj.down.weight"][:decay_rank] = tensor
            else:
                target[renamed.get(name, name)] = tensor
        muir.load_state_dict(target)
        muir.reset_read_gate()
        return muir


def _parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def muir_ffn_width(
    hidden_size: int,
    num_heads: int,
    head_dim: int,
    gdn2_ffn_width: int,
    *,
    value_dim: int | None = None,
    ranks: MuirRanks | None = None,
    read_gate: str = "dynamic",
    gdn2_decay_rank: int | None = None,
    gdn2_gate_rank: int | None = None,
    multiple_of: int = 64,
) -> int:
    """The SwiGLU width that gives a Muir block the parameters of a GDN-2 block.

    A block is mixer + SwiGLU FFN (3 * hidden * width parameters) + norms (the same in both), so
    the parameters Muir's gates save are reinvested in the FFN: width = gdn2_ffn_width +
    (GDN-2 mixer - Muir mixer) / (3 * hidden), rounded to a multiple of `multiple_of` (64 by
    default: GDN-2's 1.3B width 6208 is 97 * 64). Mixers are counted by instantiating both on
    the meta device, so any size is free. The other arguments configure the two mixers as
    their constructors do.
    """
    require_positive_int("gdn2_ffn_width", gdn2_ffn_width)
    require_positive_int("multiple_of", multiple_of)
    sizes = {
        "hidden_size": hidden_size,
        "num_heads": num_heads,
        "head_dim": head_dim,
        "value_dim": value_dim,
    }
    with torch.device("meta"):
        gdn2 = GatedDeltaNet2(**sizes, decay_rank=gdn2_decay_rank, gate_rank=gdn2_gate_rank)
        muir = Muir(**sizes, ranks=ranks, read_gate=read_gate)
    saved = _parameter_count(gdn2) - _parameter_count(muir)
    width = gdn2_ffn_width + saved / (SWIGLU_MATRICES * hidden_size)
    return max(multiple_of, multiple_of * round(width / multiple_of))
