"""One autocast copy of a layer's input x shared by its projections: `sharing_autocast_input`
opens the block (computing the declared projections together, `deltalab.layers.projections`),
`project` hands each projection of x its output inside it."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from deltalab.layers.projections import fusable, input_linears, project_together

__all__ = ["project", "shared_autocast_input", "sharing_autocast_input"]


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
