"""deltalab.benchmarking: the timing helpers behind the benchmark scripts' tables."""

from __future__ import annotations

import pytest
import torch

from deltalab import benchmarking


def test_kernel_ms_counts_the_ops_of_a_call_and_grows_with_the_work():
    """On CPU the kernels' own time is the aten ops' self time: positive for a call that runs
    ops, and larger for ten times the work (the host's Python between calls not counted)."""
    a = torch.randn(256, 256)

    def once() -> None:
        a @ a

    def ten_times() -> None:
        for _ in range(10):
            a @ a

    one = benchmarking.kernel_ms(once, "cpu", 5)
    ten = benchmarking.kernel_ms(ten_times, "cpu", 5)
    assert one > 0 and ten > 3 * one
    assert benchmarking.kernel_ms(lambda: None, "cpu", 5) == 0


def test_phase_times_on_cpu_give_wall_clock_only():
    """The kernels' own time is measured on CUDA only (a Triton kernel under the interpreter
    is no aten op), so the CPU result holds the wall-clock figures alone."""
    times = benchmarking.phase_times(lambda: None, lambda: None, "cpu", 2)
    assert set(times) == {"forward_ms", "train_ms"}


def _result(kernels: bool) -> dict:
    def backend(ms: float) -> dict:
        entry = {"forward_ms": ms, "train_ms": 2 * ms, "errors": {"y": 1e-7}}
        if kernels:
            entry |= {"forward_kernel_ms": ms / 4, "train_kernel_ms": ms / 2}
        return entry

    return {"torch": backend(2.0), "triton": backend(1.0)}


@pytest.mark.parametrize("kernels", [False, True])
def test_speedups_and_the_table_show_the_kernel_times_when_measured(kernels, capsys):
    result = benchmarking.add_speedups(_result(kernels))
    assert result["speedup_forward"] == result["speedup_train"] == 2.0
    assert ("speedup_forward_kernel" in result) == kernels
    if kernels:
        assert result["speedup_forward_kernel"] == result["speedup_train_kernel"] == 2.0
    benchmarking.print_backend_case("case", result, ("torch", "triton"))
    out = capsys.readouterr().out
    assert ("fwd kernels ms" in out) == kernels
    assert ("kernels alone: forward 2.00x, forward+backward 2.00x" in out) == kernels


def test_a_forward_only_result_shows_and_compares_its_forward_alone(capsys):
    result = _result(kernels=True)
    for entry in result.values():
        del entry["train_ms"], entry["train_kernel_ms"]
    result = benchmarking.add_speedups(result)
    assert result["speedup_forward"] == result["speedup_forward_kernel"] == 2.0
    assert "speedup_train" not in result
    benchmarking.print_backend_case("case", result, ("torch", "triton"))
    out = capsys.readouterr().out
    assert "fwd kernels ms" in out and "fwd+bwd" not in out
    assert "torch / triton: forward 2.00x\n" in out and "kernels alone: forward 2.00x\n" in out
