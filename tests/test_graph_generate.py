"""`CausalLM.generate` on the static-cache decoder (`deltalab.models.graph_generate`): the same
tokens as the token-by-token forward and as transformers' loop, what it serves and what it
leaves to the loop, and the decoders it keeps. On CPU the decoder's step runs eagerly
(`static_decoding=True`); tests/test_cuda.py replays it as a CUDA graph."""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from deltalab.benchmarking import HOST_READS, OperatorCounter
from deltalab.eval.common import greedy_decode
from deltalab.models import MIXER_KINDS, CausalLM, build_config
from deltalab.models.graph_generate import KEPT_DECODERS
from deltalab.models.prefill import prefill
from deltalab.ops._triton import INTERPRET

TINY = dict(hidden_size=32, num_layers=2, num_heads=2, head_dim=16, vocab_size=67, chunk_size=16)


def tiny_model(mixer: str, dtype: torch.dtype = torch.float32, **overrides) -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(build_config("tiny", mixer=mixer, **{**TINY, **overrides})).to(dtype).eval()


def left_padded(generator, lengths: list[int], pad: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of `lengths` tokens, left-padded to the longest: (ids, attention mask)."""
    longest = max(lengths)
    ids = torch.full((len(lengths), longest), pad)
    mask = torch.zeros(len(lengths), longest, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, longest - n :] = torch.randint(0, 67, (n,), generator=generator)
        mask[i, longest - n :] = 1
    return ids, mask


def forward_greedy(model, ids, mask, new_tokens):
    """Greedy decoding by the full forward over the whole sequence at every token (no cache)."""
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(ids, attention_mask=mask).logits[:, -1]
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return ids


def generate(model, ids, mask, **settings):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, **settings)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
@pytest.mark.parametrize("mixer", MIXER_KINDS)
def test_greedy_generate_gives_the_tokens_of_the_token_by_token_forward(generator, mixer, padded):
    model = tiny_model(mixer, torch.float64)
    ids, mask = left_padded(generator, [6, 9, 4] if padded else [9, 9])
    expected = forward_greedy(model, ids, mask, 12)
    settings = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert torch.equal(generate(model, ids, mask, static_decoding=False, **settings), expected)
    assert torch.equal(generate(model, ids, mask, static_decoding=True, **settings), expected)


class SumStop(StoppingCriteria):
    """Finishes a row whose last two tokens sum to `total`: a criterion on the ids alone, as
    stop strings and lm-eval's are."""

    def __init__(self, total: int) -> None:
        self.total = total

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -2:].sum(-1) == self.total


@pytest.mark.parametrize("mixer", ["gdn2", "transformer"])
def test_end_tokens_and_stopping_criteria_stop_rows_as_the_loop_does(generator, mixer):
    model = tiny_model(mixer)
    ids, mask = left_padded(generator, [5, 8, 7])
    free = generate(model, ids, mask, max_new_tokens=40, do_sample=False, eos_token_id=None)
    # An end token row 0 produces early, and a stop on row 1's third and fourth new tokens.
    eos = int(free[0, 8 + 2])
    stop = SumStop(int(free[1, 8 + 2 : 8 + 4].sum()))
    settings = dict(
        max_new_tokens=40, do_sample=False, eos_token_id=[eos, 66], pad_token_id=1,
        stopping_criteria=StoppingCriteriaList([stop]),
    )  # fmt: skip
    expected = generate(model, ids, mask, static_decoding=False, **settings)
    got = generate(model, ids, mask, static_decoding=True, **settings)
    assert (expected[:, 8:] == 1).any(), "a row should finish early"
    assert torch.equal(got, expected)


def test_sampled_generate_is_reproducible_with_a_seed_and_stays_within_top_k(generator):
    model = tiny_model("kdn_diag")
    ids, mask = left_padded(generator, [6, 6])
    settings = dict(
        max_new_tokens=15, do_sample=True, temperature=1.5, top_k=3, static_decoding=True
    )
    torch.manual_seed(7)
    first = generate(model, ids, mask, **settings)
    torch.manual_seed(7)
    again = generate(model, ids, mask, **settings)
    with torch.no_grad():
        logits = model(first[:, :-1]).logits[:, 5:]
    assert torch.equal(first, again)
    assert (logits.topk(3, dim=-1).indices == first[:, 6:, None]).any(-1).all()


def test_a_decoder_is_built_once_per_batch_and_dtype_and_reused(generator):
    model = tiny_model("transformer")
    settings = dict(do_sample=False, static_decoding=True)
    ids, mask = left_padded(generator, [5, 7])
    generate(model, ids, mask, max_new_tokens=6, **settings)
    (first,) = [entry[2] for entry in model._static_decoders.decoders.values()]
    longer, longer_mask = left_padded(generator, [9, 4])
    generate(model, longer, longer_mask, max_new_tokens=3, **settings)
    three, three_mask = left_padded(generator, [5, 6, 7])
    generate(model, three, three_mask, max_new_tokens=6, **settings)
    model.double()
    generate(model, ids, mask, max_new_tokens=6, **settings)
    decoders = {key[:2]: entry[2] for key, entry in model._static_decoders.decoders.items()}
    assert decoders[(2, torch.float32)] is first
    assert set(decoders) == {(2, torch.float32), (3, torch.float32), (2, torch.float64)}


@pytest.mark.parametrize(
    ("settings", "reason"),
    [
        (dict(do_sample=True, top_p=0.9), "TopPLogitsWarper"),
        (dict(do_sample=False, repetition_penalty=1.2), "RepetitionPenaltyLogitsProcessor"),
        (dict(do_sample=False, return_dict_in_generate=True), "return_dict_in_generate"),
    ],
    ids=["top_p", "repetition_penalty", "per_step_outputs"],
)
def test_what_the_decoder_cannot_serve_is_named_or_left_to_the_loop(generator, settings, reason):
    model = tiny_model("gdn2")
    ids, mask = left_padded(generator, [5, 5])
    with pytest.raises(
        ValueError, match=rf"static_decoding=True cannot serve this call: .*{reason}"
    ):
        generate(model, ids, mask, max_new_tokens=4, static_decoding=True, **settings)
    generate(model, ids, mask, max_new_tokens=4, **settings)  # the loop, off CUDA by default
    assert not hasattr(model, "_static_decoders")


def test_a_model_whose_weights_changed_gets_a_new_decoder(generator):
    """The decoder holds copies of the projection weights: a weight updated in place (a
    training step between two calls) must not be decoded with the old copy."""
    model = tiny_model("gdn2")
    ids, mask = left_padded(generator, [6, 6])
    settings = dict(max_new_tokens=8, do_sample=False, eos_token_id=None)
    generate(model, ids, mask, static_decoding=True, **settings)
    (before,) = [entry[2] for entry in model._static_decoders.decoders.values()]
    with torch.no_grad():
        model.model.blocks[0].mixer.q_proj.weight.mul_(-3.0)
    expected = generate(model, ids, mask, static_decoding=False, **settings)
    assert torch.equal(generate(model, ids, mask, static_decoding=True, **settings), expected)
    (after,) = [entry[2] for entry in model._static_decoders.decoders.values()]
    assert after is not before


def host_reads_of_a_token(model: CausalLM, generator) -> int:
    """Values read back to the host while transformers' loop feeds one token to the model."""
    ids = torch.randint(0, 67, (2, 6), generator=generator)
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        with OperatorCounter() as counter:
            model(ids[:, :1], past_key_values=cache, use_cache=True)
    return sum(counter.totals.get(name, [0])[0] for name in HOST_READS)


@pytest.mark.parametrize("mixer", ["gdn2", "kdn_diag"])
def test_the_loops_token_forward_reads_back_once_whatever_the_depth(generator, mixer):
    """The layers' value checks are read back together after the last block (`one_host_read`),
    not once a layer: one read for them, one for the token ids' check."""
    reads = [host_reads_of_a_token(tiny_model(mixer, num_layers=n), generator) for n in (1, 4)]
    assert reads == [2, 2]


def byte_level_tokenizer():
    """A small byte-level BPE tokenizer (the kind stop strings are matched through)."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    raw = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(["def add(a, b):", "return a + b", "class Node: pass"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="</s>")


def test_stop_strings_stop_generation_as_the_loop_does(generator):
    tokenizer = byte_level_tokenizer()
    torch.manual_seed(0)
    config = build_config("tiny", mixer="gdn2", **{**TINY, "vocab_size": len(tokenizer)})
    model = CausalLM(config).eval()
    ids = torch.randint(2, len(tokenizer), (2, 6), generator=generator)
    mask = torch.ones_like(ids)
    free = generate(model, ids, mask, max_new_tokens=30, do_sample=False, eos_token_id=None)

    def printable_token(row: int, start: int) -> str:
        texts = (tokenizer.decode([t]) for t in free[row, 6 + start :].tolist())
        return next(t for t in texts if t.strip() and t.isascii() and t.isprintable())

    stops = [printable_token(0, 3), printable_token(1, 5)]
    settings = dict(
        max_new_tokens=30, do_sample=False, stop_strings=stops, tokenizer=tokenizer,
        pad_token_id=0,
    )  # fmt: skip
    expected = generate(model, ids, mask, static_decoding=False, **settings)
    got = generate(model, ids, mask, static_decoding=True, **settings)
    assert expected.shape[1] < 6 + 30, "the stop strings should end generation early"
    assert torch.equal(got, expected)


def test_a_model_keeps_at_most_its_few_latest_decoders(generator):
    model = tiny_model("gdn2")
    for batch in range(1, 7):
        ids, mask = left_padded(generator, [4] * batch)
        generate(model, ids, mask, max_new_tokens=3, do_sample=False, static_decoding=True)
    kept = [key[0] for key in model._static_decoders.decoders]
    assert kept == list(range(7 - KEPT_DECODERS, 7))


@pytest.mark.interpreter
@pytest.mark.skipif(not INTERPRET, reason="CPU tensors need TRITON_INTERPRET=1 set before import")
@pytest.mark.parametrize(
    ("mixer", "extra"),
    [("kdn_diag", {}), ("transformer", {}), ("gdn2", {"attention_layers": [0]})],
    ids=["kdn_diag", "transformer", "hybrid"],
)
def test_the_static_step_on_triton_kernels_gives_the_tokens_of_the_loop(generator, mixer, extra):
    """The step on the Triton path under the interpreter: the delta-rule layers' fused step
    (`deltalab.layers.decode_step`), attention's one RoPE of q and k. Diagonal KDN's state
    (memory, precision, conv caches) is the widest the fused step carries from token to token;
    every mixer's step against its unfused step is in tests/test_decode_fused.py."""
    torch.manual_seed(0)
    model = CausalLM(build_config("tiny", mixer=mixer, backend="triton", **TINY, **extra)).eval()
    ids, mask = left_padded(generator, [5, 7])
    settings = dict(max_new_tokens=8, do_sample=False, eos_token_id=None)
    expected = generate(model, ids, mask, static_decoding=False, **settings)
    assert torch.equal(generate(model, ids, mask, static_decoding=True, **settings), expected)


@pytest.mark.parametrize("mixer", MIXER_KINDS)
def test_a_prompt_read_in_segments_leaves_the_cache_of_one_forward(generator, mixer):
    model = tiny_model(mixer, torch.float64)
    ids, mask = left_padded(generator, [23, 17])
    whole_cache, whole_last = prefill(model, ids, 64, attention_mask=mask)
    cache, last = prefill(model, ids, 5, attention_mask=mask)
    torch.testing.assert_close(last, whole_last, rtol=1e-10, atol=1e-10)
    assert cache.seen_tokens == whole_cache.seen_tokens == 23
    for got, want in zip(cache.tensors(), whole_cache.tensors(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mixer", ["kdn_diag", "transformer"])
def test_generate_with_a_prompt_longer_than_its_prefill_segment_gives_the_same_tokens(
    generator, mixer
):
    model = tiny_model(mixer, torch.float64)
    ids, mask = left_padded(generator, [19, 11])
    settings = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, static_decoding=True)
    whole = generate(model, ids, mask, **settings)
    assert torch.equal(generate(model, ids, mask, prefill_segment=4, **settings), whole)
    with pytest.raises(ValueError, match="segment_len"):
        generate(model, ids, mask, prefill_segment=0, **settings)


@pytest.mark.parametrize("mixer", ["gdn2", "transformer"])
def test_the_eval_tasks_decode_on_the_static_decoder_with_the_tokens_of_the_token_loop(
    generator, mixer
):
    model = tiny_model(mixer, torch.float64)
    ids, mask = left_padded(generator, [9, 6, 12])

    def stop(row: int, tokens: list[int]) -> bool:  # rows end at different tokens
        return len(tokens) >= 3 + 4 * row or tokens[-1] % 17 == 0

    def decode(static: bool) -> list[list[int]]:
        cache, logits = prefill(model, ids, 4, attention_mask=mask)
        return greedy_decode(model, cache, logits, 20, stop=stop, static=static)

    looped = decode(static=False)
    assert len({len(row) for row in looped}) > 1, "rows should stop at different lengths"
    assert decode(static=True) == looped
    assert decode(static=True) == looped  # again, on the decoder the model kept
