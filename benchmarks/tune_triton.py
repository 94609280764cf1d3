"""Launch settings of each Triton stage of the delta rule, timed one against another (GPU).

    python -m benchmarks tune                                   # GPU, B=4 T=4096 H=16 K=128
    python -m benchmarks tune --shape 4x4096x8x128 --stages state_pass state_pass_split
    TRITON_INTERPRET=1 python -m benchmarks tune --device cpu --shape 1x64x1x16 --stages intra

For each stage kernel (stage 1 forward/backward, the decay factors, the solve and dL, the state
pass forward/backward, the operator gradients) and each candidate setting (tile sizes, warps,
pipeline stages), the median ms at `--shape` (default B=4 T=4096 H=16 K=128; KDA form, bf16
inputs read in place, the products as the defaults take them: TF32, but bf16 in the state
pass's walks) and the largest difference of its outputs from the first setting's, relative to
each output's largest element, over the elements a kernel writes (most settings change tiling,
not the math; the rows that set walk_dots, `KernelOptions.walk_dots`, change the products'
precision and differ by it). Each stage's first setting is its module's default, chosen from
these sweeps on an H200 (docs/PERFORMANCE.md; where a faster setting is not the default, the
module's comment says why). On CPU (under the interpreter) it only proves the settings run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from functools import partial

import torch
import triton

from benchmarks.bench_triton import draw_inputs, print_records
from benchmarks.common import parse_shape
from deltalab.errors import UserError
from deltalab.ops.delta_rule.triton import chunk as state_module
from deltalab.ops.delta_rule.triton import factors as factors_module
from deltalab.ops.delta_rule.triton import intra as intra_module
from deltalab.ops.delta_rule.triton import solve as solve_module
from deltalab.ops.delta_rule.triton.chunk import (
    _operators_triton,
    operator_dtype,
    operator_grads_triton,
    state_pass_split_triton,
    state_pass_split_triton_backward,
    state_pass_triton,
    state_pass_triton_backward,
)
from deltalab.ops.delta_rule.triton.intra import Tokens


def measure(fn, device):
    if device == "cuda":
        return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def flatten(result):
    """The tensors of a result: a tensor, or (nested) tuples and lists of them and of None."""
    if isinstance(result, torch.Tensor):
        return [result]
    return [t for item in (result or ()) for t in flatten(item)]


def max_diff(xs, ys):
    """The largest difference between two settings' outputs, relative to each output's largest
    element (the factors' adjoint has elements near 1e3, where float32 rounding alone is 1e-4)."""
    return max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-30))
               for x, y in zip(xs, ys, strict=True))  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", type=parse_shape, default=(4, 4096, 16, 128), help="BxTxHxK")
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--stages", nargs="+", default=None, help="only these stages")


def run(args: argparse.Namespace) -> dict:
    device = args.device
    batch, length, heads, dim = args.shape
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter: fp32 only
    x = draw_inputs(batch, length, heads, dim, device, dtype)
    precision = "tf32" if device == "cuda" else "ieee"
    # Token-major inputs, read in place by the kernels as the backend passes them; a = beta,
    # a strength per token, as the KDA layers pass it.
    q, a, b, u, g = (x["q"], x["beta"], x["k"], x["v"], x["g"])
    tokens = Tokens(-(-length // args.chunk), heads, length, args.chunk)
    ops, lower = _operators_triton(
        q, a, b, u, g, precision, tokens, 1.0, operator_dtype(q, a, b, u)
    )
    state = torch.randn(batch, heads, dim, dim, device=device)
    # The gradients are float32 whatever dtype the operators are stored in.
    f32 = {"dtype": torch.float32}
    d_out = torch.randn_like(ops.target, **f32)
    d_lower, d_attend = torch.randn_like(lower), torch.randn_like(ops.attend, **f32)
    _, residuals, states, _ = state_pass_triton(ops, state, precision)
    d_residual, d_next, _ = state_pass_triton_backward(ops, d_out, state, precision)
    # d read, d rhs, d write, dq1, da1, db1
    chunked = [torch.randn_like(ops.read, **f32) for _ in range(6)]
    d_decay = torch.randn_like(ops.decay)

    # A row's `walk_dots` (the option, passed to the state passes), set for each row below; its
    # other keys are fields of the stage's launch table (its module's `LAUNCH` otherwise).
    walk = {"walk_dots": "operators"}

    cases = {
        "intra": (
            intra_module.LAUNCH,
            [dict(block=k, num_warps=w) for k in (64, 128, 32) for w in (1, 2, 4)],
            lambda t: intra_module.intra_triton(q, a, b, g, precision, tokens, table=t),
            lambda t: intra_module.intra_triton_backward(
                q, a, b, g, d_lower, d_attend, precision, tokens, table=t
            ),
        ),
        "factors": (
            factors_module.LAUNCH,
            [dict(block=k, num_warps=w) for k in (32, 64, 128) for w in (4, 8, 2)],
            lambda t: factors_module.factors_triton(q, a, b, g, tokens, table=t),
            lambda t: factors_module.factors_triton_backward(
                q, a, b, g, *chunked[:3], d_decay, *chunked[3:], tokens, table=t
            ),
        ),
        "solve": (
            solve_module.LAUNCH,
            [dict(block=n, num_warps=w) for n in (64, 128, 32) for w in (4, 2, 8)],
            lambda t: solve_module.solve_triton(lower, u, precision, tokens, table=t),
            lambda t: [
                solve_module.solve_triton_backward(lower, d_out, precision, table=t),
                solve_module.lower_grad_triton(d_out, ops.target, d_out, ops.target, precision,
                                               t),
            ],
            # dL's blocks above the diagonal are never written (nothing reads them).
            lambda outputs: [*outputs[:-1], torch.tril(outputs[-1], -1)],
        ),
        "state_pass": (
            state_module.LAUNCH,
            # First the defaults (with 16-bit operators, products in their dtype, walk_dots),
            # then each setting as given with the products widened to float32: warps, row
            # block, value columns and pipeline stages (num_stages: 16-bit operators only), the
            # narrow launch off (their outputs differ from the first row's by the rounding);
            # then the widened products at their default launch, and 16-bit products at some of
            # the same settings.
            [{}] + [dict(num_warps=w, block_c=c, block_v=v, num_stages=s, narrow_block_v=None,
                         walk_dots="float32")
                    for w, c, v, s in [(8, 64, 64, 1), (4, 64, 64, 1), (4, 64, 32, 1),
                                       (8, 64, 32, 1), (4, 32, 16, 1), (2, 64, 32, 1),
                                       (2, 32, 16, 1), (8, 64, 64, 2), (8, 64, 64, 3),
                                       (4, 64, 32, 2), (8, 64, 32, 2), (4, 64, 16, 2)]]
            + [{"walk_dots": "float32"}]  # the widened products at their own default launch
            + [dict(num_warps=w, block_c=64, block_v=v, num_stages=s, narrow_block_v=None,
                    low_dots_num_warps=w, low_dots_num_stages=s, walk_dots="operators")
               for w, v, s in [(8, 64, 1), (8, 64, 2), (4, 64, 2), (8, 128, 1), (4, 32, 2),
                               (8, 32, 2)]],
            lambda t: state_pass_triton(ops, state, precision, table=t, **walk),
            lambda t: state_pass_triton_backward(ops, d_out, state, precision, table=t, **walk),
        ),
        # The split pass (the walk, then the outputs; the dO products, then the adjoint walk),
        # to time against state_pass's first (default) row: the walk's pipeline stages, value
        # block and warps, the parallel kernels' value block and warps. First row: the defaults.
        "state_pass_split": (
            state_module.LAUNCH,
            [{}]
            + [dict(split_num_stages=s, split_walk_block_v=v, split_walk_num_warps=w,
                    split_block_v=sv, split_num_warps=sw)
               for s, v, w, sv, sw in [(2, 16, 2, 64, 8), (2, 32, 4, 64, 8), (1, 64, 8, 64, 8),
                                       (2, 16, 4, 64, 8), (2, 16, 1, 64, 8), (3, 16, 2, 64, 8),
                                       (2, 16, 2, 32, 4), (2, 16, 2, 128, 8), (3, 32, 4, 64, 8),
                                       (4, 16, 2, 64, 8), (3, 16, 1, 64, 8)]]
            # The walks' products widened to float32 (walk_dots; 16-bit products are the
            # default), at the defaults and with the walk at 32 columns and 4 warps.
            + [{"walk_dots": "float32"},
               dict(split_walk_block_v=32, split_walk_num_warps=4, walk_dots="float32")],
            lambda t: state_pass_split_triton(ops, state, precision, table=t, **walk),
            lambda t: state_pass_split_triton_backward(ops, d_out, state, precision, table=t,
                                                       **walk),
        ),
        "operator_grads": (
            state_module.LAUNCH,
            [dict(num_warps=w, operator_block_v=v) for w in (8, 4, 2) for v in (32, 64, 16)],
            lambda t: operator_grads_triton(
                states, residuals, d_out, d_residual, d_next, precision, table=t
            ),
            None,
        ),
    }  # fmt: skip
    if args.stages:
        unknown = set(args.stages) - set(cases)
        if unknown:
            raise UserError(f"--stages: unknown {sorted(unknown)}; known: {sorted(cases)}")
        cases = {k: v for k, v in cases.items() if k in args.stages}
    rows = []
    for stage, (default, settings, forward, backward, *written) in cases.items():
        reference = None
        for setting in settings:
            fields = dict(setting)
            walk["walk_dots"] = fields.pop("walk_dots", "operators")
            table = replace(default, **fields)
            try:
                outputs = flatten(forward(table)) + (flatten(backward(table)) if backward else [])
                outputs = written[0](outputs) if written else outputs
                reference = reference or outputs
                row = {"stage": stage, "setting": str(setting),
                       "fwd_ms": measure(partial(forward, table), device),
                       "bwd_ms": measure(partial(backward, table), device) if backward else None,
                       "max_diff": max_diff(outputs, reference)}  # fmt: skip
            except Exception as error:  # a setting that fails to compile is a result too
                row = {"stage": stage, "setting": str(setting), "error": repr(error)[:200]}
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
    print_records(rows)
    return {"device": device, "rows": rows}
