"""One decoding step of the generalized delta rule as one Triton kernel.

    S' = diag(exp(g)) S;   nu = u - S'^T b;   S_new = S' + a nu^T;   o = scale * S_new^T q

Each value column of S evolves on its own (nu_j and o_j only read column j), so a program owns
one (sequence, head) and a block of BV value columns with all K rows: the state tile is read
once, updated in registers and written once, and no program waits for another. The step is
bound by that read and write of the float32 state; everything else is a few vectors.

Writing the new state over the old one is safe: a program reads its whole tile before it writes
it, and no two programs share a tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltalab.ops._triton import opaque_to_compiler

__all__ = ["delta_rule_step_triton"]

# Largest state tile (rows x columns) one program keeps in registers: 4096 float32 over 4 warps
# is 32 values per thread, which leaves room for the products without spilling.
MAX_TILE = 4096
MIN_BLOCK = 16
NUM_WARPS = 4
# Below this many programs a GPU has idle SMs; then the value blocks are made narrower (more
# programs, each reading less), which is what a batch of one sequence needs.
MIN_PROGRAMS = 256


@triton.jit
def _step_kernel(
    q_ptr,
    a_ptr,
    b_ptr,
    u_ptr,
    g_ptr,
    state_ptr,
    new_state_ptr,
    o_ptr,
    scale,
    K,
    V,
    HEAD_DECAY: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    # Row bh of the flattened [B*H] axis; inputs and states are contiguous (the wrapper sees to it).
    bh = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BV + tl.arange(0, BV)
    rows = tl.arange(0, BK)
    row_ok = rows < K
    col_ok = cols < V
    tile_ok = row_ok[:, None] & col_ok[None, :]

    # Padded rows load as zeros: with a = b = q = 0 there they neither read nor write the tile.
    q = tl.load(q_ptr + bh * K + rows, mask=row_ok, other=0.0).to(tl.float32) * scale
    a = tl.load(a_ptr + bh * K + rows, mask=row_ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + bh * K + rows, mask=row_ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + bh * V + cols, mask=col_ok, other=0.0).to(tl.float32)

    tile = bh * K * V + rows[:, None] * V + cols[None, :]
    s = tl.load(state_ptr + tile, mask=tile_ok, other=0.0).to(tl.float32)
    if HEAD_DECAY:
        s = s * tl.exp(tl.load(g_ptr + bh).to(tl.float32))
    else:
        g = tl.load(g_ptr + bh * K + rows, mask=row_ok, other=0.0).to(tl.float32)
        s = s * tl.exp(g)[:, None]
    nu = u - tl.sum(b[:, None] * s, axis=0)
    s = s + a[:, None] * nu[None, :]
    o = tl.sum(q[:, None] * s, axis=0)

    tl.store(new_state_ptr + tile, s, mask=tile_ok)
    tl.store(o_ptr + bh * V + cols, o.to(o_ptr.dtype.element_ty), mask=col_ok)


def _blocks(rows: int, key_dim: int, value_dim: int) -> tuple[int, int]:
    """(BK, BV): all key rows in one tile, as many value columns as fit (see MAX_TILE)."""
    block_k = max(MIN_BLOCK, triton.next_power_of_2(key_dim))
    widest = max(MIN_BLOCK, min(triton.next_power_of_2(value_dim), MAX_TILE // block_k))
    block_v = widest
    while block_v > MIN_BLOCK and rows * triton.cdiv(value_dim, block_v) < MIN_PROGRAMS:
        block_v //= 2
    return block_k, block_v


@opaque_to_compiler
def delta_rule_step_triton(
    q: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor,
    state: torch.Tensor,
    *,
    scale: float,
    new_state: torch.Tensor | None = None,
    o: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated inputs (as `delta_rule_step`'s, any float dtype but float64; scale not yet
    applied to q) -> (o `[B, H, V]` in q's dtype, new state `[B, H, K, V]` float32).

    new_state: where the new state goes, a contiguous float32 `[B, H, K, V]`; may be `state`
    itself (an in-place update). A new tensor when None. o: the output buffer, likewise.
    """
    batch, heads, key_dim = q.shape
    value_dim = u.shape[-1]
    # Inputs are a few vectors per head: making them contiguous costs nothing next to the state,
    # and lets the kernel index every tensor as [B*H, ...] rows.
    q, a, b, u, g = (x.contiguous() for x in (q, a, b, u, g))
    if new_state is None:
        new_state = torch.empty(
            batch, heads, key_dim, value_dim, dtype=torch.float32, device=q.device
        )
    if o is None:
        o = torch.empty(batch, heads, value_dim, dtype=q.dtype, device=q.device)
    if new_state.data_ptr() == state.data_ptr() and not state.is_contiguous():
        raise ValueError("state must be contiguous to be updated in place")
    expected = {"new_state": (state.shape, torch.float32), "o": (u.shape, q.dtype)}
    for name, x in (("new_state", new_state), ("o", o)):
        shape, dtype = expected[name]
        if x.shape != shape or x.dtype != dtype or not x.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous {dtype} tensor of shape {tuple(shape)}, got "
                f"{x.dtype} {tuple(x.shape)}"
            )
    if new_state.data_ptr() != state.data_ptr():
        state = state.contiguous()
    rows = batch * heads
    block_k, block_v = _blocks(rows, key_dim, value_dim)
    grid = (rows, triton.cdiv(value_dim, block_v))
    _step_kernel[grid](
        q,
        a,
        b,
        u,
        g,
        state,
        new_state,
        o,
        float(scale),
        key_dim,
        value_dim,
        HEAD_DECAY=g.dim() == 2,
        BK=block_k,
        BV=block_v,
        num_warps=NUM_WARPS,
    )
    return o, new_state
