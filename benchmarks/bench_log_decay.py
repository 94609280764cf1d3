"""Times the log decay's Triton kernels against the torch path the layers took before
(deltalab.ops.log_decay).

    python benchmarks/bench_log_decay.py --out decay.json                          # GPU
    TRITON_INTERPRET=1 python benchmarks/bench_log_decay.py --tiny --out /tmp/tiny.json

Cases, at the 340M training step's shapes (B=4, T=4096, H=8 heads of K=128), raw in bfloat16 as
the decay projection gives it under bf16 autocast, the parameters float32, g float32:
  channel: KDA's / GDN-2's / Muir's / KDN's decay, raw `[4, 4096, 8, 128]`, A_log `[8, 1]`,
           dt_bias `[8, 128]`;
  scalar:  GDN's decay, raw `[4, 4096, 8]`, A_log and dt_bias `[8]`.
(`--tiny`: small shapes on CPU under the interpreter, float32, to prove the script runs.)

Per case and backend ("torch": the formula under `recomputed`, its forward run again in the
backward; "triton"), median ms of the forward (no autograd) and of forward + backward (the
gradients of A_log, raw and dt_bias by `torch.autograd.grad` with a random dg), by
`triton.testing.do_bench` on the GPU; then torch / triton, and each backend's error against the
float64 formula ("naive") on the same inputs: normwise relative error of g and each gradient.
raw is 3 x random normal (its range in training), A_log as initialized (log U(1, 16)), dt_bias
as initialized. The JSON written to --out holds every number printed.
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
from deltalab.layers.decay import init_A_log, init_dt_bias
from deltalab.ops.log_decay import log_decay

# name -> raw shape (the parameters span its last dims: [H] or [H, K]), raw dtype on the GPU
CASES = {
    "channel": ((4, 4096, 8, 128), torch.bfloat16),
    "scalar": ((4, 4096, 8), torch.bfloat16),
}
TINY_SHAPES = {"channel": (2, 9, 3, 24), "scalar": (2, 9, 3)}
BACKENDS = ("torch", "triton")
NAMES = ("g", "dA_log", "draw", "ddt_bias")


def make_inputs(shape, dtype: torch.dtype, device: str):
    """A_log, raw, dt_bias, dg on `device`: the parameters float32, raw in `dtype`."""
    torch.manual_seed(0)
    channel = len(shape) == 4
    heads = shape[2]
    a_log = init_A_log(heads).detach()
    a_log = a_log.unsqueeze(-1) if channel else a_log
    dt_bias = init_dt_bias(*shape[2:]).detach()
    gen = torch.Generator().manual_seed(0)
    raw = 3 * torch.randn(*shape, generator=gen)
    dg = torch.randn(*shape, generator=gen)
    return a_log.to(device), raw.to(device, dtype), dt_bias.to(device), dg.to(device)


def outputs(backend, a_log, raw, dt_bias, dg):
    """g and the gradients of A_log, raw and dt_bias."""
    leaves = [t.detach().requires_grad_() for t in (a_log, raw, dt_bias)]
    g = log_decay(*leaves, backend=backend)
    return [g, *torch.autograd.grad(g, leaves, dg.to(g.dtype))]


def bench_case(name: str, shape, dtype, device: str, repeats: int) -> dict:
    a_log, raw, dt_bias, dg = make_inputs(shape, dtype, device)
    result = {"case": name, "shape": list(shape), "dtype": str(dtype).removeprefix("torch.")}
    reference = outputs("naive", *(t.double() for t in (a_log, raw, dt_bias, dg)))
    result |= time_backends(
        BACKENDS,
        lambda backend: log_decay(a_log, raw, dt_bias, backend=backend),
        lambda backend: outputs(backend, a_log, raw, dt_bias, dg),
        reference,
        NAMES,
        device,
        repeats,
    )
    return add_speedups(result)


def print_case(result: dict) -> None:
    print_backend_case(
        f"{result['case']}: raw {result['shape']} {result['dtype']}", result, BACKENDS
    )


def main() -> None:
    args = case_parser(__doc__, "--cases", CASES).parse_args()

    def measure(name: str, device: str, repeats: int) -> dict:
        shape, dtype = CASES[name]
        if args.tiny:
            # bfloat16 under the interpreter is not supported (numpy has none): float32 there.
            shape, dtype = TINY_SHAPES[name], torch.float32
        return bench_case(name, shape, dtype, device, repeats)

    run_cases(args, args.cases, measure, print_case)


if __name__ == "__main__":
    main()
