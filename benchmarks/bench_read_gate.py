"""Times Muir's read-gate Triton kernels against the torch path the layers took before
(deltalab.ops.read_gate).

    python benchmarks/bench_read_gate.py --out read_gate.json                      # GPU
    TRITON_INTERPRET=1 python benchmarks/bench_read_gate.py --tiny --out /tmp/tiny.json

Cases, at the 340M training step's shapes (B=4, T=4096, H=8 heads of K=128), q and raw in
bfloat16 as the frontend and the fused gate projection give them under bf16 autocast, read_log
float32 `[8, 128]`, the product in q's dtype:
  dynamic: rho = exp(read_log) 2 sigmoid(raw), q and raw `[4, 4096, 8, 128]` (Muir's default);
  static:  rho = exp(read_log), q `[4, 4096, 8, 128]`.
(`--tiny`: small shapes on CPU under the interpreter, float32, to prove the script runs.)

Per case and backend ("torch": rho built in float32 and multiplied into q, the layers' old
path; "triton"), median ms of the forward (no autograd) and of forward + backward (the
gradients of q, read_log and raw by `torch.autograd.grad` with a random dout), by
`triton.testing.do_bench` on the GPU; then torch / triton, and each backend's error against the
float64 formula ("naive") on the same inputs: normwise relative error of the product and each
gradient. q is unit-norm per head (as the L2-normalized query), raw 3 x random normal,
read_log the log of matched-filter-like weights (normal, std 0.5). The JSON written to --out
holds every number printed.
"""

from __future__ import annotations

import torch

from deltalab.benchmarking import (
    add_speedups,
    case_parser,
    print_backend_case,
    run_cases,
    time_backends,
)
from deltalab.ops.read_gate import read_query

# name -> (q shape, whether raw is given), q and raw dtype on the GPU
CASES = {
    "dynamic": ((4, 4096, 8, 128), True, torch.bfloat16),
    "static": ((4, 4096, 8, 128), False, torch.bfloat16),
}
TINY_SHAPE = (2, 9, 3, 24)
BACKENDS = ("torch", "triton")


def make_inputs(shape, dynamic: bool, dtype: torch.dtype, device: str):
    """q, read_log, raw (None when static), dout on `device`: read_log float32, the rest in
    `dtype`."""
    gen = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(*shape, generator=gen), dim=-1)
    read_log = 0.5 * torch.randn(*shape[-2:], generator=gen)
    raw = 3 * torch.randn(*shape, generator=gen) if dynamic else None
    dout = torch.randn(*shape, generator=gen)
    raw = None if raw is None else raw.to(device, dtype)
    return q.to(device, dtype), read_log.to(device), raw, dout.to(device, dtype)


def outputs(backend, q, read_log, raw, dout):
    """The product and the gradients of q, read_log (and raw)."""
    leaves = [t.detach().requires_grad_() for t in (q, read_log, raw) if t is not None]
    out = read_query(*leaves, backend=backend)
    return [out, *torch.autograd.grad(out, leaves, dout.to(out.dtype))]


def bench_case(name: str, shape, dynamic: bool, dtype, device: str, repeats: int) -> dict:
    q, read_log, raw, dout = make_inputs(shape, dynamic, dtype, device)
    result = {"case": name, "shape": list(shape), "dtype": str(dtype).removeprefix("torch.")}
    names = ("out", "dq", "dread_log", "draw")[: 4 if dynamic else 3]
    wide = [None if t is None else t.double() for t in (q, read_log, raw, dout)]
    reference = outputs("naive", *wide)
    result |= time_backends(
        BACKENDS,
        lambda backend: read_query(q, read_log, raw, backend=backend),
        lambda backend: outputs(backend, q, read_log, raw, dout),
        reference,
        names,
        device,
        repeats,
    )
    return add_speedups(result)


def print_case(result: dict) -> None:
    print_backend_case(f"{result['case']}: q {result['shape']} {result['dtype']}", result, BACKENDS)


def main() -> None:
    args = case_parser(__doc__, "--cases", CASES).parse_args()

    def measure(name: str, device: str, repeats: int) -> dict:
        shape, dynamic, dtype = CASES[name]
        if args.tiny:
            # bfloat16 under the interpreter is not supported (numpy has none): float32 there.
            shape, dtype = TINY_SHAPE, torch.float32
        return bench_case(name, shape, dynamic, dtype, device, repeats)

    run_cases(args, args.cases, measure, print_case)


if __name__ == "__main__":
    main()
