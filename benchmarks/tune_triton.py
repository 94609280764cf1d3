"""Launch settings of each Triton stage of the delta rule, timed one against another (GPU).

    python benchmarks/tune_triton.py --out tune.json

For each stage kernel (state pass forward/backward, stage 1 forward/backward, the solve) and
each candidate setting (tile sizes, warps), the median ms on the issue's 4K shape (KDA form,
bf16 inputs read in place, TF32 products) and the largest difference of its outputs from the
first setting's (the settings change tiling, not the math). The defaults in the kernels' modules
are the fastest of these on the machine this ran on (docs/RESULTS.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch
import triton
from bench_triton import draw_inputs

from deltalab.ops.delta_rule.triton import chunk as state_module
from deltalab.ops.delta_rule.triton import intra as intra_module
from deltalab.ops.delta_rule.triton import solve as solve_module
from deltalab.ops.delta_rule.triton.chunk import (
    _operators_triton,
    state_pass_triton,
    state_pass_triton_backward,
)
from deltalab.ops.delta_rule.triton.intra import Tokens


@contextlib.contextmanager
def patched(module, **values):
    before = {k: getattr(module, k) for k in values}
    for k, v in values.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in before.items():
            setattr(module, k, v)


def measure(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


def as_list(result):
    return list(result) if isinstance(result, tuple) else [result]


def max_diff(xs, ys):
    return max(float((x - y).abs().max()) for x, y in zip(xs, ys, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="4x4096x16x128")
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    batch, length, heads, dim = (int(n) for n in args.shape.split("x"))
    x = draw_inputs(batch, length, heads, dim, "cuda", torch.bfloat16)
    # Token-major bf16 inputs, read in place by the kernels as the backend passes them.
    q, a, b, u, g = (x["q"], x["beta"][..., None] * x["k"], x["k"], x["v"], x["g"])
    tokens = Tokens(-(-length // args.chunk), heads, length, args.chunk)
    ops, lower = _operators_triton(q, a, b, u, g, "tf32", tokens, 1.0)
    state = torch.randn(batch, heads, dim, dim, device="cuda")
    d_out = torch.randn_like(ops.target)
    d_lower, d_attend = torch.randn_like(lower), torch.randn_like(ops.attend)
    cases = {
        "state_pass": (
            state_module,
            [dict(NUM_WARPS=w, BLOCK_C=c, BLOCK_V=v)
             for w, c, v in [(4, 64, 32), (8, 64, 32), (4, 64, 16), (4, 32, 16), (8, 64, 64),
                             (8, 32, 32)]],
            lambda: state_pass_triton(ops, state, "tf32"),
            lambda: state_pass_triton_backward(ops, d_out, state, "tf32"),
        ),
        "intra": (
            intra_module,
            [dict(BLOCK_KD=k, LAUNCH={"num_warps": w, "num_stages": 1})
             for k, w in [(32, 4), (64, 4), (32, 8), (64, 8), (16, 4), (128, 8)]],
            lambda: intra_module.intra_triton(q, a, b, g, "tf32", tokens),
            lambda: intra_module.intra_triton_backward(
                q, a, b, g, d_lower, d_attend, "tf32", tokens
            ),
        ),
        "solve": (
            solve_module,
            [dict(BLOCK_N=n, LAUNCH={"num_warps": w, "num_stages": 1})
             for n, w in [(64, 4), (128, 4), (32, 4), (64, 8), (128, 8)]],
            lambda: solve_module.solve_triton(lower, u, "tf32", tokens),
            lambda: solve_module.solve_triton_backward(lower, d_out, "tf32"),
        ),
    }  # fmt: skip
    rows = []
    for stage, (module, settings, forward, backward) in cases.items():
        reference = None
        for setting in settings:
            with patched(module, **setting):
                try:
                    outputs = [*as_list(forward()), *as_list(backward())]
                    reference = reference or outputs
                    row = {"stage": stage, "setting": str(setting),
                           "fwd_ms": measure(forward), "bwd_ms": measure(backward),
                           "max_diff": max_diff(outputs, reference)}  # fmt: skip
                except Exception as error:  # a setting that fails to compile is a result too
                    row = {"stage": stage, "setting": str(setting), "error": repr(error)[:200]}
            rows.append(row)
            print(row, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
