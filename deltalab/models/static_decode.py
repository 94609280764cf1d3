"""Decoding with a static cache, one token per CUDA-graph replay.

transformers' decoding loop runs every layer's Python code for every token; at the batch sizes
of interactive decoding that Python time, not the GPU, sets the cost of a token (`CausalLM.generate`
hands its greedy and sampled calls to this decoder on CUDA: `deltalab.models.graph_generate`).
Here:

- the prompt is prefilled by the model's own (chunked) forward;
- its cache is copied into buffers that never move: recurrent states as they are (their size is
  fixed), attention keys and values into `[B, max_length, H, *]` buffers with a mask of the
  filled slots;
- one decoding step (embedding, blocks, norm, head, choice of the next token) reads and writes
  only those buffers and a few device tensors (the last token, its position), so it is captured
  in a CUDA graph once and replayed for every token. Recurrent memories are updated in place
  (`RecurrentState.in_place`), so the step copies no state;
- where Triton runs, a delta-rule layer's step is two matrix products, one kernel for all of
  its recurrent work and the output projection (`deltalab.layers.decode_step`): at batch 1 a
  step costs its kernel launches, and the unfused layer makes some fifty.

Without CUDA (or with `cuda_graph=False`) the same step runs eagerly, which is how the CPU tests
check that it produces the tokens of `model.generate`. Greedy decoding gives exactly those
tokens; sampling draws from the same distribution (temperature, then top-k, as transformers
does) with its own use of the random generator, so a seed gives other samples than there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from deltalab.layers.attention import Attention, sliding_window_mask
from deltalab.layers.common import compute_dtype
from deltalab.layers.decode_step import add_projected, fused_step, runs_fused
from deltalab.layers.projections import concatenated_weights, project_together
from deltalab.layers.states import AttentionState, RecurrentState
from deltalab.models.cache import RecurrentCache
from deltalab.models.lm import CausalLM
from deltalab.ops._checks import unchecked_values

__all__ = ["StaticDecoder", "StaticKV", "static_generate"]

# Eager steps run before the capture: they compile the Triton kernels and let cuBLAS and cuDNN
# pick their algorithms, none of which may happen during a capture.
WARMUP_STEPS = 2
# Tokens between two looks at whether every sequence has finished (each look waits for the GPU).
FINISH_CHECK_EVERY = 32


@dataclass
class StaticKV:
    """An attention layer's static cache: the slots of positions 0..L-1.

    key `[B, L, H, K]` (RoPE applied), value `[B, L, H, V]`, filled `[B, L]` (True at slots that
    hold a real token: written and not padding).
    """

    key: torch.Tensor
    value: torch.Tensor
    filled: torch.Tensor


def _tensor_fields(state: RecurrentState) -> dict[str, torch.Tensor]:
    """The state's tensors by field name (the gates trace excluded)."""
    return {
        f.name: value
        for f in dataclasses.fields(state)
        if f.name != "gates" and isinstance(value := getattr(state, f.name), torch.Tensor)
    }


def _static_recurrent(state: RecurrentState) -> RecurrentState:
    """Contiguous copies of a recurrent state's tensors, marked for in-place updates."""
    copies = {
        name: t.clone(memory_format=torch.contiguous_format)
        for name, t in _tensor_fields(state).items()
    }
    return dataclasses.replace(state, **copies, gates=None, in_place=True)


def _static_kv(state: AttentionState, length: int) -> StaticKV:
    batch, _, heads, key_dim = state.key.shape
    key = state.key.new_zeros(batch, length, heads, key_dim)
    value = state.value.new_zeros(batch, length, heads, state.value.shape[-1])
    filled = torch.zeros(batch, length, dtype=torch.bool, device=key.device)
    return StaticKV(key, value, filled)


def attention_step(
    layer: Attention,
    x: torch.Tensor,
    kv: StaticKV,
    position: torch.Tensor,
    residual: torch.Tensor | None = None,
    in_place: bool = False,
) -> torch.Tensor:
    """`Attention.forward` for one token `x [B, 1, D]` at `position [1]` (a device tensor), its
    key and value written into `kv`; attends over every slot, the unfilled ones masked. Plus
    `residual` when given, summed in the output projection's product (`add_projected`;
    in_place: into `residual`)."""
    projected = project_together(x, [layer.q_proj, layer.k_proj, layer.v_proj])
    # Queries and keys rotated together, as heads of one tensor: one RoPE instead of two.
    qk = torch.cat([projected[layer.q_proj], projected[layer.k_proj]], dim=-1)
    q, k = layer.rotate(qk.unflatten(-1, (2 * layer.num_heads, layer.head_dim)), position).split(
        layer.num_heads, dim=2
    )
    v = projected[layer.v_proj].unflatten(-1, (layer.num_heads, layer.value_dim))
    kv.key.index_copy_(1, position, k.to(kv.key.dtype))
    kv.value.index_copy_(1, position, v.to(kv.value.dtype))
    kv.filled.index_fill_(1, position, True)
    slots = torch.arange(kv.key.shape[1], device=x.device)
    visible = kv.filled & sliding_window_mask(position, slots, layer.window)  # [B, L]
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        kv.key.to(q.dtype).transpose(1, 2),
        kv.value.to(v.dtype).transpose(1, 2),
        attn_mask=visible[:, None, None, :],
    )
    o = o.transpose(1, 2).flatten(-2)
    return add_projected(residual, o, layer.o_proj, layer.backend, in_place=in_place)


class StaticDecoder:
    """Decodes a batch from a prefilled cache with fixed buffers; see the module docstring.

    Args:
        model: the `CausalLM` (in eval mode; its device and dtype are used as they are).
        cache: the `RecurrentCache` left by the prompt's forward (`use_cache=True`).
        max_new_tokens: tokens this decoder may produce (buffers are sized for them).
        temperature: 0 for greedy decoding, else the softmax temperature of sampling.
        top_k: sample among the k most likely tokens only (None: all).
        eos_token_id: a sequence that produced it is finished: it gets `pad_token_id` from then
            on (as `model.generate`); None: no end token.
        pad_token_id: defaults to `eos_token_id`.
        cuda_graph: capture the step in a CUDA graph: None (when the model is on CUDA), True
            (required) or False (run the step eagerly).
        max_length: positions the attention layers' buffers hold, prompt included (None: the
            cache's prompt and `max_new_tokens`); room for longer prompts lets `load` take them.

    Use: `start(logits)` with the prompt's last logits `[B, vocab]` chooses the first token,
    each `step()` one more; `generated()` returns them `[B, n]`; `load(cache)` restarts from
    another prefilled cache of the same batch, whose prompt and `max_new_tokens` fit in
    `max_length`. The step runs without value checks (`unchecked_values`): nothing in it reads
    back to the host. It multiplies each layer's projections by a copy of their weights
    concatenated (`concatenated_weights`), made at the first step: weights changed after it
    need a new decoder.
    """

    def __init__(
        self,
        model: CausalLM,
        cache: RecurrentCache,
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        cuda_graph: bool | None = None,
        max_length: int | None = None,
    ) -> None:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise TypeError(f"max_new_tokens must be an int, got {type(max_new_tokens).__name__}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)):
            raise TypeError(f"top_k must be an int or None, got {type(top_k).__name__}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        if not isinstance(cache, RecurrentCache) or any(s is None for s in cache.states):
            raise ValueError("cache must be the RecurrentCache of a forward with use_cache=True")
        device = model.lm_head.weight.device
        if cuda_graph is None:
            cuda_graph = device.type == "cuda"
        elif cuda_graph and device.type != "cuda":
            raise ValueError(f"cuda_graph=True needs the model on a CUDA device, not {device}")
        self.model = model
        self.temperature, self.top_k = float(temperature), top_k
        self.eos = eos_token_id
        self.pad = eos_token_id if pad_token_id is None else pad_token_id
        # The step writes at most `room` tokens (and the warm-up as many) between loads.
        self.room = max(max_new_tokens, WARMUP_STEPS)
        length = cache.seen_tokens + self.room
        if max_length is not None:
            if isinstance(max_length, bool) or not isinstance(max_length, int):
                raise TypeError(f"max_length must be an int, got {type(max_length).__name__}")
            if max_length < length:
                raise ValueError(
                    f"max_length must hold the prompt ({cache.seen_tokens} tokens) and "
                    f"{self.room} new ones, got {max_length}"
                )
            length = max_length
        self.max_length = length
        self.states: list[RecurrentState | StaticKV] = [
            _static_kv(s, length) if isinstance(s, AttentionState) else _static_recurrent(s)
            for s in cache.states
        ]
        batch = self.batch = cache.tensors()[0].shape[0]
        # Device-side counters, so the captured step advances them itself.
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        self.index = torch.zeros(1, dtype=torch.long, device=device)
        self.history = torch.zeros(batch, self.room, dtype=torch.long, device=device)
        self.unfinished = torch.ones(batch, dtype=torch.bool, device=device)
        self.done = torch.zeros(self.room, dtype=torch.bool, device=device)
        self.produced = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        # Each layer's projections of x concatenated (`concatenated_weights`): one product a
        # layer, for a copy of those weights held by this decoder.
        self.weights: dict = {}
        self.load(cache)
        if cuda_graph:
            self._capture()
            self.load(cache)

    @torch.no_grad()
    def load(self, cache: RecurrentCache) -> None:
        """Copies a prefilled cache (of this decoder's batch, its prompt and `room` new tokens
        within `max_length`) into the buffers and forgets the tokens produced so far."""
        batch = cache.tensors()[0].shape[0]
        if batch != self.batch:
            raise ValueError(
                f"cache holds {batch} sequences, this decoder was built for {self.batch}"
            )
        if cache.seen_tokens + self.room > self.max_length:
            raise ValueError(
                f"cache has seen {cache.seen_tokens} tokens; with {self.room} new ones that "
                f"passes this decoder's max_length {self.max_length}"
            )
        for buffer, state in zip(self.states, cache.states, strict=True):
            if isinstance(buffer, StaticKV):
                # Under a sliding window the cache holds only the last few positions.
                start = state.offset - state.key.shape[1]
                buffer.key[:, start : state.offset].copy_(state.key)
                buffer.value[:, start : state.offset].copy_(state.value)
                buffer.filled.zero_()
                kept = True if state.key_mask is None else state.key_mask
                buffer.filled[:, start : state.offset] = kept
            else:
                for name, tensor in _tensor_fields(state).items():
                    getattr(buffer, name).copy_(tensor)
        self.position.fill_(cache.seen_tokens)
        self.index.zero_()
        self.unfinished.fill_(True)
        self.done.zero_()
        self.produced = 0

    @torch.no_grad()
    def start(self, logits: torch.Tensor) -> None:
        """Chooses the first new token from the prompt's last logits `[B, vocab]`."""
        self._reserve()
        self._choose(logits.to(compute_dtype(logits)))

    @torch.no_grad()
    def step(self) -> None:
        """Feeds the last token and chooses the next one (a graph replay when captured)."""
        self._reserve()
        if self.graph is not None:
            self.graph.replay()
        else:
            self._step()

    def finished(self) -> bool:
        """Whether every sequence has produced the end token (waits for the GPU)."""
        return self.eos is not None and bool(self.done[: self.produced].any())

    def generated(self) -> torch.Tensor:
        """The tokens produced since the last load `[B, n]`, up to the step at which the last
        sequence finished (as `model.generate` stops)."""
        count = self.produced
        if self.eos is not None:
            ends = self.done[:count].nonzero()
            if len(ends):
                count = int(ends[0, 0]) + 1
        return self.history[:, :count]

    def _reserve(self) -> None:
        if self.produced >= self.room:
            raise RuntimeError(
                f"this decoder was built for {self.room} new tokens and has produced them all"
            )
        self.produced += 1

    def _choose(self, logits: torch.Tensor) -> None:
        """Next tokens from logits `[B, vocab]` in at least float32 (a float64 model's stay
        float64, as `generate` keeps them), written to `token` and `history`."""
        if self.temperature == 0:
            chosen = logits.argmax(dim=-1)
        else:
            logits = logits / self.temperature
            if self.top_k is not None and self.top_k < logits.shape[-1]:
                kth = logits.topk(self.top_k, dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = logits.softmax(dim=-1)
            # argmax(p / E) with E ~ Exp(1) picks token i with probability p_i (the exponential
            # race): a draw without multinomial's checks, which a graph could not contain.
            chosen = (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)
        if self.eos is not None:
            chosen = torch.where(self.unfinished, chosen, self.pad)
            self.unfinished &= chosen != self.eos
            self.done.index_copy_(0, self.index, ~self.unfinished.any().view(1))
        self.token.copy_(chosen.unsqueeze(1))
        self.history.index_copy_(1, self.index, self.token)
        self.index += 1

    def _step(self) -> None:
        """The captured step: `token` in, the next `token` out, the buffers advanced."""
        with unchecked_values(), concatenated_weights(self.weights):
            self._advance()

    def _advance(self) -> None:
        core = self.model.model
        x = core.embed(self.token)
        for block, state in zip(core.blocks, self.states, strict=True):
            if isinstance(state, StaticKV):
                normed = block.mixer_norm(x)
                x = attention_step(block.mixer, normed, state, self.position, residual=x,
                                   in_place=True)  # fmt: skip
            elif runs_fused(block.mixer, x, state):
                x = fused_step(block.mixer, x, state, self.weights, residual=x,
                               norm=block.mixer_norm, in_place=True)  # fmt: skip
            else:
                y, new_state = block.mixer(block.mixer_norm(x), state)
                x = x + y
                # The memory was updated in place; conv caches (and KDN uncertainties) are new.
                for name, tensor in _tensor_fields(new_state).items():
                    buffer = getattr(state, name)
                    if tensor is not buffer:
                        buffer.copy_(tensor)
            # Block.forward's FFN branch, its norm in the first product where the kernel runs
            # it, SwiGLU's gating in the second where the kernel runs it, the residual summed into
            # x in the down projection's product.
            ffn = block.ffn
            products = ffn.backend  # its products follow it (`products_backend`)
            gate_up = add_projected(None, x, ffn.gate_up, products, norm=block.ffn_norm)
            x = add_projected(x, gate_up, ffn.down, products, swiglu_backend=ffn.backend,
                              in_place=True)  # fmt: skip
        logits = self.model.lm_head(core.norm(x))[:, -1]
        logits = logits.to(compute_dtype(logits))
        self.position += 1
        self._choose(logits)

    def _capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(self.graph):
            self._step()


@torch.no_grad()
def static_generate(
    model: CausalLM,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    attention_mask: torch.Tensor | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    cuda_graph: bool | None = None,
) -> torch.Tensor:
    """`model.generate` through a `StaticDecoder`: `[B, T]` prompt ids (left-padded with
    `attention_mask` `[B, T]`, 0 at padding) -> `[B, T + n]`, n <= max_new_tokens.

    Greedy at temperature 0 (the tokens of `model.generate(..., do_sample=False)`), else
    sampled; the other arguments as `StaticDecoder`'s.
    """
    out: Any = model(input_ids, attention_mask=attention_mask, use_cache=True, logits_to_keep=1)
    decoder = StaticDecoder(
        model,
        out.past_key_values,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        cuda_graph=cuda_graph,
    )
    decoder.start(out.logits[:, -1])
    del out  # the decoder holds its own copy of the cache
    for produced in range(1, max_new_tokens):
        if produced % FINISH_CHECK_EVERY == 0 and decoder.finished():
            break
        decoder.step()
    return torch.cat([input_ids, decoder.generated()], dim=1)
