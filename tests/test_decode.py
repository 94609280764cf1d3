"""Static-cache decoding (`deltalab.models.static_decode`) against `model.generate`, and the
decoding step's dispatch. On CPU the static step runs eagerly; tests/test_cuda.py replays it
as a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from deltalab.benchmarking import HOST_READS, OperatorCounter
from deltalab.layers.projections import concatenated_weights
from deltalab.models import MIXER_KINDS, CausalLM, build_config
from deltalab.models.static_decode import StaticDecoder, static_generate
from deltalab.ops import delta_rule_step
from deltalab.ops._triton import INTERPRET

TINY = dict(hidden_size=32, num_layers=2, num_heads=2, head_dim=16, vocab_size=67, chunk_size=16)


def tiny_model(mixer: str, seed: int = 0, **overrides) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(build_config("tiny", mixer=mixer, **{**TINY, **overrides})).eval()


def token_ids(generator, batch, length, vocab=67):
    return torch.randint(0, vocab, (batch, length), generator=generator)


def eager_generate(model, prompt, attention_mask=None, **settings):
    mask = torch.ones_like(prompt) if attention_mask is None else attention_mask
    with torch.no_grad():
        return model.generate(prompt, attention_mask=mask, do_sample=False, **settings)


@pytest.mark.parametrize("mixer", MIXER_KINDS)
def test_static_greedy_decoding_gives_the_tokens_of_generate(generator, mixer):
    model = tiny_model(mixer)
    prompt = token_ids(generator, 2, 9)
    expected = eager_generate(model, prompt, max_new_tokens=16, eos_token_id=None)
    got = static_generate(model, prompt, max_new_tokens=16, cuda_graph=False)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["float64", "bfloat16"])
def test_static_decoding_chooses_from_logits_widened_to_float32_never_narrowed(
    generator, monkeypatch, dtype
):
    """A float64 model's tokens are chosen from float64 logits, as `generate` keeps them; a
    bf16 model's from float32 ones."""
    seen = []
    choose = StaticDecoder._choose

    def spy(self, logits):
        seen.append(logits.dtype)
        return choose(self, logits)

    monkeypatch.setattr(StaticDecoder, "_choose", spy)
    model = tiny_model("gdn2").to(dtype)
    static_generate(model, token_ids(generator, 2, 5), max_new_tokens=3, cuda_graph=False)
    assert seen == [torch.promote_types(dtype, torch.float32)] * 3


@pytest.mark.parametrize(
    ("mixer", "overrides"),
    [
        ("gdn", dict(attention_every=2)),
        ("kdn_iso", {}),
        ("transformer", dict(attention_window=5)),
    ],
    ids=["gdn_hybrid", "kdn_iso", "transformer_window"],
)
def test_left_padded_batch_with_an_end_token_stops_as_generate(generator, mixer, overrides):
    model = tiny_model(mixer, **overrides)
    prompts = [token_ids(generator, 1, n) for n in (5, 11, 8)]
    longest = max(p.shape[1] for p in prompts)
    pad = 3
    batch = torch.full((3, longest), pad)
    attention = torch.zeros(3, longest, dtype=torch.long)
    for i, p in enumerate(prompts):
        batch[i, longest - p.shape[1] :] = p[0]
        attention[i, longest - p.shape[1] :] = 1
    free = eager_generate(model, batch, attention, max_new_tokens=12, eos_token_id=None)
    # An end token that some row produces early: that row is padded from then on, and
    # generation stops once every row has produced it (or at max_new_tokens).
    eos = int(free[0, longest + 2])
    settings = dict(max_new_tokens=12, eos_token_id=eos, pad_token_id=pad)
    expected = eager_generate(model, batch, attention, **settings)
    got = static_generate(model, batch, attention_mask=attention, cuda_graph=False, **settings)
    assert (expected[:, longest:] == pad).any(), "the end token should finish a row early"
    assert torch.equal(got, expected)


def test_every_row_finishing_stops_generation_early(generator):
    model = tiny_model("gdn2")
    prompt = token_ids(generator, 1, 7)
    free = eager_generate(model, prompt, max_new_tokens=40, eos_token_id=None)
    eos = int(free[0, 7 + 4])
    expected = eager_generate(model, prompt, max_new_tokens=40, eos_token_id=eos, pad_token_id=0)
    got = static_generate(model, prompt, max_new_tokens=40, eos_token_id=eos, pad_token_id=0)
    assert got.shape[1] < 7 + 40
    assert torch.equal(got, expected)


def test_sampling_is_reproducible_with_a_seed_and_stays_within_top_k(generator):
    model = tiny_model("muir")
    prompt = token_ids(generator, 2, 6)
    settings = dict(max_new_tokens=15, temperature=1.5, top_k=3, cuda_graph=False)
    torch.manual_seed(7)
    first = static_generate(model, prompt, **settings)
    torch.manual_seed(7)
    again = static_generate(model, prompt, **settings)
    greedy = static_generate(model, prompt, max_new_tokens=15, cuda_graph=False)
    with torch.no_grad():
        logits = model(first[:, :-1]).logits[:, prompt.shape[1] - 1 :]
    top3 = logits.topk(3, dim=-1).indices
    assert torch.equal(first, again)
    assert not torch.equal(first, greedy)
    assert (top3 == first[:, prompt.shape[1] :, None]).any(-1).all()


def test_decoder_refuses_more_tokens_than_it_was_built_for(generator):
    model = tiny_model("gdn2")
    with torch.no_grad():
        out = model(token_ids(generator, 1, 4), use_cache=True)
    decoder = StaticDecoder(model, out.past_key_values, 3, cuda_graph=False)
    decoder.start(out.logits[:, -1])
    decoder.step()
    decoder.step()
    with pytest.raises(RuntimeError, match=r"built for 3 new tokens"):
        decoder.step()
    decoder.load(out.past_key_values)
    decoder.start(out.logits[:, -1])
    assert decoder.generated().shape == (1, 1)


def test_cuda_graph_without_a_gpu_is_refused_naming_the_argument(generator):
    model = tiny_model("gdn2")
    with torch.no_grad():
        out = model(token_ids(generator, 1, 4), use_cache=True)
    with pytest.raises(ValueError, match=r"cuda_graph=True needs the model on a CUDA device"):
        StaticDecoder(model, out.past_key_values, 3, cuda_graph=True)


def test_static_decoding_leaves_the_prefill_cache_unchanged(generator):
    model = tiny_model("kdn_diag")
    with torch.no_grad():
        out = model(token_ids(generator, 2, 5), use_cache=True)
    before = [t.clone() for t in out.past_key_values.tensors()]
    decoder = StaticDecoder(model, out.past_key_values, 4, cuda_graph=False)
    decoder.start(out.logits[:, -1])
    for _ in range(3):
        decoder.step()
    after = out.past_key_values.tensors()
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


@pytest.mark.parametrize("channel_decay", [False, True], ids=["head_decay", "channel_decay"])
def test_step_in_place_overwrites_the_state_with_the_new_one(generator, channel_decay):
    k = torch.nn.functional.normalize(torch.randn(2, 3, 8, generator=generator), dim=-1)
    g = -torch.rand(2, 3, 8, generator=generator) if channel_decay else -torch.rand(2, 3)
    args = (torch.randn(2, 3, 8, generator=generator), 0.5 * k, k)
    u = torch.randn(2, 3, 5, generator=generator)
    state = torch.randn(2, 3, 8, 5, generator=generator)
    o_new, s_new = delta_rule_step(*args, u, g, state, backend="naive")
    buffer = state.clone()
    o, s = delta_rule_step(*args, u, g, buffer, backend="naive", in_place=True)
    assert s is buffer
    assert torch.equal(o, o_new) and torch.equal(buffer, s_new)
    with pytest.raises(ValueError, match=r"in_place=True needs state in torch.float32"):
        delta_rule_step(*args, u, g, state.bfloat16(), in_place=True)


@pytest.mark.skipif(INTERPRET, reason="under TRITON_INTERPRET=1 Triton runs on CPU tensors")
def test_triton_step_on_cpu_is_refused_naming_the_backend(generator):
    k = torch.nn.functional.normalize(torch.randn(1, 2, 8, generator=generator), dim=-1)
    args = (torch.randn(1, 2, 8), k, k, torch.randn(1, 2, 4), -torch.rand(1, 2))
    with pytest.raises(RuntimeError, match=r'backend="triton" cannot run here'):
        delta_rule_step(*args, torch.zeros(1, 2, 8, 4), backend="triton")
    with pytest.raises(ValueError, match=r"backend must be one of"):
        delta_rule_step(*args, torch.zeros(1, 2, 8, 4), backend="chunk")


def counted_step(model: CausalLM, generator) -> dict[str, list[float]]:
    """The ATen operators one static decoding step dispatches (`OperatorCounter`), after a
    prompt and two steps."""
    with torch.no_grad():
        out = model(token_ids(generator, 2, 7, model.config.vocab_size), use_cache=True)
    decoder = StaticDecoder(model, out.past_key_values, 4, cuda_graph=False)
    decoder.start(out.logits[:, -1])
    decoder.step()
    with OperatorCounter() as counter:
        decoder.step()
    return counter.totals


# What a decoding step of one layer dispatches at most on the unfused path (CPU, `OperatorCounter`):
# block norms, mixer and FFN. Before the step skipped its value checks and made one product of
# its projections, one short convolution of q, k and v, one norm of q and k, one RoPE of
# attention's q and k: Transformer 63, DeltaNet 69, GDN 74, KDA 76, GDN-2 79, Isotropic KDN
# 145, Diagonal KDN 144, exact KDN 101, Muir 88, KDN-Muir 152; before the FFN's residual sum
# went into its down projection's product, one more each (two for attention's output
# projection, likewise). Where Triton runs, the delta-rule
# layers take the fused step instead (tests/test_decode_fused.py holds its counts).
STEP_OPERATORS_PER_LAYER = {
    "transformer": 45,
    "deltanet": 53,
    "gdn": 57,
    "kda": 60,
    "gdn2": 62,
    "kdn_iso": 107,
    "kdn_diag": 107,
    "kdn_exact": 86,
    "muir": 73,
    "kdn_muir": 116,
}


@pytest.mark.parametrize("mixer", MIXER_KINDS)
def test_a_decoding_step_dispatches_at_most_its_operator_count_per_layer(generator, mixer):
    """The count of a two-layer model's step less a one-layer model's: one layer's operators,
    the embedding, head and token choice cancelled."""
    counts = [
        sum(n for n, _ in counted_step(tiny_model(mixer, num_layers=layers), generator).values())
        for layers in (1, 2)
    ]
    assert counts[1] - counts[0] <= STEP_OPERATORS_PER_LAYER[mixer]


@pytest.mark.parametrize("mixer", MIXER_KINDS)
def test_a_decoding_step_reads_nothing_back_to_the_host(generator, mixer):
    model = tiny_model(mixer, **(dict(attention_every=2) if mixer == "gdn" else {}))
    assert not HOST_READS & set(counted_step(model, generator))


@pytest.mark.parametrize("mixer", MIXER_KINDS)
def test_a_step_on_concatenated_projection_weights_equals_the_step_on_each(generator, mixer):
    """One product over a layer's projection weights concatenated (`concatenated_weights`, as
    the static decoder's step runs) gives the outputs and state of the maps one by one, to
    rounding; a weight changed in place is concatenated again."""
    model = tiny_model(mixer)
    mixer_layer = model.model.blocks[0].mixer
    with torch.no_grad():
        prompt = model.model.embed(token_ids(generator, 2, 5))
        _, state = mixer_layer(prompt)
        x = torch.randn(2, 1, 32, generator=generator)
        store: dict = {}
        for _ in range(2):
            expected = mixer_layer(x, state)
            with concatenated_weights(store):
                got = mixer_layer(x, state)
            assert store, "the step should have concatenated its projections"
            for a, b in zip(_tensors(got), _tensors(expected), strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            next(mixer_layer.parameters()).mul_(1.5)  # the second round: changed weights


def _tensors(output) -> list[torch.Tensor]:
    y, state = output
    return [y, *(getattr(state, f) for f in ("memory", "key", "value") if hasattr(state, f))]
