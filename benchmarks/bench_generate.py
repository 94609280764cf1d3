"""Per-token cost of `model.generate` as a Hugging Face user calls it, against transformers'
own loop and the static decoder's step alone.

    python -m benchmarks decode generate            # GPU, 340M presets
    python -m benchmarks decode generate --tiny     # CPU smoke run

Per mixer and batch, one random prompt of `--context` tokens per sequence; three paths:

- `generate`: `model.generate(ids, max_new_tokens=n, do_sample=False)`, the default path (the
  static cache replayed as a CUDA graph on CUDA, `CausalLM.generate`);
- `loop`: the same call with `static_decoding=False` (transformers' loop);
- `step`: `StaticDecoder.step()` alone, from a prefilled cache (the graph replay on CUDA).

A generate path's cost per token is (time of n tokens - time of 1 token) / (n - 1): the prompt's
forward and the first token cancel. The median over `--rounds` timed calls, after one untimed
call (which captures the graph). Random weights, bfloat16 on CUDA, float32 on CPU; no end token,
so every call produces its n tokens. The aim: `generate` within 1.3x of `step`.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.common import add_model_arguments, save
from deltalab.benchmarking import format_table
from deltalab.models import CausalLM, build_config
from deltalab.models.static_decode import StaticDecoder


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_call(fn, rounds: int, device: torch.device) -> float:
    """Median seconds of fn() over `rounds` calls after one untimed call."""
    times = []
    for _ in range(rounds + 1):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[len(times[1:]) // 2]


def generate_ms(model, ids, tokens: int, rounds: int, device, **settings) -> float:
    """Milliseconds per token of `model.generate` past the first (see the module docstring)."""

    def call(n: int):
        def run() -> None:
            with torch.no_grad():
                model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=n,
                    min_new_tokens=None,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                    **settings,
                )

        return run

    longer = median_call(call(tokens), rounds, device)
    one = median_call(call(1), rounds, device)
    return 1e3 * (longer - one) / (tokens - 1)


def step_ms(model, ids, tokens: int, rounds: int, device) -> float:
    with torch.no_grad():
        prefill = model(ids, use_cache=True, logits_to_keep=1)
    decoder = StaticDecoder(
        model, prefill.past_key_values, tokens, cuda_graph=device.type == "cuda"
    )

    def run() -> None:
        decoder.load(prefill.past_key_values)
        decoder.start(prefill.logits[:, -1])
        for _ in range(tokens - 1):
            decoder.step()

    return 1e3 * median_call(run, rounds, device) / (tokens - 1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, ["gdn2", "kdn_diag", "kda", "transformer"])
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="default 1 64")
    parser.add_argument("--context", type=int, default=None, help="prompt tokens (default 512)")
    parser.add_argument("--tokens", type=int, default=None, help="new tokens (default 128)")
    parser.add_argument("--rounds", type=int, default=None, help="timed calls (default 3)")


def run(args: argparse.Namespace) -> dict:
    preset = "tiny" if args.tiny else args.preset
    batches = args.batches or ([1, 2] if args.tiny else [1, 64])
    context = args.context or (16 if args.tiny else 512)
    tokens = args.tokens or (4 if args.tiny else 128)
    rounds = args.rounds or (1 if args.tiny else 3)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # Off CUDA the default path is transformers' loop: the static decoder's eager step instead.
    default = {} if device.type == "cuda" else {"static_decoding": True}
    generator = torch.Generator().manual_seed(0)
    meta = {
        "preset": preset,
        "device": device.type,
        "dtype": str(dtype),
        "context": context,
        "tokens": tokens,
        "rounds": rounds,
    }
    results, rows = [], []
    for mixer in args.mixers:
        torch.manual_seed(0)
        with torch.device(device):
            model = CausalLM(build_config(preset, mixer=mixer)).to(dtype).eval()
        for batch in batches:
            ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=generator)
            ids = ids.to(device)
            entry = {
                "mixer": mixer,
                "batch": batch,
                "generate_ms": generate_ms(model, ids, tokens, rounds, device, **default),
                "loop_ms": generate_ms(model, ids, tokens, rounds, device, static_decoding=False),
                "step_ms": step_ms(model, ids, tokens, rounds, device),
            }
            entry["generate_over_step"] = entry["generate_ms"] / entry["step_ms"]
            results.append(entry)
            print(json.dumps(entry), flush=True)
            save(args, {"meta": meta, "results": results})
            rows.append(
                [mixer, batch]
                + [f"{entry[k]:.3f}" for k in ("generate_ms", "loop_ms", "step_ms")]
                + [f"{entry['generate_over_step']:.2f}"]
            )
        del model
    headers = ["mixer", "batch", "generate ms/token", "loop ms/token", "step ms/token", "ratio"]
    print(format_table(headers, rows))
    return {"meta": meta, "results": results}
