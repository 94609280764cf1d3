"""read_gate: the torch path is the layers' old read, the Triton kernels (forward, backward and
the forward-mode jvp) match the float64 formula, and Muir and KDN-Muir fuse their read gate into
the query where nothing can see rho, with the same outputs, gradients, reports and gate hooks.

The Triton tests run on a CUDA GPU, or on CPU tensors under Triton's interpreter:

    TRITON_INTERPRET=1 python -m pytest tests/test_read_gate.py

(README's test command runs this file a second time with it set); skipped otherwise. Shapes are
tiny: the interpreter runs every operation of a kernel in Python.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import nn

from deltalab.analysis.gate_sensitivity import gate_sensitivity, perturb_gate
from deltalab.layers import KDNMuir, Muir
from deltalab.layers.muir import FUSED_READ
from deltalab.ops import read_gate as op
from deltalab.ops._triton import INTERPRET, triton_unavailable_reason
from deltalab.ops.read_gate import layer_backend, read_query, resolve_backend
from deltalab.testing import assert_close

pytestmark = pytest.mark.interpreter

F64 = torch.float64
CUDA = torch.cuda.is_available() and not INTERPRET
DEVICE = "cuda" if CUDA else "cpu"
NO_TRITON = triton_unavailable_reason(torch.device(DEVICE))
needs_triton = pytest.mark.skipif(NO_TRITON is not None, reason=str(NO_TRITON))
# float32 kernels against the float64 formula: a few float32 ulps, and sums over rows.
F32_TOL = 1e-5
NAMES = ("out", "dq", "dread_log", "draw")
# (q shape, read_log shape): Muir's [H, K] vector, a vector per head [H, 1], one shared [K],
# odd sizes and other leading dims.
LAYOUTS = {
    "heads": ((2, 5, 3, 7), (3, 7)),
    "per-head": ((2, 5, 3, 7), (3, 1)),
    "shared": ((11, 3, 5), (5,)),
    "lead": ((2, 1, 3, 2, 5), (2, 5)),
}


def read_inputs(generator, layout, dynamic=True, scale=3.0):
    """q, read_log, raw (None unless dynamic), dout: float64; read_log around the matched
    filter's logs (log of weights ~ 1), raw 3 x random normal."""
    q_shape, r_shape = LAYOUTS[layout]

    def draw(*s):
        return torch.randn(*s, generator=generator, dtype=F64)

    raw = scale * draw(*q_shape) if dynamic else None
    return draw(*q_shape), draw(*r_shape), raw, draw(*q_shape)


def with_grads(inputs, backend, dtype, device=DEVICE, table=None):
    """The product and the gradients of q, read_log (and raw) of sum(out * dout), as float64
    CPU tensors; with a launch `table`, by the Triton kernels launched by it."""
    q, read_log, raw, dout = inputs
    leaves = [
        t.detach().to(device, dtype).requires_grad_() for t in (q, read_log, raw) if t is not None
    ]
    if table is None:
        out = read_query(*leaves, backend=backend)
    else:
        from deltalab.ops.read_gate.triton import read_query_triton

        q, r, *raw = leaves  # read_log spans q's trailing dims
        out = read_query_triton(q, r.expand(q.shape[q.dim() - r.dim():]).reshape(-1), *raw,
                                table=table)  # fmt: skip
    grads = torch.autograd.grad((out * dout.to(device, out.dtype)).sum(), leaves)
    return [t.detach().cpu().to(F64) for t in (out, *grads)]


def assert_all_close(actual, expected, tol, what=""):
    assert len(actual) == len(expected)
    for name, a, e in zip(NAMES, actual, expected, strict=False):
        assert_close(a, e, tol, f"{what} {name}")


def old_layers_read(read_log, raw, q):
    """`FusedGateMixer.read_from` (x float32) then `muir.read_query` before the op existed,
    verbatim (raw `[..., H, K]` already unflattened)."""
    dtype = torch.float32
    read = read_log.to(dtype).exp()
    if raw is not None:
        modulation = torch.sigmoid(raw.to(dtype))
        read = read * (2.0 * modulation)
    read = read.to(torch.float32).expand(q.shape)
    return (read * q).to(q.dtype)


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
def test_torch_path_is_the_layers_read_bit_for_bit(generator, dynamic):
    inputs = read_inputs(generator, "heads", dynamic)
    ours = with_grads(inputs, "torch", torch.float32, "cpu")
    q, read_log, raw, dout = (None if t is None else t.float().requires_grad_() for t in inputs)
    out = old_layers_read(read_log, raw, q)
    leaves = [t for t in (q, read_log, raw) if t is not None]
    grads = torch.autograd.grad((out * dout).sum(), leaves)
    for a, b in zip(ours, (out, *grads), strict=True):
        assert torch.equal(a, b.detach().to(F64))


def test_torch_path_keeps_q_dtype_with_rho_in_float32(generator):
    """bfloat16 q (autocast), float32 read_log, bfloat16 raw: the product is bfloat16, computed
    from the float32 rho and rounded once."""
    q, read_log, raw, _ = read_inputs(generator, "heads")
    q16, raw16 = q.bfloat16(), raw.bfloat16()
    out = read_query(q16, read_log.float(), raw16, backend="torch")
    rho = read_log.float().exp() * 2.0 * torch.sigmoid(raw16.float())
    assert out.dtype == torch.bfloat16 and torch.equal(out, (q16.float() * rho).bfloat16())


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_naive_formula_and_torch_path_agree_in_float64(generator, layout, dynamic):
    inputs = read_inputs(generator, layout, dynamic)
    expected = with_grads(inputs, "naive", F64, "cpu")
    assert_all_close(with_grads(inputs, "torch", F64, "cpu"), expected, 1e-12)


@needs_triton
@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_triton_matches_naive_float64_and_the_torch_path_with_gradients(
    generator, poisoned_empty, layout, dynamic
):
    inputs = read_inputs(generator, layout, dynamic)
    expected = with_grads(inputs, "naive", F64, "cpu")
    actual = with_grads(inputs, "triton", torch.float32)
    assert len(actual) == (4 if dynamic else 3)
    assert_all_close(actual, expected, F32_TOL, layout)
    assert_all_close(actual, with_grads(inputs, "torch", torch.float32, "cpu"), F32_TOL, layout)


@needs_triton
def test_triton_is_finite_where_rho_is_for_any_read_log(generator):
    """read_log of 90-100 (exp(read_log) overflows float32) with raw near -read_log (rho ~ 2),
    and moderate read_log with raw of +-50 and +-1e4 (sigmoid saturates, exp(-|raw|)
    underflows): every output and gradient finite and, element by element, the float64
    formula's to float32 rounding."""
    q, _, _, dout = read_inputs(generator, "heads")
    read_log = torch.tensor([100.0, 95.0, 90.0, 3.0, -3.0, 0.5, -0.5], dtype=F64).repeat(3, 1)
    far = (read_log > 50).expand(q.shape)
    sizes = torch.tensor([50.0, 1e4], dtype=F64)[torch.randint(0, 2, q.shape, generator=generator)]
    signs = torch.where(torch.rand(q.shape, generator=generator) < 0.5, -1.0, 1.0).to(F64)
    near = -read_log + torch.randn(q.shape, generator=generator, dtype=F64)
    raw = torch.where(far, near, signs * sizes)
    inputs = (q, read_log, raw, dout)
    actual = with_grads(inputs, "triton", torch.float32)
    expected = with_grads(inputs, "naive", F64, "cpu")
    # torch's sigmoid backward, (1 - s) s, is 0 in float64 too once s rounds to 1 (raw = 50):
    # the exact d raw = dout q rho sigmoid(-raw), which the kernel computes.
    rho = read_log.exp() * 2.0 * torch.sigmoid(raw)
    expected[3] = dout * q * rho * torch.sigmoid(-raw)
    for name, a, e in zip(NAMES, actual, expected, strict=True):
        assert torch.isfinite(a).all(), name
        if name == "dread_log":
            # A sum over rows of terms of both signs: compared as a whole.
            assert_close(a, e, F32_TOL, name)
        else:
            assert torch.allclose(a, e, rtol=F32_TOL, atol=0.0), name
    # rho ~ 2 where read_log is 90-100: the product is of q's size, not 0 or inf.
    assert (actual[0][far].abs() > 0).any()


@needs_triton
def test_triton_read_log_gradient_sums_over_many_programs(generator, poisoned_empty):
    """More row blocks than backward programs, programs whose last blocks run past the rows and
    several column blocks: each program's partial sums are added once."""
    from deltalab.ops.log_decay import triton as kernels  # the launch table the read gate takes

    small = {"forward_elements": 16, "backward_elements": 16, "max_columns": 8,
             "backward_programs": 3}  # fmt: skip
    table = dataclasses.replace(kernels.LAUNCH, **small)
    inputs = read_inputs(generator, "heads")  # N = 21: three column blocks of 8
    rows = inputs[0].numel() // 21
    assert kernels.launch(rows, 21, "backward", table).grid[1] == 3
    assert -(-rows // 2) > 3  # more row blocks of 2 than the 3 programs
    assert_all_close(
        with_grads(inputs, "triton", torch.float32, table=table),
        with_grads(inputs, "naive", F64, "cpu"),
        F32_TOL,
    )


@needs_triton
def test_triton_reads_a_query_split_from_a_wider_projection(generator, poisoned_empty):
    """q and raw as column slices of wider projections (views with a row stride, as a split of
    a fused projection gives them): read in place, gradients written into their columns only."""
    _, read_log, _, dout = read_inputs(generator, "heads")
    fused_q = torch.randn(2, 5, 40, generator=generator, dtype=F64)
    fused_raw = 3 * torch.randn(2, 5, 30, generator=generator, dtype=F64)
    cols_q, cols_raw = slice(7, 28), slice(9, 30)

    def pieces(q_leaf, raw_leaf):
        return q_leaf[..., cols_q].unflatten(-1, (3, 7)), raw_leaf[..., cols_raw].unflatten(
            -1, (3, 7)
        )

    q, raw = pieces(fused_q, fused_raw)
    assert not q.is_contiguous()
    expected = with_grads((q, read_log, raw, dout), "naive", F64, "cpu")
    leaves = [t.float().to(DEVICE).requires_grad_() for t in (fused_q, read_log, fused_raw)]
    out = read_query(
        pieces(leaves[0], leaves[2])[0],
        leaves[1],
        pieces(leaves[0], leaves[2])[1],
        backend="triton",
    )
    dq, dr, draw = torch.autograd.grad((out * dout.to(DEVICE, out.dtype)).sum(), leaves)
    assert_close(out.cpu().double(), expected[0], F32_TOL, "out")
    assert_close(dq[..., cols_q].cpu().double().unflatten(-1, (3, 7)), expected[1], F32_TOL, "dq")
    assert_close(dr.cpu().double(), expected[2], F32_TOL, "dread_log")
    assert_close(
        draw[..., cols_raw].cpu().double().unflatten(-1, (3, 7)), expected[3], F32_TOL, "draw"
    )
    assert (dq[..., :7] == 0).all() and (dq[..., 28:] == 0).all() and (draw[..., :9] == 0).all()


@needs_triton
@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
def test_triton_forward_mode_derivative_matches_the_torch_path(generator, dynamic):
    inputs = read_inputs(generator, "heads", dynamic)
    primals = [t for t in inputs[:3] if t is not None]
    tangents = [torch.randn(t.shape, generator=generator, dtype=F64) for t in primals]
    results = {}
    for backend, device in (("torch", "cpu"), ("triton", DEVICE)):
        with fwAD.dual_level():
            duals = [
                fwAD.make_dual(p.float().to(device), t.float().to(device))
                for p, t in zip(primals, tangents, strict=True)
            ]
            out = read_query(*duals, backend=backend)
            results[backend] = fwAD.unpack_dual(out).tangent.cpu().double()
    assert_close(results["triton"], results["torch"], F32_TOL, "tangent")


def test_backends_follow_the_delta_rule_and_auto_takes_triton_only_on_cuda():
    assert [layer_backend(b) for b in ("auto", "triton", "chunk", "naive")] == [
        "auto", "triton", "torch", "torch"
    ]  # fmt: skip
    assert resolve_backend("auto", torch.zeros(2, dtype=F64)) == "torch"
    assert resolve_backend("auto", torch.zeros(2)) == "torch"


@pytest.mark.parametrize(
    ("shapes", "message"),
    [
        (((2, 5, 3, 7), (3, 6), None), "read_log must broadcast against q"),
        (((3, 7), (2, 3, 7), None), "read_log must broadcast against q"),
        (((2, 5, 3, 7), (3, 7), (2, 5, 21)), "raw must have q's shape"),
    ],
)
def test_bad_shapes_are_refused_naming_the_argument(shapes, message):
    q, read_log, raw = (None if s is None else torch.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=message):
        read_query(q, read_log, raw, backend="torch")


def test_bad_types_and_an_unknown_backend_are_refused_naming_the_argument():
    with pytest.raises(TypeError, match="q must be a floating-point tensor"):
        read_query(torch.zeros(2, 3, dtype=torch.long), torch.zeros(3))
    with pytest.raises(TypeError, match=r"raw must be a torch\.Tensor"):
        read_query(torch.zeros(2, 3), torch.zeros(3), [0.0])
    with pytest.raises(ValueError, match="backend must be one of"):
        read_query(torch.zeros(2, 3), torch.zeros(3), backend="chunk")


@pytest.mark.skipif(NO_TRITON is None, reason="Triton runs here")
def test_triton_backend_says_why_it_cannot_run():
    with pytest.raises(RuntimeError, match='backend="triton" cannot run here'):
        read_query(torch.zeros(2, 3), torch.zeros(3), backend="triton")


FRONTEND = dict(hidden_size=32, num_heads=2, head_dim=16, value_dim=8, conv_size=4, chunk_size=16)


def spy_read_query(monkeypatch) -> list[str]:
    """The backend of every call the layers make to the fused op for their read gate (their gate
    products, `sigmoid_gate`, share its implementation but not this entry: `spy_sigmoid_gate`)."""
    calls: list[str] = []
    original = op.read_query

    def spy(q, read_log, *args, backend):
        calls.append(backend)
        return original(q, read_log, *args, backend=backend)

    monkeypatch.setattr(op, "read_query", spy)
    return calls


def forward_backward(layer, x, dy):
    """(y, every parameter's gradient by name, the reported gates) of one forward and backward
    of `layer` on x with output gradient dy."""
    y, state = layer(x, return_gates=True)
    (y * dy).sum().backward()
    return y.detach(), {n: p.grad for n, p in layer.named_parameters()}, state.gates


def build(mixer, backend, read_gate="dynamic"):
    torch.manual_seed(0)
    layer = mixer(**FRONTEND, backend=backend, read_gate=read_gate).to(DEVICE)
    if read_gate == "dynamic":
        with torch.no_grad():
            # Away from the zero init, so that rho depends on the token.
            nn.init.normal_(layer.gate_proj.projection("read").weight, std=0.5)
    return layer


@pytest.mark.parametrize("mixer", [Muir, KDNMuir], ids=lambda c: c.__name__)
@pytest.mark.parametrize("backend", ["chunk", "naive", "auto"])
def test_pytorch_and_cpu_layers_keep_rho_among_their_gates(monkeypatch, mixer, backend):
    """The PyTorch paths (and "auto" on CPU) build rho as before and never call the op."""
    calls = spy_read_query(monkeypatch)
    layer = build(mixer, backend).cpu()
    _, state = layer(torch.randn(1, 5, 32), return_gates=True)
    assert calls == [] and "read" in state.gates and FUSED_READ not in state.gates


@needs_triton
@pytest.mark.parametrize("read_gate", ["dynamic", "static"])
@pytest.mark.parametrize("mixer", [Muir, KDNMuir], ids=lambda c: c.__name__)
def test_triton_layer_fuses_its_read_and_matches_the_chunk_layer(monkeypatch, mixer, read_gate):
    """The same parameters on both backends: the Triton layer calls the fused op (and the chunk
    layer does not), with the chunk layer's outputs, every parameter's gradient (read_log and
    the read gate's projection among them) and reported gates, rho included."""
    chunk, triton = build(mixer, "chunk", read_gate), build(mixer, "triton", read_gate)
    triton.load_state_dict(chunk.state_dict(), strict=True)
    x = torch.randn(2, 9, 32, device=DEVICE)
    dy = torch.randn(2, 9, 32, device=DEVICE)
    calls = spy_read_query(monkeypatch)
    results = {"chunk": forward_backward(chunk, x, dy), "triton": forward_backward(triton, x, dy)}
    assert calls == ["triton"]
    (y_t, grads_t, gates_t), (y_c, grads_c, gates_c) = results["triton"], results["chunk"]
    assert_close(y_t, y_c, 1e-5, "y")

    def flat(grads):
        return torch.cat([grads[name].flatten() for name in grads_c])

    assert all(grads_c[n] is not None for n in grads_c)
    assert_close(flat(grads_t), flat(grads_c), 1e-5, "parameter gradients")
    assert_close(grads_t["read_log"], grads_c["read_log"], 1e-5, "dread_log")
    assert gates_t.keys() == gates_c.keys() and FUSED_READ not in gates_t
    assert gates_t["read"].dtype == gates_c["read"].dtype == torch.float32
    assert_close(gates_t["read"], gates_c["read"], 1e-6, "reported rho")


@needs_triton
@pytest.mark.parametrize("mixer", [Muir, KDNMuir], ids=lambda c: c.__name__)
def test_a_gate_hook_on_a_triton_layer_sees_and_moves_rho(monkeypatch, mixer):
    """With a hook registered the layer builds rho (no fused op): a hook sees the read gate by
    its name and moves the same quantity as on the chunk path."""
    chunk, triton = build(mixer, "chunk"), build(mixer, "triton")
    triton.load_state_dict(chunk.state_dict(), strict=True)
    x = torch.randn(2, 6, 32, device=DEVICE)
    calls = spy_read_query(monkeypatch)
    outputs = {}
    with torch.no_grad():
        for name, layer in (("chunk", chunk), ("triton", triton)):
            with perturb_gate(layer, "read", lambda rho: 0.5 * rho):
                y, state = layer(x, return_gates=True)
            outputs[name] = (y, state.gates["read"])
            plain, _ = layer(x)
            assert (plain - y).abs().max() > 1e-4, "the hook must move the output"
    assert calls == ["triton"]  # the unhooked triton forward only
    assert_close(outputs["triton"][0], outputs["chunk"][0], 1e-5, "perturbed y")
    assert_close(outputs["triton"][1], outputs["chunk"][1], 1e-6, "perturbed rho")


@needs_triton
def test_gate_sensitivity_of_a_triton_muir_model_equals_the_chunk_models(monkeypatch):
    """The probes run the layers on the chunk path: rho is a gate there, the fused op is not
    called, and the report (the read gate's included) is the all-PyTorch model's."""
    from deltalab.models import CausalLM, DeltaLabConfig

    ids = torch.randint(0, 50, (1, 9), generator=torch.Generator().manual_seed(0))

    def report(backend):
        config = DeltaLabConfig(
            mixer="muir", hidden_size=32, num_layers=1, num_heads=2, head_dim=16, vocab_size=50,
            chunk_size=16, backend=backend,
        )  # fmt: skip
        torch.manual_seed(0)
        model = CausalLM(config).to(DEVICE).eval()
        loss = lambda m, b: m(input_ids=b, labels=b).loss  # noqa: E731
        return gate_sensitivity(model, ids.to(DEVICE), probes=1, seed=0, loss_fn=loss)

    calls = spy_read_query(monkeypatch)
    ours, theirs = report("triton"), report("chunk")
    assert calls == []
    for table in ("state", "loss"):
        a, b = getattr(ours, table), getattr(theirs, table)
        assert a.keys() == b.keys()
        for layer, gates in b.items():
            assert gates.keys() == a[layer].keys() and "read" in gates
            for gate, value in gates.items():
                assert a[layer][gate] == pytest.approx(value, rel=1e-6), (table, layer, gate)


@pytest.mark.skipif(not CUDA or NO_TRITON is not None, reason="bfloat16 kernels: CUDA only")
@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
def test_triton_bfloat16_query_is_the_torch_paths_to_rounding(generator, dynamic):
    """bfloat16 q and raw (autocast), float32 read_log: the product and dq bfloat16, draw
    bfloat16, dread_log float32; within a bfloat16 rounding of the torch path (one rounding of
    the same float32 numbers) and as close to float64 as it."""
    q, read_log, raw, dout = read_inputs(generator, "heads", dynamic)
    q, raw, dout = (None if t is None else t.bfloat16().double() for t in (q, raw, dout))
    expected = with_grads((q, read_log, raw, dout), "naive", F64, "cpu")
    got = {}
    for backend in ("torch", "triton"):
        leaves = [q.bfloat16().cuda(), read_log.float().cuda()]
        leaves += [] if raw is None else [raw.bfloat16().cuda()]
        leaves = [t.requires_grad_() for t in leaves]
        out = read_query(*leaves, backend=backend)
        assert out.dtype == torch.bfloat16
        grads = torch.autograd.grad((out * dout.cuda().bfloat16()).sum(), leaves)
        assert [g.dtype for g in grads] == [t.dtype for t in leaves]
        got[backend] = [t.detach().cpu().double() for t in (out, *grads)]
        assert_close(got[backend][0], expected[0], 1e-2, f"{backend} out")
        assert_close(got[backend][2], expected[2], 1e-4, f"{backend} dread_log")
    assert_all_close(got["triton"], got["torch"], 1e-2, "triton vs torch")


# --- GDN-2's and Muir's gate products: sigmoid_gate, the read at the constant vector 1/2 ---


def test_log_half_is_exactly_one_half_after_exp():
    # The op is then sigmoid(logits) * x to its own rounding, in float32 and in float64.
    for dtype in (torch.float32, F64):
        assert torch.tensor(op.LOG_HALF, dtype=dtype).exp().item() == 0.5


@pytest.mark.parametrize("backend", ["naive", "torch", "triton"])
def test_sigmoid_gate_is_x_times_the_sigmoid_with_its_gradients(backend):
    if backend == "triton" and NO_TRITON is not None:
        pytest.skip(NO_TRITON)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 5, 2, 9, generator=g, dtype=F64)
    # Logits far into both tails, where 1 - s must keep its digits.
    logits = 6.0 * torch.randn(3, 5, 2, 9, generator=g, dtype=F64)
    logits[0, 0, 0, :3] = torch.tensor([-100.0, 100.0, -30.0], dtype=F64)
    dout = torch.randn(3, 5, 2, 9, generator=g, dtype=F64)
    s = torch.sigmoid(logits)
    expected = (x * s, dout * s, dout * x * s * torch.sigmoid(-logits))
    dtype = F64 if backend != "triton" else torch.float32
    xd = x.to(DEVICE, dtype).requires_grad_()
    ld = logits.to(DEVICE, dtype).requires_grad_()
    out = op.sigmoid_gate(xd, ld, backend=backend)
    out.backward(dout.to(DEVICE, dtype))
    assert out.dtype == dtype
    tol = 1e-12 if dtype == F64 else F32_TOL
    for name, got, want in zip(
        ("out", "dx", "dlogits"), (out, xd.grad, ld.grad), expected, strict=True
    ):
        assert_close(got.detach().cpu().double(), want, tol, name)


def spy_sigmoid_gate(monkeypatch) -> list[str]:
    """The backend of every gate product the layers compute with `sigmoid_gate` (they call the
    name that the parametrization imported)."""
    from deltalab.ops import parametrize

    calls: list[str] = []
    original = parametrize.sigmoid_gate

    def spy(x, logits, *, backend):
        calls.append(backend)
        return original(x, logits, backend=backend)

    monkeypatch.setattr(parametrize, "sigmoid_gate", spy)
    return calls


def build_gated(mixer, backend):
    from deltalab.layers import GatedDeltaNet2

    torch.manual_seed(0)
    if mixer is GatedDeltaNet2:
        return mixer(**FRONTEND, backend=backend).to(DEVICE)
    return build(mixer, backend)


@needs_triton
@pytest.mark.parametrize("mixer", ["GatedDeltaNet2", "Muir"])
def test_triton_layer_fuses_its_gate_products_and_matches_the_chunk_layer(monkeypatch, mixer):
    """Where nothing sees the erase and write gates, the Triton layer multiplies each sigmoid in
    with `sigmoid_gate` (the chunk layer does not): the chunk layer's outputs, every parameter's
    gradient, and the same reported gates (the sigmoids, not the logits)."""
    import deltalab.layers as layers
    from deltalab.layers.gdn2 import ERASE_LOGITS, WRITE_LOGITS

    cls = getattr(layers, mixer)
    chunk, triton = build_gated(cls, "chunk"), build_gated(cls, "triton")
    triton.load_state_dict(chunk.state_dict(), strict=True)
    x = torch.randn(2, 9, 32, device=DEVICE)
    dy = torch.randn(2, 9, 32, device=DEVICE)
    calls = spy_sigmoid_gate(monkeypatch)
    results = {}
    for name, layer in (("chunk", chunk), ("triton", triton)):
        results[name] = forward_backward(layer, x, dy)
        assert calls == ([] if name == "chunk" else ["triton", "triton"]), name
    (y_t, grads_t, gates_t), (y_c, grads_c, gates_c) = results["triton"], results["chunk"]
    assert_close(y_t, y_c, 1e-5, "y")
    for n, grad in grads_c.items():
        assert grad is not None and grads_t[n] is not None, n
        assert_close(grads_t[n], grad, 1e-5, f"d{n}")
    assert gates_t.keys() == gates_c.keys()
    assert ERASE_LOGITS not in gates_t and WRITE_LOGITS not in gates_t
    for name in ("erase", "write"):
        assert_close(gates_t[name], gates_c[name], 1e-6, name)


@needs_triton
@pytest.mark.parametrize("mixer", ["GatedDeltaNet2", "Muir"])
def test_a_gate_hook_on_a_triton_layer_sees_the_erase_and_write_sigmoids(monkeypatch, mixer):
    """With a hook registered the layer builds the sigmoids (no fused product), and a hook that
    moves the erase gate moves the output as on the chunk path."""
    import deltalab.layers as layers

    cls = getattr(layers, mixer)
    chunk, triton = build_gated(cls, "chunk"), build_gated(cls, "triton")
    triton.load_state_dict(chunk.state_dict(), strict=True)
    x = torch.randn(2, 6, 32, device=DEVICE)
    with torch.no_grad():
        plain = triton(x)[0]  # no hook: the fused products
    calls = spy_sigmoid_gate(monkeypatch)
    seen, outputs = {}, {}

    def halve_erase(gates):
        seen[len(seen)] = sorted(gates)
        return gates | {"erase": 0.5 * gates["erase"]}

    with torch.no_grad():
        for name, layer in (("chunk", chunk), ("triton", triton)):
            handle = layer.register_gate_hook(halve_erase)
            outputs[name] = layer(x)[0]
            handle.remove()
    assert calls == []
    assert all("erase" in names and "write" in names for names in seen.values())
    # The hook took effect on the Triton layer, and as on the chunk path.
    assert (plain - outputs["triton"]).abs().max() > 1e-4
    assert_close(outputs["triton"], outputs["chunk"], 1e-5, "hooked y")


@needs_triton
@pytest.mark.parametrize("mixer", ["GatedDeltaNet2", "Muir"])
def test_a_subclass_whose_gates_take_no_logits_keeps_the_sigmoids_on_triton(monkeypatch, mixer):
    """A subclass overriding `gates(self, x)` the way the base class documented it before the
    `logits` keyword runs on Triton with its sigmoids (no fused products, no TypeError), giving
    its parent's outputs."""
    import deltalab.layers as layers

    parent = getattr(layers, mixer)

    class Plain(parent):
        def gates(self, x):
            return super().gates(x)

    base = build_gated(parent, "triton")
    torch.manual_seed(0)
    plain = Plain(**FRONTEND, backend="triton", **({} if mixer == "GatedDeltaNet2" else {
        "read_gate": "dynamic"})).to(DEVICE)  # fmt: skip
    plain.load_state_dict(base.state_dict(), strict=True)
    x = torch.randn(2, 6, 32, device=DEVICE)
    calls = spy_sigmoid_gate(monkeypatch)
    with torch.no_grad():
        y_plain = plain(x)[0]
    assert calls == []
    with torch.no_grad():
        y_base = base(x)[0]
    assert calls  # the parent fuses its products
    assert_close(y_plain, y_base, 1e-5, "y")
