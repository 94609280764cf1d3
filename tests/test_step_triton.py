"""The Triton decoding step against the token definition (float64) and the naive backend.

Runs compiled on a GPU, or on CPU under Triton's interpreter: `TRITON_INTERPRET=1 python -m
pytest tests/test_step_triton.py` (the variable must be set before triton and deltalab load).
Skipped otherwise. The interpreter computes bf16 wrongly, so CPU runs check float32 only.
"""

from __future__ import annotations

import pytest
import torch
from conftest import random_delta_inputs

from deltalab.ops import delta_rule_step, kdn_diag_step, kdn_iso_step
from deltalab.ops._triton import INTERPRET
from deltalab.ops.delta_rule.naive import delta_rule_token
from deltalab.ops.parametrize import DeltaRuleInputs
from deltalab.testing import TOLERANCE, assert_close

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(
        not (INTERPRET or torch.cuda.is_available()),
        reason="needs a CUDA GPU, or TRITON_INTERPRET=1 set before import",
    ),
]

DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
DECAYS = pytest.mark.parametrize(
    "channel_decay", [False, True], ids=["head_decay", "channel_decay"]
)
# (B, H, K, V): square, K != V both ways, and sizes that are not powers of two (masked rows and
# columns).
SHAPES = pytest.mark.parametrize("shape", [(2, 3, 16, 16), (1, 2, 32, 16), (3, 1, 20, 12)])


def step_inputs(generator, shape, channel_decay, dtype=torch.float32):
    """(q, a, b, u, g, state) of one token on DEVICE in `dtype`, the state float32."""
    batch, heads, key_dim, value_dim = shape
    inputs = random_delta_inputs(
        generator, batch, 1, heads, key_dim, value_dim, channel_decay=channel_decay
    )
    state = torch.randn(batch, heads, key_dim, value_dim, generator=generator, dtype=torch.float64)
    return [x[:, 0].to(DEVICE, dtype) for x in inputs] + [state.to(DEVICE, torch.float32)]


def reference(q, a, b, u, g, state, scale):
    """`delta_rule_token` in float64 on CPU."""
    q, a, b, u, g, state = (x.double().cpu() for x in (q, a, b, u, g, state))
    return delta_rule_token(DeltaRuleInputs(q * scale, a, b, u, g), state)


def nan_like(x, dtype=None):
    return torch.full_like(x, float("nan"), dtype=dtype)


@DECAYS
@SHAPES
def test_triton_step_matches_float64_definition(generator, shape, channel_decay):
    from deltalab.ops.delta_rule.triton.step import delta_rule_step_triton

    q, a, b, u, g, state = step_inputs(generator, shape, channel_decay)
    scale = 0.7
    o_ref, s_ref = reference(q, a, b, u, g, state, scale)
    # Unwritten elements stay NaN and fail the comparison.
    o, s = delta_rule_step_triton(
        q, a, b, u, g, state, scale=scale, new_state=nan_like(state), o=nan_like(u)
    )
    assert_close(o, o_ref, TOLERANCE[torch.float32], "output")
    assert_close(s, s_ref, TOLERANCE[torch.float32], "state")


@DECAYS
def test_triton_step_in_place_writes_the_new_state_over_the_old(generator, channel_decay):
    q, a, b, u, g, state = step_inputs(generator, (2, 2, 20, 12), channel_decay)
    o_ref, s_ref = reference(q, a, b, u, g, state, 20**-0.5)
    buffer = state.clone()
    o, s = delta_rule_step(q, a, b, u, g, buffer, backend="triton", in_place=True)
    assert s is buffer
    assert_close(o, o_ref, TOLERANCE[torch.float32], "output")
    assert_close(buffer, s_ref, TOLERANCE[torch.float32], "state")


@DECAYS
@SHAPES
def test_triton_backend_equals_naive_backend(generator, shape, channel_decay):
    inputs = step_inputs(generator, shape, channel_decay)
    o_naive, s_naive = delta_rule_step(*inputs, backend="naive")
    o, s = delta_rule_step(*inputs, backend="triton")
    assert o.dtype == o_naive.dtype and s.dtype == s_naive.dtype == torch.float32
    assert_close(o, o_naive, TOLERANCE[torch.float32], "output")
    assert_close(s, s_naive, TOLERANCE[torch.float32], "state")


def test_triton_step_reads_strided_inputs(generator):
    q, a, b, u, g, state = step_inputs(generator, (3, 2, 16, 8), True)
    # A head-major copy viewed batch-major: same values, other strides.
    q_strided = q.transpose(0, 1).contiguous().transpose(0, 1)
    assert not q_strided.is_contiguous()
    o, s = delta_rule_step(q_strided, a, b, u, g, state, backend="triton")
    o_naive, s_naive = delta_rule_step(q, a, b, u, g, state, backend="naive")
    assert_close(o, o_naive, TOLERANCE[torch.float32], "output")
    assert_close(s, s_naive, TOLERANCE[torch.float32], "state")


@pytest.mark.parametrize("step", [kdn_iso_step, kdn_diag_step], ids=["iso", "diag"])
def test_kdn_steps_pass_the_backend_to_the_memory_update(generator, step):
    batch, heads, key_dim, value_dim = 2, 2, 16, 8
    q, _, k, v, g, memory = step_inputs(generator, (batch, heads, key_dim, value_dim), True)
    noise_shape = (batch, heads) if step is kdn_iso_step else (batch, heads, key_dim)
    q_noise = torch.rand(noise_shape, generator=generator).to(DEVICE) * 0.1
    r = (torch.rand(batch, heads, generator=generator) + 0.1).to(DEVICE)
    precision = torch.ones(noise_shape, device=DEVICE)
    args = (q, k, v, g, q_noise, r, (memory, precision))
    o_naive, (m_naive, p_naive) = step(*args, backend="naive")
    o, (m, p) = step(*args, backend="triton")
    assert_close(o, o_naive, TOLERANCE[torch.float32], "output")
    assert_close(m, m_naive, TOLERANCE[torch.float32], "memory")
    assert torch.equal(p, p_naive)


def test_triton_backend_refuses_float64_naming_the_backend(generator):
    inputs = step_inputs(generator, (1, 1, 16, 16), False, dtype=torch.float64)
    with pytest.raises(ValueError, match=r'backend="triton" keeps the state in float32'):
        delta_rule_step(*inputs, backend="triton")


@pytest.mark.skipif(DEVICE != "cuda", reason="the interpreter computes bf16 wrongly")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@DECAYS
def test_triton_step_low_precision_inputs_match_float64_definition(generator, dtype, channel_decay):
    q, a, b, u, g, state = step_inputs(generator, (4, 3, 128, 128), channel_decay, dtype=dtype)
    o_ref, s_ref = reference(q, a, b, u, g, state, 128**-0.5)
    o, s = delta_rule_step(q, a, b, u, g, state, backend="triton")
    assert o.dtype == dtype and s.dtype == torch.float32
    assert_close(o, o_ref, TOLERANCE[dtype], "output")
    assert_close(s, s_ref, TOLERANCE[dtype], "state")


def test_a_decoding_step_that_needs_gradients_keeps_them_or_is_refused(generator):
    """The fused step records no backward: "auto" takes the token loop when an input requires
    grad (the gradient is the loop's), "triton" refuses by name rather than dropping it."""
    from deltalab.ops import delta_rule_step

    b, h, k = 2, 2, 4
    draw = lambda *shape: torch.rand(*shape, generator=generator)  # noqa: E731
    q, a, key, u, g = draw(b, h, k), draw(b, h), draw(b, h, k), draw(b, h, k), -draw(b, h)
    q.requires_grad_()
    state = draw(b, h, k, k)
    o, _ = delta_rule_step(q, a, key, u, g, state, backend="auto")
    (dq,) = torch.autograd.grad(o.sum(), q)
    o_loop, _ = delta_rule_step(q, a, key, u, g, state, backend="naive")
    (dq_loop,) = torch.autograd.grad(o_loop.sum(), q)
    assert torch.equal(dq, dq_loop)
    with pytest.raises(ValueError, match='backend="triton" decodes without gradients'):
        delta_rule_step(q, a, key, u, g, state, backend="triton")
