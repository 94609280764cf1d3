"""Training throughput of `deltalab train` per mixer (tokens/s, and peak GPU memory on CUDA).

    python benchmarks/bench_train.py                       # CPU: the tiny default, every mixer
    python benchmarks/bench_train.py --device cuda --preset 340M --seq-len 4096 --batch 8 \\
        --mixers muir gdn2 transformer                     # H200, bf16 autocast

Each mixer trains `--steps` steps of the real loop on the stdlib corpus; the figure is the
median tokens/s over the steps after the first two (compilation and allocator warm-up), and
its ratio to the Transformer's when "transformer" is among the mixers. On a fresh GPU machine
each training process ran faster than the one before it (docs/RESULTS.md, 2026-12-02): warm
the machine with a throwaway run before measuring, and compare runs of one invocation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from deltalab.benchmarking import add_delta_rule_options, apply_delta_rule_options, format_table
from deltalab.models import MIXER_KINDS
from deltalab.train import load_run_config, train


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
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
    add_delta_rule_options(parser)
    args = parser.parse_args()
    apply_delta_rule_options(args)
    rows = []
    for mixer in args.mixers:
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
                ],
            )
            train(config)
            metrics = json.loads((Path(out) / "metrics.json").read_text())
        speeds = [r["tokens_per_s"] for r in metrics["history"]["train"][2:]]
        memory = metrics["peak_memory_bytes"]
        rows.append(
            [
                mixer,
                f"{metrics['parameters'] / 1e6:.1f}M",
                statistics.median(speeds),
                "-" if memory is None else f"{memory / 2**30:.1f}",
            ]
        )
    print(
        f"deltalab train, preset {args.preset}, {args.device}, batch {args.batch} x "
        f"{args.seq_len} tokens, {args.steps} steps{', torch.compile' if args.compile else ''}"
        f"{', FFN recomputed' if args.recompute_ffn else ''}"
    )
    headers = ["mixer", "params", "tokens/s", "peak GiB"]
    # The targets are ratios to the Transformer's tokens/s, measured in the same run.
    reference = next((row[2] for row in rows if row[0] == "transformer"), None)
    if reference is not None:
        headers.append("vs transformer")
        rows = [[*row, f"{row[2] / reference:.3f}x"] for row in rows]
    print(format_table(headers, rows))


if __name__ == "__main__":
    main()
