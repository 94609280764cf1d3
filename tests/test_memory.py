"""What the mixers keep for backward under bf16 autocast (benchmarks/memory_audit.py measures
it per token): the frontend's projections of one input share one autocast copy of it (without
changing an output or a gradient), k reaches the delta rule contiguous, the tensor the
layer's gate product keeps (the Triton kernel keeps its inputs contiguous: a strided k would be
kept twice), and the RMS norms keep their input and one number per row, not the normalized
values (their adjoints recompute them)."""

from __future__ import annotations

import contextlib
import copy
from unittest import mock

import pytest
import torch
from conftest import check_ffn_recompute, with_formula_norms

import deltalab.layers.projections as projections
import deltalab.layers.recurrence as recurrence
import deltalab.layers.shared_input as shared_input
from deltalab.layers import (
    Attention,
    DeltaNet,
    DiagonalKDN,
    ExactKDN,
    GatedDeltaNet,
    GatedDeltaNet2,
    IsotropicKDN,
    KDNMuir,
    KimiDeltaAttention,
    Muir,
)
from deltalab.layers.norms import GatedRMSNorm, RMSNorm
from deltalab.layers.shared_input import project, shared_autocast_input, sharing_autocast_input
from deltalab.ops.norms.reference import rms_norm_naive, rms_norm_torch

DELTA_MIXERS = (
    DeltaNet,
    GatedDeltaNet,
    KimiDeltaAttention,
    GatedDeltaNet2,
    Muir,
    IsotropicKDN,
    DiagonalKDN,
    ExactKDN,
    KDNMuir,
)
SIZES = dict(hidden_size=32, num_heads=2, head_dim=16)
FRONTEND = dict(**SIZES, conv_size=3, chunk_size=16, backend="chunk")


def build(cls):
    torch.manual_seed(0)
    layer = cls(**SIZES) if cls is Attention else cls(**FRONTEND)
    with torch.no_grad():
        # Zero-initialized projections (Muir's read gate) would leave a gate constant.
        for param in layer.parameters():
            if not param.any():
                param.normal_(std=0.1)
    return layer


def hidden(length=20):
    return torch.randn(2, length, SIZES["hidden_size"], generator=torch.Generator().manual_seed(1))


def non_leaf(x):
    """x as a layer sees it in a model: the output of an op (autocast caches its casts of
    leaves that need a gradient, so a leaf would share its cast anyway)."""
    leaf = x.requires_grad_()
    return leaf, leaf * 1.0


def saved_tensors(layer, x):
    """Every tensor the layer's graph saves for backward under CPU bf16 autocast."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            layer(x)
    return saved


def saved_copies(cls, share: bool) -> int:
    """How many storages the layer saves holding x's bf16 cast."""
    layer = build(cls) if share else projected_apart(build(cls))
    _, x = non_leaf(hidden())
    copy = x.detach().bfloat16().flatten(0, 1)
    with unshared(not share):
        saved = saved_tensors(layer, x)
    return len(
        {
            t.untyped_storage().data_ptr()
            for t in saved
            if t.dtype == torch.bfloat16
            and t.numel() == x.numel()
            and torch.equal(t.reshape(copy.shape), copy)
        }
    )


def separate(x):
    """What the layers did before `shared_autocast_input`: x as it is, autocast casts it."""
    return lambda: x


@contextlib.contextmanager
def unshared(active: bool = True):
    """The layers with `separate` in place of `shared_autocast_input` (when active)."""
    with contextlib.ExitStack() as stack:
        if active:
            stack.enter_context(mock.patch.object(shared_input, "shared_autocast_input", separate))
        yield


def projected_apart(layer: torch.nn.Module) -> torch.nn.Module:
    """`layer` with each projection called as a module, with its own gradient product, as
    autograd makes them: a forward pre-hook that does nothing makes a `nn.Linear` not
    `fusable`, so `project_together` computes none of them."""
    for module in layer.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(lambda module, inputs: None)
    return layer


@pytest.mark.parametrize("cls", (*DELTA_MIXERS, Attention), ids=lambda cls: cls.__name__)
def test_every_projection_of_the_input_shares_one_saved_autocast_copy(cls):
    # q, k, v, the output gate and the gates' projections of x (erase and write, the decays,
    # the noise models, Muir's fused gates) keep one bf16 copy of x between them, where each
    # would keep its own.
    assert saved_copies(cls, share=True) == 1
    assert saved_copies(cls, share=False) >= (3 if cls is Attention else 4)


def test_project_hands_out_the_shared_copy_only_for_the_shared_input():
    x, other = torch.randn(3, 4), torch.randn(3, 4)
    seen = []

    def proj(t):
        seen.append(t)
        return t

    assert project(proj, x) is x  # no block: x itself
    with torch.autocast("cpu", dtype=torch.bfloat16), sharing_autocast_input(x) as x_in:
        shared = project(proj, x)
        assert torch.equal(shared, x.bfloat16())
        assert shared.untyped_storage().data_ptr() == x_in().untyped_storage().data_ptr()
        assert project(proj, other) is other  # another tensor, even an equal one: as it is
        assert project(proj, x.clone()) is not shared
        with sharing_autocast_input(other):
            assert torch.equal(project(proj, other), other.bfloat16())
            assert project(proj, x).dtype == torch.float32  # the inner block shares other only
        assert project(proj, x).untyped_storage().data_ptr() == shared.untyped_storage().data_ptr()
    assert project(proj, x) is x


# The mixers whose k reaches the delta rule through `deltalab.ops.parametrize`.
PARAMETRIZED = (DeltaNet, GatedDeltaNet, KimiDeltaAttention, GatedDeltaNet2, Muir)


@pytest.mark.parametrize("cls", PARAMETRIZED, ids=lambda cls: cls.__name__)
def test_the_key_the_delta_rule_keeps_is_the_one_the_gate_product_keeps(cls):
    layer, x = build(cls), hidden()
    calls = []
    real = recurrence.delta_rule

    def spy(*inputs, **kwargs):
        calls.append(inputs)
        return real(*inputs, **kwargs)

    with mock.patch.object(recurrence, "delta_rule", spy):
        saved = saved_tensors(layer, x)
    ((_, a, b, _, _),) = calls
    key = a if cls in (GatedDeltaNet2, Muir) else b
    # Contiguous, so the Triton kernel keeps k itself rather than a copy, and the same storage
    # as the k the layer's graph keeps.
    assert key.is_contiguous()
    storages = {t.untyped_storage().data_ptr() for t in saved}
    assert key.untyped_storage().data_ptr() in storages


def test_shared_autocast_input_is_what_autocast_would_cast_and_nothing_else():
    x = torch.randn(3, 4)
    assert shared_autocast_input(x)() is x
    with torch.autocast("cpu", dtype=torch.bfloat16):
        make = shared_autocast_input(x)
        first, second = make(), make()
        assert torch.equal(first, x.bfloat16()) and first.dtype == torch.bfloat16
        assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
        assert shared_autocast_input(x.double())().dtype == torch.float64
        bf16 = x.bfloat16()
        assert shared_autocast_input(bf16)() is bf16
    with torch.device("meta"):
        meta = torch.empty(3, 4)
    assert shared_autocast_input(meta)() is meta


def test_each_use_of_the_shared_copy_returns_its_gradient_in_the_input_dtype():
    # With one node for all uses, their gradients would add up in bf16 before reaching x.
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(8, 8, generator=generator) for _ in range(3)]

    def grad(share: bool):
        leaf, x = non_leaf(torch.randn(4, 8, generator=torch.Generator().manual_seed(1)))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            make = shared_autocast_input(x) if share else lambda: x
            y = sum(torch.nn.functional.linear(make(), w).float() for w in weights)
        y.square().sum().backward()
        return leaf.grad

    assert torch.equal(grad(True), grad(False))


@pytest.mark.parametrize("cls", (*DELTA_MIXERS, Attention), ids=lambda cls: cls.__name__)
def test_sharing_the_autocast_copy_changes_no_output_or_gradient(cls):
    def run(share: bool):
        layer = build(cls)
        leaf, x = non_leaf(hidden())
        with unshared(not share), torch.autocast("cpu", dtype=torch.bfloat16):
            y, _ = layer(x)
        y.float().square().sum().backward()
        return [y, leaf.grad, *(p.grad for p in layer.parameters())]

    for shared, separate in zip(run(True), run(False), strict=True):
        assert torch.equal(shared, separate)


NORM_CASES = [(None, "sigmoid"), ("sigmoid", "sigmoid"), ("silu", "silu")]


@pytest.mark.parametrize(("gated", "activation"), NORM_CASES, ids=["plain", "sigmoid", "silu"])
def test_rms_norm_adjoints_are_the_formulas_derivatives(gated, activation):
    """Backward and forward-mode derivatives (gate-sensitivity probes use the latter) of the
    hand-written adjoints against finite differences, float64, weight and gate included."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(8, generator=gen, dtype=torch.float64, requires_grad=True)
    gate = torch.randn(3, 5, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    args = (x, weight, gate) if gated else (x, weight)

    def norm(x, weight, gate=None):
        return rms_norm_torch(x, weight, 1e-5, gate, activation)

    assert torch.autograd.gradcheck(norm, args)
    assert torch.autograd.gradcheck(
        norm, args, check_forward_ad=True, check_backward_ad=False, check_undefined_grad=False
    )


def test_the_torch_rms_norms_second_output_has_its_derivatives():
    """1/rms, the Function's second output (returned for torch.func), differentiated both ways
    with the first, in float64."""
    from deltalab.ops.norms.reference import _RMSNormFunction

    gen = torch.Generator().manual_seed(3)
    x, gate = (torch.randn(3, 5, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    weight = torch.randn(8, generator=gen, dtype=torch.float64)
    args = tuple(t.requires_grad_() for t in (x, weight, gate))
    both = lambda x, w, g: _RMSNormFunction.apply(x, w, g, 1e-5, "silu")  # noqa: E731
    assert torch.autograd.gradcheck(both, args, check_forward_ad=True)


@pytest.mark.parametrize(("gated", "activation"), NORM_CASES, ids=["plain", "sigmoid", "silu"])
def test_the_torch_rms_norm_takes_vmap_of_jvp_with_the_formulas_tangents(gated, activation):
    """What gate sensitivity's batched probes do to the norms: torch.func.vmap over
    torch.func.jvp, four directions at once; the torch path's tangents are the formula's."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 5, 16, generator=gen)
    weight = torch.randn(16, generator=gen)
    gate = torch.randn(2, 5, 16, generator=gen) if gated else None
    directions = torch.randn(4, 2, 5, 16, generator=gen)

    def tangents(norm):
        def one(d):
            return torch.func.jvp(lambda x: norm(x, weight, 1e-5, gate, activation), (x,), (d,))[1]

        return torch.func.vmap(one)(directions)

    ours, formula = tangents(rms_norm_torch), tangents(rms_norm_naive)
    assert ours.shape == (4, 2, 5, 16)
    torch.testing.assert_close(ours, formula, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("gated", "activation"), NORM_CASES, ids=["plain", "sigmoid", "silu"])
def test_rms_norm_output_is_the_formulas_bit_for_bit(dtype, gated, activation):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 7, 16, generator=gen).to(dtype)
    weight = torch.randn(16, generator=gen)
    gate = torch.randn(4, 7, 16, generator=gen).to(dtype) if gated else None
    assert torch.equal(
        rms_norm_torch(x, weight, 1e-5, gate, activation),
        rms_norm_naive(x, weight, 1e-5, gate, activation),
    )


@pytest.mark.parametrize("norm", [RMSNorm(16), GatedRMSNorm(16)], ids=["rms", "gated"])
def test_rms_norms_keep_their_inputs_and_one_number_per_row(norm):
    """Saved for backward: the input (and gate) as given, the weight, and 1/rms per row:
    nothing else of the input's size (the formula left to autograd kept three such tensors)."""
    x = torch.randn(2, 9, 16, requires_grad=True)
    gate = torch.randn(2, 9, 16, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = norm(x) if isinstance(norm, RMSNorm) else norm(x, gate)
    big = [t for t in saved if t is not None and t.numel() == x.numel()]
    rows = [t for t in saved if t is not None and t.numel() == x.numel() // x.shape[-1]]
    assert len(big) == (1 if isinstance(norm, RMSNorm) else 2)
    assert all(t.data_ptr() in (x.data_ptr(), gate.data_ptr()) for t in big)
    assert len(rows) == 1
    y.sum().backward()
    assert x.grad is not None and norm.weight.grad is not None


def test_a_model_trained_through_the_norm_adjoints_gets_the_formulas_gradients():
    """Every parameter's gradient of a small GDN-2 model, float32, with the hand-written norm
    adjoints against autograd through the formula: the same to float32 rounding."""
    from deltalab.models import CausalLM, DeltaLabConfig

    config = DeltaLabConfig(
        mixer="gdn2", hidden_size=32, num_layers=2, num_heads=2, head_dim=16, vocab_size=50,
        chunk_size=16, backend="chunk",
    )  # fmt: skip
    ids = torch.randint(0, 50, (2, 24), generator=torch.Generator().manual_seed(0))

    def gradients(formula: bool):
        torch.manual_seed(0)
        model = CausalLM(config)
        if formula:
            with_formula_norms(model)
        model(ids, labels=ids).loss.backward()
        return {n: p.grad for n, p in model.named_parameters()}

    ours = gradients(formula=False)
    formula = gradients(formula=True)
    assert any(not torch.equal(ours[n], formula[n]) for n in ours), "the paths rounded alike"
    for name, grad in ours.items():
        scale = formula[name].abs().max().clamp_min(1e-12)
        assert (grad - formula[name]).abs().max() / scale < 1e-5, name


def _pieces():
    """Each piece as the layers run it (its formula under `recomputed`) and its formula called
    whole, on one set of parameters."""
    from deltalab.layers.decay import log_decay
    from deltalab.layers.short_conv import ShortConvolution, _conv_silu
    from deltalab.models.lm import SwiGLU
    from deltalab.ops.log_decay.reference import log_decay_naive
    from deltalab.ops.swiglu.reference import swiglu_formula

    torch.manual_seed(0)
    conv, swiglu = ShortConvolution(8, 4), SwiGLU(8, 12)
    a_log, dt_bias = torch.randn(2, 1), torch.randn(2, 4)

    def conv_whole(x):
        padded = torch.cat([x.new_zeros(x.shape[0], 8, 3), x.transpose(1, 2)], dim=-1)
        return _conv_silu(padded, conv.weight).transpose(1, 2)

    return {
        "log_decay": (
            lambda x: log_decay(a_log, x.unflatten(-1, (2, 4)), dt_bias),
            lambda x: log_decay_naive(a_log, x.unflatten(-1, (2, 4)), dt_bias),
        ),
        "short_convolution": (lambda x: conv(x)[0], conv_whole),
        "swiglu": (swiglu, lambda x: swiglu.down(swiglu_formula(swiglu.gate_up(x)))),
    }


@pytest.mark.parametrize("name", ["log_decay", "short_convolution", "swiglu"])
def test_recomputed_pieces_keep_less_and_give_the_same_gradients_bit_for_bit(name):
    """Under bf16 autocast on a bf16 input (a projection's output), as training runs: each
    piece keeps fewer bytes for backward with its intermediates recomputed than its formula
    called whole, and every gradient is the same bit for bit."""
    recomputing, whole = _pieces()[name]

    def run(fn):
        x = torch.randn(2, 9, 8, generator=torch.Generator().manual_seed(2)).bfloat16()
        x.requires_grad_()
        kept = {}

        def pack(t):
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = fn(x)
        y.float().square().sum().backward()
        return sum(kept.values()), x.grad, y

    kept, grad, y = run(recomputing)
    kept_plain, grad_plain, y_plain = run(whole)
    assert torch.equal(y, y_plain)
    assert kept < kept_plain
    assert torch.equal(grad, grad_plain)


def test_sharing_the_autocast_copy_breaks_no_compiled_graph():
    # Dynamo does not trace ContextVar operations: under torch.compile, `sharing_autocast_input`
    # and `project` leave them out, so no graph break comes from them.
    layer = build(GatedDeltaNet2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explained = torch._dynamo.explain(lambda x: layer(x)[0])(hidden())
    frames = {frame.name for reason in explained.break_reasons for frame in reason.user_stack or []}
    assert not frames & {"project", "sharing_autocast_input"}, frames


@pytest.mark.parametrize("cls", (*DELTA_MIXERS, Attention), ids=lambda cls: cls.__name__)
def test_every_projection_of_the_input_comes_from_the_layers_shared_products(cls):
    # A projection of x that a mixer does not declare (`gate_projections`) still works, as a
    # module call on x with a gradient product and sum of its own: none may be left.
    layer, (_, x) = build(cls), non_leaf(hidden())
    calls, together = [], []

    def record(module, inputs):
        # A projection run as a module on x itself (modules that take x and project it through
        # `project`, the decays and noise models, are not projections).
        if isinstance(module, (torch.nn.Linear, torch.nn.Sequential)) and inputs[0] is x:
            calls.append(module)

    real = shared_input.project_together

    def spy(x_in, linears):
        together.append(len(linears))
        return real(x_in, linears)

    # A module-wide hook: a hook on a projection itself would make it unfusable (`fusable`).
    handle = torch.nn.modules.module.register_module_forward_pre_hook(record)
    try:
        with mock.patch.object(shared_input, "project_together", spy):
            layer(x)[0].sum().backward()
    finally:
        handle.remove()
    assert calls == []
    (count,) = together  # one shared block per forward
    assert count == 3 if cls is Attention else count >= 5  # q, k, v, output gate, a gate


@pytest.mark.parametrize("cls", (*DELTA_MIXERS, Attention), ids=lambda cls: cls.__name__)
def test_projecting_together_changes_no_output_and_every_gradient_by_rounding_only(cls):
    # float64: one product for the input gradient is the sum of the separate ones.
    def run(together: bool):
        layer = build(cls).double()
        layer = layer if together else projected_apart(layer)
        leaf, x = non_leaf(hidden().double())
        y, _ = layer(x)
        y.square().sum().backward()
        return [y, leaf.grad, *(p.grad for p in layer.parameters())]

    for fused, apart in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(fused, apart, rtol=1e-12, atol=1e-12)


def linears_and_input(bias_of=(False, True, False), dtype=torch.float32):
    generator = torch.Generator().manual_seed(2)
    linears = [
        torch.nn.Linear(24, width, bias=bias)
        for width, bias in zip((16, 8, 40), bias_of, strict=True)
    ]
    for lin in linears:
        lin.to(dtype)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=generator))
            if lin.bias is not None:
                lin.bias.copy_(torch.randn(lin.bias.shape, generator=generator))
    x = torch.randn(3, 5, 24, generator=generator, dtype=dtype, requires_grad=True)
    upstream = [torch.randn(3, 5, lin.out_features, generator=generator) for lin in linears]
    return linears, x, upstream


def project_grads(linears, x, upstream, together: bool, autocast: bool = False, used=(0, 1, 2)):
    for p in [x, *(p for lin in linears for p in lin.parameters())]:
        p.grad = None
    # Not the leaf itself: autocast caches its casts of leaves, so separate projections of a
    # leaf would share one cast (and add their gradients in bf16).
    _, x_op = non_leaf(x)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        if together:
            outputs = projections.project_together(x_op, linears)
        else:
            outputs = {lin: lin(x_op) for lin in linears}
    loss = sum((outputs[linears[i]].double() * upstream[i]).sum() for i in used)
    loss.backward()
    outs = [outputs[lin] for lin in linears]
    return outs, [x.grad, *(p.grad for lin in linears for p in lin.parameters())]


@pytest.mark.parametrize("used", [(0, 1, 2), (0, 2)], ids=["all", "one unused"])
def test_project_together_is_each_linear_with_their_gradients_summed(used):
    linears, x, upstream = linears_and_input(dtype=torch.float64)
    outs, grads = project_grads(linears, x, upstream, True, used=used)
    ref_outs, ref_grads = project_grads(linears, x, upstream, False, used=used)
    for out, ref in zip(outs, ref_outs, strict=True):
        assert torch.equal(out, ref)  # the forward is each map's own product
    for grad, ref in zip(grads, ref_grads, strict=True):
        if ref is None:  # the unused output's weight (and bias): none, as autograd gives it
            assert grad is None
        else:
            torch.testing.assert_close(grad, ref, rtol=1e-12, atol=1e-12)


def test_project_together_under_autocast_rounds_the_gradients_as_much_as_apart():
    # bf16: autograd rounds each dx_i to bf16 before adding them in float32; one product
    # rounds their sum once. Against float64 both errors are of the same size (the bf16 copy
    # of x dominates them), and the weights' gradients (one product each way) are within bf16
    # rounding.
    linears, x, upstream = linears_and_input()
    exact_linears = [copy.deepcopy(lin).double() for lin in linears]
    exact_x = x.detach().double().requires_grad_()
    exact = project_grads(exact_linears, exact_x, upstream, False)[1]
    outs, fused = project_grads(linears, x, upstream, True, autocast=True)
    ref_outs, apart = project_grads(linears, x, upstream, False, autocast=True)
    assert all(o.dtype == torch.bfloat16 for o in outs)
    for out, ref in zip(outs, ref_outs, strict=True):
        assert torch.equal(out, ref)
    assert fused[0].dtype == torch.float32 and fused[1].dtype == torch.float32
    error = (fused[0].double() - exact[0]).norm() / exact[0].norm()
    error_apart = (apart[0].double() - exact[0]).norm() / exact[0].norm()
    assert 2**-10 < error_apart < 2**-6  # bf16 rounding, not exact
    assert error <= 1.05 * error_apart, (error, error_apart)
    for grad, ref, truth in zip(fused[1:], apart[1:], exact[1:], strict=True):
        scale = truth.abs().max()
        assert (grad.double() - truth).abs().max() <= 2**-7 * scale
        assert (ref.double() - truth).abs().max() <= 2**-7 * scale


def test_a_projection_whose_gate_a_hook_replaced_gets_no_gradient_as_apart():
    # None, not zeros: AdamW's weight decay and DDP treat a zero gradient as a gradient.
    def grads(together: bool):
        layer, (_, x) = build(GatedDeltaNet2), non_leaf(hidden())
        layer = layer if together else projected_apart(layer)
        layer.register_gate_hook(
            lambda gates: {**gates, "erase": torch.full_like(gates["erase"], 0.5)}
        )
        layer(x)[0].sum().backward()
        return layer.b_proj.weight.grad, layer.w_proj.weight.grad

    (erase, write), (erase_apart, write_apart) = grads(True), grads(False)
    assert erase is None and erase_apart is None
    torch.testing.assert_close(write, write_apart)


def test_hooked_or_subclassed_projections_are_called_as_modules():
    # A hook (pruning's mask is one) or a forward of its own runs only if the module is called.
    from torch.nn.utils import prune

    class Doubled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    layer, (_, x) = build(GatedDeltaNet2), non_leaf(hidden())
    seen = []
    layer.q_proj.register_forward_pre_hook(lambda module, inputs: seen.append(module))
    prune.random_unstructured(layer.k_proj, name="weight", amount=0.5)
    doubled = Doubled(SIZES["hidden_size"], layer.w_proj.out_features, bias=False)
    with torch.no_grad():
        doubled.weight.copy_(layer.w_proj.weight)
    layer.w_proj = doubled
    for _ in range(2):  # pruning's reparametrization recomputes the weight each forward
        layer(x)[0].sum().backward(retain_graph=True)
    assert seen == [layer.q_proj, layer.q_proj]
    assert layer.k_proj.weight_orig.grad is not None and layer.w_proj.weight.grad is not None
    assert not projections.fusable(layer.q_proj) and not projections.fusable(doubled)
    assert projections.fusable(layer.v_proj)


def test_projecting_together_has_the_forward_mode_derivative_of_the_maps_apart():
    # With gradients on as well: forward-mode AD through the Function's jvp.
    import torch.autograd.forward_ad as fwAD

    def tangent(together: bool):
        layer = build(GatedDeltaNet2).double()
        layer = layer if together else projected_apart(layer)
        x = hidden().double().requires_grad_()
        t = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
        with fwAD.dual_level():
            y, _ = layer(fwAD.make_dual(x, t))
            return fwAD.unpack_dual(y).tangent

    torch.testing.assert_close(tangent(True), tangent(False), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mixer", ["gdn2", "transformer"])
def test_recomputing_the_ffn_keeps_none_of_its_activations_and_gives_the_same_gradients(
    mixer, monkeypatch
):
    """A model with `recompute_ffn` (train.recompute_ffn), trained under bf16 autocast on the
    torch path: each block's FFN branch is recomputed, no tensor of the FFN's hidden width is
    kept for backward (without it, its activations and its weights' bf16 copies are), fewer
    bytes in all, and every parameter's gradient is the same bit for bit. Outside training
    (eval mode, gradients on) nothing is recomputed. tests/test_layers_triton.py checks the
    same on the Triton kernels."""
    check_ffn_recompute(mixer, "chunk", monkeypatch)
