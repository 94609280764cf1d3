"""Decoding speed against context length: a recurrent model stays flat, a transformer falls.

    python -m benchmarks decode context        # CPU, tiny preset, gdn2 vs transformer

For each model: prefill a random context of each length, then time token-by-token decoding
through the cache (median of rounds) and report tokens/s and the cache's size.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from deltalab.benchmarking import format_table
from deltalab.models import CausalLM, build_config


def decode_rate(
    model: CausalLM, context: int, steps: int, repeats: int, generator
) -> tuple[float, int]:
    """(tokens/s of `steps` cached decoding steps after `context` tokens, cache bytes)."""
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, context), generator=generator)
    tokens = torch.randint(0, vocab, (steps, 1, 1), generator=generator)
    times = []
    with torch.no_grad():
        prefill = model(prompt, use_cache=True).past_key_values
        for _ in range(repeats + 1):
            # The forward updates the cache in place: each round decodes from its own copy,
            # made outside the timed region.
            cache = copy.deepcopy(prefill)
            start = time.perf_counter()
            for token in tokens:
                cache = model(token, past_key_values=cache, use_cache=True).past_key_values
            times.append(time.perf_counter() - start)
    return steps / statistics.median(times[1:]), prefill.nbytes()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mixers", nargs="+", default=["gdn2", "transformer"])
    parser.add_argument("--contexts", type=int, nargs="+", default=[100, 4000])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)


def run(args: argparse.Namespace) -> dict:
    generator = torch.Generator().manual_seed(0)
    print(
        f"cached decoding, tiny preset, CPU float32, {args.steps} steps, median of "
        f"{args.repeats}; torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    rows = []
    for mixer in args.mixers:
        torch.manual_seed(0)
        model = CausalLM(build_config("tiny", mixer=mixer)).eval()
        rates = []
        for context in args.contexts:
            rate, nbytes = decode_rate(model, context, args.steps, args.repeats, generator)
            rates.append(rate)
            rows.append([mixer, context, rate, nbytes / 1024])
        print(
            f"{mixer}: tokens/s at {args.contexts[-1]} / at {args.contexts[0]} = {rates[-1] / rates[0]:.2f}"
        )
    headers = ["mixer", "context", "tokens/s", "cache KiB"]
    print(format_table(headers, rows))
    return {"device": "cpu", "columns": headers, "rows": rows}
