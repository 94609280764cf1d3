"""Times short_conv's Triton kernels against the conv1d path (ShortConvolution's off Triton).

    python benchmarks/bench_short_conv.py --out conv.json                 # GPU, bfloat16, W=4
    python benchmarks/bench_short_conv.py --sweep --out conv.json         # and the launch sweep
    TRITON_INTERPRET=1 python benchmarks/bench_short_conv.py --tiny --sweep --out /tmp/tiny.json

Shapes: x `[4, 4096, C]`, C in (1024, 2048), one convolution of the three a mixer runs (`--tiny`:
`[2, 37, 40]` on CPU under the interpreter, to prove the script runs). Per shape and backend,
median ms of the forward (no autograd) and of forward + backward (dx and dweight, by
`torch.autograd.grad` with a random dy), by `triton.testing.do_bench` on the GPU; no cache
(training). "torch" is `short_conv(backend="torch")`, the layers' path on the PyTorch backends
(and on every backend before the kernels were wired in): transpose, concatenation of the zero
cache, grouped F.conv1d, SiLU; its y is a transposed view, as the layers get it (a later reshape
that copies it is not timed; neither is ShortConvolution's `recomputed` checkpointing). Then torch / triton, and each backend's error against the float64
definition ("naive") on the same inputs: normwise relative error and max |error| / max |ref|,
for y, dx and dweight.

`--sweep` times the Triton kernels at other launches (BT tokens per chunk, BC channels per
program, warps; and the backward's program count) at each shape; the default is marked.
Inputs are random normal (x, dy) and nn.Conv1d-initialized weights, never zeros. The JSON written
to --out holds every number printed.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from deltalab.benchmarking import format_table, median_ms, run_environment
from deltalab.ops.short_conv import short_conv
from deltalab.testing import relative_error

SHAPES = [(4, 4096, 1024), (4, 4096, 2048)]
TINY_SHAPES = [(2, 37, 40)]
# (BT, BC, warps) launches tried by --sweep, per kernel; and the backward's program counts.
FORWARD_SWEEP = [(16, 1024, 4), (16, 512, 4), (32, 512, 4), (16, 2048, 8)]
BACKWARD_SWEEP = [(16, 1024, 4), (16, 512, 8), (32, 512, 8), (8, 512, 4)]
PROGRAMS_SWEEP = [512, 1024, 2048, 4096]  # at the default launch
TINY_FORWARD_SWEEP = [(8, 32, 1), (16, 64, 2)]
TINY_BACKWARD_SWEEP = [(8, 32, 1)]
TINY_PROGRAMS_SWEEP = [4]


def make_inputs(shape, width: int, device: str, dtype: torch.dtype):
    """x `[B, T, C]`, dy like it (random normal) and a weight `[C, 1, W]` (float32, as
    ShortConvolution keeps it, with nn.Conv1d's initialization)."""
    batch, length, channels = shape
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, length, channels, generator=gen).to(device, dtype)
    dy = torch.randn(batch, length, channels, generator=gen).to(device, dtype)
    bound = 1 / math.sqrt(width)  # kaiming_uniform_(a=sqrt(5)) on fan_in = W
    weight = (2 * torch.rand(channels, 1, width, generator=gen) - 1) * bound
    return x, dy, weight.to(device)


def timings(x, dy, weight, device: str, repeats: int, **kw) -> dict[str, float]:
    """Forward and forward+backward ms of short_conv(**kw)."""

    def forward() -> None:
        with torch.no_grad():
            short_conv(x, weight, **kw)

    xs, ws = x.detach().requires_grad_(), weight.detach().requires_grad_()

    def train() -> None:
        y, _ = short_conv(xs, ws, **kw)
        torch.autograd.grad(y, (xs, ws), dy)

    return {
        "fwd_ms": median_ms(forward, device, repeats),
        "fwd_bwd_ms": median_ms(train, device, repeats),
    }


def outputs(x, dy, weight, backend: str, dtype=None) -> list[torch.Tensor]:
    """y, dx and dweight of short_conv(backend) (inputs cast to `dtype` first, when given)."""
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in (x, weight)]
    y, _ = short_conv(*leaves, backend=backend)
    grads = torch.autograd.grad(y, leaves, dy.to(y.dtype))
    return [y.detach(), *grads]


def errors(x, dy, weight) -> dict[str, dict[str, float]]:
    """Each backend's error against the float64 definition on the same (rounded) inputs."""
    reference = outputs(x, dy, weight, "naive", torch.float64)
    result = {}
    for backend in ("torch", "triton"):
        for name, got, ref in zip(
            ("y", "dx", "dweight"), outputs(x, dy, weight, backend), reference, strict=True
        ):
            got, ref = got.double(), ref.reshape(got.shape)
            result.setdefault(backend, {})[f"{name}_rel"] = relative_error(got, ref)
            worst = (got - ref).abs().max() / ref.abs().max()
            result[backend][f"{name}_max"] = worst.item()
    return result


def sweep(x, dy, weight, device: str, args) -> list[dict]:
    from deltalab.ops.short_conv import triton as kernels

    rows = []
    width = weight.shape[-1]
    channels = x.shape[-1]
    forward_default = kernels.launch(channels, width, "forward")
    backward_default = kernels.launch(channels, width, "backward")
    tiny = args.tiny
    for launch in TINY_FORWARD_SWEEP if tiny else FORWARD_SWEEP:
        config = {"forward": launch}
        ms = median_ms(
            lambda c=config: kernels.short_conv_triton(x, weight[:, 0], None, True, c),
            device,
            args.repeats,
        )
        effective = kernels.launch(channels, width, "forward", launch)
        rows.append(
            {
                "kernel": "forward",
                "launch": list(effective),
                "programs": None,
                "ms": ms,
                "default": effective == forward_default,
            }
        )
    programs_default = kernels.BACKWARD_PROGRAMS
    xs, ws = x.detach().requires_grad_(), weight[:, 0].detach().requires_grad_()
    configs = [
        (launch, programs_default) for launch in (TINY_BACKWARD_SWEEP if tiny else BACKWARD_SWEEP)
    ]
    configs += [(None, programs) for programs in (TINY_PROGRAMS_SWEEP if tiny else PROGRAMS_SWEEP)]
    try:
        for launch, programs in configs:
            kernels.BACKWARD_PROGRAMS = programs
            config = {"backward": launch} if launch else None

            def train(c=config) -> None:
                y, _ = kernels.short_conv_triton(xs, ws, None, True, c)
                torch.autograd.grad(y, (xs, ws), dy)

            effective = kernels.launch(channels, width, "backward", launch)
            rows.append(
                {
                    "kernel": "forward+backward",
                    "launch": list(effective),
                    "programs": programs,
                    "ms": median_ms(train, device, args.repeats),
                    "default": effective == backward_default and programs == programs_default,
                }
            )
    finally:
        kernels.BACKWARD_PROGRAMS = programs_default
    return rows


def bench_shape(shape, args, device: str, dtype: torch.dtype) -> dict:
    x, dy, weight = make_inputs(shape, args.width, device, dtype)
    rows = {b: timings(x, dy, weight, device, args.repeats, backend=b) for b in ("torch", "triton")}
    for key in ("fwd_ms", "fwd_bwd_ms"):
        rows["triton"][key.replace("ms", "speedup")] = rows["torch"][key] / rows["triton"][key]
    result = {
        "B": shape[0],
        "T": shape[1],
        "C": shape[2],
        "rows": rows,
        "errors": errors(x, dy, weight),
    }
    if args.sweep:
        result["sweep"] = sweep(x, dy, weight, device, args)
    return result


def print_shape(result: dict) -> None:
    print(f"\nB={result['B']} T={result['T']} C={result['C']}")
    headers = ["backend", "fwd ms", "fwd+bwd ms", "torch/triton fwd", "torch/triton fwd+bwd"]
    table = [
        [
            name,
            row["fwd_ms"],
            row["fwd_bwd_ms"],
            row.get("fwd_speedup", "-"),
            row.get("fwd_bwd_speedup", "-"),
        ]
        for name, row in result["rows"].items()
    ]
    print(format_table(headers, table))
    names = ("y", "dx", "dweight")
    headers = ["vs float64", *(f"{n} rel" for n in names), *(f"{n} max" for n in names)]
    table = [
        [backend, *(e[f"{n}_rel"] for n in names), *(e[f"{n}_max"] for n in names)]
        for backend, e in result["errors"].items()
    ]
    print(format_table(headers, table))
    if "sweep" in result:
        headers = ["kernel", "BT", "BC", "warps", "programs", "ms"]
        table = [
            [
                s["kernel"] + (" (default)" if s["default"] else ""),
                *s["launch"],
                s["programs"] or "-",
                s["ms"],
            ]
            for s in result["sweep"]
        ]
        print(format_table(headers, table))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", required=True, help="path of the JSON file to write")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (interpreter smoke run)")
    parser.add_argument("--sweep", action="store_true", help="also time other Triton launches")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--width", type=int, default=4, help="kernel width W")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs (CPU only)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    args.repeats = args.repeats or (1 if args.tiny else 10)
    # bfloat16 under the interpreter is not supported (numpy has no bfloat16): float32 there.
    dtype = getattr(torch, args.dtype) if device == "cuda" else torch.float32
    header = {
        **run_environment(device),
        "dtype": str(dtype).removeprefix("torch."),
        "W": args.width,
    }
    print(" ".join(f"{k}={v}" for k, v in header.items()))
    results = []
    for shape in TINY_SHAPES if args.tiny else SHAPES:
        results.append(bench_shape(shape, args, device, dtype))
        print_shape(results[-1])
        # Written after every shape: a run stopped by its time limit keeps what it measured.
        with open(args.out, "w") as f:
            json.dump({**header, "shapes": results}, f, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
