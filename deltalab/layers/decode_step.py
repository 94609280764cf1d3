"""A delta-rule layer's decoding step as two matrix products, one fused kernel and the output
projection: what the static-cache decoder runs per layer where Triton runs.

`mixer(x, state)` for one token dispatches some fifty operators (projections, three short
convolutions, norms, each gate's activation, the delta rule, the gated norm), each a kernel
launch on a GPU: at batch 1 their launches, not the weights' bytes, set the cost of a token.
Here the same step is

    p1 = x [W_q; W_k; W_v; full-rank gate maps; low-rank first factors]^T (+ biases)
    p2 = p1[first factors] blockdiag(second factors)^T (+ biases)     (mixers with low-rank gates)
    `deltalab.ops.delta_rule.triton.fused_step.fused_layer_step`        (one kernel, in place;
                                                                         two for Exact KDN)
    x' = x + o_proj(out)                        (the residual sum in the product: `add_projected`)

with the weights concatenated once into the decoder's store (remade when a weight changes, as
`deltalab.layers.projections.concatenated_weights` does). The block-diagonal second product
reads the zeros between its blocks: a few hundred KB a layer, against one launch per gate.

Each mixer's parametrization (`StepForm`, which of its maps feed which gate, its parameters)
is `step_plan`'s; a mixer class it does not know exactly (a subclass may change its gates),
gate hooks, float64, or a device without Triton keep the unfused step, which is this step's
PyTorch twin (tests/test_decode_fused.py holds them equal).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from deltalab.layers.delta_mixer import DeltaMixer
from deltalab.layers.deltanet import DeltaNet, GatedDeltaNet
from deltalab.layers.gdn2 import GatedDeltaNet2
from deltalab.layers.kda import KimiDeltaAttention
from deltalab.layers.kdn import DiagonalKDN, ExactKDN, FreeProcessNoise, IsotropicKDN, KDNMixer
from deltalab.layers.kdn_muir import KDNMuir
from deltalab.layers.muir import FusedGateProjection, Muir
from deltalab.layers.norms import RMSNorm
from deltalab.layers.projections import _concatenated, _kept, fusable
from deltalab.layers.states import RecurrentState
from deltalab.ops._checks import require_choice
from deltalab.ops._triton import triton_available, triton_unavailable_reason
from deltalab.ops.delta_rule.triton.fused_step import FusedStepLaunch, StepForm
from deltalab.ops.norms import L2_EPS
from deltalab.ops.row_linear import products_backend, resolve_backend, row_linear
from deltalab.ops.swiglu import BACKENDS as SWIGLU_BACKENDS
from deltalab.ops.swiglu import swiglu

__all__ = [
    "LowRank",
    "StepPlan",
    "add_projected",
    "fused_step",
    "runs_fused",
    "step_plan",
    "step_rows",
]


@dataclass(frozen=True, eq=False)
class LowRank:
    """A gate's low-rank map: columns offset..offset+rank of `down`'s output, through `up`."""

    down: nn.Linear
    offset: int
    rank: int
    up: nn.Linear


Source = nn.Linear | LowRank


@dataclass(eq=False)
class StepPlan:
    """A mixer's step: its `StepForm`, the map of x feeding each input of the kernel ("gate",
    and the form's among "beta", "write", "decay", "read", "noise", "obs"), its parameters
    ("A_log", "dt_bias", "read_log", "p_inf_raw") and the KDN constants."""

    form: StepForm
    sources: dict[str, Source]
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    r_min: float = 0.0
    info_scale: float = 1.0


def _source(module: nn.Module) -> Source | None:
    """A plain linear map, or a low-rank `Sequential(Linear, Linear)`; None for another."""
    if isinstance(module, nn.Linear):
        return module
    if isinstance(module, nn.Sequential) and len(module) == 2:
        down, up = module
        if isinstance(down, nn.Linear) and isinstance(up, nn.Linear):
            return LowRank(down, 0, down.out_features, up)
    return None


def _fused_gate(proj: FusedGateProjection, name: str) -> Source:
    """Gate `name` of a fused gate projection: its full-rank map, or its slice of the shared
    down-projection through its up-projection."""
    if name in proj.full:
        return proj.full[name]
    names = list(proj.up.keys())
    offset = sum(proj.split_sizes[: names.index(name)])
    assert proj.down is not None  # a low-rank gate exists, so the shared down-projection does
    return LowRank(proj.down, offset, proj.split_sizes[names.index(name)], proj.up[name])


def _decay_plan(mixer: DeltaMixer) -> tuple[str, dict[str, nn.Module], dict[str, torch.Tensor]]:
    decay = mixer.decay  # type: ignore[attr-defined]
    kind = "head" if type(mixer) is GatedDeltaNet else "channel"
    proj = decay.a_proj if kind == "head" else decay.f_proj
    return kind, {"decay": proj}, {"A_log": decay.A_log, "dt_bias": decay.dt_bias}


def _read_plan(mixer: Muir | KDNMuir) -> tuple[dict[str, Source], dict[str, torch.Tensor]]:
    if mixer.read_gate == "none":
        return {}, {}
    sources = {"read": _fused_gate(mixer.gate_proj, "read")} if mixer.read_gate == "dynamic" else {}
    return sources, {"read_log": mixer.read_log}


def _kdn_plan(mixer: KDNMixer, rule: str, activation: str) -> tuple[StepForm, dict, dict]:
    tied = not isinstance(mixer.process, FreeProcessNoise)
    sources: dict[str, nn.Module] = {"decay": mixer.decay.f_proj, "obs": mixer.r_proj}
    params = {"A_log": mixer.decay.A_log, "dt_bias": mixer.decay.dt_bias}
    if tied:
        params["p_inf_raw"] = mixer.process.p_inf_raw  # type: ignore[assignment]
    else:
        sources["noise"] = mixer.process.proj  # type: ignore[assignment]
    return StepForm("channel", rule, tied=tied, gate_activation=activation), sources, params


KDN_RULES = {IsotropicKDN: "kdn_iso", DiagonalKDN: "kdn_diag", ExactKDN: "kdn_exact"}


def _plan_of(mixer: DeltaMixer) -> StepPlan | None:
    """The plan of a mixer of a class known exactly, before its maps are checked."""
    kind = type(mixer)
    activation = mixer.o_norm.activation
    modules: dict[str, nn.Module] = {}
    sources: dict[str, Source] = {}
    params: dict[str, torch.Tensor] = {}
    constants: dict[str, float] = {}
    if kind in (DeltaNet, GatedDeltaNet, KimiDeltaAttention):
        decay, modules, params = ("none", {}, {}) if kind is DeltaNet else _decay_plan(mixer)
        modules["beta"] = mixer.b_proj  # type: ignore[assignment]
        form = StepForm(decay, "beta", gate_activation=activation)
    elif kind is GatedDeltaNet2:
        _, modules, params = _decay_plan(mixer)
        modules |= {"beta": mixer.b_proj, "write": mixer.w_proj}  # type: ignore[dict-item]
        form = StepForm("channel", "erase_write", gate_activation=activation)
    elif kind is Muir or kind is KDNMuir:
        proj = mixer.gate_proj  # type: ignore[attr-defined]
        muir = kind is Muir
        names = {"decay": "decay"} | (
            {"beta": "erase", "write": "write"}
            if muir
            else {"noise": "process", "obs": "observation"}
        )
        sources = {key: _fused_gate(proj, name) for key, name in names.items()}
        read_sources, params = _read_plan(mixer)  # type: ignore[arg-type]
        sources |= read_sources
        params |= {"A_log": mixer.A_log, "dt_bias": mixer.dt_bias}  # type: ignore[dict-item]
        rule = "erase_write" if muir else "kdn_diag"
        form = StepForm("channel", rule, read=mixer.read_gate, gate_activation=activation)  # type: ignore[attr-defined]
        if not muir:
            constants = {"r_min": mixer.r_min, "info_scale": mixer.info_scale}  # type: ignore[attr-defined]
    elif kind in KDN_RULES:
        form, modules, params = _kdn_plan(mixer, KDN_RULES[kind], activation)  # type: ignore[arg-type]
        # Exact KDN has no information scale: it is exact, s = 1.
        constants = {"r_min": mixer.r_min, "info_scale": getattr(mixer, "info_scale", 1.0)}  # type: ignore[attr-defined]
    else:
        return None
    for key, module in {"gate": mixer.g_proj, **modules}.items():
        source = _source(module)
        if source is None:
            return None
        sources[key] = source
    return StepPlan(form, sources, params, **constants)


def step_plan(mixer: nn.Module) -> StepPlan | None:
    """The fused step's plan of `mixer`, or None where it keeps the unfused step: a class not
    known exactly, or a map that is not a plain hook-free `nn.Linear` (`fusable`)."""
    if not isinstance(mixer, DeltaMixer):
        return None
    plan = _plan_of(mixer)
    if plan is None:
        return None
    maps = [mixer.q_proj, mixer.k_proj, mixer.v_proj]
    for source in plan.sources.values():
        maps += [source.down, source.up] if isinstance(source, LowRank) else [source]
    return plan if all(fusable(m) for m in maps) else None


def runs_fused(mixer: nn.Module, x: torch.Tensor, state: object) -> bool:
    """Whether the static decoder's step of `mixer` on x `[B, 1, D]` continuing `state` (its
    own buffers, `in_place`) takes the fused kernel: a planned mixer without gate hooks, a
    16-bit or float32 x, and Triton where the mixer's backend takes it ("auto": compiled on
    CUDA; "triton": also under the interpreter)."""
    if not (isinstance(state, RecurrentState) and state.in_place and x.shape[1] == 1):
        return False
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    if not isinstance(mixer, DeltaMixer) or mixer._gate_hooks:
        return False
    if mixer.backend == "auto":
        ready = triton_available(x.device)
    else:
        ready = mixer.backend == "triton" and triton_unavailable_reason(x.device) is None
    # The kernel updates these in place, indexing them as contiguous buffers (the memory and
    # the KDN filter's state in float32), as the decoder's own are.
    buffers = [state.memory, getattr(state, "uncertainty", state.memory)]
    caches = (state.conv_q, state.conv_k, state.conv_v)
    return (
        ready
        and all(t.dtype == torch.float32 and t.is_contiguous() for t in buffers)
        and all(t.is_contiguous() for t in caches)
        and step_plan(mixer) is not None
    )


@dataclass(frozen=True, eq=False)
class _Layout:
    """The two products of a plan: product 1's maps (q, k, v, full-rank gates, then the first
    factors, which end it), product 2's second factors and each one's input columns."""

    first: list[nn.Linear]
    downs: list[nn.Linear]
    ups: list[nn.Linear]
    columns: list[tuple[int, int]]


def _layout(mixer: DeltaMixer, plan: StepPlan) -> _Layout:
    full = [s for s in plan.sources.values() if isinstance(s, nn.Linear)]
    low = [s for s in plan.sources.values() if isinstance(s, LowRank)]
    first = list(dict.fromkeys([mixer.q_proj, mixer.k_proj, mixer.v_proj, *full]))
    downs = list(dict.fromkeys(s.down for s in low))
    starts, start = {}, 0
    for down in downs:
        starts[down] = start
        start += down.out_features
    columns = [(starts[s.down] + s.offset, s.rank) for s in low]
    return _Layout(first, downs, [s.up for s in low], columns)


def _block_diagonal(layout: _Layout, dtype: torch.dtype):
    """The second factors as one `[sum widths, sum ranks of the downs]` weight, each at its
    input columns (zeros elsewhere), and their biases (None when none has one)."""
    ups = layout.ups
    width = sum(d.out_features for d in layout.downs)
    weight = ups[0].weight.new_zeros(sum(u.out_features for u in ups), width, dtype=dtype)
    row = 0
    for up, (column, rank) in zip(ups, layout.columns, strict=True):
        weight[row : row + up.out_features, column : column + rank] = up.weight.detach()
        row += up.out_features
    if all(up.bias is None for up in ups):
        return weight, None
    biases = [weight.new_zeros(u.out_features) if u.bias is None else u.bias.detach() for u in ups]
    return weight, torch.cat(biases).to(dtype)


def _product(
    x, maps, store, dtype, make, backend, norm=None
) -> tuple[torch.Tensor, dict[nn.Linear, torch.Tensor]]:
    """The product of x with the maps' weights concatenated (`make()`, kept in `store`) by
    `row_linear` (`products_backend` of the layer's `backend`), and {map: its columns}. norm:
    an `RMSNorm` the product applies to x first (`step_rows` gives it where it may)."""
    params = [p for m in maps for p in (m.weight, m.bias) if p is not None]
    weight, bias = _kept(store, params, dtype, make)
    y = row_linear(x, weight, bias, backend=products_backend(backend, x), **_norm_arguments(norm))
    return y, dict(zip(maps, y.split([m.out_features for m in maps], -1), strict=True))


def _norm_arguments(norm: nn.Module | None) -> dict:
    return {} if norm is None else {"norm_weight": norm.weight, "norm_eps": norm.eps}


def step_rows(
    x: torch.Tensor, norm: nn.Module | None, dtype: torch.dtype, backend: str
) -> tuple[torch.Tensor, nn.Module | None]:
    """A one-token step's input x `[B, 1, D]` as the rows `[B, D]` of `dtype` that a product
    takes, and the pre-norm `norm` (a norm module or None) left for that product to apply: the
    product's kernel normalizes its rows itself where the layer's products take `row_linear`'s
    kernel (`products_backend` of `backend`, the layer's), no cast comes between the norm and
    the product and the norm is a plain `RMSNorm` without hooks (`fusable`); else the module
    runs here, as the block's forward runs it, and None is left. The fused norm rounds its
    output to x's dtype as the module does, so the two differ by the order of a sum only."""
    rows = x[:, 0]
    kernel = resolve_backend(products_backend(backend, rows), rows) == "triton"
    if norm is not None and (rows.dtype != dtype or not kernel or not fusable(norm, RMSNorm)):
        rows, norm = norm(x)[:, 0], None
    return rows.to(dtype), norm


def add_projected(
    residual: torch.Tensor | None,
    inputs: torch.Tensor,
    linear: nn.Linear,
    backend: str = "auto",
    *,
    norm: nn.Module | None = None,
    swiglu_backend: str | None = None,
    in_place: bool = False,
) -> torch.Tensor:
    """residual + linear(norm(inputs)) `[B, 1, D]` (no residual: none; no norm: inputs as they
    are) by `row_linear` on its backend for a layer on `backend` (`products_backend`), the sum
    and the norm in the product where nothing casts between them (no autocast, one dtype);
    else the modules' forwards and a sum. inputs `[B, n]` or `[B, 1, n]`. swiglu_backend:
    inputs `[B, 2n]` are SwiGLU's gate and up, gated inside the product where it runs
    `row_linear`'s kernel (in float32, rounded once to their dtype: what `swiglu`'s kernel
    writes), else first by `swiglu` on this backend (the FFN's). in_place: the sum may be
    written into `residual` (which must not be needed after), so that no copy of it is made;
    the result is the returned tensor. The maps are plain `nn.Linear`s (`fusable`): their
    forward is the product."""
    weight, bias = linear.weight, linear.bias
    dtypes = {t.dtype for t in (inputs, weight, bias, residual) if t is not None}
    plain = not torch.is_autocast_enabled(inputs.device.type) and len(dtypes) == 1
    gated = swiglu_backend is not None
    if gated:
        require_choice("swiglu_backend", swiglu_backend, SWIGLU_BACKENDS)
        if norm is not None:
            raise ValueError("add_projected: give norm or swiglu_backend, not both")
        rows = inputs.flatten(0, -2)
        if not plain or resolve_backend(products_backend(backend, rows), rows) != "triton":
            inputs, gated = swiglu(inputs, backend=swiglu_backend), False
    if not plain:
        y = linear(inputs if norm is None else norm(inputs)).view(inputs.shape[0], 1, -1)
        return y if residual is None else residual + y.view_as(residual)
    if norm is not None:
        rows, norm = step_rows(inputs.view(inputs.shape[0], 1, -1), norm, inputs.dtype, backend)
    else:
        rows = inputs.flatten(0, -2)
    flat = None if residual is None else residual.flatten(0, -2)
    y = row_linear(rows, weight, bias, flat, out=flat if in_place else None,
                   swiglu=gated, backend=products_backend(backend, rows),
                   **_norm_arguments(norm))  # fmt: skip
    return y.view(inputs.shape[0], 1, -1)


def fused_step(
    mixer: DeltaMixer, x: torch.Tensor, state: RecurrentState, store: dict, *,
    residual: torch.Tensor | None = None, norm: nn.Module | None = None,
    in_place: bool = False, block_v: int | None = None, table: FusedStepLaunch | None = None,
) -> torch.Tensor:  # fmt: skip
    """`mixer(norm(x), state)[0]` for one token x `[B, 1, D]` (no norm: x as it is; the norm in
    the first product where `step_rows` lets it), plus `residual` when given, in the output
    projection's product (`add_projected`; in_place: summed into `residual`), the state's
    buffers updated in place, on the fused kernel (where `runs_fused`). store: the decoder's
    dict that keeps the concatenated weights. block_v, table: the kernel's value block, or its
    launch table (None: the card's; `fused_layer_step`)."""
    from deltalab.ops.delta_rule.triton.fused_step import fused_layer_step

    plan = step_plan(mixer)
    assert plan is not None  # runs_fused checked it
    layout = _layout(mixer, plan)
    dtype = x.dtype
    if torch.is_autocast_enabled(x.device.type) and dtype != torch.float64:
        dtype = torch.get_autocast_dtype(x.device.type)
    products = mixer.backend  # the products follow the layer's backend (`products_backend`)
    x, norm = step_rows(x, norm, dtype, products)
    product, first = _product(x, layout.first + layout.downs, store, dtype,
                              lambda: _concatenated(layout.first + layout.downs, dtype),
                              products, norm)  # fmt: skip
    outputs: dict[Source, torch.Tensor] = dict(first)
    low = [s for s in plan.sources.values() if isinstance(s, LowRank)]
    if low:
        # The first factors end product 1: their outputs are one view, product 2's input.
        start = sum(m.out_features for m in layout.first)
        _, second = _product(product[:, start:], layout.ups, store, dtype,
                             lambda: _block_diagonal(layout, dtype), products)  # fmt: skip
        outputs |= {s: second[s.up] for s in low}
    batch = x.shape[0]
    out = torch.empty(batch, mixer.num_heads * mixer.value_dim, dtype=dtype, device=x.device)
    gates = {name: outputs[source] for name, source in plan.sources.items() if name != "gate"}
    params = dict(plan.params)
    uncertainty = getattr(state, "uncertainty", None)
    if uncertainty is not None:
        params["precision"] = uncertainty
    fused_layer_step(
        plan.form,
        (first[mixer.q_proj], first[mixer.k_proj], first[mixer.v_proj]),
        (mixer.q_conv.weight, mixer.k_conv.weight, mixer.v_conv.weight),
        (state.conv_q, state.conv_k, state.conv_v),
        state.memory,
        outputs[plan.sources["gate"]],
        mixer.o_norm.weight,
        out,
        scale=mixer.head_dim**-0.5,
        l2_eps=L2_EPS,
        norm_eps=mixer.o_norm.eps,
        gates=gates,
        params=params,
        r_min=plan.r_min,
        info_scale=plan.info_scale,
        block_v=block_v,
        table=table,
    )
    return add_projected(residual, out, mixer.o_proj, products, in_place=in_place)
