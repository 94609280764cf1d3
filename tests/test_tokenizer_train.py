"""`deltalab tokenizer train`: a byte-level BPE trained offline that round-trips any text, loads
in transformers, and carries a run from training to an evaluation per token and per byte."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
from conftest import make_corpus
from test_study import InProcess, micro_spec, plan_of, quiet
from test_train import run_config

from deltalab.cli import main
from deltalab.data import CorpusConfig, load_tokenizer, prepare_tokens
from deltalab.study.cli import execute
from deltalab.study.report import collect
from deltalab.train import train

TEXTS = [
    "def f(x):\n    return x + 1\n",
    "Grüße aus 東京 🙂, tabs\tand  double  spaces \n\n",
    "<|eos|> is text here, not the token",
    "",
    " leading space and trailing ",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """(corpus, tokenizer directory): a 300-token BPE of a small corpus, by the command."""
    folder = tmp_path_factory.mktemp("bpe")
    corpus = Path(make_corpus(folder / "corpus"))
    out = folder / "tokenizer"
    assert main(["tokenizer", "train", str(corpus), "--vocab", "300", "--out", str(out)]) == 0
    return corpus, out


def test_a_trained_tokenizer_round_trips_any_text_and_loads_in_transformers(trained):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    _, out = trained
    tokenizer = load_tokenizer(str(out))
    assert tokenizer.vocab_size == 300
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (0, 1, 2)
    auto = AutoTokenizer.from_pretrained(str(out))
    fast = PreTrainedTokenizerFast.from_pretrained(str(out))
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        assert auto.encode(text, add_special_tokens=False) == ids
        assert fast.decode(ids) == text
    # Merges were learned: the corpus's words take fewer tokens than bytes.
    line = "def item_3 = return(3)\n"
    assert len(tokenizer.encode(line)) < len(line.encode("utf-8"))
    record = json.loads((out / "training.json").read_text())
    assert record["split"] == "train" and record["vocab_size"] == 300


def test_the_token_byte_lengths_of_a_trained_tokenizer_add_up_to_the_texts_bytes(trained, tmp_path):
    corpus, out = trained
    tokenizer = load_tokenizer(str(out))
    lengths = tokenizer.token_byte_lengths()
    for text in TEXTS:
        assert int(lengths[tokenizer.encode(text)].sum()) == len(text.encode("utf-8"))
    config = CorpusConfig(source=str(corpus), split="held_out", held_out_fraction=0.2)
    shards = prepare_tokens(config, tokenizer, tmp_path / "cache")
    stream = shards[0 : len(shards)].astype("int64")
    assert int(lengths[stream].sum()) == shards.manifest.text_bytes


def test_a_run_trains_on_the_tokenizer_and_evaluates_per_token_and_per_byte(
    trained, tmp_path, capsys
):
    corpus, out = trained
    extra = [f"data.tokenizer={out}", "train.steps=3", "eval.sample_tokens=4"]
    result = train(run_config(tmp_path, str(corpus), *extra))
    assert result.final_perplexity < result.initial_perplexity
    model = tmp_path / "run" / "model"
    assert load_tokenizer(str(model)).encode(TEXTS[1]) == load_tokenizer(str(out)).encode(TEXTS[1])
    words = [f"source={corpus}", "held_out_fraction=0.2", f"cache_dir={tmp_path / 'cache'}"]
    argv = ["eval", str(model), "--task", "perplexity", *words, "--out", str(tmp_path / "ev")]
    assert main([*argv, "--no-progress"]) == 0
    capsys.readouterr()
    metrics = json.loads((tmp_path / "ev" / "results.json").read_text())["metrics"]
    assert 0 < metrics["bytes"] and metrics["tokens"] < metrics["bytes"]
    per_byte = metrics["loss"] * metrics["tokens"] / metrics["bytes"]
    assert metrics["nats_per_byte"] == pytest.approx(per_byte, rel=1e-12)
    assert metrics["bits_per_byte"] == pytest.approx(per_byte / math.log(2), rel=1e-12)


def test_a_study_with_the_tokenizer_reports_the_loss_per_token_and_per_byte(trained, tmp_path):
    corpus, out = trained
    spec = micro_spec(tmp_path, corpus)
    spec["run"]["data"]["tokenizer"] = str(out)
    spec["grid"] = {"mixers": ["gdn2"], "seeds": [0]}
    plan = plan_of(copy.deepcopy(spec))
    assert execute(plan, launcher=InProcess(), say=quiet) == 0
    (run,) = collect(plan)["runs"]
    assert {"perplexity.loss", "perplexity.bits_per_byte"} <= set(run["metrics"])
    assert all(math.isfinite(v) for v in run["metrics"].values())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--vocab", "100"], "--vocab must be at least 259"),
        (["--min-frequency", "0"], "--min-frequency must be >= 1, got 0"),
        (["--out", "{existing}"], "exists and is not an empty directory"),
    ],
)
def test_a_bad_tokenizer_argument_is_one_line_naming_it(trained, tmp_path, capsys, args, message):
    corpus, out = trained
    command = ["tokenizer", "train", str(corpus), "--vocab", "300", "--out", str(tmp_path / "t")]
    command += [a.format(existing=out) for a in args]
    assert main(command) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err, err
