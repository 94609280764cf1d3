"""Causal language models over every deltalab mixer, as `transformers` models."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from deltalab.models.cache import RecurrentCache
from deltalab.models.config import MIXER_KINDS, RECURRENT_KINDS, DeltaLabConfig
from deltalab.models.lm import CausalLM, DeltaLabModel
from deltalab.models.presets import PRESETS, build_config, count_parameters

__all__ = [
    "MIXER_KINDS",
    "PRESETS",
    "RECURRENT_KINDS",
    "CausalLM",
    "DeltaLabConfig",
    "DeltaLabModel",
    "RecurrentCache",
    "build_config",
    "count_parameters",
]

AutoConfig.register(DeltaLabConfig.model_type, DeltaLabConfig, exist_ok=True)
AutoModel.register(DeltaLabConfig, DeltaLabModel, exist_ok=True)
AutoModelForCausalLM.register(DeltaLabConfig, CausalLM, exist_ok=True)
