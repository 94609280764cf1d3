"""`rebuildable` / `rebuilt_in_backward`: inputs of the delta rule that cheap ops made are made
again in the backward instead of kept, with the same gradients bit for bit.

The mechanism is tested here on CPU with a custom Function that saves its input; the layers on
the Triton kernels (where the delta rule's own Function saves q, a, b, u, g) are tested under the
interpreter in tests/test_layers_triton.py.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from deltalab.models import CausalLM, build_config
from deltalab.ops import _recompute
from deltalab.ops._recompute import (
    Recipe,
    rebuildable,
    rebuildable_as,
    rebuilding,
    rebuilt_in_backward,
    without_rebuild,
)


class _Square(torch.autograd.Function):
    """x^2, saving x: what it keeps is read from `kept` by a hook-free spy."""

    kept: ClassVar[list] = []

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        _Square.kept.append(x)
        return 2 * x * dy


def _packed(fn):
    """The objects the saved-tensor hooks of `rebuilt_in_backward` pack while fn runs."""
    packed = []
    pack = _recompute._pack

    def spy(t):
        packed.append(pack(t))
        return packed[-1]

    original, _recompute._pack = _recompute._pack, spy
    try:
        fn()
    finally:
        _recompute._pack = original
    return packed


def _marked_product(generator):
    x = torch.randn(5, generator=generator, requires_grad=True)
    y = torch.randn(5, generator=generator, requires_grad=True)
    return x, y, rebuildable(x * y, torch.mul, x, y)


def test_a_marked_input_is_kept_as_its_recipe_and_rebuilt_with_the_same_gradients(generator):
    x, y, product = _marked_product(generator)
    results = {}
    for rebuild in (False, True):
        _Square.kept.clear()
        x.grad = y.grad = None
        calls = []

        def forward(rebuild=rebuild, calls=calls):
            context = rebuilt_in_backward() if rebuild else torch.enable_grad()
            with context:
                calls.append(_Square.apply(product))

        packed = _packed(forward)
        calls[0].sum().backward(retain_graph=True)
        results[rebuild] = (x.grad.clone(), y.grad.clone(), _Square.kept[0])
        if rebuild:
            assert len(packed) == 1 and isinstance(packed[0], Recipe)
        else:
            assert packed == []
    assert torch.equal(results[True][0], results[False][0])
    assert torch.equal(results[True][1], results[False][1])
    # The backward read a new tensor with the saved one's values, not the saved tensor.
    assert torch.equal(results[True][2], product)
    assert results[True][2].data_ptr() != product.data_ptr()


def test_an_input_changed_in_place_after_marking_is_kept(generator):
    _, _, product = _marked_product(generator)
    marked = product.clone()  # a non-leaf that requires grad, marked below
    marked = rebuildable(marked, torch.clone, product)
    with torch.no_grad():
        marked.add_(1)  # bumps its version: the recipe no longer gives its values
    packed = _packed(lambda: _run_rebuilt(marked))
    assert len(packed) == 1 and packed[0] is marked


def _run_rebuilt(t):
    with rebuilt_in_backward():
        return _Square.apply(t)


def test_a_recipe_whose_argument_changed_in_place_refuses_to_run_naming_it(generator):
    _, y, product = _marked_product(generator)
    out = _run_rebuilt(product)
    with torch.no_grad():
        y.mul_(2)
    with pytest.raises(RuntimeError, match=r"argument 1 of 'mul'.*modified in place"):
        out.sum().backward()


@pytest.mark.parametrize(
    "off", ["no grad", "rebuilding(False)", "without_rebuild"], ids=lambda s: s.replace(" ", "-")
)
def test_nothing_is_rebuilt_without_gradients_inside_rebuilding_false_or_without_rebuild(
    generator, off
):
    x, y, product = _marked_product(generator)
    if off == "no grad":
        with torch.no_grad():
            product = rebuildable(x * y, torch.mul, x, y)
        assert _recompute.recipe_of(product) is None
        return
    if off == "rebuilding(False)":
        with rebuilding(False):
            packed = _packed(lambda: _run_rebuilt(product))
            assert _recompute.recipe_of(product) is None
            # Nothing made inside is marked either.
            assert _recompute.recipe_of(rebuildable(x * y, torch.mul, x, y)) is None
    else:
        packed = _packed(lambda: without_rebuild(_run_rebuilt)(product))
    assert packed == []  # the hooks were never installed: the tensor is saved as usual
    # The mark stands outside either block.
    assert _recompute.recipe_of(product) is not None


def _model(mixer, rebuild, **overrides):
    """A one-block tiny model, the same weights whatever `rebuild`, its layers' kernel option
    rebuild_in_backward."""
    torch.manual_seed(0)
    options = {"rebuild_in_backward": rebuild}
    return CausalLM(build_config("tiny", mixer=mixer, num_layers=1, kernel_options=options,
                                 **overrides))  # fmt: skip


@pytest.mark.parametrize("mixer", ["gdn2", "kda", "muir"])
def test_models_train_to_the_same_gradients_with_and_without_rebuilding(mixer):
    """The chunk path (CPU): the same loss and parameter gradients bit for bit."""
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    results = {}
    for rebuild in (False, True):
        model = _model(mixer, rebuild)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results[rebuild] = [loss.detach(), *(p.grad.clone() for p in model.parameters())]
    for a, b in zip(results[True], results[False], strict=True):
        assert torch.equal(a, b)


def test_a_reshaped_marked_tensor_is_rebuilt_in_its_own_shape(generator):
    """`rebuildable_as`: what an op saves in a marked tensor's place, reshaped (the norms' rows),
    is rebuilt as the recipe's tensor in that shape; an unmarked source marks nothing."""
    x, y, product = _marked_product(generator)
    rows = rebuildable_as(product.view(5, 1), product)
    recipe = _recompute.recipe_of(rows)
    assert recipe is not None and torch.equal(recipe(), rows)
    plain = x * y
    assert _recompute.recipe_of(rebuildable_as(plain.view(5, 1), plain)) is None
    assert rebuildable_as(product, product) is product


@pytest.mark.parametrize("rebuild", [True, False], ids=["rebuild", "rebuild_in_backward-off"])
@pytest.mark.parametrize(("mixer", "rebuilt"), [("gdn2", True), ("kda", True), ("deltanet", False)])
def test_a_low_rank_output_gate_reaches_the_gated_norm_as_its_recipe(mixer, rebuilt, rebuild):
    """The gated output norm keeps a low-rank gate (`hidden -> rank -> H*V`) as its recipe, made
    again from the first factor's output that the second factor's backward keeps (the torch
    path here; the Triton norm in tests/test_layers_triton.py); a full-rank gate (DeltaNet's) is
    kept, and so is every gate of a model whose kernel option rebuild_in_backward is off. The
    gradients stay the same bit for bit (the model test above)."""
    model = _model(mixer, rebuild)
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    packed = _packed(lambda: model(input_ids=ids, labels=ids).loss)
    gates = [p for p in packed if isinstance(p, Recipe) and p.fn.__name__ == "low_rank_gate"]
    assert len(gates) == (1 if rebuilt and rebuild else 0)
    if gates:
        layer = model.model.blocks[0].mixer
        assert gates[0]().shape == (2, 24, layer.num_heads, layer.value_dim)


def _gate_recipes(model, ids):
    packed = _packed(lambda: model(input_ids=ids, labels=ids).loss)
    return [p for p in packed if isinstance(p, Recipe) and p.fn.__name__ == "low_rank_gate"]


def test_a_gate_parameter_changed_before_the_backward_fails_instead_of_rebuilding_another_gate():
    """The recipe holds the second factor's weight and bias, not the module: a bias updated in
    place between forward and backward (which the factor's own backward never reads) fails the
    version check, naming the argument, instead of giving the gradients of another gate."""
    torch.manual_seed(0)
    model = CausalLM(build_config("tiny", mixer="gdn2", num_layers=1))
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    loss = model(input_ids=ids, labels=ids).loss
    with torch.no_grad():
        model.model.blocks[0].mixer.g_proj[1].bias.add_(0.5)
    with pytest.raises(RuntimeError, match=r"argument 2 of 'low_rank_gate'.*modified in place"):
        loss.backward()


def test_a_replaced_gate_weight_still_rebuilds_the_gate_the_forward_used():
    """A Parameter swapped in after the forward does not enter the rebuilt gate: the
    gradients are those of the gate the forward made, bit for bit."""
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    grads = {}
    for rebuild in (False, True):
        model = _model("gdn2", rebuild)
        second = model.model.blocks[0].mixer.g_proj[1]
        original = second.weight
        loss = model(input_ids=ids, labels=ids).loss
        second.weight = torch.nn.Parameter(original.detach() + 1.0)
        loss.backward()
        second.weight = original
        grads[rebuild] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    for a, b in zip(grads[True], grads[False], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("second", ["dropout", "hooked linear", "linear subclass"])
def test_a_gate_whose_second_factor_is_not_a_plain_linear_is_kept(second):
    """Only a hook-free `nn.Linear` second factor is made again: a random one (dropout), one
    with hooks (which may change its output or count its calls) or a subclass (LoRA-style
    wrappers) is kept, so its forward runs once and its gradients stay those of its forward."""
    torch.manual_seed(0)
    model = CausalLM(build_config("tiny", mixer="gdn2", num_layers=1))
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    proj = model.model.blocks[0].mixer.g_proj
    assert len(_gate_recipes(model, ids)) == 1  # the plain low-rank gate is rebuilt
    calls = []
    if second == "dropout":
        proj[1] = torch.nn.Sequential(proj[1], torch.nn.Dropout(0.1))
    elif second == "hooked linear":
        proj[1].register_forward_hook(lambda *_: calls.append(1))
    else:

        class Scaled(torch.nn.Linear):
            def forward(self, x):
                return 2 * super().forward(x)

        scaled = Scaled(proj[1].in_features, proj[1].out_features)
        scaled.load_state_dict(proj[1].state_dict())
        proj[1] = scaled
    assert _gate_recipes(model, ids) == []
    if second == "hooked linear":
        model(input_ids=ids, labels=ids).loss.backward()
        assert len(calls) == 2  # the spy's forward and this one: none in the backward
