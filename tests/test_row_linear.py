"""`deltalab.ops.row_linear`: the kernel and the torch path against the float64 definition on
fresh random inputs, and its argument checks."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import needs_triton

from deltalab.layers.norms import RMSNorm
from deltalab.ops._triton import (
    INTERPRET,
    dependent_launch,
    dependent_launch_unsupported_reason,
    triton_unavailable_reason,
)
from deltalab.ops.norms.reference import rms_norm_torch
from deltalab.ops.row_linear import (
    MAX_TRITON_ROWS,
    products_backend,
    resolve_backend,
    row_linear,
    row_linear_naive,
)
from deltalab.ops.swiglu import swiglu
from deltalab.testing import relative_error

# (rows, outputs, K): one row as a decoding step makes, rows past one, a K of several blocks
# (1100: two blocks of 1024, the second partial), outputs not a multiple of the block, and the
# many rows of a batched decoding step (backend="triton" runs the same kernel at any rows).
SHAPES = [(1, 40, 48), (3, 17, 1100), (2, 64, 256), (20, 40, 300), (64, 70, 1100)]
# The kernel's tensors: CUDA's where it compiles, else CPU's for the interpreter.
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


def inputs(shape, generator, bias: bool, residual: bool):
    """x a column slice of a wider product (row stride 2K), as the decoder's second product is;
    the bias a strided view and the residual rows of a wider tensor, which the kernel must read
    by their strides or pack."""
    rows, outputs, width = shape
    x = torch.randn(rows, 2 * width, generator=generator)[:, :width]
    weight = torch.randn(outputs, width, generator=generator) / width**0.5
    b = torch.randn(2 * outputs, generator=generator)[::2] if bias else None
    r = torch.randn(rows, outputs + 3, generator=generator)[:, 3:] if residual else None
    return tuple(None if t is None else t.to(DEVICE) for t in (x, weight, b, r))


@pytest.mark.parametrize("backend", [
    "torch", pytest.param("triton", marks=[pytest.mark.interpreter, needs_triton])
])  # fmt: skip
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize(("bias", "residual"), [(False, False), (True, False), (False, True),
                                                (True, True)])  # fmt: skip
def test_row_linear_matches_the_float64_definition(generator, backend, shape, bias, residual):
    x, weight, b, r = inputs(shape, generator, bias, residual)
    got = row_linear(x, weight, b, r, backend=backend)
    as64 = [None if t is None else t.double() for t in (b, r)]
    expected = row_linear(x.double(), weight.double(), *as64, backend="naive")
    assert got.dtype == x.dtype and got.shape == expected.shape
    assert relative_error(got, expected) < 1e-5


@pytest.mark.parametrize("backend", [
    "torch", pytest.param("triton", marks=[pytest.mark.interpreter, needs_triton])
])  # fmt: skip
def test_row_linear_of_no_columns_is_the_bias_and_the_residual(backend):
    x, weight = torch.zeros(2, 0, device=DEVICE), torch.zeros(3, 0, device=DEVICE)
    bias, residual = torch.ones(3, device=DEVICE), torch.full((2, 3), 2.0, device=DEVICE)
    assert torch.equal(row_linear(x, weight, bias, residual, backend=backend).cpu(),
                       torch.full((2, 3), 3.0))  # fmt: skip


def test_auto_takes_the_kernel_on_cuda_for_a_few_rows_only():
    x = torch.zeros(1, 8)
    assert resolve_backend("auto", x) == "torch"  # CPU: the interpreter is asked for by name
    assert resolve_backend("auto", x.double()) == "torch"
    if torch.cuda.is_available() and triton_unavailable_reason(torch.device("cuda")) is None:
        assert resolve_backend("auto", x.cuda()) == "triton"
        many = torch.zeros(MAX_TRITON_ROWS + 1, 8, device="cuda")
        assert resolve_backend("auto", many) == "torch"
        assert resolve_backend("auto", x.cuda().double()) == "torch"


@pytest.mark.parametrize(
    ("layer", "rows", "dtype", "expected"),
    [
        ("triton", 1, torch.float32, "triton"),
        ("triton", MAX_TRITON_ROWS + 1, torch.float32, "auto"),
        ("triton", 1, torch.float64, "auto"),
        ("auto", 1, torch.bfloat16, "auto"),
        ("chunk", 1, torch.float32, "torch"),
        ("naive", 1, torch.float32, "torch"),
    ],
)
def test_a_layers_products_take_the_kernel_only_where_the_op_offers_it(
    layer, rows, dtype, expected
):
    assert products_backend(layer, torch.zeros(rows, 8, dtype=dtype)) == expected


X = torch.zeros(2, 8)
SHARED = torch.zeros(2, 8)  # one memory for two operands


@pytest.mark.parametrize("backend", [
    "torch", pytest.param("triton", marks=[pytest.mark.interpreter, needs_triton])
])  # fmt: skip
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_norm_in_the_product_matches_the_float64_definition(generator, backend, shape):
    x, weight, b, r = inputs(shape, generator, bias=True, residual=True)
    x = 3.0 * x + 0.5  # a mean square far from 1, so a missing norm cannot pass
    scale = 1.0 + torch.rand(shape[2], generator=generator).to(DEVICE)
    got = row_linear(x, weight, b, r, norm_weight=scale, norm_eps=1e-3, backend=backend)
    expected = row_linear_naive(x.double(), weight.double(), b.double(), r.double(),
                                scale.double(), 1e-3)  # fmt: skip
    by_parts = RMSNorm(shape[2], eps=1e-3, backend="naive").to(DEVICE)
    by_parts.weight.data.copy_(scale)
    assert relative_error(got, expected) < 1e-5
    assert relative_error(got, row_linear(by_parts(x), weight, b, r, backend="torch")) < 1e-5


@pytest.mark.parametrize("backend", [
    "torch", pytest.param("triton", marks=[pytest.mark.interpreter, needs_triton])
])  # fmt: skip
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_swiglu_in_the_product_matches_the_float64_definition(generator, backend, shape):
    """x `[M, 2K]`: the product takes silu(gate) * up, gate the first K columns (a gate and
    up of other scales, so that a swapped half or a missing gate cannot pass)."""
    rows, outputs, width = shape
    gate_up = torch.cat([2.0 * torch.randn(rows, width, generator=generator),
                         0.5 + torch.randn(rows, width, generator=generator),
                         torch.randn(rows, 5, generator=generator)], 1)  # fmt: skip
    gate_up = gate_up.to(DEVICE)[:, : 2 * width]  # rows 2K + 5 apart: read by their stride
    _, weight, b, r = inputs(shape, generator, bias=True, residual=True)
    got = row_linear(gate_up, weight, b, r, swiglu=True, backend=backend)
    expected = row_linear_naive(gate_up.double(), weight.double(), b.double(), r.double(),
                                swiglu=True)  # fmt: skip
    by_parts = row_linear(swiglu(gate_up, backend="naive"), weight, b, r, backend="torch")
    assert got.shape == (rows, outputs)
    assert relative_error(got, expected) < 1e-5
    assert relative_error(got, by_parts) < 1e-5
    swapped = torch.cat([gate_up[:, width:], gate_up[:, :width]], 1)
    assert relative_error(row_linear_naive(swapped.double(), weight.double(), b.double(),
                                           r.double(), swiglu=True), expected) > 1e-2  # fmt: skip


@pytest.mark.parametrize("backend", [
    "torch", "naive", pytest.param("triton", marks=[pytest.mark.interpreter, needs_triton])
])  # fmt: skip
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [3, 40])  # a few rows, many
def test_out_equal_to_the_residual_sums_into_it_in_place(generator, backend, bias, rows):
    x, weight, b, r = inputs((rows, 17, 1100), generator, bias, residual=True)
    residual = r.clone()  # packed rows, as the decoder's residual stream is
    expected = row_linear(x, weight, b, residual, backend=backend)
    got = row_linear(x, weight, b, residual, out=residual, backend=backend)
    assert got.data_ptr() == residual.data_ptr()
    assert relative_error(got, expected) < 1e-6


@pytest.mark.parametrize("backend", [
    "torch", pytest.param("triton", marks=[pytest.mark.interpreter, needs_triton])
])  # fmt: skip
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [2, 40])  # a few rows, many
def test_out_without_a_residual_receives_the_product(generator, backend, bias, rows):
    x, weight, b, _ = inputs((rows, 40, 48), generator, bias, residual=False)
    out = torch.full((rows, 45), float("nan"), device=DEVICE)[:, 5:]  # rows apart by 45
    got = row_linear(x, weight, b, out=out, backend=backend)
    assert got.data_ptr() == out.data_ptr() and not out.isnan().any()
    assert relative_error(got, row_linear(x, weight, b, backend="naive")) < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="bfloat16: a CUDA GPU")
@pytest.mark.parametrize("rows", [4, 64])  # a few rows, many
def test_the_norm_in_the_product_rounds_the_normalized_row_to_xs_dtype(generator, rows):
    """Each output adds two normalized columns (weight rows e_2i + e_2i+1), so the sum of the
    rounded columns, what the norm module's output gives the product, differs from the sum of
    unrounded ones in a share of the outputs; the kernel gives the former (up to the rare
    rounding that the order of the mean square's sum may flip)."""
    width = 512
    x = torch.randn(rows, width, generator=generator).to(DEVICE, torch.bfloat16)
    scale = (1.0 + torch.rand(width, generator=generator)).to(DEVICE, torch.bfloat16)
    weight = torch.zeros(width // 2, width, device=DEVICE, dtype=torch.bfloat16)
    pairs = torch.arange(width // 2, device=DEVICE)
    weight[pairs, 2 * pairs] = weight[pairs, 2 * pairs + 1] = 1.0
    normed = rms_norm_torch(x, scale, 1e-5)  # float32, the module's before its rounding
    rounded = normed.to(torch.bfloat16).float()
    expected = (rounded[:, 0::2] + rounded[:, 1::2]).to(torch.bfloat16)
    unrounded = (normed[:, 0::2] + normed[:, 1::2]).to(torch.bfloat16)
    got = row_linear(x, weight, norm_weight=scale, norm_eps=1e-5, backend="triton")
    assert (expected != unrounded).float().mean() > 0.05  # the two are told apart here
    assert (got != expected).float().mean() < 0.01


@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="bfloat16: a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 4])
def test_swiglu_in_the_product_rounds_the_gated_row_to_xs_dtype(generator, rows):
    """As the norm's test below: each output adds two gated columns, so the sum of the rounded
    columns (what `swiglu`'s output gives the product) differs from the unrounded sum in a share
    of the outputs; the kernel gives the former, bit for bit with `swiglu`'s kernel."""
    width = 512
    gate_up = torch.randn(rows, 2 * width, generator=generator).to(DEVICE, torch.bfloat16)
    weight = torch.zeros(width // 2, width, device=DEVICE, dtype=torch.bfloat16)
    pairs = torch.arange(width // 2, device=DEVICE)
    weight[pairs, 2 * pairs] = weight[pairs, 2 * pairs + 1] = 1.0
    gated = swiglu(gate_up.float(), backend="torch")  # float32, before any rounding
    rounded = gated.to(torch.bfloat16).float()
    expected = (rounded[:, 0::2] + rounded[:, 1::2]).to(torch.bfloat16)
    unrounded = (gated[:, 0::2] + gated[:, 1::2]).to(torch.bfloat16)
    got = row_linear(gate_up, weight, swiglu=True, backend="triton")
    assert (expected != unrounded).float().mean() > 0.05  # the two are told apart here
    assert torch.equal(got, row_linear(swiglu(gate_up, backend="triton"), weight,
                                       backend="triton"))  # fmt: skip
    assert (got != expected).float().mean() < 0.01


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"x": torch.zeros(2, 1, 8)}, "x must be"),
        ({"swiglu": True, "x": torch.zeros(2, 7)}, "swiglu: x must be"),
        ({"swiglu": True, "norm_weight": torch.zeros(4)}, "give norm_weight=None"),
        ({"swiglu": True}, r"weight must have shape .*K = x.shape\[1\] / 2"),
        ({"swiglu": 1}, "swiglu must be a bool"),
        ({"weight": torch.zeros(4, 7)}, "weight must have shape"),
        ({"bias": torch.zeros(5)}, "bias"),
        ({"residual": torch.zeros(2, 5)}, "residual"),
        ({"bias": torch.zeros(4, dtype=torch.float64)}, "bias must have x's dtype"),
        ({"backend": "cublas"}, "backend must be one of"),
        ({"norm_weight": torch.zeros(7)}, "norm_weight must have shape"),
        ({"out": torch.zeros(2, 5)}, "out must have shape"),
        ({"out": torch.zeros(2, 4, dtype=torch.float64)}, "out must have x's dtype"),
        ({"out": torch.zeros(4, 2).t()}, "out must have unit column stride"),
        ({"out": X[:, :4]}, "out shares memory with x"),
        ({"out": torch.zeros(1, 4).expand(2, 4)}, "out's rows overlap"),
        ({"residual": SHARED[:, :4], "out": SHARED[:, 1:5]}, "out shares memory with residual"),
        ({"norm_weight": SHARED[0], "out": SHARED[1].view(2, 4)}, "out shares memory with norm_w"),
    ],
)
def test_row_linear_refuses_bad_arguments_naming_them(change, match):
    arguments = {"x": X, "weight": torch.zeros(4, 8), "bias": None,
                 "residual": None, "backend": "torch"} | change  # fmt: skip
    backend = arguments.pop("backend")
    with pytest.raises((ValueError, TypeError), match=match):
        row_linear(**arguments, backend=backend)


def test_dependent_launch_is_off_where_unsupported_and_refused_when_asked_for_there():
    cpu = torch.device("cpu")
    assert dependent_launch(cpu) is False and dependent_launch(cpu, False) is False
    with pytest.raises(ValueError, match=r"dependent=True: (the interpreter|dependent launch is)"):
        dependent_launch(cpu, True)
    with pytest.raises(TypeError, match="launch must be a bool or None"):
        dependent_launch(cpu, 1, "launch")


@pytest.mark.parametrize(
    ("settings", "reason"),
    [
        ({"interpret": True}, "the interpreter"),
        ({"hip": "6.4"}, r"NVIDIA GPUs; got cuda:0 \(ROCm 6.4\)"),
        ({"triton_version": "3.4.0"}, "needs Triton 3.5 or later, got 3.4.0"),
        ({"triton_version": None}, "needs Triton 3.5 or later, got None"),
        ({"driver": 12020}, "needs a CUDA 12.3 driver or later, got 12020"),
        ({"driver": None}, "needs a CUDA 12.3 driver or later, got None"),
    ],
)
def test_dependent_launch_names_why_a_card_or_build_cannot_have_it(settings, reason):
    """Checked before the card is asked for its capability: runs without a GPU."""
    cuda = torch.device("cuda", 0)
    given = {"interpret": False, "hip": None, "triton_version": "3.6.0", "driver": 12080}
    given |= settings
    assert re.search(reason, dependent_launch_unsupported_reason(cuda, **given))


DEPENDENT = torch.cuda.is_available() and dependent_launch(torch.device("cuda"))


@pytest.mark.skipif(not DEPENDENT, reason="dependent launch: an NVIDIA GPU of capability 9+")
def test_products_launched_dependent_give_the_bits_of_products_launched_in_turn(generator):
    """16 products in one CUDA graph, each normalizing the last one's output and summing into
    it (as a decoder's blocks chain them), the graph replayed thrice: the same bits with
    dependent launch as without. A kernel that read before its wait would read a stale row."""
    from deltalab.ops.row_linear.triton import row_linear_triton

    width = 1024
    weights = [(torch.randn(width, width, generator=generator) / width**0.5).to(DEVICE).bfloat16()
               for _ in range(16)]  # fmt: skip
    scale = torch.rand(width, generator=generator).add(0.5).to(DEVICE).bfloat16()
    start = torch.randn(1, width, generator=generator).to(DEVICE).bfloat16()

    def replayed(dependent: bool) -> torch.Tensor:
        h = start.clone()
        outs = [torch.empty_like(start) for _ in weights]

        def chain() -> None:
            x = h
            for w, out in zip(weights, outs, strict=True):
                x = row_linear_triton(x, w, None, x, scale, 1e-5, out, dependent=dependent)
            h.copy_(x / x.abs().amax())

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            chain()
        torch.cuda.current_stream().wait_stream(side)
        h.copy_(start)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        return h.clone()

    assert torch.equal(replayed(True), replayed(False))
