"""The scan kernels of deltalab/ops/kdn/triton.py alone: the isotropic gain's scan stage
(kdn_iso_scan) against its float64 PyTorch twin, in one chunk or split over T, with any subset
of its outputs used and at the extremes of r; scans of no steps; and `split_plan`, which splits
the float32 scans of few programs over T.

The kernels run on a CUDA GPU, or on CPU tensors under Triton's interpreter:

    TRITON_INTERPRET=1 python -m pytest tests/test_kdn_scan_triton.py

(README's test command runs this file a second time with it set); skipped otherwise, except the
checks of the split plan. Shapes are tiny: the interpreter runs every operation of a kernel in
Python.
"""

from __future__ import annotations

import pytest
import torch
from test_kdn_gain_triton import DEVICE, F32, F64, needs_triton

from deltalab.ops.kdn import gains
from deltalab.testing import TOLERANCE, assert_close

pytestmark = pytest.mark.interpreter


def iso_scan_inputs(seed, shape):
    """decay2, norm2, q_noise, r `[N, T, H]` and p0 `[N, H]` (float64) for the isotropic scan
    alone, with a reset (a = 0), a zero key (no evidence), no process noise on one token,
    r = 1e30, 1e-6 and 1e-30 (where p^2 underflows float32 and c = s ||k||^2 / (K r) nearly
    overflows it)."""
    gen = torch.Generator().manual_seed(seed)

    def uniform(low, high, size=shape):
        return low + (high - low) * torch.rand(size, generator=gen, dtype=F64)

    decay2, norm2, q_noise, r = (
        uniform(0.05, 1.0),
        uniform(0.0, 4.0),
        uniform(0, 0.3),
        uniform(0.2, 2),
    )
    decay2[0, 3, 0], norm2[-1, 5, -1], q_noise[0, 7, 1] = 0.0, 0.0, 0.0
    r[0, 2, 0], r[-1, 4, -1], r[-1, 9, 0] = 1e30, 1e-6, 1e-30
    return [decay2, norm2, q_noise, r, uniform(0.5, 1.5, (shape[0], shape[2]))]


def test_split_plan_splits_float32_scans_of_few_lane_programs_into_powers_of_2():
    from deltalab.ops.kdn.triton import SPLIT_PROGRAMS, split_plan

    # Isotropic at B=1 H=16 T=32768 (one lane per program, tiles of 1024): 16 programs.
    chunk, parts = split_plan(16, 32768, 1024, 1, F32)
    assert chunk == 2048 and parts == 16 and 16 * parts == SPLIT_PROGRAMS
    assert split_plan(32, 4096, 1024, 1, F32) == (1024, 4)
    assert split_plan(64, 4096, 1024, 1, F32) == (4096, 1)  # B=4 H=16: measured unsplit
    # Many programs, float64, or T within a tile: one chunk covering T's tiles.
    assert split_plan(8192, 4096, 64, 32, F32) == (4096, 1)
    assert split_plan(16, 32768, 1024, 1, F64) == (32768, 1)
    assert split_plan(16, 50, 64, 1, F32) == (64, 1)
    assert split_plan(3, 37, 16, 1, F32, chunk=16) == (16, 3)
    with pytest.raises(ValueError, match="multiple of BLOCK_T = 16"):
        split_plan(3, 37, 16, 1, F32, chunk=24)
    with pytest.raises(ValueError, match="float32 only"):
        split_plan(3, 37, 16, 1, F64, chunk=16)


@needs_triton
@pytest.mark.parametrize("used", [(1,), (1, 2)], ids=str)
def test_iso_scan_gradients_stay_finite_with_beta_unused_at_no_evidence_and_tiny_r(used):
    """||k||^2 = 0 with r = 1e-30: beta = p_bar / r ~ 1e30 and its own gradient share g2 beta
    / den ~ 1e60 overflow float32, so with beta unused that share must be an exact 0, not
    0 * inf (the other outputs' gradients are finite and match float64)."""
    from deltalab.ops.kdn.triton import kdn_iso_scan

    shape = (2, 20, 3)
    inputs = iso_scan_inputs(44, shape)
    inputs[1][0, 11, 2], inputs[3][0, 11, 2] = 0.0, 1e-30
    weights = torch.randn(shape, generator=torch.Generator().manual_seed(45), dtype=F64)
    results = []
    for device, dtype, scan in (("cpu", F64, iso_scan_reference), (DEVICE, F32, kdn_iso_scan)):
        leaves = [x.to(device, dtype).requires_grad_() for x in inputs]
        outputs = scan(*leaves, 0.75)
        loss = sum((outputs[i] * weights.to(outputs[i])).sum() for i in used)
        results.append(torch.autograd.grad(loss, leaves))
    for name, x, x64 in zip(
        ("a", "norm2", "q_noise", "r", "p0"), results[1], results[0], strict=True
    ):
        assert_close(x, x64, TOLERANCE[F32], f"d/d{name}")


@needs_triton
def test_scans_of_no_steps_return_empty_outputs_and_a_zero_prior_gradient():
    from deltalab.ops.kdn.triton import kdn_iso_scan, kdn_variance_scan

    inputs = [x[:, :0].to(DEVICE, F32) for x in iso_scan_inputs(43, (2, 12, 3))[:4]]
    p0 = torch.ones(2, 3, device=DEVICE, requires_grad=True)
    for outputs in (kdn_iso_scan(*inputs, p0, 0.5), kdn_variance_scan(*inputs[:3], p0)):
        assert all(o.shape == (2, 0, 3) for o in outputs)
        (grad,) = torch.autograd.grad(sum(o.sum() for o in outputs), p0, allow_unused=True)
        assert grad is None or torch.equal(grad, torch.zeros_like(p0))


def iso_scan_reference(decay2, norm2, q_noise, r, p_prior, evidence_scale):
    """The isotropic scan as gains.iso_gain composes it on the PyTorch path, step by step."""
    evidence = evidence_scale * norm2 / r
    p, p_bar = gains._variance_scan(decay2, q_noise, evidence, p_prior, "sequential")
    beta, predictive = gains.iso_beta(p_bar, norm2, r)
    return beta, p, predictive


@needs_triton
@pytest.mark.parametrize("used", [(0, 1, 2), (0,), (1,), (2,), (0, 2)], ids=str)
@pytest.mark.parametrize(
    ("config", "chunk", "carry_block"),
    [
        ((16, 2), 48, None),
        ((64, 1), None, None),
        ((16, 2), None, None),
        ((16, 1), 32, None),
        ((16, 2), 16, (2, 2)),
    ],
    ids=["3_tiles_one_chunk", "one_tile", "default_plan_3_chunks", "2_chunks_of_32",
         "3_chunks_in_carry_blocks_of_2x2"],
)  # fmt: skip
def test_iso_scan_kernel_and_every_gradient_match_float64_ops_with_outputs_used_or_not(
    poisoned_empty, used, config, chunk, carry_block
):
    """The scan stage of the isotropic gain alone (triton.kdn_iso_scan: the evidence, the
    Mobius scan, beta and predictive in one kernel each way) against its twin, the PyTorch ops
    in float64, for a loss on any subset of (beta, p, predictive): an unused output's gradient
    is skipped in the kernel, not zero-filled. T = 37 crosses tiles of 16; lanes are masked
    at H = 3 with two per program. Split over T (`chunk`): the chunks' maps and adjoints, the
    carry passes between them and the chunks walked from their carries, the last chunk
    partly past T; with carry blocks of 2 chunks x 2 lanes the carry passes cross blocks of
    both. With no chunk given `split_plan` splits (3 lane programs)."""
    from deltalab.ops.kdn.triton import kdn_iso_scan

    shape = (2, 37, 3)
    inputs = iso_scan_inputs(41, shape)
    gen = torch.Generator().manual_seed(42)
    weights = [torch.randn(shape, generator=gen, dtype=F64) for _ in range(3)]
    results = {}
    plan = {"config": config, "chunk": chunk, "carry_block": carry_block}
    for label, device, dtype, scan in (
        ("float64 ops", "cpu", F64, iso_scan_reference),
        ("kernel", DEVICE, F32, lambda *x: kdn_iso_scan(*x, **plan)),
    ):
        leaves = [x.to(device, dtype).requires_grad_() for x in inputs]
        outputs = scan(*leaves, 0.75)
        loss = sum((outputs[i] * weights[i].to(outputs[i])).sum() for i in used)
        grads = torch.autograd.grad(loss, leaves)
        results[label] = [x.detach() for x in (*outputs, *grads)]
    labels = ["beta", "p", "predictive", *(f"d/d{n}" for n in ("a", "norm2", "q_noise", "r", "p0"))]
    for label, x, x64 in zip(labels, results["kernel"], results["float64 ops"], strict=True):
        assert x.dtype == F32, label
        assert_close(x, x64, TOLERANCE[F32], label)
