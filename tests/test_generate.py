"""`deltalab generate`: its mistakes are one line and exit 2 as `deltalab eval`'s, a
Transformer pushed past its trained length says so once, and the terminal never receives raw
control bytes."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest
import torch

from deltalab.cli import main
from deltalab.generate import (
    GenerateConfig,
    generate_text,
    load_model,
    require_device,
    require_dtype,
)
from deltalab.models import CausalLM, DeltaLabConfig


def save_tiny(path: Path, mixer: str = "gdn2") -> Path:
    torch.manual_seed(0)
    config = DeltaLabConfig(
        mixer=mixer, hidden_size=32, num_layers=2, num_heads=2, head_dim=16, chunk_size=16
    )
    CausalLM(config).eval().save_pretrained(path)
    return path


def one_line_error(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("deltalab: error: ") and "\n" not in err, err
    assert "Traceback" not in err
    return err


def _truncated(tmp_path: Path) -> tuple[Path, list[str]]:
    model = save_tiny(tmp_path / "model")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return model, []


def _broken_config(tmp_path: Path) -> tuple[Path, list[str]]:
    model = save_tiny(tmp_path / "model")
    (model / "config.json").write_text('{"mixer": ')
    return model, []


def _tokenizer_file(tmp_path: Path) -> tuple[Path, list[str]]:
    (tmp_path / "tokenizer.txt").write_text("not a tokenizer\n")
    return save_tiny(tmp_path / "model"), ["--tokenizer", str(tmp_path / "tokenizer.txt")]


def _missing_gpu(tmp_path: Path) -> tuple[Path, list[str]]:
    # One index past the last GPU: "cuda" itself where there is none.
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return save_tiny(tmp_path / "model"), ["--device", f"cuda:{count}" if count else "cuda"]


def _bogus_device(tmp_path: Path) -> tuple[Path, list[str]]:
    return save_tiny(tmp_path / "model"), ["--device", "bogus"]


def _bogus_dtype(tmp_path: Path) -> tuple[Path, list[str]]:
    return save_tiny(tmp_path / "model"), ["--dtype", "float16"]


def test_device_auto_is_the_first_cuda_gpu_where_torch_finds_one_else_the_cpu():
    expected = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() else "cpu"
    assert require_device("auto") == torch.device(expected)


def test_dtype_auto_is_bfloat16_on_a_cuda_gpu_that_computes_it_else_float32():
    assert require_dtype("auto", torch.device("cpu")) == torch.float32
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            device = torch.device("cuda", index)
            ampere = torch.cuda.get_device_capability(device) >= (8, 0)
            assert require_dtype("auto", device) == (torch.bfloat16 if ampere else torch.float32)
    assert require_dtype("float32", torch.device("cpu")) == torch.float32
    assert require_dtype(torch.bfloat16, torch.device("cpu")) == torch.bfloat16


def test_a_loaded_model_is_in_the_dtype_asked_for_and_greedy_text_follows_its_forward(tmp_path):
    """load_model casts every weight to `dtype`, and `generate` in bfloat16 continues a prompt
    with the argmax of the bfloat16 model's own forward, token after token."""
    path = save_tiny(tmp_path / "model")
    model, _ = load_model(str(path), dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in load_model(str(path))[0].parameters()} == {torch.float32}
    ids = torch.tensor([[5, 17, 99, 3, 42]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                         do_sample=False, pad_token_id=0)  # fmt: skip
    with torch.no_grad():
        for t in range(ids.shape[1], out.shape[1]):
            logits = model(input_ids=out[:, :t]).logits[:, -1].float()
            assert int(logits.argmax(-1)) == int(out[0, t])


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (_truncated, r"checkpoint .*model' does not load: .*(header|metadata)"),
        (_broken_config, r"checkpoint .*model' does not load: .*config"),
        (_tokenizer_file, r"tokenizer .*tokenizer\.txt' is a file"),
        (_missing_gpu, r"device 'cuda(:\d+)?' .*CUDA"),
        (_bogus_device, r"--device must be .*cpu.*got 'bogus'"),
        (_bogus_dtype, r"--dtype must be one of auto, float32, bfloat16; got 'float16'"),
    ],
)
def test_a_checkpoint_or_device_that_cannot_be_used_is_one_line_and_exit_2(
    tmp_path, capsys, make, message
):
    model, extra = make(tmp_path)
    err = one_line_error(capsys, ["generate", str(model), "hi", "--max-new-tokens", "2", *extra])
    assert re.search(message, err), err


def _run_dir(tmp_path: Path, seq_len: int) -> Path:
    model = save_tiny(tmp_path / "run" / "model", mixer="transformer")
    (tmp_path / "run" / "config.yaml").write_text(f"train:\n  seq_len: {seq_len}\n")
    return model


def test_a_transformer_continued_past_its_trained_length_warns_once(tmp_path, capsys):
    model = _run_dir(tmp_path, seq_len=16)
    capsys.readouterr()
    assert main(["generate", str(model), "abcd", "--max-new-tokens", "30"]) == 0
    err = capsys.readouterr().err
    warned = [line for line in err.splitlines() if "trained on" in line]
    assert len(warned) == 1 and "16 tokens" in warned[0] and "34" in warned[0], err
    assert main(["generate", str(model), "abcd", "--max-new-tokens", "8"]) == 0
    assert "trained on" not in capsys.readouterr().err


def _controls(text: str) -> list[str]:
    return [c for c in text if unicodedata.category(c) == "Cc" and c not in "\n\t"]


def test_generated_control_bytes_are_escaped_on_the_terminal(tmp_path, capsys):
    model = save_tiny(tmp_path / "model")
    settings = {"max_new_tokens": 200, "temperature": 1.0, "seed": 3}
    exact = generate_text(GenerateConfig(checkpoint=str(model), prompt="def ", **settings))
    assert _controls(exact), "an untrained byte model's sample holds control bytes"
    capsys.readouterr()
    argv = ["generate", str(model), "def ", "--max-new-tokens", "200", "--temperature", "1"]
    assert main([*argv, "--seed", "3"]) == 0
    printed = capsys.readouterr().out
    assert not _controls(printed)
    assert printed.startswith("def ") and f"\\x{ord(_controls(exact)[0]):02x}" in printed


def test_prompt_control_bytes_are_escaped_on_the_terminal(tmp_path, capsys):
    model = save_tiny(tmp_path / "model")
    assert main(["generate", str(model), "a\x1b[2Jb", "--max-new-tokens", "4", "--seed", "0"]) == 0
    printed = capsys.readouterr().out
    assert not _controls(printed)
    assert printed.startswith("a\\x1b[2Jb")
