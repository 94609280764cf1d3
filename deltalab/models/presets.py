"""Named model presets: `tiny` for CPU, and the papers' scales for every mixer family.

`build_config("340M", mixer="muir", num_layers=2)` returns a `DeltaLabConfig`. Scale presets
fix width, depth and heads (head dim 128, vocab 32000, as in the GDN-2 and KDN papers); the
FFN width is solved so that the non-embedding parameter count (embeddings and LM head excluded,
as the papers count) matches the scale, except where a paper publishes it (GDN-2 1.3B: 6208).
Muir's FFN reinvests what its low-rank gates save, matching GDN-2's count at each scale;
KDN-Muir's matches the scale's target, and at tiny Diagonal KDN's count, the same way.
Parameter counts are taken on the meta device, so the big presets allocate nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from deltalab.catalog import (
    MIXER_KINDS,
    PRESET_TABLE,
    PRESET_TRAINING,
    PRESETS,
    TrainingDefaults,
    preset_mixers,
)
from deltalab.errors import closest
from deltalab.models.config import DeltaLabConfig

__all__ = [
    "PRESETS",
    "PRESET_TRAINING",
    "SCALES",
    "TrainingDefaults",
    "build_config",
    "count_parameters",
    "preset_table",
]

FFN_MULTIPLE = 32
PAPER_VOCAB = 32000
PAPER_HEAD_DIM = 128


@dataclass(frozen=True)
class Scale:
    """Shape of one scale: target non-embedding parameters, width, depth."""

    target: float
    hidden_size: int
    num_layers: int


# The scale presets: `PRESETS` (deltalab.catalog) after tiny.
SCALES = {
    "166M": Scale(166e6, 1024, 12),
    "340M": Scale(340e6, 1024, 24),
    "750M": Scale(750e6, 1536, 24),
    # GDN-2 and KDN 1.3B: 18 layers of width 2304 (docs/MATH.md sec. 4.3).
    "1.3B": Scale(1.3e9, 2304, 18),
}

TINY = dict(hidden_size=128, num_layers=6, num_heads=2, head_dim=64, vocab_size=259)
# The tiny FFN widths solved for a parameter count are multiples of 8 (the scales': 32).
TINY_FFN_MULTIPLE = 8
# Tiny presets whose FFN is solved to the parameter count of another mixer's tiny preset (Muir's
# is solved against GDN-2 by `muir_ffn_width`): KDN-Muir against its unfused twin, Diagonal KDN.
TINY_MATCHED = {"kdn_muir": "kdn_diag"}

# Published FFN widths: (scale, mixer) -> width.
PUBLISHED_FFN = {("1.3B", "gdn2"): 6208}

# The KDN authors' 1.3B models (their release's `iso_kdn_1.3B` and `diag_kdn_1.3B`): the 1.3B
# shape with their FFN widths, which give their non-embedding counts exactly, and their noise
# projections' zero initial biases (r = r_min + ln 2, q = ln 2 for a zero input). What deltalab
# cannot reproduce is listed in docs/MATH.md sec. 3.6.
KDN_AUTHORS = "kdn-authors-1.3B"
KDN_AUTHORS_FFN = {"kdn_iso": 7208, "kdn_diag": 7128}
KDN_AUTHORS_OPTIONS = {"r_bias": 0.0, "q_bias": 0.0}


def count_parameters(config: DeltaLabConfig, *, embeddings: bool = False) -> int:
    """Parameters of `CausalLM(config)`, built on the meta device; embeddings and LM head are
    left out unless `embeddings` (tied weights counted once)."""
    from deltalab.models.lm import CausalLM

    with torch.device("meta"):
        model = CausalLM(config)
    skip = set() if embeddings else {id(model.model.embed.weight), id(model.lm_head.weight)}
    unique = {id(p): p for p in model.parameters()}
    return sum(p.numel() for key, p in unique.items() if key not in skip)


def _heads(scale_name: str, mixer: str, hidden_size: int) -> int:
    # GDN-2 1.3B uses 16 heads of 128 (key width 2048 < 2304); KDN and the others fill the width.
    if scale_name == "1.3B" and mixer in ("gdn2", "muir", "gdn", "kda", "deltanet"):
        return 16
    return hidden_size // PAPER_HEAD_DIM


def _solve_ffn(fields: dict[str, Any], target: float, multiple: int = FFN_MULTIPLE) -> int:
    """The FFN width (a multiple of `multiple`) whose model is closest to `target`."""
    probe = DeltaLabConfig(**{**fields, "ffn_width": multiple})
    without_ffn = count_parameters(probe) - 3 * probe.hidden_size * multiple * probe.num_layers
    per_unit = 3 * probe.hidden_size * probe.num_layers
    width = round((target - without_ffn) / per_unit / multiple) * multiple
    if width <= 0:
        raise ValueError(f"the {fields['mixer']} mixer alone exceeds {target:.3g} parameters")
    return width


def _muir_ffn(fields: dict[str, Any], gdn2_ffn: int, multiple: int = FFN_MULTIPLE) -> int:
    """Reinvest what Muir's low-rank gates save: the FFN that matches GDN-2's parameter count."""
    from deltalab.layers.muir import muir_ffn_width

    return muir_ffn_width(
        fields["hidden_size"],
        fields["num_heads"],
        fields["head_dim"],
        gdn2_ffn,
        multiple_of=multiple,
    )


def _scale_fields(name: str, mixer: str) -> dict[str, Any]:
    scale = SCALES[name]
    fields: dict[str, Any] = dict(
        mixer=mixer,
        hidden_size=scale.hidden_size,
        num_layers=scale.num_layers,
        num_heads=_heads(name, mixer, scale.hidden_size),
        head_dim=PAPER_HEAD_DIM,
        vocab_size=PAPER_VOCAB,
        tie_word_embeddings=False,
    )
    if (name, mixer) in PUBLISHED_FFN:
        fields["ffn_width"] = PUBLISHED_FFN[(name, mixer)]
    elif mixer == "muir":
        fields["ffn_width"] = _muir_ffn(fields, _scale_fields(name, "gdn2")["ffn_width"])
    else:
        fields["ffn_width"] = _solve_ffn(fields, scale.target)
    return fields


def _kdn_authors_fields(mixer: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """The `kdn-authors-1.3B` fields; the run's mixer_options are merged over the preset's."""
    if mixer not in KDN_AUTHORS_FFN:
        raise ValueError(
            f"preset {KDN_AUTHORS!r} is made for the mixers {list(KDN_AUTHORS_FFN)}, got "
            f"mixer {mixer!r}"
        )
    fields = _scale_fields("1.3B", mixer)
    fields["ffn_width"] = KDN_AUTHORS_FFN[mixer]
    fields["mixer_options"] = {**KDN_AUTHORS_OPTIONS, **overrides.pop("mixer_options", {})}
    return fields


def build_config(preset: str, **overrides: Any) -> DeltaLabConfig:
    """The config of a named preset (`PRESETS`), with field overrides (e.g. `mixer="kdn_diag"`)."""
    if preset not in PRESETS:
        raise ValueError(
            f"preset must be one of {list(PRESETS)}, got {preset!r}{closest(str(preset), PRESETS)}"
        )
    mixer = overrides.pop("mixer", "gdn2")
    if mixer not in MIXER_KINDS:
        raise ValueError(
            f"mixer must be one of {list(MIXER_KINDS)}, got {mixer!r}{closest(str(mixer), MIXER_KINDS)}"
        )
    if preset == KDN_AUTHORS:
        fields = _kdn_authors_fields(mixer, overrides)
    elif preset == "tiny":
        fields = {**TINY, "mixer": mixer}
        if mixer == "muir":
            gdn2_ffn = DeltaLabConfig(**{**TINY, "mixer": "gdn2"}).ffn_width
            fields["ffn_width"] = _muir_ffn(fields, gdn2_ffn, multiple=TINY_FFN_MULTIPLE)
        elif mixer in TINY_MATCHED:
            # Reinvest what the fused gates save, as Muir does: the count of the unfused twin.
            twin = count_parameters(DeltaLabConfig(**{**TINY, "mixer": TINY_MATCHED[mixer]}))
            fields["ffn_width"] = _solve_ffn(fields, twin, multiple=TINY_FFN_MULTIPLE)
    else:
        fields = _scale_fields(preset, mixer)
    unknown = set(overrides) - set(DeltaLabConfig().to_dict()) - {"ffn_width", "value_dim"}
    for name in sorted(unknown):
        raise ValueError(
            f"unknown config field {name!r}{closest(name, list(DeltaLabConfig().to_dict()))}"
        )
    return DeltaLabConfig(**{**fields, **overrides})


def preset_table(mixers: tuple[str, ...] = MIXER_KINDS) -> list[list[object]]:
    """Rows: preset, mixer, width, layers, heads, FFN, non-embedding and total parameters, then
    the preset's peak learning rate and warmup steps (`PRESET_TRAINING`)."""
    rows = []
    for preset in PRESETS:
        for mixer in preset_mixers(preset, mixers):
            config = build_config(preset, mixer=mixer)
            rows.append(
                [
                    preset,
                    mixer,
                    config.hidden_size,
                    config.num_layers,
                    config.num_heads,
                    config.ffn_width,
                    count_parameters(config),
                    count_parameters(config, embeddings=True),
                    PRESET_TRAINING[preset].lr,
                    PRESET_TRAINING[preset].warmup_steps,
                ]
            )
    return rows


def write_preset_table() -> None:
    """Writes `preset_table()` of every mixer to the file `deltalab presets` reads."""
    rows = json.dumps(preset_table(), indent=None)
    PRESET_TABLE.write_text(rows.replace("], [", "],\n [") + "\n", encoding="utf-8")
