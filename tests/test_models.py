"""Causal LMs over every mixer: cache decoding, generate(), save/load, hybrids, presets."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import deltalab.models  # noqa: F401  (registers the model with transformers' Auto classes)
from deltalab.layers.norms import GatedRMSNorm, RMSNorm
from deltalab.models import MIXER_KINDS, CausalLM, RecurrentCache, build_config, count_parameters
from deltalab.models.presets import SCALES
from deltalab.ops.options import KernelOptions
from deltalab.testing import assert_close

TINY = dict(hidden_size=32, num_layers=2, num_heads=2, head_dim=16, vocab_size=67, chunk_size=16)


def tiny_model(mixer: str, seed: int = 0, **overrides) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(build_config("tiny", mixer=mixer, **{**TINY, **overrides})).eval()


def token_ids(generator, batch, length, vocab=67):
    return torch.randint(0, vocab, (batch, length), generator=generator)


@pytest.mark.parametrize("mixer", MIXER_KINDS)
def test_prefill_then_token_by_token_decoding_equals_full_forward(generator, mixer):
    model = tiny_model(mixer)
    ids = token_ids(generator, 2, 37)
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :20], use_cache=True)
        logits, cache = [out.logits], out.past_key_values
        for t in range(20, 37):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            logits.append(out.logits)
            cache = out.past_key_values
    assert_close(torch.cat(logits, dim=1), full, 1e-5, mixer)


@pytest.mark.parametrize("mixer", ["gdn2", "kdn_diag", "muir", "transformer"])
def test_greedy_generate_equals_argmax_of_full_forwards(generator, mixer):
    model = tiny_model(mixer)
    prompt = token_ids(generator, 1, 9)
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None)
        ids = prompt
        for _ in range(12):
            next_id = model(ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_id], dim=1)
    assert torch.equal(generated, ids)


@pytest.mark.parametrize("mixer", ["gdn", "kdn_iso", "muir", "transformer"])
def test_left_padded_batch_generates_as_one_by_one(generator, mixer):
    model = tiny_model(mixer, attention_every=2) if mixer == "gdn" else tiny_model(mixer)
    prompts = [token_ids(generator, 1, n) for n in (5, 11, 8)]
    longest = max(p.shape[1] for p in prompts)
    pad = 3  # any id: the attention mask, not the id, marks padding
    batch = torch.full((3, longest), pad)
    attention = torch.zeros(3, longest, dtype=torch.long)
    for i, p in enumerate(prompts):
        batch[i, longest - p.shape[1] :] = p[0]
        attention[i, longest - p.shape[1] :] = 1
    settings = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=pad)
    with torch.no_grad():
        together = model.generate(batch, attention_mask=attention, **settings)
        for i, p in enumerate(prompts):
            alone = model.generate(p, attention_mask=torch.ones_like(p), **settings)
            assert torch.equal(together[i, longest:], alone[0, p.shape[1] :]), f"prompt {i}"


@pytest.mark.parametrize("mixer", MIXER_KINDS)
def test_save_pretrained_round_trip_gives_identical_logits(tmp_path, generator, mixer):
    model = tiny_model(mixer)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, CausalLM)
    ids = token_ids(generator, 2, 23)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


@pytest.mark.parametrize("mixer", MIXER_KINDS)
def test_from_pretrained_keeps_every_loaded_weight(tmp_path, mixer):
    # An untied head, so that the LM head is a weight of its own that loading must not draw again.
    model = tiny_model(mixer, tie_word_embeddings=False)
    model.save_pretrained(tmp_path)
    loaded = CausalLM.from_pretrained(tmp_path).state_dict()
    saved = model.state_dict()
    assert loaded.keys() == saved.keys()
    assert not [key for key in saved if not torch.equal(loaded[key], saved[key])]


def initialized_model(mixer: str, hidden_size: int) -> CausalLM:
    """A seeded 2-block model of tiny's sizes at `hidden_size`, its LM head untied (drawn)."""
    torch.manual_seed(0)
    config = build_config(
        "tiny", mixer=mixer, hidden_size=hidden_size, num_layers=2, tie_word_embeddings=False
    )
    return CausalLM(config)


# Tiny's width and a wider one: PyTorch's default init of a linear map has std 1/sqrt(3 fan_in),
# 0.051 and 0.036 for the FFN's input map at these widths, 0.029 and 0.022 for its output map.
@pytest.mark.parametrize("hidden_size", [128, 256])
@pytest.mark.parametrize("mixer", MIXER_KINDS)
def test_embedding_ffn_and_lm_head_start_at_the_initializer_range_and_norms_at_one(
    mixer, hidden_size
):
    model = initialized_model(mixer, hidden_size)
    std = model.config.initializer_range
    drawn = {
        name: p
        for name, p in model.named_parameters()
        if name in ("model.embed.weight", "lm_head.weight") or ".ffn." in name
    }
    assert len(drawn) == 2 + 2 * model.config.num_layers
    moments = {
        name: (float(p.detach().mean()), float(p.detach().std())) for name, p in drawn.items()
    }
    off = {
        name: (round(mean, 4), round(sd, 4))
        for name, (mean, sd) in moments.items()
        if not (abs(mean) < 0.05 * std and abs(sd / std - 1) < 0.05)
    }
    assert not off, f"(mean, std) not (0, {std}): {off}"
    norms = [m.weight for m in model.modules() if isinstance(m, (RMSNorm, GatedRMSNorm))]
    assert len(norms) >= 2 * model.config.num_layers + 1
    assert all(torch.equal(w, torch.ones_like(w)) for w in norms)


@pytest.mark.parametrize("hidden_size", [128, 256])
@pytest.mark.parametrize("mixer", MIXER_KINDS)
def test_mixer_maps_keep_their_own_initialization(mixer, hidden_size):
    # Every linear map and short convolution of a mixer keeps PyTorch's default init, uniform in
    # +-1/sqrt(fan_in) (std 1/sqrt(3 fan_in), checked where 256 draws or more give it to a few
    # percent), unless its constructor zeroes it: the model's init draws none of them again.
    model = initialized_model(mixer, hidden_size)
    off = {}
    for i, block in enumerate(model.model.blocks):
        for name, p in block.mixer.named_parameters():
            if not name.endswith("weight") or p.dim() < 2 or not p.any():
                continue
            bound = p[0].numel() ** -0.5
            std = float(p.detach().std())
            if p.abs().max() > bound or (p.numel() >= 256 and abs(std * 3**0.5 / bound - 1) > 0.1):
                off[f"{i}.{name}"] = (round(std, 4), round(bound / 3**0.5, 4))
    assert not off, f"(std, PyTorch default): {off}"


def test_saved_weights_follow_the_umask_like_every_other_file(tmp_path):
    previous = os.umask(0o027)
    try:
        tiny_model("gdn2").save_pretrained(tmp_path)
    finally:
        os.umask(previous)
    modes = {path.name: path.stat().st_mode & 0o777 for path in tmp_path.iterdir()}
    assert modes["model.safetensors"] == 0o640 == modes["config.json"], modes


def test_checkpoint_whose_config_does_not_match_the_weights_is_refused(tmp_path):
    tiny_model("gdn2").save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    config.mixer = "kda"
    with pytest.raises(ValueError, match=r"do not match|missing|unexpected"):
        CausalLM.from_pretrained(tmp_path, config=config)


@pytest.mark.parametrize(
    ("layout", "expected"),
    [(dict(attention_layers=[0, 3]), [0, 3]), (dict(attention_every=2), [1, 3])],
)
def test_hybrid_layout_puts_attention_exactly_at_the_requested_layers(layout, expected):
    model = tiny_model("muir", num_layers=4, attention_window=8, **layout)
    kinds = [type(block.mixer).__name__ for block in model.model.blocks]
    assert [i for i, k in enumerate(kinds) if k == "Attention"] == expected
    assert all(k == "Muir" for i, k in enumerate(kinds) if i not in expected)
    assert all(model.model.blocks[i].mixer.window == 8 for i in expected)


@pytest.mark.parametrize("mixer", ["gdn2", "kdn_diag"])
def test_recurrent_cache_memory_is_constant_in_the_number_of_tokens(generator, mixer):
    model = tiny_model(mixer)
    sizes = {}
    with torch.no_grad():
        out = model(token_ids(generator, 1, 5), use_cache=True)
        cache = out.past_key_values
        for step in range(1, 1025):
            next_id = out.logits[:, -1:].argmax(-1)
            out = model(next_id, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            if step in (16, 1024):
                sizes[step] = cache.nbytes()
    assert isinstance(cache, RecurrentCache)
    assert sizes[16] == sizes[1024] > 0


def test_sliding_window_attention_cache_is_bounded_by_the_window(generator):
    model = tiny_model("transformer", attention_window=6)
    with torch.no_grad():
        out = model(token_ids(generator, 1, 20), use_cache=True)
    assert all(state.key.shape[1] == 5 for state in out.past_key_values.states)


def test_loss_is_next_token_cross_entropy(generator):
    model = tiny_model("gdn")
    ids = token_ids(generator, 2, 15)
    out = model(ids, labels=ids)
    expected = torch.nn.functional.cross_entropy(
        out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()
    )
    assert_close(out.loss, expected, 1e-6)
    # Labels of -100 (padding) are left out of the mean, wherever they are.
    labels = ids.clone()
    labels[0, 3:7] = -100
    labels[1, -1] = -100
    kept = labels[:, 1:].flatten() != -100
    per_token = torch.nn.functional.cross_entropy(
        out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none"
    )
    assert_close(model(ids, labels=labels).loss, per_token[kept].mean(), 1e-6)


def test_unknown_mixer_and_preset_and_field_are_named():
    with pytest.raises(ValueError, match=r"mixer must be one of .*got 'gdn3' \(did you mean 'gdn"):
        build_config("tiny", mixer="gdn3")
    with pytest.raises(ValueError, match=r"preset must be one of .*'34OM'"):
        build_config("34OM")
    with pytest.raises(
        ValueError, match=r"unknown config field 'num_layer'.*did you mean 'num_layers'"
    ):
        build_config("tiny", num_layer=3)
    with pytest.raises(ValueError, match=r"attention_layers holds 7, outside the layers 0..5"):
        build_config("tiny", attention_layers=[1, 7])


@pytest.mark.parametrize("base", [0.5, 1.0])
def test_rope_base_the_attention_layer_refuses_is_refused_by_the_config(base):
    """The config checks rope_base as the Attention layer does (> 1), so a bad base fails when
    the config is made, not when a hybrid model is built from it."""
    with pytest.raises(ValueError, match=r"rope_base must be > 1"):
        build_config("tiny", rope_base=base)


def test_input_ids_outside_the_vocabulary_are_refused():
    model = tiny_model("gdn")
    with pytest.raises(
        ValueError, match=r"input_ids must lie in \[0, 66\].*got values in \[0, 67\]"
    ):
        model(torch.tensor([[0, 67]]))


def test_embedding_accessors_reach_the_token_table_and_the_tied_head():
    model = tiny_model("gdn")
    assert model.get_input_embeddings() is model.model.embed
    assert model.model.get_input_embeddings() is model.model.embed
    assert model.get_output_embeddings() is model.lm_head
    assert model.lm_head.weight is model.model.embed.weight
    table = torch.nn.Embedding(67, TINY["hidden_size"])
    model.set_input_embeddings(table)
    assert model.model.embed is table
    head = torch.nn.Linear(TINY["hidden_size"], 67, bias=False)
    model.set_output_embeddings(head)
    assert model.lm_head is head


@pytest.mark.parametrize("mixer", MIXER_KINDS)
@pytest.mark.parametrize("scale", list(SCALES))
def test_preset_parameter_count_matches_its_name(scale, mixer):
    count = count_parameters(build_config(scale, mixer=mixer))
    target = SCALES[scale].target
    assert abs(count - target) / target < 0.05, f"{scale} {mixer}: {count / 1e6:.1f}M"


def test_tiny_presets_are_cpu_sized():
    for mixer in MIXER_KINDS:
        total = count_parameters(build_config("tiny", mixer=mixer), embeddings=True)
        assert 1e6 <= total <= 5e6, f"{mixer}: {total}"


def test_gdn2_1p3b_preset_is_the_published_shape():
    config = build_config("1.3B", mixer="gdn2")
    shape = (config.num_layers, config.hidden_size, config.num_heads, config.head_dim)
    assert shape == (18, 2304, 16, 128) and config.ffn_width == 6208 and config.vocab_size == 32000
    kdn = build_config("1.3B", mixer="kdn_diag")
    assert (kdn.num_heads, kdn.head_dim) == (18, 128)


def test_muir_preset_matches_gdn2_parameter_count():
    for scale in ("tiny", *SCALES):
        muir = count_parameters(build_config(scale, mixer="muir"))
        gdn2 = count_parameters(build_config(scale, mixer="gdn2"))
        assert abs(muir - gdn2) / gdn2 < 0.005, scale


def test_generate_command_continues_a_prompt_from_a_checkpoint(tmp_path, capsys):
    from deltalab.cli import main
    from deltalab.data import ByteTokenizer

    torch.manual_seed(0)
    model = CausalLM(build_config("tiny", mixer="kdn_iso")).eval()
    model.save_pretrained(tmp_path)
    assert main(["generate", str(tmp_path), "def f(", "--max-new-tokens", "7"]) == 0
    printed = capsys.readouterr().out
    tokenizer = ByteTokenizer()
    prompt = torch.tensor([tokenizer.encode("def f(")])
    with torch.no_grad():
        expected = model.generate(
            prompt,
            max_new_tokens=7,
            do_sample=False,
            eos_token_id=tokenizer.eos_id,
            pad_token_id=tokenizer.pad_id,
        )
    assert printed == "def f(" + tokenizer.decode(expected[0, prompt.shape[1] :].tolist()) + "\n"


def test_text_generation_pipeline_runs_on_a_model_directory_with_the_byte_tokenizer(tmp_path):
    from transformers import AutoTokenizer, pipeline

    from deltalab.data import ByteTokenizer, save_tokenizer

    torch.manual_seed(0)
    model = CausalLM(build_config("tiny", mixer="muir", num_layers=1)).eval()
    model.save_pretrained(tmp_path)
    tokenizer = ByteTokenizer()
    save_tokenizer(tokenizer, tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.encode("é", add_special_tokens=False) == [195, 169]
    prompt = "Grüße: def f("
    generator = pipeline("text-generation", model=str(tmp_path), device="cpu")
    text = generator(prompt, max_new_tokens=9, do_sample=False)[0]["generated_text"]
    ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=9, do_sample=False)
    assert text == prompt + tokenizer.decode(expected[0, ids.shape[1] :].tolist())


def test_generate_command_refuses_a_folder_without_a_checkpoint(tmp_path):
    from deltalab.generate import GenerateConfig, generate_text

    with pytest.raises(ValueError, match=r"holds no config.json"):
        generate_text(GenerateConfig(checkpoint=str(tmp_path), prompt="x"))


def test_muir_ranks_given_as_configuration_round_trip(tmp_path, generator):
    from deltalab.layers import MuirRanks

    ranks = dict(decay=8, erase=2, write=4, read=3, outgate=8)
    as_mapping = tiny_model("muir", mixer_options={"ranks": ranks})
    as_object = tiny_model("muir", mixer_options={"ranks": MuirRanks(**ranks)})
    assert as_object.config.mixer_options == as_mapping.config.mixer_options
    as_object.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = token_ids(generator, 1, 19)
    with torch.no_grad():
        assert torch.equal(as_object(ids).logits, loaded(ids).logits)
    with pytest.raises(ValueError, match=r"ranks has unknown gates \['erasure'\]"):
        tiny_model("muir", mixer_options={"ranks": {"erasure": 2}})


def test_sampled_generation_is_reproducible_with_a_seed_and_respects_top_k(generator):
    model = tiny_model("muir")
    prompt = token_ids(generator, 2, 6)
    settings = dict(max_new_tokens=15, do_sample=True, temperature=1.5, top_k=3, eos_token_id=None)
    with torch.no_grad():
        torch.manual_seed(7)
        first = model.generate(prompt, attention_mask=torch.ones_like(prompt), **settings)
        torch.manual_seed(7)
        again = model.generate(prompt, attention_mask=torch.ones_like(prompt), **settings)
        greedy = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=15,
            do_sample=False,
            eos_token_id=None,
        )
        # Every sampled token is among the 3 most likely given what came before it.
        logits = model(first[:, :-1]).logits[:, prompt.shape[1] - 1 :]
        top3 = logits.topk(3, dim=-1).indices
    assert torch.equal(first, again)
    assert not torch.equal(first, greedy)
    assert (top3 == first[:, prompt.shape[1] :, None]).any(-1).all()


def test_config_backend_reaches_every_recurrent_mixer_and_round_trips(tmp_path):
    model = CausalLM(build_config("tiny", mixer="kdn_diag", attention_every=2, backend="chunk"))
    backends = {m.backend for m in model.modules() if getattr(m, "backend", None) is not None}
    # The block norms take the norms' name of the PyTorch path (deltalab.ops.norms.layer_backend);
    # the mixers' output norms have none of their own (None: their mixer's).
    assert backends == {"chunk", "torch"}
    assert {m.backend for m in model.modules() if isinstance(m, GatedRMSNorm)} == {None}
    assert {m.backend for m in model.modules() if isinstance(m, RMSNorm)} == {"torch"}
    model.save_pretrained(tmp_path)
    assert CausalLM.from_pretrained(tmp_path).config.backend == "chunk"


def test_config_kernel_options_reach_every_recurrent_mixer_and_round_trip(tmp_path):
    """kernel_options, a mapping in the config (config.json), reach every recurrent layer as a
    KernelOptions (the fields left out at their defaults) and come back from a saved model."""
    from deltalab.layers.delta_mixer import DeltaMixer

    given = {"walk_dots": "float32", "recompute_states": False}
    config = build_config("tiny", mixer="gdn2", attention_every=2, kernel_options=given)
    model = CausalLM(config)
    mixers = [m for m in model.modules() if isinstance(m, DeltaMixer)]
    assert mixers and {m.kernel_options for m in mixers} == {KernelOptions(**given)}
    model.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert loaded.kernel_options == given
    assert build_config("tiny", mixer="gdn2").kernel_options == {}


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [({"walk_dot": "float32"}, ValueError, r"kernel_options: unknown .*\['walk_dot'\]"),
     ({"state_pass": "fast"}, ValueError, r"kernel_options: state_pass must be one of"),
     ({"checkpoint_every": 0}, ValueError, r"kernel_options: checkpoint_every must be"),
     ("fused", TypeError, r"kernel_options must be a dict")],
)  # fmt: skip
def test_config_kernel_options_are_validated_naming_the_key(options, error, match):
    with pytest.raises(error, match=match):
        build_config("tiny", mixer="gdn2", kernel_options=options)


def test_config_backend_is_validated_naming_the_field():
    with pytest.raises(ValueError, match="backend must be one of"):
        build_config("tiny", mixer="gdn2", backend="cuda")


def test_a_model_saved_with_the_triton_backend_generates_on_the_cpu(tmp_path):
    from deltalab.generate import GenerateConfig, generate_text

    torch.manual_seed(0)
    CausalLM(build_config("tiny", mixer="gdn", backend="triton")).save_pretrained(tmp_path)
    text = generate_text(GenerateConfig(str(tmp_path), "def f(", max_new_tokens=5))
    assert isinstance(text, str)


@pytest.mark.parametrize("mixer", ["kdn_iso", "kdn_diag"])
def test_config_backend_also_picks_the_kdn_variance_scan(monkeypatch, mixer):
    import deltalab.ops.kdn.gains as gains

    seen = []
    scan = gains._variance_scan

    def spy(decay2, q_noise, evidence, p_prior, scan_name):
        seen.append(scan_name)
        return scan(decay2, q_noise, evidence, p_prior, scan_name)

    monkeypatch.setattr(gains, "_variance_scan", spy)
    model = CausalLM(build_config("tiny", mixer=mixer, num_layers=1, backend="naive"))
    model(torch.randint(0, 256, (1, 20)))
    assert seen and all(backend == "sequential" for backend in seen)


def test_mixer_option_names_leave_out_what_a_kdn_variant_refuses():
    from deltalab.models.mixers import mixer_option_names

    assert "noise_rank" not in mixer_option_names("kdn_iso")
    assert "info_scale" not in mixer_option_names("kdn_exact")
    assert {"noise_rank", "info_scale"} <= set(mixer_option_names("kdn_diag"))


def test_config_kernel_options_save_the_same_given_as_object_or_mapping(tmp_path):
    """A KernelOptions object and a mapping of the same choices store the same config.json
    entry: only the fields that differ from `KernelOptions()`."""
    saved = {}
    for spelling, given in [
        ("object", KernelOptions(walk_dots="float32")),
        ("mapping", {"walk_dots": "float32", "checkpoint_every": 8}),
    ]:
        build_config("tiny", mixer="gdn2", kernel_options=given).save_pretrained(
            tmp_path / spelling
        )
        saved[spelling] = json.loads((tmp_path / spelling / "config.json").read_text())
    assert saved["object"]["kernel_options"] == {"walk_dots": "float32"}
    assert saved["mapping"]["kernel_options"] == saved["object"]["kernel_options"]
