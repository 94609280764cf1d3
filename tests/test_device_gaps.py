"""benchmarks/device_gaps.py: the device's idle gaps read from a profiler trace, attributed to the
host code that launched the work after them (a synthetic trace: CI has no GPU)."""

from __future__ import annotations

from benchmarks import device_gaps

HOST, OTHER_THREAD = 7, 8


def event(cat, name, ts, dur, tid=HOST, correlation=None):
    args = {} if correlation is None else {"correlation": correlation}
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


def kernel(name, ts, dur, correlation, stream=1):
    return event("kernel", name, ts, dur, tid=stream, correlation=correlation)


def launch(ts, correlation):
    return event("cuda_runtime", "cudaLaunchKernel", ts, 3, correlation=correlation)


def trace():
    """Kernel a [0, 200] (stream 1) and b [50, 100] (stream 2) overlap; c starts at 260, launched
    at 250 inside `iso_beta` > `aten::div`, while the host had sat in a stream synchronize from
    195 to 240; d starts 3 us after c ends."""
    return [
        kernel("a", 0, 200, 1),
        kernel("b", 50, 50, 2, stream=2),
        kernel("c", 260, 20, 3),
        kernel("d", 283, 10, 4),
        launch(-20, 1),
        launch(-10, 2),
        launch(250, 3),
        launch(255, 4),
        event("cuda_runtime", "cudaStreamSynchronize", 195, 45),
        event("python_function", "step", 0, 400),
        event("python_function", "iso_beta", 245, 20),
        event("cpu_op", "aten::div", 248, 5),
        event("cpu_op", "aten::mul", 240, 30, tid=OTHER_THREAD),  # another thread: not it
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 230},  # not a span: ignored
    ]


def test_a_gap_is_measured_from_the_end_of_all_streams_work_and_attributed_to_its_launch():
    (gap,) = device_gaps.device_gaps(trace(), min_us=5.0)
    assert gap["start_us"] == 200  # a ends last, though b, on another stream, started later
    assert gap["idle_us"] == 60
    assert gap["before"] == "c"
    assert gap["launched_in"] == ["step", "iso_beta", "aten::div"]
    assert gap["host_waited"] is True


def test_gaps_below_the_threshold_are_not_reported_and_depth_keeps_the_innermost():
    gaps = device_gaps.device_gaps(trace(), min_us=2.0, depth=1)
    assert [(g["before"], g["idle_us"]) for g in gaps] == [("c", 60), ("d", 3)]
    assert gaps[0]["launched_in"] == ["aten::div"]
    assert gaps[1]["host_waited"] is False  # the synchronize ended before c ran


def test_summary_sums_gaps_per_launching_code_largest_first():
    gaps = [
        {"idle_us": 10.0, "before": "k", "launched_in": ["f", "aten::add"], "host_waited": False},
        {"idle_us": 30.0, "before": "k", "launched_in": ["g"], "host_waited": True},
        {"idle_us": 25.0, "before": "k", "launched_in": ["f", "aten::add"], "host_waited": False},
        {"idle_us": 1.0, "before": "memset", "launched_in": [], "host_waited": False},
    ]
    rows = device_gaps.summarize(gaps)
    assert [(r["launched_in"], r["gaps"], r["idle_us"]) for r in rows] == [
        ("f > aten::add", 2, 35.0),
        ("g", 1, 30.0),
        ("memset", 1, 1.0),
    ]
    assert rows[1]["host_waited"] is True
    assert len(device_gaps.summarize(gaps, top=2)) == 2


def test_a_trace_without_device_work_has_no_gaps():
    assert device_gaps.device_gaps([event("cpu_op", "aten::add", 0, 5)]) == []
