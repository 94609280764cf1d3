"""short_conv: the naive definition against conv1d, the conv1d path against ShortConvolution, and
the Triton kernels (forward and backward) against the definition in float64.

The Triton tests run on a CUDA GPU, or on CPU tensors under Triton's interpreter:

    TRITON_INTERPRET=1 python -m pytest tests/test_short_conv.py

(README's test command runs this file a second time with it set); skipped otherwise. Shapes are
tiny: the interpreter runs every operation of a kernel in Python.
"""

from __future__ import annotations

import pytest
import torch

from deltalab.layers.short_conv import ShortConvolution
from deltalab.ops import short_conv
from deltalab.ops._triton import INTERPRET, triton_unavailable_reason
from deltalab.ops.short_conv import resolve_backend
from deltalab.testing import TOLERANCE, assert_close

pytestmark = pytest.mark.interpreter

F64 = torch.float64
CUDA = torch.cuda.is_available() and not INTERPRET
DEVICE = "cuda" if CUDA else "cpu"
NO_TRITON = triton_unavailable_reason(torch.device(DEVICE))
needs_triton = pytest.mark.skipif(NO_TRITON is not None, reason=str(NO_TRITON))


def conv_inputs(generator, batch, length, channels, width, with_cache=True):
    """x `[B, T, C]`, weight `[C, W]`, cache `[B, C, W-1]` (or None), float64, and the random
    weights of a loss over y and the new cache."""

    def draw(*shape):
        return torch.randn(*shape, generator=generator, dtype=F64)

    cache = draw(batch, channels, width - 1) if with_cache else None
    x, weight = draw(batch, length, channels), draw(channels, width) / width**0.5
    return x, weight, cache, draw(batch, length, channels), draw(batch, channels, width - 1)


def run_with_grads(inputs, backend, dtype, device, activation="silu", cache_grad=True, **kw):
    """y, the new cache, and the gradients of x, weight (and cache, when it requires grad) of
    sum(y * dy) + sum(new_cache * dcache), on float64 CPU copies."""
    x, weight, cache, dy, dnew = inputs

    def leaf(t, grad=True):
        return None if t is None else t.detach().to(device, dtype).requires_grad_(grad)

    leaves = [leaf(x), leaf(weight), leaf(cache, cache_grad)]
    if backend == "table":
        from deltalab.ops.short_conv.triton import short_conv_triton

        y, new_cache = short_conv_triton(*leaves, activation == "silu", **kw)
    else:
        y, new_cache = short_conv(*leaves, activation=activation, backend=backend)
    loss = (y * dy.to(device, y.dtype)).sum() + (new_cache * dnew.to(device, y.dtype)).sum()
    wrt = [t for t in leaves if t is not None and t.requires_grad]
    grads = torch.autograd.grad(loss, wrt)
    return [t.detach().cpu().to(F64) for t in (y, new_cache, *grads)]


NAMES = ["y", "new cache", "dx", "dweight", "dcache"]


def assert_all_close(actual, expected, tol, what=""):
    assert len(actual) == len(expected)
    for name, a, e in zip(NAMES, actual, expected, strict=False):
        assert_close(a, e, tol, f"{what} {name}")


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("with_cache", [True, False], ids=["cache", "no-cache"])
@pytest.mark.parametrize("width", [3, 4])
def test_naive_definition_matches_conv1d_in_float64(generator, width, with_cache, activation):
    inputs = conv_inputs(generator, 2, 9, 5, width, with_cache)
    naive = run_with_grads(inputs, "naive", F64, "cpu", activation)
    conv1d = run_with_grads(inputs, "torch", F64, "cpu", activation)
    assert_all_close(naive, conv1d, TOLERANCE[F64])


@pytest.mark.parametrize("with_cache", [True, False], ids=["cache", "no-cache"])
def test_conv1d_path_is_shortconvolution_bit_for_bit(generator, with_cache):
    """`short_conv(..., backend="torch")` is a drop-in for ShortConvolution.forward: the same y,
    cache and gradients, exactly, with the weight as stored ([C, 1, W]) or as [C, W]."""
    conv = ShortConvolution(6, 4)
    x, _, cache, dy, dnew = conv_inputs(generator, 2, 7, 6, 4, with_cache)
    results = []
    for call in (
        conv,
        lambda x, c: short_conv(x, conv.weight, c, backend="torch"),
        lambda x, c: short_conv(x, conv.weight[:, 0], c, backend="torch"),
    ):
        leaves = [x.float().requires_grad_(), None if cache is None else cache.float()]
        if leaves[1] is not None:
            leaves[1].requires_grad_()
        y, new_cache = call(*leaves)
        loss = (y * dy.float()).sum() + (new_cache * dnew.float()).sum()
        wrt = [conv.weight, *(t for t in leaves if t is not None)]
        results.append([y.detach(), new_cache.detach(), *torch.autograd.grad(loss, wrt)])
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("backend", ["naive", pytest.param("triton", marks=needs_triton)])
def test_cache_continues_the_sequence(generator, backend):
    """Feeding the returned cache back with the next tokens gives the whole sequence's output,
    for pieces shorter than the cache too."""
    x, weight, cache, _, _ = conv_inputs(generator, 2, 11, 5, 4)
    device = DEVICE if backend == "triton" else "cpu"
    x, weight, cache = (t.to(device, torch.float32) for t in (x, weight, cache))
    whole, whole_cache = short_conv(x, weight, cache, backend=backend)
    pieces, state = [], cache
    for lo, hi in ((0, 1), (1, 3), (3, 8), (8, 11)):
        y, state = short_conv(x[:, lo:hi], weight, state, backend=backend)
        pieces.append(y)
    assert_close(torch.cat(pieces, dim=1), whole, 1e-6, "y in pieces")
    assert torch.equal(state, whole_cache)


@needs_triton
@pytest.mark.parametrize("length", [1, 2, 5, 37])
@pytest.mark.parametrize("width", [3, 4])
@pytest.mark.parametrize("with_cache", [True, False], ids=["cache", "no-cache"])
def test_triton_matches_naive_float64_with_gradients(
    generator, poisoned_empty, length, width, with_cache
):
    """y, new cache, dx, dweight and dcache; C = 20 leaves masked channels in every block, and
    T < W - 1 (1, 2) reads the cache past the sequence's start in both directions."""
    inputs = conv_inputs(generator, 2, length, 20, width, with_cache)
    expected = run_with_grads(inputs, "naive", F64, "cpu")
    actual = run_with_grads(inputs, "triton", torch.float32, DEVICE)
    assert_all_close(actual, expected, TOLERANCE[torch.float32], f"T={length} W={width}")


@needs_triton
@pytest.mark.parametrize("width", [2, 8])
def test_triton_other_widths_match_naive(generator, poisoned_empty, width):
    """The smallest width with a cache, and the widest the kernels take (its backward launches
    with more warps); T = 5 < W - 1 = 7 at W = 8."""
    for length in (5, 20):
        inputs = conv_inputs(generator, 2, length, 20, width)
        expected = run_with_grads(inputs, "naive", F64, "cpu")
        actual = run_with_grads(inputs, "triton", torch.float32, DEVICE)
        assert_all_close(actual, expected, TOLERANCE[torch.float32], f"T={length} W={width}")


@needs_triton
@pytest.mark.parametrize(
    ("length", "width", "with_cache", "cache_grad"),
    [(37, 4, True, True), (5, 3, False, True), (6, 4, True, False)],
    ids=["T37-W4-cache", "T5-W3", "T6-W4-cache-without-grad"],
)
def test_triton_without_activation_matches_naive(
    generator, poisoned_empty, length, width, with_cache, cache_grad
):
    inputs = conv_inputs(generator, 2, length, 20, width, with_cache)
    expected = run_with_grads(inputs, "naive", F64, "cpu", None, cache_grad)
    actual = run_with_grads(inputs, "triton", torch.float32, DEVICE, None, cache_grad)
    assert_all_close(actual, expected, TOLERANCE[torch.float32])


@needs_triton
@pytest.mark.parametrize("programs", [4, 1024], ids=["chunks-per-split", "split-per-chunk"])
def test_triton_chunks_splits_and_channel_blocks_carry_correctly(
    generator, poisoned_empty, programs
):
    """Chunks of 8 tokens and blocks of 32 channels: 5 chunks (the last 5/8 used), 2 channel
    blocks (the second 8/32 used), and the backward's token splits either several chunks long
    (its dw carried across chunks in registers) or one chunk each (dw summed across programs)."""
    from deltalab.ops.short_conv import triton as kernels

    table = kernels.ConvLaunch(forward=(8, 32, 1), backward=(8, 32, 1), backward_programs=programs)
    # 2 sequences x 2 channel blocks: 1 program each over the 5 chunks, or a chunk each.
    split = kernels.backward_split(2, 37, 2, 8, table)
    assert split == (40 if programs == 4 else 8)
    inputs = conv_inputs(generator, 2, 37, 40, 4)
    expected = run_with_grads(inputs, "naive", F64, "cpu")
    actual = run_with_grads(inputs, "table", torch.float32, DEVICE, table=table)
    assert_all_close(actual, expected, TOLERANCE[torch.float32], f"{programs} programs")


@needs_triton
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_triton_silu_saturates_without_nan(generator, poisoned_empty):
    """Pre-activations of +-1e4: exp(-z) overflows, and silu and its slope take their limits
    (z and 1 above, 0 below) with no inf * 0 in the forward or the backward."""
    x, weight, cache, dy, dnew = conv_inputs(generator, 1, 6, 16, 4)
    x = 1e4 * x.sign()
    weight = torch.zeros_like(weight)
    weight[:, -1] = 1.0  # z = x
    expected = run_with_grads((x, weight, cache, dy, dnew), "naive", F64, "cpu")
    actual = run_with_grads((x, weight, cache, dy, dnew), "triton", torch.float32, DEVICE)
    assert_all_close(actual, expected, TOLERANCE[torch.float32])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, F64])
def test_triton_returns_x_dtype_computed_in_float32(generator, poisoned_empty, dtype):
    """y, the new cache and dx come back in x's dtype; float16 to its own precision, float64 to
    float32's (the kernels compute in float32 whatever comes in)."""
    inputs = conv_inputs(generator, 2, 9, 20, 4)
    expected = run_with_grads(inputs, "naive", F64, "cpu")
    x, weight, cache, dy, dnew = inputs
    leaves = [t.to(DEVICE, dtype).requires_grad_() for t in (x, weight, cache)]
    y, new_cache = short_conv(*leaves, backend="triton")
    assert y.dtype == new_cache.dtype == dtype
    loss = (y * dy.to(DEVICE, dtype)).sum() + (new_cache * dnew.to(DEVICE, dtype)).sum()
    grads = torch.autograd.grad(loss, leaves)
    assert [g.dtype for g in grads] == [dtype] * 3
    tol = TOLERANCE[torch.float16 if dtype == torch.float16 else torch.float32]
    actual = [t.detach().cpu().to(F64) for t in (y, new_cache, *grads)]
    assert_all_close(actual, expected, tol, str(dtype))


@needs_triton
def test_triton_reads_strided_inputs(generator):
    """x as a view with a channel stride (a slice of a wider projection, as q, k, v are) and the
    weight as a transposed view give the result of contiguous copies."""
    x, weight, cache, _, _ = conv_inputs(generator, 2, 7, 10, 4)
    wide = torch.randn(2, 7, 30, generator=generator, dtype=F64)
    wide[..., 10:20] = x
    x, wide, weight, cache = (t.to(DEVICE, torch.float32) for t in (x, wide, weight, cache))
    strided = short_conv(wide[..., 10:20], weight.t().contiguous().t(), cache, backend="triton")
    plain = short_conv(x, weight, cache, backend="triton")
    for a, b in zip(strided, plain, strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not CUDA or NO_TRITON is not None, reason="bfloat16 kernels: CUDA only")
@pytest.mark.parametrize("with_cache", [True, False], ids=["cache", "no-cache"])
def test_triton_bfloat16_is_close_to_float64(generator, with_cache):
    inputs = conv_inputs(generator, 2, 300, 200, 4, with_cache)
    expected = run_with_grads(inputs, "naive", F64, "cpu")
    actual = run_with_grads(inputs, "triton", torch.bfloat16, DEVICE)
    assert_all_close(actual, expected, TOLERANCE[torch.bfloat16])


def test_auto_takes_triton_only_on_cuda_for_widths_it_compiles():
    assert resolve_backend("auto", torch.device("cpu"), 4) == "torch"
    assert resolve_backend("auto", torch.device("cuda"), 9) == "torch"
    cuda = "torch" if triton_unavailable_reason(torch.device("cuda")) else "triton"
    assert resolve_backend("auto", torch.device("cuda"), 4) == cuda


def _bad(**changes):
    args = {
        "x": torch.zeros(2, 5, 6),
        "weight": torch.zeros(6, 1, 4),
        "cache": torch.zeros(2, 6, 3),
        "activation": "silu",
        "backend": "torch",
    }
    return {**args, **changes}


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        (_bad(x=torch.zeros(2, 5, 6, dtype=torch.int64)), TypeError, "x must be a floating"),
        (_bad(x=torch.zeros(5, 6)), ValueError, r"x must have rank 3 \(\[B, T, C\]\)"),
        (_bad(x=torch.zeros(2, 0, 6)), ValueError, "x must hold at least one token"),
        (_bad(weight=torch.zeros(4, 6)), ValueError, r"weight must have shape \[C, W\]"),
        (_bad(weight=torch.zeros(6, 2, 4)), ValueError, r"weight must have shape \[C, 1, W\]"),
        (_bad(weight=torch.zeros(6)), ValueError, "weight must have rank 2 or 3"),
        (_bad(weight=torch.zeros(6, 0)), ValueError, r"weight must hold at least one tap"),
        (_bad(cache=torch.zeros(2, 6, 4)), ValueError, r"cache must have shape \[B, C, W-1\]"),
        (_bad(cache=torch.zeros(1, 6, 3)), ValueError, r"cache must have shape \[B, C, W-1\]"),
        (_bad(cache=[0.0]), TypeError, "cache must be a torch.Tensor"),
        (_bad(weight=torch.zeros(6, 4, device="meta")), ValueError, "weight is on meta"),
        (_bad(activation="relu"), ValueError, "activation must be one of"),
        (_bad(backend="conv1d"), ValueError, "backend must be one of"),
        # Either Triton cannot run here, or it refuses a width it is not unrolled for.
        (_bad(weight=torch.zeros(6, 9), cache=None, backend="triton"), (RuntimeError, ValueError),
         'backend="triton"'),
    ],
)  # fmt: skip
def test_bad_inputs_are_refused_naming_the_argument(args, error, message):
    with pytest.raises(error, match=message):
        short_conv(**args)


@needs_triton
@pytest.mark.parametrize("launch", [(0, 32, 1), (8, 48, 1), (8, 32, 0)])
def test_triton_refuses_launch_tables_it_cannot_run(launch):
    from deltalab.ops.short_conv.triton import ConvLaunch

    with pytest.raises(ValueError, match=r"ConvLaunch\.backward must be \(BT >= 1, BC a power"):
        ConvLaunch(backward=launch)
