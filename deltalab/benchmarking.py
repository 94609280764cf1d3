"""Timing helpers shared by `deltalab check` and the scripts under benchmarks/."""

from __future__ import annotations

import importlib.util
import platform
import statistics
import time
from collections.abc import Callable

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
