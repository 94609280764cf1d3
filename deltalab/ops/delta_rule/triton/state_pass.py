"""Triton state pass of the chunkwise delta rule: stage 3 (and the output, stage 4) fused.

The chunk operators (stages 1-2, `delta_rule/chunk.py`'s `chunk_operators`) are parallel over
chunks; what remains sequential is, per chunk i with chunk-start state S_i [K, V]:

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
`_state_pass_split_fwd` (`state_pass_kernels.py`) says why that is exact and what it costs in
memory traffic.

Precision: S and every accumulator are float32. The operators arrive in the inputs' dtype when
those are 16-bit (`KernelOptions.operator_dtype` "inputs", the default), else in float32.
16-bit operators are multiplied as stored, the state and the other operands rounded to their
dtype for each product (`KernelOptions.walk_dots` "operators", the default; "float32" widens
them to TF32 products).
With float32 operators the products run in IEEE float32 (TF32 would cost ~1e-3 relative
error); no exponential is taken here, the decays arrive as factors <= 1 from the stable
stage 1.

The kernels are in `state_pass_kernels.py`; this module launches them (`_launch`, from the op's
launch table `DeltaRuleLaunch`, `launch.py`) and holds the two forms' entry points (`PASS_FORMS`)
and the operator gradients that follow the adjoint walk.
"""

from __future__ import annotations

import torch
import triton

from deltalab.ops.delta_rule.chunk import ChunkOperators
from deltalab.ops.delta_rule.triton.intra import Tokens, key_block
from deltalab.ops.delta_rule.triton.launch import LAUNCH, DeltaRuleLaunch
from deltalab.ops.delta_rule.triton.state_pass_kernels import (
    _operator_grads_kernel,
    _state_pass_bwd,
    _state_pass_fwd,
    _state_pass_split_bwd,
    _state_pass_split_dout,
    _state_pass_split_fwd,
    _state_pass_split_out,
)
from deltalab.ops.options import DEFAULT_OPTIONS, KernelOptions

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
    """Stages 3-4 of `delta_rule/chunk.py` in one kernel: (outputs, residuals [B, H, n, C, V],
    chunk-start states [B, H, n, K, V], final state [B, H, K, V]). With keep_every > 1 only the
    states of chunks 0, keep_every, 2 keep_every, ... [B, H, ceil(n / keep_every), K, V] (what
    the backward keeps with `KernelOptions.recompute_states`: the others are never written);
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
    chunks; see the comment above `_state_pass_split_fwd`, `state_pass_kernels.py`): the same
    arguments and returns. The output kernel reads every chunk-start state and residual, so the
    walk writes them all; keep_every and keep_residuals only choose what is returned."""
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
    over chunks, then the walk; see the comment above `_state_pass_split_fwd`,
    `state_pass_kernels.py`): the same arguments and returns, and no memory beyond them."""
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
