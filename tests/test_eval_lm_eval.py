"""The lm-evaluation-harness adapter, on tiny models built here and the local tasks of
tests/lm_eval_tasks (JSONL datasets beside their YAML; nothing is downloaded)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Nothing may be downloaded: the tasks' datasets are local JSONL files (set before lm_eval
# imports datasets, which reads these once).
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance

from deltalab.cli import main
from deltalab.eval.common import load_checkpoint
from deltalab.eval.lm_eval_model import DeltaLabLM
from deltalab.models import CausalLM, DeltaLabConfig

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "lm_eval_tasks"


def save_tiny(tmp_path: Path, mixer: str, *, uniform: bool = False) -> Path:
    torch.manual_seed(0)
    config = DeltaLabConfig(
        mixer=mixer, hidden_size=32, num_layers=2, num_heads=2, head_dim=16, chunk_size=16
    )
    model = CausalLM(config)
    if uniform:
        with torch.no_grad():
            model.lm_head.weight.zero_()  # tied: every logit is 0
    model.save_pretrained(tmp_path / mixer)
    return tmp_path / mixer


def requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


PAIRS = [
    ("def add(a, b):\n    return", " a + b"),
    ("x", " = 1"),
    ("import os\nimport sys\n\nprint(os.getcwd())", "\n"),
    ("for i in range(10):", "\n    print(i)"),
    ("", "hello"),
]


@pytest.mark.parametrize("mixer", ["gdn2", "transformer"])
def test_lm_eval_loglikelihoods_equal_a_direct_forward(tmp_path, mixer):
    loaded = load_checkpoint(str(save_tiny(tmp_path, mixer)), trained_length=256)
    # Batches of 3 with left padding, read in segments of 5 tokens through the cache.
    lm = DeltaLabLM(loaded=loaded, batch_size=3, segment_len=5)
    got = lm.loglikelihood(requests("loglikelihood", PAIRS), disable_tqdm=True)
    eos = loaded.tokenizer.eos_id
    for (context, continuation), (logprob, greedy) in zip(PAIRS, got, strict=True):
        context_ids = list(context.encode()) or [eos]
        target = list(continuation.encode())
        ids = torch.tensor([context_ids + target])
        with torch.no_grad():
            logits = loaded.model(input_ids=ids).logits[0, :-1].double().log_softmax(-1)
        rows = logits[len(context_ids) - 1 :]
        expected = rows[torch.arange(len(target)), torch.tensor(target)].sum().item()
        assert logprob == pytest.approx(expected, abs=1e-4)
        assert greedy == bool((rows.argmax(-1) == torch.tensor(target)).all())


def test_lm_eval_model_args_dtype_casts_the_weights(tmp_path):
    path = save_tiny(tmp_path, "gdn2")
    lm = DeltaLabLM(pretrained=str(path), device="cpu", dtype="bfloat16")
    assert {p.dtype for p in lm.model.parameters()} == {torch.bfloat16}
    lm = DeltaLabLM(pretrained=str(path), device="cpu")
    assert {p.dtype for p in lm.model.parameters()} == {torch.float32}


def test_lm_eval_rolling_loglikelihood_is_the_whole_text_after_eos(tmp_path):
    loaded = load_checkpoint(str(save_tiny(tmp_path, "muir")))
    lm = DeltaLabLM(loaded=loaded, batch_size=2, segment_len=7)
    texts = ["def f(x):\n    return x * 2\n" * 3, "short"]
    got = lm.loglikelihood_rolling(
        requests("loglikelihood_rolling", [(t,) for t in texts]), disable_tqdm=True
    )
    for text, value in zip(texts, got, strict=True):
        ids = torch.tensor([[loaded.tokenizer.eos_id, *text.encode()]])
        with torch.no_grad():
            logits = loaded.model(input_ids=ids).logits[0, :-1].double().log_softmax(-1)
        expected = logits[torch.arange(ids.shape[1] - 1), ids[0, 1:]].sum().item()
        assert value == pytest.approx(expected, abs=1e-4)


def test_lm_eval_rolling_windows_of_a_full_attention_model_cover_every_token(tmp_path):
    # 70 tokens, trained length 16: lm-eval's disjoint rolling windows, each within 16 tokens.
    loaded = load_checkpoint(
        str(save_tiny(tmp_path, "transformer", uniform=True)), trained_length=16
    )
    lm = DeltaLabLM(loaded=loaded, batch_size=4)
    (value,) = lm.loglikelihood_rolling(
        requests("loglikelihood_rolling", [("a" * 70,)]), disable_tqdm=True
    )
    assert value == pytest.approx(-70 * torch.log(torch.tensor(259.0)).item(), rel=1e-5)


def test_lm_eval_generate_until_batches_like_single_requests_and_cuts_at_until(tmp_path):
    loaded = load_checkpoint(str(save_tiny(tmp_path, "gdn2")))
    contexts = ["def f():\n    return", "x = 1\ny =", "import"]
    options = {"until": ["\n", "e"], "max_gen_toks": 12}
    batched = DeltaLabLM(loaded=loaded, batch_size=3, segment_len=4).generate_until(
        requests("generate_until", [(c, options) for c in contexts]), disable_tqdm=True
    )
    single = DeltaLabLM(loaded=loaded, batch_size=1).generate_until(
        requests("generate_until", [(c, options) for c in contexts]), disable_tqdm=True
    )
    assert batched == single
    assert all("\n" not in text and "e" not in text for text in batched)
    free = DeltaLabLM(loaded=loaded, batch_size=1).generate_until(
        requests("generate_until", [(contexts[0], {"until": [], "max_gen_toks": 12})]),
        disable_tqdm=True,
    )
    # 12 byte tokens decode to at most 12 characters (a byte that is no valid UTF-8 becomes one
    # U+FFFD, three bytes when encoded again: the bound is on characters, not bytes).
    assert free[0].startswith(single[0]) and len(free[0]) <= 12


def test_deltalab_eval_runs_local_lm_eval_tasks(tmp_path, monkeypatch, capsys):
    # The task YAMLs name their datasets relative to the repository root.
    monkeypatch.chdir(ROOT)
    checkpoint = save_tiny(tmp_path, "gdn2", uniform=True)
    out = tmp_path / "lm-eval"
    task = "lm-eval:deltalab_tiny_choice,deltalab_tiny_rolling,deltalab_tiny_gen"
    args = ["eval", str(checkpoint), "--task", task, f"include_path={TASKS}", "--out", str(out)]
    capsys.readouterr()
    assert main([*args, "--no-progress"]) == 0
    # No bar at all: loading the weights, building the datasets and requests, scoring.
    err = capsys.readouterr().err
    assert "it/s" not in err and "examples/s" not in err and "%|" not in err, err
    record = json.loads((out / "results.json").read_text())
    metrics = record["metrics"]
    assert set(metrics) >= {"deltalab_tiny_choice", "deltalab_tiny_rolling", "deltalab_tiny_gen"}
    # A uniform model: every byte costs log 259, whatever the text.
    assert metrics["deltalab_tiny_rolling"]["byte_perplexity"]["value"] == pytest.approx(
        259, rel=1e-4
    )
    assert metrics["deltalab_tiny_choice"]["acc"]["value"] in (0.0, 0.25, 0.5, 0.75, 1.0)
    assert "ci95" in metrics["deltalab_tiny_choice"]["acc"]
    assert record["summary"]["deltalab_tiny_gen/exact_match"] == 0.0
    assert (
        main(
            [
                "eval",
                str(checkpoint),
                "--task",
                "lm-eval:deltalab_tiny_chioce",
                f"include_path={TASKS}",
            ]
        )
        == 2
    )


def test_deltalab_lm_eval_command_runs_a_task_with_the_registered_model(tmp_path):
    # lm-eval's own command line through `python -m deltalab.lm_eval`, which registers the
    # model; lm-eval's built-in models (dummy here) stay registered beside it.
    checkpoint = save_tiny(tmp_path, "gdn2", uniform=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "deltalab.lm_eval", "--model", "deltalab"]
    args = ["--model_args", f"pretrained={checkpoint}", "--tasks", "deltalab_tiny_rolling"]
    args += ["--include_path", str(TASKS), "--device", "cpu"]
    result = subprocess.run(
        [*command, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    # A uniform model: every byte costs log 259.
    row = next(line for line in result.stdout.splitlines() if "byte_perplexity" in line)
    assert "259.0" in row
    code = (
        "from deltalab.lm_eval import register\n"
        "register()\n"
        "from lm_eval.api.registry import get_model\n"
        "print(get_model('deltalab').__name__, get_model('dummy').__name__)\n"
    )
    listed = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.split() == ["DeltaLabLM", "DummyLM"]
