"""`deltalab generate`: prompt in, text out, from a saved checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["GenerateConfig", "generate_text", "load_model"]


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


def load_model(checkpoint: str, *, tokenizer: str | None = None, device: str = "cpu"):
    """(model in eval mode on `device`, tokenizer) of a `save_pretrained` directory; the
    tokenizer is `tokenizer` ("byte" or a local path), else the one saved beside the model,
    else bytes."""
    from transformers import AutoModelForCausalLM

    import deltalab.models  # noqa: F401  (registers the model type)
    from deltalab.data import load_tokenizer

    path = Path(checkpoint)
    if not (path / "config.json").exists():
        raise ValueError(
            f"checkpoint {str(path)!r} holds no config.json (a save_pretrained directory)"
        )
    spec = tokenizer
    if spec is None:
        spec = str(path) if (path / "tokenizer_config.json").exists() else "byte"
    loaded = load_tokenizer(spec)
    model = AutoModelForCausalLM.from_pretrained(path).to(device).eval()
    return model, loaded


def generate_text(config: GenerateConfig) -> str:
    """The prompt's continuation (greedy at temperature 0, else sampled)."""
    model, tokenizer = load_model(
        config.checkpoint, tokenizer=config.tokenizer, device=config.device
    )
    ids = torch.tensor(
        [tokenizer.encode(config.prompt) or [tokenizer.bos_id]], device=config.device
    )
    torch.manual_seed(config.seed)
    sampling = config.temperature > 0
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
