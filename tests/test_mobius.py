"""Mobius scans: the parallel scan against the step loop, gradients, range over 10^6 steps."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from deltalab.ops._triton import INTERPRET
from deltalab.ops.mobius import mobius_scan
from deltalab.testing import TOLERANCE, assert_close


def random_maps(shape: tuple[int, ...], gen: torch.Generator, dtype=torch.float64):
    """General non-negative maps with A D >= 0.25 > 0.16 >= B C (so A D - B C > 0)."""

    def uniform(low: float, high: float) -> torch.Tensor:
        return low + (high - low) * torch.rand(shape, generator=gen, dtype=dtype)

    return uniform(0.5, 2.0), uniform(0.0, 0.4), uniform(0.0, 0.4), uniform(0.5, 2.0)


def kdn_maps(log_decay, process_noise, evidence):
    """The variance map of KDN (docs/MATH.md sec. 3.4): A = a, B = q, C = c a, D = c q + 1."""
    a = (2 * log_decay).exp()
    return a, process_noise, evidence * a, evidence * process_noise + 1


def sequential_float64_numpy(A, B, C, D, x0: float) -> np.ndarray:
    """The definition on one sequence `[T]`, in float64 Python floats (fast enough for 10^6)."""
    An, Bn, Cn, Dn = (x.double().tolist() for x in (A, B, C, D))
    out = np.empty(len(An))
    x = float(x0)
    for t in range(len(An)):
        x = (An[t] * x + Bn[t]) / (Cn[t] * x + Dn[t])
        out[t] = x
    return out


@pytest.mark.parametrize("length", [1, 2, 3, 7, 64, 100, 257])
@pytest.mark.parametrize("batch", [(), (2, 3)])
def test_parallel_matches_sequential_float64(length, batch):
    gen = torch.Generator().manual_seed(length)
    A, B, C, D = random_maps((*batch, length), gen)
    x0 = 3 * torch.rand(batch, generator=gen, dtype=torch.float64)
    expected = mobius_scan(A, B, C, D, x0, backend="sequential")
    actual = mobius_scan(A, B, C, D, x0, backend="parallel")
    assert actual.shape == (*batch, length) and actual.dtype == torch.float64
    assert_close(actual, expected, TOLERANCE[torch.float64], "parallel vs sequential")
    assert_close(mobius_scan(A, B, C, D, x0), actual, 0.0, "auto is parallel")


def test_parallel_matches_sequential_on_kdn_maps_float64():
    gen = torch.Generator().manual_seed(1)
    shape = (4, 300)
    g = -3 * torch.rand(shape, generator=gen, dtype=torch.float64)
    q = torch.rand(shape, generator=gen, dtype=torch.float64)
    c = 10 * torch.rand(shape, generator=gen, dtype=torch.float64)
    x0 = torch.tensor([0.0, 0.1, 1.0, 1e6], dtype=torch.float64)
    maps = kdn_maps(g, q, c)
    expected = mobius_scan(*maps, x0, backend="sequential")
    assert_close(mobius_scan(*maps, x0, backend="parallel"), expected, TOLERANCE[torch.float64])


@pytest.mark.parametrize("backend", ["sequential", "parallel"])
@pytest.mark.parametrize("length", [1, 6, 7])
def test_gradients_match_finite_differences(backend, length):
    gen = torch.Generator().manual_seed(2)
    inputs = [x.requires_grad_() for x in random_maps((2, length), gen)]
    x0 = torch.rand(2, generator=gen, dtype=torch.float64).requires_grad_()

    def scan(A, B, C, D, x0):
        return mobius_scan(A, B, C, D, x0, backend=backend)

    assert torch.autograd.gradcheck(scan, (*inputs, x0))


def test_parallel_gradients_match_sequential_gradients_on_long_kdn_maps():
    gen = torch.Generator().manual_seed(3)
    shape = (3, 200)
    raw = [
        -2 * torch.rand(shape, generator=gen, dtype=torch.float64),
        torch.rand(shape, generator=gen, dtype=torch.float64),
        5 * torch.rand(shape, generator=gen, dtype=torch.float64),
    ]
    x0 = torch.rand(3, dtype=torch.float64, generator=gen)
    weights = torch.randn(shape, generator=gen, dtype=torch.float64)
    grads = {}
    for backend in ("sequential", "parallel"):
        leaves = [x.clone().requires_grad_() for x in (*raw, x0)]
        loss = (mobius_scan(*kdn_maps(*leaves[:3]), leaves[3], backend=backend) * weights).sum()
        grads[backend] = torch.autograd.grad(loss, leaves)
    for name, seq, par in zip("gqcx", grads["sequential"], grads["parallel"], strict=True):
        assert_close(par, seq, TOLERANCE[torch.float64], f"d/d{name}")


# Strong decay (exp(2 g) down to exp(-40)), evidence up to 10^4 per step, process noise over
# eight decades: the products' scale spans far beyond float32's range over 10^6 steps.
MILLION = 10**6


@pytest.mark.parametrize(
    "regime",
    ["random decay, noise and evidence", "no decay, no noise, evidence 1e4 each step"],
)
def test_float32_million_steps_stays_finite_and_accurate(regime):
    gen = torch.Generator().manual_seed(4)
    if regime.startswith("random"):
        g = -20 * torch.rand(MILLION, generator=gen, dtype=torch.float64)
        q = 10 ** (-8 * torch.rand(MILLION, generator=gen, dtype=torch.float64))
        c = 10 ** (8 * torch.rand(MILLION, generator=gen, dtype=torch.float64) - 4)
    else:
        g = torch.zeros(MILLION, dtype=torch.float64)
        q = torch.zeros(MILLION, dtype=torch.float64)
        c = torch.full((MILLION,), 1e4, dtype=torch.float64)
    maps = [x.float().unsqueeze(0) for x in kdn_maps(g, q, c)]
    x = mobius_scan(*maps, torch.tensor([1.0]))
    assert x.dtype == torch.float32 and bool(torch.isfinite(x).all())
    expected = torch.from_numpy(sequential_float64_numpy(*(m[0] for m in maps), 1.0))
    assert_close(x[0], expected, TOLERANCE[torch.float32], "10^6 steps vs float64 loop")
    worst = ((x[0].double() - expected).abs() / expected).max().item()
    assert worst < TOLERANCE[torch.float32], f"worst elementwise relative error {worst:.2e}"


def test_huge_and_zero_starting_points_do_not_overflow_float32():
    gen = torch.Generator().manual_seed(5)
    A, B, C, D = (x.float() for x in random_maps((3, 50), gen))
    x0 = torch.tensor([0.0, 1e30, 3e38])
    actual = mobius_scan(A, B, C, D, x0)
    expected = mobius_scan(*(x.double() for x in (A, B, C, D)), x0.double(), backend="sequential")
    assert bool(torch.isfinite(actual).all())
    assert_close(actual, expected, TOLERANCE[torch.float32])


def test_single_step_is_the_map_itself():
    A, B, C, D = (torch.tensor([[v]], dtype=torch.float64) for v in (2.0, 1.0, 0.5, 3.0))
    x0 = torch.tensor([4.0], dtype=torch.float64)
    for backend in ("sequential", "parallel"):
        out = mobius_scan(A, B, C, D, x0, backend=backend)
        assert math.isclose(out.item(), (2 * 4 + 1) / (0.5 * 4 + 3), rel_tol=1e-15)


def valid_arguments() -> dict[str, torch.Tensor]:
    A, B, C, D = random_maps((2, 5), torch.Generator().manual_seed(6))
    return {"A": A, "B": B, "C": C, "D": D, "x0": torch.ones(2, dtype=torch.float64)}


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"A": -torch.ones(2, 5)}, ValueError, "A must be >= 0"),
        ({"C": torch.full((2, 5), -0.1)}, ValueError, "C must be >= 0"),
        ({"x0": -torch.ones(2)}, ValueError, "x0 must be >= 0"),
        ({"B": torch.ones(2, 4)}, ValueError, "B must have shape"),
        ({"D": torch.ones(5)}, ValueError, "D must have shape"),
        ({"x0": torch.ones(5)}, ValueError, "x0 must have shape"),
        ({"B": torch.full((2, 5), 4.0), "C": torch.full((2, 5), 4.0)}, ValueError, r"A \* D"),
        ({"A": torch.ones(2, 5, dtype=torch.int64)}, TypeError, "A must be a floating-point"),
        ({"x0": 1.0}, TypeError, "x0 must be a torch.Tensor"),
        ({"A": torch.ones(()), "x0": torch.ones(())}, ValueError, "A must have rank >= 1"),
        ({k: torch.ones(2, 0) for k in "ABCD"}, ValueError, r"T >= 1"),
    ],
)
def test_bad_inputs_raise_naming_the_argument(change, error, match):
    args = {**valid_arguments(), **change}
    with pytest.raises(error, match=match):
        mobius_scan(**args)


def test_unknown_backend_raises():
    with pytest.raises(ValueError, match="backend must be one of"):
        mobius_scan(**valid_arguments(), backend="fast")


@pytest.mark.skipif(INTERPRET, reason="under TRITON_INTERPRET=1 the Triton scan runs on CPU")
def test_triton_backend_on_cpu_says_it_needs_the_interpreter():
    # tests/test_mobius_triton.py checks the kernel itself (GPU, or TRITON_INTERPRET=1).
    with pytest.raises(RuntimeError, match='backend="triton" cannot run here'):
        mobius_scan(**valid_arguments(), backend="triton")
