"""benchmarks/profile_train.py: a training step's kernel time, by category."""

from __future__ import annotations

import argparse
import contextlib
import re
from pathlib import Path

import pytest
import torch

from benchmarks import profile_train

_ROOT = Path(__file__).parents[1]

DELTA = "delta-rule and KDN kernels"


@pytest.mark.parametrize(
    "name, expected",
    [
        ("_intra_bwd", DELTA),
        ("_mobius_forward_kernel", DELTA),
        ("_log_decay_bwd", profile_train.OTHER),
        ("aten::linalg_solve_triangular", profile_train.OTHER),  # "_solve_" inside, not a prefix
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matrix products"),
        ("aten::mm", "matrix products"),
        ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", "attention"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::silu>", "elementwise, "
         "reductions, copies"),
        ("void at::native::(anonymous)::multi_tensor_apply_kernel<adam>", "optimizer"),
    ],
)  # fmt: skip
def test_kernel_names_fall_in_their_categories(name, expected):
    assert profile_train.category(name) == expected


def test_every_launched_triton_kernel_of_the_project_falls_in_its_category():
    """A kernel added later without a matching prefix would be counted as elementwise work: the
    short convolution's kernels are convolution, the norms' and SwiGLU's "normalization,
    SwiGLU", the log decay's, the read gate's and RoPE's elementwise (glue they replace),
    `row_linear`'s matrix products, every other one a delta-rule or KDN kernel."""
    expected = {}
    for path in (_ROOT / "deltalab" / "ops").rglob("*.py"):
        text = path.read_text()
        launched = set(re.findall(r"\b(_[a-z0-9_]+)\[", text))
        jitted = set(re.findall(r"@triton\.jit\ndef (_[a-z0-9_]+)\(", text))
        label = "convolution" if "short_conv" in path.parts else DELTA
        glue_side = "norms" in path.parts or "swiglu" in path.parts
        label = profile_train.NORMS_SWIGLU if glue_side else label
        elementwise = {"log_decay", "read_gate", "rope"} & set(path.parts)
        label = profile_train.OTHER if elementwise else label
        label = "matrix products" if "row_linear" in path.parts else label
        expected.update(dict.fromkeys(launched & jitted, label))
    assert len(expected) >= 12 and "convolution" in expected.values()
    assert {k: profile_train.category(k) for k in expected} == expected


@pytest.mark.parametrize(
    ("recompute_ffn", "cuda_graphs"),
    [(False, False), (True, False), (False, True)],
    ids=["", "ffn-recomputed", "graphs"],
)
def test_a_cpu_step_splits_into_categories_that_add_up(recompute_ffn, cuda_graphs, monkeypatch):
    """Also with --cuda-graphs, where (on CPU, no graph) the steps after the warmup go through
    `StepGraph.step`, the whole passes queued in the timeline's "forward"."""
    from deltalab.train.graphs import WARMUP_STEPS, StepGraph

    replays = []
    real_step = StepGraph.step
    monkeypatch.setattr(StepGraph, "step", lambda self, w: replays.append(1) or real_step(self, w))
    args = argparse.Namespace(preset="tiny", num_layers=2, device="cpu", seq_len=32, batch=2,
                              warmup=WARMUP_STEPS + 1 if cuda_graphs else 1, steps=1, top=5,
                              compile=False, checks_after_backward=False,
                              recompute_ffn=recompute_ffn, cuda_graphs=cuda_graphs)  # fmt: skip
    report = profile_train.profile_mixer(args, "gdn2")
    # The capture's step, the timeline's and the profiler's: each through the graph's path.
    assert len(replays) == (3 if cuda_graphs else 0)
    assert report["total_ms"] > 0
    # The host's timeline: every segment, the queueing ones taking time (on CPU they run).
    timeline = report["host_timeline_ms"]
    assert timeline.keys() == profile_train.TIMELINE.keys()
    queued = ("forward", "optimizer") if cuda_graphs else ("forward", "backward", "optimizer")
    assert all(timeline[phase] > 0 for phase in queued)
    assert all(ms >= 0 for ms in timeline.values())
    # The wall time of a step holds its kernels' (on CPU, the ops' own times) and more.
    assert report["wall_ms"] > 0
    assert sum(report["categories"].values()) == pytest.approx(report["total_ms"])
    assert report["categories"]["matrix products"] > 0
    # Every kernel is kept, slowest first, and they add up to the total as the categories do.
    times = [k["ms"] for k in report["kernels"]]
    assert len(times) > 5 and times == sorted(times, reverse=True)
    assert sum(times) == pytest.approx(report["total_ms"])


@pytest.mark.parametrize("after_backward", [False, True], ids=["trainer", "after-backward"])
def test_a_step_reads_its_queued_value_checks_where_asked(monkeypatch, after_backward):
    """The step reads the forward's checks back as the trainer does, at the forward's end, or
    after the backward with --checks-after-backward (the experiment)."""
    import deltalab.train.loop as loop

    events = []
    real_checks, real_backward = loop._forward_checks, torch.Tensor.backward

    @contextlib.contextmanager
    def checks(checkpointing):
        with real_checks(checkpointing):
            yield
        events.append("read")

    def backward(self, *args, **kwargs):
        events.append("backward")
        return real_backward(self, *args, **kwargs)

    monkeypatch.setattr(loop, "_forward_checks", checks)
    monkeypatch.setattr(torch.Tensor, "backward", backward)
    _, _, step = profile_train.training_step(
        "gdn", "tiny", 2, 16, num_layers=1, checks_after_backward=after_backward
    )
    step()
    assert events == (["backward", "read"] if after_backward else ["read", "backward"])
