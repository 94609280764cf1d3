"""A decoding step's matrix products at many sequences, each way the residual can be summed.

    python -m benchmarks decode products                    # GPU, the 340M GDN-2's products
    python -m benchmarks decode products --tiny             # CPU smoke run

At 64 sequences the decoder's products are cuBLAS's, and the two that sum into the residual
stream (the output projection and the FFN's down projection, `addmm_` in place) run its beta = 1
kernels, which read their weights at less than half the rate of the wide plain products
(docs/PERFORMANCE.md, "Where a decoded token's time goes"), and are the narrowest. Per product of a layer of `--preset`
/ `--mixer` and per number of rows this times:

- `addmm_`: `residual.addmm_(x, w.t())`, what the decoder runs;
- `mm, add_`: the plain product into a buffer, then `residual.add_(buffer)`: two launches;
- `mm`: the plain product alone, the cost left if the sum moves into the kernel that reads the
  residual next (the next block's norm);

and the products without a residual (x's projections with the gates' first factors, their
block-diagonal second factors, the FFN's gate and up) as `mm`, with their bias where the layer
has one; each with the weight as `nn.Linear` stores it, [out, in], and stored transposed,
[in, out] (cuBLAS chooses its kernel by the layout too). Each variant runs over distinct
weights (one a layer, more for a small weight: 150 MB in all, past the L2 cache) as 10 passes
in one CUDA graph, replayed (`bench_decode_gpu.kernel_seconds`); the figure is the median
replay, in us a product, with the rate the weight is read at. Recurrent mixers (those with a
fused step). Random inputs (never zeros), bf16 on CUDA; float32 and eager on CPU.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch

from benchmarks.bench_decode_gpu import kernel_seconds
from deltalab.benchmarking import format_table
from deltalab.models import CausalLM, build_config

VARIANTS = ("addmm_", "mm, add_", "mm")
# A weight as `nn.Linear` stores it, [out, in] (multiplied as its transpose), or stored
# transposed, [in, out]: cuBLAS picks its kernels by the layout too.
LAYOUTS = ("[out, in]", "[in, out]")
# Distinct weights a product is timed over: at least one a layer, and enough bytes (three times
# an H100's or H200's 50 MB L2) that no weight is still cached when its turn comes again, as in
# the decoder, where the rest of a layer's weights pass between two reads of one.
MIN_BYTES = 150e6
# Passes over every weight in one CUDA graph (`kernel_seconds`): the graph's own launch is
# paid once for all of them.
PASSES = 10


@dataclass(frozen=True)
class Product:
    """One product of a layer's decoding step: weight [n_out, n_in], with a bias, summed into
    the residual stream."""

    n_out: int
    n_in: int
    bias: bool = False
    summed: bool = False


def layer_products(preset: str, mixer: str) -> tuple[dict[str, Product], int]:
    """The products of one block's fused decoding step (`deltalab.layers.decode_step`): x's
    projections with the gates' first factors concatenated, the block-diagonal second factors,
    the output projection, the FFN's gate and up and its down; and the number of blocks."""
    from deltalab.layers.decode_step import _layout, step_plan

    config = build_config(preset, mixer=mixer)
    with torch.device("meta"):
        block = CausalLM(config).model.blocks[0]
    plan = None if mixer == "transformer" else step_plan(block.mixer)
    if plan is None:
        raise SystemExit(f"decode products: {mixer!r} has no fused decoding step")
    layout = _layout(block.mixer, plan)
    first = layout.first + layout.downs
    o_proj, ffn = block.mixer.o_proj, block.ffn
    products = {
        "x's projections": Product(
            sum(m.out_features for m in first), config.hidden_size,
            bias=any(m.bias is not None for m in first),
        ),
        "output projection": Product(o_proj.out_features, o_proj.in_features, summed=True),
        "FFN gate and up": Product(ffn.gate_up.out_features, ffn.gate_up.in_features),
        "FFN down": Product(ffn.down.out_features, ffn.down.in_features, summed=True),
    }  # fmt: skip
    if layout.ups:
        products["second factors"] = Product(
            sum(u.out_features for u in layout.ups), sum(d.out_features for d in layout.downs),
            bias=any(u.bias is not None for u in layout.ups),
        )  # fmt: skip
    return products, config.num_layers


def one_pass(variant: str, xs, mats, bias, residual, buffer) -> None:
    """One product a layer: mats are the right-hand factors, [in, out] (a weight's transpose or
    a weight stored so)."""
    for x, m in zip(xs, mats, strict=True):
        if variant == "addmm_":
            residual.addmm_(x, m)
        elif bias is not None:
            torch.addmm(bias, x, m, out=buffer)
        else:
            torch.mm(x, m, out=buffer)
        if variant == "mm, add_":
            residual.add_(buffer)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tiny", action="store_true", help="the tiny preset on the CPU")
    parser.add_argument("--preset", default="340M", help="model preset (default 340M)")
    parser.add_argument("--mixer", default="gdn2", help="the mixer whose layer's products")
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128],
                        help="sequences decoded together")  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    preset = "tiny" if args.tiny else args.preset
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    products, layers = layer_products(preset, args.mixer)
    gen = torch.Generator(device="cpu").manual_seed(0)
    results, table = [], []
    for rows in args.rows:
        for name, product in products.items():
            n_out, n_in = product.n_out, product.n_in
            size = n_out * n_in * torch.finfo(dtype).bits // 8
            copies = max(layers, math.ceil(MIN_BYTES / size)) if device.type == "cuda" else layers
            weights = [
                (torch.randn(n_out, n_in, generator=gen) * n_in**-0.5).to(device, dtype)
                for _ in range(copies)
            ]
            xs = [torch.randn(rows, n_in, generator=gen).to(device, dtype) for _ in range(copies)]
            bias = torch.randn(n_out, generator=gen).to(device, dtype) if product.bias else None
            residual = torch.randn(rows, n_out, generator=gen).to(device, dtype)
            buffer = torch.empty_like(residual)
            for layout in LAYOUTS:
                stored = [w.t().contiguous() for w in weights] if layout == "[in, out]" else None
                mats = [w.t() for w in weights] if stored is None else stored
                for variant in VARIANTS if product.summed else ("mm",):
                    call = (variant, xs, mats, bias, residual, buffer)
                    seconds = kernel_seconds(lambda c=call: one_pass(*c), device, PASSES) / copies
                    results.append(
                        {"rows": rows, "product": name, "shape": [n_out, n_in],
                         "bias": product.bias, "layout": layout, "variant": variant,
                         "us": seconds * 1e6, "weight_tb_s": size / seconds / 1e12}
                    )  # fmt: skip
                    table.append([rows, name, f"{n_out} x {n_in}", layout, variant,
                                  f"{seconds * 1e6:.2f}", f"{size / seconds / 1e12:.2f}"])  # fmt: skip
                del stored
    print(format_table(["rows", "product", "weight", "stored", "variant", "us", "weight TB/s"],
                       table))  # fmt: skip
    meta = {"preset": preset, "mixer": args.mixer, "layers": layers, "device": device.type,
            "dtype": str(dtype), "passes_a_graph": PASSES}  # fmt: skip
    return {"meta": meta, "results": results}
