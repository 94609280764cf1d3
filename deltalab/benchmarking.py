"""Timing helpers shared by `deltalab check` and the scripts under benchmarks/."""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deltalab.ops.options import DEFAULT_OPTIONS, KernelOptions
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


def time_backends(
    backends: Sequence[str],
    forward: Callable[[str], object],
    with_grads: Callable[[str], list[torch.Tensor]],
    reference: list[torch.Tensor],
    names: Sequence[str],
    device: str,
    repeats: int,
) -> dict:
    """Per backend: the median ms of `forward(backend)` without autograd and of
    `with_grads(backend)` (the outputs and their gradients; `phase_times`, with the kernels'
    own time on CUDA), and the relative error of each of with_grads' tensors against
    `reference` (float64), by `names`."""
    from deltalab.testing import relative_error

    result = {}
    for backend in backends:

        def run_forward(backend=backend) -> None:
            with torch.no_grad():
                forward(backend)

        got = with_grads(backend)
        result[backend] = {
            **phase_times(
                run_forward, lambda backend=backend: with_grads(backend), device, repeats
            ),
            "errors": {
                n: relative_error(a, e) for n, a, e in zip(names, got, reference, strict=True)
            },
        }
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


def forward_and_train_seconds(
    fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], repeats: int
) -> tuple[float, float]:
    """Median seconds of `fn(*inputs)` without autograd, and of `fn(*inputs).sum().backward()`
    with every input a fresh leaf."""

    def forward() -> None:
        with torch.no_grad():
            fn(*inputs)

    leaves = [x.clone().requires_grad_() for x in inputs]

    def train() -> None:
        fn(*leaves).sum().backward()

    return median_seconds(forward, repeats), median_seconds(train, repeats)


def run_environment(device: str) -> dict[str, str | None]:
    """What a benchmark's JSON records of the machine: the device's name (the GPU's on CUDA, the
    processor's otherwise) and the torch and Triton versions (None without Triton)."""
    if device == "cuda":
        name = torch.cuda.get_device_name()
    else:
        name = platform.processor() or platform.machine()
    triton = None
    if importlib.util.find_spec("triton") is not None:
        import triton as triton_module

        triton = triton_module.__version__
    return {"device": name, "torch": torch.__version__, "triton": triton}


def case_parser(description: str, option: str, cases: Sequence[str]) -> argparse.ArgumentParser:
    """The command line of a backend-comparison script: --out (JSON), --tiny (the tiny shapes,
    float32, on CPU: a run under the Triton interpreter), --repeats (CPU only) and `option`
    (e.g. "--cases") choosing among `cases`, all by default."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", required=True, help="path of the JSON file to write")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (interpreter smoke run)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs (CPU only)")
    parser.add_argument(option, nargs="+", default=list(cases), choices=list(cases))
    return parser


def model_parser(description: str, mixers: Sequence[str]) -> argparse.ArgumentParser:
    """The command line of a whole-model script: --out (JSON), --tiny (the tiny preset on CPU:
    a smoke run), --preset (default 340M) and --mixers (default `mixers`)."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--tiny", action="store_true", help="tiny preset on CPU (smoke run)")
    parser.add_argument("--preset", default="340M")
    parser.add_argument("--mixers", nargs="+", default=list(mixers))
    return parser


def run_cases(
    args: argparse.Namespace,
    names: Sequence[str],
    measure: Callable[[str, str, int], dict],
    show: Callable[[dict], None],
) -> list[dict]:
    """`measure(name, device, repeats)` for each case name, then `show` it; the JSON at
    `args.out` (`run_environment` and "cases") is written after every case, so a run stopped by
    its time limit keeps what it measured. CUDA unless --tiny or none is there."""
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    repeats = args.repeats or (1 if args.tiny else 10)
    header = run_environment(device)
    print(" ".join(f"{k}={v}" for k, v in header.items()))
    results: list[dict] = []
    for name in names:
        results.append(measure(name, device, repeats))
        show(results[-1])
        with open(args.out, "w") as f:
            json.dump({**header, "cases": results}, f, indent=1)
    print(f"\nwrote {args.out}")
    return results


def add_delta_rule_options(parser: argparse.ArgumentParser) -> None:
    """The `KernelOptions` a benchmark can set from its command line (`delta_rule_options`):
    the Triton delta rule's state pass, whether its backward walks the chunk-start states again,
    the dtype of its chunk operators and of its walks' products, whether the layers rebuild
    the delta rule's cheap inputs in the backward."""
    parser.add_argument(
        "--state-pass",
        choices=["auto", "fused", "split"],
        default="auto",
        help="the Triton delta rule's state pass (KernelOptions.state_pass)",
    )
    parser.add_argument(
        "--keep-states",
        action="store_true",
        help="the Triton delta rule keeps its chunk-start states and residuals for the backward "
        "instead of walking them again (KernelOptions.recompute_states off)",
    )
    parser.add_argument(
        "--operator-dtype",
        choices=["inputs", "float32"],
        default="inputs",
        help="the dtype the Triton delta rule stores its chunk operators in: the inputs' 16-bit "
        "dtype or float32 (KernelOptions.operator_dtype)",
    )
    parser.add_argument(
        "--walk-dots",
        choices=["operators", "float32"],
        default="operators",
        help="the products of the Triton delta rule's walks with 16-bit operators: in the "
        "operators' dtype or widened to float32 (KernelOptions.walk_dots)",
    )
    parser.add_argument(
        "--keep-inputs",
        action="store_true",
        help="the delta rule keeps the inputs that cheap ops made (gate products, read query, "
        "log decay) instead of rebuilding them in the backward "
        "(KernelOptions.rebuild_in_backward off)",
    )


def delta_rule_options(args: argparse.Namespace) -> KernelOptions:
    """The `KernelOptions` that `add_delta_rule_options` parsed."""
    return KernelOptions(
        state_pass=args.state_pass,
        recompute_states=not args.keep_states,
        operator_dtype=args.operator_dtype,
        walk_dots=args.walk_dots,
        rebuild_in_backward=not args.keep_inputs,
    )


def changed_options(options: KernelOptions) -> dict[str, object]:
    """The fields of `options` that differ from the defaults (what a config needs to hold)."""
    return {k: v for k, v in options.to_dict().items() if v != DEFAULT_OPTIONS.to_dict()[k]}


def backward_fresh(out: torch.Tensor, d_out: torch.Tensor, leaves: Sequence[torch.Tensor]) -> None:
    """`out.backward(d_out)` into fresh `.grad` tensors: the leaves' gradients from an earlier
    call are dropped first. A timed loop of forward+backward calls would otherwise also time
    autograd's accumulation into `.grad`, an add over every leaf each call, which the
    activations of a training step do not have (on the H200 five bf16 adds took 0.37 ms of the
    KDA form's 13 at B=1 T=32768 H=16)."""
    for leaf in leaves:
        leaf.grad = None
    out.backward(d_out)


# Operators that only make views, read metadata or allocate (no kernel on a GPU).
NOT_KERNELS = set(
    "view _unsafe_view reshape _reshape_alias expand unsqueeze squeeze permute transpose t "
    "select slice as_strided alias detach unflatten flatten split split_with_sizes unbind chunk "
    "narrow lift_fresh empty empty_strided empty_like resolve_conj resolve_neg to result_type "
    "promote_types resize_ is_same_size".split()
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
