"""Pinned file sets: a corpus given as an archive or a list of files, so that the data a run
reads no longer depends on the machine (the built-in `"stdlib"` corpus is the running Python's
standard library, whose files, and hence held-out split, change with the Python version).

- an archive, `.tar`, `.tar.gz`/`.tgz`, `.tar.bz2`, `.tar.xz` or `.zip`: every regular member
  file is one document, named by its path inside the archive (a leading `./` dropped);
- a file list, `@LIST`: LIST names one file per line (relative paths are relative to LIST's
  folder; blank lines and lines starting with `#` are skipped); each file is one document,
  named by its line.

A file set is split and ordered as the stdlib corpus is: by the hash of each document's name
(`held_out_score`), so `archive_stdlib("py312.tar.gz")` gives, on any machine, the documents,
split and order the built-in source gives on the Python that wrote it. Documents are decoded as
UTF-8 with invalid bytes replaced, as the stdlib's are. An archive is read into memory once per
pass over it; keep corpora larger than memory as directories of `.jsonl` or `.parquet` files.
"""

from __future__ import annotations

import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

from deltalab.errors import DataError

__all__ = [
    "ARCHIVE_SUFFIXES",
    "FILE_LIST_PREFIX",
    "archive_stdlib",
    "file_set_documents",
    "file_set_files",
    "file_set_path",
    "is_file_set",
]

ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".zip")
FILE_LIST_PREFIX = "@"


def is_archive(path: str | Path) -> bool:
    return str(path).lower().endswith(ARCHIVE_SUFFIXES)


def is_file_set(source: str) -> bool:
    """Whether `source` names a file list (`@LIST`) or an archive."""
    return source.startswith(FILE_LIST_PREFIX) or is_archive(source)


def file_set_path(source: str) -> Path:
    """The file behind a file-set source: the list of `@LIST`, or the archive."""
    path = Path(source[len(FILE_LIST_PREFIX) :] if source.startswith(FILE_LIST_PREFIX) else source)
    if not path.is_file():
        what = "file list" if source.startswith(FILE_LIST_PREFIX) else "archive"
        raise DataError(f"source {source!r}: the {what} {str(path)!r} is not an existing file")
    return path


def listed_files(source: str) -> list[tuple[str, Path]]:
    """(name, path) of each file `@LIST` names, in the list's order."""
    listing = file_set_path(source)
    found = []
    for number, line in enumerate(listing.read_text(encoding="utf-8").splitlines(), start=1):
        name = line.strip()
        if not name or name.startswith("#"):
            continue
        path = Path(name) if Path(name).is_absolute() else listing.parent / name
        if not path.is_file():
            raise DataError(f"{listing}:{number}: {name!r} is not an existing file")
        found.append((name, path))
    if not found:
        raise DataError(f"file list {str(listing)!r} names no file")
    return found


def _archive_members(path: Path) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of every regular file of the archive, in the archive's order."""
    try:
        if path.name.lower().endswith(".zip"):
            with zipfile.ZipFile(path) as archive:
                for info in archive.infolist():
                    if not info.is_dir():
                        yield _member_name(info.filename), archive.read(info)
            return
        with tarfile.open(path) as archive:
            for member in archive:
                if member.isfile():
                    handle = archive.extractfile(member)
                    assert handle is not None
                    yield _member_name(member.name), handle.read()
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError) as error:
        raise DataError(f"archive {str(path)!r} cannot be read: {error}") from None


def _member_name(name: str) -> str:
    return name[2:] if name.startswith("./") else name


def file_set_documents(source: str) -> dict[str, bytes]:
    """Every document of the file set by name, as bytes (names must be unique)."""
    if source.startswith(FILE_LIST_PREFIX):
        pairs: Iterator[tuple[str, bytes]] = (
            (name, path.read_bytes()) for name, path in listed_files(source)
        )
    else:
        pairs = _archive_members(file_set_path(source))
    documents: dict[str, bytes] = {}
    for name, raw in pairs:
        if name in documents:
            raise DataError(f"source {source!r} names the document {name!r} twice")
        documents[name] = raw
    if not documents:
        raise DataError(f"source {source!r} holds no file")
    return documents


def file_set_files(source: str) -> list[tuple[str, Path]]:
    """(name, path) of every file the source's documents depend on, for its fingerprint: the
    archive, or the list and each file it names."""
    path = file_set_path(source)
    if not source.startswith(FILE_LIST_PREFIX):
        return [(path.name, path)]
    return [(f"{FILE_LIST_PREFIX}{path.name}", path), *listed_files(source)]


def archive_stdlib(path: str | Path, stdlib_max_file_bytes: int | None = None) -> Path:
    """Writes the built-in corpus's files (the running Python's standard library, as the
    `"stdlib"` source selects them) to the archive `path`, named by their path in the library,
    so that `data.source=PATH` reads the same documents anywhere. Returns `path`."""
    from deltalab.data.corpus import CorpusConfig, stdlib_files, stdlib_root

    path = Path(path)
    if not is_archive(path) or path.name.lower().endswith(".zip"):
        raise ValueError(f"path must end in one of {ARCHIVE_SUFFIXES[:-1]}, got {str(path)!r}")
    config = CorpusConfig(split="all")
    if stdlib_max_file_bytes is not None:
        config = CorpusConfig(split="all", stdlib_max_file_bytes=stdlib_max_file_bytes)
    root = stdlib_root()
    mode = {".gz": "w:gz", ".tgz": "w:gz", ".bz2": "w:bz2", ".xz": "w:xz"}.get(path.suffix, "w")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, mode) as archive:
        for name in sorted(stdlib_files(config)):
            archive.add(root / name, arcname=name, recursive=False)
    return path
