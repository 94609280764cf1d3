"""The elementwise ops' Triton kernels against the torch paths the layers took before them.

    python -m benchmarks small_ops                              # GPU: every op, 340M shapes
    python -m benchmarks small_ops --ops norms rope             # some ops
    python -m benchmarks small_ops --ops short_conv --sweep     # and short_conv's launch sweep
    TRITON_INTERPRET=1 python -m benchmarks small_ops --tiny    # CPU smoke run

Cases, at the 340M training step's shapes (B=4, T=4096, H=8 heads of K=128, hidden 1024) in the
dtypes that step gives them under bf16 autocast (`--tiny`: small shapes on CPU under the
interpreter, float32, which has no bfloat16):
  norms       block: the block RMSNorm on the float32 residual stream, x `[4 * 4096, 1024]`;
              gated: the mixers' gated output norm (SiLU gate), o and gate bf16 `[4, 4096, 8, 128]`;
              l2:    the q/k L2 normalization, bf16 `[4, 4096, 8, 128]`;
  short_conv  c1024, c2048: x `[4, 4096, C]` bf16, a width-4 depthwise causal convolution, SiLU;
  swiglu      gdn2, transformer: gate_up `[4 * 4096, 2F]` bf16, F the preset's FFN width;
  rope        4k (B=4, T=4096), 16k (B=1, T=16384): x `[B, T, 8, 128]` bf16, positions 0..T-1;
  read_gate   dynamic (rho = exp(read_log) 2 sigmoid(raw)), static (rho = exp(read_log)): q and
              raw bf16 `[4, 4096, 8, 128]`, read_log float32 `[8, 128]`;
  log_decay   channel: raw bf16 `[4, 4096, 8, 128]`, A_log `[8, 1]`, dt_bias `[8, 128]`;
              scalar: raw bf16 `[4, 4096, 8]`, A_log and dt_bias `[8]`;
  normed_linear  the static decoder's products at 1 and 64 rows (forward only), x bf16
              `[M, 1024]`: p1 (the GDN-2 layer's first product, norm first, N = 5376), gate_up
              (norm, N = 2 * 2400, SwiGLU gating), o_proj (N = 1024, no norm, the residual
              added), head (norm, N = 32000); "torch" is the decoder's unfused step (the norm's
              and the gating's kernels, cuBLAS between them, addmm for the residual).

Per case and backend ("torch": the layers' old path; "triton"), the median ms of the forward (no
autograd) and, for ops with a backward, of forward + backward (every input's gradient by `torch.autograd.grad` with a random
output gradient), by `triton.testing.do_bench` on the GPU, with the kernels' own time alone
(torch.profiler); torch / triton; and each backend's normwise relative error against the float64
definition ("naive") on the same inputs, of the output and of every gradient. Where a case gives
the bytes its kernels must move, also GB/s at the measured times. Inputs are random normal, never
zeros (parameters as the layers initialize them).
"""

from __future__ import annotations

import argparse
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks.common import add_case_arguments, case_device, save, time_backends
from deltalab.benchmarking import add_speedups, format_table, median_ms, print_backend_case

BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class Case:
    """One shape of one op. `inputs(shape, dtype, device)` gives the differentiable inputs
    (None where absent), the other arguments and the output's gradient; `call(backend, *leaves,
    **others)` the output; `names` the output's and the gradients' names; `moved(shape, dtype)`,
    where given, the bytes the kernels must move forward and forward+backward (None without a
    backward); `backward`: False for a forward-only op (timed and checked forward only)."""

    shape: tuple[int, ...]
    tiny: tuple[int, ...]
    dtype: torch.dtype
    inputs: Callable[..., tuple[list, dict, torch.Tensor]]
    call: Callable[..., torch.Tensor]
    names: tuple[str, ...]
    moved: Callable[[tuple[int, ...], torch.dtype], tuple[int, int | None]] | None = None
    backward: bool = True


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen)


def _norm_inputs(gated: bool, l2: bool = False):
    def inputs(shape, dtype, device):
        gen = torch.Generator().manual_seed(0)
        x = _randn(gen, *shape).to(device, dtype)
        weight = (1 + 0.1 * _randn(gen, shape[-1])).to(device)  # float32, as the modules keep it
        gate = _randn(gen, *shape).to(device, dtype) if gated else None
        dy = _randn(gen, *shape).to(device, dtype)
        return ([x] if l2 else [x, weight, gate]), {}, dy

    return inputs


def _rms(backend, x, weight, gate=None):
    from deltalab.ops.norms import rms_norm

    activation = "silu" if gate is not None else "sigmoid"
    return rms_norm(x, weight, 1e-5, gate, activation, out_dtype=x.dtype, backend=backend)


def _l2(backend, x):
    from deltalab.ops.norms import l2_normalize

    return l2_normalize(x, backend=backend)


def _x_and_dy(shape, dtype, device) -> tuple[torch.Tensor, torch.Tensor, torch.Generator]:
    """x and the output's gradient, random normal of `shape`, and the generator that drew them."""
    gen = torch.Generator().manual_seed(0)
    x = _randn(gen, *shape).to(device, dtype)
    return x, _randn(gen, *shape).to(device, dtype), gen


def _conv_inputs(shape, dtype, device):
    x, dy, gen = _x_and_dy(shape, dtype, device)
    width = 4
    bound = 1 / math.sqrt(width)  # nn.Conv1d's kaiming_uniform_(a=sqrt(5)) on fan_in = W
    weight = (2 * torch.rand(shape[-1], 1, width, generator=gen) - 1) * bound
    return [x, weight.to(device)], {}, dy


def _conv(backend, x, weight):
    from deltalab.ops.short_conv import short_conv

    return short_conv(x, weight, backend=backend)[0]


def _swiglu_inputs(shape, dtype, device):
    gen = torch.Generator().manual_seed(0)
    rows, width = shape
    gate_up = _randn(gen, rows, 2 * width).to(device, dtype)
    return [gate_up], {}, _randn(gen, rows, width).to(device, dtype)


def _swiglu(backend, gate_up):
    from deltalab.ops.swiglu import swiglu

    return swiglu(gate_up, backend=backend)


def _rope_inputs(shape, dtype, device):
    x, dy, _ = _x_and_dy(shape, dtype, device)
    return [x], {"positions": torch.arange(shape[1], device=device)}, dy


def _rope(backend, x, positions):
    from deltalab.ops.rope import rope

    return rope(x, positions, backend=backend)


def _read_inputs(dynamic: bool):
    def inputs(shape, dtype, device):
        gen = torch.Generator().manual_seed(0)
        q = torch.nn.functional.normalize(_randn(gen, *shape), dim=-1)  # as the L2-normed query
        read_log = 0.5 * _randn(gen, *shape[-2:])
        raw = 3 * _randn(gen, *shape) if dynamic else None
        dout = _randn(gen, *shape).to(device, dtype)
        raw = None if raw is None else raw.to(device, dtype)
        return [q.to(device, dtype), read_log.to(device), raw], {}, dout

    return inputs


def _read(backend, q, read_log, raw=None):
    from deltalab.ops.read_gate import read_query

    return read_query(q, read_log, raw, backend=backend)


def _decay_inputs(shape, dtype, device):
    from deltalab.layers.decay import init_A_log, init_dt_bias

    torch.manual_seed(0)
    channel = len(shape) == 4
    a_log = init_A_log(shape[2]).detach()
    a_log = a_log.unsqueeze(-1) if channel else a_log
    dt_bias = init_dt_bias(*shape[2:]).detach()
    gen = torch.Generator().manual_seed(0)
    raw = (3 * _randn(gen, *shape)).to(device, dtype)  # its range in training
    return [a_log.to(device), raw, dt_bias.to(device)], {}, _randn(gen, *shape).to(device)


def _decay(backend, a_log, raw, dt_bias):
    from deltalab.ops.log_decay import log_decay

    return log_decay(a_log, raw, dt_bias, backend=backend)


def _swiglu_shape(mixer: str) -> tuple[int, int]:
    from deltalab.models import build_config

    return (4 * 4096, build_config("340M", mixer=mixer).ffn_width)


def _elementwise_bytes(reads: int, writes: int):
    """Bytes of `reads` + `writes` tensors of the case's shape forward, and twice that with the
    backward (read the output's gradient and the inputs again, write the inputs' gradients)."""

    def moved(shape, dtype):
        size = math.prod(shape) * dtype.itemsize
        return (reads + writes) * size, 2 * (reads + writes) * size

    return moved


def _swiglu_bytes(shape, dtype):
    rows, width = shape
    size = rows * width * dtype.itemsize
    return 3 * size, 8 * size  # forward: gate_up in, h out; backward: gate_up, dh in, d(gate_up)


def _gemv_inputs(norm: bool, residual: bool, epilogue: str):
    def inputs(shape, dtype, device):
        rows, width, dim = shape
        gen = torch.Generator().manual_seed(0)
        x = _randn(gen, rows, dim).to(device, dtype)
        weight = (_randn(gen, width, dim) / math.sqrt(dim)).to(device, dtype)
        norm_weight = (1 + 0.1 * _randn(gen, dim)).to(device) if norm else None
        out = width // 2 if epilogue == "swiglu" else width
        res = _randn(gen, rows, out).to(device, dtype) if residual else None
        return [x, weight, norm_weight, res], {"epilogue": epilogue}, torch.zeros(rows, out)

    return inputs


def _gemv(backend, x, weight, norm_weight=None, residual=None, epilogue="none"):
    """The "torch" row: the decoder's unfused step (the norm's and the gating's kernels under "auto",
    cuBLAS between them, addmm for the residual); else `normed_linear` on `backend`."""
    if backend != "torch":
        from deltalab.ops.normed_linear import normed_linear

        return normed_linear(x, weight, norm_weight=norm_weight, residual=residual,
                             epilogue=epilogue, backend=backend)  # fmt: skip
    h = x if norm_weight is None else _rms("auto", x, norm_weight)
    if residual is not None:
        return torch.addmm(residual, h, weight.t())
    y = torch.nn.functional.linear(h, weight)
    return _swiglu("auto", y) if epilogue == "swiglu" else y


def _gemv_bytes(shape, dtype):
    rows, width, dim = shape
    return (width * dim + rows * (dim + width)) * dtype.itemsize, None


# The decoding step's normed products at the 340M GDN-2 shapes: (norm, residual, epilogue) of
# the layer's first product, the FFN's gate_up with the gating, the output projection with the
# residual, the head.
GEMV = {"p1": (True, False, "none"), "gate_up": (True, False, "swiglu"),
        "o_proj": (False, True, "none"), "head": (True, False, "none")}  # fmt: skip


@functools.cache
def _gemv_shapes() -> tuple[int, dict[str, int]]:
    """D and each product's N at the 340M GDN-2 preset (p1's from the layer's step plan)."""
    from deltalab.layers.decode_step import _layout, step_plan
    from deltalab.models import build_config
    from deltalab.models.mixers import build_mixer

    config = build_config("340M", mixer="gdn2")
    with torch.device("meta"):
        mixer = build_mixer(config, "gdn2")
    layout = _layout(mixer, step_plan(mixer))
    widths = {"p1": sum(m.out_features for m in layout.first + layout.downs),
              "gate_up": 2 * config.ffn_width, "o_proj": config.hidden_size,
              "head": config.vocab_size}  # fmt: skip
    return config.hidden_size, widths


def _gemv_case(name: str, rows: int) -> Case:
    dim, widths = _gemv_shapes()
    tiny = (1 if rows == 1 else 9, 36, 40)  # one row on the broadcast product, 9 on tl.dot
    return Case((rows, widths[name], dim), tiny, BF16, _gemv_inputs(*GEMV[name]), _gemv,
                ("y",), _gemv_bytes, backward=False)  # fmt: skip


BF16 = torch.bfloat16
HEADS = (4, 4096, 8, 128)
# op -> case -> Case. Shapes at the 340M training step (`_swiglu_shape` reads the preset).
OPS: dict[str, dict[str, Callable[[], Case]]] = {
    "norms": {
        "block": lambda: Case((4 * 4096, 1024), (37, 40), torch.float32, _norm_inputs(False),
                              _rms, ("y", "dx", "dweight")),
        "gated": lambda: Case(HEADS, (2, 9, 2, 24), BF16, _norm_inputs(True), _rms,
                              ("y", "dx", "dweight", "dgate")),
        "l2": lambda: Case(HEADS, (2, 9, 2, 24), BF16, _norm_inputs(False, l2=True), _l2,
                           ("y", "dx")),
    },
    "short_conv": {
        f"c{c}": lambda c=c, tiny=tiny: Case((4, 4096, c), (2, 37, tiny), BF16, _conv_inputs, _conv,
                                  ("y", "dx", "dweight"))
        for c, tiny in ((1024, 40), (2048, 72))
    },
    "swiglu": {
        m: lambda m=m: Case(_swiglu_shape(m), (37, 20), BF16, _swiglu_inputs, _swiglu,
                            ("h", "d_gate_up"), _swiglu_bytes)
        for m in ("gdn2", "transformer")
    },
    "rope": {
        "4k": lambda: Case(HEADS, (2, 9, 3, 12), BF16, _rope_inputs, _rope, ("y", "dx"),
                           _elementwise_bytes(1, 1)),
        "16k": lambda: Case((1, 16384, 8, 128), (1, 7, 2, 6), BF16, _rope_inputs, _rope,
                            ("y", "dx"), _elementwise_bytes(1, 1)),
    },
    "read_gate": {
        "dynamic": lambda: Case(HEADS, (2, 9, 3, 24), BF16, _read_inputs(True), _read,
                                ("out", "dq", "dread_log", "draw")),
        "static": lambda: Case(HEADS, (2, 9, 3, 24), BF16, _read_inputs(False), _read,
                               ("out", "dq", "dread_log")),
    },
    "log_decay": {
        "channel": lambda: Case(HEADS, (2, 9, 3, 24), BF16, _decay_inputs, _decay,
                                ("g", "dA_log", "draw", "ddt_bias")),
        "scalar": lambda: Case((4, 4096, 8), (2, 9, 3), BF16, _decay_inputs, _decay,
                               ("g", "dA_log", "draw", "ddt_bias")),
    },
    "normed_linear": {
        f"{name}_m{rows}": lambda name=name, rows=rows: _gemv_case(name, rows)
        for name in GEMV
        for rows in (1, 64)
    },
}  # fmt: skip


def outputs(case: Case, backend: str, leaves: list, others: dict, d_out: torch.Tensor) -> list:
    """The case's output and the gradients of its differentiable inputs."""
    leaves = [None if t is None else t.detach().requires_grad_() for t in leaves]
    out = case.call(backend, *leaves, **others)
    present = [t for t in leaves if t is not None]
    return [out, *torch.autograd.grad(out, present, d_out.to(out.dtype))]


def bench_case(op: str, name: str, case: Case, tiny: bool, device: str, repeats: int) -> dict:
    shape, dtype = (case.tiny, torch.float32) if tiny else (case.shape, case.dtype)
    leaves, others, d_out = case.inputs(shape, dtype, device)
    result = {"op": op, "case": name, "shape": list(shape), "dtype": str(dtype)[6:]}
    wide = [None if t is None else t.double() for t in leaves]

    def forward(backend: str, leaves=leaves) -> list:
        return [case.call(backend, *leaves, **others)]

    if case.backward:
        reference = outputs(case, "naive", wide, others, d_out.double())
        with_grads = lambda backend: outputs(case, backend, leaves, others, d_out)  # noqa: E731
    else:
        reference = forward("naive", wide)
        with_grads = None
    result |= time_backends(BACKENDS, forward, with_grads, reference, case.names, device, repeats)
    if case.moved is not None:
        moved = dict(zip(("forward", "train"), case.moved(shape, dtype), strict=True))
        result["kernel_bytes"] = moved
        for backend in BACKENDS:
            row = result[backend]
            row["gb_per_s"] = {p: n / row[f"{p}_ms"] / 1e6 for p, n in moved.items() if n}
    return add_speedups(result)


def print_case(result: dict) -> None:
    title = f"{result['op']} {result['case']}: {result['shape']} {result['dtype']}"
    print_backend_case(title, result, BACKENDS, "the kernels' bytes over each backend's time")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_case_arguments(parser, "--ops", OPS)
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="also time the kernels of short_conv and normed_linear (those in --ops) at other "
        "launches",
    )


def run(args: argparse.Namespace) -> dict:
    device, repeats = case_device(args)
    results: dict = {"device": device, "cases": []}
    for op in args.ops:
        for name, make in OPS[op].items():
            results["cases"].append(bench_case(op, name, make(), args.tiny, device, repeats))
            print_case(results["cases"][-1])
            save(args, results)
    sweeps = {"short_conv": short_conv_sweep, "normed_linear": normed_linear_sweep}
    for op, sweep in sweeps.items():
        if args.sweep and op in args.ops:
            results[f"{op}_sweep"] = sweep(args.tiny, device, repeats)
            save(args, results)
    return results


# normed_linear's launches tried by --sweep: (BN, BK, warps, stages) of the broadcast product
# at one row and of tl.dot at 64 (the shipped table's first), and the tiny run's.
GEMV_SWEEP = {
    "broadcast": [(16, 256, 4, 2), (8, 256, 4, 2), (32, 128, 4, 2), (16, 512, 4, 2),
                  (16, 256, 8, 2), (16, 128, 2, 2), (16, 256, 4, 3), (8, 512, 8, 2)],
    "dot": [(32, 64, 8, 3), (16, 64, 4, 3), (32, 32, 4, 3), (64, 64, 8, 3), (32, 128, 8, 2),
            (16, 128, 4, 2), (64, 32, 8, 3)],
}  # fmt: skip
TINY_GEMV_SWEEP = {"broadcast": [(16, 16, 1, 1), (16, 32, 2, 1)], "dot": [(16, 16, 1, 1)]}


def normed_linear_sweep(tiny: bool, device: str, repeats: int) -> list[dict]:
    """normed_linear's kernel at each launch of the sweep, on the p1, gate_up and head cases
    (the broadcast's at one row, tl.dot's at 64)."""
    from dataclasses import replace

    from deltalab.ops.normed_linear.triton import LAUNCH, ProductLaunch, normed_linear_triton

    rows = []
    for form, launches in (TINY_GEMV_SWEEP if tiny else GEMV_SWEEP).items():
        for name in ("p1", "gate_up", "head"):
            case = _gemv_case(name, 1 if form == "broadcast" else 64)
            shape, dtype = (case.tiny, torch.float32) if tiny else (case.shape, case.dtype)
            (x, weight, norm_weight, _), others, _ = case.inputs(shape, dtype, device)
            call = functools.partial(normed_linear_triton, x, weight, norm_weight, 1e-5,
                                     others["epilogue"], None, None)  # fmt: skip
            for launch in launches:
                table = replace(LAUNCH, **{form: ProductLaunch(*launch)})
                ms = median_ms(functools.partial(call, table=table), device, repeats)
                rows.append({"case": name, "shape": list(shape), "form": form,
                             "launch": list(launch), "ms": ms,
                             "gb_per_s": _gemv_bytes(shape, dtype)[0] / ms / 1e6,
                             "default": table == LAUNCH})  # fmt: skip
    print(f"\nnormed_linear's launches, {'tiny shapes' if tiny else 'the cases above'}")
    headers = ["case", "shape", "form", "BN", "BK", "warps", "stages", "ms", "GB/s"]
    table = [[r["case"], "x".join(map(str, r["shape"])), r["form"] + (" (default)" if r["default"]
              else ""), *r["launch"], r["ms"], r["gb_per_s"]] for r in rows]  # fmt: skip
    print(format_table(headers, table))
    return rows


# short_conv's launches tried by --sweep: (BT tokens per chunk, BC channels per program, warps)
# per kernel, and the backward's program counts at its default launch.
FORWARD_SWEEP = [(16, 1024, 4), (16, 512, 4), (32, 512, 4), (16, 2048, 8)]
BACKWARD_SWEEP = [(16, 1024, 4), (16, 512, 8), (32, 512, 8), (8, 512, 4)]
PROGRAMS_SWEEP = [512, 1024, 2048, 4096]
TINY_SWEEP = ([(8, 32, 1), (16, 64, 2)], [(8, 32, 1)], [4])


def short_conv_sweep(tiny: bool, device: str, repeats: int) -> list[dict]:
    """short_conv's Triton kernels at each launch of the sweep, at each of its case shapes."""
    rows = []
    for name, make in OPS["short_conv"].items():
        case = make()
        shape, dtype = (case.tiny, torch.float32) if tiny else (case.shape, case.dtype)
        (x, weight), _, dy = case.inputs(shape, dtype, device)
        for row in launch_sweep(x, weight[:, 0], dy, tiny, device, repeats):
            rows.append({"case": name, **row})
    print(f"\nshort_conv's launches, {'tiny shapes' if tiny else 'the cases above'}")
    headers = ["case", "kernel", "BT", "BC", "warps", "programs", "ms"]
    table = [[r["case"], r["kernel"] + (" (default)" if r["default"] else ""), *r["launch"],
              r["programs"] or "-", r["ms"]] for r in rows]  # fmt: skip
    print(format_table(headers, table))
    return rows


def launch_sweep(x, weight, dy, tiny: bool, device: str, repeats: int) -> list[dict]:
    from dataclasses import replace

    from deltalab.ops.short_conv import triton as kernels

    channels, width = weight.shape
    forward_sweep, backward_sweep, programs_sweep = (
        TINY_SWEEP if tiny else (FORWARD_SWEEP, BACKWARD_SWEEP, PROGRAMS_SWEEP)
    )
    rows = []
    default = kernels.LAUNCH
    forward_default = kernels.launch(channels, width, "forward")
    for launch in forward_sweep:
        table = replace(default, forward=launch)
        ms = median_ms(
            lambda t=table: kernels.short_conv_triton(x, weight, None, True, table=t),
            device,
            repeats,
        )
        effective = kernels.launch(channels, width, "forward", table)
        rows.append({"kernel": "forward", "launch": list(effective), "programs": None, "ms": ms,
                     "default": effective == forward_default})  # fmt: skip
    backward_default = kernels.launch(channels, width, "backward")
    programs_default = default.backward_programs
    xs, ws = x.detach().requires_grad_(), weight.detach().requires_grad_()
    configs = [(launch, programs_default) for launch in backward_sweep]
    configs += [(None, programs) for programs in programs_sweep]
    for launch, programs in configs:
        table = replace(default, backward_programs=programs)
        if launch:  # the backward's launch at any width
            table = replace(table, backward=launch, backward_wide=launch)

        def train(t=table) -> None:
            y, _ = kernels.short_conv_triton(xs, ws, None, True, table=t)
            torch.autograd.grad(y, (xs, ws), dy)

        effective = kernels.launch(channels, width, "backward", table)
        rows.append({"kernel": "forward+backward", "launch": list(effective),
                     "programs": programs, "ms": median_ms(train, device, repeats),
                     "default": effective == backward_default
                     and programs == programs_default})  # fmt: skip
    return rows
