"""The Triton kernels of the delta rule's state pass: the fused walks (`_state_pass_fwd`,
`_state_pass_bwd`), the split pass's walks and its kernels parallel over chunks, the operator
gradients' kernel, and the tile helpers they share. `state_pass.py` launches them; its docstring
gives the recurrences they walk and their precision.
"""

from __future__ import annotations

import triton
import triton.language as tl

from deltalab.ops.delta_rule.triton.intra import _load_rows, _operand, _token_offset


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
