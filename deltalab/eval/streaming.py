"""Streaming extrapolation: one token stream far longer than the training length, read in
segments through the recurrent state, the loss reported per log-spaced position bucket.

The state is never reset (documents follow each other, separated by EOS, as in training), so
the loss at position p is the loss of a model that has read p tokens. A recurrent model's cache
has a fixed size, which `cache_bytes` shows; a full-attention model is refused past its trained
length, or windowed with `--long-context window` (its cache then holds the window).
"""

from __future__ import annotations

import itertools
import math
import resource
from pathlib import Path
from typing import Any

import torch

from deltalab.eval.common import (
    EvalError,
    checkpoint_label,
    source_tokens,
    stream_token_nll,
)
from deltalab.eval.settings import StreamingSettings
from deltalab.eval.tasks import TaskContext, TaskOutcome

__all__ = ["StreamingSettings", "bucket_edges", "plot_streaming", "streaming"]


def bucket_edges(length: int, first: int) -> list[int]:
    """[0, first, 2 first, 4 first, ..., length]: log-spaced position buckets."""
    edges = [0]
    edge = first
    while edge < length:
        edges.append(edge)
        edge *= 2
    return [*edges, length]


def _rss_bytes() -> int:
    """Resident memory of this process now (Linux), else its peak."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@torch.no_grad()
def streaming(settings: StreamingSettings, ctx: TaskContext) -> TaskOutcome:
    loaded = ctx.checkpoint
    assert loaded is not None
    loaded.allow_context(settings.tokens, ctx.long_context)
    stream = source_tokens(settings, loaded.tokenizer)
    if len(stream) < settings.tokens + 1:
        raise EvalError(
            f"tokens={settings.tokens} needs {settings.tokens + 1} tokens but source "
            f"{settings.source!r} split {settings.split!r} holds {len(stream)}; use split=all, "
            "a larger source or fewer tokens"
        )
    ids = torch.as_tensor(stream[0 : settings.tokens + 1].astype("int64"))[None]
    edges = bucket_edges(settings.tokens, settings.first_bucket)
    probes: list[dict[str, int]] = []
    probe_at = set(edges[1:])

    def probe(end: int, cache: Any) -> None:
        # One probe per bucket edge crossed, and after the first segment (the baseline).
        if not probes or any(probes[-1]["position"] < e <= end for e in probe_at):
            probes.append(
                {"position": end, "cache_bytes": cache.nbytes(), "rss_bytes": _rss_bytes()}
            )

    bar = ctx.bar(total=settings.tokens, unit="tok", desc="streaming")
    losses = stream_token_nll(
        loaded.model, ids, settings.segment_len, progress=bar, on_segment=probe
    )[0]
    bar.close()
    buckets = []
    for lo, hi in itertools.pairwise(edges):
        part = losses[lo:hi].double()
        buckets.append({"start": lo, "stop": hi, "tokens": hi - lo, "loss": part.mean().item()})
    trained = loaded.trained_length
    summary: dict[str, Any] = {"loss_all": losses.double().mean().item()}
    if trained is not None and trained < settings.tokens:
        summary["loss_within_trained"] = losses[:trained].double().mean().item()
        summary["loss_beyond_trained"] = losses[trained:].double().mean().item()
    summary["loss_last_bucket"] = buckets[-1]["loss"]
    summary["cache_mb_max"] = max(p["cache_bytes"] for p in probes) / 2**20
    summary["rss_growth_mb"] = (probes[-1]["rss_bytes"] - probes[0]["rss_bytes"]) / 2**20
    metrics = {
        "buckets": buckets,
        "memory": probes,
        "tokens": settings.tokens,
        "trained_length": trained,
        "attention_window_applied": loaded.window_applied,
    }
    lines = ["| positions | tokens | loss (nats/token) | cache MiB |", "|---|---|---|---|"]
    for bucket in buckets:
        cache = next((p["cache_bytes"] for p in probes if p["position"] >= bucket["stop"]), None)
        cache_text = "" if cache is None else f"{cache / 2**20:.3f}"
        lines.append(
            f"| [{bucket['start']}, {bucket['stop']}) | {bucket['tokens']} | {bucket['loss']:.4f} | {cache_text} |"
        )
    plot = plot_streaming([(checkpoint_label(loaded.path), metrics)], ctx.out_dir / "streaming.png")
    return TaskOutcome(metrics=metrics, summary=summary, table="\n".join(lines), files=[str(plot)])


def plot_streaming(runs: list[tuple[str, dict[str, Any]]], path: Path) -> Path:
    """Loss against position (log scale) for every run on one figure; a dotted line marks each
    run's trained length."""
    from deltalab.analysis._plot import finish_figure, new_figure

    fig = new_figure(figsize=(7, 4))
    ax = fig.add_subplot(1, 1, 1)
    for label, metrics in runs:
        buckets = metrics["buckets"]
        # The geometric middle of a bucket; the first bucket starts at 0, so its middle is half.
        xs = [
            math.sqrt(max(b["start"], 1) * b["stop"]) if b["start"] else b["stop"] / 2
            for b in buckets
        ]
        line = ax.plot(xs, [b["loss"] for b in buckets], "o-", label=label, ms=3)[0]
        if metrics.get("trained_length"):
            ax.axvline(metrics["trained_length"], color=line.get_color(), ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("position in the stream (tokens)")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title("streaming extrapolation (dotted: trained length)")
    return finish_figure(fig, ax, path, legend_size=8)
