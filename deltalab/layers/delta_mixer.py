"""`DeltaMixer`, the base of the delta-rule mixers, and its low-rank output gate.

The delta-rule frontend (docs/MATH.md sec. 5) lives once, in `DeltaMixer`: q, k, v projections,
a short causal depthwise convolution with SiLU on each, L2-normalized q and k (q is scaled by
`K^-1/2` inside `delta_rule`), per-head RMSNorm of the output gated by an output-gate
projection, output projection. Its options are one `FrontendOptions`, which every mixer takes
as `options=` or as the same plain keywords (`Muir(hidden_size=..., num_heads=..., head_dim=...)`).
A mixer only adds its gates and its `deltalab.ops.parametrize` call.
"""

from __future__ import annotations

import abc
import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import ClassVar, Unpack, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from deltalab.layers.common import check_hidden, check_mask, check_state_batch
from deltalab.layers.frontend import FrontendKeywords, FrontendOptions, frontend_options
from deltalab.layers.norms import GatedRMSNorm, l2_normalize
from deltalab.layers.projections import concatenation_store
from deltalab.layers.recurrence import identity_at_padding, run_delta_rule
from deltalab.layers.shared_input import project, sharing_autocast_input
from deltalab.layers.short_conv import ShortConvolution, convolve_together, short_conv_backend
from deltalab.layers.states import RecurrentState
from deltalab.ops._checks import require_positive_int
from deltalab.ops._recompute import rebuildable, rebuilding, rebuilt_in_backward
from deltalab.ops.context_parallel import context_group, previous_tail, require_fresh_sequences
from deltalab.ops.norms import layer_backend
from deltalab.ops.parametrize import DeltaRuleInputs

__all__ = ["DeltaMixer"]


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
