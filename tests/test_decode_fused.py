"""The static decoder's fused layer step (`deltalab.layers.decode_step`, one Triton kernel for a
layer's recurrent work) against its PyTorch twin, the mixer's own one-token forward, for every
mixer it serves, under the Triton interpreter."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_recurrent_state

from deltalab.benchmarking import HOST_READS, OperatorCounter
from deltalab.layers.decode_step import fused_step, runs_fused, step_plan
from deltalab.models import CausalLM, build_config
from deltalab.models.static_decode import StaticDecoder, _static_recurrent
from deltalab.ops._triton import INTERPRET

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(not INTERPRET, reason="CPU tensors need TRITON_INTERPRET=1 set first"),
]

TINY = dict(hidden_size=32, num_layers=1, num_heads=2, head_dim=16, vocab_size=67, chunk_size=16)

# (kind, mixer options, config overrides): every parametrization the kernel has, the default
# block of the value columns and two blocks (value_dim 32 at block_v 16).
CASES = [
    ("deltanet", {}, {}),
    ("gdn", {}, {}),
    ("kda", {}, {"value_dim": 32}),
    ("gdn2", {}, {}),
    ("muir", {}, {}),
    ("muir", {"read_gate": "static"}, {}),
    ("muir", {"read_gate": "none"}, {"value_dim": 32}),
    ("kdn_iso", {}, {}),
    ("kdn_iso", {"process_noise": "tied"}, {}),
    ("kdn_diag", {}, {"value_dim": 32}),
    ("kdn_diag", {"process_noise": "tied"}, {}),
    ("kdn_exact", {}, {}),
    ("kdn_exact", {"process_noise": "tied"}, {"value_dim": 32}),
    ("kdn_muir", {}, {}),
]


def _case_id(case) -> str:
    kind, options, overrides = case
    return "-".join([kind, *map(str, options.values()), *(f"V{v}" for v in overrides.values())])


# Every case at the default table's launch (the interpreter's: one block, at value_dim 32 each
# head's columns over 2 programs of 16 but for Exact KDN), and the value_dim 32 cases again in
# blocks of 16 on one program (two blocks). At value_dim 16 a block of 16 is the default launch.
BLOCKS = [
    *(pytest.param(case, None, id=f"{_case_id(case)}-table") for case in CASES),
    *(
        pytest.param(case, 16, id=f"{_case_id(case)}-blocks_of_16")
        for case in CASES
        if case[2].get("value_dim", TINY["head_dim"]) > 16
    ),
]


def tiny_mixer(kind: str, options: dict, overrides: dict, generator):
    torch.manual_seed(0)
    config = build_config(
        "tiny", mixer=kind, backend="triton", mixer_options=options, **{**TINY, **overrides}
    )
    mixer = CausalLM(config).model.blocks[0].mixer.eval()
    with torch.no_grad():
        # Off their initial values, which zero some maps (Muir's read gate, KDN's noise).
        for p in mixer.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=generator))
    return mixer


@pytest.mark.parametrize(("case", "block_v"), BLOCKS)
def test_the_fused_step_equals_the_unfused_step(generator, case, block_v):
    """Output, memory, conv caches and KDN precision after a token, from a prefilled state."""
    mixer = tiny_mixer(*case, generator)
    with torch.no_grad():
        _, state = mixer(torch.randn(2, 5, 32, generator=generator))
        x = torch.randn(2, 1, 32, generator=generator)
        buffers = _static_recurrent(state)
        assert runs_fused(mixer, x, buffers) and step_plan(mixer) is not None
        expected, after = mixer(x, state)
        got = fused_step(mixer, x, buffers, {}, block_v=block_v)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert_same_recurrent_state(buffers, after)


# What the interpreter does with a launch's arguments (copies to and from the host), which no
# GPU launch does: left out of the counts below.
INTERPRETER_OPS = {"aten::new_empty", "aten::set_", "aten::copy_"}
# ATen operators of one layer's fused decoding step besides its Triton kernels (the block's two
# norms; its products by `row_linear`: x's projections, the low-rank gates' second factors, the
# output projection with the residual sum, the FFN's two; the fused step; SwiGLU's gating):
# none. On a GPU 8 launches a layer, 9 with low-rank gates, where the unfused step makes 54 to
# 117 (tests/test_decode.py); past `row_linear.MAX_TRITON_ROWS` sequences the products are
# cuBLAS's, the same launches.
FUSED_STEP_OPERATORS_PER_LAYER = 0
FUSED_KINDS = ["deltanet", "gdn", "kda", "gdn2", "kdn_iso", "kdn_diag", "kdn_exact", "muir",
               "kdn_muir"]  # fmt: skip


def counted_fused_step(kind: str, layers: int, generator) -> dict[str, list[float]]:
    """The ATen operators one static decoding step on the fused path dispatches, after a
    prompt and two steps, the interpreter's own left out."""
    torch.manual_seed(0)
    config = build_config("tiny", mixer=kind, backend="triton", **{**TINY, "num_layers": layers})
    model = CausalLM(config).eval()
    with torch.no_grad():
        out = model(torch.randint(0, 67, (2, 7), generator=generator), use_cache=True)
    decoder = StaticDecoder(model, out.past_key_values, 4, cuda_graph=False)
    decoder.start(out.logits[:, -1])
    decoder.step()
    with OperatorCounter() as counter:
        decoder.step()
    return {name: v for name, v in counter.totals.items() if name not in INTERPRETER_OPS}


@pytest.mark.parametrize("kind", FUSED_KINDS)
def test_a_fused_decoding_step_dispatches_at_most_its_operator_count_per_layer(generator, kind):
    """A two-layer model's step less a one-layer model's: one layer's operators. None reads a
    value back to the host."""
    one, two = (counted_fused_step(kind, layers, generator) for layers in (1, 2))
    assert not HOST_READS & set(two)
    total = [sum(n for n, _ in counts.values()) for counts in (one, two)]
    assert total[1] - total[0] <= FUSED_STEP_OPERATORS_PER_LAYER


def test_the_launch_table_picks_its_blocks_by_the_number_of_programs_and_the_shapes():
    """Below `split_programs` each head's columns over `splits` programs, in blocks cut to a
    program's share (the splits cut so each owns columns); below `many_programs` the table's
    blocks, from it the wide-batch ones; a block no wider than the head; Exact KDN and sizes
    that are not multiples of 16 the whole head in one block (where the table's few warps
    spill), unsplit."""
    from deltalab.ops.delta_rule.triton.fused_step import FusedStepLaunch, launch, table_launch

    table = FusedStepLaunch(block_v=64, num_warps=4, many_programs=512, many_block_v=32,
                            many_num_warps=2, splits=8, split_programs=64,
                            split_num_warps=2)  # fmt: skip
    assert table_launch(table, "erase_write", 8, 128, 128) == (128, 16, 2, 8)
    assert table_launch(table, "kdn_diag", 63, 128, 128) == (128, 16, 2, 8)
    assert table_launch(table, "kdn_iso", 8, 128, 48) == (128, 16, 2, 3)
    assert table_launch(table, "beta", 8, 128, 16) == (128, 16, 4, 1)
    assert table_launch(table, "erase_write", 64, 128, 128) == (128, 64, 4, 1)
    assert table_launch(table, "kdn_diag", 512, 128, 128) == (128, 32, 2, 1)
    assert table_launch(table, "beta", 64, 128, 32) == (128, 32, 4, 1)
    whole = launch(128, 128)
    assert whole == (128, 128, 16)
    assert table_launch(table, "kdn_exact", 8, 128, 128) == (*whole, 1)
    assert table_launch(table, "erase_write", 8, 128, 128, aligned=False) == (*whole, 1)
    never = FusedStepLaunch(block_v=64, num_warps=4, many_programs=None, splits=1)
    assert table_launch(never, "beta", 10**6, 128, 128) == (128, 64, 4, 1)
    assert table_launch(never, "beta", 1, 128, 128) == (128, 64, 4, 1)
    always = FusedStepLaunch(block_v=32, num_warps=4, splits=2, split_programs=None)
    assert table_launch(always, "beta", 10**6, 128, 128) == (128, 32, 2, 2)


@pytest.mark.parametrize("kind", ["muir", "kdn_diag", "kda"])
@pytest.mark.parametrize("many_programs", [8, 4], ids=["few_programs", "many_programs"])
def test_the_fused_step_equals_the_unfused_step_at_each_launch_of_a_table(
    generator, fused_step_launches, kind, many_programs
):
    """A step (value_dim 32, 2 sequences x 2 heads: 4 programs) by a table whose launches
    differ: blocks of 16 over 1 warp below `many_programs`, one block of 32 over 2 from it; the
    launch taken is the table's."""
    from deltalab.ops.delta_rule.triton.fused_step import FusedStepLaunch

    table = FusedStepLaunch(block_v=16, num_warps=1, many_programs=many_programs,
                            many_block_v=32, many_num_warps=2, splits=1)  # fmt: skip
    mixer = tiny_mixer(kind, {}, {"value_dim": 32}, generator)
    with torch.no_grad():
        _, state = mixer(torch.randn(2, 5, 32, generator=generator))
        x = torch.randn(2, 1, 32, generator=generator)
        buffers = _static_recurrent(state)
        expected, after = mixer(x, state)
        got = fused_step(mixer, x, buffers, {}, table=table)
    assert fused_step_launches == [(16, 16, 1, 1) if many_programs > 4 else (16, 32, 2, 1)]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert_same_recurrent_state(buffers, after)


# (kind, value_dim, heads): the forms whose step splits a head's columns; value_dim 48 is no
# multiple of 2 x 16 (the last program's second block is past the head) nor of 4 x 16 (three
# programs). Isotropic KDN at 4 heads: its per-head gates then keep the projection's later
# columns 16-byte aligned, where the table launches (`table_launch`).
SPLIT_CASES = [("muir", 48, 2), ("kdn_diag", 64, 2), ("kdn_iso", 64, 4), ("kda", 64, 2),
               ("gdn2", 48, 2)]  # fmt: skip


@pytest.mark.parametrize(("kind", "value_dim", "heads"), SPLIT_CASES,
                         ids=[k for k, *_ in SPLIT_CASES])  # fmt: skip
@pytest.mark.parametrize("splits", [2, 4])
@pytest.mark.parametrize("batch", [1, 3])
def test_the_fused_step_split_over_programs_equals_the_unfused_step_step_after_step(
    generator, fused_step_launches, kind, value_dim, heads, splits, batch
):
    """Two consecutive steps with each head's value columns over `splits` programs (blocks of
    16: at 64 columns 2 blocks a program of 2, 1 of 4; at 48 columns 2 and 1, the last program
    holding the columns past the head, or 3 programs of 1): after each, the output, memory,
    conv caches and KDN filter state equal the mixer's own step's. The second step starts from
    the arrival counters the first left (every head's last program resets its own)."""
    from deltalab.ops.delta_rule.triton.fused_step import FusedStepLaunch, split_columns

    table = FusedStepLaunch(block_v=16, num_warps=1, splits=splits, split_programs=None,
                            split_num_warps=1)  # fmt: skip
    mixer = tiny_mixer(kind, {}, {"value_dim": value_dim, "num_heads": heads}, generator)
    with torch.no_grad():
        _, state = mixer(torch.randn(batch, 5, 32, generator=generator))
        buffers = _static_recurrent(state)
        for _ in range(2):
            x = torch.randn(batch, 1, 32, generator=generator)
            expected, state = mixer(x, state)
            got = fused_step(mixer, x, buffers, {}, table=table)
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
            assert_same_recurrent_state(buffers, state)
    taken = split_columns(value_dim, 16, splits)[1]
    assert taken > 1 and fused_step_launches == [(16, 16, 1, taken)] * 2


def test_a_step_given_both_a_value_block_and_a_table_is_refused_naming_them(generator):
    from deltalab.ops.delta_rule.triton.fused_step import LAUNCH

    mixer = tiny_mixer("gdn2", {}, {}, generator)
    with torch.no_grad():
        _, state = mixer(torch.randn(2, 5, 32, generator=generator))
        buffers = _static_recurrent(state)
        with pytest.raises(ValueError, match="block_v and table"):
            fused_step(mixer, torch.randn(2, 1, 32, generator=generator), buffers, {},
                       block_v=16, table=LAUNCH)  # fmt: skip
