"""The static decoder's fused layer step (`deltalab.layers.decode_step`, one Triton kernel for a
layer's recurrent work) against its PyTorch twin, the mixer's own one-token forward, for every
mixer it serves, under the Triton interpreter."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_recurrent_state

from deltalab.benchmarking import HOST_READS, OperatorCounter
from deltalab.layers.decode_step import fused_step, runs_fused, step_plan
from deltalab.layers.norms import RMSNorm
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
    ("kdn_exact", {}, {"head_dim": 20}),
    ("kdn_exact", {"process_noise": "tied"}, {"head_dim": 48}),
    ("kdn_muir", {}, {}),
]


def _case_id(case) -> str:
    kind, options, overrides = case
    sizes = (f"{'V' if name == 'value_dim' else 'K'}{v}" for name, v in overrides.items())
    return "-".join([kind, *map(str, options.values()), *sizes])


# Every case in the kernel's default block, and the value_dim 32 cases again in blocks of 16 (two
# blocks). At value_dim 16 a block of 16 is the default block: the same launch.
BLOCKS = [
    *(pytest.param(case, None, id=f"{_case_id(case)}-one_block") for case in CASES),
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


@pytest.mark.parametrize(
    ("kind", "hooked"), [("gdn2", False), ("kdn_diag", False), ("muir", False), ("gdn2", True)]
)
def test_the_fused_step_with_the_blocks_norm_and_residual_equals_the_blocks_mixer_branch(
    generator, kind, hooked
):
    """x + mixer(norm(x)): the norm in the first product's kernel, the sum written into x. A
    norm with a hook of its own is run as a module, its hook with it (`fusable`)."""
    mixer = tiny_mixer(kind, {}, {}, generator)
    norm = RMSNorm(32, eps=1e-3, backend="torch")
    if hooked:
        norm.register_forward_hook(lambda module, inputs, output: -3.0 * output)
    with torch.no_grad():
        norm.weight.copy_(1.0 + torch.rand(32, generator=generator))
        _, state = mixer(torch.randn(2, 5, 32, generator=generator))
        x = 3.0 * torch.randn(2, 1, 32, generator=generator)
        buffers = _static_recurrent(state)
        y, after = mixer(norm(x), state)
        expected = x + y
        got = fused_step(mixer, x, buffers, {}, residual=x, norm=norm, in_place=True)
    assert got.data_ptr() == x.data_ptr()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert_same_recurrent_state(buffers, after)


def test_a_decoding_step_on_the_kernels_runs_no_norm_module_but_the_heads(generator, norm_calls):
    """At a few rows the blocks' norms are computed by the products after them (`norm_calls`)."""
    torch.manual_seed(0)
    model = CausalLM(build_config("tiny", mixer="gdn2", backend="triton", **TINY)).eval()
    with torch.no_grad():
        out = model(torch.randint(0, 67, (2, 7), generator=generator), use_cache=True)
    decoder = StaticDecoder(model, out.past_key_values, 4, cuda_graph=False)
    decoder.start(out.logits[:, -1])
    norm_calls.clear()
    decoder.step()
    assert norm_calls == [model.model.norm]


@pytest.fixture
def kernel_launches(monkeypatch) -> list:
    """The names of the Triton kernels launched from here on, in order (a spy on the
    interpreter's launches)."""
    from triton.runtime.interpreter import InterpretedFunction

    names = []
    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        names.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", counted)
    return names


def test_a_decoding_step_on_the_kernels_launches_no_swiglu_kernel(generator, kernel_launches):
    """At a few rows on the kernels the down projection gates its input by SwiGLU itself: a step
    launches no SwiGLU kernel (a spy on its launches, which the model's forward does make), and
    its next token is the model's own forward's."""

    def swiglu_launches() -> int:
        return kernel_launches.count("_swiglu_fwd")

    torch.manual_seed(0)
    model = CausalLM(build_config("tiny", mixer="gdn2", backend="triton",
                                  **{**TINY, "num_layers": 2})).eval()  # fmt: skip
    prompt = torch.randint(0, 67, (2, 7), generator=generator)
    with torch.no_grad():
        out = model(prompt, use_cache=True)
        assert swiglu_launches() == 2  # the forward's, one a layer: the spy sees them
        decoder = StaticDecoder(model, out.past_key_values, 4, cuda_graph=False)
        decoder.start(out.logits[:, -1])
        kernel_launches.clear()
        decoder.step()
        assert swiglu_launches() == 0
        tokens = decoder.generated()
        whole = model(torch.cat([prompt, tokens[:, :1]], 1)).logits[:, -1].argmax(-1)
    assert torch.equal(tokens[:, 1], whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["kernel", "apart"])
def test_add_projected_gates_swiglu_in_the_kernel_or_apart_with_the_same_result(
    generator, kernel_launches, dtype
):
    """float32 rows at a few rows take the kernel, which gates them itself (no SwiGLU launch);
    float64 ones take `swiglu` on the given backend (its kernel), then torch's product: both the
    FFN's down branch."""
    from deltalab.layers.decode_step import add_projected
    from deltalab.ops.swiglu import swiglu

    down = torch.nn.Linear(24, 16).to(dtype)
    gate_up = torch.randn(3, 1, 48, generator=generator).to(dtype)
    residual = torch.randn(3, 1, 16, generator=generator).to(dtype)
    with torch.no_grad():
        expected = residual + down(swiglu(gate_up, backend="naive"))
        got = add_projected(residual, gate_up, down, "triton", swiglu_backend="triton")
    assert kernel_launches.count("_swiglu_fwd") == (0 if dtype == torch.float32 else 1)
    assert got.shape == (3, 1, 16)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        ({"swiglu_backend": "cuda"}, ValueError, "swiglu_backend must be one of"),
        ({"swiglu_backend": "triton", "norm": RMSNorm(48)}, ValueError, "norm or swiglu_backend"),
    ],
)
def test_add_projected_refuses_bad_gating_naming_it(arguments, error, match):
    from deltalab.layers.decode_step import add_projected

    with pytest.raises(error, match=match):
        add_projected(None, torch.zeros(2, 1, 48), torch.nn.Linear(24, 16), "triton", **arguments)


# What the interpreter does with a launch's arguments (copies to and from the host), which no
# GPU launch does: left out of the counts below.
INTERPRETER_OPS = {"aten::new_empty", "aten::set_", "aten::copy_"}
# ATen operators of one layer's fused decoding step besides its Triton kernels (its products
# by `row_linear`: x's projections after the block's first norm, the low-rank gates' second
# factors, the output projection with the residual sum, the FFN's two, the first after the
# second norm, the second gating its input by SwiGLU; the fused step): none but Exact KDN's
# buffer for P_bar k, an allocation without a launch (`aten::new_empty`, among the
# interpreter's here), where the unfused step makes 54 to 117 (tests/test_decode.py).
FUSED_STEP_OPERATORS_PER_LAYER = 0
# Triton launches of one layer's fused step at a few rows: its five products (the low-rank
# gates' second factors one more) and the fused step (Exact KDN's covariance one more: its
# first stage). Past `row_linear.MAX_TRITON_ROWS` sequences the products are cuBLAS's and the
# two norms and SwiGLU their own launches.
FUSED_STEP_LAUNCHES_PER_LAYER = {"deltanet": 5, "gdn": 5, "kda": 6, "gdn2": 6, "kdn_iso": 6,
                                 "kdn_diag": 6, "kdn_exact": 7, "muir": 6, "kdn_muir": 6}  # fmt: skip
FUSED_KINDS = list(FUSED_STEP_LAUNCHES_PER_LAYER)


def counted_fused_step(kind: str, layers: int, generator, launches: list) -> dict[str, list]:
    """The ATen operators one static decoding step on the fused path dispatches, after a
    prompt and two steps, the interpreter's own left out; its kernels' launches appended to
    `launches` (a spy's list, `kernel_launches`)."""
    torch.manual_seed(0)
    config = build_config("tiny", mixer=kind, backend="triton", **{**TINY, "num_layers": layers})
    model = CausalLM(config).eval()
    with torch.no_grad():
        out = model(torch.randint(0, 67, (2, 7), generator=generator), use_cache=True)
    decoder = StaticDecoder(model, out.past_key_values, 4, cuda_graph=False)
    decoder.start(out.logits[:, -1])
    decoder.step()
    launches.clear()
    with OperatorCounter() as counter:
        decoder.step()
    return {name: v for name, v in counter.totals.items() if name not in INTERPRETER_OPS}


@pytest.mark.parametrize("kind", FUSED_KINDS)
def test_a_fused_decoding_step_dispatches_at_most_its_operator_count_per_layer(
    generator, kernel_launches, kind
):
    """A two-layer model's step less a one-layer model's: one layer's operators, none but its
    Triton kernels, and at most FUSED_STEP_LAUNCHES_PER_LAYER of those. None reads a value back
    to the host."""
    counts, launched = [], []
    for layers in (1, 2):
        counts.append(counted_fused_step(kind, layers, generator, kernel_launches))
        launched.append(list(kernel_launches))
    assert not HOST_READS & set(counts[1])
    total = [sum(n for n, _ in each.values()) for each in counts]
    assert total[1] - total[0] <= FUSED_STEP_OPERATORS_PER_LAYER
    assert len(launched[1]) - len(launched[0]) <= FUSED_STEP_LAUNCHES_PER_LAYER[kind], launched
    assert "_swiglu_fwd" not in launched[1] and "_fused_step_kernel" in launched[1]


def test_the_launch_table_picks_its_blocks_by_the_number_of_programs_and_the_shapes():
    """Below `many_programs` the table's blocks, from it the wide-batch ones; a block no wider
    than the head; sizes that are not multiples of 16 the whole head in one block (where the
    table's few warps spill)."""
    from deltalab.ops.delta_rule.triton.fused_step import FusedStepLaunch, launch, table_launch

    table = FusedStepLaunch(block_v=64, num_warps=4, many_programs=512, many_block_v=32,
                            many_num_warps=2)  # fmt: skip
    assert table_launch(table, 511, 128, 128) == (128, 64, 4)
    assert table_launch(table, 512, 128, 128) == (128, 32, 2)
    assert table_launch(table, 8, 128, 32) == (128, 32, 4)
    whole = launch(128, 128)
    assert whole == (128, 128, 16)
    assert table_launch(table, 8, 128, 128, aligned=False) == whole
    never = FusedStepLaunch(block_v=64, num_warps=4, many_programs=None)
    assert table_launch(never, 10**6, 128, 128) == (128, 64, 4)


@pytest.mark.parametrize("kind", ["muir", "kdn_diag", "kda"])
@pytest.mark.parametrize("many_programs", [8, 4], ids=["few_programs", "many_programs"])
def test_the_fused_step_equals_the_unfused_step_at_each_launch_of_a_table(
    generator, monkeypatch, kind, many_programs
):
    """A step (value_dim 32, 2 sequences x 2 heads: 4 programs) by a table whose launches
    differ: blocks of 16 over 1 warp below `many_programs`, one block of 32 over 2 from it; the
    launch taken is the table's (observed, not changed)."""
    from deltalab.ops.delta_rule.triton import fused_step as kernel_module

    launches = []

    def observed(*args, **kwargs):
        launches.append(table_launch(*args, **kwargs))
        return launches[-1]

    table_launch = kernel_module.table_launch
    monkeypatch.setattr(kernel_module, "table_launch", observed)
    table = kernel_module.FusedStepLaunch(block_v=16, num_warps=1, many_programs=many_programs,
                                          many_block_v=32, many_num_warps=2)  # fmt: skip
    mixer = tiny_mixer(kind, {}, {"value_dim": 32}, generator)
    with torch.no_grad():
        _, state = mixer(torch.randn(2, 5, 32, generator=generator))
        x = torch.randn(2, 1, 32, generator=generator)
        buffers = _static_recurrent(state)
        expected, after = mixer(x, state)
        got = fused_step(mixer, x, buffers, {}, table=table)
    assert launches == [(16, 16, 1) if many_programs > 4 else (16, 32, 2)]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert_same_recurrent_state(buffers, after)


def test_a_step_given_both_a_value_block_and_a_table_is_refused_naming_them(generator):
    from deltalab.ops.delta_rule.triton.fused_step import LAUNCH

    mixer = tiny_mixer("gdn2", {}, {}, generator)
    with torch.no_grad():
        _, state = mixer(torch.randn(2, 5, 32, generator=generator))
        buffers = _static_recurrent(state)
        with pytest.raises(ValueError, match="block_v and table"):
            fused_step(mixer, torch.randn(2, 1, 32, generator=generator), buffers, {},
                       block_v=16, table=LAUNCH)  # fmt: skip
