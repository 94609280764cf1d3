"""Times the norms' Triton kernels against the torch path the layers took before (deltalab.ops.norms).

    python benchmarks/bench_norms.py --out norms.json                            # GPU
    TRITON_INTERPRET=1 python benchmarks/bench_norms.py --tiny --out /tmp/tiny.json

Cases, at the 340M training step's shapes (B=4, T=4096, H=8 heads of 128, hidden 1024), in the
dtypes that step gives them under bf16 autocast:
  block: the block RMSNorm on the float32 residual stream, x `[4 * 4096, 1024]`, float32 out;
  gated: the mixers' gated output norm (SiLU gate), o and gate `[4, 4096, 8, 128]` bfloat16;
  l2:    the q/k L2 normalization, `[4, 4096, 8, 128]` bfloat16 (torch: under `recomputed`, so
         its forward runs again in the backward, as in the layers).
(`--tiny`: small shapes on CPU under the interpreter, float32, to prove the script runs.)

Per case and backend ("torch": the layers' old path, with the cast to x's dtype the modules make;
"triton"), median ms of the forward (no autograd) and of forward + backward (every input's
gradient by `torch.autograd.grad` with a random dy), by `triton.testing.do_bench` on the GPU;
then torch / triton, and each backend's error against the float64 formula ("naive") on the same
inputs: normwise relative error of y and of each gradient. Inputs are random normal, the weight
1 + 0.1 normal. The JSON written to --out holds every number printed.
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
from deltalab.ops.norms import l2_normalize, rms_norm
from deltalab.testing import relative_error

# name -> (shape, input dtype on the GPU, gate activation or None, kind)
CASES = {
    "block": ((4 * 4096, 1024), torch.float32, None, "rms"),
    "gated": ((4, 4096, 8, 128), torch.bfloat16, "silu", "rms"),
    "l2": ((4, 4096, 8, 128), torch.bfloat16, None, "l2"),
}
TINY_SHAPES = {"block": (37, 40), "gated": (2, 9, 2, 24), "l2": (2, 9, 2, 24)}
BACKENDS = ("torch", "triton")


def make_inputs(shape, dtype: torch.dtype, device: str, gated: bool):
    """x, weight `[N]` (float32, as the modules keep it), gate (or None) and dy, on `device`."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=gen)
    weight = 1 + 0.1 * torch.randn(shape[-1], generator=gen)
    gate = torch.randn(*shape, generator=gen) if gated else None
    dy = torch.randn(*shape, generator=gen)
    moved = [None if t is None else t.to(device, dtype) for t in (x, gate, dy)]
    return moved[0], weight.to(device), moved[1], moved[2]


def apply(kind: str, backend: str, x, weight, gate, activation):
    """The case's norm on `backend`, x's dtype out (as the modules return it)."""
    if kind == "l2":
        return l2_normalize(x, backend=backend)
    return rms_norm(
        x, weight, 1e-5, gate, activation or "sigmoid", out_dtype=x.dtype, backend=backend
    )


def outputs(kind, backend, x, weight, gate, dy, activation):
    """y and the gradients of every input (x; weight and gate for the RMS norm)."""
    x, weight, gate = (
        None if t is None else t.detach().requires_grad_() for t in (x, weight, gate)
    )
    y = apply(kind, backend, x, weight, gate, activation)
    leaves = [x] if kind == "l2" else [t for t in (x, weight, gate) if t is not None]
    grads = torch.autograd.grad(y, leaves, dy.to(y.dtype))
    return [y, *grads]


def bench_case(name: str, shape, dtype, activation, kind, device: str, repeats: int) -> dict:
    x, weight, gate, dy = make_inputs(shape, dtype, device, activation is not None)
    result = {"case": name, "shape": list(shape), "dtype": str(dtype).removeprefix("torch.")}
    wide = [None if t is None else t.double() for t in (x, weight, gate, dy)]
    reference = outputs(kind, "naive", *wide, activation)
    # The outputs' names, in `outputs`' order: the block norm has no gate, L2 no weight either.
    names = (
        ["y", "dx"]
        + (["dweight"] if kind == "rms" else [])
        + (["dgate"] if gate is not None else [])
    )
    for backend in BACKENDS:

        def forward(backend=backend) -> None:
            with torch.no_grad():
                apply(kind, backend, x, weight, gate, activation)

        def train(backend=backend) -> None:
            outputs(kind, backend, x, weight, gate, dy, activation)

        got = outputs(kind, backend, x, weight, gate, dy, activation)
        result[backend] = {
            **phase_times(forward, train, device, repeats),
            "errors": {
                n: relative_error(a, e) for n, a, e in zip(names, got, reference, strict=True)
            },
        }
    return add_speedups(result)


def print_case(result: dict) -> None:
    print_backend_case(f"{result['case']}: {result['shape']} {result['dtype']}", result, BACKENDS)


def main() -> None:
    args = case_parser(__doc__, "--cases", CASES).parse_args()

    def measure(name: str, device: str, repeats: int) -> dict:
        shape, dtype, activation, kind = CASES[name]
        if args.tiny:
            # bfloat16 under the interpreter is not supported (numpy has none): float32 there.
            shape, dtype = TINY_SHAPES[name], torch.float32
        return bench_case(name, shape, dtype, activation, kind, device, repeats)

    run_cases(args, args.cases, measure, print_case)


if __name__ == "__main__":
    main()
