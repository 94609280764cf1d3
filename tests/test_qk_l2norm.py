"""qk_l2norm=True (q and b made unit-norm inside the op) against normalizing first and calling
the op without it: the output, the final state and every gradient, on every backend, for
delta_rule, kdn_iso and kdn_diag.

The reference is the float64 token loop on `l2_normalize`d inputs, with the gradients reaching
the raw q and b through the normalization by autograd. The Triton cases run where its kernels
can run (a CUDA GPU, or CPU tensors under TRITON_INTERPRET=1) at tiny shapes; only they are
marked `interpreter` (the PyTorch cases would run the same again).
"""

from __future__ import annotations

import pytest
import torch
from conftest import needs_triton, random_delta_inputs
from test_kdn import kdn_inputs

from deltalab.ops import delta_rule, delta_rule_step, kdn_diag, kdn_iso
from deltalab.ops._triton import INTERPRET
from deltalab.ops.norms import L2_EPS
from deltalab.ops.norms.reference import l2_normalize_naive
from deltalab.testing import TOLERANCE, assert_close

DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
LABELS = ["o", "final state", "dq", "da", "db", "du", "dg", "d initial state"]


def raw_inputs(generator, length, key_dim, *, channel_decay, strengths, batch=2, heads=2):
    """random_delta_inputs with q and b of norms far from 1 (0.3 to 3 per row)."""
    q, a, b, u, g = random_delta_inputs(
        generator, batch, length, heads, key_dim, 8, channel_decay=channel_decay,
        strengths=strengths,
    )  # fmt: skip
    lengths = 0.3 + 2.7 * torch.rand(2, batch, length, heads, 1, generator=generator)
    return q * lengths[0].double(), a, b * lengths[1].double(), u, g


def run_op(op, inputs, state, dtype, device, **kwargs):
    """op's output, final state and the gradients of every input and of the initial state."""
    leaves = [x.detach().to(device, dtype).requires_grad_() for x in (*inputs, state)]
    o, s = op(*leaves[:5], initial_state=leaves[5], output_final_state=True, **kwargs)
    weights = torch.linspace(-1, 1, o.numel(), dtype=torch.float64).reshape(o.shape)
    ((o * weights.to(device, o.dtype)).sum() + s.sum()).backward()
    return [o, s, *(x.grad for x in leaves)]


def normalized_first(q, a, b, u, g, **kwargs):
    """The definition: q and b through l2_normalize, then the op without qk_l2norm."""
    unit_q, unit_b = (l2_normalize_naive(x, L2_EPS) for x in (q, b))
    return delta_rule(unit_q, a, unit_b, u, g, backend="naive", **kwargs)


def compare(inputs, state, backend, dtype, device, **kwargs):
    reference = run_op(normalized_first, inputs, state, torch.float64, "cpu")
    actual = run_op(delta_rule, inputs, state, dtype, device, backend=backend, qk_l2norm=True,
                    **kwargs)  # fmt: skip
    for label, x, ref in zip(LABELS, actual, reference, strict=True):
        assert_close(x, ref, TOLERANCE[dtype], label)


@pytest.mark.parametrize("strengths", [False, True], ids=["direction", "strength"])
@pytest.mark.parametrize("backend", ["naive", "chunk"])
def test_pytorch_backends_with_qk_l2norm_equal_normalizing_first(generator, backend, strengths):
    inputs = raw_inputs(generator, 37, 16, channel_decay=True, strengths=strengths)
    state = torch.randn(2, 2, 16, 8, generator=generator, dtype=torch.float64)
    dtype = torch.float64 if backend == "naive" else torch.float32
    compare(inputs, state, backend, dtype, "cpu", chunk_size=16)


# Both a layouts and both g layouts; K = 80 cuts stage 1's adjoint into two channel blocks and
# the factors' forward into three, which read the norms stage 1's forward wrote.
@pytest.mark.interpreter
@needs_triton
@pytest.mark.parametrize(
    ("length", "key_dim", "channel_decay", "strengths"),
    [
        pytest.param(37, 16, False, True, id="gdn-form"),
        pytest.param(37, 16, True, False, id="direction-channel_decay"),
        pytest.param(20, 80, True, True, id="kda-form-channel-blocks"),
    ],
)
def test_triton_with_qk_l2norm_equals_normalizing_first(
    generator, poisoned_empty, length, key_dim, channel_decay, strengths
):
    inputs = raw_inputs(generator, length, key_dim, channel_decay=channel_decay,
                        strengths=strengths)  # fmt: skip
    state = torch.randn(2, 2, key_dim, 8, generator=generator, dtype=torch.float64)
    compare(inputs, state, "triton", torch.float32, DEVICE, chunk_size=16)


@pytest.mark.interpreter
@needs_triton
def test_triton_with_qk_l2norm_on_packed_sequences_equals_normalizing_first(
    generator, poisoned_empty
):
    inputs = raw_inputs(generator, 40, 16, channel_decay=False, strengths=True, batch=1)
    state = torch.randn(3, 2, 16, 8, generator=generator, dtype=torch.float64)
    cu_seqlens = torch.tensor([0, 7, 30, 40])
    reference = run_op(normalized_first, inputs, state, torch.float64, "cpu", cu_seqlens=cu_seqlens)
    actual = run_op(delta_rule, inputs, state, torch.float32, DEVICE, backend="triton",
                    qk_l2norm=True, chunk_size=16, cu_seqlens=cu_seqlens.to(DEVICE))  # fmt: skip
    for label, x, ref in zip(LABELS, actual, reference, strict=True):
        assert_close(x, ref, TOLERANCE[torch.float32], label)


def test_qk_l2norm_must_be_a_bool(generator):
    inputs = raw_inputs(generator, 4, 16, channel_decay=False, strengths=True)
    with pytest.raises(TypeError, match="qk_l2norm must be a bool"):
        delta_rule(*inputs, backend="chunk", qk_l2norm=1)


KDN_OPS = {"iso": kdn_iso, "diag": kdn_diag}
KDN_DIFFERENTIABLE = ("q", "k", "v", "g", "q_noise", "r", "p0")


def run_kdn(variant, args, memory, dtype, device, normalize_first, **kwargs):
    """A KDN op's output, final memory and precision and the gradients of every input and of
    the initial memory; with `normalize_first`, q and k are l2_normalized before the call."""
    leaves = {n: x.detach().to(device, dtype).requires_grad_() for n, x in args.items()}
    start = memory.detach().to(device, dtype).requires_grad_()
    inputs = dict(leaves)
    if normalize_first:
        inputs["q"], inputs["k"] = (l2_normalize_naive(inputs[n], L2_EPS) for n in "qk")
    o, (s, precision) = KDN_OPS[variant](
        **inputs, initial_state=(start, None), output_final_state=True, **kwargs
    )
    weights = torch.linspace(-1, 1, o.numel(), dtype=torch.float64).reshape(o.shape)
    loss = (o * weights.to(device, o.dtype)).sum() + s.sum() + precision.sum()
    loss.backward()
    return [o, s, precision, *(leaves[n].grad for n in KDN_DIFFERENTIABLE), start.grad]


def compare_kdn(variant, backend, dtype, device, generator, length=21, key_dim=16):
    args = kdn_inputs(generator, (2, length, 2, key_dim, 8), variant=variant)
    memory = torch.randn(2, 2, key_dim, 8, generator=generator, dtype=torch.float64)
    reference = run_kdn(variant, args, memory, torch.float64, "cpu", True, backend="naive")
    actual = run_kdn(variant, args, memory, dtype, device, False, backend=backend,
                     qk_l2norm=True, chunk_size=16)  # fmt: skip
    labels = ["o", "memory", "precision", *(f"d{n}" for n in KDN_DIFFERENTIABLE), "d memory"]
    for label, x, ref in zip(labels, actual, reference, strict=True):
        assert_close(x, ref, TOLERANCE[dtype], label)


@pytest.mark.parametrize("variant", ["iso", "diag"])
@pytest.mark.parametrize("backend", ["naive", "chunk"])
def test_kdn_pytorch_backends_with_qk_l2norm_equal_normalizing_first(generator, variant, backend):
    dtype = torch.float64 if backend == "naive" else torch.float32
    compare_kdn(variant, backend, dtype, "cpu", generator)


@pytest.mark.interpreter
@needs_triton
@pytest.mark.parametrize("variant", ["iso", "diag"])
def test_kdn_triton_with_qk_l2norm_equals_normalizing_first(generator, poisoned_empty, variant):
    compare_kdn(variant, "triton", torch.float32, DEVICE, generator)


def test_a_decoding_step_with_qk_l2norm_equals_normalizing_first(generator):
    q, a, b, u, g = (x[:, 0] for x in raw_inputs(generator, 1, 16, channel_decay=True,
                                                  strengths=True))  # fmt: skip
    state = torch.randn(2, 2, 16, 8, generator=generator, dtype=torch.float64)
    o, new = delta_rule_step(q, a, b, u, g, state, backend="naive", qk_l2norm=True)
    unit_q, unit_b = (l2_normalize_naive(x, L2_EPS) for x in (q, b))
    o_ref, new_ref = delta_rule_step(unit_q, a, unit_b, u, g, state, backend="naive")
    assert torch.equal(o, o_ref) and torch.equal(new, new_ref)
