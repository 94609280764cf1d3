"""swiglu: the torch path is the FFN's old path, the Triton kernels (forward, backward and the
forward-mode jvp) match the float64 formula, and the models dispatch to them.

The Triton tests run on a CUDA GPU, or on CPU tensors under Triton's interpreter:

    TRITON_INTERPRET=1 python -m pytest tests/test_swiglu.py

(README's test command runs this file a second time with it set); skipped otherwise. Shapes are
tiny: the interpreter runs every operation of a kernel in Python.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from deltalab.ops._recompute import recomputed
from deltalab.ops._triton import INTERPRET, triton_unavailable_reason
from deltalab.ops.swiglu import resolve_backend, swiglu
from deltalab.testing import TOLERANCE, assert_close, forward_tangent, relative_error

pytestmark = pytest.mark.interpreter

F64 = torch.float64
CUDA = torch.cuda.is_available() and not INTERPRET
DEVICE = "cuda" if CUDA else "cpu"
NO_TRITON = triton_unavailable_reason(torch.device(DEVICE))
needs_triton = pytest.mark.skipif(NO_TRITON is not None, reason=str(NO_TRITON))
# float32 kernels against the float64 formula: a few float32 ulps of elementwise products.
F32_TOL = 1e-6


def draw(generator, *shape):
    return torch.randn(*shape, generator=generator, dtype=F64)


def with_grad(gate_up, dh, backend, dtype, device=DEVICE, table=None):
    """h and d(gate_up) of sum(h * dh), as float64 CPU tensors; with a launch `table`, by the
    Triton kernels launched by it."""
    leaf = gate_up.detach().to(device, dtype).requires_grad_()
    if table is None:
        h = swiglu(leaf, backend=backend)
    else:
        from deltalab.ops.swiglu.triton import swiglu_triton

        h = swiglu_triton(leaf, table=table)
    assert h.dtype == dtype and h.shape == (*gate_up.shape[:-1], gate_up.shape[-1] // 2)
    (grad,) = torch.autograd.grad(h, leaf, dh.to(device, dtype))
    assert grad.dtype == dtype and grad.shape == gate_up.shape
    return h.detach().cpu().to(F64), grad.cpu().to(F64)


def assert_pair_close(actual, expected, tol, what=""):
    assert_close(actual[0], expected[0], tol, f"{what} h")
    assert_close(actual[1], expected[1], tol, f"{what} d(gate_up)")


def _old_ffn_swiglu(gate_up):
    """`deltalab.models.lm._swiglu` before this op existed."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_is_the_ffns_old_swiglu_bit_for_bit(generator, dtype):
    gate_up, dh = draw(generator, 2, 5, 2 * 12), draw(generator, 2, 5, 12)
    ours = with_grad(gate_up, dh, "torch", dtype, "cpu")
    leaf = gate_up.to(dtype).requires_grad_()
    h = recomputed(_old_ffn_swiglu, leaf)
    (grad,) = torch.autograd.grad(h, leaf, dh.to(dtype))
    assert torch.equal(ours[0], h.double()) and torch.equal(ours[1], grad.double())


def test_naive_formula_and_torch_path_agree_in_float64(generator):
    gate_up, dh = draw(generator, 3, 2 * 7), draw(generator, 3, 7)
    naive = with_grad(gate_up, dh, "naive", F64, "cpu")
    assert_pair_close(with_grad(gate_up, dh, "torch", F64, "cpu"), naive, TOLERANCE[F64])


@needs_triton
@pytest.mark.parametrize("shape", [(2, 3, 16), (5, 37), (2, 3, 2, 100), (1, 1), (3, 300)])
def test_triton_matches_naive_float64_and_the_torch_path(generator, poisoned_empty, shape):
    """Odd F (37, 100, 1: not powers of 2, masked columns; 300: more than one column block),
    leading batch dims, one row; h and d(gate_up) against the float64 formula and the torch
    path in float32."""
    gate_up, dh = draw(generator, *shape[:-1], 2 * shape[-1]), draw(generator, *shape)
    expected = with_grad(gate_up, dh, "naive", F64, "cpu")
    actual = with_grad(gate_up, dh, "triton", torch.float32)
    assert_pair_close(actual, expected, F32_TOL, f"{shape} vs float64")
    torch_path = with_grad(gate_up, dh, "torch", torch.float32, "cpu")
    assert_pair_close(actual, torch_path, F32_TOL, f"{shape} vs torch")


@needs_triton
def test_triton_runs_over_many_row_and_column_blocks(generator, poisoned_empty):
    """Tiles of 4 x 8: row blocks and column blocks past M and F masked off, every element of
    h and d(gate_up) written once."""
    from deltalab.ops.swiglu import triton as kernels

    small = {"forward_elements": 32, "backward_elements": 32, "max_columns": 8}
    table = dataclasses.replace(kernels.LAUNCH, **small)
    assert kernels.launch(21, 21, "forward", table)[:2] == (4, 8)
    gate_up, dh = draw(generator, 7, 3, 2 * 21), draw(generator, 7, 3, 21)
    expected = with_grad(gate_up, dh, "naive", F64, "cpu")
    actual = with_grad(gate_up, dh, "triton", torch.float32, table=table)
    assert_pair_close(actual, expected, F32_TOL)


@needs_triton
def test_triton_reads_strided_inputs_and_gradients(generator):
    """gate_up every other row and a transposed view (its last dim strided: copied), dh every
    other row: the same values as on contiguous copies."""
    wide = draw(generator, 8, 3, 2 * 10)
    dh_wide = draw(generator, 8, 3, 10)
    cases = [
        (wide[::2], dh_wide[::2]),
        (draw(generator, 20, 6).t(), draw(generator, 6, 10)),
    ]
    for gate_up, dh in cases:
        assert not gate_up.is_contiguous()
        expected = with_grad(gate_up.contiguous(), dh.contiguous(), "naive", F64, "cpu")
        leaf = gate_up.detach().to(DEVICE, torch.float32).requires_grad_()
        h = swiglu(leaf, backend="triton")
        (grad,) = torch.autograd.grad(h, leaf, dh.to(DEVICE, torch.float32))
        assert_pair_close((h.cpu().double(), grad.cpu().double()), expected, F32_TOL, "strided")


@needs_triton
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_triton_large_gates_saturate_without_nan(generator):
    """|gate| up to 1e4: sigmoid underflows to 0 or rounds to 1; h and both gradients stay
    finite and match the float64 limits."""
    gate = torch.tensor([-1e4, -200.0, -90.0, -88.0, 0.0, 88.0, 90.0, 200.0, 1e4, 3.0], dtype=F64)
    up = draw(generator, 3, 10)
    gate_up = torch.cat([gate.expand(3, 10), up], dim=-1)
    dh = draw(generator, 3, 10)
    expected = with_grad(gate_up, dh, "naive", F64, "cpu")
    actual = with_grad(gate_up, dh, "triton", torch.float32)
    assert all(bool(torch.isfinite(t).all()) for t in actual)
    assert_pair_close(actual, expected, F32_TOL, "saturated")


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, F64])
def test_triton_writes_gate_ups_dtype_computed_in_float32(generator, dtype):
    gate_up = draw(generator, 4, 2 * 24).to(DEVICE, dtype).requires_grad_()
    expected = swiglu(gate_up.detach().double(), backend="naive")
    h = swiglu(gate_up, backend="triton")
    assert h.dtype == dtype
    tol = 1e-3 if dtype == torch.float16 else F32_TOL
    assert_close(h.detach().cpu().double(), expected.cpu(), tol, str(dtype))
    (grad,) = torch.autograd.grad(h.sum(), gate_up)
    assert grad.dtype == dtype


@needs_triton
def test_triton_forward_mode_derivative_matches_the_torch_path(generator):
    gate_up, tangent = draw(generator, 2, 3, 2 * 20), draw(generator, 2, 3, 2 * 20)

    def run(backend, dtype):
        fn = lambda t: swiglu(t, backend=backend)  # noqa: E731
        return (
            forward_tangent(fn, [gate_up.to(DEVICE, dtype)], [tangent.to(DEVICE, dtype)])
            .cpu()
            .double()
        )

    assert_close(run("triton", torch.float32), run("torch", F64), F32_TOL, "jvp")


def test_auto_takes_triton_only_on_cuda_and_not_for_float64():
    cpu = torch.zeros(2, 8)
    assert resolve_backend("auto", cpu) == "torch"
    assert resolve_backend("naive", cpu) == "naive"
    if torch.cuda.is_available() and NO_TRITON is None:
        assert resolve_backend("auto", cpu.cuda()) == "triton"
        assert resolve_backend("auto", cpu.cuda().bfloat16()) == "triton"
        assert resolve_backend("auto", cpu.cuda().double()) == "torch"


@pytest.mark.parametrize(
    ("gate_up", "backend", "error", "message"),
    [
        (torch.ones(3, 8), "fast", ValueError, "backend must be one of"),
        (torch.ones(3, 7), "torch", ValueError, r"gate_up must have shape \[\.\.\., 2F\]"),
        (torch.tensor(1.0), "torch", ValueError, "gate_up must have shape"),
        (torch.ones(3, 8, dtype=torch.int64), "torch", TypeError, "gate_up must be a floating"),
    ],
)
def test_bad_inputs_are_refused_naming_the_argument(gate_up, backend, error, message):
    with pytest.raises(error, match=message):
        swiglu(gate_up, backend=backend)


@pytest.mark.skipif(NO_TRITON is None, reason="Triton runs here")
def test_triton_backend_says_why_it_cannot_run():
    with pytest.raises(RuntimeError, match='backend="triton" cannot run here'):
        swiglu(torch.ones(2, 4), backend="triton")


def _config(mixer, backend, **kw):
    from deltalab.models import DeltaLabConfig

    settings = {"num_layers": 2, **kw}
    return DeltaLabConfig(
        mixer=mixer, hidden_size=32, num_heads=2, head_dim=16, vocab_size=50, chunk_size=16,
        backend=backend, ffn_width=36, **settings,
    )  # fmt: skip


def test_models_give_their_ffns_the_configs_backend_with_parameters_unchanged():
    from deltalab.models import CausalLM
    from deltalab.models.lm import SwiGLU

    shapes = {}
    for backend, expected in (("chunk", "torch"), ("auto", "auto"), ("triton", "triton")):
        model = CausalLM(_config("gdn2", backend))
        assert {m.backend for m in model.modules() if isinstance(m, SwiGLU)} == {expected}
        shapes[backend] = {n: p.shape for n, p in model.named_parameters() if ".ffn." in n}
    assert shapes["chunk"] == shapes["auto"] == shapes["triton"]
    assert set(shapes["auto"]["model.blocks.0.ffn.gate_up.weight"]) == {32, 72}


@needs_triton
@pytest.mark.parametrize("mixer", ["gdn2", "transformer"])
def test_a_model_on_triton_gives_the_chunk_backends_loss_and_gradients(mixer):
    """A tiny model with its FFNs' gating (and its norms and delta rule) on Triton against the
    same weights on the PyTorch paths ("chunk"), float32; F = 36 is not a power of 2."""
    from deltalab.models import CausalLM

    ids = torch.randint(0, 50, (2, 20), generator=torch.Generator().manual_seed(0))

    def run(backend):
        torch.manual_seed(0)
        model = CausalLM(_config(mixer, backend)).to(DEVICE)
        loss = model(ids.to(DEVICE), labels=ids.to(DEVICE)).loss
        loss.backward()
        return loss.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()}

    loss, grads = run("triton")
    ref_loss, ref_grads = run("chunk")
    assert abs(float(loss - ref_loss)) <= 1e-5 * abs(float(ref_loss))
    for name, grad in grads.items():
        assert_close(grad, ref_grads[name], 1e-5, name)


@needs_triton
def test_gate_sensitivity_runs_on_a_model_built_for_triton():
    """Gate-sensitivity probes (forward-mode AD) switch the FFNs' gating to the torch path with
    the norms and give it back: no Triton SwiGLU runs in a probe, and the report equals the
    all-PyTorch model's. (The Triton Function's own jvp is checked above.)"""
    from deltalab.analysis import gate_sensitivity
    from deltalab.models import CausalLM
    from deltalab.models.lm import SwiGLU
    from deltalab.ops.swiglu import triton as kernels

    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))

    def report(backend):
        torch.manual_seed(0)
        model = CausalLM(_config("gdn2", backend, num_layers=1)).to(DEVICE).eval()
        loss = lambda m, b: m(input_ids=b, labels=b).loss  # noqa: E731
        result = gate_sensitivity(model, ids.to(DEVICE), probes=1, seed=0, loss_fn=loss)
        found = {m.backend for m in model.modules() if isinstance(m, SwiGLU)}
        assert found == {"torch" if backend == "chunk" else backend}
        return result

    def no_jvp(*args):
        raise AssertionError("a probe ran the Triton SwiGLU")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels._SwiGLU, "jvp", staticmethod(no_jvp))
        triton_report = report("triton")
    torch_report = report("chunk")
    for table in ("state", "loss"):
        ours, theirs = getattr(triton_report, table), getattr(torch_report, table)
        for layer, gates in theirs.items():
            for gate, value in gates.items():
                assert ours[layer][gate] == pytest.approx(value, rel=1e-6), (table, layer, gate)


@pytest.mark.skipif(not CUDA or NO_TRITON is not None, reason="bfloat16 kernels: CUDA only")
def test_triton_bfloat16_is_as_close_to_float64_as_the_torch_path(generator):
    """bfloat16 gate_up and dh (the projection's output under autocast): the kernels compute in
    float32 and round once, at the store; the torch path rounds silu(gate) first."""
    gate_up, dh = draw(generator, 4, 512, 2 * 344), draw(generator, 4, 512, 344)
    expected = with_grad(gate_up, dh, "naive", F64, "cpu")
    errors = {}
    for backend in ("triton", "torch"):
        actual = with_grad(gate_up, dh, backend, torch.bfloat16)
        assert_pair_close(actual, expected, TOLERANCE[torch.bfloat16], backend)
        errors[backend] = [relative_error(a, e) for a, e in zip(actual, expected, strict=True)]
    assert all(t <= 1.05 * r for t, r in zip(*errors.values(), strict=True)), errors
