"""`deltalab generate`: prompt in, text out, from a saved checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["GenerateConfig", "generate_text"]

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


def generate_text(config: GenerateConfig) -> str:
    """The prompt's continuation (greedy at temperature 0, else sampled). On CUDA through
    `static_generate` (CUDA graphs), elsewhere through `model.generate`."""
    from transformers import AutoModelForCausalLM

    import deltalab.models  # noqa: F401  (registers the model type)
    from deltalab.data import load_tokenizer
    from deltalab.models.static_decode import static_generate

    path = Path(config.checkpoint)
    if not (path / "config.json").exists():
        raise ValueError(
            f"checkpoint {str(path)!r} holds no config.json (a save_pretrained directory)"
        )
    spec = config.tokenizer
    if spec is None:
        spec = str(path) if (path / "tokenizer_config.json").exists() else "byte"
    tokenizer = load_tokenizer(spec)
    model = AutoModelForCausalLM.from_pretrained(path).to(config.device).eval()
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
