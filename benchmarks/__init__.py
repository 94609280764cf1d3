"""deltalab's benchmark suites, run as `python -m benchmarks SUITE [ARGS]` (`--list` names them).

Each suite is a module of this package with `add_arguments(parser)` and `run(args)`; `run`
prints its tables and returns its results, which the runner writes as JSON under a header (the
machine, torch and Triton versions, the commit, the date and the command line). A suite of
several modes maps each mode's name to its module: `python -m benchmarks SUITE MODE [ARGS]`.
"""

from __future__ import annotations

# suite -> (module, or mode -> module; one line on what it measures)
SUITES: dict[str, tuple[str | dict[str, str], str]] = {
    "ops": (
        "bench_triton",
        "the delta rule's Triton forms against fla and SDPA: errors, forward and forward+backward "
        "times, peak memory",
    ),
    "kdn": ("bench_kdn_triton", "KDN's Triton gains and the Mobius scan against PyTorch (GPU)"),
    "train": ("bench_train", "training throughput and peak memory of each mixer"),
    "decode": (
        {
            "latency": "bench_decode_gpu",
            "context": "bench_decode",
            "generate": "bench_generate",
            "tune": "tune_decode_step",
            "products": "decode_products",
        },
        "decoding: per-token latency eager and CUDA-graphed, tokens/s against context length, "
        "model.generate per token against transformers' loop and the static step, the fused "
        "step's launch settings, the products at many sequences by how the residual is summed "
        "(GPU)",
    ),
    "tune": ("tune_triton", "launch settings of each Triton stage of the delta rule (GPU)"),
    "profile": (
        {
            "train": "profile_train",
            "decode": "profile_decode",
            "gaps": "device_gaps",
            "kernels": "profile_triton",
            "diagonal": "diagonal_forms",
        },
        "where time goes: a training step, a decoding step, the device's idle gaps, an op's "
        "kernels, the diagonal sub-blocks the Triton stage 1 walks",
    ),
    "cpu": (
        {"delta_rule": "bench_delta_rule", "kdn": "bench_kdn", "layers": "bench_layers"},
        "the PyTorch backends on CPU: the delta rule's chunk sizes, the KDN ops, the layers",
    ),
    "small_ops": (
        "small_ops",
        "the elementwise ops' Triton kernels against their torch paths: norms, short_conv, "
        "swiglu, rope, read_gate, log_decay",
    ),
    "memory": ("memory_audit", "what one block saves for backward, per token (CPU)"),
    "traffic": ("traffic", "a training step's memory traffic by module, op and category (CPU)"),
}
