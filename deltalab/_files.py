"""Files written whole or not at all."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["write_text_atomically"]


def write_text_atomically(path: Path, text: str) -> None:
    """`text` (UTF-8) to `path` through a hidden temporary file beside it and `os.replace`: a
    reader never sees half a file, and a failed write leaves no temporary file behind."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(text, encoding="utf-8")
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
