"""log_decay: the torch path is the layers' old path, the Triton kernels (forward, backward and
the forward-mode jvp) match the float64 formula, and the gated mixers dispatch to them.

The Triton tests run on a CUDA GPU, or on CPU tensors under Triton's interpreter:

    TRITON_INTERPRET=1 python -m pytest tests/test_log_decay.py

(README's test command runs this file a second time with it set); skipped otherwise. Shapes are
tiny: the interpreter runs every operation of a kernel in Python.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

from deltalab.layers import (
    DiagonalKDN,
    GatedDeltaNet,
    GatedDeltaNet2,
    KDNMuir,
    KimiDeltaAttention,
    Muir,
)
from deltalab.layers.decay import ChannelDecay, ScalarDecay
from deltalab.layers.delta_mixer import DeltaMixer
from deltalab.ops import log_decay as op
from deltalab.ops._recompute import recomputed
from deltalab.ops._triton import INTERPRET, triton_unavailable_reason
from deltalab.ops.log_decay import layer_backend, log_decay, resolve_backend
from deltalab.testing import assert_close

pytestmark = pytest.mark.interpreter

F64 = torch.float64
CUDA = torch.cuda.is_available() and not INTERPRET
DEVICE = "cuda" if CUDA else "cpu"
NO_TRITON = triton_unavailable_reason(torch.device(DEVICE))
needs_triton = pytest.mark.skipif(NO_TRITON is not None, reason=str(NO_TRITON))
# float32 kernels against the float64 formula: a few float32 ulps, and sums over rows.
F32_TOL = 1e-5
NAMES = ("g", "dA_log", "draw", "ddt_bias")
# A launch table of tiles of 2 x 8 and at most 3 backward programs a column block.
SMALL_TABLE = {"forward_elements": 16, "backward_elements": 16, "max_columns": 8,
               "backward_programs": 3}  # fmt: skip
# (A_log, raw, dt_bias) shapes: scalar decay [H] / [B, T, H], channel decay [H, 1] / [B, T, H, K],
# odd H and K, and other leading dims.
LAYOUTS = {
    "scalar": ((3,), (2, 5, 3), (3,)),
    "channel": ((3, 1), (2, 5, 3, 7), (3, 7)),
    "scalar-1d": ((5,), (11, 5), (5,)),
    "channel-lead": ((2, 1), (2, 1, 3, 2, 5), (2, 5)),
}


def decay_inputs(generator, layout, scale=3.0):
    """A_log, raw, dt_bias, dg: float64 (A_log as initialized, log U(1, 16))."""
    a_shape, raw_shape, b_shape = LAYOUTS[layout]

    def draw(*s):
        return torch.randn(*s, generator=generator, dtype=F64)

    a_log = torch.rand(*a_shape, generator=generator, dtype=F64) * 2.7
    return a_log, scale * draw(*raw_shape), draw(*b_shape), draw(*raw_shape)


def with_grads(inputs, backend, dtype, device=DEVICE, table=None):
    """g and the gradients of A_log, raw, dt_bias of sum(g * dg), as float64 CPU tensors; with
    a launch `table`, by the Triton kernels launched by it."""
    a_log, raw, dt_bias, dg = inputs
    leaves = [t.detach().to(device, dtype).requires_grad_() for t in (a_log, raw, dt_bias)]
    if table is None:
        g = log_decay(*leaves, backend=backend)
    else:
        from deltalab.ops.log_decay.triton import log_decay_triton

        a, x, b = leaves
        shape = torch.broadcast_shapes(a.shape, b.shape)  # the parameters' span of raw
        a, b = (p.expand(shape).reshape(-1) for p in (a, b))
        g = log_decay_triton(a, x, b, table=table)
    grads = torch.autograd.grad((g * dg.to(device, g.dtype)).sum(), leaves)
    return [t.detach().cpu().to(F64) for t in (g, *grads)]


def assert_all_close(actual, expected, tol, what=""):
    for name, a, e in zip(NAMES, actual, expected, strict=True):
        assert_close(a, e, tol, f"{what} {name}")


def old_layers_log_decay(A_log, raw, dt_bias):
    """deltalab.layers.decay.log_decay before the op existed, verbatim."""

    def formula(A_log, raw, dt_bias):
        dtype = torch.promote_types(raw.dtype, torch.float32)
        rate = A_log.to(dtype).exp()
        return -rate * F.softplus(raw.to(dtype) + dt_bias.to(dtype))

    return recomputed(formula, A_log, raw, dt_bias)


@pytest.mark.parametrize("layout", ["scalar", "channel"])
def test_torch_path_is_the_layers_log_decay_bit_for_bit(generator, layout):
    inputs = decay_inputs(generator, layout)
    ours = with_grads(inputs, "torch", torch.float32, "cpu")
    a_log, raw, dt_bias, dg = (t.float().requires_grad_() for t in inputs)
    g = old_layers_log_decay(a_log, raw, dt_bias)
    grads = torch.autograd.grad((g * dg).sum(), [a_log, raw, dt_bias])
    for a, b in zip(ours, (g, *grads), strict=True):
        assert torch.equal(a, b.detach().to(F64))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_naive_formula_and_torch_path_agree_in_float64(generator, layout):
    inputs = decay_inputs(generator, layout)
    expected = with_grads(inputs, "naive", F64, "cpu")
    assert_all_close(with_grads(inputs, "torch", F64, "cpu"), expected, 1e-12)


@needs_triton
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_triton_matches_naive_float64_and_the_torch_path_with_gradients(
    generator, poisoned_empty, layout
):
    inputs = decay_inputs(generator, layout)
    expected = with_grads(inputs, "naive", F64, "cpu")
    actual = with_grads(inputs, "triton", torch.float32)
    assert_all_close(actual, expected, F32_TOL, layout)
    assert_all_close(actual, with_grads(inputs, "torch", torch.float32, "cpu"), F32_TOL, layout)


@needs_triton
@pytest.mark.parametrize("layout", ["scalar", "channel"])
def test_triton_is_finite_and_exact_in_the_limits_for_large_raw(generator, layout):
    """raw of +-50 (and +-1e4): softplus is x above the threshold, exp(x) far below it, with no
    overflow or 0/0; every output and gradient finite and equal to the float64 formula's."""
    a_log, raw, dt_bias, dg = decay_inputs(generator, layout)
    signs = torch.where(torch.rand(raw.shape, generator=generator) < 0.5, -1.0, 1.0).to(F64)
    raw = signs * torch.where(torch.rand(raw.shape, generator=generator) < 0.8, 50.0, 1e4)
    inputs = (a_log, raw.to(F64), dt_bias, dg)
    actual = with_grads(inputs, "triton", torch.float32)
    assert all(torch.isfinite(t).all() for t in actual)
    expected = with_grads(inputs, "naive", F64, "cpu")
    assert_all_close(actual, expected, F32_TOL, "+-50")
    # At -50, g is -exp(A_log) exp(x + dt_bias) ~ -1e-21: tiny, not 0 (log1p(e) is e there).
    assert (actual[0][raw == -50] < 0).all()


@needs_triton
def test_triton_parameter_gradients_sum_over_many_programs(generator, poisoned_empty):
    """More row blocks than backward programs, programs whose last blocks run past the rows and
    several column blocks: each program's partial sums are added once."""
    from deltalab.ops.log_decay import triton as kernels

    table = dataclasses.replace(kernels.LAUNCH, **SMALL_TABLE)
    inputs = decay_inputs(generator, "channel")  # N = 21: three column blocks of 8
    # 10 rows in blocks of 2: 5 row blocks over 3 programs of 2 each column block.
    assert kernels.launch(10, 21, "backward", table).grid == (3, 3)
    assert_all_close(
        with_grads(inputs, "triton", torch.float32, table=table),
        with_grads(inputs, "naive", F64, "cpu"),
        F32_TOL,
    )


@needs_triton
def test_triton_reads_a_column_slice_as_muir_passes_its_decay(generator):
    """Muir's raw decay is a column slice of its fused projection: read with its row stride."""
    fused = torch.randn(2, 5, 40, generator=generator, dtype=F64)
    raw = fused[..., 7:28].unflatten(-1, (3, 7))
    a_log, _, dt_bias, dg = decay_inputs(generator, "channel")
    expected = with_grads((a_log, raw, dt_bias, dg), "naive", F64, "cpu")
    leaf = fused.float().to(DEVICE).requires_grad_()
    a, b = a_log.float().to(DEVICE), dt_bias.float().to(DEVICE)
    g = log_decay(a, leaf[..., 7:28].unflatten(-1, (3, 7)), b, backend="triton")
    (grad,) = torch.autograd.grad((g * dg.to(DEVICE, g.dtype)).sum(), leaf)
    assert_close(g.cpu().double(), expected[0], F32_TOL, "g")
    assert_close(grad[..., 7:28].cpu().double().unflatten(-1, (3, 7)), expected[2], F32_TOL, "dr")
    assert (grad[..., :7] == 0).all() and (grad[..., 28:] == 0).all()


@needs_triton
@pytest.mark.parametrize("layout", ["scalar", "channel"])
def test_triton_forward_mode_derivative_matches_the_torch_path(generator, layout):
    inputs = decay_inputs(generator, layout)
    tangents = [torch.randn(t.shape, generator=generator, dtype=F64) for t in inputs[:3]]
    results = {}
    for backend, device in (("torch", "cpu"), ("triton", DEVICE)):
        with fwAD.dual_level():
            duals = [
                fwAD.make_dual(p.float().to(device), t.float().to(device))
                for p, t in zip(inputs[:3], tangents, strict=True)
            ]
            g = log_decay(*duals, backend=backend)
            results[backend] = fwAD.unpack_dual(g).tangent.cpu().double()
    assert_close(results["triton"], results["torch"], F32_TOL, "tangent")


def test_backends_follow_the_delta_rule_and_auto_takes_triton_only_on_cuda():
    assert [layer_backend(b) for b in ("auto", "triton", "chunk", "naive")] == [
        "auto", "triton", "torch", "torch"
    ]  # fmt: skip
    assert resolve_backend("auto", torch.zeros(2, dtype=F64)) == "torch"
    cpu = resolve_backend("auto", torch.zeros(2))
    assert cpu == "torch"


@pytest.mark.parametrize(
    ("shapes", "message"),
    [
        (((3,), (2, 5, 4), (4,)), "broadcast against raw"),
        (((3, 1), (2, 5, 3, 7), (3, 6)), "broadcast against raw"),
        (((2, 3, 1), (3, 7), (3, 7)), "broadcast against raw"),
    ],
)
def test_bad_shapes_are_refused_naming_the_layouts(shapes, message):
    a, raw, b = (torch.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=message):
        log_decay(a, raw, b, backend="torch")


def test_an_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend must be one of"):
        log_decay(torch.zeros(3), torch.zeros(2, 3), torch.zeros(3), backend="chunk")


@pytest.mark.skipif(NO_TRITON is None, reason="Triton runs here")
def test_triton_backend_says_why_it_cannot_run():
    with pytest.raises(RuntimeError, match='backend="triton" cannot run here'):
        log_decay(torch.zeros(3), torch.zeros(2, 3), torch.zeros(3), backend="triton")


def spy_log_decay(monkeypatch) -> list[str]:
    """The backend of every call the decays make to the op."""
    calls: list[str] = []
    original = op.log_decay

    def spy(*args, backend):
        calls.append(backend)
        return original(*args, backend=backend)

    monkeypatch.setattr("deltalab.layers.decay._op.log_decay", spy)
    return calls


FRONTEND = dict(hidden_size=32, num_heads=2, head_dim=16, value_dim=8, conv_size=4, chunk_size=16)


@pytest.mark.parametrize(
    "mixer", [GatedDeltaNet, KimiDeltaAttention, GatedDeltaNet2, Muir, DiagonalKDN, KDNMuir]
)
@pytest.mark.parametrize(
    ("backend", "expected"), [("chunk", "torch"), ("naive", "torch"), ("auto", "auto")]
)
def test_mixers_pass_their_delta_rules_backend_to_the_decay(monkeypatch, mixer, backend, expected):
    calls = spy_log_decay(monkeypatch)
    torch.manual_seed(0)
    mixer(**FRONTEND, backend=backend)(torch.randn(1, 5, 32))
    assert calls == [expected]


@needs_triton
@pytest.mark.parametrize("mixer", [GatedDeltaNet, KimiDeltaAttention, GatedDeltaNet2, DiagonalKDN])
def test_triton_layer_gives_the_chunk_layers_outputs_and_parameter_gradients(monkeypatch, mixer):
    """The whole layer on Triton (decay included) against the chunk path, same parameters."""
    calls = spy_log_decay(monkeypatch)
    torch.manual_seed(0)
    chunk = mixer(**FRONTEND, backend="chunk").to(DEVICE)
    triton = mixer(**FRONTEND, backend="triton").to(DEVICE)
    triton.load_state_dict(chunk.state_dict(), strict=True)
    x = torch.randn(2, 20, 32, device=DEVICE)
    dy = torch.randn(2, 20, 32, device=DEVICE)
    results = {}
    for name, layer in (("chunk", chunk), ("triton", triton)):
        y, _ = layer(x)
        (y * dy).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in layer.parameters()])
        decay = {n: p.grad for n, p in layer.named_parameters() if "A_log" in n or "dt_bias" in n}
        results[name] = (y.detach(), grads, decay)
    assert calls == ["torch", "triton"]
    assert_close(results["triton"][0], results["chunk"][0], F32_TOL, "y")
    assert_close(results["triton"][1], results["chunk"][1], F32_TOL, "parameter gradients")
    assert results["triton"][2].keys() == results["chunk"][2].keys() and results["chunk"][2]


@needs_triton
def test_gate_sensitivity_of_a_triton_model_runs_its_decays_on_the_torch_path(monkeypatch):
    """Forward-mode probes switch the layers to "chunk": the decays follow them to the torch
    path, and the report equals the all-PyTorch model's."""
    from deltalab.analysis import gate_sensitivity
    from deltalab.models import CausalLM, DeltaLabConfig

    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))

    def report(backend):
        config = DeltaLabConfig(
            mixer="kda", hidden_size=32, num_layers=1, num_heads=2, head_dim=16, vocab_size=50,
            chunk_size=16, backend=backend,
        )  # fmt: skip
        torch.manual_seed(0)
        model = CausalLM(config).to(DEVICE).eval()
        loss = lambda m, b: m(input_ids=b, labels=b).loss  # noqa: E731
        result = gate_sensitivity(model, ids.to(DEVICE), probes=1, seed=0, loss_fn=loss)
        assert {m.backend for m in model.modules() if isinstance(m, DeltaMixer)} == {backend}
        return result

    calls = spy_log_decay(monkeypatch)
    triton_report = report("triton")
    assert calls and set(calls) == {"torch"}
    chunk_report = report("chunk")
    for table in ("state", "loss"):
        ours, theirs = getattr(triton_report, table), getattr(chunk_report, table)
        assert ours.keys() == theirs.keys()
        for layer, gates in theirs.items():
            assert gates.keys() == ours[layer].keys() and "g" in gates
            for gate, value in gates.items():
                assert ours[layer][gate] == pytest.approx(value, rel=1e-6), (table, layer, gate)


@pytest.mark.parametrize("decay", ["scalar", "channel"])
def test_decay_modules_default_to_auto_and_take_the_backend_they_are_given(monkeypatch, decay):
    calls = spy_log_decay(monkeypatch)
    module = ScalarDecay(8, 2) if decay == "scalar" else ChannelDecay(8, 2, 4, 3)
    x = torch.randn(1, 3, 8)
    module(x)
    module(x, backend="naive")
    assert calls == ["auto", "naive"]


@pytest.mark.skipif(not CUDA or NO_TRITON is not None, reason="bfloat16 kernels: CUDA only")
@pytest.mark.parametrize("layout", ["scalar", "channel"])
def test_triton_bfloat16_raw_is_as_close_to_float64_as_the_torch_path(generator, layout):
    """bfloat16 raw (under autocast), float32 parameters: g float32, d raw bfloat16."""
    a_log, raw, dt_bias, dg = decay_inputs(generator, layout)
    raw = raw.bfloat16().double()  # both paths see the same bfloat16 values
    expected = with_grads((a_log, raw, dt_bias, dg), "naive", F64, "cpu")
    for backend in ("torch", "triton"):
        leaves = [a_log.float().cuda(), raw.bfloat16().cuda(), dt_bias.float().cuda()]
        leaves = [t.requires_grad_() for t in leaves]
        g = log_decay(*leaves, backend=backend)
        assert g.dtype == torch.float32
        grads = torch.autograd.grad((g * dg.cuda().float()).sum(), leaves)
        assert grads[1].dtype == torch.bfloat16
        actual = [t.detach().cpu().double() for t in (g, *grads)]
        assert_close(actual[0], expected[0], F32_TOL, f"{backend} g")
        assert_close(actual[1], expected[1], F32_TOL, f"{backend} dA_log")
        assert_close(actual[2], expected[2], 1e-2, f"{backend} draw")
        assert_close(actual[3], expected[3], F32_TOL, f"{backend} ddt_bias")
