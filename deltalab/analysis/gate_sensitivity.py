"""Gate sensitivity (docs/MATH.md sec. 4.4): how far each gate moves a layer's memory, and the loss.

For a delta-rule layer with gate G (erase `[B, T, H, K]`, write `[B, T, H, V]`, log decay g,
read rho, beta `[B, T, H]`, ...) and that layer's final memory M `[B, H, K, V]`, the sensitivity
at token t along a unit direction d_t of the gate's space is the directional derivative
J_t d_t = dM/d eps of G_t -> G_t + eps d_t. We report the root mean square over the B*T tokens
and over random unit directions,

    state(G) = sqrt( E_d  1/(B T) sum_{b,t} ||J_{b,t} d_{b,t}||^2 )     (loss(G): dL instead of dM)

estimated with every token perturbed at once: for independent zero-mean directions the cross
terms of ||sum_t J_t d_t||^2 vanish in expectation, so E||J d||^2 / (B T) is the mean over tokens
of E||J_t d_t||^2 -- one forward pass per probe, not one per token. Each pass is exact
forward-mode AD (`torch.autograd.forward_ad`) through the whole model, not a finite difference.

Perturbation: `perturb_gate` registers a gate hook on the layer
(`DeltaMixer.register_gate_hook`), which every mixer calls between computing its gates (`gates`)
and turning them into the primitive's inputs (`inputs_from_gates`). The gates of a KDN layer
(`deltalab.layers.kdn.KDNMixer`) are its noise model: g (log decay `[B, T, H, K]`), q_noise
(process noise `[B, T, H(, K)]`) and r (observation noise `[B, T, H]`), which the filter then
turns into gains as usual; their derived gates (beta, gain, p, predictive) are not perturbed on
their own.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.autograd.forward_ad as fwAD
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from deltalab.analysis._plot import new_figure, save_figure
from deltalab.benchmarking import format_table
from deltalab.layers.attention import Attention
from deltalab.layers.common import require_positive_int
from deltalab.layers.delta_mixer import DeltaMixer
from deltalab.layers.kdn import KalmanMixer
from deltalab.layers.norms import GatedRMSNorm, RMSNorm
from deltalab.models.lm import SwiGLU
from deltalab.ops.parametrize import DeltaRuleInputs

__all__ = [
    "GateInputs",
    "SensitivityReport",
    "gate_inputs",
    "gate_sensitivity",
    "perturb_gate",
    "plot_gate_sensitivity",
    "unit_directions",
]

# (q, k, v, gates by name) -> the primitive's inputs: how a layer's gates enter the delta rule.
GateInputs = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, Mapping[str, torch.Tensor]], DeltaRuleInputs
]
# (layer name, gate name, gate value [B, T, ...]) -> direction of the gate's shape, unit norm
# over each (b, t) slice.
Direction = Callable[[str, str, torch.Tensor], torch.Tensor]
LossFn = Callable[[nn.Module, Any], torch.Tensor]


def gate_inputs(layer: DeltaMixer) -> GateInputs:
    """How `layer`'s gates enter the primitive: its `inputs_from_gates` method."""
    _check_perturbable(layer)
    return layer.inputs_from_gates


def _check_perturbable(layer: DeltaMixer) -> None:
    """Raises TypeError if `perturb_gate` cannot perturb `layer`'s gates: a mixer that still
    computes its gates inside its own `primitive_inputs` offers no point to hook them."""
    cls = type(layer)
    if cls.gates is DeltaMixer.gates or cls.inputs_from_gates is DeltaMixer.inputs_from_gates:
        raise TypeError(
            f"{cls.__name__} has no gates(x) and inputs_from_gates(q, k, v, gates) methods: its "
            "gates cannot be perturbed"
        )
    if cls.primitive_inputs is DeltaMixer.primitive_inputs or isinstance(layer, KalmanMixer):
        return
    raise TypeError(
        f"{cls.__name__} overrides primitive_inputs, which may bypass the gate hooks: its gates "
        "cannot be perturbed"
    )


@contextlib.contextmanager
def perturb_gate(
    layer: DeltaMixer, gate: str, delta: Callable[[torch.Tensor], torch.Tensor]
) -> Iterator[None]:
    """Inside the block, every forward of `layer` uses `gate + delta(gate)` for the named gate.

    `delta` receives the gate tensor (e.g. erase `[B, T, H, K]`) and returns a tensor of its
    shape. The perturbed gates are also what `return_gates=True` reports. The hook is removed on
    exit, also after an error. For a KDN layer the gate is one of `KALMAN_GATES` (g, q_noise,
    r); the caller keeps q_noise >= 0 and r >= r_min if the perturbed point must be a valid
    filter.
    """
    _check_perturbable(layer)

    def moved(gates: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if gate not in gates:
            raise KeyError(f"{type(layer).__name__} has no gate {gate!r}; gates: {list(gates)}")
        return {**gates, gate: gates[gate] + delta(gates[gate])}

    handle = layer.register_gate_hook(moved)
    try:
        yield
    finally:
        handle.remove()


def unit_directions(value: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Gaussian directions of `value`'s shape `[B, T, ...]`, unit norm over each (b, t) slice.

    Drawn in float64 on the CPU from `generator` (the same numbers on every device), returned in
    `value`'s dtype and device.
    """
    d = torch.randn(value.shape, generator=generator, dtype=torch.float64)
    norms = d.flatten(2).norm(dim=-1)  # [B, T]
    d = d / norms[(..., *[None] * (d.dim() - 2))]
    return d.to(device=value.device, dtype=value.dtype)


@dataclass(frozen=True)
class SensitivityReport:
    """Per layer (module name) and gate: RMS over tokens and directions of the change of the
    layer's final memory (`state`) and of the loss (`loss`) per unit gate perturbation."""

    state: dict[str, dict[str, float]]
    loss: dict[str, dict[str, float]]
    probes: int

    @property
    def layers(self) -> list[str]:
        return list(self.state)

    @property
    def gates(self) -> list[str]:
        """Every gate name, in order of first appearance."""
        return list(dict.fromkeys(g for per_layer in self.state.values() for g in per_layer))

    def mean(self, kind: str = "loss") -> dict[str, float]:
        """Each gate's sensitivity averaged over the layers that have it ("state" or "loss")."""
        if kind not in ("state", "loss"):
            raise ValueError(f"kind must be 'state' or 'loss', got {kind!r}")
        table = getattr(self, kind)
        means = {}
        for gate in self.gates:
            values = [per_layer[gate] for per_layer in table.values() if gate in per_layer]
            means[gate] = sum(values) / len(values)
        return means

    def table(self) -> str:
        """One row per layer and gate, then the mean over layers."""
        rows: list[list[object]] = [
            [layer, gate, value, self.loss[layer][gate]]
            for layer, per_layer in self.state.items()
            for gate, value in per_layer.items()
        ]
        state, loss = self.mean("state"), self.mean("loss")
        rows += [["mean", gate, state[gate], loss[gate]] for gate in self.gates]
        headers = ["layer", "gate", "d state / d gate", "d loss / d gate"]
        return format_table(headers, rows)


def _default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return model(batch)


def _delta_layers(model: nn.Module, only: Sequence[str] | None) -> list[tuple[str, DeltaMixer]]:
    """The model's delta-rule layers (module name, layer), restricted to `only` when given;
    refuses a layer whose gates cannot be perturbed rather than leaving it out silently."""
    layers = [
        (name or type(model).__name__, module)
        for name, module in model.named_modules()
        if isinstance(module, DeltaMixer)
    ]
    if only is not None:
        unknown = set(only) - {name for name, _ in layers}
        if unknown:
            raise ValueError(f"layers {sorted(unknown)} are not delta-rule layers of the model")
        layers = [(name, layer) for name, layer in layers if name in only]
    if not layers:
        raise ValueError(f"{type(model).__name__} holds no delta-rule layer (DeltaMixer)")
    for name, layer in layers:
        try:
            _check_perturbable(layer)
        except TypeError as error:
            raise TypeError(f"layer {name!r}: {error}; leave it out with layers=[...]") from None
    return layers


def _scalar_loss(loss_fn: LossFn, model: nn.Module, batch: Any) -> torch.Tensor:
    loss = loss_fn(model, batch)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return loss
    got = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
    raise ValueError(f"loss_fn(model, batch) must return a scalar tensor, got {got}")


def _gate_names(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    layers: list[tuple[str, DeltaMixer]],
    keep_values: bool = False,
) -> tuple[
    dict[str, list[str]],
    list[tuple[DeltaMixer, Any]] | None,
    dict[str, dict[str, torch.Tensor]],
]:
    """Runs the model once and records each layer's gate names (layers never called: none),
    every delta-rule layer's output in call order for `_replaying` (None when a layer is
    called more than once per loss: then no output stands for all of its calls), and each
    layer's gates as its first call computed them: the values themselves with `keep_values`
    (a `direction` function may read them), else zero-stride stand-ins of their shape, dtype
    and device, which is all `unit_directions` reads."""
    names: dict[str, list[str]] = {name: [] for name, _ in layers}
    values: dict[str, dict[str, torch.Tensor]] = {name: {} for name, _ in layers}
    calls: list[tuple[DeltaMixer, Any]] = []

    def record(module: nn.Module, args: Any, output: Any) -> None:
        calls.append((module, output))

    with contextlib.ExitStack() as stack:
        for name, layer in layers:
            stack.enter_context(_recording(layer, names[name], values[name], keep_values))
        for module in model.modules():
            if isinstance(module, DeltaMixer):
                stack.callback(module.register_forward_hook(record).remove)
        with torch.no_grad():
            _scalar_loss(loss_fn, model, batch)
    once = len({id(layer) for layer, _ in calls}) == len(calls)
    return names, calls if once else None, values


@contextlib.contextmanager
def _replaying(calls: Sequence[tuple[DeltaMixer, Any]]) -> Iterator[None]:
    """Inside the block each listed layer returns its recorded output without computing it.

    A probe perturbs one layer's gate, so the layers called before it see no tangent and
    compute what the recording pass computed: replaying them is exact (the same tensors, where
    recomputing could differ only by nondeterministic rounding) and saves on average half of
    the delta-rule work of every probe. The model consumes a mixer's output out of place
    (`x + y`), so one recorded tensor serves every probe. The instance attribute `forward`
    shadows the class's method for `nn.Module.__call__`; hooks still run. Removed on exit, also
    after an error."""
    replayed = []
    try:
        for layer, output in calls:
            if "forward" in vars(layer):
                raise RuntimeError(f"{type(layer).__name__} already has an instance forward")
            layer.forward = lambda *args, _output=output, **kwargs: _output
            replayed.append(layer)
        yield
    finally:
        for layer in replayed:
            del layer.forward


@contextlib.contextmanager
def _recording(
    layer: DeltaMixer,
    names: list[str],
    values: dict[str, torch.Tensor] | None = None,
    keep_values: bool = False,
) -> Iterator[None]:
    """Appends the names of the gates `layer` computes to `names`, changing nothing else (for a
    KDN layer: its noise model, the gates `perturb_gate` can move); with `values`, also keeps
    each gate of the first call there (see `_gate_names`)."""

    def recorded(gates: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        names.extend(g for g in gates if g not in names)
        if values is not None:
            for g, value in gates.items():
                if g not in values:
                    stand_in = torch.zeros((), dtype=value.dtype, device=value.device)
                    values[g] = value if keep_values else stand_in.expand(value.shape)
        return gates

    handle = layer.register_gate_hook(recorded)
    try:
        yield
    finally:
        handle.remove()


def _checked(d: torch.Tensor, gate: str, value: torch.Tensor) -> torch.Tensor:
    """The direction d for `gate`, refused unless it has the gate value's shape."""
    if d.shape != value.shape:
        raise ValueError(
            f"direction for gate {gate!r} must have shape {tuple(value.shape)}, "
            f"got {tuple(d.shape)}"
        )
    return d


class _Probed(NamedTuple):
    """What a probe differentiates: the loss of `model` on `batch` and the final memory of
    `layer`, one of its delta-rule layers."""

    model: nn.Module
    batch: Any
    loss_fn: LossFn
    layer: DeltaMixer

    def loss(self) -> torch.Tensor:
        return _scalar_loss(self.loss_fn, self.model, self.batch)


def _probe(
    probed: _Probed, gate: str, direction: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[float, float]:
    """||J d||^2 / tokens for the layer's final memory and for the loss, one direction."""
    layer = probed.layer
    tokens, memory = 0, None

    def delta(value: torch.Tensor) -> torch.Tensor:
        nonlocal tokens
        d = _checked(direction(value), gate, value)
        tokens += value.shape[0] * value.shape[1]
        # A dual number: primal 0, tangent d; the model carries d/d eps along exactly.
        return fwAD.make_dual(torch.zeros_like(value), d.to(value.dtype))

    def capture(module: nn.Module, args: Any, output: tuple[torch.Tensor, Any]) -> None:
        nonlocal memory
        memory = output[1].memory

    handle = layer.register_forward_hook(capture)
    try:
        with torch.no_grad(), fwAD.dual_level(), perturb_gate(layer, gate, delta):
            loss = probed.loss()
            loss_tangent = fwAD.unpack_dual(loss).tangent
            memory_tangent = fwAD.unpack_dual(memory).tangent
    finally:
        handle.remove()
    # No tangent: the quantity does not depend on the gate (e.g. the memory on the read gate).
    state_sq = 0.0 if memory_tangent is None else memory_tangent.double().square().sum().item()
    loss_sq = 0.0 if loss_tangent is None else loss_tangent.double().square().item()
    return state_sq / tokens, loss_sq / tokens


def _batched_probes(
    probed: _Probed, jobs: Sequence[tuple[str, torch.Tensor]], tokens: int
) -> list[tuple[float, float]]:
    """What `_probe` gives for each (gate, direction) of `jobs`, all from one forward pass.

    The directions are the tangents of one batched forward-mode derivative (`torch.func.jvp`
    under `torch.func.vmap`): the model's primal is computed once, and every op carries all the
    tangents at once, where `_probe` computes the primal once per direction. Each direction
    perturbs its own gate only (the tangent of the pass's other gates is 0 for it), so each
    tangent is that of its `_probe` pass, up to rounding. Needs the layer called once per loss
    and a model that vmap goes through (torch ops and autograd Functions written with
    `setup_context` and a vmap rule, as the norms' torch paths are)."""
    layer = probed.layer
    chosen = list(dict.fromkeys(gate for gate, _ in jobs))
    primals = tuple(torch.zeros_like(next(d for g, d in jobs if g == gate)) for gate in chosen)
    tangents = tuple(
        torch.stack([d if g == gate else zero for g, d in jobs])
        for gate, zero in zip(chosen, primals, strict=True)
    )

    def run(*eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen: dict[str, torch.Tensor] = {}

        def capture(module: nn.Module, args: Any, output: tuple[torch.Tensor, Any]) -> None:
            seen["memory"] = output[1].memory

        with contextlib.ExitStack() as stack:
            stack.callback(layer.register_forward_hook(capture).remove)
            for gate, delta in zip(chosen, eps, strict=True):
                stack.enter_context(perturb_gate(layer, gate, lambda value, d=delta: d))
            loss = probed.loss()
        return loss, seen["memory"]

    def tangent_of(*directions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.func.jvp(run, primals, directions)[1]

    with torch.no_grad():
        loss_tangents, memory_tangents = torch.func.vmap(tangent_of)(*tangents)
    return [
        (
            memory_tangents[i].double().square().sum().item() / tokens,
            loss_tangents[i].double().square().item() / tokens,
        )
        for i in range(len(jobs))
    ]


def _measure_batched(
    probed: _Probed, jobs: Sequence[tuple[str, torch.Tensor]], tokens: int, per_pass: int
) -> list[tuple[float, float]]:
    """`_batched_probes` over `jobs`, `per_pass` at a time; where vmap cannot go through the
    model or the loss (an op without a batching rule, `.item()` of a tangent-carrying tensor,
    random ops), a warning and one `_probe` pass per direction, with the same directions."""
    try:
        return [
            result
            for start in range(0, len(jobs), per_pass)
            for result in _batched_probes(probed, jobs[start : start + per_pass], tokens)
        ]
    except (RuntimeError, NotImplementedError) as error:
        warnings.warn(
            f"gate_sensitivity: batched probes failed ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}); running one pass per "
            "direction (per_pass=1)",
            RuntimeWarning,
            stacklevel=3,
        )
    return [_probe(probed, gate, lambda value, d=d: d) for gate, d in jobs]


@contextlib.contextmanager
def _forward_mode_paths(model: nn.Module) -> Iterator[None]:
    """Runs every delta-rule layer of `model` on a path that forward-mode AD can go through.

    A probe's tangent flows from the perturbed gate through every later layer, and forward-mode
    AD needs each autograd Function on the way to define a jvp. The PyTorch paths ("chunk",
    "naive") are built from torch ops and have them; the Triton kernels' Functions define only
    a backward. So layers whose backend is "auto" or "triton" run the chunk path (and its
    parallel variance scan, and the conv1d path of their short convolutions, which follow the
    layer's backend: `short_conv_backend`) while the probes run, and get their backend back
    afterwards, also after an error. The numbers agree up to rounding: both paths compute one
    function. Their norms follow their backend too; the blocks' RMSNorms, the FFNs' SwiGLU
    gating and the attention blocks' RoPE (hybrid models), which take the model's backend, run
    the torch path alongside (their Triton Functions define a jvp, but a model built for
    "triton" on a machine without it is probed too). Softmax attention runs SDPA's math
    backend (matrix products and a softmax: forward-mode AD goes through them; the fused flash
    and memory-efficient kernels define no jvp, on CPU as on CUDA)."""
    switched = [
        (layer, layer.backend, "chunk")
        for layer in model.modules()
        if isinstance(layer, DeltaMixer) and layer.backend not in ("chunk", "naive")
    ]
    switched += [
        (module, module.backend, "torch")
        for module in model.modules()
        if isinstance(module, RMSNorm | SwiGLU | Attention)
        and module.backend not in ("torch", "naive")
    ]
    # An output norm with a backend of its own (else it follows its layer's, switched above).
    switched += [
        (module, module.backend, "torch")
        for module in model.modules()
        if isinstance(module, GatedRMSNorm) and module.backend not in (None, "torch", "naive")
    ]
    for layer, _, path in switched:
        layer.backend = path
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        for layer, backend, _ in switched:
            layer.backend = backend


def gate_sensitivity(
    model: nn.Module,
    batch: Any,
    *,
    loss_fn: LossFn | None = None,
    probes: int = 4,
    seed: int = 0,
    direction: Direction | None = None,
    gates: Sequence[str] | None = None,
    layers: Sequence[str] | None = None,
    per_pass: int | None = None,
) -> SensitivityReport:
    """Sensitivity of each delta-rule layer's final memory and of the loss to each of its gates.

    Args:
        model: any module holding `DeltaMixer` layers (found by `named_modules`).
        batch: what `loss_fn` takes.
        loss_fn: `(model, batch) -> scalar tensor`; default `model(batch)`.
        probes: random directions per gate (the estimate's error falls as 1/sqrt(probes)).
        seed: seeds the directions (a local generator; the global RNG is untouched).
        direction: replaces the random directions: `(layer name, gate name, gate value
            [B, T, ...]) -> direction` of the value's shape, unit norm per (b, t) slice.
        gates: only these gate names (default: every gate of every layer).
        layers: only these layers, by module name (default: every `DeltaMixer`). A layer whose
            gates cannot be perturbed (no `inputs_from_gates`, not a baseline, not a KDN layer)
            is an error. A KDN layer reports its noise model's gates g, q_noise and r.
        per_pass: directions whose derivatives one forward pass computes (default: `probes`,
            the probes of one gate). Above 1 the passes are batched forward-mode derivatives
            (`torch.func.jvp` under `vmap`, `_batched_probes`): the primal once per pass, not
            once per direction; the numbers are those of one pass per direction up to rounding,
            with the same directions. Memory grows with it (each op holds `per_pass` tangents).
            1 runs one `torch.autograd.forward_ad` pass per direction, as does a model whose
            layer is called more than once per loss.

    Returns a `SensitivityReport`: the numbers of the module docstring per layer and gate. A
    layer called more than once per loss is perturbed in every call; its memory is the last
    call's and the tokens are counted over all calls. The model is run as is (train/eval mode),
    its delta-rule layers (short convolutions included) on the PyTorch chunk path
    (`_forward_mode_paths`: the Triton kernels define no forward-mode derivative).
    """
    loss_fn = _default_loss if loss_fn is None else loss_fn
    probes = require_positive_int("probes", probes)
    per_pass = probes if per_pass is None else require_positive_int("per_pass", per_pass)
    chosen_layers = _delta_layers(model, layers)
    generator = torch.Generator().manual_seed(seed)
    state: dict[str, dict[str, float]] = {}
    loss: dict[str, dict[str, float]] = {}
    with _forward_mode_paths(model):
        names, calls, values = _gate_names(
            model, batch, loss_fn, chosen_layers, keep_values=direction is not None
        )
        position = {id(layer): i for i, (layer, _) in enumerate(calls or [])}
        for layer_name, layer in chosen_layers:
            # The layers called before this one, replayed (all of them computed if calls is None).
            before = calls[: position[id(layer)]] if id(layer) in position else []
            chosen = [g for g in names[layer_name] if gates is None or g in gates]
            if not chosen:
                continue
            probed = _Probed(model, batch, loss_fn, layer)

            def draw(value: torch.Tensor, layer_name=layer_name, gate=None) -> torch.Tensor:
                if direction is None:
                    return unit_directions(value, generator)
                return direction(layer_name, gate, value)

            if per_pass > 1 and calls is not None:
                # Every direction of the layer, drawn in the order the passes below would draw
                # them one by one (gate by gate, probe by probe), then batched `per_pass` at a
                # time.
                jobs = []
                for gate in chosen:
                    value = values[layer_name][gate]
                    for _ in range(probes):
                        d = _checked(draw(value, gate=gate), gate, value)
                        jobs.append((gate, d.to(value.dtype)))
                value = values[layer_name][chosen[0]]
                tokens = value.shape[0] * value.shape[1]
                with _replaying(before):
                    measured = _measure_batched(probed, jobs, tokens, per_pass)
                per_gate = {
                    gate: measured[i * probes : (i + 1) * probes] for i, gate in enumerate(chosen)
                }
            else:
                per_gate = {}
                for gate in chosen:
                    with _replaying(before):
                        per_gate[gate] = [
                            _probe(probed, gate, partial(draw, gate=gate)) for _ in range(probes)
                        ]
            state[layer_name], loss[layer_name] = {}, {}
            for gate, results in per_gate.items():
                state[layer_name][gate] = math.sqrt(sum(r[0] for r in results) / probes)
                loss[layer_name][gate] = math.sqrt(sum(r[1] for r in results) / probes)
    return SensitivityReport(state=state, loss=loss, probes=probes)


def plot_gate_sensitivity(report: SensitivityReport, path: str | os.PathLike[str]) -> Path:
    """Bar chart of the report (memory and loss panels, one bar group per layer) as a PNG."""
    figure = new_figure(figsize=(max(6.0, 1.2 * len(report.layers) + 3.0), 6.0))
    axes = figure.subplots(2, 1, sharex=True)
    gates, layers = report.gates, report.layers
    width = 0.8 / max(1, len(gates))
    for ax, kind, label in (
        (axes[0], report.state, "d final memory / d gate"),
        (axes[1], report.loss, "d loss / d gate"),
    ):
        for i, gate in enumerate(gates):
            xs = [j + (i - (len(gates) - 1) / 2) * width for j in range(len(layers))]
            heights = [kind[layer].get(gate, 0.0) for layer in layers]
            ax.bar(xs, heights, width=width, label=gate)
        ax.set_ylabel(label)
    axes[0].legend(title="gate", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes[0].set_title(f"Gate sensitivity: RMS over tokens, {report.probes} random directions")
    axes[1].set_xticks(range(len(layers)), layers, rotation=30, ha="right")
    return save_figure(figure, path)
