"""The static decoder's fused layer step (`deltalab.layers.decode_step`, one Triton kernel for a
layer's recurrent work) against its PyTorch twin, the mixer's own one-token forward, for every
mixer it serves, whole and split over programs a head, and its normed products
(`deltalab.ops.normed_linear`: a block's norm in the product after it) against the model's
forward, under the Triton interpreter."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from deltalab.benchmarking import HOST_READS, OperatorCounter
from deltalab.layers.decode_step import fused_step, runs_fused, runs_normed, step_plan
from deltalab.layers.norms import RMSNorm
from deltalab.models import CausalLM, build_config
from deltalab.models.static_decode import StaticDecoder, _static_recurrent
from deltalab.ops._triton import INTERPRET
from deltalab.ops.delta_rule.triton.fused_step import (
    FusedStepLaunch,
    StepForm,
    fused_layer_step,
    split_launch,
)

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


@pytest.mark.parametrize("normed", [False, True], ids=["x_given_normed", "norm_in_the_product"])
@pytest.mark.parametrize(("case", "block_v"), BLOCKS)
def test_the_fused_step_equals_the_unfused_step(generator, case, block_v, normed):
    """Output, memory, conv caches and KDN precision after a token, from a prefilled state; with
    the block's norm given, computed in the first product's launch."""
    mixer = tiny_mixer(*case, generator)
    norm = RMSNorm(32, backend="triton")
    with torch.no_grad():
        norm.weight.add_(0.3 * torch.randn(32, generator=generator))
        _, state = mixer(torch.randn(2, 5, 32, generator=generator))
        x = torch.randn(2, 1, 32, generator=generator)
        buffers = _static_recurrent(state)
        assert runs_fused(mixer, x, buffers) and step_plan(mixer) is not None
        assert runs_normed(norm, x)
        expected, after = mixer(norm(x) if normed else x, state)
        got = fused_step(mixer, x, buffers, {}, block_v=block_v, norm=norm if normed else None)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    _assert_same_state(buffers, after, rtol=1e-4, atol=1e-5)


def _assert_same_state(got, expected, **tolerance) -> None:
    for f in dataclasses.fields(expected):
        value = getattr(expected, f.name)
        if f.name != "gates" and isinstance(value, torch.Tensor):
            torch.testing.assert_close(getattr(got, f.name), value, **tolerance)


# (kind, mixer options, value_dim, programs_per_head): every rule, decay form and read form,
# each head split over 2 or 4 programs; V = 48 in blocks of 32 and of 16 (a last block partly
# past V; 3 programs where 4 were asked).
SPLIT_CASES = [
    ("deltanet", {}, 64, 4),
    ("gdn", {}, 48, 2),
    ("kda", {}, 64, 4),
    ("muir", {}, 48, 4),
    ("muir", {"read_gate": "static"}, 32, 2),
    ("kdn_iso", {"process_noise": "tied"}, 32, 2),
    ("kdn_diag", {}, 64, 4),
    ("kdn_exact", {}, 48, 2),
    ("kdn_muir", {}, 32, 2),
]


def _split_case_id(case) -> str:
    kind, options, value_dim, programs = case
    return "-".join([kind, *map(str, options.values()), f"V{value_dim}", f"NV{programs}"])


@pytest.mark.parametrize("case", SPLIT_CASES, ids=_split_case_id)
def test_the_step_split_over_programs_equals_the_whole_step_and_the_unfused_step(generator, case):
    """Over three consecutive tokens (the caches shifted, the head's counter reset between
    them), output and state of the step split over programs a head equal one program's
    and the mixer's own step's."""
    kind, options, value_dim, programs = case
    mixer = tiny_mixer(kind, options, {"value_dim": value_dim}, generator)
    split = FusedStepLaunch(programs_per_head=programs)
    with torch.no_grad():
        _, state = mixer(torch.randn(2, 5, 32, generator=generator))
        whole, parted = _static_recurrent(state), _static_recurrent(state)
        assert split_launch(parted.memory, split)[3] == min(programs, -(-value_dim // 16))
        store: dict = {}
        for _ in range(3):
            x = torch.randn(2, 1, 32, generator=generator)
            expected, state = mixer(x, state)
            one = fused_step(mixer, x, whole, {}, table=FusedStepLaunch())
            got = fused_step(mixer, x, parted, store, table=split)
            torch.testing.assert_close(got, one, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
            _assert_same_state(parted, whole, rtol=1e-5, atol=1e-6)
            _assert_same_state(parted, state, rtol=1e-4, atol=1e-5)


def test_the_split_steps_counters_are_back_to_zero_after_each_step(generator):
    """The counters of a head's finished programs end every step at 0, ready for the next one
    (and for a CUDA graph's replay)."""
    mixer = tiny_mixer("gdn", {}, {"value_dim": 64}, generator)
    split = FusedStepLaunch(programs_per_head=4)
    with torch.no_grad():
        _, state = mixer(torch.randn(2, 5, 32, generator=generator))
        buffers, store = _static_recurrent(state), {}
        for _ in range(2):
            fused_step(mixer, torch.randn(2, 1, 32, generator=generator), buffers, store,
                       table=split)  # fmt: skip
            (workspace,) = [v for k, v in store.items() if k[0] == "fused_step_workspace"]
            assert workspace.shape == (2 * 2, 1 + 4)
            assert workspace[:, 0].tolist() == [0] * 4


def test_the_default_launch_keeps_one_program_a_head_and_a_table_splits_up_to_its_heads():
    """At the 340M presets' heads (K = V = 128): one program of 16 warps by default; a table's
    split takes blocks of V / NV columns over warps by their tile, up to split_max_heads."""
    heads = [torch.empty(batch, 8, 128, 128, device="meta") for batch in (1, 2)]
    assert split_launch(heads[0]) == (128, 128, 16, 1)
    for programs, block_v, warps in ((2, 64, 8), (4, 32, 4), (8, 16, 4)):
        table = FusedStepLaunch(programs_per_head=programs, split_max_heads=8)
        assert split_launch(heads[0], table) == (128, block_v, warps, programs)
        assert split_launch(heads[1], table) == (128, 128, 16, 1)
    exact = split_launch(heads[0], FusedStepLaunch(programs_per_head=4), covariance=True)
    assert exact == (128, 32, 16, 4)


def test_a_split_launch_without_its_workspace_is_refused_naming_it():
    memory, placeholder = torch.zeros(1, 2, 16, 64), torch.zeros(32, 1, 4)
    with pytest.raises(ValueError, match=r"^workspace: the launch splits each head over 4"):
        fused_layer_step(
            StepForm("head", "beta"), (placeholder,) * 3, (placeholder,) * 3, (placeholder,) * 3,
            memory, placeholder, placeholder, placeholder, scale=1.0, l2_eps=1e-6, norm_eps=1e-6,
            gates={}, params={}, table=FusedStepLaunch(programs_per_head=4),
        )  # fmt: skip


# What the interpreter does with a launch's arguments (copies to and from the host), which no
# GPU launch does: left out of the counts below.
INTERPRETER_OPS = {"aten::new_empty", "aten::set_", "aten::copy_"}
# ATen operators of one layer's fused decoding step (its products: the low-rank gates' second
# factors, the output projection with the residual sum, the FFN's down projection with its
# residual sum), besides its three Triton kernels (the mixer's norm and x's projections, the
# fused step, the FFN's norm, gate_up product and gating): on a GPU 5 launches a layer, 6 with
# low-rank gates, where the unfused step makes 54 to 117 (tests/test_decode.py). With each
# norm and the gating launched apart from the products: 8 and 9.
FUSED_STEP_OPERATORS_PER_LAYER = {
    "deltanet": 2,
    "gdn": 2,
    "kda": 3,
    "gdn2": 3,
    "kdn_iso": 3,
    "kdn_diag": 3,
    "kdn_exact": 3,
    "muir": 3,
    "kdn_muir": 3,
}


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


@pytest.mark.parametrize("kind", list(FUSED_STEP_OPERATORS_PER_LAYER))
def test_a_fused_decoding_step_dispatches_at_most_its_operator_count_per_layer(generator, kind):
    """A two-layer model's step less a one-layer model's: one layer's operators. None reads a
    value back to the host."""
    one, two = (counted_fused_step(kind, layers, generator) for layers in (1, 2))
    assert not HOST_READS & set(two)
    total = [sum(n for n, _ in counts.values()) for counts in (one, two)]
    assert total[1] - total[0] <= FUSED_STEP_OPERATORS_PER_LAYER[kind]


class _KeptLogits(StaticDecoder):
    """A static decoder that keeps the logits each of its choices was made from."""

    def __init__(self, *args, **kwargs) -> None:
        self.logits: list[torch.Tensor] = []
        super().__init__(*args, **kwargs)

    def _choose(self, logits: torch.Tensor) -> None:
        self.logits.append(logits.clone())
        super()._choose(logits)


@pytest.mark.parametrize("kind", ["gdn2", "transformer"])
def test_the_static_step_with_normed_products_gives_the_logits_of_the_forward(generator, kind):
    """The decoder's step on the normed products (the mixer's norm in its first product, the
    FFN's norm, gate_up and gating in one launch, the final norm in the head's) gives the
    logits the model's forward gives over the prompt and the tokens chosen, to rounding."""
    torch.manual_seed(0)
    config = build_config("tiny", mixer=kind, backend="triton", **{**TINY, "num_layers": 2})
    model = CausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # off their initial ones, so a norm left out would show
                p.add_(0.3 * torch.randn(p.shape, generator=generator))
        prompt = torch.randint(0, 67, (2, 7), generator=generator)
        out = model(prompt, use_cache=True)
        decoder = _KeptLogits(model, out.past_key_values, 4, cuda_graph=False)
        decoder.start(out.logits[:, -1])
        for _ in range(3):
            decoder.step()
        ids = torch.cat([prompt, decoder.generated()[:, :3]], dim=1)
        expected = model(ids).logits[:, 6:]
    x = torch.zeros(2, 1, 32)
    block = model.model.blocks[0]
    with torch.no_grad():
        assert runs_normed(block.ffn_norm, x, block.ffn.gate_up, backend=block.ffn.backend)
        assert runs_normed(model.model.norm, x, model.lm_head)
    torch.testing.assert_close(torch.stack(decoder.logits, 1), expected, rtol=1e-4, atol=1e-4)


def test_the_normed_product_is_taken_only_without_gradients_and_where_its_consumer_runs_triton():
    """normed_linear has no backward: with gradients on, the norm runs as a module; and an FFN
    whose gating is on the torch path keeps it there though its norm would run on Triton."""
    norm, linear = RMSNorm(32, backend="triton"), nn.Linear(32, 8, bias=False)
    x = torch.zeros(2, 1, 32)
    with torch.no_grad():
        assert runs_normed(norm, x, linear) and runs_normed(norm, x, linear, backend="triton")
        assert not runs_normed(norm, x, linear, backend="torch")
    assert not runs_normed(norm, x, linear)
