"""The options of the delta-rule frontend (`FrontendOptions`), which every `DeltaMixer` takes
as `options=` or as the same plain keywords (`FrontendKeywords`, resolved by
`frontend_options`)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypedDict

from deltalab.errors import closest
from deltalab.layers.norms import GATE_ACTIVATIONS
from deltalab.ops._checks import require_choice, require_positive_int
from deltalab.ops.delta_rule import BACKENDS, require_chunk_size
from deltalab.ops.options import DEFAULT_OPTIONS, KernelOptions

__all__ = ["FrontendKeywords", "FrontendOptions", "frontend_options"]


@dataclass(frozen=True, kw_only=True)
class FrontendOptions:
    """The options of the delta-rule frontend that every `DeltaMixer` shares (see `DeltaMixer`).

    hidden_size: D. num_heads: H. head_dim: K. value_dim: V (None: K).
    conv_size: kernel of the short convolutions. chunk_size: tokens per chunk, 16..256.
    backend: `delta_rule`'s backend for whole sequences ("auto", "naive", "chunk", "triton"),
        which the short convolutions follow (`short_conv_backend`).
    gate_activation: "sigmoid" or "silu" on the output gate, None for the mixer's default.
    norm_eps: of the output RMSNorm.
    kernel_options: the `KernelOptions` of the Triton delta rule (and of the rebuilding of its
        cheap inputs in the backward, `rebuild_in_backward`); the defaults measured best.
    """

    hidden_size: int
    num_heads: int
    head_dim: int
    value_dim: int | None = None
    conv_size: int = 4
    chunk_size: int = 64
    backend: str = "auto"
    gate_activation: str | None = None
    norm_eps: float = 1e-5
    kernel_options: KernelOptions = DEFAULT_OPTIONS

    def __post_init__(self) -> None:
        require_positive_int("hidden_size", self.hidden_size)
        require_positive_int("num_heads", self.num_heads)
        require_positive_int("head_dim", self.head_dim)
        value_dim = self.head_dim if self.value_dim is None else self.value_dim
        # Frozen: the resolved V is written once here, so every reader sees an int.
        object.__setattr__(self, "value_dim", require_positive_int("value_dim", value_dim))
        require_positive_int("conv_size", self.conv_size)
        require_chunk_size(self.chunk_size)
        require_choice("backend", self.backend, BACKENDS)
        if self.gate_activation is not None:
            require_choice("gate_activation", self.gate_activation, GATE_ACTIVATIONS)
        if not isinstance(self.kernel_options, KernelOptions):
            raise TypeError(
                "kernel_options must be a deltalab.ops.options.KernelOptions, got "
                f"{type(self.kernel_options).__name__}"
            )


class FrontendKeywords(TypedDict, total=False):
    """`FrontendOptions` as keyword arguments of a mixer: type checkers see every keyword."""

    hidden_size: int
    num_heads: int
    head_dim: int
    value_dim: int | None
    conv_size: int
    chunk_size: int
    backend: str
    gate_activation: str | None
    norm_eps: float
    kernel_options: KernelOptions


FRONTEND_FIELDS = tuple(f.name for f in dataclasses.fields(FrontendOptions))


def frontend_options(
    options: FrontendOptions | None, keywords: Mapping[str, object], mixer: type
) -> FrontendOptions:
    """The frontend options of a `mixer` constructed with `options` or with the plain
    frontend `keywords` (the rest of its keyword arguments), not both.

    A keyword that is neither a frontend option nor one of the mixer's own arguments is refused
    by name, with the closest valid one: the keywords arrive through `**`, so Python no longer
    does that.
    """
    unknown = sorted(set(keywords) - set(FRONTEND_FIELDS))
    if unknown:
        parameters = inspect.signature(mixer.__init__).parameters.values()
        own = [p.name for p in parameters if p.kind == p.KEYWORD_ONLY]
        valid = [*FRONTEND_FIELDS, *own]
        raise TypeError(
            f"{mixer.__name__} got an unexpected keyword argument {unknown[0]!r}"
            f"{closest(unknown[0], valid)}"
        )
    if options is None:
        return FrontendOptions(**keywords)  # type: ignore[arg-type]
    if not isinstance(options, FrontendOptions):
        raise TypeError(f"options must be a FrontendOptions or None, got {type(options).__name__}")
    if keywords:
        raise TypeError(
            f"{mixer.__name__} takes options or the frontend keywords, not both: got options "
            f"and {sorted(keywords)}"
        )
    return options
