"""Grouped value heads (as GQA: u with G times q's heads, head h reading q's and b's head h // G)
against repeating q's and b's heads and calling the rule on the repeated copies: the output, the
final state and every gradient (q's and b's summed over each group by autograd), on every
backend, with and without qk_l2norm.

The Triton cases run where its kernels can run (a CUDA GPU, or CPU tensors under
TRITON_INTERPRET=1) at tiny shapes; only they are marked `interpreter` (the PyTorch cases would
run the same again).
"""

from __future__ import annotations

import pytest
import torch
from conftest import needs_triton, random_delta_inputs

from deltalab.ops import delta_rule, delta_rule_step
from deltalab.ops._triton import INTERPRET
from deltalab.testing import TOLERANCE, assert_close

DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
LABELS = ["o", "final state", "dq", "da", "db", "du", "dg", "d initial state"]
KEY_HEADS, GROUP = 2, 3


def grouped_inputs(generator, length, key_dim, *, channel_decay, strengths):
    """(q, b with KEY_HEADS heads; a, u, g with GROUP times as many), the initial state."""
    heads = KEY_HEADS * GROUP
    q, a, b, u, g = random_delta_inputs(
        generator, 2, length, heads, key_dim, 8, channel_decay=channel_decay,
        strengths=strengths,
    )  # fmt: skip
    q, b = q[:, :, :KEY_HEADS], b[:, :, :KEY_HEADS]
    state = torch.randn(2, heads, key_dim, 8, generator=generator, dtype=torch.float64)
    return (q, a, b, u, g), state


def run_op(inputs, state, dtype, device, repeat, **kwargs):
    """The rule's output, final state and the gradients of every input and of the initial
    state; with `repeat`, called on q and b with their heads repeated GROUP times."""
    leaves = [x.detach().to(device, dtype).requires_grad_() for x in (*inputs, state)]
    q, a, b, u, g = leaves[:5]
    if repeat:
        q, b = (x.repeat_interleave(GROUP, dim=2) for x in (q, b))
    o, s = delta_rule(q, a, b, u, g, initial_state=leaves[5], output_final_state=True, **kwargs)
    weights = torch.linspace(-1, 1, o.numel(), dtype=torch.float64).reshape(o.shape)
    ((o * weights.to(device, o.dtype)).sum() + s.sum()).backward()
    return [o, s, *(x.grad for x in leaves)]


def compare(inputs, state, backend, dtype, device, **kwargs):
    reference = run_op(inputs, state, torch.float64, "cpu", True, backend="naive", **kwargs)
    actual = run_op(inputs, state, dtype, device, False, backend=backend, chunk_size=16, **kwargs)
    for label, x, ref in zip(LABELS, actual, reference, strict=True):
        assert_close(x, ref, TOLERANCE[dtype], label)


@pytest.mark.parametrize("qk_l2norm", [False, True], ids=["raw", "qk_l2norm"])
@pytest.mark.parametrize("backend", ["naive", "chunk"])
def test_pytorch_backends_with_grouped_value_heads_equal_repeating_q_and_b(
    generator, backend, qk_l2norm
):
    inputs, state = grouped_inputs(generator, 21, 16, channel_decay=True, strengths=True)
    dtype = torch.float64 if backend == "naive" else torch.float32
    compare(inputs, state, backend, dtype, "cpu", qk_l2norm=qk_l2norm)


@pytest.mark.interpreter
@needs_triton
@pytest.mark.parametrize(
    ("channel_decay", "strengths", "qk_l2norm"),
    [
        pytest.param(False, True, False, id="gdn-form"),
        pytest.param(True, False, False, id="direction-channel_decay"),
        pytest.param(True, True, True, id="kda-form-qk_l2norm"),
    ],
)
def test_triton_with_grouped_value_heads_equals_repeating_q_and_b(
    generator, poisoned_empty, channel_decay, strengths, qk_l2norm
):
    inputs, state = grouped_inputs(generator, 21, 16, channel_decay=channel_decay,
                                   strengths=strengths)  # fmt: skip
    compare(inputs, state, "triton", torch.float32, DEVICE, qk_l2norm=qk_l2norm)


def test_value_heads_that_are_no_multiple_of_q_heads_are_refused_naming_u(generator):
    inputs, _ = grouped_inputs(generator, 4, 16, channel_decay=False, strengths=True)
    q, a, b, u, g = inputs
    with pytest.raises(ValueError, match=r"u must have shape .*grouped value heads"):
        delta_rule(q[:, :, :1].expand(-1, -1, 4, -1), a, b[:, :, :1].expand(-1, -1, 4, -1), u, g)


@pytest.mark.parametrize("qk_l2norm", [False, True], ids=["raw", "qk_l2norm"])
def test_a_decoding_step_with_grouped_value_heads_equals_repeating_q_and_b(generator, qk_l2norm):
    inputs, state = grouped_inputs(generator, 1, 16, channel_decay=False, strengths=True)
    q, a, b, u, g = (x[:, 0] for x in inputs)
    o, new = delta_rule_step(q, a, b, u, g, state, backend="naive", qk_l2norm=qk_l2norm)
    q_all, b_all = (x.repeat_interleave(GROUP, dim=1) for x in (q, b))
    o_ref, new_ref = delta_rule_step(
        q_all, a, b_all, u, g, state, backend="naive", qk_l2norm=qk_l2norm
    )
    assert torch.equal(o, o_ref) and torch.equal(new, new_ref)
