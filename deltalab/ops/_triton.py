"""Whether Triton kernels can run, and where.

Triton kernels run compiled on CUDA tensors, or under Triton's interpreter on CPU tensors when
`TRITON_INTERPRET=1` is set before deltalab is imported (that is how CI and reviewers without a
GPU run them). A machine without Triton still imports deltalab; asking for a Triton backend there
is an error that says why.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from dataclasses import dataclass

import torch

from deltalab.provenance import installed_version

HAS_TRITON = importlib.util.find_spec("triton") is not None

# The installed release, read from whichever distribution provides the module (PyPI's `triton` or
# PyTorch's `pytorch-triton*` builds) without importing it; None without Triton.
TRITON_VERSION = installed_version("triton") if HAS_TRITON else None
# The oldest release whose compiler builds every kernel: 3.2 and 3.3 fail on the state pass's
# 16-bit walks at 8 warps (README's "Triton versions"). Their interpreter runs the kernels.
OLDEST_COMPILING_TRITON = (3, 4)
# Read once: triton.jit decides at decoration time whether a kernel is compiled or interpreted.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# The oldest release whose grid-dependency instructions (`tl.extra.cuda.gdc_wait`,
# `gdc_launch_dependents`) compile: 3.4's take a keyword its own builtins no longer pass.
OLDEST_DEPENDENT_TRITON = (3, 5)


def _release(version: str | None) -> tuple[int, int] | None:
    """(major, minor) of a Triton version string, None where it has none."""
    parsed = re.match(r"(\d+)\.(\d+)", version or "")
    return None if parsed is None else (int(parsed[1]), int(parsed[2]))


def _has_dependent_launch(version: str | None) -> bool:
    """Whether Triton `version` compiles the grid-dependency instructions."""
    release = _release(version)
    return release is not None and release >= OLDEST_DEPENDENT_TRITON


# Whether the installed Triton has dependent launch (tests skip what it needs by this).
TRITON_HAS_DEPENDENT_LAUNCH = _has_dependent_launch(TRITON_VERSION)


# The oldest CUDA driver that captures dependent launches into a CUDA graph (programmatic
# dependency edges: CUDA 12.3), as cuDriverGetVersion reports it.
OLDEST_DEPENDENT_DRIVER = 12030


@functools.cache
def cuda_driver_version() -> int | None:
    """The CUDA driver's version (12030 for 12.3), None where no driver library loads."""
    import ctypes

    try:
        library = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    if library.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return version.value


@functools.cache
def _hopper_class(index: int) -> bool:
    """CUDA device `index` has compute capability 9.0 or later (read once a device)."""
    return torch.cuda.get_device_capability(index)[0] >= 9


def dependent_launch_unsupported_reason(
    device: torch.device,
    *,
    interpret: bool = INTERPRET,
    hip: str | None = torch.version.hip,
    triton_version: str | None = TRITON_VERSION,
    driver: int | None = -1,
) -> str | None:
    """None where kernels on `device` can be launched dependent (`dependent_launch`), else why
    not; the keywords default to this process's interpreter switch, ROCm build, Triton and CUDA
    driver (-1: `cuda_driver_version()`, read only for a CUDA device)."""
    oldest = ".".join(map(str, OLDEST_DEPENDENT_TRITON))
    if interpret:
        return "the interpreter (TRITON_INTERPRET=1) has no grid-dependency instructions"
    if device.type != "cuda" or hip is not None:
        return f"dependent launch is CUDA's, on NVIDIA GPUs; got {device}" + (
            f" (ROCm {hip})" if hip is not None else ""
        )
    if not _has_dependent_launch(triton_version):
        return f"dependent launch needs Triton {oldest} or later, got {triton_version}"
    driver = cuda_driver_version() if driver == -1 else driver
    if driver is None or driver < OLDEST_DEPENDENT_DRIVER:
        return f"dependent launch in CUDA graphs needs a CUDA 12.3 driver or later, got {driver}"
    index = torch.cuda.current_device() if device.index is None else device.index
    if not _hopper_class(index):
        return f"dependent launch needs compute capability 9.0 or later, {device} has less"
    return None


@functools.cache
def _unsupported_reason_here(device: torch.device) -> str | None:
    """`dependent_launch_unsupported_reason` in this process, once a device (every decoding
    launch asks)."""
    return dependent_launch_unsupported_reason(device)


def dependent_launch(
    device: torch.device, requested: bool | None = None, name: str = "dependent"
) -> bool:
    """Whether a kernel launched on `device` starts before the kernel ahead of it has finished
    (CUDA's programmatic dependent launch: compiled kernels on an NVIDIA GPU of compute
    capability 9.0 or later, Triton 3.5 or later, a CUDA 12.3 driver or later). A kernel
    launched so first waits (`gdc_wait`) for the kernel ahead to finish and its writes to
    show, and only then lets the next one start (`gdc_launch_dependents`) and touches memory.
    So at most the one kernel ahead is still running while a kernel starts, and every access
    comes after all of it:
    the results are those of launches one after another, and what overlaps is one kernel's
    tail with the next one's launch (docs/PERFORMANCE.md, "Fewer launches, overlapped").

    requested (the caller's argument `name`): None, wherever it is supported; True where it
    is not is an error naming it and why; False, never."""
    if requested is not None and not isinstance(requested, bool):
        raise TypeError(f"{name} must be a bool or None, got {requested!r}")
    if requested is False:
        return False
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    reason = _unsupported_reason_here(device)
    if requested and reason is not None:
        raise ValueError(f"{name}=True: {reason}")
    return reason is None


def opaque_to_compiler(fn):
    """fn, a function that launches Triton kernels, run as it is under `torch.compile`: Dynamo
    stops its graph at the call and resumes after it, and the compiler fuses the PyTorch code
    around the kernels (the glue between the norms, projections and the delta rule).

    Why not trace into them: the launches take sizes as compile-time constants (tile sizes,
    warps), which Dynamo sees as symbols once a shape is marked dynamic, and then fails on
    them; under `TRITON_INTERPRET=1` it traces into the interpreter itself and fails there.
    `deltalab train` with train.compile=true crashed on either before this (a 340M GDN-2 on the
    H200, and tests/test_compile.py on CPU). The kernels are compiled by Triton already: the
    graph break costs the kernels nothing, but every break hands control back to the host,
    and on the H200 a compiled 340M GDN-2 step took twice its kernel time in wall time, slower
    than eager (2026-12-02): registering the kernels as PyTorch custom ops is
    what would keep the graph whole."""
    return torch.compiler.disable(fn, recursive=True)


def compiler_too_old_reason(version: str | None) -> str | None:
    """None when Triton `version` (e.g. "3.4.0", "3.5.0+git1a2b") compiles every kernel, else a
    sentence naming it and the oldest release that does. None for an unreadable version."""
    release = _release(version)
    if release is None or release >= OLDEST_COMPILING_TRITON:
        return None
    oldest = ".".join(map(str, OLDEST_COMPILING_TRITON))
    return f"Triton {version} is installed; the compiled kernels need {oldest} or later"


def triton_unavailable_reason(
    device: torch.device, triton_version: str | None = TRITON_VERSION
) -> str | None:
    """None when a Triton kernel can run on `device`, else a sentence saying why not.
    `triton_version`: the installed release (the compiled kernels need OLDEST_COMPILING_TRITON)."""
    if not HAS_TRITON:
        return "Triton is not installed (pip install triton)"
    if device.type == "cuda":
        if INTERPRET:
            return "TRITON_INTERPRET=1 is set, which runs kernels on CPU tensors only"
        return compiler_too_old_reason(triton_version)
    if device.type == "cpu":
        if INTERPRET:
            return None
        return "CPU tensors need TRITON_INTERPRET=1 set before deltalab is imported"
    return f"Triton kernels run on CUDA (or on CPU under TRITON_INTERPRET=1), not on {device.type}"


def require_triton(name: str, device: torch.device) -> None:
    """Raises a RuntimeError naming the caller's backend argument when Triton cannot run."""
    reason = triton_unavailable_reason(device)
    if reason is not None:
        raise RuntimeError(f'{name}="triton" cannot run here: {reason}')


def triton_available(device: torch.device) -> bool:
    """True when `backend="auto"` should take a Triton kernel on `device` (compiled CUDA only)."""
    return device.type == "cuda" and triton_unavailable_reason(device) is None


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """t `[..., N]` as `[M, N]` rows for a row-wise kernel: unit column stride, and rows that do
    not overlap (a gradient written in the same layout must not write one element twice). A
    view when t allows one (e.g. a column slice of a wider projection), else a copy."""
    t2 = t.reshape(-1, t.shape[-1])
    rows, dim = t2.shape
    unit = t2.stride(1) == 1 or dim == 1
    apart = rows == 1 or t2.stride(0) >= dim
    return t2 if unit and apart else t2.contiguous()


def row_stride(t: torch.Tensor) -> int:
    """The stride between the rows of `as_rows`' result (its width when there is one row)."""
    return t.stride(0) if t.shape[0] > 1 else t.shape[1]


# The backends of the elementwise ops (norms, SwiGLU, RoPE, log decay, read gate).
ELEMENTWISE_BACKENDS = ("auto", "naive", "torch", "triton")


def elementwise_backend(backend: str, x: torch.Tensor) -> str:
    """The backend an elementwise op (ELEMENTWISE_BACKENDS) runs on for its input x: "auto" is
    "triton" on CUDA (compiled) for inputs other than float64, else "torch" (the kernels compute
    in float32: float64 references and gradient checks stay in PyTorch); "triton" must be able
    to run on x's device."""
    from deltalab.ops._checks import require_choice

    require_choice("backend", backend, ELEMENTWISE_BACKENDS)
    if backend == "auto":
        fits = x.dtype != torch.float64
        return "triton" if fits and triton_available(x.device) else "torch"
    if backend == "triton":
        require_triton("backend", x.device)
    return backend


def _power_of_2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def row_tiles(
    rows: int, width: int, elements: int, max_columns: int, per_thread: int, max_warps: int
) -> tuple[int, int, int]:
    """(BM rows, BN columns, warps) of a program of a row-wise kernel over M = `rows` rows of
    N = `width` columns: BN the power of 2 covering N (at most `max_columns`), BM = `elements`
    / BN rows (at least 1, at most the rows' power of 2), warps for `per_thread` elements a
    thread (1 to `max_warps`). The elementwise ops' kernels (norms, SwiGLU, log decay, read
    gate) all tile this way, each with its own sizes."""
    block_n = min(max_columns, _power_of_2_at_least(width))
    block_m = max(1, min(elements // block_n, _power_of_2_at_least(max(rows, 1))))
    warps = max(1, min(max_warps, block_m * block_n // (32 * per_thread)))
    return block_m, block_n, warps


@dataclass(frozen=True)
class RowLaunch:
    """The launch table of a row-wise kernel pair over `[M, N]` rows (`row_tiles`): per kernel
    ("forward", "backward") the elements a program holds and the elements a thread holds; the
    most warps, the widest column block (None: the power of 2 covering the whole row) and the
    most backward programs that each keep a partial sum (`spread_row_blocks`). Each
    elementwise op keeps one in its kernel module, private; its launch functions take another
    as an argument (tests reach at tiny shapes the tilings of large ones with small tables)."""

    forward_elements: int
    backward_elements: int
    forward_per_thread: int
    backward_per_thread: int
    max_warps: int
    max_columns: int | None = None
    backward_programs: int = 1024

    def tiles(self, rows: int, width: int, kernel: str) -> tuple[int, int, int]:
        """(BM rows, BN columns, warps) of a `kernel` ("forward" or "backward") program."""
        forward = kernel == "forward"
        elements = self.forward_elements if forward else self.backward_elements
        per_thread = self.forward_per_thread if forward else self.backward_per_thread
        columns = self.max_columns or _power_of_2_at_least(width)
        return row_tiles(rows, width, elements, columns, per_thread, self.max_warps)


def spread_row_blocks(rows: int, block_m: int, max_programs: int) -> tuple[int, int]:
    """(row blocks per program, programs) when the ceil(rows / block_m) row blocks of a backward
    with per-program partial sums are spread over at most `max_programs` programs."""
    n_blocks = -(-rows // block_m)
    per_program = -(-n_blocks // min(n_blocks, max_programs))
    return per_program, -(-n_blocks // per_program)
