"""normed_linear: the Triton kernel against the float64 definition, the torch path against the
unfused modules (RMSNorm, nn.Linear, swiglu), and the arguments it refuses.

The Triton tests run on a CUDA GPU, or on CPU tensors under Triton's interpreter:

    TRITON_INTERPRET=1 python -m pytest tests/test_normed_linear.py

skipped otherwise. Shapes are tiny, the launch tables small, so that D spans several reduction
steps (the last one partial) and N several column blocks (the last one partial).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from deltalab.layers.norms import RMSNorm
from deltalab.ops._triton import INTERPRET, triton_unavailable_reason
from deltalab.ops.normed_linear import normed_linear, resolve_backend
from deltalab.ops.normed_linear.triton import LAUNCH, NormedLinearLaunch, ProductLaunch
from deltalab.ops.swiglu import swiglu
from deltalab.testing import TOLERANCE, assert_close, relative_error

pytestmark = pytest.mark.interpreter

F64 = torch.float64
CUDA = torch.cuda.is_available() and not INTERPRET
DEVICE = "cuda" if CUDA else "cpu"
NO_TRITON = triton_unavailable_reason(torch.device(DEVICE))
needs_triton = pytest.mark.skipif(NO_TRITON is not None, reason=str(NO_TRITON))
# float32 products of D = 40 terms against float64: a few float32 ulps.
F32_TOL = 1e-6
D, WIDTH = 40, 19  # D: 3 steps of 16; WIDTH: the output's columns, 2 blocks of 16
SMALL = ProductLaunch(block_n=16, block_k=16, num_warps=1, num_stages=1)
# Every row count on one product form: the broadcast (tl.dot never), tl.dot (from one row on).
TABLES = {
    "broadcast": NormedLinearLaunch(dot_rows=1 << 20, block_m=16, broadcast=SMALL, dot=SMALL),
    "dot": NormedLinearLaunch(dot_rows=1, block_m=16, broadcast=SMALL, dot=SMALL),
}
TERMS = {"plain": (), "residual": ("residual",), "bias": ("bias",),
         "residual_bias": ("residual", "bias")}  # fmt: skip


def draw(generator, *shape):
    return torch.randn(*shape, generator=generator, dtype=F64)


def inputs(generator, rows: int, epilogue: str, norm: bool, terms=()) -> dict:
    """float64 arguments of one call: x, weight and the optional ones asked for."""
    out = WIDTH if epilogue == "none" else 2 * WIDTH
    args = {"x": draw(generator, rows, D), "weight": draw(generator, out, D) / D**0.5,
            "epilogue": epilogue}  # fmt: skip
    if norm:
        args["norm_weight"] = 1 + 0.1 * draw(generator, D)
    if "residual" in terms:
        args["residual"] = draw(generator, rows, WIDTH)
    if "bias" in terms:
        args["bias"] = draw(generator, out)
    return args


def call(args: dict, dtype, backend: str, device="cpu", **options) -> torch.Tensor:
    """normed_linear on `args` moved to `device` in `dtype` (None: each in its own)."""
    moved = {k: v.to(device, dtype or v.dtype) if isinstance(v, torch.Tensor) else v
             for k, v in args.items()}  # fmt: skip
    with torch.no_grad():
        return normed_linear(**moved, backend=backend, **options)


@needs_triton
@pytest.mark.parametrize("form", list(TABLES))
@pytest.mark.parametrize("terms", list(TERMS))
@pytest.mark.parametrize("norm", [True, False], ids=["normed", "unnormed"])
@pytest.mark.parametrize("epilogue", ["none", "swiglu"])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_triton_matches_the_float64_definition(generator, rows, epilogue, norm, terms, form):
    args = inputs(generator, rows, epilogue, norm, TERMS[terms])
    got = call(args, torch.float32, "triton", DEVICE, table=TABLES[form])
    assert got.dtype == torch.float32 and got.shape == (rows, WIDTH)
    assert_close(got.cpu(), call(args, F64, "naive"), F32_TOL)


@needs_triton
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_triton_on_the_devices_own_table_matches_the_definition(generator, rows):
    """The shipped table (M = 1 and 3 on the broadcast, 17 on tl.dot), D and N inside one
    block of it."""
    args = inputs(generator, rows, "swiglu", True, ("residual", "bias"))
    assert_close(call(args, torch.float32, "triton", DEVICE).cpu(), call(args, F64, "naive"),
                 F32_TOL)  # fmt: skip


@needs_triton
@pytest.mark.parametrize("epilogue", ["none", "swiglu"])
def test_triton_with_one_output_column_matches_the_definition(generator, epilogue):
    """N = 1 (one column, or one gated column from two weight rows): compiled, Triton would
    make an int argument equal to 1 a constant, which the kernel must not take apart."""
    args = {"x": draw(generator, 3, D), "weight": draw(generator, 1 + (epilogue == "swiglu"), D),
            "norm_weight": 1 + 0.1 * draw(generator, D), "epilogue": epilogue}  # fmt: skip
    got = call(args, torch.float32, "triton", DEVICE)
    assert got.shape == (3, 1)
    assert_close(got.cpu(), call(args, F64, "naive"), F32_TOL)


@needs_triton
def test_triton_reads_rows_of_x_a_long_sequence_apart(generator):
    """x = h[:, -1] of h [B, T, D]: rows T * D apart (past 2^31 elements at long prompts
    and large batches, so the kernel's row offsets are 64-bit)."""
    h = draw(generator, 17, 5, D)
    args = {"x": h[:, -1], "weight": draw(generator, WIDTH, D), "epilogue": "none",
            "norm_weight": 1 + 0.1 * draw(generator, D)}  # fmt: skip
    assert args["x"].stride(0) == 5 * D
    got = call(args, torch.float32, "triton", DEVICE, table=TABLES["dot"])
    assert_close(got.cpu(), call(args, F64, "naive"), F32_TOL)


@needs_triton
@pytest.mark.parametrize("epilogue", ["none", "swiglu"])
def test_triton_on_float16_weights_rounds_where_the_torch_path_does(generator, epilogue):
    """float32 x and float16 weights (a model under autocast): the normed x rounded to float32
    then float16, the gating on the float16 product, as the unfused modules. The two differ by
    the order of the float32 sums only (nothing here); the normed x left unrounded differs by
    2.5e-4 to 6.5e-4."""
    args = inputs(generator, 3, epilogue, True)
    args = {k: v.half() if k in ("weight", "residual") else v.float() if k != "epilogue" else v
            for k, v in args.items()}  # fmt: skip
    got = call(args, None, "triton", DEVICE, table=TABLES["dot"]).cpu()
    torch_path = call(args, None, "torch")
    assert got.dtype == torch_path.dtype == torch.float16
    assert_close(got, torch_path, 5e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("epilogue", ["none", "swiglu"])
def test_torch_path_matches_the_unfused_modules(generator, dtype, epilogue):
    """RMSNorm module, nn.Linear, the swiglu op, the residual sum: bit for bit without gating or
    residual, to the dtype's rounding with them (swiglu's torch path rounds silu(gate) first)."""
    args = inputs(generator, 3, epilogue, True, ("residual",))
    norm = RMSNorm(D, eps=1e-5, backend="torch").to(dtype)
    linear = nn.Linear(D, args["weight"].shape[0], bias=False).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(args["norm_weight"])
        linear.weight.copy_(args["weight"])
        x, residual = args["x"].to(dtype), args["residual"].to(dtype)
        y = linear(norm(x))
        bare = call({**args, "residual": None}, dtype, "torch") if epilogue == "none" else None
        y = swiglu(y, backend="torch") if epilogue == "swiglu" else y
        expected = residual + y
    if bare is not None:
        assert torch.equal(bare, y)
    assert_close(call(args, dtype, "torch"), expected, TOLERANCE[dtype])


@pytest.mark.skipif(not CUDA, reason="bfloat16 kernels need a CUDA GPU (the interpreter has none)")
@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize(("width", "epilogue"), [(5376, "none"), (4800, "swiglu")])
def test_bfloat16_at_decoding_shapes_is_as_close_to_float64_as_the_unfused_path(
    generator, rows, width, epilogue
):
    """The 340M GDN-2 layer's first product and gate_up at D = 1024, on the card's own table:
    within a bfloat16 rounding of the torch path, and no farther from the float64 definition."""
    args = {"x": draw(generator, rows, 1024), "weight": draw(generator, width, 1024) / 32,
            "norm_weight": 1 + 0.1 * draw(generator, 1024), "epilogue": epilogue}  # fmt: skip
    got = call(args, torch.bfloat16, "triton", "cuda").cpu()
    torch_path = call(args, torch.bfloat16, "torch", "cuda").cpu()
    definition = call(args, F64, "naive")
    assert_close(got, torch_path, 4e-3)  # 2^-8: one bfloat16 rounding
    assert relative_error(got, definition) <= 1.1 * relative_error(torch_path, definition)


def test_torch_path_under_autocast_rounds_as_the_modules(generator):
    """float32 x and bfloat16 weights: the RMSNorm module's float32 output, cast to bfloat16
    by autocast for nn.Linear, bit for bit."""
    args = inputs(generator, 2, "none", True)
    norm = RMSNorm(D, backend="torch")
    linear = nn.Linear(D, WIDTH, bias=False)
    with torch.no_grad():
        norm.weight.copy_(args["norm_weight"])
        linear.weight.copy_(args["weight"])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = linear(norm(args["x"].float()))
        got = normed_linear(args["x"].float(), linear.weight.bfloat16(),
                            norm_weight=norm.weight, backend="torch")  # fmt: skip
    assert got.dtype == expected.dtype == torch.bfloat16 and torch.equal(got, expected)


@pytest.mark.parametrize("epilogue", ["none", "swiglu"])
def test_torch_path_and_definition_agree_in_float64(generator, epilogue):
    args = inputs(generator, 3, epilogue, True, ("residual", "bias"))
    assert_close(call(args, F64, "torch"), call(args, F64, "naive"), TOLERANCE[F64])


def test_auto_takes_torch_on_cpu_for_float64_and_where_a_gradient_is_asked_for(generator):
    x = draw(generator, 2, D).float()
    assert resolve_backend("auto", [x.double()]) == "torch"
    assert resolve_backend("auto", [x.requires_grad_()]) == "torch"
    if not CUDA:
        assert resolve_backend("auto", [x.detach()]) == "torch"


BAD = [
    (dict(x=torch.zeros(2, 3, D)), ValueError, r"x must have shape \[M, D\]"),
    (dict(x=torch.zeros(2, D, dtype=torch.long)), TypeError, "x must be a floating-point"),
    (dict(weight=torch.zeros(WIDTH, D + 1)), ValueError, r"weight must have shape \[N, D\]"),
    (dict(weight=torch.zeros(WIDTH, D), epilogue="swiglu"), ValueError, "weight \\[2F, D\\]"),
    (dict(epilogue="gelu"), ValueError, "epilogue must be one of"),
    (dict(norm_weight=torch.ones(D - 1)), ValueError, r"norm_weight must have shape \[D\]"),
    (dict(bias=torch.ones(WIDTH + 1)), ValueError, r"bias must have shape \[N\]"),
    (dict(residual=torch.ones(2, WIDTH + 1)), ValueError, r"residual must have shape \[M, N\]"),
    (dict(residual=torch.ones(2, WIDTH, dtype=F64)), TypeError, "residual must have weight's"),
    (dict(backend="cuda"), ValueError, "backend must be one of"),
    (dict(table=LAUNCH, backend="torch"), ValueError, "table is the Triton kernel's"),
]


@pytest.mark.parametrize(("bad", "error", "message"), BAD, ids=[m for _, _, m in BAD])
def test_bad_arguments_are_refused_naming_the_argument(bad, error, message):
    args = {"x": torch.zeros(2, D), "weight": torch.zeros(WIDTH, D), **bad}
    with pytest.raises(error, match=message):
        normed_linear(args.pop("x"), args.pop("weight"), **args)


@needs_triton
def test_triton_refuses_float64_and_gradients_naming_the_backend():
    x, weight = torch.zeros(2, D, device=DEVICE), torch.zeros(WIDTH, D, device=DEVICE)
    with pytest.raises(ValueError, match='backend="triton" computes in float32'):
        normed_linear(x.double(), weight.double(), backend="triton")
    with pytest.raises(ValueError, match='backend="triton" computes no gradients'):
        normed_linear(x, weight.requires_grad_(), backend="triton")


def test_a_dot_table_with_blocks_under_16_is_refused_naming_the_table():
    from deltalab.ops.normed_linear.triton import launch

    narrow = dataclasses.replace(LAUNCH, dot=dataclasses.replace(LAUNCH.dot, block_k=8))
    with pytest.raises(ValueError, match=r"table: tl\.dot needs"):
        launch(64, narrow)
    assert launch(1, narrow)[2] is False  # one row takes the broadcast, which has no minimum


@pytest.mark.skipif(INTERPRET, reason="compiles the kernel for sm_90 (not interpreted)")
@pytest.mark.parametrize("x_dtype", ["bf16", "fp32"], ids=["bf16_stream", "fp32_stream"])
@pytest.mark.parametrize("epilogue", ["none", "swiglu"])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_the_kernel_compiles_for_hopper_without_spills_at_its_launches(rows, epilogue, x_dtype):
    """The shipped table's launches at 1, 3 (the broadcast) and 64 rows (tl.dot), every term
    on, bfloat16 weights and a bfloat16 or float32 residual stream; float32 weights too at 64
    rows (the widest operands)."""
    pytest.importorskip("triton")
    from test_triton_compile import HOPPER_SHARED_BYTES, _compile_for_hopper, _stack_bytes

    from deltalab.ops.normed_linear import triton as kernels

    kernel = kernels._normed_linear
    block_m, product, dot = kernels.launch(rows)
    options = {"num_warps": product.num_warps, "num_stages": product.num_stages}
    pointers = kernel.arg_names[:6]
    for w_dtype in ["bf16", "fp32"] if rows == 64 else ["bf16"]:
        types = {"X": f"*{x_dtype}", **{p: f"*{w_dtype}" for p in ("W", "BIAS", "RES", "Y")}}
        constants = {"BM": block_m, "BN": product.block_n, "BK": product.block_k,
                     "HAS_NORM": True, "HAS_BIAS": True, "HAS_RES": True,
                     "SWIGLU": epilogue == "swiglu", "DOT": dot, "IEEE": w_dtype == "fp32"}  # fmt: skip
        scalars = [a for a in kernel.arg_names[6:] if a not in constants]
        compiled = _compile_for_hopper(kernel, pointers, scalars, constants, options,
                                       {"NORM_W": "*fp32", **types}, aligned=pointers)  # fmt: skip
        what = f"M={rows} {epilogue} x {x_dtype} W {w_dtype}"
        assert compiled.metadata.shared <= HOPPER_SHARED_BYTES, what
        assert _stack_bytes(compiled) in (None, 0), f"{what}: spills to local memory"
