"""A decoding step's matrix products at many sequences, each way the residual can be summed.

    python -m benchmarks decode products                    # GPU, the 340M GDN-2's products
    python -m benchmarks decode products --tiny             # CPU smoke run

At 64 sequences the decoder's products are cuBLAS's, and the two that sum into the residual
stream (the output projection and the FFN's down projection, `addmm_` in place) run its beta = 1
kernels, which read their weights at well under half the rate of the plain products beside them
(docs/PERFORMANCE.md, "Where a decoded token's time goes"). Per product of a layer of `--preset`
/ `--mixer` and per number of rows this times:

- `addmm_`: `residual.addmm_(x, w.t())`, what the decoder runs;
- `mm, add_`: the plain product into a buffer, then `residual.add_(buffer)`: two launches;
- `mm`: the plain product alone, the cost left if the sum moves into the kernel that reads the
  residual next (the next block's norm);

and the products without a residual (x's projections, the FFN's gate and up) as `mm`. Each
variant runs over one distinct weight per layer (as many as the model has) inside one CUDA graph,
replayed; the figure is the median replay over the layers, in us a product, with the rate the
weight is read at. Random inputs (never zeros), bf16 on CUDA; float32 and eager on CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from deltalab.benchmarking import format_table
from deltalab.models import CausalLM, build_config

VARIANTS = ("addmm_", "mm, add_", "mm")


def layer_products(preset: str, mixer: str) -> tuple[dict[str, tuple[int, int, bool]], int]:
    """The products of one block's decoding step, name -> (out, in, sums into the residual), and
    the number of blocks: x's projections concatenated (every map of the mixer's input but the
    output projection), the output projection, the FFN's gate and up, its down projection."""
    config = build_config(preset, mixer=mixer)
    with torch.device("meta"):
        block = CausalLM(config).model.blocks[0]
    width = config.hidden_size
    inputs = sum(
        m.out_features
        for name, m in block.mixer.named_modules()
        if isinstance(m, torch.nn.Linear) and m.in_features == width and name != "o_proj"
    )
    products = {
        "x's projections": (inputs, width, False),
        "output projection": (
            block.mixer.o_proj.out_features,
            block.mixer.o_proj.in_features,
            True,
        ),
        "FFN gate and up": (block.ffn.gate_up.out_features, width, False),
        "FFN down": (width, block.ffn.down.in_features, True),
    }
    return products, config.num_layers


def one_pass(variant: str, xs, weights, residual, buffer) -> None:
    for x, w in zip(xs, weights, strict=True):
        if variant == "addmm_":
            residual.addmm_(x, w.t())
        elif variant == "mm, add_":
            torch.mm(x, w.t(), out=buffer)
            residual.add_(buffer)
        else:
            torch.mm(x, w.t(), out=buffer)


def time_variant(variant, xs, weights, residual, buffer, repeats: int) -> float:
    """Median seconds of one pass over every layer's weight (a CUDA graph's replay on CUDA)."""
    device = residual.device
    if device.type == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # cuBLAS picks and warms its kernels outside the capture
                one_pass(variant, xs, weights, residual, buffer)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            one_pass(variant, xs, weights, residual, buffer)
        run = graph.replay
    else:
        one_pass(variant, xs, weights, residual, buffer)

        def run() -> None:
            one_pass(variant, xs, weights, residual, buffer)

    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        else:
            begin = time.perf_counter()
            run()
            times.append(time.perf_counter() - begin)
    return statistics.median(times[1:])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tiny", action="store_true", help="the tiny preset on the CPU")
    parser.add_argument("--preset", default="340M", help="model preset (default 340M)")
    parser.add_argument("--mixer", default="gdn2", help="the mixer whose layer's products")
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128],
                        help="sequences decoded together")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=50, help="timed replays (median)")


def run(args: argparse.Namespace) -> dict:
    preset = "tiny" if args.tiny else args.preset
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    repeats = 2 if args.tiny else args.repeats
    products, layers = layer_products(preset, args.mixer)
    gen = torch.Generator(device="cpu").manual_seed(0)
    results, table = [], []
    for rows in args.rows:
        for name, (n_out, n_in, summed) in products.items():
            weights = [
                (torch.randn(n_out, n_in, generator=gen) * n_in**-0.5).to(device, dtype)
                for _ in range(layers)
            ]
            xs = [torch.randn(rows, n_in, generator=gen).to(device, dtype) for _ in range(layers)]
            residual = torch.randn(rows, n_out, generator=gen).to(device, dtype)
            buffer = torch.empty_like(residual)
            for variant in VARIANTS if summed else ("mm",):
                seconds = time_variant(variant, xs, weights, residual, buffer, repeats) / layers
                read = n_out * n_in * weights[0].element_size()
                results.append(
                    {"rows": rows, "product": name, "shape": [n_out, n_in], "variant": variant,
                     "us": seconds * 1e6, "weight_tb_s": read / seconds / 1e12}
                )  # fmt: skip
                table.append([rows, name, f"{n_out} x {n_in}", variant, f"{seconds * 1e6:.2f}",
                              f"{read / seconds / 1e12:.2f}"])  # fmt: skip
    print(format_table(["rows", "product", "weight", "variant", "us", "weight TB/s"], table))
    meta = {"preset": preset, "mixer": args.mixer, "layers": layers, "device": device.type,
            "dtype": str(dtype), "repeats": repeats}  # fmt: skip
    return {"meta": meta, "results": results}
