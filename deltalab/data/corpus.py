"""Documents to train on: the built-in Python-stdlib corpus, or the user's files.

`iter_documents(config)` yields the documents (strings) of one source, split and capped as the
`CorpusConfig` says; `source_fingerprint(config)` hashes everything those documents depend on, so
that tokenized shards can be reused until the source changes.

Sources:
- `"stdlib"`: the `*.py` files of the running Python's standard library, without site-packages,
  test directories and files over `stdlib_max_file_bytes` (generated tables such as
  `pydoc_data/topics.py`). One file is one document.
- a file: `.jsonl` (one JSON object per line, text in `text_field`), `.parquet` (column
  `text_field`, read with pyarrow), anything else is one UTF-8 text document. Such a single
  text file is split by position, not by hash (one document would always fall in one split):
  its last `held_out_fraction` of bytes, from a line start, is held out, the rest is trained on.
- a directory saved by Hugging Face `datasets` (`save_to_disk`): column `text_field`.
- any other directory: every `.txt`, `.jsonl` and `.parquet` file below it, in path order.
- a pinned file set (`deltalab.data.pinned`): an archive (`.tar`, `.tar.gz`, `.tgz`, `.tar.bz2`,
  `.tar.xz`, `.zip`) or a file list `@LIST`; each file is one document, split by its name as
  the stdlib's files are.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from deltalab.data._validate import require_choice, require_fraction, require_int
from deltalab.data.pinned import (
    FILE_LIST_PREFIX,
    file_set_documents,
    file_set_files,
    is_file_set,
)
from deltalab.errors import DataError

STDLIB_SOURCE = "stdlib"
SPLITS = ("train", "held_out", "all")
DOCUMENT_SUFFIXES = (".txt", ".jsonl", ".parquet")
# Directory names skipped in the stdlib: installed packages, test suites (`test/`, `tests/`,
# `idlelib/idle_test`, `lib2to3/tests`, `ctypes/test`, ...) and bytecode caches.
STDLIB_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)
# Files that mark a directory written by `datasets.Dataset(Dict).save_to_disk`.
HF_DATASET_MARKERS = ("dataset_dict.json", "state.json")
# 4 MiB of the ~11 MB stdlib: a few million byte tokens, a first run of minutes on a CPU.
DEFAULT_MAX_BYTES = 4 * 2**20
# Bumped whenever the way documents are read changes, which invalidates every cached shard set.
# 2: a single text file is split by position.
FINGERPRINT_VERSION = 2
# How far past the split point of a single text file a line start is looked for.
_LINE_SEARCH_BYTES = 1 << 16
_HASH_CHUNK = 1 << 20


@dataclass(frozen=True)
class CorpusConfig:
    """Which documents to read.

    source: `"stdlib"`, a path (file, directory, or a saved Hugging Face dataset), an archive or
        `@LIST` (a pinned file set, `deltalab.data.pinned`).
    split: `"train"`, `"held_out"` or `"all"`. A stdlib file belongs to the held-out split when
        the hash of its relative path falls below `held_out_fraction`; a user document when the
        hash of its text does, so duplicated documents never straddle the split. A source that
        is a single text file is one document, split by position instead: the held-out split is
        its last `held_out_fraction` of bytes (from the next line start), train the rest.
    max_bytes: reading stops after the document that reaches this many UTF-8 bytes (counted
        within the split); None reads the whole source. Of a single text file, at most this
        many bytes of the split's range are read.
    stdlib_max_file_bytes: stdlib files larger than this are skipped.
    text_field: the JSON field / parquet or dataset column holding the text.
    dataset_split: the split of a saved `DatasetDict` (ignored for a single `Dataset`).
    """

    source: str = STDLIB_SOURCE
    split: str = "train"
    held_out_fraction: float = 0.05
    max_bytes: int | None = DEFAULT_MAX_BYTES
    stdlib_max_file_bytes: int = 200_000
    text_field: str = "text"
    dataset_split: str = "train"

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(f"source must be 'stdlib' or a path, got {self.source!r}")
        require_choice("split", self.split, SPLITS)
        require_fraction("held_out_fraction", self.held_out_fraction)
        if self.max_bytes is not None:
            require_int("max_bytes", self.max_bytes, minimum=1)
        require_int("stdlib_max_file_bytes", self.stdlib_max_file_bytes, minimum=1)
        if not isinstance(self.text_field, str) or not self.text_field:
            raise ValueError(f"text_field must be a non-empty str, got {self.text_field!r}")


def held_out_score(key: str) -> float:
    """A uniform number in [0, 1) fixed by `key`: the first 8 bytes of its SHA-1."""
    digest = hashlib.sha1(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def in_split(key: str, split: str, held_out_fraction: float) -> bool:
    """Whether the item named by `key` belongs to `split` (`"all"` takes everything)."""
    if split == "all":
        return True
    held_out = held_out_score(key) < held_out_fraction
    return held_out == (split == "held_out")


def stdlib_root() -> Path:
    """The directory of the running Python's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(config: CorpusConfig) -> list[str]:
    """Relative POSIX paths of the stdlib files of `config.split`, in the corpus order.

    The order is that of `held_out_score`, a pure function of the path: a byte cap then keeps a
    sample of the whole library rather than the modules that sort first alphabetically.
    """
    root = stdlib_root()
    found: list[str] = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in STDLIB_EXCLUDED_DIRS]
        for name in files:
            path = Path(directory, name)
            if name.endswith(".py") and path.stat().st_size <= config.stdlib_max_file_bytes:
                found.append(path.relative_to(root).as_posix())
    return split_by_name(found, config)


def split_by_name(names: Iterable[str], config: CorpusConfig) -> list[str]:
    """The names of `config.split`, in the corpus order: that of `held_out_score`, a pure
    function of the name (the stdlib's files and a pinned file set's documents)."""
    chosen = [n for n in names if in_split(n, config.split, config.held_out_fraction)]
    return sorted(chosen, key=lambda n: (held_out_score(n), n))


def read_text_file(path: str | Path) -> Iterator[str]:
    """The whole file as one document (nothing when it is empty)."""
    path = Path(path)
    text = _decode(path.read_bytes(), path)
    if text:
        yield text


def _decode(raw: bytes, path: Path, *, first_line: int = 1) -> str:
    """`raw` as UTF-8, or a DataError naming the file and line of the first invalid byte."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = first_line + raw.count(b"\n", 0, error.start)
        raise DataError(
            f"{path}:{line} is not valid UTF-8 (byte {raw[error.start]:#04x}); documents must "
            "be UTF-8 text"
        ) from None


def read_text_range(
    path: str | Path, split: str, held_out_fraction: float, max_bytes: int | None = None
) -> Iterator[str]:
    """The part of one text file that belongs to `split`, as one document.

    The held-out part is the last `held_out_fraction` of the file's bytes, moved forward to the
    next line start (when one lies within 64 KiB; else to a character boundary); the train part
    is everything before it, `"all"` the whole file. At most `max_bytes` bytes of the part are
    read, cut back to a line end where there is one, so a large file is never read in full.
    """
    path = Path(path)
    require_choice("split", split, SPLITS)
    size = path.stat().st_size
    with path.open("rb") as file:
        cut = _split_point(file, size, held_out_fraction)
        start, stop = {"train": (0, cut), "held_out": (cut, size), "all": (0, size)}[split]
        length = stop - start if max_bytes is None else min(stop - start, max_bytes)
        file.seek(start)
        raw = file.read(length)
    if length < stop - start:
        # Capped: end at a line end, or at least not inside a multi-byte character.
        raw = raw[: raw.rfind(b"\n") + 1 or _complete_chars(raw)]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        # Only now are the lines before `start` worth counting, to name the line.
        with path.open("rb") as file:
            before = file.read(start).count(b"\n")
        text = _decode(raw, path, first_line=1 + before)
    if text:
        yield text


def _split_point(file, size: int, held_out_fraction: float) -> int:
    """Where the held-out part of a single text file begins: a line start (or a character
    boundary) at or after the last `held_out_fraction` of its bytes."""
    target = size - round(size * held_out_fraction)
    if target <= 0 or target >= size:
        return target
    file.seek(target - 1)
    window = file.read(_LINE_SEARCH_BYTES + 1)
    newline = window.find(b"\n")
    if newline >= 0:
        return target + newline
    index = 1
    while index < len(window) and window[index] & 0xC0 == 0x80:  # a continuation byte
        index += 1
    return target - 1 + index


def _complete_chars(raw: bytes) -> int:
    """The length of `raw` without a UTF-8 character cut off at its end."""
    for back in range(1, min(4, len(raw)) + 1):
        lead = raw[-back]
        if lead & 0xC0 != 0x80:  # not a continuation byte: the last character starts here
            need = 1 if lead < 0x80 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
            return len(raw) - back if back < need else len(raw)
    return len(raw)


def read_jsonl(path: str | Path, text_field: str = "text") -> Iterator[str]:
    """One document per non-blank line, from the string field `text_field` of its JSON object."""
    path = Path(path)
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            line = _decode(raw, path, first_line=number)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{path}:{number} is not valid JSON: {error}") from error
            text = record.get(text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise DataError(
                    f"{path}:{number} must be a JSON object with a string field {text_field!r}, "
                    f"got {type(record).__name__} {line.strip()[:80]!r}"
                )
            if text:
                yield text


def read_parquet(path: str | Path, text_field: str = "text") -> Iterator[str]:
    """One document per row of the string column `text_field`, read in record batches."""
    path = Path(path)
    try:
        import pyarrow.parquet as pq
    except ImportError as error:
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from error
    table = pq.ParquetFile(path)
    if text_field not in table.schema_arrow.names:
        raise DataError(
            f"{path} has no column {text_field!r}; its columns are {table.schema_arrow.names}"
        )
    for batch in table.iter_batches(columns=[text_field]):
        for text in batch.column(0).to_pylist():
            if text:
                yield str(text)


def read_hf_dataset(
    path: str | Path, text_field: str = "text", dataset_split: str = "train"
) -> Iterator[str]:
    """The column `text_field` of a dataset saved with `datasets`' `save_to_disk`."""
    path = Path(path)
    try:
        import datasets
    except ImportError as error:
        raise ImportError(
            f"reading the saved dataset {path} needs datasets: pip install datasets"
        ) from error
    dataset = datasets.load_from_disk(str(path))
    if isinstance(dataset, datasets.DatasetDict):
        if dataset_split not in dataset:
            raise DataError(
                f"dataset_split {dataset_split!r} is not in {path}; it has {list(dataset)}"
            )
        dataset = dataset[dataset_split]
    if text_field not in dataset.column_names:
        raise DataError(
            f"{path} has no column {text_field!r}; its columns are {dataset.column_names}"
        )
    for batch in dataset.select_columns([text_field]).iter(batch_size=1024):
        for text in batch[text_field]:
            if text:
                yield str(text)


def is_hf_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / marker).is_file() for marker in HF_DATASET_MARKERS)


def document_files(directory: str | Path) -> list[Path]:
    """The `.txt`, `.jsonl` and `.parquet` files below `directory`, sorted by relative path."""
    directory = Path(directory)
    found = [
        p
        for p in directory.rglob("*")
        if p.is_file() and p.suffix in DOCUMENT_SUFFIXES and not p.name.startswith(".")
    ]
    return sorted(found, key=lambda p: p.relative_to(directory).as_posix())


def read_file(path: Path, text_field: str = "text") -> Iterator[str]:
    """The documents of one file, by its suffix: `.jsonl`, `.parquet`, else plain text."""
    if path.suffix == ".jsonl":
        return read_jsonl(path, text_field)
    if path.suffix == ".parquet":
        return read_parquet(path, text_field)
    return read_text_file(path)


def read_directory(directory: str | Path, text_field: str = "text") -> Iterator[str]:
    """The documents of every `.txt`, `.jsonl` and `.parquet` file below `directory`.

    An empty directory is refused here, at the call, not at the first `next()`.
    """
    files = _require_document_files(Path(directory))
    return (text for path in files for text in read_file(path, text_field))


def iter_documents(config: CorpusConfig) -> Iterator[str]:
    """The documents of `config.source` in its split, in a fixed order, up to `max_bytes`.

    Raises `DataError` (a ValueError) naming the source when the path is missing or a directory holds no
    document file (at the call), or when no document is left (at the end of the iteration:
    empty files, or everything in the other split).
    """
    if config.source == STDLIB_SOURCE:
        root = stdlib_root()
        # Sources are UTF-8 unless a coding line says otherwise (PEP 3120); such a rare file is
        # read with replacement characters rather than ending the run.
        texts: Iterator[str] = (
            (root / relative).read_bytes().decode("utf-8", errors="replace")
            for relative in stdlib_files(config)
        )
        # Stdlib files are split by path, above; user documents by their text, below.
        return _capped(texts, config, split_by_text=False)
    if is_file_set(config.source):
        return _capped(_file_set_texts(config), config, split_by_text=False)
    path = _require_path(config.source)
    if _is_text_file(path):
        texts = read_text_range(path, config.split, config.held_out_fraction, config.max_bytes)
        why = (
            f"the file is empty or too short to give both splits a part with "
            f"held_out_fraction={config.held_out_fraction}"
        )
        return _capped(texts, config, split_by_text=False, why=why)
    return _capped(_read_source(path, config), config, split_by_text=True)


def _file_set_texts(config: CorpusConfig) -> Iterator[str]:
    """The documents of a pinned file set (`deltalab.data.pinned`), split and ordered by name as
    the stdlib's files are, decoded as they are."""
    documents = file_set_documents(config.source)
    for name in split_by_name(documents, config):
        yield documents[name].decode("utf-8", errors="replace")


def resolve_source(source: str) -> str:
    """`source` with its path made absolute (`"stdlib"` as is; `@LIST` keeps its `@`): one cache
    entry per source however its path is spelled."""
    if source == STDLIB_SOURCE:
        return source
    if source.startswith(FILE_LIST_PREFIX):
        return FILE_LIST_PREFIX + str(Path(source[len(FILE_LIST_PREFIX) :]).resolve())
    return str(Path(source).resolve())


def source_path(source: str) -> Path | None:
    """The file or directory `source` reads (the list of `@LIST`); None for `"stdlib"`."""
    if source == STDLIB_SOURCE:
        return None
    return Path(source[len(FILE_LIST_PREFIX) :] if source.startswith(FILE_LIST_PREFIX) else source)


def _is_text_file(path: Path) -> bool:
    """A source that is one plain-text file, hence one document, split by position."""
    return path.is_file() and path.suffix not in (".jsonl", ".parquet")


def _capped(
    texts: Iterator[str], config: CorpusConfig, *, split_by_text: bool, why: str = ""
) -> Iterator[str]:
    count, total = 0, 0
    for text in texts:
        if not text:
            continue
        if split_by_text and not in_split(text, config.split, config.held_out_fraction):
            continue
        yield text
        count += 1
        total += len(text.encode("utf-8"))
        if config.max_bytes is not None and total >= config.max_bytes:
            return
    if count == 0:
        why = why or (
            "empty files, or every document fell in the other split with "
            f"held_out_fraction={config.held_out_fraction}; split='all' takes every document"
        )
        raise DataError(f"no documents in split {config.split!r} of {config.source} ({why})")


def source_fingerprint(config: CorpusConfig) -> str:
    """SHA-1 over the config and the bytes of every file the source reads.

    Reading the files again costs far less than tokenizing them, and unlike sizes and mtimes the
    bytes cannot change unnoticed.
    """
    digest = hashlib.sha1()
    settings = dataclasses.asdict(config)
    settings["fingerprint_version"] = FINGERPRINT_VERSION
    digest.update(json.dumps(settings, sort_keys=True).encode("utf-8"))
    for name, path in _source_files(config):
        digest.update(name.encode("utf-8") + b"\0")
        with path.open("rb") as handle:
            while chunk := handle.read(_HASH_CHUNK):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()


def _require_path(source: str) -> Path:
    path = Path(source)
    if not path.exists():
        raise DataError(f"source {source!r} is neither 'stdlib' nor an existing file or directory")
    if not (path.is_file() or path.is_dir()):
        # A device such as /dev/zero, a pipe or a socket can be read without end.
        raise DataError(
            f"source {source!r} is not a regular file or directory (a device, pipe or socket "
            "has no end to read to); save the text to a file and point at that"
        )
    return path


def _require_document_files(directory: Path) -> list[Path]:
    files = document_files(directory)
    if not files:
        raise DataError(
            f"directory {directory} holds no document file; expected files ending in "
            f"{' or '.join(DOCUMENT_SUFFIXES)}, or a dataset saved by `datasets`"
        )
    return files


def _read_source(path: Path, config: CorpusConfig) -> Iterator[str]:
    if is_hf_dataset(path):
        return read_hf_dataset(path, config.text_field, config.dataset_split)
    if path.is_dir():
        return read_directory(path, config.text_field)
    return read_file(path, config.text_field)


def _source_files(config: CorpusConfig) -> list[tuple[str, Path]]:
    """(name, path) of every file the source depends on, in a fixed order."""
    if config.source == STDLIB_SOURCE:
        root = stdlib_root()
        everything = dataclasses.replace(config, split="all")
        return [(name, root / name) for name in sorted(stdlib_files(everything))]
    if is_file_set(config.source):
        return file_set_files(config.source)
    path = _require_path(config.source)
    if not path.is_dir():
        return [(path.name, path)]
    files = (
        sorted(p for p in path.rglob("*") if p.is_file())
        if is_hf_dataset(path)
        else _require_document_files(path)
    )
    return [(p.relative_to(path).as_posix(), p) for p in files]
