"""The Triton delta rule's entry: `delta_rule_triton` and its autograd Function
`_DeltaRuleTriton`, which chain the stages' kernels forward and back.

Forward: stages 1-2 (`_operators_triton`: stage 1's L and M, `intra.py`; the decay factors,
`factors.py`; the solve, `solve.py`) make the chunk operators, then the state pass (stages 3-4,
`state_pass.py`, in the form `chosen_state_pass` picks) walks the chunks and writes the
outputs. Backward: stages 1-2 again, the chunk-start states and residuals walked again from the
kept ones (`KernelOptions.recompute_states`), the adjoint walk, the operator gradients, then
the solve, stage 1 and the factors back, which write the input gradients.

Here the inputs' dtypes choose the products' precision and the dtype the chunk operators are
stored in (`operator_dtype`); the launch table (`DeltaRuleLaunch`, `LAUNCH_TABLES`) is in
`launch.py`.
"""

from __future__ import annotations

import torch

from deltalab.ops._triton import opaque_to_compiler
from deltalab.ops._varlen import max_seqlen, pad_packed, unpad_packed
from deltalab.ops.delta_rule.chunk import ChunkOperators
from deltalab.ops.delta_rule.triton.factors import factors_triton, factors_triton_backward
from deltalab.ops.delta_rule.triton.intra import (
    Tokens,
    intra_triton,
    intra_triton_backward,
    unit_norms,
)
from deltalab.ops.delta_rule.triton.launch import LAUNCH, LAUNCH_TABLES, DeltaRuleLaunch
from deltalab.ops.delta_rule.triton.solve import (
    lower_grad_triton,
    solve_triton,
    solve_triton_backward,
)
from deltalab.ops.delta_rule.triton.state_pass import (
    PASS_FORMS,
    chosen_state_pass,
    operator_grads_triton,
)
from deltalab.ops.options import DEFAULT_OPTIONS, KernelOptions

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
