"""Triton state pass of the chunkwise delta rule: stage 3 (and the output, stage 4) fused.

The chunk operators (stages 1-2, `chunk.py`'s `chunk_operators`) are parallel over chunks; what
remains sequential is, per chunk i with chunk-start state S_i [K, V]:

    N_i     = target_i - erase_i S_i                     residuals          [C, V]
    O_i     = read_i S_i + attend_i N_i                  outputs            [C, V]
    S_{i+1} = decay_i * S_i + write_i^T N_i              next state         [K, V]

One program owns one (sequence, head) and a block of BV value columns and walks the chunks with
S in registers: columns of S never mix (every product above acts on S from the left), so value
blocks are independent programs. The backward walks the chunks in reverse with the adjoint
dS [K, BV] in registers:

    dN_i = attend_i^T dO_i + write_i dS_{i+1}
    dS_i = read_i^T dO_i + decay_i * dS_{i+1} - erase_i^T dN_i

and returns dN_i and dS_{i+1} per chunk; the gradients of the operators are then products
parallel over all chunks (`operator_grads_triton`; its PyTorch twin `_operator_grads`):

    d read_i = dO_i S_i^T    d attend_i = dO_i N_i^T    d erase_i = -dN_i S_i^T
    d write_i = N_i dS_{i+1}^T    d decay_i = sum_v dS_{i+1} * S_i    d target_i = dN_i

Two forms of the pass, chosen by `KernelOptions.state_pass` (by default the one that is faster
at the launch's size, `chosen_state_pass`): "fused" (above) and "split"
(`state_pass_split_triton`, `state_pass_split_triton_backward`), whose walks
keep only the products that depend on S or dS (N and S' forward, dN and dS backward) and leave
the outputs, attend^T dO and read^T dO to kernels parallel over chunks; the comment above
`_state_pass_split_fwd` says why that is exact and what it costs in memory traffic.

Precision: S and every accumulator are float32. The operators arrive in the inputs' dtype when
those are 16-bit (`KernelOptions.operator_dtype` "inputs", the default), else in float32.
16-bit operators are multiplied as stored, the state and the other operands rounded to their
dtype for each product (`KernelOptions.walk_dots` "operators", the default; "float32" widens
them to TF32 products).
With float32 operators the products run in IEEE float32 (TF32 would cost ~1e-3 relative
error); no exponential is taken here, the decays arrive as factors <= 1 from the stable
stage 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deltalab.ops._triton import opaque_to_compiler
from deltalab.ops._varlen import max_seqlen, pad_packed, unpad_packed
from deltalab.ops.delta_rule.chunk import ChunkOperators
from deltalab.ops.delta_rule.triton.factors import LAUNCH as FACTORS_LAUNCH
from deltalab.ops.delta_rule.triton.factors import factors_triton, factors_triton_backward
from deltalab.ops.delta_rule.triton.intra import LAUNCH as INTRA_LAUNCH
from deltalab.ops.delta_rule.triton.intra import (
    TileLaunch,
    Tokens,
    _load_rows,
    _operand,
    _token_offset,
    intra_triton,
    intra_triton_backward,
    key_block,
    unit_norms,
)
from deltalab.ops.delta_rule.triton.solve import LAUNCH as SOLVE_LAUNCH
from deltalab.ops.delta_rule.triton.solve import (
    lower_grad_triton,
    solve_triton,
    solve_triton_backward,
)
from deltalab.ops.launch_tables import LaunchRegistry
from deltalab.ops.options import DEFAULT_OPTIONS, KernelOptions


@dataclass(frozen=True)
class DeltaRuleLaunch:
    """The Triton delta rule's launch table: the state pass's value columns, row blocks, warps
    and pipeline stages, the threshold between its fused and split forms, and the tables of
    the kernels of stages 1-2 (`TileLaunch`: the factors, stage 1, the solve). `LAUNCH` holds
    the settings measured best (below); `delta_rule_triton` and the stages' launch functions
    take another as an argument (`tune_triton.py` sweeps them; tests reach at tiny shapes the
    paths of large ones)."""

    # Value columns per program: S [K, BV] float32 stays in registers, and B * H * V / BV programs
    # fill the GPU's SMs (one sequence and head alone is sequential). Measured on the H200 at
    # K = 128 (benchmarks/tune_triton.py): 64 columns with 8 warps beat 32 with 4 (0.78 / 0.86 ms
    # forward / backward against 0.88 / 1.19: half the programs reload each chunk's operators);
    # K = 256 keeps 32.
    block_v: int = 64
    block_v_wide_k: int = 32
    # Rows of a chunk per tile: a 64 x 64 float32 tile of `attend` is 16 KiB; a whole 256 x 256
    # chunk is 256 KiB, past the 227 KiB of shared memory of an H100/H200 SM (measured: chunk 256
    # failed to compile as one tile).
    block_c: int = 64
    # Warps per program of the state pass (with block_v above; the narrow launch below takes its
    # own) and of the operator gradients.
    num_warps: int = 8
    # Pipeline stages of the fused walks' chunk loop, with 16-bit operators and K <= 128 (`_launch`
    # takes 1 otherwise). Software pipelining keeps the next chunk's tiles in shared memory while
    # this one's products run: with float32 operators 2 stages overflowed the SM's 227 KiB
    # (2026-12-02). 16-bit operators (`KernelOptions.operator_dtype`) halve the operator tiles;
    # compiled for sm_90 (Triton 3.9, BV 64, 8 warps), forward / backward at chunk 64 take 64 / 64
    # KiB with 1 stage, 64 / 128 with 2, 64 / 160 with 3 (chunk 128: 64 / 64, 84 / 80, 100 / 96;
    # tests/test_triton_compile.py checks 2 and 3 fit). With the products widened (`walk_dots`
    # "float32") it stays 1 at block_v: 2 stages at BV 64 were slower backward on the H200 (below),
    # and where the fused walks make enough programs the narrow launch below is faster than either;
    # 16-bit products take low_dots_num_stages instead.
    num_stages: int = 1
    # The fused walks with 16-bit operators (K <= 128) and widened products (with 16-bit products,
    # see low_dots_num_warps below): narrow_block_v columns, narrow_num_stages stages and
    # narrow_num_warps warps wherever that makes fused_pass_min_programs walks (else block_v's
    # launch or the split pass; narrow_block_v None: never). Half the columns double the walks, and
    # the pipeline hides the operator loads of each chunk behind the products of the one before.
    # Measured on the H200, B=4 T=4096 K=V=128, bf16 (`tune_triton.py --shape 4xTx{8,16}x128
    # --stages state_pass state_pass_split`, 2026-12-02), forward / backward ms per layer:
    #
    #                                                   H=8 (340M preset)   H=16
    #   fused, BV 64, 8 warps, 1 stage                  0.56 / 0.57         0.63 / 0.61
    #   fused, BV 64, 8 warps, 2 stages                 0.48 / 0.59         0.51 / 0.60
    #   fused, BV 32, 8 warps, 2 stages                 0.36 / 0.33         0.73 / 0.66
    #   fused, BV 32, 4 warps, 2 stages (this launch)   0.32 / 0.39         0.47 / 0.58
    #   split, its launch                               0.37 / 0.45         0.68 / 0.83
    #
    # At H=8 it replaced the split pass (0.82 -> 0.71 ms a layer: the 340M step's delta-rule kernels
    # 76.8 -> 74.4 ms), at H=16 the fused pass at block_v (1.24 -> 1.05). With one sequence of 16K
    # tokens at H=8 (32 walks even at 32 columns) the split pass stays. With the products widened to
    # float32 the forward walk spills registers at each of these launches (compiled for sm_90; the
    # figures at `low_dots`, the choice that removes them).
    narrow_block_v: int | None = 32
    narrow_num_stages: int = 2
    narrow_num_warps: int = 4
    # With the walks' products in the operators' 16-bit dtype (`walk_dots` "operators", the default)
    # the operand registers halve and the order above changes: block_v's 64 columns on
    # low_dots_num_warps warps with low_dots_num_stages stages wherever they make
    # fused_pass_min_programs walks, else the narrow launch where its walks do, else the split pass.
    # Measured on the H200, B=4 T=4096 K=V=128, bf16, products in bf16 (`tune_triton.py --shape
    # 4x4096x{16,8}x128 --stages state_pass`, 2026-12-02), forward / backward ms per layer:
    #
    #                                                   H=8 (340M preset)   H=16
    #   fused, BV 64, 4 warps, 2 stages (this launch)   0.24 / 0.25         0.28 / 0.31
    #   fused, BV 64, 8 warps, 2 stages                 0.26 / 0.26         0.30 / 0.29
    #   fused, BV 32, 4 warps, 2 stages (narrow)        0.20 / 0.19         0.38 / 0.38
    #   (products widened to float32, the narrow launch 0.32 / 0.39         0.47 / 0.57)
    #
    # so H=16 takes this launch (128 walks) and H=8 at B=4 the narrow one (64 walks at 64 columns).
    low_dots_num_warps: int = 4
    low_dots_num_stages: int = 2
    # Value columns per step of the operator-gradient kernel: its [C, K] accumulators stay in
    # registers, the [K, BV] state blocks stream through.
    operator_block_v: int = 32
    # Pipeline stages of the split walks' chunk loop (forward and backward), at K <= 128 (K = 256
    # takes 1). The fused walks need 1 (2 overflowed shared memory); the split walks hold fewer
    # tiles per step, and 2 stages overlap the next chunk's loads with this one's products. Compiled
    # for sm_90 (tests/test_triton_compile.py's way, TF32, 8 warps, BV = 64): forward / backward
    # walk 80 / 80 KiB of shared memory with 1 stage, 208 / 192 KiB with 2 (the SM has 227), 288 /
    # 256 with 3; at K = 256, chunk 128 (BV = 32) 104 / 104 KiB with 1, 312 / 304 with 2 (too many).
    split_num_stages: int = 2
    # Value columns and warps per program of the split walks. The walk is latency-bound (one chunk
    # after another, a few small products each), so more programs of fewer columns win. Measured on
    # the H200 at the 340M preset's heads, H=8 K=V=128 chunk 64, bf16 inputs (benchmarks/
    # tune_triton.py --stages state_pass_split), forward / backward ms per layer:
    #
    #   walk setting (2 stages unless said)   B=4 T=4096     B=1 T=16384
    #   BV 16, 2 warps                         0.46 / 0.59    1.00 / 1.38
    #   BV 32, 4 warps                         0.49 / 0.56    1.40 / 1.56
    #   BV 64, 8 warps, 1 stage                0.66 / 0.76    2.06 / 2.33
    #   fused pass, its default (BV 64)        0.72 / 0.84    2.72 / 3.23
    #
    # (3 stages at BV 32 ran out of shared memory: 240 of 227 KiB.) K = 256 keeps block_v_wide_k.
    split_walk_block_v: int = 16
    split_walk_num_warps: int = 2
    # Value columns and warps per program of the split pass's parallel kernels (outputs forward, P
    # and Q backward): B * H * n * V / BV programs (times the row blocks forward), no registers
    # carried across chunks. Compiled for sm_90 at K = 128 and 256 (tests/test_triton_compile.py), 4
    # warps of 32 columns spill no registers (an earlier backward spilled 176 bytes a thread in its
    # Q [K, BV] at 4 warps of 64 columns; the current one does not). Measured on the H200 with bf16
    # operators (`tune_triton.py --stages state_pass_split`, 2026-12-02), the split pass forward /
    # backward ms per layer:
    #
    #   parallel kernels                B=4 T=4096 H=8   B=1 T=16384 H=8
    #   BV 64, 8 warps                  0.37 / 0.45      0.77 / 1.09
    #   BV 32, 4 warps                  0.33 / 0.43      0.71 / 1.07
    #   BV 128, 8 warps                 0.45 / 0.49      0.84 / 1.13
    split_block_v: int = 32
    split_num_warps: int = 4
    # The state pass `_DeltaRuleTriton` runs, `KernelOptions.state_pass`: "fused" (stages 3-4 in one
    # walk, `state_pass_triton`), "split" (the walk reduced to the state recurrence,
    # `state_pass_split_triton`), or "auto", the default: the fused pass from
    # fused_pass_min_programs programs (B * H * V / BV at the launch `_launch` picks), the split
    # pass below (96: a threshold between the two measured points, 64 and 128 programs, not itself
    # measured). The backward takes the forward's form. Measured on the H200 (`tune_triton.py`, per
    # layer, forward / backward ms):
    #   B=4 T=4096 H=16 (128 fused programs): fused 0.78 / 0.86, split 0.91 / 1.25;
    #   B=4 T=4096 H=8 (64): fused 0.72 / 0.84, split 0.46 / 0.59;
    #   B=1 T=16384 H=8 (16): fused 2.72 / 3.23, split 1.00 / 1.38.
    # (Those with float32 operators; with 16-bit ones the fused pass's launches are counted as
    # `_launch` picks them: at B=4, BV 64 at H=16 and the narrow launch at H=8, see
    # low_dots_num_warps.) The split walk has 4x the programs of the fused one (16 value columns,
    # not 64) and leaves the outputs to kernels parallel over chunks: it wins while the fused walks
    # leave SMs idle (132 on the H200), and loses by its extra kernels and traffic once they do not.
    fused_pass_min_programs: int = 96
    # The kernels of stages 1-2.
    factors: TileLaunch = FACTORS_LAUNCH
    intra: TileLaunch = INTRA_LAUNCH
    solve: TileLaunch = SOLVE_LAUNCH


LAUNCH = DeltaRuleLaunch()
# The table per card (`deltalab.ops.launch_tables`): `delta_rule_triton` takes the one for its
# inputs' device when given none.
LAUNCH_TABLES = LaunchRegistry("delta_rule", LAUNCH)


@triton.jit
def _offsets(K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
             BV: tl.constexpr, BC: tl.constexpr):  # fmt: skip
    """The program's index (of its walk or chunk) and the offsets and masks of its tiles: S
    [BK, BV], rows of a chunk [BC, BK] and [BC, BV], and a [BC, BC] block of `attend` (row
    stride C).

    Axis 0 of the launch grid counts (index, value block), the value block fastest: the programs
    of one chunk's value blocks run side by side (sharing its operators' loads in L2), and the
    count is bounded by 2^31 - 1, not by the 65535 of a grid's second axis (B * H * chunks
    passes that at B * H = 32, T = 128K, chunks of 64)."""
    blocks = tl.cdiv(V, BV)
    program = tl.program_id(0)
    index = (program // blocks).to(tl.int64)
    rk = tl.arange(0, BK)
    rv = (program % blocks) * BV + tl.arange(0, BV)
    rc = tl.arange(0, BC)
    mk = rk < K
    mv = rv < V
    kv = rk[:, None] * V + rv[None, :]
    mkv = mk[:, None] & mv[None, :]
    ck = rc[:, None] * K + rk[None, :]
    cv = rc[:, None] * V + rv[None, :]
    cc = rc[:, None] * C + rc[None, :]
    return index, rk, rv, rc, mk, mv, kv, mkv, ck, cv, cc


@triton.jit
def _state_or_zeros(at, mask, PRESENT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """A walk's first [BK, BV] float32 block: loaded at `at` when PRESENT (an initial state, a
    final state's gradient), else zeros."""
    if PRESENT:
        return tl.load(at, mask=mask, other=0.0).to(tl.float32)
    return tl.zeros([BK, BV], dtype=tl.float32)


@triton.jit
def _decayed(decay, chunk, rk, mk, s, K: tl.constexpr):
    """decay_i * S: the chunk's decays [K] (float32) scaling the rows of S."""
    d = tl.load(decay + chunk * K + rk, mask=mk, other=0.0)
    return d[:, None] * s


@triton.jit
def _residual_rows(erase, target, s, rows, ck, cv, mk, mv, K: tl.constexpr, V: tl.constexpr,
                   PRECISION: tl.constexpr, LOW_DOTS: tl.constexpr):  # fmt: skip
    """N = target - erase S over the chunk rows at `rows` [BC, BV], float32."""
    e = _operand(tl.load(erase + rows * K + ck, mask=mk[None, :], other=0.0), erase, LOW_DOTS)
    t = tl.load(target + rows * V + cv, mask=mv[None, :], other=0.0).to(tl.float32)
    return t - tl.dot(e, s.to(e.dtype), input_precision=PRECISION)


@triton.jit
def _written(write, n, rows, ck, mk, K: tl.constexpr, PRECISION: tl.constexpr,
             LOW_DOTS: tl.constexpr):  # fmt: skip
    """write^T N over the chunk rows at `rows`: their share of the next state [BK, BV]."""
    w = _operand(tl.load(write + rows * K + ck, mask=mk[None, :], other=0.0), write, LOW_DOTS)
    return tl.dot(tl.trans(w), n.to(w.dtype), input_precision=PRECISION)


@triton.jit
def _state_pass_fwd(
    read, attend, erase, target, write, decay, initial, out, residual, states, final,
    n_chunks, seg_len, n_seg, keep_every, TN, H, T, CS,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BC: tl.constexpr, HAS_INITIAL: tl.constexpr, PRECISION: tl.constexpr,
    WRITE_OUT: tl.constexpr = True, STORE_RESIDUAL: tl.constexpr = True,
    LOW_DOTS: tl.constexpr = False,
):  # fmt: skip
    """out: token-major [B, T, H, V] as `intra.Tokens` (TN, H, T, CS) maps it, written in its
    own dtype; the operators chunked, float32 or 16-bit (`operator_dtype`), read into float32;
    everything else chunked float32, n_chunks per (sequence, head). One program per
    value block and (sequence, head, segment of seg_len chunks; n_seg of them), starting from
    `initial` [B * H * n_seg, K, V] and ending in `final` of the same shape (the whole pass: one
    segment). WRITE_OUT=False: the walk alone (residuals, states, final state; `out`, read and
    attend are not touched), with the same operations on N and S as the full pass, so the same
    values. The chunk-start states stored are those of chunks 0, keep_every, 2 keep_every, ...
    of each (sequence, head), `states` holding ceil(n_chunks / keep_every) per (sequence, head)
    (keep_every = 1: all of them); STORE_RESIDUAL=False stores no residuals (with one row block,
    C == BC, nothing in the pass reads them back). LOW_DOTS: the products take the 16-bit
    operators as stored and the state and residuals rounded to their dtype (`low_dots`)."""
    walk, rk, rv, rc, mk, mv, kv, mkv, ck, cv, cc = _offsets(K, V, C, BK, BV, BC)
    bh = walk // n_seg
    start = (walk % n_seg) * seg_len
    s = _state_or_zeros(initial + walk * K * V + kv, mkv, HAS_INITIAL, BK, BV)
    n_kept = tl.cdiv(n_chunks, keep_every)
    for i in range(start, tl.minimum(start + seg_len, n_chunks)):
        chunk = bh * n_chunks + i
        out_offset, valid = _token_offset(chunk, TN, H, T, CS, V)
        kept = (bh * n_kept + i // keep_every).to(tl.int64)
        # (kv * 0 + ...: the condition as a tile, which the interpreter's masks require.)
        tl.store(states + kept * K * V + kv, s, mask=mkv & (kv * 0 + i % keep_every == 0))
        s_next = _decayed(decay, chunk, rk, mk, s, K)
        # Row blocks in order: block rb's outputs need the residuals of blocks <= rb, which
        # this program wrote to `residual` before the barrier (same CTA: visible after it).
        for rb in range(C // BC):
            rows = chunk * C + rb * BC
            n = _residual_rows(erase, target, s, rows, ck, cv, mk, mv, K, V, PRECISION, LOW_DOTS)
            if STORE_RESIDUAL:
                tl.store(residual + rows * V + cv, n, mask=mv[None, :])
            if WRITE_OUT:
                r = _operand(
                    tl.load(read + rows * K + ck, mask=mk[None, :], other=0.0), read, LOW_DOTS
                )
                m = _operand(tl.load(attend + rows * C + rb * BC + cc), attend, LOW_DOTS)
                o = (tl.dot(r, s.to(r.dtype), input_precision=PRECISION)
                     + tl.dot(m, n.to(m.dtype), input_precision=PRECISION))  # fmt: skip
                if rb > 0:
                    tl.debug_barrier()
                for cb in range(rb):
                    m = _operand(tl.load(attend + rows * C + cb * BC + cc), attend, LOW_DOTS)
                    n_before = tl.load(residual + (chunk * C + cb * BC) * V + cv,
                                       mask=mv[None, :])  # fmt: skip
                    o += tl.dot(m, n_before.to(m.dtype), input_precision=PRECISION)
                tokens = out_offset + (rb * BC + rc)[:, None] * (H * V) + rv[None, :]
                present = ((rb * BC + rc) < valid)[:, None] & mv[None, :]
                tl.store(out + tokens, o.to(out.dtype.element_ty), mask=present)
            s_next += _written(write, n, rows, ck, mk, K, PRECISION, LOW_DOTS)
        s = s_next
    tl.store(final + walk * K * V + kv, s, mask=mkv)


@triton.jit
def _state_pass_bwd(
    read, attend, erase, write, decay, d_out, d_final, d_residual, d_next, d_initial,
    n_chunks, TN, H, T, CS,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BC: tl.constexpr, HAS_D_FINAL: tl.constexpr, PRECISION: tl.constexpr,
    LOW_DOTS: tl.constexpr = False,
):  # fmt: skip
    """d_out: token-major [B, T, H, V] as `intra.Tokens` (TN, H, T, CS) maps it, any float
    dtype; everything else chunked float32. LOW_DOTS as `_state_pass_fwd`'s (dS, dN and dO
    rounded to the operators' dtype in the products)."""
    bh, rk, rv, rc, mk, mv, kv, mkv, ck, cv, cc = _offsets(K, V, C, BK, BV, BC)
    ds = _state_or_zeros(d_final + bh * K * V + kv, mkv, HAS_D_FINAL, BK, BV)
    for j in range(n_chunks):
        chunk = bh * n_chunks + (n_chunks - 1 - j)
        out_offset, valid = _token_offset(chunk, TN, H, T, CS, V)
        tl.store(d_next + chunk * K * V + kv, ds, mask=mkv)
        ds_before = _decayed(decay, chunk, rk, mk, ds, K)
        for cb in range(C // BC):
            cols = chunk * C + cb * BC
            # dN of column block cb: attend^T dO over row blocks rb >= cb (attend is lower
            # triangular in blocks), plus the path through the next state.
            w = _operand(
                tl.load(write + cols * K + ck, mask=mk[None, :], other=0.0), write, LOW_DOTS
            )
            dn = tl.dot(w, ds.to(w.dtype), input_precision=PRECISION)
            for rb in range(cb, C // BC):
                rows = chunk * C + rb * BC
                m = _operand(tl.load(attend + rows * C + cb * BC + cc), attend, LOW_DOTS)
                do = _load_rows(d_out + out_offset, rb * BC + rc, H * V, rv, 1, valid, mv)
                dn += tl.dot(tl.trans(m), do.to(m.dtype), input_precision=PRECISION)
            tl.store(d_residual + cols * V + cv, dn, mask=mv[None, :])
            r = _operand(tl.load(read + cols * K + ck, mask=mk[None, :], other=0.0), read, LOW_DOTS)
            e = _operand(
                tl.load(erase + cols * K + ck, mask=mk[None, :], other=0.0), erase, LOW_DOTS
            )
            do = _load_rows(d_out + out_offset, cb * BC + rc, H * V, rv, 1, valid, mv)
            ds_before += tl.dot(tl.trans(r), do.to(r.dtype), input_precision=PRECISION)
            ds_before -= tl.dot(tl.trans(e), dn.to(e.dtype), input_precision=PRECISION)
        ds = ds_before
    tl.store(d_initial + bh * K * V + kv, ds, mask=mkv)


# --- The split state pass: the sequential walk reduced to what depends on the state -------------
#
# The fused kernels above compute, inside the walk over chunks, products that do not depend on
# the walk: the outputs O_i need S_i and N_i, but nothing later needs O_i; in the adjoint,
# attend_i^T dO_i and read_i^T dO_i depend on dO only. The split moves them out of the loop:
#
#   forward   (1) sequential: N_i = target_i - erase_i S_i, S_{i+1} = decay_i S_i + write_i^T N_i,
#                 storing S_i and N_i (as the fused kernel does: backward saves them anyway);
#             (2) parallel over (chunk, row block, value block): O_i = read_i S_i + attend_i N_i
#                 from the stored S_i and N_i.
#   backward  (1) parallel over (chunk, value block): P_i = attend_i^T dO_i [C, V] and
#                 Q_i = read_i^T dO_i [K, V];
#             (2) sequential: dN_i = P_i + write_i dS_{i+1}, dS_i = Q_i + decay_i dS_{i+1}
#                 - erase_i^T dN_i.
#
# Exact: the same sums in another order. O_i is a function of (S_i, N_i) only, and S_i, N_i are
# stored in float32, the precision the fused kernel keeps them in registers: the outputs are the
# same products of the same float32 values (up to the order of the additions). Likewise P_i and
# Q_i are the terms of dN_i and dS_i that do not involve dS_{i+1}, formed in float32 and added
# in float32.
#
# Per row block of a step of the walk, the forward keeps 2 products (erase S, write^T N) of the
# fused 4 (and the fused kernel's attend N of earlier row blocks) and loads erase, target, write
# and decay, not read, attend nor earlier residuals back; the backward keeps 2 (write dS,
# erase^T dN) of the fused 3 plus the row blocks of attend^T dO, and loads write, erase, decay,
# P and Q in place of read, attend, write, erase, decay and (C/BC) (C/BC + 3) / 2 row blocks of
# dO per chunk (every one a strided token-major load).
#
# Extra memory traffic: the forward writes S_i and N_i either way; the output kernel reads them
# back (n K V + n C V floats per (sequence, head): at B=4 H=8 T=4096 K=V=128 chunk 64, 128 + 64
# MiB per layer) and re-reads read and attend, which the fused kernel read once. The backward
# writes P and Q once and reads them back once (the same 64 + 128 MiB, twice).
#
# Extra memory: none. P_i is written into dN's buffer (d_residual) and Q_i into the slot where
# the walk stores dS_i (d_next of the chunk before, or d_initial for the first chunk); the walk
# reads each before it overwrites it with dN_i / dS_i. A separate Q would be one [K, V] float32
# per chunk, as large as the saved chunk-start states (128 MiB per layer at the shape above, on
# top of a backward peak that already holds states, residuals, the recomputed operators, dN and
# dS'). Reading and then overwriting the same addresses in one program is safe without a
# barrier: the value stored at each element is computed from the value loaded there (dN = P +
# ..., dS = Q + ...), so whichever thread stores an element has already received what was
# loaded from it.


@triton.jit
def _state_pass_split_fwd(
    erase, target, write, decay, initial, residual, states, final,
    n_chunks, seg_len, n_seg,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BC: tl.constexpr, HAS_INITIAL: tl.constexpr, PRECISION: tl.constexpr,
    LOW_DOTS: tl.constexpr = False,
):  # fmt: skip
    """The split forward's walk: residuals and chunk-start states (chunked float32, n_chunks
    per (sequence, head)) and the final state; no outputs. Segments and LOW_DOTS as
    `_state_pass_fwd`'s."""
    walk, rk, _, _, mk, mv, kv, mkv, ck, cv, _ = _offsets(K, V, C, BK, BV, BC)
    bh = walk // n_seg
    start = (walk % n_seg) * seg_len
    s = _state_or_zeros(initial + walk * K * V + kv, mkv, HAS_INITIAL, BK, BV)
    for i in range(start, tl.minimum(start + seg_len, n_chunks)):
        chunk = bh * n_chunks + i
        tl.store(states + chunk * K * V + kv, s, mask=mkv)
        s_next = _decayed(decay, chunk, rk, mk, s, K)
        for rb in range(C // BC):
            rows = chunk * C + rb * BC
            n = _residual_rows(erase, target, s, rows, ck, cv, mk, mv, K, V, PRECISION, LOW_DOTS)
            tl.store(residual + rows * V + cv, n, mask=mv[None, :])
            s_next += _written(write, n, rows, ck, mk, K, PRECISION, LOW_DOTS)
        s = s_next
    tl.store(final + walk * K * V + kv, s, mask=mkv)


@triton.jit
def _state_pass_split_out(
    read, attend, residual, states, out,
    TN, H, T, CS,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BC: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The split forward's outputs, one program per (chunk and value block, row block):
    O = read S + attend N over the stored S and N. out token-major as in `_state_pass_fwd`."""
    chunk, _, rv, rc, mk, mv, kv, mkv, ck, cv, cc = _offsets(K, V, C, BK, BV, BC)
    rb = tl.program_id(1)
    out_offset, valid = _token_offset(chunk, TN, H, T, CS, V)
    rows = chunk * C + rb * BC
    s = tl.load(states + chunk * K * V + kv, mask=mkv, other=0.0)
    r = tl.load(read + rows * K + ck, mask=mk[None, :], other=0.0).to(tl.float32)
    o = tl.dot(r, s, input_precision=PRECISION)
    # attend is lower triangular in blocks: column blocks cb <= rb.
    for cb in range(rb + 1):
        m = tl.load(attend + rows * C + cb * BC + cc).to(tl.float32)
        n = tl.load(residual + (chunk * C + cb * BC) * V + cv, mask=mv[None, :], other=0.0)
        o += tl.dot(m, n, input_precision=PRECISION)
    tokens = out_offset + (rb * BC + rc)[:, None] * (H * V) + rv[None, :]
    present = ((rb * BC + rc) < valid)[:, None] & mv[None, :]
    tl.store(out + tokens, o.to(out.dtype.element_ty), mask=present)


@triton.jit
def _state_pass_split_dout(
    read, attend, d_out, d_residual, d_next, d_initial,
    n_chunks, TN, H, T, CS,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BC: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The split backward's parallel part, one program per (chunk, value block): P = attend^T dO
    into d_residual, Q = read^T dO into the slot the walk will store dS_i in (d_next of the
    chunk before; d_initial for a sequence's first chunk). d_out as in `_state_pass_bwd`."""
    chunk, _, rv, rc, mk, mv, kv, mkv, ck, cv, cc = _offsets(K, V, C, BK, BV, BC)
    out_offset, valid = _token_offset(chunk, TN, H, T, CS, V)
    q = tl.zeros([BK, BV], dtype=tl.float32)
    for cb in range(C // BC):
        cols = chunk * C + cb * BC
        p = tl.zeros([BC, BV], dtype=tl.float32)
        for rb in range(cb, C // BC):
            m = tl.load(attend + (chunk * C + rb * BC) * C + cb * BC + cc).to(tl.float32)
            do = _load_rows(d_out + out_offset, rb * BC + rc, H * V, rv, 1, valid, mv)
            p += tl.dot(tl.trans(m), do, input_precision=PRECISION)
        tl.store(d_residual + cols * V + cv, p, mask=mv[None, :])
        r = tl.load(read + cols * K + ck, mask=mk[None, :], other=0.0).to(tl.float32)
        do = _load_rows(d_out + out_offset, cb * BC + rc, H * V, rv, 1, valid, mv)
        q += tl.dot(tl.trans(r), do, input_precision=PRECISION)
    i = chunk % n_chunks
    if i == 0:
        tl.store(d_initial + (chunk // n_chunks) * K * V + kv, q, mask=mkv)
    else:
        tl.store(d_next + (chunk - 1) * K * V + kv, q, mask=mkv)


@triton.jit
def _state_pass_split_bwd(
    erase, write, decay, d_final, d_residual, d_next, d_initial,
    n_chunks,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BC: tl.constexpr, HAS_D_FINAL: tl.constexpr, PRECISION: tl.constexpr,
    LOW_DOTS: tl.constexpr = False,
):  # fmt: skip
    """The split backward's walk (LOW_DOTS as `_state_pass_bwd`'s), in place: d_residual holds
    P and turns into dN; the slot of dS_i (d_next of chunk i - 1, or d_initial) holds Q_i and
    turns into dS_i; d_next of the last chunk is dS_n = d_final (or 0)."""
    bh, rk, _, _, mk, mv, kv, mkv, ck, cv, _ = _offsets(K, V, C, BK, BV, BC)
    ds = _state_or_zeros(d_final + bh * K * V + kv, mkv, HAS_D_FINAL, BK, BV)
    tl.store(d_next + (bh * n_chunks + n_chunks - 1) * K * V + kv, ds, mask=mkv)
    for j in range(n_chunks):
        i = n_chunks - 1 - j
        chunk = bh * n_chunks + i
        if i == 0:
            slot = d_initial + bh * K * V + kv
        else:
            slot = d_next + (chunk - 1) * K * V + kv
        d = tl.load(decay + chunk * K + rk, mask=mk, other=0.0)
        ds_before = tl.load(slot, mask=mkv, other=0.0) + d[:, None] * ds
        for cb in range(C // BC):
            cols = chunk * C + cb * BC
            w = _operand(
                tl.load(write + cols * K + ck, mask=mk[None, :], other=0.0), write, LOW_DOTS
            )
            p = tl.load(d_residual + cols * V + cv, mask=mv[None, :], other=0.0)
            dn = p + tl.dot(w, ds.to(w.dtype), input_precision=PRECISION)
            tl.store(d_residual + cols * V + cv, dn, mask=mv[None, :])
            e = _operand(
                tl.load(erase + cols * K + ck, mask=mk[None, :], other=0.0), erase, LOW_DOTS
            )
            ds_before -= tl.dot(tl.trans(e), dn.to(e.dtype), input_precision=PRECISION)
        ds = ds_before
        tl.store(slot, ds, mask=mkv)


@triton.jit
def _operator_grads_kernel(
    d_out, states, residual, d_residual, d_next, d_read, d_attend, d_erase, d_write, d_decay,
    TN, H, T, CS,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BC: tl.constexpr, FROM_OUTPUT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The operator gradients of one block of BC rows of one chunk, summed over blocks of BV
    value columns. FROM_OUTPUT: d_read = dO S^T [BC, K] and d_attend = dO N^T [BC, C] (dO
    token-major as `intra.Tokens` maps it); else d_erase = -dN S^T, d_write = N dS'^T [BC, K]
    and, from the first row block, d_decay = sum_v dS' * S [K]. S the chunk-start state, N the
    residuals, dS' the adjoint after the chunk; all chunked float32. Two launches of one
    source, so that each keeps only its own accumulators in registers."""
    chunk = tl.program_id(0).to(tl.int64)
    rb = tl.program_id(1)
    rows = rb * BC + tl.arange(0, BC)
    rc = tl.arange(0, C)
    rk = tl.arange(0, BK)
    mk = rk < K
    rows_k = chunk * C * K + rows[:, None] * K + rk[None, :]
    if FROM_OUTPUT:
        out_offset, valid = _token_offset(chunk, TN, H, T, CS, V)
        acc_read = tl.zeros([BC, BK], dtype=tl.float32)
        acc_attend = tl.zeros([BC, C], dtype=tl.float32)
    else:
        acc_erase = tl.zeros([BC, BK], dtype=tl.float32)
        acc_write = tl.zeros([BC, BK], dtype=tl.float32)
        acc_decay = tl.zeros([BK], dtype=tl.float32)
    for vb in range(0, V, BV):
        rv = vb + tl.arange(0, BV)
        mv = rv < V
        mkv = mk[:, None] & mv[None, :]
        kv = chunk * K * V + rk[:, None] * V + rv[None, :]
        rows_v = chunk * C * V + rows[:, None] * V + rv[None, :]
        s = tl.load(states + kv, mask=mkv, other=0.0)
        if FROM_OUTPUT:
            do = _load_rows(d_out + out_offset, rows, H * V, rv, 1, valid, mv)
            n = tl.load(residual + chunk * C * V + rc[:, None] * V + rv[None, :],
                        mask=mv[None, :], other=0.0)  # fmt: skip
            acc_read += tl.dot(do, tl.trans(s), input_precision=PRECISION)
            acc_attend += tl.dot(do, tl.trans(n), input_precision=PRECISION)
        else:
            n = tl.load(residual + rows_v, mask=mv[None, :], other=0.0)
            dn = tl.load(d_residual + rows_v, mask=mv[None, :], other=0.0)
            ds = tl.load(d_next + kv, mask=mkv, other=0.0)
            acc_erase -= tl.dot(dn, tl.trans(s), input_precision=PRECISION)
            acc_write += tl.dot(n, tl.trans(ds), input_precision=PRECISION)
            acc_decay += tl.sum(ds * s, axis=1)
    if FROM_OUTPUT:
        tl.store(d_read + rows_k, acc_read, mask=mk[None, :])
        tl.store(d_attend + chunk * C * C + rows[:, None] * C + rc[None, :], acc_attend)
    else:
        tl.store(d_erase + rows_k, acc_erase, mask=mk[None, :])
        tl.store(d_write + rows_k, acc_write, mask=mk[None, :])
        tl.store(d_decay + chunk * K + rk, acc_decay, mask=mk & (rk * 0 + rb == 0))


# `KernelOptions.walk_dots`: the products of the walks (fused: `_state_pass_fwd`,
# `_state_pass_bwd`; split: their split counterparts) with 16-bit operators:
# "float32" widens every operand to float32 (TF32 products, as for float32 operators);
# "operators" (the default) multiplies the operators as stored, in their 16-bit dtype, with the
# state, the residuals, dS, dN and dO rounded to it at each product (the state itself and every
# accumulator stay float32), as fla's kernels do. 16-bit products halve the operand registers
# and run at twice TF32's rate on Hopper. Compiled for sm_90 (Triton 3.9, K = V = 128, chunk
# 64, bf16 operators), bytes spilled a thread, forward / adjoint walk, "float32" against
# "operators": the narrow launch 192 / 144 against 0 / 0, BV 64 with 8 warps and 1 stage
# 352 / 0 against 0 / 0 (shared memory 64 -> 40 KiB); tests/test_triton_compile.py keeps
# "operators" spill-free (but 40 and 24 bytes at chunks of 128, see there). On the H200 the
# walks took 0.59 instead of 1.04 ms a layer at H=16 and 0.39 instead of 0.71 at H=8 (forward
# and backward, the new launches against the widened defaults then, see
# `DeltaRuleLaunch.low_dots_num_warps`).
# The state stays float32 and only its copy for each product is rounded (bf16 keeps 8 bits
# against TF32's 11), so the rounding does not compound from chunk to chunk: each chunk's
# products carry a relative error of about 2^-9, as every other bf16 product of the layer
# does. Checked against the float64 loop: fp16 under the interpreter within the fp16 bound
# (tests/test_delta_rule_triton.py), bf16 on the H200 by its
# test_bf16_walks_stay_within_the_bf16_bound_of_the_loop (2026-12-02). The
# H200 runs' outputs with bf16 products
# differed from widened ones by at most 2.7e-3 (`tune_triton.py`). With fp16 operators the
# rounded adjoints (dS, dN, dO) must also fit fp16's range (65504), as under a loss scale they
# may not: set "float32" for fp16 training with large loss scales.


def low_dots(operators: torch.dtype, walk_dots: str = "operators") -> bool:
    """Whether the walks multiply in the operators' 16-bit dtype (`KernelOptions.walk_dots`)."""
    return walk_dots == "operators" and operators.itemsize == 2


def _launch(value_dim: int, programs: int, size: int, key_dim: int, precision: str,
            operators: torch.dtype = torch.float32, walk_dots: str = "operators",
            table: DeltaRuleLaunch = LAUNCH):  # fmt: skip
    """Grid and the shape constants shared by both kernels, from `table`; `operators`: the
    dtype the chunk operators are stored in, `walk_dots` their products' (16-bit operators take
    a pipelined launch: with 16-bit products low_dots_num_warps and low_dots_num_stages at
    block_v where its walks are enough, else the narrow launch where its own are; widened, the
    narrow launch where its walks are enough, else num_stages at block_v)."""
    block_v = table.block_v if key_dim <= 128 else table.block_v_wide_k
    pipelined = operators.itemsize == 2 and key_dim <= 128
    low = pipelined and low_dots(operators, walk_dots)
    stages, warps = (table.num_stages if pipelined else 1), table.num_warps
    if low:
        stages, warps = table.low_dots_num_stages, table.low_dots_num_warps
    threshold = table.fused_pass_min_programs
    enough = triton.cdiv(value_dim, block_v) * programs >= threshold
    if pipelined and table.narrow_block_v and not (enough and low):
        narrow = triton.cdiv(value_dim, table.narrow_block_v) * programs
        if narrow >= threshold:
            block_v, stages = table.narrow_block_v, table.narrow_num_stages
            warps = table.narrow_num_warps
    grid = (triton.cdiv(value_dim, block_v) * programs,)  # `_offsets` splits it
    consts = {
        "K": key_dim, "V": value_dim, "C": size, "BK": key_block(key_dim),
        "BV": block_v, "BC": min(size, table.block_c), "PRECISION": precision,
        "num_warps": warps, "num_stages": stages,
    }  # fmt: skip
    return grid, consts


def state_pass_triton(ops, initial_state: torch.Tensor | None, precision: str = "ieee",
                      out: torch.Tensor | None = None, tokens: Tokens | None = None,
                      write_out: bool = True, keep_every: int = 1,
                      keep_residuals: bool = True, walk_dots: str = "operators",
                      table: DeltaRuleLaunch = LAUNCH):  # fmt: skip
    """Stages 3-4 of `chunk.py` in one kernel: (outputs, residuals [B, H, n, C, V], chunk-start
    states [B, H, n, K, V], final state [B, H, K, V]). With keep_every > 1 only the states of
    chunks 0, keep_every, 2 keep_every, ... [B, H, ceil(n / keep_every), K, V] (what the
    backward keeps with `KernelOptions.recompute_states`: the others are never written);
    keep_residuals=False returns None for the residuals (the kernel writes them only where it
    reads them back).

    `ops`: a `ChunkOperators` of contiguous tensors [B, H, n, C, *] (float32, or 16-bit as
    `operator_dtype` stores them; decay float32); initial_state:
    [B, H, K, V] or None; precision: "ieee" (float32 products) or "tf32". The outputs go to
    `out`, token-major [B, T, H, V] as `tokens` maps it, in its dtype; without it, to a new
    chunked float32 [B, H, n, C, V]. write_out=False: no outputs (returned as None). `table`:
    the launch table.
    """
    start = None if initial_state is None else initial_state[:, :, None]
    out, residual, states, ends = _walk_fused(
        ops, start, ops.read.shape[2], precision, out, tokens, write_out, keep_every,
        keep_residuals, walk_dots, table,
    )  # fmt: skip
    return out, residual, states, ends[:, :, 0]


def _walk_fused(ops, starts, every: int, precision: str, out=None, tokens=None,
                write_out: bool = True, keep_every: int = 1, keep_residuals: bool = True,
                walk_dots: str = "operators", table: DeltaRuleLaunch = LAUNCH):  # fmt: skip
    """`_state_pass_fwd` over segments of `every` chunks, all at once, each from its start state
    in `starts` [B, H, n_seg, K, V] float32 (None: one segment, from zero): (outputs or None,
    residuals or None, chunk-start states (every keep_every-th), each segment's end state
    [B, H, n_seg, K, V])."""
    batch, heads, n_chunks, size, key_dim = ops.read.shape
    value_dim = ops.target.shape[-1]
    n_seg = 1 if starts is None else starts.shape[2]
    device = ops.read.device
    # The launch of the whole walk (value columns, warps, stages), only with n_seg times its
    # programs: the segments' walk then does each chunk's products as the forward did, the same
    # values bit for bit, where a launch picked by the segments' count could differ.
    _, consts = _launch(value_dim, batch * heads, size, key_dim, precision, ops.read.dtype,
                        walk_dots, table)  # fmt: skip
    grid = (triton.cdiv(value_dim, consts["BV"]) * batch * heads * n_seg,)
    # Residuals are written where they are kept or where the pass reads them back (row blocks
    # after the first read the earlier blocks' residuals: chunks past block_c rows).
    store_residual = keep_residuals or size > consts["BC"]
    residual = (
        torch.empty(batch, heads, n_chunks, size, value_dim, device=device)
        if store_residual
        else None
    )
    if not write_out:  # the kernel reads neither `out` nor `tokens`
        out, tokens = None, Tokens(1, 1, size, size)
    elif out is None:
        out = torch.empty(batch, heads, n_chunks, size, value_dim, device=device)
        tokens = Tokens.of_chunks(out)
    states = torch.empty(batch, heads, -(-n_chunks // keep_every), key_dim, value_dim,
                         device=device)  # fmt: skip
    ends = torch.empty(batch, heads, n_seg, key_dim, value_dim, device=device)
    _state_pass_fwd[grid](
        *ops, starts if starts is not None else ends, out if out is not None else ends,
        residual if residual is not None else ends, states, ends, n_chunks, every, n_seg,
        keep_every, *tokens.args(), HAS_INITIAL=starts is not None, WRITE_OUT=write_out,
        STORE_RESIDUAL=store_residual, LOW_DOTS=low_dots(ops.read.dtype, walk_dots), **consts,
    )  # fmt: skip
    return out, residual if keep_residuals else None, states, ends


def _adjoint_buffers(ops, d_out: torch.Tensor, tokens: Tokens | None):
    """The adjoint walks' token map (`tokens`, or d_out's chunks when None) and their outputs,
    uninitialized: dN [B, H, n, C, V], dS after each chunk [B, H, n, K, V], d initial
    state [B, H, K, V]."""
    batch, heads, n_chunks, size, key_dim = ops.read.shape
    value_dim = d_out.shape[-1]
    tokens = Tokens.of_chunks(d_out) if tokens is None else tokens
    device = d_out.device
    d_residual = torch.empty(batch, heads, n_chunks, size, value_dim, device=device)
    d_next = torch.empty(batch, heads, n_chunks, key_dim, value_dim, device=device)
    d_initial = torch.empty(batch, heads, key_dim, value_dim, device=device)
    return tokens, d_residual, d_next, d_initial


def state_pass_triton_backward(
    ops, d_out: torch.Tensor, d_final: torch.Tensor | None, precision: str = "ieee",
    tokens: Tokens | None = None, walk_dots: str = "operators", table: DeltaRuleLaunch = LAUNCH,
):  # fmt: skip
    """The adjoint walk: (dN [B, H, n, C, V], dS after each chunk [B, H, n, K, V],
    d initial state [B, H, K, V]). d_out: token-major [B, T, H, V] as `tokens` maps it, or
    chunked [B, H, n, C, V] float32 (tokens=None). `table`: the launch table."""
    batch, heads, n_chunks, size, key_dim = ops.read.shape
    value_dim = d_out.shape[-1]
    tokens, d_residual, d_next, d_initial = _adjoint_buffers(ops, d_out, tokens)
    grid, consts = _launch(value_dim, batch * heads, size, key_dim, precision, ops.read.dtype,
                           walk_dots, table)  # fmt: skip
    _state_pass_bwd[grid](
        ops.read, ops.attend, ops.erase, ops.write, ops.decay, d_out,
        d_final if d_final is not None else d_initial, d_residual, d_next, d_initial, n_chunks,
        *tokens.args(), HAS_D_FINAL=d_final is not None,
        LOW_DOTS=low_dots(ops.read.dtype, walk_dots), **consts,
    )  # fmt: skip
    return d_residual, d_next, d_initial


def _split_launch(value_dim: int, size: int, key_dim: int, precision: str,
                  table: DeltaRuleLaunch = LAUNCH):  # fmt: skip
    """The split pass's launch constants from `table`: (walk's, parallel kernels'), each with
    its options."""
    _, walk = _launch(value_dim, 1, size, key_dim, precision, table=table)
    if key_dim <= 128:
        walk.update(BV=table.split_walk_block_v, num_warps=table.split_walk_num_warps,
                    num_stages=table.split_num_stages)  # fmt: skip
    parallel = {**walk, "BV": min(table.split_block_v, key_block(value_dim)),
                "num_warps": table.split_num_warps, "num_stages": 1}  # fmt: skip
    return walk, parallel


def _walk_split(ops, starts, every: int, precision: str, walk_dots: str = "operators",
                table: DeltaRuleLaunch = LAUNCH):  # fmt: skip
    """`_state_pass_split_fwd` over segments of `every` chunks, as `_walk_fused` (no outputs):
    (residuals, chunk-start states, each segment's end state)."""
    batch, heads, n_chunks, size, key_dim = ops.read.shape
    value_dim = ops.target.shape[-1]
    n_seg = 1 if starts is None else starts.shape[2]
    device = ops.read.device
    residual = torch.empty(batch, heads, n_chunks, size, value_dim, device=device)
    states = torch.empty(batch, heads, n_chunks, key_dim, value_dim, device=device)
    ends = torch.empty(batch, heads, n_seg, key_dim, value_dim, device=device)
    walk, _ = _split_launch(value_dim, size, key_dim, precision, table)
    _state_pass_split_fwd[(triton.cdiv(value_dim, walk["BV"]) * batch * heads * n_seg,)](
        ops.erase, ops.target, ops.write, ops.decay, starts if starts is not None else ends,
        residual, states, ends, n_chunks, every, n_seg, HAS_INITIAL=starts is not None,
        LOW_DOTS=low_dots(ops.read.dtype, walk_dots), **walk,
    )  # fmt: skip
    return residual, states, ends


def state_walk_split_triton(ops, starts: torch.Tensor, every: int, precision: str = "ieee",
                            walk_dots: str = "operators",
                            table: DeltaRuleLaunch = LAUNCH):  # fmt: skip
    """What the backward recomputes when it does not keep the split pass's states and residuals
    (`KernelOptions.recompute_states`): (residuals [B, H, n, C, V], chunk-start states
    [B, H, n, K, V]) from `starts` [B, H, ceil(n / every), K, V], the chunk-start states of
    chunks 0, every, 2 every, ... The segments between them are walked at once, one program
    each (per value block), with the forward walk's operations: the same values, bit for bit.
    walk_dots: the products' dtype, as the forward took them (`low_dots`); `table`, its launch
    table."""
    residual, states, _ = _walk_split(ops, starts, every, precision, walk_dots, table)
    return residual, states


def state_walk_fused_triton(ops, starts: torch.Tensor, every: int, precision: str = "ieee",
                            walk_dots: str = "operators",
                            table: DeltaRuleLaunch = LAUNCH):  # fmt: skip
    """`state_walk_split_triton` for the fused pass (`_state_pass_fwd` with WRITE_OUT=False):
    the values its forward gave."""
    _, residual, states, _ = _walk_fused(ops, starts, every, precision, write_out=False,
                                         walk_dots=walk_dots, table=table)  # fmt: skip
    return residual, states


def state_pass_split_triton(ops, initial_state: torch.Tensor | None, precision: str = "ieee",
                            out: torch.Tensor | None = None, tokens: Tokens | None = None,
                            keep_every: int = 1, keep_residuals: bool = True,
                            walk_dots: str = "operators",
                            table: DeltaRuleLaunch = LAUNCH):  # fmt: skip
    """`state_pass_triton` split in two kernels (the walk, then the outputs in parallel over
    chunks; see above `_state_pass_split_fwd`): the same arguments and returns. The output
    kernel reads every chunk-start state and residual, so the walk writes them all; keep_every
    and keep_residuals only choose what is returned."""
    batch, heads, n_chunks, size, key_dim = ops.read.shape
    value_dim = ops.target.shape[-1]
    start = None if initial_state is None else initial_state[:, :, None]
    residual, states, ends = _walk_split(ops, start, n_chunks, precision, walk_dots, table)
    final = ends[:, :, 0]
    if out is None:
        out, tokens = torch.empty_like(residual), Tokens.of_chunks(residual)
    _, parallel = _split_launch(value_dim, size, key_dim, precision, table)
    blocks = triton.cdiv(value_dim, parallel["BV"]) * batch * heads * n_chunks
    _state_pass_split_out[(blocks, size // parallel["BC"])](
        ops.read, ops.attend, residual, states, out, *tokens.args(), **parallel
    )
    if keep_every > 1:
        states = states[:, :, ::keep_every].contiguous()
    return out, residual if keep_residuals else None, states, final


def state_pass_split_triton_backward(
    ops, d_out: torch.Tensor, d_final: torch.Tensor | None, precision: str = "ieee",
    tokens: Tokens | None = None, walk_dots: str = "operators", table: DeltaRuleLaunch = LAUNCH,
):  # fmt: skip
    """`state_pass_triton_backward` split in two kernels (attend^T dO and read^T dO in parallel
    over chunks, then the walk; see above `_state_pass_split_fwd`): the same arguments and
    returns, and no memory beyond them."""
    batch, heads, n_chunks, size, key_dim = ops.read.shape
    value_dim = d_out.shape[-1]
    tokens, d_residual, d_next, d_initial = _adjoint_buffers(ops, d_out, tokens)
    walk, parallel = _split_launch(value_dim, size, key_dim, precision, table)
    _state_pass_split_dout[(triton.cdiv(value_dim, parallel["BV"]) * batch * heads * n_chunks,)](
        ops.read, ops.attend, d_out, d_residual, d_next, d_initial, n_chunks, *tokens.args(),
        **parallel,
    )  # fmt: skip
    _state_pass_split_bwd[(triton.cdiv(value_dim, walk["BV"]) * batch * heads,)](
        ops.erase, ops.write, ops.decay, d_final if d_final is not None else d_initial,
        d_residual, d_next, d_initial, n_chunks, HAS_D_FINAL=d_final is not None,
        LOW_DOTS=low_dots(ops.read.dtype, walk_dots), **walk,
    )  # fmt: skip
    return d_residual, d_next, d_initial


# Per state pass: its forward, its backward, and the walk that gives the residuals and the
# chunk-start states again (`KernelOptions.recompute_states`).
PASS_FORMS = {
    "fused": (state_pass_triton, state_pass_triton_backward, state_walk_fused_triton),
    "split": (state_pass_split_triton, state_pass_split_triton_backward, state_walk_split_triton),
}


def chosen_state_pass(batch: int, heads: int, key_dim: int, value_dim: int,
                      operators: torch.dtype = torch.float32,
                      options: KernelOptions = DEFAULT_OPTIONS,
                      table: DeltaRuleLaunch = LAUNCH) -> str:  # fmt: skip
    """The state pass `options.state_pass` names for inputs of this shape whose chunk operators
    are stored in `operators` (`DeltaRuleLaunch.fused_pass_min_programs`; 16-bit ones may take
    the narrow fused launch), launched by `table`."""
    if options.state_pass != "auto":
        return options.state_pass
    (programs,), _ = _launch(value_dim, batch * heads, 1, key_dim, "ieee", operators,
                             options.walk_dots, table)  # fmt: skip
    return "fused" if programs >= table.fused_pass_min_programs else "split"


# `KernelOptions.recompute_states` (default on): the backward walks the chunks again for the
# chunk-start states [B, H, n, K, V] and the residuals [B, H, n, C, V] instead of keeping them
# from the forward. Both are float32: with 8 heads of K = V = 128 and chunks of 64 (the 340M
# preset) they are 12 KB per token and layer, the largest item of what a GDN-2 block keeps for
# its backward. Measured on the H200 in a 340M GDN-2 training step (bf16, 24 layers, split pass;
# 2026-12-01): peak memory 33.0 -> 28.8 GiB at B=4 T=4096 and 33.1 -> 28.7 at
# B=1 T=16384 (Muir 35.9 -> 31.6 at 16K, Diagonal KDN 38.9 -> 34.7 at 4K); kernel time per step
# 232.2 -> 238.8 ms (+2.8%) at 4K and 261.6 -> 288.4 (+10%: 64 walks of 256 chunks, as in the
# forward) at 16K. Those figures are for the walk from the initial state; walking from
# checkpoints (below), the 16K step's delta-rule kernels took 112.8 ms against 135.2
# (2026-12-02). The walk gives the forward's values bit for bit, both passes, compiled on the
# H200 (Triton 3.6, bf16 and float32) and under the interpreter (tests/test_delta_rule_triton.py).
#
# `KernelOptions.checkpoint_every` (default 8): the forward keeps the chunk-start states of chunks
# 0, 8, 16, ... (1/8 of them: 1 KB per token and layer at the 340M preset, against 12 KB for all
# of them and the residuals), and the backward walks the segments between them all at once:
# B * H * n / 8 walks of 8 chunks instead of B * H walks of n. A walk is latency-bound (one chunk
# after the other), so the 340M preset's recomputation at B=1 T=16384 (16 walks of 256 chunks
# with the fused pass's value blocks; 64 with the split pass's) becomes 32 times as many walks,
# each 32 times shorter, and fills the GPU.


def operator_grads_triton(states, residuals, d_out, d_residual, d_next, precision: str = "ieee",
                          tokens: Tokens | None = None,
                          table: DeltaRuleLaunch = LAUNCH) -> ChunkOperators:  # fmt: skip
    """`_operator_grads` in Triton (erase and target as in the twin; d_out token-major as
    `tokens` maps it, or chunked float32 with tokens=None). Returns chunked float32 tensors
    shaped as the operators [B, H, n, C, *]. `table`: the launch table."""
    batch, heads, n_chunks, key_dim, value_dim = states.shape
    size = residuals.shape[-2]
    tokens = Tokens.of_chunks(d_out) if tokens is None else tokens
    lead = (batch, heads, n_chunks)
    d_read, d_erase, d_write = (states.new_empty(*lead, size, key_dim) for _ in range(3))
    d_attend = states.new_empty(*lead, size, size)
    d_decay = states.new_empty(*lead, key_dim)
    block_v = min(table.operator_block_v, key_block(value_dim))
    for from_output in (True, False):
        block_c = min(size, table.block_c)
        _operator_grads_kernel[(batch * heads * n_chunks, size // block_c)](
            d_out, states, residuals, d_residual, d_next, d_read, d_attend, d_erase, d_write,
            d_decay, *tokens.args(), K=key_dim, V=value_dim, C=size, BK=key_block(key_dim),
            BV=block_v, BC=block_c, FROM_OUTPUT=from_output, PRECISION=precision,
            num_warps=table.num_warps, num_stages=1,
        )  # fmt: skip
    return ChunkOperators(d_read, d_attend, d_erase, d_residual, d_write, d_decay)


def _operator_grads(states, residuals, d_out, d_residual, d_next) -> ChunkOperators:
    """Gradients of the chunk operators from the adjoint walk, batched over all chunks (the
    PyTorch twin of `operator_grads_triton`)."""
    states_t = states.transpose(-1, -2)
    return ChunkOperators(
        read=d_out @ states_t,
        attend=d_out @ residuals.transpose(-1, -2),
        erase=-(d_residual @ states_t),
        target=d_residual,
        write=residuals @ d_next.transpose(-1, -2),
        decay=(d_next * states).sum(dim=-1),
    )


# `KernelOptions.operator_dtype`: the dtype the chunk operators are stored in between kernels
# (read, attend, erase, target, write, and the erase's right-hand side exp(G) b; not the decays,
# nor L, the solve's matrix): "inputs" (the default) stores them in the inputs' 16-bit dtype when
# q, a, b or u is bf16 or fp16 (`operator_dtype`); "float32" always in float32. Every kernel forms
# them in float32; the state pass's walks multiply 16-bit ones as stored
# (`KernelOptions.walk_dots`), the other kernels read them
# back into float32 products; the states, residuals and every accumulator stay
# float32. What the 16-bit storage adds is the rounding of each operator to the inputs' dtype:
# read, write and exp(G) b are factors <= 1 times q, a, b (rounded as the inputs were), M is a
# float32 sum rounded once, and the solve's rows carry the rounding of the rows solved before
# them (it reads them back as stored). With fp16 that is finer than the TF32 operands the
# products already take (11 significant bits each); with bf16 (8 bits) it is coarser, an
# error of the inputs' own size on every operator. It halves the bytes the state pass, the
# solve and the factors move per chunk. Measured on the H200 (2026-12-02;
# python -m benchmarks ops and train), bf16 inputs: the largest
# relative error against float64 over the output and every gradient, at bench_triton.py's
# check shape, 6.4e-3 (float32 operators: 6.1e-3); at B=4 T=4096 H=16, GDN-2's
# forward+backward 7.37 -> 6.66 ms and its peak 2.04 -> 1.76 GiB; the 340M GDN-2 step's
# delta-rule kernels 86.1 -> 76.8 ms.


def operator_dtype(*inputs: torch.Tensor, stored: str = "inputs") -> torch.dtype:
    """The dtype the chunk operators are stored in for inputs q, a, b, u and
    `KernelOptions.operator_dtype` `stored`: with "inputs" the first 16-bit dtype among them,
    else (or with none) float32."""
    low = _low_precision(*inputs)
    return low if stored == "inputs" and low is not None else torch.float32


def _precision_inputs(q, a, b, u) -> tuple[torch.Tensor, ...]:
    """The inputs whose dtypes pick the operators' dtype and the products' precision: all four,
    but a strength per token (a [B, T, H]), a factor multiplied in float32 as b is loaded, whose
    16-bit rounding is the product's own (a float32 call with a bf16 beta stays float32, as it
    did when the direction beta k was formed in k's dtype)."""
    return (q, b, u) if a.dim() == q.dim() - 1 else (q, a, b, u)


def _low_precision(*inputs: torch.Tensor) -> torch.dtype | None:
    """The first 16-bit float dtype among the inputs, or None."""
    return next((x.dtype for x in inputs if x.dtype in (torch.bfloat16, torch.float16)), None)


def _operators_triton(q, a, b, u, g, precision: str, tokens: Tokens, scale: float,
                      dtype: torch.dtype = torch.float32, norms=None,
                      table: DeltaRuleLaunch = LAUNCH):  # fmt: skip
    """Stages 1-2 in Triton over token-major inputs as `tokens` maps them (q times `scale`):
    (the chunk operators [B, H, n, C, *] in `dtype`, the decays float32; L float32), launched
    by `table`. The twin of `chunk.chunk_operators`. With `norms` (`intra.unit_norms`), of
    unit-norm q and b rows: stage 1, which loads whole rows, writes their inverse norms there
    for the factors."""
    lower, attend = intra_triton(q, a, b, g, precision, tokens, scale, attend_dtype=dtype,
                                 norms=norms, table=table.intra)  # fmt: skip
    read, erase_rhs, write, decay = factors_triton(q, a, b, g, tokens, scale, dtype, norms,
                                                   table.factors)  # fmt: skip
    erase = solve_triton(lower, erase_rhs, precision, dtype=dtype, table=table.solve)
    target = solve_triton(lower, u, precision, tokens, dtype=dtype, table=table.solve)
    lead = (q.shape[0], tokens.heads, tokens.chunks)
    ops = ChunkOperators(read, attend, erase, target, write, decay)
    return ChunkOperators(*(x.view(*lead, *x.shape[1:]) for x in ops)), lower


class _DeltaRuleTriton(torch.autograd.Function):
    """Inputs [B, T, H, *] in their own dtype -> (o [B, T, H, V] in q's dtype, final state).

    Every stage is a Triton kernel. The kernels read the inputs where they lie (token-major, any
    float dtype, `intra.Tokens`) and write the output and the input gradients there in the
    inputs' dtypes: no copy into chunks, no cast. The backward recomputes stages 1-2 instead of
    storing the per-chunk operators, and walks the stages back by hand (no PyTorch graph through
    them).

    Saved for backward: the inputs themselves, and (with `options.recompute_states`, the
    default) the chunk-start states of every `options.checkpoint_every`-th chunk, from which the
    backward walks the others and the residuals again; without it, all chunk-start states and
    the residuals. The backward runs with the forward's options and launch table. With
    `qk_l2norm` the kernels make q and b unit-norm as they load them, and the inverse norms (one
    float32 per token) are saved too, not normalized copies.
    """

    @staticmethod
    def forward(ctx, q, a, b, u, g, initial_state, chunk_size, scale, precision, options, table,
                qk_l2norm=False):  # fmt: skip
        ctx.set_materialize_grads(False)
        batch, length, key_heads, key_dim = q.shape
        heads = u.shape[2]  # grouped value heads: a multiple of q's
        # Read once: the backward recomputes the operators as the forward made them.
        ctx.operator_dtype = operator_dtype(
            *_precision_inputs(q, a, b, u), stored=options.operator_dtype
        )
        chosen = chosen_state_pass(batch, heads, key_dim, u.shape[-1], ctx.operator_dtype,
                                   options, table)  # fmt: skip
        ctx.table = table
        state_pass, ctx.state_pass_backward, ctx.walk = PASS_FORMS[chosen]
        q, a, b, u, g = (x.contiguous() for x in (q, a, b, u, g))
        initial_state = initial_state.contiguous()
        tokens = Tokens(-(-length // chunk_size), heads, length, chunk_size, heads // key_heads)
        norms = unit_norms(u) if qk_l2norm else None
        ops, _ = _operators_triton(q, a, b, u, g, precision, tokens, scale, ctx.operator_dtype,
                                   norms, table)  # fmt: skip
        out = q.new_empty(u.shape)
        recompute, ctx.walk_dots = options.recompute_states, options.walk_dots
        ctx.recompute_states, ctx.every = recompute, options.checkpoint_every
        # Recomputing, the pass keeps only the states of every `every`-th chunk (the backward
        # walks the segments between them again, all at once) and no residuals.
        _, residuals, states, final = state_pass(
            ops, initial_state, precision, out=out, tokens=tokens,
            keep_every=ctx.every if recompute else 1, keep_residuals=not recompute,
            walk_dots=ctx.walk_dots, table=table,
        )  # fmt: skip
        ctx.unit = qk_l2norm
        kept_norms = norms if qk_l2norm else ()
        if recompute:
            ctx.save_for_backward(q, a, b, u, g, *kept_norms, states)
        else:
            ctx.save_for_backward(q, a, b, u, g, *kept_norms, states, residuals)
        ctx.precision, ctx.tokens, ctx.scale = precision, tokens, scale
        return out, final

    @staticmethod
    def backward(ctx, d_o, d_final):
        precision, tokens, scale = ctx.precision, ctx.tokens, ctx.scale
        q, a, b, u, g, *kept = ctx.saved_tensors
        table = ctx.table
        norms = (kept.pop(0), kept.pop(0)) if ctx.unit else None
        # The recomputed stage 1 writes the same inverse norms over the saved ones.
        ops, lower = _operators_triton(q, a, b, u, g, precision, tokens, scale, ctx.operator_dtype,
                                       norms, table)  # fmt: skip
        if ctx.recompute_states:
            residuals, states = ctx.walk(ops, kept[0], ctx.every, precision, ctx.walk_dots, table)
        else:
            states, residuals = kept
        # The output's gradient is read token-major where it lies, like the inputs.
        d_out = torch.zeros_like(u) if d_o is None else d_o.contiguous()
        d_final = None if d_final is None else d_final.contiguous()
        d_residual, d_next, d_initial = ctx.state_pass_backward(
            ops, d_out, d_final, precision, tokens, ctx.walk_dots, table
        )
        grads = operator_grads_triton(
            states, residuals, d_out, d_residual, d_next, precision, tokens, table
        )
        # Each tensor is dropped once its last use is behind: the peak of the backward is the
        # sum of what is alive at its fullest point, not of everything it makes.
        erase, target = ops.erase, ops.target
        del ops, d_out, d_residual, d_next
        # Stage 2 back: R = [exp(G) B | U] through the solve, then L's share; du token-major.
        d_erase_rhs = solve_triton_backward(
            lower, grads.erase.contiguous(), precision, table=table.solve
        )
        d_target_rhs, du = solve_triton_backward(
            lower, grads.target.contiguous(), precision, tokens_like=u, tokens=tokens,
            table=table.solve,
        )  # fmt: skip
        grads = grads._replace(erase=None, target=None)
        d_lower = lower_grad_triton(d_erase_rhs, erase, d_target_rhs, target, precision,
                                    table.solve)  # fmt: skip
        del erase, target, d_target_rhs
        # Stage 1 back, then the factors (which also form dg for both, and write dq, da, db,
        # dg token-major in the inputs' dtypes).
        dq1, da1, db1 = intra_triton_backward(
            q, a, b, g, d_lower, grads.attend.contiguous(), precision, tokens, scale,
            norms=norms, table=table.intra,
        )  # fmt: skip
        del d_lower, lower
        dq, da, db, dg = factors_triton_backward(
            q, a, b, g, grads.read.contiguous(), d_erase_rhs, grads.write.contiguous(),
            grads.decay.contiguous(), dq1, da1, db1, tokens, scale, norms, table.factors,
        )  # fmt: skip
        needed = ctx.needs_input_grad
        grads = [d if need else None for d, need in zip((dq, da, db, du, dg), needed, strict=False)]
        return (*grads, d_initial, None, None, None, None, None, None)


@opaque_to_compiler
def delta_rule_triton(
    q: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor,
    initial_state: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    chunk_size: int,
    scale: float,
    options: KernelOptions = DEFAULT_OPTIONS,
    qk_l2norm: bool = False,
    *,
    table: DeltaRuleLaunch | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated inputs in their own dtype (bf16, fp16 or fp32); computes in float32 with float32
    state and accumulators, and stores the chunk operators between kernels as
    `options.operator_dtype` says (by default in the inputs' dtype when that is bf16 or fp16,
    else float32). With `qk_l2norm`, q and b are made unit-norm inside the kernels. Returns
    (o [B, T, H, V] in q's dtype, final state [N, H, K, V]).

    Matrix products take TF32 operands when an input is bf16/fp16 (its rounding is already
    coarser than TF32's), but for the state pass's walks, which multiply the 16-bit operators
    as stored (`options.walk_dots`), and for float32 inputs only when PyTorch is allowed TF32
    for float32 matrix products (`torch.set_float32_matmul_precision("high")`), as its own
    matmuls are. `table`: the launch table (None: the one for q's device, `LAUNCH_TABLES`; tests
    pass small ones to reach at tiny shapes the paths of large ones).
    """
    table = LAUNCH_TABLES.launch_table_for(q.device) if table is None else table
    # Any input in bf16/fp16 (a float32 gate times a bf16 projection still carries its rounding).
    low_precision = _low_precision(*_precision_inputs(q, a, b, u)) is not None
    allowed = torch.get_float32_matmul_precision() != "highest"
    precision = "tf32" if low_precision or allowed else "ieee"
    # The kernels cast to float32 on load, then scale q, as the other
    # backends do it: fp16 q times a scale > 1 cannot overflow.
    length = q.shape[1]
    if cu_seqlens is not None:
        max_len = max_seqlen(cu_seqlens, length)  # one device -> host sync (see max_seqlen)
        q, a, b, u, g = (pad_packed(x, cu_seqlens, max_len) for x in (q, a, b, u, g))
    o, state = _DeltaRuleTriton.apply(
        q, a, b, u, g, initial_state, chunk_size, scale, precision, options, table, qk_l2norm
    )
    return (o, state) if cu_seqlens is None else (unpad_packed(o, cu_seqlens, length), state)
