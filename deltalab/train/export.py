"""Between training checkpoints and Hugging Face directories: `deltalab export CKPT OUT`, and
`model.init_from`, a Hugging Face directory whose weights start a run; the run's own `model/`
directory is written the same way (`save_model_directory`).

A checkpoint (a single file or a sharded directory, `deltalab.train.checkpoint`) holds the run
config; the model is rebuilt from it, its weights read in one process (a sharded checkpoint of
any number of ranks is reassembled by DCP), and written with `save_pretrained` beside the run's
tokenizer, the layout of a run's own `model/` directory.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from deltalab.errors import CheckpointError, ConfigError
from deltalab.models import CausalLM

__all__ = ["export_checkpoint", "load_initial_weights", "save_model_directory"]

# DeltaLabConfig entries that describe the file rather than the model.
_FILE_FIELDS = {"_name_or_path", "architectures", "transformers_version", "torch_dtype", "dtype"}


def export_checkpoint(checkpoint: str | Path, out: str | Path) -> Path:
    """Writes the model of `checkpoint` to the directory `out` (model safetensors, config,
    tokenizer files); returns the checkpoint read.

    checkpoint: a run directory (its newest complete checkpoint), a checkpoint file
    `step_*.pt` or a sharded checkpoint directory `step_*`. `out` must not hold files.
    """
    from deltalab.data import load_tokenizer
    from deltalab.train import preflight
    from deltalab.train.config import RunConfig
    from deltalab.train.sharded import load_sharded_arrays

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"OUT {str(out)!r} exists and is not an empty directory")
    path, payload = _read_checkpoint(Path(checkpoint))
    config = RunConfig.from_dict(payload["config"])
    tokenizer = load_tokenizer(config.data.tokenizer)
    model = CausalLM(preflight.model_config(config, tokenizer, torch.device("cpu")))
    if path.is_dir():
        weights = model.state_dict()
        load_sharded_arrays(path, {"model": weights})
    else:
        weights = payload["model"]
    model.load_state_dict(weights)
    save_model_directory(model, tokenizer, out)
    return path


def save_model_directory(
    model: CausalLM, tokenizer, out: Path, weights: dict[str, Any] | None = None
) -> None:
    """`model` (`save_pretrained`: safetensors and config, from `weights` when given, else its
    own state) and the files of its `tokenizer`, to the directory `out`.

    A missing `out`, or one that holds a previous model, is written whole or not at all: the
    files go to a hidden sibling, `.NAME.partial`, renamed to `out` once all are there, so a
    save stopped part way (a kill, a full disk) leaves `out` as it was, never a directory with
    a config and no weights. A previous `out` is moved aside to `.NAME.previous` for the rename
    and then removed (a save stopped between the two renames leaves it there, and the next
    save removes it). An empty `out` (`deltalab export` accepts one) is written into; a link
    to a directory is followed."""
    from deltalab.data import save_tokenizer
    from deltalab.train.sharded import replace_directory

    out = Path(out)
    if out.is_symlink():
        out = out.resolve()

    def write(directory: Path) -> None:
        model.save_pretrained(directory, state_dict=weights)
        save_tokenizer(tokenizer, directory)

    if out.is_dir() and not any(out.iterdir()):
        write(out)
        return
    out = Path(os.path.abspath(out))
    partial, previous = (out.with_name(f".{out.name}.{part}") for part in ("partial", "previous"))
    shutil.rmtree(partial, ignore_errors=True)
    try:
        write(partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    shutil.rmtree(previous, ignore_errors=True)  # left by a save stopped between its renames
    replace_directory(partial, out, aside=previous)


def _read_checkpoint(path: Path) -> tuple[Path, dict[str, Any]]:
    """(checkpoint, payload) of a run directory's newest complete checkpoint or of one
    checkpoint, verified as `--resume` verifies it."""
    from deltalab.train.checkpoint import CHECKPOINT_DIR, find_latest_checkpoint

    if not path.exists():
        raise CheckpointError(f"CKPT {str(path)!r} does not exist")
    if (path / CHECKPOINT_DIR).is_dir():
        run_dir, wanted = path, None
    else:
        run_dir, wanted = path.parent.parent, path
        if path.parent.name != CHECKPOINT_DIR:
            raise CheckpointError(
                f"CKPT {str(path)!r} is neither a run directory nor a checkpoint in one's "
                f"{CHECKPOINT_DIR}/"
            )
    found, skipped = find_latest_checkpoint(run_dir, required=("config",))
    if wanted is not None:
        for skipped_path, problem in skipped:
            if skipped_path == wanted:
                raise CheckpointError(f"cannot export {str(wanted)!r}: {problem}")
        if found is None or found[0] != wanted:
            # Older than the newest usable one: read it alone.
            return wanted, _read_one(wanted)
    if found is None:
        reasons = "; ".join(f"{p.name}: {problem}" for p, problem in skipped) or "none found"
        raise CheckpointError(f"CKPT {str(path)!r} holds no usable checkpoint ({reasons})")
    return found


def _read_one(path: Path) -> dict[str, Any]:
    from deltalab.train.checkpoint import _NUMPY_ARRAY_GLOBALS, _completeness_problem
    from deltalab.train.sharded import load_sharded_state

    problem = _completeness_problem(path)
    if problem is not None:
        raise CheckpointError(f"cannot export {str(path)!r}: {problem}")
    if path.is_dir():
        return load_sharded_state(path)
    with torch.serialization.safe_globals(_NUMPY_ARRAY_GLOBALS):
        return torch.load(path, map_location="cpu", weights_only=True)


def load_initial_weights(model: CausalLM, source: str | Path) -> None:
    """Copies into `model` the weights of the Hugging Face directory `source` (model.init_from).

    Its config must give the same parameter shapes; otherwise a ConfigError names the config
    fields that differ.
    """
    source = Path(source)
    if not (source / "config.json").is_file():
        raise ConfigError(
            f"model.init_from={str(source)!r} is not a Hugging Face model directory (no "
            "config.json): give a run's model/ directory or one written by deltalab export"
        )
    pretrained = CausalLM.from_pretrained(source, dtype=torch.float32)
    theirs, mine = pretrained.state_dict(), model.state_dict()
    unlike = sorted(
        name
        for name in set(theirs) | set(mine)
        if name not in theirs or name not in mine or theirs[name].shape != mine[name].shape
    )
    if unlike:
        raise ConfigError(
            f"model.init_from={str(source)!r} does not fit this run's model: "
            f"{_config_differences(pretrained.config, model.config, unlike[0])}"
        )
    with torch.no_grad():
        for name, tensor in mine.items():
            tensor.copy_(theirs[name])


def _config_differences(theirs, mine, parameter: str) -> str:
    """The config fields whose values differ, as 'field is X there, Y here'; else the first
    parameter of different shape."""
    a, b = theirs.to_dict(), mine.to_dict()
    fields = sorted(k for k in set(a) | set(b) if k not in _FILE_FIELDS and a.get(k) != b.get(k))
    if fields:
        return "; ".join(f"{k} is {a.get(k)!r} there, {b.get(k)!r} here" for k in fields)
    return f"parameter {parameter} has another shape or is missing"
