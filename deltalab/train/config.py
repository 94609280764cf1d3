"""The run configuration of `deltalab train` as typed sections: one frozen dataclass per
section, each field's type, default and checks, `RunConfig` (the sections, with optim.lr and
schedule.warmup_steps filled from the model's preset) and the fields a resumed run may change.
Reading a file and dotted overrides, writing a file and the --help text are config_io.py's.

Every value is checked against its field's type when the sections are built, and every error
names the dotted field. The model's own fields (preset, mixer, overrides) are checked later, by
`deltalab.models.build_config`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from deltalab.catalog import PRESET_TRAINING
from deltalab.config_parse import (
    check_keys,
    coerce,
    plain,
    require,
    require_choice,
    type_hints,
)
from deltalab.errors import closest

__all__ = [
    "DEVICES",
    "NAN_POLICIES",
    "PARALLEL_MODES",
    "PRECISIONS",
    "SCHEDULES",
    "SECTIONS",
    "CheckpointSection",
    "DataSection",
    "EvalSection",
    "LogSection",
    "ModelSection",
    "OptimSection",
    "RunConfig",
    "ScheduleSection",
    "TrainSection",
    "checked_sections",
    "resume_changes",
    "section_class",
]

SCHEDULES = ("cosine", "wsd", "constant")
PRECISIONS = ("auto", "fp32", "bf16")
NAN_POLICIES = ("stop", "skip")
PARALLEL_MODES = ("ddp", "fsdp")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class _Section:
    """One section of the run configuration; `key` is its name in `RunConfig`."""

    key: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = coerce(
                self.dotted(f.name), getattr(self, f.name), type_hints(type(self))[f.name]
            )
            object.__setattr__(self, f.name, value)
        self.validate()

    def validate(self) -> None:
        """The section's checks beyond the field types."""

    @classmethod
    def dotted(cls, name: str) -> str:
        """`section.field`, the name of a field in files, overrides and errors."""
        return f"{cls.key}.{name}"

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def check_names(cls, data: Any) -> dict[str, Any]:
        """`data` (a mapping, or None for nothing set) as a dict, refusing unknown fields."""
        if data is None:
            return {}
        if not isinstance(data, Mapping):
            raise TypeError(f"{cls.key} must be a mapping of fields, got {data!r}")
        known, listing = cls.field_names(), f"the fields of {cls.key} are"
        check_keys(data, known, f"{cls.key}.", what="config field", listing=listing)
        return dict(data)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Self:
        """The section from a mapping of its fields (missing ones take their defaults)."""
        return cls(**cls.check_names(data))

    def to_dict(self) -> dict[str, Any]:
        """The fields as YAML/JSON data (tuples as lists)."""
        return {
            f.name: plain(self.dotted(f.name), getattr(self, f.name))
            for f in dataclasses.fields(self)
        }


def _require_text(section: _Section, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        require(bool(value), section.dotted(name), "a non-empty string", value)


@dataclass(frozen=True)
class ModelSection(_Section):
    """Which model to train.

    preset: named model preset of `deltalab.models.PRESETS` (tiny, 166M, 340M, 750M, 1.3B, and
        kdn-authors-1.3B for kdn_iso and kdn_diag: the KDN authors' configuration).
    mixer: token mixer of every block, one of `deltalab.models.MIXER_KINDS`.
    overrides: further `DeltaLabConfig` fields, e.g. {num_layers: 2, mixer_options: {...}}.
    init_from: a Hugging Face model directory (a run's model/, `deltalab export` output) whose
        weights start the run instead of a random initialization; its config must give this
        model's parameter shapes (null: random initialization).
    """

    key: ClassVar[str] = "model"

    preset: str = "tiny"
    mixer: str = "muir"
    overrides: dict[str, Any] = field(default_factory=dict)
    init_from: str | None = None

    def validate(self) -> None:
        _require_text(self, "preset", "mixer")
        if self.init_from is not None:
            _require_text(self, "init_from")
        if "mixer" in self.overrides:
            raise ValueError("model.overrides.mixer is not allowed: set model.mixer instead")


@dataclass(frozen=True)
class DataSection(_Section):
    """What to train on (see `deltalab.data.CorpusConfig`).

    source: "stdlib" (the Python standard library), an archive or @LIST of files (pinned; split
        by file name as the stdlib is), or a path: a file, a directory of .txt, .jsonl and
        .parquet files, or a dataset saved by Hugging Face `datasets`. A single
        text file is one document, split by position: its last held_out_fraction (from a line
        start) is held out.
    tokenizer: "byte", or a directory holding a Hugging Face tokenizer (`deltalab tokenizer
        train` writes one).
    cache_dir: directory of the tokenized shards, reused until the source changes.
    max_bytes: stop reading the source after this many UTF-8 bytes (null: read it all).
    held_out_fraction: fraction of the documents held out for evaluation, in (0, 1); of a
        single text file, the fraction of its bytes.
    text_field: JSON field, parquet or dataset column that holds the text.
    """

    key: ClassVar[str] = "data"

    source: str = "stdlib"
    tokenizer: str = "byte"
    cache_dir: str = "runs/token-cache"
    max_bytes: int | None = 4194304
    held_out_fraction: float = 0.05
    text_field: str = "text"

    def validate(self) -> None:
        _require_text(self, "source", "tokenizer", "cache_dir", "text_field")
        if self.max_bytes is not None:
            require(self.max_bytes > 0, self.dotted("max_bytes"), "> 0 or null", self.max_bytes)
        fraction = self.held_out_fraction
        require(0 < fraction < 1, self.dotted("held_out_fraction"), "in (0, 1)", fraction)


@dataclass(frozen=True)
class OptimSection(_Section):
    """AdamW and gradient clipping.

    lr: peak learning rate, > 0 (null: the preset's, as `deltalab presets` lists).
    betas: AdamW (beta1, beta2), each in [0, 1).
    eps: AdamW epsilon, > 0.
    weight_decay: decoupled weight decay, >= 0.
    grad_clip: clip the global gradient norm to this, >= 0 (0: no clipping).
    """

    key: ClassVar[str] = "optim"

    lr: float | None = None
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0

    def validate(self) -> None:
        if self.lr is not None:
            require(self.lr > 0, self.dotted("lr"), "> 0", self.lr)
        require(all(0 <= b < 1 for b in self.betas), self.dotted("betas"), "in [0, 1)", self.betas)
        require(self.eps > 0, self.dotted("eps"), "> 0", self.eps)
        require(self.weight_decay >= 0, self.dotted("weight_decay"), ">= 0", self.weight_decay)
        require(self.grad_clip >= 0, self.dotted("grad_clip"), ">= 0", self.grad_clip)


@dataclass(frozen=True)
class ScheduleSection(_Section):
    """The learning-rate schedule.

    kind: "cosine" (warmup, then cosine decay to min_lr_ratio), "wsd" (warmup, stable, then
        linear decay over the last decay_fraction of the steps) or "constant" (warmup, then flat).
    warmup_steps: steps of linear warmup from 0 to the peak learning rate, >= 0 (null: the
        preset's, as `deltalab presets` lists).
    min_lr_ratio: final learning rate as a fraction of the peak, in [0, 1].
    decay_fraction: WSD only: the last fraction of the steps that decays, in [0, 1].
    """

    key: ClassVar[str] = "schedule"

    kind: str = "cosine"
    warmup_steps: int | None = None
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2

    def validate(self) -> None:
        require_choice(self.dotted("kind"), self.kind, SCHEDULES)
        if self.warmup_steps is not None:
            warmup = self.warmup_steps
            require(warmup >= 0, self.dotted("warmup_steps"), ">= 0", warmup)
        ratio, fraction = self.min_lr_ratio, self.decay_fraction
        require(0 <= ratio <= 1, self.dotted("min_lr_ratio"), "in [0, 1]", ratio)
        require(0 <= fraction <= 1, self.dotted("decay_fraction"), "in [0, 1]", fraction)


@dataclass(frozen=True)
class TrainSection(_Section):
    """The training loop.

    steps: optimizer steps of the run, > 0.
    batch_size: sequences per optimizer step, global across ranks and accumulation steps.
    seq_len: tokens per training sequence, > 0.
    grad_accum: micro-batches accumulated per optimizer step; must divide batch_size.
    precision: "auto" (bf16 autocast on CUDA, fp32 on CPU), "fp32" or "bf16".
    compile: compile the model with torch.compile.
    activation_checkpointing: recompute each block's activations in the backward pass.
    recompute_ffn: recompute each block's FFN branch (norm, projections, gating) in the backward
        pass, keeping only its input; less memory for one more FFN forward per step (no effect
        with activation_checkpointing, which recomputes the whole block).
    cuda_graphs: after two eager steps, record the step's forward and backward passes as one
        CUDA graph and replay it at every later step: the host queues a step with one call
        instead of one per operation. null (the default): wherever it can run, a single-process
        CUDA run without compile; true: always (one process, not with compile; without CUDA
        the passes run eagerly); false: never. A recording that fails stops the run. Replayed
        steps read no value back: the ops' checks of their inputs run in the two eager steps
        only, and non-finite values show in the loss and gradient norm (train.nan_policy).
    seed: seed of initialization and data order, >= 0.
    nan_policy: on a non-finite loss, "stop" the run or "skip" the step.
    parallel: multi-GPU strategy, "ddp" or "fsdp".
    context_parallel: ranks each sequence is split over (deltalab/train/context.py): the
        world_size ranks form world_size / context_parallel data-parallel groups of this many;
        must divide the ranks and seq_len, not with compile. 1: no split.
    device: "auto" (CUDA when available), "cpu" or "cuda".
    """

    key: ClassVar[str] = "train"

    steps: int = 240
    batch_size: int = 8
    seq_len: int = 256
    grad_accum: int = 1
    precision: str = "auto"
    compile: bool = False
    activation_checkpointing: bool = False
    recompute_ffn: bool = False
    cuda_graphs: bool | None = None
    seed: int = 0
    nan_policy: str = "stop"
    parallel: str = "ddp"
    context_parallel: int = 1
    device: str = "auto"

    def validate(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "grad_accum"):
            require(getattr(self, name) > 0, self.dotted(name), "> 0", getattr(self, name))
        require(self.seed >= 0, self.dotted("seed"), ">= 0", self.seed)
        self.micro_batch(world_size=1)
        require_choice(self.dotted("precision"), self.precision, PRECISIONS)
        require_choice(self.dotted("nan_policy"), self.nan_policy, NAN_POLICIES)
        require_choice(self.dotted("parallel"), self.parallel, PARALLEL_MODES)
        require_choice(self.dotted("device"), self.device, DEVICES)
        cp = self.context_parallel
        require(cp > 0, self.dotted("context_parallel"), "> 0", cp)
        if self.seq_len % cp:
            raise ValueError(
                f"{self.dotted('seq_len')} ({self.seq_len}) must divide evenly over "
                f"{self.dotted('context_parallel')} ({cp}) ranks"
            )
        if cp > 1 and self.compile:
            raise ValueError(
                f"{self.dotted('context_parallel')}={cp} and {self.dotted('compile')}=true: "
                "choose one (the layers read the context-parallel group outside the graph)"
            )
        if self.cuda_graphs is True and self.compile:
            raise ValueError(
                f"{self.dotted('cuda_graphs')}=true and {self.dotted('compile')}=true: choose "
                "one (the compiled step breaks its graph at every Triton kernel)"
            )

    def micro_batch(self, world_size: int) -> int:
        """Windows per forward on each of `world_size` ranks: batch_size must split evenly
        into world_size x grad_accum micro-batches (checked with one rank on construction,
        with the real number when the run starts)."""
        parts = world_size * self.grad_accum
        if self.batch_size % parts:
            raise ValueError(
                f"train.batch_size ({self.batch_size}) must divide evenly over {world_size} "
                f"rank(s) x train.grad_accum ({self.grad_accum})"
            )
        return self.batch_size // parts


@dataclass(frozen=True)
class EvalSection(_Section):
    """Held-out evaluation and samples.

    every: evaluate every this many steps and at the last step (0: at the last step only).
    batches: held-out batches per evaluation, > 0.
    sample_tokens: tokens generated from sample_prompt at the end of the run (0: no sample).
    sample_prompt: prompt of the generated sample (quote it to keep edge spaces: "'def '").
    sample_temperature: sampling temperature of the sample, seeded by train.seed (0: greedy).
    """

    key: ClassVar[str] = "eval"

    every: int = 80
    batches: int = 8
    sample_tokens: int = 120
    sample_prompt: str = "def "
    sample_temperature: float = 0.7

    def validate(self) -> None:
        require(self.every >= 0, self.dotted("every"), ">= 0", self.every)
        require(self.batches > 0, self.dotted("batches"), "> 0", self.batches)
        require(self.sample_tokens >= 0, self.dotted("sample_tokens"), ">= 0", self.sample_tokens)
        require(
            self.sample_temperature >= 0,
            self.dotted("sample_temperature"),
            ">= 0",
            self.sample_temperature,
        )


@dataclass(frozen=True)
class CheckpointSection(_Section):
    """Checkpoints and resumption.

    every: save every this many steps and at the last step (0: at the last step only).
    keep: newest checkpoints kept on disk, > 0.
    resume: continue from the newest checkpoint in log.out_dir, if there is one.
    """

    key: ClassVar[str] = "checkpoint"

    every: int = 80
    keep: int = 2
    resume: bool = False

    def validate(self) -> None:
        require(self.every >= 0, self.dotted("every"), ">= 0", self.every)
        require(self.keep > 0, self.dotted("keep"), "> 0", self.keep)


@dataclass(frozen=True)
class LogSection(_Section):
    """Where the run writes and what it shows.

    out_dir: directory of the run: resolved config, metrics, checkpoints, logs.
    progress: show a progress bar on the terminal.
    tensorboard: also write TensorBoard event files to out_dir/tb (needs the tensorboard extra:
        pip install 'deltalab[tensorboard]').
    """

    key: ClassVar[str] = "log"

    out_dir: str = "runs/default"
    progress: bool = True
    tensorboard: bool = False

    def validate(self) -> None:
        _require_text(self, "out_dir")
        require(
            not self.tensorboard or importlib.util.find_spec("tensorboard") is not None,
            self.dotted("tensorboard"),
            "false where tensorboard is not installed (pip install 'deltalab[tensorboard]')",
            self.tensorboard,
        )


@dataclass(frozen=True)
class RunConfig:
    """Everything a `deltalab train` run depends on, one section per concern."""

    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    train: TrainSection = field(default_factory=TrainSection)
    eval: EvalSection = field(default_factory=EvalSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    log: LogSection = field(default_factory=LogSection)

    def __post_init__(self) -> None:
        for name, section in SECTIONS.items():
            value = getattr(self, name)
            if not isinstance(value, section):
                raise TypeError(
                    f"{name} must be a {section.__name__}, got {type(value).__name__} {value!r}"
                )
        self._apply_preset_training()

    def _apply_preset_training(self) -> None:
        """Fill optim.lr and schedule.warmup_steps left null with the preset's values, so a
        340M model does not train at the tiny model's learning rate. An unknown preset is
        left for the model's own check to refuse, with its list of presets."""
        training = PRESET_TRAINING.get(self.model.preset)
        if training is None:
            return
        if self.optim.lr is None:
            object.__setattr__(self, "optim", dataclasses.replace(self.optim, lr=training.lr))
        if self.schedule.warmup_steps is None:
            schedule = dataclasses.replace(self.schedule, warmup_steps=training.warmup_steps)
            object.__setattr__(self, "schedule", schedule)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunConfig:
        """The config from a mapping by section (as `to_dict` writes); missing parts default."""
        tree = checked_sections(data)
        return cls(**{name: SECTIONS[name].from_dict(fields) for name, fields in tree.items()})

    def to_dict(self) -> dict[str, Any]:
        """Every field of every section, as YAML/JSON data."""
        return {name: getattr(self, name).to_dict() for name in SECTIONS}


SECTIONS: dict[str, type[_Section]] = {
    f.name: type_hints(RunConfig)[f.name] for f in dataclasses.fields(RunConfig)
}


def section_class(name: str) -> type[_Section]:
    """The section class of `name`, refused with the closest known section's name."""
    if name not in SECTIONS:
        raise ValueError(f"unknown config section {name!r}{closest(name, list(SECTIONS))}")
    return SECTIONS[name]


def checked_sections(data: Any) -> dict[str, dict[str, Any]]:
    """`data` as {section: {field: value}}, refusing unknown sections and fields."""
    if not isinstance(data, Mapping):
        raise TypeError(f"a run config must be a mapping by section, got {data!r}")
    return {str(name): section_class(str(name)).check_names(value) for name, value in data.items()}


# Fields a resumed run may change: they do not change what is computed.
RESUMABLE_CHANGES = {
    "model.init_from",  # read only when a run starts, never on resume
    "checkpoint.resume",
    "checkpoint.every",
    "checkpoint.keep",
    "train.device",
    "train.compile",
    "train.activation_checkpointing",
    "train.recompute_ffn",
    "train.cuda_graphs",
    "train.nan_policy",
    "train.parallel",
    "train.context_parallel",
    "eval.every",
    "eval.sample_tokens",
    "eval.sample_prompt",
    "log.progress",
    "log.tensorboard",
    "log.out_dir",
    "data.cache_dir",
}


def resume_changes(saved: dict, current: dict) -> list[str]:
    """The fields of the config dict `current` that differ from `saved` (a checkpoint's), as
    `section.field: old -> new`, leaving out those a resumed run may change. A field the saved
    config lacks (it predates the field) counts as its default, which keeps the behaviour of
    the code that saved it."""
    defaults = RunConfig().to_dict()
    changed = []
    for section, fields in current.items():
        for name, value in fields.items():
            key = f"{section}.{name}"
            old = saved.get(section, {}).get(name, defaults.get(section, {}).get(name))
            if key not in RESUMABLE_CHANGES and old != value:
                changed.append(f"{key}: {old!r} -> {value!r}")
    return changed
