"""delta_rule backend="triton" against the float64 token loop, stage by stage and end to end.

Runs where Triton kernels can run: on a CUDA GPU, or on CPU tensors under TRITON_INTERPRET=1
(README's test command runs this file a second time with it set). Shapes are tiny: the
interpreter executes every tile operation in Python.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import random_delta_inputs

from deltalab.ops import delta_rule
from deltalab.ops._triton import HAS_TRITON, INTERPRET
from deltalab.ops.options import KernelOptions
from deltalab.testing import TOLERANCE, assert_close

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(
        not (HAS_TRITON and (INTERPRET or torch.cuda.is_available())),
        reason="needs Triton on a CUDA GPU, or TRITON_INTERPRET=1 on CPU",
    ),
]

DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
F32 = TOLERANCE[torch.float32]


def _run(inputs, state, backend, dtype, device, table=None, **kwargs):
    """Output, final state and the gradients of every input and of the initial state. With a
    launch `table`, by the Triton backend's entry launched by it (`backend` is then "triton")."""
    leaves = [x.detach().to(device, dtype).requires_grad_() for x in (*inputs, state)]
    if table is None:
        o, s = delta_rule(
            *leaves[:5], initial_state=leaves[5], backend=backend, output_final_state=True,
            **kwargs,
        )  # fmt: skip
    else:
        o, s = _triton_launched_by(table, *leaves, **kwargs)
    weights = torch.linspace(-1, 1, o.numel(), dtype=torch.float64).reshape(o.shape)
    # One backward through both outputs (the interpreter is slow): every gradient then carries the
    # output's and the final state's contributions together.
    ((o * weights.to(device, o.dtype)).sum() + s.sum()).backward()
    return [o, s, *(x.grad for x in leaves)]


def _triton_launched_by(table, q, a, b, u, g, state, chunk_size, options=None, cu_seqlens=None):
    """`delta_rule_triton`, the entry `delta_rule` calls for backend="triton", launched by
    `table` (with the defaults `delta_rule` gives it: scale K^-0.5, a float32 state)."""
    from deltalab.ops.delta_rule.triton.chunk import delta_rule_triton

    options = KernelOptions() if options is None else options
    return delta_rule_triton(q, a, b, u, g, state.float(), cu_seqlens, chunk_size,
                             q.shape[-1] ** -0.5, options, table=table)  # fmt: skip


def _compare(inputs, state, chunk_size, cu_seqlens=None, options=None, table=None):
    kwargs = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
    reference = _run(inputs, state, "naive", torch.float64, "cpu", **kwargs)
    if cu_seqlens is not None:
        kwargs["cu_seqlens"] = cu_seqlens.to(DEVICE)
    actual = _run(inputs, state, "triton", torch.float32, DEVICE, table, chunk_size=chunk_size,
                  options=options, **kwargs)  # fmt: skip
    labels = ["o", "final state", "dq", "da", "db", "du", "dg", "d initial state"]
    for label, x, ref in zip(labels, actual, reference, strict=True):
        assert_close(x, ref, F32, label)


def _compare_at(inputs, state, dtype, chunk_size, options=None, table=None):
    """The Triton backend at `dtype` (an fp16 one: the interpreter's 16-bit float) with the
    kernel `options` (and launch `table`) against the float64 loop: output, final state and
    every gradient within `dtype`'s bound."""
    reference = _run(inputs, state, "naive", torch.float64, "cpu")
    actual = _run(inputs, state, "triton", dtype, DEVICE, table, chunk_size=chunk_size,
                  options=options)  # fmt: skip
    labels = ["o", "final state", "dq", "da", "db", "du", "dg", "d initial state"]
    for label, x, ref in zip(labels, actual, reference, strict=True):
        assert_close(x, ref, TOLERANCE[dtype], label)


# The state pass's walks, forward and adjoint, fused and split.
WALKS = ("_state_pass_fwd", "_state_pass_bwd", "_state_pass_split_fwd", "_state_pass_split_bwd")


def _recorded_launches(monkeypatch, module, names) -> list:
    """Every launch of the kernels `names` by `module`'s functions from now on (replaced in
    `module`, where those look them up), as (kernel name, grid, keyword arguments), each launch
    run as it was."""
    launches = []

    class Recorded:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((self.kernel.fn.__name__, tuple(grid), kwargs))
                return self.kernel[grid](*args, **kwargs)

            return launch

    for name in names:
        monkeypatch.setattr(module, name, Recorded(getattr(module, name)))
    return launches


# Both decay layouts at the short lengths, one at each long one: the layout only changes how g is
# loaded, which the chunk size does not touch, and a long case takes ~30 s in the interpreter.
@pytest.mark.parametrize(
    ("length", "chunk_size", "channel_decay"),
    [
        pytest.param(length, chunk, channel, id=f"{length}-{chunk}-{layout}")
        for length, chunk in [(1, 16), (37, 16), (100, 32), (70, 64)]
        for channel, layout in [(False, "head_decay"), (True, "channel_decay")]
        if length < 50 or channel == (chunk == 64)
    ],
)
def test_triton_matches_float64_loop_with_every_gradient(
    generator, poisoned_empty, length, chunk_size, channel_decay
):
    inputs = random_delta_inputs(generator, 2, length, 2, 16, 8, channel_decay=channel_decay)
    state = torch.randn(2, 2, 16, 8, generator=generator, dtype=torch.float64)
    _compare(inputs, state, chunk_size)


@pytest.mark.parametrize("channel_decay", [False, True], ids=["head_decay", "channel_decay"])
def test_triton_gradients_under_strong_decays_where_stage_1_walks_its_diagonal(
    generator, poisoned_empty, monkeypatch, channel_decay
):
    """Log decays down to -16 per token: the full diagonal sub-blocks exceed the factored form's bound
    and are walked row by row, in the forward and the adjoint; with stage 1's adjoint cut into
    channel blocks of 16, K = 20 takes two of them."""
    from deltalab.ops.delta_rule.triton import intra, launch

    table = replace(launch.LAUNCH, intra=replace(intra.LAUNCH, block=16))
    inputs = random_delta_inputs(
        generator, 1, 37, 1, 20, 8, channel_decay=channel_decay, min_log_decay=-16.0
    )
    g = inputs[-1] if channel_decay else inputs[-1][..., None]
    depth = g[:, :32].unflatten(1, (-1, intra.SUB_BLOCK)).sum(2).abs().amax((-2, -1))
    assert (depth > intra.DIAGONAL_FACTOR_BOUND).all()  # every full sub-block walks
    state = torch.randn(1, 1, 20, 8, generator=generator, dtype=torch.float64)
    recorded = _recorded_launches(monkeypatch, intra, ("_intra_bwd",))
    _compare(inputs, state, 16, table=table)
    assert [grid[1] for _, grid, _ in recorded] == [2]  # two channel blocks


# a as one strength per token (a_t = beta_t b_t, formed on load): both decay layouts, chunks
# of 16, 64 and 128, the walked diagonal (log decays to -16) with two channel blocks in the
# adjoint (each writes its share of d beta), and packed sequences. At chunk 128 one sequence of
# one head, as in the direction form's chunk-128 test: the batch and head offsets do not depend
# on the chunk size, and the shorter cases cover them (2 x 2 heads took the interpreter ~30 s).
@pytest.mark.parametrize(
    ("length", "chunk_size", "channel_decay", "min_log_decay", "packed"),
    [
        pytest.param(37, 16, False, -1.0, False, id="37-16-head_decay"),
        pytest.param(70, 64, True, -1.0, False, id="70-64-channel_decay"),
        pytest.param(130, 128, False, -1.0, False, id="130-128-head_decay"),
        pytest.param(37, 16, True, -16.0, False, id="37-16-channel_decay-walked"),
        pytest.param(50, 16, False, -16.0, True, id="packed-head_decay-walked"),
    ],
)
def test_triton_per_token_write_strength_matches_the_loop_with_every_gradient(
    generator, poisoned_empty, monkeypatch, length, chunk_size, channel_decay, min_log_decay,
    packed,
):  # fmt: skip
    from deltalab.ops.delta_rule.triton import factors, intra, launch

    table = replace(launch.LAUNCH, intra=replace(intra.LAUNCH, block=16),
                    factors=replace(factors.LAUNCH, block=16))  # fmt: skip
    batch, heads = (1, 1) if chunk_size == 128 else (1 if packed else 2, 2)
    inputs = random_delta_inputs(
        generator, batch, length, heads, 20, 8, channel_decay=channel_decay,
        min_log_decay=min_log_decay, strengths=True,
    )  # fmt: skip
    assert inputs[1].shape == (batch, length, heads)
    cu_seqlens = torch.tensor([0, 7, 30, length]) if packed else None
    sequences = 3 if packed else batch
    state = torch.randn(sequences, heads, 20, 8, generator=generator, dtype=torch.float64)
    adjoints = [_recorded_launches(monkeypatch, intra, ("_intra_bwd",)),
                _recorded_launches(monkeypatch, factors, ("_factors_bwd",))]  # fmt: skip
    _compare(inputs, state, chunk_size, cu_seqlens=cu_seqlens, table=table)
    # Stage 1's adjoint and the factors' in two channel blocks each.
    assert [[grid[1] for _, grid, _ in launches] for launches in adjoints] == [[2], [2]]


def test_a_16_bit_write_strength_keeps_a_float32_call_in_float32(generator, poisoned_empty):
    """The strength's dtype does not pick the precision: float32 q, k, u, g with an fp16 beta
    (the interpreter's 16-bit float) stay within float32's bound of the loop, as with the
    direction beta k formed in float32, not the 16-bit bound the operators would then carry."""
    q, beta, b, u, g = random_delta_inputs(
        generator, 1, 40, 2, 16, 8, channel_decay=True, strengths=True
    )
    beta = beta.to(torch.float16).double()  # the values both runs see
    reference = delta_rule(q, beta, b, u, g, backend="naive", output_final_state=True)
    f32 = [x.to(DEVICE, torch.float32) for x in (q, b, u, g)]
    o, s = delta_rule(
        f32[0], beta.to(DEVICE, torch.float16), *f32[1:], backend="triton", chunk_size=16,
        output_final_state=True,
    )  # fmt: skip
    assert o.dtype == torch.float32
    assert_close(o, reference[0], F32, "o")
    assert_close(s, reference[1], F32, "final state")


def test_triton_chunk_128_with_key_and_value_sizes_that_need_masking(generator, poisoned_empty):
    inputs = random_delta_inputs(generator, 1, 130, 1, 20, 12, channel_decay=True)
    state = torch.randn(1, 1, 20, 12, generator=generator, dtype=torch.float64)
    _compare(inputs, state, 128)


def test_triton_packed_sequences_match_the_loop(generator, poisoned_empty):
    inputs = random_delta_inputs(generator, 1, 50, 2, 16, 8, channel_decay=True)
    state = torch.randn(3, 2, 16, 8, generator=generator, dtype=torch.float64)
    _compare(inputs, state, 16, cu_seqlens=torch.tensor([0, 7, 30, 50]))


@pytest.mark.parametrize("channel_decay", [False, True], ids=["head_decay", "channel_decay"])
def test_triton_float32_is_stable_under_log_decays_down_to_minus_20(generator, channel_decay):
    inputs = random_delta_inputs(
        generator, 1, 150, 1, 16, 8, channel_decay=channel_decay, min_log_decay=-20.0
    )
    o_ref, s_ref = delta_rule(*inputs, backend="naive", output_final_state=True)
    f32 = [x.to(DEVICE, torch.float32) for x in inputs]
    o, s = delta_rule(*f32, backend="triton", chunk_size=64, output_final_state=True)
    assert_close(o, o_ref, F32, "o")
    assert_close(s, s_ref, F32, "final state")


def test_triton_log_decay_of_minus_infinity_is_an_exact_reset(generator):
    q, a, b, u, g = random_delta_inputs(generator, 1, 40, 2, 16, 8, channel_decay=True)
    g[:, 21] = -float("inf")
    f32 = [x.to(DEVICE, torch.float32) for x in (q, a, b, u, g)]
    o, s = delta_rule(*f32, backend="triton", chunk_size=16, output_final_state=True)
    o_ref, s_ref = delta_rule(q, a, b, u, g, backend="naive", output_final_state=True)
    assert torch.isfinite(o).all()
    assert_close(o, o_ref, F32, "o")
    assert_close(s, s_ref, F32, "final state")


def _stage_1_and_twin(q, a, b, g, bound):
    """Stage 1 in Triton (float32, diagonal factored below `bound`; its forward and adjoint
    kernels) and its float64 PyTorch twin `intra_chunk` (by autograd) on chunked inputs
    [..., C, K], both differentiated against the same random weights of L and M, above the
    diagonal too (the kernel must not read them) -> (L, M) of Triton, (L, M) of the twin, then
    the float32 and float64 inputs (q, a, b, g), `.grad` filled (the Triton dg formed from the
    adjoint's dq, da, db as the delta rule's backward forms it, the module docstring's reverse
    cumulative sum)."""
    from deltalab.ops.delta_rule.chunk import intra_chunk
    from deltalab.ops.delta_rule.triton.intra import intra_triton, intra_triton_backward

    ref = [x.clone().requires_grad_() for x in (q, a, b, g)]
    lower, attend = intra_chunk(*ref)
    d_lower, d_attend = torch.randn_like(lower), torch.randn_like(attend)
    ((lower * d_lower).sum() + (attend * d_attend).sum()).backward()
    f32 = [x.to(DEVICE, torch.float32).contiguous() for x in (q, a, b, g)]
    # The chunked kernels take g per channel: a log decay per head is every channel's.
    per_head = g.dim() == q.dim() - 1
    channels = f32[3].unsqueeze(-1).expand(f32[0].shape).contiguous() if per_head else f32[3]
    lower_t, attend_t = intra_triton(*f32[:3], channels, factor_bound=bound)
    weights = [x.to(DEVICE, torch.float32).contiguous() for x in (d_lower, d_attend)]
    grads = intra_triton_backward(*f32[:3], channels, *weights, factor_bound=bound)
    dq, da, db = (x.view(f32[0].shape) for x in grads)
    q32, a32, b32, _ = f32
    dg = (q32 * dq + b32 * db - a32 * da).flip(-2).cumsum(-2).flip(-2)
    for x, grad in zip(f32, (dq, da, db, dg.sum(-1) if per_head else dg), strict=True):
        x.grad = grad
    return lower_t, attend_t, lower, attend, f32, ref


@pytest.mark.parametrize("diagonal", ["factored_where_mild", "walked_everywhere"])
def test_triton_intra_stage_matches_its_pytorch_twin(generator, diagonal):
    """Both forms of a diagonal sub-block: factored (mild decays) and walked row by row (strong
    decays; everywhere with a bound of 0), mixed within one chunk."""
    from deltalab.ops.delta_rule.triton.intra import DIAGONAL_FACTOR_BOUND, SUB_BLOCK

    shape = (1, 2, 2, 32, 20)
    q, a, b = (torch.randn(*shape, generator=generator, dtype=torch.float64) for _ in range(3))
    g = -3.0 * torch.rand(*shape, generator=generator, dtype=torch.float64)
    g[:, :, 0, SUB_BLOCK:] *= 8.0  # one sub-block per (batch, head) too strong to factor
    depth = g.unflatten(-2, (-1, SUB_BLOCK)).sum(-2).abs().amax(-1)  # per sub-block
    assert (depth < DIAGONAL_FACTOR_BOUND).any() and (depth > DIAGONAL_FACTOR_BOUND).any()
    bound = DIAGONAL_FACTOR_BOUND if diagonal == "factored_where_mild" else 0.0
    lower_t, attend_t, lower, attend, f32, ref = _stage_1_and_twin(q, a, b, g, bound)
    assert_close(lower_t, lower, F32, "L")
    assert_close(attend_t, attend, F32, "M")
    for name, x, r in zip("qabg", f32, ref, strict=True):
        assert_close(x.grad, r.grad, F32, f"d{name}")


def test_triton_factored_diagonal_at_depths_only_the_shift_admits(generator):
    """Every diagonal sub-block 40 to 80 deep (log decays of -2.6 to -4.9 per token): taken by
    the factored form at the production bound (before the midpoint shift, such sub-blocks were
    walked), L, M and every gradient match the float64 twin."""
    from deltalab.ops.delta_rule.triton.intra import DIAGONAL_FACTOR_BOUND, SUB_BLOCK

    shape = (1, 2, 2, 32, 20)
    q, a, b = (torch.randn(*shape, generator=generator, dtype=torch.float64) for _ in range(3))
    g = -2.6 - 2.3 * torch.rand(*shape, generator=generator, dtype=torch.float64)
    depth = g.unflatten(-2, (-1, SUB_BLOCK)).sum(-2).abs().amax(-1)
    assert (depth > 40).all() and (depth < DIAGONAL_FACTOR_BOUND).all()
    lower_t, attend_t, lower, attend, f32, ref = _stage_1_and_twin(
        q, a, b, g, DIAGONAL_FACTOR_BOUND
    )
    assert_close(lower_t, lower, F32, "L")
    assert_close(attend_t, attend, F32, "M")
    for name, x, r in zip("qabg", f32, ref, strict=True):
        assert_close(x.grad, r.grad, F32, f"d{name}")


def test_triton_factored_diagonal_is_shifted_to_its_midpoint(generator):
    """Sub-blocks about 100 deep (log decays of -5.5 to -7 per token) with the bound raised to
    120: exp(-c) alone would overflow float32 (e^88), but the factors taken about the midpoint
    of c stay within e^60, and L, M and their gradients match the float64 twin."""
    from deltalab.ops.delta_rule.triton.intra import SUB_BLOCK

    shape = (1, 2, 2, 32, 20)
    q, a, b = (torch.randn(*shape, generator=generator, dtype=torch.float64) for _ in range(3))
    g = -5.5 - 1.5 * torch.rand(*shape, generator=generator, dtype=torch.float64)
    depth = g.unflatten(-2, (-1, SUB_BLOCK)).sum(-2).abs()
    assert (depth > 88).all() and (depth < 120).all()
    lower_t, attend_t, lower, attend, f32, ref = _stage_1_and_twin(q, a, b, g, 120.0)
    assert_close(lower_t, lower, F32, "L")  # fails on inf or NaN too
    assert_close(attend_t, attend, F32, "M")
    for name, x, r in zip("qab", f32[:3], ref[:3], strict=True):
        assert_close(x.grad, r.grad, F32, f"d{name}")
    # dg is a reverse cumulative sum of q dq + b db - a da in float32, which cancels at this
    # depth whatever the diagonal's form: 8e-5 with the walk on such inputs, 1.1e-4 factored.
    assert_close(f32[3].grad, ref[3].grad, 1e-3, "dg")


@pytest.mark.parametrize("channel_decay", [False, True], ids=["head_decay", "channel_decay"])
def test_triton_intra_walk_is_exact_across_resets_and_deep_decays(generator, channel_decay):
    """Stage 1 alone with the exact diagonal form everywhere (bound 0: the row walk) on
    sub-blocks that mix resets (g = -inf), deep log decays (-30) and mild ones, which the
    factored form cannot take (its factors would overflow, or be NaN across a reset). Every pair
    across a reset is an exact 0, and L, M and every gradient, dg included, stay finite and
    within 1e-6 of the float64 twin (running sums of log decays, never differences), where the
    other tests allow 1e-4."""

    shape = (1, 2, 1, 32, 20)  # one chunk of two sub-blocks per head
    q, a, b = (torch.randn(*shape, generator=generator, dtype=torch.float64) for _ in range(3))
    decay_shape = (*shape[:-1], shape[-1] if channel_decay else 1)
    g = -0.5 * torch.rand(*decay_shape, generator=generator, dtype=torch.float64)
    # Resets inside a sub-block (tokens 8, 19) and at a sub-block's first token (16); deep
    # decays beside them.
    resets = [8, 16, 19]
    g[..., resets, :] = -float("inf")
    g[..., [3, 12, 25], :] = -30.0
    if channel_decay:  # and a reset of a few channels only
        g[..., 5, :7] = -float("inf")
    else:
        g = g.squeeze(-1)
    lower_t, attend_t, lower, attend, f32, ref = _stage_1_and_twin(q, a, b, g, 0.0)
    token = torch.arange(shape[-2], device=lower_t.device)
    for r in resets:
        across = (token[:, None] >= r) & (token[None, :] < r)  # s < r <= t
        assert (lower_t[..., across] == 0).all() and (attend_t[..., across] == 0).all()
    exact = 1e-6
    assert_close(lower_t, lower, exact, "L")
    assert_close(attend_t, attend, exact, "M")
    for name, x, r in zip("qabg", f32, ref, strict=True):
        assert_close(x.grad, r.grad, exact, f"d{name}")  # fails on inf or NaN too


def test_triton_solve_stage_and_its_adjoint_match_the_pytorch_inverse(generator, poisoned_empty):
    """Stage 2: (I + L)^-1 R by blockwise substitution, dR = (I + L)^-T dX and dL, against the
    doubling inverse of chunk.py in float64 (chunk 64: four row blocks, both loop orders)."""
    from deltalab.ops.delta_rule.chunk import unit_lower_inverse
    from deltalab.ops.delta_rule.triton.solve import (
        lower_grad_triton,
        solve_triton,
        solve_triton_backward,
    )

    lead, size = (2, 3), 64
    # Entries of a realistic size (unit keys times beta): the solve is well conditioned there.
    lower = 0.3 * torch.randn(*lead, size, size, generator=generator, dtype=torch.float64)
    lower = lower.tril(-1).requires_grad_()
    rhs_b = torch.randn(*lead, size, 20, generator=generator, dtype=torch.float64).requires_grad_()
    rhs_u = torch.randn(*lead, size, 12, generator=generator, dtype=torch.float64).requires_grad_()
    inverse = unit_lower_inverse(lower)
    x_b, x_u = inverse @ rhs_b, inverse @ rhs_u
    d_b, d_u = torch.randn_like(x_b), torch.randn_like(x_u)
    ((x_b * d_b).sum() + (x_u * d_u).sum()).backward()

    def f32(x):
        return x.detach().to(DEVICE, torch.float32).contiguous()

    # The upper triangle is never read: fill it with NaN to prove it.
    lower_t = f32(lower) + torch.full((size, size), float("nan")).triu().to(DEVICE)
    x_b_t, x_u_t = solve_triton(lower_t, f32(rhs_b)), solve_triton(lower_t, f32(rhs_u))
    dr_b, dr_u = solve_triton_backward(lower_t, f32(d_b)), solve_triton_backward(lower_t, f32(d_u))
    d_lower = lower_grad_triton(dr_b, x_b_t, dr_u, x_u_t)
    assert_close(x_b_t, x_b, F32, "erase operator")
    assert_close(x_u_t, x_u, F32, "target operator")
    assert_close(dr_b, rhs_b.grad, F32, "d rhs (erase)")
    assert_close(dr_u, rhs_u.grad, F32, "d rhs (target)")
    assert_close(d_lower.tril(-1), lower.grad.tril(-1), F32, "dL")


def test_triton_decay_factors_and_their_adjoint_match_autograd(generator, poisoned_empty):
    """The factor kernels against the same formulas in float64 PyTorch with autograd, with
    stage 1's gradients added (dg includes its reverse cumulative sum); one chunk has a reset."""
    from deltalab.ops.delta_rule.triton.factors import factors_triton, factors_triton_backward

    shape = (2, 3, 32, 20)
    q, a, b = (torch.randn(*shape, generator=generator, dtype=torch.float64) for _ in range(3))
    g = -2.0 * torch.rand(*shape, generator=generator, dtype=torch.float64)
    g[0, 1, 7, 3] = -float("inf")
    leaves = [x.clone().requires_grad_() for x in (q, a, b, g)]
    lq, la, lb, lg = leaves
    from_start = lg.cumsum(-2).exp()
    after = torch.cat([lg[..., 1:, :], torch.zeros_like(lg[..., :1, :])], dim=-2)
    to_end = after.flip(-2).cumsum(-2).flip(-2).exp()
    outputs = (from_start * lq, from_start * lb, to_end * la, lg.sum(-2).exp())
    weights = [torch.randn_like(x) for x in outputs]
    intra = [torch.randn_like(q) for _ in range(3)]  # stage 1's dq, da, db
    # Stage 1's share of dg (intra.py): reverse cumsum of q dq' + b db' - a da'.
    stage1 = (lq * intra[0] + lb * intra[2] - la * intra[1]).flip(-2).cumsum(-2).flip(-2)
    loss = sum((x * w).sum() for x, w in zip(outputs, weights, strict=True))
    loss = loss + (lq * intra[0]).sum() + (la * intra[1]).sum() + (lb * intra[2]).sum()
    (loss + (lg * stage1.detach()).sum()).backward()

    def f32(x):
        return x.detach().to(DEVICE, torch.float32).contiguous()

    got = factors_triton(*(f32(x) for x in (q, a, b, g)))
    for label, x, ref in zip(("read", "erase rhs", "write", "decay"), got, outputs, strict=True):
        assert_close(x, ref.detach(), F32, label)
    grads = factors_triton_backward(
        *(f32(x) for x in (q, a, b, g)), *(f32(w) for w in weights), *(f32(x) for x in intra)
    )
    for name, x, leaf in zip("qabg", grads, leaves, strict=True):
        assert_close(x, leaf.grad, F32, f"d{name}")


@pytest.mark.parametrize("min_log_decay", [-0.5, -16.0], ids=["factored", "walked"])
def test_triton_stage_1_and_factors_take_a_strength_per_token_as_its_product_with_b(
    generator, poisoned_empty, min_log_decay
):
    """Stage 1 and the factors given a as one strength per token give what they give for the
    direction beta * b, and the factors' adjoint splits that direction's gradient da' into
    db + beta da' and d beta = sum_k b da' (two channel blocks: each writes its share)."""
    from deltalab.ops.delta_rule.triton import factors, intra

    table = replace(factors.LAUNCH, block=16)
    shape = (2, 3, 32, 20)
    q, b = (torch.randn(*shape, generator=generator, dtype=torch.float64) for _ in range(2))
    beta = torch.rand(*shape[:-1], generator=generator, dtype=torch.float64)
    g = min_log_decay * torch.rand(*shape, generator=generator, dtype=torch.float64)

    def f32(x):
        return x.to(DEVICE, torch.float32).contiguous()

    q, b, beta, g = (f32(x) for x in (q, b, beta, g))
    a = beta.unsqueeze(-1) * b
    for label, x, ref in zip(
        ("L", "M"), intra.intra_triton(q, beta, b, g), intra.intra_triton(q, a, b, g), strict=True
    ):
        assert_close(x, ref, F32, label)
    got = factors.factors_triton(q, beta, b, g, table=table)
    ref = factors.factors_triton(q, a, b, g, table=table)
    for label, x, r in zip(("read", "erase rhs", "write", "decay"), got, ref, strict=True):
        assert_close(x, r, F32, label)
    upstream = [f32(torch.randn_like(x, dtype=torch.float64)) for x in ref]
    stage1 = [f32(torch.randn(*shape, generator=generator, dtype=torch.float64)) for _ in "qab"]
    dq, d_beta, db, dg = factors.factors_triton_backward(q, beta, b, g, *upstream, *stage1,
                                                         table=table)  # fmt: skip
    dq_ref, da_ref, db_ref, dg_ref = factors.factors_triton_backward(
        q, a, b, g, *upstream, *stage1, table=table
    )
    assert d_beta.shape == beta.shape
    assert_close(dq, dq_ref, F32, "dq")
    assert_close(dg, dg_ref, F32, "dg")
    assert_close(db, db_ref + beta.unsqueeze(-1) * da_ref, F32, "db")
    assert_close(d_beta, (b * da_ref).sum(-1), F32, "d beta")


def test_triton_state_pass_matches_its_pytorch_twin(generator):
    from deltalab.ops.delta_rule.chunk import (
        ChunkOperators,
        chunk_operators,
        chunk_output,
        state_pass,
        to_chunks,
    )
    from deltalab.ops.delta_rule.triton.state_pass import state_pass_triton

    inputs = random_delta_inputs(generator, 1, 90, 2, 16, 8, channel_decay=True)
    ops = chunk_operators(*(to_chunks(x, 32) for x in inputs))
    state = torch.randn(1, 2, 16, 8, generator=generator, dtype=torch.float64)
    residuals, states, final = state_pass(ops, state)
    out = chunk_output(ops, states, residuals)
    ops32 = ChunkOperators(*(x.to(DEVICE, torch.float32).contiguous() for x in ops))
    out_t, residuals_t, states_t, final_t = state_pass_triton(ops32, state.to(DEVICE).float())
    for label, x, ref in (
        ("outputs", out_t, out),
        ("residuals", residuals_t, residuals),
        ("chunk-start states", states_t, states),
        ("final state", final_t, final),
    ):
        assert_close(x, ref, F32, label)


@pytest.mark.parametrize("state_pass", ["fused", "split"])
@pytest.mark.parametrize("block_c", [32, 16], ids=["one-row-block", "two-row-blocks"])
def test_triton_state_pass_keeping_every_kth_state_writes_those_of_the_full_pass(
    generator, poisoned_empty, monkeypatch, state_pass, block_c
):
    """keep_every=2, keep_residuals=False (what the forward keeps with recompute_states): the
    states of chunks 0, 2, 4 of the full pass, bit for bit, and its outputs and final state;
    no residuals returned (the fused kernel writes them only with two row blocks per chunk,
    where it reads them back). Buffers are NaN-filled before launch: an unwritten kept state
    fails."""
    from deltalab.ops.delta_rule.chunk import ChunkOperators, chunk_operators, to_chunks
    from deltalab.ops.delta_rule.triton import state_pass as state_module
    from deltalab.ops.delta_rule.triton.launch import LAUNCH

    table = replace(LAUNCH, block_c=block_c)
    inputs = random_delta_inputs(generator, 1, 150, 2, 16, 8, channel_decay=True)
    ops = chunk_operators(*(to_chunks(x, 32) for x in inputs))  # 5 chunks
    ops = ChunkOperators(*(x.to(DEVICE, torch.float32).contiguous() for x in ops))
    state = torch.randn(1, 2, 16, 8, generator=generator).to(DEVICE)
    run = state_module.PASS_FORMS[state_pass][0]
    recorded = _recorded_launches(monkeypatch, state_module, WALKS)
    full = run(ops, state, "ieee", table=table)
    kept = run(ops, state, "ieee", keep_every=2, keep_residuals=False, table=table)
    assert recorded and {kwargs["BC"] for _, _, kwargs in recorded} == {block_c}
    assert kept[1] is None
    assert kept[2].shape[2] == 3
    assert torch.equal(kept[2], full[2][:, :, ::2])
    assert torch.equal(kept[0], full[0]) and torch.equal(kept[3], full[3])


def _state_pass_walk_with_adjoint(ops, state, d_o, d_final):
    """The state pass and its adjoint in float64 by autograd over the chunk loop: (outputs,
    residuals, chunk-start states, final state) and (dN, dS after each chunk, d initial state),
    the adjoints being the gradients of <O, d_o> + <final, d_final> at each N_i and S_{i+1}."""
    initial = state.clone().requires_grad_()
    s, outputs, residuals, states, after = initial, [], [], [], []
    for i in range(ops.read.shape[2]):
        states.append(s)
        n = ops.target[:, :, i] - ops.erase[:, :, i] @ s
        n.retain_grad()
        residuals.append(n)
        outputs.append(ops.read[:, :, i] @ s + ops.attend[:, :, i] @ n)
        s = ops.decay[:, :, i, :, None] * s + ops.write[:, :, i].transpose(-1, -2) @ n
        s.retain_grad()
        after.append(s)
    out = torch.stack(outputs, dim=2)
    ((out * d_o).sum() + (s * d_final).sum()).backward()
    forward = [out, *(torch.stack(x, dim=2) for x in (residuals, states)), s]
    backward = [torch.stack([x.grad for x in residuals], dim=2),
                torch.stack([x.grad for x in after], dim=2), initial.grad]  # fmt: skip
    return [x.detach() for x in forward], backward


@pytest.mark.parametrize(
    ("length", "chunk_size", "block_c"),
    [(50, 32, 16), (130, 128, 64)],
    ids=["chunk32-two-row-blocks", "chunk128"],
)
def test_triton_split_state_pass_matches_the_fused_pass_and_the_pytorch_walk(
    generator, poisoned_empty, monkeypatch, length, chunk_size, block_c
):
    """The split state pass (walk, then outputs; dO products, then the adjoint walk) against the
    fused kernels and the float64 walk differentiated by autograd: outputs written token-major
    (every token of a partial last chunk; dO read from there too), residuals, chunk-start
    states, final state, dN, dS after each chunk and d initial state. K = 20 and V = 12 need
    masking; row blocks of 16 (chunk 32) or 64 (chunk 128) make two per chunk."""
    from deltalab.ops.delta_rule.chunk import (
        ChunkOperators,
        chunk_operators,
        from_chunks,
        to_chunks,
    )
    from deltalab.ops.delta_rule.triton import state_pass as state_module
    from deltalab.ops.delta_rule.triton.intra import Tokens
    from deltalab.ops.delta_rule.triton.launch import LAUNCH

    table = replace(LAUNCH, block_c=block_c)
    batch, heads, key_dim, value_dim = 1, 2, 20, 12
    inputs = random_delta_inputs(
        generator, batch, length, heads, key_dim, value_dim, channel_decay=True
    )
    ops = chunk_operators(*(to_chunks(x, chunk_size) for x in inputs))
    state = torch.randn(batch, heads, key_dim, value_dim, generator=generator, dtype=torch.float64)
    d_o = torch.randn(batch, length, heads, value_dim, generator=generator, dtype=torch.float64)
    d_final = torch.randn_like(state)
    forward, backward = _state_pass_walk_with_adjoint(ops, state, to_chunks(d_o, chunk_size),
                                                      d_final)  # fmt: skip
    forward[0] = from_chunks(forward[0], chunk_size, length)

    def f32(x):
        return x.to(DEVICE, torch.float32).contiguous()

    ops32 = ChunkOperators(*(f32(x) for x in ops))
    tokens = Tokens(ops.read.shape[2], heads, length, chunk_size)
    recorded = _recorded_launches(monkeypatch, state_module, WALKS)
    got = {}
    for name in ("fused", "split"):
        state_pass, state_pass_backward, walk = state_module.PASS_FORMS[name]
        out = torch.empty(batch, length, heads, value_dim, device=DEVICE)
        got[name] = [
            *state_pass(ops32, f32(state), out=out, tokens=tokens, table=table),
            *state_pass_backward(ops32, f32(d_o), f32(d_final), tokens=tokens, table=table),
        ]
        # The walk a backward repeats (recompute_states) gives the forward's values exactly,
        # from the initial state alone (one segment) or from every chunk's start state (as
        # many segments as chunks, walked at once).
        states = got[name][2]
        for every in (1, states.shape[2]):
            walked = walk(ops32, states[:, :, ::every].contiguous(), every, table=table)
            for label, again, first in zip(("residuals", "chunk-start states"), walked,
                                           got[name][1:3], strict=True):  # fmt: skip
                assert torch.equal(again, first), f"{label} walked again ({name}, {every})"
    assert {kwargs["BC"] for _, _, kwargs in recorded} == {block_c}  # two row blocks a chunk
    labels = ["outputs", "residuals", "chunk-start states", "final state", "dN",
              "dS after each chunk", "d initial state"]  # fmt: skip
    for label, split, fused, ref in zip(labels, got["split"], got["fused"], forward + backward,
                                        strict=True):  # fmt: skip
        assert_close(split, ref, F32, f"{label} (split against the float64 walk)")
        assert_close(split, fused, 1e-6, f"{label} (split against fused)")


@pytest.mark.parametrize(("chosen", "other"), [("split", "fused"), ("fused", "split")])
def test_triton_each_state_pass_matches_float64_loop_with_every_gradient(
    generator, poisoned_empty, monkeypatch, chosen, other
):
    """delta_rule(backend="triton", options=KernelOptions(state_pass=...)) runs that form, forward
    and backward (the other made to fail if called): output, final state and every gradient
    against the float64 token loop, over a partial last chunk."""
    from deltalab.ops.delta_rule.triton import state_pass as state_module

    def fail(*args, **kwargs):
        raise AssertionError(f"the {other} state pass ran")

    monkeypatch.setitem(state_module.PASS_FORMS, other, (fail, fail, fail))
    inputs = random_delta_inputs(generator, 2, 37, 2, 16, 8, channel_decay=True)
    state = torch.randn(2, 2, 16, 8, generator=generator, dtype=torch.float64)
    _compare(inputs, state, 16, options=KernelOptions(state_pass=chosen))


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        pytest.param(
            torch.bfloat16,
            marks=pytest.mark.skipif(DEVICE != "cuda", reason="bfloat16 kernels: CUDA only"),
        ),
    ],
    ids=["fp32", "bf16"],
)
@pytest.mark.parametrize("state_pass", ["split", "fused"])
def test_triton_backward_walking_the_states_again_keeps_less_and_gives_the_same_gradients(
    generator, state_pass, dtype
):
    """With recompute_states the forward keeps the chunk-start states of every `every`-th chunk
    instead of all of them and the residuals (float32 [B, H, n, K, V] and [B, H, n, C, V]), and
    the backward's second walk (3 chunks: every 2, segments of 2 and 1 walked at once; every 8,
    one segment) gives every gradient bit for bit (on the GPU also with bf16 inputs, the
    precision of training). Both against one run that keeps every state."""
    batch, length, heads, key_dim, value_dim, chunk = 2, 37, 2, 16, 8, 16
    inputs = random_delta_inputs(generator, batch, length, heads, key_dim, value_dim,
                                 channel_decay=True)  # fmt: skip
    state = torch.randn(batch, heads, key_dim, value_dim, generator=generator, dtype=torch.float64)
    results, kept = {}, {}
    for every in (None, 2, 8):  # None: every state kept
        options = KernelOptions(state_pass=state_pass, recompute_states=every is not None)
        if every is not None:
            options = replace(options, checkpoint_every=every)
        saved: list[torch.Tensor] = []

        def pack(t, saved=saved):
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            results[every] = _run(inputs, state, "triton", dtype, DEVICE,
                                  chunk_size=chunk, options=options)  # fmt: skip
        kept[every] = sum(t.numel() * t.element_size() for t in saved)
    labels = ["o", "final state", "dq", "da", "db", "du", "dg", "d initial state"]
    chunks = -(-length // chunk)
    walked = batch * heads * chunks * (key_dim + chunk) * value_dim * 4
    for every in (2, 8):
        for label, again, first in zip(labels, results[every], results[None], strict=True):
            assert torch.equal(again, first), f"every {every}: {label}"
        checkpoints = batch * heads * -(-chunks // every) * key_dim * value_dim * 4
        assert kept[None] - kept[every] == walked - checkpoints, f"every {every}"


@pytest.mark.parametrize(
    ("min_programs", "chosen", "other"), [(4, "fused", "split"), (5, "split", "fused")]
)
def test_auto_state_pass_takes_the_fused_pass_from_its_program_threshold(
    generator, monkeypatch, min_programs, chosen, other
):
    """state_pass="auto" (the default) runs the fused pass when its walks would launch at least
    fused_pass_min_programs programs (here B * H * ceil(V / block_v) = 2 * 2 * 1 = 4) and the
    split pass below that (the other made to fail if called), and the result is still exact."""
    from deltalab.ops.delta_rule.triton import state_pass as state_module
    from deltalab.ops.delta_rule.triton.launch import LAUNCH

    def fail(*args, **kwargs):
        raise AssertionError(f"the {other} state pass ran")

    table = replace(LAUNCH, fused_pass_min_programs=min_programs)
    monkeypatch.setitem(state_module.PASS_FORMS, other, (fail, fail, fail))
    assert state_module.chosen_state_pass(2, 2, 16, 8, table=table) == chosen
    inputs = random_delta_inputs(generator, 2, 21, 2, 16, 8, channel_decay=True)
    state = torch.randn(2, 2, 16, 8, generator=generator, dtype=torch.float64)
    _compare(inputs, state, 16, table=table)


@pytest.mark.parametrize(
    ("dtype", "walk_dots", "threshold", "chosen"),
    [(torch.float16, "operators", 3, "narrow"), (torch.float16, "operators", 2, "low_dots"),
     (torch.float16, "float32", 3, "narrow"), (torch.float16, "float32", 2, "narrow"),
     (torch.float32, "operators", 3, "split"), (torch.float32, "operators", 2, "fused")],
    ids=["fp16-few-walks", "fp16-enough-walks", "fp16-widened-few-walks",
         "fp16-widened-enough-walks", "fp32-few-walks", "fp32-enough-walks"],
)  # fmt: skip
def test_auto_takes_the_fused_launch_its_walks_earn_and_every_walk_of_the_op_takes_it(
    generator, monkeypatch, dtype, walk_dots, threshold, chosen
):
    """With 16-bit chunk operators, "auto" runs the fused pass at the launch its walks' count
    earns (here B * H * V / BV walks: 4 at narrow_block_v = 32, 2 at block_v = 64, against
    thresholds fused_pass_min_programs of 3 and 2), forward, the backward's walk from the
    checkpoints and the adjoint walk: with the products in 16 bits (walk_dots "operators"),
    block_v columns on low_dots_num_warps warps where they make enough walks, else
    narrow_block_v columns on narrow_num_warps where those do; with them widened, the narrow
    launch wherever it makes enough. Float32 operators take the split pass below the threshold
    and the fused one at block_v columns from it. Either way the output, the final state and
    every gradient are the loop's (fp16: the interpreter's 16-bit float)."""
    from deltalab.ops.delta_rule.triton import state_pass as state_module
    from deltalab.ops.delta_rule.triton.launch import LAUNCH

    # The backward's walk from every chunk's start: 3 segments at once, 3x the forward's walks,
    # yet the forward's launch (a launch chosen by its own count would pass the thresholds).
    options = KernelOptions(walk_dots=walk_dots, checkpoint_every=1)

    recorded = _recorded_launches(monkeypatch, state_module, WALKS)
    table = replace(LAUNCH, low_dots_num_warps=1, block_v=64, narrow_block_v=32,
                    narrow_num_warps=2, fused_pass_min_programs=threshold)  # fmt: skip
    inputs = random_delta_inputs(generator, 1, 37, 2, 16, 64, channel_decay=True)
    state = torch.randn(1, 2, 16, 64, generator=generator, dtype=torch.float64)
    _compare_at(inputs, state, dtype, chunk_size=16, options=options, table=table)
    launches = [(name, kwargs["BV"], kwargs["num_warps"]) for name, _, kwargs in recorded]
    walks = ["_state_pass_fwd"] * 2 + ["_state_pass_bwd"]  # forward, from checkpoints, adjoint
    if chosen == "narrow":
        assert launches == [(name, 32, 2) for name in walks]
    elif chosen == "low_dots":
        assert launches == [(name, 64, 1) for name in walks]
    elif chosen == "fused":
        assert launches == [(name, 64, table.num_warps) for name in walks]
    else:
        assert {launch[0] for launch in launches} == {
            "_state_pass_split_fwd",
            "_state_pass_split_bwd",
        }


@pytest.mark.parametrize("state_pass", ["fused", "split"])
@pytest.mark.parametrize("walk_dots", ["float32", "operators"])
def test_16bit_products_in_the_walks_keep_every_result_within_the_16bit_bound(
    generator, monkeypatch, walk_dots, state_pass
):
    """walk_dots "operators": the walks, fused or split, forward and adjoint, multiply the
    16-bit operators as stored with the state, residuals, dS, dN and dO rounded to their dtype
    (LOW_DOTS reaches the walk kernels only then, and only with 16-bit operators); the output,
    the final state and every gradient stay within the 16-bit bound of the float64 loop (fp16:
    the interpreter's 16-bit float; bf16 is timed and checked on the GPU), over two row blocks
    per chunk and, fused, both passes through the residuals of earlier row blocks."""
    from deltalab.ops.delta_rule.triton import state_pass as state_module
    from deltalab.ops.delta_rule.triton.launch import LAUNCH

    walks = {"fused": ("_state_pass_fwd", "_state_pass_bwd"),
             "split": ("_state_pass_split_fwd", "_state_pass_split_bwd")}  # fmt: skip
    recorded = _recorded_launches(monkeypatch, state_module, walks[state_pass])
    table = replace(LAUNCH, block_c=16)  # two row blocks per chunk of 32
    options = KernelOptions(state_pass=state_pass, walk_dots=walk_dots)
    inputs = random_delta_inputs(generator, 1, 45, 2, 16, 32, channel_decay=True)
    state = torch.randn(1, 2, 16, 32, generator=generator, dtype=torch.float64)
    _compare_at(inputs, state, torch.float16, chunk_size=32, options=options, table=table)
    flags = [kwargs["LOW_DOTS"] for _, _, kwargs in recorded]
    assert flags and set(flags) == {walk_dots == "operators"}
    assert {kwargs["BC"] for _, _, kwargs in recorded} == {16}


@pytest.mark.skipif(DEVICE != "cuda", reason="bfloat16 kernels: CUDA only")
@pytest.mark.parametrize("launch", ["wide", "narrow", "split"])
def test_bf16_walks_stay_within_the_bf16_bound_of_the_loop(generator, monkeypatch, launch):
    """bf16 inputs as training gives them, the walks' products in bf16 (walk_dots, the
    default), at each launch "auto" may take (the fused pass at block_v columns, at the narrow
    launch, the split pass: chosen here by the walk threshold), K = V = 128 as the presets
    have, strong and weak decays over 5 chunks: the output, the final state and every gradient
    within the bf16 bound of the float64 loop (the interpreter checks fp16 the same way)."""
    from deltalab.ops.delta_rule.triton import state_pass as state_module
    from deltalab.ops.delta_rule.triton.launch import LAUNCH

    recorded = _recorded_launches(monkeypatch, state_module, WALKS)
    batch, heads = 2, 3
    threshold = {"wide": 2, "narrow": 4, "split": 5}[launch] * batch * heads
    table = replace(LAUNCH, fused_pass_min_programs=threshold)
    inputs = random_delta_inputs(generator, batch, 300, heads, 128, 128, channel_decay=True,
                                 min_log_decay=-2.0)  # fmt: skip
    state = torch.randn(batch, heads, 128, 128, generator=generator, dtype=torch.float64)
    _compare_at(inputs, state, torch.bfloat16, chunk_size=64, table=table)
    taken = {(name, kwargs.get("BV"), kwargs["LOW_DOTS"]) for name, _, kwargs in recorded}
    if launch == "split":
        assert {name for name, _, _ in taken} == {"_state_pass_split_fwd", "_state_pass_split_bwd"}
    else:
        bv = {"wide": table.block_v, "narrow": table.narrow_block_v}[launch]
        assert taken == {("_state_pass_fwd", bv, True), ("_state_pass_bwd", bv, True)}


@pytest.mark.parametrize("state_pass", ["split", "fused"])
def test_state_pass_grids_count_chunks_and_walks_on_their_first_axis(
    generator, monkeypatch, state_pass
):
    """Every state-pass kernel's launch grid puts the walks or chunks on its first axis (CUDA
    bounds that one by 2^31 - 1, the others by 65535, which B * H * chunks passes at B * H = 32,
    T = 128K, chunks of 64): the other axes of every launch, forward and backward, stay as small
    as a chunk's row blocks, whatever the number of chunks."""
    from deltalab.ops.delta_rule.triton import state_pass as state_module

    recorded = _recorded_launches(monkeypatch, state_module, (
        "_state_pass_fwd", "_state_pass_bwd", "_state_pass_split_fwd", "_state_pass_split_out",
        "_state_pass_split_dout", "_state_pass_split_bwd",
    ))  # fmt: skip
    options = KernelOptions(state_pass=state_pass, checkpoint_every=2)
    inputs = random_delta_inputs(generator, 2, 70, 2, 16, 8, channel_decay=True)
    state = torch.randn(2, 2, 16, 8, generator=generator, dtype=torch.float64)
    _compare(inputs, state, 16, options=options)  # 5 chunks: 3 segments in the backward's walk
    grids = [(name, grid) for name, grid, _ in recorded]
    assert {name for name, _ in grids} >= (
        {"_state_pass_fwd", "_state_pass_bwd"} if state_pass == "fused"
        else {"_state_pass_split_fwd", "_state_pass_split_out", "_state_pass_split_dout",
              "_state_pass_split_bwd"}
    )  # fmt: skip
    for name, grid in grids:  # (the split outputs' row blocks: one per chunk of 16)
        assert all(size == 1 for size in grid[1:]), f"{name}: grid {grid}"
    # Axis 0 counts every (chunk, value block) of the parallel kernels: B * H * 5 chunks, one
    # value block of V = 8.
    for name, grid in grids:
        if name in ("_state_pass_split_out", "_state_pass_split_dout"):
            assert grid[0] == 2 * 2 * 5, f"{name}: grid {grid}"


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [("state_pass", "fast", r"state_pass must be one of .*'fast'"),
     ("operator_dtype", "bfloat16", r"operator_dtype must be one of .*'bfloat16'"),
     ("walk_dots", "bf16", r"walk_dots must be one of .*'bf16'"),
     ("recompute_states", 1, r"recompute_states must be a bool"),
     ("checkpoint_every", 0, r"checkpoint_every must be a positive int")],
)  # fmt: skip
def test_invalid_kernel_option_is_refused_naming_the_option(field, value, match):
    with pytest.raises((ValueError, TypeError), match=match):
        KernelOptions(**{field: value})


def test_delta_rule_refuses_options_that_are_not_kernel_options(generator):
    inputs = random_delta_inputs(generator, 1, 8, 1, 16, 8, channel_decay=True)
    with pytest.raises(TypeError, match=r"options must be a deltalab\.ops\.options\.KernelOptions"):
        delta_rule(*(x.to(DEVICE, torch.float32) for x in inputs), backend="triton",
                   options={"state_pass": "fused"})  # fmt: skip


def test_triton_operator_gradients_match_their_pytorch_twin(generator, poisoned_empty):
    """The operator-gradient kernel against `_operator_grads` (batched matmuls in float64), with
    dO token-major over a length that is not a multiple of the chunk (its padding rows read as
    zero), K and V that need masking."""
    from deltalab.ops.delta_rule.chunk import ChunkOperators, to_chunks
    from deltalab.ops.delta_rule.triton.intra import Tokens
    from deltalab.ops.delta_rule.triton.state_pass import _operator_grads, operator_grads_triton

    batch, length, heads, key_dim, value_dim, size = 2, 50, 3, 20, 12, 32
    n = -(-length // size)

    def rand(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    states, d_next = rand(batch, heads, n, key_dim, value_dim), rand(batch, heads, n, key_dim,
                                                                     value_dim)  # fmt: skip
    residuals, d_residual = rand(batch, heads, n, size, value_dim), rand(batch, heads, n, size,
                                                                         value_dim)  # fmt: skip
    d_o = rand(batch, length, heads, value_dim)
    ref = _operator_grads(states, residuals, to_chunks(d_o, size), d_residual, d_next)
    got = operator_grads_triton(
        *(x.to(DEVICE, torch.float32) for x in (states, residuals, d_o, d_residual, d_next)),
        tokens=Tokens(n, heads, length, size),
    )
    for label, x, r in zip(ChunkOperators._fields, got, ref, strict=True):
        assert_close(x, r, F32, f"d {label}")


def test_triton_refuses_float64_naming_the_backend(generator):
    inputs = random_delta_inputs(generator, 1, 5, 1, 16, 8, channel_decay=False)
    with pytest.raises(ValueError, match='backend="triton" computes in float32'):
        delta_rule(*(x.to(DEVICE) for x in inputs), backend="triton")


def test_triton_bfloat16_inputs_return_bfloat16_close_to_the_loop(generator):
    inputs = random_delta_inputs(generator, 1, 40, 2, 16, 8, channel_decay=True)
    o_ref, _ = delta_rule(*inputs, backend="naive")
    # bf16 inputs, float32 inside: the interpreter only loads them (the products see float32).
    o, _ = delta_rule(*(x.to(DEVICE, torch.bfloat16) for x in inputs), backend="triton")
    assert o.dtype == torch.bfloat16
    assert_close(o, o_ref, TOLERANCE[torch.bfloat16], "o")


@pytest.mark.parametrize("state_pass", ["fused", "split"])
@pytest.mark.parametrize("operators", ["inputs", "float32"])
def test_triton_16bit_inputs_store_the_operators_as_told_and_stay_close_to_the_loop(
    generator, monkeypatch, operators, state_pass
):
    """fp16 inputs (the interpreter's 16-bit float: its bf16 arithmetic is not bf16's): with
    operator_dtype="inputs" every chunk operator but the decays reaches the state pass (each
    form) in fp16, forward and backward, with "float32" in float32; either way the output, the
    final state and every gradient stay within fp16's tolerance of the float64 loop."""
    from deltalab.ops.delta_rule.chunk import ChunkOperators
    from deltalab.ops.delta_rule.triton import state_pass as state_module

    options = KernelOptions(operator_dtype=operators, state_pass=state_pass)
    seen = []
    for name, passes in list(state_module.PASS_FORMS.items()):

        def spy(fn, name=name):
            def run(ops, *args, **kwargs):
                seen.append((name, {field: x.dtype for field, x in ops._asdict().items()}))
                return fn(ops, *args, **kwargs)

            return run

        monkeypatch.setitem(state_module.PASS_FORMS, name, tuple(spy(fn) for fn in passes))
    inputs = random_delta_inputs(generator, 2, 37, 2, 16, 8, channel_decay=True)
    state = torch.randn(2, 2, 16, 8, generator=generator, dtype=torch.float64)
    _compare_at(inputs, state, torch.float16, chunk_size=16, options=options)
    stored = torch.float16 if operators == "inputs" else torch.float32
    expected = {field: stored for field in ChunkOperators._fields}
    expected["decay"] = torch.float32
    # The forward's pass, the backward's walk again from the checkpoints, its adjoint pass,
    # each of the form set.
    assert seen == [(state_pass, expected)] * 3


# Muir's layer launches every kernel GDN-2's does and its read query, Diagonal KDN's the gain's;
# each mixer's layer alone is compared with its chunk path in tests/test_layers_triton.py.
@pytest.mark.parametrize("mixer", ["muir", "kdn_diag"])
def test_model_trains_identically_on_the_triton_backend(mixer):
    from deltalab.models import CausalLM, build_config

    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 20), device=DEVICE)
    # Narrow heads (K = V = 16) and chunks of 16 keep the interpreter's tiles small; 20 tokens
    # still make two chunks, a partial one among them. The wiring is what is tested.
    results = {}
    for backend in ("chunk", "triton"):
        torch.manual_seed(0)
        model = CausalLM(
            build_config(
                "tiny",
                mixer=mixer,
                num_layers=2,
                hidden_size=32,
                head_dim=16,
                chunk_size=16,
                backend=backend,
            )
        )
        model = model.to(DEVICE)
        loss = model(ids, labels=ids).loss
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results[backend] = (loss.detach(), grads)
    assert_close(results["triton"][0], results["chunk"][0], F32, "loss")
    assert_close(results["triton"][1], results["chunk"][1], 1e-5, "parameter gradients")


def test_triton_with_tiny_head_dims_matches_the_loop(generator, poisoned_empty):
    # K = 3 pads to a 16-wide key tile (NVIDIA's tl.dot needs an inner dimension >= 8).
    inputs = random_delta_inputs(generator, 1, 20, 1, 3, 2, channel_decay=True)
    state = torch.randn(1, 1, 3, 2, generator=generator, dtype=torch.float64)
    _compare(inputs, state, 16)


def test_triton_one_head_and_one_chunk_matches_the_loop(generator, poisoned_empty):
    # One chunk of one head: token-major inputs that stage 1 once took for chunked ones.
    inputs = random_delta_inputs(generator, 1, 20, 1, 16, 8, channel_decay=True)
    state = torch.randn(1, 1, 16, 8, generator=generator, dtype=torch.float64)
    _compare(inputs, state, 32)


def test_triton_refuses_head_dims_past_its_tiles_naming_k(generator):
    inputs = random_delta_inputs(generator, 1, 2, 1, 257, 4, channel_decay=False)
    with pytest.raises(ValueError, match="K <= 256, got K = 257"):
        delta_rule(*(x.to(DEVICE, torch.float32) for x in inputs), backend="triton")
