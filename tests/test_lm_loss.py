"""deltalab.ops.lm_loss: the LM head and cross-entropy in chunks against the float32 logits'
formula; CausalLM's loss-only path and the trainer's loss against the path they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deltalab.models import CausalLM, build_config
from deltalab.ops.lm_loss import (
    default_chunk,
    linear_cross_entropy,
    linear_cross_entropy_reference,
)
from deltalab.train import loop

TINY = dict(hidden_size=32, num_layers=2, num_heads=2, head_dim=16, vocab_size=67, chunk_size=16)


def _inputs(generator, n, d, v, dtype, ignored=()):
    hidden = torch.randn(n, d, generator=generator, dtype=torch.float64).to(dtype)
    weight = (torch.randn(v, d, generator=generator, dtype=torch.float64) / d**0.5).to(dtype)
    targets = torch.randint(0, v, (n,), generator=generator)
    targets[list(ignored)] = -100
    return hidden.requires_grad_(), weight.requires_grad_(), targets


def _value_and_grads(fn, hidden, weight, targets, **kwargs):
    loss = fn(hidden, weight, targets, **kwargs)
    # A non-unit incoming gradient: the backward scales by it.
    d_hidden, d_weight = torch.autograd.grad(loss * 1.7, (hidden, weight))
    return loss, d_hidden, d_weight


@pytest.mark.parametrize(
    "dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)], ids=["float64", "float32"]
)
@pytest.mark.parametrize("chunk", [1, 7, 16, 45, 64])
def test_chunked_loss_and_gradients_equal_the_formula(generator, dtype, tol, chunk):
    # 45 rows: chunk sizes that do not divide it, one chunk (64), one row per chunk (1).
    hidden, weight, targets = _inputs(generator, 45, 12, 53, dtype, ignored=(0, 3, 4, 20, 44))
    got = _value_and_grads(linear_cross_entropy, hidden, weight, targets, chunk=chunk)
    want = _value_and_grads(linear_cross_entropy_reference, hidden, weight, targets)
    for name, g, w in zip(("loss", "d hidden", "d weight"), got, want, strict=True):
        assert g.dtype == w.dtype == dtype, name
        torch.testing.assert_close(g, w, rtol=tol, atol=tol, msg=name)


def test_an_all_ignored_chunk_contributes_nothing(generator):
    hidden, weight, targets = _inputs(generator, 24, 8, 30, torch.float64, ignored=range(8, 16))
    got = _value_and_grads(linear_cross_entropy, hidden, weight, targets, chunk=8)
    want = _value_and_grads(linear_cross_entropy_reference, hidden, weight, targets)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    assert not got[1][8:16].any()  # the ignored rows' hidden gets no gradient


def test_an_all_ignored_batch_gives_nan_and_zero_gradients_as_cross_entropy(generator):
    hidden, weight, targets = _inputs(generator, 10, 8, 30, torch.float32, ignored=range(10))
    loss, d_hidden, d_weight = _value_and_grads(
        linear_cross_entropy, hidden, weight, targets, chunk=4
    )
    ref_loss, ref_hidden, ref_weight = _value_and_grads(
        linear_cross_entropy_reference, hidden, weight, targets
    )
    assert torch.isnan(loss) and torch.isnan(ref_loss)
    assert not d_hidden.any() and not d_weight.any()
    assert not ref_hidden.any() and not ref_weight.any()


def test_without_a_gradient_only_the_loss_is_computed(generator):
    hidden, weight, targets = _inputs(generator, 30, 8, 40, torch.float64, ignored=(2, 5))
    with_grad = linear_cross_entropy(hidden, weight, targets, chunk=7)
    with torch.no_grad():
        without = linear_cross_entropy(hidden, weight, targets, chunk=7)
    assert without.grad_fn is None
    torch.testing.assert_close(without, with_grad.detach(), rtol=0, atol=0)


def test_large_logits_stay_finite(generator):
    """logsumexp subtracts the row maximum: logits of order 1e4 neither overflow nor lose the
    loss (float32 exp would overflow beyond 88)."""
    hidden, weight, targets = _inputs(generator, 16, 8, 30, torch.float32)
    big = (hidden.detach() * 3000).requires_grad_()
    got = _value_and_grads(linear_cross_entropy, big, weight, targets, chunk=5)
    want = _value_and_grads(linear_cross_entropy_reference, big, weight, targets)
    assert all(torch.isfinite(t).all() for t in got)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-3)


def test_under_autocast_the_product_is_bf16_and_the_weight_gradient_float32(generator):
    """As the LM head under autocast: bf16 logits from the fp32 weight cast to bf16, the loss
    in float32, gradients in the inputs' dtypes (the fp32 master weight gets float32)."""
    hidden, weight, targets = _inputs(generator, 50, 16, 70, torch.float32, ignored=(1, 2))

    def reference(h, w, t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = F.linear(h, w)
        assert logits.dtype == torch.bfloat16
        return F.cross_entropy(logits.float(), t)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _value_and_grads(linear_cross_entropy, hidden, weight, targets, chunk=16)
    want = _value_and_grads(reference, hidden, weight, targets)
    assert [t.dtype for t in got] == [torch.float32] * 3
    # The same bf16 logits and float32 log-softmax: the loss to float32 rounding.
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    for g, w in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2 * float(w.abs().max()))


def test_the_default_chunk_is_a_fixed_number_of_logits():
    assert default_chunk(32000) == 4096
    assert default_chunk(1 << 30) == 1
    assert default_chunk(259) % 128 == 0


def test_bad_inputs_are_refused(generator):
    hidden, weight, targets = _inputs(generator, 6, 4, 9, torch.float32)
    with pytest.raises(ValueError, match="shapes do not match"):
        linear_cross_entropy(hidden, weight[:, :3], targets)
    with pytest.raises(TypeError, match="integer"):
        linear_cross_entropy(hidden, weight, targets.float())
    with pytest.raises(ValueError, match="chunk"):
        linear_cross_entropy(hidden, weight, targets, chunk=0)
    with pytest.raises(TypeError, match="one dtype"):
        linear_cross_entropy(hidden, weight.double(), targets)


def _tiny(seed=0, **overrides) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(build_config("tiny", mixer="gdn2", **{**TINY, **overrides})).train()


def _grads(model: CausalLM, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _compare(model, old, new, *, rtol, atol):
    loss_old, loss_new = old(), new()
    torch.testing.assert_close(loss_new.detach(), loss_old.detach(), rtol=rtol, atol=atol)
    grads_old, grads_new = _grads(model, loss_old), _grads(model, loss_new)
    assert grads_old.keys() == grads_new.keys()
    for name in grads_old:
        assert grads_new[name].dtype == torch.float32, name
        scale = float(grads_old[name].abs().max()) or 1.0
        torch.testing.assert_close(
            grads_new[name], grads_old[name], rtol=rtol, atol=atol * scale, msg=name
        )


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_loss_only_forward_equals_the_logits_path_with_labels(generator, tied):
    """labels (shifted inside, the last position ignored): the chunked loss and every
    parameter's gradient as the float32 logits' cross-entropy; with tied embeddings the LM
    head's gradient reaches the embedding once (it is one parameter)."""
    model = _tiny(tie_word_embeddings=tied)
    assert (model.lm_head.weight is model.model.embed.weight) == tied
    ids = torch.randint(0, TINY["vocab_size"], (2, 21), generator=generator)
    labels = ids.clone()
    labels[0, 5:9] = -100

    def old():
        out = model(input_ids=ids, labels=labels)
        assert out.logits is not None
        return out.loss

    def new():
        out = model(input_ids=ids, labels=labels, return_logits=False)
        assert out.logits is None
        return out.loss

    _compare(model, old, new, rtol=1e-5, atol=1e-5)
    names = [n for n, _ in model.named_parameters()]
    assert ("lm_head.weight" in names) == (not tied)


def test_a_float64_model_keeps_float64_logits_and_both_loss_paths_agree_to_its_rounding(
    generator,
):
    """The logits path widens bf16 logits to float32 but never narrows float64 ones, so a
    float64 model (gradient checks, finite differences) gets float64 logits and a loss that
    equals the chunked path's to float64 rounding."""
    model = _tiny().double()
    ids = torch.randint(0, TINY["vocab_size"], (2, 21), generator=generator)
    out = model(input_ids=ids, labels=ids)
    assert out.logits.dtype == out.loss.dtype == torch.float64
    chunked = model(input_ids=ids, labels=ids, return_logits=False).loss
    assert chunked.dtype == torch.float64
    torch.testing.assert_close(out.loss, chunked, rtol=1e-12, atol=0)


def test_loss_only_forward_under_autocast_equals_the_logits_path_to_bf16(generator):
    model = _tiny()
    ids = torch.randint(0, TINY["vocab_size"], (2, 33), generator=generator)

    def run(**kwargs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(input_ids=ids, labels=ids, **kwargs).loss

    _compare(model, run, lambda: run(return_logits=False), rtol=2e-2, atol=3e-2)


def test_shift_labels_are_the_targets_of_each_position(generator):
    model = _tiny()
    window = torch.randint(0, TINY["vocab_size"], (3, 17), generator=generator)
    logits = model(input_ids=window[:, :-1]).logits
    expected = F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
    for return_logits in (True, False):
        loss = model(
            input_ids=window[:, :-1], shift_labels=window[:, 1:], return_logits=return_logits
        ).loss
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)


def test_loss_only_forward_refuses_what_it_cannot_answer(generator):
    model = _tiny()
    ids = torch.randint(0, TINY["vocab_size"], (1, 8), generator=generator)
    with pytest.raises(ValueError, match="nothing to return"):
        model(input_ids=ids, return_logits=False)
    with pytest.raises(ValueError, match="not both"):
        model(input_ids=ids, labels=ids, shift_labels=ids)


def _old_loss(model, window, autocast):
    """The trainer's loss before the chunked op: the model's float32 logits, cross-entropy."""
    with autocast:
        logits = model(input_ids=window[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), window[:, 1:].flatten())


@pytest.mark.parametrize(
    "precision, rtol, atol", [("fp32", 1e-5, 1e-5), ("bf16", 2e-2, 3e-2)], ids=["fp32", "bf16"]
)
def test_the_trainers_loss_and_step_equal_the_old_ones(generator, precision, rtol, atol):
    """One step of the trainer's loss (`train.loop._loss`) against the formula it replaced:
    the loss, each gradient and the parameters after one AdamW step."""
    window = torch.randint(0, TINY["vocab_size"], (2, 25), generator=generator)
    bf16 = precision == "bf16"

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)

    model = _tiny()
    _compare(
        model,
        lambda: _old_loss(model, window, autocast()),
        lambda: loop._loss(model, window, autocast()),
        rtol=rtol,
        atol=atol,
    )
    stepped = []
    for loss_fn in (_old_loss, loop._loss):
        model = _tiny()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss_fn(model, window, autocast()).backward()
        optimizer.step()
        stepped.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    # AdamW's first step moves each weight by about lr * sign(grad): equal up to the rare
    # entries whose gradient is rounding-sized.
    torch.testing.assert_close(stepped[1], stepped[0], rtol=0, atol=2e-3 if bf16 else 1e-5)
