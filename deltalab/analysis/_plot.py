"""Figures for the analysis helpers: made without pyplot, written atomically.

`matplotlib.figure.Figure` used directly has no global state and renders through Agg, so these
helpers work headless and in threads; the file appears complete or not at all.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

__all__ = ["finish_figure", "new_figure", "save_figure"]

# Permissions of a written figure (mkstemp creates 0600 files): readable by everyone.
FIGURE_MODE = 0o644


def new_figure(**kwargs: Any) -> Figure:
    """A pyplot-free `Figure` (constrained layout unless `layout` is given)."""
    kwargs.setdefault("layout", "constrained")
    return Figure(**kwargs)


def save_figure(figure: Figure, path: str | os.PathLike[str], *, dpi: int = 120) -> Path:
    """Writes `figure` to `path` (format from the suffix, PNG without one) through a temporary
    file in the same folder and `os.replace`, so a reader never sees a half-written file.
    Creates the folder if needed; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    file_format = path.suffix.lstrip(".").lower() or "png"
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as stream:
            figure.savefig(stream, format=file_format, dpi=dpi)
        os.chmod(temporary, FIGURE_MODE)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    return path


def finish_figure(
    figure: Figure, axes: Any, path: str | os.PathLike[str], legend_size: int
) -> Path:
    """The figures' common close: a light grid and the legend (`legend_size` points) on `axes`,
    then `figure` saved to `path` (`save_figure`); returns the path."""
    axes.grid(alpha=0.3)
    axes.legend(fontsize=legend_size)
    return save_figure(figure, path)
