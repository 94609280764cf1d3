"""Training throughput of `deltalab train` per mixer (tokens/s, and peak GPU memory on CUDA).

    python -m benchmarks train                          # CPU: the tiny default, every mixer
    python -m benchmarks train --device cuda --preset 340M --seq-len 4096 --batch 4 \\
        --mixers gdn2 muir kdn_diag transformer          # GPU, bf16 autocast
    python -m benchmarks train --device cuda --preset 340M --seq-len 16384 --batch 1 \\
        --mixers gdn2 muir transformer --cuda-graphs both   # eager and graphed, side by side

Each mixer trains `--steps` steps of the real loop on the stdlib corpus; the figure is the
median tokens/s over the steps after the first `SKIPPED_STEPS` (compilation, allocator
warm-up, and with train.cuda_graphs its eager warmup steps and the capture), and its ratio to
the Transformer's (of the same `--cuda-graphs` mode) when "transformer" is among the mixers.
"peak GiB" is the most memory the tensors held, "reserved GiB" the most the allocator held
(its cache and a CUDA graph's pool included: a replay allocates nothing, so only this one
counts what a graph keeps). On a GPU just started, each training process can run faster than
the one before it: warm the GPU with a throwaway run before measuring, and
compare runs of one invocation; "both" runs each mixer's two modes back to back, graphed first.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
from pathlib import Path

import torch

from benchmarks.common import add_delta_rule_options, changed_options, delta_rule_options
from deltalab.benchmarking import format_table
from deltalab.errors import UserError
from deltalab.models import MIXER_KINDS
from deltalab.train import load_run_config, train
from deltalab.train.graphs import WARMUP_STEPS

# Steps left out of the median: the graph's eager warmup steps and its capture (the first
# eager steps also compile the kernels and warm the allocator, in either mode).
SKIPPED_STEPS = WARMUP_STEPS + 1
# "both" runs the graphed step first: where a GPU speeds up from one process to the next, that
# drift favours the eager run, not the graph's.
MODES = {"off": (False,), "on": (True,), "both": (True, False)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mixers", nargs="+", default=list(MIXER_KINDS))
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--cache-dir", default="runs/token-cache")
    parser.add_argument("--compile", action="store_true", help="train.compile=true")
    parser.add_argument(
        "--recompute-ffn",
        action="store_true",
        help="train.recompute_ffn=true: each block's FFN branch computed again in the backward",
    )
    parser.add_argument(
        "--cuda-graphs",
        choices=list(MODES),
        default="off",
        help="train.cuda_graphs: off (eager steps, the default here; the trainer's own default "
        "graphs single-GPU runs), on, or both (each mixer graphed, then eager)",
    )
    add_delta_rule_options(parser)


def run(args: argparse.Namespace) -> dict:
    if args.steps <= SKIPPED_STEPS:
        raise UserError(f"--steps must be > {SKIPPED_STEPS} (the steps left out of the median)")
    rows = []  # (mixer, graphed, cells)
    for mixer in args.mixers:
        for graphs in MODES[args.cuda_graphs]:
            name = f"{mixer} (graphs)" if graphs and args.cuda_graphs == "both" else mixer
            try:
                metrics = train_run(args, mixer, graphs)
            except Exception as error:  # one failing run must not take the others' rows
                print(f"{name}: failed: {type(error).__name__}: {error}")
                continue
            speeds = [r["tokens_per_s"] for r in metrics["history"]["train"][SKIPPED_STEPS:]]
            memory = [metrics.get(key) for key in ("peak_memory_bytes", "peak_reserved_bytes")]
            cells = [
                name,
                f"{metrics['parameters'] / 1e6:.1f}M",
                statistics.median(speeds),
                *("-" if m is None else f"{m / 2**30:.1f}" for m in memory),
            ]
            rows.append((mixer, graphs, cells))
    print(
        f"deltalab train, preset {args.preset}, {args.device}, batch {args.batch} x "
        f"{args.seq_len} tokens, {args.steps} steps{', torch.compile' if args.compile else ''}"
        f"{', FFN recomputed' if args.recompute_ffn else ''}"
        f"{', CUDA graphs ' + args.cuda_graphs if args.cuda_graphs != 'off' else ''}"
    )
    headers = ["mixer", "params", "tokens/s", "peak GiB", "reserved GiB"]
    # Throughput is compared as a ratio to the Transformer's tokens/s, measured in the same run:
    # each row against the Transformer's row of its own mode.
    references = {graphs: cells[2] for mixer, graphs, cells in rows if mixer == "transformer"}
    table = [cells for _, _, cells in rows]
    if references:
        headers.append("vs transformer")
        table = [
            [*cells, "-" if graphs not in references else f"{cells[2] / references[graphs]:.3f}x"]
            for _, graphs, cells in rows
        ]
    print(format_table(headers, table))
    return {"device": args.device, "columns": headers, "rows": table}


def train_run(args: argparse.Namespace, mixer: str, graphs: bool) -> dict:
    """One `deltalab train` run of `mixer`; returns its metrics.json."""
    if args.device == "cuda":
        # The runs share this process: the blocks an earlier run's allocator cached (a graph's
        # pool among them) go back first, so that "reserved GiB" is this run's alone.
        gc.collect()
        torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as out:
        config = load_run_config(
            None,
            [
                f"model.preset={args.preset}",
                f"model.mixer={mixer}",
                f"train.device={args.device}",
                f"train.seq_len={args.seq_len}",
                f"train.batch_size={args.batch}",
                f"train.steps={args.steps}",
                f"data.cache_dir={args.cache_dir}",
                "eval.batches=1",
                "eval.sample_tokens=0",
                "checkpoint.every=0",
                "log.progress=false",
                "log.tensorboard=false",
                f"log.out_dir={out}",
                f"train.compile={str(args.compile).lower()}",
                f"train.recompute_ffn={str(args.recompute_ffn).lower()}",
                f"train.cuda_graphs={str(graphs).lower()}",
                *(
                    f"model.overrides.kernel_options.{name}={json.dumps(value)}"
                    for name, value in changed_options(delta_rule_options(args)).items()
                ),
            ],
        )
        train(config)
        return json.loads((Path(out) / "metrics.json").read_text())
