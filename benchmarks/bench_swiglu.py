"""Times SwiGLU's Triton kernels against the FFN's torch path (deltalab.ops.swiglu).

    python benchmarks/bench_swiglu.py --out swiglu.json                          # GPU
    TRITON_INTERPRET=1 python benchmarks/bench_swiglu.py --tiny --out /tmp/tiny.json

Cases, at the 340M training step's shape (B=4, T=4096) in the dtype that step gives the gating
under bf16 autocast: gate_up `[4 * 4096, 2F]` bfloat16 (the fused projection's output), F the
340M preset's FFN width from the config of each mixer (GDN-2: 2400, Transformer: 3232).
(`--tiny`: small shapes on CPU under the interpreter, float32, to prove the script runs.)

Per case and backend ("torch": the FFN's old path, the formula under activation checkpointing,
so its forward runs again in the backward; "triton"), median ms of the forward (no autograd) and
of forward + backward (d(gate_up) by `torch.autograd.grad` with a random dh), by
`triton.testing.do_bench` on the GPU; then torch / triton, each backend's error against the
float64 formula ("naive") on the same inputs (normwise relative error of h and of d(gate_up)),
and the bytes each kernel must move (forward: read gate_up, write h; backward: read gate_up and
dh, write d(gate_up)) as GB/s at the measured times. The JSON written to --out holds every
number printed.
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
from deltalab.ops.swiglu import swiglu
from deltalab.testing import relative_error

MIXERS = ("gdn2", "transformer")
ROWS = 4 * 4096
TINY = (37, 20)  # rows, F
BACKENDS = ("torch", "triton")


def outputs(backend: str, gate_up: torch.Tensor, dh: torch.Tensor) -> list[torch.Tensor]:
    """h and d(gate_up)."""
    leaf = gate_up.detach().requires_grad_()
    h = swiglu(leaf, backend=backend)
    (grad,) = torch.autograd.grad(h, leaf, dh.to(h.dtype))
    return [h, grad]


def bench_case(mixer: str, rows: int, width: int, dtype, device: str, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(rows, 2 * width, generator=gen).to(device, dtype)
    dh = torch.randn(rows, width, generator=gen).to(device, dtype)
    result = {"case": mixer, "shape": [rows, 2 * width], "dtype": str(dtype).removeprefix("torch.")}
    reference = outputs("naive", gate_up.double(), dh.double())
    size = gate_up.element_size()
    moved = {"forward_ms": 3 * rows * width * size, "train_ms": 8 * rows * width * size}
    result["kernel_bytes"] = {"forward": moved["forward_ms"], "train": moved["train_ms"]}
    for backend in BACKENDS:

        def forward(backend=backend) -> None:
            with torch.no_grad():
                swiglu(gate_up, backend=backend)

        def train(backend=backend) -> None:
            outputs(backend, gate_up, dh)

        got = outputs(backend, gate_up, dh)
        times = phase_times(forward, train, device, repeats)
        result[backend] = {
            **times,
            "gb_per_s": {k[:-3]: moved[k] / times[k] / 1e6 for k in moved},
            "errors": {
                n: relative_error(a, e)
                for n, a, e in zip(("h", "d_gate_up"), got, reference, strict=True)
            },
        }
    return add_speedups(result)


def print_case(result: dict) -> None:
    title = f"{result['case']}: gate_up {result['shape']} {result['dtype']}"
    print_backend_case(title, result, BACKENDS, "the fused kernels' bytes over each backend's time")


def main() -> None:
    args = case_parser(__doc__, "--mixers", MIXERS).parse_args()

    def measure(mixer: str, device: str, repeats: int) -> dict:
        if args.tiny:
            # bfloat16 under the interpreter is not supported (numpy has none): float32 there.
            (rows, width), dtype = TINY, torch.float32
        else:
            rows, width, dtype = ROWS, build_config("340M", mixer=mixer).ffn_width, torch.bfloat16
        return bench_case(mixer, rows, width, dtype, device, repeats)

    run_cases(args, args.mixers, measure, print_case)


if __name__ == "__main__":
    main()
