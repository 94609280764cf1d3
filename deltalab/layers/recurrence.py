"""How a delta-rule layer runs `deltalab.ops.delta_rule` over its tokens: `run_delta_rule`
(whole sequences, a decoding step, or a piece under context parallelism), the step's backend,
and padding tokens made identity tokens of the recurrence."""

from __future__ import annotations

from typing import cast

import torch

from deltalab.ops._checks import require_choice
from deltalab.ops._recompute import rebuilt_in_backward
from deltalab.ops.context_parallel import context_group, context_parallel_delta_rule
from deltalab.ops.delta_rule import BACKENDS, delta_rule, delta_rule_step
from deltalab.ops.options import KernelOptions
from deltalab.ops.parametrize import DeltaRuleInputs

__all__ = ["identity_at_padding", "run_delta_rule", "step_backend", "zero_at_padding"]


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
