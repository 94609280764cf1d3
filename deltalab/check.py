"""`deltalab check`: the primitive's backends against each other on fresh random inputs.

For each decay kind and chunk size: the chunk backend against the token loop in float64 (outputs,
final states, gradients), float32 chunks against the float64 loop under strong decay, and the
forward time of both backends. On a CUDA GPU with Triton, the same for the Triton backend in
float32 (errors against the float64 loop, time against the chunk backend on the GPU). Returns a
non-zero exit code when any error exceeds its tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from deltalab.benchmarking import format_table, median_seconds
from deltalab.ops import delta_rule
from deltalab.ops._triton import triton_available, triton_unavailable_reason
from deltalab.testing import TOLERANCE, relative_error


@dataclass(frozen=True)
class CheckConfig:
    """Sizes of the self-check; the defaults finish in well under a minute on 2 CPU cores."""

    heads: int = 4
    key_dim: int = 32
    value_dim: int = 48
    accuracy_length: int = 300
    timing_length: int = 2048
    chunk_sizes: tuple[int, ...] = (16, 64, 256)
    strong_log_decay: float = -20.0
    seed: int = 0


def _inputs(config: CheckConfig, length: int, channel: bool, min_log_decay: float, generator):
    shape = (1, length, config.heads, config.key_dim)
    k = torch.nn.functional.normalize(
        torch.randn(shape, generator=generator, dtype=torch.float64), dim=-1
    )
    beta = torch.rand(*shape[:3], 1, generator=generator, dtype=torch.float64)
    q = torch.randn(shape, generator=generator, dtype=torch.float64)
    u = torch.randn(*shape[:3], config.value_dim, generator=generator, dtype=torch.float64)
    g_shape = shape if channel else shape[:3]
    g = torch.rand(g_shape, generator=generator, dtype=torch.float64) * min_log_decay
    return q, beta * k, k, u, g


def _gradients(inputs, **kwargs):
    leaves = [x.clone().requires_grad_() for x in inputs]
    o, _ = delta_rule(*leaves, **kwargs)
    o.square().sum().backward()
    return torch.cat([x.grad.flatten() for x in leaves])


class _Reference(NamedTuple):
    """Float64 inputs of one decay kind (`accurate`: g >= -1; `strong`: g >= strong_log_decay),
    float32 inputs for timing, and the token loop's outputs on the float64 ones."""

    accurate: tuple[torch.Tensor, ...]
    strong: tuple[torch.Tensor, ...]
    timed: list[torch.Tensor]
    o: torch.Tensor
    s: torch.Tensor
    grad: torch.Tensor
    o_strong: torch.Tensor


def _reference(config: CheckConfig, channel: bool, generator, device="cpu") -> _Reference:
    """`_Reference` of per-channel (`channel`) or per-head decay, the timing inputs on `device`."""
    accurate = _inputs(config, config.accuracy_length, channel, -1.0, generator)
    strong = _inputs(config, config.accuracy_length, channel, config.strong_log_decay, generator)
    timed = [
        x.float().to(device)
        for x in _inputs(config, config.timing_length, channel, -1.0, generator)
    ]
    o, s = delta_rule(*accurate, backend="naive", output_final_state=True)
    grad = _gradients(accurate, backend="naive")
    o_strong, _ = delta_rule(*strong, backend="naive")
    return _Reference(accurate, strong, timed, o, s, grad, o_strong)


def _errors(inputs, ref: _Reference, **kwargs) -> list[float]:
    """Relative errors of o, the final state and the gradients against the token loop's."""
    o, s = delta_rule(*inputs, output_final_state=True, **kwargs)
    return [
        relative_error(o, ref.o),
        relative_error(s, ref.s),
        relative_error(_gradients(inputs, **kwargs), ref.grad),
    ]


def run_check(config: CheckConfig = CheckConfig()) -> tuple[list[list[object]], bool]:
    """Returns the table rows and whether every error is within tolerance."""
    generator = torch.Generator().manual_seed(config.seed)
    rows, ok = [], True
    for channel in (False, True):
        decay = "channel" if channel else "head"
        ref = _reference(config, channel, generator)
        timed = ref.timed
        naive_time = median_seconds(lambda x=timed: delta_rule(*x, backend="naive"), repeats=3)
        for chunk in config.chunk_sizes:
            kwargs = dict(backend="chunk", chunk_size=chunk)
            errors64 = _errors(ref.accurate, ref, **kwargs)
            o32, _ = delta_rule(*(x.float() for x in ref.strong), **kwargs)
            error32 = relative_error(o32, ref.o_strong)
            ok &= max(errors64) <= TOLERANCE[torch.float64] and error32 <= TOLERANCE[torch.float32]
            chunk_time = median_seconds(lambda x=timed, k=kwargs: delta_rule(*x, **k), repeats=3)
            rows.append(
                [
                    decay,
                    chunk,
                    *errors64,
                    error32,
                    naive_time * 1e3,
                    chunk_time * 1e3,
                    naive_time / chunk_time,
                ]
            )
    return rows, ok


def run_triton_check(config: CheckConfig, device: torch.device) -> tuple[list[list[object]], bool]:
    """The Triton backend in float32 on `device` against the float64 loop on the CPU."""
    generator = torch.Generator().manual_seed(config.seed + 1)
    rows, ok = [], True
    for channel in (False, True):
        ref = _reference(config, channel, generator, device)
        timed = ref.timed
        on_device = [x.float().to(device) for x in ref.accurate]
        for chunk in (64, 128):
            kwargs = dict(backend="triton", chunk_size=chunk)
            strong = (x.float().to(device) for x in ref.strong)
            errors = [
                *_errors(on_device, ref, **kwargs),
                relative_error(delta_rule(*strong, **kwargs)[0], ref.o_strong),
            ]
            ok &= max(errors) <= TOLERANCE[torch.float32]
            chunk_time = median_seconds(
                lambda x=timed, c=chunk: delta_rule(*x, backend="chunk", chunk_size=c), repeats=3
            )
            triton_time = median_seconds(lambda x=timed, k=kwargs: delta_rule(*x, **k), repeats=3)
            rows.append(
                [
                    "channel" if channel else "head",
                    chunk,
                    *errors,
                    chunk_time * 1e3,
                    triton_time * 1e3,
                    chunk_time / triton_time,
                ]
            )
    return rows, ok


TRITON_HEADERS = [
    "decay",
    "chunk",
    "err o f32",
    "err S f32",
    "err grad f32",
    "err o f32 (g>=-20)",
    "chunk ms",
    "triton ms",
    "speedup",
]

HEADERS = [
    "decay",
    "chunk",
    "err o f64",
    "err S f64",
    "err grad f64",
    "err o f32 (g>=-20)",
    "naive ms",
    "chunk ms",
    "speedup",
]


def main(config: CheckConfig = CheckConfig()) -> int:
    print(
        f"delta_rule self-check: H={config.heads} K={config.key_dim} V={config.value_dim}; "
        f"errors at T={config.accuracy_length} vs the float64 token loop "
        f"(tolerances {TOLERANCE[torch.float64]:.0e} f64, {TOLERANCE[torch.float32]:.0e} f32); "
        f"float32 forward times at T={config.timing_length}, median of 3"
    )
    rows, ok = run_check(config)
    print(format_table(HEADERS, rows))
    device = torch.device("cuda") if torch.cuda.is_available() else None
    if device is not None and not triton_available(device):
        print(f"backend='triton' not checked: {triton_unavailable_reason(device)}")
    elif device is not None:
        print("backend='triton' on the GPU (float32, TF32 off) vs the float64 loop on the CPU:")
        torch.backends.cuda.matmul.allow_tf32 = False
        triton_rows, triton_ok = run_triton_check(config, device)
        print(format_table(TRITON_HEADERS, triton_rows))
        ok &= triton_ok
    print("all backends agree" if ok else "FAILED: an error exceeds its tolerance")
    return 0 if ok else 1
