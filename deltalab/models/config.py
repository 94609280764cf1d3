"""The model configuration: a `transformers` config with typed, validated fields.

One config describes every model of the project: which mixer each block uses (a recurrent kind
everywhere, or softmax attention at the layers of a hybrid layout), the block sizes, the FFN, the
vocabulary. Options specific to one mixer go in `mixer_options` and reach its constructor as
keyword arguments (so an unknown option fails there, naming the field).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import PreTrainedConfig

from deltalab.catalog import MIXER_KINDS, RECURRENT_KINDS
from deltalab.errors import closest
from deltalab.ops._checks import require_choice, require_positive_int
from deltalab.ops.delta_rule import BACKENDS
from deltalab.ops.options import KernelOptions

__all__ = ["MIXER_KINDS", "RECURRENT_KINDS", "DeltaLabConfig", "closest"]


def _kernel_options(value: object) -> dict[str, Any]:
    """The config's kernel_options as the mapping it stores (what config.json holds): the
    fields that differ from `KernelOptions()`, whether given as a `KernelOptions` or as a
    mapping (validated by `KernelOptions.from_dict`; errors name the key)."""
    if isinstance(value, KernelOptions):
        options = value
    elif value is not None and not isinstance(value, dict):
        raise TypeError(f"kernel_options must be a dict, got {type(value).__name__}")
    else:
        try:
            options = KernelOptions.from_dict(value)
        except (TypeError, ValueError) as error:
            raise type(error)(f"kernel_options: {error}") from None
    defaults = KernelOptions().to_dict()
    return {name: v for name, v in options.to_dict().items() if v != defaults[name]}


class DeltaLabConfig(PreTrainedConfig):
    """Configuration of a deltalab causal language model.

    Args:
        mixer: the token mixer of every block: one of `MIXER_KINDS`.
        hidden_size, num_layers, num_heads, head_dim: model width, depth, heads and key dim K.
        value_dim: V per head (defaults to head_dim).
        ffn_width: SwiGLU hidden width (defaults to 8/3 hidden rounded up to a multiple of 64).
        vocab_size: rows of the embedding and of the LM head.
        norm_eps: epsilon of every RMSNorm. tie_word_embeddings: share embedding and LM head.
        initializer_range: std of the normal init of embeddings, FFN and LM head.
        conv_size, chunk_size: short-convolution kernel and chunk length of recurrent mixers.
        backend: `delta_rule` backend of the recurrent mixers: "auto" (Triton on CUDA, else the
            PyTorch chunk path), "chunk", "triton" or "naive"; set it to compare backends on
            one model. The blocks' norms, FFN gating and the attention blocks' RoPE follow it
            (`deltalab.ops.norms.layer_backend`: "chunk" and "naive" take their torch paths).
        attention_layers: indices of the blocks that use softmax attention instead of `mixer`.
        attention_every: alternatively, every n-th block (indices n-1, 2n-1, ...) uses attention.
        attention_window: sliding window of the attention blocks (None: full causal attention).
        rope_base: rotary base of the attention blocks.
        mixer_options: extra keyword arguments of the recurrent mixer (e.g. `read_gate` for Muir).
        kernel_options: the Triton delta rule's options for every recurrent mixer, a mapping of
            `deltalab.ops.options.KernelOptions` fields (e.g. {"walk_dots": "float32"} for fp16
            training with large loss scales); the ones left out keep their defaults.
    """

    model_type = "deltalab"

    def __init__(
        self,
        mixer: str = "gdn2",
        hidden_size: int = 256,
        num_layers: int = 4,
        num_heads: int = 4,
        head_dim: int = 64,
        value_dim: int | None = None,
        ffn_width: int | None = None,
        vocab_size: int = 259,
        norm_eps: float = 1e-5,
        tie_word_embeddings: bool = True,
        initializer_range: float = 0.02,
        conv_size: int = 4,
        chunk_size: int = 64,
        backend: str = "auto",
        attention_layers: list[int] | None = None,
        attention_every: int | None = None,
        attention_window: int | None = None,
        rope_base: float = 10000.0,
        mixer_options: dict[str, Any] | None = None,
        kernel_options: dict[str, Any] | KernelOptions | None = None,
        **kwargs: Any,
    ) -> None:
        if mixer not in MIXER_KINDS:
            raise ValueError(
                f"mixer must be one of {list(MIXER_KINDS)}, got {mixer!r}{closest(str(mixer), MIXER_KINDS)}"
            )
        self.mixer = mixer
        self.hidden_size = require_positive_int("hidden_size", hidden_size)
        self.num_layers = require_positive_int("num_layers", num_layers)
        self.num_heads = require_positive_int("num_heads", num_heads)
        self.head_dim = require_positive_int("head_dim", head_dim)
        self.value_dim = require_positive_int(
            "value_dim", head_dim if value_dim is None else value_dim
        )
        default_ffn = 64 * -(-8 * hidden_size // (3 * 64))
        self.ffn_width = require_positive_int(
            "ffn_width", default_ffn if ffn_width is None else ffn_width
        )
        self.vocab_size = require_positive_int("vocab_size", vocab_size)
        if not norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0, got {norm_eps}")
        self.norm_eps = float(norm_eps)
        if not initializer_range > 0:
            raise ValueError(f"initializer_range must be > 0, got {initializer_range}")
        self.initializer_range = float(initializer_range)
        self.conv_size = require_positive_int("conv_size", conv_size)
        self.chunk_size = require_positive_int("chunk_size", chunk_size)
        self.backend = require_choice("backend", backend, BACKENDS)
        if attention_layers is not None and attention_every is not None:
            raise ValueError("give attention_layers or attention_every, not both")
        if attention_every is not None:
            require_positive_int("attention_every", attention_every)
        for index in attention_layers or []:
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < num_layers:
                raise ValueError(
                    f"attention_layers holds {index!r}, outside the layers 0..{num_layers - 1}"
                )
        self.attention_layers = sorted(set(attention_layers)) if attention_layers else None
        self.attention_every = attention_every
        if attention_window is not None:
            require_positive_int("attention_window", attention_window)
        self.attention_window = attention_window
        if not rope_base > 1.0:
            raise ValueError(
                f"rope_base must be > 1 (base^(-i/(K/2)) must fall with i), got {rope_base}"
            )
        self.rope_base = float(rope_base)
        if mixer_options is not None and not isinstance(mixer_options, dict):
            raise TypeError(f"mixer_options must be a dict, got {type(mixer_options).__name__}")
        # Dataclass options (e.g. MuirRanks) are stored as plain mappings, so that the config
        # serializes to config.json and the mixer rebuilds them on load.
        self.mixer_options = {
            key: dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
            for key, value in (mixer_options or {}).items()
        }
        self.kernel_options = _kernel_options(kernel_options)
        # The byte tokenizer's specials (deltalab.data.ByteTokenizer) when the vocabulary has them.
        for name, byte_id in (("bos_token_id", 256), ("eos_token_id", 257), ("pad_token_id", 258)):
            kwargs.setdefault(name, byte_id if byte_id < vocab_size else None)
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    def attention_indices(self) -> list[int]:
        """Indices of the blocks that use softmax attention."""
        if self.mixer == "transformer":
            return list(range(self.num_layers))
        if self.attention_every is not None:
            n = self.attention_every
            return [i for i in range(self.num_layers) if (i + 1) % n == 0]
        return list(self.attention_layers or [])

    def layer_kinds(self) -> list[str]:
        """The mixer kind of every block: "attention" or the recurrent kind."""
        attention = set(self.attention_indices())
        return ["attention" if i in attention else self.mixer for i in range(self.num_layers)]
