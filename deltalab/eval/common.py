"""What every task shares: loading a checkpoint, the context-length policy, scoring and decoding
through the recurrent cache, confidence intervals.

Long inputs are fed in segments of `segment_len` tokens through a `RecurrentCache`, so a
recurrent model reads any length in constant memory; attention layers keep their keys in the
cache, which grows unless a sliding window bounds it (`LongContext.WINDOW`).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from deltalab.errors import EvalError, UserError
from deltalab.eval.settings import TextSource

__all__ = [
    "LONG_CONTEXT_POLICIES",
    "EvalError",
    "LoadedCheckpoint",
    "greedy_decode",
    "load_checkpoint",
    "stream_token_nll",
    "wilson_interval",
]

LONG_CONTEXT_POLICIES = ("refuse", "window")


@dataclass
class LoadedCheckpoint:
    """A model ready to evaluate and what results need to say about it.

    trained_length: the sequence length it was trained on, from the run's `config.yaml` beside
        `model/` or given by the user; None when unknown.
    limited: whether some attention layer attends to the whole past (no sliding window), so the
        model may not be fed more than `trained_length` tokens unless windowed.
    """

    model: Any
    tokenizer: Any
    path: str
    config_hash: str
    mixer: str
    trained_length: int | None
    limited: bool
    window_applied: int | None = None
    notes: list[str] = field(default_factory=list)

    def describe(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "config_hash": self.config_hash,
            "mixer": self.mixer,
            "trained_length": self.trained_length,
            "attention_window_applied": self.window_applied,
        }

    def allow_context(self, length: int, policy: str) -> None:
        """Refuses (EvalError) or windows a full-attention model fed `length` > trained tokens.

        Never truncates: under "window" every full-attention layer attends to its last
        `trained_length` keys (and the cache keeps only those), the positions it was trained on.
        """
        if policy not in LONG_CONTEXT_POLICIES:
            raise EvalError(
                f"--long-context must be one of {list(LONG_CONTEXT_POLICIES)}, got {policy!r}"
            )
        if not self.limited or self.window_applied is not None:
            return
        if self.trained_length is None:
            raise EvalError(
                f"checkpoint {self.path} has full-attention layers and its trained length is "
                f"unknown (no run config.yaml beside it); a context of {length} tokens needs "
                "--trained-length N"
            )
        if length <= self.trained_length:
            return
        if policy == "refuse":
            raise EvalError(
                f"a context of {length} tokens is longer than the {self.trained_length} tokens "
                f"checkpoint {self.path} ({self.mixer}, full attention) was trained on; pass "
                f"--long-context window to attend over a sliding window of {self.trained_length} "
                "tokens, or use shorter settings"
            )
        from deltalab.layers.attention import Attention

        for module in self.model.modules():
            if isinstance(module, Attention):
                if module.window is None or module.window > self.trained_length:
                    module.window = self.trained_length
        self.window_applied = self.trained_length
        self.notes.append(f"sliding attention window of {self.trained_length} tokens applied")


def checkpoint_label(checkpoint: str) -> str:
    """A short name for a checkpoint: a run's `model/` is named after its run directory."""
    path = Path(checkpoint).resolve()
    return (path.parent.name if path.name == "model" else path.name) or str(checkpoint)


def _config_hash(path: Path) -> str:
    config = json.loads((path / "config.json").read_text())
    # Fields transformers rewrites on every save carry no information about the model.
    for volatile in ("transformers_version", "_name_or_path"):
        config.pop(volatile, None)
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def run_train_field(path: str | Path, name: str) -> int | None:
    """train.<name> (an int: seq_len, seed) of the run whose `model/` directory `path` is, if
    the run's config.yaml is beside it."""
    import yaml

    path = Path(path)
    run_config = path.parent / "config.yaml"
    if path.name != "model" or not run_config.is_file():
        return None
    try:
        data = yaml.safe_load(run_config.read_text())
        return int(data["train"][name])
    except (yaml.YAMLError, KeyError, TypeError, ValueError):
        return None


def load_checkpoint(
    checkpoint: str,
    *,
    tokenizer: str | None = None,
    device: str = "cpu",
    dtype: str = "auto",
    trained_length: int | None = None,
) -> LoadedCheckpoint:
    """A deltalab checkpoint directory (a run's `model/` or a `save_pretrained` folder), in eval
    mode on `device` with its weights in `dtype` (`deltalab.generate.load_model`), with its
    tokenizer; EvalError naming the path when it does not load."""
    from deltalab.generate import load_model

    path = Path(checkpoint)
    if trained_length is not None and trained_length < 1:
        raise EvalError(f"--trained-length must be a positive int, got {trained_length}")
    try:
        # Refuses a device this machine lacks, and names the checkpoint or tokenizer with the
        # reason when either does not load.
        model, tok = load_model(str(path), tokenizer=tokenizer, device=device, dtype=dtype)
    except UserError as error:
        raise EvalError(str(error)) from error
    config_hash = _config_hash(path)
    from deltalab.layers.attention import Attention

    config = model.config
    limited = any(
        isinstance(module, Attention) and module.window is None for module in model.modules()
    )
    return LoadedCheckpoint(
        model=model,
        tokenizer=tok,
        path=str(path),
        config_hash=config_hash,
        mixer=str(config.mixer),
        trained_length=(
            trained_length if trained_length is not None else run_train_field(path, "seq_len")
        ),
        limited=limited,
    )


def _segments(length: int, segment_len: int) -> list[tuple[int, int]]:
    from deltalab.models.prefill import segments

    try:
        return segments(length, segment_len)
    except ValueError as error:
        raise EvalError(str(error)) from None


@torch.no_grad()
def stream_token_nll(
    model: Any,
    ids: torch.Tensor,
    segment_len: int,
    *,
    attention_mask: torch.Tensor | None = None,
    progress: Any = None,
    on_segment: Any = None,
    with_greedy: bool = False,
) -> Any:
    """Next-token losses `[B, T - 1]` (nats, float32) of `ids [B, T]`, read in segments.

    Entry t is -log p(ids[t + 1] | ids[: t + 1]); the last token is only a target, never fed.
    Each segment continues the previous one's cache, so a recurrent model gives the losses of
    one full-length pass in constant memory. `attention_mask [B, T]` marks left padding (False).
    `on_segment(end, cache)` is called after each segment (memory probes); `progress` is a tqdm
    bar advanced by the tokens of each segment. With `with_greedy`, also returns `[B, T - 1]`
    bools: whether the target was the most likely token.
    """
    from deltalab.models.cache import RecurrentCache

    device = next(model.parameters()).device
    batch, length = ids.shape
    cache = RecurrentCache(len(model.model.blocks))
    losses = torch.empty(batch, max(length - 1, 0), dtype=torch.float32)
    greedy = torch.empty(batch, max(length - 1, 0), dtype=torch.bool)
    for start, stop in _segments(length - 1, segment_len):
        chunk = ids[:, start:stop].to(device)
        mask = None if attention_mask is None else attention_mask[:, start:stop].to(device)
        logits = model(input_ids=chunk, attention_mask=mask, past_key_values=cache, use_cache=True)
        targets = ids[:, start + 1 : stop + 1].to(device)
        nll = F.cross_entropy(logits.logits.flatten(0, 1), targets.flatten(), reduction="none")
        losses[:, start:stop] = nll.view(batch, -1).float().cpu()
        if with_greedy:
            greedy[:, start:stop] = (logits.logits.argmax(-1) == targets).cpu()
        if on_segment is not None:
            on_segment(stop, cache)
        if progress is not None:
            progress.update(stop - start)
    return (losses, greedy) if with_greedy else losses


@torch.no_grad()
def greedy_decode(
    model: Any,
    cache: Any,
    logits: torch.Tensor,
    max_new_tokens: int,
    *,
    stop: Any = None,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    static: bool | None = None,
) -> list[list[int]]:
    """Continues every row of a prefilled cache: greedy (temperature 0) or sampled.

    `stop(row, tokens) -> bool` ends a row early (its tokens so far are kept); decoding ends
    when every row has stopped. `static`: None (default) decodes on the static-cache decoder
    replayed as a CUDA graph on CUDA (`deltalab.models.static_decode`, the decoder kept on the
    model and reused) and token by token through the model's forward elsewhere; True or False
    choose. The static decoder gives the same greedy tokens; its samples come from the device's
    random generator, not `generator`.
    """
    if static is None:
        static = logits.device.type == "cuda"
    if static:
        return _static_decode(model, cache, logits, max_new_tokens, stop, temperature)
    batch = logits.shape[0]
    out: list[list[int]] = [[] for _ in range(batch)]
    done = [False] * batch
    for _ in range(max_new_tokens):
        if temperature > 0:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            token = torch.multinomial(probs.cpu(), 1, generator=generator)[:, 0]
        else:
            token = logits.argmax(dim=-1).cpu()
        for row in range(batch):
            if not done[row]:
                out[row].append(int(token[row]))
                done[row] = stop is not None and stop(row, out[row])
        if all(done):
            break
        device = logits.device
        step = model(input_ids=token[:, None].to(device), past_key_values=cache, use_cache=True)
        logits = step.logits[:, -1]
    return out


def _static_decode(
    model: Any, cache: Any, logits: torch.Tensor, max_new_tokens: int, stop: Any, temperature: float
) -> list[list[int]]:
    """`greedy_decode` on the model's kept static decoder; `stop` is asked after each
    `CHECK_EVERY` tokens the device produced, for each of them in order."""
    from deltalab.models.graph_generate import CHECK_EVERY, StaticPlan, kept_decoder

    plan = StaticPlan(temperature, None)
    cuda_graph = logits.device.type == "cuda"
    decoder = kept_decoder(model, cache, plan, max_new_tokens, cuda_graph)
    decoder.start(logits)
    batch = logits.shape[0]
    out: list[list[int]] = [[] for _ in range(batch)]
    done = [False] * batch
    seen = 0
    while seen < max_new_tokens and not all(done):
        end = min(seen + CHECK_EVERY, max_new_tokens)
        while decoder.produced < end:
            decoder.step()
        chunk = decoder.history[:, seen:end].cpu()
        for i in range(end - seen):
            for row in range(batch):
                if not done[row]:
                    out[row].append(int(chunk[row, i]))
                    done[row] = stop is not None and stop(row, out[row])
        seen = end
    return out


def wilson_interval(successes: float, trials: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion (stays inside [0, 1], sane at 0 and n)."""
    if trials == 0:
        return (0.0, 1.0)
    p = successes / trials
    denominator = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denominator
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denominator
    return (max(0.0, centre - half), min(1.0, centre + half))


def source_tokens(text: TextSource, tokenizer: Any) -> Any:
    """The token stream of `text` (documents joined by EOS, as in training), through the data
    layer's shard cache; EvalError naming the source when it is missing or empty."""
    from deltalab.data import CorpusConfig, prepare_tokens, resolve_source

    try:
        corpus = CorpusConfig(
            source=resolve_source(text.source),
            split=text.split,
            held_out_fraction=text.held_out_fraction,
            max_bytes=text.max_bytes,
            text_field=text.text_field,
        )
        return prepare_tokens(corpus, tokenizer, text.cache_dir)
    except (ValueError, ImportError) as error:
        raise EvalError(f"source {text.source!r}: {error}") from error


def source_documents(text: TextSource) -> Any:
    """The documents (strings) of `text`, lazily; EvalError naming a missing source."""
    from deltalab.data import CorpusConfig, iter_documents

    try:
        corpus = CorpusConfig(
            source=text.source,
            split=text.split,
            held_out_fraction=text.held_out_fraction,
            max_bytes=text.max_bytes,
            text_field=text.text_field,
        )
        return iter_documents(corpus)
    except (ValueError, ImportError) as error:
        raise EvalError(f"source {text.source!r}: {error}") from error


def token_bytes(tokenizer: Any, ids: Any) -> int:
    """UTF-8 bytes the tokens `ids` stand for (specials count 0): exact, token by token, for a
    byte-level tokenizer (`token_byte_lengths`); else the bytes of their decoded text."""
    lengths = getattr(tokenizer, "token_byte_lengths", lambda: None)()
    if lengths is not None:
        return int(lengths[torch.as_tensor(ids).long().cpu()].sum())
    return len(tokenizer.decode([int(i) for i in ids]).encode("utf-8"))
