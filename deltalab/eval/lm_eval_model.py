"""deltalab checkpoints as an lm-evaluation-harness (lm-eval 0.4.x) model, `--model deltalab`.

    python -m deltalab.lm_eval --model deltalab --model_args pretrained=runs/default/model \
        --tasks lambada_openai
    deltalab eval runs/default/model --task lm-eval:lambada_openai

Requests are sorted by length and scored in left-padded batches; long inputs are read in
segments through the recurrent cache, so a recurrent model scores any length in constant memory.
A full-attention model past its trained length is refused, or windowed with
`long_context=window` (loglikelihood_rolling then uses lm-eval's rolling windows instead).
This module imports lm_eval; `deltalab.eval.lm_eval_adapter` is the part that does not.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm.auto import tqdm

from deltalab.eval.common import (
    LoadedCheckpoint,
    greedy_decode,
    load_checkpoint,
    stream_token_nll,
)
from deltalab.models.prefill import prefill

__all__ = ["DeltaLabLM"]


def _int(name: str, value: Any, default: int) -> int:
    # lm_eval passes model_args as strings and batch_size may be "auto".
    if value is None or value == "auto" or (isinstance(value, str) and value.startswith("auto")):
        return default
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive int, got {value!r}") from None
    if number < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return number


@register_model("deltalab")
class DeltaLabLM(TemplateLM):
    """model_args: pretrained (a checkpoint directory), tokenizer ("byte" or a path; default the
    checkpoint's), device, dtype (as `deltalab eval --dtype`; default auto), batch_size,
    segment_len (tokens per forward pass), long_context ("refuse" or "window"),
    trained_length, max_gen_toks (default of generate_until), seed (of sampled generation)."""

    def __init__(
        self,
        pretrained: str | None = None,
        *,
        loaded: LoadedCheckpoint | None = None,
        tokenizer: str | None = None,
        device: str | None = "auto",
        dtype: str | None = "auto",
        batch_size: int | str | None = 8,
        max_batch_size: int | None = None,
        segment_len: int | str = 2048,
        long_context: str = "refuse",
        trained_length: int | str | None = None,
        max_gen_toks: int | str = 256,
        seed: int | str = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if loaded is None:
            if pretrained is None:
                raise ValueError(
                    "model_args needs pretrained=CHECKPOINT (a deltalab checkpoint directory)"
                )
            length = None if trained_length is None else _int("trained_length", trained_length, 0)
            # None (lm_eval's --device not given): "auto", the first CUDA GPU where torch finds
            # one, else the CPU. A CUDA device asked for without a GPU falls back to the CPU,
            # as lm_eval's HF model does.
            device = device or "auto"
            if device.startswith("cuda") and not torch.cuda.is_available():
                device = "cpu"
            loaded = load_checkpoint(
                str(pretrained),
                tokenizer=tokenizer,
                device=device,
                dtype=dtype or "auto",
                trained_length=length,
            )
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.batch_size = _int("batch_size", batch_size, 8)
        self.segment_len = _int("segment_len", segment_len, 2048)
        self.long_context = long_context
        self.max_gen_toks = _int("max_gen_toks", max_gen_toks, 256)
        self.seed = int(seed)
        self._device = next(self.model.parameters()).device

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        # Documents are separated by EOS in training, so EOS is what precedes a document.
        return self.tokenizer.eos_id

    @property
    def max_length(self) -> int | None:
        return self.loaded.trained_length

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.spec

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs: Any
    ) -> list[int]:
        return self.tokenizer.encode(string)

    def tok_decode(self, tokens: list[int], **kwargs: Any) -> str:
        return self.tokenizer.decode(tokens)

    def _padded(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows left-padded to one length -> (ids [B, T], mask [B, T] or None if none padded)."""
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.tokenizer.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.bool)
        for i, row in enumerate(rows):
            ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row) :] = True
        return ids, None if bool(mask.all()) else mask

    def _loglikelihood_tokens(
        self,
        requests: list[tuple[Any, list[int], list[int]]],
        disable_tqdm: bool = False,
        **kwargs: Any,
    ) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether it is the greedy continuation)."""
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        # Longest first: a batch pads to its first row, and an over-long input fails at once.
        order = sorted(
            range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2])
        )
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="loglikelihood")
        for start in range(0, len(order), self.batch_size):
            chosen = order[start : start + self.batch_size]
            rows = [(requests[i][1] + requests[i][2]) for i in chosen]
            # The last token of a row is only a target: the model reads one token fewer.
            self.loaded.allow_context(max(len(r) for r in rows) - 1, self.long_context)
            ids, mask = self._padded(rows)
            nll, greedy = stream_token_nll(
                self.model, ids, self.segment_len, attention_mask=mask, with_greedy=True
            )
            for row, index in enumerate(chosen):
                count = len(requests[index][2])
                logprob = -nll[row, nll.shape[1] - count :].double().sum().item()
                is_greedy = bool(greedy[row, greedy.shape[1] - count :].all())
                results[index] = (logprob, is_greedy)
                if requests[index][0] is not None:
                    self.cache_hook.add_partial(
                        "loglikelihood", requests[index][0], (logprob, is_greedy)
                    )
            bar.update(len(chosen))
        bar.close()
        return results  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole texts after the prefix token: one pass through the recurrent
        state, or lm-eval's rolling windows of the trained length for a full-attention model."""
        windows: list[tuple[Any, list[int], list[int]]] = []
        owners: list[int] = []
        for index, request in enumerate(requests):
            (text,) = request.args
            tokens = self.tok_encode(text)
            limited = self.loaded.limited and self.loaded.window_applied is None
            if limited and self.loaded.trained_length is not None and self.long_context == "refuse":
                parts = [
                    make_disjoint_window(w)
                    for w in get_rolling_token_windows(
                        tokens, self.prefix_token_id, self.loaded.trained_length, 1
                    )
                ]
            else:
                parts = [([self.prefix_token_id], tokens)]
            for context, continuation in parts:
                windows.append((None, context, continuation))
                owners.append(index)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, scores, strict=True):
            totals[owner] += logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Continuations of each context until one of its `until` strings (cut there), EOS or
        `max_gen_toks`; greedy unless do_sample with temperature > 0."""
        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(
                index
            )
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="generate_until")
        generator = torch.Generator().manual_seed(self.seed)
        for key, members in groups.items():
            options = dict(json.loads(key))
            until = options.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(options.pop("max_gen_toks", self.max_gen_toks))
            sampling = bool(options.pop("do_sample", False))
            temperature = float(options.pop("temperature", 0.0) or 0.0) if sampling else 0.0
            members.sort(key=lambda i: -len(requests[i].args[0]))
            for start in range(0, len(members), self.batch_size):
                chosen = members[start : start + self.batch_size]
                rows = [
                    self.tok_encode(requests[i].args[0]) or [self.prefix_token_id] for i in chosen
                ]
                self.loaded.allow_context(max(len(r) for r in rows) + max_new, self.long_context)
                ids, mask = self._padded(rows)
                cache, logits = prefill(self.model, ids, self.segment_len, attention_mask=mask)

                def stop(row: int, tokens: list[int], until: list[str] = until) -> bool:
                    if tokens[-1] == self.eot_token_id:
                        return True
                    text = self.tok_decode(tokens[-64:])
                    return any(s in text for s in until)

                outputs = greedy_decode(
                    self.model,
                    cache,
                    logits,
                    max_new,
                    stop=stop,
                    temperature=temperature,
                    generator=generator,
                )
                for row, index in enumerate(chosen):
                    text = self.tok_decode(outputs[row])
                    for s in until:
                        text = text.split(s)[0] if s else text
                    results[index] = text
                    self.cache_hook.add_partial("generate_until", requests[index].args, text)
                bar.update(len(chosen))
        bar.close()
        return results  # type: ignore[return-value]
