"""Where a training step's GPU time goes, per mixer: the delta-rule kernels, the matrix products,
attention, normalization and SwiGLU, the optimizer, and the elementwise ops between them.

    python -m benchmarks profile train --device cuda --preset 340M --seq-len 4096 --batch 4 \\
        --mixers gdn2 muir kdn_diag transformer                      # GPU, bf16 autocast
    python -m benchmarks profile train --mixers gdn2 --steps 1       # CPU: the tiny preset

One step is what `deltalab train` does per optimizer step without the data pipeline: forward and
loss under bf16 autocast (on CUDA), backward, AdamW. After `--warmup` steps (Triton compiles its
kernels) `--steps` steps run under torch.profiler, and every GPU kernel's time is put in the
first category whose name pattern it matches (`CATEGORIES`; on CPU, the aten ops' own CPU time
instead). Prints per mixer the milliseconds per step of each category and the slowest kernels,
the wall time of a step, and the host's timeline of one (`host_timeline`: how long it takes to
queue the forward, the backward and AdamW, and how long it waits for the device), which says
whether the device waits for the host; `--compile` wraps the model in torch.compile as
`train.compile` does.

It answers the question the throughput numbers leave open (docs/PERFORMANCE.md): at 340M and 4K
context the recurrent models train at less than half the Transformer's speed, while the
delta-rule kernels alone take a fraction of the step.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from torch import nn

from benchmarks.common import add_delta_rule_options, changed_options, delta_rule_options
from deltalab.benchmarking import kernel_times
from deltalab.errors import UserError
from deltalab.ops.options import DEFAULT_OPTIONS, KernelOptions
from deltalab.train.graphs import WARMUP_STEPS

# The category of the norms' and SwiGLU's kernels (benchmarks/traffic.py counts them as glue).
NORMS_SWIGLU = "normalization, SwiGLU"
# (category, name prefixes, name substrings) of the lowercased kernel or op name; the first
# match wins. The project's Triton kernels are named by their functions, so a prefix finds them
# (a substring would also catch e.g. aten::linalg_solve_triangular on CPU).
CATEGORIES = (
    (
        "delta-rule and KDN kernels",
        (
            "_intra_",
            "_solve_",
            "_state_pass_",
            "_factors_",
            "_operator_grads",
            "_lower_grad",
            "_step_kernel",
            "_fused_step_kernel",
            "_exact_predict_kernel",
            "_mobius_",
            "_kdn_",
        ),
        (),
    ),
    ("attention", (), ("flash", "fmha", "attention", "sdpa")),
    (
        "matrix products",
        ("_row_linear_",),
        (
            "gemm",
            "xmma",
            "cutlass",
            "nvjet",
            "cublas",
            "aten::mm",
            "aten::bmm",
            "aten::addmm",
            "aten::matmul",
            "aten::linear",
        ),
    ),
    ("convolution", ("_short_conv_",), ("conv",)),
    # The norms' kernels and the FFN's SwiGLU gating: elementwise work around the mixers.
    (NORMS_SWIGLU, (), ("norm", "swiglu")),
    ("optimizer", (), ("adam", "multi_tensor", "foreach")),
)
OTHER = "elementwise, reductions, copies"


def category(name: str) -> str:
    """The category of a kernel or op name (CATEGORIES; everything else is OTHER)."""
    lowered = name.lower()
    for label, prefixes, substrings in CATEGORIES:
        if lowered.startswith(prefixes) or any(p in lowered for p in substrings):
            return label
    return OTHER


def summarize(times: dict[str, float]) -> dict:
    """Per-category totals (ms per step, descending) and every kernel, slowest first (the
    printout shows `--top` of them; the JSON keeps all, so any kernel's time can be read)."""
    by_category: dict[str, float] = defaultdict(float)
    for name, ms in times.items():
        by_category[category(name)] += ms
    kernels = sorted(times.items(), key=lambda kv: -kv[1])
    return {
        "total_ms": sum(times.values()),
        "categories": dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
        "kernels": [{"name": k[:100], "ms": ms, "category": category(k)} for k, ms in kernels],
    }


def training_step(
    mixer: str,
    preset: str,
    batch: int,
    seq_len: int,
    device: str = "cpu",
    *,
    num_layers: int | None = None,
    compile: bool = False,
    autocast: bool | None = None,
    checks_after_backward: bool = False,
    recompute_ffn: bool = False,
    cuda_graphs: bool = False,
    kernel_options: KernelOptions | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    """The model, its AdamW (`deltalab train`'s) and one training step: forward and loss on
    random token ids `[batch, seq_len]` under bf16 autocast, backward, AdamW, gradients set to
    None.

    The loss is `deltalab train`'s (`deltalab.train.loop._loss`): windows of seq_len + 1 random
    ids, the model reading the first seq_len and predicting the next token at each of them,
    the LM head and the cross-entropy in chunks inside the forward (no `[B, T, vocab]` logits).

    autocast: None autocasts on CUDA only (as `deltalab train`); benchmarks/traffic.py asks for
    it on CPU, where it gives CPU autocast the CUDA op lists. Tensors are made on `device` (or
    by whatever tensor mode is active, e.g. fake tensors). The forward's value checks read back
    once, at the forward's end, as the trainer's (`loop._forward_checks`); checks_after_backward
    reads them after the backward instead (an experiment: 3 steps each on an H200, a 340M
    GDN-2 step at 4K took 315.8 ms of wall time that way against 286.0; docs/PERFORMANCE.md).
    cuda_graphs: the trainer's `train.cuda_graphs` (`deltalab.train.graphs.StepGraph`): the
    first `WARMUP_STEPS` steps eager on the capture stream, the next records the passes, later
    ones replay them and read the loss back, as the trainer does; AdamW stays eager and the
    gradients stay set. Then the timeline's "forward" is the replay's queueing (all the passes),
    "checks" the wait for the loss, "backward" nothing. kernel_options: the model config's
    (`DeltaLabConfig.kernel_options`; None: the defaults).
    """
    from deltalab.models import CausalLM, build_config
    from deltalab.train import loop
    from deltalab.train.config import OptimSection
    from deltalab.train.optim import build_optimizer

    torch.manual_seed(0)
    overrides = {} if num_layers is None else {"num_layers": num_layers}
    options = changed_options(kernel_options or DEFAULT_OPTIONS)
    model = CausalLM(build_config(preset, mixer=mixer, kernel_options=options, **overrides))
    model.model.recompute_ffn = recompute_ffn  # as the trainer sets train.recompute_ffn
    if device != "cpu":
        # Built on CPU; not moved there again (fake tensors cannot be swapped in place).
        model = model.to(device)
    forward = torch.compile(model) if compile else model
    # The trainer's own AdamW (fused on CUDA), with its groups.
    optimizer = build_optimizer(model, OptimSection(lr=1e-4))
    window = torch.randint(0, model.config.vocab_size, (batch, seq_len + 1), device=device)
    enabled = device == "cuda" if autocast is None else autocast

    graph = None
    if cuda_graphs:
        from deltalab.train.graphs import StepGraph

        no_cache = torch.autocast(
            device, dtype=torch.bfloat16, enabled=enabled, cache_enabled=False
        )

        def passes(windows: torch.Tensor) -> torch.Tensor:
            return loop._micro_pass(forward, windows[0], no_cache, 1, checkpointing=False)

        graph = StepGraph(passes, (1, *window.shape), model.parameters(), torch.device(device))

    def step(mark: Callable[[str], None] = lambda phase: None) -> None:
        """One training step; `mark(phase)` is called as the host finishes each phase (for
        `host_timeline`)."""
        if graph is not None and not graph.warming_up:
            loss = graph.step(window[None])
            mark("forward")
            loss.item()  # the trainer reads the loss back
            mark("checks")
            mark("backward")
            optimizer.step()
            mark("optimizer")
            return
        with graph.warmup_step() if graph is not None else contextlib.nullcontext():
            eager_passes(mark)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mark("optimizer")

    def eager_passes(mark: Callable[[str], None]) -> None:
        with contextlib.ExitStack() as checks:
            checks.enter_context(loop._forward_checks(False))  # the trainer's value checks
            loss = loop._loss(
                forward, window, torch.autocast(device, dtype=torch.bfloat16, enabled=enabled)
            )
            mark("forward")
            if not checks_after_backward:
                checks.close()  # reads them back now, as the trainer
                mark("checks")
            loss.backward()
            mark("backward")

    return model, optimizer, step


# The host's timeline of a step (`host_timeline`), each segment's meaning.
TIMELINE = {
    "forward": "the host queues the forward",
    "checks": "it waits for the forward's value checks (the device finishing the forward)",
    "backward": "it queues the backward",
    "optimizer": "it queues AdamW",
    "drain": "the device finishes what is queued",
}


def host_timeline(
    step: Callable[..., None], steps: int, device: str
) -> tuple[float, dict[str, float]]:
    """(the median milliseconds of a step, host and device, each timed from an idle device to
    an idle device as the trainer's steps run between its reads of the loss; the median of each
    segment of it as the host lives it, `TIMELINE`). No synchronization inside a step but the
    trainer's own (the value checks read after the forward). A segment of queueing as long as
    the device's work for it means the device waited for the host; a long wait or drain means
    the host waited for the device. On CPU everything runs as it is queued (the waits are ~0)."""
    rows = []
    for _ in range(steps):
        if device == "cuda":
            torch.cuda.synchronize()
        times = [("start", time.perf_counter())]
        step(lambda phase, times=times: times.append((phase, time.perf_counter())))
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(("drain", time.perf_counter()))
        rows.append({phase: (t - times[i][1]) * 1e3 for i, (phase, t) in enumerate(times[1:])})
    wall = statistics.median(sum(r.values()) for r in rows)
    return wall, {phase: statistics.median(r.get(phase, 0.0) for r in rows) for phase in TIMELINE}


def profile_mixer(
    args: argparse.Namespace, mixer: str, kernel_options: KernelOptions | None = None
) -> dict:
    device = args.device
    _, _, step = training_step(
        mixer,
        args.preset,
        args.batch,
        args.seq_len,
        device,
        num_layers=args.num_layers,
        compile=args.compile,
        checks_after_backward=args.checks_after_backward,
        recompute_ffn=args.recompute_ffn,
        cuda_graphs=args.cuda_graphs,
        kernel_options=kernel_options,
    )
    for _ in range(args.warmup):
        step()
    # The wall time per step next to the kernel time: the difference is the time the device
    # waits for the host (launches after a read-back, Python between kernels). Timed before
    # the profiler runs: steps timed after it took 286 ms of wall time where `deltalab train`
    # took 232 (a 340M GDN-2 step at 4K on an H200), as if its instrumentation stayed.
    wall, timeline = host_timeline(step, args.steps, device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        torch.cuda.synchronize()
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
    return {
        **summarize(kernel_times(prof, args.steps, device)),
        "wall_ms": wall,
        "host_timeline_ms": timeline,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mixers", nargs="+", default=["gdn2", "transformer"])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--num-layers", type=int, default=None, help="default: the preset's")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument(
        "--checks-after-backward",
        action="store_true",
        help="read the forward's value checks back after the backward instead of between the "
        "forward and the backward, as the trainer does (an experiment)",
    )
    add_delta_rule_options(parser)
    parser.add_argument(
        "--recompute-ffn",
        action="store_true",
        help="recompute each block's FFN branch in the backward (train.recompute_ffn)",
    )
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="the step's passes replayed as one CUDA graph (train.cuda_graphs), recorded "
        "during the warmup steps",
    )


def run(args: argparse.Namespace) -> dict:
    if args.cuda_graphs and args.warmup <= WARMUP_STEPS:
        raise UserError(
            f"--cuda-graphs needs --warmup > {WARMUP_STEPS} (its eager steps, the capture)"
        )
    report: dict = {"device": args.device, "mixers": {}}
    for mixer in args.mixers:
        result = report["mixers"][mixer] = profile_mixer(args, mixer, delta_rule_options(args))
        print(
            f"\n{mixer}: {result['total_ms']:.1f} ms of kernel time per step, "
            f"{result['wall_ms']:.1f} ms of wall time"
        )
        for label, ms in result["categories"].items():
            print(f"  {label:<32} {ms:9.2f} ms  {ms / result['total_ms']:6.1%}")
        print("  the host's timeline of a step:")
        for phase, ms in result["host_timeline_ms"].items():
            print(f"    {ms:8.2f} ms  {TIMELINE[phase]}")
        for k in result["kernels"][: args.top]:
            print(f"    {k['ms']:8.2f} ms  {k['name'][:80]}")
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return report
