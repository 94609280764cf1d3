"""The fused decoding step's launch settings, timed one against another at each batch (GPU).

    python -m benchmarks decode tune                        # GPU: 8 heads of 128 x 128, B 1 16 64 128
    TRITON_INTERPRET=1 python -m benchmarks decode tune --device cpu --heads 2 --head-dim 16 \
        --batches 1 2 --layers 2 --table-dir /tmp/launch

For each batch and each candidate launch of `fused_layer_step` (blocks of 16 to 128 value
columns, a whole 128-column head among them, over 1 to 16 warps), the median us of one layer's
step, summed over the write rules of `--rules` (by default the GDN-2 form and the Diagonal KDN one
with its own process noise, as the presets run them), and
the largest difference of its outputs and state from the shipped table's. On a GPU a layer's
step is timed as the decoder runs it: `--layers` launches on distinct buffers (no layer finds its
state in L2) in one CUDA graph, replayed. On CPU (under the interpreter) it only proves the
settings run.

Then the best table: the launch fastest at the smallest batch (`block_v`, `num_warps`), and the
one fastest at the largest batch from the smallest batch where it beats the first
(`many_programs`, in programs: sequences x heads; None where it never does). It is written as
this card's section "fused_step" of `<--table-dir>/<card key>.json` (default: the directory the
lookup reads, which every later process on this card then takes). Printed and in the JSON: per
batch, the shipped table's time over the best setting's.
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

import torch

from benchmarks.bench_decode_gpu import kernel_seconds
from benchmarks.tune_triton import card
from deltalab.ops.delta_rule.triton.fused_step import (
    LAUNCH_TABLES,
    FusedStepLaunch,
    StepForm,
    fused_layer_step,
    table_launch,
)
from deltalab.ops.launch_tables import table_as_dict, user_table_directory, write_table_file

# The forms timed, by name: every gate input a step of that rule reads.
FORMS = {
    "erase_write": StepForm("channel", "erase_write"),
    "beta": StepForm("head", "beta"),
    # The KDN layers' default: process noise of their own (`process_noise="free"`), a gate input.
    "kdn_diag": StepForm("channel", "kdn_diag"),
    "kdn_iso": StepForm("channel", "kdn_iso"),
    "kdn_exact": StepForm("channel", "kdn_exact"),
}
# (value columns a block, warps) tried.
LAUNCHES = ((128, (8, 16)), (64, (4, 8)), (32, (1, 2, 4)), (16, (1, 2)))
# A setting whose outputs differ more than this from the shipped one's is wrong, not a candidate.
SAME_RESULT = 1e-3
CONV_WIDTH = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128, help="K = V")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128])
    parser.add_argument("--rules", nargs="+", choices=sorted(FORMS),
                        default=["erase_write", "kdn_diag"])  # fmt: skip
    parser.add_argument("--layers", type=int, default=24, help="launches a timing holds")
    parser.add_argument("--table-dir", type=Path, default=None,
                        help="where the best table is written, as <card key>.json (default: the "
                        "directory the lookup reads)")  # fmt: skip


def candidates(head_dim: int) -> list[FusedStepLaunch]:
    """Every launch tried, at any batch (a block no wider than the head)."""
    return [FusedStepLaunch(block_v=v, num_warps=w, many_programs=None)
            for v, warps in LAUNCHES if v <= max(16, head_dim) for w in warps]  # fmt: skip


def step_inputs(form: StepForm, batch: int, heads: int, dim: int, device: str, dtype, generator):
    """One layer's arguments of `fused_layer_step` (random, off zero), as a dict."""

    def draw(*shape, scale=1.0, kind=dtype):
        x = torch.randn(*shape, generator=generator, device=device) * scale
        return x.to(kind)

    width, f32 = heads * dim, torch.float32
    gates = {"decay": draw(batch, width)}
    params = {"A_log": draw(heads, scale=0.1, kind=f32), "dt_bias": draw(width, kind=f32)}
    if form.rule == "erase_write":
        gates |= {"beta": draw(batch, width), "write": draw(batch, width)}
    elif form.rule == "beta":
        gates = {"decay": draw(batch, heads), "beta": draw(batch, heads)}
        params["dt_bias"] = draw(heads, kind=f32)
    else:
        iso = form.rule == "kdn_iso"
        gates |= {"obs": draw(batch, heads), "noise": draw(batch, heads if iso else width)}
        if form.rule == "kdn_exact":  # a covariance: symmetric positive definite
            root = draw(batch, heads, dim, dim, scale=dim**-0.5, kind=f32)
            params["precision"] = root @ root.mT + torch.eye(dim, device=device)
        else:
            shape = (batch, heads) if iso else (batch, heads, dim)
            params["precision"] = 1 + draw(*shape, kind=f32).abs()
    return {
        "qkv": tuple(draw(batch, width) for _ in range(3)),
        "conv_weights": tuple(draw(width, 1, CONV_WIDTH, scale=0.5) for _ in range(3)),
        "caches": tuple(draw(batch, width, CONV_WIDTH - 1) for _ in range(3)),
        "memory": draw(batch, heads, dim, dim, scale=0.1, kind=f32),
        "gate": draw(batch, width),
        "norm_weight": 1 + draw(dim, scale=0.1),
        "out": torch.empty(batch, width, dtype=dtype, device=device),
        "gates": gates,
        "params": params,
    }


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple):
        return tuple(_clone(v) for v in value)
    return {k: _clone(v) for k, v in value.items()}


def step(form: StepForm, inputs: dict, table: FusedStepLaunch, dim: int) -> None:
    fused_layer_step(form, inputs["qkv"], inputs["conv_weights"], inputs["caches"],
                     inputs["memory"], inputs["gate"], inputs["norm_weight"], inputs["out"],
                     scale=dim**-0.5, l2_eps=1e-6, norm_eps=1e-5, gates=inputs["gates"],
                     params=inputs["params"], r_min=0.01, table=table)  # fmt: skip


def us_per_layer(calls: list, device: str) -> float:
    """Median us of one call of `calls` (one a layer), all of them in turn timed as one function
    (`kernel_seconds`: on CUDA from a graph of 10 rounds of them, replayed)."""

    def every_layer() -> None:
        for call in calls:
            call()

    return 1e6 * kernel_seconds(every_layer, torch.device(device), calls=10) / len(calls)


def difference(got: dict, expected: dict) -> float:
    """The largest difference of what a step writes (the output, the memory, the convolution
    caches and a KDN filter's state), relative to each one's largest element."""
    pairs = [(got["out"], expected["out"]), (got["memory"], expected["memory"])]
    pairs += list(zip(got["caches"], expected["caches"], strict=True))
    if got["params"].get("precision") is not None:
        pairs.append((got["params"]["precision"], expected["params"]["precision"]))
    return max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
               for a, b in pairs)  # fmt: skip


def time_batch(args, batch: int, settings: list[FusedStepLaunch], dtype) -> list[dict]:
    """Each setting's us a layer (summed over the rules) and its largest difference from the
    first's, at `batch`."""
    totals, diffs = [0.0] * len(settings), [0.0] * len(settings)
    dim = args.head_dim
    for rule in args.rules:
        form = FORMS[rule]
        generator = torch.Generator(device=args.device).manual_seed(batch)
        base = step_inputs(form, batch, args.heads, dim, args.device, dtype, generator)
        expected = None
        for i, table in enumerate(settings):
            once = _clone(base)
            step(form, once, table, dim)
            expected = once if expected is None else expected
            diffs[i] = max(diffs[i], difference(once, expected))
            layers = [_clone(base) for _ in range(args.layers)]
            calls = [partial(step, form, x, table, dim) for x in layers]
            totals[i] += us_per_layer(calls, args.device)
    return [{"batch": batch, "setting": table_as_dict(t), "shipped": i == 0, "us": us,
             "max_diff": d}
            for i, (t, us, d) in enumerate(zip(settings, totals, diffs, strict=True))]  # fmt: skip


def best_table(rows: list[dict], heads: int) -> FusedStepLaunch:
    """The table of the module docstring from the candidates' `rows` (not the shipped table's)."""
    ok = [r for r in rows if r["max_diff"] <= SAME_RESULT and not r["shipped"]]
    batches = sorted({r["batch"] for r in ok})
    if not batches:
        raise ValueError(f"rows: no launch gave the shipped table's result (within {SAME_RESULT})")

    def fastest(batch):
        return min((r for r in ok if r["batch"] == batch), key=lambda r: r["us"])["setting"]

    def us(batch, setting):
        return next((r["us"] for r in ok if r["batch"] == batch and r["setting"] == setting), None)

    small, large = fastest(batches[0]), fastest(batches[-1])
    table = FusedStepLaunch(small["block_v"], small["num_warps"], None)
    if large == small:
        return table
    for batch in batches:
        wide, narrow = us(batch, large), us(batch, small)
        # A batch where either launch gave another result (max_diff) decides nothing.
        if wide is not None and narrow is not None and wide < narrow:
            return FusedStepLaunch(small["block_v"], small["num_warps"], batch * heads,
                                   large["block_v"], large["num_warps"])  # fmt: skip
    return table


def run(args: argparse.Namespace) -> dict:
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    shipped = LAUNCH_TABLES.launch_table_for(torch.device(args.device))
    settings = candidates(args.head_dim)
    rows = []
    for batch in args.batches:
        # The shipped table as it launches at this batch, then every candidate.
        rows += time_batch(args, batch, [shipped, *settings], dtype)
    table = best_table(rows, args.heads)
    properties = card(args.device)
    directory = user_table_directory() if args.table_dir is None else args.table_dir
    path = Path(directory) / f"{properties.key}.json"
    write_table_file(path, properties, "fused_step", table)
    ratios = {}
    for batch in args.batches:
        here = [r for r in rows if r["batch"] == batch and r["max_diff"] <= SAME_RESULT]
        shipped_us, best_us = here[0]["us"], min(r["us"] for r in here)
        ratios[batch] = shipped_us / best_us
        launched = table_launch(table, batch * args.heads, args.head_dim, args.head_dim)
        print(
            f"B={batch:4d}: shipped {shipped_us:8.2f} us a layer, best {best_us:8.2f}, "
            f"shipped/best {ratios[batch]:.2f}; the new table's (BK, BV, warps) {launched}"
        )
    print(f"table {table_as_dict(table)} -> {path}")
    return {"device_key": properties.key, "table_file": str(path), "table": table_as_dict(table),
            "shipped": table_as_dict(shipped), "shipped_over_best": ratios, "rows": rows}  # fmt: skip
