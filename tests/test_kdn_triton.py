"""Diagonal KDN's fused gain (deltalab/ops/kdn/triton_diag_gain.py) against the float64 definition (the
step loop of the variance scan) and the PyTorch path (the terms, the parallel scan and the gain as
separate ops), and where the layers and the gain functions take it.

The kernels run on a CUDA GPU, or on CPU tensors under Triton's interpreter:

    TRITON_INTERPRET=1 python -m pytest tests/test_kdn_triton.py

(README's test command runs this file a second time with it set); skipped otherwise, except the
checks of where the fused path is taken. Shapes are tiny: the interpreter runs every operation
of a kernel in Python.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from test_kdn import kdn_inputs
from torch.utils._python_dispatch import TorchDispatchMode

from deltalab.analysis import gate_sensitivity
from deltalab.layers import DiagonalKDN, IsotropicKDN
from deltalab.models import CausalLM, build_config
from deltalab.ops import kdn_gain_diag, kdn_gain_iso
from deltalab.ops._triton import HAS_TRITON, INTERPRET, triton_unavailable_reason
from deltalab.ops.kdn import gains
from deltalab.ops.kdn.gains import diag_gain
from deltalab.testing import TOLERANCE, assert_close, relative_error

pytestmark = pytest.mark.interpreter

CUDA = torch.cuda.is_available() and not INTERPRET
DEVICE = "cuda" if CUDA else "cpu"
NO_TRITON = triton_unavailable_reason(torch.device(DEVICE))
needs_triton = pytest.mark.skipif(NO_TRITON is not None, reason=str(NO_TRITON))
F32, F64 = torch.float32, torch.float64
NAMES = ("k", "g", "q_noise", "r", "p_prior")
OUTPUTS = ("gain", "p", "predictive")
# k and g as the gain hands them on to the delta rule (`Gains.k`, `Gains.g`): routed through the
# kernels' node, whose backward adds their gradients to its own; the inputs on the PyTorch path.
ROUTED = ("routed k", "routed g")
LABELS = (*OUTPUTS, *(f"d/d{n}" for n in NAMES))


def spy_fused(monkeypatch) -> list[tuple[int, ...]]:
    """k's shape at every call of the fused gain (gains.diag_gain imports it at each call)."""
    calls: list[tuple[int, ...]] = []
    if not HAS_TRITON:
        return calls
    from deltalab.ops.kdn import triton_diag_gain

    original = triton_diag_gain.kdn_diag_gain

    def spy(k, *args, **kwargs):
        calls.append(tuple(k.shape))
        return original(k, *args, **kwargs)

    monkeypatch.setattr(triton_diag_gain, "kdn_diag_gain", spy)
    return calls


def gain_inputs(seed, shape, *, channel_decay=True, extremes=True):
    """k, g, q_noise, r, p_prior (float64) for diag_gain; with `extremes`, resets (g = -inf,
    one token of every channel, one of a single channel), r = 1e30 (no evidence) and r = 1e-6."""
    batch, length, heads, key_dim = shape
    gen = torch.Generator().manual_seed(seed)
    args = kdn_inputs(gen, (*shape, 1), variant="diag", channel_decay=channel_decay)
    p_prior = 0.5 + torch.rand(batch, heads, key_dim, generator=gen, dtype=F64)
    k, g, q_noise, r = (args[n].clone() for n in ("k", "g", "q_noise", "r"))
    if extremes:
        g[0, 2] = -torch.inf
        if channel_decay:
            g[-1, length - 3, -1, key_dim // 2] = -torch.inf
        r[0, 4, 0] = 1e30
        r[-1, 1, -1] = 1e-6
        q_noise[0, 2, 0] = 0.0  # a reset to a zero variance: p_bar = 0 there
    return [k, g, q_noise, r, p_prior]


def run(fn, inputs, dtype, weights, info_scale):
    """Outputs and the gradients of sum(weights * outputs) (an output without a weight is
    unused, so its gradient reaches the kernel as None). The outputs after the first three are
    k and g handed on to the delta rule (`ROUTED`; None: the inputs themselves)."""
    leaves = [x.to(DEVICE, dtype).requires_grad_() for x in inputs]
    outputs = list(fn(*leaves, info_scale))
    outputs[3:] = [leaf if o is None else o for o, leaf in zip(outputs[3:], leaves, strict=False)]
    loss = sum((o * w.to(o)).sum() for o, w in zip(outputs, weights, strict=True) if w is not None)
    grads = torch.autograd.grad(loss, leaves)
    # The routed k and g are the inputs' values (g holds -inf): only their gradients compare.
    return [x.detach().cpu().double() for x in (*outputs[:3], *grads)]


def assert_matches_definition_and_pytorch(inputs, weights, block_t, chunk=None, **tuning):
    """The fused gain, with T split into chunks of `chunk` tokens (None: the default plan, one
    chunk at these T but for K = 256's 70 tokens), against the float64 definition and the PyTorch
    path; the split also against one program per (sequence, head), a chunk covering T. `tuning`:
    kdn_diag_gain's other launch overrides (carry_block)."""
    from deltalab.ops.kdn.triton_diag_gain import SPLIT_GAIN_MIN_CHUNK, kdn_diag_gain

    info_scale = float(inputs[0].shape[-1])
    length = inputs[0].shape[1]
    fused = run(
        lambda *x: kdn_diag_gain(*x, block_t=block_t, chunk=chunk, **tuning),
        inputs, F32, weights, info_scale,
    )  # fmt: skip
    definition = run(lambda *x: diag_gain(*x, "sequential"), inputs, F64, weights, info_scale)
    pytorch = run(lambda *x: diag_gain(*x, "parallel"), inputs, F32, weights, info_scale)
    labels = LABELS
    if (chunk or SPLIT_GAIN_MIN_CHUNK) < length:
        covering = max(2, 1 << (length - 1).bit_length())
        whole = run(
            lambda *x: kdn_diag_gain(*x, block_t=block_t, chunk=covering), inputs, F32, weights,
            info_scale,
        )  # fmt: skip
        for label, x, x1 in zip(labels, fused, whole, strict=True):
            assert_close(x, x1, TOLERANCE[F32], f"{label} against the one-program kernel")
    for label, x, x64, x32 in zip(labels, fused, definition, pytorch, strict=True):
        assert_close(x, x64, TOLERANCE[F32], f"{label} against float64")
        # Up to the PyTorch path's own float32 error: at r = 1e-6 its dr is off by ~4e-4 on the
        # CPU and ~2e-2 on an H200 (the fused kernel's by ~1e-7), elsewhere both are within a
        # few 1e-7 of float64. The triangle inequality in ||x64|| units, then rescaled to
        # ||x32||, the norm relative_error(x, x32) divides by.
        scale = x64.norm().item() / max(x32.norm().item(), 1e-300)
        tol = (TOLERANCE[F32] + relative_error(x32, x64)) * scale
        assert_close(x, x32, tol, f"{label} against the PyTorch path")


def weights_for(inputs, seed, used=OUTPUTS + ROUTED):
    gen = torch.Generator().manual_seed(seed)
    k, g = inputs[:2]
    shapes = {"gain": k.shape, "p": k.shape, "predictive": k.shape[:-1]}
    shapes |= {"routed k": k.shape, "routed g": g.shape}
    return [
        torch.randn(shapes[o], generator=gen, dtype=F64) if o in used else None
        for o in OUTPUTS + ROUTED
    ]


@needs_triton
@pytest.mark.parametrize("channel_decay", [True, False], ids=["channel_decay", "head_decay"])
@pytest.mark.parametrize(
    ("shape", "block_t"),
    [((2, 13, 2, 5), 4), ((1, 7, 3, 8), 2), ((2, 11, 1, 3), None)],
    ids=["odd_K-3_tiles_and_a_part", "K_power_of_2-tiles_of_2", "default_tile"],
)
def test_fused_gain_and_all_gradients_match_float64_definition_and_pytorch_path(
    shape, block_t, channel_decay
):
    inputs = gain_inputs(1, shape, channel_decay=channel_decay)
    weights = weights_for(inputs, 2)
    assert_matches_definition_and_pytorch(inputs, weights, block_t)


@needs_triton
@pytest.mark.parametrize("channel_decay", [True, False], ids=["channel_decay", "head_decay"])
@pytest.mark.parametrize(
    ("shape", "block_t", "chunk"),
    [
        ((2, 13, 2, 5), 4, 4),
        ((1, 13, 3, 8), 2, 8),
        ((2, 11, 1, 3), None, 4),
        ((1, 70, 1, 256), None, None),
    ],
    ids=[
        "4_chunks_of_a_tile_and_a_part",
        "2_chunks_of_4_tiles_and_a_part",
        "default_tile",
        "default_chunks_at_k256",  # 2 chunks of 64; the token backward unrolls 1 token
    ],
)
def test_split_gain_and_all_gradients_match_float64_definition_pytorch_and_one_program_kernel(
    shape, block_t, chunk, channel_decay
):
    """T split into chunks (a program each, with the carry passes between them), the last one
    partial: the outputs and the gradients of k, g, q_noise, r and p_prior, against the float64
    definition, the PyTorch path and the one-program kernel."""
    inputs = gain_inputs(1, shape, channel_decay=channel_decay)
    weights = weights_for(inputs, 2)
    assert_matches_definition_and_pytorch(inputs, weights, block_t, chunk)


@needs_triton
@pytest.mark.parametrize("channel_decay", [True, False], ids=["channel_decay", "head_decay"])
def test_split_gain_carries_cross_blocks_of_chunks_and_channels(channel_decay):
    """The carry passes scan the chunks' maps BLOCK_P chunks and BLOCK_C channels at a time:
    with blocks of 2 x 2, T = 19 in 10 chunks of 2 (5 blocks, the last chunk partial) and K = 5
    (3 blocks of channels, the last partial) cross every boundary, forward and backward."""
    from deltalab.ops.kdn.triton_carry import carry_block

    assert carry_block(10, (2, 2)) == (2, 2)
    inputs = gain_inputs(17, (2, 19, 1, 5), channel_decay=channel_decay)
    weights = weights_for(inputs, 18)
    assert_matches_definition_and_pytorch(inputs, weights, 2, 2, carry_block=(2, 2))


@needs_triton
@pytest.mark.parametrize("chunk", [None, 4], ids=["one_program", "split_chunks_of_4"])
def test_fused_gain_writes_every_output_and_gradient_element(poisoned_empty, chunk):
    """torch.empty is NaN-filled: the kernels write every element of the outputs, the
    gradients and (split) the chunk maps and carries they read back."""
    inputs = gain_inputs(13, (2, 10, 2, 3))
    weights = weights_for(inputs, 14)
    assert_matches_definition_and_pytorch(inputs, weights, 2, chunk)


@needs_triton
def test_split_chunks_are_powers_of_2_filling_about_split_gain_programs():
    """At the benchmark's shapes (given tiles of 16 tokens at K = 128): 64 tokens for the 340M
    preset (B H = 32, T = 4096: 2048 programs) and at B H = 16, T = 32768 (8192 programs), 128
    for 8192 programs at B H = 16, T = 65536; never below SPLIT_GAIN_MIN_CHUNK or a tile."""
    from deltalab.ops.kdn.triton_diag_gain import SPLIT_GAIN_MIN_CHUNK, chunk_tokens, launch

    assert launch(128, 4096, "forward")[0] <= 16 and launch(128, 4096, "backward")[0] <= 16
    assert chunk_tokens(32, 4096, 16) == 64
    assert chunk_tokens(16, 32768, 16) == 64
    assert chunk_tokens(16, 65536, 16) == 128
    assert chunk_tokens(1, 100, 16) == SPLIT_GAIN_MIN_CHUNK
    assert chunk_tokens(1, 100, 128) == 128


@needs_triton
@pytest.mark.parametrize("key_dim", [3, 64, 128, 256])
def test_gain_plans_tile_every_chunk_and_cover_t(key_dim):
    """Each direction's launch plan, its two kernels' tokens possibly different (the backward
    unrolls 2 tokens where the chunk adjoints unroll 4; 1 and 2 at K = 256): the tokens of the
    kernels launched are powers of 2 that divide the chunk, the chunks cover T and the last one
    holds a token, split or not, at short, odd and long T, with given tokens and chunk or the
    defaults."""
    from deltalab.ops.kdn import triton_diag_gain

    directions = (("forward", "chunk_maps"), ("backward", "chunk_adjoints"))
    for kernels in directions:
        for length in (1, 2, 5, 37, 64, 100, 4096, 32768):
            for bh, block_t, chunk in itertools.product((1, 16, 4096), (None, 2), (None, 2, 64)):
                tiles, _, _, chunk_t, parts = triton_diag_gain._plan(
                    bh, length, key_dim, kernels, block_t, chunk
                )
                case = (kernels, length, bh, block_t, chunk, tiles, chunk_t, parts)
                # The chunks' maps run only when T is split (parts > 1).
                launched = tiles if parts > 1 else tiles[:1]
                assert all(t >= 1 and t & (t - 1) == 0 and chunk_t % t == 0 for t in launched), case
                assert chunk_t * parts >= length > chunk_t * (parts - 1), case
                if parts > 1:
                    assert chunk_t & (chunk_t - 1) == 0, case
    assert triton_diag_gain.launch(256, 4096, "backward")[0] == 1


SPLITS = pytest.mark.parametrize("chunk", [None, 4], ids=["one_program", "split_chunks_of_4"])


@needs_triton
@SPLITS
@pytest.mark.parametrize(
    "used",
    [("gain",), ("p", "predictive"), ("gain", "routed g")],
    ids=["gain_only", "no_gain", "gain_and_routed_g"],
)
def test_fused_gain_gradients_are_right_when_outputs_go_unused(used, chunk):
    """An unused output's gradient comes to the backward as None (p in the mixers, which read
    only its last step, also dgain; k and g routed to no delta rule): the kernels (the split's
    chunk adjoints too) take it as zero."""
    inputs = gain_inputs(3, (2, 9, 2, 6))
    weights = weights_for(inputs, 4, used)
    assert_matches_definition_and_pytorch(inputs, weights, 2 if chunk else 4, chunk)


@needs_triton
@pytest.mark.parametrize("chunk", [None, 8], ids=["one_program", "split_chunks_of_8"])
def test_fused_gain_stays_finite_at_extreme_noise_and_resets(chunk):
    """r from 1e-6 to 1e30 (no evidence), q_noise from 0 to 10, decays down to g = -inf (a
    reset), long enough (40 tokens, tiles of 4) for the carry to cross many tiles (and, split,
    five chunks of two tiles: resets and r = 1e30 inside the composed chunk maps)."""
    gen = torch.Generator().manual_seed(5)
    inputs = gain_inputs(5, (1, 40, 2, 7))
    inputs[3] = 10 ** (36 * torch.rand(1, 40, 2, generator=gen, dtype=F64) - 6)
    inputs[2] = 10 * torch.rand(1, 40, 2, 7, generator=gen, dtype=F64) ** 4
    inputs[1] = torch.where(torch.rand(1, 40, 2, 7, generator=gen) < 0.1, -torch.inf, inputs[1])
    weights = weights_for(inputs, 6)
    assert_matches_definition_and_pytorch(inputs, weights, 4, chunk)


def streamed_gain(chunk):
    """(gain, p, final precision) of Diagonal KDN's gain on the fused path from k, g, q_noise, r,
    p0 `[H, K]` and a carried precision (or None): kdn_gain_diag's, or (`chunk`) the kernel's own
    with T split into chunks of `chunk` tokens (two of a token each)."""
    if chunk is None:
        return lambda *x, p0, precision: kdn_gain_diag(
            *x, p0, initial_precision=precision, backend="triton"
        )
    from deltalab.ops.kdn.triton_diag_gain import kdn_diag_gain

    def gain(k, g, q_noise, r, *, p0, precision):
        prior = p0.expand(k.shape[0], *p0.shape) if precision is None else 1.0 / precision
        gain, p, *_ = kdn_diag_gain(k, g, q_noise, r, prior, k.shape[-1], chunk=chunk, block_t=2)
        return gain, p, 1.0 / p[:, -1]

    return gain


@needs_triton
@pytest.mark.parametrize("chunk", [None, 4], ids=["kdn_gain_diag", "split_chunks_of_4"])
def test_kdn_gain_diag_streams_its_final_precision_through_the_fused_path(monkeypatch, chunk):
    """Two calls carrying the final precision (initial_precision) give the gains, p and the
    final precision of one call, and the gradients of both pieces, on the fused path (split:
    12 = 3 chunks, 5 = 2 chunks with a partial one, 7 = 2)."""
    calls = spy_fused(monkeypatch)
    fn = streamed_gain(chunk)
    inputs = gain_inputs(7, (2, 12, 2, 5))
    k, g, q_noise, r, _ = (x.to(DEVICE, F32) for x in inputs)
    p0 = torch.rand(2, 5, generator=torch.Generator().manual_seed(8), dtype=F64) + 0.5
    p0 = p0.to(DEVICE, F32)
    leaves = [x.clone().requires_grad_() for x in (k, g, q_noise, r)]
    gain, p, final = fn(*leaves, p0=p0, precision=None)
    whole = [gain, p, final, *torch.autograd.grad(gain.sum() + p.sum() + final.sum(), leaves)]
    leaves = [x.clone().requires_grad_() for x in (k, g, q_noise, r)]
    first, second = ([x[:, :5] for x in leaves], [x[:, 5:] for x in leaves])
    gain_1, p_1, precision = fn(*first, p0=p0, precision=None)
    gain_2, p_2, final = fn(*second, p0=p0, precision=precision)
    gain, p = torch.cat([gain_1, gain_2], 1), torch.cat([p_1, p_2], 1)
    pieces = [gain, p, final, *torch.autograd.grad(gain.sum() + p.sum() + final.sum(), leaves)]
    labels = ["gain", "p", "final precision", *(f"d/d{n}" for n in NAMES[:4])]
    for label, x, ref in zip(labels, pieces, whole, strict=True):
        assert_close(x, ref, TOLERANCE[F32], label)
    assert calls == [(2, 12, 2, 5), (2, 5, 2, 5), (2, 7, 2, 5)]


@pytest.mark.parametrize(
    ("backend", "dtype", "fused"),
    [
        pytest.param("triton", F32, True, marks=needs_triton),
        pytest.param("triton", F64, False, marks=needs_triton),
        ("auto", F32, CUDA),
        ("parallel", F32, False),
        ("sequential", F32, False),
    ],
)
def test_kdn_gain_diag_takes_the_fused_gain_exactly_on_the_triton_scan_in_float32(
    monkeypatch, backend, dtype, fused
):
    """Where the variance scan ran on Triton: "triton", and "auto" on CUDA; float64 keeps the
    PyTorch ops around the (float64) Triton scan."""
    calls = spy_fused(monkeypatch)
    k, g, q_noise, r, _ = (
        x.to(DEVICE, dtype) for x in gain_inputs(9, (1, 3, 2, 4), extremes=False)
    )
    kdn_gain_diag(k, g, q_noise, r, torch.ones(2, device=DEVICE, dtype=dtype), backend=backend)
    assert calls == ([(1, 3, 2, 4)] if fused else [])


LAYER = dict(hidden_size=32, num_heads=2, head_dim=16, value_dim=8, conv_size=4, chunk_size=16)


@needs_triton
def test_diagonal_kdn_layer_on_triton_matches_chunk_with_parameter_gradients(monkeypatch):
    """The same parameters on both backends: outputs and every parameter's gradient to 1e-5,
    the Triton layer's gains on the fused kernels (20 tokens, two tiles of 16)."""
    calls = spy_fused(monkeypatch)
    layers = {}
    for backend in ("chunk", "triton"):
        torch.manual_seed(0)
        layers[backend] = DiagonalKDN(**LAYER, backend=backend).to(DEVICE)
    layers["triton"].load_state_dict(layers["chunk"].state_dict(), strict=True)
    x = torch.randn(2, 20, LAYER["hidden_size"], device=DEVICE)
    dy = torch.randn(2, 20, LAYER["hidden_size"], device=DEVICE)
    results = {}
    for backend, layer in layers.items():
        y, _ = layer(x)
        (y * dy).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in layer.parameters()])
        results[backend] = (y.detach(), grads)
    assert calls == [(2, 20, 2, 16)]
    assert_close(results["triton"][0], results["chunk"][0], 1e-5, "y")
    assert_close(results["triton"][1], results["chunk"][1], 1e-5, "parameter gradients")


@needs_triton
@pytest.mark.parametrize("mixer", ["kdn_diag", "kdn_iso"])
def test_gate_sensitivity_on_a_triton_kdn_model_never_reaches_the_fused_kernels(monkeypatch, mixer):
    """Forward-mode AD cannot go through the fused gain or terms (their Functions define no
    jvp): gate sensitivity runs the layers on the chunk path, and its numbers agree with a chunk
    model's."""
    torch.manual_seed(0)
    sizes = dict(num_layers=1, hidden_size=32, head_dim=16, chunk_size=16)
    models = {
        backend: CausalLM(build_config("tiny", mixer=mixer, backend=backend, **sizes)).eval()
        for backend in ("triton", "chunk")
    }
    models["chunk"].load_state_dict(models["triton"].state_dict(), strict=True)
    batch = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(10))
    calls = (spy_fused if mixer == "kdn_diag" else spy_iso_gain)(monkeypatch)
    reports = {}
    for backend, model in models.items():
        with torch.no_grad():
            reports[backend] = gate_sensitivity(
                model.to(DEVICE), batch.to(DEVICE), probes=1,
                loss_fn=lambda m, b: m(input_ids=b, labels=b).loss,
            )  # fmt: skip
    assert calls == []
    for layer, gates in reports["chunk"].state.items():
        assert reports["triton"].state[layer] == pytest.approx(gates, rel=1e-4)
        assert reports["triton"].loss[layer] == pytest.approx(
            reports["chunk"].loss[layer], rel=1e-4
        )
    # The layers keep their backend, and take the fused kernels again afterwards.
    with torch.no_grad():
        models["triton"](input_ids=batch.to(DEVICE))
    assert len(calls) == 1


# --- Isotropic KDN: the terms' reductions over K on the kernels of triton_iso_terms.py ----------


def spy_iso_gain(monkeypatch) -> list[tuple[int, ...]]:
    """k's shape at every call of the isotropic gain's kernels (terms, then scan)."""
    calls: list[tuple[int, ...]] = []
    if not HAS_TRITON:
        return calls
    from deltalab.ops.kdn import triton_iso_terms

    original = triton_iso_terms.kdn_iso_gain

    def spy(k, *args):
        calls.append(tuple(k.shape))
        return original(k, *args)

    monkeypatch.setattr(triton_iso_terms, "kdn_iso_gain", spy)
    return calls


def iso_inputs(seed, shape, channel_decay):
    """k, g, q_noise, r, p0 (float64) for kdn_gain_iso, with a reset (g = -inf) on one token
    and in one channel, r = 1e30 and r = 1e-6."""
    batch, length, heads, key_dim = shape
    gen = torch.Generator().manual_seed(seed)
    args = kdn_inputs(gen, (*shape, 1), variant="iso", channel_decay=channel_decay)
    k, g, q_noise, r = (args[n].clone() for n in ("k", "g", "q_noise", "r"))
    g[0, 1] = -torch.inf
    if channel_decay:
        g[-1, length - 2, -1, key_dim - 1] = -torch.inf
    r[0, 2, 0], r[-1, 3, -1] = 1e30, 1e-6
    p0 = 0.5 + torch.rand(batch, heads, generator=gen, dtype=F64)
    return [k, g, q_noise, r, p0]


@needs_triton
@pytest.mark.parametrize("channel_decay", [True, False], ids=["channel_decay", "head_decay"])
@pytest.mark.parametrize("shape", [(2, 9, 2, 5), (1, 6, 3, 16)], ids=["odd_K", "K_16"])
def test_iso_gain_on_its_kernels_matches_float64_definition_and_pytorch_path(
    monkeypatch, shape, channel_decay
):
    """beta, p, predictive, the final precision and the gradients of k, g, q_noise, r, p0."""
    calls = spy_iso_gain(monkeypatch)
    inputs = iso_inputs(11, shape, channel_decay)
    gen = torch.Generator().manual_seed(12)
    weights = [torch.randn(shape[:3], generator=gen, dtype=F64) for _ in range(3)]
    results = {}
    for name, backend, dtype in (
        ("fused", "triton", F32),
        ("definition", "sequential", F64),
        ("pytorch", "parallel", F32),
    ):
        leaves = [x.to(DEVICE, dtype).requires_grad_() for x in inputs]
        beta, p, final, predictive = kdn_gain_iso(*leaves, backend=backend, output_predictive=True)
        outputs = (beta, p, predictive)
        loss = sum((o * w.to(o)).sum() for o, w in zip(outputs, weights, strict=True))
        grads = torch.autograd.grad(loss + final.sum(), leaves)
        results[name] = [x.detach().cpu().double() for x in (*outputs, final, *grads)]
    assert calls == [shape]
    labels = ["beta", "p", "predictive", "final precision", *(f"d/d{n}" for n in NAMES)]
    for label, x, x64, x32 in zip(labels, *results.values(), strict=True):
        assert_close(x, x64, TOLERANCE[F32], f"{label} against float64")
        tol = TOLERANCE[F32] + relative_error(x32, x64)
        assert_close(x, x32, tol, f"{label} against the PyTorch path")


@pytest.mark.parametrize(
    ("backend", "dtype", "fused"),
    [
        pytest.param("triton", F32, True, marks=needs_triton),
        pytest.param("triton", F64, False, marks=needs_triton),
        ("auto", F32, CUDA),
        ("parallel", F32, False),
    ],
)
def test_kdn_gain_iso_takes_its_kernels_exactly_on_the_triton_scan_in_float32(
    monkeypatch, backend, dtype, fused
):
    calls = spy_iso_gain(monkeypatch)
    k, g, q_noise, r, _ = (x.to(DEVICE, dtype) for x in iso_inputs(13, (1, 4, 2, 3), True))
    kdn_gain_iso(k, g, q_noise, r, torch.ones(2, device=DEVICE, dtype=dtype), backend=backend)
    assert calls == ([(1, 4, 2, 3)] if fused else [])


@needs_triton
@pytest.mark.parametrize("channel_decay", [True, False], ids=["channel_decay", "head_decay"])
@pytest.mark.parametrize("routed", ["k and g", "k", "neither"])
def test_iso_terms_backward_adds_the_routed_gradients_of_k_and_g_to_its_own(
    poisoned_empty, channel_decay, routed
):
    """The terms' node hands k and g back (for the delta rule): their values unchanged, and the
    gradients they receive summed with the terms' own shares by its backward kernel, against
    float64 autograd of the PyTorch terms with k and g used as directly (every output and
    gradient element written: NaN-filled before launch)."""
    from deltalab.ops.kdn.triton_iso_terms import _KDNIsoTerms

    shape = (2, 7, 3, 5)
    gen = torch.Generator().manual_seed(21)
    k = torch.randn(shape, generator=gen, dtype=F64)
    g = -3 * torch.rand(shape if channel_decay else shape[:3], generator=gen, dtype=F64)
    g[0, 1] = -torch.inf
    weights = [torch.randn(shape[:3], generator=gen, dtype=F64) for _ in range(2)]
    weights += [torch.randn(x.shape, generator=gen, dtype=F64) for x in (k, g)]
    uses = {"k and g": (True, True), "k": (True, False), "neither": (False, False)}[routed]
    results = {}
    for name, dtype in (("kernels", F32), ("float64", F64)):
        leaves = [x.to(DEVICE, dtype).requires_grad_() for x in (k, g)]
        if name == "kernels":
            decay2, norm2, k_out, g_out = _KDNIsoTerms.apply(*leaves)
            assert torch.equal(k_out, leaves[0]) and torch.equal(g_out, leaves[1])
        else:
            decay2, norm2, _ = gains.iso_terms(*leaves, leaves[0].new_ones(shape[:3]), 1.0)
            k_out, g_out = leaves
        outputs = (decay2, norm2, k_out, g_out)
        used = (True, True, *uses)
        pairs = zip(outputs, weights, used, strict=True)
        loss = sum((o * w.to(o)).sum() for o, w, u in pairs if u)
        results[name] = [x.detach().cpu().double() for x in torch.autograd.grad(loss, leaves)]
    for label, x, x64 in zip(("dk", "dg"), *results.values(), strict=True):
        assert_close(x, x64, TOLERANCE[F32], label)


@needs_triton
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
def test_isotropic_kdn_hands_the_delta_rule_k_and_g_through_its_terms_node_checked_once(
    monkeypatch, packed
):
    """On the kernels' route the delta rule takes k and g as the terms' node hands them back (so
    that node's backward sums both gradients), and g's check is not queued again for them;
    packed sequences, whose gain sees padded copies, hand it the inputs themselves. The
    gradients of k and g match the chunk path's."""
    from deltalab.ops import kdn_iso
    from deltalab.ops.kdn import mixers

    b, t, h, d = (1, 9, 2, 4)
    gen = torch.Generator().manual_seed(22)
    draw = lambda *shape: torch.rand(*shape, generator=gen)  # noqa: E731
    q, k, v = draw(b, t, h, d), draw(b, t, h, d) - 0.5, draw(b, t, h, d)
    g, q_noise, r = -draw(b, t, h, d), draw(b, t, h), draw(b, t, h) + 0.5
    cu = torch.tensor([0, 4, 9], device=DEVICE) if packed else None
    seen = []

    def spy(q, a, b, u, g, **kwargs):
        seen.append((b, g))
        return original(q, a, b, u, g, **kwargs)

    original = mixers.delta_rule
    monkeypatch.setattr(mixers, "delta_rule", spy)
    results = {}
    for backend in ("triton", "chunk"):
        leaves = [x.to(DEVICE).requires_grad_() for x in (k, g)]
        inputs = [x.to(DEVICE) for x in (q, v, q_noise, r)]
        with CountedMax(leaves[1]) as counted:
            o, _ = kdn_iso(
                inputs[0], leaves[0], inputs[1], leaves[1], *inputs[2:],
                p0=torch.ones(h, device=DEVICE), cu_seqlens=cu, backend=backend,
            )  # fmt: skip
        if backend == "triton":
            routed = all(x is not leaf for x, leaf in zip(seen[-1], leaves, strict=True))
            assert routed != packed
            assert counted.count == 1
        results[backend] = torch.autograd.grad((o * o).sum(), leaves)
    for label, x, ref in zip(("dk", "dg"), *results.values(), strict=True):
        assert_close(x, ref, 1e-5, label)


@needs_triton
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided_g"])
@pytest.mark.parametrize("variant", ["iso", "diag"])
def test_a_kdn_op_on_the_kernels_queues_no_check_after_its_send_on_first_or_later_calls(
    monkeypatch, variant, strided
):
    """The delta rule takes k and g as the gain's node hands them back, and checks g again: it
    must find that check queued (first call) or passed (a later call with the same inputs, the
    pass remembered), or the check is read at the block's end, behind all the work (on a GPU a
    wait for the whole forward). A strided g too, which the kernels take as a contiguous copy:
    the copy is what is checked."""
    from deltalab.ops import _checks, kdn_diag, kdn_iso

    late = []
    answer = _checks._Block.answer

    def spy(block):
        late.append(len(block.queued) - block.sent_count)
        return answer(block)

    monkeypatch.setattr(_checks._Block, "answer", spy)
    b, t, h, d = (1, 6, 2, 4)
    gen = torch.Generator().manual_seed(23)
    draw = lambda *shape: torch.rand(*shape, generator=gen, device="cpu").to(DEVICE)  # noqa: E731
    q, k, v, g = draw(b, t, h, d), draw(b, t, h, d) - 0.5, draw(b, t, h, d), -draw(b, t, h, d)
    if strided:
        g = (-draw(b, t, h, 2 * d))[..., ::2]
        assert not g.is_contiguous()
    q_noise = draw(b, t, h, d) if variant == "diag" else draw(b, t, h)
    op = kdn_diag if variant == "diag" else kdn_iso
    leaves = [x.requires_grad_() for x in (k, g)]
    for _ in range(2):
        p0 = torch.ones(h, device=DEVICE)  # fresh each call: one check read per call
        op(q, leaves[0], v, leaves[1], q_noise, draw(b, t, h) + 0.5, p0=p0, backend="triton")
    assert late == [0, 0]


class CountedMax(TorchDispatchMode):
    """Counts the max reductions (the value checks') over the elements of `x`."""

    def __init__(self, x: torch.Tensor) -> None:
        super().__init__()
        self.x, self.count = x, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        reductions = (torch.ops.aten.amax.default, torch.ops.aten.aminmax.default)
        first = args[0] if args else None
        if func in reductions and isinstance(first, torch.Tensor):
            self.count += first.data_ptr() == self.x.data_ptr() and first.shape == self.x.shape
        return func(*args, **(kwargs or {}))


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


@needs_triton
@pytest.mark.parametrize("layer_class", [IsotropicKDN, DiagonalKDN], ids=lambda c: c.__name__)
def test_kdn_layers_on_triton_hand_the_delta_rule_k_and_g_through_the_gain_rebuildable(
    monkeypatch, layer_class
):
    """In training the KDN layers give the delta rule k and g as the gain's node hands them back
    (so its backward sums both gradients), each carrying the recipe that rebuilds g in the
    backward (else the delta rule would keep the routed g, and with it the tensor the rebuild
    spares); on the chunk path, k and g themselves."""
    from deltalab.layers import recurrence
    from deltalab.ops._recompute import recipe_of

    seen = []
    original = recurrence.delta_rule

    def spy(q, a, b, u, g, **kwargs):
        seen.append((b.grad_fn, g.grad_fn, recipe_of(g)))
        return original(q, a, b, u, g, **kwargs)

    monkeypatch.setattr(recurrence, "delta_rule", spy)
    for backend in ("triton", "chunk"):
        torch.manual_seed(0)
        layer = layer_class(**LAYER, backend=backend).to(DEVICE)
        x = torch.randn(1, 6, LAYER["hidden_size"], device=DEVICE)
        layer(x)[0].sum().backward()
        (b_node, g_node, recipe) = seen[-1]
        routed = {type(b_node).__name__, type(g_node).__name__}
        gain = {"_KDNIsoTermsBackward", "_KDNDiagGainBackward"}
        assert bool(routed & gain) == (backend == "triton"), routed
        assert recipe is not None


@needs_triton
def test_isotropic_kdn_layer_on_triton_matches_chunk_with_parameter_gradients(monkeypatch):
    calls = spy_iso_gain(monkeypatch)
    layers = {}
    for backend in ("chunk", "triton"):
        torch.manual_seed(0)
        layers[backend] = IsotropicKDN(**LAYER, backend=backend).to(DEVICE)
    layers["triton"].load_state_dict(layers["chunk"].state_dict(), strict=True)
    x = torch.randn(2, 20, LAYER["hidden_size"], device=DEVICE)
    dy = torch.randn(2, 20, LAYER["hidden_size"], device=DEVICE)
    results = {}
    for backend, layer in layers.items():
        y, _ = layer(x)
        (y * dy).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in layer.parameters()])
        results[backend] = (y.detach(), grads)
    assert calls == [(2, 20, 2, 16)]
    assert_close(results["triton"][0], results["chunk"][0], 1e-5, "y")
    assert_close(results["triton"][1], results["chunk"][1], 1e-5, "parameter gradients")


# 16-bit inputs on the Triton route: float16 under the interpreter (numpy has it), bf16 too on
# the GPU (tests/test_cuda.py times nothing; this is the correctness side).
SIXTEEN_BIT = [torch.float16, *([torch.bfloat16] if CUDA else [])]


@needs_triton
@pytest.mark.parametrize("dtype", SIXTEEN_BIT, ids=str)
@pytest.mark.parametrize("variant", ["iso", "diag"])
def test_16_bit_kdn_inputs_reach_the_gain_kernels_uncast_and_match_float64(
    monkeypatch, variant, dtype
):
    """kdn_iso / kdn_diag on Triton with 16-bit q, k, v, g, q_noise, r: the gain kernels read k,
    g (and Diagonal's q_noise, r) in their own dtype (no float32 copies), the Diagonal gain
    comes back in k's dtype for the delta rule, and the output, final state and every gradient
    match the float64 chunk path on the same (rounded) inputs within the dtype's tolerance;
    the gradients come back in the inputs' dtypes."""
    from deltalab.ops import kdn_diag, kdn_iso
    from deltalab.ops.kdn import triton_diag_gain, triton_iso_terms

    seen = []
    module, name = {
        "diag": (triton_diag_gain, "kdn_diag_gain"),
        "iso": (triton_iso_terms, "kdn_iso_gain"),
    }[variant]
    original = getattr(module, name)

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.append(([a.dtype for a in args if isinstance(a, torch.Tensor)], out[0].dtype))
        return out

    monkeypatch.setattr(module, name, spy)
    gen = torch.Generator().manual_seed(31)
    args = kdn_inputs(gen, (2, 19, 2, 8, 8), variant=variant)
    args["k"] = torch.nn.functional.normalize(args["k"], dim=-1)
    low = {n: (x.to(dtype) if n != "p0" else x.float()) for n, x in args.items()}
    fn = kdn_diag if variant == "diag" else kdn_iso
    results = {}
    for label, inputs, backend in [
        ("triton", {n: x.to(DEVICE) for n, x in low.items()}, "triton"),
        ("float64", {n: x.double() for n, x in low.items()}, "chunk"),
    ]:
        leaves = {n: x.detach().requires_grad_() for n, x in inputs.items()}
        o, (memory, precision) = fn(**leaves, backend=backend, output_final_state=True)
        weights = torch.randn(o.shape, generator=torch.Generator().manual_seed(5), dtype=F64)
        loss = (o.double() * weights.to(o.device)).sum() + memory.double().sum()
        loss.backward()
        grads = {n: x.grad for n, x in leaves.items()}
        results[label] = (o, memory, precision, grads)
    inputs_seen, out_dtype = seen[0]
    # k, g, q_noise, r as they come, then p_prior in float32.
    expected = [dtype] * 4 + [F32]
    assert inputs_seen == expected
    assert out_dtype == (dtype if variant == "diag" else F32)
    o, memory, precision, grads = results["triton"]
    o64, memory64, precision64, grads64 = results["float64"]
    assert o.dtype == dtype and memory.dtype == precision.dtype == F32
    tol = TOLERANCE[dtype]
    assert_close(o, o64, tol, "o")
    assert_close(memory, memory64, tol, "final memory")
    assert_close(precision, precision64, tol, "final precision")
    for n, grad in grads.items():
        assert grad.dtype == low[n].dtype, n
        assert_close(grad, grads64[n], tol, f"d/d{n}")


@needs_triton
@pytest.mark.parametrize(
    ("layer_class", "write_16bit"),
    [
        (DiagonalKDN, [(F32, 4), (torch.float16, 4)]),
        # One strength per token, the gain scan's float32: 1/K of the direction's elements.
        (IsotropicKDN, [(F32, 3), (F32, 3)]),
    ],
    ids=["diag", "iso"],
)
def test_16_bit_kdn_layers_hand_the_delta_rule_a_16_bit_direction_or_a_strength_and_match_float32(
    monkeypatch, layer_class, write_16bit
):
    """A float16 KDN layer on Triton: Diagonal's write direction (its gain) reaches the delta
    rule's kernels in float16, as the op kdn_diag passes it (not float32, read and kept at twice
    the bytes), Isotropic's write as its strength per token [B, T, H] (beta, not beta k), and
    the output and parameter gradients stay within float16's tolerance of the same layer in
    float32."""
    from deltalab.ops.delta_rule.triton import chunk as triton_chunk

    writes = []
    original = triton_chunk.delta_rule_triton

    def spy(q, a, *rest):
        writes.append((a.dtype, a.dim()))
        return original(q, a, *rest)

    monkeypatch.setattr(triton_chunk, "delta_rule_triton", spy)
    torch.manual_seed(0)
    layers = {F32: layer_class(**LAYER, backend="triton").to(DEVICE)}
    layers[torch.float16] = layer_class(**LAYER, backend="triton").to(DEVICE, torch.float16)
    layers[torch.float16].load_state_dict(layers[F32].state_dict())
    x = torch.randn(2, 20, LAYER["hidden_size"], device=DEVICE)
    dy = torch.randn(2, 20, LAYER["hidden_size"], device=DEVICE)
    results = {}
    for dtype, layer in layers.items():
        y, _ = layer(x.to(dtype))
        (y.float() * dy).sum().backward()
        grads = torch.cat([p.grad.float().flatten() for p in layer.parameters()])
        results[dtype] = (y.float().detach(), grads)
    assert writes == write_16bit
    tol = TOLERANCE[torch.float16]
    assert_close(results[torch.float16][0], results[F32][0], tol, "y")
    assert_close(results[torch.float16][1], results[F32][1], 4 * tol, "parameter gradients")
