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
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from deltalab.errors import CheckpointError

__all__ = ["LOCK_NAME", "hold_run_directory"]

LOCK_NAME = ".train.lock"


@contextlib.contextmanager
def hold_run_directory(out_dir: Path) -> Iterator[None]:
    """Holds `out_dir`'s trainer lock (creating the directory); CheckpointError naming the pid
    of the process that holds it already."""
    out_dir.mkdir(parents=True, exist_ok=True)
    # "a+", not "w": opening must not erase the holder's pid before the lock is known to be ours.
    with open(out_dir / LOCK_NAME, "a+", encoding="utf-8") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            # Empty while the holder is between taking the lock and writing its pid.
            holder = handle.read().strip() or "unknown"
            raise CheckpointError(
                f"log.out_dir {str(out_dir)!r} is in use by another trainer (pid {holder}); "
                f"wait for it to finish or stop it (kill {holder}), or choose another log.out_dir"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        yield
