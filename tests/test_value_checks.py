"""The value checks of deltalab.ops._checks read their answers back to the host one at a time,
or, inside `one_host_read`, all together once; either way a failing input gets the same error."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deltalab.ops import delta_rule, kdn_diag, kdn_iso
from deltalab.ops._checks import (
    NonFiniteError,
    one_host_read,
    require_finite,
    require_nonnegative,
    require_nonnegative_finite,
    require_nonpositive,
    require_positive,
    require_positive_finite,
    send_answers,
    share_passes,
)


class HostReads(TorchDispatchMode):
    """Counts the values read back to the host (`aten._local_scalar_dense`)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


class Ops(TorchDispatchMode):
    """Records each op with the tensors it reads and writes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        reads = [a for a in args if isinstance(a, torch.Tensor)]
        self.calls.append((func, reads, [o for o in outs if isinstance(o, torch.Tensor)]))
        return out


def run_checks(g, q_noise, r, p0):
    require_nonpositive("g", g, "a log decay")
    require_nonnegative("q_noise", q_noise, "a process-noise variance")
    require_finite("q_noise", q_noise, "a process-noise variance")
    require_positive("r", r, "an observation-noise variance")
    require_finite("r", r, "an observation-noise variance")
    require_positive("p0", p0, "a prior variance")


def valid_inputs(generator):
    draw = lambda: torch.rand(2, 5, 3, generator=generator)  # noqa: E731
    return {"g": -draw(), "q_noise": draw(), "r": draw() + 0.1, "p0": draw() + 0.1}


def test_checks_in_a_block_read_back_once_instead_of_once_each(generator):
    with HostReads() as alone:
        run_checks(**valid_inputs(generator))
    with HostReads() as together:
        with one_host_read():
            run_checks(**valid_inputs(generator))  # fresh tensors: no pass remembered
    assert alone.count == 6
    assert together.count == 1


def test_a_block_inside_a_block_reads_back_with_the_enclosing_one(generator):
    """A nested block queues into the enclosing one: one read at the outer end, and a failing
    check inside the inner block raises there, as it would alone."""
    inputs = valid_inputs(generator)
    with HostReads() as nested:
        with one_host_read():
            with one_host_read():
                run_checks(**inputs)
            run_checks(**inputs)
            assert nested.count == 0
    assert nested.count == 1
    broken = {**inputs, "r": -inputs["r"]}
    with pytest.raises(ValueError, match="r must be > 0") as raised:
        with one_host_read():
            with one_host_read():
                run_checks(**broken)
            reached = True  # the inner block's end reads nothing: the work goes on
    assert reached and "r must be > 0" in str(raised.value)


BREAKS = [
    ("g", lambda x: x.index_fill(0, torch.tensor([1]), 0.5), ValueError, "g must be <= 0"),
    ("q_noise", lambda x: -x, ValueError, "q_noise must be >= 0"),
    ("q_noise", lambda x: x.index_fill(1, torch.tensor([2]), float("inf")), NonFiniteError,
     "q_noise must be finite"),
    ("r", lambda x: x.index_fill(2, torch.tensor([0]), float("nan")), NonFiniteError,
     "r must be > 0"),
    ("p0", lambda x: torch.zeros_like(x), ValueError, "p0 must be > 0"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "broken", "error", "message"), BREAKS)
def test_a_failing_check_in_a_block_raises_what_it_raises_alone(
    generator, name, broken, error, message
):
    inputs = valid_inputs(generator)
    inputs[name] = broken(inputs[name])
    with pytest.raises(error, match=message) as alone:
        run_checks(**inputs)
    with pytest.raises(error, match=message) as together:
        with one_host_read():
            run_checks(**inputs)
    assert type(together.value) is type(alone.value)
    assert str(together.value) == str(alone.value)


def test_the_first_failing_check_in_order_names_the_error(generator):
    inputs = valid_inputs(generator)
    inputs["q_noise"], inputs["p0"] = -inputs["q_noise"], -inputs["p0"]
    with pytest.raises(ValueError, match="q_noise must be >= 0"):
        with one_host_read():
            run_checks(**inputs)


def test_an_error_inside_the_block_yields_to_a_failing_check_queued_before_it(generator):
    """As outside a block, where the check would have raised before the code that raised: the
    queued check's error, with the block's own as its context; a passing queued check lets the
    block's error through. Checks are immediate again after the block."""
    inputs = valid_inputs(generator)
    with pytest.raises(ValueError, match="p0 must be > 0") as raised:
        with one_host_read():
            require_positive("p0", -inputs["p0"], "a prior variance")  # queued, fails
            raise KeyError("raised inside")
    assert isinstance(raised.value.__context__, KeyError)
    with pytest.raises(KeyError):
        with one_host_read():
            require_positive("p0", inputs["p0"], "a prior variance")  # queued, passes
            raise KeyError("raised inside")
    with pytest.raises(ValueError, match="p0 must be > 0"):  # outside: at once again
        require_positive("p0", -inputs["p0"], "a prior variance")


def test_an_interrupt_inside_a_block_closes_it_and_checks_are_immediate_again(generator):
    inputs = valid_inputs(generator)
    with pytest.raises(KeyboardInterrupt):
        with one_host_read():
            require_positive("p0", inputs["p0"], "a prior variance")
            raise KeyboardInterrupt
    with pytest.raises(ValueError, match="p0 must be > 0"):
        require_positive("p0", -inputs["p0"], "a prior variance")


def test_an_error_after_a_passed_check_keeps_its_answer_though_the_input_changed(generator):
    """The queued answer decides, not a check run again on values the work changed since."""
    g = -torch.rand(3, 4, generator=generator)
    with pytest.raises(RuntimeError, match="raised inside"):
        with one_host_read():
            require_nonpositive("g", g, "a log decay")  # passes when queued
            g.add_(2.0)
            raise RuntimeError("raised inside")


def test_an_argument_error_after_a_queued_value_check_still_comes_second(generator):
    """delta_rule checks g <= 0 before its other arguments; the check is queued behind the
    work, yet a bad g is still the error named when chunk_size is bad too (and a KDN op's bad
    r before the chunk_size its delta rule refuses)."""
    b, t, h, k = 1, 5, 2, 3
    draw = lambda *shape: torch.rand(*shape, generator=generator)  # noqa: E731
    q, key, v, beta, g = (draw(b, t, h, k), draw(b, t, h, k), draw(b, t, h, k), draw(b, t, h),
                          draw(b, t, h))  # fmt: skip
    with pytest.raises(ValueError, match="g must be <= 0"):
        delta_rule(q, beta, key, v, g, chunk_size=7, backend="chunk")
    with pytest.raises(ValueError, match="chunk_size must be in"):
        delta_rule(q, beta, key, v, -g, chunk_size=7, backend="chunk")
    r = -draw(b, t, h)
    with pytest.raises(ValueError, match="r must be > 0"):
        kdn_iso(q, key, v, -g, draw(b, t, h), r, p0=torch.ones(h), chunk_size=7, backend="chunk")


def test_a_kdn_op_reads_its_inputs_checks_back_once(generator):
    """Diagonal KDN checks g, q_noise, r and p0 with one read back, the delta rule it calls
    does not check g again, and a positive log decay is still refused by name."""
    b, t, h, k = 1, 6, 2, 4
    draw = lambda *shape: torch.rand(*shape, generator=generator)  # noqa: E731
    q, key, v = draw(b, t, h, k), draw(b, t, h, k), draw(b, t, h, k)
    g, q_noise, r = -draw(b, t, h, k), draw(b, t, h, k), draw(b, t, h) + 0.5
    p0 = torch.ones(h)
    with HostReads() as reads:
        kdn_diag(q, key, v, g, q_noise, r, p0=p0, backend="chunk")
    # The KDN's inputs in one read; the delta rule's own check of g <= 0 finds it passed.
    assert reads.count == 1
    with pytest.raises(ValueError, match="g must be <= 0"):
        kdn_diag(q, key, v, -g, q_noise, r, p0=p0, backend="chunk")


def answers_sent_and_read(ops: Ops) -> tuple[list[int], list[int]]:
    """Where in the recorded ops the checks' answers were sent toward the host (each send
    stacks the 0-d bool answers queued since the last) and where values were read back. The
    block's end stacks the sent answers once more, to read them in one go: not a send."""
    stacks = [
        i
        for i, (f, _, outs) in enumerate(ops.calls)
        if f is torch.ops.aten.stack.default and outs[0].dtype == torch.bool
    ]
    read = torch.ops.aten._local_scalar_dense.default
    return stacks[:-1], [i for i, (f, *_) in enumerate(ops.calls) if f is read]


@pytest.mark.parametrize("op", [kdn_diag, kdn_iso], ids=lambda f: f.__name__)
def test_a_kdn_op_sends_its_answers_before_its_work_and_reads_them_after(
    monkeypatch, generator, op
):
    """The checks' answers are gathered (and on a GPU their copy to the host started) before
    the gain's work is queued, and read once after the delta rule's: on a GPU the host waits
    for that early copy only, not for the work. A bad input still raises."""
    from deltalab.ops.kdn import mixers

    b, t, h, k = 1, 6, 2, 4
    draw = lambda *shape: torch.rand(*shape, generator=generator)  # noqa: E731
    q, key, v = draw(b, t, h, k), draw(b, t, h, k), draw(b, t, h, k)
    per_channel = op is kdn_diag
    g, r = -draw(b, t, h, k), draw(b, t, h) + 0.5
    q_noise = draw(b, t, h, k) if per_channel else draw(b, t, h)
    marks = {}

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            marks[f"{name} starts"] = len(ops.calls)
            out = fn(*args, **kwargs)
            marks[f"{name} ends"] = len(ops.calls)
            return out

        monkeypatch.setattr(mixers, name, wrapped)

    gain = "diag_gain" if per_channel else "iso_gain"
    spy(gain, getattr(mixers, gain))
    spy("delta_rule", mixers.delta_rule)
    with Ops() as ops:
        op(q, key, v, g, q_noise, r, p0=torch.ones(h), backend="chunk")
    sent, reads = answers_sent_and_read(ops)
    assert len(sent) == 1 and sent[0] < marks[f"{gain} starts"]
    assert marks[f"{gain} ends"] <= marks["delta_rule starts"]
    assert len(reads) == 1 and reads[0] >= marks["delta_rule ends"]
    with pytest.raises(ValueError, match="r must be > 0"):
        op(q, key, v, g, q_noise, -r, p0=torch.ones(h), backend="chunk")


def assert_sent_before_and_read_after(monkeypatch, module, name, call):
    """Runs call() with module.name (the work the checks guard) spied on: the answers are sent
    once before that work starts and read once after it ends."""
    work, marks = getattr(module, name), {}

    def spy(*args, **kwargs):
        marks["starts"] = len(ops.calls)
        out = work(*args, **kwargs)
        marks["ends"] = len(ops.calls)
        return out

    monkeypatch.setattr(module, name, spy)
    with Ops() as ops:
        call()
    sent, reads = answers_sent_and_read(ops)
    assert len(sent) == 1 and sent[0] < marks["starts"]
    assert len(reads) == 1 and reads[0] >= marks["ends"]


@pytest.mark.parametrize("per_channel", [False, True], ids=["kdn_gain_iso", "kdn_gain_diag"])
def test_a_kdn_gain_sends_its_answers_before_its_work_and_reads_them_after(
    monkeypatch, generator, per_channel
):
    """The public gain functions as the KDN ops: checks sent before the gain's work is queued,
    read once after it; a bad input still raises by name."""
    from deltalab.ops.kdn import gains

    b, t, h, k = 1, 6, 2, 4
    draw = lambda *shape: torch.rand(*shape, generator=generator)  # noqa: E731
    key, g, r = draw(b, t, h, k), -draw(b, t, h, k), draw(b, t, h) + 0.5
    q_noise = draw(b, t, h, k) if per_channel else draw(b, t, h)
    name = "diag_gain" if per_channel else "iso_gain"
    fn = gains.kdn_gain_diag if per_channel else gains.kdn_gain_iso
    assert_sent_before_and_read_after(
        monkeypatch, gains, name, lambda: fn(key, g, q_noise, r, torch.ones(h), backend="parallel")
    )
    with pytest.raises(ValueError, match="g must be <= 0"):
        fn(key, -g, q_noise, r, torch.ones(h), backend="parallel")


@pytest.mark.parametrize("per_channel", [False, True], ids=["kdn_iso_step", "kdn_diag_step"])
def test_a_kdn_decoding_step_sends_its_answers_before_its_work_and_reads_them_after(
    monkeypatch, generator, per_channel
):
    """A decoding step checks, sends, then queues its variance step and memory update, and reads
    once after them; a bad input still raises by name, and the state given is left as it was."""
    from deltalab.ops.kdn import step

    b, h, k = 2, 3, 4
    draw = lambda *shape: torch.rand(*shape, generator=generator)  # noqa: E731
    q, key, v, g, r = draw(b, h, k), draw(b, h, k), draw(b, h, k), -draw(b, h, k), draw(b, h) + 0.5
    q_noise = draw(b, h, k) if per_channel else draw(b, h)
    state = (draw(b, h, k, k), torch.ones(b, h, k) if per_channel else torch.ones(b, h))
    fn = step.kdn_diag_step if per_channel else step.kdn_iso_step
    assert_sent_before_and_read_after(
        monkeypatch,
        step,
        "delta_rule_step",
        lambda: fn(q, key, v, g, q_noise, r, state, backend="naive"),
    )
    before = [x.clone() for x in state]
    with pytest.raises(ValueError, match="g must be <= 0"):
        fn(q, key, v, -g, q_noise, r, state, backend="naive")
    assert all(torch.equal(x, y) for x, y in zip(state, before, strict=True))


def test_inside_an_enclosing_block_an_op_sends_nothing_and_the_block_reads_once(generator):
    """The trainer wraps each forward in one block: the ops inside add their checks to it and
    do not send them on their own (a send per op would only add launches); the block reduces,
    sends and reads once at its end, after all the work."""
    b, t, h, k = 1, 6, 2, 4
    draw = lambda *shape: torch.rand(*shape, generator=generator)  # noqa: E731
    q, key, v, g = draw(b, t, h, k), draw(b, t, h, k), draw(b, t, h, k), -draw(b, t, h, k)
    with Ops() as ops:
        with one_host_read():
            kdn_iso(q, key, v, g, draw(b, t, h), draw(b, t, h) + 0.5, p0=torch.ones(h))
            work_done = len(ops.calls)
    (sent,), (read,) = answers_sent_and_read(ops)
    assert work_done <= sent < read


def test_the_delta_rule_sends_its_check_before_its_work_and_reads_it_after(generator):
    """delta_rule's check of g <= 0: gathered before the backend's work, read once after it;
    a positive log decay is still refused by name, and its results are not returned."""
    b, t, h, k = 1, 5, 2, 3
    draw = lambda *shape: torch.rand(*shape, generator=generator)  # noqa: E731
    q, key, v, beta, g = (
        draw(b, t, h, k),
        draw(b, t, h, k),
        draw(b, t, h, k),
        draw(b, t, h),
        -draw(b, t, h),
    )
    with Ops() as ops:
        delta_rule(q, beta, key, v, g, backend="chunk")
    (sent,), (read,) = answers_sent_and_read(ops)
    v_used = [i for i, (_, inputs, _) in enumerate(ops.calls) if any(x is v for x in inputs)]
    assert sent < v_used[0] and v_used[-1] < read
    with pytest.raises(ValueError, match="g must be <= 0"):
        delta_rule(q, beta, key, v, -g, backend="chunk")


def test_a_passed_check_is_not_run_again_until_the_tensor_changes(generator):
    g = -torch.rand(3, 4, generator=generator)
    with HostReads() as reads:
        require_nonpositive("g", g, "a log decay")
        require_nonpositive("g", g, "a log decay")
        require_nonpositive("g", g[1:], "a log decay")  # a view is another tensor: checked
    assert reads.count == 2
    g[0, 0] = 0.5  # the version counter moves: checked again, and refused
    with pytest.raises(ValueError, match="g must be <= 0"):
        require_nonpositive("g", g, "a log decay")
    view = g[1:]
    require_nonpositive("g", view, "a log decay")
    g[2, 1] = 0.25  # a write through the base bumps the view's version too
    with pytest.raises(ValueError, match="g must be <= 0"):
        require_nonpositive("g", view, "a log decay")
    h = -torch.rand(3, generator=generator)
    require_nonpositive("h", h, "a log decay")
    h.data = torch.ones(3)  # new data, same version counter: checked again
    with pytest.raises(ValueError, match="h must be <= 0"):
        require_nonpositive("h", h, "a log decay")


def test_a_failed_check_is_never_remembered_as_passed(generator):
    r = torch.rand(5, generator=generator) - 2.0
    for _ in range(2):
        with pytest.raises(ValueError, match="r must be > 0"):
            require_positive("r", r, "an observation-noise variance")
    with pytest.raises(ValueError, match="r must be > 0"):
        with one_host_read():
            require_positive("r", r, "an observation-noise variance")
    with pytest.raises(ValueError, match="r must be > 0"):
        require_positive("r", r, "an observation-noise variance")


def test_a_check_of_another_kind_still_runs_on_a_passed_tensor(generator):
    x = torch.rand(4, generator=generator)
    x[1] = float("inf")
    require_nonnegative("x", x, "a variance")  # passes: inf >= 0
    with pytest.raises(NonFiniteError, match="x must be finite"):
        require_nonnegative_finite("x", x, "a variance")


def test_a_block_queues_a_repeated_check_once_and_remembers_it_only_on_success(generator):
    g = -torch.rand(3, 4, generator=generator)
    with Ops() as ops:
        with one_host_read():
            require_nonpositive("g", g, "a log decay")
            require_nonpositive("g", g, "a log decay")
    assert sum(func is torch.ops.aten.amax.default for func, *_ in ops.calls) == 1
    with HostReads() as reads:
        require_nonpositive("g", g, "a log decay")
    assert reads.count == 0
    # Queued at one version, written after: the pass is remembered for the version checked.
    h = -torch.rand(3, generator=generator)
    with one_host_read():
        require_nonpositive("h", h, "a log decay")
        h[0] = 1.0
    with pytest.raises(ValueError, match="h must be <= 0"):
        require_nonpositive("h", h, "a log decay")


def test_a_block_knows_a_queued_check_for_a_view_of_the_same_elements(generator):
    """A view over exactly x's elements (as autograd hands back a tensor routed through a
    node) is not checked again inside the block; a view of part of x, of x's elements negated,
    an alias with a storage handle of its own, or a copy is."""
    g = -torch.rand(3, 4, generator=generator)
    z = torch.complex(-torch.rand(3, generator=generator), -torch.rand(3, generator=generator))
    with Ops() as ops:
        with one_host_read():
            require_nonpositive("g", g, "a log decay")
            require_nonpositive("g", g.view_as(g), "a log decay")
            require_nonpositive("g", g[1:], "a log decay")
            require_nonpositive("g", g.t(), "a log decay")
            require_nonpositive("g", g.data, "a log decay")
            require_nonpositive("g", g.clone(), "a log decay")
            require_nonpositive("g", z.imag, "a log decay")
    assert sum(func is torch.ops.aten.amax.default for func, *_ in ops.calls) == 6
    # z.conj().imag views z.imag's elements negated, at the same address: > 0 here.
    with pytest.raises(ValueError, match="z must be <= 0"):
        with one_host_read():
            require_nonpositive("z", z.imag, "a log decay")
            require_nonpositive("z", z.conj().imag, "a log decay")


def test_a_view_over_the_same_elements_shares_a_remembered_pass_only_when_given_it(generator):
    """A pass is remembered on the tensor object: a view of x (as autograd hands back a tensor
    routed through a node) is checked again unless `share_passes` hands it x's passes, which
    it does only for a view over exactly x's elements."""

    class Route(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, dx):
            return dx

    g = -torch.rand(3, 4, generator=generator).requires_grad_()
    require_nonpositive("g", g, "a log decay")
    routed, part = Route.apply(g), g[1:]
    assert routed is not g
    share_passes(routed, g)
    share_passes(part, g)
    with HostReads() as reads:
        require_nonpositive("g", routed, "a log decay")
    assert reads.count == 0
    with HostReads() as reads:
        require_nonpositive("g", part, "a log decay")
        require_nonpositive("g", Route.apply(g), "a log decay")  # not handed the passes
    assert reads.count == 2
    h = -torch.rand(3, 4, generator=generator)
    require_nonpositive("h", h, "a log decay")
    view = h.view_as(h)
    share_passes(view, h)
    h[0, 0] = 1.0  # a write through the base: the shared pass no longer holds
    with pytest.raises(ValueError, match="h must be <= 0"):
        require_nonpositive("h", view, "a log decay")


def test_inference_tensors_are_checked_every_time(generator):
    with torch.inference_mode():
        g = -torch.rand(3, generator=generator)
    with HostReads() as reads:
        require_nonpositive("g", g, "a log decay")
        require_nonpositive("g", g, "a log decay")
    assert reads.count == 2


CHECKS = {
    require_nonpositive: lambda x: -x,
    require_positive: lambda x: x + 0.1,
    require_nonnegative: lambda x: x,
    require_finite: lambda x: x - 0.5,
    require_nonnegative_finite: lambda x: x,
    require_positive_finite: lambda x: x + 0.1,
}


@pytest.mark.parametrize("check", list(CHECKS), ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_passing_value_check_reads_its_tensor_once_and_writes_nothing_of_its_size(
    generator, check, dtype
):
    """One reduction over x, no elementwise pass writing a tensor of x's size (on a GPU each
    such pass over a [B, T, H, K] input costs as much as the reduction)."""
    x = CHECKS[check](torch.rand(4, 5, 6, generator=generator)).to(dtype)
    with Ops() as ops:
        check("x", x, "a test input")
    # A detach is a view (it reads no element); the reduction takes x through it.
    views = {id(o) for func, _, outs in ops.calls if func.is_view for o in outs}
    readers = [
        func
        for func, reads, _ in ops.calls
        if not func.is_view and any(r is x or id(r) in views for r in reads)
    ]
    assert len(readers) == 1, readers
    assert all(o.numel() <= 2 for func, _, outs in ops.calls if not func.is_view for o in outs), (
        ops.calls
    )


@pytest.mark.parametrize("check", list(CHECKS), ids=lambda c: c.__name__)
def test_a_value_check_records_nothing_for_autograd(generator, check):
    """A check of a tensor that requires grad saves nothing for a backward (saved-tensor hooks
    see no tensor): it must not keep its input alive, nor reach a rebuild recipe's packing."""
    x = CHECKS[check](torch.rand(4, 5, generator=generator)).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        check("x", x, "a test input")
    assert saved == []


FINITE_BREAKS = {
    "negative": lambda x: x.index_fill(0, torch.tensor([1]), -0.5),
    "zero": lambda x: x.index_fill(1, torch.tensor([2]), 0.0),
    "+inf": lambda x: x.index_fill(1, torch.tensor([2]), float("inf")),
    "-inf": lambda x: x.index_fill(2, torch.tensor([0]), -float("inf")),
    "NaN": lambda x: x.index_fill(0, torch.tensor([0]), float("nan")),
    "NaN and negative": lambda x: -x.index_fill(0, torch.tensor([0]), float("nan")),
}


@pytest.mark.parametrize("blocked", [False, True], ids=["alone", "in a block"])
@pytest.mark.parametrize("broken", list(FINITE_BREAKS))
@pytest.mark.parametrize(
    ("combined", "first"),
    [
        (require_nonnegative_finite, require_nonnegative),
        (require_positive_finite, require_positive),
    ],
    ids=["nonnegative", "positive"],
)
def test_a_combined_check_passes_and_fails_as_its_two_checks_in_order(
    generator, combined, first, broken, blocked
):
    x = torch.rand(3, 4, 5, generator=generator) + 0.1
    combined("x", x, "a variance")  # a valid input passes
    x = FINITE_BREAKS[broken](x)
    try:
        first("x", x, "a variance")
        require_finite("x", x, "a variance")
        expected = None
    except ValueError as error:
        expected = error
    try:
        if blocked:
            with one_host_read():
                combined("x", x, "a variance")
        else:
            combined("x", x, "a variance")
        raised = None
    except ValueError as error:
        raised = error
    assert (raised is None) == (expected is None)
    if expected is not None:
        assert type(raised) is type(expected)
        assert str(raised) == str(expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned-memory copies: CUDA only")
def test_a_block_waits_for_its_sent_answers_and_not_for_the_work_queued_after():
    """On a GPU, a block whose answers were sent before a long kernel ends while that kernel
    still runs (the stream is busy after the block), and a failing check still raises by name
    (its check then runs again, reading at once). The CPU tests above check the order of
    sending, work and reading."""
    stream = torch.cuda.current_stream()
    x = torch.rand(1000, device="cuda") + 0.5
    with one_host_read():
        require_positive("x", x, "a variance")
        send_answers()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU cycles, queued behind the copy
    assert not stream.query(), "the block's end waited for the work queued after the send"
    stream.synchronize()
    with pytest.raises(ValueError, match="x must be > 0"):
        with one_host_read():
            require_positive("x", x - 2.0, "a variance")
            send_answers()
            torch.cuda._sleep(1_000_000)
