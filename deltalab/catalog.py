"""What the command line lists and checks before torch loads: the mixer kinds, the model presets
with their training defaults, and every preset's shape and parameter count (`deltalab presets`).

The counts are stored in preset_table.json, written by
`deltalab.models.presets.write_preset_table()` from models built on the meta device; a test
builds them again and compares.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "MIXER_CLASSES",
    "MIXER_KINDS",
    "PRESETS",
    "PRESET_MIXERS",
    "PRESET_TRAINING",
    "RECURRENT_KINDS",
    "TrainingDefaults",
    "preset_mixers",
    "stored_preset_table",
]

# kind -> "module:Class" inside deltalab.layers; imported on use so a kind's module loads only
# when a model needs it (`deltalab.models.mixers`). The one list of mixer kinds: the recurrent
# ones, in this order, then softmax attention.
MIXER_CLASSES = {
    "deltanet": "deltanet:DeltaNet",
    "gdn": "deltanet:GatedDeltaNet",
    "kda": "kda:KimiDeltaAttention",
    "gdn2": "gdn2:GatedDeltaNet2",
    "kdn_iso": "kdn:IsotropicKDN",
    "kdn_diag": "kdn:DiagonalKDN",
    "kdn_exact": "kdn:ExactKDN",
    "muir": "muir:Muir",
    "kdn_muir": "kdn_muir:KDNMuir",
    "attention": "attention:Attention",
}
RECURRENT_KINDS = tuple(kind for kind in MIXER_CLASSES if kind != "attention")
MIXER_KINDS = ("transformer", *RECURRENT_KINDS)


@dataclass(frozen=True)
class TrainingDefaults:
    """The peak learning rate and warmup a preset trains with unless the run sets its own."""

    lr: float
    warmup_steps: int


# tiny: measured here; 3e-3 trains the CPU model in a few hundred steps.
# Scales: the GDN, Gated DeltaNet-2 and KDA papers train 340M at a peak of 1e-3 and 1.3B at 4e-4,
# warming up over about 1K steps (~0.5B tokens at 0.5M tokens a step). The others follow
# lr = 1e-3 * 1024 / hidden_size, the 1/width rule that gives both published points (1.3B, width
# 2304: 4.4e-4), rounded to one digit: 166M (width 1024) 1e-3, 750M (width 1536) 7e-4.
# Why it matters: a 340M Muir at tiny's 3e-3 went from held-out perplexity 309 to 449 in its
# first steps; at 1e-3 it fell to 5.9 in 40 steps.
PRESET_TRAINING = {
    "tiny": TrainingDefaults(lr=3e-3, warmup_steps=20),
    "166M": TrainingDefaults(lr=1e-3, warmup_steps=1000),
    "340M": TrainingDefaults(lr=1e-3, warmup_steps=1000),
    "750M": TrainingDefaults(lr=7e-4, warmup_steps=1000),
    "1.3B": TrainingDefaults(lr=4e-4, warmup_steps=1000),
    # The KDN authors' recipe: a peak of 4e-4, warmup over 1B tokens, 1907 steps of their
    # 128 x 4096-token batches (docs/MATH.md sec. 3.6).
    "kdn-authors-1.3B": TrainingDefaults(lr=4e-4, warmup_steps=1907),
}
# The named presets: tiny for CPU, the papers' scales (`deltalab.models.presets.SCALES`), then
# the KDN authors' 1.3B configuration.
PRESETS = tuple(PRESET_TRAINING)
# Presets made for some mixers only; the others take every mixer kind.
PRESET_MIXERS = {"kdn-authors-1.3B": ("kdn_iso", "kdn_diag")}


def preset_mixers(preset: str, mixers: tuple[str, ...]) -> tuple[str, ...]:
    """Those of `mixers` that `preset` can build, in their order."""
    allowed = PRESET_MIXERS.get(preset)
    return mixers if allowed is None else tuple(m for m in mixers if m in allowed)


PRESET_TABLE = Path(__file__).with_name("preset_table.json")


def stored_preset_table(mixers: tuple[str, ...] = MIXER_KINDS) -> list[list[object]]:
    """`deltalab.models.presets.preset_table(mixers)` as stored in preset_table.json."""
    rows = {tuple(row[:2]): row for row in json.loads(PRESET_TABLE.read_text(encoding="utf-8"))}
    return [rows[p, m] for p in PRESETS for m in preset_mixers(p, mixers)]
