"""The GPU benchmark scripts of the fused ops run end to end at their tiny shapes under the
Triton interpreter, so a script that would crash on the GPU machine (where each minute is
budgeted) fails here first; their float32 errors against float64 are those of a correct kernel.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
# script -> the number of cases its tiny run measures (every one of them must be written).
SCRIPTS = {
    "bench_norms.py": 3,
    "bench_swiglu.py": 2,
    "bench_log_decay.py": 2,
    "bench_read_gate.py": 2,
    "bench_rope.py": 2,
}


def run_tiny(script: str, out: Path) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    args = [sys.executable, str(ROOT / "benchmarks" / script), "--tiny", "--out", str(out)]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_tiny_run_measures_every_case_with_float32_errors(script, tmp_path):
    pytest.importorskip("triton")
    report = run_tiny(script, tmp_path / "out.json")
    assert len(report["cases"]) == SCRIPTS[script]
    for case in report["cases"]:
        for backend in ("torch", "triton"):
            row = case[backend]
            assert row["forward_ms"] > 0 and row["train_ms"] > 0
            assert row["errors"], f"{script} {case['case']}: no errors measured"
            for name, error in row["errors"].items():
                assert math.isfinite(error) and error < 1e-5, (script, case["case"], name, error)
        assert case["speedup_train"] == pytest.approx(
            case["torch"]["train_ms"] / case["triton"]["train_ms"]
        )


def test_short_conv_tiny_run_measures_errors_and_the_launch_sweep(tmp_path):
    pytest.importorskip("triton")
    report = run_tiny("bench_short_conv.py", tmp_path / "out.json")
    for shape in report["shapes"]:
        assert set(shape["rows"]) == {"torch", "triton"}
        for errors in shape["errors"].values():
            assert all(math.isfinite(e) and e < 1e-5 for e in errors.values()), errors


def test_decode_profile_tiny_run_reports_every_mixer_by_operator(tmp_path):
    """benchmarks/profile_decode.py (the GPU's decode-step profile) runs its CPU smoke run: every
    mixer profiled, at least one operator a layer, the projections' matrix products among them,
    none of the view or allocation operators that launch no kernel counted."""
    report = run_tiny("profile_decode.py", tmp_path / "out.json")
    mixers = [r["mixer"] for r in report["results"]]
    assert mixers == ["gdn2", "muir", "kdn_diag", "transformer"]
    for result in report["results"]:
        names = [row["name"] for row in result["kernels"]]
        assert result["kernels_per_token"] >= result["layers"], result["mixer"]
        assert not {"aten::view", "aten::as_strided", "aten::empty_strided"} & set(names)
        assert {"aten::mm", "aten::addmm"} & set(names), result["mixer"]


def test_generate_bench_tiny_run_times_every_mixer_on_the_three_paths(tmp_path):
    """benchmarks/bench_generate.py (model.generate against the loop and the step) runs its CPU
    smoke run: a finite time per token for every path, mixer and batch."""
    report = run_tiny("bench_generate.py", tmp_path / "out.json")
    cases = [(r["mixer"], r["batch"]) for r in report["results"]]
    assert cases == [(m, b) for m in ("gdn2", "kdn_diag", "kda", "transformer") for b in (1, 2)]
    for result in report["results"]:
        assert all(math.isfinite(result[k]) for k in ("generate_ms", "loop_ms", "step_ms"))
