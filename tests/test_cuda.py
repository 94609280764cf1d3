"""GPU counterparts of the CPU tests: the same ops on CUDA against float64 references on CPU.

Skipped where no GPU is present (CI); everything checked here has a CPU test beside it.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import assert_same_recurrent_state, built_and_default_adamw_steps, random_delta_inputs

from deltalab.layers.norms import RMSNorm
from deltalab.models import MIXER_KINDS, CausalLM, build_config
from deltalab.models.static_decode import StaticDecoder, static_generate
from deltalab.ops import delta_rule, kdn_diag, kdn_iso
from deltalab.ops.row_linear import MAX_TRITON_ROWS
from deltalab.testing import TOLERANCE, relative_error
from deltalab.train import train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("channel_decay", [False, True], ids=["head_decay", "channel_decay"])
@pytest.mark.parametrize("chunk_size", [16, 64, 256])
@pytest.mark.parametrize("length", [1, 100, 257])
def test_cuda_chunk_float64_matches_cpu_naive(generator, length, chunk_size, channel_decay):
    inputs = random_delta_inputs(generator, 2, length, 3, 16, 8, channel_decay=channel_decay)
    o_ref, s_ref = delta_rule(*inputs, backend="naive", output_final_state=True)
    o, s = delta_rule(*(x.cuda() for x in inputs), chunk_size=chunk_size, output_final_state=True)
    assert relative_error(o.cpu(), o_ref) < TOLERANCE[torch.float64]
    assert relative_error(s.cpu(), s_ref) < TOLERANCE[torch.float64]


@pytest.mark.parametrize("channel_decay", [False, True], ids=["head_decay", "channel_decay"])
def test_cuda_float32_chunk_256_is_stable_under_strong_decay(generator, channel_decay):
    inputs = random_delta_inputs(
        generator, 1, 1024, 4, 64, 64, channel_decay=channel_decay, min_log_decay=-20.0
    )
    o_ref, _ = delta_rule(*inputs, backend="naive")
    o, _ = delta_rule(*(x.float().cuda() for x in inputs), chunk_size=256)
    assert torch.isfinite(o).all()
    assert relative_error(o.cpu(), o_ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("op", [kdn_iso, kdn_diag])
def test_cuda_kdn_matches_cpu(generator, op):
    B, T, H, K, V = 2, 130, 2, 16, 8
    q = torch.randn(B, T, H, K, generator=generator, dtype=torch.float64)
    k = torch.nn.functional.normalize(
        torch.randn(B, T, H, K, generator=generator, dtype=torch.float64), dim=-1
    )
    v = torch.randn(B, T, H, V, generator=generator, dtype=torch.float64)
    g = -torch.rand(B, T, H, K, generator=generator, dtype=torch.float64)
    noise_shape = (B, T, H) if op is kdn_iso else (B, T, H, K)
    q_noise = torch.rand(*noise_shape, generator=generator, dtype=torch.float64) * 0.1
    r = torch.rand(B, T, H, generator=generator, dtype=torch.float64) + 0.1
    p0 = torch.ones(H) if op is kdn_iso else torch.ones(H, K)
    args = (q, k, v, g, q_noise, r, p0.double())
    o_ref, _ = op(*args, backend="naive")
    o, _ = op(*(x.cuda() for x in args))
    assert relative_error(o.cpu(), o_ref) < TOLERANCE[torch.float64]


@pytest.mark.parametrize("mixer", ["gdn2", "muir", "kdn_diag", "kdn_muir", "transformer"])
def test_cuda_model_decoding_equals_full_forward(generator, mixer):
    torch.manual_seed(0)
    config = build_config("tiny", mixer=mixer, chunk_size=16)
    model = CausalLM(config).cuda().eval()
    ids = torch.randint(0, config.vocab_size, (2, 40), generator=generator).cuda()
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :25], use_cache=True)
        logits, cache = [out.logits], out.past_key_values
        for t in range(25, 40):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            logits.append(out.logits)
    assert relative_error(torch.cat(logits, dim=1), full) < 1e-5


GRAPH_MIXERS = [
    ("gdn2", {}),
    ("muir", {}),
    ("kdn_diag", {}),
    ("kdn_iso", {}),
    ("kdn_exact", {}),
    ("kdn_muir", {}),
    ("transformer", {}),
    ("transformer", dict(attention_window=7)),
    ("gdn", dict(attention_every=2)),
]
GRAPH_IDS = [
    "gdn2",
    "muir",
    "kdn_diag",
    "kdn_iso",
    "kdn_exact",
    "kdn_muir",
    "transformer",
    "window",
    "hybrid",
]


def cuda_tiny_model(mixer, dtype=torch.float32, **overrides):
    torch.manual_seed(0)
    config = build_config("tiny", mixer=mixer, chunk_size=16, **overrides)
    return CausalLM(config).to("cuda", dtype).eval()


@pytest.mark.parametrize(("mixer", "overrides"), GRAPH_MIXERS, ids=GRAPH_IDS)
def test_cuda_graph_decoding_gives_the_tokens_of_generate(generator, mixer, overrides):
    model = cuda_tiny_model(mixer, **overrides)
    prompt = torch.randint(0, 256, (3, 21), generator=generator).cuda()
    with torch.no_grad():
        expected = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=40,
            do_sample=False,
            eos_token_id=None,
            static_decoding=False,
        )
    got = static_generate(model, prompt, max_new_tokens=40, cuda_graph=True)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("batch", [2, MAX_TRITON_ROWS + 1])
def test_cuda_static_step_normalizes_in_its_products_at_a_few_sequences_only(
    generator, norm_calls, batch
):
    """The default ("auto") layers: the blocks' norms go into `row_linear`'s kernel at up to
    MAX_TRITON_ROWS sequences; past that every norm module runs (`norm_calls`)."""
    model = cuda_tiny_model("gdn2", dtype=torch.bfloat16)
    with torch.no_grad():
        out = model(torch.randint(0, 256, (batch, 9), generator=generator).cuda(), use_cache=True)
    decoder = StaticDecoder(model, out.past_key_values, 4, cuda_graph=False)
    decoder.start(out.logits[:, -1])
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    norm_calls.clear()
    decoder.step()
    if batch <= MAX_TRITON_ROWS:
        assert norm_calls == [model.model.norm]
    else:
        assert sorted(map(id, norm_calls)) == sorted(map(id, norms))


@pytest.mark.parametrize("mixer", ["gdn2", "kdn_diag", "transformer"])
def test_cuda_graph_replays_the_eager_static_step_in_bfloat16(generator, mixer):
    model = cuda_tiny_model(mixer, dtype=torch.bfloat16)
    prompt = torch.randint(0, 256, (4, 33), generator=generator).cuda()
    eager = static_generate(model, prompt, max_new_tokens=30, cuda_graph=False)
    graph = static_generate(model, prompt, max_new_tokens=30, cuda_graph=True)
    assert torch.equal(graph, eager)


def test_cuda_graph_left_padded_batch_with_an_end_token_stops_as_generate(generator):
    model = cuda_tiny_model("gdn", attention_every=2)
    lengths, pad = (5, 11, 8), 3
    batch = torch.full((3, 11), pad)
    attention = torch.zeros(3, 11, dtype=torch.long)
    for i, n in enumerate(lengths):
        batch[i, 11 - n :] = torch.randint(0, 256, (n,), generator=generator)
        attention[i, 11 - n :] = 1
    batch, attention = batch.cuda(), attention.cuda()
    settings = dict(max_new_tokens=12, do_sample=False, pad_token_id=pad, static_decoding=False)
    with torch.no_grad():
        free = model.generate(batch, attention_mask=attention, eos_token_id=None, **settings)
        eos = int(free[0, 11 + 2])
        expected = model.generate(batch, attention_mask=attention, eos_token_id=eos, **settings)
    got = static_generate(
        model,
        batch,
        attention_mask=attention,
        max_new_tokens=12,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    assert torch.equal(got, expected)


def test_cuda_graph_sampling_is_reproducible_and_stays_within_top_k(generator):
    model = cuda_tiny_model("muir")
    prompt = torch.randint(0, 256, (2, 6), generator=generator).cuda()
    settings = dict(max_new_tokens=20, temperature=1.5, top_k=3, cuda_graph=True)
    torch.manual_seed(7)
    first = static_generate(model, prompt, **settings)
    torch.manual_seed(7)
    again = static_generate(model, prompt, **settings)
    with torch.no_grad():
        logits = model(first[:, :-1]).logits[:, prompt.shape[1] - 1 :]
    top3 = logits.topk(3, dim=-1).indices
    assert torch.equal(first, again)
    assert (top3 == first[:, prompt.shape[1] :, None]).any(-1).all()
    assert len(first[:, prompt.shape[1] :].unique()) > 3


def test_cuda_graph_decoder_reloaded_from_its_cache_decodes_the_same_tokens(generator):
    model = cuda_tiny_model("kdn_diag")
    with torch.no_grad():
        out = model(torch.randint(0, 256, (2, 17), generator=generator).cuda(), use_cache=True)
    decoder = StaticDecoder(model, out.past_key_values, 10, cuda_graph=True)
    assert decoder.graph is not None
    runs = []
    for _ in range(2):
        decoder.load(out.past_key_values)
        decoder.start(out.logits[:, -1])
        for _ in range(9):
            decoder.step()
        runs.append(decoder.generated().clone())
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_cuda_generate_command_gives_the_tokens_of_generate(tmp_path, dtype):
    """`deltalab generate` loads the weights in the dtype asked for (`auto`: bfloat16 on a GPU
    that computes it) and continues a prompt as `model.generate` does on weights of that
    dtype."""
    from deltalab.data import ByteTokenizer
    from deltalab.generate import GenerateConfig, generate_text, load_model

    model = cuda_tiny_model("muir")
    model.save_pretrained(tmp_path)
    capable = torch.cuda.get_device_capability() >= (8, 0)
    weights = torch.bfloat16 if dtype == "auto" and capable else torch.float32
    loaded, _ = load_model(str(tmp_path), device="cuda", dtype=dtype)
    assert {p.dtype for p in loaded.parameters()} == {weights}
    config = GenerateConfig(str(tmp_path), "def f(", max_new_tokens=25, device="cuda", dtype=dtype)
    tokenizer = ByteTokenizer()
    prompt = torch.tensor([tokenizer.encode("def f(")], device="cuda")
    with torch.no_grad():
        expected = model.to(weights).generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=25,
            do_sample=False,
            eos_token_id=tokenizer.eos_id,
            pad_token_id=tokenizer.pad_id,
        )
    assert generate_text(config) == tokenizer.decode(expected[0, prompt.shape[1] :].tolist())


@pytest.mark.parametrize(("mixer", "overrides"), GRAPH_MIXERS, ids=GRAPH_IDS)
def test_cuda_generate_replays_a_graph_by_itself_with_the_tokens_of_the_loop(
    generator, mixer, overrides
):
    model = cuda_tiny_model(mixer, **overrides)
    prompt = torch.randint(0, 256, (3, 21), generator=generator).cuda()
    mask = torch.ones_like(prompt)
    mask[0, :5] = 0
    settings = dict(attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=None)
    with torch.no_grad():
        expected = model.generate(prompt, static_decoding=False, **settings)
        got = model.generate(prompt, **settings)
        again = model.generate(prompt, **settings)
    ((_, _, decoder),) = model._static_decoders.decoders.values()
    assert decoder.graph is not None
    assert torch.equal(got, expected) and torch.equal(again, expected)


def test_cuda_generate_runs_the_loop_for_top_p_with_one_log_line(generator, caplog):
    model = cuda_tiny_model("gdn2")
    prompt = torch.randint(0, 256, (1, 9), generator=generator).cuda()
    settings = dict(max_new_tokens=5, do_sample=True, top_p=0.5)
    with torch.no_grad(), caplog.at_level("WARNING", "deltalab.models.graph_generate"):
        model.generate(prompt, attention_mask=torch.ones_like(prompt), **settings)
        model.generate(prompt, attention_mask=torch.ones_like(prompt), **settings)
    lines = [r for r in caplog.records if "TopPLogitsWarper" in r.getMessage()]
    assert len(lines) == 1 and not hasattr(model, "_static_decoders")


def test_cuda_fused_adamw_steps_as_the_default_step(generator):
    """On CUDA `build_optimizer` takes AdamW's fused kernel, and its steps move the parameters
    as torch's default (multi-tensor) step does, given the same gradients."""
    model = CausalLM(build_config("tiny", mixer="gdn2", num_layers=1)).cuda()
    built, params = built_and_default_adamw_steps(model, generator)
    assert built.defaults["fused"] is True
    for name, p, q in params:
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_cuda_graph_replay_writes_each_steps_gradients_over_the_last(generator):
    """`StepGraph` (train.cuda_graphs): after its eager warmup steps, each replay on new
    windows, with the parameters changed in place between steps as the optimizer changes them,
    gives the loss and the gradients of an eager step from unset gradients, in the same
    gradient tensors at every step (the CPU tests check the trainer's use of it)."""
    from deltalab.train.graphs import WARMUP_STEPS, StepGraph

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    ).cuda()
    params = list(model.parameters())

    def passes(windows):
        total = torch.zeros((), device=windows.device)
        for i in range(windows.shape[0]):
            loss = model(windows[i].float()).square().mean() / windows.shape[0]
            loss.backward()
            total += loss.detach()
        return total

    graph = StepGraph(passes, (2, 4, 8), params, torch.device("cuda"))
    windows = [torch.randint(0, 5, (2, 4, 8), generator=generator) for _ in range(WARMUP_STEPS + 4)]
    for w in windows[:WARMUP_STEPS]:
        with graph.warmup_step():
            passes(w.cuda())
        model.zero_grad(set_to_none=True)
    assert not graph.warming_up and not graph.captured
    pointers = None
    for w in windows[WARMUP_STEPS:]:
        loss = graph.step(w).clone()
        assert graph.captured
        grads = [p.grad for p in params]
        pointers = pointers or [g.data_ptr() for g in grads]
        assert [g.data_ptr() for g in grads] == pointers
        for p in params:
            p.grad = None
        expected = passes(w.cuda())
        torch.testing.assert_close(loss, expected)
        for p, g in zip(params, grads, strict=True):
            torch.testing.assert_close(g, p.grad)
            p.grad = g  # the graph's own tensor back, as the trainer leaves it
        with torch.no_grad():
            for p in params:
                p.add_(0.05 * torch.randn_like(p))
    # A NaN parameter makes a replay's loss and gradients NaN (a step the trainer skips); with
    # the parameter restored, the next replay's gradients are an eager step's again: nothing of
    # the NaN step is carried over.
    first = params[0]
    kept = first.detach().clone()
    with torch.no_grad():
        first[0, 0] = float("nan")
    assert torch.isnan(graph.step(windows[-1])) and torch.isnan(first.grad).any()
    with torch.no_grad():
        first.copy_(kept)
    loss = graph.step(windows[-1]).clone()
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    torch.testing.assert_close(loss, passes(windows[-1].cuda()))
    for p, g in zip(params, grads, strict=True):
        torch.testing.assert_close(g, p.grad)


GRAPHED_RUNS = [(mixer, ()) for mixer in MIXER_KINDS] + [
    ("gdn2", ("train.activation_checkpointing=true",)),
    ("gdn2", ("train.recompute_ffn=true", "train.grad_accum=2")),
]


@pytest.mark.parametrize(
    ("mixer", "extra"),
    GRAPHED_RUNS,
    ids=[f"{m}{'+' if e else ''}{'+'.join(e)}" for m, e in GRAPHED_RUNS],
)
def test_cuda_graphed_training_follows_the_eager_loss_curve(tmp_path, capsys, mixer, extra):
    """`deltalab train` on the GPU (Triton kernels, bf16 autocast) with train.cuda_graphs at
    its default, every mixer, and GDN-2 with its blocks or FFN branches recomputed and with
    accumulation: the step records without reading anything back, and its replays follow the
    losses of the eager run (train.cuda_graphs=false; the kernels are the same, cuBLAS may pick
    other algorithms inside a capture)."""
    from conftest import make_corpus
    from test_train import run_config

    corpus = make_corpus(tmp_path / "corpus")
    settings = (f"model.mixer={mixer}", "train.device=cuda", "train.steps=7", *extra)
    eager = train(run_config(tmp_path / "eager", corpus, *settings, "train.cuda_graphs=false"))
    capsys.readouterr()
    graphed = train(run_config(tmp_path / "graphs", corpus, *settings))
    out = capsys.readouterr().out
    assert "CUDA graphs: each step after the first two replays" in out
    for name, recorded in (("eager", False), ("graphs", True)):
        metrics = json.loads((tmp_path / name / "run" / "metrics.json").read_text())
        assert metrics["cuda_graphs"] is recorded, name
    assert len(graphed.losses) == 7
    torch.testing.assert_close(
        torch.tensor(graphed.losses), torch.tensor(eager.losses), rtol=0, atol=2e-3
    )


def test_cuda_an_h100_or_h200_launches_the_decoding_kernels_dependent():
    """On the cards the dependent launch was measured on, with a Triton that has it, it is on:
    a driver or capability misread would turn it off silently (slower, not wrong)."""
    from deltalab.ops import _triton
    from deltalab.ops._triton import dependent_launch, dependent_launch_unsupported_reason

    name = torch.cuda.get_device_name()
    if not any(card in name for card in ("H100", "H200")):
        pytest.skip(f"dependent launch was measured on H100 and H200, not {name}")
    if not _triton.TRITON_HAS_DEPENDENT_LAUNCH:
        pytest.skip(f"Triton {_triton.TRITON_VERSION} has no dependent launch")
    cuda = torch.device("cuda")
    assert dependent_launch(cuda), dependent_launch_unsupported_reason(cuda)


def test_cuda_an_h100_or_h200_takes_the_launch_tables_shipped_for_its_own_name():
    """The shipped files are named by the keys these cards' CUDA names give (else they would
    take their family's table, silently)."""
    pytest.importorskip("triton")
    from deltalab.ops.delta_rule.triton.launch import LAUNCH_TABLES
    from deltalab.ops.launch_tables import BUILTIN_DIRECTORY, device_properties, read_table_file

    card = device_properties(torch.device("cuda"))
    if not any(name in card.name for name in ("H100", "H200")):
        pytest.skip(f"no table is shipped for {card.name}")
    path = BUILTIN_DIRECTORY / f"{card.key}.json"
    assert path.exists(), f"{card.name}: no {path.name} among the shipped tables"
    shipped = read_table_file(path)["tables"]["delta_rule"]
    assert dataclasses.asdict(LAUNCH_TABLES.builtin(card)) == shipped


@pytest.mark.parametrize("mixer", ["gdn2", "kdn_diag", "kdn_exact"])
@pytest.mark.parametrize("many_programs", [None, 1], ids=["few_programs", "many_programs"])
def test_cuda_fused_step_at_the_tables_launches_equals_the_unfused_step(
    generator, mixer, many_programs
):
    """Compiled, at the 340M heads (K = V = 128) in float32: the fused step at each launch of
    the shipped default table (`FusedStepLaunch`: its blocks below `many_programs`, its wide
    batch blocks from it) equals the mixer's own step, output and state."""
    pytest.importorskip("triton")
    from deltalab.layers.decode_step import fused_step, runs_fused
    from deltalab.models.static_decode import _static_recurrent
    from deltalab.ops.delta_rule.triton.fused_step import LAUNCH

    torch.manual_seed(0)
    config = build_config("tiny", mixer=mixer, hidden_size=256, num_layers=1, num_heads=2,
                          head_dim=128, vocab_size=67)  # fmt: skip
    layer = CausalLM(config).model.blocks[0].mixer.cuda().eval()
    with torch.no_grad():
        for p in layer.parameters():  # off their initial values, which zero some maps
            p.add_(0.1 * torch.randn(p.shape, generator=generator).cuda())
        _, state = layer(torch.randn(3, 9, 256, generator=generator).cuda())
        x = torch.randn(3, 1, 256, generator=generator).cuda()
        buffers = _static_recurrent(state)
        assert runs_fused(layer, x, buffers)
        expected, after = layer(x, state)
        table = dataclasses.replace(LAUNCH, many_programs=many_programs)
        got = fused_step(layer, x, buffers, {}, table=table)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert_same_recurrent_state(buffers, after)
