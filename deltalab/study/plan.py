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
from deltalab.study.spec import SELECTION_TASK, EvalSpec, StudySpec, Variant

__all__ = [
    "EvalStep",
    "PlannedRun",
    "PlannedTask",
    "PlannedThroughput",
    "StudyPlan",
    "lr_text",
    "make_plan",
]

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


@dataclass(frozen=True)
class PlannedThroughput:
    """A variant's speed measurement at a size: a short run of its config, trained alone
    (`spec.throughput_steps` steps at the first seed and rate, evaluated only before training
    and at its end, no sample)."""

    name: str
    variant: Variant
    size: str
    config: Any  # RunConfig
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
    throughput: list[PlannedThroughput] = field(default_factory=list)

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
        from deltalab.train.preflight import model_config

        try:
            config = RunConfig.from_dict(tree)
            spec = config.data.tokenizer
            if spec not in self.tokenizers:
                self.tokenizers[spec] = self._load_tokenizer(spec)
            return config, model_config(config, self.tokenizers[spec], self.device)
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
    if spec.sweeps and entry.task == SELECTION_TASK:
        # The rate is chosen on these windows; the report's test numbers are the others'.
        settings["validation_fraction"] = spec.selection.validation_fraction
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


def _longest_context(step: EvalStep, tokenizer: Any) -> int | None:
    """The longest context, in tokens, of an evaluation with context lengths, its examples built
    as `deltalab eval` builds them (EvalError for a length too short to hold one); None for the
    other tasks and for haystacks of natural text (reading it is the evaluation's work)."""
    from deltalab.eval import needles
    from deltalab.eval.tasks import get_task, parse_settings

    settings = parse_settings(get_task(step.task).settings, list(step.words))
    if step.task == "passkey":
        return max(
            needles.make_passkey_example(n, depth, 0, tokenizer, settings.digits).length
            for n in settings.lengths
            for depth in settings.depths
        )
    haystack = needles.NEEDLE_TASKS.get(step.task, ("text",))[0]
    if step.task == "variable-tracking" or haystack == "noise":
        one = dataclasses.replace(settings, samples=1)
        return max(e.length for e in needles.needle_examples(step.task, one, 0, tokenizer))
    return None


def _full_attention(model_config: Any) -> bool:
    """Whether a layer attends over its whole context: `deltalab eval` refuses such a model a
    context longer than it was trained on, unless long_context is "window"."""
    import torch

    from deltalab.layers.attention import Attention
    from deltalab.models.lm import CausalLM

    with torch.device("meta"):
        model = CausalLM(model_config)
    return any(isinstance(m, Attention) and m.window is None for m in model.modules())


def _check_contexts(
    spec: StudySpec, run: PlannedRun, model_config: Any, tokenizer: Any, longest_of: dict
) -> None:
    """Evaluations that can only fail once the run is trained are refused now: a length too
    short for the task's prompt, or longer than a full-attention run's train.seq_len.
    `longest_of` caches `_longest_context` by task, settings and tokenizer."""
    from deltalab.eval.common import EvalError

    trained = run.config.train.seq_len
    full = None
    for step in run.evals:
        where = f"evals {step.task!r} of run {run.name}"
        key = (step.task, step.words, run.config.data.tokenizer)
        try:
            if key not in longest_of:
                longest_of[key] = _longest_context(step, tokenizer)
        except EvalError as error:
            raise _fail(spec, f"{where}: {error}") from error
        longest = longest_of[key]
        if longest is None or longest <= trained or step.long_context != "refuse":
            continue
        full = _full_attention(model_config) if full is None else full
        if full:
            raise _fail(
                spec,
                f"{where}: contexts of up to {longest} tokens, longer than the {trained} "
                f"tokens of train.seq_len, which {run.variant.name} (full attention) refuses; "
                f"set the entry's long_context: window, skip: [{run.variant.name}], or shorter "
                "lengths",
            )


def _check_out_dir(spec: StudySpec) -> None:
    for path in (spec.out_dir, *spec.out_dir.parents):
        if path.exists():
            if not path.is_dir():
                raise _fail(
                    spec,
                    f"out_dir {str(spec.out_dir)!r} cannot be a directory: {str(path)!r} is a "
                    "file; choose another out_dir (or --out)",
                )
            return


def _device(spec: StudySpec) -> str:
    import torch

    if spec.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if spec.device == "cuda" and not torch.cuda.is_available():
        raise _fail(spec, "device is 'cuda' but no CUDA device is available")
    return spec.device


def lr_text(lr: float) -> str:
    """The learning rate as run names and the report write it: `:g` (0.003, 1e-05) where that reads back as
    the same number, else the shortest text that does (0.0030000001), so that two rates never
    share a name."""
    short = f"{lr:g}"
    return short if float(short) == lr else repr(lr)


def run_name(variant: str, size: str, lr: float, seed: int) -> str:
    return f"{variant}.{size}.lr{lr_text(lr)}.s{seed}"


def _refuse_shared_directories(spec: StudySpec, runs: list, tasks: list) -> None:
    """No two runs, task jobs or evaluations of a run may share a directory: the second would
    pass for done with the first's results. Paths compare case-folded, as a case-insensitive
    file system compares them."""
    owners: dict[str, str] = {}
    clashes = []

    def claim(path: Path, owner: str) -> None:
        first = owners.setdefault(str(path).casefold(), owner)
        if first != owner:
            clashes.append(f"{first} and {owner} ({path})")

    for run in runs:
        claim(run.directory, f"run {run.name}")
        for step in run.evals:
            claim(run.directory / step.out, f"evals {step.task!r} of {run.name}")
    for task in tasks:
        claim(task.directory, f"task job {task.name}")
    if clashes:
        raise _fail(
            spec,
            f"grid points would share a directory: {'; '.join(clashes)}; give them names that "
            "differ by more than letter case",
        )


def make_plan(spec: StudySpec) -> StudyPlan:
    """Every run and task of `spec`, configs built and checked, parameter counts matched;
    ConfigError (naming the runs) for anything that would fail or be unfair."""
    from deltalab.eval.tasks import get_task

    _check_out_dir(spec)
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

    runs: list[PlannedRun] = []
    longest_of: dict[tuple, int | None] = {}
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
                    config, model_config = counter.model_config(f"run {name}", run_tree)
                    steps = tuple(
                        _checkpoint_step(spec, e, config)
                        for e in checkpoint_entries
                        if variant.name not in e.skip
                    )
                    run = PlannedRun(
                        name, variant, size, lr, seed, config, count, total, width, directory, steps
                    )
                    tokenizer = counter.tokenizers[config.data.tokenizer]
                    _check_contexts(spec, run, model_config, tokenizer, longest_of)
                    runs.append(run)
    tasks = []
    for entry in task_entries:
        for variant in (v for v in spec.variants if v.name not in entry.skip):
            step = _task_step(spec, entry, variant)
            for seed in spec.seeds:
                name = f"{_slug(entry.task)}.{variant.name}.s{seed}"
                tasks.append(PlannedTask(name, variant, seed, step, spec.out_dir / "tasks" / name))
    throughput = []
    if spec.throughput_steps is not None:
        throughput = [
            _throughput(spec, counter, variant, size, shapes[(variant.name, size)][0], device)
            for size in sizes
            for variant in spec.variants
        ]
    _refuse_shared_directories(spec, runs, tasks)
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
        throughput=throughput,
    )


def _throughput(
    spec: StudySpec, counter: _Counter, variant: Variant, size: str, tree: dict, device: str
) -> PlannedThroughput:
    """The speed run of a variant at a size: its grid config at the first seed and rate, cut to
    `throughput_steps` steps, warmup cut in proportion, evaluated only before training and at
    its end."""
    from deltalab.train.config import RunConfig

    name = f"throughput.{variant.name}.{size}"
    directory = spec.out_dir / "throughput" / name
    tree = copy.deepcopy(tree)
    steps = spec.throughput_steps
    assert steps is not None
    train = tree.setdefault("train", {})
    grid = RunConfig.from_dict(tree)
    grid_steps, warmup = grid.train.steps, grid.schedule.warmup_steps
    train.update(seed=spec.seeds[0], steps=steps, device=device)
    tree.setdefault("schedule", {})["warmup_steps"] = warmup * steps // max(grid_steps, 1)
    if spec.lrs:
        tree.setdefault("optim", {})["lr"] = spec.lrs[0]
    tree.setdefault("eval", {}).update(every=0, sample_tokens=0)
    tree.setdefault("checkpoint", {})["every"] = 0
    tree["log"]["out_dir"] = str(directory)
    config, _ = counter.model_config(f"run {name}", tree)
    return PlannedThroughput(name, variant, size, config, directory)
