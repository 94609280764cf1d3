"""What the suites share: the JSON header, writing results, and the command-line helpers of the
backend comparisons and of the kernels' options (`KernelOptions`)."""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import platform
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from deltalab.benchmarking import phase_times
from deltalab.ops.options import DEFAULT_OPTIONS, KernelOptions
from deltalab.provenance import code_version

ROOT = Path(__file__).resolve().parents[1]


def machine() -> str:
    """The GPU's name when CUDA is there, else the processor's."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine() or "cpu"


def commit() -> dict[str, object]:
    """The commit of the code (a checkout's, or one `git archive` stamped) and whether the
    checkout's tracked files differ from it (None for an archive; both None for an install)."""
    code = code_version()
    return {"commit": code.get("commit"), "dirty": code.get("dirty")}


def header(argv: Sequence[str]) -> dict[str, object]:
    """What every suite's JSON starts with: the machine, torch and Triton versions, the commit,
    the date (UTC) and the command line."""
    triton = None
    if importlib.util.find_spec("triton") is not None:
        import triton as triton_module

        triton = triton_module.__version__
    return {
        "machine": machine(),
        "torch": torch.__version__,
        "triton": triton,
        **commit(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python -m benchmarks", *argv]),
    }


def save(args: argparse.Namespace, results: dict) -> None:
    """Writes `results` under the run's header to `args.json`. Suites call it after each case,
    so that a run stopped part-way keeps what it measured."""
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"header": args.header, **results}, indent=1) + "\n")


def add_case_arguments(parser: argparse.ArgumentParser, option: str, cases: Sequence[str]) -> None:
    """The options of a backend comparison: --tiny (tiny shapes, float32, on CPU: a run under
    the Triton interpreter), --repeats (CPU only) and `option` choosing among `cases`, all by
    default."""
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (interpreter smoke run)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs (CPU only)")
    parser.add_argument(option, nargs="+", default=list(cases), choices=list(cases))


def add_model_arguments(parser: argparse.ArgumentParser, mixers: Sequence[str]) -> None:
    """The options of a whole-model suite: --tiny (the tiny preset on CPU: a smoke run),
    --preset (default 340M) and --mixers (default `mixers`)."""
    parser.add_argument("--tiny", action="store_true", help="tiny preset on CPU (smoke run)")
    parser.add_argument("--preset", default="340M", help="model preset (default 340M)")
    parser.add_argument("--mixers", nargs="+", default=list(mixers))


def case_device(args: argparse.Namespace) -> tuple[str, int]:
    """CUDA unless --tiny or none is there; the repeats (1 with --tiny, else 10 unless given)."""
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    return device, args.repeats or (1 if args.tiny else 10)


def run_cases(
    args: argparse.Namespace,
    names: Sequence[str],
    measure: Callable[[str, str, int], dict],
    show: Callable[[dict], None],
) -> dict:
    """`measure(name, device, repeats)` for each case name, then `show` it; the results are
    saved after every case."""
    device, repeats = case_device(args)
    results: list[dict] = []
    for name in names:
        results.append(measure(name, device, repeats))
        show(results[-1])
        save(args, {"device": device, "cases": results})
    return {"device": device, "cases": results}


def time_backends(
    backends: Sequence[str],
    forward: Callable[[str], object],
    with_grads: Callable[[str], list[torch.Tensor]],
    reference: list[torch.Tensor],
    names: Sequence[str],
    device: str,
    repeats: int,
) -> dict:
    """Per backend: the median ms of `forward(backend)` without autograd and of
    `with_grads(backend)` (the outputs and their gradients; `phase_times`, with the kernels'
    own time on CUDA), and the relative error of each of with_grads' tensors against
    `reference` (float64), by `names`."""
    from deltalab.testing import relative_error

    result = {}
    for backend in backends:

        def run_forward(backend=backend) -> None:
            with torch.no_grad():
                forward(backend)

        got = with_grads(backend)
        result[backend] = {
            **phase_times(
                run_forward, lambda backend=backend: with_grads(backend), device, repeats
            ),
            "errors": {
                n: relative_error(a, e) for n, a, e in zip(names, got, reference, strict=True)
            },
        }
    return result


def forward_and_train_seconds(
    fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], repeats: int
) -> tuple[float, float]:
    """Median seconds of `fn(*inputs)` without autograd, and of `fn(*inputs).sum().backward()`
    with every input a fresh leaf."""
    from deltalab.benchmarking import median_seconds

    def forward() -> None:
        with torch.no_grad():
            fn(*inputs)

    leaves = [x.clone().requires_grad_() for x in inputs]

    def train() -> None:
        fn(*leaves).sum().backward()

    return median_seconds(forward, repeats), median_seconds(train, repeats)


def backward_fresh(out: torch.Tensor, d_out: torch.Tensor, leaves: Sequence[torch.Tensor]) -> None:
    """`out.backward(d_out)` into fresh `.grad` tensors: the leaves' gradients from an earlier
    call are dropped first, so that a timed loop of forward+backward calls does not also time
    autograd's accumulation into `.grad` (an add over every leaf each call), which the
    activations of a training step do not have."""
    for leaf in leaves:
        leaf.grad = None
    out.backward(d_out)


def parse_shape(text: str) -> tuple[int, int, int, int]:
    """argparse type: a shape BxTxHxK of four positive integers."""
    parts = text.split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected BxTxHxK of positive integers, got {text!r}")
    return tuple(int(p) for p in parts)  # type: ignore[return-value]


def add_delta_rule_options(parser: argparse.ArgumentParser) -> None:
    """The `KernelOptions` a suite can set from its command line (`delta_rule_options`):
    the Triton delta rule's state pass, whether its backward walks the chunk-start states again,
    the dtype of its chunk operators and of its walks' products, whether the layers rebuild
    the delta rule's cheap inputs in the backward."""
    parser.add_argument(
        "--state-pass",
        choices=["auto", "fused", "split"],
        default="auto",
        help="the Triton delta rule's state pass (KernelOptions.state_pass)",
    )
    parser.add_argument(
        "--keep-states",
        action="store_true",
        help="the Triton delta rule keeps its chunk-start states and residuals for the backward "
        "instead of walking them again (KernelOptions.recompute_states off)",
    )
    parser.add_argument(
        "--operator-dtype",
        choices=["inputs", "float32"],
        default="inputs",
        help="the dtype the Triton delta rule stores its chunk operators in: the inputs' 16-bit "
        "dtype or float32 (KernelOptions.operator_dtype)",
    )
    parser.add_argument(
        "--walk-dots",
        choices=["operators", "float32"],
        default="operators",
        help="the products of the Triton delta rule's walks with 16-bit operators: in the "
        "operators' dtype or widened to float32 (KernelOptions.walk_dots)",
    )
    parser.add_argument(
        "--keep-inputs",
        action="store_true",
        help="the delta rule keeps the inputs that cheap ops made (gate products, read query, "
        "log decay) instead of rebuilding them in the backward "
        "(KernelOptions.rebuild_in_backward off)",
    )


def delta_rule_options(args: argparse.Namespace) -> KernelOptions:
    """The `KernelOptions` that `add_delta_rule_options` parsed."""
    return KernelOptions(
        state_pass=args.state_pass,
        recompute_states=not args.keep_states,
        operator_dtype=args.operator_dtype,
        walk_dots=args.walk_dots,
        rebuild_in_backward=not args.keep_inputs,
    )


def changed_options(options: KernelOptions) -> dict[str, object]:
    """The fields of `options` that differ from the defaults (what a config needs to hold)."""
    return {k: v for k, v in options.to_dict().items() if v != DEFAULT_OPTIONS.to_dict()[k]}
