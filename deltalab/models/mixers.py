"""Which layer class builds each mixer kind, from a `DeltaLabConfig`."""

from __future__ import annotations

import importlib

from torch import nn

from deltalab.models.config import DeltaLabConfig

__all__ = ["MIXER_CLASSES", "build_mixer"]

# kind -> "module:Class" inside deltalab.layers; imported on use so a kind's module loads only
# when a model needs it.
MIXER_CLASSES = {
    "deltanet": "deltanet:DeltaNet",
    "gdn": "deltanet:GatedDeltaNet",
    "kda": "kda:KimiDeltaAttention",
    "gdn2": "gdn2:GatedDeltaNet2",
    "muir": "muir:Muir",
    "kdn_iso": "kdn:IsotropicKDN",
    "kdn_diag": "kdn:DiagonalKDN",
    "kdn_exact": "kdn:ExactKDN",
    "attention": "attention:Attention",
}


def mixer_class(kind: str) -> type[nn.Module]:
    module, name = MIXER_CLASSES[kind].split(":")
    return getattr(importlib.import_module(f"deltalab.layers.{module}"), name)


def build_mixer(config: DeltaLabConfig, kind: str) -> nn.Module:
    """The mixer of one block: `kind` is "attention" or the config's recurrent kind."""
    common = dict(
        hidden_size=config.hidden_size,
        num_heads=config.num_heads,
        head_dim=config.head_dim,
        value_dim=config.value_dim,
    )
    if kind == "attention":
        return mixer_class(kind)(
            **common, window=config.attention_window, rope_base=config.rope_base
        )
    return mixer_class(kind)(
        **common,
        conv_size=config.conv_size,
        chunk_size=config.chunk_size,
        backend=config.backend,
        **config.mixer_options,
    )
