"""Launch settings of each Triton stage of the delta rule, timed one against another (GPU).

    python -m benchmarks tune                                   # GPU, B=4 T=4096 H=16 K=128
    python -m benchmarks tune --shape 4x4096x8x128 --stages state_pass state_pass_split
    TRITON_INTERPRET=1 python -m benchmarks tune --device cpu --shape 1x64x1x16 --stages intra \
        --table-dir /tmp/launch

For each stage kernel (stage 1 forward/backward, the decay factors, the solve and dL, the state
pass forward/backward, the operator gradients) and each candidate setting (tile sizes, warps,
pipeline stages), the median ms at `--shape` (default B=4 T=4096 H=16 K=128; KDA form, bf16
inputs read in place, the products as the defaults take them: TF32, but bf16 in the state
pass's walks) and the largest difference of its outputs from the first setting's, relative to
each output's largest element, over the elements a kernel writes (most settings change tiling,
not the math; the rows that set walk_dots, `KernelOptions.walk_dots`, change the products'
precision and differ by it). Each stage's first setting is the table the package ships for
this card (`deltalab.ops.launch_tables`: its own, else its family's, else the default, whose
values were chosen from these sweeps on an H200, docs/PERFORMANCE.md; where a faster setting is
not the default, the module's comment says why). On CPU (under the interpreter) it only proves
the settings run.

Then the best table found: for each stage, the fastest setting (forward + backward ms) among
those that keep the default products (`walk_dots`) and whose outputs are within
`SAME_RESULT` of the first setting's; their fields applied to the shipped table (a field two
stages' winners set differently keeps the first stage's, and is reported). It is written as
this card's section "delta_rule" of `<--table-dir>/<card key>.json` (default: the directory the
lookup reads, `$DELTALAB_LAUNCH_DIR` or `~/.cache/deltalab/launch`), which every later process
on this card then takes. Printed and in the JSON: per stage and over the stages timed, the
ratio of the shipped table's time to the best one's (1.00: nothing faster found; the package
ships a card's table when it is within 1.05 of its best).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
import triton

from benchmarks.bench_triton import draw_inputs, print_records
from benchmarks.common import parse_shape
from deltalab.errors import UserError
from deltalab.ops.delta_rule.triton import factors as factors_module
from deltalab.ops.delta_rule.triton import intra as intra_module
from deltalab.ops.delta_rule.triton import solve as solve_module
from deltalab.ops.delta_rule.triton.chunk import _operators_triton, operator_dtype
from deltalab.ops.delta_rule.triton.intra import Tokens
from deltalab.ops.delta_rule.triton.launch import LAUNCH_TABLES, DeltaRuleLaunch
from deltalab.ops.delta_rule.triton.state_pass import (
    operator_grads_triton,
    state_pass_split_triton,
    state_pass_split_triton_backward,
    state_pass_triton,
    state_pass_triton_backward,
)
from deltalab.ops.launch_tables import (
    DeviceProperties,
    device_properties,
    table_as_dict,
    user_table_directory,
    write_table_file,
)

# The largest difference from the first setting's outputs (`max_diff`) of a setting that may win:
# tilings change the rounding only; a larger one is a wrong result, not a candidate.
SAME_RESULT = 2e-2
# The stages whose tables are nested in `DeltaRuleLaunch` (the others set its own fields).
NESTED = ("intra", "factors", "solve")


def measure(fn, device):
    if device == "cuda":
        return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def flatten(result):
    """The tensors of a result: a tensor, or (nested) tuples and lists of them and of None."""
    if isinstance(result, torch.Tensor):
        return [result]
    return [t for item in (result or ()) for t in flatten(item)]


def max_diff(xs, ys):
    """The largest difference between two settings' outputs, relative to each output's largest
    element (the factors' adjoint has elements near 1e3, where float32 rounding alone is 1e-4)."""
    return max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-30))
               for x, y in zip(xs, ys, strict=True))  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", type=parse_shape, default=(4, 4096, 16, 128), help="BxTxHxK")
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--stages", nargs="+", default=None, help="only these stages")
    parser.add_argument(
        "--table-dir",
        type=Path,
        default=None,
        help="where the best table is written, as <card key>.json (default: the directory the "
        "lookup reads, $DELTALAB_LAUNCH_DIR or ~/.cache/deltalab/launch)",
    )


def card(device: str) -> DeviceProperties:
    """The properties the lookup keys `device`'s tables by (a CPU: "cpu", the default tables)."""
    return device_properties(torch.device(device)) or DeviceProperties(
        "cpu", (0, 0), os.cpu_count() or 1
    )


def best_table(shipped: DeltaRuleLaunch, rows: list[dict], settings: dict) -> tuple:
    """(the best table, per stage {shipped_ms, best_ms, ratio, best}, the conflicts): each
    stage's fastest candidate (module docstring) applied to `shipped`. `settings` maps a row's
    index to its setting (a dict of table fields, with walk_dots where the row sets it)."""
    table, stages, owner, conflicts = shipped, {}, {}, []
    for stage in dict.fromkeys(row["stage"] for row in rows):
        ran = [(i, r) for i, r in enumerate(rows) if r["stage"] == stage]
        timed = [(i, r) for i, r in ran if "error" not in r]
        first = ran[0][0]  # the shipped table's row
        if "error" in rows[first]:
            continue
        ms = {i: r["fwd_ms"] + (r["bwd_ms"] or 0.0) for i, r in timed}
        candidates = [i for i, r in timed if r["max_diff"] <= SAME_RESULT
                      and settings[i].get("walk_dots", "operators") == "operators"]  # fmt: skip
        best = min(candidates, key=ms.__getitem__)
        fields = {k: v for k, v in settings[best].items() if k != "walk_dots"}
        stages[stage] = {"shipped_ms": ms[first], "best_ms": ms[best],
                         "ratio": ms[first] / ms[best], "best": str(settings[best])}  # fmt: skip
        if stage in NESTED:
            table = replace(table, **{stage: replace(getattr(shipped, stage), **fields)})
            continue
        for name, value in fields.items():
            if name in owner and getattr(table, name) != value:
                conflicts.append(f"{name}: {stage} chose {value}, {owner[name]} kept "
                                 f"{getattr(table, name)}")  # fmt: skip
                continue
            owner.setdefault(name, stage)
            table = replace(table, **{name: value})
    return table, stages, conflicts


def report_table(args, shipped: DeltaRuleLaunch, rows: list[dict], settings: dict) -> dict:
    """The best table and the shipped table's ratio to it, printed, and the table written."""
    properties = card(args.device)
    table, stages, conflicts = best_table(shipped, rows, settings)
    shipped_ms = sum(s["shipped_ms"] for s in stages.values())
    ratio = shipped_ms / max(sum(s["best_ms"] for s in stages.values()), 1e-30)
    path = (args.table_dir or user_table_directory()) / f"{properties.key}.json"
    write_table_file(path, properties, "delta_rule", table)
    print(f"\n{properties.name} ({properties.key}): the shipped table's time / the best found")
    for stage, summary in stages.items():
        print(f"  {stage:18s} {summary['ratio']:.3f}  ({summary['shipped_ms']:.3f} / "
              f"{summary['best_ms']:.3f} ms; best {summary['best']})")  # fmt: skip
    print(f"  {'all stages':18s} {ratio:.3f}")
    for conflict in conflicts:
        print(f"  conflict: {conflict}")
    print(f"wrote the best table to {path}")
    return {"device_key": properties.key, "device_name": properties.name,
            "shipped_over_best": ratio, "stages": stages, "conflicts": conflicts,
            "table": table_as_dict(table), "table_file": str(path)}  # fmt: skip


def shipped_first(default, settings: list[dict]) -> list[dict]:
    """The shipped table's row ({}) first, then the settings that change the table or the
    products (a setting equal to the shipped table is not timed twice)."""

    def changes(setting: dict) -> bool:
        fields = {k: v for k, v in setting.items() if k != "walk_dots"}
        return setting.get("walk_dots", "operators") != "operators" or (
            replace(default, **fields) != default
        )

    return [{}, *filter(changes, settings)]


def run(args: argparse.Namespace) -> dict:
    device = args.device
    shipped = LAUNCH_TABLES.builtin(card(device))
    batch, length, heads, dim = args.shape
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter: fp32 only
    x = draw_inputs(batch, length, heads, dim, device, dtype)
    precision = "tf32" if device == "cuda" else "ieee"
    # Token-major inputs, read in place by the kernels as the backend passes them; a = beta,
    # a strength per token, as the KDA layers pass it.
    q, a, b, u, g = (x["q"], x["beta"], x["k"], x["v"], x["g"])
    tokens = Tokens(-(-length // args.chunk), heads, length, args.chunk)
    ops, lower = _operators_triton(
        q, a, b, u, g, precision, tokens, 1.0, operator_dtype(q, a, b, u)
    )
    state = torch.randn(batch, heads, dim, dim, device=device)
    # The gradients are float32 whatever dtype the operators are stored in.
    f32 = {"dtype": torch.float32}
    d_out = torch.randn_like(ops.target, **f32)
    d_lower, d_attend = torch.randn_like(lower), torch.randn_like(ops.attend, **f32)
    _, residuals, states, _ = state_pass_triton(ops, state, precision)
    d_residual, d_next, _ = state_pass_triton_backward(ops, d_out, state, precision)
    # d read, d rhs, d write, dq1, da1, db1
    chunked = [torch.randn_like(ops.read, **f32) for _ in range(6)]
    d_decay = torch.randn_like(ops.decay)

    # A row's `walk_dots` (the option, passed to the state passes), set for each row below; its
    # other keys are fields of the stage's launch table (the shipped one's otherwise).
    walk = {"walk_dots": "operators"}

    cases = {
        "intra": (
            shipped.intra,
            [dict(block=k, num_warps=w) for k in (64, 128, 32) for w in (1, 2, 4)],
            lambda t: intra_module.intra_triton(q, a, b, g, precision, tokens, table=t),
            lambda t: intra_module.intra_triton_backward(
                q, a, b, g, d_lower, d_attend, precision, tokens, table=t
            ),
        ),
        "factors": (
            shipped.factors,
            [dict(block=k, num_warps=w) for k in (32, 64, 128) for w in (4, 8, 2)],
            lambda t: factors_module.factors_triton(q, a, b, g, tokens, table=t),
            lambda t: factors_module.factors_triton_backward(
                q, a, b, g, *chunked[:3], d_decay, *chunked[3:], tokens, table=t
            ),
        ),
        "solve": (
            shipped.solve,
            [dict(block=n, num_warps=w) for n in (64, 128, 32) for w in (4, 2, 8)],
            lambda t: solve_module.solve_triton(lower, u, precision, tokens, table=t),
            lambda t: [
                solve_module.solve_triton_backward(lower, d_out, precision, table=t),
                solve_module.lower_grad_triton(d_out, ops.target, d_out, ops.target, precision,
                                               t),
            ],
            # dL's blocks above the diagonal are never written (nothing reads them).
            lambda outputs: [*outputs[:-1], torch.tril(outputs[-1], -1)],
        ),
        "state_pass": (
            shipped,
            # First the defaults (with 16-bit operators, products in their dtype, walk_dots),
            # then each setting as given with the products widened to float32: warps, row
            # block, value columns and pipeline stages (num_stages: 16-bit operators only), the
            # narrow launch off (their outputs differ from the first row's by the rounding);
            # then the widened products at their default launch, and 16-bit products at some of
            # the same settings.
            [{}] + [dict(num_warps=w, block_c=c, block_v=v, num_stages=s, narrow_block_v=None,
                         walk_dots="float32")
                    for w, c, v, s in [(8, 64, 64, 1), (4, 64, 64, 1), (4, 64, 32, 1),
                                       (8, 64, 32, 1), (4, 32, 16, 1), (2, 64, 32, 1),
                                       (2, 32, 16, 1), (8, 64, 64, 2), (8, 64, 64, 3),
                                       (4, 64, 32, 2), (8, 64, 32, 2), (4, 64, 16, 2)]]
            + [{"walk_dots": "float32"}]  # the widened products at their own default launch
            + [dict(num_warps=w, block_c=64, block_v=v, num_stages=s, narrow_block_v=None,
                    low_dots_num_warps=w, low_dots_num_stages=s, walk_dots="operators")
               for w, v, s in [(8, 64, 1), (8, 64, 2), (4, 64, 2), (8, 128, 1), (4, 32, 2),
                               (8, 32, 2)]],
            lambda t: state_pass_triton(ops, state, precision, table=t, **walk),
            lambda t: state_pass_triton_backward(ops, d_out, state, precision, table=t, **walk),
        ),
        # The split pass (the walk, then the outputs; the dO products, then the adjoint walk),
        # to time against state_pass's first (default) row: the walk's pipeline stages, value
        # block and warps, the parallel kernels' value block and warps. First row: the defaults.
        "state_pass_split": (
            shipped,
            [{}]
            + [dict(split_num_stages=s, split_walk_block_v=v, split_walk_num_warps=w,
                    split_block_v=sv, split_num_warps=sw)
               for s, v, w, sv, sw in [(2, 16, 2, 64, 8), (2, 32, 4, 64, 8), (1, 64, 8, 64, 8),
                                       (2, 16, 4, 64, 8), (2, 16, 1, 64, 8), (3, 16, 2, 64, 8),
                                       (2, 16, 2, 32, 4), (2, 16, 2, 128, 8), (3, 32, 4, 64, 8),
                                       (4, 16, 2, 64, 8), (3, 16, 1, 64, 8)]]
            # The walks' products widened to float32 (walk_dots; 16-bit products are the
            # default), at the defaults and with the walk at 32 columns and 4 warps.
            + [{"walk_dots": "float32"},
               dict(split_walk_block_v=32, split_walk_num_warps=4, walk_dots="float32")],
            lambda t: state_pass_split_triton(ops, state, precision, table=t, **walk),
            lambda t: state_pass_split_triton_backward(ops, d_out, state, precision, table=t,
                                                       **walk),
        ),
        "operator_grads": (
            shipped,
            [dict(num_warps=w, operator_block_v=v) for w in (8, 4, 2) for v in (32, 64, 16)],
            lambda t: operator_grads_triton(
                states, residuals, d_out, d_residual, d_next, precision, table=t
            ),
            None,
        ),
    }  # fmt: skip
    if args.stages:
        unknown = set(args.stages) - set(cases)
        if unknown:
            raise UserError(f"--stages: unknown {sorted(unknown)}; known: {sorted(cases)}")
        cases = {k: v for k, v in cases.items() if k in args.stages}
    rows, row_settings = [], {}
    for stage, (default, settings, forward, backward, *written) in cases.items():
        reference = None
        for setting in shipped_first(default, settings):
            fields = dict(setting)
            walk["walk_dots"] = fields.pop("walk_dots", "operators")
            table = replace(default, **fields)
            try:
                outputs = flatten(forward(table)) + (flatten(backward(table)) if backward else [])
                outputs = written[0](outputs) if written else outputs
                reference = reference or outputs
                row = {"stage": stage, "setting": str(setting),
                       "fwd_ms": measure(partial(forward, table), device),
                       "bwd_ms": measure(partial(backward, table), device) if backward else None,
                       "max_diff": max_diff(outputs, reference)}  # fmt: skip
            except Exception as error:  # a setting that fails to compile is a result too
                row = {"stage": stage, "setting": str(setting), "error": repr(error)[:200]}
            row_settings[len(rows)] = setting
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
    print_records(rows)
    return {"device": device, "rows": rows, **report_table(args, shipped, rows, row_settings)}
