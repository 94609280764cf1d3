"""`deltalab generate`: prompt in, text out, from a saved checkpoint."""

from __future__ import annotations

import math
import unicodedata
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deltalab.errors import CheckpointError, ConfigError, DataError, UserError

__all__ = [
    "ContextLengthWarning",
    "GenerateConfig",
    "continuation",
    "generate_text",
    "load_model",
    "printable",
    "require_dtype",
]

# What `dtype="auto"` gives on each device type: bfloat16 where a CUDA GPU computes it (the
# precision training runs its products in, and the one docs/PERFORMANCE.md's decoding figures
# are measured in), float32 elsewhere (the CPU paths' tests and figures are float32's).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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
    dtype: str = "auto"

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
        device = require_device(self.device, "generate device")
        require_dtype(self.dtype, device, "generate dtype")


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


def require_device(device: object, name: str = "device") -> torch.device:
    """`device` as a torch device this machine has (cpu, cuda, cuda:N, mps; "auto": the first
    CUDA GPU where torch finds one, else the CPU); ConfigError naming `name` otherwise, before
    anything is loaded onto it."""
    if device == "auto":
        found = torch.cuda.is_available() and torch.cuda.device_count() > 0
        return torch.device("cuda" if found else "cpu")
    try:
        parsed = torch.device(device)  # type: ignore[arg-type]
    except (RuntimeError, TypeError, ValueError):
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"{name} must be auto, cpu, cuda, cuda:N or mps, got {device!r}")
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"{name} {device!r} needs a CUDA GPU, and torch finds none here")
        if parsed.index is not None and parsed.index >= count:
            raise ConfigError(
                f"{name} {device!r} names a CUDA GPU this machine lacks (it has {count}: "
                f"cuda:0 to cuda:{count - 1})"
            )
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"{name} {device!r} needs Apple's MPS, which torch finds unavailable")
    return parsed


def require_dtype(dtype: object, device: torch.device, name: str = "dtype") -> torch.dtype:
    """`dtype` ("auto", "float32", "bfloat16" or a torch dtype of those) as the torch dtype a
    model on `device` computes in ("auto": `DTYPES`'s comment); ConfigError naming `name`
    otherwise. No float16: a model trained under bfloat16 autocast may hold activations past
    float16's range."""
    if dtype == "auto":
        # bfloat16 arithmetic from compute capability 8.0 (Ampere) on, of `device` itself.
        cuda = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)
        return torch.bfloat16 if cuda else torch.float32
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ConfigError(f"{name} must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")


def _reason(error: BaseException) -> str:
    """The first line of an error from another library (the rest is its stack of advice)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def load_model(
    checkpoint: str,
    *,
    tokenizer: str | None = None,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "auto",
):
    """(model in eval mode on `device` (`require_device`: "auto" too) with its weights in
    `dtype` (`require_dtype`), tokenizer) of a `save_pretrained` directory; the tokenizer is
    `tokenizer` ("byte" or a local path), else the one saved beside the model, else bytes. A
    device this machine lacks is a ConfigError, a checkpoint or tokenizer that does not load a
    CheckpointError or DataError naming its path."""
    from transformers import AutoModelForCausalLM

    import deltalab.models  # noqa: F401  (registers the model type)
    from deltalab.data import load_tokenizer

    device = require_device(device)
    dtype = require_dtype(dtype, device)
    path = Path(checkpoint)
    if not (path / "config.json").exists():
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds no config.json; expected a save_pretrained "
            "directory such as a run's model/"
        )
    spec = tokenizer
    if spec is None:
        spec = str(path) if (path / "tokenizer_config.json").exists() else "byte"
    try:
        loaded = load_tokenizer(spec)
    except UserError:
        raise
    except Exception as error:
        raise DataError(f"tokenizer {spec!r} does not load: {_reason(error)}") from error
    try:
        # The backend a model was trained with is a choice of that machine (a GPU's Triton
        # kernels): inference picks the fastest one available where it runs.
        model = AutoModelForCausalLM.from_pretrained(path, backend="auto")
    except Exception as error:
        # Whatever went wrong inside transformers (a truncated safetensors file, broken JSON,
        # mismatched weights), the user needs the path and the reason, not the stack.
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not load: {_reason(error)}"
        ) from error
    return model.to(device=device, dtype=dtype).eval(), loaded


class ContextLengthWarning(UserWarning):
    """A full-attention model asked for more tokens than it was trained on: it still answers,
    at positions it never saw."""


def _warn_past_trained_length(model: Any, checkpoint: str, total: int) -> None:
    """One ContextLengthWarning when a model with full-attention layers is to read `total`
    tokens (prompt and continuation) past the length its run trained on (the run's
    config.yaml beside `model/`; unknown: no warning)."""
    from deltalab.eval.common import run_train_field
    from deltalab.layers.attention import Attention

    limited = any(isinstance(m, Attention) and m.window is None for m in model.modules())
    trained = run_train_field(checkpoint, "seq_len") if limited else None
    if trained is not None and total > trained:
        warnings.warn(
            f"{checkpoint} has full-attention layers and was trained on {trained} tokens; "
            f"prompt and continuation make {total}, so the tokens past {trained} come from "
            "positions it never saw",
            ContextLengthWarning,
            stacklevel=3,
        )


def generate_text(config: GenerateConfig) -> str:
    """The prompt's continuation (greedy at temperature 0, else sampled) by `model.generate`,
    which on CUDA replays its static-cache step as a CUDA graph (`CausalLM.generate`)."""
    device = require_device(config.device, "generate device")
    model, tokenizer = load_model(
        config.checkpoint, tokenizer=config.tokenizer, device=device, dtype=config.dtype
    )
    ids = tokenizer.encode(config.prompt) or [tokenizer.bos_id]
    _warn_past_trained_length(model, config.checkpoint, len(ids) + config.max_new_tokens)
    torch.manual_seed(config.seed)
    return continuation(
        model, tokenizer, ids, device, max_new_tokens=config.max_new_tokens,
        temperature=config.temperature, top_k=config.top_k, eos_token_id=tokenizer.eos_id,
    )  # fmt: skip


@torch.no_grad()
def continuation(
    model: Any,
    tokenizer: Any,
    ids: list[int],
    device: str | torch.device,
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None = None,
    eos_token_id: int | None = None,
) -> str:
    """The text `model.generate` continues the token ids `ids` with on `device`: greedy at
    temperature 0, else sampled (from the `top_k` likeliest tokens when given) from torch's
    generator; it stops at `eos_token_id` when given, else after `max_new_tokens`."""
    prompt = torch.tensor([ids], device=device)
    sampling = temperature > 0
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=max_new_tokens,
        do_sample=sampling,
        temperature=temperature if sampling else None,
        top_k=top_k if sampling else None,
        eos_token_id=eos_token_id,
        pad_token_id=tokenizer.pad_id,
    )
    return tokenizer.decode(out[0, prompt.shape[1] :].tolist())
