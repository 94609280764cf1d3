"""`deltalab generate`: prompt in, text out, from a saved checkpoint."""

from __future__ import annotations

import math
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import torch

from deltalab.errors import CheckpointError, ConfigError

__all__ = ["GenerateConfig", "generate_text", "load_model", "printable"]

# The top_k that model.generate samples with when none is given (transformers' default).
HF_DEFAULT_TOP_K = 50


@dataclass(frozen=True)
class GenerateConfig:
    """checkpoint: a `save_pretrained` directory. tokenizer: "byte", a local tokenizer path, or
    None to use the checkpoint's own (a tokenizer saved beside it, else bytes)."""

    checkpoint: str
    prompt: str
    max_new_tokens: int = 200
    temperature: float = 0.0
    top_k: int | None = None
    seed: int = 0
    tokenizer: str | None = None
    device: str = "cpu"

    def __post_init__(self) -> None:
        checks = (
            ("max_new_tokens", self.max_new_tokens, "an int >= 0", _is_int(self.max_new_tokens, 0)),
            ("temperature", self.temperature, "a finite number >= 0 (0: greedy)", _is_temp(self)),
            (
                "top_k",
                self.top_k,
                "null or an int >= 1",
                self.top_k is None or _is_int(self.top_k, 1),
            ),
            ("seed", self.seed, "an int >= 0", _is_int(self.seed, 0)),
        )
        for name, value, expected, ok in checks:
            if not ok:
                raise ConfigError(f"generate {name} must be {expected}, got {value!r}")


def printable(text: str) -> str:
    """`text` safe to print on a terminal: control characters other than newline and tab (the
    escape sequences, carriage returns and bells a byte model emits before it has learned
    text) are written as `\\xNN`. What is saved to files keeps the text as generated."""
    return "".join(
        f"\\x{ord(c):02x}" if unicodedata.category(c) == "Cc" and c not in "\n\t" else c
        for c in text
    )


def _is_int(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _is_temp(config: GenerateConfig) -> bool:
    value = config.temperature
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < math.inf


def load_model(checkpoint: str, *, tokenizer: str | None = None, device: str = "cpu"):
    """(model in eval mode on `device`, tokenizer) of a `save_pretrained` directory; the
    tokenizer is `tokenizer` ("byte" or a local path), else the one saved beside the model,
    else bytes."""
    from transformers import AutoModelForCausalLM

    import deltalab.models  # noqa: F401  (registers the model type)
    from deltalab.data import load_tokenizer

    path = Path(checkpoint)
    if not (path / "config.json").exists():
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds no config.json; expected a save_pretrained "
            "directory such as a run's model/"
        )
    spec = tokenizer
    if spec is None:
        spec = str(path) if (path / "tokenizer_config.json").exists() else "byte"
    loaded = load_tokenizer(spec)
    # The backend a model was trained with is a choice of that machine (a GPU's Triton kernels):
    # inference picks the fastest one available where it runs.
    model = AutoModelForCausalLM.from_pretrained(path, backend="auto").to(device).eval()
    return model, loaded


def generate_text(config: GenerateConfig) -> str:
    """The prompt's continuation (greedy at temperature 0, else sampled). On CUDA through
    `static_generate` (CUDA graphs), elsewhere through `model.generate`."""
    from deltalab.models.static_decode import static_generate

    model, tokenizer = load_model(
        config.checkpoint, tokenizer=config.tokenizer, device=config.device
    )
    ids = torch.tensor(
        [tokenizer.encode(config.prompt) or [tokenizer.bos_id]], device=config.device
    )
    torch.manual_seed(config.seed)
    sampling = config.temperature > 0
    if model.device.type == "cuda":
        # Static cache and CUDA graphs: the per-token cost of the GPU, not of Python. Greedy
        # tokens are those of model.generate; top_k as model.generate reads it (unset: 50,
        # 0: every token).
        top_k = HF_DEFAULT_TOP_K if config.top_k is None else config.top_k
        out = static_generate(
            model,
            ids,
            max_new_tokens=config.max_new_tokens,
            temperature=config.temperature if sampling else 0.0,
            top_k=(top_k or None) if sampling else None,
            eos_token_id=tokenizer.eos_id,
            pad_token_id=tokenizer.pad_id,
        )
        return tokenizer.decode(out[0, ids.shape[1] :].tolist())
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=config.max_new_tokens,
            do_sample=sampling,
            temperature=config.temperature if sampling else None,
            top_k=config.top_k if sampling else None,
            eos_token_id=tokenizer.eos_id,
            pad_token_id=tokenizer.pad_id,
        )
    return tokenizer.decode(out[0, ids.shape[1] :].tolist())
