"""Triton RoPE, forward and backward: one kernel, compiled once for each direction.

    theta = p * f_i,   f_i = base^(-i / (K/2))                          (p = positions[t])
    forward:  y1 = x1 cos(theta) - x2 sin(theta),   y2 = x2 cos(theta) + x1 sin(theta)
    backward: dx1 = dy1 cos(theta) + dy2 sin(theta),   dx2 = dy2 cos(theta) - dy1 sin(theta)

x1, x2 = x[..., :K/2], x[..., K/2:]. The rotation is linear and orthogonal, so the backward is
the inverse rotation (theta -> -theta) of the output gradient: the same kernel with INVERSE set.
Nothing is saved for backward but positions `[T]` and the inverse frequencies `[K/2]`.

Layout. x `[B, T, H, K]` is read with its own strides along B, T and H (a view out of a fused
projection, or the transposed gradient SDPA's backward hands back), the last dim contiguous (a
copy otherwise); the result is written contiguous `[B, T, H, K]` in x's dtype. A program owns
BT tokens (the flat index b T + t) x BH heads x BD of the K/2 pairs: it loads BT positions,
computes the `[BT, BD]` angles, cosines and sines once and applies them to its BH heads.

Precision. Everything in float32 registers, x and dy widened at load and rounded once at the
store. The angles are those of the torch path, bit for bit: the kernel gets the inverse
frequencies as a `[K/2]` float32 tensor computed by the torch path's own call
(`reference.inverse_frequencies`, on the same device, so the same pow), converts the position
to float32 as `positions.to(torch.float32)` does (round to nearest; exact below 2^24), and
forms theta with one float32 multiply, correctly rounded, as torch's `mul` does. No pow in the
kernel: exp2(-i / (K/2) log2(base)) would differ from torch's pow in the last bits of f_i, and
that error is multiplied by p (an ulp of f just below 1, 6e-8, is 2e-3 rad of theta at p =
32768). The angle's own rounding (half an ulp of theta, 2e-3 rad at p = 32768) is the float32
angles' error, the torch path's too: the tests compare both to float64 at positions from 30000
to 2^20. cos and sin are libdevice's `__nv_cosf` / `__nv_sinf` on CUDA (with their full range
reduction: accurate for any float32 theta, no `cos.approx`; tests/test_triton_compile.py checks
the PTX), numpy's under the interpreter, torch's on the torch path: all within an ulp or two of
the true values for the same float32 theta. So the kernel matches the torch path to float32
rounding (of cos, sin and the products; `x1 cos - x2 sin` may be contracted to an fma here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deltalab.ops._triton import opaque_to_compiler


# Pairs (BT tokens x BH heads x BD columns) a program holds, the widest column block, and the
# pairs a thread holds (which sets the warps, at most 8). At the 340M Transformer (H = 8,
# K = 128) a program is 4 tokens x 8 heads x 64 pairs at 4 warps. Compiled for sm_90 (ptxas, no
# GPU): 86-90 registers, no spill (8 pairs a thread at 8 warps spilled 4 bytes at H = 3, K =
# 48); the 32-byte stack frame is libdevice's cos/sin range reduction (its table for |theta| >
# 105615). First guesses otherwise, to be tuned on the GPU
# (python -m benchmarks small_ops --ops rope).
@dataclass(frozen=True)
class RopeLaunch:
    """The kernel's launch table (`launch`); the functions that launch it take another as an
    argument (tests reach at tiny shapes the blocks of large ones with small tables)."""

    block_pairs: int = 2048
    max_block_d: int = 128
    per_thread: int = 16
    max_warps: int = 8


LAUNCH = RopeLaunch()


@triton.jit
def _rope_kernel(X, POS, FREQ, Y, TOKENS, T, H, HALF, stride_b, stride_t, stride_h,
                 INVERSE: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
                 BD: tl.constexpr):  # fmt: skip
    tokens = tl.program_id(0) * BT + tl.arange(0, BT)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    cols = tl.program_id(2) * BD + tl.arange(0, BD)
    token_ok = tokens < TOKENS
    col_ok = cols < HALF
    t = tokens % T
    # theta = float32(p) * f: one correctly rounded float32 product, as the torch path's.
    p = tl.load(POS + t, mask=token_ok, other=0).to(tl.float32)
    f = tl.load(FREQ + cols, mask=col_ok, other=0.0)
    theta = p[:, None] * f[None, :]  # [BT, BD], shared by the BH heads
    cos = tl.cos(theta)[:, None, :]
    sin = tl.sin(theta)[:, None, :]
    if INVERSE:
        sin = -sin
    mask = token_ok[:, None, None] & (heads < H)[None, :, None] & col_ok[None, None, :]
    tokens64 = tokens.to(tl.int64)
    row = (tokens64 // T) * stride_b + (tokens64 % T) * stride_t
    at = row[:, None, None] + (heads.to(tl.int64) * stride_h)[None, :, None] + cols[None, None, :]
    x1 = tl.load(X + at, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + at + HALF, mask=mask, other=0.0).to(tl.float32)
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    out = (tokens64[:, None, None] * H + heads[None, :, None]) * (2 * HALF) + cols[None, None, :]
    tl.store(Y + out, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(Y + out + HALF, y2.to(Y.dtype.element_ty), mask=mask)


def launch(
    tokens: int, heads: int, half: int, table: RopeLaunch = LAUNCH
) -> tuple[int, int, int, int]:
    """(BT tokens, BH heads, BD columns, warps) of a program for `tokens` = B T, H heads and
    K/2 = half pairs a head: BD the power of 2 covering half (at most `table.max_block_d`), BH
    the heads' power of 2 (within `table.block_pairs`), BT the rest of the block's pairs (at
    least 1, at most the tokens' power of 2); warps for `table.per_thread` pairs a thread (1 to
    `table.max_warps`)."""
    block_d = min(table.max_block_d, triton.next_power_of_2(half))
    block_h = min(triton.next_power_of_2(heads), max(1, table.block_pairs // block_d))
    room = table.block_pairs // (block_d * block_h)
    block_t = max(1, min(room, triton.next_power_of_2(max(tokens, 1))))
    pairs = block_t * block_h * block_d
    warps = max(1, min(table.max_warps, pairs // (32 * table.per_thread)))
    return block_t, block_h, block_d, warps


@opaque_to_compiler
def rotate(
    x: torch.Tensor, positions: torch.Tensor, freq: torch.Tensor, inverse: bool,
    table: RopeLaunch = LAUNCH,
) -> torch.Tensor:  # fmt: skip
    """The kernel on x `[B, T, H, K]` (non-empty): x rotated by theta = positions * freq
    (`inverse`: by -theta), contiguous, in x's dtype, launched by `table`."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    batch, length, heads, dim = x.shape
    half = dim // 2
    y = torch.empty(batch, length, heads, dim, dtype=x.dtype, device=x.device)
    block_t, block_h, block_d, warps = launch(batch * length, heads, half, table)
    grid = (
        triton.cdiv(batch * length, block_t),
        triton.cdiv(heads, block_h),
        triton.cdiv(half, block_d),
    )
    _rope_kernel[grid](
        x, positions, freq, y, batch * length, length, heads, half,
        x.stride(0), x.stride(1), x.stride(2),
        INVERSE=inverse, BT=block_t, BH=block_h, BD=block_d, num_warps=warps,
    )  # fmt: skip
    return y


class _Rope(torch.autograd.Function):
    """x rotated by theta (`inverse`: by -theta). Saves positions and freq only. The backward
    is the kernel the other way (the inverse rotation of dy), the jvp the same rotation of the
    tangent (a linear map is its own derivative). Each launched by `table`."""

    @staticmethod
    def forward(ctx, x, positions, freq, inverse, table):
        ctx.inverse, ctx.table = inverse, table
        ctx.save_for_backward(positions, freq)
        ctx.save_for_forward(positions, freq)
        return rotate(x, positions, freq, inverse, table)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        positions, freq = ctx.saved_tensors
        return rotate(dy, positions, freq, not ctx.inverse, ctx.table), None, None, None, None

    @staticmethod
    def jvp(ctx, t_x, *_):
        positions, freq = ctx.saved_tensors
        return rotate(t_x, positions, freq, ctx.inverse, ctx.table)


@opaque_to_compiler
def rope_triton(
    x: torch.Tensor, positions: torch.Tensor, freq: torch.Tensor, *, table: RopeLaunch = LAUNCH
) -> torch.Tensor:
    """RoPE by the kernel, validated non-empty x `[B, T, H, K]` and positions `[T]`, freq the
    float32 inverse frequencies `[K/2]`; x's dtype out, computed in float32. `table`: the
    launch table."""
    return _Rope.apply(x, positions, freq, False, table)
