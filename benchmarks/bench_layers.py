"""Times each token mixer's forward+backward: a table, and Muir against GDN-2.

    python -m benchmarks cpu layers        # CPU, float32, B=2 T=2048 D=256, 4 heads of 64

Prints the median time of each layer (input gradient included, as inside a model) and its ratio
to GDN-2. Target of issue 4: Muir (default ranks, dynamic read gate) <= 1.15x GDN-2.

The layers are timed in interleaved rounds (each round times every layer once, as the median of
`--repeats` runs): a shared machine's load then hits all layers alike, the table gives the median
over rounds, and the Muir / GDN-2 verdict uses the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable

import torch
from torch import nn

from deltalab.benchmarking import format_table, median_seconds
from deltalab.layers.attention import Attention
from deltalab.layers.deltanet import DeltaNet, GatedDeltaNet
from deltalab.layers.gdn2 import GatedDeltaNet2
from deltalab.layers.kda import KimiDeltaAttention
from deltalab.layers.muir import Muir

MUIR_TARGET = 1.15
LAYERS: dict[str, Callable[..., nn.Module]] = {
    "DeltaNet": DeltaNet,
    "GatedDeltaNet": GatedDeltaNet,
    "KimiDeltaAttention": KimiDeltaAttention,
    "GatedDeltaNet2": GatedDeltaNet2,
    "Muir": Muir,
    "Attention": Attention,
}


def time_train_step(layer: nn.Module, x: torch.Tensor, repeats: int) -> float:
    """Median seconds of forward + backward through `layer` (parameters and input)."""
    x = x.detach().requires_grad_()

    def step() -> None:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        y, _ = layer(x)
        y.sum().backward()

    return median_seconds(step, repeats)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)


def run(args: argparse.Namespace) -> dict:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    head_dim = args.hidden // args.heads
    sizes = {"hidden_size": args.hidden, "num_heads": args.heads, "head_dim": head_dim}
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, args.length, args.hidden, generator=generator)
    x = x.to(device=device, dtype=dtype)
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    print(
        f"mixers on {args.device}, {args.dtype}, B={args.batch} T={args.length} D={args.hidden} "
        f"H={args.heads} K=V={head_dim}, chunk {args.chunk_size}; forward+backward medians of "
        f"{args.repeats} x {args.rounds} rounds; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, load average {load}"
    )
    layers, counts = {}, {}
    for name, factory in LAYERS.items():
        torch.manual_seed(0)
        extra = {} if name == "Attention" else {"chunk_size": args.chunk_size}
        layers[name] = factory(**sizes, **extra).to(device=device, dtype=dtype)
        counts[name] = sum(p.numel() for p in layers[name].parameters())
    rounds: list[dict[str, float]] = [
        {name: time_train_step(layer, x, args.repeats) for name, layer in layers.items()}
        for _ in range(args.rounds)
    ]
    times = {name: statistics.median(r[name] for r in rounds) for name in LAYERS}
    base = times["GatedDeltaNet2"]
    rows = [[name, counts[name], times[name] * 1e3, times[name] / base] for name in LAYERS]
    print(format_table(["layer", "params", "fwd+bwd ms", "vs GDN-2"], rows))
    ratios = [r["Muir"] / r["GatedDeltaNet2"] for r in rounds]
    ratio = statistics.median(ratios)
    verdict = "met" if ratio <= MUIR_TARGET else "MISSED"
    spread = ", ".join(f"{r:.3f}" for r in ratios)
    print(f"Muir / GDN-2 = {ratio:.3f} (rounds: {spread}; target <= {MUIR_TARGET}): {verdict}")

    return {"device": args.device, "rows": rows, "muir_vs_gdn2_rounds": ratios}
