"""Where the GPU waits for the host: the device's idle gaps in a profiled op, and who caused them.

    python -m benchmarks profile gaps --forms kda_c64 kdn_iso_c64     # CUDA only

Wall time beyond kernel time (`python -m benchmarks ops --parts overhead`) says how much the
device idles, not where. This runs each form's forward and backward (the ops suite's forms and
inputs, bf16) back to back under the profiler, with the value checks on and, separately, off,
and reads the trace: every stretch where no kernel, copy or fill runs on the device longer than
`--min-us`, attributed to the host code that launched the work after it (the innermost Python
function and PyTorch op around that launch) and marked when the host sat in a synchronizing
call (a read-back) during it. Gaps are summed per attribution: the top rows are what to fix.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
from collections import defaultdict
from pathlib import Path

# Trace categories: work on the device, launches from the host, host code.
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATEGORIES = ("cpu_op", "python_function", "user_annotation")
# Runtime calls in which the host waits for the device.
SYNCHRONIZING = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "cudaMemcpyAsync",
)


def _end(event: dict) -> float:
    return event["ts"] + event.get("dur", 0.0)


def _correlation(event: dict) -> int | None:
    return event.get("args", {}).get("correlation")


def _launched_in(host: list[dict], thread, at: float, depth: int) -> list[str]:
    """The names of the host events on `thread` that enclose time `at`, outermost first, the
    innermost `depth` of them."""
    around = [e for e in host if e.get("tid") == thread and e["ts"] <= at <= _end(e)]
    around.sort(key=lambda e: (e["ts"], -_end(e)))
    return [e["name"] for e in around][-depth:]


def device_gaps(events: list[dict], min_us: float = 5.0, depth: int = 3) -> list[dict]:
    """The device's idle gaps of at least `min_us` microseconds in a Chrome trace's events
    (`torch.profiler`'s `export_chrome_trace`), in time order: each with its length, the
    device work after it, the host code that launched that work (`launched_in`, outermost
    first) and whether the host was in a synchronizing runtime call during the gap. The device's
    streams count as one timeline: a gap is a stretch where none of them runs anything."""
    timed = [e for e in events if e.get("ph") == "X" and "ts" in e]
    device = sorted((e for e in timed if e.get("cat") in DEVICE_CATEGORIES), key=lambda e: e["ts"])
    runtime = [e for e in timed if e.get("cat") == "cuda_runtime"]
    launches = {_correlation(e): e for e in runtime if _correlation(e) is not None}
    syncs = [e for e in runtime if e["name"] in SYNCHRONIZING]
    host = [e for e in timed if e.get("cat") in HOST_CATEGORIES]
    gaps = []
    busy_until = None
    for work in device:
        if busy_until is not None and work["ts"] - busy_until >= min_us:
            launch = launches.get(_correlation(work))
            thread, at = (launch["tid"], launch["ts"]) if launch else (None, work["ts"])
            waited = any(s["ts"] < work["ts"] and _end(s) > busy_until for s in syncs)
            gaps.append(
                {
                    "start_us": busy_until,
                    "idle_us": work["ts"] - busy_until,
                    "before": work["name"],
                    "launched_in": _launched_in(host, thread, at, depth) if launch else [],
                    "host_waited": waited,
                }
            )
        busy_until = _end(work) if busy_until is None else max(busy_until, _end(work))
    return gaps


def summarize(gaps: list[dict], top: int = 15) -> list[dict]:
    """Gaps summed per attribution (the launching host code, and whether the host had waited on
    the device), largest total first."""
    totals: dict[tuple, list[float]] = defaultdict(list)
    for gap in gaps:
        key = (" > ".join(gap["launched_in"]) or gap["before"], gap["host_waited"])
        totals[key].append(gap["idle_us"])
    rows = [
        {"launched_in": k[0], "host_waited": k[1], "gaps": len(v), "idle_us": sum(v)}
        for k, v in totals.items()
    ]
    return sorted(rows, key=lambda r: -r["idle_us"])[:top]


def _profile_form(fn, names, inputs, iterations: int, checks: bool, min_us: float) -> dict:
    import torch

    from benchmarks.bench_triton import value_checks_off
    from benchmarks.common import backward_fresh

    leaves = {k: (v.clone().requires_grad_() if k in names else v) for k, v in inputs.items()}
    d_out = torch.randn_like(fn(**inputs))

    def step():
        backward_fresh(fn(**leaves), d_out, [leaves[k] for k in names])

    with contextlib.nullcontext() if checks else value_checks_off():
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities, with_stack=True) as prof:
            for _ in range(iterations):
                step()
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        events = json.loads(Path(path).read_text())["traceEvents"]
    gaps = device_gaps(events, min_us)
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES]
    span = (max(map(_end, device)) - min(e["ts"] for e in device)) if device else 0.0
    busy = sum(e.get("dur", 0.0) for e in device)
    return {
        "checks": checks,
        "iterations": iterations,
        "device_span_ms_per_iteration": span / 1e3 / iterations,
        "device_busy_ms_per_iteration": busy / 1e3 / iterations,
        "idle_ms_per_iteration": sum(g["idle_us"] for g in gaps) / 1e3 / iterations,
        "top": summarize(gaps),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from benchmarks.common import parse_shape

    parser.add_argument("--forms", nargs="+", default=["kda_c64", "kdn_iso_c64", "kdn_diag_c64"])
    parser.add_argument("--shape", type=parse_shape, default=(4, 4096, 16, 128), help="BxTxHxD")
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--min-us", type=float, default=5.0)


def run(args: argparse.Namespace) -> dict:
    import torch

    from deltalab.errors import UserError

    if not torch.cuda.is_available():
        raise UserError("profile gaps reads the GPU's timeline: it needs CUDA")
    from benchmarks.bench_triton import draw_inputs, forms

    inputs = draw_inputs(*args.shape, "cuda", torch.bfloat16)
    cases = {}
    for chunk in (64, 128):
        cases.update({f"{k}_c{chunk}": v for k, v in forms("triton", chunk).items()})
    report = {}
    for name in args.forms:
        fn, names = cases[name]
        for checks in (True, False):
            result = _profile_form(fn, names, inputs, args.iterations, checks, args.min_us)
            report[f"{name}, checks {'on' if checks else 'off'}"] = result
            print(
                f"\n== {name}, checks {'on' if checks else 'off'}: device span "
                f"{result['device_span_ms_per_iteration']:.3f} ms, busy "
                f"{result['device_busy_ms_per_iteration']:.3f}, idle in gaps >= {args.min_us} us "
                f"{result['idle_ms_per_iteration']:.3f} (per forward+backward)"
            )
            for row in result["top"]:
                waited = " (host waited)" if row["host_waited"] else ""
                print(f"{row['idle_us'] / args.iterations:9.1f} us x{row['gaps']:<3d} "
                      f"{row['launched_in']}{waited}")  # fmt: skip
    return report
