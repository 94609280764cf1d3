"""The Triton delta rule's state pass: against its PyTorch twin and the float64 walk, fused and
split, keeping every k-th chunk-start state and walking them again (recompute_states), the form
and launch state_pass="auto" takes, the walks' 16-bit products, the kernels' grids, and the
operator-gradient kernel; through delta_rule against the float64 token loop where a form or a
launch is chosen.

Runs where tests/test_delta_rule_triton.py runs, at its tiny shapes.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import needs_triton, random_delta_inputs
from test_delta_rule_triton import DEVICE, F32, _compare, _compare_at, _recorded_launches, _run

from deltalab.ops.options import KernelOptions
from deltalab.testing import assert_close

pytestmark = [pytest.mark.interpreter, needs_triton]


# The state pass's walks, forward and adjoint, fused and split.
WALKS = ("_state_pass_fwd", "_state_pass_bwd", "_state_pass_split_fwd", "_state_pass_split_bwd")


def test_triton_state_pass_matches_its_pytorch_twin(generator):
    from deltalab.ops.delta_rule.chunk import (
        ChunkOperators,
        chunk_operators,
        chunk_output,
        state_pass,
        to_chunks,
    )
    from deltalab.ops.delta_rule.triton.state_pass import state_pass_triton

    inputs = random_delta_inputs(generator, 1, 90, 2, 16, 8, channel_decay=True)
    ops = chunk_operators(*(to_chunks(x, 32) for x in inputs))
    state = torch.randn(1, 2, 16, 8, generator=generator, dtype=torch.float64)
    residuals, states, final = state_pass(ops, state)
    out = chunk_output(ops, states, residuals)
    ops32 = ChunkOperators(*(x.to(DEVICE, torch.float32).contiguous() for x in ops))
    out_t, residuals_t, states_t, final_t = state_pass_triton(ops32, state.to(DEVICE).float())
    for label, x, ref in (
        ("outputs", out_t, out),
        ("residuals", residuals_t, residuals),
        ("chunk-start states", states_t, states),
        ("final state", final_t, final),
    ):
        assert_close(x, ref, F32, label)


@pytest.mark.parametrize("state_pass", ["fused", "split"])
@pytest.mark.parametrize("block_c", [32, 16], ids=["one-row-block", "two-row-blocks"])
def test_triton_state_pass_keeping_every_kth_state_writes_those_of_the_full_pass(
    generator, poisoned_empty, monkeypatch, state_pass, block_c
):
    """keep_every=2, keep_residuals=False (what the forward keeps with recompute_states): the
    states of chunks 0, 2, 4 of the full pass, bit for bit, and its outputs and final state;
    no residuals returned (the fused kernel writes them only with two row blocks per chunk,
    where it reads them back). Buffers are NaN-filled before launch: an unwritten kept state
    fails."""
    from deltalab.ops.delta_rule.chunk import ChunkOperators, chunk_operators, to_chunks
    from deltalab.ops.delta_rule.triton import state_pass as state_module
    from deltalab.ops.delta_rule.triton.launch import LAUNCH

    table = replace(LAUNCH, block_c=block_c)
    inputs = random_delta_inputs(generator, 1, 150, 2, 16, 8, channel_decay=True)
    ops = chunk_operators(*(to_chunks(x, 32) for x in inputs))  # 5 chunks
    ops = ChunkOperators(*(x.to(DEVICE, torch.float32).contiguous() for x in ops))
    state = torch.randn(1, 2, 16, 8, generator=generator).to(DEVICE)
    run = state_module.PASS_FORMS[state_pass][0]
    recorded = _recorded_launches(monkeypatch, state_module, WALKS)
    full = run(ops, state, "ieee", table=table)
    kept = run(ops, state, "ieee", keep_every=2, keep_residuals=False, table=table)
    assert recorded and {kwargs["BC"] for _, _, kwargs in recorded} == {block_c}
    assert kept[1] is None
    assert kept[2].shape[2] == 3
    assert torch.equal(kept[2], full[2][:, :, ::2])
    assert torch.equal(kept[0], full[0]) and torch.equal(kept[3], full[3])


def _state_pass_walk_with_adjoint(ops, state, d_o, d_final):
    """The state pass and its adjoint in float64 by autograd over the chunk loop: (outputs,
    residuals, chunk-start states, final state) and (dN, dS after each chunk, d initial state),
    the adjoints being the gradients of <O, d_o> + <final, d_final> at each N_i and S_{i+1}."""
    initial = state.clone().requires_grad_()
    s, outputs, residuals, states, after = initial, [], [], [], []
    for i in range(ops.read.shape[2]):
        states.append(s)
        n = ops.target[:, :, i] - ops.erase[:, :, i] @ s
        n.retain_grad()
        residuals.append(n)
        outputs.append(ops.read[:, :, i] @ s + ops.attend[:, :, i] @ n)
        s = ops.decay[:, :, i, :, None] * s + ops.write[:, :, i].transpose(-1, -2) @ n
        s.retain_grad()
        after.append(s)
    out = torch.stack(outputs, dim=2)
    ((out * d_o).sum() + (s * d_final).sum()).backward()
    forward = [out, *(torch.stack(x, dim=2) for x in (residuals, states)), s]
    backward = [torch.stack([x.grad for x in residuals], dim=2),
                torch.stack([x.grad for x in after], dim=2), initial.grad]  # fmt: skip
    return [x.detach() for x in forward], backward


@pytest.mark.parametrize(
    ("length", "chunk_size", "block_c"),
    [(50, 32, 16), (130, 128, 64)],
    ids=["chunk32-two-row-blocks", "chunk128"],
)
def test_triton_split_state_pass_matches_the_fused_pass_and_the_pytorch_walk(
    generator, poisoned_empty, monkeypatch, length, chunk_size, block_c
):
    """The split state pass (walk, then outputs; dO products, then the adjoint walk) against the
    fused kernels and the float64 walk differentiated by autograd: outputs written token-major
    (every token of a partial last chunk; dO read from there too), residuals, chunk-start
    states, final state, dN, dS after each chunk and d initial state. K = 20 and V = 12 need
    masking; row blocks of 16 (chunk 32) or 64 (chunk 128) make two per chunk."""
    from deltalab.ops.delta_rule.chunk import (
        ChunkOperators,
        chunk_operators,
        from_chunks,
        to_chunks,
    )
    from deltalab.ops.delta_rule.triton import state_pass as state_module
    from deltalab.ops.delta_rule.triton.intra import Tokens
    from deltalab.ops.delta_rule.triton.launch import LAUNCH

    table = replace(LAUNCH, block_c=block_c)
    batch, heads, key_dim, value_dim = 1, 2, 20, 12
    inputs = random_delta_inputs(
        generator, batch, length, heads, key_dim, value_dim, channel_decay=True
    )
    ops = chunk_operators(*(to_chunks(x, chunk_size) for x in inputs))
    state = torch.randn(batch, heads, key_dim, value_dim, generator=generator, dtype=torch.float64)
    d_o = torch.randn(batch, length, heads, value_dim, generator=generator, dtype=torch.float64)
    d_final = torch.randn_like(state)
    forward, backward = _state_pass_walk_with_adjoint(ops, state, to_chunks(d_o, chunk_size),
                                                      d_final)  # fmt: skip
    forward[0] = from_chunks(forward[0], chunk_size, length)

    def f32(x):
        return x.to(DEVICE, torch.float32).contiguous()

    ops32 = ChunkOperators(*(f32(x) for x in ops))
    tokens = Tokens(ops.read.shape[2], heads, length, chunk_size)
    recorded = _recorded_launches(monkeypatch, state_module, WALKS)
    got = {}
    for name in ("fused", "split"):
        state_pass, state_pass_backward, walk = state_module.PASS_FORMS[name]
        out = torch.empty(batch, length, heads, value_dim, device=DEVICE)
        got[name] = [
            *state_pass(ops32, f32(state), out=out, tokens=tokens, table=table),
            *state_pass_backward(ops32, f32(d_o), f32(d_final), tokens=tokens, table=table),
        ]
        # The walk a backward repeats (recompute_states) gives the forward's values exactly,
        # from the initial state alone (one segment) or from every chunk's start state (as
        # many segments as chunks, walked at once).
        states = got[name][2]
        for every in (1, states.shape[2]):
            walked = walk(ops32, states[:, :, ::every].contiguous(), every, table=table)
            for label, again, first in zip(("residuals", "chunk-start states"), walked,
                                           got[name][1:3], strict=True):  # fmt: skip
                assert torch.equal(again, first), f"{label} walked again ({name}, {every})"
    assert {kwargs["BC"] for _, _, kwargs in recorded} == {block_c}  # two row blocks a chunk
    labels = ["outputs", "residuals", "chunk-start states", "final state", "dN",
              "dS after each chunk", "d initial state"]  # fmt: skip
    for label, split, fused, ref in zip(labels, got["split"], got["fused"], forward + backward,
                                        strict=True):  # fmt: skip
        assert_close(split, ref, F32, f"{label} (split against the float64 walk)")
        assert_close(split, fused, 1e-6, f"{label} (split against fused)")


@pytest.mark.parametrize(("chosen", "other"), [("split", "fused"), ("fused", "split")])
def test_triton_each_state_pass_matches_float64_loop_with_every_gradient(
    generator, poisoned_empty, monkeypatch, chosen, other
):
    """delta_rule(backend="triton", options=KernelOptions(state_pass=...)) runs that form, forward
    and backward (the other made to fail if called): output, final state and every gradient
    against the float64 token loop, over a partial last chunk."""
    from deltalab.ops.delta_rule.triton import state_pass as state_module

    def fail(*args, **kwargs):
        raise AssertionError(f"the {other} state pass ran")

    monkeypatch.setitem(state_module.PASS_FORMS, other, (fail, fail, fail))
    inputs = random_delta_inputs(generator, 2, 37, 2, 16, 8, channel_decay=True)
    state = torch.randn(2, 2, 16, 8, generator=generator, dtype=torch.float64)
    _compare(inputs, state, 16, options=KernelOptions(state_pass=chosen))


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        pytest.param(
            torch.bfloat16,
            marks=pytest.mark.skipif(DEVICE != "cuda", reason="bfloat16 kernels: CUDA only"),
        ),
    ],
    ids=["fp32", "bf16"],
)
@pytest.mark.parametrize("state_pass", ["split", "fused"])
def test_triton_backward_walking_the_states_again_keeps_less_and_gives_the_same_gradients(
    generator, state_pass, dtype
):
    """With recompute_states the forward keeps the chunk-start states of every `every`-th chunk
    instead of all of them and the residuals (float32 [B, H, n, K, V] and [B, H, n, C, V]), and
    the backward's second walk (3 chunks: every 2, segments of 2 and 1 walked at once; every 8,
    one segment) gives every gradient bit for bit (on the GPU also with bf16 inputs, the
    precision of training). Both against one run that keeps every state."""
    batch, length, heads, key_dim, value_dim, chunk = 2, 37, 2, 16, 8, 16
    inputs = random_delta_inputs(generator, batch, length, heads, key_dim, value_dim,
                                 channel_decay=True)  # fmt: skip
    state = torch.randn(batch, heads, key_dim, value_dim, generator=generator, dtype=torch.float64)
    results, kept = {}, {}
    for every in (None, 2, 8):  # None: every state kept
        options = KernelOptions(state_pass=state_pass, recompute_states=every is not None)
        if every is not None:
            options = replace(options, checkpoint_every=every)
        saved: list[torch.Tensor] = []

        def pack(t, saved=saved):
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            results[every] = _run(inputs, state, "triton", dtype, DEVICE,
                                  chunk_size=chunk, options=options)  # fmt: skip
        kept[every] = sum(t.numel() * t.element_size() for t in saved)
    labels = ["o", "final state", "dq", "da", "db", "du", "dg", "d initial state"]
    chunks = -(-length // chunk)
    walked = batch * heads * chunks * (key_dim + chunk) * value_dim * 4
    for every in (2, 8):
        for label, again, first in zip(labels, results[every], results[None], strict=True):
            assert torch.equal(again, first), f"every {every}: {label}"
        checkpoints = batch * heads * -(-chunks // every) * key_dim * value_dim * 4
        assert kept[None] - kept[every] == walked - checkpoints, f"every {every}"


@pytest.mark.parametrize(
    ("min_programs", "chosen", "other"), [(4, "fused", "split"), (5, "split", "fused")]
)
def test_auto_state_pass_takes_the_fused_pass_from_its_program_threshold(
    generator, monkeypatch, min_programs, chosen, other
):
    """state_pass="auto" (the default) runs the fused pass when its walks would launch at least
    fused_pass_min_programs programs (here B * H * ceil(V / block_v) = 2 * 2 * 1 = 4) and the
    split pass below that (the other made to fail if called), and the result is still exact."""
    from deltalab.ops.delta_rule.triton import state_pass as state_module
    from deltalab.ops.delta_rule.triton.launch import LAUNCH

    def fail(*args, **kwargs):
        raise AssertionError(f"the {other} state pass ran")

    table = replace(LAUNCH, fused_pass_min_programs=min_programs)
    monkeypatch.setitem(state_module.PASS_FORMS, other, (fail, fail, fail))
    assert state_module.chosen_state_pass(2, 2, 16, 8, table=table) == chosen
    inputs = random_delta_inputs(generator, 2, 21, 2, 16, 8, channel_decay=True)
    state = torch.randn(2, 2, 16, 8, generator=generator, dtype=torch.float64)
    _compare(inputs, state, 16, table=table)


@pytest.mark.parametrize(
    ("dtype", "walk_dots", "threshold", "chosen"),
    [(torch.float16, "operators", 3, "narrow"), (torch.float16, "operators", 2, "low_dots"),
     (torch.float16, "float32", 3, "narrow"), (torch.float16, "float32", 2, "narrow"),
     (torch.float32, "operators", 3, "split"), (torch.float32, "operators", 2, "fused")],
    ids=["fp16-few-walks", "fp16-enough-walks", "fp16-widened-few-walks",
         "fp16-widened-enough-walks", "fp32-few-walks", "fp32-enough-walks"],
)  # fmt: skip
def test_auto_takes_the_fused_launch_its_walks_earn_and_every_walk_of_the_op_takes_it(
    generator, monkeypatch, dtype, walk_dots, threshold, chosen
):
    """With 16-bit chunk operators, "auto" runs the fused pass at the launch its walks' count
    earns (here B * H * V / BV walks: 4 at narrow_block_v = 32, 2 at block_v = 64, against
    thresholds fused_pass_min_programs of 3 and 2), forward, the backward's walk from the
    checkpoints and the adjoint walk: with the products in 16 bits (walk_dots "operators"),
    block_v columns on low_dots_num_warps warps where they make enough walks, else
    narrow_block_v columns on narrow_num_warps where those do; with them widened, the narrow
    launch wherever it makes enough. Float32 operators take the split pass below the threshold
    and the fused one at block_v columns from it. Either way the output, the final state and
    every gradient are the loop's (fp16: the interpreter's 16-bit float)."""
    from deltalab.ops.delta_rule.triton import state_pass as state_module
    from deltalab.ops.delta_rule.triton.launch import LAUNCH

    # The backward's walk from every chunk's start: 3 segments at once, 3x the forward's walks,
    # yet the forward's launch (a launch chosen by its own count would pass the thresholds).
    options = KernelOptions(walk_dots=walk_dots, checkpoint_every=1)

    recorded = _recorded_launches(monkeypatch, state_module, WALKS)
    table = replace(LAUNCH, low_dots_num_warps=1, block_v=64, narrow_block_v=32,
                    narrow_num_warps=2, fused_pass_min_programs=threshold)  # fmt: skip
    inputs = random_delta_inputs(generator, 1, 37, 2, 16, 64, channel_decay=True)
    state = torch.randn(1, 2, 16, 64, generator=generator, dtype=torch.float64)
    _compare_at(inputs, state, dtype, chunk_size=16, options=options, table=table)
    launches = [(name, kwargs["BV"], kwargs["num_warps"]) for name, _, kwargs in recorded]
    walks = ["_state_pass_fwd"] * 2 + ["_state_pass_bwd"]  # forward, from checkpoints, adjoint
    if chosen == "narrow":
        assert launches == [(name, 32, 2) for name in walks]
    elif chosen == "low_dots":
        assert launches == [(name, 64, 1) for name in walks]
    elif chosen == "fused":
        assert launches == [(name, 64, table.num_warps) for name in walks]
    else:
        assert {launch[0] for launch in launches} == {
            "_state_pass_split_fwd",
            "_state_pass_split_bwd",
        }


@pytest.mark.parametrize("state_pass", ["fused", "split"])
@pytest.mark.parametrize("walk_dots", ["float32", "operators"])
def test_16bit_products_in_the_walks_keep_every_result_within_the_16bit_bound(
    generator, monkeypatch, walk_dots, state_pass
):
    """walk_dots "operators": the walks, fused or split, forward and adjoint, multiply the
    16-bit operators as stored with the state, residuals, dS, dN and dO rounded to their dtype
    (LOW_DOTS reaches the walk kernels only then, and only with 16-bit operators); the output,
    the final state and every gradient stay within the 16-bit bound of the float64 loop (fp16:
    the interpreter's 16-bit float; bf16 is timed and checked on the GPU), over two row blocks
    per chunk and, fused, both passes through the residuals of earlier row blocks."""
    from deltalab.ops.delta_rule.triton import state_pass as state_module
    from deltalab.ops.delta_rule.triton.launch import LAUNCH

    walks = {"fused": ("_state_pass_fwd", "_state_pass_bwd"),
             "split": ("_state_pass_split_fwd", "_state_pass_split_bwd")}  # fmt: skip
    recorded = _recorded_launches(monkeypatch, state_module, walks[state_pass])
    table = replace(LAUNCH, block_c=16)  # two row blocks per chunk of 32
    options = KernelOptions(state_pass=state_pass, walk_dots=walk_dots)
    inputs = random_delta_inputs(generator, 1, 45, 2, 16, 32, channel_decay=True)
    state = torch.randn(1, 2, 16, 32, generator=generator, dtype=torch.float64)
    _compare_at(inputs, state, torch.float16, chunk_size=32, options=options, table=table)
    flags = [kwargs["LOW_DOTS"] for _, _, kwargs in recorded]
    assert flags and set(flags) == {walk_dots == "operators"}
    assert {kwargs["BC"] for _, _, kwargs in recorded} == {16}


@pytest.mark.skipif(DEVICE != "cuda", reason="bfloat16 kernels: CUDA only")
@pytest.mark.parametrize("launch", ["wide", "narrow", "split"])
def test_bf16_walks_stay_within_the_bf16_bound_of_the_loop(generator, monkeypatch, launch):
    """bf16 inputs as training gives them, the walks' products in bf16 (walk_dots, the
    default), at each launch "auto" may take (the fused pass at block_v columns, at the narrow
    launch, the split pass: chosen here by the walk threshold), K = V = 128 as the presets
    have, strong and weak decays over 5 chunks: the output, the final state and every gradient
    within the bf16 bound of the float64 loop (the interpreter checks fp16 the same way)."""
    from deltalab.ops.delta_rule.triton import state_pass as state_module
    from deltalab.ops.delta_rule.triton.launch import LAUNCH

    recorded = _recorded_launches(monkeypatch, state_module, WALKS)
    batch, heads = 2, 3
    threshold = {"wide": 2, "narrow": 4, "split": 5}[launch] * batch * heads
    table = replace(LAUNCH, fused_pass_min_programs=threshold)
    inputs = random_delta_inputs(generator, batch, 300, heads, 128, 128, channel_decay=True,
                                 min_log_decay=-2.0)  # fmt: skip
    state = torch.randn(batch, heads, 128, 128, generator=generator, dtype=torch.float64)
    _compare_at(inputs, state, torch.bfloat16, chunk_size=64, table=table)
    taken = {(name, kwargs.get("BV"), kwargs["LOW_DOTS"]) for name, _, kwargs in recorded}
    if launch == "split":
        assert {name for name, _, _ in taken} == {"_state_pass_split_fwd", "_state_pass_split_bwd"}
    else:
        bv = {"wide": table.block_v, "narrow": table.narrow_block_v}[launch]
        assert taken == {("_state_pass_fwd", bv, True), ("_state_pass_bwd", bv, True)}


@pytest.mark.parametrize("state_pass", ["split", "fused"])
def test_state_pass_grids_count_chunks_and_walks_on_their_first_axis(
    generator, monkeypatch, state_pass
):
    """Every state-pass kernel's launch grid puts the walks or chunks on its first axis (CUDA
    bounds that one by 2^31 - 1, the others by 65535, which B * H * chunks passes at B * H = 32,
    T = 128K, chunks of 64): the other axes of every launch, forward and backward, stay as small
    as a chunk's row blocks, whatever the number of chunks."""
    from deltalab.ops.delta_rule.triton import state_pass as state_module

    recorded = _recorded_launches(monkeypatch, state_module, (
        "_state_pass_fwd", "_state_pass_bwd", "_state_pass_split_fwd", "_state_pass_split_out",
        "_state_pass_split_dout", "_state_pass_split_bwd",
    ))  # fmt: skip
    options = KernelOptions(state_pass=state_pass, checkpoint_every=2)
    inputs = random_delta_inputs(generator, 2, 70, 2, 16, 8, channel_decay=True)
    state = torch.randn(2, 2, 16, 8, generator=generator, dtype=torch.float64)
    _compare(inputs, state, 16, options=options)  # 5 chunks: 3 segments in the backward's walk
    grids = [(name, grid) for name, grid, _ in recorded]
    assert {name for name, _ in grids} >= (
        {"_state_pass_fwd", "_state_pass_bwd"} if state_pass == "fused"
        else {"_state_pass_split_fwd", "_state_pass_split_out", "_state_pass_split_dout",
              "_state_pass_split_bwd"}
    )  # fmt: skip
    for name, grid in grids:  # (the split outputs' row blocks: one per chunk of 16)
        assert all(size == 1 for size in grid[1:]), f"{name}: grid {grid}"
    # Axis 0 counts every (chunk, value block) of the parallel kernels: B * H * 5 chunks, one
    # value block of V = 8.
    for name, grid in grids:
        if name in ("_state_pass_split_out", "_state_pass_split_dout"):
            assert grid[0] == 2 * 2 * 5, f"{name}: grid {grid}"


def test_triton_operator_gradients_match_their_pytorch_twin(generator, poisoned_empty):
    """The operator-gradient kernel against `_operator_grads` (batched matmuls in float64), with
    dO token-major over a length that is not a multiple of the chunk (its padding rows read as
    zero), K and V that need masking."""
    from deltalab.ops.delta_rule.chunk import ChunkOperators, to_chunks
    from deltalab.ops.delta_rule.triton.intra import Tokens
    from deltalab.ops.delta_rule.triton.state_pass import _operator_grads, operator_grads_triton

    batch, length, heads, key_dim, value_dim, size = 2, 50, 3, 20, 12, 32
    n = -(-length // size)

    def rand(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    states, d_next = rand(batch, heads, n, key_dim, value_dim), rand(batch, heads, n, key_dim,
                                                                     value_dim)  # fmt: skip
    residuals, d_residual = rand(batch, heads, n, size, value_dim), rand(batch, heads, n, size,
                                                                         value_dim)  # fmt: skip
    d_o = rand(batch, length, heads, value_dim)
    ref = _operator_grads(states, residuals, to_chunks(d_o, size), d_residual, d_next)
    got = operator_grads_triton(
        *(x.to(DEVICE, torch.float32) for x in (states, residuals, d_o, d_residual, d_next)),
        tokens=Tokens(n, heads, length, size),
    )
    for label, x, r in zip(ChunkOperators._fields, got, ref, strict=True):
        assert_close(x, r, F32, f"d {label}")
