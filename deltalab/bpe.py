"""`deltalab tokenizer train SOURCE --vocab N --out DIR`: a byte-level BPE tokenizer trained
offline, with Hugging Face `tokenizers`, on any data source the trainer reads.

    deltalab tokenizer train stdlib --vocab 32000 --out tokenizers/stdlib-32k
    deltalab train data.tokenizer=tokenizers/stdlib-32k
    deltalab eval --task perplexity runs/train/model     # loss per token and bits per byte

SOURCE is what `data.source` takes: `stdlib`, a file, a directory, a saved dataset, an archive
or `@LIST` (deltalab/data/corpus.py). The tokenizer learns from the source's train split only
(`--held-out-fraction`, as the trainer splits it), so the text a run evaluates on stays unseen;
`--max-bytes` caps what it reads (default: all of the split).

The tokenizer is byte-level: any text encodes (no unknown token) and decodes back to itself.
Its first ids are the specials `<|bos|>` 0, `<|eos|>` 1, `<|pad|>` 2; then the 256 bytes, then
the merges. DIR holds the files `PreTrainedTokenizerFast.save_pretrained` writes (loadable by
`transformers.AutoTokenizer` and `data.tokenizer=DIR`) and `training.json`, which names the
source, its SHA-1 fingerprint (`source_fingerprint`) and the settings.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from deltalab.cli import add_command, argument_type, positive_int

__all__ = ["SPECIAL_TOKENS", "TRAINING_NAME", "add_parser", "train_tokenizer"]

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")
TRAINING_NAME = "training.json"
# Merges seen fewer times than this are not learned: a pair seen once is noise of the sample.
DEFAULT_MIN_FREQUENCY = 2
# The byte alphabet and the specials come first: a smaller vocabulary would hold no merge.
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)


def train_tokenizer(
    corpus: Any,
    vocab_size: int,
    out_dir: str | Path,
    *,
    min_frequency: int = DEFAULT_MIN_FREQUENCY,
) -> Path:
    """Trains a byte-level BPE of `vocab_size` ids on the documents of `corpus` (a
    `deltalab.data.CorpusConfig`) and writes it to `out_dir`; returns `out_dir`.

    The result has fewer ids than `vocab_size` when the text holds fewer pairs worth merging.
    """
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from deltalab.data import iter_documents, source_fingerprint
    from deltalab.data._validate import require_int
    from deltalab.data.tokenizer import byte_level_fast

    require_int("vocab_size", vocab_size, minimum=MIN_VOCAB)
    require_int("min_frequency", min_frequency, minimum=1)
    raw = tokenizers.Tokenizer(models.BPE())
    # GPT-2's split of the text into words before merging, and no space added before it: the
    # text maps to bytes exactly, so decoding gives it back.
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    stats = {"documents": 0, "bytes": 0}

    def documents():
        for text in iter_documents(corpus):
            stats["documents"] += 1
            stats["bytes"] += len(text.encode("utf-8"))
            yield text

    raw.train_from_iterator(documents(), trainer=trainer)
    out = Path(out_dir)
    byte_level_fast(raw, SPECIAL_TOKENS).save_pretrained(out)
    record = {
        "source": corpus.source,
        "split": corpus.split,
        "held_out_fraction": corpus.held_out_fraction,
        "max_bytes": corpus.max_bytes,
        "text_field": corpus.text_field,
        "source_fingerprint": source_fingerprint(corpus),
        "documents": stats["documents"],
        "text_bytes": stats["bytes"],
        "vocab_size_asked": vocab_size,
        "vocab_size": raw.get_vocab_size(with_added_tokens=True),
        "min_frequency": min_frequency,
        "tokenizers": tokenizers.__version__,
    }
    (out / TRAINING_NAME).write_text(json.dumps(record, indent=2) + "\n")
    return out


def _max_bytes(text: str) -> int | None:
    """argparse type: a byte count > 0, or `none` for the whole split."""
    return None if text.lower() in ("none", "null") else positive_int(text)


_max_bytes.__name__ = "byte count > 0 or none"
_fraction = argument_type(float, lambda value: 0 < value < 1, "fraction in (0, 1)")


def _run(args: argparse.Namespace) -> int:
    from deltalab.data import CorpusConfig, resolve_source
    from deltalab.errors import ConfigError

    if args.vocab < MIN_VOCAB:
        raise ConfigError(
            f"--vocab must be at least {MIN_VOCAB} (the 256 bytes and {len(SPECIAL_TOKENS)} "
            f"specials), got {args.vocab}"
        )
    if args.min_frequency < 1:
        raise ConfigError(f"--min-frequency must be >= 1, got {args.min_frequency}")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {args.out!r} exists and is not an empty directory")
    corpus = CorpusConfig(
        source=resolve_source(args.source),
        split="train",
        held_out_fraction=args.held_out_fraction,
        max_bytes=args.max_bytes,
        text_field=args.text_field,
    )
    train_tokenizer(corpus, args.vocab, out, min_frequency=args.min_frequency)
    record = json.loads((out / TRAINING_NAME).read_text())
    size = record["vocab_size"]
    short = "" if size >= args.vocab else f" (asked {args.vocab}: the corpus gave no more merges)"
    print(
        f"vocabulary of {size}{short} from {record['documents']} documents "
        f"({record['text_bytes']:,} bytes) of {args.source}; use data.tokenizer={out}"
    )
    return 0


def add_parser(commands: Any) -> None:
    tokenizer = commands.add_parser("tokenizer", help="train a byte-level BPE tokenizer offline")
    actions = tokenizer.add_subparsers(dest="action", required=True)
    train = add_command(
        actions,
        "train",
        "train a byte-level BPE on a data source (as data.source takes it)",
        __doc__,
    )
    train.add_argument("source", help="stdlib, a file, a directory, an archive or @LIST")
    train.add_argument(
        "--vocab", type=int, required=True, help="the vocabulary size, specials included"
    )
    train.add_argument("--out", required=True, help="the directory to write (new or empty)")
    train.add_argument(
        "--held-out-fraction",
        type=_fraction,
        default=0.05,
        help="the share the trainer holds out, left out here too (default 0.05, data's default)",
    )
    train.add_argument(
        "--max-bytes",
        type=_max_bytes,
        default=None,
        help="read at most this many bytes of the train split (default: none, all of it)",
    )
    train.add_argument("--text-field", default="text", help="JSONL field / column of the text")
    train.add_argument(
        "--min-frequency",
        type=int,
        default=DEFAULT_MIN_FREQUENCY,
        help=f"learn only merges seen this often (default {DEFAULT_MIN_FREQUENCY})",
    )
    train.set_defaults(run=_run)
