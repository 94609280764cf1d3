"""The causal language model: embedding -> pre-norm blocks (mixer, SwiGLU) -> norm -> LM head.

    x = x + mixer(norm(x));   x = x + SwiGLU(norm(x))

`CausalLM` is a `transformers` model (`model_type = "deltalab"`): `save_pretrained`,
`from_pretrained` and `generate()` work as for any Hugging Face causal LM. Generation keeps a
`RecurrentCache`: per block the mixer's state (memory and short-conv buffers for recurrent
mixers, keys and values for attention), so a pure recurrent model decodes in constant memory.

Initialization: the embedding, both maps of every FFN and the LM head are drawn from
normal(0, `initializer_range`); the norms start at one and each mixer keeps its own
initialization (docs/MATH.md sec. 5).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from deltalab.layers.common import compute_dtype
from deltalab.layers.norms import RMSNorm
from deltalab.models.cache import RecurrentCache
from deltalab.models.config import DeltaLabConfig
from deltalab.models.mixers import build_mixer
from deltalab.models.prefill import PREFILL_SEGMENT, segments
from deltalab.ops._checks import one_host_read, values_checkable
from deltalab.ops._recompute import recomputed, without_rebuild
from deltalab.ops.lm_loss import linear_cross_entropy
from deltalab.ops.norms import layer_backend
from deltalab.ops.swiglu import swiglu

__all__ = ["Block", "CausalLM", "DeltaLabModel", "SwiGLU"]

# `CausalLM.generate`'s (static_decoding, prefill_segment) for the `_sample` it calls.
_STATIC_DECODING: contextvars.ContextVar[tuple[bool | None, int]] = contextvars.ContextVar(
    "deltalab_static_decoding", default=(None, PREFILL_SEGMENT)
)


class SwiGLU(nn.Module):
    """`x [..., D] -> down(silu(gate(x)) * up(x)) [..., D]`, hidden width `width`.

    The gating runs on `backend` (`deltalab.ops.swiglu`; the blocks pass the config's through
    `layer_backend`, as to their norms): "torch" keeps the projection for backward, not
    silu(gate) (activation checkpointing), "triton" one kernel each way, "auto" Triton on CUDA.
    """

    def __init__(self, hidden_size: int, width: int, backend: str = "auto") -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden_size, 2 * width, bias=False)
        self.down = nn.Linear(width, hidden_size, bias=False)
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(swiglu(self.gate_up(x), backend=self.backend))


class Block(nn.Module):
    """One pre-norm block around a token mixer."""

    def __init__(self, config: DeltaLabConfig, kind: str) -> None:
        super().__init__()
        self.kind = kind
        # The norms and the FFN's gating run on the config's backend: Triton on CUDA under
        # "auto", as the mixers.
        norm_backend = layer_backend(config.backend)
        self.mixer_norm = RMSNorm(config.hidden_size, eps=config.norm_eps, backend=norm_backend)
        self.mixer = build_mixer(config, kind)
        self.ffn_norm = RMSNorm(config.hidden_size, eps=config.norm_eps, backend=norm_backend)
        self.ffn = SwiGLU(config.hidden_size, config.ffn_width, backend=norm_backend)

    def forward(
        self,
        x: torch.Tensor,
        state: Any = None,
        mask: torch.Tensor | None = None,
        recompute_ffn: bool = False,
    ) -> tuple[torch.Tensor, Any]:
        """x `[B, T, D]`, the mixer's state, mask `[B, T]` (False at padding) -> (x, state).
        recompute_ffn: keep only the FFN branch's input (the residual stream, which its norm
        keeps anyway) and compute the branch again in the backward (`DeltaLabModel`)."""
        y, state = self.mixer(self.mixer_norm(x), state, mask=mask)
        x = x + y
        branch = recomputed(self.ffn_branch, x) if recompute_ffn else self.ffn_branch(x)
        return x + branch, state

    def ffn_branch(self, x: torch.Tensor) -> torch.Tensor:
        """The FFN's residual branch: ffn(ffn_norm(x))."""
        return self.ffn(self.ffn_norm(x))


def _umask() -> int:
    """The process's umask (read by setting it and setting it back: Python has no getter)."""
    import os

    current = os.umask(0o022)
    os.umask(current)
    return current


class DeltaLabPreTrainedModel(PreTrainedModel):
    config_class = DeltaLabConfig
    config: DeltaLabConfig
    base_model_prefix = "model"
    # transformers' embedding accessors find the token table by this name (`DeltaLabModel.embed`,
    # `CausalLM.model.embed`) and the output embeddings as `lm_head`.
    _input_embed_layer = "embed"
    _no_split_modules: ClassVar[list[str]] = ["Block"]
    main_input_name = "input_ids"

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # Generation state is a RecurrentCache built by the model, not a transformers KV cache.
        return False

    def save_pretrained(self, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        """`PreTrainedModel.save_pretrained`, then the weight files given the permissions of
        every other file the process writes: safetensors writes them 0600 whatever the umask,
        which keeps a shared run's model from its readers."""
        from pathlib import Path

        result = super().save_pretrained(save_directory, *args, **kwargs)
        mode = 0o666 & ~_umask()
        for path in Path(save_directory).glob("*.safetensors"):
            path.chmod(mode)
        return result

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """The model-level initialization: the embedding, both maps of every FFN and the LM head
        from normal(0, initializer_range). Everything else keeps what its constructor set:
        the mixers' own initializations (PyTorch's default on their linear maps and short
        convolutions, decay rates, zero-initialized gate projections, noise biases) and the
        norms' unit weights. `transformers.initialization`'s functions leave a tensor that
        `from_pretrained` loaded as it is."""
        std = self.config.initializer_range
        if isinstance(module, nn.Embedding):
            init.normal_(module.weight, std=std)
        elif isinstance(module, SwiGLU):
            init.normal_(module.gate_up.weight, std=std)
            init.normal_(module.down.weight, std=std)
        elif isinstance(module, CausalLM):
            init.normal_(module.lm_head.weight, std=std)

    def _initialize_weights(self, module: nn.Module, is_custom_code: bool = False) -> None:
        # Every module not yet initialized goes to `_init_weights`. For a model defined outside
        # the transformers package (`is_custom_code`), transformers 5.23 instead marks a module
        # initialized, without calling `_init_weights`, when each parameter of its own carries
        # the loaded flag: vacuously true of a module with no parameters of its own, as
        # `SwiGLU` and `CausalLM` (their weights are their child Linears'), which left the FFN
        # and an untied LM head at PyTorch's default init. That shortcut serves code that writes
        # weights in place; the functions `_init_weights` calls skip loaded tensors themselves.
        super()._initialize_weights(module)


class DeltaLabModel(DeltaLabPreTrainedModel):
    """Embedding and blocks: `input_ids [B, T] -> hidden states [B, T, D]`."""

    def __init__(self, config: DeltaLabConfig) -> None:
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config, kind) for kind in config.layer_kinds())
        self.norm = RMSNorm(
            config.hidden_size, eps=config.norm_eps, backend=layer_backend(config.backend)
        )
        # Set by the trainer: recompute each block in the backward pass instead of storing it
        # (`train.activation_checkpointing`), or only each block's FFN branch
        # (`train.recompute_ffn`). The FFN keeps the most per token of a block at the presets
        # (its two hidden activations and its norm's output: 16 of 53 KB per token at the
        # 340M GDN-2 preset, 21 of 41 KB at the Transformer's; benchmarks/memory_audit.py),
        # and computing it again costs its forward once more: 17% more of a block's matrix
        # products at the 340M GDN-2 preset, 23% at the Transformer's (its weights are 52% and
        # 70% of the block's; a product's forward is a third of its forward and backward), and
        # no delta rule.
        # Measured on an H200 (2026-12-02, docs/PERFORMANCE.md): the 340M GDN-2
        # preset's peak 25.7 -> 19.7 GiB at B=4 T=4096, 25.7 -> 19.8 at B=1 T=16384.
        self.checkpoint_blocks = False
        self.recompute_ffn = False
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: RecurrentCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            check_token_ids(input_ids, self.config.vocab_size)
            inputs_embeds = self.embed(input_ids)
        length = inputs_embeds.shape[1]
        mask = padding_mask(attention_mask, length)
        if use_cache and past_key_values is None:
            past_key_values = RecurrentCache(len(self.blocks))
        x = inputs_embeds
        # Without gradients (evaluation, transformers' decoding loop) the layers' value checks
        # read back to the host once, after the last block, not once or twice a layer: on a GPU
        # each read waits for the device (`one_host_read`). A failing check raises there, with
        # the cache's states already replaced. Training keeps the trainer's own block.
        with contextlib.nullcontext() if torch.is_grad_enabled() else one_host_read():
            x = self._blocks(x, mask, past_key_values)
        if past_key_values is not None:
            past_key_values.seen_tokens += length
        return BaseModelOutputWithPast(
            last_hidden_state=self.norm(x), past_key_values=past_key_values
        )

    def _blocks(
        self, x: torch.Tensor, mask: torch.Tensor | None, past_key_values: RecurrentCache | None
    ) -> torch.Tensor:
        """x through every block, each continuing (and leaving) its state in the cache."""
        for i, block in enumerate(self.blocks):
            state = None if past_key_values is None else past_key_values.states[i]
            if self.checkpoint_blocks and self.training and torch.is_grad_enabled():
                # The checkpoint keeps none of the block's tensors: nothing to rebuild inside.
                # A block draws no random numbers, so the RNG state is not saved around it
                # (host work, and a read of the generator that older torch refuses while a CUDA
                # graph records: train.cuda_graphs).
                x, state = torch.utils.checkpoint.checkpoint(
                    without_rebuild(block), x, state, mask, use_reentrant=False,
                    preserve_rng_state=False,
                )  # fmt: skip
            else:
                x, state = block(x, state, mask, self.recompute_ffn and self.training)
            if past_key_values is not None:
                past_key_values.states[i] = state
        return x


def check_token_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    if input_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise TypeError(f"input_ids must be an integer tensor, got dtype {input_ids.dtype}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must have shape [B, T], got {tuple(input_ids.shape)}")
    # Read back at once, not inside a `one_host_read` block: an id outside the table would
    # fault the embedding's lookup on a GPU. One read for valid ids; the range only on failure.
    # Not while a CUDA graph records (nothing may be read back): the trainer's replayed steps
    # check their windows on the host before copying them in (deltalab.train.graphs).
    if values_checkable(input_ids) and bool(((input_ids < 0) | (input_ids >= vocab_size)).any()):
        raise ValueError(
            f"input_ids must lie in [0, {vocab_size - 1}] (vocab_size {vocab_size}), got values "
            f"in [{int(input_ids.min())}, {int(input_ids.max())}]"
        )


def padding_mask(attention_mask: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """The last `length` columns of a `[B, S]` attention mask as bool, or None if all ones."""
    if attention_mask is None:
        return None
    mask = attention_mask[:, -length:].bool()
    return None if bool(mask.all()) else mask


class CausalLM(DeltaLabPreTrainedModel, GenerationMixin):
    """deltalab language model with an LM head; `forward` follows transformers' causal LMs."""

    _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.weight": "model.embed.weight"}

    def __init__(self, config: DeltaLabConfig) -> None:
        super().__init__(config)
        self.model = DeltaLabModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> Any:
        """As `PreTrainedModel.from_pretrained`, but a checkpoint whose weights do not match the
        config (missing, unexpected or reshaped tensors) is refused instead of half-loaded."""
        want_info = kwargs.pop("output_loading_info", False)
        # Reshaped tensors are reported below with the rest, instead of transformers' own error.
        kwargs.setdefault("ignore_mismatched_sizes", True)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        problems = {
            key: sorted(map(str, value))[:5]
            for key, value in info.items()
            if key in ("missing_keys", "unexpected_keys", "mismatched_keys") and value
        }
        if problems:
            raise ValueError(f"the checkpoint's weights do not match its config: {problems}")
        return (model, info) if want_info else model

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: RecurrentCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        *,
        shift_labels: torch.LongTensor | None = None,
        return_logits: bool = True,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """input_ids `[B, T]` -> logits `[B, T, vocab]` (float32, or float64 in a float64 model),
        loss when labels are given.

        labels `[B, T]` are shifted inside (position t predicts labels[t + 1]); -100 is ignored.
        shift_labels `[B, T]` instead: the targets already aligned with the positions (position
        t predicts shift_labels[t]), as transformers' loss functions take them; the trainer
        passes window[:, 1:] for input_ids window[:, :-1], so every position has a target.

        return_logits=False (with labels or shift_labels) asks for the loss only: logits is None
        and the loss comes from `deltalab.ops.lm_loss.linear_cross_entropy`, the LM head and the
        cross-entropy in chunks of tokens, so that no `[B, T, vocab]` tensor is made (the
        training path). The loss equals the default path's to rounding.
        """
        if labels is not None and shift_labels is not None:
            raise ValueError("give labels or shift_labels, not both")
        if not return_logits and labels is None and shift_labels is None:
            raise ValueError("return_logits=False needs labels or shift_labels: nothing to return")
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        targets = shift_labels
        if labels is not None:
            # Token t predicts label t + 1: the labels shift left and the last position is
            # ignored, rather than slicing the logits, whose float32 slice would be copied by
            # flatten and copied again by its backward (a full [B, T, vocab] each way).
            targets = F.pad(labels[:, 1:], (0, 1), value=-100)
        if targets is not None and logits_to_keep:
            targets = targets[:, -logits_to_keep:]
        if not return_logits:
            loss = linear_cross_entropy(
                hidden.flatten(0, 1), self.lm_head.weight, targets.flatten(), ignore_index=-100
            )
            return CausalLMOutputWithPast(
                loss=loss, logits=None, past_key_values=out.past_key_values
            )
        logits = self.lm_head(hidden)
        # At least float32 (bf16 logits under autocast are widened); a float64 model keeps them.
        logits = logits.to(compute_dtype(logits))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values)

    def generate(
        self,
        *args: Any,
        static_decoding: bool | None = None,
        prefill_segment: int = PREFILL_SEGMENT,
        **kwargs: Any,
    ) -> Any:
        """`GenerationMixin.generate`, with greedy and sampled decoding on the static-cache
        decoder where it serves the call (`deltalab.models.graph_generate`: a CUDA graph
        replayed per token on CUDA).

        static_decoding: None (default) uses it on CUDA and runs transformers' loop elsewhere
        and for what it cannot serve (one log line says why); True uses it on any device (an
        eager step off CUDA) and raises ValueError where it cannot serve the call; False
        always runs transformers' loop.

        prefill_segment: the static decoder reads the prompt in segments of this many tokens
        (`deltalab.models.prefill`; default 65536), so a prompt of a million tokens fits where
        one forward over it would not; transformers' loop reads it in one forward.
        """
        if static_decoding not in (None, True, False):
            raise TypeError(f"static_decoding must be None or a bool, got {static_decoding!r}")
        segments(1, prefill_segment)  # the check, before any work
        token = _STATIC_DECODING.set((static_decoding, prefill_segment))
        try:
            return super().generate(*args, **kwargs)
        finally:
            _STATIC_DECODING.reset(token)

    def _sample(
        self,
        input_ids: torch.LongTensor,
        logits_processor: Any,
        stopping_criteria: Any,
        generation_config: Any,
        synced_gpus: bool = False,
        streamer: Any = None,
        **model_kwargs: Any,
    ) -> Any:
        """transformers' greedy and sampling loop, or the static decoder (`generate`)."""
        from deltalab.models import graph_generate

        choice, segment = _STATIC_DECODING.get()
        on_cuda = self.device.type == "cuda"
        if choice is not False and (on_cuda or choice):
            plan = graph_generate.static_plan(
                logits_processor, stopping_criteria, generation_config, model_kwargs,
                streamer, synced_gpus,
            )  # fmt: skip
            if not isinstance(plan, str):
                return graph_generate.static_sample(
                    self, input_ids, plan, stopping_criteria, generation_config, model_kwargs,
                    cuda_graph=on_cuda, prefill_segment=segment,
                )  # fmt: skip
            if choice:
                raise ValueError(f"static_decoding=True cannot serve this call: {plan}")
            graph_generate.note_fallback(plan)
        return super()._sample(
            input_ids, logits_processor, stopping_criteria, generation_config,
            synced_gpus=synced_gpus, streamer=streamer, **model_kwargs,
        )  # fmt: skip

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        past_key_values: RecurrentCache | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = True,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """The prompt on the first call, then only the tokens the cache has not seen."""
        if past_key_values is not None and past_key_values.seen_tokens > 0:
            input_ids = input_ids[:, past_key_values.seen_tokens :]
            inputs_embeds = None
        inputs: dict[str, Any] = dict(
            past_key_values=past_key_values, attention_mask=attention_mask, use_cache=use_cache
        )
        if inputs_embeds is not None:
            inputs["inputs_embeds"] = inputs_embeds
        else:
            inputs["input_ids"] = input_ids
        return inputs
