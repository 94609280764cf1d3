"""The Triton backend of the delta rule against the chunk backend, fla and SDPA, in one run.

    python -m benchmarks ops                                   # GPU: both shapes, every part
    python -m benchmarks ops --parts time --shapes 4x4096x16x128 \
        --only kda_c64 gdn2_c64 kdn_iso_c64 kdn_diag_c64 fla_kda fla_gdn2 sdpa   # against fla
    python -m benchmarks ops --parts time --shapes 4x4096x16x128 \
        --only kda_qk kda_l2first gdn_qk gdn_l2first gdn2_l2first fla_kda_qk fla_gdn_qk fla_gdn2_qk
    TRITON_INTERPRET=1 python -m benchmarks ops --tiny          # CPU smoke run

fla is a yardstick, not a dependency: its rows (fla_kda, fla_gdn2 and the three `_qk` ones, which
normalize q and k in fla's call) appear where it imports
(benchmarks/README.md). Its kernels autotune on their first call, which takes minutes.

Four parts, all on fresh random inputs (never zeros), bf16 inputs unless said:
1. check: relative error against a float64 reference (the chunk backend in float64) of the
   output and every gradient, fp32 (TF32 off) and bf16 inputs;
2. stability: float32 error at chunk 64/128/256 under per-channel log decays down to -gmax,
   next to fla's `chunk_kda` (fixed chunk 64) on the same inputs;
3. time: median ms of forward and forward+backward and peak GiB of forward+backward, per form
   (KDA: a = beta per token, b = k, and `kda_product` with the direction beta k formed first; GDN-2: a = k, b = beta_e * k, u = w * v; GDN: one decay per head;
   Isotropic / Diagonal KDN; KDA and GDN with q and k made unit-norm inside the rule,
   `_qk` (`qk_l2norm=True`), or by the norm op before it, `_l2first` (GDN-2 too), against fla's
   `use_qk_l2norm_in_kernel=True`), with forward and forward+backward ratios to fla's kernel of
   the same form in the same run (`FLA_ANCHOR`);
4. overhead (CUDA): wall time beyond the kernels' own, split into the value checks' read-backs
   and the host's launching, per form (`--parts overhead`, not in the default parts).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import statistics
import sys

import torch
import torch.nn.functional as F

from benchmarks.common import (
    add_delta_rule_options,
    backward_fresh,
    delta_rule_options,
    parse_shape,
)
from deltalab.benchmarking import format_table, median_seconds
from deltalab.ops import delta_rule as _delta_rule
from deltalab.ops import kdn_diag, kdn_iso
from deltalab.ops.norms import l2_normalize, layer_backend
from deltalab.ops.options import DEFAULT_OPTIONS, KernelOptions
from deltalab.testing import relative_error

try:  # fla is a yardstick, not a dependency: its rows are skipped where it does not import.
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.gdn2 import chunk_gdn2
    from fla.ops.kda import chunk_kda
except ImportError:
    chunk_kda = chunk_gdn2 = chunk_gated_delta_rule = None


def draw_inputs(batch, length, heads, dim, device, dtype, gmax=1.0, seed=0):
    """Unit keys, beta and the GDN-2 gates in (0, 1), per-channel log decays in [-gmax, 0]."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    def rand(*shape):
        return torch.rand(*shape, generator=gen)

    shape = (batch, length, heads, dim)
    x = {
        "q": randn(*shape),
        "k": F.normalize(randn(*shape), dim=-1),
        "v": randn(*shape),
        "g": -gmax * rand(*shape),
        "g_head": -gmax * rand(*shape[:3]),
        "beta": rand(*shape[:3]),
        "erase_gate": rand(*shape),
        "write_gate": rand(*shape),
        "q_noise": 0.1 * rand(*shape[:3]),
        "r": 0.01 + rand(*shape[:3]),
        # Diagonal KDN's process noise is per channel (the layers project it so): drawn as such,
        # not a per-head draw expanded, whose copy and sum over K the op would be timed with.
        "q_noise_k": 0.1 * rand(*shape),
    }
    return {k: v.to(device=device, dtype=dtype) for k, v in x.items()}


def forms(backend: str, chunk_size: int, options: KernelOptions = DEFAULT_OPTIONS):
    """name -> (fn(**inputs) -> output, input names that get gradients); every form with the
    kernel `options`."""
    delta_rule = functools.partial(_delta_rule, options=options)
    iso_op = functools.partial(kdn_iso, options=options)
    diag_op = functools.partial(kdn_diag, options=options)

    # a = beta: the primitive's per-token strength, multiplied in as its kernels load k.
    def kda(q, k, v, g, beta, **_):
        return delta_rule(q, beta, k, v, g, chunk_size=chunk_size, backend=backend)[0]

    # The same with the direction beta k formed by the caller: what the per-token strength saves.
    def kda_product(q, k, v, g, beta, **_):
        a = beta[..., None] * k
        return delta_rule(q, a, k, v, g, chunk_size=chunk_size, backend=backend)[0]

    def gdn2(q, k, v, g, erase_gate, write_gate, **_):
        return delta_rule(
            q, k, erase_gate * k, write_gate * v, g, chunk_size=chunk_size, backend=backend
        )[0]

    # GDN-2 with q and k made unit-norm by the norm op first, as its layer does: the erase gate
    # scales the normalized key, so the rule's own `qk_l2norm` (which normalizes b) does not fit.
    def gdn2_l2first(q, k, v, g, erase_gate, write_gate, **_):
        q, k = (l2_normalize(t, backend=layer_backend(backend)) for t in (q, k))
        return gdn2(q, k, v, g, erase_gate, write_gate)

    def gdn(q, k, v, g_head, beta, **_):
        return delta_rule(q, beta, k, v, g_head, chunk_size=chunk_size, backend=backend)[0]

    # KDA (decay "g") or GDN ("g_head") with q and k unit-norm: inside the rule (its kernels
    # normalize rows as they load them), or by the norm op before it (what the layers did
    # before `qk_l2norm`).
    def unit_keys(decay: str, first: bool):
        def form(q, k, v, beta, **x):
            if first:
                q, k = (l2_normalize(t, backend=layer_backend(backend)) for t in (q, k))
            return delta_rule(q, beta, k, v, x[decay], chunk_size=chunk_size, backend=backend,
                              qk_l2norm=not first)[0]  # fmt: skip

        return form, ("q", "k", "v", decay, "beta")

    def iso(q, k, v, g, q_noise, r, **_):
        p0 = torch.ones(q.shape[2], device=q.device)
        return iso_op(q, k, v, g, q_noise, r, p0, chunk_size=chunk_size, backend=backend)[0]

    def diag(q, k, v, g, q_noise_k, r, **_):
        p0 = torch.ones(q.shape[2], q.shape[3], device=q.device)
        return diag_op(q, k, v, g, q_noise_k, r, p0, chunk_size=chunk_size, backend=backend)[0]

    return {
        "kda": (kda, ("q", "k", "v", "g", "beta")),
        "kda_product": (kda_product, ("q", "k", "v", "g", "beta")),
        "gdn2": (gdn2, ("q", "k", "v", "g", "erase_gate", "write_gate")),
        "gdn2_l2first": (gdn2_l2first, ("q", "k", "v", "g", "erase_gate", "write_gate")),
        "gdn": (gdn, ("q", "k", "v", "g_head", "beta")),
        "kda_qk": unit_keys("g", first=False),
        "kda_l2first": unit_keys("g", first=True),
        "gdn_qk": unit_keys("g_head", first=False),
        "gdn_l2first": unit_keys("g_head", first=True),
        "kdn_iso": (iso, ("q", "k", "v", "g", "q_noise", "r")),
        "kdn_diag": (diag, ("q", "k", "v", "g", "q_noise_k", "r")),
    }


def fla_forms():
    if chunk_kda is None:
        return {}

    def kda(q, k, v, g, beta, **_):
        return chunk_kda(q, k, v, g.float(), beta)[0]

    def gdn2(q, k, v, g, erase_gate, write_gate, **_):
        return chunk_gdn2(q, k, v, g.float(), erase_gate, write_gate)[0]

    def gdn2_qk(q, k, v, g, erase_gate, write_gate, **_):
        g = g.float()
        return chunk_gdn2(q, k, v, g, erase_gate, write_gate, use_qk_l2norm_in_kernel=True)[0]

    def kda_qk(q, k, v, g, beta, **_):
        return chunk_kda(q, k, v, g.float(), beta, use_qk_l2norm_in_kernel=True)[0]

    def gdn_qk(q, k, v, g_head, beta, **_):
        g = g_head.float()
        return chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]

    return {
        "fla_kda": (kda, ("q", "k", "v", "g", "beta")),
        "fla_gdn2": (gdn2, ("q", "k", "v", "g", "erase_gate", "write_gate")),
        "fla_gdn2_qk": (gdn2_qk, ("q", "k", "v", "g", "erase_gate", "write_gate")),
        "fla_kda_qk": (kda_qk, ("q", "k", "v", "g", "beta")),
        "fla_gdn_qk": (gdn_qk, ("q", "k", "v", "g_head", "beta")),
    }


def sdpa_form():
    def sdpa(q, k, v, **_):
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return out.transpose(1, 2)

    return {"sdpa": (sdpa, ("q", "k", "v"))}


def run_with_grads(fn, inputs, names, d_out=None):
    leaves = {
        k: (v.detach().clone().requires_grad_() if k in names else v) for k, v in inputs.items()
    }
    out = fn(**leaves)
    if d_out is None:
        d_out = torch.randn_like(out)
    out.backward(d_out.to(out.dtype))
    return out.detach(), {k: leaves[k].grad for k in names}, d_out


def check(device, shape, chunk_sizes, options=DEFAULT_OPTIONS):
    """Relative errors of output and gradients against the chunk backend in float64."""
    rows = []
    torch.backends.cuda.matmul.allow_tf32 = False
    for name, (fn64, names) in forms("chunk", 64).items():
        ref_inputs = draw_inputs(*shape, device, torch.float64, seed=1)
        o_ref, g_ref, d_out = run_with_grads(fn64, ref_inputs, names)
        for chunk in chunk_sizes:
            fn, _ = forms("triton", chunk, options)[name]
            for dtype in (torch.float32, torch.bfloat16):
                if dtype == torch.bfloat16 and device == "cpu":
                    continue  # the interpreter computes bf16 tiles wrongly; fp32 covers it
                inputs = {k: v.to(dtype) for k, v in ref_inputs.items()}
                o, grads, _ = run_with_grads(fn, inputs, names, d_out)
                errors = {"out": relative_error(o, o_ref)}
                errors.update({f"d{k}": relative_error(grads[k], g_ref[k]) for k in names})
                rows.append(
                    {"form": name, "chunk": chunk, "dtype": str(dtype).split(".")[-1], **errors}
                )
    return rows


def stability(device, shape, gmaxes, chunk_sizes, options=DEFAULT_OPTIONS):
    """float32 output error vs float64 under strong per-channel decays (KDA form)."""
    rows = []
    for gmax in gmaxes:
        inputs = draw_inputs(*shape, device, torch.float64, gmax=gmax, seed=2)
        ref = forms("chunk", 64)["kda"][0](**inputs)
        f32 = {k: v.float() for k, v in inputs.items()}
        row = {"gmax": gmax}
        for chunk in chunk_sizes:
            try:
                with torch.no_grad():
                    out = forms("triton", chunk, options)["kda"][0](**f32)
                row[f"triton_c{chunk}"] = relative_error(out, ref)
            except Exception as error:  # a failed case is a result: record it, run the rest
                row[f"triton_c{chunk}"] = f"{type(error).__name__}"
            print(f"gmax {gmax} triton_c{chunk}: {row[f'triton_c{chunk}']}", file=sys.stderr,
                  flush=True)  # fmt: skip
        if chunk_kda is not None and device == "cuda":
            with torch.no_grad():
                out = fla_forms()["fla_kda"][0](**f32)
            row["fla_kda_c64"] = relative_error(out, ref)
            print(f"gmax {gmax} fla_kda_c64: {row['fla_kda_c64']}", file=sys.stderr, flush=True)
        rows.append(row)
    return rows


def time_case(fn, inputs, names, repeats, device):
    def forward():
        with torch.no_grad():
            fn(**inputs)

    leaves = {k: (v.clone().requires_grad_() if k in names else v) for k, v in inputs.items()}
    d_out = torch.randn_like(fn(**inputs))

    def train():
        backward_fresh(fn(**leaves), d_out, [leaves[k] for k in names])

    if device == "cuda":
        import triton

        forward_ms = triton.testing.do_bench(forward, warmup=50, rep=300, return_mode="median")
        train()
        torch.cuda.synchronize()
        # The peak counts the gradients a call makes: the last call's are dropped before the
        # base is read (train drops them on entry, which would otherwise lower the peak).
        for k in names:
            leaves[k].grad = None
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        train()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        train_ms = triton.testing.do_bench(train, warmup=50, rep=300, return_mode="median")
        return forward_ms, train_ms, peak
    return median_seconds(forward, repeats) * 1e3, median_seconds(train, repeats) * 1e3, math.nan


def timings(device, shapes, chunk_sizes, repeats, with_chunk_backend, only, gmax=1.0,
            options=DEFAULT_OPTIONS):  # fmt: skip
    rows = []
    for shape in shapes:
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        inputs = draw_inputs(*shape, device, dtype, gmax=gmax)
        cases = {}
        for chunk in chunk_sizes:
            cases.update({f"{k}_c{chunk}": v for k, v in forms("triton", chunk, options).items()})
        if with_chunk_backend:
            cases.update({f"{k}_chunk64": v for k, v in forms("chunk", 64).items()})
        if device == "cuda":
            cases.update(fla_forms())
            cases.update(sdpa_form())
        for name, (fn, names) in cases.items():
            if only and not any(name.startswith(prefix) for prefix in only):
                continue
            try:
                fwd, train, peak = time_case(fn, inputs, names, repeats, device)
            except torch.OutOfMemoryError:
                fwd = train = peak = math.inf
            except Exception as error:  # a failed case is a result: record it, run the rest
                print(f"{name}: {error!r}", file=sys.stderr)
                fwd = train = peak = math.nan
            torch.cuda.empty_cache() if device == "cuda" else None
            rows.append(
                {"shape": "x".join(map(str, shape)), "case": name, "gmax": gmax, "fwd_ms": fwd,
                 "train_ms": train, "peak_gib": peak}
            )  # fmt: skip
            print(f"{rows[-1]}", file=sys.stderr, flush=True)
    return rows


def stages(device, shape, chunk_size, options=DEFAULT_OPTIONS):
    """Forward time of each stage of the Triton path (KDA form): where the time goes."""
    from deltalab.ops.delta_rule.chunk import chunk_operators, intra_chunk, to_chunks
    from deltalab.ops.delta_rule.triton.chunk import _operators_triton, operator_dtype
    from deltalab.ops.delta_rule.triton.factors import factors_triton
    from deltalab.ops.delta_rule.triton.intra import Tokens, intra_triton
    from deltalab.ops.delta_rule.triton.solve import solve_triton
    from deltalab.ops.delta_rule.triton.state_pass import state_pass_triton

    x = draw_inputs(*shape, device, torch.bfloat16 if device == "cuda" else torch.float32)
    raw = (x["q"], x["beta"][..., None] * x["k"], x["k"], x["v"], x["g"])
    # The Triton stages read the token-major inputs in place; the PyTorch twin takes chunks.
    q, a, b, u, g = raw
    chunked = [to_chunks(t.float(), chunk_size).contiguous() for t in raw]
    tokens = Tokens(-(-shape[1] // chunk_size), shape[2], shape[1], chunk_size)
    state = torch.zeros(shape[0], shape[2], shape[3], shape[3], device=device)
    # Every Triton stage stores its operators as the delta rule would (options.operator_dtype).
    dtype = operator_dtype(q, a, b, u, stored=options.operator_dtype)
    walk = {"walk_dots": options.walk_dots}
    ops, lower = _operators_triton(q, a, b, u, g, "tf32", tokens, 1.0, dtype)
    out = torch.empty_like(u)
    rows = []
    cases = (
        ("stages 1-2, PyTorch", lambda: chunk_operators(*chunked, intra=intra_chunk)),
        ("factors", lambda: factors_triton(q, a, b, g, tokens, dtype=dtype)),
        ("stage 1", lambda: intra_triton(q, a, b, g, "tf32", tokens, attend_dtype=dtype)),
        ("stage 2 (one solve)", lambda: solve_triton(lower, u, "tf32", tokens, dtype=dtype)),
        (
            "stages 1-2, Triton",
            lambda: _operators_triton(q, a, b, u, g, "tf32", tokens, 1.0, dtype),
        ),
        ("stages 3-4, IEEE", lambda: state_pass_triton(ops, state, "ieee", out, tokens, **walk)),
        ("stages 3-4, TF32", lambda: state_pass_triton(ops, state, "tf32", out, tokens, **walk)),
    )
    for name, fn in cases:
        ms = median_seconds(fn, 5) * 1e3
        if device == "cuda":
            import triton

            ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
        rows.append(
            {"shape": "x".join(map(str, shape)), "chunk": chunk_size, "stage": name, "fwd_ms": ms}
        )
    return rows


@contextlib.contextmanager
def value_checks_off():
    """Every value check skipped, as during a CUDA graph capture (shape and dtype checks stay):
    what the checks' read-backs cost is the time with them on minus the time in here."""
    from deltalab.ops import _checks

    checkable = _checks.values_checkable
    _checks.values_checkable = lambda x: False
    try:
        yield
    finally:
        _checks.values_checkable = checkable


def host_ms(call, calls=12):
    """Median host milliseconds of one `call()` while the GPU is kept busy by a long sleep
    queued first: the host never waits for the device, so this is the launching alone (value
    checks must be off, or their read-backs wait for the sleep)."""
    import time

    call()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about 1 s of GPU clock: longer than the calls below
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e3


def overhead(device, shape, only, chunk_size=64, options=DEFAULT_OPTIONS):
    """Where wall time goes beyond the kernels: per form, forward+backward wall ms with the
    value checks on and off, the kernels' own ms, and the host's ms to launch one forward and
    one forward+backward (checks off); then the host's op table for the KDN forms."""
    from deltalab.benchmarking import kernel_ms

    inputs = draw_inputs(*shape, device, torch.bfloat16)
    rows = []
    for name, (fn, names) in forms("triton", chunk_size, options).items():
        if only and not any(f"{name}_c{chunk_size}".startswith(p) for p in only):
            continue
        leaves = {k: (v.clone().requires_grad_() if k in names else v) for k, v in inputs.items()}
        d_out = torch.randn_like(fn(**inputs))

        def train(fn=fn, leaves=leaves, d_out=d_out, names=names):
            backward_fresh(fn(**leaves), d_out, [leaves[k] for k in names])

        def forward(fn=fn):
            with torch.no_grad():
                fn(**inputs)

        import triton

        def bench(call):
            return triton.testing.do_bench(call, warmup=50, rep=300, return_mode="median")

        row = {"form": f"{name}_c{chunk_size}", "wall_ms": bench(train)}
        with value_checks_off():
            row["wall_unchecked_ms"] = bench(train)
            row["kernel_ms"] = kernel_ms(train, device, 10)
            row["host_fwd_ms"] = host_ms(forward)
            row["host_train_ms"] = host_ms(train)
            if name.startswith("kdn"):
                train()
                torch.cuda.synchronize()
                activities = [torch.profiler.ProfilerActivity.CPU]
                with torch.profiler.profile(activities=activities) as prof:
                    for _ in range(5):
                        train()
                    torch.cuda.synchronize()
                print(f"--- host ops of {name}, 5 calls, checks off", file=sys.stderr)
                table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
                print(table, file=sys.stderr, flush=True)
        row["checks_ms"] = row["wall_ms"] - row["wall_unchecked_ms"]
        row["unhidden_host_ms"] = row["wall_unchecked_ms"] - row["kernel_ms"]
        rows.append(row)
        print(row, file=sys.stderr, flush=True)
    return rows


# Each form's fla kernel, q and k normalized the same way (the `_qk` / `_l2first` forms against
# fla normalizing in its call): the one of the same recurrence, but that GDN with unit keys
# given and the KDN forms go against `chunk_kda` (fla's GDN is timed here only normalizing,
# and the KDN recurrences generalize KDA's).
FLA_ANCHOR = {
    "kda": "fla_kda", "kda_product": "fla_kda", "gdn": "fla_kda", "kdn_iso": "fla_kda",
    "kdn_diag": "fla_kda",
    "gdn2": "fla_gdn2", "kda_qk": "fla_kda_qk", "kda_l2first": "fla_kda_qk",
    "gdn_qk": "fla_gdn_qk", "gdn_l2first": "fla_gdn_qk", "gdn2_l2first": "fla_gdn2_qk",
}  # fmt: skip


def add_ratios(rows):
    """Each row's forward and forward+backward times over fla's of the same form and shape."""
    by_case = {(r["shape"], r["case"]): r for r in rows}
    for r in rows:
        form = r["case"].rsplit("_", 1)[0]
        ref = by_case.get((r["shape"], FLA_ANCHOR.get(form, "")))
        sdpa = by_case.get((r["shape"], "sdpa"))
        r["vs_fla"] = r["train_ms"] / ref["train_ms"] if ref else math.nan
        r["fwd_vs_fla"] = r["fwd_ms"] / ref["fwd_ms"] if ref else math.nan
        r["vs_sdpa"] = r["train_ms"] / sdpa["train_ms"] if sdpa else math.nan
        r["fwd_tb_s"] = floor_bytes(r["shape"]) / (r["fwd_ms"] * 1e-3) / 1e12
    return rows


def floor_bytes(shape: str) -> int:
    """Bytes a forward pass cannot avoid moving: q, k, v and per-channel g read once, the output
    written once, all bf16 ([B, T, H, D] each; the per-head scalars are negligible). Over the
    forward time this is the achieved bandwidth to set against the GPU's peak (H200: 4.8 TB/s)."""
    batch, length, heads, dim = (int(n) for n in shape.split("x"))
    return 5 * batch * length * heads * dim * 2


def print_records(rows: list[dict]) -> None:
    """One table for rows with different keys (a blank where a row lacks a column)."""
    columns = list(dict.fromkeys(k for r in rows for k in r))
    print(format_table(columns, [[r.get(c, "") for c in columns] for r in rows]))


PARTS = ("check", "stability", "stages", "time", "overhead")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU, interpreter)")
    parser.add_argument(
        "--parts", nargs="+", choices=PARTS, default=["check", "stability", "stages", "time"]
    )
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--with-chunk-backend", action="store_true")
    parser.add_argument(
        "--only", nargs="+", default=None, help="time only cases with these prefixes"
    )
    parser.add_argument(
        "--shapes", nargs="+", type=parse_shape, default=None,
        help="timed shapes as BxTxHxD (default: 4x4096x16x128 1x32768x16x128)",
    )  # fmt: skip
    parser.add_argument(
        "--gmax", type=float, default=1.0,
        help="timed log decays uniform in [-gmax, 0]; 1 keeps every diagonal sub-block of the\n"
        "Triton stage 1 factored, 8 or more sends most to the walk, as trained gates do\n"
        "(python -m benchmarks profile diagonal)",
    )  # fmt: skip
    add_delta_rule_options(parser)  # --operator-dtype, --state-pass, --keep-states, ...


def run(args: argparse.Namespace) -> dict:
    options = delta_rule_options(args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.tiny:
        check_shape, stab_shape, shapes = (1, 40, 2, 16), (1, 300, 2, 16), [(1, 100, 2, 32)]
    else:
        check_shape, stab_shape = (2, 1000, 4, 64), (1, 4096, 4, 128)
        shapes = [(4, 4096, 16, 128), (1, 32768, 16, 128)]
    shapes = args.shapes or shapes
    result: dict = {"device": device}
    if "check" in args.parts:
        result["check"] = check(device, check_shape, args.chunk_sizes, options)
        print_records(result["check"])
    if "stability" in args.parts:
        result["stability"] = stability(
            device, stab_shape, [1.0, 8.0, 20.0], [64, 128, 256], options
        )
        print_records(result["stability"])
    if "stages" in args.parts:
        result["stages"] = [
            r for c in args.chunk_sizes for r in stages(device, shapes[0], c, options)
        ]
        print_records(result["stages"])
    if "time" in args.parts:
        rows = add_ratios(
            timings(
                device,
                shapes,
                args.chunk_sizes,
                3,
                args.with_chunk_backend,
                args.only,
                args.gmax,
                options,
            )
        )
        result["time"] = rows
        print_records(rows)
    if "overhead" in args.parts and device == "cuda":
        result["overhead"] = overhead(device, shapes[0], args.only, args.chunk_sizes[0], options)
        print_records(result["overhead"])
    result["kernel_options"] = options.to_dict()
    return result
