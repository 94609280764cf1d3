"""Tokenize once, read many times: documents -> memory-mapped token shards on disk.

A shard set is a directory of `shard_00000.bin`, `shard_00001.bin`, ... (raw little-endian
uint16 tokens when the vocabulary fits, else uint32) and a `manifest.json` describing them.
Together the shards are one token stream: every document's tokens followed by the tokenizer's
EOS id, documents back to back, a document free to continue into the next shard. The manifest
is written last and atomically, so a directory with a manifest always holds complete shards.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import IO, Any

import numpy as np

from deltalab.data._validate import require_int
from deltalab.data.corpus import CorpusConfig, iter_documents
from deltalab.data.corpus import source_fingerprint as corpus_fingerprint
from deltalab.data.tokenizer import Tokenizer
from deltalab.errors import DataError

MANIFEST_NAME = "manifest.json"
SHARD_NAME = "shard_{:05d}.bin"
# 2: the manifest carries the sha256 of the token stream and of the text (older sets rebuild).
FORMAT_VERSION = 2
# 64 Mi tokens: 128 MiB shards at uint16, few enough files for any corpus that fits on a disk.
DEFAULT_SHARD_TOKENS = 1 << 26
# uint16 holds the ids 0..65535.
UINT16_MAX_VOCAB = 1 << 16
# Encoded to tell tokenizers apart beyond their spec (a local directory's files can change).
_TOKENIZER_PROBE = "def f(x):\n    return x  # Grüße, 東京, 🙂\n\nThe end.<|eos|>"


@dataclass(frozen=True)
class ShardManifest:
    """The contents of `manifest.json`.

    dtype: `"uint16"` or `"uint32"`. shard_files / shard_tokens: file names and token counts,
    in stream order. tokenizer: the spec given to `load_tokenizer`. The fingerprints identify the
    source documents and the tokenizer, for cache reuse. text_bytes: the UTF-8 bytes of the
    documents (what per-byte losses divide by); text_sha256: SHA-256 of the documents, each
    followed by a NUL byte; tokens_sha256: SHA-256 of the token stream as stored (the shards'
    bytes in order). The last three are what a run records of the data it used.
    """

    dtype: str
    vocab_size: int
    eos_id: int
    tokenizer: str
    tokenizer_fingerprint: str
    source: str
    source_fingerprint: str
    num_documents: int
    shard_files: tuple[str, ...]
    shard_tokens: tuple[int, ...]
    text_bytes: int
    text_sha256: str
    tokens_sha256: str
    format_version: int = FORMAT_VERSION

    @property
    def num_tokens(self) -> int:
        return sum(self.shard_tokens)

    def fingerprint(self) -> dict[str, Any]:
        """What a run records of this token stream (its provenance): the source, the sizes and
        the SHA-256 of the text and of the tokens."""
        return {
            "source": self.source,
            "tokenizer": self.tokenizer,
            "documents": self.num_documents,
            "text_bytes": self.text_bytes,
            "text_sha256": self.text_sha256,
            "tokens": self.num_tokens,
            "tokens_sha256": self.tokens_sha256,
        }

    def to_json(self) -> str:
        record: dict[str, Any] = asdict(self)
        # Written for people reading the file; recomputed, never trusted, on load.
        record["num_tokens"] = self.num_tokens
        return json.dumps(record, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str = MANIFEST_NAME) -> ShardManifest:
        record = json.loads(text)
        names = {f.name for f in fields(cls)}
        missing = sorted(names - set(record))
        if missing:
            raise ValueError(f"{where} lacks the fields {missing}")
        if record["format_version"] != FORMAT_VERSION:
            raise ValueError(
                f"{where} has format_version {record['format_version']}, this version of "
                f"deltalab reads {FORMAT_VERSION}; rebuild the shards"
            )
        values = {name: record[name] for name in names}
        values["shard_files"] = tuple(values["shard_files"])
        values["shard_tokens"] = tuple(int(n) for n in values["shard_tokens"])
        if len(values["shard_files"]) != len(values["shard_tokens"]):
            raise ValueError(f"{where} lists a different number of shard files and token counts")
        return cls(**values)


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32: half the disk and page cache for most vocabs."""
    return np.dtype(np.uint16 if vocab_size <= UINT16_MAX_VOCAB else np.uint32)


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """SHA-1 of the tokenizer's spec, sizes, special ids and its encoding of a probe text."""
    identity = [
        tokenizer.spec,
        tokenizer.vocab_size,
        tokenizer.eos_id,
        tokenizer.bos_id,
        tokenizer.pad_id,
        tokenizer.encode(_TOKENIZER_PROBE),
    ]
    return hashlib.sha1(json.dumps(identity).encode("utf-8")).hexdigest()


def build_shards(
    documents: Iterable[str],
    tokenizer: Tokenizer,
    out_dir: str | Path,
    *,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    source: str = "",
    source_fingerprint: str = "",
) -> ShardManifest:
    """Tokenizes `documents` into `out_dir`; returns the manifest it wrote last.

    Each document becomes `tokenizer.encode(document) + [tokenizer.eos_id]`. A previous shard
    set in `out_dir` is removed first, manifest before shards, so an exception or a crash in the
    middle (including one raised by `documents`) leaves no manifest behind. Raises ValueError
    when there is no document.

    Example: byte tokenizer, documents `["ab", "c"]`, shard_tokens=4 -> shard_00000.bin holds
    `[97, 98, 257, 99]`, shard_00001.bin `[257]`.
    """
    require_int("shard_tokens", shard_tokens, minimum=1)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _remove_shard_set(out)
    vocab_size, eos = tokenizer.vocab_size, tokenizer.eos_id
    if not 0 <= eos < vocab_size:
        raise ValueError(f"tokenizer eos_id must be in [0, {vocab_size}), got {eos}")
    dtype = token_dtype(vocab_size)
    writer = _ShardWriter(out, dtype, shard_tokens)
    num_documents, text_bytes, text_hash = 0, 0, hashlib.sha256()
    try:
        for number, document in enumerate(documents):
            raw = document.encode("utf-8")
            text_bytes += len(raw)
            text_hash.update(raw + b"\0")
            ids = np.asarray(tokenizer.encode(document), dtype=np.int64)
            if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                raise ValueError(
                    f"document {number} was encoded to ids in [{ids.min()}, {ids.max()}], "
                    f"expected ids in [0, {vocab_size}) for vocab_size {vocab_size}"
                )
            writer.write(ids.astype(dtype))
            writer.write(np.array([eos], dtype=dtype))
            num_documents += 1
    finally:
        writer.close()
    if num_documents == 0:
        raise DataError(f"no documents to write into {out}")
    manifest = ShardManifest(
        dtype=dtype.name,
        vocab_size=vocab_size,
        eos_id=eos,
        tokenizer=tokenizer.spec,
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        source=source,
        source_fingerprint=source_fingerprint,
        num_documents=num_documents,
        shard_files=tuple(writer.files),
        shard_tokens=tuple(writer.counts),
        text_bytes=text_bytes,
        text_sha256=text_hash.hexdigest(),
        tokens_sha256=writer.digest.hexdigest(),
    )
    _write_atomically(out / MANIFEST_NAME, manifest.to_json())
    return manifest


class TokenShards:
    """Read-only view of a shard set as one token stream `[N]`, memory-mapped shard by shard.

    `len(shards)` is N; `shards[i]` an int; `shards[a:b]` (step 1) a new array of the manifest's
    dtype, stitched across shard boundaries. Pickling keeps only the directory, so DataLoader
    workers reopen the files instead of copying their contents.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        manifest_path = self.directory / MANIFEST_NAME
        if not manifest_path.is_file():
            raise ValueError(
                f"{self.directory} has no {MANIFEST_NAME}: not a shard set, or its build did "
                "not finish"
            )
        self.manifest = ShardManifest.from_json(manifest_path.read_text(), str(manifest_path))
        # Shards are little-endian whatever the machine that wrote them.
        self.dtype = np.dtype(self.manifest.dtype).newbyteorder("<")
        self._offsets = [0]
        for count in self.manifest.shard_tokens:
            self._offsets.append(self._offsets[-1] + count)
        self._maps: list[np.memmap] = []
        for name, count in zip(self.manifest.shard_files, self.manifest.shard_tokens, strict=True):
            path = self.directory / name
            expected = count * self.dtype.itemsize
            size = path.stat().st_size if path.is_file() else None
            if size != expected:
                raise ValueError(
                    f"shard {path} must hold {count} tokens ({expected} bytes) as its manifest "
                    f"says, got {'no file' if size is None else f'{size} bytes'}"
                )
            self._maps.append(np.memmap(path, dtype=self.dtype, mode="r", shape=(count,)))

    @property
    def vocab_size(self) -> int:
        return self.manifest.vocab_size

    @property
    def eos_id(self) -> int:
        return self.manifest.eos_id

    def __len__(self) -> int:
        return self._offsets[-1]

    def __getitem__(self, key: int | slice) -> Any:
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                raise ValueError(f"TokenShards slices must have step 1, got step {step}")
            return self.read(start, max(start, stop))
        index = int(key)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"token index {key} is out of range for {len(self)} tokens")
        shard = bisect.bisect_right(self._offsets, index) - 1
        return int(self._maps[shard][index - self._offsets[shard]])

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens `[start, stop)` of the stream, `0 <= start <= stop <= len(self)`, as a copy."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"read({start}, {stop}) is out of range for {len(self)} tokens")
        pieces = []
        shard = bisect.bisect_right(self._offsets, start) - 1
        while start < stop:
            begin = start - self._offsets[shard]
            end = min(stop, self._offsets[shard + 1]) - self._offsets[shard]
            pieces.append(self._maps[shard][begin:end])
            start += end - begin
            shard += 1
        if not pieces:
            return np.empty(0, dtype=self.dtype)
        return np.concatenate(pieces)

    def __getstate__(self) -> dict[str, str]:
        return {"directory": str(self.directory)}

    def __setstate__(self, state: dict[str, str]) -> None:
        self.__init__(state["directory"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return (
            f"TokenShards({str(self.directory)!r}, tokens={len(self)}, "
            f"documents={self.manifest.num_documents}, dtype={self.dtype.name})"
        )


def open_shards(directory: str | Path) -> TokenShards:
    """The shard set in `directory`; ValueError when it has no manifest or a shard is off."""
    return TokenShards(directory)


def prepare_tokens(
    source: CorpusConfig | str,
    tokenizer: Tokenizer,
    cache_dir: str | Path,
    *,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
) -> TokenShards:
    """The tokenized documents of `source`, built under `cache_dir` unless already there.

    The cache entry is `cache_dir/<source>-<split>-<key>`, the key hashing the source's
    fingerprint (config and file bytes) with the tokenizer's. An entry whose manifest carries
    both fingerprints is reused as is; otherwise the shards are built in a temporary directory
    next to it and renamed into place, so concurrent or interrupted builds never leave a partial
    entry. A string source means `CorpusConfig(source=...)` with its defaults. Entries of older
    sources stay until deleted: other runs may still read them.
    """
    config = source if isinstance(source, CorpusConfig) else CorpusConfig(source=source)
    source_key = corpus_fingerprint(config)
    tokenizer_key = tokenizer_fingerprint(tokenizer)
    key = hashlib.sha1(f"{FORMAT_VERSION}:{source_key}:{tokenizer_key}".encode()).hexdigest()
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    final = cache / f"{_slug(config)}-{key[:16]}"
    cached = _open_if_current(final, source_key, tokenizer_key)
    if cached is not None:
        return cached
    shutil.rmtree(final, ignore_errors=True)
    building = Path(tempfile.mkdtemp(prefix=f".{final.name}.building-", dir=cache))
    try:
        build_shards(
            iter_documents(config),
            tokenizer,
            building,
            shard_tokens=shard_tokens,
            source=f"{config.source} ({config.split})",
            source_fingerprint=source_key,
        )
        try:
            os.rename(building, final)
        except OSError:
            # Another process renamed its own complete build into place first: use that one.
            if _open_if_current(final, source_key, tokenizer_key) is None:
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return open_shards(final)


class _ShardWriter:
    """Appends tokens to numbered shard files, starting a new file every `shard_tokens`."""

    def __init__(self, directory: Path, dtype: np.dtype, shard_tokens: int) -> None:
        self.directory, self.dtype, self.shard_tokens = directory, dtype, shard_tokens
        self.files: list[str] = []
        self.counts: list[int] = []
        self._handle: IO[bytes] | None = None
        # Of the bytes written, in order: the stream's fingerprint, without reading it back.
        self.digest = hashlib.sha256()

    def write(self, tokens: np.ndarray) -> None:
        tokens = tokens.astype(self.dtype.newbyteorder("<"), copy=False)
        while tokens.size:
            handle = self._handle
            # A file is only opened for tokens to put in it: no shard is ever empty.
            if handle is None or self.counts[-1] == self.shard_tokens:
                handle = self._next_file()
            room = self.shard_tokens - self.counts[-1]
            piece = tokens[:room].tobytes()
            handle.write(piece)
            self.digest.update(piece)
            self.counts[-1] += min(room, tokens.size)
            tokens = tokens[room:]

    def close(self) -> None:
        if self._handle is not None:
            self._handle.flush()
            # On disk before the manifest that vouches for it is written.
            os.fsync(self._handle.fileno())
            self._handle.close()
            self._handle = None

    def _next_file(self) -> IO[bytes]:
        self.close()
        name = SHARD_NAME.format(len(self.files))
        self._handle = (self.directory / name).open("wb")
        self.files.append(name)
        self.counts.append(0)
        return self._handle


def _remove_shard_set(directory: Path) -> None:
    (directory / MANIFEST_NAME).unlink(missing_ok=True)
    for path in directory.glob("shard_*.bin"):
        path.unlink()


def _write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with temporary.open("w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def _open_if_current(directory: Path, source_key: str, tokenizer_key: str) -> TokenShards | None:
    """The shard set in `directory` when it is complete and built from these fingerprints."""
    if not (directory / MANIFEST_NAME).is_file():
        return None
    # A damaged entry is rebuilt, never trusted.
    try:
        shards = open_shards(directory)
    except (ValueError, OSError, KeyError, TypeError):
        return None
    manifest = shards.manifest
    if manifest.source_fingerprint != source_key:
        return None
    if manifest.tokenizer_fingerprint != tokenizer_key:
        return None
    return shards


def _slug(config: CorpusConfig) -> str:
    name = Path(config.source).name or "source"
    return re.sub(r"[^A-Za-z0-9._-]+", "_", f"{name}-{config.split}")
