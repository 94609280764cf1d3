"""deltalab train: loss falls for every family; a run writes its checkpoints, export, metrics,
curve and sample (a local tokenizer exported with it, TensorBoard events when asked), refuses data
and directories it cannot use, stops or skips a non-finite loss as configured, keeps its loss
curve under gradient accumulation and recomputation, and reads its value checks back once a step.
Resume, distributed runs, graphed steps and the optimizer have their own files
(tests/test_train_resume.py, test_train_distributed.py, test_train_graphs.py, test_train_optim.py),
which take this file's helpers."""

from __future__ import annotations

import json
import math
import unicodedata
from pathlib import Path

import pytest
import torch

from deltalab.errors import DivergenceError
from deltalab.models import MIXER_KINDS
from deltalab.train import load_run_config, train
from deltalab.train.checkpoint import list_checkpoints

SMALL_MODEL = (
    "model.overrides={hidden_size: 32, num_layers: 2, num_heads: 2, head_dim: 16, chunk_size: 16}"
)


def run_config(tmp_path, corpus, *extra: str):
    return load_run_config(None, run_overrides(tmp_path, corpus, *extra))


def run_overrides(tmp_path, corpus, *extra: str) -> list[str]:
    """The overrides of `run_config`, as `deltalab train` takes them."""
    return [
        f"data.source={corpus}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.max_bytes=null",
        "data.held_out_fraction=0.2",
        SMALL_MODEL,
        "train.seq_len=32",
        "train.batch_size=4",
        "train.steps=6",
        "train.device=cpu",
        "optim.lr=0.01",
        "schedule.warmup_steps=2",
        "eval.every=3",
        "eval.batches=2",
        "eval.sample_tokens=8",
        "checkpoint.every=3",
        "checkpoint.keep=3",
        "log.progress=false",
        "log.tensorboard=false",
        f"log.out_dir={tmp_path / 'run'}",
        *extra,
    ]


def poison_loss_at(monkeypatch, call: int) -> dict[str, int]:
    """Makes the `call`-th training loss (counting from 1) NaN; returns the counter, which a
    test resets to poison a second run the same way."""
    import deltalab.train.loop as loop

    original = loop._loss
    calls = {"n": 0}

    def poisoned(model, window, autocast):
        loss = original(model, window, autocast)
        if model.training:
            calls["n"] += 1
            if calls["n"] == call:
                return loss * float("nan")
        return loss

    monkeypatch.setattr(loop, "_loss", poisoned)
    return calls


def _metrics(run: Path) -> dict:
    return json.loads((run / "metrics.json").read_text())


def _flatten(tree: dict, prefix: str = "") -> list[tuple[str, str]]:
    import json

    items = []
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and key != "overrides":
            items.extend(_flatten(value, name + "."))
        else:
            items.append((name, json.dumps(value)))
    return items


@pytest.mark.parametrize("mixer", MIXER_KINDS)
def test_a_few_steps_lower_the_held_out_loss(tmp_path, corpus, mixer):
    result = train(run_config(tmp_path, corpus, f"model.mixer={mixer}", "train.steps=10"))
    assert result.final_perplexity < result.initial_perplexity
    assert all(math.isfinite(loss) for loss in result.losses) and len(result.losses) == 10


def test_run_writes_checkpoint_export_metrics_curve_and_sample(tmp_path, corpus):
    result = train(run_config(tmp_path, corpus))
    run = tmp_path / "run"
    exported = ("model/config.json", "model/tokenizer.json", "model/tokenizer_config.json")
    for name in ("config.yaml", "metrics.json", "loss_curve.png", "log.jsonl", *exported):
        assert (run / name).stat().st_size > 0, name
    assert [p.name for p in list_checkpoints(run)] == ["step_00000003.pt", "step_00000006.pt"]
    assert isinstance(result.sample, str)


def test_the_printed_sample_escapes_control_bytes_and_the_metrics_keep_them(
    tmp_path, corpus, capsys
):
    # Two steps leave a byte model close to uniform: a sample of 200 tokens at temperature 1
    # holds control bytes (ESC, CR, ...), which would act on the terminal.
    run = train(
        run_config(
            tmp_path, corpus, "train.steps=2", "eval.sample_tokens=200",
            "eval.sample_temperature=1.0",
        )
    )  # fmt: skip
    controls = [c for c in run.sample if unicodedata.category(c) == "Cc" and c not in "\n\t"]
    assert controls, "the sample holds no control character to escape"
    printed = capsys.readouterr().out.split("sample:\n", 1)[1]
    assert not [c for c in printed if unicodedata.category(c) == "Cc" and c not in "\n\t"]
    assert f"\\x{ord(controls[0]):02x}" in printed
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["sample"] == run.sample


def test_no_sample_line_when_no_sample_is_asked_for(tmp_path, corpus, capsys):
    result = train(run_config(tmp_path, corpus, "train.steps=2", "eval.sample_tokens=0"))
    assert result.sample == ""
    assert "sample:" not in capsys.readouterr().out


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_non_finite_loss_stops_or_skips_per_config(tmp_path, corpus, monkeypatch, policy):
    poison_loss_at(monkeypatch, 2)
    config = run_config(tmp_path, corpus, f"train.nan_policy={policy}")
    if policy == "stop":
        with pytest.raises(FloatingPointError, match=r"not finite.*train.nan_policy=stop") as e:
            train(config)
        # Step 2 fails before the first checkpoint (step 3) is due.
        assert "no checkpoint was written" in str(e.value)
    else:
        result = train(config)
        assert len(result.losses) == 5 and all(math.isfinite(x) for x in result.losses)


def test_a_diverging_recurrent_model_is_stopped_by_the_policy_with_a_hint(tmp_path, corpus):
    # At this learning rate the gates go NaN inside the forward, where the op refuses them.
    diverging = ("optim.lr=1000", "schedule.warmup_steps=0", "optim.grad_clip=0")
    with pytest.raises(DivergenceError, match=r"step 2 is not finite \(the model produced") as e:
        train(run_config(tmp_path, corpus, "model.mixer=gdn", *diverging))
    assert "no checkpoint was written" in str(e.value) and "lower optim.lr" in str(e.value)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_a_diverged_run_under_skip_ends_cleanly_and_says_so(tmp_path, corpus, monkeypatch, graphs):
    """With train.cuda_graphs too, where the steps refused by the model's value checks do not
    count as the graph's warmup steps (passes that stopped early leave kernels unrun): from
    step 2 on every step is refused, so the graph is never recorded."""
    import deltalab.train.graphs as graph_module

    stepped = []
    monkeypatch.setattr(graph_module.StepGraph, "step", lambda self, w: stepped.append(w))
    diverging = ("optim.lr=1000", "schedule.warmup_steps=0", "optim.grad_clip=0")
    settings = ("model.mixer=muir", "train.nan_policy=skip", f"train.cuda_graphs={graphs}")
    result = train(run_config(tmp_path, corpus, *settings, *diverging))
    assert len(result.losses) == 1 and result.sample == ""
    metrics = _metrics(tmp_path / "run")
    assert (metrics["status"], metrics["skipped_steps"]) == ("completed", 5)
    assert not stepped


def test_corpus_smaller_than_one_sequence_is_refused(tmp_path, corpus):
    with pytest.raises(ValueError, match=r"seq_len=100000 needs at least"):
        train(run_config(tmp_path, corpus, "train.seq_len=100000"))


def test_a_single_text_file_trains_on_its_head_and_evaluates_on_its_tail(tmp_path, corpus):
    # One document used to fall whole into one split, leaving the other empty.
    book = tmp_path / "book.txt"
    book.write_text("".join(p.read_text() for p in sorted(Path(corpus).glob("*.txt"))))
    result = train(run_config(tmp_path, str(book)))
    assert len(result.losses) == 6 and result.final_perplexity < result.initial_perplexity


def test_missing_data_path_is_refused(tmp_path, corpus):
    with pytest.raises(ValueError, match=r"does-not-exist"):
        train(run_config(tmp_path, str(tmp_path / "does-not-exist")))


def test_gradient_accumulation_and_recomputation_keep_the_loss_curve(
    tmp_path, corpus, monkeypatch, capsys
):
    """grad_accum=2 to rounding; activation checkpointing of the blocks and the recomputed FFN
    branches (which the run does compute again) bit for bit. With both set, the blocks are
    checkpointed whole (no FFN branch recomputed apart) and the run says the FFN setting does
    nothing."""
    import deltalab.models.lm as lm

    plain = train(run_config(tmp_path / "plain", corpus))
    accumulated = train(run_config(tmp_path / "accum", corpus, "train.grad_accum=2"))
    branches = []
    real = lm.recomputed
    monkeypatch.setattr(lm, "recomputed", lambda fn, *args: branches.append(fn) or real(fn, *args))
    capsys.readouterr()
    both = ("train.activation_checkpointing=true", "train.recompute_ffn=true")
    recomputed = train(run_config(tmp_path / "ckpt", corpus, *both))
    assert "train.recompute_ffn=true does nothing" in capsys.readouterr().out
    assert not branches
    ffn_recomputed = train(run_config(tmp_path / "ffn", corpus, "train.recompute_ffn=true"))
    assert branches
    assert torch.allclose(torch.tensor(accumulated.losses), torch.tensor(plain.losses), atol=1e-5)
    assert recomputed.losses == plain.losses
    assert ffn_recomputed.losses == plain.losses


def test_tensorboard_events_are_written_when_enabled(tmp_path, corpus):
    pytest.importorskip("tensorboard")
    train(run_config(tmp_path, corpus, "log.tensorboard=true"))
    assert any((tmp_path / "run" / "tb").glob("events.out.tfevents.*"))


def test_run_directories_inside_the_data_source_are_refused(tmp_path, corpus):
    with pytest.raises(ValueError, match=r"log.out_dir .* lies inside data.source"):
        train(run_config(tmp_path, corpus, f"log.out_dir={corpus}/run"))


def test_a_run_with_a_local_tokenizer_exports_it_for_generate(tmp_path, corpus, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from deltalab.cli import main

    raw = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"])
    raw.train_from_iterator(["def item_1 = value(2)", "return self"] * 30, trainer)
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, unk_token="<unk>", eos_token="</s>"
    ).save_pretrained(tmp_path / "tok")
    train(run_config(tmp_path, corpus, f"data.tokenizer={tmp_path / 'tok'}"))
    assert (tmp_path / "run" / "model" / "tokenizer_config.json").exists()
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "run" / "model"), "def", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("def")


@pytest.mark.parametrize(
    ("checkpointing", "mixer"), [(False, "gdn"), (False, "kdn_diag"), (True, "gdn")]
)
def test_a_training_forwards_value_checks_read_back_once_unless_checkpointing(
    tmp_path, corpus, monkeypatch, checkpointing, mixer
):
    """Inside a training step's forward every value check is queued in the trainer's block
    (read back together at its end, one host read instead of one per layer); with activation
    checkpointing, which a check held to the forward's end would undercut (it keeps its input
    alive), none is: each is read at once or at the end of the op that made it."""
    import deltalab.train.loop as loop
    from deltalab.ops import _checks

    counts = {True: 0, False: 0}  # not held by the trainer's block -> how many
    in_training = {True: 0, False: 0}
    failed, loss_of = _checks._failed, loop._loss
    trainer_block = []

    def counting(x, kind, passed, check):
        block = _checks._QUEUED.get()
        counts[block is None or block is not trainer_block[-1]] += 1
        return failed(x, kind, passed, check)

    def loss(model, window, autocast):
        trainer_block.append(_checks._QUEUED.get())  # the trainer's block, or None
        before = dict(counts)
        out = loss_of(model, window, autocast)
        if model.training:
            for now in counts:
                in_training[now] += counts[now] - before[now]
        return out

    monkeypatch.setattr(_checks, "_failed", counting)
    monkeypatch.setattr(loop, "_loss", loss)
    train(run_config(tmp_path, corpus, f"model.mixer={mixer}",
                     f"train.activation_checkpointing={str(checkpointing).lower()}"))  # fmt: skip
    # Without checkpointing every one is held by the trainer's block, with it none.
    assert in_training[checkpointing] > 0
    assert in_training[not checkpointing] == 0
