"""rope: the torch path is the attention layer's old RoPE, the Triton kernel (forward, backward
and the forward-mode jvp) matches the float64 definition and the torch path, and the attention
layer and the models dispatch to it.

The Triton tests run on a CUDA GPU, or on CPU tensors under Triton's interpreter:

    TRITON_INTERPRET=1 python -m pytest tests/test_rope.py

(README's test command runs this file a second time with it set); skipped otherwise. Shapes are
tiny: the interpreter runs every operation of a kernel in Python.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deltalab.ops._triton import INTERPRET, triton_unavailable_reason
from deltalab.ops.rope import ROPE_BASE, inverse_frequencies, resolve_backend, rope
from deltalab.testing import TOLERANCE, assert_close, forward_tangent, relative_error

pytestmark = pytest.mark.interpreter

F64 = torch.float64
F32 = torch.float32
CUDA = torch.cuda.is_available() and not INTERPRET
DEVICE = "cuda" if CUDA else "cpu"
NO_TRITON = triton_unavailable_reason(torch.device(DEVICE))
needs_triton = pytest.mark.skipif(NO_TRITON is not None, reason=str(NO_TRITON))
# float32 kernels against the float64 definition at small angles: a few float32 ulps.
F32_TOL = 1e-6


def draw(generator, *shape):
    return torch.randn(*shape, generator=generator, dtype=F64)


def with_grad(x, positions, dy, backend, dtype, device=DEVICE, base=ROPE_BASE, table=None):
    """y and dx of sum(y * dy), as float64 CPU tensors; with a launch `table`, by the Triton
    kernel launched by it."""
    leaf = x.detach().to(device, dtype).requires_grad_()
    if table is None:
        y = rope(leaf, positions.to(device), base=base, backend=backend)
    else:
        from deltalab.ops.rope.triton import rope_triton

        freq = inverse_frequencies(x.shape[-1] // 2, base, torch.float32, device)
        y = rope_triton(leaf, positions.to(device), freq, table=table)
    assert y.dtype == dtype and y.shape == x.shape
    (grad,) = torch.autograd.grad(y, leaf, dy.to(device, dtype))
    assert grad.dtype == dtype and grad.shape == x.shape
    return y.detach().cpu().to(F64), grad.cpu().to(F64)


def assert_pair_close(actual, expected, tol, what=""):
    assert_close(actual[0], expected[0], tol, f"{what} y")
    assert_close(actual[1], expected[1], tol, f"{what} dx")


def _old_apply_rope(x, positions, base=ROPE_BASE):
    """`deltalab.layers.attention.apply_rope` before this op existed."""
    dtype = torch.promote_types(x.dtype, F32)
    half = x.shape[-1] // 2
    inv_freq = base ** -(torch.arange(half, dtype=dtype, device=x.device) / half)
    angles = positions.to(dtype)[:, None] * inv_freq
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x.to(dtype).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16, F64])
def test_torch_path_is_the_attention_layers_old_rope_bit_for_bit(generator, dtype):
    x, dy = draw(generator, 2, 5, 3, 12), draw(generator, 2, 5, 3, 12)
    positions = torch.arange(7, 12)
    ours = with_grad(x, positions, dy, "torch", dtype, "cpu", base=500.0)
    leaf = x.to(dtype).requires_grad_()
    y = _old_apply_rope(leaf, positions, 500.0)
    (grad,) = torch.autograd.grad(y, leaf, dy.to(dtype))
    assert torch.equal(ours[0], y.double()) and torch.equal(ours[1], grad.double())


def test_naive_definition_and_torch_path_agree_in_float64(generator):
    x, dy = draw(generator, 2, 4, 3, 10), draw(generator, 2, 4, 3, 10)
    positions = torch.tensor([0, 3, 100, 5000])
    naive = with_grad(x, positions, dy, "naive", F64, "cpu")
    assert_pair_close(with_grad(x, positions, dy, "torch", F64, "cpu"), naive, TOLERANCE[F64])


@needs_triton
@pytest.mark.parametrize("heads", [1, 3])
@pytest.mark.parametrize("dim", [2, 6, 16, 48, 128])
def test_triton_matches_naive_float64_and_the_torch_path(generator, poisoned_empty, heads, dim):
    """Odd head counts, K = 2 .. 128 (6 and 48: K/2 not a power of 2, masked columns), positions
    from an offset: y and dx against the float64 definition and the torch path in float32."""
    x, dy = draw(generator, 2, 3, heads, dim), draw(generator, 2, 3, heads, dim)
    positions = torch.arange(5, 8)
    expected = with_grad(x, positions, dy, "naive", F64, "cpu")
    actual = with_grad(x, positions, dy, "triton", F32)
    assert_pair_close(actual, expected, F32_TOL, f"H={heads} K={dim} vs float64")
    torch_path = with_grad(x, positions, dy, "torch", F32, "cpu")
    assert_pair_close(actual, torch_path, F32_TOL, f"H={heads} K={dim} vs torch")


@needs_triton
@pytest.mark.parametrize(("pairs", "blocks"), [(8, (1, 2, 4)), (32, (2, 4, 4))])
def test_triton_runs_over_many_token_head_and_column_blocks(
    generator, poisoned_empty, pairs, blocks
):
    """Programs of BT tokens x BH heads x 4 pairs over B T = 15 tokens, H = 3 heads, K/2 = 10
    pairs: blocks past each end masked off, every element of y and dx written once."""
    from deltalab.ops.rope import triton as kernels

    table = dataclasses.replace(kernels.LAUNCH, block_pairs=pairs, max_block_d=4)
    assert kernels.launch(15, 3, 10, table)[:3] == blocks
    x, dy = draw(generator, 3, 5, 3, 20), draw(generator, 3, 5, 3, 20)
    positions = torch.arange(5)
    expected = with_grad(x, positions, dy, "naive", F64, "cpu")
    assert_pair_close(with_grad(x, positions, dy, "triton", F32, table=table), expected, F32_TOL)


@needs_triton
def test_triton_continues_at_an_offset_as_decoding_does(generator):
    """A sequence rotated whole equals its prefix and its continuation (positions from T0)
    rotated apart, bit for bit: the angle depends on the position only."""
    x = draw(generator, 2, 9, 3, 8).to(DEVICE, F32)
    whole = rope(x, torch.arange(9, device=DEVICE), backend="triton")
    start = rope(x[:, :6], torch.arange(6, device=DEVICE), backend="triton")
    steps = [rope(x[:, t : t + 1], torch.tensor([t], device=DEVICE), backend="triton")
             for t in range(6, 9)]  # fmt: skip
    assert torch.equal(torch.cat([start, *steps], dim=1), whole)


@needs_triton
def test_triton_at_large_positions_rotates_by_the_torch_paths_float32_angles(generator):
    """Positions 30000 and beyond (and 2^20): the float32 angle p * f is off the float64 one by
    up to about p 2^-23 rad (f and the product rounded), for the torch path and the kernel
    alike: both share that error (the same float32 angles) and agree to float32 rounding."""
    x, dy = draw(generator, 1, 4, 2, 16), draw(generator, 1, 4, 2, 16)
    positions = torch.tensor([30000, 30001, 32767, 1 << 20])
    expected = with_grad(x, positions, dy, "naive", F64, "cpu")
    actual = with_grad(x, positions, dy, "triton", F32)
    torch_path = with_grad(x, positions, dy, "torch", F32, "cpu")
    assert_pair_close(actual, torch_path, 4 * F32_TOL, "vs torch")
    bound = 2.0**20 * 2.0**-22
    for got, ours, theirs in zip(actual, torch_path, expected, strict=True):
        error, torch_error = relative_error(got, theirs), relative_error(ours, theirs)
        assert error <= bound and error <= 1.01 * torch_error + F32_TOL, (error, torch_error)


@needs_triton
def test_triton_reads_strided_views_and_gradients(generator):
    """q as a column slice of a fused qkv projection `[B, T, 3 H K]`, and as the transpose of a
    `[B, H, T, K]` tensor (SDPA's layout; so is the gradient its backward hands back); the last
    dim strided too (copied): the values of contiguous copies."""
    heads, dim = 3, 8

    def on_device(*shape):
        return draw(generator, *shape).to(DEVICE, F32)

    fused = on_device(2, 4, 3 * heads * dim)
    cases = [
        (fused[..., heads * dim : 2 * heads * dim].unflatten(-1, (heads, dim)), "slice"),
        (on_device(2, heads, 4, dim).transpose(1, 2), "transpose"),
        (on_device(2, 4, heads, 2 * dim)[..., ::2], "strided last dim"),
    ]
    dy = on_device(2, heads, 4, dim).transpose(1, 2)
    positions = torch.arange(3, 7)
    for x, what in cases:
        assert not x.is_contiguous()
        expected = with_grad(x.cpu().double(), positions, dy.cpu().double(), "naive", F64, "cpu")
        leaf = x.detach().requires_grad_()
        y = rope(leaf, positions.to(DEVICE), backend="triton")
        (grad,) = torch.autograd.grad(y, leaf, dy)
        assert_pair_close((y.detach().cpu().double(), grad.cpu().double()), expected, F32_TOL, what)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, F64])
def test_triton_writes_xs_dtype_computed_in_float32(generator, dtype):
    x = draw(generator, 2, 3, 2, 8).to(DEVICE, dtype).requires_grad_()
    positions = torch.arange(3, device=DEVICE)
    expected = rope(x.detach().double(), positions, backend="naive")
    y = rope(x, positions, backend="triton")
    assert y.dtype == dtype
    tol = 1e-3 if dtype == torch.float16 else F32_TOL
    assert_close(y.detach().cpu().double(), expected.cpu(), tol, str(dtype))
    (grad,) = torch.autograd.grad(y.sum(), x)
    assert grad.dtype == dtype


@needs_triton
def test_triton_forward_mode_derivative_matches_the_torch_path(generator):
    x, tangent = draw(generator, 2, 3, 2, 10), draw(generator, 2, 3, 2, 10)
    positions = torch.arange(4, 7, device=DEVICE)

    def run(backend, dtype):
        fn = lambda t: rope(t, positions, backend=backend)  # noqa: E731
        return (
            forward_tangent(fn, [x.to(DEVICE, dtype)], [tangent.to(DEVICE, dtype)]).cpu().double()
        )

    assert_close(run("triton", F32), run("torch", F64), F32_TOL, "jvp")


def test_auto_takes_triton_only_on_cuda_and_not_for_float64():
    cpu = torch.zeros(1, 2, 1, 4)
    assert resolve_backend("auto", cpu) == "torch"
    assert resolve_backend("naive", cpu) == "naive"
    if torch.cuda.is_available() and NO_TRITON is None:
        assert resolve_backend("auto", cpu.cuda()) == "triton"
        assert resolve_backend("auto", cpu.cuda().bfloat16()) == "triton"
        assert resolve_backend("auto", cpu.cuda().double()) == "torch"


@pytest.mark.parametrize(
    ("x", "positions", "kwargs", "error", "message"),
    [
        (torch.ones(1, 3, 2, 7), torch.arange(3), {}, ValueError, "x must have an even last dim"),
        (torch.ones(3, 2, 8), torch.arange(3), {}, ValueError, r"x must have rank 4 \(\[B, T"),
        (torch.ones(1, 3, 2, 8, dtype=torch.int64), torch.arange(3), {}, TypeError, "x must be"),
        (torch.ones(1, 3, 2, 8), torch.arange(4), {}, ValueError, r"positions must have shape"),
        (torch.ones(1, 3, 2, 8), torch.arange(3.0), {}, TypeError, "positions must be an integer"),
        (torch.ones(1, 3, 2, 8), [0, 1, 2], {}, TypeError, "positions must be a torch.Tensor"),
        (torch.ones(1, 3, 2, 8), torch.arange(3), {"base": 1.0}, ValueError, "base must be > 1"),
        (torch.ones(1, 3, 2, 8), torch.arange(3), {"backend": "fast"}, ValueError, "backend must"),
    ],
)
def test_bad_inputs_are_refused_naming_the_argument(x, positions, kwargs, error, message):
    with pytest.raises(error, match=message):
        rope(x, positions, **{"backend": "torch", **kwargs})


@pytest.mark.skipif(NO_TRITON is None, reason="Triton runs here")
def test_triton_backend_says_why_it_cannot_run():
    with pytest.raises(RuntimeError, match='backend="triton" cannot run here'):
        rope(torch.ones(1, 2, 1, 4), torch.arange(2), backend="triton")


def _config(mixer, backend, **kw):
    from deltalab.models import DeltaLabConfig

    settings = {"num_layers": 2, **kw}
    return DeltaLabConfig(
        mixer=mixer, hidden_size=32, num_heads=2, head_dim=16, vocab_size=50, chunk_size=16,
        backend=backend, ffn_width=36, **settings,
    )  # fmt: skip


def spy_rope(monkeypatch) -> list[str]:
    """Records the backend of every rope call the attention layers make."""
    import deltalab.layers.attention as attention

    calls, real = [], attention.rope

    def spy(x, positions, *, base, backend):
        calls.append(backend)
        return real(x, positions, base=base, backend=backend)

    monkeypatch.setattr(attention, "rope", spy)
    return calls


@pytest.mark.parametrize(
    ("backend", "expected"), [("chunk", "torch"), ("naive", "torch"), ("auto", "auto")]
)
def test_attention_blocks_take_the_configs_backend(monkeypatch, backend, expected):
    """Transformer and hybrid models: "chunk" and "naive" -> "torch" (`layer_backend`), "auto"
    as it is; queries and keys both rotated."""
    from deltalab.layers import Attention
    from deltalab.models import CausalLM

    calls = spy_rope(monkeypatch)
    for mixer, settings in (("transformer", {}), ("gdn", {"attention_every": 2})):
        model = CausalLM(_config(mixer, backend, **settings))
        assert {m.backend for m in model.modules() if isinstance(m, Attention)} == {expected}
        calls.clear()
        model(torch.zeros(1, 3, dtype=torch.long))
        attention_layers = sum(isinstance(m, Attention) for m in model.modules())
        assert calls == [expected] * 2 * attention_layers and attention_layers


@needs_triton
def test_a_transformer_on_triton_gives_the_chunk_backends_loss_and_gradients():
    """A tiny Transformer with its RoPE (and its norms and FFN gating) on Triton against the
    same weights on the PyTorch paths ("chunk"), float32: loss and every parameter gradient."""
    from deltalab.models import CausalLM

    ids = torch.randint(0, 50, (2, 20), generator=torch.Generator().manual_seed(0))

    def run(backend):
        torch.manual_seed(0)
        model = CausalLM(_config("transformer", backend)).to(DEVICE)
        loss = model(ids.to(DEVICE), labels=ids.to(DEVICE)).loss
        loss.backward()
        return loss.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()}

    loss, grads = run("triton")
    ref_loss, ref_grads = run("chunk")
    assert abs(float(loss - ref_loss)) <= 1e-5 * abs(float(ref_loss))
    for name, grad in grads.items():
        assert_close(grad, ref_grads[name], 1e-5, name)


@needs_triton
@pytest.mark.parametrize("window", [None, 4])
def test_triton_prefill_then_decoding_matches_one_forward(monkeypatch, window):
    """A Transformer on Triton fed a prompt, then one token at a time through its cache (the
    positions continue at the cache's offset), gives the logits of one forward over the whole
    sequence; and the static-cache decoder (its step eager here) the tokens of `generate`."""
    from deltalab.models import CausalLM
    from deltalab.models.static_decode import static_generate

    calls = spy_rope(monkeypatch)
    torch.manual_seed(0)
    model = CausalLM(_config("transformer", "triton", attention_window=window)).to(DEVICE).eval()
    ids = torch.randint(0, 50, (2, 11), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad():
        whole = model(ids).logits
        out = model(ids[:, :7], use_cache=True)
        pieces, cache = [out.logits], out.past_key_values
        for t in range(7, 11):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            pieces.append(out.logits)
        assert_close(torch.cat(pieces, dim=1), whole, 1e-5, "logits")
        mask = torch.ones_like(ids[:, :5])
        settings = dict(max_new_tokens=4, eos_token_id=None)
        expected = model.generate(ids[:, :5], attention_mask=mask, do_sample=False, **settings)
        got = static_generate(model, ids[:, :5], attention_mask=mask, cuda_graph=False, **settings)
    assert torch.equal(got, expected)
    assert set(calls) == {"triton"}


def test_forward_mode_probes_switch_the_attention_blocks_rope_to_the_torch_path():
    """Gate-sensitivity probes (`_forward_mode_paths`) put a hybrid model's attention blocks on
    the torch RoPE with its norms and FFNs, and give them their backend back. (The Triton
    Function's own jvp is checked above; a probe through attention still stops at SDPA, which
    has no forward-mode derivative on CPU.)"""
    from deltalab.analysis.gate_sensitivity import _forward_mode_paths
    from deltalab.layers import Attention
    from deltalab.models import CausalLM

    model = CausalLM(_config("gdn", "auto", attention_every=2))
    attention = [m for m in model.modules() if isinstance(m, Attention)]
    assert attention and {m.backend for m in attention} == {"auto"}
    with _forward_mode_paths(model):
        assert {m.backend for m in attention} == {"torch"}
    assert {m.backend for m in attention} == {"auto"}


@pytest.mark.skipif(not CUDA or NO_TRITON is not None, reason="bfloat16 kernels: CUDA only")
def test_triton_bfloat16_is_as_close_to_float64_as_the_torch_path(generator):
    """bfloat16 q (the projection's output under autocast) at the 340M head shape, positions to
    4K: the kernel computes in float32 and rounds once, as the torch path; dy bfloat16."""
    x, dy = draw(generator, 2, 1024, 8, 128), draw(generator, 2, 1024, 8, 128)
    positions = torch.arange(3072, 4096)
    expected = with_grad(x, positions, dy, "naive", F64, "cpu")
    errors = {}
    for backend in ("triton", "torch"):
        actual = with_grad(x, positions, dy, backend, torch.bfloat16)
        assert_pair_close(actual, expected, TOLERANCE[torch.bfloat16], backend)
        errors[backend] = [relative_error(a, e) for a, e in zip(actual, expected, strict=True)]
    assert all(t <= 1.05 * r for t, r in zip(*errors.values(), strict=True)), errors
