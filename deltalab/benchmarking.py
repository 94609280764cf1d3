"""Timing and table helpers shared by `deltalab check` and the benchmark suites (benchmarks/)."""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deltalab.tables import format_table


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_seconds(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of `fn()` over `repeats` runs after `warmup` untimed runs."""
    for _ in range(warmup):
        fn()
    _synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def median_ms(fn: Callable[[], object], device: str, repeats: int) -> float:
    """Median ms of `fn()`: `triton.testing.do_bench` on CUDA (its own warm-up and repeats,
    the L2 cache flushed between runs), else wall time after one warm-up over `repeats` runs (a
    CPU run under the Triton interpreter)."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    return 1e3 * median_seconds(fn, repeats)


def kernel_times(prof: torch.profiler.profile, calls: int, device: str) -> dict[str, float]:
    """Milliseconds per call of each kernel a profile saw over `calls` calls (CUDA: the device
    time of the kernels themselves, not of the ops that launched them, which would count them
    twice; CPU: each aten op's own time)."""
    times: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        if device == "cuda":
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = getattr(e, "self_device_time_total", None) or e.device_time_total
        else:
            if not e.key.startswith("aten::"):
                continue
            us = e.self_cpu_time_total
        if us > 0:
            times[e.key] += us / calls / 1e3
    return dict(times)


# Bytes zeroed between timed calls on CUDA, as `triton.testing.do_bench` does: more than an
# H200's 50 MiB of L2, so that no call reads what the previous one left in the cache.
L2_FLUSH_BYTES = 256 * 2**20


def kernel_ms(fn: Callable[[], object], device: str, repeats: int) -> float:
    """The kernels' own time in one `fn()` call, averaged over `repeats` calls after one
    warm-up (torch.profiler). A wall-clock timer of short kernels (`median_ms`) also counts the
    host's time between launches whenever the host is the slower side (autograd, wrappers,
    Triton's launcher); this does not. On CUDA the L2 cache is flushed before each call and the
    flushes' own kernel time is taken out (profiled alone, the same number of times). Elsewhere
    it is the aten ops' own CPU time (a Triton kernel under the interpreter is not an aten op
    and is not counted: compare backends with it on CUDA only)."""
    fn()
    _synchronize()
    if device != "cuda":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(repeats):
                fn()
        return sum(kernel_times(prof, repeats, device).values())
    flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]

    def profiled(call: Callable[[], object]) -> float:
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(repeats):
                flush.zero_()
                call()
            torch.cuda.synchronize()
        return sum(kernel_times(prof, repeats, device).values())

    return max(0.0, profiled(fn) - profiled(lambda: None))


def phase_times(
    forward: Callable[[], object], train: Callable[[], object], device: str, repeats: int
) -> dict[str, float]:
    """ "forward_ms" and "train_ms" (`median_ms`: wall clock) of a forward and of a forward and
    backward; on CUDA also "forward_kernel_ms" and "train_kernel_ms" (`kernel_ms`: the kernels
    alone), so that small kernels are compared without the host's share."""
    times = {
        "forward_ms": median_ms(forward, device, repeats),
        "train_ms": median_ms(train, device, repeats),
    }
    if device == "cuda":
        times["forward_kernel_ms"] = kernel_ms(forward, device, repeats)
        times["train_kernel_ms"] = kernel_ms(train, device, repeats)
    return times


def add_speedups(result: dict, slow: str = "torch", fast: str = "triton") -> dict:
    """`result[slow]` and `result[fast]` hold "forward_ms" and "train_ms" (and, from
    `phase_times` on CUDA, "forward_kernel_ms" and "train_kernel_ms"): adds their ratios, slow
    / fast, as "speedup_forward" and "speedup_train" (and "speedup_forward_kernel",
    "speedup_train_kernel")."""
    for phase in ("forward", "train"):
        result[f"speedup_{phase}"] = result[slow][f"{phase}_ms"] / result[fast][f"{phase}_ms"]
        key = f"{phase}_kernel_ms"
        if key in result[slow] and key in result[fast] and result[fast][key] > 0:
            result[f"speedup_{phase}_kernel"] = result[slow][key] / result[fast][key]
    return result


def print_backend_case(
    title: str, result: dict, backends: tuple[str, ...], bytes_note: str = ""
) -> None:
    """One case of a backend comparison: per backend its forward and forward+backward ms (and
    the kernels' own ms when the result has them, `phase_times` on CUDA), its
    achieved GB/s when the result has them (`result[backend]["gb_per_s"]`, "forward" and
    "train": a kernel's bytes over each backend's time, what `bytes_note` says) and its errors
    (`result[backend]["errors"]`, name -> value), then `add_speedups`' ratios."""
    print(f"\n{title}")
    names = list(result[backends[0]]["errors"])
    rates = "gb_per_s" in result[backends[0]]
    kernels = all("forward_kernel_ms" in result[b] for b in backends)
    kernel_keys = ("forward_kernel_ms", "train_kernel_ms") if kernels else ()
    rows = [
        [backend, result[backend]["forward_ms"], result[backend]["train_ms"]]
        + [result[backend][k] for k in kernel_keys]
        + ([result[backend]["gb_per_s"][k] for k in ("forward", "train")] if rates else [])
        + [result[backend]["errors"][n] for n in names]
        for backend in backends
    ]
    headers = ["backend", "fwd ms", "fwd+bwd ms"]
    headers += ["fwd kernels ms", "fwd+bwd kernels ms"] if kernels else []
    headers += ["fwd GB/s*", "fwd+bwd GB/s*"] if rates else []
    print(format_table(headers + [f"err {n}" for n in names], rows))
    note = f"  (* {bytes_note})" if rates and bytes_note else ""
    print(f"{backends[0]} / {backends[-1]}: forward {result['speedup_forward']:.2f}x, "
          f"forward+backward {result['speedup_train']:.2f}x{note}")  # fmt: skip
    if "speedup_forward_kernel" in result and "speedup_train_kernel" in result:
        print(f"  kernels alone: forward {result['speedup_forward_kernel']:.2f}x, "
              f"forward+backward {result['speedup_train_kernel']:.2f}x")  # fmt: skip


# Operators that only make views, read metadata or allocate (no kernel on a GPU).
NOT_KERNELS = set(
    "view _unsafe_view reshape _reshape_alias expand unsqueeze squeeze permute transpose t "
    "select slice as_strided alias detach unflatten flatten split split_with_sizes unbind chunk "
    "narrow lift_fresh empty empty_strided empty_like new_empty resolve_conj resolve_neg to "
    "result_type promote_types resize_ is_same_size".split()
)


# Operators that read a value back to the host (`.item()`, `bool(t)`, `.tolist()`): on a GPU
# each waits for the device.
HOST_READS = {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::equal"}


class OperatorCounter(TorchDispatchMode):
    """The CPU stand-in for a GPU's kernel list: every ATen operator dispatched below autograd
    (composites already split into their parts, as they launch on a GPU), `NOT_KERNELS` left
    out, with its count and seconds."""

    def __init__(self) -> None:
        super().__init__()
        self.totals: dict[str, list[float]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if name not in NOT_KERNELS:
            entry = self.totals.setdefault("aten::" + name, [0, 0.0])
            entry[0] += 1
            entry[1] += 1e6 * (time.perf_counter() - start)
        return out
