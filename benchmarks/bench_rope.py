"""Times RoPE's Triton kernel against the attention layer's torch path (deltalab.ops.rope).

    python benchmarks/bench_rope.py --out rope.json                          # GPU
    TRITON_INTERPRET=1 python benchmarks/bench_rope.py --tiny --out /tmp/tiny.json

Cases: the queries (or keys) of one attention layer of the 340M Transformer in the dtype its
projection gives them under bf16 autocast, x `[B, T, H, K]` bfloat16 with H and K from the
preset's config (8 x 128), positions 0..T-1: "4k" (B=4, T=4096: the training step's shape) and
"16k" (B=1, T=16384: the same bytes, angles to 16K). (`--tiny`: small shapes on CPU under the
interpreter, float32, odd heads and K/2 not a power of 2, to prove the script runs.)

Per case and backend ("torch": the layer's old path, float32 angles, casts, chunk and cat, its
backward left to autograd; "triton"), median ms of the forward (no autograd) and of forward +
backward (dx by `torch.autograd.grad` with a random dy), by `triton.testing.do_bench` on the
GPU; then torch / triton, each backend's error against the float64 definition ("naive") on the
same inputs (normwise relative error of y and of dx), and the bytes the kernel must move
(forward: read x, write y; backward: read dy, write dx) as GB/s at the measured times. The JSON
written to --out holds every number printed.
"""

from __future__ import annotations

import torch

from deltalab.benchmarking import (
    add_speedups,
    case_parser,
    phase_times,
    print_backend_case,
    run_cases,
)
from deltalab.models import build_config
from deltalab.ops.rope import rope
from deltalab.testing import relative_error

CASES = {"4k": (4, 4096), "16k": (1, 16384)}  # batch, length
TINY = {"4k": (2, 9, 3, 12), "16k": (1, 7, 2, 6)}  # B, T, H, K
BACKENDS = ("torch", "triton")


def outputs(backend: str, x: torch.Tensor, positions: torch.Tensor, dy: torch.Tensor):
    """y and dx."""
    leaf = x.detach().requires_grad_()
    y = rope(leaf, positions, backend=backend)
    (grad,) = torch.autograd.grad(y, leaf, dy.to(y.dtype))
    return [y, grad]


def bench_case(name: str, shape: tuple[int, ...], dtype, device: str, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=gen).to(device, dtype)
    dy = torch.randn(*shape, generator=gen).to(device, dtype)
    positions = torch.arange(shape[1], device=device)
    result = {"case": name, "shape": list(shape), "dtype": str(dtype).removeprefix("torch.")}
    reference = outputs("naive", x.double(), positions, dy.double())
    size = x.numel() * x.element_size()
    moved = {"forward_ms": 2 * size, "train_ms": 4 * size}
    result["kernel_bytes"] = {"forward": moved["forward_ms"], "train": moved["train_ms"]}
    for backend in BACKENDS:

        def forward(backend=backend) -> None:
            with torch.no_grad():
                rope(x, positions, backend=backend)

        def train(backend=backend) -> None:
            outputs(backend, x, positions, dy)

        got = outputs(backend, x, positions, dy)
        times = phase_times(forward, train, device, repeats)
        result[backend] = {
            **times,
            "gb_per_s": {k[:-3]: moved[k] / times[k] / 1e6 for k in moved},
            "errors": {
                n: relative_error(a, e) for n, a, e in zip(("y", "dx"), got, reference, strict=True)
            },
        }
    return add_speedups(result)


def print_case(result: dict) -> None:
    title = f"{result['case']}: x {result['shape']} {result['dtype']}"
    print_backend_case(title, result, BACKENDS, "the kernel's bytes over each backend's time")


def main() -> None:
    args = case_parser(__doc__, "--cases", CASES).parse_args()

    def measure(name: str, device: str, repeats: int) -> dict:
        if args.tiny:
            # bfloat16 under the interpreter is not supported (numpy has none): float32 there.
            shape, dtype = TINY[name], torch.float32
        else:
            config = build_config("340M", mixer="transformer")
            shape, dtype = (*CASES[name], config.num_heads, config.head_dim), torch.bfloat16
        return bench_case(name, shape, dtype, device, repeats)

    run_cases(args, args.cases, measure, print_case)


if __name__ == "__main__":
    main()
