"""delta_rule backend="triton" as one op against the float64 token loop: the output, the final
state and every gradient over chunk sizes and decay layouts, a write strength per token, packed
sequences, strong decays and resets, 16-bit inputs, a model trained on it, and the refusals.
The stages alone are tested in tests/test_delta_rule_stages_triton.py and the state pass in
tests/test_delta_rule_state_pass_triton.py, with this file's helpers.

Runs where Triton kernels can run: on a CUDA GPU, or on CPU tensors under TRITON_INTERPRET=1
(README's test command runs this file a second time with it set). Shapes are tiny: the
interpreter executes every tile operation in Python.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import needs_triton, random_delta_inputs

from deltalab.ops import delta_rule
from deltalab.ops._triton import INTERPRET
from deltalab.ops.options import KernelOptions
from deltalab.testing import TOLERANCE, assert_close

pytestmark = [pytest.mark.interpreter, needs_triton]

DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
F32 = TOLERANCE[torch.float32]


def _run(inputs, state, backend, dtype, device, table=None, **kwargs):
    """Output, final state and the gradients of every input and of the initial state. With a
    launch `table`, by the Triton backend's entry launched by it (`backend` is then "triton")."""
    leaves = [x.detach().to(device, dtype).requires_grad_() for x in (*inputs, state)]
    if table is None:
        o, s = delta_rule(
            *leaves[:5], initial_state=leaves[5], backend=backend, output_final_state=True,
            **kwargs,
        )  # fmt: skip
    else:
        o, s = _triton_launched_by(table, *leaves, **kwargs)
    weights = torch.linspace(-1, 1, o.numel(), dtype=torch.float64).reshape(o.shape)
    # One backward through both outputs (the interpreter is slow): every gradient then carries the
    # output's and the final state's contributions together.
    ((o * weights.to(device, o.dtype)).sum() + s.sum()).backward()
    return [o, s, *(x.grad for x in leaves)]


def _triton_launched_by(table, q, a, b, u, g, state, chunk_size, options=None, cu_seqlens=None):
    """`delta_rule_triton`, the entry `delta_rule` calls for backend="triton", launched by
    `table` (with the defaults `delta_rule` gives it: scale K^-0.5, a float32 state)."""
    from deltalab.ops.delta_rule.triton.chunk import delta_rule_triton

    options = KernelOptions() if options is None else options
    return delta_rule_triton(q, a, b, u, g, state.float(), cu_seqlens, chunk_size,
                             q.shape[-1] ** -0.5, options, table=table)  # fmt: skip


def _compare(inputs, state, chunk_size, cu_seqlens=None, options=None, table=None):
    kwargs = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
    reference = _run(inputs, state, "naive", torch.float64, "cpu", **kwargs)
    if cu_seqlens is not None:
        kwargs["cu_seqlens"] = cu_seqlens.to(DEVICE)
    actual = _run(inputs, state, "triton", torch.float32, DEVICE, table, chunk_size=chunk_size,
                  options=options, **kwargs)  # fmt: skip
    labels = ["o", "final state", "dq", "da", "db", "du", "dg", "d initial state"]
    for label, x, ref in zip(labels, actual, reference, strict=True):
        assert_close(x, ref, F32, label)


def _compare_at(inputs, state, dtype, chunk_size, options=None, table=None):
    """The Triton backend at `dtype` (an fp16 one: the interpreter's 16-bit float) with the
    kernel `options` (and launch `table`) against the float64 loop: output, final state and
    every gradient within `dtype`'s bound."""
    reference = _run(inputs, state, "naive", torch.float64, "cpu")
    actual = _run(inputs, state, "triton", dtype, DEVICE, table, chunk_size=chunk_size,
                  options=options)  # fmt: skip
    labels = ["o", "final state", "dq", "da", "db", "du", "dg", "d initial state"]
    for label, x, ref in zip(labels, actual, reference, strict=True):
        assert_close(x, ref, TOLERANCE[dtype], label)


def _recorded_launches(monkeypatch, module, names) -> list:
    """Every launch of the kernels `names` by `module`'s functions from now on (replaced in
    `module`, where those look them up), as (kernel name, grid, keyword arguments), each launch
    run as it was."""
    launches = []

    class Recorded:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((self.kernel.fn.__name__, tuple(grid), kwargs))
                return self.kernel[grid](*args, **kwargs)

            return launch

    for name in names:
        monkeypatch.setattr(module, name, Recorded(getattr(module, name)))
    return launches


# Both decay layouts at the short lengths, one at each long one: the layout only changes how g is
# loaded, which the chunk size does not touch, and a long case takes ~30 s in the interpreter.
@pytest.mark.parametrize(
    ("length", "chunk_size", "channel_decay"),
    [
        pytest.param(length, chunk, channel, id=f"{length}-{chunk}-{layout}")
        for length, chunk in [(1, 16), (37, 16), (100, 32), (70, 64)]
        for channel, layout in [(False, "head_decay"), (True, "channel_decay")]
        if length < 50 or channel == (chunk == 64)
    ],
)
def test_triton_matches_float64_loop_with_every_gradient(
    generator, poisoned_empty, length, chunk_size, channel_decay
):
    inputs = random_delta_inputs(generator, 2, length, 2, 16, 8, channel_decay=channel_decay)
    state = torch.randn(2, 2, 16, 8, generator=generator, dtype=torch.float64)
    _compare(inputs, state, chunk_size)


@pytest.mark.parametrize("channel_decay", [False, True], ids=["head_decay", "channel_decay"])
def test_triton_gradients_under_strong_decays_where_stage_1_walks_its_diagonal(
    generator, poisoned_empty, monkeypatch, channel_decay
):
    """Log decays down to -16 per token: the full diagonal sub-blocks exceed the factored form's bound
    and are walked row by row, in the forward and the adjoint; with stage 1's adjoint cut into
    channel blocks of 16, K = 20 takes two of them."""
    from deltalab.ops.delta_rule.triton import intra, launch

    table = replace(launch.LAUNCH, intra=replace(intra.LAUNCH, block=16))
    inputs = random_delta_inputs(
        generator, 1, 37, 1, 20, 8, channel_decay=channel_decay, min_log_decay=-16.0
    )
    g = inputs[-1] if channel_decay else inputs[-1][..., None]
    depth = g[:, :32].unflatten(1, (-1, intra.SUB_BLOCK)).sum(2).abs().amax((-2, -1))
    assert (depth > intra.DIAGONAL_FACTOR_BOUND).all()  # every full sub-block walks
    state = torch.randn(1, 1, 20, 8, generator=generator, dtype=torch.float64)
    recorded = _recorded_launches(monkeypatch, intra, ("_intra_bwd",))
    _compare(inputs, state, 16, table=table)
    assert [grid[1] for _, grid, _ in recorded] == [2]  # two channel blocks


# a as one strength per token (a_t = beta_t b_t, formed on load): both decay layouts, chunks
# of 16, 64 and 128, the walked diagonal (log decays to -16) with two channel blocks in the
# adjoint (each writes its share of d beta), and packed sequences. At chunk 128 one sequence of
# one head, as in the direction form's chunk-128 test: the batch and head offsets do not depend
# on the chunk size, and the shorter cases cover them (2 x 2 heads took the interpreter ~30 s).
@pytest.mark.parametrize(
    ("length", "chunk_size", "channel_decay", "min_log_decay", "packed"),
    [
        pytest.param(37, 16, False, -1.0, False, id="37-16-head_decay"),
        pytest.param(70, 64, True, -1.0, False, id="70-64-channel_decay"),
        pytest.param(130, 128, False, -1.0, False, id="130-128-head_decay"),
        pytest.param(37, 16, True, -16.0, False, id="37-16-channel_decay-walked"),
        pytest.param(50, 16, False, -16.0, True, id="packed-head_decay-walked"),
    ],
)
def test_triton_per_token_write_strength_matches_the_loop_with_every_gradient(
    generator, poisoned_empty, monkeypatch, length, chunk_size, channel_decay, min_log_decay,
    packed,
):  # fmt: skip
    from deltalab.ops.delta_rule.triton import factors, intra, launch

    table = replace(launch.LAUNCH, intra=replace(intra.LAUNCH, block=16),
                    factors=replace(factors.LAUNCH, block=16))  # fmt: skip
    batch, heads = (1, 1) if chunk_size == 128 else (1 if packed else 2, 2)
    inputs = random_delta_inputs(
        generator, batch, length, heads, 20, 8, channel_decay=channel_decay,
        min_log_decay=min_log_decay, strengths=True,
    )  # fmt: skip
    assert inputs[1].shape == (batch, length, heads)
    cu_seqlens = torch.tensor([0, 7, 30, length]) if packed else None
    sequences = 3 if packed else batch
    state = torch.randn(sequences, heads, 20, 8, generator=generator, dtype=torch.float64)
    adjoints = [_recorded_launches(monkeypatch, intra, ("_intra_bwd",)),
                _recorded_launches(monkeypatch, factors, ("_factors_bwd",))]  # fmt: skip
    _compare(inputs, state, chunk_size, cu_seqlens=cu_seqlens, table=table)
    # Stage 1's adjoint and the factors' in two channel blocks each.
    assert [[grid[1] for _, grid, _ in launches] for launches in adjoints] == [[2], [2]]


def test_a_16_bit_write_strength_keeps_a_float32_call_in_float32(generator, poisoned_empty):
    """The strength's dtype does not pick the precision: float32 q, k, u, g with an fp16 beta
    (the interpreter's 16-bit float) stay within float32's bound of the loop, as with the
    direction beta k formed in float32, not the 16-bit bound the operators would then carry."""
    q, beta, b, u, g = random_delta_inputs(
        generator, 1, 40, 2, 16, 8, channel_decay=True, strengths=True
    )
    beta = beta.to(torch.float16).double()  # the values both runs see
    reference = delta_rule(q, beta, b, u, g, backend="naive", output_final_state=True)
    f32 = [x.to(DEVICE, torch.float32) for x in (q, b, u, g)]
    o, s = delta_rule(
        f32[0], beta.to(DEVICE, torch.float16), *f32[1:], backend="triton", chunk_size=16,
        output_final_state=True,
    )  # fmt: skip
    assert o.dtype == torch.float32
    assert_close(o, reference[0], F32, "o")
    assert_close(s, reference[1], F32, "final state")


def test_triton_chunk_128_with_key_and_value_sizes_that_need_masking(generator, poisoned_empty):
    inputs = random_delta_inputs(generator, 1, 130, 1, 20, 12, channel_decay=True)
    state = torch.randn(1, 1, 20, 12, generator=generator, dtype=torch.float64)
    _compare(inputs, state, 128)


def test_triton_packed_sequences_match_the_loop(generator, poisoned_empty):
    inputs = random_delta_inputs(generator, 1, 50, 2, 16, 8, channel_decay=True)
    state = torch.randn(3, 2, 16, 8, generator=generator, dtype=torch.float64)
    _compare(inputs, state, 16, cu_seqlens=torch.tensor([0, 7, 30, 50]))


@pytest.mark.parametrize("channel_decay", [False, True], ids=["head_decay", "channel_decay"])
def test_triton_float32_is_stable_under_log_decays_down_to_minus_20(generator, channel_decay):
    inputs = random_delta_inputs(
        generator, 1, 150, 1, 16, 8, channel_decay=channel_decay, min_log_decay=-20.0
    )
    o_ref, s_ref = delta_rule(*inputs, backend="naive", output_final_state=True)
    f32 = [x.to(DEVICE, torch.float32) for x in inputs]
    o, s = delta_rule(*f32, backend="triton", chunk_size=64, output_final_state=True)
    assert_close(o, o_ref, F32, "o")
    assert_close(s, s_ref, F32, "final state")


def test_triton_log_decay_of_minus_infinity_is_an_exact_reset(generator):
    q, a, b, u, g = random_delta_inputs(generator, 1, 40, 2, 16, 8, channel_decay=True)
    g[:, 21] = -float("inf")
    f32 = [x.to(DEVICE, torch.float32) for x in (q, a, b, u, g)]
    o, s = delta_rule(*f32, backend="triton", chunk_size=16, output_final_state=True)
    o_ref, s_ref = delta_rule(q, a, b, u, g, backend="naive", output_final_state=True)
    assert torch.isfinite(o).all()
    assert_close(o, o_ref, F32, "o")
    assert_close(s, s_ref, F32, "final state")


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [("state_pass", "fast", r"state_pass must be one of .*'fast'"),
     ("operator_dtype", "bfloat16", r"operator_dtype must be one of .*'bfloat16'"),
     ("walk_dots", "bf16", r"walk_dots must be one of .*'bf16'"),
     ("recompute_states", 1, r"recompute_states must be a bool"),
     ("checkpoint_every", 0, r"checkpoint_every must be a positive int")],
)  # fmt: skip
def test_invalid_kernel_option_is_refused_naming_the_option(field, value, match):
    with pytest.raises((ValueError, TypeError), match=match):
        KernelOptions(**{field: value})


def test_delta_rule_refuses_options_that_are_not_kernel_options(generator):
    inputs = random_delta_inputs(generator, 1, 8, 1, 16, 8, channel_decay=True)
    with pytest.raises(TypeError, match=r"options must be a deltalab\.ops\.options\.KernelOptions"):
        delta_rule(*(x.to(DEVICE, torch.float32) for x in inputs), backend="triton",
                   options={"state_pass": "fused"})  # fmt: skip


def test_triton_refuses_float64_naming_the_backend(generator):
    inputs = random_delta_inputs(generator, 1, 5, 1, 16, 8, channel_decay=False)
    with pytest.raises(ValueError, match='backend="triton" computes in float32'):
        delta_rule(*(x.to(DEVICE) for x in inputs), backend="triton")


def test_triton_bfloat16_inputs_return_bfloat16_close_to_the_loop(generator):
    inputs = random_delta_inputs(generator, 1, 40, 2, 16, 8, channel_decay=True)
    o_ref, _ = delta_rule(*inputs, backend="naive")
    # bf16 inputs, float32 inside: the interpreter only loads them (the products see float32).
    o, _ = delta_rule(*(x.to(DEVICE, torch.bfloat16) for x in inputs), backend="triton")
    assert o.dtype == torch.bfloat16
    assert_close(o, o_ref, TOLERANCE[torch.bfloat16], "o")


@pytest.mark.parametrize("state_pass", ["fused", "split"])
@pytest.mark.parametrize("operators", ["inputs", "float32"])
def test_triton_16bit_inputs_store_the_operators_as_told_and_stay_close_to_the_loop(
    generator, monkeypatch, operators, state_pass
):
    """fp16 inputs (the interpreter's 16-bit float: its bf16 arithmetic is not bf16's): with
    operator_dtype="inputs" every chunk operator but the decays reaches the state pass (each
    form) in fp16, forward and backward, with "float32" in float32; either way the output, the
    final state and every gradient stay within fp16's tolerance of the float64 loop."""
    from deltalab.ops.delta_rule.chunk import ChunkOperators
    from deltalab.ops.delta_rule.triton import state_pass as state_module

    options = KernelOptions(operator_dtype=operators, state_pass=state_pass)
    seen = []
    for name, passes in list(state_module.PASS_FORMS.items()):

        def spy(fn, name=name):
            def run(ops, *args, **kwargs):
                seen.append((name, {field: x.dtype for field, x in ops._asdict().items()}))
                return fn(ops, *args, **kwargs)

            return run

        monkeypatch.setitem(state_module.PASS_FORMS, name, tuple(spy(fn) for fn in passes))
    inputs = random_delta_inputs(generator, 2, 37, 2, 16, 8, channel_decay=True)
    state = torch.randn(2, 2, 16, 8, generator=generator, dtype=torch.float64)
    _compare_at(inputs, state, torch.float16, chunk_size=16, options=options)
    stored = torch.float16 if operators == "inputs" else torch.float32
    expected = {field: stored for field in ChunkOperators._fields}
    expected["decay"] = torch.float32
    # The forward's pass, the backward's walk again from the checkpoints, its adjoint pass,
    # each of the form set.
    assert seen == [(state_pass, expected)] * 3


# Muir's layer launches every kernel GDN-2's does and its read query, Diagonal KDN's the gain's;
# each mixer's layer alone is compared with its chunk path in tests/test_layers_triton.py.
@pytest.mark.parametrize("mixer", ["muir", "kdn_diag"])
def test_model_trains_identically_on_the_triton_backend(mixer):
    from deltalab.models import CausalLM, build_config

    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 20), device=DEVICE)
    # Narrow heads (K = V = 16) and chunks of 16 keep the interpreter's tiles small; 20 tokens
    # still make two chunks, a partial one among them. The wiring is what is tested.
    results = {}
    for backend in ("chunk", "triton"):
        torch.manual_seed(0)
        model = CausalLM(
            build_config(
                "tiny",
                mixer=mixer,
                num_layers=2,
                hidden_size=32,
                head_dim=16,
                chunk_size=16,
                backend=backend,
            )
        )
        model = model.to(DEVICE)
        loss = model(ids, labels=ids).loss
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results[backend] = (loss.detach(), grads)
    assert_close(results["triton"][0], results["chunk"][0], F32, "loss")
    assert_close(results["triton"][1], results["chunk"][1], 1e-5, "parameter gradients")


def test_triton_with_tiny_head_dims_matches_the_loop(generator, poisoned_empty):
    # K = 3 pads to a 16-wide key tile (NVIDIA's tl.dot needs an inner dimension >= 8).
    inputs = random_delta_inputs(generator, 1, 20, 1, 3, 2, channel_decay=True)
    state = torch.randn(1, 1, 3, 2, generator=generator, dtype=torch.float64)
    _compare(inputs, state, 16)


def test_triton_one_head_and_one_chunk_matches_the_loop(generator, poisoned_empty):
    # One chunk of one head: token-major inputs that stage 1 once took for chunked ones.
    inputs = random_delta_inputs(generator, 1, 20, 1, 16, 8, channel_decay=True)
    state = torch.randn(1, 1, 16, 8, generator=generator, dtype=torch.float64)
    _compare(inputs, state, 32)


def test_triton_refuses_head_dims_past_its_tiles_naming_k(generator):
    inputs = random_delta_inputs(generator, 1, 2, 1, 257, 4, channel_decay=False)
    with pytest.raises(ValueError, match="K <= 256, got K = 257"):
        delta_rule(*(x.to(DEVICE, torch.float32) for x in inputs), backend="triton")
