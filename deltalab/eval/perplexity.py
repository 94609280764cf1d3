"""Perplexity (per token) and the loss per byte (nats and bits) on held-out text.

The text is the data layer's token stream (the built-in corpus's held-out split by default, or
the user's files), cut into windows exactly as the training loop's evaluation cuts it
(`PackedSequences`: every token but the first is predicted once). The loss is the sum of all
token losses divided by the number of tokens, not a mean of batch means.
"""

from __future__ import annotations

import math

import torch

from deltalab.eval.common import EvalError, source_tokens, stream_token_nll, token_bytes
from deltalab.eval.settings import PerplexitySettings
from deltalab.eval.tasks import TaskContext, TaskOutcome

__all__ = ["PerplexitySettings", "perplexity"]


@torch.no_grad()
def perplexity(settings: PerplexitySettings, ctx: TaskContext) -> TaskOutcome:
    from deltalab.data import PackedSequences

    loaded = ctx.checkpoint
    assert loaded is not None
    seq_len = settings.seq_len or loaded.trained_length or 1024
    loaded.allow_context(seq_len, ctx.long_context)
    tokens = source_tokens(settings, loaded.tokenizer)
    try:
        windows = PackedSequences(tokens, seq_len)
    except ValueError as error:
        raise EvalError(f"seq_len={seq_len}: {error}") from error
    count = len(windows)
    if settings.max_tokens is not None:
        count = min(count, max(1, settings.max_tokens // seq_len))
    total_nll, total_tokens, total_bytes = 0.0, 0, 0
    bar = ctx.bar(total=count * seq_len, unit="tok", desc="perplexity")
    for start in range(0, count, settings.batch_size):
        batch = torch.stack(
            [windows[i] for i in range(start, min(start + settings.batch_size, count))]
        )
        nll = stream_token_nll(loaded.model, batch, settings.segment_len)
        # Sums in float64: over a million tokens a float32 running sum loses digits.
        total_nll += nll.double().sum().item()
        total_tokens += nll.numel()
        total_bytes += token_bytes(loaded.tokenizer, batch[:, 1:].flatten())
        bar.update(nll.numel())
    bar.close()
    loss = total_nll / total_tokens
    # Per byte: the same summed loss over the UTF-8 bytes the predicted tokens stand for, so
    # nats_per_byte = loss * tokens / bytes, comparable across tokenizers.
    npb = total_nll / total_bytes if total_bytes else float("nan")
    bpb = npb / math.log(2)
    metrics = {
        "loss": loss,
        "nats_per_byte": npb,
        "perplexity": math.exp(loss),
        "bits_per_byte": bpb,
        "tokens": total_tokens,
        "bytes": total_bytes,
        "windows": count,
        "seq_len": seq_len,
    }
    table = (
        "| tokens | seq_len | loss (nats/token) | perplexity | bits/byte |\n|---|---|---|---|---|\n"
        f"| {total_tokens} | {seq_len} | {loss:.4f} | {math.exp(loss):.3f} | {bpb:.4f} |"
    )
    summary = {"loss": loss, "perplexity": math.exp(loss), "bits_per_byte": bpb}
    return TaskOutcome(metrics=metrics, summary=summary, table=table)
