"""The projections of one input, with one matrix product for their input gradient.

A delta-rule mixer multiplies its input x `[B, T, D]` by up to eight weights: q, k, v, the
output gate's first factor, and its gates' (erase, write, beta, the decay's first factor, the
Kalman noises...). Autograd gives each product its own input gradient, dx_i = dy_i W_i, and adds
them up: under bf16 autocast each dx_i is a bf16 matrix product, cast to float32 (x is the
float32 norm output) and summed there. For a GDN-2 layer of the 340M preset at 4K tokens that
is seven products, seven casts and six float32 sums of `[B T, D]`, about 2 GB of memory traffic
per layer and step, against half a GB for what is done here:

    dx = [dy_1, ..., dy_n] [W_1; ...; W_n]      one product over the concatenated outputs
    [dW_1; ...; dW_n] = [dy_1, ..., dy_n]^T x   one product for every weight gradient

The price is one copy, the concatenation of the output gradients, transient in the backward
(which also waits for every output's gradient before it runs, as any node with several outputs
does). The projections' outputs stay separate tensors: the forward is n products as before, so
nothing a later op keeps for its backward pins a shared buffer.

Precision: the product sums over all n W_i in one float32 accumulator and rounds dx once, where
autograd rounds each dx_i to bf16 and sums in float32; against float64 the two errors are of
the same size (within a few percent in the tests: the bf16 copy of x dominates both).

Only plain, hook-free `nn.Linear` maps are computed from their weights (`fusable`); any other
is called as a module. An output no loss reaches gives its weight no gradient, as autograd
would; forward-mode AD goes through the Function's jvp.

`project_together` is the op; `deltalab.layers.shared_input.sharing_autocast_input` applies it to
a layer's declared projections, and `project` hands each one its output.

Inside `concatenated_weights(store)`, without gradients, the forward is one product too: x times
the maps' weights concatenated (made once, kept in `store`, made again when a weight changes),
its output split into each map's. The static-cache decoder's step runs so: one matrix product
and one kernel launch per layer for its up to eight projections of one token, for a copy of
those weights held as long as the store.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "concatenated_parameters",
    "concatenated_weights",
    "concatenation_store",
    "fusable",
    "input_linears",
    "project_together",
]

# The store of `concatenated_weights`; None outside it.
_CONCATENATED: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "deltalab_concatenated_weights", default=None
)


@contextlib.contextmanager
def concatenated_weights(store: dict) -> Iterator[None]:
    """Inside: `project_together` without gradients makes one product over the maps'
    concatenated weights, kept in `store` (the caller's dict, which holds that copy of the
    weights) by the maps they join and remade when a weight changes (its version, address or
    dtype)."""
    token = _CONCATENATED.set(store)
    try:
        yield
    finally:
        _CONCATENATED.reset(token)


def concatenation_store() -> dict | None:
    """The store of the open `concatenated_weights` block, None outside one (and while
    torch.compile traces: Dynamo breaks its graph at a ContextVar read)."""
    return None if torch.compiler.is_compiling() else _CONCATENATED.get()


def concatenated_parameters(
    store: dict, params: Sequence[torch.Tensor], dtype: torch.dtype
) -> torch.Tensor:
    """`params` (each `[n_i, ...]`, equal trailing shapes) concatenated along dim 0 in `dtype`,
    kept in `store` and made again when one of them changed (address, version) or the dtype
    did."""
    return _kept(store, params, dtype, lambda: torch.cat([p.detach().to(dtype) for p in params]))


def _kept(store: dict, params: Sequence[torch.Tensor], dtype: torch.dtype, make: Callable) -> Any:
    """`make()`, kept in `store` by the identities of `params` and remade when one of them
    changed (address, version) or `dtype` did."""
    key = tuple(id(p) for p in params)
    version = (dtype, *((p.data_ptr(), p._version) for p in params))
    kept = store.get(key)
    if kept is None or kept[0] != version:
        kept = store[key] = (version, make())
    return kept[1]


def _concatenated(
    linears: list[nn.Linear], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The maps' weights `[sum of widths, D]` and biases (None when no map has one) in dtype."""
    weight = torch.cat([lin.weight.detach().to(dtype) for lin in linears])
    if all(lin.bias is None for lin in linears):
        return weight, None
    biases = [
        weight.new_zeros(lin.out_features) if lin.bias is None else lin.bias.detach().to(dtype)
        for lin in linears
    ]
    return weight, torch.cat(biases)


def _project_concatenated(
    x: torch.Tensor, linears: list[nn.Linear], store: dict
) -> dict[nn.Linear, torch.Tensor]:
    """{linear: linear(x)} from one product with the concatenated weights and biases (zeros
    for a map without one)."""
    device = x.device.type
    dtype = x.dtype
    if torch.is_autocast_enabled(device) and x.is_floating_point() and x.dtype != torch.float64:
        dtype = torch.get_autocast_dtype(device)
    params = [p for lin in linears for p in (lin.weight, lin.bias) if p is not None]
    weight, bias = _kept(store, params, dtype, lambda: _concatenated(linears, dtype))
    y = F.linear(x.to(dtype), weight, bias)
    parts = y.split([lin.out_features for lin in linears], dim=-1)
    return dict(zip(linears, parts, strict=True))


def input_linears(module: nn.Module) -> list[nn.Linear]:
    """The linear maps of a projection module that take its input: the module itself (an
    `nn.Linear`), the first map of an `nn.Sequential` (a low-rank projection), or what a module
    lists with an `input_linears()` method of its own (Muir's fused gate projection)."""
    if isinstance(module, nn.Linear):
        return [module]
    if isinstance(module, nn.Sequential) and len(module) and isinstance(module[0], nn.Linear):
        return [module[0]]
    own = getattr(module, "input_linears", None)
    if callable(own):
        return list(own())
    raise TypeError(
        f"a projection of x must be an nn.Linear, an nn.Sequential starting with one, or define "
        f"input_linears(); got {type(module).__name__}"
    )


def fusable(module: nn.Module, kind: type[nn.Module] = nn.Linear) -> bool:
    """Whether a fused kernel may compute this module from its parameters: a plain `kind` (by
    default `nn.Linear`; not a subclass with a forward of its own: quantized, LoRA-style,
    parametrized) with no hook of its own (forward, forward pre-, backward: pruning's mask is a
    pre-hook), which only calling the module would run. `project_together` calls any other map
    as a module, with its own gradient product; the decoding step runs any other norm as a
    module (`deltalab.layers.decode_step.step_rows`). Module-wide hooks
    (`nn.modules.module.register_module_forward_hook`) see no call of a fused module."""
    return type(module) is kind and not (
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
    )


def _cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


class _ProjectTogether(torch.autograd.Function):
    """(x, n, W_1..W_n, b_1..b_n) -> (x W_1^T + b_1, ..., x W_n^T + b_n); a missing bias is
    None. The backward makes one product for dx and one for all the dW (module docstring)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, count: int, *params: torch.Tensor | None) -> tuple:
        weights, biases = params[:count], params[count:]
        return tuple(F.linear(x, w, b) for w, b in zip(weights, biases, strict=True))

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, count, *params = inputs
        ctx.count = count
        ctx.has_bias = [b is not None for b in params[count:]]
        # An output without a gradient reaches backward as None, not as zeros (see backward).
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, *params[:count])
        ctx.save_for_forward(x, *params[:count])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads: torch.Tensor | None) -> tuple:
        x, *weights = ctx.saved_tensors
        rows, count, needs = x.shape[:-1].numel(), ctx.count, ctx.needs_input_grad
        dweights: list[torch.Tensor | None] = [None] * count
        dbiases: list[torch.Tensor | None] = [None] * count
        # An output no loss reached (a gate a hook replaced) has no gradient: left out of the
        # products, and its weight and bias get none (as autograd gives a map alone).
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return (None, None, *dweights, *dbiases)
        widths = [weights[i].shape[0] for i in present]
        dy = _cat([grads[i].reshape(rows, w) for i, w in zip(present, widths, strict=True)], -1)
        dx = None
        if needs[0]:
            dx = (dy @ _cat([weights[i] for i in present], 0)).reshape(x.shape)
        if any(needs[2 + i] for i in present):
            products = (dy.t() @ x.reshape(rows, -1)).split(widths)
            for i, dw in zip(present, products, strict=True):
                dweights[i] = dw if needs[2 + i] else None
        start = 0
        for i, width in zip(present, widths, strict=True):
            if ctx.has_bias[i] and needs[2 + count + i]:
                dbiases[i] = dy[:, start : start + width].sum(0)
            start += width
        return (dx, None, *dweights, *dbiases)

    @staticmethod
    def jvp(ctx, tx: torch.Tensor | None, _count, *tparams: torch.Tensor | None) -> tuple:
        """Forward-mode derivative: tx W_i^T + x tW_i^T + tb_i (each map is linear)."""
        x, *weights = ctx.saved_tensors
        tweights, tbiases = tparams[: ctx.count], tparams[ctx.count :]
        tangents = []
        for w, tw, tb in zip(weights, tweights, tbiases, strict=True):
            t = torch.zeros(*x.shape[:-1], w.shape[0], dtype=x.dtype, device=x.device)
            if tx is not None:
                t = t + F.linear(tx, w)
            if tw is not None:
                t = t + F.linear(x, tw)
            if tb is not None:
                t = t + tb
            tangents.append(t)
        return tuple(tangents)


def project_together(
    x: torch.Tensor, linears: Sequence[nn.Linear]
) -> dict[nn.Linear, torch.Tensor]:
    """{linear: linear(x)} for every linear map of x `[..., D]`, with one matrix product for the
    gradient of x and one for the weights' (module docstring). The forward is each map's own
    product, with the same numbers as calling them one by one.

    Under autocast, x (usually already the autocast copy of the layer input,
    `shared_autocast_input`) and the weights are cast to the autocast dtype here, as autocast
    would cast them for `F.linear`; the gradients return through those casts in the inputs'
    dtypes. Without gradients (inference, gate sensitivity's forward-mode passes under no_grad)
    it is each map called alone.
    """
    linears = list(dict.fromkeys(linears))
    if not all(fusable(lin) for lin in linears):
        # The others are called as modules, on this x. (A layer's shared input leaves them out
        # before this and calls each on a cast node of its own: `_SharedInput.apply`.)
        fused = project_together(x, [lin for lin in linears if fusable(lin)])
        return {lin: fused[lin] if lin in fused else lin(x) for lin in linears}
    if not linears:
        return {}
    weights = [lin.weight for lin in linears]
    biases = [lin.bias for lin in linears]
    wanted = x.requires_grad or any(p.requires_grad for p in (*weights, *biases) if p is not None)
    if not (torch.is_grad_enabled() and wanted):
        store = concatenation_store()
        if store is not None and len(linears) > 1:
            return _project_concatenated(x, linears, store)
        return {lin: lin(x) for lin in linears}
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.is_floating_point() and x.dtype != torch.float64:
        # Autocast's policy for F.linear (float64 is left alone), made explicit: the Function
        # computes in one dtype, forward and backward.
        dtype = torch.get_autocast_dtype(device)
        x = x.to(dtype)
        weights = [w.to(dtype) for w in weights]
        biases = [b if b is None else b.to(dtype) for b in biases]
    outputs = _ProjectTogether.apply(x, len(linears), *weights, *biases)
    return dict(zip(linears, outputs, strict=True))
