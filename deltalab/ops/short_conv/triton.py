"""Triton short causal convolution with a fused SiLU, forward and backward.

    z[t, c] = sum_{j < W} w[c, j] xpad[t + j, c],   y = silu(z),   xpad = [cache (W-1 rows); x]

In x's coordinates xpad[t + j] is x[t + j - (W-1)]; a negative token index reads the cache (or 0).

Layout. x, y, dy, dx are contiguous `[B, T, C]`: token-major, channels contiguous. A program owns
a tile of BT tokens x BC channels of one sequence; each row of the tile is BC contiguous
elements, so every load and store is coalesced over channels. The weight `[C, W]` and the cache
`[B, C, W-1]` are tiny and read through the caches.

Forward traffic. Tap j is a load of the tile shifted by j - (W-1) tokens: W loads of [BT, BC],
all but the first W-1 rows shared with the previous tap and the previous tile, so they are L1/L2
hits; DRAM sees one read of x (plus W-1 halo rows per BT, 3/32 of x, mostly from L2) and one
write of y. The pre-activation z is never written: the backward recomputes it.

Backward. With dz_t = dy_t silu'(z_t), silu'(z) = s (1 + z (1 - s)), s = sigmoid(z):

    dxpad[p] = sum_{j < W} w[c, j] dz[p - j]          (a correlation towards later tokens)
    dx[t]    = dxpad[t + W - 1]      dcache[i] = dxpad[i]  (i < W-1)
    dw[c, j] = sum_{b, t} dz[b, t, c] xpad[b, t + j, c]

In x's coordinates dx[t] = sum_k w[c, W-1-k] dz[t + k]: a tile needs dz at its BT tokens and the
W-1 after them, and dz there needs z, i.e. x from W-1 tokens before to W-1 tokens after the tile.
Each of the W shifted dz tiles is recomputed from W shifted x tiles (W^2 loads of [BT, BC], L1
hits but for the halo rows) and one dy tile. DRAM sees one read of x, one of dy and one write of
dx; nothing of size [B, T, C] is kept from the forward but x itself.

dw is reduced over tokens without atomics, so it is deterministic: a program walks a split of
the sequence tile by tile, keeps dw for its BC channels in float32 registers, and writes it once
to a partial-sum buffer `[B * n_splits, C, W]`; torch sums its rows. There are only enough
splits to fill the GPU (a few per SM), so the buffer is small (1 MiB at B=4, C=2048) against x.

Precision. Every product and sum is float32 whatever x's dtype (bfloat16 x and dy are widened at
load; the weight is used at float32, not rounded to x's dtype as the conv1d path does), and y
and dx are rounded once, at the store. z sums W products: its error is about W float32 ulps of
sum |w x|. dw sums B T products per channel, in a float32 register per program, then across
programs: relative error ~ (T / n_splits) eps in the worst case (random signs give its square
root), well below bfloat16's rounding of y. SiLU: sigmoid(z) = 1 / (1 + exp(-z)) overflows
exp(-z) to inf for z < -88, giving s = 0 and silu(z) = z s = -0 (the true value is below 1e-36
in magnitude); for large z, s rounds to 1 and silu(z) = z. silu'(z) = s (1 + z (1 - s)) takes the
same limits (0, then 1): no inf * 0, no cancellation that a float64 reference would not share.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tile sizes (tokens x channels) and warps. The forward holds two [BT, BC] float32 tiles per
# program (the sum and the loaded tap), the backward about five (dx, dz, z, a tap, dy): 32 and
# 16 elements per thread at 4 warps. BC = 128 bfloat16 elements is 256 contiguous bytes a row.
FORWARD_BLOCK = (32, 128)
BACKWARD_BLOCK = (32, 64)
NUM_WARPS = 4
# Programs the backward aims for (a few per SM of an H200's 132), which sets the splits of T.
BACKWARD_PROGRAMS = 1024


@triton.jit
def _xpad_tile(X, CACHE, x_base, cache_base, first, tok, ch, ch_ok, T, C,
               W: tl.constexpr, HAS_CACHE: tl.constexpr):  # fmt: skip
    """x at tokens `tok` [BT] (first = tok[0]; negative tokens read the cache, or 0) and
    channels `ch` [BC], as float32 [BT, BC]."""
    in_x = (tok >= 0) & (tok < T)
    offsets = x_base + tok.to(tl.int64)[:, None] * C + ch[None, :]
    v = tl.load(X + offsets, mask=in_x[:, None] & ch_ok[None, :], other=0.0).to(tl.float32)
    if HAS_CACHE:
        # A scalar branch: only the tiles that reach before token 0 touch the cache.
        if first < 0:
            in_cache = (tok < 0) & (tok >= 1 - W)
            at = cache_base + ch[None, :] * (W - 1) + (tok + (W - 1))[:, None]
            mask = in_cache[:, None] & ch_ok[None, :]
            v += tl.load(CACHE + at, mask=mask, other=0.0).to(tl.float32)
    return v


@triton.jit
def _short_conv_fwd(X, WEIGHT, CACHE, Y, T, C, N_CB, W: tl.constexpr, BT: tl.constexpr,
                    BC: tl.constexpr, HAS_CACHE: tl.constexpr, SILU: tl.constexpr):  # fmt: skip
    # Channel blocks vary fastest over the program ids: neighbouring programs read whole rows.
    pid = tl.program_id(0)
    b = tl.program_id(1)
    first = (pid // N_CB) * BT
    tok = first + tl.arange(0, BT)
    ch = (pid % N_CB) * BC + tl.arange(0, BC)
    ch_ok = ch < C
    x_base = b.to(tl.int64) * T * C
    cache_base = b.to(tl.int64) * C * (W - 1)
    z = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(W):
        w = tl.load(WEIGHT + ch * W + j, mask=ch_ok, other=0.0).to(tl.float32)
        shift = j - (W - 1)
        tap = _xpad_tile(X, CACHE, x_base, cache_base, first + shift, tok + shift, ch, ch_ok,
                         T, C, W, HAS_CACHE)  # fmt: skip
        z += w[None, :] * tap
    y = z
    if SILU:
        y = z * tl.sigmoid(z)
    offsets = x_base + tok.to(tl.int64)[:, None] * C + ch[None, :]
    tl.store(Y + offsets, y.to(Y.dtype.element_ty), mask=(tok < T)[:, None] & ch_ok[None, :])


@triton.jit
def _dxpad_tile(X, WEIGHT, CACHE, DY, x_base, cache_base, first, tok, ch, ch_ok, T, C,
                W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_CACHE: tl.constexpr,
                SILU: tl.constexpr):  # fmt: skip
    """For tokens `tok` [BT] (may start before 0, for the cache's gradient): dx there as float32
    [BT, BC], sum_k w[:, W-1-k] dz[tok + k], and dz at `tok` itself (0 outside [0, T))."""
    dx = tl.zeros([BT, BC], dtype=tl.float32)
    dz_here = tl.zeros([BT, BC], dtype=tl.float32)
    for k in tl.static_range(W):
        t = tok + k
        ok = ((t >= 0) & (t < T))[:, None] & ch_ok[None, :]
        dz = tl.load(DY + x_base + t.to(tl.int64)[:, None] * C + ch[None, :], mask=ok, other=0.0)
        dz = dz.to(tl.float32)
        if SILU:
            # z at tokens t, recomputed from W shifted taps (L1 hits but the halo rows).
            z = tl.zeros([BT, BC], dtype=tl.float32)
            for i in tl.static_range(W):
                w = tl.load(WEIGHT + ch * W + i, mask=ch_ok, other=0.0).to(tl.float32)
                shift = k + i - (W - 1)
                tap = _xpad_tile(X, CACHE, x_base, cache_base, first + shift, tok + shift, ch,
                                 ch_ok, T, C, W, HAS_CACHE)  # fmt: skip
                z += w[None, :] * tap
            s = tl.sigmoid(z)
            dz = dz * (s * (1.0 + z * (1.0 - s)))
        w_k = tl.load(WEIGHT + ch * W + (W - 1 - k), mask=ch_ok, other=0.0).to(tl.float32)
        dx += w_k[None, :] * dz
        if k == 0:
            dz_here = dz
    return dx, dz_here


@triton.jit
def _short_conv_bwd(X, WEIGHT, CACHE, DY, DX, DW, DCACHE, T, C, N_CB, SPLIT,
                    W: tl.constexpr, WP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                    HAS_CACHE: tl.constexpr, HAS_DCACHE: tl.constexpr,
                    SILU: tl.constexpr):  # fmt: skip
    # One program: channel block pid % N_CB of sequence b, tokens [split SPLIT, next split).
    pid = tl.program_id(0)
    b = tl.program_id(1)
    split = pid // N_CB
    ch = (pid % N_CB) * BC + tl.arange(0, BC)
    ch_ok = ch < C
    rows = tl.arange(0, BT)
    taps = tl.arange(0, WP)
    x_base = b.to(tl.int64) * T * C
    cache_base = b.to(tl.int64) * C * (W - 1)
    dw = tl.zeros([BC, WP], dtype=tl.float32)
    start = split * SPLIT
    end = tl.minimum(start + SPLIT, T)
    for first in range(start, end, BT):
        tok = first + rows
        dx, dz = _dxpad_tile(X, WEIGHT, CACHE, DY, x_base, cache_base, first, tok, ch, ch_ok,
                             T, C, W, BT, BC, HAS_CACHE, SILU)  # fmt: skip
        offsets = x_base + tok.to(tl.int64)[:, None] * C + ch[None, :]
        tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=(tok < T)[:, None] & ch_ok[None, :])
        # dw[:, j] += sum over the tile's tokens of dz[t] xpad[t + j] (dz is 0 past T).
        for j in tl.static_range(W):
            shift = j - (W - 1)
            tap = _xpad_tile(X, CACHE, x_base, cache_base, first + shift, tok + shift, ch, ch_ok,
                             T, C, W, HAS_CACHE)  # fmt: skip
            dw += tl.where(taps[None, :] == j, tl.sum(dz * tap, axis=0)[:, None], 0.0)
    row = b * (tl.num_programs(0) // N_CB) + split
    at = row.to(tl.int64) * C * W + ch[:, None] * W + taps[None, :]
    tl.store(DW + at, dw, mask=ch_ok[:, None] & (taps < W)[None, :])
    if HAS_DCACHE:
        if split == 0:
            # The cache's rows are tokens -(W-1)..-1: the same correlation, before token 0.
            tok = rows - (W - 1)
            dcache, _ = _dxpad_tile(X, WEIGHT, CACHE, DY, x_base, cache_base, 1 - W, tok, ch,
                                    ch_ok, T, C, W, BT, BC, HAS_CACHE, SILU)  # fmt: skip
            at = cache_base + ch[None, :] * (W - 1) + (tok + (W - 1))[:, None]
            mask = (tok < 0)[:, None] & ch_ok[None, :]
            tl.store(DCACHE + at, dcache.to(DCACHE.dtype.element_ty), mask=mask)


def channel_block(channels: int, block: int) -> int:
    """The channel block: `block`, or the power of 2 covering C when C is smaller (>= 16)."""
    return min(block, max(16, triton.next_power_of_2(channels)))


def backward_split(batch: int, length: int, channel_blocks: int, block_t: int) -> int:
    """Tokens per backward program, a multiple of block_t: T split in as many pieces as make
    about BACKWARD_PROGRAMS programs (one piece when the batch and channels already do)."""
    tiles = triton.cdiv(length, block_t)
    pieces = max(1, min(tiles, BACKWARD_PROGRAMS // max(1, batch * channel_blocks)))
    return triton.cdiv(tiles, pieces) * block_t


class _ShortConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, cache, silu, config):
        # x: contiguous [B, T, C]; weight: contiguous [C, W]; cache: contiguous [B, C, W-1] in
        # x's dtype, or None.
        batch, length, channels = x.shape
        width = weight.shape[1]
        block_t, block_c = (config or {}).get("forward", FORWARD_BLOCK)
        block_c = channel_block(channels, block_c)
        n_cb = triton.cdiv(channels, block_c)
        y = torch.empty_like(x)
        grid = (n_cb * triton.cdiv(length, block_t), batch)
        _short_conv_fwd[grid](
            x, weight, x if cache is None else cache, y, length, channels, n_cb,
            W=width, BT=block_t, BC=block_c, HAS_CACHE=cache is not None, SILU=silu,
            num_warps=NUM_WARPS,
        )  # fmt: skip
        ctx.save_for_backward(x, weight, cache)
        ctx.silu = silu
        ctx.config = config
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, weight, cache = ctx.saved_tensors
        batch, length, channels = x.shape
        width = weight.shape[1]
        block_t, block_c = (ctx.config or {}).get("backward", BACKWARD_BLOCK)
        block_c = channel_block(channels, block_c)
        n_cb = triton.cdiv(channels, block_c)
        split = backward_split(batch, length, n_cb, block_t)
        n_splits = triton.cdiv(length, split)
        dx = torch.empty_like(x)
        dw_parts = torch.empty(
            batch * n_splits, channels, width, device=x.device, dtype=torch.float32
        )
        want_dcache = cache is not None and ctx.needs_input_grad[2]
        dcache = torch.empty_like(cache) if want_dcache else None
        _short_conv_bwd[(n_cb * n_splits, batch)](
            x, weight, x if cache is None else cache, dy.contiguous(), dx, dw_parts,
            dx if dcache is None else dcache, length, channels, n_cb, split,
            W=width, WP=triton.next_power_of_2(width), BT=block_t, BC=block_c,
            HAS_CACHE=cache is not None, HAS_DCACHE=want_dcache, SILU=ctx.silu,
            num_warps=NUM_WARPS,
        )  # fmt: skip
        dweight = dw_parts.sum(0).to(weight.dtype)
        return dx, dweight, dcache, None, None


def short_conv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    cache: torch.Tensor | None,
    silu: bool,
    config: dict[str, tuple[int, int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The convolution by the Triton kernels: x `[B, T, C]`, weight `[C, W]` (1 <= W <=
    MAX_TRITON_WIDTH), cache `[B, C, W-1]` or None, validated. Returns (y `[B, T, C]` in x's dtype,
    new cache `[B, C, W-1]` in x's dtype).

    `config` overrides the tiles: {"forward": (BT, BC), "backward": (BT, BC)} (BT >= W - 1, both
    powers of 2; benchmarks sweep them).
    """
    from deltalab.ops.short_conv.reference import conv_cache

    width = weight.shape[-1]
    for name, (block_t, block_c) in (config or {}).items():
        if not all(n > 0 and n & (n - 1) == 0 for n in (block_t, block_c)):
            raise ValueError(f"config[{name!r}] must be powers of 2, got {(block_t, block_c)}")
        if block_t < width - 1:
            raise ValueError(f"config[{name!r}]: BT must be >= W - 1 = {width - 1}, got {block_t}")
    new_cache = conv_cache(x, cache, width)
    if cache is not None:
        # The cache in x's dtype, as ShortConvolution takes it (autograd carries the cast).
        cache = cache.to(x.dtype)
    if width == 1 or cache is None:
        cache_in = None
    else:
        cache_in = cache.contiguous()
    if x.numel() == 0:
        y = x.new_zeros(x.shape)
    else:
        y = _ShortConv.apply(x.contiguous(), weight.contiguous(), cache_in, silu, config)
    return y, new_cache
