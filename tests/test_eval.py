"""The evaluation suite: generators, scoring, streaming, MQAR training and the `deltalab eval`
command. Models are built here, tiny (2 layers, width 32-64), so the file runs in well under a
minute on two cores."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from deltalab.cli import main
from deltalab.data import ByteTokenizer
from deltalab.data.corpus import CorpusConfig, iter_documents
from deltalab.eval.common import EvalError, load_checkpoint, stream_token_nll
from deltalab.eval.mqar import (
    IGNORE,
    MQARConfig,
    MQARTrainSettings,
    _model,
    choose_by_validation,
    generate_mqar,
    recall_accuracy,
    train_mqar,
    train_one,
)
from deltalab.eval.needles import (
    NEEDLE_TASKS,
    NeedleSettings,
    make_passkey_example,
    make_variable_tracking_example,
    needle_examples,
    score_answer,
    write_passkey_corpus,
)
from deltalab.eval.perplexity import PerplexitySettings, perplexity
from deltalab.eval.tasks import TaskContext, parse_settings
from deltalab.models import CausalLM, DeltaLabConfig

ROOT = Path(__file__).resolve().parents[1]
TEXT = "def add(a, b):\n    return a + b\n\n" * 40


def tiny_model(mixer: str, seed: int = 0, **fields) -> CausalLM:
    torch.manual_seed(seed)
    config = DeltaLabConfig(
        mixer=mixer, hidden_size=32, num_layers=2, num_heads=2, head_dim=16, chunk_size=16, **fields
    )
    return CausalLM(config).eval()


def save_tiny(tmp_path: Path, mixer: str, name: str = "model", **fields) -> Path:
    path = tmp_path / name
    tiny_model(mixer, **fields).save_pretrained(path)
    return path


def context(tmp_path: Path, checkpoint=None, **fields) -> TaskContext:
    return TaskContext(
        checkpoint=checkpoint,
        seed=0,
        device="cpu",
        out_dir=tmp_path / "out",
        progress=False,
        **fields,
    )


# --- MQAR ---------------------------------------------------------------------------------


def test_mqar_generator_is_a_pure_function_of_settings_and_seed():
    config = MQARConfig(vocab_size=32, seq_len=32, num_pairs=4, num_examples=20)
    first, again, other = (
        generate_mqar(config, 3),
        generate_mqar(config, 3),
        generate_mqar(config, 4),
    )
    assert torch.equal(first.inputs, again.inputs) and torch.equal(first.labels, again.labels)
    assert not torch.equal(first.inputs, other.inputs)
    state = torch.random.get_rng_state()
    generate_mqar(config, 3)
    assert torch.equal(state, torch.random.get_rng_state()), "the global RNG was used"


def test_mqar_labels_stand_exactly_at_queries_and_name_the_paired_value():
    config = MQARConfig(vocab_size=64, seq_len=64, num_pairs=8, num_examples=50)
    data = generate_mqar(config, 0)
    half = config.vocab_size // 2
    for inputs, labels in zip(data.inputs.tolist(), data.labels.tolist(), strict=True):
        keys, values = inputs[0:16:2], inputs[1:16:2]
        assert len(set(keys)) == 8 and len(set(values)) == 8, "pairs drawn with replacement"
        assert all(k < half for k in keys) and all(v >= half for v in values)
        paired = dict(zip(keys, values, strict=True))
        answered = [t for t, label in enumerate(labels) if label != IGNORE]
        assert len(answered) == 8 and all(t >= 16 and t % 2 == 0 for t in answered)
        assert sorted(inputs[t] for t in answered) == sorted(keys), "each key asked once"
        for t in answered:
            assert labels[t] == paired[inputs[t]] == inputs[t + 1]


def test_mqar_refuses_more_pairs_than_keys():
    with pytest.raises(EvalError, match=r"num_pairs=20 .* 16 keys of vocab_size=32"):
        MQARConfig(vocab_size=32, seq_len=128, num_pairs=20)
    with pytest.raises(EvalError, match="seq_len=14 leaves 3 query slots"):
        MQARConfig(vocab_size=64, seq_len=14, num_pairs=4)


def test_mqar_training_learns_recall():
    settings = MQARTrainSettings(
        mixers=("gdn2",), vocab_size=16, train=((16, 2),), test=((16, 2),), steps=80, lrs=(1e-2,)
    )
    train = [generate_mqar(settings.config(16, 2, 2000), 0)]
    model = train_one(settings, "gdn2", 1e-2, 0, train)
    correct, total = recall_accuracy(model, generate_mqar(settings.config(16, 2, 100), 1))
    # Chance is 1/8 (the eight values); the model has to read the pairs to get this far.
    assert correct / total > 0.9


def test_mqar_transformer_solves_64x4_with_its_head_untied():
    """The harness's attention model binds values to keys (Zoology's result at 64x4) with its
    default, untied head (docs/STUDY.md: tied, the keys' embeddings collapse)."""
    settings = MQARTrainSettings(mixers=("transformer",), train=((64, 4),), test=((64, 4),),
                                 steps=1000, lrs=(3e-3,))  # fmt: skip
    assert (
        not settings.tie_embeddings
        and not _model(settings, "transformer", 0).config.tie_word_embeddings
    )
    train = [generate_mqar(settings.config(64, 4, settings.train_examples), 0)]
    model = train_one(settings, "transformer", 3e-3, 0, train)
    correct, total = recall_accuracy(model, generate_mqar(settings.config(64, 4, 200), 1))
    assert correct / total > 0.9


def test_mqar_tie_embeddings_shares_the_head_with_the_embedding_only_when_asked():
    for tie in (False, True):
        model = _model(MQARTrainSettings(mixers=("transformer",), tie_embeddings=tie), "gdn2", 0)
        shared = model.lm_head.weight.data_ptr() == model.model.embed.weight.data_ptr()
        assert shared is tie


def test_mqar_models_take_the_mixer_options():
    settings = parse_settings(
        MQARTrainSettings, ["mixers=[muir, transformer]", "mixer_options={read_gate: none}"]
    )
    muir = _model(settings, "muir", 0)
    assert {block.mixer.read_gate for block in muir.model.blocks} == {"none"}
    _model(settings, "transformer", 0)  # attention blocks take no options
    with pytest.raises(EvalError, match="read_gat is not an option of the muir mixer"):
        parse_settings(MQARTrainSettings, ["mixers=[muir]", "mixer_options={read_gat: none}"])


def test_mqar_sweep_reports_a_diverging_learning_rate_and_goes_on():
    settings = MQARTrainSettings(
        mixers=("gdn",), vocab_size=16, train=((16, 2),), test=((16, 2),), steps=6,
        lrs=(1e3, 1e-2), train_examples=64, test_examples=16,
    )  # fmt: skip
    context = TaskContext(None, seed=0, device="cpu", out_dir=Path("."), progress=False)
    runs = train_mqar(settings, context).metrics["runs"]
    assert [r["lr"] for r in runs] == [1e3, 1e-2]
    assert "diverged" in runs[0] and runs[0]["accuracy"]["16x2"]["accuracy"] == 0.0
    assert "diverged" not in runs[1]


# --- perplexity and streaming ----------------------------------------------------------------


def test_uniform_model_has_perplexity_equal_to_vocab_size(tmp_path):
    model = tiny_model("gdn2")
    with torch.no_grad():
        model.lm_head.weight.zero_()  # tied: every logit is 0, every token has p = 1/259
    model.save_pretrained(tmp_path / "uniform")
    (tmp_path / "text.txt").write_text(TEXT)
    loaded = load_checkpoint(str(tmp_path / "uniform"))
    settings = PerplexitySettings(
        source=str(tmp_path / "text.txt"),
        split="all",
        cache_dir=str(tmp_path / "cache"),
        seq_len=64,
    )
    outcome = perplexity(settings, context(tmp_path, loaded))
    assert outcome.metrics["perplexity"] == pytest.approx(259, rel=1e-5)
    assert outcome.metrics["bits_per_byte"] == pytest.approx(math.log2(259), rel=1e-5)


def test_perplexity_averages_over_tokens_not_batches(tmp_path):
    model = tiny_model("gdn2")
    model.save_pretrained(tmp_path / "m")
    (tmp_path / "text.txt").write_text(TEXT)
    loaded = load_checkpoint(str(tmp_path / "m"))
    # 3 windows in batches of 2: a mean of batch means would weigh the last window double.
    settings = PerplexitySettings(
        source=str(tmp_path / "text.txt"),
        split="all",
        cache_dir=str(tmp_path / "cache"),
        seq_len=100,
        max_tokens=300,
        batch_size=2,
    )
    outcome = perplexity(settings, context(tmp_path, loaded))
    ids = torch.tensor(list(TEXT.encode()))[:301]
    windows = torch.stack([ids[i * 100 : i * 100 + 101] for i in range(3)])
    with torch.no_grad():
        logits = model(input_ids=windows[:, :-1]).logits
    expected = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item()
    assert outcome.metrics["tokens"] == 300
    assert outcome.metrics["loss"] == pytest.approx(expected, rel=1e-5)
    # A third of the windows as validation: the first window is scored apart, the test is the
    # other two.
    split = perplexity(
        dataclasses.replace(settings, validation_fraction=1 / 3), context(tmp_path, loaded)
    )
    nll = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten(), reduction="none")
    assert split.summary["validation_loss"] == pytest.approx(nll[:100].mean().item(), rel=1e-5)
    assert split.metrics["tokens"] == 200
    assert split.summary["loss"] == pytest.approx(nll[100:].mean().item(), rel=1e-5)


@pytest.mark.parametrize("mixer", ["gdn2", "muir", "kdn_diag"])
def test_streamed_loss_of_recurrent_model_equals_full_sequence_loss(mixer):
    model = tiny_model(mixer)
    ids = torch.randint(0, 259, (2, 61), generator=torch.Generator().manual_seed(0))
    streamed = stream_token_nll(model, ids, segment_len=13)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    full = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    torch.testing.assert_close(streamed, full.view(2, 60), rtol=1e-4, atol=1e-4)


def test_full_attention_past_trained_length_is_refused_or_windowed(tmp_path):
    path = save_tiny(tmp_path, "transformer")
    loaded = load_checkpoint(str(path), trained_length=16)
    loaded.allow_context(16, "refuse")  # within the trained length: nothing to say
    with pytest.raises(EvalError, match="40 tokens is longer than the 16 tokens"):
        loaded.allow_context(40, "refuse")
    loaded.allow_context(40, "window")
    ids = torch.randint(0, 259, (1, 40), generator=torch.Generator().manual_seed(1))
    streamed = stream_token_nll(loaded.model, ids, segment_len=7)
    # The same weights built with a 16-token window, read in one pass.
    windowed = tiny_model("transformer", attention_window=16)
    windowed.load_state_dict(tiny_model("transformer").state_dict())
    with torch.no_grad():
        logits = windowed(input_ids=ids).logits
    full = F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="none")
    torch.testing.assert_close(streamed[0], full, rtol=1e-4, atol=1e-4)
    unknown = load_checkpoint(str(path))
    with pytest.raises(EvalError, match="trained length is unknown"):
        unknown.allow_context(40, "refuse")


# --- settings and the command ----------------------------------------------------------------


def test_settings_errors_name_the_field_and_the_closest_name():
    with pytest.raises(EvalError, match=r"unknown setting 'seq_lne'.*did you mean 'seq_len'"):
        parse_settings(PerplexitySettings, ["seq_lne=5"])
    with pytest.raises(EvalError, match=r"batch_size must be an int, got str 'x'"):
        parse_settings(PerplexitySettings, ["batch_size=x"])
    with pytest.raises(EvalError, match=r"mixers holds 'gnd2'.*did you mean 'gdn2'"):
        parse_settings(MQARTrainSettings, ["mixers=[gnd2]"])
    assert parse_settings(MQARTrainSettings, ["lrs=[1e-3, 2]"]).lrs == (1e-3, 2.0)


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "deltalab.cli", "eval", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_bad_input_is_one_line_and_exit_code_2(tmp_path):
    result = run_cli("--task", "perplexty", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 2
    assert "did you mean 'perplexity'" in result.stderr and "Traceback" not in result.stderr
    assert main(["eval", str(tmp_path / "missing"), "--task", "perplexity"]) == 2


def test_dtype_is_refused_on_one_line_where_no_checkpoint_is_loaded_or_it_is_unknown(
    tmp_path, capsys
):
    path = save_tiny(tmp_path, "gdn2")
    for argv, message in (
        (["--task", "mqar-train", "--dtype", "bfloat16"], "trains its own models; --dtype"),
        ([str(path), "--task", "perplexity", "--dtype", "float16"], "--dtype must be one of"),
    ):
        capsys.readouterr()
        assert main(["eval", *argv, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err, err


def test_a_malformed_yaml_setting_is_reported_on_one_line(tmp_path, capsys):
    path = save_tiny(tmp_path, "gdn2")
    capsys.readouterr()  # saving the model prints a progress bar
    assert main(["eval", str(path), "--task", "perplexity", "max_tokens=[1,2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot read '[1,2' as YAML" in err and "\n" not in err


def test_eval_command_writes_results_and_compares_runs(tmp_path, capsys):
    path = save_tiny(tmp_path, "gdn2")
    (tmp_path / "text.txt").write_text(TEXT)
    common = [
        f"source={tmp_path / 'text.txt'}",
        "split=all",
        f"cache_dir={tmp_path / 'cache'}",
        "seq_len=64",
    ]
    for name in ("a", "b"):
        out = tmp_path / name
        assert (
            main(
                [
                    "eval",
                    str(path),
                    "--task",
                    "perplexity",
                    *common,
                    "--out",
                    str(out),
                    "--no-progress",
                ]
            )
            == 0
        )
        record = json.loads((out / "results.json").read_text())
        assert record["task"] == "perplexity" and record["seed"] == 0
        assert record["settings"]["seq_len"] == 64
        assert (
            record["checkpoint"]["path"] == str(path)
            and len(record["checkpoint"]["config_hash"]) == 16
        )
        assert {"python", "torch", "transformers"} <= set(record["versions"])
    capsys.readouterr()
    assert main(["eval", "--compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| run | task | checkpoint | loss | perplexity | bits_per_byte")
    assert len(table) == 4


def test_eval_dtype_casts_the_weights_and_is_recorded(tmp_path):
    """--dtype bfloat16 evaluates the bfloat16 model: its loss is the float32 one's to bfloat16
    rounding, not equal to it, and the record says which dtype ran."""
    path = save_tiny(tmp_path, "gdn2")
    (tmp_path / "text.txt").write_text(TEXT)
    settings = [f"source={tmp_path / 'text.txt'}", "split=all", f"cache_dir={tmp_path / 'c'}"]
    losses = {}
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / dtype
        argv = ["eval", str(path), "--task", "perplexity", *settings, "--dtype", dtype]
        assert main([*argv, "--device", "cpu", "--out", str(out), "--no-progress"]) == 0
        record = json.loads((out / "results.json").read_text())
        assert record["settings"]["dtype"] == dtype
        losses[dtype] = record["metrics"]["loss"]
    assert losses["bfloat16"] != losses["float32"]
    assert losses["bfloat16"] == pytest.approx(losses["float32"], rel=0.02)


# --- needles ---------------------------------------------------------------------------------

NEEDLE_NAMES = [*NEEDLE_TASKS, "variable-tracking"]


def haystack_file(tmp_path: Path) -> Path:
    path = tmp_path / "haystack.txt"
    path.write_text(
        "".join(
            f"line {i}: the river keeps the mill turning, season after season.\n"
            for i in range(400)
        )
    )
    return path


@pytest.mark.parametrize("task", NEEDLE_NAMES)
def test_needle_examples_are_deterministic_per_seed_and_differ_across_seeds(tmp_path, task):
    settings = NeedleSettings(
        source=str(haystack_file(tmp_path)), split="all", lengths=(1024,), samples=2
    )
    first = needle_examples(task, settings, 0, ByteTokenizer())
    assert first == needle_examples(task, settings, 0, ByteTokenizer())
    assert [e.context for e in first] != [
        e.context for e in needle_examples(task, settings, 1, ByteTokenizer())
    ]


@pytest.mark.parametrize("task", NEEDLE_NAMES)
def test_needles_are_present_exactly_once_at_the_requested_length(tmp_path, task):
    settings = NeedleSettings(
        source=str(haystack_file(tmp_path)), split="all", lengths=(1024, 2048), samples=3
    )
    examples = needle_examples(task, settings, 0, ByteTokenizer())
    for example, length in zip(examples, [1024] * 3 + [2048] * 3, strict=True):
        for needle in example.needles:
            assert example.context.count(needle) == 1, needle
        if task != "variable-tracking":
            for answer in example.answers:
                assert example.context.count(answer) == 1, answer
        # Within one haystack line (or noise paragraph) of the requested length.
        assert length - 5 <= example.length <= length + 100
    keys, values, asked = NEEDLE_TASKS.get(task, (None, None, None, 1, 1, 1))[3:]
    assert all(
        len(e.needles) == (5 if task == "variable-tracking" else keys * values) for e in examples
    )
    assert all(
        len(e.answers) == (5 if task == "variable-tracking" else asked * values) for e in examples
    )


def test_variable_tracking_answers_are_the_chain_bound_to_the_value(tmp_path):
    example = make_variable_tracking_example(1024, 0, ByteTokenizer(), chains=2, hops=3)
    bound: dict[str, str] = {}
    for statement in example.needles:  # in the order they stand in the context
        name, value = statement.removeprefix("VAR ").rstrip(".").split(" = ")
        bound[name] = bound.get(value, value)
        assert example.context.index(statement) >= 0
    value = bound[example.answers[0]]
    assert sorted(n for n, v in bound.items() if v == value) == sorted(example.answers)
    assert len(example.answers) == 4 and f"the value {value} in the text above" in example.context


def test_passkey_depth_places_the_needle(tmp_path):
    top = make_passkey_example(1024, 0.0, 0, ByteTokenizer())
    bottom = make_passkey_example(1024, 1.0, 0, ByteTokenizer())
    middle = make_passkey_example(1024, 0.5, 0, ByteTokenizer())
    position = [e.context.index(e.needles[0]) / len(e.context) for e in (top, middle, bottom)]
    assert position[0] < 0.2 < 0.4 < position[1] < 0.6 < 0.85 < position[2]
    assert top.context.count(top.needles[0]) == 1 and top.answers[0] in top.needles[0]
    assert 1000 <= top.length <= 1124


def test_passkey_corpus_examples_end_with_their_own_key_and_read_as_a_file_list(tmp_path):
    tokenizer = ByteTokenizer()
    listing = write_passkey_corpus(tmp_path / "pk", 12, tokenizer, lengths=(500, 700), seed=3)
    documents = list(iter_documents(CorpusConfig(source=f"@{listing}", split="all")))
    assert len(documents) == 12
    keys, places, sizes = [], [], []
    for document in documents:
        needle = re.search(
            r"The pass key is (\d{5})\. Remember it\. \1 is the pass key\.", document
        )
        assert needle is not None and document.count("The pass key is ") == 2
        key = needle.group(1)
        assert document.endswith(f"What is the pass key? The pass key is {key}.\n")
        size = len(tokenizer.encode(document))
        assert 500 <= size <= 700 + 100
        sizes.append(size)
        keys.append(key)
        places.append(needle.start() / len(document))
    assert len(set(keys)) == 12 and min(places) < 0.3 and max(places) > 0.7
    assert min(sizes) < 560 and max(sizes) > 640  # lengths drawn across the range
    again = write_passkey_corpus(tmp_path / "again", 12, tokenizer, lengths=(500, 700), seed=3)
    other = write_passkey_corpus(tmp_path / "other", 12, tokenizer, lengths=(500, 700), seed=4)
    assert again.read_text() == listing.read_text()
    assert [(again.parent / n).read_text() for n in again.read_text().split()] == [
        (listing.parent / n).read_text() for n in listing.read_text().split()
    ]
    assert (other.parent / "passkey-0000000.txt").read_text() != documents[0]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (dict(examples=0), "examples must be an int >= 1"),
        (dict(examples=2.5), "examples must be an int >= 1"),
        (dict(lengths=(700, 500)), "lengths must be"),
        (dict(lengths=(500,)), "lengths must be two ints"),
        (dict(lengths=500), "lengths must be two ints"),
        (dict(digits=True), "digits must be an int in"),
        (dict(lengths=(200, 400)), "lengths holds 200: passkey needs more than"),
        (dict(seed=-1), "seed must be an int >= 0"),
        (dict(digits=0), "digits must be an int in"),
    ],
    ids=[
        "no-examples",
        "fractional",
        "reversed",
        "one-length",
        "not-a-pair",
        "bool-digits",
        "too-short",
        "seed",
        "digits",
    ],
)
def test_passkey_corpus_refuses_bad_arguments_before_writing(tmp_path, arguments, message):
    given = dict(examples=3, lengths=(500, 700)) | arguments
    with pytest.raises(EvalError, match=message):
        write_passkey_corpus(tmp_path / "pk", tokenizer=ByteTokenizer(), **given)
    assert not (tmp_path / "pk").exists()


@pytest.mark.parametrize(
    ("name", "contents", "message"),
    [
        ("empty", None, "holds no document file"),
        ("nothing.txt", "", "no documents in split 'all'"),
        ("blank.txt", "\n\n   \n", "holds 0 tokens of non-blank lines"),
    ],
)
def test_empty_haystack_sources_are_refused(tmp_path, name, contents, message):
    source = tmp_path / name
    if contents is None:
        source.mkdir()
    else:
        source.write_text(contents)
    settings = NeedleSettings(source=str(source), split="all", lengths=(1024,), samples=1)
    with pytest.raises(EvalError, match=message):
        needle_examples("niah-single-2", settings, 0, ByteTokenizer())


def test_needle_settings_that_cannot_be_generated_are_refused(tmp_path):
    with pytest.raises(EvalError, match="lengths holds 100: niah-multikey needs more than"):
        needle_examples(
            "niah-multikey",
            NeedleSettings(
                source=str(haystack_file(tmp_path)), split="all", lengths=(100,), samples=1
            ),
            0,
            ByteTokenizer(),
        )


def test_score_counts_the_expected_strings_found():
    assert score_answer(" 123 and 456.", ["123", "456"]) == 1.0
    assert score_answer(" 123 only", ["123", "456"]) == 0.5
    assert score_answer("", ["1"]) == 0.0


def test_passkey_command_writes_grid_and_heatmap(tmp_path):
    path = save_tiny(tmp_path, "gdn2")
    out = tmp_path / "pk"
    args = [
        "eval",
        str(path),
        "--task",
        "passkey",
        "lengths=[400,600]",
        "depths=[0,1]",
        "samples=1",
    ]
    assert main([*args, "--out", str(out), "--no-progress"]) == 0
    record = json.loads((out / "results.json").read_text())
    assert len(record["metrics"]["grid"]) == 2 and len(record["metrics"]["grid"][0]) == 2
    assert len(record["metrics"]["examples"]) == 4 and (out / "passkey.png").stat().st_size > 0
    # No --device or --dtype: "auto", recorded as the device and dtype they resolved to.
    assert record["settings"]["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    ampere = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
    assert record["settings"]["dtype"] == ("bfloat16" if ampere else "float32")


def test_streaming_several_checkpoints_share_one_plot_and_recurrent_memory_stays_flat(tmp_path):
    (tmp_path / "text.txt").write_text(TEXT * 2)
    first, second = save_tiny(tmp_path, "gdn2", "a"), save_tiny(tmp_path, "muir", "b")
    out = tmp_path / "streams"
    settings = ["tokens=1500", "segment_len=100", "first_bucket=16", "split=all"]
    settings += [f"source={tmp_path / 'text.txt'}", f"cache_dir={tmp_path / 'cache'}"]
    assert (
        main(
            [
                "eval",
                str(first),
                str(second),
                "--task",
                "streaming",
                *settings,
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    assert (out / "streaming.png").stat().st_size > 0
    for name in ("a", "b"):
        metrics = json.loads((out / name / "results.json").read_text())["metrics"]
        assert [b["start"] for b in metrics["buckets"]] == [0, 16, 32, 64, 128, 256, 512, 1024]
        assert sum(b["tokens"] for b in metrics["buckets"]) == 1500
        # The recurrent state has one size from the first segment to the 1500th token.
        assert (
            len({p["cache_bytes"] for p in metrics["memory"]}) == 1 and len(metrics["memory"]) > 3
        )


def test_unknown_task_suggests_the_family_member(capsys):
    assert main(["eval", "--task", "mqar"]) == 2
    assert "did you mean 'mqar-train'" in capsys.readouterr().err


# --- where results go, and what is refused before any work -------------------------------------


def perplexity_words(tmp_path: Path, *extra: str) -> list[str]:
    (tmp_path / "text.txt").write_text(TEXT)
    return [
        "--task",
        "perplexity",
        f"source={tmp_path / 'text.txt'}",
        "split=all",
        f"cache_dir={tmp_path / 'cache'}",
        "--no-progress",
        *extra,
    ]


def test_an_evaluation_with_other_settings_never_replaces_an_earlier_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = save_tiny(tmp_path / "run", "gdn2")
    for seq_len in (32, 64):
        assert main(["eval", str(path), *perplexity_words(tmp_path, f"seq_len={seq_len}")]) == 0
    found = sorted((tmp_path / "runs" / "eval").glob("*/results.json"))
    assert [p.parent.name for p in found] == ["perplexity-run", "perplexity-run-2"]
    assert [json.loads(p.read_text())["settings"]["seq_len"] for p in found] == [32, 64]


def test_checkpoints_whose_directories_share_a_name_get_a_directory_each(tmp_path):
    first = save_tiny(tmp_path / "a" / "run", "gdn2")
    second = save_tiny(tmp_path / "b" / "run", "muir")
    out = tmp_path / "out"
    words = perplexity_words(tmp_path, "seq_len=32", "--out", str(out))
    assert main(["eval", str(first), str(second), *words]) == 0
    mixers = [
        json.loads((out / name / "results.json").read_text())["checkpoint"]["mixer"]
        for name in ("run", "run-2")
    ]
    assert mixers == ["gdn2", "muir"]


def test_an_out_directory_holding_results_is_refused_unless_overwrite(tmp_path, capsys):
    path = save_tiny(tmp_path, "gdn2")
    out = str(tmp_path / "out")
    assert main(["eval", str(path), *perplexity_words(tmp_path, "seq_len=32", "--out", out)]) == 0
    capsys.readouterr()
    assert main(["eval", str(path), *perplexity_words(tmp_path, "seq_len=64", "--out", out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--out" in err and "--overwrite" in err and "\n" not in err, err
    assert json.loads((tmp_path / "out" / "results.json").read_text())["settings"]["seq_len"] == 32
    words = perplexity_words(tmp_path, "seq_len=64", "--out", out, "--overwrite")
    assert main(["eval", str(path), *words]) == 0
    assert json.loads((tmp_path / "out" / "results.json").read_text())["settings"]["seq_len"] == 64


@pytest.mark.parametrize("where", ["file", "below a file"])
def test_an_out_that_cannot_be_a_directory_is_refused_before_the_evaluation(
    tmp_path, capsys, where
):
    (tmp_path / "taken").write_text("a file\n")
    out = tmp_path / "taken" if where == "file" else tmp_path / "taken" / "results"
    # The checkpoint does not exist either: the --out check comes first, before any loading.
    words = perplexity_words(tmp_path, "--out", str(out))
    assert main(["eval", str(tmp_path / "no-model"), *words]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "no-model" not in err, err


@pytest.mark.parametrize("task", ["passkey", "niah-single-1", "variable-tracking"])
@pytest.mark.parametrize("value", [0, -3])
def test_retrieval_tasks_refuse_no_room_for_an_answer(task, value):
    from deltalab.eval.tasks import get_task

    with pytest.raises(EvalError, match=rf"max_new_tokens must be .*got {value}"):
        parse_settings(get_task(task).settings, [f"max_new_tokens={value}"])


def test_a_negative_seed_is_refused(tmp_path, capsys):
    path = save_tiny(tmp_path, "gdn2")
    assert main(["eval", str(path), *perplexity_words(tmp_path, "--seed", "-1")]) == 2
    assert "--seed must be an int >= 0, got -1" in capsys.readouterr().err


def test_a_checkpoint_path_with_an_equals_sign_is_a_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = save_tiny(tmp_path / "lr=0.01", "gdn2")
    out = tmp_path / "out"
    assert (
        main(["eval", str(path), *perplexity_words(tmp_path, "seq_len=32", "--out", str(out))]) == 0
    )
    assert json.loads((out / "results.json").read_text())["checkpoint"]["path"] == str(path)
    # After `--` a word is a setting even where a file of that name exists.
    (tmp_path / "max_tokens=64").mkdir()
    words = perplexity_words(tmp_path, "seq_len=32", "--out", str(tmp_path / "o2"))
    assert main(["eval", str(path), *words, "--", "max_tokens=64"]) == 0
    assert (
        json.loads((tmp_path / "o2" / "results.json").read_text())["settings"]["max_tokens"] == 64
    )


def test_a_setting_given_twice_is_refused():
    with pytest.raises(EvalError, match=r"max_tokens is given twice \(1 and 2\)"):
        parse_settings(PerplexitySettings, ["max_tokens=1", "max_tokens=2"])


def test_lm_eval_without_task_names_says_so(tmp_path, capsys):
    path = save_tiny(tmp_path, "gdn2")
    assert main(["eval", str(path), "--task", "lm-eval:"]) == 2
    assert "--task lm-eval: names no lm-eval task" in capsys.readouterr().err


def test_compare_shows_the_settings_that_differ(tmp_path, capsys):
    path = save_tiny(tmp_path, "gdn2")
    for seq_len in (32, 64):
        out = str(tmp_path / f"s{seq_len}")
        assert (
            main(
                ["eval", str(path), *perplexity_words(tmp_path, f"seq_len={seq_len}", "--out", out)]
            )
            == 0
        )
    capsys.readouterr()
    assert main(["eval", "--compare", str(tmp_path / "s32"), str(tmp_path / "s64")]) == 0
    header, _, first, second = capsys.readouterr().out.splitlines()
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert "seq_len" in columns and "source" not in columns and "max_tokens" not in columns
    index = columns.index("seq_len")
    assert [[c.strip() for c in row.strip("|").split("|")][index] for row in (first, second)] == [
        "32",
        "64",
    ]


def test_no_progress_silences_every_bar(tmp_path):
    path = save_tiny(tmp_path, "gdn2")
    result = run_cli(str(path), *perplexity_words(tmp_path, "seq_len=32"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


def test_mqar_chooses_the_learning_rate_on_validation_even_where_test_disagrees():
    def run(lr, validation, test):
        return {
            "mixer": "gdn2", "lr": lr,
            "validation": {"16x2": {"accuracy": validation}},
            "accuracy": {"16x2": {"accuracy": test, "ci95": None, "answers": 4}},
        }  # fmt: skip

    # 1e-2 is better on the test examples, 1e-3 on the validation ones: 1e-3 is chosen.
    runs = [run(1e-3, 0.9, 0.5), run(1e-2, 0.6, 0.95)]
    chosen = choose_by_validation(runs, ("gdn2",), ["16x2"])["gdn2"]
    assert chosen["lr"] == 1e-3 and chosen["16x2"]["accuracy"] == 0.5
    assert chosen["validation"] == 0.9


def test_mqar_reports_the_chosen_rate_and_evaluates_validation_apart_from_test():
    settings = MQARTrainSettings(
        mixers=("gdn",), vocab_size=16, train=((16, 2),), test=((16, 2),), steps=2,
        lrs=(1e-3, 1e-2), train_examples=16, test_examples=8, validation_examples=6,
    )  # fmt: skip
    context = TaskContext(None, seed=0, device="cpu", out_dir=Path("."), progress=False)
    outcome = train_mqar(settings, context)
    assert outcome.summary["gdn@lr"] in (1e-3, 1e-2)
    run = outcome.metrics["runs"][0]
    # 6 validation examples of 2 answers, 8 test examples of 2 answers.
    assert run["validation"]["16x2"]["answers"] == 12 and run["accuracy"]["16x2"]["answers"] == 16
