"""What the suites share: the JSON header, writing results, and the command-line helpers of the
backend comparisons and of the delta rule's switches."""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import platform
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from deltalab.benchmarking import phase_times

ROOT = Path(__file__).resolve().parents[1]


def machine() -> str:
    """The GPU's name when CUDA is there, else the processor's."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine() or "cpu"


def commit() -> dict[str, object]:
    """The checkout's commit and whether its tracked files differ from it (None outside git)."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    head = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if head else None
    return {"commit": head, "dirty": None if status is None else bool(status)}


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
    """The Triton delta rule's switches a training benchmark can set (`apply_delta_rule_options`):
    its state pass, whether its backward keeps the chunk-start states, the dtype of its chunk
    operators, whether it keeps or rebuilds its cheap inputs; and whether the layers
    project their input together (`deltalab.layers.projections.PROJECT_TOGETHER`)."""
    parser.add_argument(
        "--state-pass",
        choices=["auto", "fused", "split"],
        default=None,
        help="the Triton delta rule's state pass (triton/chunk.py STATE_PASS; default: its own)",
    )
    parser.add_argument(
        "--keep-states",
        action="store_true",
        help="the Triton delta rule keeps its chunk-start states and residuals for the backward "
        "instead of walking them again (triton/chunk.py RECOMPUTE_STATES off)",
    )
    parser.add_argument(
        "--operator-dtype",
        choices=["inputs", "float32"],
        default=None,
        help="the dtype the Triton delta rule stores its chunk operators in: the inputs' 16-bit "
        "dtype or float32 (triton/chunk.py OPERATOR_DTYPE; default: its own)",
    )
    parser.add_argument(
        "--walk-dots",
        choices=["float32", "operators"],
        default=None,
        help="the products of the Triton delta rule's walks with 16-bit operators: "
        "widened to float32 or in the operators' dtype (triton/chunk.py WALK_DOTS; default: "
        "its own)",
    )
    parser.add_argument(
        "--intra-dots",
        choices=["float32", "inputs"],
        default=None,
        help="the products of the Triton delta rule's stage 1 with 16-bit inputs: widened to "
        "float32 or in the inputs' dtype (triton/intra.py INTRA_DOTS; default: its own)",
    )
    parser.add_argument(
        "--keep-inputs",
        action="store_true",
        help="the delta rule keeps the inputs that cheap ops made (gate products, read query, "
        "log decay) instead of rebuilding them in the backward "
        "(deltalab/ops/_recompute.py REBUILD_IN_BACKWARD off)",
    )
    parser.add_argument(
        "--project-separately",
        action="store_true",
        help="each projection of a layer's input with its own gradient product and sum, as "
        "autograd makes them (deltalab.layers.projections.PROJECT_TOGETHER off)",
    )


def apply_delta_rule_options(args: argparse.Namespace) -> None:
    """Sets what `add_delta_rule_options` parsed (imports Triton only when something is set)."""
    from deltalab.layers import projections
    from deltalab.ops import _recompute

    projections.PROJECT_TOGETHER = not args.project_separately
    _recompute.REBUILD_IN_BACKWARD = not args.keep_inputs
    triton_switches = (args.state_pass, args.operator_dtype, args.walk_dots, args.intra_dots)
    if all(switch is None for switch in triton_switches) and not args.keep_states:
        return
    from deltalab.ops.delta_rule.triton import chunk, intra

    intra.INTRA_DOTS = args.intra_dots or intra.INTRA_DOTS

    chunk.STATE_PASS = args.state_pass or chunk.STATE_PASS
    chunk.RECOMPUTE_STATES = chunk.RECOMPUTE_STATES and not args.keep_states
    chunk.OPERATOR_DTYPE = args.operator_dtype or chunk.OPERATOR_DTYPE
    chunk.WALK_DOTS = args.walk_dots or chunk.WALK_DOTS
