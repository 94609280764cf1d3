"""A decoding step's matrix products: torch's (cuBLAS, after the norm's own kernel where the
product has a pre-norm) against `row_linear`'s Triton kernels at each candidate launch (GPU).

    python -m benchmarks decode products                    # 340M GDN-2 at 64 rows
    TRITON_INTERPRET=1 python -m benchmarks decode products --tiny

The products are the ones the static decoder runs for one token of `--mixer` at `--preset`'s
shapes, recorded from one eager step of one sequence (each call of `row_linear` the layer step
makes: the weight's shape, and whether it adds a bias, a residual, a pre-norm), each distinct one
once. Each is then timed at `--rows` rows as the decoder runs it: `--layers` distinct weights,
one product after another, in one CUDA graph, replayed (`tune_decode_step.us_per_layer`); on CPU (under the interpreter) it only
proves the launches run and agree. Printed per product and for a token's (each product as many
times as the step makes it): torch's us, the
tiles' kernel's (`_rows_dot_kernel`, from `DOT_ROWS` rows) at its shipped launch and at its best
candidate, and each over torch's.
"""

from __future__ import annotations

import argparse
import itertools
from functools import partial
from unittest import mock

import torch

from benchmarks.tune_decode_step import us_per_layer
from deltalab.layers import decode_step
from deltalab.models import CausalLM, build_config
from deltalab.models.static_decode import StaticDecoder
from deltalab.ops.norms import rms_norm
from deltalab.ops.row_linear import row_linear
from deltalab.ops.row_linear.triton import DOT_LAUNCH, DotLaunch, row_linear_triton

# The launches tried besides the shipped one: outputs a program, columns a step, stages, warps.
CANDIDATES = [DotLaunch(64, n, k, s, w) for n, k, s, w in
              itertools.product((16, 32, 64), (64, 128, 256), (3, 4), (4,))]  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tiny", action="store_true", help="tiny preset on CPU (smoke run)")
    parser.add_argument("--preset", default="340M")
    parser.add_argument("--mixer", default="gdn2")
    parser.add_argument("--rows", type=int, default=None, help="sequences (default 64)")
    parser.add_argument("--layers", type=int, default=None, help="weights a timing holds (24)")
    parser.add_argument("--device", default=None, help="default cuda (cpu with --tiny)")


def record_products(model: CausalLM) -> list[dict]:
    """The distinct products of one decoding step of one sequence, with how often the step
    makes each."""
    seen: dict[tuple, int] = {}
    real = decode_step.row_linear

    def spy(x, weight, bias=None, residual=None, **kwargs):
        key = (weight.shape[0], weight.shape[1], bias is not None, residual is not None,
               kwargs.get("norm_weight") is not None)  # fmt: skip
        seen[key] = seen.get(key, 0) + 1
        return real(x, weight, bias, residual, **kwargs)

    prompt = torch.zeros(1, 4, dtype=torch.long, device=model.device)
    with torch.no_grad():
        cache = model(prompt, use_cache=True).past_key_values
        decoder = StaticDecoder(model, cache, 2, cuda_graph=False)
        decoder.load(cache)
        with mock.patch.object(decode_step, "row_linear", spy):
            decoder.step()
    return [dict(outputs=n, width=k, bias=b, residual=r, norm=nm, calls=c)
            for (n, k, b, r, nm), c in seen.items()]  # fmt: skip


def operands(product: dict, rows: int, dtype, device, generator) -> dict:
    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator, device=device) * scale).to(dtype)

    n, k = product["outputs"], product["width"]
    return {
        "x": draw(rows, k),
        "weight": draw(n, k, scale=k**-0.5),
        "bias": draw(n) if product["bias"] else None,
        "residual": draw(rows, n) if product["residual"] else None,
        "norm_weight": 1 + draw(k, scale=0.1) if product["norm"] else None,
    }


def torch_product(o: dict) -> torch.Tensor:
    """What the decoder runs at many rows: the `RMSNorm` module's path (its Triton kernel on
    CUDA), then torch's product (into the residual in place)."""
    x = o["x"]
    if o["norm_weight"] is not None:
        x = rms_norm(x, o["norm_weight"], 1e-5, out_dtype=x.dtype, backend="auto")
    residual = o["residual"]
    return row_linear(x, o["weight"], o["bias"], residual, out=residual, backend="torch")


def triton_product(o: dict, launch: DotLaunch) -> torch.Tensor:
    return row_linear_triton(o["x"], o["weight"], o["bias"], o["residual"], o["norm_weight"],
                             1e-5, o["residual"], launch)  # fmt: skip


def time_product(product: dict, args, dtype, device, launches) -> dict:
    generator = torch.Generator(device=device).manual_seed(0)
    layers = [operands(product, args.rows, dtype, device, generator) for _ in range(args.layers)]
    kept = [None if o["residual"] is None else o["residual"].clone() for o in layers]

    def fresh(o, r) -> dict:
        return o if r is None else {**o, "residual": r.clone()}

    expected = torch_product(fresh(layers[0], kept[0])).float()

    def us(call) -> float:
        return us_per_layer([partial(call, o) for o in layers], device.type)

    row = {**product, "torch_us": us(torch_product), "launches": []}
    for launch in launches:
        got = triton_product(fresh(layers[0], kept[0]), launch).float()
        error = float((got - expected).abs().max() / expected.abs().max().clamp_min(1e-30))
        row["launches"].append({"launch": vars(launch), "us": us(lambda o, lc=launch:
                                triton_product(o, lc)), "error": error})  # fmt: skip
    return row


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device or ("cpu" if args.tiny else "cuda"))
    preset = "tiny" if args.tiny else args.preset
    args.rows = args.rows or (16 if args.tiny else 64)
    args.layers = args.layers or (1 if args.tiny else 24)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    launches = [DOT_LAUNCH, *(CANDIDATES[:1] if args.tiny else CANDIDATES)]
    torch.manual_seed(0)
    # One sequence on the Triton products (the interpreter's on CPU), so that a product with
    # a pre-norm takes it inside and the recording sees it.
    shape = {"num_layers": 1} if args.tiny else {}  # the smoke run: one block's products
    with torch.device(device):
        config = build_config(preset, mixer=args.mixer, backend="triton", **shape)
        model = CausalLM(config).to(dtype)
    products = record_products(model.eval())
    del model
    if args.tiny:  # the smoke run: the widest product with a norm and one without
        products = sorted(products, key=lambda p: (not p["norm"], -p["outputs"]))
        products = [products[0], next(p for p in products if not p["norm"])]
    rows, totals = [], {"torch": 0.0, "shipped": 0.0, "best": 0.0}
    for product in products:
        row = time_product(product, args, dtype, device, launches)
        agree = [r for r in row["launches"] if r["error"] < 2e-2]
        best = min(agree, key=lambda r: r["us"])
        shipped = row["launches"][0]["us"]
        for name, value in (("torch", row["torch_us"]), ("shipped", shipped), ("best", best["us"])):
            totals[name] += value * product["calls"]
        rows.append(row)
        shape = f"{product['outputs']} x {product['width']}"
        extras = "".join(f" +{name}" for name in ("norm", "bias", "residual") if product[name])
        print(f"{shape:>12}{extras:<16} x{product['calls']}: torch {row['torch_us']:7.2f} us, "
              f"shipped {shipped:7.2f} ({shipped / row['torch_us']:.2f}x), best "
              f"{best['us']:7.2f} ({best['us'] / row['torch_us']:.2f}x) at {best['launch']}")  # fmt: skip
    print(f"a token's products (every layer) at {args.rows} rows: torch {totals['torch']:.1f} us, shipped "
          f"{totals['shipped']:.1f} ({totals['shipped'] / totals['torch']:.2f}x), best "
          f"{totals['best']:.1f} ({totals['best'] / totals['torch']:.2f}x)")  # fmt: skip
    meta = {"preset": preset, "mixer": args.mixer, "rows": args.rows, "layers": args.layers,
            "dtype": str(dtype)}  # fmt: skip
    return {"meta": meta, "products": rows, "layer_us": totals}
