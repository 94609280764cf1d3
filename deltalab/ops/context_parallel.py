"""Context parallelism: one sequence split over the ranks of a process group.

Rank r of a group of N holds tokens `[r T/N, (r+1) T/N)` of every sequence. The recurrences that
cross rank boundaries are carried by composing spans, each rank's computed locally at once:

- The delta rule (`delta_rule/README.md`'s convention, `S [K, V]`). Over a span the state
  transition is affine: `S_end = A S_start + B_span`, `A = prod_t (I - a_t b_t^T) D_t` `[K, K]`
  and `B_span` the span's final state from zero. One call of the primitive gives both, and the
  outputs: run with the values `[u, 0]` (V + K columns) from the initial state `[0, I]`, its
  final state is `[B_span, A]`, its outputs `[o0, R]`, where `o0` are the outputs from a zero
  state and `R_t = scale A_{1..t}^T q_t` `[K]` the read of the initial state, so that with the
  true initial state `S_0` the outputs are `o_t = o0_t + R_t^T S_0` and the final state
  `A S_0 + B_span`. Each rank all-gathers the ranks' `(A, B_span)` and composes those of the
  earlier ranks into its `S_0`. Cost: the primitive with V + K value columns instead of V
  (stages 1-2, L, M and the solve, are unchanged; the state pass, the outputs and U' double at
  V = K), a `[T, K] x [K, V]` product per head, an all-gather of `H K (K + V)` numbers per
  sequence and N - 1 `[K, K] x [K, V]` products.
- The short convolution: the last `W - 1` inputs of the previous rank are its cache.
- KDN's variance scan: a span of Mobius maps is one map (a 2x2 matrix per lane, the product of
  the span's); each rank composes the earlier ranks' maps and applies them to the prior.

Softmax attention (`layers/attention.py`) all-gathers the keys and values. Exact KDN's dense
covariance has no span map here; it refuses the split.

Every exchange is an all-gather whose backward all-reduces the gathered gradient
(`gather_ranks`), so gradients cross ranks: the backward of the whole group equals the
single-process backward. The layers read the group from `context_parallel(group)`, which the
trainer enters around each forward (`train.context_parallel`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.distributed as dist

from deltalab.ops._checks import state_dtype

__all__ = [
    "affine_span",
    "context_group",
    "context_parallel",
    "context_parallel_delta_rule",
    "gather_ranks",
    "group_rank",
    "kdn_span_maps",
    "kdn_start_prior",
    "previous_tail",
    "require_fresh_sequences",
    "span_outputs",
    "start_states",
]

# The process group of the forward running inside `context_parallel`; None outside.
_GROUP: contextvars.ContextVar[dist.ProcessGroup | None] = contextvars.ContextVar(
    "deltalab_context_parallel_group", default=None
)


@contextlib.contextmanager
def context_parallel(group: dist.ProcessGroup | None) -> Iterator[None]:
    """Inside the block, the recurrent layers treat their input as this rank's piece of
    sequences split over `group` (rank order = token order); None or a group of one rank:
    whole sequences, as outside."""
    if group is not None and dist.get_world_size(group) == 1:
        group = None
    token = _GROUP.set(group)
    try:
        yield
    finally:
        _GROUP.reset(token)


def context_group() -> dist.ProcessGroup | None:
    """The group of the enclosing `context_parallel` block (None: whole sequences)."""
    return _GROUP.get()


def require_fresh_sequences(state: object, mask: object) -> None:
    """A layer's forward under context parallelism takes no state and no padding mask: its
    input is a piece of whole sequences that start from zero."""
    refused = "state" if state is not None else "mask" if mask is not None else None
    if refused is not None:
        raise ValueError(
            f"{refused} must be None under context parallelism (whole sequences split over "
            "ranks, from a zero state, without padding)"
        )


def group_rank(group: dist.ProcessGroup) -> tuple[int, int]:
    """(this process's rank in `group`, the group's size)."""
    return dist.get_rank(group), dist.get_world_size(group)


class _GatherRanks(torch.autograd.Function):
    """`[N, *x.shape]`: x of every rank of the group, in rank order. The backward sums the
    gathered gradient over the ranks and returns this rank's row: each rank's x gets the
    gradients of every rank's use of it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        rank, size = group_rank(group)
        ctx.rank = rank
        x = x.contiguous()
        out = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(out, x, group=group)
        return torch.stack(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad[ctx.rank], None


def gather_ranks(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """x `[...]` of every rank of `group`, stacked `[N, ...]` in rank order; differentiable
    across ranks (every rank must call it, with equal shapes).

    The backward is a collective too, so every rank must run the gathers' backwards in the same
    order: the callers build the same graph on every rank (each rank computes what all ranks
    need from the gathered rows and selects its own), so that autograd, which orders nodes by
    the graph alone, runs them alike."""
    return _GatherRanks.apply(x, group)


def previous_tail(x: torch.Tensor, width: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The last `width` tokens of the previous rank's x `[B, T, C]` as `[B, C, width]` (a short
    convolution's cache), zeros on rank 0."""
    if x.shape[1] < width:
        raise ValueError(
            f"context parallelism needs at least conv_size - 1 = {width} tokens on each rank, "
            f"got {x.shape[1]}"
        )
    tail = x[:, x.shape[1] - width :].transpose(1, 2)
    if width == 0:
        return tail
    rank, _ = group_rank(group)
    gathered = gather_ranks(tail, group)
    # Every rank builds the same graph, only the row it takes differs (`gather_ranks`).
    return torch.cat([torch.zeros_like(gathered[:1]), gathered[:-1]])[rank]


# The delta rule


def affine_span(
    run, q, a, b, u, g
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One span of the delta rule as an affine map of its initial state: `run(q, a, b, u, g,
    initial_state)` is the primitive (returning outputs and final state), u `[B, T, H, V]`,
    k = q.shape[-1]. Returns (o0 `[B, T, H, V]` from a zero state, R `[B, T, H, K]` the read of
    the initial state, A `[B, H, K, K]`, B_span `[B, H, K, V]`) with
    `o = o0 + R S_0` per head and `S_end = A S_0 + B_span` (the module docstring)."""
    batch, _, heads, key_dim = q.shape
    value_dim = u.shape[-1]
    values = torch.cat([u, u.new_zeros(*u.shape[:-1], key_dim)], dim=-1)
    eye = torch.eye(key_dim, dtype=state_dtype(q, a, b, u, g), device=u.device)
    initial = torch.cat([eye.new_zeros(key_dim, value_dim), eye], dim=-1).expand(
        batch, heads, key_dim, value_dim + key_dim
    )
    o, final = run(q, a, b, values, g, initial)
    return o[..., :value_dim], o[..., value_dim:], final[..., value_dim:], final[..., :value_dim]


def start_states(maps: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The state before each of N spans and after the last, from zero, `[N + 1, ..., K, V]`:
    the spans composed in order, `S <- A_j S + B_j`; maps `[N, ..., K, K]`, offsets
    `[N, ..., K, V]`."""
    states = [torch.zeros_like(offsets[0])]
    for transition, offset in zip(maps, offsets, strict=True):
        states.append(transition @ states[-1] + offset)
    return torch.stack(states)


def span_outputs(o0: torch.Tensor, read: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """`o0 + R S_0`: o0 `[B, T, H, V]`, R `[B, T, H, K]`, S_0 `[B, H, K, V]`, in o0's dtype
    (the product in S_0's)."""
    through = torch.einsum("bthk,bhkv->bthv", read.to(state.dtype), state)
    return (o0.to(state.dtype) + through).to(o0.dtype)


def context_parallel_delta_rule(
    run, q, a, b, u, g, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's outputs and final state of sequences split over `group`: `affine_span`,
    the earlier ranks' spans gathered and composed (`start_state`), the outputs from there."""
    rank, _ = group_rank(group)
    o0, read, transition, offset = affine_span(run, q, a, b, u, g)
    states = start_states(gather_ranks(transition, group), gather_ranks(offset, group))
    return span_outputs(o0, read, states[rank]), states[rank + 1]


# KDN's variance scan


Maps = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def kdn_span_maps(
    k: torch.Tensor,
    g: torch.Tensor,
    q_noise: torch.Tensor,
    r: torch.Tensor,
    info_scale: float,
    diagonal: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The variance recursion of KDN's gains (`deltalab.ops.kdn.gains`) over this span as one
    Mobius map per lane, `[4, B, H]` (Isotropic) or `[4, B, H, K]` (Diagonal): (A, B, C, D)
    = the product of the steps' `(a, q, c a, c q + 1)`."""
    from deltalab.ops.kdn.gains import diag_terms, iso_terms
    from deltalab.ops.mobius.parallel import span_map

    k, g, q_noise, r = (x.to(dtype) for x in (k, g, q_noise, r))
    terms = diag_terms if diagonal else iso_terms
    decay2, _, evidence = terms(k, g, r, info_scale)
    steps = (decay2, q_noise, evidence * decay2, evidence * q_noise + 1)
    return torch.stack(span_map(tuple(x.movedim(1, -1) for x in steps)))  # type: ignore[arg-type]


def kdn_start_prior(
    prior: torch.Tensor, spans: torch.Tensor, group: dist.ProcessGroup
) -> torch.Tensor:
    """The variance at the start of this rank's span: the earlier ranks' span maps (spans
    `[4, B, *lanes]` from `kdn_span_maps`, gathered) composed and applied to the prior
    (broadcast to `[B, *lanes]`)."""
    from deltalab.ops.mobius.parallel import apply_map, compose

    rank, size = group_rank(group)
    gathered = gather_ranks(spans, group)
    prior = prior.to(spans.dtype).expand(spans.shape[1:])
    # The start of every rank, each rank alike (`gather_ranks`): the maps of ranks 0 .. j-1
    # composed and applied to the prior.
    starts, total = [prior], tuple(gathered[0].unbind(0))
    for j in range(1, size):
        starts.append(apply_map(total, prior))
        total = compose(tuple(gathered[j].unbind(0)), total)
    return torch.stack(starts)[rank]
