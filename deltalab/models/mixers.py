"""Which layer class builds each mixer kind, from a `DeltaLabConfig`."""

from __future__ import annotations

import importlib
import inspect
from typing import TYPE_CHECKING, Any

from torch import nn

from deltalab.catalog import MIXER_CLASSES
from deltalab.layers.frontend import FRONTEND_FIELDS, FrontendOptions
from deltalab.ops.norms import layer_backend
from deltalab.ops.options import KernelOptions

if TYPE_CHECKING:
    from deltalab.models.config import DeltaLabConfig

__all__ = ["MIXER_CLASSES", "build_mixer", "mixer_option_names"]

# The frontend options that are the config's own fields (the rest may come in mixer_options).
CONFIG_FRONTEND_FIELDS = (
    "hidden_size",
    "num_heads",
    "head_dim",
    "value_dim",
    "conv_size",
    "chunk_size",
    "backend",
    "kernel_options",
)


def mixer_class(kind: str) -> type[nn.Module]:
    module, name = MIXER_CLASSES[kind].split(":")
    return getattr(importlib.import_module(f"deltalab.layers.{module}"), name)


def frontend_options(config: DeltaLabConfig) -> tuple[FrontendOptions, dict[str, Any]]:
    """The recurrent mixers' `FrontendOptions` from the config, and the rest of
    `config.mixer_options` (the mixer's own keyword arguments).

    The sizes, conv_size, chunk_size, backend and kernel_options are config fields (the last a
    mapping there, a `KernelOptions` here); the other frontend options
    (gate_activation, norm_eps) may come in `mixer_options`, which must not repeat a field.
    """
    own = dict(config.mixer_options)
    shared = {name: own.pop(name) for name in FRONTEND_FIELDS if name in own}
    fields = {name: getattr(config, name) for name in CONFIG_FRONTEND_FIELDS}
    fields["kernel_options"] = KernelOptions.from_dict(config.kernel_options)
    for name in sorted(set(shared) & set(fields)):
        raise ValueError(f"mixer_options.{name} repeats the config field {name}; set it there")
    return FrontendOptions(**fields, **shared), own


def mixer_option_names(kind: str) -> list[str]:
    """What `mixer_options` may hold for a recurrent `kind`: its class's own keyword arguments
    and the frontend options that are not config fields."""
    cls = mixer_class(kind)
    parameters = inspect.signature(cls.__init__).parameters.values()
    own = {p.name for p in parameters if p.kind == p.KEYWORD_ONLY}
    # Variants sharing one constructor (the KDN family) name what they refuse of it.
    own -= getattr(cls, "refused_options", frozenset)()
    return sorted(own | (set(FRONTEND_FIELDS) - set(CONFIG_FRONTEND_FIELDS)))


def build_mixer(config: DeltaLabConfig, kind: str) -> nn.Module:
    """The mixer of one block: `kind` is "attention" or the config's recurrent kind."""
    if kind == "attention":
        return mixer_class(kind)(
            hidden_size=config.hidden_size,
            num_heads=config.num_heads,
            head_dim=config.head_dim,
            value_dim=config.value_dim,
            window=config.attention_window,
            rope_base=config.rope_base,
            # RoPE on the config's backend, as the blocks' norms and FFN (Triton under "auto").
            backend=layer_backend(config.backend),
        )
    options, own = frontend_options(config)
    return mixer_class(kind)(options, **own)
