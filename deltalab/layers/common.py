"""Pieces shared by every token mixer: short convolution, norms, states, the delta-rule frontend.

Protocol of every mixer: `forward(x [B, T, D], state=None, *, return_gates=False) -> (y [B, T, D],
state)`. Passing the returned state back in with the next tokens (any number of them) continues
the sequence exactly as one forward over the whole sequence would. With `return_gates=True` the
returned state also carries the mixer's intermediate gates in `state.gates` (name -> tensor).

The delta-rule frontend (docs/MATH.md sec. 5) lives once, in `DeltaMixer`: q, k, v projections,
a short causal depthwise convolution with SiLU on each, L2-normalized q and k (q is scaled by
`K^-1/2` inside `delta_rule`), per-head RMSNorm of the output gated by an output-gate
projection, output projection. Its options are one `FrontendOptions`, which every mixer takes
as `options=` or as the same plain keywords (`Muir(hidden_size=..., num_heads=..., head_dim=...)`).
A mixer only adds its gates and its `deltalab.ops.parametrize` call.
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
import dataclasses
import inspect
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, TypedDict, Unpack, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from deltalab.errors import closest
from deltalab.layers.projections import (
    concatenated_parameters,
    concatenation_store,
    fusable,
    input_linears,
    project_together,
)
from deltalab.ops import norms
from deltalab.ops._checks import (
    require_choice,
    require_positive_int,
    require_rank,
    require_shape,
)
from deltalab.ops._recompute import rebuildable, rebuilding, rebuilt_in_backward, recomputed
from deltalab.ops.context_parallel import (
    context_group,
    context_parallel_delta_rule,
    previous_tail,
    require_fresh_sequences,
)
from deltalab.ops.delta_rule import (
    BACKENDS,
    delta_rule,
    delta_rule_step,
    require_chunk_size,
)
from deltalab.ops.norms import L2_EPS, layer_backend
from deltalab.ops.norms.reference import (
    _RMSNormFunction,  # noqa: F401 (importable here, where it was)
    compute_dtype,
    rms_norm_naive,
    rms_norm_torch,
)
from deltalab.ops.options import DEFAULT_OPTIONS, KernelOptions
from deltalab.ops.parametrize import DeltaRuleInputs
from deltalab.ops.short_conv import BACKENDS as SHORT_CONV_BACKENDS
from deltalab.ops.short_conv import resolve_backend as resolve_short_conv_backend
from deltalab.ops.short_conv import short_conv

__all__ = [
    "GATE_ACTIVATIONS",
    "AttentionState",
    "DeltaMixer",
    "FrontendKeywords",
    "FrontendOptions",
    "GatedRMSNorm",
    "RMSNorm",
    "RecurrentState",
    "ShortConvolution",
    "check_hidden",
    "check_mask",
    "check_state_batch",
    "compute_dtype",
    "frontend_options",
    "identity_at_padding",
    "l2_normalize",
    "no_weight_decay",
    "project",
    "recomputed",
    "require_positive_int",
    "run_delta_rule",
    "shared_autocast_input",
    "sharing_autocast_input",
    "short_conv_backend",
    "step_backend",
    "zero_at_padding",
]

GATE_ACTIVATIONS = norms.ACTIVATIONS


@dataclass(frozen=True, kw_only=True)
class FrontendOptions:
    """The options of the delta-rule frontend that every `DeltaMixer` shares (see `DeltaMixer`).

    hidden_size: D. num_heads: H. head_dim: K. value_dim: V (None: K).
    conv_size: kernel of the short convolutions. chunk_size: tokens per chunk, 16..256.
    backend: `delta_rule`'s backend for whole sequences ("auto", "naive", "chunk", "triton"),
        which the short convolutions follow (`short_conv_backend`).
    gate_activation: "sigmoid" or "silu" on the output gate, None for the mixer's default.
    norm_eps: of the output RMSNorm.
    kernel_options: the `KernelOptions` of the Triton delta rule (and of the rebuilding of its
        cheap inputs in the backward, `rebuild_in_backward`); the defaults measured best.
    """

    hidden_size: int
    num_heads: int
    head_dim: int
    value_dim: int | None = None
    conv_size: int = 4
    chunk_size: int = 64
    backend: str = "auto"
    gate_activation: str | None = None
    norm_eps: float = 1e-5
    kernel_options: KernelOptions = DEFAULT_OPTIONS

    def __post_init__(self) -> None:
        require_positive_int("hidden_size", self.hidden_size)
        require_positive_int("num_heads", self.num_heads)
        require_positive_int("head_dim", self.head_dim)
        value_dim = self.head_dim if self.value_dim is None else self.value_dim
        # Frozen: the resolved V is written once here, so every reader sees an int.
        object.__setattr__(self, "value_dim", require_positive_int("value_dim", value_dim))
        require_positive_int("conv_size", self.conv_size)
        require_chunk_size(self.chunk_size)
        require_choice("backend", self.backend, BACKENDS)
        if self.gate_activation is not None:
            require_choice("gate_activation", self.gate_activation, GATE_ACTIVATIONS)
        if not isinstance(self.kernel_options, KernelOptions):
            raise TypeError(
                "kernel_options must be a deltalab.ops.options.KernelOptions, got "
                f"{type(self.kernel_options).__name__}"
            )


class FrontendKeywords(TypedDict, total=False):
    """`FrontendOptions` as keyword arguments of a mixer: type checkers see every keyword."""

    hidden_size: int
    num_heads: int
    head_dim: int
    value_dim: int | None
    conv_size: int
    chunk_size: int
    backend: str
    gate_activation: str | None
    norm_eps: float
    kernel_options: KernelOptions


FRONTEND_FIELDS = tuple(f.name for f in dataclasses.fields(FrontendOptions))


def frontend_options(
    options: FrontendOptions | None, keywords: Mapping[str, object], mixer: type
) -> FrontendOptions:
    """The frontend options of a `mixer` constructed with `options` or with the plain
    frontend `keywords` (the rest of its keyword arguments), not both.

    A keyword that is neither a frontend option nor one of the mixer's own arguments is refused
    by name, with the closest valid one: the keywords arrive through `**`, so Python no longer
    does that.
    """
    unknown = sorted(set(keywords) - set(FRONTEND_FIELDS))
    if unknown:
        parameters = inspect.signature(mixer.__init__).parameters.values()
        own = [p.name for p in parameters if p.kind == p.KEYWORD_ONLY]
        valid = [*FRONTEND_FIELDS, *own]
        raise TypeError(
            f"{mixer.__name__} got an unexpected keyword argument {unknown[0]!r}"
            f"{closest(unknown[0], valid)}"
        )
    if options is None:
        return FrontendOptions(**keywords)  # type: ignore[arg-type]
    if not isinstance(options, FrontendOptions):
        raise TypeError(f"options must be a FrontendOptions or None, got {type(options).__name__}")
    if keywords:
        raise TypeError(
            f"{mixer.__name__} takes options or the frontend keywords, not both: got options "
            f"and {sorted(keywords)}"
        )
    return options


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


class _SharedCast(torch.autograd.Function):
    """`cast`, a copy of x made once, as one more use of x: the gradient goes back to x in its
    dtype through this node alone, as through the cast autocast makes for each use."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cast: torch.Tensor) -> torch.Tensor:
        ctx.dtype = x.dtype
        return cast.view_as(cast)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.dtype), None


def shared_autocast_input(x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Hands out x as autocast would cast it for a matrix product, all from one copy.

    Under autocast every `nn.Linear` casts a float32 input anew and keeps its cast for backward:
    n projections of x keep n equal copies. The returned function gives each projection x in the
    autocast dtype of its device as a view of one copy made here, through its own graph node, so
    each gradient returns to x in x's dtype and they add up there as before: forward and
    backward are unchanged, and the projections keep one copy between them. Without autocast on
    x's device (or for float64 x, which autocast leaves alone) it gives x itself.
    """
    device = x.device.type
    if not (
        x.is_floating_point()
        and x.dtype != torch.float64
        and torch.amp.is_autocast_available(device)
        and torch.is_autocast_enabled(device)
    ):
        return lambda: x
    cast = x.detach().to(torch.get_autocast_dtype(device))
    if cast.dtype == x.dtype:
        return lambda: x
    return lambda: _SharedCast.apply(x, cast)


class _SharedInput:
    """What `sharing_autocast_input(x, projections)` shares while its block runs: x, the
    function that hands out its autocast copy, and the outputs of the declared projections
    (`project_together`), each handed out by `project`."""

    def __init__(
        self,
        x: torch.Tensor,
        x_in: Callable[[], torch.Tensor],
        projections: Sequence[nn.Module],
    ) -> None:
        self.x, self.x_in = x, x_in
        # A map `project_together` cannot compute from its weight (`fusable`) is left to
        # `apply`, which calls it as a module.
        linears = [lin for proj in projections for lin in input_linears(proj) if fusable(lin)]
        self.outputs = project_together(x_in(), linears) if linears else {}

    def apply(self, proj: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """proj(x): a declared linear map's output, a low-rank projection's second factor
        applied to its first's, or (not declared) proj of the autocast copy."""
        if isinstance(proj, nn.Linear) and proj in self.outputs:
            return self.outputs[proj]
        if isinstance(proj, nn.Sequential) and len(proj) and proj[0] in self.outputs:
            y = self.outputs[proj[0]]
            for module in list(proj)[1:]:
                y = module(y)
            return y
        return proj(self.x_in())


# The input a layer's forward is sharing (`sharing_autocast_input`); None outside such a forward.
_SHARED_INPUT: contextvars.ContextVar[_SharedInput | None] = contextvars.ContextVar(
    "deltalab_shared_autocast_input", default=None
)


@contextlib.contextmanager
def sharing_autocast_input(
    x: torch.Tensor, projections: Sequence[nn.Module] = ()
) -> Iterator[Callable[[], torch.Tensor]]:
    """`shared_autocast_input(x)`, whose copy `project(proj, x)` also hands to the projections
    of x made inside the block: the gates' projections, computed by methods that take x itself
    (and read its dtype), keep no copy of their own. Nested blocks share their own input.

    projections: the layer's projections of x (`nn.Linear`, low-rank `nn.Sequential`, or a
    module with `input_linears()`), computed here by `project_together`, so that their input
    gradient is one matrix product (`deltalab.layers.projections`); `project` hands each its
    output. A projection left out still works, with a product of its own.
    """
    x_in = shared_autocast_input(x)
    if torch.compiler.is_compiling():
        # Dynamo does not trace ContextVar operations (each would break the graph); the compiled
        # graph has the gates' casts of x in one graph, where the compiler can merge them.
        yield x_in
        return
    token = _SHARED_INPUT.set(_SharedInput(x, x_in, projections))
    try:
        yield x_in
    finally:
        _SHARED_INPUT.reset(token)


def project(proj: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """proj(x), inside `sharing_autocast_input(x, ...)` (the same tensor x, not an equal one)
    from what that block shares: the output it computed for a declared projection, else proj
    of its autocast copy of x; outside such a block proj(x). The same numbers either way, up to
    the order of a matrix product's sums: autocast would cast x for proj's product all the
    same."""
    if torch.compiler.is_compiling():
        return proj(x)
    shared = _SHARED_INPUT.get()
    if shared is not None and shared.x is x:
        return shared.apply(proj)
    return proj(x)


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS, *, backend: str = "auto") -> torch.Tensor:
    """x / sqrt(||x||^2 + eps) over the last dim, computed in at least float32; x's dtype out
    (`deltalab.ops.norms.l2_normalize`: keeps its output and 1/norm per row for backward)."""
    return norms.l2_normalize(x, eps, backend=backend)


class ShortConvolution(nn.Module):
    """Causal depthwise conv1d followed by SiLU, with a cache of the last `kernel_size - 1` inputs.

    The cache makes decoding exact: the convolution over `[cache, x]` is the one the full sequence
    would have seen, for any number of new tokens. The weight is stored `[C, 1, W]`, as
    nn.Conv1d's, whichever backend runs it.
    """

    def __init__(self, channels: int, kernel_size: int = 4) -> None:
        super().__init__()
        self.channels = require_positive_int("channels", channels)
        self.kernel_size = require_positive_int("conv_size", kernel_size)
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        # Same initialization as nn.Conv1d.
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(
        self, x: torch.Tensor, cache: torch.Tensor | None = None, *, backend: str = "torch"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[B, T, C]`, cache `[B, C, W-1]` (zeros when None) -> (y `[B, T, C]`, new cache).

        backend: `short_conv`'s ("auto", "naive", "torch", "triton"; a mixer passes
        `short_conv_backend(its backend)`). "torch" is the grouped conv1d path, whose
        intermediates are computed again in the backward rather than kept (`recomputed`);
        the others run `short_conv`.
        """
        batch, _, channels = x.shape
        if cache is not None:
            width = self.kernel_size - 1
            require_shape("conv cache", cache, (batch, channels, width), "[B, C, W-1]")
        return convolve(x, self.weight, cache, backend)


def convolve(
    x: torch.Tensor, weight: torch.Tensor, cache: torch.Tensor | None, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ShortConvolution.forward` with its weight `[C, 1, W]` given: x `[B, T, C]`, cache
    `[B, C, W-1]` or None -> (y `[B, T, C]`, new cache)."""
    batch, length, channels = x.shape
    kernel_size = weight.shape[-1]
    require_choice("backend", backend, SHORT_CONV_BACKENDS)
    if resolve_short_conv_backend(backend, x.device, kernel_size) != "torch":
        # short_conv takes the cache: decoding steps (T = 1) run on the same kernels.
        return short_conv(x, weight, cache, backend=backend)
    x_t = x.transpose(1, 2)
    if cache is None:
        cache = x_t.new_zeros(batch, channels, kernel_size - 1)
    padded = torch.cat([cache.to(x_t.dtype), x_t], dim=-1)
    # Keeps the padded input for backward, not the convolution's output (`recomputed`).
    y = recomputed(_conv_silu, padded, weight)
    return y.transpose(1, 2), padded[..., length:]


def convolve_together(
    convs: Sequence[ShortConvolution],
    xs: Sequence[torch.Tensor],
    caches: Sequence[torch.Tensor],
    store: dict,
    backend: str,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`conv(x, cache)` for each (conv, x `[B, T, C_i]`, cache `[B, C_i, W-1]`) as one depthwise
    convolution over their channels concatenated (the convolution is per channel, so the same
    numbers), the weights concatenated once into `store` (`concatenated_weights`) -> (the ys
    concatenated `[B, T, sum C_i]`, the new caches, views of one tensor)."""
    weights = [conv.weight for conv in convs]
    weight = concatenated_parameters(store, weights, weights[0].dtype)
    widths = [conv.channels for conv in convs]
    y, cache = convolve(torch.cat(list(xs), -1), weight, torch.cat(list(caches), 1), backend)
    return y, list(cache.split(widths, dim=1))


def short_conv_backend(backend: str, dtype: torch.dtype) -> str:
    """The short convolutions' backend for a mixer whose delta rule runs on `backend`, with
    inputs of `dtype`: the convolutions take the same kind of path as the delta rule.

    "triton" -> "triton" (the kernels: CUDA, or CPU under TRITON_INTERPRET=1). "auto" -> "auto"
    (Triton on CUDA, conv1d elsewhere; `short_conv`), except float64, which stays in PyTorch as
    the delta rule's "auto" keeps it (the kernels compute in float32). "chunk", "naive" ->
    "torch": the PyTorch paths stay PyTorch end to end, which forward-mode AD needs (gate
    sensitivity switches layers to "chunk" for that; the Triton Function defines no jvp).
    """
    # The norms' mapping (`layer_backend`), with short_conv's "auto" kept off float64.
    follow = layer_backend(backend)
    return "torch" if follow == "auto" and dtype == torch.float64 else follow


def _conv_silu(padded: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SiLU of the depthwise causal convolution of `padded [B, C, W-1+T]`: `[B, C, T]`."""
    return F.silu(F.conv1d(padded, weight.to(padded.dtype), groups=padded.shape[1]))


# The norm modules' torch path (`_dispatch_rms_norm` looks `rms_norm` up here on each call, so
# gate sensitivity can swap in the formula). `rms_norm_reference`: x / rms(x) * weight over the
# last dim, times activation(gate) when a gate is given, in at least float32, left to autograd
# (`deltalab.ops.norms`' "naive" backend); `rms_norm`: the same bit for bit, keeping less for
# backward (`_RMSNormFunction`, the "torch" backend).
rms_norm_reference = rms_norm_naive
rms_norm = rms_norm_torch


def _dispatch_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    gate: torch.Tensor | None,
    activation: str,
    backend: str,
) -> torch.Tensor:
    """The norm modules' path, x's dtype out: the Triton kernels or the formula when `backend`
    resolves to them (`norms.resolve_backend`), else this module's `rms_norm` (the torch path,
    looked up here so that tests can swap it for the formula)."""
    resolved = norms.resolve_backend(backend, x)
    if resolved == "torch":
        return rms_norm(x, weight, eps, gate, activation).to(x.dtype)
    return norms.rms_norm(x, weight, eps, gate, activation, out_dtype=x.dtype, backend=resolved)


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dim `[..., dim]`, computed in at least float32.

    backend: `deltalab.ops.norms`' ("auto": the Triton kernels on CUDA, else the torch path).
    """

    def __init__(self, dim: int, eps: float = 1e-5, *, backend: str = "auto") -> None:
        super().__init__()
        self.dim = require_positive_int("dim", dim)
        self.eps = eps
        self.backend = require_choice("backend", backend, norms.BACKENDS)
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _dispatch_rms_norm(x, self.weight, self.eps, None, "sigmoid", self.backend)


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm of `o [..., dim]` multiplied by `activation(gate [..., dim])`.

    One weight `[dim]` shared by the heads (fla's `FusedRMSNormGated`).
    """

    def __init__(self, dim: int, eps: float = 1e-5, activation: str = "sigmoid") -> None:
        super().__init__()
        self.dim = require_positive_int("dim", dim)
        self.eps = eps
        self.activation = require_choice("gate_activation", activation, GATE_ACTIVATIONS)
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(
        self, o: torch.Tensor, gate: torch.Tensor, *, backend: str = "auto"
    ) -> torch.Tensor:
        """backend: `deltalab.ops.norms`'; a mixer passes its delta rule's (`layer_backend`)."""
        return _dispatch_rms_norm(o, self.weight, self.eps, gate, self.activation, backend)


@dataclass
class RecurrentState:
    """What a delta-rule mixer needs to continue a sequence.

    memory: `[B, H, K, V]`, float32 (float64 for float64 inputs) whatever the activations' dtype.
    conv_q, conv_k: `[B, H*K, W-1]`; conv_v: `[B, H*V, W-1]`: the last W-1 projected inputs.
    gates: the mixer's gates over the tokens of this call when asked for (`return_gates=True`),
        e.g. beta `[B, T, H]`, g `[B, T, H]` or `[B, T, H, K]`, erase `[B, T, H, K]`.
    in_place: a one-token step writes the new memory into `memory` instead of a new tensor
        (the returned state holds the same tensor). Set by the static-cache decoder on its own
        buffers, which a captured CUDA graph reads at fixed addresses; False everywhere else,
        so a state passed to a mixer is never modified.
    """

    memory: torch.Tensor
    conv_q: torch.Tensor
    conv_k: torch.Tensor
    conv_v: torch.Tensor
    gates: dict[str, torch.Tensor] | None = None
    in_place: bool = False


@dataclass
class AttentionState:
    """What softmax attention needs to continue a sequence.

    key: `[B, S, H, K]` (RoPE already applied), value: `[B, S, H, V]`: the cached tokens, the
        last `window - 1` of them under a sliding window; offset: the position of the next token.
    gates: empty dict when asked for (softmax attention has no gates), else None.
    key_mask: `[B, S]`, False at cached padding tokens; None when no padding was seen.
    """

    key: torch.Tensor
    value: torch.Tensor
    offset: int
    gates: dict[str, torch.Tensor] | None = None
    key_mask: torch.Tensor | None = None


def step_backend(backend: str) -> str:
    """`delta_rule_step`'s backend in a layer whose whole sequences run on `backend`: "auto"
    for "auto" and "triton" (the fused kernel, or the token loop where a step needs gradients,
    which the kernel does not record), the token loop ("naive") for the PyTorch paths ("chunk",
    "naive"). So a model switched to a PyTorch backend (to compare backends, or for gate
    sensitivity's forward-mode probes) decodes in PyTorch too."""
    require_choice("backend", backend, BACKENDS)
    return "auto" if backend in ("auto", "triton") else "naive"


def run_delta_rule(
    inputs: DeltaRuleInputs,
    memory: torch.Tensor | None,
    *,
    chunk_size: int,
    backend: str = "auto",
    in_place: bool = False,
    options: KernelOptions | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The one place where a mixer's recurrent-vs-chunked choice is made.

    inputs: q, b `[B, T, H, K]`, a `[B, T, H(, K)]`, u `[B, T, H, V]`, g `[B, T, H(, K)]`;
    memory `[B, H, K, V]` or None (zeros); options: `delta_rule`'s for whole sequences.
    Returns (o `[B, T, H, V]`, new memory `[B, H, K, V]`). One token continuing a state is a
    decoding step: the token update, with none of the chunked path's padding; with `in_place`
    it overwrites `memory` (see `RecurrentState.in_place`).
    """
    if memory is not None and inputs.q.shape[1] == 1:
        o, memory = delta_rule_step(
            *(x[:, 0] for x in inputs), memory, backend=step_backend(backend), in_place=in_place
        )
        return o.unsqueeze(1), memory

    def run(q, a, b, u, g, initial_state):
        # output_final_state=True always returns the state.
        o, final = delta_rule(
            q, a, b, u, g,
            initial_state=initial_state,
            output_final_state=True,
            chunk_size=chunk_size,
            backend=backend,
            options=options,
        )  # fmt: skip
        return o, cast(torch.Tensor, final)

    # Inputs that a cheap op made from tensors its backward keeps (the gate products, the log
    # decay) are made again in the backward instead of kept a second time (`rebuildable`).
    with rebuilt_in_backward():
        group = context_group()
        if group is not None:
            # This rank's piece of sequences split over the group (mixers refuse a state then).
            return context_parallel_delta_rule(run, *inputs, group)
        return run(*inputs, memory)


def zero_at_padding(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x `[B, T, ...]` with zeros where mask `[B, T]` is False (exact even for inf/NaN there)."""
    keep = mask.reshape(*mask.shape, *([1] * (x.dim() - 2)))
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))


def identity_at_padding(inputs: DeltaRuleInputs, mask: torch.Tensor) -> DeltaRuleInputs:
    """Turns padding tokens (mask `[B, T]` False) into identity tokens of the delta rule:
    q = a = b = u = 0 and g = 0, so they neither decay, erase nor write."""
    return DeltaRuleInputs(*(zero_at_padding(x, mask) for x in inputs))


def output_gate_projection(hidden_size: int, width: int, rank: int | None) -> nn.Module:
    """hidden -> width: full rank (no bias), or `hidden -> rank -> width` (bias, as fla KDA)."""
    if rank is None:
        return nn.Linear(hidden_size, width, bias=False)
    rank = require_positive_int("gate_rank", rank)
    return nn.Sequential(nn.Linear(hidden_size, rank, bias=False), nn.Linear(rank, width))


# gates by name -> gates by name (see `DeltaMixer.register_gate_hook`).
GateHook = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


class DeltaMixer(nn.Module, abc.ABC):
    """Base of the delta-rule mixers: the shared frontend around `deltalab.ops.delta_rule`.

    Subclasses define their gates apart from the memory: `gates(x)` computes them from the
    hidden states, `inputs_from_gates(q, k, v, gates)` turns them into the primitive's inputs
    (its parametrization). `primitive_inputs` calls both, with the hooks of
    `register_gate_hook` in between (gate sensitivity perturbs gates there). Shapes: x
    `[B, T, D]`, q/k `[B, T, H, K]`, v/o `[B, T, H, V]`, memory `[B, H, K, V]`.

    A subclass's constructor takes `options: FrontendOptions | None`, its own keyword arguments
    and `**frontend: Unpack[FrontendKeywords]`, and passes options and frontend on to this one;
    one that needs the options first (e.g. for a default rank) resolves them with
    `frontend_options` and passes the result alone.

    Args:
        options: the frontend's `FrontendOptions` (`self.options` keeps them, resolved), or
            None with the same as plain keywords (`hidden_size=..., num_heads=..., ...`).
        gate_rank: rank of the output-gate projection, None for full rank.
    """

    # The output gate's activation when the options leave it None.
    default_gate_activation: ClassVar[str] = "silu"

    def __init__(
        self,
        options: FrontendOptions | None = None,
        *,
        gate_rank: int | None = None,
        **frontend: Unpack[FrontendKeywords],
    ) -> None:
        super().__init__()
        options = frontend_options(options, frontend, type(self))
        activation = options.gate_activation or self.default_gate_activation
        self.options = dataclasses.replace(options, gate_activation=activation)
        hidden_size, num_heads, head_dim = options.hidden_size, options.num_heads, options.head_dim
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
        self.value_dim = cast(int, options.value_dim)
        self.chunk_size, self.backend = options.chunk_size, options.backend
        self.kernel_options = options.kernel_options
        conv_size, norm_eps = options.conv_size, options.norm_eps
        key_width, value_width = num_heads * head_dim, num_heads * self.value_dim
        self.q_proj = nn.Linear(hidden_size, key_width, bias=False)
        self.k_proj = nn.Linear(hidden_size, key_width, bias=False)
        self.v_proj = nn.Linear(hidden_size, value_width, bias=False)
        self.q_conv = ShortConvolution(key_width, conv_size)
        self.k_conv = ShortConvolution(key_width, conv_size)
        self.v_conv = ShortConvolution(value_width, conv_size)
        self.g_proj = output_gate_projection(hidden_size, value_width, gate_rank)
        self.o_norm = GatedRMSNorm(self.value_dim, eps=norm_eps, activation=activation)
        self.o_proj = nn.Linear(value_width, hidden_size, bias=False)
        # An OrderedDict, as nn.Module's own hooks: RemovableHandle holds a weak reference to it.
        self._gate_hooks: OrderedDict[int, GateHook] = OrderedDict()

    def projections_of_x(self) -> tuple[nn.Module, ...]:
        """Every projection of the input x this mixer makes: q, k, v, the output gate's, then
        `gate_projections()`. They are computed together (`sharing_autocast_input`): one
        matrix product for x's gradient instead of a product, a cast and a sum per projection."""
        return (self.q_proj, self.k_proj, self.v_proj, self.g_proj, *self.gate_projections())

    def gate_projections(self) -> tuple[nn.Module, ...]:
        """The projections of x that `gates(x)` makes through `project` (none here). One left
        out is still correct, with a product and a gradient sum of its own; the tests check that
        every mixer lists all of its own."""
        return ()

    # Not abstract: a subclass written before `gates` existed overrides `primitive_inputs`
    # instead, and keeps working (without gate hooks).
    def gates(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """x `[B, T, D]` -> the mixer's gates by name (shapes in each class's docstring)."""
        raise NotImplementedError(f"{type(self).__name__} does not define gates(x)")

    def inputs_from_gates(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: dict[str, torch.Tensor]
    ) -> DeltaRuleInputs:
        """Unit-norm q, k `[B, T, H, K]`, v `[B, T, H, V]` and `gates(x)` -> the primitive's
        `(q, a, b, u, g)`."""
        raise NotImplementedError(f"{type(self).__name__} does not define inputs_from_gates")

    def register_gate_hook(self, hook: GateHook) -> RemovableHandle:
        """Calls `hook(gates)` on every forward between `gates` and `inputs_from_gates`; what it
        returns replaces the gates (also those `return_gates=True` reports). Returns a handle
        whose `remove()` takes the hook away."""
        handle = RemovableHandle(self._gate_hooks)
        self._gate_hooks[handle.id] = hook
        return handle

    def hooked_gates(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """`gates(x)` passed through the registered gate hooks, in registration order."""
        gates = self.gates(x)
        for hook in self._gate_hooks.values():
            gates = hook(gates)
        return gates

    def reported_gates(self, gates: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The gates a forward reports (`return_gates=True`) from those it passed to
        `inputs_from_gates`: the same, unless a mixer fuses a gate into its use (Muir's read
        gate, `FusedGateMixer.hooked_gates`; GDN-2's and Muir's erase and write gates on
        Triton, `gdn2.products_fuse`)."""
        return gates

    def primitive_inputs(
        self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[DeltaRuleInputs, dict[str, torch.Tensor]]:
        """x `[B, T, D]`, unit-norm q, k `[B, T, H, K]`, v `[B, T, H, V]` -> the primitive's
        `(q, a, b, u, g)` and the gates by name (as passed to `inputs_from_gates`; a forward
        reports them through `reported_gates`)."""
        gates = self.hooked_gates(x)
        return self.inputs_from_gates(q, k, v, gates), gates

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
    ) -> tuple[torch.Tensor, RecurrentState]:
        """The gates and the memory update: x, q, k, v as in `primitive_inputs`, the incoming
        state, the new conv caches `(conv_q, conv_k, conv_v)`, the padding mask `[B, T]` or
        None -> (o `[B, T, H, V]`, new state).

        Mixers whose state holds more than the memory (KDN's uncertainty) override this.
        """
        inputs, gates = self.primitive_inputs(x, q, k, v)
        if mask is not None:
            inputs = identity_at_padding(inputs, mask)
        memory, in_place = (None, False) if state is None else (state.memory, state.in_place)
        o, memory = run_delta_rule(
            inputs, memory, chunk_size=self.chunk_size, backend=self.backend, in_place=in_place,
            options=self.kernel_options,
        )  # fmt: skip
        reported = self.reported_gates(gates) if return_gates else None
        return o, RecurrentState(memory, *conv, reported)

    def forward(
        self,
        x: torch.Tensor,
        state: RecurrentState | None = None,
        *,
        mask: torch.Tensor | None = None,
        return_gates: bool = False,
    ) -> tuple[torch.Tensor, RecurrentState]:
        """x `[B, T, D]`, state from a previous call or None, mask `[B, T]` (False at padding
        tokens, which leave the state as it was) -> (y `[B, T, D]`, new state)."""
        check_hidden(x, self.hidden_size)
        if state is not None and not isinstance(state, RecurrentState):
            raise TypeError(f"state must be a RecurrentState or None, got {type(state).__name__}")
        if state is not None:
            check_state_batch("state.memory", state.memory, x, "[B, H, K, V]")
        mask = check_mask(mask, x)
        # One autocast copy of x kept for the projections, the gates' included, instead of one
        # by each, and one matrix product for their input gradient (`projections_of_x`). The
        # cheap inputs of the delta rule and of the norm are rebuilt in the backward unless the
        # options keep them (`rebuilding`).
        with (
            rebuilding(self.kernel_options.rebuild_in_backward),
            sharing_autocast_input(x, self.projections_of_x()),
        ):

            def projected(proj: nn.Module) -> torch.Tensor:
                # Padding enters the short convolutions as zeros, as the zero cache does before a
                # prompt.
                y = project(proj, x)
                return y if mask is None else y * mask.unsqueeze(-1).to(y.dtype)

            # The short convolutions and the norms follow the delta rule's backend (read here, on
            # every call, so a layer switched to another backend, as gate sensitivity does, takes
            # them along): Triton where it runs, PyTorch with "chunk" or "naive".
            conv_backend = short_conv_backend(self.backend, x.dtype)
            norm_backend = layer_backend(self.backend)
            xs = [projected(p) for p in (self.q_proj, self.k_proj, self.v_proj)]
            q, k, v, conv = self.convolved(
                xs, self.conv_caches(xs, state, mask), conv_backend, norm_backend
            )
            o, new_state = self.recurrence(x, q, k, v, state, conv, return_gates, mask)
            gate = self.output_gate(x)
            # The norm keeps the gate for its backward unless the gate is made again there
            # (a low-rank gate, `output_gate`).
            with rebuilt_in_backward():
                normed = self.o_norm(o, gate, backend=norm_backend)
            return self.o_proj(normed.flatten(-2)), new_state

    def conv_caches(
        self,
        xs: list[torch.Tensor],
        state: RecurrentState | None,
        mask: torch.Tensor | None,
    ) -> Sequence[torch.Tensor | None]:
        """The short convolutions' caches for the projected q, k, v `xs`: the state's (None:
        zeros), or under context parallelism (`deltalab.ops.context_parallel`) the previous
        rank's last inputs."""
        group = context_group()
        if group is None:
            return (None,) * 3 if state is None else (state.conv_q, state.conv_k, state.conv_v)
        require_fresh_sequences(state, mask)
        width = self.q_conv.kernel_size - 1
        return [previous_tail(x, width, group) for x in xs]

    def convolved(
        self,
        xs: list[torch.Tensor],
        caches: Sequence[torch.Tensor | None],
        conv_backend: str,
        norm_backend: str,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """The projected q, k, v `xs [B, T, H*K or H*V]` through their short convolutions
        continuing `caches`, q and k made unit-norm per head -> (q, k `[B, T, H, K]`,
        v `[B, T, H, V]`, the new caches (conv_q, conv_k, conv_v)). Without gradients inside
        `concatenated_weights` (the static decoder's step), one convolution over the three's
        channels and one norm over q's and k's heads: the same numbers, per channel and per
        head, with two and one launches fewer."""
        heads, key_dim = self.num_heads, self.head_dim
        convs = (self.q_conv, self.k_conv, self.v_conv)
        store = concatenation_store()
        if store is not None and caches[0] is not None and not torch.is_grad_enabled():
            y, new = convolve_together(convs, xs, caches, store, conv_backend)  # type: ignore[arg-type]
            # q and k are neighbours in the joint output: one norm over their 2 H heads.
            qk = y[..., : 2 * heads * key_dim].unflatten(-1, (2 * heads, key_dim))
            q, k = l2_normalize(qk, backend=norm_backend).split(heads, dim=-2)
            v = y[..., 2 * heads * key_dim :].unflatten(-1, (heads, self.value_dim))
            return q, k, v, tuple(new)
        pairs = [
            conv(x, cache, backend=conv_backend)
            for conv, x, cache in zip(convs, xs, caches, strict=True)
        ]
        q, k, v = (y for y, _ in pairs)
        q = l2_normalize(q.unflatten(-1, (heads, key_dim)), backend=norm_backend)
        k = l2_normalize(k.unflatten(-1, (heads, key_dim)), backend=norm_backend)
        return q, k, v.unflatten(-1, (heads, self.value_dim)), tuple(c for _, c in pairs)

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        """The output gate `[B, T, H, V]` from x `[B, T, D]` (inside the forward's
        `sharing_autocast_input` block). A low-rank gate `hidden -> rank -> H*V` whose second
        factor is a plain `nn.Linear` is marked `rebuildable` from its first factor's output,
        which the second factor's backward keeps anyway: the gated norm then does not keep the
        gate (`rebuilt_in_backward`), and its backward makes it again, one rank x H*V product,
        saving H*V 16-bit values a token and layer (benchmarks/memory_audit.py). A full-rank gate
        would cost a D x H*V product again and is kept."""
        proj, shape = self.g_proj, (self.num_heads, self.value_dim)
        if not _low_rank_linear(proj):
            return project(proj, x).unflatten(-1, shape)
        inner = project(proj[0], x)
        second = proj[1]
        gate = second(inner).unflatten(-1, shape)
        # The recipe holds the weight and bias the forward used, not the module: a parameter
        # replaced or updated in place before the backward then fails the recipe's version
        # check (as for any saved tensor) instead of rebuilding another gate.
        return rebuildable(gate, low_rank_gate, inner, second.weight, second.bias, shape)


def _low_rank_linear(proj: nn.Module) -> bool:
    """Whether `proj` is a low-rank product `Sequential(first, nn.Linear)` whose second factor's
    output `F.linear` makes again bit for bit: exactly an `nn.Linear` (not a subclass, wrapper or
    parametrized copy, as LoRA, spectral norm or FSDP per module make it) with no hooks (which
    may change its output, or count its calls)."""
    if not (isinstance(proj, nn.Sequential) and len(proj) == 2):
        return False
    second = proj[1]
    hooks = (
        second._forward_hooks,
        second._forward_pre_hooks,
        second._backward_hooks,
        second._backward_pre_hooks,
    )
    return type(second) is nn.Linear and not any(hooks)


def low_rank_gate(
    inner: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    shape: tuple[int, int],
) -> torch.Tensor:
    """A low-rank gate's second factor again (`DeltaMixer.output_gate`'s recipe): nn.Linear's
    own forward, so the same values bit for bit."""
    return F.linear(inner, weight, bias).unflatten(-1, shape)
