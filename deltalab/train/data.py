"""A run's token windows of each split, prepared once for all its ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist

from deltalab.data import CorpusConfig, PackedSequences, prepare_tokens, resolve_source
from deltalab.errors import DataError, UserError
from deltalab.train.config import RunConfig
from deltalab.train.distributed import Distributed

__all__ = ["prepare_sequences"]


def prepare_sequences(
    config: RunConfig, tokenizer, split: str, ctx: Distributed
) -> PackedSequences:
    """The windows of `train.seq_len + 1` tokens of `split` ("train" or "held_out") of the
    run's data, tokenized into `data.cache_dir` by rank 0 first."""
    corpus = CorpusConfig(
        source=resolve_source(config.data.source),
        split=split,
        held_out_fraction=config.data.held_out_fraction,
        max_bytes=config.data.max_bytes,
        text_field=config.data.text_field,
    )
    # Rank 0 tokenizes; the others then find the finished cache entry. Rank 0's failure is
    # shared (instead of a barrier the others would wait at forever) so every rank stops.
    failure = None
    if ctx.is_main:
        try:
            tokens = prepare_tokens(corpus, tokenizer, config.data.cache_dir)
        except Exception as error:
            failure = error
    if ctx.active:
        # 0: ready; 1: a user error (the others report one too, in one line); 2: anything else.
        code = 0 if failure is None else 1 if isinstance(failure, UserError) else 2
        failed = torch.tensor(float(code), device=ctx.device)
        dist.all_reduce(failed)
        if failed.item() and failure is None:
            kind = DataError if failed.item() == 1 else RuntimeError
            raise kind("rank 0 could not prepare the training data; see its error")
    if failure is not None:
        raise failure
    if not ctx.is_main:
        tokens = prepare_tokens(corpus, tokenizer, config.data.cache_dir)
    return PackedSequences(tokens, config.train.seq_len)
