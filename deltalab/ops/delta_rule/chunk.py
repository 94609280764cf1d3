"""Chunkwise-parallel generalized delta rule in PyTorch, stable for chunks up to 256 tokens.

Inside a chunk of C tokens with inclusive cumulative log decay G_t (a K-vector, G_t <= 0) and
chunk-start state S_0 (README.md in this folder has the derivation):

    L_ts = sum_i b_ti a_si exp(G_ti - G_si)   (s < t)      M_ts = same with q_t   (s <= t)
    (I + L) N = U - (exp(G) * B) S_0
    O        = (exp(G) * Q) S_0 + M N
    S_C      = exp(G_C) * S_0 + (exp(G_C - G) * A)^T N

Stability: no positive number is ever exponentiated, and no decay exponent is a difference of
two long prefix sums. Every exponent is a sum of log decays over a token range, computed as a
sum (`segment_sum`), so it is exact for g = -inf (a full reset) and keeps float32 precision when
strong and weak decays mix (a difference G_t - G_s of prefix sums near -5000 loses ~3e-4 of
absolute precision, which is a relative error of that size in the factor). Factors between
tokens s < t in different sub-blocks go through the boundaries in between, as
exp(sum to the row's sub-block start) * exp(sum over whole sub-blocks) * exp(sum from s to its
sub-block end), all <= 1, so underflow is harmless and overflow impossible; inside a sub-block
they are formed pairwise. The naive factorization exp(G_t) * exp(-G_s) overflows once -G_s > 88
in float32, which a chunk of 256 tokens at g = -20 reaches after five tokens.

The unit lower-triangular system is solved blockwise: the 16 x 16 diagonal blocks are inverted
by triangular solves and the inverse is assembled by doubling,
    [[A, 0], [C, D]]^-1 = [[A^-1, 0], [-D^-1 C A^-1, D^-1]],
so the whole inverse is log2(C/16) rounds of batched matrix products.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from deltalab.ops._varlen import max_seqlen, pad_packed, unpad_packed
from deltalab.ops.parametrize import DeltaRuleInputs

# Sub-block size: pairwise decays inside, one reference point between. 16 is the smallest
# tile of a tensor-core matrix product, and keeps the pairwise [16, 16, K] tensors small.
SUB_BLOCK = 16
# Span of the pairwise decay factors inside a chunk with per-channel decay: pairs cost
# C * DECAY_BLOCK * K exponentials, references C^2 / DECAY_BLOCK * K; 8 was the faster on CPU
# (python -m benchmarks cpu delta_rule). Must divide SUB_BLOCK.
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


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """Sums over token ranges: x [..., L, K] -> [..., L(t), L(s), K] = sum_{s < j <= t} x_j.

    -inf where t < s (so exp gives 0 there). Computed by a masked cumulative sum, never as a
    difference of prefix sums.
    """
    length = x.shape[-2]
    idx = torch.arange(length, device=x.device)
    later = (idx[:, None] > idx[None, :]).unsqueeze(-1)  # [L(j), L(s), 1]: j > s
    terms = x.unsqueeze(-2).expand(*x.shape[:-2], length, length, x.shape[-1])
    sums = terms.masked_fill(~later, 0.0).cumsum(dim=-3)  # [..., L(t), L(s), K]
    inclusive = (idx[:, None] >= idx[None, :]).unsqueeze(-1)
    return sums.masked_fill(~inclusive, -math.inf)


def _intra_scalar(q, a, b, g):
    """L (strict) and M (inclusive) for one log decay per head; g: [..., C]."""
    decay = segment_sum(g.unsqueeze(-1)).squeeze(-1).exp()  # [..., C, C], 0 above the diagonal
    lower = ((b @ a.transpose(-1, -2)) * decay).tril(-1)
    attend = (q @ a.transpose(-1, -2)) * decay
    return lower, attend


def _intra_channel(q, a, b, g):
    """L (strict) and M (inclusive) for per-channel log decays; g: [..., C, K]."""
    size = g.shape[-2]
    blocks = size // DECAY_BLOCK
    g_blk = g.unflatten(-2, (blocks, DECAY_BLOCK))  # [..., n, c, K]
    a_blk = a.unflatten(-2, (blocks, DECAY_BLOCK))
    rows = torch.stack([b, q], dim=-1).unflatten(-3, (blocks, DECAY_BLOCK))  # [..., n, c, K, 2]
    # Row t of sub-block I: decay from I's start to t (inclusive).
    from_start = g_blk.cumsum(dim=-2).exp()  # [..., n, c, K]
    # Column s of sub-block J: decay from s to J's end (exclusive of s).
    to_end = F.pad(g_blk.flip(-2).cumsum(dim=-2).flip(-2)[..., 1:, :], (0, 0, 0, 1)).exp()
    # Whole sub-blocks strictly between J and I; 0 unless J < I.
    totals = g_blk.sum(dim=-2)  # [..., n, K]
    between = F.pad(segment_sum(totals)[..., :-1, :, :], (0, 0, 0, 0, 1, 0), value=-math.inf)
    between = between.exp()  # [..., n(I), n(J), K]
    a_ref = (between.unsqueeze(-2) * (a_blk * to_end).unsqueeze(-4)).flatten(
        -3, -2
    )  # [.., n, C, K]
    rows_ref = (rows * from_start.unsqueeze(-1)).movedim(-1, -3).flatten(-3, -2)  # [..., n, 2c, K]
    lower, attend = (rows_ref @ a_ref.transpose(-1, -2)).chunk(2, dim=-2)  # [..., n, c, C] each
    # Diagonal sub-blocks: pairwise factors, one batched mat-vec per row t for b and q together.
    pair_a = segment_sum(g_blk).exp() * a_blk.unsqueeze(-3)  # [..., n, c(t), c(s), K]
    lower_diag, attend_diag = (pair_a @ rows).unbind(-1)  # [..., n, c(t), c(s)]
    lower_diag = lower_diag.tril(-1)
    # Place the diagonal sub-blocks into the [C, C] matrices.
    eye = torch.eye(blocks, dtype=g.dtype, device=g.device)[:, None, :, None]  # [i, 1, j, 1]
    lower = lower.unflatten(-1, (blocks, DECAY_BLOCK)) + lower_diag.unsqueeze(-2) * eye
    attend = attend.unflatten(-1, (blocks, DECAY_BLOCK)) + attend_diag.unsqueeze(-2) * eye
    return lower.flatten(-4, -3).flatten(-2, -1), attend.flatten(-4, -3).flatten(-2, -1)


class ChunkOperators(NamedTuple):
    """What the sequential state pass needs of each chunk, all chunks at once.

    Shapes: [B, H, n, C, *] with n chunks of C (padded) tokens; `decay` is [B, H, n, K].

    read   = exp(G) * Q                     (queries decayed from the chunk start)
    attend = M                              (intra-chunk attention, inclusive)
    erase  = (I + L)^-1 (exp(G) * B)        (how the chunk-start state enters the residuals)
    target = (I + L)^-1 U                   (the residuals if the chunk-start state were 0)
    write  = exp(G_C - G) * A               (writes decayed to the chunk end)
    decay  = exp(G_C)                       (the chunk's total decay of the state)
    """

    read: torch.Tensor
    attend: torch.Tensor
    erase: torch.Tensor
    target: torch.Tensor
    write: torch.Tensor
    decay: torch.Tensor


def to_chunks(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[B, T, H, *rest] -> [B, H, n, C_pad, *rest] with identity (zero) tokens as padding."""
    chunks = math.ceil(x.shape[1] / chunk_size)
    x = x.movedim(2, 1)  # [B, H, T, *rest]
    rest = x.dim() - 3
    x = F.pad(x, (0, 0) * rest + (0, chunks * chunk_size - x.shape[2]))
    x = x.unflatten(2, (chunks, chunk_size))
    return F.pad(x, (0, 0) * rest + (0, padded_chunk_size(chunk_size) - chunk_size))


def from_chunks(x: torch.Tensor, chunk_size: int, length: int) -> torch.Tensor:
    """[B, H, n, C_pad, V] -> [B, T, H, V]: the inverse of `to_chunks` for outputs."""
    return x[:, :, :, :chunk_size].flatten(2, 3)[:, :, :length].movedim(1, 2)


def intra_chunk(q, a, b, g):
    """Stage 1: L (strict) and M (inclusive) [B, H, n, C, C] of chunked inputs."""
    if g.dim() == q.dim() - 1:
        return _intra_scalar(q, a, b, g)
    return _intra_channel(q, a, b, g)


def chunk_operators(q, a, b, u, g, intra=intra_chunk) -> ChunkOperators:
    """Stages 1 and 2 over chunked inputs [B, H, n, C, *]: intra-chunk matrices, then the
    unit-lower-triangular solve. Parallel over chunks. `intra` computes stage 1 (`intra_chunk`
    here, its Triton twin on the "triton" backend)."""
    lower, attend = intra(q, a, b, g)
    solve = unit_lower_inverse(lower)
    if g.dim() == q.dim() - 1:
        g = g.unsqueeze(-1)  # [B, H, n, C, 1]: broadcast over channels from here on
    # Decay from the chunk start to t (inclusive) and from t to the chunk end (exclusive).
    from_start = g.cumsum(dim=-2).exp()
    to_end = F.pad(g.flip(-2).cumsum(dim=-2).flip(-2)[..., 1:, :], (0, 0, 0, 1)).exp()
    decay = g.sum(dim=-2).exp().expand(*q.shape[:-2], q.shape[-1])
    return ChunkOperators(
        read=from_start * q,
        attend=attend,
        erase=solve @ (from_start * b),
        target=solve @ u,
        write=to_end * a,
        decay=decay,
    )


def state_pass(
    ops: ChunkOperators, initial_state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 3, sequential over chunks: residuals N [B, H, n, C, V], chunk-start states
    [B, H, n, K, V] and the final state [B, H, K, V].

        N_i = target_i - erase_i S_i,     S_{i+1} = decay_i * S_i + write_i^T N_i
    """
    state = initial_state
    residuals, states = [], []
    for i in range(ops.target.shape[2]):
        states.append(state)
        residual = ops.target[:, :, i] - ops.erase[:, :, i] @ state
        residuals.append(residual)
        state = (
            ops.decay[:, :, i, :, None] * state + ops.write[:, :, i].transpose(-1, -2) @ residual
        )
    return torch.stack(residuals, dim=2), torch.stack(states, dim=2), state


def chunk_output(ops: ChunkOperators, states: torch.Tensor, residuals: torch.Tensor):
    """Stage 4, parallel over chunks: O_i = read_i S_i + attend_i N_i, [B, H, n, C, V]."""
    return ops.read @ states + ops.attend @ residuals


def _delta_rule_chunk_dense(inputs: DeltaRuleInputs, initial_state, chunk_size):
    length = inputs.q.shape[1]
    ops = chunk_operators(*(to_chunks(x, chunk_size) for x in inputs))
    residuals, states, final = state_pass(ops, initial_state)
    return from_chunks(chunk_output(ops, states, residuals), chunk_size, length), final


def delta_rule_chunk(
    inputs: DeltaRuleInputs,
    initial_state: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise evaluation over validated inputs already scaled and cast to the state dtype.

    inputs: q, a, b [B, T, H, K]; u [B, T, H, V]; g [B, T, H(, K)]. initial_state: [N, H, K, V];
    cu_seqlens: packed-sequence boundaries [N+1] (B == 1, int64 on the inputs' device) or None.
    Returns (o [B, T, H, V], final state [N, H, K, V]).
    """
    if cu_seqlens is None:
        return _delta_rule_chunk_dense(inputs, initial_state, chunk_size)
    length = inputs.q.shape[1]
    max_len = max_seqlen(cu_seqlens, length)  # one device -> host sync (see max_seqlen)
    padded = DeltaRuleInputs(*(pad_packed(x, cu_seqlens, max_len) for x in inputs))
    o, state = _delta_rule_chunk_dense(padded, initial_state, chunk_size)
    return unpad_packed(o, cu_seqlens, length), state
