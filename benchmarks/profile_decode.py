"""Where one decoded token's time goes: the kernels of a static-cache decoding step, by name.

    python -m benchmarks profile decode             # GPU, 340M presets
    python -m benchmarks profile decode --tiny      # CPU smoke run

`python -m benchmarks decode latency` times a 340M model's token at about 5 ms replayed from a
CUDA graph at any batch up to 64 on an H200, where reading its weights once takes about 0.15 ms:
the step is bound by something other than bytes. Per mixer this script prefills one random prompt of
`--context` tokens, builds the `StaticDecoder` (one CUDA graph replay per token on CUDA), replays
`--steps` tokens under `torch.profiler` and reports, per token: the wall time (under the
profiler, so with its overhead), the kernels' summed time, the kernel count, and the kernels
by total time with their count per token, so a step made slow by many small launches (count x
a few microseconds) tells itself apart from one made slow by a few heavy kernels. On CPU
(`--tiny`) the step runs eagerly and the table lists the ATen operators it dispatches instead
(`OperatorCounter`: the smoke run, and a count of what would launch on a GPU with the
CPU's paths). Random weights, bf16 on CUDA.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import add_model_arguments
from deltalab.benchmarking import OperatorCounter, format_table
from deltalab.models import CausalLM, build_config
from deltalab.models.static_decode import StaticDecoder


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cuda_totals(prof) -> dict[str, list[float]]:
    """The profiled CUDA kernels and copies: name -> [count, microseconds]."""
    totals: dict[str, list[float]] = {}
    for e in prof.key_averages():
        if e.device_type != torch.autograd.DeviceType.CUDA or not e.key:
            continue
        micros = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        entry = totals.setdefault(e.key[:100], [0, 0.0])
        entry[0] += e.count
        entry[1] += micros
    return totals


def rows_of(totals: dict[str, list[float]], steps: int) -> list[dict]:
    """name, count and microseconds per token, by time."""
    rows = [
        {"name": name, "per_token": count / steps, "us_per_token": micros / steps}
        for name, (count, micros) in totals.items()
    ]
    return sorted(rows, key=lambda r: -r["us_per_token"])


def profile_mixer(mixer: str, args, device: torch.device, dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    with torch.device(device):
        model = CausalLM(build_config(args.preset, mixer=mixer)).to(dtype).eval()
    prompt = torch.randint(0, model.config.vocab_size, (args.batch, args.context))
    with torch.no_grad():
        prefill = model(prompt.to(device), use_cache=True, logits_to_keep=1)
    room = 2 * args.steps + 4
    decoder = StaticDecoder(model, prefill.past_key_values, room, cuda_graph=device.type == "cuda")
    decoder.start(prefill.logits[:, -1])
    for _ in range(args.steps):  # untimed: the first replays
        decoder.step()
    synchronize(device)
    start = time.perf_counter()
    if device.type == "cuda":
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(args.steps):
                decoder.step()
            synchronize(device)
        totals = cuda_totals(prof)
    else:
        with OperatorCounter() as counter:
            for _ in range(args.steps):
                decoder.step()
        totals = counter.totals
    wall = (time.perf_counter() - start) / args.steps
    rows = rows_of(totals, args.steps)
    return {
        "mixer": mixer,
        "wall_ms_per_token": 1e3 * wall,
        "kernel_ms_per_token": sum(r["us_per_token"] for r in rows) / 1e3,
        "kernels_per_token": sum(r["per_token"] for r in rows),
        "layers": model.config.num_layers,
        "kernels": rows,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, ["gdn2", "muir", "kdn_diag", "transformer"])
    parser.add_argument("--context", type=int, default=None, help="prompt tokens (default 4096)")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    parser.add_argument("--steps", type=int, default=None, help="tokens profiled (default 16)")
    parser.add_argument("--top", type=int, default=15, help="kernels printed per mixer")


def run(args: argparse.Namespace) -> dict:
    if args.tiny:
        args.preset = "tiny"
    args.context = args.context or (16 if args.tiny else 4096)
    args.steps = args.steps or (2 if args.tiny else 16)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results = []
    for mixer in args.mixers:
        result = profile_mixer(mixer, args, device, dtype)
        results.append(result)
        print(
            f"\n{mixer}: {result['wall_ms_per_token']:.3f} ms a token (wall), "
            f"{result['kernel_ms_per_token']:.3f} ms of kernels, "
            f"{result['kernels_per_token']:.0f} kernels a token "
            f"({result['kernels_per_token'] / result['layers']:.1f} a layer of "
            f"{result['layers']})"
        )
        table = [
            [r["name"], f"{r['per_token']:g}", f"{r['us_per_token']:.1f}"]
            for r in result["kernels"][: args.top]
        ]
        print(format_table(["kernel", "per token", "us per token"], table))
    meta = {
        "preset": args.preset,
        "device": device.type,
        "dtype": str(dtype),
        "context": args.context,
        "batch": args.batch,
        "steps": args.steps,
    }
    return {"meta": meta, "results": results}
