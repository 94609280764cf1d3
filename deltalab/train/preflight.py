"""What a run checks before it trains, each failure an error naming the field to change: the
directories, the data source against the run's own files, a fresh start against another run's
checkpoints, the model's config (built on the meta device) and the batch against the data.
"""

from __future__ import annotations

from pathlib import Path

import torch

from deltalab.errors import CheckpointError, ConfigError, DataError
from deltalab.models import CausalLM, DeltaLabConfig, build_config
from deltalab.models.mixers import mixer_option_names
from deltalab.ops._triton import triton_unavailable_reason
from deltalab.train.checkpoint import list_checkpoints
from deltalab.train.config import RunConfig

__all__ = [
    "check_batch_sizes",
    "check_directories",
    "check_fresh_start",
    "check_outside_source",
    "model_config",
]


def check_outside_source(config: RunConfig) -> None:
    """The run's own files must not become training data on the next run."""
    from deltalab.data import source_path

    path = source_path(config.data.source)
    if path is None:
        return
    source = path.resolve()
    for name, value in (
        ("log.out_dir", config.log.out_dir),
        ("data.cache_dir", config.data.cache_dir),
    ):
        inside = Path(value).resolve()
        if inside == source or source in inside.parents:
            raise ValueError(
                f"{name} {value!r} lies inside data.source {config.data.source!r}: the run's "
                "files would be read as documents; put them elsewhere"
            )


def check_fresh_start(out_dir: Path, config: RunConfig) -> None:
    """A new run must not share a directory with another run's checkpoints: the older ones
    would be pruned in its place and picked up by a later resume."""
    if not config.checkpoint.resume and list_checkpoints(out_dir):
        raise CheckpointError(
            f"log.out_dir {str(out_dir)!r} already holds checkpoints of a run; continue it with "
            "--resume (checkpoint.resume=true) or choose another log.out_dir"
        )


def check_directories(config: RunConfig) -> None:
    """The run and cache directories must be directories (or not exist yet), found before any
    work rather than as an OSError after tokenizing."""
    for name, value in (
        ("log.out_dir", config.log.out_dir),
        ("data.cache_dir", config.data.cache_dir),
    ):
        directory = Path(value)
        for path in (directory, *directory.parents):
            if path.exists():
                if not path.is_dir():
                    raise ConfigError(
                        f"{name} must be a directory, got {value!r}, where {str(path)!r} is a "
                        f"file; choose another {name}"
                    )
                break


def model_config(config: RunConfig, tokenizer, device: torch.device) -> DeltaLabConfig:
    """The model's config, checked by building the model on the meta device (no memory) and
    its backend against the training device: errors name `model.*` and come before any data is
    tokenized."""
    overrides = config.model.overrides
    vocab_size = overrides.get("vocab_size", tokenizer.vocab_size)
    if isinstance(vocab_size, int) and vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"model.overrides.vocab_size must be >= the tokenizer's vocabulary "
            f"({tokenizer.vocab_size} tokens of data.tokenizer={config.data.tokenizer!r}), got "
            f"{vocab_size}"
        )
    try:
        model_config = build_config(
            config.model.preset,
            mixer=config.model.mixer,
            **{"vocab_size": tokenizer.vocab_size, **overrides},
        )
    except (ValueError, TypeError) as error:
        raise ConfigError(f"model: {error}") from error
    if model_config.mixer_options:
        # Options reach the recurrent mixer only; attention blocks take none.
        recurrent = {kind for kind in model_config.layer_kinds() if kind != "attention"}
        choices = sorted({name for kind in recurrent for name in mixer_option_names(kind)})
        for name in model_config.mixer_options:
            if name not in choices:
                raise ConfigError(
                    f"model.overrides.mixer_options.{name} is not an option of the "
                    f"{model_config.mixer} mixer; its options are {choices}"
                )
    if model_config.backend == "triton":
        reason = triton_unavailable_reason(device)
        if reason is not None:
            raise ConfigError(f"model.overrides.backend='triton' cannot run on {device}: {reason}")
    for name in ("bos", "eos", "pad"):
        setattr(model_config, f"{name}_token_id", getattr(tokenizer, f"{name}_id"))
    try:
        with torch.device("meta"):
            CausalLM(model_config)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"model: {error}") from error
    return model_config


def check_batch_sizes(config: RunConfig, train_data, held_out, micro: int, ctx) -> int:
    """Refuse a batch the data cannot fill, before anything is allocated (a batch of more
    windows than the split holds repeats windows within one step and grows memory without
    bound); returns the held-out windows one evaluation uses."""
    windows = f"windows of train.seq_len + 1 = {config.train.seq_len + 1} tokens"
    if config.train.batch_size > len(train_data):
        raise ConfigError(
            f"train.batch_size must be at most the {len(train_data)} {windows} of the train "
            f"split, got {config.train.batch_size}; lower train.batch_size or train.seq_len, or "
            "train on more data"
        )
    if len(held_out) < ctx.world_size:
        raise DataError(
            f"the held-out split has {len(held_out)} windows, fewer than the {ctx.world_size} "
            "ranks; raise data.held_out_fraction or lower train.seq_len"
        )
    wanted = config.eval.batches * micro * ctx.world_size
    return min(wanted, len(held_out))
