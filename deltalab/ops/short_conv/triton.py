"""Triton short causal convolution with a fused SiLU, forward and backward.

    z[t, c] = sum_{j < W} w[c, j] xpad[t + j, c],   y = silu(z),   xpad = [cache (W-1 rows); x]

In x's coordinates xpad[t + j] is x[t + j - (W-1)]; a negative token index reads the cache (or 0).

Layout. x, y, dy, dx are contiguous `[B, T, C]`: token-major, channels contiguous. A program owns
BC channels of one sequence and walks BT consecutive tokens (a chunk) row by row: a row is BC
contiguous elements, 4 to 8 per thread (8 or 16 bytes of bfloat16), so every load and store is
coalesced over channels. The caller turns the weight (float32 `[W, C]`) and the cache
(`[B, W-1, C]`) channel-contiguous too, so they are read the same way.

Rows, not tiles. The rows of a chunk are separate tensors held in a tuple, unrolled over the
chunk: the row W-1 tokens back is simply another tuple entry. In a [BT, BC] tile it would be a
shift along a distributed axis, which Triton has no instruction for (it takes W loads of the tile
shifted in memory, or a round trip through shared memory). With rows, each x row is loaded once
per chunk and each z, sigmoid and dz is computed once per token; only the W-1 rows on either
side of a chunk (its halo) are loaded, and in the backward recomputed, by two chunks.

Forward traffic. One read of x (plus the W-1 rows before each chunk, from L2), one write of y:
4 bytes per element in bfloat16. z is not written: the backward recomputes it.

Backward. With dz_t = dy_t silu'(z_t), silu'(z) = s (1 + z (1 - s)), s = sigmoid(z):

    dxpad[p] = sum_{j < W} w[c, j] dz[p - j]          (a correlation towards later tokens)
    dx[t]    = dxpad[t + W - 1]      dcache[i] = dxpad[i]  (i < W-1)
    dw[c, j] = sum_{b, t} dz[b, t, c] xpad[b, t + j, c]

In x's coordinates dx[t] = sum_k w[c, W-1-k] dz[t + k]: a chunk needs dz at its BT tokens and at
the W-1 after them, hence z there, hence x from W-1 tokens before the chunk to W-1 after it.
Streaming over the rows, the program needs W rows of x and of dz at a time, not the chunk. DRAM
traffic: one read of x and of dy, one write of dx (6 bytes per element in bfloat16), plus the
halos (2 (W-1) / BT of x and (W-1) / BT of dy, mostly L2 hits); the SiLU is recomputed for
(BT + W - 1) / BT of the tokens.

dw is reduced over tokens without atomics, so it is deterministic: a program walks a split of
the sequence chunk by chunk, keeps dw for its BC channels in W float32 rows of registers, and
writes them once to a partial-sum buffer `[B * n_splits, W, C]`; torch sums it. The splits are
only as many as fill the GPU (`ConvLaunch.backward_programs`), so the buffer stays small (below).

Precision. Every product and sum is float32 whatever x's dtype (bfloat16 x and dy are widened at
load; the weight is used at float32, not rounded to x's dtype as the conv1d path does), and y
and dx are rounded once, at the store. z sums W products: its error is a few float32 ulps of
sum |w x|. dw sums B T products per channel, in a float32 register per program, then across
programs: relative error ~ (T / n_splits) eps in the worst case (random signs give its square
root), well below bfloat16's rounding of y. SiLU: sigmoid(z) = 1 / (1 + exp(-z)) overflows
exp(-z) to inf for z < -88, giving s = 0 and silu(z) = z s = -0 (the true value is below 1e-36
in magnitude); for large z, s rounds to 1 and silu(z) = z. silu'(z) = s (1 + z (1 - s)) takes the
same limits (0, then 1): no inf * 0, no cancellation that a float64 reference would not share.
"""

# Tuples are grown by concatenation (RUF005 would have starred tuples, which Triton does not
# compile).
# ruff: noqa: RUF005

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deltalab.ops._triton import opaque_to_compiler


# (BT tokens per chunk, BC channels per program, warps): BC / (32 warps) elements of a row per
# thread; BT rows unrolled per chunk. Compiled for sm_90 in bfloat16 at W = 4 (ptxas, no GPU
# needed): the forward at 8 elements a thread (one 16-byte load a row) takes 80 registers; the
# backward at 4 elements takes 132, at 8 it took 179 and spilled once the cache was read, so it
# is narrower. The compiler hoists a chunk's row loads, which is what the registers go to: many
# loads in flight per thread, as a bandwidth-bound kernel wants. To be tuned on the GPU
# (python -m benchmarks small_ops --ops short_conv --sweep).
@dataclass(frozen=True)
class ConvLaunch:
    """The kernels' launch table: (BT, BC, warps) of the forward and of the backward (at
    W <= 4, and above), and the programs the backward aims for. The functions that launch them
    take another as an argument (benchmarks sweep them; tests reach at tiny shapes what large
    ones do)."""

    forward: tuple[int, int, int] = (16, 1024, 4)
    backward: tuple[int, int, int] = (16, 512, 4)
    # Above W = 4 the backward holds twice the rows: 8 warps (2 elements a thread), 144
    # registers at W = 8 in bfloat16 (4 elements a thread spilled 80 bytes in float32).
    backward_wide: tuple[int, int, int] = (16, 512, 8)
    # At 132 registers three backward programs fit on an SM, so 1024 are 2.6 waves on an H200's
    # 132 SMs; the partial-sum buffer is then 1024 x W x BC x 4 bytes (8 MiB), against the
    # 200 MB the backward moves at B=4, T=4096, C=2048.
    backward_programs: int = 1024

    def __post_init__(self):
        for name in ("forward", "backward", "backward_wide"):
            block_t, block_c, warps = getattr(self, name)
            if block_t < 1 or block_c < 1 or block_c & (block_c - 1) or warps < 1:
                raise ValueError(
                    f"ConvLaunch.{name} must be (BT >= 1, BC a power of 2, warps >= 1), got "
                    f"{(block_t, block_c, warps)}"
                )
        if self.backward_programs < 1:
            raise ValueError(
                f"ConvLaunch.backward_programs must be >= 1, got {self.backward_programs}"
            )


LAUNCH = ConvLaunch()


@triton.jit
def _row(X, CACHE, x_base, cache_base, t, ch, ch_ok, T, C,
         W: tl.constexpr, HAS_CACHE: tl.constexpr):  # fmt: skip
    """xpad at token t (a scalar; negative tokens read the cache, or 0): a float32 row [BC]."""
    # The token as a row, so that every mask is row & row (the interpreter turns row & scalar
    # into integers, which it refuses as a mask); compiled, it is a broadcast of one register.
    tok = t + 0 * ch
    at = x_base + tl.cast(t, tl.int64) * C + ch
    v = tl.load(X + at, mask=ch_ok & (tok >= 0) & (tok < T), other=0.0).to(tl.float32)
    if HAS_CACHE:
        # Predicated off (no memory access) for every row but the first W-1 of a sequence.
        at = cache_base + (t + (W - 1)) * C + ch
        in_cache = ch_ok & (tok < 0) & (tok >= 1 - W)
        v += tl.load(CACHE + at, mask=in_cache, other=0.0).to(tl.float32)
    return v


@triton.jit
def _taps(WEIGHT, ch, ch_ok, C, W: tl.constexpr):
    """The weight's W taps for channels ch: a tuple of float32 rows [BC]."""
    ws = ()
    for j in tl.static_range(W):
        ws = ws + (tl.load(WEIGHT + j * C + ch, mask=ch_ok, other=0.0),)
    return ws


@triton.jit
def _program(WEIGHT, T, C, N_CB, W: tl.constexpr, BC: tl.constexpr):
    """A program's share: its block along the tokens (pid // N_CB), its sequence b, its channels
    (block pid % N_CB) and their mask, the sequence's offsets in x and in the cache, and the
    channels' taps."""
    pid = tl.program_id(0)
    b = tl.program_id(1)
    ch = (pid % N_CB) * BC + tl.arange(0, BC)
    ch_ok = ch < C
    x_base = b.to(tl.int64) * T * C
    cache_base = b.to(tl.int64) * (W - 1) * C
    return pid // N_CB, b, ch, ch_ok, x_base, cache_base, _taps(WEIGHT, ch, ch_ok, C, W)


@triton.jit
def _short_conv_fwd(X, WEIGHT, CACHE, Y, T, C, N_CB, W: tl.constexpr, BT: tl.constexpr,
                    BC: tl.constexpr, HAS_CACHE: tl.constexpr, SILU: tl.constexpr):  # fmt: skip
    # Channel blocks vary fastest over the program ids: neighbouring programs read whole rows.
    block, _, ch, ch_ok, x_base, cache_base, ws = _program(WEIGHT, T, C, N_CB, W, BC)
    first = block * BT
    # xs[m] is xpad at token first + m - (W-1); a row is loaded once, just before its first use.
    xs = ()
    for m in tl.static_range(W - 1):
        row = _row(X, CACHE, x_base, cache_base, first + m - (W - 1), ch, ch_ok, T, C, W,
                   HAS_CACHE)  # fmt: skip
        xs = xs + (row,)
    for r in tl.static_range(BT):
        t = first + r
        xs = xs + (_row(X, CACHE, x_base, cache_base, t, ch, ch_ok, T, C, W, HAS_CACHE),)
        z = ws[0] * xs[r]
        for j in tl.static_range(1, W):
            z += ws[j] * xs[r + j]
        if SILU:
            z = z * tl.sigmoid(z)
        at = x_base + tl.cast(t, tl.int64) * C + ch
        tl.store(Y + at, z.to(Y.dtype.element_ty), mask=ch_ok & (t + 0 * ch < T))


@triton.jit
def _adjoint_chunk(X, CACHE, DY, OUT, ws, dws, x_base, cache_base, out_base, first, ch, ch_ok,
                   T, C, W: tl.constexpr, ROWS: tl.constexpr, HAS_CACHE: tl.constexpr,
                   SILU: tl.constexpr):  # fmt: skip
    """dxpad for the ROWS tokens from `first` (x's coordinates; negative for the cache), stored
    to OUT at out_base + token C; returns dws (W float32 rows) plus the chunk's dw. dz is 0
    outside [0, T)."""
    xs = ()  # xs[m]: xpad at token first + m - (W-1)
    for m in tl.static_range(W - 1):
        row = _row(X, CACHE, x_base, cache_base, first + m - (W - 1), ch, ch_ok, T, C, W,
                   HAS_CACHE)  # fmt: skip
        xs = xs + (row,)
    dzs = ()  # dzs[r]: dz at token first + r
    for r in tl.static_range(ROWS + W - 1):
        t = first + r
        xs = xs + (_row(X, CACHE, x_base, cache_base, t, ch, ch_ok, T, C, W, HAS_CACHE),)
        tok = t + 0 * ch
        at = x_base + tl.cast(t, tl.int64) * C + ch
        dz = tl.load(DY + at, mask=ch_ok & (tok >= 0) & (tok < T), other=0.0).to(tl.float32)
        if SILU:
            z = ws[0] * xs[r]
            for j in tl.static_range(1, W):
                z += ws[j] * xs[r + j]
            s = tl.sigmoid(z)
            dz = dz * (s * (1.0 + z * (1.0 - s)))
        dzs = dzs + (dz,)
        if r < ROWS:
            # dw[j] += dz[t] xpad[t + j], the chunk's own tokens only (the halo is the next's).
            new = ()
            for j in tl.static_range(W):
                new = new + (dws[j] + dz * xs[r + j],)
            dws = new
        if r >= W - 1:
            # All of dz[o .. o + W-1] is known, o = r - (W-1): dx at token first + o. (The index
            # is written out: a name assigned in a kernel is a tensor, not a constant.)
            dx = ws[W - 1] * dzs[r - (W - 1)]
            for k in tl.static_range(1, W):
                dx += ws[W - 1 - k] * dzs[r - (W - 1) + k]
            t_out = first + (r - (W - 1))
            at = out_base + tl.cast(t_out, tl.int64) * C + ch
            ok = ch_ok & (t_out + 0 * ch < T)
            tl.store(OUT + at, dx.to(OUT.dtype.element_ty), mask=ok)
    return dws


@triton.jit
def _short_conv_bwd(X, WEIGHT, CACHE, DY, DX, DW, DCACHE, T, C, N_CB, SPLIT,
                    W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                    HAS_CACHE: tl.constexpr, HAS_DCACHE: tl.constexpr,
                    SILU: tl.constexpr):  # fmt: skip
    # One program: channel block pid % N_CB of sequence b, tokens [split SPLIT, next split).
    split, b, ch, ch_ok, x_base, cache_base, ws = _program(WEIGHT, T, C, N_CB, W, BC)
    dws = ()
    for _ in tl.static_range(W):
        dws = dws + (tl.zeros([BC], dtype=tl.float32),)
    start = split * SPLIT
    end = tl.minimum(start + SPLIT, T)
    for first in range(start, end, BT):
        dws = _adjoint_chunk(X, CACHE, DY, DX, ws, dws, x_base, cache_base, x_base, first, ch,
                             ch_ok, T, C, W, BT, HAS_CACHE, SILU)  # fmt: skip
    part = (b * (tl.num_programs(0) // N_CB) + split).to(tl.int64)
    for j in tl.static_range(W):
        tl.store(DW + (part * W + j) * C + ch, dws[j], mask=ch_ok)
    if HAS_DCACHE:
        if split == 0:
            # The cache's rows are tokens -(W-1)..-1: the same correlation before token 0,
            # stored at cache row token + W - 1. (Their dz is 0: nothing is added to dw.)
            _adjoint_chunk(X, CACHE, DY, DCACHE, ws, dws, x_base, cache_base,
                           cache_base + (W - 1) * C, start + (1 - W), ch, ch_ok, T, C, W, W - 1,
                           HAS_CACHE, SILU)  # fmt: skip


def launch(
    channels: int, width: int, kernel: str, table: ConvLaunch = LAUNCH
) -> tuple[int, int, int]:
    """(BT, BC, warps) of `kernel` ("forward" or "backward") for C channels and width W, from
    `table` (the backward above W = 4 its wide launch, with half the elements a thread, as it
    holds twice the rows); BC no wider than the power of 2 covering C (>= 32), and no more warps
    than give every thread a channel."""
    config = table.forward if kernel == "forward" else table.backward
    if kernel == "backward" and width > 4:
        config = table.backward_wide
    block_t, block_c, warps = config
    block_c = min(block_c, max(32, triton.next_power_of_2(channels)))
    return block_t, block_c, max(1, min(warps, block_c // 32))


def backward_split(
    batch: int, length: int, channel_blocks: int, block_t: int, table: ConvLaunch = LAUNCH
) -> int:
    """Tokens per backward program, a multiple of block_t: T split in as many pieces as make
    about `table.backward_programs` programs (one piece when the batch and channels already
    do)."""
    chunks = triton.cdiv(length, block_t)
    programs = table.backward_programs
    pieces = max(1, min(chunks, programs // max(1, batch * channel_blocks)))
    return triton.cdiv(chunks, pieces) * block_t


class _ShortConv(torch.autograd.Function):
    """The kernels' layouts, all channel-contiguous: x `[B, T, C]`, the weight as float32
    `[W, C]`, the cache as `[B, W-1, C]` in x's dtype (or None). Their gradients in the same."""

    @staticmethod
    def forward(ctx, x, weight, cache, silu, table):
        batch, length, channels = x.shape
        width = weight.shape[0]
        block_t, block_c, warps = launch(channels, width, "forward", table)
        n_cb = triton.cdiv(channels, block_c)
        y = torch.empty_like(x)
        grid = (n_cb * triton.cdiv(length, block_t), batch)
        _short_conv_fwd[grid](
            x, weight, x if cache is None else cache, y, length, channels, n_cb,
            W=width, BT=block_t, BC=block_c, HAS_CACHE=cache is not None, SILU=silu,
            num_warps=warps,
        )  # fmt: skip
        ctx.save_for_backward(x, weight, cache)
        ctx.silu = silu
        ctx.table = table
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, weight, cache = ctx.saved_tensors
        batch, length, channels = x.shape
        width = weight.shape[0]
        block_t, block_c, warps = launch(channels, width, "backward", ctx.table)
        n_cb = triton.cdiv(channels, block_c)
        split = backward_split(batch, length, n_cb, block_t, ctx.table)
        n_splits = triton.cdiv(length, split)
        dx = torch.empty_like(x)
        dw_parts = x.new_empty(batch * n_splits, width, channels, dtype=torch.float32)
        want_dcache = cache is not None and ctx.needs_input_grad[2]
        dcache = torch.empty_like(cache) if want_dcache else None
        _short_conv_bwd[(n_cb * n_splits, batch)](
            x, weight, x if cache is None else cache, dy.contiguous(), dx, dw_parts,
            dx if dcache is None else dcache, length, channels, n_cb, split,
            W=width, BT=block_t, BC=block_c, HAS_CACHE=cache is not None,
            HAS_DCACHE=want_dcache, SILU=ctx.silu, num_warps=warps,
        )  # fmt: skip
        return dx, dw_parts.sum(0), dcache, None, None


@opaque_to_compiler
def short_conv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    cache: torch.Tensor | None,
    silu: bool,
    *,
    table: ConvLaunch = LAUNCH,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The convolution by the Triton kernels: x `[B, T, C]`, weight `[C, W]` (1 <= W <=
    MAX_TRITON_WIDTH), cache `[B, C, W-1]` or None, validated. Returns (y `[B, T, C]` in x's
    dtype, new cache `[B, C, W-1]` in x's dtype).

    `table`: the launch table (benchmarks sweep it).
    """
    from deltalab.ops.short_conv.reference import conv_cache

    width = weight.shape[-1]
    new_cache = conv_cache(x, cache, width)
    if x.numel() == 0:
        return x.new_zeros(x.shape), new_cache
    # The weight and the cache are turned channel-contiguous here (W C and B (W-1) C elements),
    # so that every load in the kernels runs along channels, the layout x is read in; autograd
    # carries their gradients back through these copies. The cache is taken in x's dtype, as
    # ShortConvolution takes it.
    weight_t = weight.t().to(torch.float32).contiguous()
    cache_t = None
    if cache is not None and width > 1:
        cache_t = cache.to(x.dtype).transpose(1, 2).contiguous()
    y = _ShortConv.apply(x.contiguous(), weight_t, cache_t, silu, table)
    return y, new_cache
