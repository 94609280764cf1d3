"""Checkpoint I/O that never loses a run: atomic writes, verified reads, RNG state, clean stops.

Layout under a run directory::

    run_dir/checkpoints/step_00001000.pt          torch.save(payload)
    run_dir/checkpoints/step_00001000.pt.sha256   "<hex digest>  step_00001000.pt" (sha256sum -c)

Both files are written to a temporary file in the same directory, flushed, fsynced and renamed
over the final name (`os.replace` is atomic within one file system), so a crash leaves either the
old file, the new file, or a stale `.step_*.tmp` that nothing reads. A checkpoint is *complete*
when its sidecar exists and names the SHA-256 of the file; the loader skips anything else with a
`CheckpointWarning` and falls back to the previous complete one.

Trust: payloads are read with `torch.load(weights_only=True)`, which rebuilds tensors, plain
containers and NumPy arrays of plain data (the RNG state of older checkpoints) and refuses any
other object, so a checkpoint cannot run code when it is loaded. The digest guards against
truncation and corruption, not tampering: whoever can write the run directory can write a
matching digest, so a tampered file loads wrong numbers, never code.

Pruning deletes only checkpoints it verified (complete ones older than the newest `keep`):
files it cannot verify, such as checkpoints copied without their `.sha256`, are left for the user.

A distributed run writes sharded checkpoints instead, directories `step_00001000/` with the
same guarantees (`deltalab.train.sharded`); the functions here list, verify, load the state of
and prune both kinds. A single process writes single files, readable by `sha256sum -c` and
loadable whole; either kind resumes on any number of ranks.

One process prunes a run's checkpoints (rank 0 in a distributed run), after the save:
`prune_checkpoints` deletes temporary files it finds, which would break a save running
concurrently.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
import signal
import threading
import uuid
import warnings
from collections.abc import Collection
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import numpy as np
import torch

from deltalab.errors import CheckpointError
from deltalab.train.config import resume_changes

__all__ = [
    "PAYLOAD_KEYS",
    "CheckpointWarning",
    "GracefulStop",
    "capture_rng_state",
    "find_latest_checkpoint",
    "list_checkpoints",
    "load_latest_checkpoint",
    "prune_checkpoints",
    "restore_rng_state",
    "resumable_checkpoint",
    "sampler_state_for",
    "save_checkpoint",
]

CHECKPOINT_DIR = "checkpoints"
DIGEST_SUFFIX = ".sha256"
_CHECKPOINT_NAME = re.compile(r"step_(\d+)\.pt")
_SHARDED_NAME = re.compile(r"step_(\d+)")
_TEMP_GLOB = ".step_*.tmp"
# What a NumPy array unpickles through: checkpoints written before the RNG state was stored as
# tensors hold NumPy's key array. These build arrays of plain data only (an object array's items
# still pass the weights-only unpickler), the allow-list PyTorch documents for NumPy.
_NUMPY_ARRAY_GLOBALS = [
    np.ndarray,
    (getattr(np, "_core", None) or np.core).multiarray._reconstruct,
    np.dtype,
    type(np.dtype(np.uint32)),  # the key array's dtype class (numpy.dtypes.UInt32DType)
]


class CheckpointWarning(UserWarning):
    """A checkpoint on disk was skipped (incomplete or unreadable) or a state could not be
    restored exactly."""


def save_checkpoint(run_dir: str | Path, step: int, payload: dict[str, Any]) -> Path:
    """Write `payload` as `run_dir/checkpoints/step_{step:08d}.pt` atomically, then its digest.

    The payload is anything `torch.save` pickles: state dicts of model, optimizer and scheduler,
    sampler position, `capture_rng_state()`, config, step, metrics. Saving a step that already
    exists replaces it; until the new sidecar lands that step counts as incomplete.
    Returns the path of the checkpoint file.
    """
    if step < 0:
        raise ValueError(f"step must be non-negative, got {step}")
    directory = Path(run_dir) / CHECKPOINT_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step_{step:08d}.pt"
    sidecar = _sidecar(path)

    temp = _temp_path(path)
    try:
        with open(temp, "xb") as file:
            torch.save(payload, file)
            file.flush()
            os.fsync(file.fileno())
        digest = _sha256(temp)
        # A stale sidecar of an earlier save of this step would otherwise name the old digest.
        sidecar.unlink(missing_ok=True)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _fsync_directory(directory)
    _write_atomically(sidecar, f"{digest}  {path.name}\n".encode())
    _fsync_directory(directory)
    return path


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoints of a run, files and sharded directories, sorted by step ascending (a file
    before a directory of the same step); complete or not, temporary ones excluded."""
    directory = Path(run_dir) / CHECKPOINT_DIR
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        if (match := _CHECKPOINT_NAME.fullmatch(path.name)) and path.is_file():
            found.append((int(match.group(1)), 0, path))
        elif (match := _SHARDED_NAME.fullmatch(path.name)) and path.is_dir():
            found.append((int(match.group(1)), 1, path))
    return [path for *_, path in sorted(found)]


def find_latest_checkpoint(
    run_dir: str | Path,
    *,
    map_location: str | torch.device = "cpu",
    required: Collection[str] = (),
) -> tuple[tuple[Path, dict[str, Any]] | None, list[tuple[Path, str]]]:
    """The newest usable checkpoint as `(path, payload)` (or None), and the newer ones skipped.

    A checkpoint is usable when its digests match, `torch.load(weights_only=True)` reads it, and
    its payload is a dict holding every key in `required`. The payload of a sharded checkpoint
    (a directory) is its state file: the tensors stay in the shards (`sharded.ARRAY_KEYS`),
    for `sharded.load_sharded_arrays`. The second item lists each skipped checkpoint (newest
    first) with the reason; when the first is None, it lists every checkpoint of the run.
    """
    from deltalab.train import sharded

    skipped: list[tuple[Path, str]] = []
    for path in reversed(list_checkpoints(run_dir)):
        problem = _completeness_problem(path)
        needed = [key for key in required if not (path.is_dir() and key == "model")]
        if problem is None:
            try:
                if path.is_dir():
                    payload = sharded.load_sharded_state(path, map_location)
                else:
                    with torch.serialization.safe_globals(_NUMPY_ARRAY_GLOBALS):
                        payload = torch.load(path, map_location=map_location, weights_only=True)
            except sharded.UnsafeMetadataError as error:
                problem = str(error)
            except Exception as error:
                problem = _load_problem(error)
            else:
                if not isinstance(payload, dict):
                    problem = f"payload is a {type(payload).__name__}, not a dict"
                elif missing := [key for key in needed if key not in payload]:
                    problem = f"payload lacks {missing}"
                else:
                    return (path, payload), skipped
        skipped.append((path, problem))
    return None, skipped


def _load_problem(error: Exception) -> str:
    """Why `torch.load(weights_only=True)` did not load a file, on one line: what it refused and
    why, without torch's advice to load with `weights_only=False` (which would run the file's
    code) or its pointer to the documentation."""
    advice = ("weights_only", "Weights only load failed", "documentation", "trusted source")
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    reasons = [line for line in lines if not any(words in line for words in advice)]
    reason = reasons[0].rstrip(".") if reasons else type(error).__name__
    if "global" in reason.lower():
        # A global (a function, a class) is what a pickle calls to build an object.
        return (
            f"torch.load(weights_only=True) refused it: {reason}; a checkpoint holds tensors "
            "and plain containers only, and unpickling anything else could run code"
        )
    return f"torch.load(weights_only=True) failed ({type(error).__name__}: {reason})"


def load_latest_checkpoint(
    run_dir: str | Path,
    *,
    map_location: str | torch.device = "cpu",
    required: Collection[str] = (),
) -> tuple[Path, dict[str, Any]] | None:
    """The newest complete and loadable checkpoint as `(path, payload)`, or None if there is none.

    Newer checkpoints with a missing or wrong digest, that `torch.load(weights_only=True)`
    rejects, or whose payload lacks a `required` key, are skipped with a `CheckpointWarning`
    naming the file and the reason.
    """
    found, skipped = find_latest_checkpoint(run_dir, map_location=map_location, required=required)
    for path, problem in skipped:
        warnings.warn(
            f"skipping checkpoint {path}: {problem}; falling back to an earlier one",
            CheckpointWarning,
            stacklevel=2,
        )
    return found


def prune_checkpoints(run_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints; returns the deleted paths.

    Only checkpoints whose digest this call verified are deleted, with their sidecars; one it
    cannot verify (no sidecar, a wrong digest: copied without its `.sha256`, or damaged) is
    never deleted, since it may be the only copy of a run. Also deleted: orphan sidecars and
    stale temporary files of interrupted saves, which nothing reads. `keep >= 1`, so the newest
    complete checkpoint always survives.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1 so the newest checkpoint survives, got {keep}")
    directory = Path(run_dir) / CHECKPOINT_DIR
    if not directory.is_dir():
        return []
    complete = [path for path in list_checkpoints(run_dir) if _completeness_problem(path) is None]
    doomed = complete[: max(0, len(complete) - keep)]
    doomed += [_sidecar(path) for path in doomed]
    doomed += [
        sidecar
        for sidecar in directory.glob(f"step_*.pt{DIGEST_SUFFIX}")
        if not sidecar.with_suffix("").exists()
    ]
    doomed += directory.glob(_TEMP_GLOB)
    deleted = []
    for path in sorted(set(doomed)):
        if path.is_dir():
            shutil.rmtree(path)
            deleted.append(path)
        elif path.is_file():
            path.unlink()
            deleted.append(path)
    return deleted


def capture_rng_state() -> dict[str, Any]:
    """The global RNG states: Python `random`, NumPy, torch CPU, and every CUDA device if any.

    Only tensors, tuples, ints, floats and strings, so that `torch.load(weights_only=True)`
    reads them back: NumPy's key array is stored as an int64 tensor.
    """
    # The global NumPy state is the one third-party code draws from, hence the legacy API.
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()  # noqa: NPY002
    return {
        "python": random.getstate(),
        "numpy": (
            str(kind),
            torch.from_numpy(keys.astype(np.int64)),
            int(position),
            int(has_gauss),
            float(cached_gaussian),
        ),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore what `capture_rng_state` returned, so the same numbers are drawn again.

    CUDA states are restored for the devices present in both; a different device count means the
    run cannot continue bit for bit, which is warned about rather than ignored.
    """
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
    np.random.set_state((kind, keys.astype(np.uint32), *rest))  # noqa: NPY002
    torch.set_rng_state(state["torch"].cpu())
    saved = list(state.get("cuda", []))
    present = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if len(saved) != present:
        warnings.warn(
            f"RNG state holds {len(saved)} CUDA device(s) but {present} are present; "
            f"restoring the first {min(len(saved), present)}",
            CheckpointWarning,
            stacklevel=2,
        )
    for device, device_state in enumerate(saved[:present]):
        torch.cuda.set_rng_state(device_state.cpu(), device)


def sampler_state_for(state: dict[str, Any], world_size: int) -> dict[str, Any]:
    """A `ResumableSampler` state saved at `state["world_size"]` ranks, for `world_size` ranks.

    The ranks are those that deal the data: a run's data-parallel ranks (its processes over
    train.context_parallel), whose samplers these are. The ranks' draws interleave one epoch's
    permutation (rank r takes every world_size-th index from r), so after `position` draws per
    rank the run has used the permutation's first `position * world_size` indices, whatever the
    world size: the other world size continues from there and each step draws the same windows
    as the uninterrupted run, up to the end of the epoch. There each world size drops the
    permutation's last `num_windows % world_size` indices, so a run resumed on another world
    size differs from then by those few windows. Raises ValueError where the indices used do
    not split evenly over `world_size` ranks.
    """
    saved = int(state["world_size"])
    if saved == world_size:
        return state
    used = int(state["position"]) * saved
    if used % world_size:
        raise ValueError(
            f"the checkpoint's data position ({used} windows of epoch {state['epoch']}) does not "
            f"split over {world_size} data-parallel ranks (the ranks over "
            f"train.context_parallel); resume on a number that divides it (it was saved on "
            f"{saved})"
        )
    return {**state, "world_size": world_size, "position": used // world_size}


# What `resumable_checkpoint` requires of a payload (a sharded checkpoint's "model" and the
# optimizer's state are in its shards); one without them is skipped like a damaged file.
PAYLOAD_KEYS = ("step", "model", "optimizer", "scheduler", "sampler", "rng", "config", "history")


def resumable_checkpoint(
    run_dir: str | Path, config: dict[str, Any], data_world_size: int
) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint a run resumes from: the newest usable one of `run_dir` as `(path,
    payload)`, its sampler state converted for the run's `data_world_size` data-parallel ranks
    (`sampler_state_for`), or None where the run has no checkpoint.

    config: the resuming run's config (`RunConfig.to_dict()`), which may differ from the
    checkpoint's only in the fields that do not change what is computed (`resume_changes`).
    Newer checkpoints that cannot be used are skipped with a `CheckpointWarning`. Raises
    CheckpointError where there are checkpoints and none can be used, where the config changed,
    and where the data position does not split over the data-parallel ranks.
    """
    run_dir = Path(run_dir)
    found, skipped = find_latest_checkpoint(run_dir, required=PAYLOAD_KEYS)
    if found is None:
        if skipped:
            raise _unusable_checkpoints(run_dir, skipped)
        return None
    for skipped_path, problem in skipped:
        # Not deleted: pruning leaves files it cannot verify, and a save of the same step
        # replaces it only once the run has recomputed that step.
        warnings.warn(
            f"skipping checkpoint {skipped_path}: {problem}; resuming from {found[0].name}",
            CheckpointWarning,
            stacklevel=2,
        )
    path, payload = found
    changed = resume_changes(payload["config"], config)
    if changed:
        raise CheckpointError(
            f"cannot resume {path}: the run config changed ({'; '.join(changed)}); restore "
            "those fields or start a new run in another log.out_dir"
        )
    try:
        sampler = sampler_state_for(payload["sampler"], data_world_size)
    except ValueError as error:
        raise CheckpointError(f"cannot resume {path}: {error}") from error
    return path, {**payload, "sampler": sampler}


def _unusable_checkpoints(run_dir: Path, skipped: list[tuple[Path, str]]) -> CheckpointError:
    """Why a resume stops rather than start over: step 0 would prune the files at its first
    save and truncate the log, losing a run that may only need its digests back."""
    listing = "; ".join(f"{path.name}: {problem}" for path, problem in reversed(skipped))
    directory = run_dir / CHECKPOINT_DIR
    newest = skipped[0][0].name
    # A sharded checkpoint without its digests is an unfinished save: nothing to trust.
    advice = (
        ""
        if skipped[0][0].is_dir()
        else f"If you trust a file that lacks its digest, write one (cd {directory} && "
        f"sha256sum {newest} > {newest}.sha256) and resume again. "
    )
    return CheckpointError(
        f"cannot resume from log.out_dir {str(run_dir)!r}: it holds {len(skipped)} checkpoint(s) "
        f"and none can be used ({listing}). Nothing was changed. {advice}To start over, move "
        f"{directory} away or choose another log.out_dir"
    )


class GracefulStop:
    """Turn SIGINT/SIGTERM into a flag the training loop polls at step boundaries.

    Inside `with GracefulStop() as stop:` the first signal sets `stop.stop_requested` (and
    `stop.received`), so the loop can checkpoint and exit cleanly; a SIGINT after that raises
    `KeyboardInterrupt` as usual. The previous handlers come back on exit. Signal handlers can only
    be installed from the main thread; elsewhere this is a no-op and the flag stays False.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.stop_requested = False
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for signum, handler in self._previous.items():
            # None means a handler installed outside Python; the default is the nearest we can do.
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.stop_requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.stop_requested = True
        self.received = signal.Signals(signum)


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + DIGEST_SUFFIX)


def _temp_path(path: Path) -> Path:
    # Hidden, unique per attempt, and outside `_CHECKPOINT_NAME`, so no reader ever picks it up.
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def _sha256(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def _write_atomically(path: Path, data: bytes) -> None:
    temp = _temp_path(path)
    try:
        with open(temp, "xb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def _fsync_directory(directory: Path) -> None:
    # Makes the renames durable; POSIX only, Windows cannot open a directory as a file.
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_digest_file(path: Path) -> tuple[str, str | None]:
    """The text of the digest file `path`, and why it cannot be read (None if it can)."""
    try:
        return path.read_text(), None
    except FileNotFoundError:
        return "", f"missing digest file {path.name}"
    except (OSError, UnicodeDecodeError) as error:
        return "", f"unreadable digest file {path.name} ({error})"


def _completeness_problem(path: Path) -> str | None:
    """Why `path` is not a complete checkpoint, or None if its sidecar names its digest (a
    sharded checkpoint: if its SHA256SUMS names every file's)."""
    if path.is_dir():
        from deltalab.train.sharded import sharded_problem

        return sharded_problem(path)
    sidecar = _sidecar(path)
    text, problem = read_digest_file(sidecar)
    if problem is not None:
        return problem
    fields = text.split()
    if not fields:
        return f"empty digest file {sidecar.name}"
    try:
        actual = _sha256(path)
    except OSError as error:
        return f"unreadable checkpoint file ({error})"
    if fields[0].lower() != actual:
        return f"digest mismatch (sidecar {fields[0][:16]}..., file {actual[:16]}...)"
    return None
