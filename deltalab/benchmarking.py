"""Timing helpers shared by `deltalab check` and the scripts under benchmarks/."""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence

import torch


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


def add_speedups(result: dict, slow: str = "torch", fast: str = "triton") -> dict:
    """`result[slow]` and `result[fast]` hold "forward_ms" and "train_ms": adds their ratios,
    slow / fast, as "speedup_forward" and "speedup_train"."""
    for phase in ("forward", "train"):
        result[f"speedup_{phase}"] = result[slow][f"{phase}_ms"] / result[fast][f"{phase}_ms"]
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
    `with_grads(backend)` (the outputs and their gradients), and the relative error of each of
    with_grads' tensors against `reference` (float64), by `names`."""
    from deltalab.testing import relative_error

    result = {}
    for backend in backends:

        def run_forward(backend=backend) -> None:
            with torch.no_grad():
                forward(backend)

        got = with_grads(backend)
        result[backend] = {
            "forward_ms": median_ms(run_forward, device, repeats),
            "train_ms": median_ms(lambda backend=backend: with_grads(backend), device, repeats),
            "errors": {
                n: relative_error(a, e) for n, a, e in zip(names, got, reference, strict=True)
            },
        }
    return result


def print_backend_case(
    title: str, result: dict, backends: tuple[str, ...], bytes_note: str = ""
) -> None:
    """One case of a backend comparison: per backend its forward and forward+backward ms, its
    achieved GB/s when the result has them (`result[backend]["gb_per_s"]`, "forward" and
    "train": a kernel's bytes over each backend's time, what `bytes_note` says) and its errors
    (`result[backend]["errors"]`, name -> value), then `add_speedups`' ratios."""
    print(f"\n{title}")
    names = list(result[backends[0]]["errors"])
    rates = "gb_per_s" in result[backends[0]]
    rows = [
        [backend, result[backend]["forward_ms"], result[backend]["train_ms"]]
        + ([result[backend]["gb_per_s"][k] for k in ("forward", "train")] if rates else [])
        + [result[backend]["errors"][n] for n in names]
        for backend in backends
    ]
    headers = ["backend", "fwd ms", "fwd+bwd ms"]
    headers += ["fwd GB/s*", "fwd+bwd GB/s*"] if rates else []
    print(format_table(headers + [f"err {n}" for n in names], rows))
    note = f"  (* {bytes_note})" if rates and bytes_note else ""
    print(f"{backends[0]} / {backends[-1]}: forward {result['speedup_forward']:.2f}x, "
          f"forward+backward {result['speedup_train']:.2f}x{note}")  # fmt: skip


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


def format_table(headers: list[str], rows: list[list[object]]) -> str:
    """A plain-text table with right-aligned columns."""
    cells = [headers] + [[_format(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _format(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"
    return str(value)


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
