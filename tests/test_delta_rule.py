"""delta_rule: the chunk backend against the token-loop definition, varlen, gradients, stability."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from conftest import random_delta_inputs

from deltalab.ops import delta_rule, delta_rule_step
from deltalab.ops.delta_rule.chunk import padded_chunk_size, unit_lower_inverse
from deltalab.testing import TOLERANCE, assert_close, relative_error

F64 = TOLERANCE[torch.float64]
F32 = TOLERANCE[torch.float32]


@pytest.mark.parametrize("channel_decay", [False, True], ids=["head_decay", "channel_decay"])
@pytest.mark.parametrize("with_initial_state", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("chunk_size", [16, 64, 256])
@pytest.mark.parametrize("length", [1, 63, 100, 257])
def test_chunk_matches_naive_float64(
    generator, length, chunk_size, with_initial_state, channel_decay
):
    q, a, b, u, g = random_delta_inputs(generator, 2, length, 3, 8, 5, channel_decay=channel_decay)
    state = torch.randn(2, 3, 8, 5, generator=generator, dtype=torch.float64)
    state = state if with_initial_state else None
    kwargs = dict(initial_state=state, output_final_state=True)
    o_ref, s_ref = delta_rule(q, a, b, u, g, backend="naive", **kwargs)
    o, s = delta_rule(q, a, b, u, g, backend="chunk", chunk_size=chunk_size, **kwargs)
    assert_close(o, o_ref, F64, "output")
    assert_close(s, s_ref, F64, "final state")


@pytest.mark.parametrize("chunk_size", [17, 48, 100, 200])
def test_chunk_sizes_that_are_not_powers_of_two_match_naive(generator, chunk_size):
    q, a, b, u, g = random_delta_inputs(generator, 1, 230, 2, 8, 8, channel_decay=True)
    o_ref, s_ref = delta_rule(q, a, b, u, g, backend="naive", output_final_state=True)
    o, s = delta_rule(q, a, b, u, g, chunk_size=chunk_size, output_final_state=True)
    assert_close(o, o_ref, F64, "output")
    assert_close(s, s_ref, F64, "final state")


@pytest.mark.parametrize("backend", ["naive", "chunk"])
@pytest.mark.parametrize("channel_decay", [False, True], ids=["head_decay", "channel_decay"])
def test_packed_sequences_equal_one_by_one(generator, backend, channel_decay):
    lengths = [5, 40, 1, 77]
    offsets = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    q, a, b, u, g = random_delta_inputs(
        generator, 1, sum(lengths), 2, 8, 4, channel_decay=channel_decay
    )
    states = torch.randn(len(lengths), 2, 8, 4, generator=generator, dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in (q, a, b, u, g, states)]
    o, final = delta_rule(
        *leaves[:5],
        initial_state=leaves[5],
        output_final_state=True,
        cu_seqlens=torch.tensor(offsets),
        chunk_size=16,
        backend=backend,
    )
    (o.square().sum() + final.square().sum()).backward()
    packed_grads = [x.grad for x in leaves]

    singles = [x.clone().requires_grad_() for x in (q, a, b, u, g, states)]
    loss = 0.0
    for i, (start, end) in enumerate(itertools.pairwise(offsets)):
        piece = [x[:, start:end] for x in singles[:5]]
        o_i, s_i = delta_rule(
            *piece,
            initial_state=singles[5][i : i + 1],
            output_final_state=True,
            chunk_size=16,
            backend=backend,
        )
        assert_close(o[:, start:end], o_i, F64, f"output of sequence {i}")
        assert_close(final[i : i + 1], s_i, F64, f"final state of sequence {i}")
        loss = loss + o_i.square().sum() + s_i.square().sum()
    loss.backward()
    for name, packed, single in zip(
        "q a b u g initial_state".split(), packed_grads, singles, strict=True
    ):
        assert_close(packed, single.grad, F64, f"gradient of {name}")


@pytest.mark.parametrize(
    ("backend", "channel_decay", "length", "chunk_size"),
    [
        ("naive", False, 9, 16),
        ("naive", True, 9, 16),
        ("chunk", False, 21, 16),
        ("chunk", True, 37, 32),
    ],
)
def test_gradients_match_finite_differences(generator, backend, channel_decay, length, chunk_size):
    inputs = random_delta_inputs(generator, 1, length, 1, 3, 2, channel_decay=channel_decay)
    # Keep every finite-difference probe of g strictly negative.
    inputs = (*inputs[:4], inputs[4] - 0.05)
    state = torch.randn(1, 1, 3, 2, generator=generator, dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in (*inputs, state)]

    def run(q, a, b, u, g, s0):
        o, final = delta_rule(
            q,
            a,
            b,
            u,
            g,
            initial_state=s0,
            output_final_state=True,
            chunk_size=chunk_size,
            backend=backend,
        )
        return o, final

    assert torch.autograd.gradcheck(run, leaves, eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("channel_decay", [False, True], ids=["head_decay", "channel_decay"])
def test_float32_chunk_256_is_stable_under_strong_decay(generator, channel_decay):
    inputs = random_delta_inputs(
        generator, 1, 600, 2, 32, 16, channel_decay=channel_decay, min_log_decay=-20.0
    )
    o_ref, s_ref = delta_rule(*inputs, backend="naive", output_final_state=True)
    o, s = delta_rule(
        *(x.float() for x in inputs), backend="chunk", chunk_size=256, output_final_state=True
    )
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert relative_error(o, o_ref) < F32
    assert relative_error(s, s_ref) < F32


def test_factorized_decay_overflows_where_the_stable_form_does_not(generator):
    """The textbook factorization exp(G_t) * exp(-G_s) of one 256-token chunk at g in [-20, 0]."""
    _, a, b, _, g = random_delta_inputs(
        generator, 1, 256, 1, 32, 16, channel_decay=True, min_log_decay=-20.0
    )
    a, b, G = a[0, :, 0].float(), b[0, :, 0].float(), g[0, :, 0].float().cumsum(0)
    factorized = ((G.exp() * b) @ (torch.exp(-G) * a).T).tril(-1)
    assert not torch.isfinite(factorized).all()
    # The same matrix formed pairwise in float64, which the chunk backend matches (test above).
    pairwise = torch.einsum(
        "tk,sk,tsk->ts", b.double(), a.double(), (G[:, None] - G[None]).double().clamp(max=0).exp()
    )
    assert torch.isfinite(pairwise).all()


@pytest.mark.parametrize("channel_decay", [False, True], ids=["head_decay", "channel_decay"])
def test_step_by_step_decoding_equals_full_sequence(generator, channel_decay):
    q, a, b, u, g = random_delta_inputs(generator, 2, 30, 3, 8, 5, channel_decay=channel_decay)
    state = torch.randn(2, 3, 8, 5, generator=generator, dtype=torch.float64)
    o_full, s_full = delta_rule(q, a, b, u, g, initial_state=state, output_final_state=True)
    outputs = []
    for t in range(q.shape[1]):
        o_t, state = delta_rule_step(q[:, t], a[:, t], b[:, t], u[:, t], g[:, t], state)
        outputs.append(o_t)
    assert_close(torch.stack(outputs, dim=1), o_full, F64, "outputs")
    assert_close(state, s_full, F64, "final state")


@pytest.mark.parametrize("backend", ["naive", "chunk"])
@pytest.mark.parametrize("channel_decay", [False, True], ids=["head_decay", "channel_decay"])
def test_a_strength_per_token_acts_as_its_product_with_b_with_its_gradient(
    generator, backend, channel_decay
):
    """a [B, T, H] is the write direction a_t b_t: same outputs, final state and gradients
    (d beta = sum_k b d a) as the product passed in, here and in one-token decoding."""
    q, beta, b, u, g = random_delta_inputs(
        generator, 2, 45, 3, 8, 5, channel_decay=channel_decay, strengths=True
    )
    state = torch.randn(2, 3, 8, 5, generator=generator, dtype=torch.float64)

    def run(strength):
        leaves = [x.clone().requires_grad_() for x in (q, beta, b, u, g)]
        a = leaves[1] if strength else leaves[1].unsqueeze(-1) * leaves[2]
        o, s = delta_rule(
            leaves[0], a, *leaves[2:], initial_state=state, output_final_state=True,
            backend=backend, chunk_size=16,
        )  # fmt: skip
        weights = torch.linspace(-1, 1, o.numel(), dtype=o.dtype).reshape(o.shape)
        ((o * weights).sum() + s.sum()).backward()
        return [o, s, *(x.grad for x in leaves)]

    labels = ["o", "final state", "dq", "d beta", "db", "du", "dg"]
    for label, x, ref in zip(labels, run(True), run(False), strict=True):
        assert_close(x, ref, F64, label)
    o_t, s_t = delta_rule_step(q[:, 0], beta[:, 0], b[:, 0], u[:, 0], g[:, 0], state)
    o_ref, s_ref = delta_rule_step(
        q[:, 0], beta[:, 0, :, None] * b[:, 0], b[:, 0], u[:, 0], g[:, 0], state
    )
    assert_close(o_t, o_ref, F64, "step output")
    assert_close(s_t, s_ref, F64, "step state")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_state_is_float32_for_low_precision_inputs(generator, dtype):
    inputs = random_delta_inputs(generator, 1, 40, 2, 8, 8, channel_decay=True, dtype=dtype)
    o, s = delta_rule(*inputs, output_final_state=True)
    assert o.dtype == dtype and s.dtype == torch.float32
    o_ref, s_ref = delta_rule(*(x.double() for x in inputs), output_final_state=True)
    assert_close(s, s_ref, TOLERANCE[dtype], "final state")
    assert_close(o, o_ref, TOLERANCE[dtype], "output")
    step_o, step_s = delta_rule_step(*(x[:, 0] for x in inputs), s.to(dtype))
    assert step_o.dtype == dtype and step_s.dtype == torch.float32


def test_scale_multiplies_the_output_and_defaults_to_inverse_sqrt_key_dim(generator):
    q, a, b, u, g = random_delta_inputs(generator, 1, 20, 1, 16, 4, channel_decay=False)
    o_default, _ = delta_rule(q, a, b, u, g)
    o_unit, _ = delta_rule(q, a, b, u, g, scale=1.0)
    o_three, _ = delta_rule(q, a, b, u, g, scale=3.0)
    assert_close(o_default, o_unit / math.sqrt(16), F64)
    assert_close(o_three, 3.0 * o_unit, F64)


def test_auto_backend_matches_naive(generator):
    inputs = random_delta_inputs(generator, 1, 50, 2, 8, 8, channel_decay=True)
    o_auto, _ = delta_rule(*inputs, backend="auto")
    o_ref, _ = delta_rule(*inputs, backend="naive")
    assert_close(o_auto, o_ref, F64)


@pytest.mark.parametrize("size", [16, 32, 64, 128, 256])
def test_blockwise_triangular_inverse_matches_dense_inverse(generator, size):
    lower = torch.randn(3, size, size, generator=generator, dtype=torch.float64).tril(-1) / size
    eye = torch.eye(size, dtype=torch.float64)
    assert_close(unit_lower_inverse(lower), torch.linalg.inv(eye + lower), F64)


@pytest.mark.parametrize(
    ("chunk", "padded"), [(16, 16), (17, 32), (48, 64), (64, 64), (100, 128), (256, 256)]
)
def test_padded_chunk_size_is_sub_block_times_power_of_two(chunk, padded):
    assert padded_chunk_size(chunk) == padded


@pytest.mark.parametrize("backend", ["naive", "chunk"])
@pytest.mark.parametrize("channel_decay", [False, True], ids=["head_decay", "channel_decay"])
def test_log_decay_of_minus_infinity_is_a_full_reset(generator, backend, channel_decay):
    q, a, b, u, g = random_delta_inputs(generator, 1, 90, 2, 8, 4, channel_decay=channel_decay)
    reset = 37
    g[:, reset] = -math.inf
    o, s = delta_rule(q, a, b, u, g, backend=backend, chunk_size=32, output_final_state=True)
    # After the reset the sequence behaves as if it started there from a zero state.
    tail = [x[:, reset:] for x in (q, a, b, u, g)]
    tail[4] = tail[4].clone()
    tail[4][:, 0] = 0.0
    o_tail, s_tail = delta_rule(*tail, backend="naive", output_final_state=True)
    assert_close(o[:, reset:], o_tail, F64, "outputs after the reset")
    assert_close(s, s_tail, F64, "final state")


@pytest.mark.parametrize("chunk_size", [64, 256])
def test_float32_keeps_precision_when_strong_and_weak_decays_mix(generator, chunk_size):
    """Weak decays right after strong ones: the exponents must not be differences of large sums."""
    q, a, b, u, g = random_delta_inputs(generator, 1, 512, 2, 16, 8, channel_decay=True)
    pattern = torch.arange(512) % chunk_size < chunk_size // 2
    g = torch.where(pattern[None, :, None, None], -20.0 + 0 * g, -0.01 * g.abs())
    o_ref, s_ref = delta_rule(q, a, b, u, g, backend="naive", output_final_state=True)
    o, s = delta_rule(
        *(x.float() for x in (q, a, b, u, g)), chunk_size=chunk_size, output_final_state=True
    )
    assert relative_error(o, o_ref) < 1e-5
    assert relative_error(s, s_ref) < 1e-5
