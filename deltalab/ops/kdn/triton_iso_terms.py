"""Isotropic KDN's gain in Triton: the terms' reductions over K, then the variance scan with the
evidence and beta inside it (triton.py's `kdn_iso_scan`).

Isotropic KDN scans one variance per head (`[B, T, H]`); its only `[B, T, H, K]` work is the
terms' reductions over K, a = mean_K exp(2 g) and ||k||^2, and their gradients (a separate exp,
product, mean and sum each way in PyTorch). One kernel each way reads k (and a per-channel g) and
writes the two `[B, T, H]` terms, resp. dk and dg; the rest (the evidence, the scan, beta) is
`[B, T, H]`, K times smaller. The tokens are independent here, so a program takes a block of
(token, head) rows with all their channels, over the whole GPU. a = mean exp(2 g) is in [0, 1]
(g = -inf adds 0); every term is a sum of non-negative numbers, and the gradients are products
(no cancellation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltalab.ops._triton import opaque_to_compiler
from deltalab.ops.kdn.triton import kdn_iso_scan

# (rows, warps) of a program: BLOCK_R (token, head) rows x BLOCK_K channels of about 4096
# elements, 16 a thread.
ISO_TILE, ISO_WARPS = 4096, 8


@triton.jit
def _row_tile(K_, ROWS, KD, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """A program's BLOCK_R rows (token and head) of k `[ROWS, KD]`: the row indices, their mask,
    the tile's mask and offsets `[BLOCK_R, BLOCK_K]`, and k in float32 (0 where masked)."""
    row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ch = tl.arange(0, BLOCK_K)
    row_ok = row < ROWS
    ok = row_ok[:, None] & (ch < KD)[None, :]
    at = row.to(tl.int64)[:, None] * KD + ch[None, :]
    return row, row_ok, ok, at, tl.load(K_ + at, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _kdn_iso_terms_forward_kernel(
    K_,
    G,
    DECAY,
    NORM2,
    ROWS,
    KD,
    G_HEAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row, row_ok, ok, at, k = _row_tile(K_, ROWS, KD, BLOCK_R, BLOCK_K)
    tl.store(NORM2 + row, tl.sum(k * k, axis=1), mask=row_ok)
    if G_HEAD:
        decay = tl.exp(2.0 * tl.load(G + row, mask=row_ok, other=0.0).to(tl.float32))
    else:
        g = tl.load(G + at, mask=ok, other=0.0).to(tl.float32)
        decay = tl.sum(tl.where(ok, tl.exp(2.0 * g), 0.0), axis=1) / KD
    tl.store(DECAY + row, decay, mask=row_ok)


@triton.jit
def _kdn_iso_terms_backward_kernel(
    K_,
    G,
    DDECAY,
    DNORM2,
    DK_IN,
    DG_IN,
    DK,
    DG,
    ROWS,
    KD,
    G_HEAD: tl.constexpr,
    HAS_DK_IN: tl.constexpr,
    HAS_DG_IN: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # DK_IN, DG_IN: the gradients of k and g from the delta rule that took them through this
    # node (see _KDNIsoTerms), added to the terms' own shares in float32 before the
    # one write in k's and g's dtypes (absent: the flags off, the pointers unread).
    row, row_ok, ok, at, k = _row_tile(K_, ROWS, KD, BLOCK_R, BLOCK_K)
    d_norm2 = tl.load(DNORM2 + row, mask=row_ok, other=0.0)
    d_k = (2.0 * k) * d_norm2[:, None]
    if HAS_DK_IN:
        d_k += tl.load(DK_IN + at, mask=ok, other=0.0).to(tl.float32)
    tl.store(DK + at, d_k.to(DK.dtype.element_ty), mask=ok)
    d_decay = tl.load(DDECAY + row, mask=row_ok, other=0.0)
    if G_HEAD:
        g = tl.load(G + row, mask=row_ok, other=0.0).to(tl.float32)
        d_g = 2.0 * tl.exp(2.0 * g) * d_decay
        if HAS_DG_IN:
            d_g += tl.load(DG_IN + row, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(DG + row, d_g.to(DG.dtype.element_ty), mask=row_ok)
    else:
        g = tl.load(G + at, mask=ok, other=0.0).to(tl.float32)
        d_g = tl.exp(2.0 * g) * (2.0 * d_decay / KD)[:, None]
        if HAS_DG_IN:
            d_g += tl.load(DG_IN + at, mask=ok, other=0.0).to(tl.float32)
        tl.store(DG + at, d_g.to(DG.dtype.element_ty), mask=ok)


def iso_launch(key_dim: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_K, warps) of the isotropic terms' kernels."""
    block_k = triton.next_power_of_2(key_dim)
    return max(1, ISO_TILE // block_k), block_k, ISO_WARPS


class _KDNIsoTerms(torch.autograd.Function):
    """(a, ||k||^2, k, g): the terms, and k and g themselves routed through this node.

    The delta rule that the gain feeds takes k and g too, so each gets two gradients, which
    autograd would sum in a kernel of its own after both are written: for bf16 `[B, T, H, K]` k
    and g, two more reads and a write of each. Handed the node's k and g, the delta rule's
    gradients arrive here with the terms' own, and the backward kernel adds them in float32
    before its one write (on the H200 the separate sums took 0.10 ms of Isotropic KDN's 5.2 at
    B=4 T=4096 H=16, 0.19 ms at B=1 T=32768). Unused,
    the routed outputs cost nothing but two views.
    """

    @staticmethod
    def forward(ctx, k, g):
        # k: contiguous [B, T, H, K]; g: contiguous [B, T, H, K] or [B, T, H]; float32.
        key_dim = k.shape[-1]
        rows = k.numel() // key_dim
        decay, norm2 = (k.new_empty(k.shape[:-1], dtype=torch.float32) for _ in range(2))
        block_r, block_k, warps = iso_launch(key_dim)
        if rows:
            _kdn_iso_terms_forward_kernel[(triton.cdiv(rows, block_r),)](
                k, g, decay, norm2, rows, key_dim, G_HEAD=g.dim() < k.dim(),
                BLOCK_R=block_r, BLOCK_K=block_k, num_warps=warps,
            )  # fmt: skip
        ctx.save_for_backward(k, g)
        ctx.set_materialize_grads(False)
        # Returned as they came, autograd hands them back as views of k and g whose gradients
        # come to backward below.
        return decay, norm2, k, g

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_decay, d_norm2, dk_in, dg_in):
        k, g = ctx.saved_tensors
        key_dim = k.shape[-1]
        rows = k.numel() // key_dim
        # Either may be unused ([B, T, H]: a zero fill is K times smaller than the outputs).
        d_decay, d_norm2 = (
            k.new_zeros(k.shape[:-1], dtype=torch.float32) if d is None else d.contiguous()
            for d in (d_decay, d_norm2)
        )
        dk, dg = torch.empty_like(k), torch.empty_like(g)
        block_r, block_k, warps = iso_launch(key_dim)
        if rows:
            # An absent gradient is never read (its flag is off); k and g stand in for its
            # pointer.
            _kdn_iso_terms_backward_kernel[(triton.cdiv(rows, block_r),)](
                k, g, d_decay, d_norm2,
                k if dk_in is None else dk_in.contiguous(),
                g if dg_in is None else dg_in.contiguous(),
                dk, dg, rows, key_dim, G_HEAD=g.dim() < k.dim(),
                HAS_DK_IN=dk_in is not None, HAS_DG_IN=dg_in is not None,
                BLOCK_R=block_r, BLOCK_K=block_k, num_warps=warps,
            )  # fmt: skip
        return dk, dg


@opaque_to_compiler
def kdn_iso_gain(
    k: torch.Tensor,
    g: torch.Tensor,
    q_noise: torch.Tensor,
    r: torch.Tensor,
    p_prior: torch.Tensor,
    info_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`gains.iso_gain` on two stages each way: the terms' reductions over K above (a and
    ||k||^2 per token and head), then the scan with the evidence and beta inside it
    (`triton.kdn_iso_scan`). Returns (beta, p, predictive) `[B, T, H]` float32, then k and g
    routed through the terms' node, for the delta rule the gain feeds: its gradients of them are
    then summed with the terms' own by the terms' backward kernel (`_KDNIsoTerms`). k
    `[B, T, H, K]`, g `[B, T, H(, K)]`, q_noise and r `[B, T, H]` in their own float dtypes
    (read as they are, their gradients written back in them), p_prior `[B, H]` float32; all
    validated."""
    decay2, norm2, k, g = _KDNIsoTerms.apply(k.contiguous(), g.contiguous())
    scan = kdn_iso_scan(decay2, norm2, q_noise, r, p_prior, info_scale / k.shape[-1])
    return (*scan, k, g)
