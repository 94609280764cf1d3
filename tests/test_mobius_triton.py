"""The Triton Mobius scan and the KDN ops on it, against the step loop in float64.

Runs compiled on a CUDA GPU, or under Triton's interpreter on CPU:

    TRITON_INTERPRET=1 python -m pytest tests/test_mobius_triton.py

(the variable must be set before triton and deltalab are imported, so this is a pytest process
of its own). Skipped otherwise. The interpreter runs a scan's combine step by step in Python
(about a millisecond per tile element), so the shapes here are tiny unless a GPU is present;
the realistic shapes and 10^5-step scans run on the GPU only.
"""

from __future__ import annotations

import pytest
import torch
from test_kdn import kdn_inputs
from test_mobius import kdn_maps, random_maps, sequential_float64_numpy

from deltalab.ops import kdn_diag, kdn_gain_diag, kdn_gain_iso, kdn_iso, mobius_scan
from deltalab.ops._triton import HAS_TRITON, INTERPRET
from deltalab.ops.mobius import resolve_backend, scan_along_time
from deltalab.testing import TOLERANCE, assert_close

CUDA = torch.cuda.is_available() and not INTERPRET
pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(
        not HAS_TRITON or not (INTERPRET or CUDA),
        reason="Triton kernels need a CUDA GPU, or TRITON_INTERPRET=1 set before the import",
    ),
]
DEVICE = "cuda" if CUDA else "cpu"
F64 = torch.float64
gpu_only = pytest.mark.skipif(not CUDA, reason="realistic shapes: too slow for the interpreter")

if HAS_TRITON:
    from deltalab.ops.kdn.triton import kdn_variance_scan
    from deltalab.ops.mobius.triton import launch_config, mobius_scan_lanes


def reference_with_grads(maps, x0, weights, backend="sequential"):
    """x_1..x_T and d(sum(weights * x))/d(A, B, C, D, x0) in float64: by the step loop, or by
    the parallel scan (tested against it in test_mobius.py) where the loop is too slow."""
    device = "cpu" if backend == "sequential" else DEVICE
    leaves = [x.detach().to(device, F64).requires_grad_() for x in (*maps, x0)]
    x = mobius_scan(*leaves, backend=backend)
    grads = torch.autograd.grad((x * weights.to(x)).sum(), leaves)
    return x.detach().cpu(), [g.cpu() for g in grads]


def triton_with_grads(maps, x0, weights, config=None):
    """The Triton scan of `[..., T]` maps; with `config`, by the lane kernel on the `[N, T, R]`
    layout of the KDN ops (T moved to axis 1 of a 3-d view, and back)."""
    leaves = [x.detach().to(DEVICE).requires_grad_() for x in (*maps, x0)]
    if config is None:
        x = mobius_scan(*leaves, backend="triton")
    else:
        moved = [y.reshape(-1, *y.shape[-2:]).movedim(-1, 1) for y in leaves[:4]]
        start = leaves[4].reshape(moved[0].shape[0], -1)
        x = mobius_scan_lanes(*moved, start, config=config).movedim(1, -1).reshape(maps[0].shape)
    grads = torch.autograd.grad((x * weights.to(x)).sum(), leaves)
    return x.detach().cpu(), [g.cpu() for g in grads]


def assert_scan_matches(maps, x0, tol, config=None, what="", reference="sequential"):
    gen = torch.Generator().manual_seed(maps[0].shape[-1])
    weights = torch.randn(maps[0].shape, generator=gen, dtype=F64)
    x_ref, grads_ref = reference_with_grads(maps, x0, weights, reference)
    x, grads = triton_with_grads(maps, x0, weights, config)
    assert x.dtype == maps[0].dtype
    assert_close(x, x_ref, tol, f"{what} iterates")
    for name, g, g_ref in zip(["A", "B", "C", "D", "x0"], grads, grads_ref, strict=True):
        assert_close(g, g_ref, tol, f"{what} d/d{name}")


@pytest.mark.parametrize("length", [1, 7, 100, 257, 1000])
def test_matches_sequential_float64_with_gradients(length, poisoned_empty):
    gen = torch.Generator().manual_seed(length)
    lanes = 2 if length > 300 else 3
    maps = random_maps((lanes, length), gen)
    x0 = 3 * torch.rand(lanes, generator=gen, dtype=F64)
    assert_scan_matches(maps, x0, TOLERANCE[F64])


@pytest.mark.parametrize(
    ("config", "length"),
    [((16, 4), 45), ((16, 2), 16), ((32, 1), 33)],
    ids=["7-lanes-3-tiles", "one-full-tile", "tile-plus-one"],
)
def test_tiles_and_lane_blocks_carry_correctly(config, length, poisoned_empty):
    """Several tiles per lane (the carried x and adjoint), partial tiles and lane blocks with
    masked lanes, on the `[N, T, R]` layout the KDN ops use (lanes strided by R, T on axis 1)."""
    gen = torch.Generator().manual_seed(7 * length)
    maps = random_maps((1, 7, length), gen)  # scanned as [1, T, 7]
    x0 = 3 * torch.rand(1, 7, generator=gen, dtype=F64)
    assert_scan_matches(maps, x0, TOLERANCE[F64], config=config, what=str(config))


def test_extreme_kdn_maps_float32():
    """Evidence up to 1e4, decays down to exp(-40), noise over eight decades, x0 from 0 to 3e38:
    float32 iterates and gradients against float64 on the same float32 coefficients."""
    gen = torch.Generator().manual_seed(11)
    shape = (5, 130)
    g = -20 * torch.rand(shape, generator=gen, dtype=F64)
    g[1] = -1e-4  # slow decay: errors persist longest
    q = 10 ** (-8 * torch.rand(shape, generator=gen, dtype=F64))
    c = 10 ** (8 * torch.rand(shape, generator=gen, dtype=F64) - 4)
    c[2] = 1e4  # strong evidence at every step
    q[2] = 0.0
    maps = [x.float() for x in kdn_maps(g, q, c)]  # scanned as [1, T, 5]: lane blocks of 2
    x0 = torch.tensor([0.0, 1.0, 1e30, 3e38, 0.5])
    assert_scan_matches(maps, x0, TOLERANCE[torch.float32], config=(64, 2))


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_long_scan_stays_finite_and_accurate(dtype):
    """10^5 steps on the GPU (500 under the interpreter): no overflow of the products or of the
    adjoint, and the error does not grow with the number of tiles."""
    steps = 100_000 if CUDA else 500
    gen = torch.Generator().manual_seed(12)
    g = -20 * torch.rand(2, steps, generator=gen, dtype=F64)
    q = 10 ** (-8 * torch.rand(2, steps, generator=gen, dtype=F64))
    c = 10 ** (8 * torch.rand(2, steps, generator=gen, dtype=F64) - 4)
    g[1], q[1], c[1] = 0.0, 0.0, 1e4  # no decay, no noise: the variance falls to 1e-9
    maps = [x.to(dtype) for x in kdn_maps(g, q, c)]
    start = torch.ones(2, dtype=dtype, device=DEVICE)
    x = mobius_scan(*(m.to(DEVICE) for m in maps), start, backend="triton").cpu()
    assert bool(torch.isfinite(x).all())
    for lane in range(2):
        expected = torch.from_numpy(sequential_float64_numpy(*(m[lane] for m in maps), 1.0))
        worst = ((x[lane].double() - expected).abs() / expected).max().item()
        assert worst < TOLERANCE[dtype] * (1 if dtype == F64 else 0.1), f"lane {lane}: {worst}"
    if dtype == torch.float32:
        # Gradients over the whole length, against float64 on the same coefficients.
        reference = "parallel" if CUDA else "sequential"
        assert_scan_matches(maps, torch.ones(2), TOLERANCE[torch.float32], reference=reference)


def test_auto_takes_triton_on_cuda_only():
    assert resolve_backend("auto", torch.device("cuda")) == ("triton" if CUDA else "parallel")
    assert resolve_backend("auto", torch.device("cpu")) == "parallel"
    if INTERPRET:
        with pytest.raises(RuntimeError, match='backend="triton" cannot run here'):
            resolve_backend("triton", torch.device("cuda"))


def test_launch_config_fills_the_gpu():
    assert launch_config(64, 4096) == (1024, 1)  # isotropic, B=4 H=16: parallel over T
    block_t, block_l = launch_config(8192, 4096)  # diagonal, K=128: lanes per program
    assert block_l == 32 and block_t * block_l <= 2048
    assert launch_config(3, 7)[0] == 16


def kdn_variance_loop(a, q, c, p0):
    """p_t and p_bar_t `[N, T, R]` by the recursion as written (gains.py), step by step."""
    p, posterior, predicted = p0, [], []
    for t in range(a.shape[1]):
        p_bar = a[:, t] * p + q[:, t]
        p = p_bar / (c[:, t] * p_bar + 1)
        posterior.append(p)
        predicted.append(p_bar)
    return torch.stack(posterior, dim=1), torch.stack(predicted, dim=1)


def kdn_variance_parallel(a, q, c, p0):
    """The same by the PyTorch parallel scan (as gains.py runs it), for long references."""
    p = scan_along_time(a, q, c * a, c * q + 1, p0, "parallel")
    return p, a * torch.cat([p0.unsqueeze(1), p[:, :-1]], dim=1) + q


def assert_kdn_variance_scan_matches(
    gates, p0, tol, config, reference=kdn_variance_loop, chunk=None
):
    """p, p_bar and d/d(a, q, c, p0) of a loss weighting both, vs `reference` in float64 on
    the same numbers."""
    gen = torch.Generator().manual_seed(gates[0].shape[1])
    weights = [torch.randn(gates[0].shape, generator=gen, dtype=F64) for _ in range(2)]
    results = []
    for device, dtype, scan in (
        ("cpu" if reference is kdn_variance_loop else DEVICE, F64, reference),
        (DEVICE, gates[0].dtype, lambda *x: kdn_variance_scan(*x, config=config, chunk=chunk)),
    ):
        leaves = [x.detach().to(device, dtype).requires_grad_() for x in (*gates, p0)]
        p, p_bar = scan(*leaves)
        loss = sum((y * w.to(y)).sum() for y, w in zip((p, p_bar), weights, strict=True))
        grads = torch.autograd.grad(loss, leaves)
        results.append([x.detach().cpu() for x in (p, p_bar, *grads)])
    labels = ["p", "p_bar", "d/da", "d/dq", "d/dc", "d/dp0"]
    for label, x, ref in zip(labels, results[1], results[0], strict=True):
        assert x.dtype == gates[0].dtype
        assert_close(x, ref, tol, f"{config} {label}")


@pytest.mark.parametrize("config", [(16, 4), (32, 1), (16, 8)])
def test_kdn_variance_scan_tiles_and_lane_blocks(config, poisoned_empty):
    """KDN's fused scan (p and p_bar from a, q, c) over several tiles and masked lane blocks."""
    gen = torch.Generator().manual_seed(config[0] + config[1])
    shape = (2, 45, 3)  # [N, T, R]: 6 lanes, strided by 3

    def uniform(low, high):
        return low + (high - low) * torch.rand(shape, generator=gen, dtype=F64)

    gates = [uniform(0.05, 1.0), uniform(0.0, 0.3), uniform(0.0, 5.0)]
    p0 = 0.5 + torch.rand(2, 3, generator=gen, dtype=F64)
    assert_kdn_variance_scan_matches(gates, p0, TOLERANCE[F64], config)


@pytest.mark.parametrize("chunk", [16, 32])
def test_kdn_variance_scan_split_over_t_matches_float64(chunk, poisoned_empty):
    """The scan split into chunks of T (each chunk's map and adjoint, the carry passes, every
    chunk walked from its carry), float32 with strong decays, resets and large evidence,
    against the float64 loop: 45 steps in 3 or 2 chunks, 6 lanes, 4 per program."""
    gen = torch.Generator().manual_seed(chunk)
    shape = (2, 45, 3)
    g = -8 * torch.rand(shape, generator=gen, dtype=F64)
    g[0, 20, 1] = -torch.inf  # a reset at a chunk's interior
    q = 0.3 * torch.rand(shape, generator=gen, dtype=F64)
    c = 10 ** (4 * torch.rand(shape, generator=gen, dtype=F64) - 2)
    gates = [x.float() for x in ((2 * g).exp(), q, c)]
    p0 = (0.5 + torch.rand(2, 3, generator=gen, dtype=F64)).float()
    assert_kdn_variance_scan_matches(gates, p0, TOLERANCE[torch.float32], (16, 4), chunk=chunk)


def test_kdn_variance_scan_extreme_float32():
    """Decays down to exp(-40) and 1 - 2e-4, evidence up to 1e4 (also at every step, with no
    noise), noise over eight decades, priors from 1e-6 to 1e6: float32 against float64."""
    gen = torch.Generator().manual_seed(21)
    shape = (1, 130, 5)
    g = -20 * torch.rand(shape, generator=gen, dtype=F64)
    g[..., 1] = -1e-4
    q = 10 ** (-8 * torch.rand(shape, generator=gen, dtype=F64))
    c = 10 ** (8 * torch.rand(shape, generator=gen, dtype=F64) - 4)
    c[..., 2], q[..., 2], g[..., 2] = 1e4, 0.0, 0.0
    gates = [x.float() for x in ((2 * g).exp(), q, c)]
    p0 = torch.tensor([[1e-6, 1.0, 1.0, 1e6, 0.5]])
    assert_kdn_variance_scan_matches(gates, p0, TOLERANCE[torch.float32], (64, 2))


GAINS = {"iso": kdn_gain_iso, "diag": kdn_gain_diag}
MIXERS = {"iso": kdn_iso, "diag": kdn_diag}


@pytest.mark.parametrize("variant", ["iso", "diag"])
@pytest.mark.parametrize("channel_decay", [True, False], ids=["channel_decay", "head_decay"])
def test_kdn_gains_with_triton_scan_match_step_loop(variant, channel_decay):
    gen = torch.Generator().manual_seed(13)
    args = kdn_inputs(gen, (2, 19, 2, 4, 1), variant=variant, channel_decay=channel_decay)
    names = ("k", "g", "q_noise", "r", "p0")
    shape = (2, 19, 2, 4) if variant == "diag" else (2, 19, 2)
    weights = [torch.randn(shape, generator=gen, dtype=F64) for _ in range(2)]
    results = {}
    for backend, device in (("sequential", "cpu"), ("triton", DEVICE)):
        leaves = [args[n].detach().to(device).requires_grad_() for n in names]
        gain, p, final = GAINS[variant](*leaves, backend=backend)
        loss = (gain * weights[0].to(device)).sum() + (p * weights[1].to(device)).sum()
        grads = torch.autograd.grad(loss + final.sum(), leaves)
        results[backend] = [x.detach().cpu() for x in (gain, p, final, *grads)]
    labels = ["gain", "p", "final precision", *(f"d/d{n}" for n in names)]
    for label, x, ref in zip(labels, results["triton"], results["sequential"], strict=True):
        assert_close(x, ref, TOLERANCE[F64], label)


@pytest.mark.parametrize("variant", ["iso", "diag"])
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
def test_kdn_with_triton_backend_matches_naive(variant, packed):
    gen = torch.Generator().manual_seed(14)
    args = kdn_inputs(gen, (1 if packed else 2, 21, 2, 4, 3), variant=variant)
    kwargs = {"output_final_state": True, "chunk_size": 16}
    if packed:
        kwargs["cu_seqlens"] = torch.tensor([0, 5, 21])
        args["p0"] = args["p0"].expand(2, *args["p0"].shape).clone()
    leaves = {n: x.detach().requires_grad_() for n, x in args.items()}
    o_ref, (S_ref, prec_ref) = MIXERS[variant](**leaves, backend="naive", **kwargs)
    loss_ref = o_ref.square().sum() + S_ref.sum() + prec_ref.sum()
    grads_ref = torch.autograd.grad(loss_ref, list(leaves.values()))

    # The Triton delta rule computes in float32: compare its float32 run with the float64 loop.
    moved = {n: x.detach().to(DEVICE, torch.float32).requires_grad_() for n, x in args.items()}
    cu = kwargs.get("cu_seqlens")
    kwargs = {**kwargs, "cu_seqlens": None if cu is None else cu.to(DEVICE)}
    o, (S, prec) = MIXERS[variant](**moved, backend="triton", **kwargs)
    grads = torch.autograd.grad(o.square().sum() + S.sum() + prec.sum(), list(moved.values()))
    for label, x, ref in (("o", o, o_ref), ("memory", S, S_ref), ("precision", prec, prec_ref)):
        assert_close(x.cpu(), ref, TOLERANCE[torch.float32], label)
    for name, g, g_ref in zip(leaves, grads, grads_ref, strict=True):
        assert_close(g.cpu(), g_ref, TOLERANCE[torch.float32], f"d/d{name}")


def test_kdn_diag_per_head_prior_on_triton():
    gen = torch.Generator().manual_seed(15)
    args = kdn_inputs(gen, (2, 9, 2, 4, 3), variant="diag")
    per_head = torch.tensor([0.3, 2.0], dtype=F64)
    o_ref, _ = kdn_diag(**{**args, "p0": per_head.unsqueeze(-1).expand(2, 4)}, backend="naive")
    moved = {n: x.to(DEVICE, torch.float32) for n, x in args.items()}
    p0 = per_head.to(DEVICE, torch.float32)
    o, _ = kdn_diag(**{**moved, "p0": p0}, backend="triton", chunk_size=16)
    assert_close(o.cpu(), o_ref, TOLERANCE[torch.float32])


# --- GPU only: realistic shapes, float32 and bfloat16 inputs against float64 ----------------


def kdn_gates(batch, length, heads, dim, dtype, generator):
    """Unit keys, channel decays in [-1, 0], q_noise in [0, 0.1], r in [0.01, 1.01] (the
    benchmark's distribution), drawn on the CPU in float64 and cast."""
    shape = (batch, length, heads, dim)
    k = torch.nn.functional.normalize(torch.randn(shape, generator=generator, dtype=F64), dim=-1)
    gates = {
        "q": torch.randn(shape, generator=generator, dtype=F64),
        "k": k,
        "v": torch.randn(shape, generator=generator, dtype=F64),
        "g": -torch.rand(shape, generator=generator, dtype=F64),
        "q_noise": 0.1 * torch.rand(shape, generator=generator, dtype=F64),
        "r": 0.01 + torch.rand(shape[:3], generator=generator, dtype=F64),
    }
    # Round to the input dtype first, so the reference sees the same numbers.
    return {n: x.to(dtype).to(F64) for n, x in gates.items()}


@gpu_only
@pytest.mark.parametrize("variant", ["iso", "diag"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("batch", "length"), [(4, 4096), (1, 32768)])
def test_gpu_realistic_gains_match_float64(variant, dtype, batch, length):
    gen = torch.Generator().manual_seed(16)
    heads, dim = 16, 128
    gates = kdn_gates(batch, length, heads, dim, dtype, gen)
    if variant == "iso":
        # Rounded to the dtype again: a mean of rounded numbers is not one, and the kernels
        # would see q_noise 2^-9 away from the reference's in bf16 (a 5.5e-4 error in the gain).
        gates["q_noise"] = gates["q_noise"].mean(-1).to(dtype).to(F64)
    inputs = [gates[n] for n in ("k", "g", "q_noise", "r")]
    p0 = torch.ones(heads, dtype=F64)
    weights = torch.randn((batch, length, heads), generator=gen, dtype=F64).cuda()
    results = {}
    for backend, cast in (("parallel", F64), ("triton", dtype)):
        leaves = [x.cuda().to(cast).requires_grad_() for x in (*inputs, p0)]
        gain, p, _ = GAINS[variant](*leaves, backend=backend)
        per_head = gain if variant == "iso" else gain.sum(-1)
        grads = torch.autograd.grad((per_head * weights.to(gain)).sum() + p.sum(), leaves)
        results[backend] = [x.double().cpu() for x in (gain, p, *grads)]
    labels = ["gain", "p", "dk", "dg", "dq_noise", "dr", "dp0"]
    for label, x, ref in zip(labels, results["triton"], results["parallel"], strict=True):
        # Gains are float32 for either input dtype; gradients come back in the leaves' dtype.
        tol = TOLERANCE[torch.float32 if label in ("gain", "p") else dtype]
        assert_close(x, ref, tol, f"{variant} {dtype} {label}")


@gpu_only
@pytest.mark.parametrize("variant", ["iso", "diag"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_kdn_mixers_match_float64(variant, dtype):
    gen = torch.Generator().manual_seed(17)
    heads, dim = 4, 64
    gates = kdn_gates(2, 1024, heads, dim, dtype, gen)
    if variant == "iso":
        gates["q_noise"] = gates["q_noise"].mean(-1).to(dtype).to(F64)  # rounded, as above
    p0 = torch.ones(heads, dtype=F64)
    o_ref, (S_ref, _) = MIXERS[variant](
        **{n: x.cuda() for n, x in gates.items()},
        p0=p0.cuda(),
        backend="chunk",
        output_final_state=True,
    )
    o, (S, _) = MIXERS[variant](
        **{n: x.cuda().to(dtype) for n, x in gates.items()},
        p0=p0.cuda().to(dtype),
        backend="triton",
        output_final_state=True,
    )
    assert o.dtype == dtype
    assert_close(o.double().cpu(), o_ref.cpu(), TOLERANCE[dtype], f"{variant} o")
    assert_close(S.double().cpu(), S_ref.cpu(), TOLERANCE[dtype], f"{variant} memory")


@gpu_only
def test_gpu_many_lanes_long_scan_with_gradients():
    """256 lanes of 10^5 steps of extreme maps, float32 (default launch configuration, the
    `[..., T]` layout), against the float64 parallel scan."""
    gen = torch.Generator().manual_seed(18)
    shape = (256, 100_000)
    g = -20 * torch.rand(shape, generator=gen, dtype=F64)
    q = 10 ** (-8 * torch.rand(shape, generator=gen, dtype=F64))
    c = 10 ** (8 * torch.rand(shape, generator=gen, dtype=F64) - 4)
    maps = [x.float() for x in kdn_maps(g, q, c)]
    x0 = torch.rand(shape[0], generator=gen, dtype=F64).float()
    assert_scan_matches(maps, x0, TOLERANCE[torch.float32], reference="parallel")


@gpu_only
@pytest.mark.parametrize("lanes", [16, 256])
def test_gpu_kdn_variance_scan_long_float32(lanes):
    """KDN's fused scan over 10^5 steps (Isotropic-like and Diagonal-like lane counts, default
    launch configuration), extreme gates, float32 against the float64 parallel scan."""
    gen = torch.Generator().manual_seed(lanes)
    shape = (1, 100_000, lanes)
    g = -20 * torch.rand(shape, generator=gen, dtype=F64) ** 4  # mostly mild, some strong
    q = 10 ** (-8 * torch.rand(shape, generator=gen, dtype=F64))
    c = 10 ** (8 * torch.rand(shape, generator=gen, dtype=F64) - 4)
    gates = [x.float() for x in ((2 * g).exp(), q, c)]
    p0 = torch.rand(1, lanes, generator=gen, dtype=F64).float() + 0.1
    assert_kdn_variance_scan_matches(
        gates, p0, TOLERANCE[torch.float32], None, reference=kdn_variance_parallel
    )
