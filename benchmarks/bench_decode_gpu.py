"""Per-token decoding latency on the GPU: eager (`model(token, past_key_values=cache)`, what
`model.generate` runs per token) against the static cache replayed as a CUDA graph.

    python -m benchmarks decode latency            # GPU, 340M presets
    python -m benchmarks decode latency --tiny     # CPU smoke run

For each mixer and context: one random prompt is prefilled by the model's chunked forward (in
segments of 64K tokens, `deltalab.models.prefill`), and its cache is replicated to every
sequence of each batch (prefilling 256 x 32K tokens would take minutes; the decoding step costs
the same whatever the sequences hold). Then `--rounds` rounds of `--steps` tokens are timed per
path, each round from the prefilled cache, after one untimed round; the median round gives the
latency per token (of the whole batch). Random weights at the preset's shape, activations in
bfloat16 on CUDA (float32 on CPU). Configurations whose cache cannot fit in `--memory-fraction`
of the device memory are skipped and say so; on CPU the static path runs eagerly (no CUDA graphs
there) and is reported as "static_eager".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from benchmarks.common import add_model_arguments
from deltalab.benchmarking import format_table, median_seconds
from deltalab.models import CausalLM, RecurrentCache, build_config
from deltalab.models.prefill import PREFILL_SEGMENT, prefill
from deltalab.models.static_decode import WARMUP_STEPS, StaticDecoder
from deltalab.ops import delta_rule_step

GIB = 2**30


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def replicate(cache: RecurrentCache, batch: int) -> RecurrentCache:
    """The cache of one sequence as the cache of `batch` identical ones (expanded views: no
    memory until a path copies them)."""
    copy = RecurrentCache(len(cache.states))
    copy.seen_tokens = cache.seen_tokens
    for i, state in enumerate(cache.states):
        views = {
            f.name: value.expand(batch, *value.shape[1:])
            for f in dataclasses.fields(state)
            if f.name != "gates" and isinstance(value := getattr(state, f.name), torch.Tensor)
        }
        copy.states[i] = dataclasses.replace(state, **views)
    return copy


def time_rounds(run_round, rounds: int, device: torch.device) -> float:
    """Median seconds of `run_round()` over `rounds` timed rounds after one untimed round.

    `run_round(timed)` prepares its round (untimed), then calls `timed()` around the work."""
    times = []

    def timed(work) -> None:
        synchronize(device)
        start = time.perf_counter()
        work()
        synchronize(device)
        times.append(time.perf_counter() - start)

    for _ in range(rounds + 1):
        run_round(timed)
    return statistics.median(times[1:])


def eager_latency(model, cache, steps, rounds, generator, device) -> float:
    batch = cache.tensors()[0].shape[0]
    tokens = torch.randint(0, model.config.vocab_size, (steps, batch, 1), generator=generator)
    tokens = tokens.to(device)

    def run_round(timed) -> None:
        # The forward returns new states and leaves the prefilled ones as they were.
        current = RecurrentCache(len(cache.states))
        current.states, current.seen_tokens = list(cache.states), cache.seen_tokens

        def work() -> None:
            with torch.no_grad():
                for token in tokens:
                    model(token, past_key_values=current, use_cache=True)

        timed(work)

    return time_rounds(run_round, rounds, device) / steps


def static_latency(model, cache, steps, rounds, device) -> float:
    decoder = StaticDecoder(model, cache, steps, cuda_graph=device.type == "cuda")

    def run_round(timed) -> None:
        decoder.load(cache)

        def work() -> None:
            for _ in range(steps):
                decoder.step()

        timed(work)

    return time_rounds(run_round, rounds, device) / steps


def kernel_seconds(fn, device: torch.device, calls: int = 20) -> float:
    """Seconds per `fn()`: on CUDA replayed from a graph of `calls` calls (no Python in the
    timing, as in the decoder), else timed eagerly."""
    if device.type != "cuda":
        return median_seconds(fn, repeats=3)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compiles the kernel, outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return median_seconds(graph.replay, repeats=5) / calls


def step_kernel_timings(device, batches, heads, key_dim, value_dim, dtype) -> list[dict]:
    """`delta_rule_step` alone, per variant of what the generation path could do with the state:
    update it in place, write a new state, or write a new one and copy it back into a buffer
    (what a static cache would pay without in_place)."""
    backend = "triton" if device.type == "cuda" else "naive"
    rows = []
    for batch in batches:
        shape = (batch, heads, key_dim)
        k = torch.nn.functional.normalize(torch.randn(*shape, device=device), dim=-1)
        q, a, b = torch.randn(*shape, device=device).to(dtype), (0.5 * k).to(dtype), k.to(dtype)
        u = torch.randn(batch, heads, value_dim, device=device).to(dtype)
        g = -torch.rand(*shape, device=device)
        state = torch.randn(batch, heads, key_dim, value_dim, device=device)
        args = (q, a, b, u, g)

        def in_place(args=args, state=state) -> None:
            delta_rule_step(*args, state, backend=backend, in_place=True)

        def new_state(args=args, state=state) -> None:
            delta_rule_step(*args, state, backend=backend)

        def new_then_copy(args=args, state=state) -> None:
            state.copy_(delta_rule_step(*args, state, backend=backend)[1])

        state_bytes = state.numel() * state.element_size()
        row = dict(batch=batch, heads=heads, key_dim=key_dim, value_dim=value_dim)
        row["backend"], row["state_mib"] = backend, round(state_bytes / 2**20, 2)
        for name, fn in (("in_place", in_place), ("new", new_state), ("new_copy", new_then_copy)):
            seconds = kernel_seconds(fn, device)
            # The state is read once and written once by the step itself.
            row[name] = {
                "us": round(seconds * 1e6, 2),
                "state_gb_s": round(2 * state_bytes / seconds / 1e9, 1),
            }
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def memory_budget(device: torch.device, fraction: float) -> float:
    """Bytes a configuration may add to what is allocated now (inf on CPU)."""
    if device.type != "cuda":
        return float("inf")
    total = torch.cuda.get_device_properties(device).total_memory
    return fraction * total - torch.cuda.memory_allocated(device)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, ["gdn2", "muir", "kdn_diag", "transformer"])
    parser.add_argument("--contexts", type=int, nargs="+", default=None, help="default 4096 32768")
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="default 1 64 256")
    parser.add_argument("--steps", type=int, default=None, help="tokens per round (default 16)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 3)")
    parser.add_argument("--memory-fraction", type=float, default=0.8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def run(args: argparse.Namespace) -> dict:
    preset = "tiny" if args.tiny else args.preset
    contexts = args.contexts or ([32, 64] if args.tiny else [4096, 32768])
    batches = args.batches or ([1, 2] if args.tiny else [1, 64, 256])
    steps = args.steps or (2 if args.tiny else 16)
    rounds = args.rounds or (1 if args.tiny else 3)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    static_path = "static_graph" if device.type == "cuda" else "static_eager"
    generator = torch.Generator().manual_seed(0)
    began = time.perf_counter()

    meta = {
        "preset": preset,
        "device": device.type,
        "dtype": str(dtype),
        "steps_per_round": steps,
        "rounds": rounds,
        "statistic": "median over rounds of round time / steps, seconds per token of the batch",
        "prefill": "one random prompt per context, by the chunked forward in 64K segments; its cache is "
        "replicated to every sequence of the batch",
        "step_kernel": "delta_rule_step alone (gdn2's heads): the state updated in place, "
        "written to a new tensor, or written to a new tensor and copied back; CUDA: "
        "replayed from a graph of 20 calls",
        "paths": {
            "eager": "model(token, past_key_values=cache, use_cache=True) per token",
            static_path: "StaticDecoder.step(): static cache"
            + (", one CUDA graph replay per token" if device.type == "cuda" else ", eagerly"),
        },
    }
    # The step kernel alone, at the shape of the 340M presets (heads of 128 x 128).
    config = build_config(preset, mixer="gdn2")
    step_kernel = step_kernel_timings(
        device, batches, config.num_heads, config.head_dim, config.value_dim, dtype
    )
    rows, results = [], []
    for mixer in args.mixers:
        torch.manual_seed(0)
        with torch.device(device):
            model = CausalLM(build_config(preset, mixer=mixer)).to(dtype).eval()
        for context in contexts:
            prompt = torch.randint(0, model.config.vocab_size, (1, context), generator=generator)
            cache, prefill_s, forward_s = time_prefill(model, prompt.to(device), device)
            per_sequence = cache.nbytes()
            has_attention = any(kind == "attention" for kind in model.config.layer_kinds())
            for batch in batches:
                entry = dict(
                    mixer=mixer,
                    context=context,
                    batch=batch,
                    prefill_s=round(prefill_s, 3),
                    forward_s=forward_s and round(forward_s, 3),
                )
                # Static attention buffers hold context + steps slots; the eager cache is
                # copied by every step (torch.cat), so old and new copies coexist.
                grown = (context + max(steps, WARMUP_STEPS)) / context if has_attention else 1.0
                static_bytes = batch * per_sequence * grown
                eager_bytes = static_bytes * (2 if has_attention else 1)
                entry["cache_gib"] = round(static_bytes / GIB, 3)
                budget = memory_budget(device, args.memory_fraction)
                for path, needed, measure in (
                    ("eager", eager_bytes, eager_latency),
                    (static_path, static_bytes, static_latency),
                ):
                    if needed > budget:
                        entry[path] = (
                            f"skipped: needs ~{needed / GIB:.1f} GiB, budget {budget / GIB:.1f} GiB"
                        )
                    else:
                        replicated = replicate(cache, batch)
                        extra = (generator, device) if measure is eager_latency else (device,)
                        try:
                            seconds = measure(model, replicated, steps, rounds, *extra)
                            entry[path] = {
                                "ms_per_token": round(seconds * 1e3, 4),
                                "tokens_per_s": round(batch / seconds, 1),
                            }
                        except torch.OutOfMemoryError:
                            entry[path] = "out of memory"
                        del replicated
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
                results.append(entry)
                print(json.dumps(entry), flush=True)
                speed = f"{context / prefill_s / 1e3:.1f}K"
                if forward_s:
                    speed += f" ({forward_s / prefill_s:.2f}x fwd)"
                rows.append(
                    [mixer, context, batch, speed, *(_ms(entry[p]) for p in ("eager", static_path))]
                )
            del cache
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    meta["seconds"] = round(time.perf_counter() - began, 1)
    headers = ["mixer", "context", "batch", "prefill tokens/s", "eager ms", f"{static_path} ms"]
    print(format_table(headers, rows))
    return {"meta": meta, "step_kernel": step_kernel, "results": results}


@torch.no_grad()
def time_prefill(model, prompt: torch.Tensor, device: torch.device):
    """(cache, seconds of `prefill`, seconds of one plain forward over the prompt without a
    cache, the work a training step's forward does; None where the prompt is longer than one
    prefill segment, whose forward need not fit)."""
    # The kernels compile for this length first (the launch tables depend on it), so the
    # time is the reading alone.
    prefill(model, prompt[:, :PREFILL_SEGMENT])
    synchronize(device)
    start = time.perf_counter()
    cache, _ = prefill(model, prompt)
    synchronize(device)
    prefill_s = time.perf_counter() - start
    forward_s = None
    if prompt.shape[1] <= PREFILL_SEGMENT:
        start = time.perf_counter()
        model(prompt, use_cache=False, logits_to_keep=1)
        synchronize(device)
        forward_s = time.perf_counter() - start
    return cache, prefill_s, forward_s


def _ms(value: object) -> object:
    return value["ms_per_token"] if isinstance(value, dict) else "-"
