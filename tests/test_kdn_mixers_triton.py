"""KDN's mixers on the Triton backend, as ops (kdn_iso, kdn_diag) and as layers (IsotropicKDN,
DiagonalKDN): the layers against the chunk path with every parameter gradient, k and g handed
to the delta rule through the gain's node (whose backward sums both gradients) with g's check
queued once, 16-bit inputs reaching the gain kernels uncast, and gate sensitivity, which never
reaches the fused kernels. The gain kernels alone are tested in tests/test_kdn_gain_triton.py.

The kernels run on a CUDA GPU, or on CPU tensors under Triton's interpreter:

    TRITON_INTERPRET=1 python -m pytest tests/test_kdn_mixers_triton.py

(README's test command runs this file a second time with it set); skipped otherwise.
Shapes are tiny: the interpreter runs every operation of a kernel in Python.
"""

from __future__ import annotations

import pytest
import torch
from test_kdn import kdn_inputs
from test_kdn_gain_triton import CUDA, DEVICE, F32, F64, needs_triton, spy_fused, spy_iso_gain
from torch.utils._python_dispatch import TorchDispatchMode

from deltalab.analysis import gate_sensitivity
from deltalab.layers import DiagonalKDN, IsotropicKDN
from deltalab.models import CausalLM, build_config
from deltalab.testing import TOLERANCE, assert_close

pytestmark = pytest.mark.interpreter


LAYER = dict(hidden_size=32, num_heads=2, head_dim=16, value_dim=8, conv_size=4, chunk_size=16)


@needs_triton
@pytest.mark.parametrize(
    ("layer_class", "spy"),
    [(DiagonalKDN, spy_fused), (IsotropicKDN, spy_iso_gain)],
    ids=["diagonal", "isotropic"],
)
def test_kdn_layer_on_triton_matches_chunk_with_parameter_gradients(monkeypatch, layer_class, spy):
    """The same parameters on both backends: outputs and every parameter's gradient to 1e-5,
    the Triton layer's gains on the fused kernels (20 tokens, two tiles of 16)."""
    calls = spy(monkeypatch)
    layers = {}
    for backend in ("chunk", "triton"):
        torch.manual_seed(0)
        layers[backend] = layer_class(**LAYER, backend=backend).to(DEVICE)
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
