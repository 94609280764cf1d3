"""One trainer per run directory.

`deltalab train` holds an exclusive lock on `<log.out_dir>/.train.lock` from before it reads the
directory until it exits, so a second trainer in the same directory (a study run again while an
earlier study's run still trains, or a trainer started by hand) is refused in one line naming the
process that holds it. Two trainers in one directory would prune and overwrite each other's
checkpoints.

The lock is `flock(2)` on an open file, which the kernel drops when the process ends, however it
ends (SIGKILL and the out-of-memory killer included): a killed trainer leaves no stale lock to
clear by hand. The file holds the holder's pid for the refusal message; the file being there
means nothing by itself.

A trainer that created its directory and fails before it records anything removes what it
created, so a failed start leaves nothing that looks like a run: the files the run names as
discardable, the lock file (still held, so no second trainer can come between), then each
directory it created, by `rmdir` alone. A directory holding anything else (a checkpoint, metrics)
is not empty and stays whole; a directory that was there before is never removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from deltalab.errors import CheckpointError

__all__ = ["LOCK_NAME", "hold_run_directory"]

LOCK_NAME = ".train.lock"


@contextlib.contextmanager
def hold_run_directory(out_dir: Path, discardable: Callable[[Path], list[Path]]) -> Iterator[None]:
    """Holds `out_dir`'s trainer lock (creating the directory); CheckpointError naming the pid
    of the process that holds it already. A block that raises removes the directories this call
    created when nothing but `discardable(out_dir)` and the lock file is in them."""
    # Absolute and without "..": the directories created are then exactly the missing ancestors
    # of the directory the run writes to (with "typo/../run", "typo" is not one of them).
    out_dir = Path(os.path.abspath(out_dir))
    created = next((p for p in (*reversed(out_dir.parents), out_dir) if not p.exists()), None)
    out_dir.mkdir(parents=True, exist_ok=True)
    # "a+", not "w": opening must not erase the holder's pid before the lock is known to be ours.
    with open(out_dir / LOCK_NAME, "a+", encoding="utf-8") as handle:
        _lock(handle, out_dir)
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        try:
            yield
        except BaseException:
            if created is not None:
                _remove_created(out_dir, created, discardable)
            raise


def _lock(handle, out_dir: Path) -> None:
    """flock on `handle`, refused with the holder's pid. A lock taken on a file that a failed
    trainer removed meanwhile (it unlinks its lock file while holding it) is a lock on nothing:
    refused too, as in use, since the directory is being taken down."""
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        current = os.stat(out_dir / LOCK_NAME).st_ino
    except (BlockingIOError, FileNotFoundError):
        current = None
    if current is not None and current == os.fstat(handle.fileno()).st_ino:
        return
    handle.seek(0)
    # Empty while the holder is between taking the lock and writing its pid.
    holder = handle.read().strip() or "unknown"
    raise CheckpointError(
        f"log.out_dir {str(out_dir)!r} is in use by another trainer (pid {holder}); "
        f"wait for it to finish or stop it (kill {holder}), or choose another log.out_dir"
    )


def _remove_created(
    out_dir: Path, created: Path, discardable: Callable[[Path], list[Path]]
) -> None:
    """When `out_dir` holds nothing but `discardable(out_dir)` and the lock file, removes them
    (the lock file last) and the directories from `out_dir` up to `created`; anything else in it
    (a checkpoint a run made before logging a step, say) keeps them all. Best effort: the run's
    own error is the one reported."""
    try:
        removable = discardable(out_dir)
        kept = {p.name for p in removable} | {LOCK_NAME}
        if any(entry.name not in kept for entry in out_dir.iterdir()):
            return
        for path in removable:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        if [p.name for p in out_dir.iterdir()] != [LOCK_NAME]:
            return
        (out_dir / LOCK_NAME).unlink()
        for directory in (out_dir, *out_dir.parents):
            directory.rmdir()
            if directory == created:
                return
    except OSError:
        return
