"""The data layer: documents -> tokens -> memory-mapped shards -> packed, resumable batches.

    tokenizer = load_tokenizer("byte")
    shards = prepare_tokens(CorpusConfig(), tokenizer, "cache/tokens")  # the stdlib, once
    sequences = PackedSequences(shards, seq_len=512)
    sampler = ResumableSampler(len(sequences), seed=0, rank=rank, world_size=world_size)
    for batch in batches(sequences, sampler, batch_size=8):  # LongTensor [8, 513]
        inputs, targets = batch[:, :-1], batch[:, 1:]

Checkpoint `sampler.state_dict()` with the model; `load_state_dict` resumes the same batches.
"""

from deltalab.data.corpus import (
    DEFAULT_MAX_BYTES,
    STDLIB_SOURCE,
    CorpusConfig,
    document_files,
    held_out_score,
    in_split,
    iter_documents,
    read_directory,
    read_file,
    read_hf_dataset,
    read_jsonl,
    read_parquet,
    read_text_file,
    resolve_source,
    source_fingerprint,
    source_path,
    stdlib_files,
    stdlib_root,
)
from deltalab.data.pinned import ARCHIVE_SUFFIXES, archive_stdlib, is_file_set
from deltalab.data.sampler import (
    PackedSequences,
    ResumableSampler,
    SamplerState,
    TokenStream,
    batches,
)
from deltalab.data.shards import (
    MANIFEST_NAME,
    ShardManifest,
    TokenShards,
    build_shards,
    open_shards,
    prepare_tokens,
    token_dtype,
    tokenizer_fingerprint,
)
from deltalab.data.tokenizer import (
    ByteTokenizer,
    HuggingFaceTokenizer,
    Tokenizer,
    load_tokenizer,
    save_tokenizer,
)

__all__ = [
    "ARCHIVE_SUFFIXES",
    "DEFAULT_MAX_BYTES",
    "MANIFEST_NAME",
    "STDLIB_SOURCE",
    "ByteTokenizer",
    "CorpusConfig",
    "HuggingFaceTokenizer",
    "PackedSequences",
    "ResumableSampler",
    "SamplerState",
    "ShardManifest",
    "TokenShards",
    "TokenStream",
    "Tokenizer",
    "archive_stdlib",
    "batches",
    "build_shards",
    "document_files",
    "held_out_score",
    "in_split",
    "is_file_set",
    "iter_documents",
    "load_tokenizer",
    "open_shards",
    "prepare_tokens",
    "read_directory",
    "read_file",
    "read_hf_dataset",
    "read_jsonl",
    "read_parquet",
    "read_text_file",
    "resolve_source",
    "save_tokenizer",
    "source_fingerprint",
    "source_path",
    "stdlib_files",
    "stdlib_root",
    "token_dtype",
    "tokenizer_fingerprint",
]
