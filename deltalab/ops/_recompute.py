"""Recomputation instead of storage, in two forms the layers and ops share:

- `recomputed`: activation checkpointing of one piece (an elementwise op, or a block's FFN
  branch with `train.recompute_ffn`).
- `rebuildable` / `rebuilt_in_backward`: a cheap op's output, marked with how to make it
  again, is not kept by the ops that save it inside `rebuilt_in_backward`; their backward
  makes it again from the op's inputs, which the op's own backward keeps anyway. The delta
  rule's inputs b, u, g (and a) are such outputs: the Triton kernel saves them for its
  backward, where the gate products and the log decay that made them already keep what they
  were made from (benchmarks/memory_audit.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint


def recomputed(fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """fn(*args), keeping only args for backward: fn's intermediates are computed again when
    the backward needs them (non-reentrant activation checkpointing of one piece). The
    autograd graph is the same, so gradients are the same bit for bit; what it costs is fn's
    forward once more in the backward, for pieces whose intermediates would otherwise be kept
    per token (benchmarks/memory_audit.py): elementwise ops' float32 intermediates, a block's
    FFN branch. fn must draw no random numbers: the RNG state is not saved and restored around
    the recomputation (host work on every call, for nothing here). Without gradients, plain
    fn."""
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in args
    )
    if not needs_grad:
        return fn(*args)
    return torch.utils.checkpoint.checkpoint(
        fn, *args, use_reentrant=False, preserve_rng_state=False
    )


# Off inside `without_rebuild` (a block under activation checkpointing, whose saves the
# checkpoint already drops: a recipe would keep its inputs alive there instead) and inside
# `rebuilding(False)` (a layer with `KernelOptions.rebuild_in_backward` off).
_ENABLED = contextvars.ContextVar("deltalab_rebuild", default=True)
# The attribute of a tensor that holds its `Recipe`.
_RECIPE = "_deltalab_recipe"


class Recipe:
    """fn(*args) again, under no_grad and the autocast state of the forward that made it.
    `args` are held (the tensors among them are what a rebuilt tensor costs); each must be
    unchanged in place when the backward calls the recipe, as autograd requires of saved
    tensors."""

    def __init__(self, fn: Callable[..., torch.Tensor], args: tuple, device_type: str) -> None:
        self.fn, self.args, self.device_type = fn, args, device_type
        self.autocast = (
            torch.is_autocast_enabled(device_type),
            torch.get_autocast_dtype(device_type),
        )
        self.versions = [a._version if isinstance(a, torch.Tensor) else None for a in args]

    def tensors(self) -> list[torch.Tensor]:
        return [a for a in self.args if isinstance(a, torch.Tensor)]

    def __call__(self) -> torch.Tensor:
        for i, (a, version) in enumerate(zip(self.args, self.versions, strict=True)):
            if version is not None and a._version != version:
                raise RuntimeError(
                    f"argument {i} of {getattr(self.fn, '__name__', self.fn)!r}, from which a "
                    "tensor saved for backward is rebuilt, was modified in place after the "
                    "forward"
                )
        enabled, dtype = self.autocast
        with torch.no_grad(), torch.autocast(self.device_type, dtype=dtype, enabled=enabled):
            return self.fn(*self.args)


def rebuildable(out: torch.Tensor, fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """Marks `out` = fn(*args) (the same values bit for bit each time: a deterministic op) as
    rebuilt, not kept, where an op inside `rebuilt_in_backward` saves it. Only for an op whose
    own backward keeps the tensors among args, so that holding them costs nothing. Returns out;
    marks nothing without gradients or where nothing is rebuilt (`_rebuilding`)."""
    if _rebuilding() and torch.is_grad_enabled() and out.requires_grad:
        setattr(out, _RECIPE, (Recipe(fn, args, out.device.type), out._version))
    return out


def rebuildable_call(fn: Callable[..., torch.Tensor], *args: Any, **fixed: Any) -> torch.Tensor:
    """fn(*args, **fixed), marked `rebuildable` by that call: the keywords (resolved choices:
    a backend, a shape) are bound into the recipe, the tensors among args are what the op's
    backward keeps."""
    recipe = functools.partial(fn, **fixed)
    return rebuildable(recipe(*args), recipe, *args)


def _marked(out: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    """out marked as rebuilt by an existing recipe (as `rebuildable` marks it by a new one)."""
    if torch.is_grad_enabled() and out.requires_grad:
        setattr(out, _RECIPE, (recipe, out._version))
    return out


def _rebuilding() -> bool:
    """Whether marked tensors are rebuilt here: outside `without_rebuild` and
    `rebuilding(False)`, not under torch.compile."""
    return _ENABLED.get() and not torch.compiler.is_compiling()


def rebuildable_product(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x * y, marked `rebuildable`: the product's backward keeps both factors (a gate times a
    key or value, before the delta rule)."""
    return rebuildable(x * y, torch.mul, x, y)


def rebuildable_as(t: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """t, the elements of `source` in t's shape (a reshaped view or copy that an op saves in
    source's place, or a view in source's own shape, as autograd hands back a tensor routed
    through a node), marked `rebuildable` as source's rebuilt tensor, reshaped where the shapes
    differ, when source is marked; t unmarked otherwise."""
    recipe = recipe_of(source)
    if recipe is None or t is source:
        return t
    if t.shape == source.shape:
        return _marked(t, recipe)
    return rebuildable(t, _reshaped, recipe, t.shape)


def _reshaped(recipe: Recipe, shape: torch.Size) -> torch.Tensor:
    return recipe().reshape(shape)


def recipe_of(t: torch.Tensor) -> Recipe | None:
    """The recipe `rebuilt_in_backward` would keep in t's place now, or None (unmarked, changed
    in place since, or rebuilding off here)."""
    if not _rebuilding():
        return None
    marked = getattr(t, _RECIPE, None)
    if marked is None or marked[1] != t._version:
        return None
    return marked[0]


def _pack(t: torch.Tensor) -> Any:
    recipe = recipe_of(t)
    return t if recipe is None else recipe


def _unpack(x: Any) -> torch.Tensor:
    return x() if isinstance(x, Recipe) else x


@contextlib.contextmanager
def rebuilt_in_backward() -> Iterator[None]:
    """Inside, a tensor marked by `rebuildable` that an op saves for backward is kept as its
    recipe and made again when the backward reads it. Nothing changes under torch.compile, inside
    `without_rebuild`, or inside `rebuilding(False)`."""
    if not (_rebuilding() and torch.is_grad_enabled()):
        yield
        return
    with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
        yield


@contextlib.contextmanager
def rebuilding(enabled: bool) -> Iterator[None]:
    """Inside, with enabled=False, nothing is marked `rebuildable` nor rebuilt: the ops' saves
    keep what they save (a layer's `KernelOptions.rebuild_in_backward` off, trading memory for
    the rebuilds' time). enabled=True changes nothing (an enclosing block may have turned it
    off). Nothing is set under torch.compile, where nothing is rebuilt anyway (Dynamo does not
    trace ContextVar operations)."""
    if enabled or torch.compiler.is_compiling():
        yield
        return
    token = _ENABLED.set(False)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def without_rebuild(fn: Callable[..., Any]) -> Callable[..., Any]:
    """fn with `rebuilt_in_backward` off inside it: for a block under activation checkpointing,
    whose forward (and its rerun in the backward) keeps nothing anyway."""

    def run(*args: Any, **kwargs: Any) -> Any:
        token = _ENABLED.set(False)
        try:
            return fn(*args, **kwargs)
        finally:
            _ENABLED.reset(token)

    return run
