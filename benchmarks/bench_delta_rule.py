"""Times delta_rule's backends: forward and forward+backward, a table over chunk sizes.

    python -m benchmarks cpu delta_rule            # CPU, float32, B=1 T=4096 H=4 K=V=64

Prints medians and the speedup of each chunk size over the token loop (naive). Targets of
issue 2: chunk >= 10x naive for forward+backward, >= 3x for the forward alone (default chunk 64).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import forward_and_train_seconds
from deltalab.benchmarking import format_table
from deltalab.ops import delta_rule

TRAIN_TARGET, FORWARD_TARGET, DEFAULT_CHUNK = 10.0, 3.0, 64


def make_inputs(args, channel: bool, generator: torch.Generator):
    shape = (args.batch, args.length, args.heads, args.dim)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)

    def draw(*s, uniform=False):
        x = torch.rand(*s, generator=generator) if uniform else torch.randn(*s, generator=generator)
        return x.to(device=device, dtype=dtype)

    k = torch.nn.functional.normalize(draw(*shape), dim=-1)
    g = -draw(*(shape if channel else shape[:3]), uniform=True)
    return draw(*shape), draw(*shape[:3], 1, uniform=True) * k, k, draw(*shape), g


def time_backend(inputs, repeats, **kwargs):
    return forward_and_train_seconds(lambda *x: delta_rule(*x, **kwargs)[0], list(inputs), repeats)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64, help="K = V")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--naive-repeats", type=int, default=3)
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[16, 32, 64, 128, 256])


def run(args: argparse.Namespace) -> dict:
    generator = torch.Generator().manual_seed(0)
    print(
        f"delta_rule on {args.device}, {args.dtype}, B={args.batch} T={args.length} "
        f"H={args.heads} K=V={args.dim}; medians in ms; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    rows, verdicts = [], []
    for channel in (False, True):
        decay = "channel" if channel else "head"
        inputs = make_inputs(args, channel, generator)
        naive_fwd, naive_train = time_backend(inputs, args.naive_repeats, backend="naive")
        rows.append([decay, "naive", "-", naive_fwd * 1e3, naive_train * 1e3, 1.0, 1.0])
        for chunk in args.chunk_sizes:
            fwd, train = time_backend(inputs, args.repeats, backend="chunk", chunk_size=chunk)
            speed = (naive_fwd / fwd, naive_train / train)
            rows.append([decay, "chunk", chunk, fwd * 1e3, train * 1e3, *speed])
            if chunk == DEFAULT_CHUNK:
                ok = speed[0] >= FORWARD_TARGET and speed[1] >= TRAIN_TARGET
                verdicts.append(
                    f"{decay} decay, chunk {chunk}: forward {speed[0]:.1f}x (target {FORWARD_TARGET:g}x), "
                    f"fwd+bwd {speed[1]:.1f}x (target {TRAIN_TARGET:g}x): {'met' if ok else 'MISSED'}"
                )
    headers = [
        "decay",
        "backend",
        "chunk",
        "fwd ms",
        "fwd+bwd ms",
        "fwd vs naive",
        "fwd+bwd vs naive",
    ]
    print(format_table(headers, rows))
    print("\n".join(verdicts))

    return {"device": args.device, "columns": headers, "rows": rows, "verdicts": verdicts}
