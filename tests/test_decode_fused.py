"""The static decoder's fused layer step (`deltalab.layers.decode_step`, one Triton kernel for a
layer's recurrent work) against its PyTorch twin, the mixer's own one-token forward, for every
mixer it serves, and its normed products (`deltalab.ops.normed_linear`: a block's norm in the
product after it) against the model's forward, under the Triton interpreter."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deltalab.benchmarking import HOST_READS, OperatorCounter
from deltalab.layers.common import RMSNorm
from deltalab.layers.decode_step import fused_step, runs_fused, runs_normed, step_plan
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
@pytest.mark.parametrize("block_v", [None, 16], ids=["one_block", "blocks_of_16"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
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
    for f in dataclasses.fields(after):
        value = getattr(after, f.name)
        if f.name != "gates" and isinstance(value, torch.Tensor):
            torch.testing.assert_close(getattr(buffers, f.name), value, rtol=1e-4, atol=1e-5)


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
    assert runs_normed(block.ffn_norm, x, block.ffn.gate_up)
    assert runs_normed(model.model.norm, x, model.lm_head)
    torch.testing.assert_close(torch.stack(decoder.logits, 1), expected, rtol=1e-4, atol=1e-4)
