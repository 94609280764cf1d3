"""Times the Triton Mobius scan against the PyTorch parallel scan, and KDN against its delta rule.

    python -m benchmarks kdn                                   # GPU, float32
    python -m benchmarks kdn --gain-launches --dtype bfloat16  # the split gain's launch sweep
    TRITON_INTERPRET=1 python -m benchmarks kdn --tiny         # CPU smoke run

Shapes: B=4 T=4096 H=16 and H=8 (the 340M preset's heads) and B=1 T=32768 H=16, K=V=128 (`--tiny`: B=1 T=20 H=2 K=V=2 on
CPU under the interpreter, to prove the script runs). Per shape, medians in ms of the forward
and of forward+backward (and peak CUDA memory of forward+backward, MiB):

- the variance scan alone, Diagonal ([B, T, H K] lanes) and Isotropic ([B, T, H]): KDN's fused
  Triton kernel (a, q, c in; p and p_bar out), the generic Triton Mobius scan on the four map
  coefficients, and the PyTorch parallel scan;
- `kdn_gain_diag` / `kdn_gain_iso` with the Triton scan and with the parallel scan;
- `delta_rule` (the backend `kdn_*(backend="triton")` runs the memory on) and `kdn_diag` /
  `kdn_iso` with backend="triton", with their ratio to `delta_rule`;
- a sweep of the split diagonal gain's chunk (tokens per program), to tune
  `triton_diag_gain.chunk_tokens` (the default is marked);
- a sweep of the fused scan's launch configurations (BLOCK_T, BLOCK_L) at both lane counts, to
  tune `deltalab.ops.mobius.triton.launch_config` (the default is marked).

`--gain-chunks` runs only a sweep of the split diagonal gain's chunk (tokens per program: the
programs on the GPU at once, against the carry passes' length) at the three shapes, with the
inputs in --dtype.

`--gain-profile` runs only the split diagonal gain's forward and backward --repeats times at the
first shape (or `--shape`), untimed, for a profiler that attaches to the process
(Nsight Compute's counters of its four token walks: the command in benchmarks/README.md), the
loss reaching the gain and the routed k and g (as in the KDN mixers, whose delta rule takes them from the gain's
node, so its backward adds their gradients).

`--gain-launches` runs only a sweep of the split diagonal gain's launches at B=4 T=4096 H=16 (or
`--shape`): each of its four kernels' (BLOCK_T, warps) in turn, the others at their defaults
(`triton_diag_gain.TOKEN_LAUNCH`), with the inputs in
--dtype as the KDN mixers pass them and the loss reaching the gain and the routed k and g.

Inputs are random (unit keys, decays in [-1, 0], q_noise in [0, 0.1], r in [0.01, 1.01]), never
zeros. The JSON holds every number printed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import parse_shape, save
from deltalab.benchmarking import format_table
from deltalab.errors import UserError
from deltalab.ops import delta_rule, kdn_diag, kdn_gain_diag, kdn_gain_iso, kdn_iso
from deltalab.ops.delta_rule import BACKENDS as DELTA_RULE_BACKENDS
from deltalab.ops.kdn.triton import kdn_variance_scan
from deltalab.ops.kdn.triton_diag_gain import TOKEN_LAUNCH, chunk_tokens, kdn_diag_gain, launch
from deltalab.ops.mobius import scan_along_time
from deltalab.ops.mobius.triton import launch_config, mobius_scan_lanes

SHAPES = [(4, 4096, 16, 128), (4, 4096, 8, 128), (1, 32768, 16, 128)]  # (B, T, H, K); H=8: 340M
TINY_SHAPES = [(1, 20, 2, 2)]
SWEEP = [(16, 32), (32, 32), (64, 32), (64, 16), (128, 16), (256, 4), (1024, 1), (512, 1)]
TINY_SWEEP = [(16, 1), (16, 4)]
# Tokens per program of the diagonal gain split over T (chunk_tokens's default marked).
SPLIT_CHUNKS = [64, 128, 256, 512, 1024]
TINY_SPLIT_CHUNKS = [4, 8]
# --gain-chunks: down to two tiles of the forward (8 tokens at K = 128).
GAIN_CHUNKS = [16, 32, 64, 128, 256, 512]
TINY_GAIN_CHUNKS = [2, 4, 8]
# The diagonal gain's launches (--gain-launches): (tokens unrolled per step, warps) of one of its
# four kernels (TOKEN_LAUNCH's keys) at a time, the others at their defaults, split over T.
TOKEN_GAIN_LAUNCHES = [(bt, w) for bt in (1, 2, 4, 8) for w in (1, 2)]
TINY_GAIN_LAUNCHES = [(2, 1), (4, 2)]
# What kdn_*(backend="triton") hands delta_rule: "triton" once delta_rule has it, else "chunk".
MEMORY_BACKEND = "triton" if "triton" in DELTA_RULE_BACKENDS else "chunk"


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_op(fn, inputs, repeats: int, device: str) -> dict[str, float]:
    """Median ms of fn(*inputs) under no_grad, and of fn(*leaves).sum().backward(); peak MiB of
    the latter on CUDA (over what the inputs already hold)."""

    def median_ms(step) -> float:
        step()  # warm-up (compiles the kernels)
        synchronize(device)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            step()
            synchronize(device)
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)

    def forward() -> None:
        with torch.no_grad():
            fn(*inputs)

    leaves = [x.detach().clone().requires_grad_() for x in inputs]

    def train() -> None:
        out = fn(*leaves)
        (out[0] if isinstance(out, tuple) else out).sum().backward()
        for leaf in leaves:
            leaf.grad = None

    result = {"fwd_ms": median_ms(forward), "fwd_bwd_ms": median_ms(train)}
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        train()
        synchronize(device)
        result["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    return result


def make_inputs(shape, device: str, dtype: torch.dtype, generator: torch.Generator):
    batch, length, heads, dim = shape

    def draw(*s, uniform=False):
        x = torch.rand(*s, generator=generator) if uniform else torch.randn(*s, generator=generator)
        return x.to(device=device, dtype=dtype)

    full = (batch, length, heads, dim)
    return {
        "q": draw(*full),
        "k": torch.nn.functional.normalize(draw(*full), dim=-1),
        "v": draw(*full),
        "g": -draw(*full, uniform=True),
        "q_noise": 0.1 * draw(*full, uniform=True),
        "r": 0.01 + draw(*full[:3], uniform=True),
        "beta": draw(*full[:3], uniform=True),
    }


def variance_gates(x: dict[str, torch.Tensor], diagonal: bool) -> list[torch.Tensor]:
    """KDN's (a, q, c) `[B, T, lanes]` and p0 `[B, lanes]`, as gains.py builds them."""
    dim = x["k"].shape[-1]
    decay2 = (2 * x["g"].float()).exp()
    if diagonal:
        evidence = dim * x["k"].float().square() / x["r"].float().unsqueeze(-1)
        q_noise = x["q_noise"].float()
    else:
        decay2 = decay2.mean(-1)
        evidence = x["k"].float().square().sum(-1) / x["r"].float()
        q_noise = x["q_noise"].float().mean(-1)
    gates = [m.flatten(2).contiguous() if m.dim() == 4 else m for m in (decay2, q_noise, evidence)]
    return [*gates, torch.ones_like(gates[0][:, 0])]


def variance_maps(x: dict[str, torch.Tensor], diagonal: bool) -> list[torch.Tensor]:
    """The same as Mobius maps (A, B, C, D) `[B, T, lanes]` and x0 `[B, lanes]`."""
    a, q, c, p0 = variance_gates(x, diagonal)
    return [a, q, c * a, c * q + 1, p0]


def bench_shape(shape, args, device: str, dtype: torch.dtype) -> dict:
    batch, length, heads, dim = shape
    x = make_inputs(shape, device, dtype, torch.Generator().manual_seed(0))
    rows: dict[str, dict[str, float]] = {}
    r = args.repeats

    for variant, diagonal in (("diag", True), ("iso", False)):
        rows[f"scan {variant} triton (KDN, fused)"] = time_op(
            lambda *a: kdn_variance_scan(*a)[0], variance_gates(x, diagonal), r, device
        )
        maps = variance_maps(x, diagonal)
        rows[f"scan {variant} triton (Mobius)"] = time_op(mobius_scan_lanes, maps, r, device)
        rows[f"scan {variant} parallel"] = time_op(
            lambda *m: scan_along_time(*m, "parallel"), maps, r, device
        )

    p0 = torch.ones(heads, device=device, dtype=dtype)
    gates = [x[n] for n in ("k", "g", "q_noise", "r")]
    iso_gates = [*gates[:2], x["q_noise"].mean(-1), gates[3]]
    for backend in ("triton", "parallel"):
        rows[f"kdn_gain_diag ({backend} scan)"] = time_op(
            lambda *a, b=backend: kdn_gain_diag(*a, backend=b)[0], [*gates, p0], r, device
        )
        rows[f"kdn_gain_iso ({backend} scan)"] = time_op(
            lambda *a, b=backend: kdn_gain_iso(*a, backend=b)[0], [*iso_gates, p0], r, device
        )

    p_prior = p0[None, :, None].expand(batch, heads, dim).contiguous()

    base = [x[n] for n in ("q", "k", "v", "g")]
    rows[f"delta_rule ({MEMORY_BACKEND})"] = time_op(
        # a = beta, a strength per token, as the KDA layers pass it.
        lambda q, k, v, g, beta: delta_rule(q, beta, k, v, g, backend=MEMORY_BACKEND)[0],
        [*base, x["beta"]],
        r,
        device,
    )
    rows["kdn_diag (triton)"] = time_op(
        lambda q, k, v, g, qn, rr, p: kdn_diag(q, k, v, g, qn, rr, p, backend="triton")[0],
        [*base, x["q_noise"], x["r"], p0],
        r,
        device,
    )
    rows["kdn_iso (triton)"] = time_op(
        lambda q, k, v, g, qn, rr, p: kdn_iso(q, k, v, g, qn, rr, p, backend="triton")[0],
        [*base, x["q_noise"].mean(-1), x["r"], p0],
        r,
        device,
    )
    reference = rows[f"delta_rule ({MEMORY_BACKEND})"]
    for name in ("kdn_diag (triton)", "kdn_iso (triton)"):
        rows[name]["fwd_ratio"] = rows[name]["fwd_ms"] / reference["fwd_ms"]
        rows[name]["fwd_bwd_ratio"] = rows[name]["fwd_bwd_ms"] / reference["fwd_bwd_ms"]

    split_sweep = []
    default_chunk = chunk_tokens(batch * heads, length, launch(dim, length, "forward")[0])
    for chunk in TINY_SPLIT_CHUNKS if args.tiny else SPLIT_CHUNKS:
        timing = time_op(
            lambda *a, c=chunk: kdn_diag_gain(*a, float(dim), chunk=c)[0],
            [*gates, p_prior],
            r,
            device,
        )
        split_sweep.append({"chunk": chunk, "default": chunk == default_chunk, **timing})

    sweep = []
    for variant, diagonal in (("diag", True), ("iso", False)):
        maps = variance_maps(x, diagonal)
        lanes = maps[0].shape[0] * maps[0].shape[2]
        default = launch_config(lanes, length)
        for config in TINY_SWEEP if args.tiny else SWEEP:
            timing = time_op(lambda *m, c=config: mobius_scan_lanes(*m, config=c), maps, r, device)
            sweep.append(
                {
                    "variant": variant,
                    "lanes": lanes,
                    "BLOCK_T": config[0],
                    "BLOCK_L": config[1],
                    "default_fwd": config == default,
                    **timing,
                }
            )
    return {
        "B": batch,
        "T": length,
        "H": heads,
        "K": dim,
        "rows": rows,
        "sweep": sweep,
        "split_sweep": split_sweep,
    }


def gain_chunk_sweep(shape, args, device: str, dtype: torch.dtype) -> list[dict]:
    """The split diagonal gain's times at each chunk of GAIN_CHUNKS (the default, chunk_tokens,
    marked), on inputs in `dtype` as the KDN mixers pass them."""
    batch, length, heads, dim = shape
    x = make_inputs(shape, device, dtype, torch.Generator().manual_seed(0))
    gates = [x[n] for n in ("k", "g", "q_noise", "r")]
    p_prior = torch.ones(batch, heads, dim, device=device)
    default = chunk_tokens(batch * heads, length, launch(dim, length, "chunk_maps")[0])
    sweep = []
    for chunk in TINY_GAIN_CHUNKS if args.tiny else GAIN_CHUNKS:

        def gain(*a, c=chunk):
            return kdn_diag_gain(*a, float(dim), gain_dtype=dtype, chunk=c)[0]

        timing = time_op(gain, [*gates, p_prior], args.repeats, device)
        sweep.append({"chunk": chunk, "default": chunk == default, **timing})
    return sweep


def gain_launch_sweep(shape, args, device: str, dtype: torch.dtype) -> list[dict]:
    """The split diagonal gain's times with each kernel's (tokens, warps) from
    TOKEN_GAIN_LAUNCHES, one kernel at a time (the forward's two kernels move the forward's time,
    the backward's two the backward's), on the inputs in `dtype` as the KDN mixers pass them
    (the gain in k's dtype). BLOCK_T is the tokens the kernel launches with (`launch`: the
    table's entry scaled at wide keys and clamped at short T)."""
    batch, length, heads, dim = shape
    x = make_inputs(shape, device, dtype, torch.Generator().manual_seed(0))
    gates = [x[n] for n in ("k", "g", "q_noise", "r")]
    p_prior = torch.ones(batch, heads, dim, device=device)
    chunk = 8 if args.tiny else None

    def gain(*a, launches=None):
        # The loss reaches the routed k and g too: the backward adds their gradients, as in the
        # KDN mixers (more loads and registers than the gain's alone).
        gain, _, _, k, g = kdn_diag_gain(
            *a, float(dim), gain_dtype=dtype, chunk=chunk, launches=launches
        )
        return gain.float().sum() + k.float().sum() + g.float().sum()

    sweep = [{"kernel": "(all defaults)", **time_op(gain, [*gates, p_prior], args.repeats, device)}]
    for kernel in TOKEN_LAUNCH:
        for entry in TINY_GAIN_LAUNCHES if args.tiny else TOKEN_GAIN_LAUNCHES:
            table = {kernel: entry}
            timing = time_op(
                lambda *a, t=table: gain(*a, launches=t), [*gates, p_prior], args.repeats, device
            )
            launched = launch(dim, length, kernel, table)[0]
            sweep.append(
                {"kernel": kernel, "BLOCK_T": launched, "warps": entry[1],
                 "default": entry == TOKEN_LAUNCH[kernel], **timing}
            )  # fmt: skip
    return sweep


def print_gain_launches(sweep: list[dict]) -> None:
    headers = ["diag_gain kernel", "BLOCK_T", "warps", "fwd ms", "fwd+bwd ms"]
    table = [
        [
            s["kernel"] + (" (default)" if s.get("default") else ""),
            s.get("BLOCK_T", "-"),
            s.get("warps", "-"),
            s["fwd_ms"],
            s["fwd_bwd_ms"],
        ]
        for s in sweep
    ]
    print(format_table(headers, table))


def print_shape(result: dict) -> None:
    print(f"\nB={result['B']} T={result['T']} H={result['H']} K=V={result['K']}")
    headers = ["op", "fwd ms", "fwd+bwd ms", "peak MiB", "fwd/dr", "fwd+bwd/dr"]
    table = [
        [
            name,
            row["fwd_ms"],
            row["fwd_bwd_ms"],
            row.get("peak_mib", "-"),
            row.get("fwd_ratio", "-"),
            row.get("fwd_bwd_ratio", "-"),
        ]
        for name, row in result["rows"].items()
    ]
    print(format_table(headers, table))
    headers = ["scan", "lanes", "BLOCK_T", "BLOCK_L", "fwd ms", "fwd+bwd ms"]
    table = [
        [
            s["variant"] + (" (default fwd)" if s["default_fwd"] else ""),
            s["lanes"],
            s["BLOCK_T"],
            s["BLOCK_L"],
            s["fwd_ms"],
            s["fwd_bwd_ms"],
        ]
        for s in result["sweep"]
    ]
    print(format_table(headers, table))
    headers = ["diag_gain split over T: chunk", "fwd ms", "fwd+bwd ms"]
    table = [
        [f"{s['chunk']}" + (" (default)" if s["default"] else ""), s["fwd_ms"], s["fwd_bwd_ms"]]
        for s in result["split_sweep"]
    ]
    print(format_table(headers, table))


def one_shape(args) -> tuple[int, ...]:
    """--shape, else the first shape (of TINY_SHAPES with --tiny)."""
    return args.shape or (TINY_SHAPES if args.tiny else SHAPES)[0]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (interpreter smoke run)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per op")
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument(
        "--gain-launches",
        action="store_true",
        help="only the split diagonal gain's launch sweep, at the first shape or --shape",
    )
    modes.add_argument(
        "--gain-profile",
        action="store_true",
        help="only run the split diagonal gain (forward and backward), for a profiler",
    )
    modes.add_argument(
        "--gain-chunks",
        action="store_true",
        help="only the split diagonal gain's chunk sweep, at every shape",
    )
    parser.add_argument(
        "--shape",
        type=parse_shape,
        default=None,
        help="--gain-profile's and --gain-launches' shape, BxTxHxK (default: the first shape)",
    )


def run(args: argparse.Namespace) -> dict:
    if args.shape and not (args.gain_profile or args.gain_launches):
        raise UserError("--shape applies to --gain-profile and --gain-launches only")
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    args.repeats = args.repeats or (1 if args.tiny else 10)
    dtype = getattr(torch, args.dtype)
    result: dict = {
        "device": device,
        "dtype": args.dtype,
        "memory_backend": MEMORY_BACKEND,
        "repeats": args.repeats,
    }
    if args.gain_profile:
        shape = one_shape(args)
        batch, _, heads, dim = shape
        x = make_inputs(shape, device, dtype, torch.Generator().manual_seed(0))
        leaves = [x[n].requires_grad_() for n in ("k", "g", "q_noise", "r")]
        p_prior = torch.ones(batch, heads, dim, device=device, requires_grad=True)
        for _ in range(args.repeats):
            gain, _, _, k, g = kdn_diag_gain(*leaves, p_prior, float(dim), gain_dtype=dtype)
            (gain.float().sum() + k.float().sum() + g.float().sum()).backward()
        synchronize(device)
        print(f"ran the split diagonal gain {args.repeats} times at {shape}")
        return {**result, "shape": shape, "gain_profile_runs": args.repeats}
    if args.gain_chunks:
        results = []
        for shape in TINY_SHAPES if args.tiny else SHAPES:
            results.append({"shape": shape, "sweep": gain_chunk_sweep(shape, args, device, dtype)})
            print(f"\nB, T, H, K = {shape}")
            headers = ["diag_gain split over T: chunk", "fwd ms", "fwd+bwd ms"]
            table = [
                [f"{c['chunk']}" + (" (default)" if c["default"] else ""), c["fwd_ms"],
                 c["fwd_bwd_ms"]]
                for c in results[-1]["sweep"]
            ]  # fmt: skip
            print(format_table(headers, table))
        return {**result, "gain_chunks": results}
    if args.gain_launches:
        shape = one_shape(args)
        sweep = gain_launch_sweep(shape, args, device, dtype)
        print(f"\nB, T, H, K = {shape}")
        print_gain_launches(sweep)
        return {**result, "shape": shape, "gain_launches": sweep}
    result["shapes"] = []
    for shape in TINY_SHAPES if args.tiny else SHAPES:
        result["shapes"].append(bench_shape(shape, args, device, dtype))
        print_shape(result["shapes"][-1])
        save(args, result)
    return result
