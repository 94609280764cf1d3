"""norms: the torch path is the layers' old path, the Triton kernels (forward, backward and the
forward-mode jvp) match the float64 formula, and the layers and models dispatch to them.

The Triton tests run on a CUDA GPU, or on CPU tensors under Triton's interpreter:

    TRITON_INTERPRET=1 python -m pytest tests/test_norms.py

(README's test command runs this file a second time with it set); skipped otherwise. Shapes are
tiny: the interpreter runs every operation of a kernel in Python.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deltalab.layers import norms as layer_norms
from deltalab.ops import norms
from deltalab.ops._triton import INTERPRET, triton_unavailable_reason
from deltalab.ops.norms import l2_normalize, layer_backend, resolve_backend, rms_norm
from deltalab.ops.norms.reference import l2_normalize_naive
from deltalab.testing import TOLERANCE, assert_close, forward_tangent

pytestmark = pytest.mark.interpreter

F64 = torch.float64
CUDA = torch.cuda.is_available() and not INTERPRET
DEVICE = "cuda" if CUDA else "cpu"
NO_TRITON = triton_unavailable_reason(torch.device(DEVICE))
needs_triton = pytest.mark.skipif(NO_TRITON is not None, reason=str(NO_TRITON))
# float32 kernels against the float64 formula: a few float32 ulps of row sums.
F32_TOL = 1e-5
GATED = [(False, "sigmoid"), (True, "sigmoid"), (True, "silu")]
GATED_IDS = ["plain", "sigmoid", "silu"]


def norm_inputs(generator, shape):
    """x, weight `[N]`, gate, dy: float64, random normal (weight around 1, as trained)."""

    def draw(*s):
        return torch.randn(*s, generator=generator, dtype=F64)

    return draw(*shape), 1 + 0.3 * draw(shape[-1]), 2 * draw(*shape), draw(*shape)


def rms_with_grads(inputs, backend, dtype, gated, activation, device=DEVICE, table=None, **kw):
    """y and the gradients of x, weight (and gate) of sum(y * dy), as float64 CPU tensors; with
    a launch `table`, by the Triton kernels launched by it."""
    x, weight, gate, dy = inputs
    leaves = [t.detach().to(device, dtype).requires_grad_() for t in (x, weight, gate)]
    if not gated:
        leaves = leaves[:2]
    args = (*leaves[:2], 1e-5, *(leaves[2:3] or [None]), activation)
    if table is None:
        y = rms_norm(*args, backend=backend, **kw)
    else:
        from deltalab.ops.norms.triton import rms_norm_triton

        y = rms_norm_triton(*args, None, table=table)
    grads = torch.autograd.grad((y * dy.to(device, y.dtype)).sum(), leaves)
    return [t.detach().cpu().to(F64) for t in (y, *grads)]


def l2_with_grads(inputs, backend, dtype, device=DEVICE):
    x, _, _, dy = inputs
    leaf = x.detach().to(device, dtype).requires_grad_()
    y = l2_normalize(leaf, backend=backend)
    (grad,) = torch.autograd.grad((y * dy.to(device, y.dtype)).sum(), leaf)
    return [y.detach().cpu().to(F64), grad.cpu().to(F64)]


NAMES = ["y", "dx", "dweight", "dgate"]


def assert_all_close(actual, expected, tol, what=""):
    assert len(actual) == len(expected)
    for name, a, e in zip(NAMES, actual, expected, strict=False):
        assert_close(a, e, tol, f"{what} {name}")


@pytest.mark.parametrize(("gated", "activation"), GATED, ids=GATED_IDS)
def test_torch_path_is_the_layers_rms_norm_bit_for_bit(generator, gated, activation):
    """The op's "torch" backend and the norm modules' eager path (which calls the torch form
    directly, without the op's checks): the same output and gradients, bit for bit."""
    inputs = norm_inputs(generator, (2, 5, 16))
    ours = rms_with_grads(inputs, "torch", torch.float32, gated, activation, "cpu")
    x, weight, gate, dy = (t.float().requires_grad_() for t in inputs)
    if gated:
        module = layer_norms.GatedRMSNorm(16, activation=activation)
        call = lambda x: module(x, gate, backend="torch")  # noqa: E731
    else:
        module = layer_norms.RMSNorm(16, backend="torch")
        call = module
    with torch.no_grad():
        module.weight.copy_(weight)
    y = call(x)
    grads = torch.autograd.grad(
        (y * dy).sum(), [x, module.weight, gate] if gated else [x, module.weight]
    )
    for a, b in zip(ours, (y, *grads), strict=True):
        assert torch.equal(a, b.double())


def test_torch_l2_path_computes_the_formulas_output_bit_for_bit_and_its_gradient(generator):
    inputs = norm_inputs(generator, (2, 5, 16))
    x, dy = inputs[0].float().requires_grad_(), inputs[3].float()
    y = l2_normalize_naive(x, 1e-6)
    (grad,) = torch.autograd.grad((y * dy).sum(), x)
    ours = l2_with_grads(inputs, "torch", torch.float32, "cpu")
    assert torch.equal(ours[0], y.double())
    # The adjoint from the output, r (dy - y (y . dy)), not autograd's path through the formula.
    assert_close(ours[1], grad.double(), 1e-6, "dx")
    exact = l2_with_grads(inputs, "torch", F64, "cpu")
    assert_all_close(exact, l2_with_grads(inputs, "naive", F64, "cpu"), TOLERANCE[F64])


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_l2_normalize_keeps_its_output_and_one_number_per_row_not_its_input(backend):
    # The layers' q and k: the delta rule keeps the normalized ones anyway; the input (the
    # short convolution's output) would be kept by the norm alone. bfloat16 as trained, but
    # float32 under the Triton interpreter (which computes bfloat16 wrongly).
    device = DEVICE if backend == "triton" else "cpu"
    dtype = torch.float32 if backend == "triton" and device == "cpu" else torch.bfloat16
    x = torch.randn(2, 5, 3, 16, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    x.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = l2_normalize(x * 1.0, backend=backend)
    storages = {t.untyped_storage().data_ptr(): t for t in saved}
    assert y.untyped_storage().data_ptr() in storages
    others = [t for p, t in storages.items() if p != y.untyped_storage().data_ptr()]
    assert [t.numel() for t in others] == [2 * 5 * 3]  # 1/norm per row
    assert others[0].dtype == torch.float32
    # With its gradient from y: the formula's within bf16 rounding.
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(device)
    (grad,) = torch.autograd.grad((y.float() * dy).sum(), x)
    xd = x.detach().double().requires_grad_()
    (exact,) = torch.autograd.grad((l2_normalize_naive(xd, 1e-6) * dy.double()).sum(), xd)
    assert (grad.double() - exact).norm() <= 2**-7 * exact.norm()


@pytest.mark.parametrize(("gated", "activation"), GATED, ids=GATED_IDS)
def test_naive_formula_and_torch_path_agree_in_float64(generator, gated, activation):
    inputs = norm_inputs(generator, (3, 7))
    naive = rms_with_grads(inputs, "naive", F64, gated, activation, "cpu")
    torch_path = rms_with_grads(inputs, "torch", F64, gated, activation, "cpu")
    assert_all_close(torch_path, naive, TOLERANCE[F64])


@needs_triton
@pytest.mark.parametrize(("gated", "activation"), GATED, ids=GATED_IDS)
@pytest.mark.parametrize("shape", [(2, 3, 16), (5, 37), (2, 3, 2, 100), (1, 5)])
def test_triton_rms_norm_matches_naive_float64_with_gradients(
    generator, poisoned_empty, shape, gated, activation
):
    """Odd widths (37, 100: not powers of 2, masked columns), leading batch dims, one row;
    every gradient: x, weight, gate."""
    inputs = norm_inputs(generator, shape)
    expected = rms_with_grads(inputs, "naive", F64, gated, activation, "cpu")
    actual = rms_with_grads(inputs, "triton", torch.float32, gated, activation)
    assert_all_close(actual, expected, F32_TOL, f"{shape} {activation if gated else 'plain'}")


@needs_triton
@pytest.mark.parametrize("shape", [(2, 3, 16), (5, 37), (3, 2, 2, 100)])
def test_triton_l2_normalize_matches_naive_float64_with_gradients(generator, poisoned_empty, shape):
    inputs = norm_inputs(generator, shape)
    expected = l2_with_grads(inputs, "naive", F64, "cpu")
    actual = l2_with_grads(inputs, "triton", torch.float32)
    assert_all_close(actual, expected, F32_TOL, str(shape))


@needs_triton
def test_triton_weight_gradient_sums_over_many_programs(generator, poisoned_empty):
    """More row blocks than backward programs, and programs whose last blocks run past the
    rows: each program's partial dweight is summed once."""
    from deltalab.ops.norms import triton as kernels

    small = {"forward_elements": 32, "backward_elements": 32, "backward_programs": 3}
    table = dataclasses.replace(kernels.LAUNCH, **small)
    # 21 rows of 16 in blocks of 2: 11 row blocks over 3 programs of 4 (the last one 3).
    assert kernels.launch(21, 16, "backward", table)[0] == 2
    inputs = norm_inputs(generator, (7, 3, 16))
    expected = rms_with_grads(inputs, "naive", F64, True, "silu", "cpu")
    actual = rms_with_grads(inputs, "triton", torch.float32, True, "silu", table=table)
    assert_all_close(actual, expected, F32_TOL)


@needs_triton
def test_triton_reads_strided_inputs_as_the_layers_pass_them(generator):
    """The layers' q and k come from the short convolution as a transposed view ([B, C, T]
    memory seen as [B, T, C], then split into heads: the last dim is strided); a gate and x
    taken every other row."""
    x = torch.randn(2, 24, 5, generator=generator, dtype=F64).transpose(1, 2)
    heads = x.unflatten(-1, (2, 12))
    dy = torch.randn(heads.shape, generator=generator, dtype=F64)
    for backend, dtype in (("naive", F64), ("triton", torch.float32)):
        leaf = heads.detach().to(DEVICE, dtype).requires_grad_()
        y = l2_normalize(leaf, backend=backend)
        (grad,) = torch.autograd.grad((y * dy.to(DEVICE, dtype)).sum(), leaf)
        if backend == "naive":
            expected = (y, grad)
        else:
            assert_close(y.cpu(), expected[0], F32_TOL, "strided l2 y")
            assert_close(grad.cpu(), expected[1], F32_TOL, "strided l2 dx")
    inputs = norm_inputs(generator, (6, 3, 20))
    strided = [inputs[0][::2], inputs[1], inputs[2][::2], inputs[3][::2]]
    expected = rms_with_grads(strided, "naive", F64, True, "sigmoid", "cpu")
    actual = rms_with_grads(strided, "triton", torch.float32, True, "sigmoid")
    assert_all_close(actual, expected, F32_TOL, "every other row")


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, F64])
def test_triton_writes_the_requested_dtype_computed_in_float32(generator, dtype):
    """out_dtype None: the compute dtype, as the torch path returns (float32 for float16, float64
    for float64); the layers ask for x's. Gradients come back in their inputs' dtypes."""
    x, weight, gate, _ = (t.to(DEVICE, dtype) for t in norm_inputs(generator, (4, 24)))
    expected = norms.rms_norm(x, weight, 1e-5, gate, backend="naive")
    for out_dtype in (None, dtype):
        y = rms_norm(x, weight, 1e-5, gate, out_dtype=out_dtype, backend="triton")
        assert y.dtype == expected.to(out_dtype or expected.dtype).dtype
        tol = 1e-3 if y.dtype == torch.float16 else F32_TOL
        assert_close(y.cpu(), expected.cpu(), tol, f"{dtype} -> {y.dtype}")
    assert l2_normalize(x, backend="triton").dtype == dtype
    leaves = [t.requires_grad_() for t in (x, weight, gate)]
    y = rms_norm(*leaves[:2], 1e-5, leaves[2], out_dtype=dtype, backend="triton")
    grads = torch.autograd.grad(y.sum(), leaves)
    assert [g.dtype for g in grads] == [dtype] * 3


@needs_triton
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("activation", ["sigmoid", "silu"])
def test_triton_gate_saturates_without_nan(generator, activation):
    x, weight, _, dy = norm_inputs(generator, (3, 8))
    gate = torch.tensor([-200.0, -90.0, 0.0, 90.0, 200.0, -1e4, 1e4, 3.0]).expand(3, 8)
    inputs = (x, weight, gate.double(), dy)
    expected = rms_with_grads(inputs, "naive", F64, True, activation, "cpu")
    actual = rms_with_grads(inputs, "triton", torch.float32, True, activation)
    assert all(bool(torch.isfinite(t).all()) for t in actual)
    assert_all_close(actual, expected, F32_TOL, activation)


@needs_triton
@pytest.mark.parametrize(("gated", "activation"), GATED, ids=GATED_IDS)
def test_triton_forward_mode_derivative_matches_the_torch_path(generator, gated, activation):
    """The jvp (gate-sensitivity probes push tangents through the norms) of every input."""
    x, weight, gate, _ = norm_inputs(generator, (2, 3, 20))
    primals = [x, weight, gate] if gated else [x, weight]
    tangents = [torch.randn(p.shape, generator=generator, dtype=F64) for p in primals]

    def run(backend, dtype):
        ps = [p.to(DEVICE, dtype) for p in primals]
        ts = [t.to(DEVICE, dtype) for t in tangents]

        def fn(*args):
            return rms_norm(*args[:2], 1e-5, *args[2:3] or [None], activation, backend=backend)

        return forward_tangent(fn, ps, ts).cpu().double()

    assert_close(run("triton", torch.float32), run("torch", F64), F32_TOL, "rms jvp")
    l2 = [
        forward_tangent(lambda t, b=b, d=d: l2_normalize(t, backend=b), [x.to(DEVICE, d)],
             [tangents[0].to(DEVICE, d)]).cpu().double()
        for b, d in (("triton", torch.float32), ("torch", F64))
    ]  # fmt: skip
    assert_close(l2[0], l2[1], F32_TOL, "l2 jvp")


def test_backends_follow_the_delta_rule_and_auto_takes_triton_only_on_cuda():
    assert [layer_backend(b) for b in ("auto", "triton", "chunk", "naive")] == [
        "auto", "triton", "torch", "torch",
    ]  # fmt: skip
    cpu = torch.zeros(2, 8)
    assert resolve_backend("auto", cpu) == "torch"
    assert resolve_backend("torch", cpu) == "torch"
    if torch.cuda.is_available() and NO_TRITON is None:
        assert resolve_backend("auto", cpu.cuda()) == "triton"
        assert resolve_backend("auto", cpu.cuda().double()) == "torch"
        assert resolve_backend("auto", torch.zeros(1, 20000, device="cuda")) == "torch"


def test_models_give_their_norms_the_configs_backend():
    from deltalab.models import CausalLM, DeltaLabConfig

    for backend, expected in (("chunk", "torch"), ("auto", "auto")):
        config = DeltaLabConfig(
            mixer="gdn2", hidden_size=32, num_layers=1, num_heads=2, head_dim=16, vocab_size=50,
            chunk_size=16, backend=backend, attention_layers=[0],
        )  # fmt: skip
        model = CausalLM(config)
        found = {m.backend for m in model.modules() if isinstance(m, layer_norms.RMSNorm)}
        assert found == {expected}


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"backend": "fast"}, ValueError, "backend must be one of"),
        ({"activation": "relu"}, ValueError, "activation must be one of"),
        ({"weight": torch.ones(7)}, ValueError, "weight must have shape"),
        ({"gate": torch.ones(3, 7)}, ValueError, "gate must have shape"),
        ({"x": torch.ones(3, 8, dtype=torch.int64)}, TypeError, "x must be a floating-point"),
    ],
)
def test_bad_inputs_are_refused_naming_the_argument(kwargs, error, message):
    args = {"x": torch.ones(3, 8), "weight": torch.ones(8), "eps": 1e-5, **kwargs}
    with pytest.raises(error, match=message):
        rms_norm(**args)


@pytest.mark.skipif(NO_TRITON is None, reason="Triton runs here")
def test_triton_backend_says_why_it_cannot_run():
    with pytest.raises(RuntimeError, match='backend="triton" cannot run here'):
        l2_normalize(torch.ones(2, 4), backend="triton")


@needs_triton
@pytest.mark.parametrize("mixer", ["gdn2", "transformer"])
def test_a_model_on_triton_gives_the_torch_paths_loss_and_gradients(mixer):
    """A tiny model with every norm (block norms, q/k L2, gated output norm) and the delta rule on
    Triton against the same weights on the PyTorch paths ("chunk"), float32."""
    from deltalab.models import CausalLM, DeltaLabConfig

    ids = torch.randint(0, 50, (2, 20), generator=torch.Generator().manual_seed(0))

    def run(backend):
        config = DeltaLabConfig(
            mixer=mixer, hidden_size=32, num_layers=2, num_heads=2, head_dim=16, vocab_size=50,
            chunk_size=16, backend=backend,
        )  # fmt: skip
        torch.manual_seed(0)
        model = CausalLM(config).to(DEVICE)
        loss = model(ids.to(DEVICE), labels=ids.to(DEVICE)).loss
        loss.backward()
        return loss.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()}

    loss, grads = run("triton")
    ref_loss, ref_grads = run("chunk")
    assert abs(float(loss - ref_loss)) <= 1e-5 * abs(float(ref_loss))
    for name, grad in grads.items():
        assert_close(grad, ref_grads[name], 1e-5, name)


@pytest.mark.skipif(not CUDA or NO_TRITON is not None, reason="bfloat16 kernels: CUDA only")
@pytest.mark.parametrize(("gated", "activation"), GATED, ids=GATED_IDS)
def test_triton_bfloat16_is_as_close_to_float64_as_the_torch_path(generator, gated, activation):
    """bfloat16 x, gate and output (x's dtype, as the layers ask): the kernels round once, at
    the store, so their error is within the torch path's (which rounds the same result)."""
    inputs = norm_inputs(generator, (4, 64, 3, 128))
    expected = rms_with_grads(inputs, "naive", F64, gated, activation, "cpu")
    for backend in ("torch", "triton"):
        actual = rms_with_grads(
            inputs, backend, torch.bfloat16, gated, activation, out_dtype=torch.bfloat16
        )
        assert_all_close(actual, expected, TOLERANCE[torch.bfloat16], backend)
    expected = l2_with_grads(inputs, "naive", F64, "cpu")
    assert_all_close(l2_with_grads(inputs, "triton", torch.bfloat16), expected, 2e-2, "l2")


@needs_triton
def test_gate_sensitivity_probes_run_every_norm_on_the_torch_path_and_restore_them():
    """Gate-sensitivity probes switch the delta-rule layers (and with them the q/k and output
    norms) and the block norms to the PyTorch paths, and give them back their backend: the
    report equals the all-PyTorch model's. (The Triton norms' own jvp is checked above.)"""
    from deltalab.analysis import gate_sensitivity
    from deltalab.models import CausalLM, DeltaLabConfig
    from deltalab.ops.norms import triton as kernels

    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))

    def report(backend):
        config = DeltaLabConfig(
            mixer="gdn2", hidden_size=32, num_layers=1, num_heads=2, head_dim=16, vocab_size=50,
            chunk_size=16, backend=backend,
        )  # fmt: skip
        torch.manual_seed(0)
        model = CausalLM(config).to(DEVICE).eval()
        loss = lambda m, b: m(input_ids=b, labels=b).loss  # noqa: E731
        result = gate_sensitivity(model, ids.to(DEVICE), probes=1, seed=0, loss_fn=loss)
        norm_backends = {m.backend for m in model.modules() if isinstance(m, layer_norms.RMSNorm)}
        assert norm_backends == {norms.layer_backend(backend)}
        return result

    def no_jvp(*args):
        raise AssertionError("a probe ran a Triton norm")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels._Norm, "jvp", staticmethod(no_jvp))
        triton_report = report("triton")
    torch_report = report("chunk")
    for table in ("state", "loss"):
        ours, theirs = getattr(triton_report, table), getattr(torch_report, table)
        for layer, gates in theirs.items():
            for gate, value in gates.items():
                assert ours[layer][gate] == pytest.approx(value, rel=1e-6), (table, layer, gate)


def test_torch_l2_path_has_the_formulas_derivatives_of_every_order():
    # Its backward and jvp are torch ops on its differentiable outputs (y and 1/norm): second
    # derivatives, forward-mode and reverse-through-forward all follow the formula.
    x = torch.randn(3, 4, 6, dtype=F64, generator=torch.Generator().manual_seed(3))
    x.requires_grad_()

    def ours(t):
        return l2_normalize(t, backend="torch")

    assert torch.autograd.gradcheck(ours, (x,), check_forward_ad=True)
    assert torch.autograd.gradgradcheck(ours, (x,))
    tangent = torch.randn(x.shape, dtype=F64, generator=torch.Generator().manual_seed(4))

    def reverse_of_tangent(fn):
        (grad,) = torch.autograd.grad(forward_tangent(fn, (x,), (tangent,)).square().sum(), x)
        return grad

    naive = reverse_of_tangent(lambda t: l2_normalize_naive(t, 1e-6))
    assert_close(reverse_of_tangent(ours), naive, 1e-12, "reverse of the tangent")
