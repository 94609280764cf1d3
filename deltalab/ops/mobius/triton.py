"""Triton Mobius scan, forward and backward: x_t = (A_t x_{t-1} + B_t) / (C_t x_{t-1} + D_t).

Layout. Every tensor is a contiguous `[N, T, R]` block: lane `l = n R + r` is one independent
scan along T (stride R). `[..., T]` inputs of `mobius_scan` are `[L, T, 1]`; KDN's `[B, T, H(, K)]`
gates are `[B, T, H(K)]`, so the variance scan reads them in place, without moving T last.

Forward. A program owns BLOCK_L lanes and walks T in tiles of BLOCK_T steps. In a tile,
`tl.associative_scan` forms the prefix products of the step matrices M = [[A, B], [C, D]] (the
map is M acting on (x, 1)), each product divided by the sum of its entries; the tile's iterates
are those products applied to the scalar x carried in from the previous tile. Parallel over T
inside a tile (the isotropic case has few lanes: 64 at B=4, H=16), sequential across tiles.

Range. The map does not change when M is multiplied by a positive number, so every matrix is
divided by the sum of its entries (at load, and after each product): entries stay in [0, 1] and
sum to 1, whatever the accumulated evidence (10^4 per step reaches 10^(4 T) unnormalized). Only
a scalar x crosses tiles, never a product, so nothing grows with T. It is applied as
(x / s, 1 / s), s = max(x, 1), so a huge x cannot overflow. A sum that underflows is clamped to
the smallest normal float32 (any positive divisor is exact for a scale-invariant map).

Accuracy. With non-negative entries nothing cancels: an entry of a tile's prefix product keeps a
relative error of about 4 log2(BLOCK_T) eps, and so does each iterate given the carried x. The
carried error does not grow: for entries >= 0 and det = AD - BC > 0,
(A x + B)(C x + D) >= (AD + BC) x >= det x, so |d log f / d log x| = det x / ((A x + B)(C x + D))
<= 1. Relative errors of x are at worst carried unchanged from tile to tile (KDN's decay and
evidence shrink them), so they add up over T / BLOCK_T tiles, not over T steps.

Backward. The adjoint of x_t = f_t(x_{t-1}) is the reverse first-order linear recurrence

    nu_t = dL/dx_t (direct) + m_{t+1} nu_{t+1},    m_t = f_t'(x_{t-1}) = det_t / (C_t x_{t-1} + D_t)^2

(nu_t the total derivative of the loss with respect to x_t), another scan: tiles from the last
to the first, inside a tile `tl.associative_scan` over the affine maps y -> g + m y (rows in
reversed time order), nu carried across tiles as a scalar. Then, with den_t = C_t x_{t-1} + D_t,

    dA_t = nu_t x_{t-1} / den_t     dB_t = nu_t / den_t
    dC_t = -nu_t x_t x_{t-1} / den_t    dD_t = -nu_t x_t / den_t    dx_0 = m_1 nu_1.

Stability of the adjoint. m_t >= 0 (det > 0), so the recurrence is a positive combination and
introduces no cancellation of its own (only the incoming dL/dx_t may differ in sign, which the
float64 reference shares). The product of the m over a stretch is the derivative of the composed
map; by the bound above it is at most x_end / x_start, so it cannot overflow while the iterates'
ratios are representable; for KDN, det = a <= 1 and D >= 1 give m <= 1: products only shrink,
and their underflow to 0 is the correct limit (no influence across that stretch). det = AD - BC
is formed in float64: the products of float32 numbers are exact there, so KDN's det = a comes out
right even where AD and BC are both about c q times larger (c q = 10^4 would leave 10^-3 of
relative error in float32). Like the forward, den and x_{t-1} are used scaled by
s = max(x_{t-1}, 1), so a huge x_0 neither overflows den nor its square.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from deltalab.ops._triton import opaque_to_compiler


@triton.jit
def _normalize(a, b, c, d):
    # Clamped at the smallest normal float32: any positive divisor is exact for the map; this
    # one only keeps 0 / 0 out of degenerate, underflowed products.
    inv = 1.0 / tl.maximum(a + b + c + d, 1.1754943508222875e-38)
    return a * inv, b * inv, c * inv, d * inv


@triton.jit
def _compose(a1, b1, c1, d1, a2, b2, c2, d2):
    """Step 2 after step 1: the matrix product M2 @ M1, renormalized (an associative op)."""
    return _normalize(
        a2 * a1 + b2 * c1,
        a2 * b1 + b2 * d1,
        c2 * a1 + d2 * c1,
        c2 * b1 + d2 * d1,
    )


@triton.jit
def _then_affine(m1, g1, m2, g2):
    """y -> g2 + m2 y after y -> g1 + m1 y: the adjoint's steps composed (associative)."""
    return m2 * m1, g2 + m2 * g1


@triton.jit
def _lane_offsets(pid, T, INNER, LANES, BLOCK_L: tl.constexpr):
    lane = pid * BLOCK_L + tl.arange(0, BLOCK_L)
    base = (lane // INNER).to(tl.int64) * T * INNER + lane % INNER
    return lane, lane < LANES, base


@triton.jit
def _slope(A, B, C, D, at, mask, x):
    """f'(x) of the map at offsets `at` (the identity where `mask` is off) = det / (C x + D)^2,
    as det (v1 / den)^2 with v1 = 1 / s, den = (C x + D) / s and s = max(x, 1): finite for any
    finite x >= 0."""
    a = tl.load(A + at, mask=mask, other=1.0)
    b = tl.load(B + at, mask=mask, other=0.0)
    c = tl.load(C + at, mask=mask, other=0.0)
    d = tl.load(D + at, mask=mask, other=1.0)
    size = tl.maximum(x, 1.0)
    v1 = 1.0 / size
    den = c * (x / size) + d * v1
    # Exact products of float32 numbers in float64 (see the module docstring).
    det = (a.to(tl.float64) * d.to(tl.float64) - b.to(tl.float64) * c.to(tl.float64)).to(x.dtype)
    ratio = v1 / den
    return det * ratio * ratio


@triton.jit
def _mobius_forward_kernel(
    A, B, C, D, X0, X, T, INNER, LANES, BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr
):
    lane, lane_ok, base = _lane_offsets(tl.program_id(0), T, INNER, LANES, BLOCK_L)
    rows = tl.arange(0, BLOCK_T)
    x = tl.load(X0 + lane, mask=lane_ok, other=0.0)
    for start in range(0, T, BLOCK_T):
        t = start + rows
        ok = (t < T)[:, None] & lane_ok[None, :]
        offsets = base[None, :] + t.to(tl.int64)[:, None] * INNER
        # Steps past T (and lanes past LANES) load the identity map, so the tile's last row
        # is always the iterate at its last real step.
        a = tl.load(A + offsets, mask=ok, other=1.0)
        b = tl.load(B + offsets, mask=ok, other=0.0)
        c = tl.load(C + offsets, mask=ok, other=0.0)
        d = tl.load(D + offsets, mask=ok, other=1.0)
        a, b, c, d = _normalize(a, b, c, d)
        a, b, c, d = tl.associative_scan((a, b, c, d), 0, _compose)
        size = tl.maximum(x, 1.0)
        v0 = (x / size)[None, :]
        v1 = (1.0 / size)[None, :]
        y = (a * v0 + b * v1) / (c * v0 + d * v1)
        tl.store(X + offsets, y, mask=ok)
        x = tl.sum(tl.where(rows[:, None] == BLOCK_T - 1, y, 0.0), axis=0)


@triton.jit
def _mobius_backward_kernel(
    A,
    B,
    C,
    D,
    X0,
    X,
    GX,
    GA,
    GB,
    GC,
    GD,
    GX0,
    T,
    INNER,
    LANES,
    BLOCK_T: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    lane, lane_ok, base = _lane_offsets(tl.program_id(0), T, INNER, LANES, BLOCK_L)
    rows = tl.arange(0, BLOCK_T)
    x0 = tl.load(X0 + lane, mask=lane_ok, other=0.0)
    nu = tl.zeros([BLOCK_L], dtype=x0.dtype)  # nu at the first step after the tile (0 after T)
    last_start = (T - 1) // BLOCK_T * BLOCK_T
    for i in range(0, T, BLOCK_T):
        # Tiles from the last to the first; row 0 is the tile's last step.
        t = (last_start - i) + (BLOCK_T - 1) - rows
        ok = (t < T)[:, None] & lane_ok[None, :]
        has_next = (t + 1 < T)[:, None] & lane_ok[None, :]
        has_prev = (t > 0)[:, None] & ok
        offsets = base[None, :] + t.to(tl.int64)[:, None] * INNER
        x_t = tl.load(X + offsets, mask=ok, other=0.0)
        x_prev = tl.load(X + offsets - INNER, mask=has_prev, other=0.0)
        x_prev = tl.where(has_prev, x_prev, x0[None, :])
        grad = tl.load(GX + offsets, mask=ok, other=0.0)
        # m_{t+1} = f_{t+1}'(x_t), from the next step's coefficients (0 past the end).
        nxt = offsets + INNER
        m_next = _slope(A, B, C, D, nxt, has_next, x_t)
        m_next = tl.where(has_next, m_next, 0.0)
        slope, total = tl.associative_scan((m_next, grad), 0, _then_affine)
        nu_t = total + slope * nu[None, :]
        c = tl.load(C + offsets, mask=ok, other=0.0)
        d = tl.load(D + offsets, mask=ok, other=1.0)
        size = tl.maximum(x_prev, 1.0)
        v0 = x_prev / size
        v1 = 1.0 / size
        w = nu_t / (c * v0 + d * v1)
        tl.store(GA + offsets, w * v0, mask=ok)
        tl.store(GB + offsets, w * v1, mask=ok)
        tl.store(GC + offsets, -(w * x_t) * v0, mask=ok)
        tl.store(GD + offsets, -(w * x_t) * v1, mask=ok)
        nu = tl.sum(tl.where(rows[:, None] == BLOCK_T - 1, nu_t, 0.0), axis=0)
    # nu now holds nu_1 (the first step); dx_0 = f_1'(x_0) nu_1.
    slope0 = _slope(A, B, C, D, base, lane_ok, x0)
    tl.store(GX0 + lane, slope0 * nu, mask=lane_ok)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def launch_config(lanes: int, length: int, tile: int = 2048) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_L) for `lanes` scans of `length` steps, `tile` elements per tile at most.

    Lanes per program only while there are programs enough to fill an H200 (132 SMs); the rest
    of the tile goes to steps, which the scan handles in parallel. Many lanes (Diagonal KDN,
    8192 at B=4, H=16, K=128): 32 lanes x 64 steps; few lanes (Isotropic, 64): one lane x 1024
    steps, so a lane is only T / 1024 sequential tiles long.
    """
    block_l = 32
    while block_l > 1 and triton.cdiv(lanes, block_l) < 128:
        block_l //= 2
    block_t = max(16, min(tile // block_l, 1024, _next_power_of_2(length)))
    return block_t, block_l


class _MobiusScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, A, B, C, D, x0, config):
        # A..D: contiguous [N, T, R]; x0: contiguous [N, R]; all one float dtype.
        n, length, inner = A.shape
        lanes = n * inner
        block_t, block_l = config or launch_config(lanes, length)
        # Uninitialized: the kernel writes every element (the tests NaN-fill torch.empty*, the
        # poisoned_empty fixture, so an element left unwritten fails them).
        x = torch.empty_like(A)
        grid = (triton.cdiv(lanes, block_l),)
        _mobius_forward_kernel[grid](
            A, B, C, D, x0, x, length, inner, lanes, BLOCK_T=block_t, BLOCK_L=block_l
        )
        ctx.save_for_backward(A, B, C, D, x0, x)
        ctx.config = config
        return x

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_x):
        A, B, C, D, x0, x = ctx.saved_tensors
        n, length, inner = A.shape
        lanes = n * inner
        block_t, block_l = ctx.config or launch_config(lanes, length, tile=1024)
        grads = [torch.empty_like(A) for _ in range(4)]
        grad_x0 = torch.empty_like(x0)
        grid = (triton.cdiv(lanes, block_l),)
        _mobius_backward_kernel[grid](
            A,
            B,
            C,
            D,
            x0,
            x,
            grad_x.contiguous(),
            *grads,
            grad_x0,
            length,
            inner,
            lanes,
            BLOCK_T=block_t,
            BLOCK_L=block_l,
        )
        return (*grads, grad_x0, None)


@opaque_to_compiler
def mobius_scan_lanes(
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    x0: torch.Tensor,
    config: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The scan along axis 1: A..D `[N, T, *rest]`, x0 `[N, *rest]`, one float dtype (float32 or
    float64), on a device where Triton runs. Returns x_1..x_T `[N, T, *rest]`.

    `config` = (BLOCK_T, BLOCK_L) overrides `launch_config` (benchmarks sweep it).
    """
    shape = A.shape
    if A.numel() == 0:
        return A.new_empty(shape)
    n, length = shape[0], shape[1]
    maps = [x.reshape(n, length, -1).contiguous() for x in (A, B, C, D)]
    start = x0.reshape(n, -1).contiguous()
    return _MobiusScan.apply(*maps, start, config).reshape(shape)


@opaque_to_compiler
def mobius_scan_triton(
    A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, x0: torch.Tensor
) -> torch.Tensor:
    """All iterates of the per-step maps: A..D `[..., T]` (validated, one dtype), x0 `[...]`.
    Returns x_1..x_T `[..., T]`."""
    shape = A.shape
    lanes = [x.reshape(-1, shape[-1], 1) for x in (A, B, C, D)]
    return mobius_scan_lanes(*lanes, x0.reshape(-1, 1)).reshape(shape)
