"""Where the time of one forward+backward goes, kernel by kernel (torch.profiler), per form.

    python -m benchmarks profile kernels --forms kda_c64 fla_kda --batch 4 --length 4096  # CUDA

Prints, per form, the kernels sorted by total GPU time over `--steps` forward+backward passes
(after warm-up). Uses the ops suite's inputs and forms (bf16 inputs; fla's where it imports).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.bench_triton import draw_inputs, fla_forms, forms
from benchmarks.common import backward_fresh
from deltalab.errors import UserError


def profile_form(fn, names, inputs, steps: int, top: int):
    leaves = {k: (v.clone().requires_grad_() if k in names else v) for k, v in inputs.items()}
    d_out = torch.randn_like(fn(**inputs))
    grads = [leaves[k] for k in names]
    for _ in range(3):
        backward_fresh(fn(**leaves), d_out, grads)
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            backward_fresh(fn(**leaves), d_out, grads)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        # Kernels only: an op that launched kernels carries their time too (counted twice).
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        gpu_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if gpu_us > 0 and e.key:
            rows.append({"kernel": e.key[:90], "calls": e.count // steps,
                         "ms_per_step": gpu_us / steps / 1e3})  # fmt: skip
    rows.sort(key=lambda r: -r["ms_per_step"])
    total = sum(r["ms_per_step"] for r in rows)
    return {"total_gpu_ms_per_step": total, "kernels": rows[:top]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--forms", nargs="+", default=["kda_c64", "fla_kda"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=25)


def run(args: argparse.Namespace) -> dict:
    if not torch.cuda.is_available():
        raise UserError("profile kernels reads the GPU's kernels: it needs CUDA")
    inputs = draw_inputs(args.batch, args.length, args.heads, args.dim, "cuda", torch.bfloat16)
    cases = {}
    for chunk in (64, 128):
        cases.update({f"{k}_c{chunk}": v for k, v in forms("triton", chunk).items()})
    cases.update(fla_forms())
    report = {}
    for name in args.forms:
        fn, names = cases[name]
        report[name] = profile_form(fn, names, inputs, args.steps, args.top)
        print(f"\n== {name}: {report[name]['total_gpu_ms_per_step']:.2f} ms GPU per fwd+bwd")
        for r in report[name]["kernels"]:
            print(f"{r['ms_per_step']:8.3f} ms  x{r['calls']:<3d} {r['kernel']}")
    return report
