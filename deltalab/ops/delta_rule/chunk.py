"""Chunkwise-parallel generalized delta rule in PyTorch, stable for chunks up to 256 tokens.

Inside a chunk of C tokens with inclusive cumulative log decay G_t (a K-vector, G_t <= 0) and
chunk-start state S_0 (README.md in this folder has the derivation):

    L_ts = sum_i b_ti a_si exp(G_ti - G_si)   (s < t)      M_ts = same with q_t   (s <= t)
    (I + L) N = U - (exp(G) * B) S_0
    O        = (exp(G) * Q) S_0 + M N
    S_C      = exp(G_C) * S_0 + (exp(G_C - G) * A)^T N

Stability: no positive number is ever exponentiated. Decay factors between tokens s < t are
formed against a reference point r with s <= r <= t, as exp(G_t - G_r) * exp(G_r - G_s) (both
factors <= 1, so underflow is harmless and overflow impossible); inside a diagonal sub-block they
are formed pairwise. The naive factorization exp(G_t) * exp(-G_s) overflows once -G_s > 88 in
float32, which a chunk of 256 tokens at g = -20 reaches after five tokens.

The unit lower-triangular system is solved blockwise: the 16 x 16 diagonal blocks are inverted
by triangular solves and the inverse is assembled by doubling,
    [[A, 0], [C, D]]^-1 = [[A^-1, 0], [-D^-1 C A^-1, D^-1]],
so the whole inverse is log2(C/16) rounds of batched matrix products.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from deltalab.ops._varlen import pad_packed, unpad_packed

# Sub-block size: pairwise decays inside, one reference point between. 16 is the smallest
# tile of a tensor-core matrix product, and keeps the pairwise [16, 16, K] tensors small.
SUB_BLOCK = 16
# Span of the pairwise decay factors inside a chunk with per-channel decay: pairs cost
# C * DECAY_BLOCK * K exponentials, references C^2 / DECAY_BLOCK * K; 8 was the faster on CPU
# (benchmarks/bench_delta_rule.py). Must divide SUB_BLOCK.
DECAY_BLOCK = 8


def padded_chunk_size(chunk_size: int) -> int:
    """The internal chunk length: C rounded up to SUB_BLOCK * 2^m (the doubling needs it).

    The extra positions hold identity tokens (a = b = u = q = 0, g = 0), which change nothing.
    """
    blocks = math.ceil(chunk_size / SUB_BLOCK)
    return SUB_BLOCK * (1 << (blocks - 1).bit_length())


def unit_lower_inverse(lower: torch.Tensor) -> torch.Tensor:
    """(I + L)^-1 for strictly lower-triangular L [..., C, C], C = SUB_BLOCK * 2^m."""
    size = lower.shape[-1]
    blocks = size // SUB_BLOCK
    eye = torch.eye(SUB_BLOCK, dtype=lower.dtype, device=lower.device)
    tiles = lower.unflatten(-2, (blocks, SUB_BLOCK)).unflatten(-1, (blocks, SUB_BLOCK))
    diagonal = torch.diagonal(tiles, dim1=-4, dim2=-2).movedim(-1, -3)  # [..., n, 16, 16]
    inverse = torch.linalg.solve_triangular(
        diagonal, eye.expand(diagonal.shape), upper=False, unitriangular=True
    )
    width = SUB_BLOCK
    while width < size:
        pairs = size // (2 * width)
        tiles = lower.unflatten(-2, (pairs, 2 * width)).unflatten(-1, (pairs, 2 * width))
        coupling = torch.diagonal(tiles, dim1=-4, dim2=-2).movedim(-1, -3)[..., width:, :width]
        first, second = inverse[..., 0::2, :, :], inverse[..., 1::2, :, :]
        corner = -(second @ coupling @ first)
        top = torch.cat([first, torch.zeros_like(first)], dim=-1)
        bottom = torch.cat([corner, second], dim=-1)
        inverse = torch.cat([top, bottom], dim=-2)
        width *= 2
    return inverse.squeeze(-3)


def _pair_masks(size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.arange(size, device=device)
    inclusive = idx[:, None] >= idx[None, :]
    return inclusive, idx[:, None] > idx[None, :]


def _intra_scalar(q, a, b, G):
    """L (strict) and M (inclusive) for one log decay per head; G: [..., C]."""
    inclusive, strict = _pair_masks(G.shape[-1], G.device)
    gap = (G[..., :, None] - G[..., None, :]).masked_fill(~inclusive, -math.inf)
    decay = gap.exp()
    lower = (b @ a.transpose(-1, -2)) * decay * strict
    attend = (q @ a.transpose(-1, -2)) * decay
    return lower, attend


def _intra_channel(q, a, b, G):
    """L (strict) and M (inclusive) for per-channel log decays; G: [..., C, K]."""
    size, _dim = G.shape[-2:]
    blocks = size // DECAY_BLOCK
    device = G.device
    G_blk = G.unflatten(-2, (blocks, DECAY_BLOCK))  # [..., n, c, K]
    # Reference of sub-block I: G just before its first token (0 for the first sub-block).
    ref = F.pad(G_blk[..., :-1, -1, :], (0, 0, 1, 0))  # [..., n, K]
    to_ref = (G_blk - ref.unsqueeze(-2)).exp()  # exp(G_t - ref_I(t)) <= 1
    b_ref = b.unflatten(-2, (blocks, DECAY_BLOCK)) * to_ref
    q_ref = q.unflatten(-2, (blocks, DECAY_BLOCK)) * to_ref
    # Columns s before sub-block I: a_s * exp(ref_I - G_s) <= 1, masked elsewhere before exp.
    position = torch.arange(size, device=device)
    starts = torch.arange(blocks, device=device) * DECAY_BLOCK
    before = (position[None, :] < starts[:, None]).unsqueeze(-1)  # [n, C, 1]
    gap = (ref.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill_(~before, -math.inf)
    a_ref = a.unsqueeze(-3) * gap.exp()  # [..., n, C, K]
    lower = torch.einsum("...itk,...isk->...its", b_ref, a_ref)  # [..., n, c, C]
    attend = torch.einsum("...itk,...isk->...its", q_ref, a_ref)
    # Diagonal sub-blocks: pairwise factors exp(G_t - G_s), s <= t, as one batched mat-vec
    # per row t for b and q together.
    inclusive, strict = _pair_masks(DECAY_BLOCK, device)
    pair = (G_blk.unsqueeze(-2) - G_blk.unsqueeze(-3)).masked_fill_(
        ~inclusive.unsqueeze(-1), -math.inf
    )
    pair_a = pair.exp() * a.unflatten(-2, (blocks, DECAY_BLOCK)).unsqueeze(-3)  # [..., n, c, c, K]
    rows = torch.stack([b, q], dim=-1).unflatten(-3, (blocks, DECAY_BLOCK))  # [..., n, c, K, 2]
    lower_diag, attend_diag = (pair_a @ rows).unbind(-1)  # [..., n, c(t), c(s)]
    lower_diag = lower_diag * strict
    # Place the diagonal sub-blocks into the [C, C] matrices.
    eye = torch.eye(blocks, dtype=G.dtype, device=device)[:, None, :, None]  # [i, 1, j, 1]
    lower = lower.unflatten(-1, (blocks, DECAY_BLOCK)) + lower_diag.unsqueeze(-2) * eye
    attend = attend.unflatten(-1, (blocks, DECAY_BLOCK)) + attend_diag.unsqueeze(-2) * eye
    return lower.flatten(-4, -3).flatten(-2, -1), attend.flatten(-4, -3).flatten(-2, -1)


def _to_chunks(x: torch.Tensor, chunks: int, chunk: int, padded: int) -> torch.Tensor:
    """[B, T, H, *rest] -> [B, H, n, C_pad, *rest], zero (identity) padding."""
    x = x.movedim(2, 1)  # [B, H, T, *rest]
    rest = x.dim() - 3
    x = F.pad(x, (0, 0) * rest + (0, chunks * chunk - x.shape[2]))
    x = x.unflatten(2, (chunks, chunk))
    return F.pad(x, (0, 0) * rest + (0, padded - chunk))


def _delta_rule_chunk_dense(q, a, b, u, g, initial_state, chunk_size):
    _batch, length, _heads, _ = q.shape
    chunks = math.ceil(length / chunk_size)
    padded = padded_chunk_size(chunk_size)
    q, a, b, u, g = (_to_chunks(x, chunks, chunk_size, padded) for x in (q, a, b, u, g))
    G = g.cumsum(dim=3)  # [B, H, n, C] or [B, H, n, C, K]
    if g.dim() == 4:
        lower, attend = _intra_scalar(q, a, b, G)
        G_k = G.unsqueeze(-1)
        G_end = G[..., -1:].unsqueeze(-1)  # [B, H, n, 1, 1]
    else:
        lower, attend = _intra_channel(q, a, b, G)
        G_k = G
        G_end = G[..., -1:, :]  # [B, H, n, 1, K]
    solve = unit_lower_inverse(lower)
    erase_from_start = solve @ (G_k.exp() * b)  # [B, H, n, C, K]
    target = solve @ u  # [B, H, n, C, V]
    read_from_start = G_k.exp() * q
    write_to_end = (G_end - G_k).exp() * a
    end_decay = G_end.exp().transpose(-1, -2)  # [B, H, n, K or 1, 1]

    state = initial_state
    outputs = []
    for i in range(chunks):
        residual = target[:, :, i] - erase_from_start[:, :, i] @ state
        outputs.append(read_from_start[:, :, i] @ state + attend[:, :, i] @ residual)
        state = end_decay[:, :, i] * state + write_to_end[:, :, i].transpose(-1, -2) @ residual
    o = torch.stack(outputs, dim=2)[:, :, :, :chunk_size]  # [B, H, n, C, V]
    o = o.flatten(2, 3)[:, :, :length].movedim(1, 2)
    return o, state


def delta_rule_chunk(
    q: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor,
    initial_state: torch.Tensor,
    offsets: list[int] | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise evaluation over validated inputs already scaled and cast to the state dtype.

    q, a, b: [B, T, H, K]; u: [B, T, H, V]; g: [B, T, H(, K)]; initial_state: [N, H, K, V];
    offsets: packed-sequence boundaries (B == 1) or None. Returns (o [B, T, H, V],
    final state [N, H, K, V]).
    """
    if offsets is None:
        return _delta_rule_chunk_dense(q, a, b, u, g, initial_state, chunk_size)
    padded = [pad_packed(x, offsets) for x in (q, a, b, u, g)]
    o, state = _delta_rule_chunk_dense(*padded, initial_state, chunk_size)
    return unpad_packed(o, offsets), state
