"""The Triton delta rule's stages alone against their float64 PyTorch twins: stage 1 (L and M
within a chunk, each diagonal sub-block factored or walked row by row), stage 2's solve and its
adjoint, the decay factors and their adjoint, and stage 1 and the factors given a write
strength per token.

Runs where tests/test_delta_rule_triton.py runs, at its tiny shapes.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import needs_triton
from test_delta_rule_triton import DEVICE, F32

from deltalab.testing import assert_close

pytestmark = [pytest.mark.interpreter, needs_triton]


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
