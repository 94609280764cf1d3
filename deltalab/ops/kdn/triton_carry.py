"""The carry passes of a scan split over T, shared by KDN's variance scan (triton.py) and Diagonal
KDN's gain (triton_diag_gain.py).

A scan split into chunks of T, a program each, needs its value at every chunk's boundary: p at
the chunk's first step forward, the adjoint after its last step backward. Each chunk's steps
composed into one map (by the op's own kernel) leave a short scan over the chunks, which these
passes run: `carry_starts` applies the chunks' composed Mobius maps (A, B, C, D) `[N, chunks, 4,
L]` in order to p before the first chunk `[N, L]`, `carry_ends` the chunks' adjoint affine maps
(slope, total) `[N, chunks, 2, L]` in reverse from 0 after the last; both write `[N, chunks, L]`.
A program takes one of the N rows and a block of BLOCK_C lanes and scans its maps BLOCK_P chunks
at a time: `tl.associative_scan` over a block of maps each shifted by one chunk (a row holds its
predecessor's map forward, its successor's backward; the identity on the block's first row),
applied to the value carried in, gives every chunk's boundary value (an exclusive scan); the
block's last chunk's own map carries it into the next block. (A walk of one chunk per step waits
on a dependent load per chunk, ~1 us: 0.13 ms at 128 chunks, a cost that grows as the chunks
shrink; scanned, T / (chunk BLOCK_P) steps on N L / BLOCK_C programs.)

Precision across chunks. Forward, a composed map is a product of normalized non-negative
matrices, renormalized after every product (mobius/triton.py's `_compose`): its entries stay in
[0, 1] and sum to 1 whatever the evidence, and with nothing to cancel each entry keeps a relative
error of ~4 eps per product on its path. It is applied to the carried p as (p / s, 1 / s),
s = max(p, 1), so no p overflows it; and since the map's |d log f / d log p| <= 1 (det = prod a
>= 0), a relative error of the carry is passed on unchanged at worst (shrunk by decay and
evidence): the carries' errors add over the chunks. A reset (a = 0) makes A = C = 0: the composed
map is then constant (B / D), as the carry ignores p, exactly. Backward, the slope is a product
of multipliers in [0, 1] (only shrinks; its underflow to 0 is the true limit) and the total a
positive combination of the steps' direct terms: no cancellation beyond the float64 reference's,
no overflow.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltalab.ops.mobius.triton import _compose, _then_affine

# (chunks, lanes) of a program's block, and its warps.
CARRY_BLOCK = (64, 16)
CARRY_WARPS = 4


@triton.jit
def _apply_map(a, b, c, d, p):
    """The normalized map (a, b, c, d) applied to p >= 0 as (p / s, 1 / s), s = max(p, 1), so a
    huge p cannot overflow it."""
    size = tl.maximum(p, 1.0)
    v0 = p / size
    v1 = 1.0 / size
    return (a * v0 + b * v1) / (c * v0 + d * v1)


@triton.jit
def _store_map(MAPS, at, width, a, b, c, d, mask):
    """A composed map (a, b, c, d) into MAPS `[..., 4, width]` at offsets `at` of its A."""
    tl.store(MAPS + at, a, mask=mask)
    tl.store(MAPS + at + width, b, mask=mask)
    tl.store(MAPS + at + 2 * width, c, mask=mask)
    tl.store(MAPS + at + 3 * width, d, mask=mask)


@triton.jit
def _load_map(MAPS, at, width, mask):
    """The map (a, b, c, d) `_store_map` wrote at `at`; the identity where `mask` is off."""
    a = tl.load(MAPS + at, mask=mask, other=1.0)
    b = tl.load(MAPS + at + width, mask=mask, other=0.0)
    c = tl.load(MAPS + at + 2 * width, mask=mask, other=0.0)
    d = tl.load(MAPS + at + 3 * width, mask=mask, other=1.0)
    return a, b, c, d


@triton.jit
def _carry_program(KD, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """(head pid, its channels and their mask, the rows of a block) of a carry pass's program."""
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    return tl.program_id(0), ch, ch < KD, tl.arange(0, BLOCK_P)


@triton.jit
def _kdn_carry_starts_kernel(
    MAPS, P0, P_START, PARTS, KD, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr
):  # fmt: skip
    """P_START[pid, part] = p before chunk `part`: p_prior, then each chunk's map applied."""
    pid, ch, ch_ok, rows = _carry_program(KD, BLOCK_P, BLOCK_C)
    first = pid.to(tl.int64) * PARTS  # the head's first chunk
    p = tl.load(P0 + pid * KD + ch, mask=ch_ok, other=1.0)
    for start in range(0, PARTS, BLOCK_P):
        part = start + rows
        # Row i holds the map of chunk part - 1 (the identity on the block's row 0).
        before = ((part < PARTS) & (rows > 0))[:, None] & ch_ok[None, :]
        at = (first + part - 1)[:, None] * 4 * KD + ch[None, :]
        ma, mb, mc, md = _load_map(MAPS, at, KD, before)
        ma, mb, mc, md = tl.associative_scan((ma, mb, mc, md), 0, _compose)
        p_start = _apply_map(ma, mb, mc, md, p[None, :])
        ok = (part < PARTS)[:, None] & ch_ok[None, :]
        tl.store(P_START + (first + part)[:, None] * KD + ch[None, :], p_start, mask=ok)
        # Into the next block (if any): the block's last chunk after its start.
        end = start + BLOCK_P - 1
        at = (first + end) * 4 * KD + ch
        ok = ch_ok & (end + 0 * ch < PARTS)  # a vector mask (the interpreter refuses a scalar's)
        p_end = tl.sum(tl.where(rows[:, None] == BLOCK_P - 1, p_start, 0.0), axis=0)
        end_a, end_b, end_c, end_d = _load_map(MAPS, at, KD, ok)
        p = _apply_map(end_a, end_b, end_c, end_d, p_end)


@triton.jit
def _kdn_carry_ends_kernel(
    MAPS, PI_END, PARTS, KD, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr
):  # fmt: skip
    """PI_END[pid, part] = pi after chunk `part`: 0 after the last, then back chunk by chunk."""
    pid, ch, ch_ok, rows = _carry_program(KD, BLOCK_P, BLOCK_C)
    first = pid.to(tl.int64) * PARTS
    pi = tl.zeros([BLOCK_C], dtype=tl.float32)
    for i in range(0, PARTS, BLOCK_P):
        part = PARTS - 1 - i - rows  # row 0: the block's last chunk in time
        # Row r holds the map of chunk part + 1 (the identity on row 0).
        after = ((part >= 0) & (rows > 0))[:, None] & ch_ok[None, :]
        at = (first + part + 1)[:, None] * 2 * KD + ch[None, :]
        slope = tl.load(MAPS + at, mask=after, other=1.0)
        total = tl.load(MAPS + at + KD, mask=after, other=0.0)
        slope, total = tl.associative_scan((slope, total), 0, _then_affine)
        pi_end = total + slope * pi[None, :]
        ok = (part >= 0)[:, None] & ch_ok[None, :]
        tl.store(PI_END + (first + part)[:, None] * KD + ch[None, :], pi_end, mask=ok)
        # Into the next block (if any): pi before the block's first chunk in time.
        end = PARTS - i - BLOCK_P
        at = (first + end) * 2 * KD + ch
        ok = ch_ok & (end + 0 * ch >= 0)  # a vector mask (the interpreter refuses a scalar's)
        pi_first = tl.sum(tl.where(rows[:, None] == BLOCK_P - 1, pi_end, 0.0), axis=0)
        pi = (
            tl.load(MAPS + at + KD, mask=ok, other=0.0)
            + tl.load(MAPS + at, mask=ok, other=1.0) * pi_first
        )


def carry_block(parts: int, block: tuple[int, int] | None = None) -> tuple[int, int]:
    """(BLOCK_P, BLOCK_C) of the carry passes over `parts` chunks: `block` (tests: small blocks
    cross their boundaries at small shapes) or CARRY_BLOCK, BLOCK_P at most `parts` rounded up to
    a power of 2."""
    block_p, block_c = block or CARRY_BLOCK
    return min(block_p, max(2, triton.next_power_of_2(parts))), block_c


def _launch(kernel, maps, inputs, block):
    """One carry pass over maps `[N, parts, width, L]`: its output `[N, parts, L]`."""
    n, parts, _, lanes = maps.shape
    out = maps.new_empty(n, parts, lanes)
    block_p, block_c = carry_block(parts, block)
    kernel[(n, triton.cdiv(lanes, block_c))](
        maps, *inputs, out, parts, lanes, BLOCK_P=block_p, BLOCK_C=block_c, num_warps=CARRY_WARPS
    )
    return out


def carry_starts(
    maps: torch.Tensor, p_first: torch.Tensor, block: tuple[int, int] | None = None
) -> torch.Tensor:
    """p before each chunk `[N, parts, L]` from the chunks' composed normalized Mobius maps
    `maps` `[N, parts, 4, L]` (float32, contiguous) and p before the first chunk, `p_first`
    (contiguous, N L elements)."""
    return _launch(_kdn_carry_starts_kernel, maps, (p_first,), block)


def carry_ends(maps: torch.Tensor, block: tuple[int, int] | None = None) -> torch.Tensor:
    """The adjoint after each chunk `[N, parts, L]` (0 after the last) from the chunks' adjoint
    maps (slope, total) `maps` `[N, parts, 2, L]` (float32, contiguous): the adjoint at a chunk's
    first step is total + slope times the one after its last."""
    return _launch(_kdn_carry_ends_kernel, maps, (), block)
