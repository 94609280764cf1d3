"""A study's plan: every run of the grid with its full train config, its parameter count and
its evaluations, all checked before anything trains.

Parameter counts (non-embedding, as `deltalab presets` counts them) are matched by the FFN
width: at each size, the `params.match` variant keeps its own width and sets the target count,
and every other variant gets the SwiGLU width (a multiple of `params.ffn_multiple`) whose model
comes closest to it, the rule by which Muir reinvests what its low-rank gates save. A variant
whose overrides fix `ffn_width` keeps it. Any run further than `params.tolerance` (2%) from the
target is refused, naming every such run, before anything trains.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deltalab.errors import ConfigError, UserError
from deltalab.study.spec import EvalSpec, StudySpec, Variant

__all__ = ["EvalStep", "PlannedRun", "PlannedTask", "StudyPlan", "make_plan"]

# The perplexity-style tasks read text as training does; left unset in the spec, these settings
# come from the run's data section, so the held-out text is the run's own held-out split (and
# its tokens are already in the cache).
DATA_FIELDS = ("source", "held_out_fraction", "max_bytes", "text_field", "cache_dir")


@dataclass(frozen=True)
class EvalStep:
    """One `deltalab eval` call: its task, its settings as `name=value` words, where it
    writes (relative to the run or task directory)."""

    task: str
    words: tuple[str, ...]
    settings: dict[str, Any]
    out: str
    long_context: str = "refuse"


@dataclass(frozen=True)
class PlannedRun:
    """One training run of the grid and the evaluations of its checkpoint."""

    name: str
    variant: Variant
    size: str
    lr: float
    seed: int
    config: Any  # RunConfig
    params: int
    total_params: int
    ffn_width: int
    directory: Path
    evals: tuple[EvalStep, ...]

    @property
    def group(self) -> tuple[str, float]:
        """The grid cell the run belongs to apart from its variant and seed."""
        return (self.size, self.lr)


@dataclass(frozen=True)
class PlannedTask:
    """A task that trains its own models (mqar-train), run once per variant and seed."""

    name: str
    variant: Variant
    seed: int
    step: EvalStep
    directory: Path


@dataclass
class StudyPlan:
    spec: StudySpec
    runs: list[PlannedRun]
    tasks: list[PlannedTask]
    targets: dict[str, int]  # size -> the matched non-embedding parameter count
    device: str
    threads: int
    tokens_per_run: int
    notes: list[str] = field(default_factory=list)

    @property
    def sizes(self) -> list[str]:
        return list(dict.fromkeys(r.size for r in self.runs))

    @property
    def lrs(self) -> list[float]:
        return list(dict.fromkeys(r.lr for r in self.runs))


def _merge(*layers: dict[str, Any]) -> dict[str, Any]:
    """Model overrides of base, size and variant, later ones winning; mixer_options merged."""
    merged: dict[str, Any] = {}
    options: dict[str, Any] = {}
    for layer in layers:
        layer = copy.deepcopy(layer)
        options.update(layer.pop("mixer_options", None) or {})
        merged.update(layer)
    if options:
        merged["mixer_options"] = options
    return merged


def _fail(spec: StudySpec, message: str) -> ConfigError:
    return ConfigError(f"study spec {spec.path or '(given as data)'}: {message}")


def _config_dict(spec: StudySpec, variant: Variant, size_fields: dict[str, Any]) -> dict:
    """The run config (by section) of a variant at a size, before seed, lr and FFN width."""
    run = copy.deepcopy(spec.run)
    model = run.setdefault("model", {})
    options = {"mixer_options": variant.options} if variant.options else {}
    model["overrides"] = _merge(
        model.get("overrides") or {}, size_fields, variant.overrides, options
    )
    model["mixer"] = variant.mixer
    # A study's runs write no progress bars.
    run.setdefault("log", {})["progress"] = False
    return run


class _Counter:
    """Non-embedding parameter counts of run configs, on the meta device (cached)."""

    def __init__(self, spec: StudySpec, device: str) -> None:
        import torch

        from deltalab.data import load_tokenizer

        self.spec = spec
        self.device = torch.device(device)
        self.tokenizers: dict[str, Any] = {}
        self._load_tokenizer = load_tokenizer

    def model_config(self, where: str, tree: dict[str, Any]):
        from deltalab.train.config import RunConfig
        from deltalab.train.loop import _model_config

        try:
            config = RunConfig.from_dict(tree)
            spec = config.data.tokenizer
            if spec not in self.tokenizers:
                self.tokenizers[spec] = self._load_tokenizer(spec)
            return config, _model_config(config, self.tokenizers[spec], self.device)
        except UserError as error:
            raise _fail(self.spec, f"{where}: {error}") from error
        except (ValueError, TypeError) as error:
            raise _fail(self.spec, f"{where}: {error}") from error

    def count(self, where: str, tree: dict[str, Any]) -> tuple[Any, int, int, int]:
        """(run config, non-embedding count, total count, FFN width) of a config tree."""
        from deltalab.models.presets import count_parameters

        config, model = self.model_config(where, tree)
        return (
            config,
            count_parameters(model),
            count_parameters(model, embeddings=True),
            model.ffn_width,
        )


def _with_ffn(tree: dict[str, Any], width: int) -> dict[str, Any]:
    tree = copy.deepcopy(tree)
    tree["model"]["overrides"]["ffn_width"] = width
    return tree


def _solve_width(
    counter: _Counter, where: str, tree: dict[str, Any], target: int, multiple: int
) -> int | None:
    """The FFN width (a multiple of `multiple`) whose count is closest to `target`; the count is
    affine in the width (a SwiGLU of width w holds 3 * hidden * w weights per block)."""
    _, low, _, _ = counter.count(where, _with_ffn(tree, multiple))
    _, high, _, _ = counter.count(where, _with_ffn(tree, 2 * multiple))
    per_unit = (high - low) / multiple
    fixed = low - per_unit * multiple
    if per_unit <= 0:
        return None
    best = round((target - fixed) / per_unit / multiple) * multiple
    return best if best >= multiple else None


def _eval_words(settings: dict[str, Any]) -> tuple[str, ...]:
    # JSON is YAML, which is how `deltalab eval` reads a setting's value.
    return tuple(f"{name}={json.dumps(value)}" for name, value in settings.items())


def _slug(task: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in task)


def _checkpoint_step(spec: StudySpec, entry: EvalSpec, run_config: Any) -> EvalStep:
    """An eval step of a trained checkpoint: settings parsed now (errors before training),
    text settings defaulting to the run's data."""
    from deltalab.eval.tasks import get_task

    task = get_task(entry.task)
    names = {f.name for f in dataclasses.fields(task.settings)}
    settings = dict(entry.settings)
    for name in DATA_FIELDS:
        if name in names and name not in settings:
            settings[name] = getattr(run_config.data, name)
    return _step(spec, entry, settings, f"eval/{_slug(entry.task)}")


def _step(spec: StudySpec, entry: EvalSpec, settings: dict[str, Any], out: str) -> EvalStep:
    settings = _parsed(spec, entry.task, settings)
    return EvalStep(entry.task, _eval_words(settings), settings, out, entry.long_context)


def _task_step(spec: StudySpec, entry: EvalSpec, variant: Variant) -> EvalStep:
    """An eval step of a task that trains its own models, for one variant: `mixers` is the
    variant's kind and `mixer_options` its options."""
    from deltalab.eval.tasks import get_task

    task = get_task(entry.task)
    names = {f.name for f in dataclasses.fields(task.settings)}
    if "mixers" not in names:
        raise _fail(
            spec,
            f"evals task {entry.task!r} trains its own models but has no mixers setting, so "
            "the study cannot run it per mixer",
        )
    for name in ("mixers", "mixer_options"):
        if name in entry.settings:
            raise _fail(spec, f"evals {entry.task!r}: {name} is set by the study from grid.mixers")
    if variant.overrides:
        raise _fail(
            spec,
            f"evals task {entry.task!r} trains its own models, which cannot take variant "
            f"{variant.name!r}'s model overrides {variant.overrides}",
        )
    settings = {**entry.settings, "mixers": [variant.mixer]}
    if variant.options:
        if "mixer_options" not in names:
            raise _fail(
                spec, f"evals task {entry.task!r} takes no mixer_options for {variant.name!r}"
            )
        settings["mixer_options"] = variant.options
    return _step(spec, entry, settings, ".")


def _parsed(spec: StudySpec, task_name: str, settings: dict[str, Any]) -> dict[str, Any]:
    """`settings` as the task reads them (`3e-3` a number, lists for tuples): checked now, so a
    bad setting fails before anything trains, and compared as written to results.json."""
    from deltalab.eval.tasks import get_task, parse_settings

    task = get_task(task_name)
    words = list(_eval_words(settings))
    if task_name.startswith("lm-eval:"):
        words.insert(0, f"tasks={task_name.split(':', 1)[1]}")
    try:
        parsed = dataclasses.asdict(parse_settings(task.settings, words))
    except UserError as error:
        raise _fail(spec, f"evals {task_name!r}: {error}") from error
    return json.loads(json.dumps({name: parsed[name] for name in settings}))


def _device(spec: StudySpec) -> str:
    import torch

    if spec.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if spec.device == "cuda" and not torch.cuda.is_available():
        raise _fail(spec, "device is 'cuda' but no CUDA device is available")
    return spec.device


def run_name(variant: str, size: str, lr: float, seed: int) -> str:
    return f"{variant}.{size}.lr{lr:g}.s{seed}"


def make_plan(spec: StudySpec) -> StudyPlan:
    """Every run and task of `spec`, configs built and checked, parameter counts matched;
    ConfigError (naming the runs) for anything that would fail or be unfair."""
    from deltalab.eval.tasks import get_task

    device = _device(spec)
    counter = _Counter(spec, device)
    base_preset = (spec.run.get("model") or {}).get("preset", "tiny")
    sizes = spec.sizes if spec.sizes is not None else {base_preset: {}}
    checkpoint_entries, task_entries = [], []
    for entry in spec.evals:
        try:
            task = get_task(entry.task)
        except UserError as error:
            raise _fail(spec, f"evals: {error}") from error
        (checkpoint_entries if task.needs_checkpoint else task_entries).append(entry)

    targets: dict[str, int] = {}
    shapes: dict[tuple[str, str], tuple[dict, int, int, int]] = {}
    mismatched = []
    for size, size_fields in sizes.items():
        match = spec.variant(spec.match)
        tree = _config_dict(spec, match, size_fields)
        _, target, _, _ = counter.count(f"variant {match.name} at size {size}", tree)
        targets[size] = target
        for variant in spec.variants:
            where = f"variant {variant.name} at size {size}"
            tree = _config_dict(spec, variant, size_fields)
            if variant.name != spec.match and "ffn_width" not in variant.overrides:
                width = _solve_width(counter, where, tree, target, spec.ffn_multiple)
                if width is None:
                    mismatched.append(f"{variant.name}.{size} (its mixer alone exceeds the target)")
                    continue
                tree = _with_ffn(tree, width)
            _, count, total, width = counter.count(where, tree)
            shapes[(variant.name, size)] = (tree, count, total, width)
            if abs(count / target - 1) > spec.tolerance:
                mismatched.append(f"{variant.name}.{size} ({count:,}, {count / target - 1:+.1%})")
    if mismatched:
        raise _fail(
            spec,
            f"parameter counts do not match {spec.match}'s within {spec.tolerance:.0%} "
            f"(targets {', '.join(f'{s}: {t:,}' for s, t in targets.items())}; FFN widths are "
            f"multiples of params.ffn_multiple={spec.ffn_multiple}): {'; '.join(mismatched)}",
        )

    from deltalab.train.config import RunConfig

    runs = []
    for size in sizes:
        for variant in spec.variants:
            tree, count, total, width = shapes[(variant.name, size)]
            lrs = spec.lrs or (RunConfig.from_dict(tree).optim.lr,)
            for lr in lrs:
                for seed in spec.seeds:
                    name = run_name(variant.name, size, lr, seed)
                    directory = spec.out_dir / "runs" / name
                    run_tree = copy.deepcopy(tree)
                    run_tree.setdefault("train", {})["seed"] = seed
                    run_tree.setdefault("optim", {})["lr"] = lr
                    run_tree["train"]["device"] = device
                    run_tree["log"]["out_dir"] = str(directory)
                    config, *_ = counter.model_config(f"run {name}", run_tree)
                    steps = tuple(
                        _checkpoint_step(spec, e, config)
                        for e in checkpoint_entries
                        if variant.name not in e.skip
                    )
                    runs.append(
                        PlannedRun(
                            name,
                            variant,
                            size,
                            lr,
                            seed,
                            config,
                            count,
                            total,
                            width,
                            directory,
                            steps,
                        )
                    )
    tasks = []
    for entry in task_entries:
        for variant in (v for v in spec.variants if v.name not in entry.skip):
            step = _task_step(spec, entry, variant)
            for seed in spec.seeds:
                name = f"{_slug(entry.task)}.{variant.name}.s{seed}"
                tasks.append(PlannedTask(name, variant, seed, step, spec.out_dir / "tasks" / name))
    first = runs[0].config.train
    threads = spec.threads or max(1, (os.cpu_count() or 1) // spec.parallel)
    return StudyPlan(
        spec=spec,
        runs=runs,
        tasks=tasks,
        targets=targets,
        device=device,
        threads=threads,
        tokens_per_run=first.steps * first.batch_size * first.seq_len,
    )
