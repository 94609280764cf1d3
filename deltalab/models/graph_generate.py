"""`CausalLM.generate` on the static-cache decoder (`deltalab.models.static_decode`).

transformers' greedy and sampling loop (`GenerationMixin._sample`) runs every layer's Python
code for every token; on a GPU that host time, not the device, sets the cost of a token (30-40
times the replayed graph's at batch 1 for the 340M presets). `CausalLM._sample` hands the
decoding to `static_sample` here when `static_plan` finds that the decoder serves the call:

- the logits processors are only temperature and top-k (what `StaticDecoder._choose` applies,
  in the same order), so greedy decoding gives the loop's tokens and sampling draws from the
  same distribution (with its own use of the random generator);
- the stopping criteria are called on the host with the ids the loop would pass them, token by
  token, after the device has produced a chunk of tokens (`CHECK_EVERY`); a row they finish
  gets the pad token from then on when an end token is among them, as in the loop. Criteria
  that read the clock (`MaxTimeCriteria`) cannot be replayed so and are refused;
- no streamer, no per-step outputs (`return_dict_in_generate`), no cache or embeddings passed
  in, a cache in use (`use_cache`), no synced GPUs, no assistant.

Anything else runs transformers' loop, with one log line naming the reason (on CUDA, where the
graph was expected). The decoder, its buffers and its captured graph are kept on the model per
(batch, dtype) and reused by the next call of that batch size whose settings and lengths fit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper
from transformers.generation.stopping_criteria import MaxTimeCriteria

from deltalab.models.prefill import PREFILL_SEGMENT, prefill
from deltalab.models.static_decode import StaticDecoder

__all__ = [
    "CHECK_EVERY",
    "DecoderCache",
    "StaticPlan",
    "kept_decoder",
    "note_fallback",
    "static_plan",
    "static_sample",
]

logger = logging.getLogger(__name__)

# Tokens produced on the device between two host looks at the stopping criteria (each look
# waits for the device, and a stopped row's last chunk is decoded for nothing).
CHECK_EVERY = 16
# The attention buffers' length is a multiple of this (`DecoderCache`).
LENGTH_STEP = 256
# Decoders a model keeps (each holds its buffers, graph and weight copies on the device).
KEPT_DECODERS = 4


# The fallback reasons logged so far: each is logged once per process.
_LOGGED: set[str] = set()


def note_fallback(reason: str) -> None:
    """One warning line per reason: generate runs transformers' loop on CUDA."""
    if reason not in _LOGGED:
        _LOGGED.add(reason)
        logger.warning("generate runs transformers' loop, not the CUDA graph: %s", reason)


@dataclass(frozen=True)
class StaticPlan:
    """What the decoder is built for: temperature 0 for greedy decoding; top_k None for all."""

    temperature: float
    top_k: int | None


def static_plan(
    logits_processor: Any,
    stopping_criteria: Any,
    generation_config: Any,
    model_kwargs: dict[str, Any],
    streamer: Any,
    synced_gpus: bool,
) -> StaticPlan | str:
    """The decoder's settings for a `_sample` call, or why the decoder cannot serve it."""
    if streamer is not None:
        return "a streamer is given"
    if synced_gpus:
        return "synced_gpus is set"
    if generation_config.return_dict_in_generate:
        return "return_dict_in_generate asks for per-step outputs"
    if getattr(generation_config, "is_assistant", False):
        return "the model is an assistant"
    if not model_kwargs.get("use_cache", True):
        return "use_cache is off"
    for name in ("past_key_values", "inputs_embeds"):
        if model_kwargs.get(name) is not None:
            return f"{name} is given"
    if any(isinstance(c, MaxTimeCriteria) for c in stopping_criteria):
        return "a MaxTimeCriteria reads the clock"
    temperature, top_k = 1.0, None
    for processor in logits_processor:
        if isinstance(processor, TemperatureLogitsWarper) and top_k is None:
            temperature = float(processor.temperature)
        elif isinstance(processor, TopKLogitsWarper) and top_k is None:
            top_k = int(processor.top_k)
        else:
            return f"the logits processor {type(processor).__name__}"
    if not generation_config.do_sample:
        return StaticPlan(0.0, None)
    return StaticPlan(temperature, top_k)


class DecoderCache:
    """`StaticDecoder`s by (batch, dtype, device), one each (the newest built), at most
    `KEPT_DECODERS` of them (the least recently built is dropped first). One is reused
    when the plan is the same, its room and max_length fit, and the model's parameters are the
    tensors it was built on, unchanged since."""

    def __init__(self) -> None:
        self.decoders: dict[tuple, tuple[StaticPlan, tuple[int, ...], StaticDecoder]] = {}

    def get(
        self, model: Any, cache: Any, plan: StaticPlan, new_tokens: int, cuda_graph: bool
    ) -> StaticDecoder:
        batch = cache.tensors()[0].shape[0]
        key = (batch, model.dtype, model.device)
        # The parameters' addresses and versions: the captured step reads them where they were
        # and holds copies of the projection weights (`concatenated_weights`), so a model moved,
        # cast or trained since needs a new decoder.
        weights = tuple((p.data_ptr(), p._version) for p in model.parameters())
        kept = self.decoders.get(key)
        if kept is not None:
            kept_plan, kept_weights, decoder = kept
            fits = decoder.room >= new_tokens and cache.seen_tokens + decoder.room <= (
                decoder.max_length
            )
            if kept_plan == plan and kept_weights == weights and fits:
                decoder.load(cache)
                return decoder
        # The largest room asked so far, and attention buffers rounded up to a whole number of
        # `LENGTH_STEP` positions: a later call a little longer is served again, and an
        # attention step reads at most that many unused slots.
        room = max(new_tokens, kept[2].room if kept else 0)
        needed = cache.seen_tokens + room
        # The old decoder's buffers are let go before the new ones are allocated.
        kept = decoder = None
        self.decoders.pop(key, None)
        decoder = StaticDecoder(
            model,
            cache,
            room,
            temperature=plan.temperature,
            top_k=plan.top_k,
            cuda_graph=cuda_graph,
            max_length=-(-needed // LENGTH_STEP) * LENGTH_STEP,
        )
        self.decoders[key] = (plan, weights, decoder)
        while len(self.decoders) > KEPT_DECODERS:  # the least recently built goes
            del self.decoders[next(iter(self.decoders))]
        return decoder


def kept_decoder(
    model: Any, cache: Any, plan: StaticPlan, new_tokens: int, cuda_graph: bool
) -> StaticDecoder:
    """The model's decoder for this batch (`DecoderCache`), loaded with `cache`."""
    if not hasattr(model, "_static_decoders"):
        model._static_decoders = DecoderCache()
    return model._static_decoders.get(model, cache, plan, new_tokens, cuda_graph)


@torch.no_grad()
def static_sample(
    model: Any,
    input_ids: torch.Tensor,
    plan: StaticPlan,
    stopping_criteria: Any,
    generation_config: Any,
    model_kwargs: dict[str, Any],
    cuda_graph: bool,
    prefill_segment: int = PREFILL_SEGMENT,
) -> torch.Tensor:
    """`GenerationMixin._sample`'s result (`[B, T + n]` ids) from the static decoder; the
    prompt is read in segments of `prefill_segment` tokens (`deltalab.models.prefill`)."""
    length = input_ids.shape[1]
    new_tokens = generation_config.max_length - length
    cache, last = prefill(
        model, input_ids, prefill_segment, attention_mask=model_kwargs.get("attention_mask")
    )
    decoder = kept_decoder(model, cache, plan, new_tokens, cuda_graph)
    decoder.start(last)
    del cache, last
    pad = generation_config._pad_token_tensor
    pad_finished = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    ids = torch.empty(input_ids.shape[0], length + new_tokens, dtype=input_ids.dtype)
    ids[:, :length] = input_ids.cpu()
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool)
    done = 0
    while done < new_tokens:
        end = min(done + CHECK_EVERY, new_tokens)
        while decoder.produced < end:
            decoder.step()
        chunk = decoder.history[:, done:end].cpu()
        for i in range(end - done):
            token = chunk[:, i]
            if pad_finished:
                token = torch.where(unfinished, token, pad.cpu())
            ids[:, length + done + i] = token
            unfinished &= ~stopping_criteria(ids[:, : length + done + i + 1], None).cpu()
            if not unfinished.any():
                return ids[:, : length + done + i + 1].to(input_ids.device)
        done = end
    return ids.to(input_ids.device)
