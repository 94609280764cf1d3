"""Sharded checkpoints of distributed runs: `torch.distributed.checkpoint` (DCP), every rank
writing its shard, with the guarantees of `deltalab.train.checkpoint`.

Layout under a run directory::

    run_dir/checkpoints/step_00001000/              a directory per checkpoint
        .metadata, __0_0.distcp, __1_0.distcp ...   DCP: model and optimizer tensors, by name
        state.pt                                    the rest (torch.save): step, optimizer groups,
                                                    scheduler, sampler, RNG, config, history
        SHA256SUMS                                  "<digest>  <file>" of every file above

Atomic: the ranks write into a hidden `.step_00001000.<id>.tmp/`; once every shard is on disk,
rank 0 writes `SHA256SUMS` (each rank hashed its own files) last and renames the directory to
its final name. A checkpoint is *complete* when its `SHA256SUMS` names every file in it with its
digest; the loader skips anything else and falls back to the previous complete one, and
pruning deletes stale temporary directories, which nothing reads.

Trust as for single files: `state.pt` is read with `torch.load(weights_only=True)`, the shards'
tensors are read by DCP with `torch.load(weights_only=True)`, and DCP's `.metadata` (a pickle)
is read by an unpickler that builds DCP's metadata classes, `torch.Size`, dtypes and paths only;
the DCP planner's `torch.load(weights_only=False)` of non-tensor values is replaced by a
refusal (the shards hold tensors only). So loading a checkpoint never runs code from it.

Resharding: tensors are stored by parameter name with their global shapes, so a checkpoint of
N ranks under DDP or FSDP2 loads into M ranks under either, or into one process. Tensors that
ranks hold alike (every parameter under DDP, the ranks of a context-parallel group included)
are written once: DCP's save planner gives each to one rank.

A run saves and loads its model and optimizer through `save_training_checkpoint` and
`load_training_arrays`, which take either kind: sharded in a distributed run, a single file
(`deltalab.train.checkpoint.save_checkpoint`) in one process.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from deltalab.train.checkpoint import (
    _NUMPY_ARRAY_GLOBALS,
    CHECKPOINT_DIR,
    _fsync_directory,
    _sha256,
    _write_atomically,
    read_digest_file,
    save_checkpoint,
)
from deltalab.train.optim import with_step_implementation

__all__ = [
    "ARRAY_KEYS",
    "DIGESTS_FILE",
    "FULL_STATE",
    "STATE_FILE",
    "UnsafeMetadataError",
    "load_sharded_arrays",
    "load_sharded_state",
    "load_training_arrays",
    "save_sharded_checkpoint",
    "save_training_checkpoint",
    "sharded_problem",
]

# What the DCP shards hold: the model's state dict, and the optimizer's per-parameter state
# ("state" of its state dict). STATE_FILE holds the rest, the optimizer's "param_groups" as
# state["optimizer"]; its payload lacks "model".
ARRAY_KEYS = ("model", "optimizer")
STATE_FILE = "state.pt"
DIGESTS_FILE = "SHA256SUMS"
# State dicts gathered whole onto the CPU: what a single checkpoint file and an export hold.
FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)


def save_training_checkpoint(
    run_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    payload: dict[str, Any],
    *,
    sharded: bool,
) -> Path:
    """Saves the state of `model` (unwrapped: its DDP or FSDP2 wrapper's module) and
    `optimizer` after `step` with `payload`, the rest a resume needs: `sharded`, as a sharded
    checkpoint, every rank writing its shard (collective); else as one file. Returns its path."""
    if not sharded:
        weights = get_model_state_dict(model, options=FULL_STATE)
        moments = get_optimizer_state_dict(model, optimizer, options=FULL_STATE)
        return save_checkpoint(run_dir, step, {**payload, "model": weights, "optimizer": moments})
    # The model's first: its state dict puts back FSDP2's sharded parameters, which an
    # evaluation's forward (no backward to reshard the root) leaves unsharded, and the
    # optimizer's state is mapped to names through them.
    weights = get_model_state_dict(model)
    moments = get_optimizer_state_dict(model, optimizer)
    arrays = {"model": weights, "optimizer": moments["state"]}
    state = {**payload, "optimizer": {"param_groups": moments["param_groups"]}}
    return save_sharded_checkpoint(run_dir, step, arrays, state)


def load_training_arrays(
    path: Path, payload: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """Loads into `model` and `optimizer` their state in the checkpoint `path`, whose `payload`
    `find_latest_checkpoint` read: a file holds them whole; a sharded checkpoint's are read
    into this process's shapes of them (DTensor shards under FSDP2), every rank taking part.
    The optimizer keeps its step implementation (`with_step_implementation`)."""
    if path.is_dir():
        weights = get_model_state_dict(model)
        # Holds the optimizer's state tensors (created with zeros where it has taken no step).
        moments = get_optimizer_state_dict(model, optimizer)
        load_sharded_arrays(path, {"model": weights, "optimizer": moments["state"]})
        groups = payload["optimizer"]["param_groups"]
        moments, options = {"state": moments["state"], "param_groups": groups}, None
    else:
        weights, moments, options = payload["model"], payload["optimizer"], FULL_STATE
    set_model_state_dict(model, weights, options=options)
    moments = with_step_implementation(moments, optimizer)
    set_optimizer_state_dict(model, optimizer, moments, options=options)


def save_sharded_checkpoint(
    run_dir: str | Path, step: int, arrays: dict[str, Any], state: dict[str, Any]
) -> Path:
    """Write `run_dir/checkpoints/step_{step:08d}/` atomically; collective (every rank calls it).

    arrays: {"model": ..., "optimizer": ...} state dicts of tensors (DTensors under FSDP2),
    written by DCP, each rank its shard. state: the rest of the payload, rank 0's, written by
    rank 0. Saving a step that already exists replaces it once the new one is complete.
    Returns the checkpoint's directory.
    """
    if step < 0:
        raise ValueError(f"step must be non-negative, got {step}")
    directory = Path(run_dir) / CHECKPOINT_DIR
    final = directory / f"step_{step:08d}"
    rank = dist.get_rank() if dist.is_initialized() else 0
    # One temporary directory for all ranks: rank 0 names it.
    names = [f".{final.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"]
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
    if dist.is_initialized():
        dist.broadcast_object_list(names, src=0)
    temp = directory / names[0]
    dcp.save(arrays, storage_writer=FileSystemWriter(temp, sync_files=True))
    if rank == 0:
        with open(temp / STATE_FILE, "xb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
    # Each rank hashes what it wrote; rank 0 also the metadata and the state.
    mine = list(temp.glob(f"__{rank}_*"))
    if rank == 0:
        mine += [temp / ".metadata", temp / STATE_FILE]
    digests = {path.name: _sha256(path) for path in mine}
    gathered = [digests]
    if dist.is_initialized():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, digests)
    if rank == 0:
        listing = {name: digest for part in gathered for name, digest in part.items()}
        lines = "".join(f"{listing[name]}  {name}\n" for name in sorted(listing))
        _fsync_directory(temp)
        _write_atomically(temp / DIGESTS_FILE, lines.encode())
        _fsync_directory(temp)
        replace_directory(temp, final)
        _fsync_directory(directory)
    return final


def replace_directory(source: Path, target: Path, aside: Path | None = None) -> None:
    """Rename `source` to `target`; an existing `target` (an earlier save of the same step) is
    moved aside first (to `aside`, which must not hold files; by default a fresh hidden name)
    and deleted after, so the step is complete or absent at every moment."""
    if not target.exists():
        os.replace(source, target)
        return
    aside = aside or target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.old.tmp")
    os.replace(target, aside)
    os.replace(source, target)
    shutil.rmtree(aside, ignore_errors=True)


def sharded_problem(path: Path) -> str | None:
    """Why the directory `path` is not a complete sharded checkpoint, or None if its
    `SHA256SUMS` names every file in it with its digest."""
    text, problem = read_digest_file(path / DIGESTS_FILE)
    if problem is not None:
        return problem
    listed = {}
    for line in text.splitlines():
        digest, _, name = line.partition("  ")
        listed[name] = digest.lower()
    present = {entry.name for entry in path.iterdir() if entry.name != DIGESTS_FILE}
    for required in (".metadata", STATE_FILE):
        if required not in listed:
            return f"{DIGESTS_FILE} does not list {required}"
    if missing := sorted(set(listed) - present):
        return f"missing file(s) {missing}"
    if unlisted := sorted(present - set(listed)):
        return f"file(s) not in {DIGESTS_FILE}: {unlisted}"
    for name, digest in sorted(listed.items()):
        try:
            actual = _sha256(path / name)
        except OSError as error:
            return f"unreadable file {name} ({error})"
        if actual != digest:
            return (
                f"digest mismatch of {name} ({DIGESTS_FILE} {digest[:16]}..., "
                f"file {actual[:16]}...)"
            )
    return None


class UnsafeMetadataError(pickle.UnpicklingError):
    """A sharded checkpoint's `.metadata` names a global that DCP's metadata never holds."""


def load_sharded_state(path: Path, map_location: str | torch.device = "cpu") -> Any:
    """The non-tensor part of a sharded checkpoint, read with `torch.load(weights_only=True)`,
    once its `.metadata` unpickles safely (else `UnsafeMetadataError`)."""
    _read_metadata(path / ".metadata")
    with torch.serialization.safe_globals(_NUMPY_ARRAY_GLOBALS):
        return torch.load(path / STATE_FILE, map_location=map_location, weights_only=True)


def load_sharded_arrays(path: Path, arrays: dict[str, Any]) -> None:
    """Fill the tensors of `arrays` (state dicts shaped as this process holds them: DTensor
    shards under FSDP2, full tensors otherwise) in place from the checkpoint `path`. Collective
    in a distributed run; alone without a process group."""
    dcp.load(
        arrays,
        storage_reader=_SafeReader(path),
        planner=_TensorsOnlyPlanner(),
        no_dist=not dist.is_initialized(),
    )


class _SafeReader(FileSystemReader):
    """A FileSystemReader whose metadata unpickling builds only what DCP's metadata holds."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        metadata = _read_metadata(Path(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _TensorsOnlyPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner without its `torch.load(weights_only=False)` of non-tensor values."""

    def load_bytes(self, read_item, value) -> None:
        raise ValueError(
            f"a sharded checkpoint holds tensors only; {read_item.dest_index.fqn} is not one"
        )


def _read_metadata(path: Path):
    with open(path, "rb") as file:
        return _MetadataUnpickler(io.BytesIO(file.read())).load()


# The classes DCP's metadata pickle holds: plain records, built without side effects.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
}
_PATH_CLASSES = {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata records, `torch.Size`, dtypes, layouts and paths; refuses every
    other global, so a planted `.metadata` cannot call anything else."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch.serialization" and name == "_get_layout":
            return torch.serialization._get_layout
        if module in ("pathlib", "pathlib._local") and name in _PATH_CLASSES:
            import pathlib  # pathlib._local: where Python 3.13 defines them

            return getattr(pathlib, name)
        raise UnsafeMetadataError(
            f"its .metadata calls {module}.{name}, which DCP's metadata never holds: unpickling "
            "it could run code"
        )
