"""The choices a user of the delta-rule kernels may need, in one frozen object.

`delta_rule`, the KDN ops, the layers and the model config (`DeltaLabConfig.kernel_options`)
take a `KernelOptions`; the defaults are the settings that measured best (docs/PERFORMANCE.md).
Launch tables (block sizes, warps, thresholds) are not options: each op keeps its own, private,
in one place.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

__all__ = ["DEFAULT_OPTIONS", "KernelOptions"]

_CHOICES = {
    "state_pass": ("auto", "fused", "split"),
    "operator_dtype": ("inputs", "float32"),
    "walk_dots": ("operators", "float32"),
}


@dataclass(frozen=True)
class KernelOptions:
    """Options of the Triton delta rule (the other backends ignore them).

    state_pass: how the chunk states are walked. "auto" (default) takes the fused walk when it
        fills the GPU and the split walk when the (sequence, head) programs are few; "fused" or
        "split" force one (benchmarks compare them).
    recompute_states: the backward walks the chunks again for the chunk-start states and
        residuals instead of keeping them from the forward (default True: ~12 KB less per token
        and layer at the 340M preset for a few percent of kernel time). False trades memory
        for speed when memory is plentiful.
    checkpoint_every: with recompute_states, the forward keeps every n-th chunk-start state
        and the backward walks the segments between them in parallel (default 8).
    operator_dtype: the dtype the chunk operators are stored in between kernels: "inputs"
        (default) their 16-bit dtype for bf16/fp16 inputs, halving the traffic; "float32" to
        keep them widened.
    walk_dots: the state walk's products in the operators' 16-bit dtype ("operators", default)
        or in float32 ("float32": for fp16 training with large loss scales, whose adjoints may
        not fit fp16's range).
    rebuild_in_backward: read by the layers, not by `delta_rule`: the cheap inputs of the delta
        rule and of the gated output norm (gate products, read query, log decay, a low-rank
        output gate; `deltalab.ops._recompute.rebuildable`) are made again in the backward
        instead of kept (default True, the same gradients bit for bit); False keeps them,
        trading memory for the rebuilds' time.
    """

    state_pass: Literal["auto", "fused", "split"] = "auto"
    recompute_states: bool = True
    checkpoint_every: int = 8
    operator_dtype: Literal["inputs", "float32"] = "inputs"
    walk_dots: Literal["operators", "float32"] = "operators"
    rebuild_in_backward: bool = True

    def __post_init__(self) -> None:
        for name, choices in _CHOICES.items():
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
        for name in ("recompute_states", "rebuild_in_backward"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        every = self.checkpoint_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"checkpoint_every must be a positive int, got {every!r}")

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> KernelOptions:
        """From a config mapping; unknown keys are refused by name."""
        values = dict(values or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown kernel option(s) {unknown}; known: {sorted(known)}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


DEFAULT_OPTIONS = KernelOptions()
