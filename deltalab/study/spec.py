"""The study spec: a YAML file naming one grid of `deltalab train` runs and the evaluations
that follow each.

    out_dir: runs/study/example         # where the runs and the report go (default: runs/study/<file stem>)
    parallel: 2                         # runs at once
    device: auto                        # auto (CUDA when available), cpu or cuda
    baseline: gdn2                      # the variant paired differences are taken against
    params: {match: gdn2, tolerance: 0.02, ffn_multiple: 8}
    run:                                # the train config every run shares, by section
      model: {preset: tiny}
      train: {steps: 120, batch_size: 8, seq_len: 128}
    grid:
      mixers: [transformer, gdn2, {name: muir-static, mixer: muir, options: {read_gate: static}}]
      seeds: [0, 1, 2]
      lrs: [1e-3, 3e-3]                 # optional: optim.lr of the run config (or its preset's)
      sizes: {tiny: {}, wide: {hidden_size: 192}}   # optional: model overrides per size
    evals:
      - {task: perplexity, settings: {max_tokens: 65536}}
      - {task: mqar-train, settings: {steps: 150}}
    selection: {metric: perplexity.validation_loss, goal: min, validation_fraction: 0.5}
    throughput: {steps: 30}             # optional: each variant's speed, one run alone

With several grid.lrs, every variant trains at each, and the report gives each variant's test
results at the one rate whose mean `selection.metric` over seeds is best: a number the
perplexity evaluation measures on its validation windows (the first `validation_fraction` of the
windows it scores), never on the test windows.
Every key is checked here, before anything is planned: an unknown one is named with the closest
valid name. Variants may change the model only (mixer, its options, model overrides): training
settings are shared by construction, so no mixer is tuned in a way the others are not.

`throughput` measures each variant's training speed with one short run of its config (at the
first seed and rate, `steps` steps, no evaluation along the way) trained alone on its device
before any other job starts: the speed the report's time to loss uses, where the grid's runs,
`parallel` at a time, share their devices.
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from deltalab.catalog import MIXER_KINDS
from deltalab.config_parse import check_keys, coerce, require, require_choice
from deltalab.errors import ConfigError, UserError, closest

__all__ = ["EvalSpec", "Selection", "StudySpec", "Variant", "load_spec", "parse_spec"]

DEVICES = ("auto", "cpu", "cuda")
THROUGHPUT_STEPS = 30
MIN_THROUGHPUT_STEPS = 8
LONG_CONTEXT = ("refuse", "window")
TOP_KEYS = (
    "out_dir",
    "parallel",
    "device",
    "threads",
    "baseline",
    "params",
    "run",
    "grid",
    "evals",
    "selection",
    "throughput",
)
SELECTION_KEYS = ("metric", "goal", "validation_fraction")
GOALS = ("min", "max")
# The task whose validation windows choose a learning rate, and what it measures there.
SELECTION_TASK = "perplexity"
SELECTION_METRICS = ("validation_loss", "validation_bits_per_byte")
PARAMS_KEYS = ("match", "tolerance", "ffn_multiple")
GRID_KEYS = ("mixers", "seeds", "lrs", "sizes")
VARIANT_KEYS = ("name", "mixer", "options", "overrides")
EVAL_KEYS = ("task", "settings", "long_context", "skip")
# What the study sets in each run itself, so the spec may not.
STUDY_FIELDS = {
    "log.out_dir": "the study puts each run in its own directory under out_dir",
    "train.seed": "seeds are grid.seeds",
    "model.mixer": "mixers are grid.mixers",
    "train.device": "the device is the spec's top-level device",
}
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_+-]*$")
DEFAULT_TOLERANCE = 0.02


@dataclass(frozen=True)
class Variant:
    """One entry of grid.mixers: a mixer kind with its options and model overrides.

    name: how runs and tables call it (default: the mixer kind).
    options: the model's mixer_options (merged over those of the run config).
    overrides: further model fields (e.g. attention_every); not `mixer`.
    """

    name: str
    mixer: str
    options: dict[str, Any]
    overrides: dict[str, Any]


@dataclass(frozen=True)
class EvalSpec:
    """One `deltalab eval` task run after each training run (or, for a task that trains its
    own models, once per variant and seed)."""

    task: str
    settings: dict[str, Any]
    long_context: str = "refuse"
    skip: tuple[str, ...] = ()  # variants the task does not apply to (no gates to measure)


@dataclass(frozen=True)
class Selection:
    """How a learning rate is chosen per variant when grid.lrs holds several: the mean over
    seeds of `metric` (a perplexity validation number), lowest (`goal` "min") or highest;
    `validation_fraction` of the perplexity windows are the validation part."""

    metric: str = f"{SELECTION_TASK}.validation_loss"
    goal: str = "min"
    validation_fraction: float = 0.5


@dataclass(frozen=True)
class StudySpec:
    """A validated study spec (see the module docstring for the file format)."""

    path: Path | None
    out_dir: Path
    parallel: int
    device: str
    threads: int | None
    baseline: str
    match: str
    tolerance: float
    ffn_multiple: int
    run: dict[str, Any]
    variants: tuple[Variant, ...]
    seeds: tuple[int, ...]
    lrs: tuple[float, ...] | None
    sizes: dict[str, dict[str, Any]] | None
    evals: tuple[EvalSpec, ...]
    selection: Selection = Selection()
    throughput_steps: int | None = None

    @property
    def sweeps(self) -> bool:
        """Whether a learning rate is chosen (grid.lrs holds several)."""
        return self.lrs is not None and len(self.lrs) > 1

    def variant(self, name: str) -> Variant:
        return next(v for v in self.variants if v.name == name)


def _fail(where: str, message: str) -> ConfigError:
    return ConfigError(f"study spec {where}: {message}")


def _mapping(value: Any, key: str) -> dict[str, Any]:
    """`value` as a mapping with string keys (None: an empty one)."""
    return {} if value is None else dict(coerce(key, value, dict[str, Any]))


def _list(value: Any, key: str, hint: Any) -> tuple[Any, ...]:
    """`value` as a non-empty list of `hint` items (tuple[X, ...])."""
    require(isinstance(value, list) and len(value) > 0, key, "a non-empty list", value)
    return coerce(key, value, hint)


def _int(value: Any, key: str, minimum: int) -> int:
    value = coerce(key, value, int)
    require(value >= minimum, key, f"an int >= {minimum}", value)
    return value


def _name(value: Any, key: str, where: str) -> str:
    if not isinstance(value, str) or not NAME.match(value):
        raise _fail(
            where,
            f"{key} must be a name of letters, digits, '_', '+' and '-' (it names run "
            f"directories), got {value!r}",
        )
    return value


def _entry(entry: Any, key: str, shorthand: str, known: tuple[str, ...]) -> dict:
    """A list entry as a mapping of known keys; a plain string is `{shorthand: string}`."""
    data = _mapping({shorthand: entry} if isinstance(entry, str) else entry, key)
    check_keys(data, known, f"{key}.")
    return data


def _variant(entry: Any, index: int, where: str) -> Variant:
    key = f"grid.mixers[{index}]"
    data = _entry(entry, key, "mixer", VARIANT_KEYS)
    mixer = data.get("mixer")
    if mixer not in MIXER_KINDS:
        raise _fail(
            where,
            f"{key}.mixer must be one of {list(MIXER_KINDS)}, got {mixer!r}"
            f"{closest(str(mixer), MIXER_KINDS)}",
        )
    overrides = _mapping(data.get("overrides"), f"{key}.overrides")
    if "mixer" in overrides or "mixer_options" in overrides:
        raise _fail(
            where, f"{key}.overrides may not set mixer or mixer_options: use {key}.mixer/options"
        )
    return Variant(
        name=_name(data.get("name", mixer), f"{key}.name", where),
        mixer=mixer,
        options=_mapping(data.get("options"), f"{key}.options"),
        overrides=overrides,
    )


def _check_run(run: dict[str, Any], lrs_given: bool, where: str) -> None:
    """The shared run config: valid as a `deltalab train` config, without the fields the study
    sets itself."""
    from deltalab.train.config import RunConfig

    for dotted, reason in STUDY_FIELDS.items():
        section, name = dotted.split(".")
        if name in (run.get(section) or {}):
            raise _fail(where, f"run.{dotted} is set by the study ({reason}); remove it")
    if lrs_given and "lr" in (run.get("optim") or {}):
        raise _fail(where, "run.optim.lr and grid.lrs are both set; keep one")
    try:
        RunConfig.from_dict(run)
    except (ValueError, TypeError) as error:
        raise _fail(where, f"run: {error}") from error


def _evals(value: Any, where: str) -> tuple[EvalSpec, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _fail(where, f"evals must be a list of {{task, settings}} entries, got {value!r}")
    found = []
    for index, entry in enumerate(value):
        key = f"evals[{index}]"
        data = _entry(entry, key, "task", EVAL_KEYS)
        task = data.get("task")
        if not isinstance(task, str) or not task:
            raise _fail(
                where, f"{key}.task must be a task name (deltalab eval --list), got {task!r}"
            )
        long_context = data.get("long_context", "refuse")
        require_choice(f"{key}.long_context", long_context, LONG_CONTEXT)
        skip = coerce(f"{key}.skip", data.get("skip", []), tuple[str, ...])
        settings = _mapping(data.get("settings"), f"{key}.settings")
        found.append(EvalSpec(task, settings, long_context, skip))
    tasks = [e.task for e in found]
    for task in tasks:
        if tasks.count(task) > 1:
            raise _fail(where, f"evals lists the task {task!r} twice; one entry per task")
    return tuple(found)


def _selection(
    value: Any, lrs: tuple[float, ...] | None, evals: tuple[EvalSpec, ...], where: str
) -> Selection:
    data = _mapping(value, "selection")
    check_keys(data, SELECTION_KEYS, "selection.")
    default = Selection()
    metric = data.get("metric", default.metric)
    names = [f"{SELECTION_TASK}.{name}" for name in SELECTION_METRICS]
    if metric not in names:
        raise _fail(
            where,
            f"selection.metric must be one of {names} (measured on validation windows, apart "
            f"from the test ones), got {metric!r}{closest(str(metric), names)}",
        )
    goal = data.get("goal", default.goal)
    require_choice("selection.goal", goal, GOALS)
    fraction = coerce(
        "selection.validation_fraction",
        data.get("validation_fraction", default.validation_fraction),
        float,
    )
    if not 0 < fraction < 1:
        raise _fail(where, f"selection.validation_fraction must be in (0, 1), got {fraction}")
    sweeps = lrs is not None and len(lrs) > 1
    task = next((e for e in evals if e.task == SELECTION_TASK), None)
    if sweeps and task is None:
        raise _fail(
            where,
            f"grid.lrs holds {len(lrs)} rates but evals has no {SELECTION_TASK} task, whose "
            f"validation windows choose one (selection.metric {metric!r}); add "
            f"{{task: {SELECTION_TASK}}} or give grid.lrs one rate",
        )
    if task is not None and task.skip and sweeps:
        raise _fail(where, f"evals {SELECTION_TASK} may not skip variants: it chooses their rates")
    if task is not None and "validation_fraction" in task.settings:
        raise _fail(
            where,
            f"evals {SELECTION_TASK}: validation_fraction is set by the study; give "
            "selection.validation_fraction",
        )
    return Selection(metric, goal, fraction)


def parse_spec(data: Any, path: str | os.PathLike[str] | None = None) -> StudySpec:
    """The `StudySpec` of `data` (a spec file's parsed YAML); ConfigError naming the key."""
    where = str(path) if path is not None else "(given as data)"
    try:
        return _parse(data, path, where)
    except UserError:
        raise
    except (TypeError, ValueError) as error:
        raise _fail(where, str(error)) from error


def _parse(data: Any, path: str | os.PathLike[str] | None, where: str) -> StudySpec:
    spec = _mapping(data, "the spec")
    check_keys(spec, TOP_KEYS)
    if "grid" not in spec:
        raise _fail(where, "grid is required (at least grid.mixers)")
    grid = _mapping(spec["grid"], "grid")
    check_keys(grid, GRID_KEYS, "grid.")
    variants = tuple(
        _variant(entry, i, where)
        for i, entry in enumerate(_list(grid.get("mixers"), "grid.mixers", tuple[Any, ...]))
    )
    names = [v.name for v in variants]
    for name in names:
        if names.count(name) > 1:
            raise _fail(
                where, f"grid.mixers names {name!r} twice; give the variants distinct names"
            )
    seeds = _list(grid.get("seeds", [0]), "grid.seeds", tuple[int, ...])
    require(min(seeds) >= 0, "grid.seeds", "ints >= 0", list(seeds))
    if len(set(seeds)) != len(seeds):
        raise _fail(where, f"grid.seeds repeats a seed: {list(seeds)}")
    lrs = None
    if grid.get("lrs") is not None:
        lrs = _list(grid["lrs"], "grid.lrs", tuple[float, ...])
        if any(lr <= 0 for lr in lrs) or len(set(lrs)) != len(lrs):
            raise _fail(where, f"grid.lrs must be distinct numbers > 0, got {list(lrs)}")
    sizes = None
    if grid.get("sizes") is not None:
        raw = _mapping(grid["sizes"], "grid.sizes")
        if not raw:
            raise _fail(where, "grid.sizes must name at least one size (or be left out)")
        sizes = {
            _name(name, "grid.sizes name", where): _mapping(fields, f"grid.sizes.{name}")
            for name, fields in raw.items()
        }
        for name, fields in sizes.items():
            if "mixer" in fields:
                raise _fail(where, f"grid.sizes.{name} may not set mixer")
    evals = _evals(spec.get("evals"), where)
    for index, entry in enumerate(evals):
        for name in entry.skip:
            if name not in names:
                raise _fail(
                    where,
                    f"evals[{index}].skip names {name!r}, not a grid.mixers name"
                    f"{closest(name, names)}; they are {names}",
                )
    baseline = spec.get("baseline", names[0])
    if baseline not in names:
        raise _fail(
            where,
            f"baseline {baseline!r} is not a grid.mixers name{closest(str(baseline), names)}; they are {names}",
        )
    params = _mapping(spec.get("params"), "params")
    check_keys(params, PARAMS_KEYS, "params.")
    match = params.get("match", baseline)
    if match not in names:
        raise _fail(
            where,
            f"params.match {match!r} is not a grid.mixers name{closest(str(match), names)}; they are {names}",
        )
    tolerance = coerce("params.tolerance", params.get("tolerance", DEFAULT_TOLERANCE), float)
    if not 0 <= tolerance <= DEFAULT_TOLERANCE:
        raise _fail(
            where,
            f"params.tolerance must be in [0, {DEFAULT_TOLERANCE}] (parameter counts are matched "
            f"within 2% at most), got {tolerance}",
        )
    selection = _selection(spec.get("selection"), lrs, evals, where)
    run = copy.deepcopy(_mapping(spec.get("run"), "run"))
    _check_run(run, lrs is not None, where)
    device = spec.get("device", "auto")
    require_choice("device", device, DEVICES)
    threads = spec.get("threads")
    if threads is not None:
        threads = _int(threads, "threads", 1)
    stem = Path(path).stem if path is not None else "study"
    out_dir = spec.get("out_dir", f"runs/study/{stem}")
    if not isinstance(out_dir, str) or not out_dir:
        raise _fail(where, f"out_dir must be a path, got {out_dir!r}")
    return StudySpec(
        path=Path(path) if path is not None else None,
        out_dir=Path(out_dir).resolve(),
        parallel=_int(spec.get("parallel", 1), "parallel", 1),
        device=device,
        threads=threads,
        baseline=baseline,
        match=match,
        tolerance=tolerance,
        ffn_multiple=_int(params.get("ffn_multiple", 8), "params.ffn_multiple", 1),
        run=run,
        variants=variants,
        seeds=seeds,
        lrs=lrs,
        sizes=sizes,
        evals=evals,
        selection=selection,
        throughput_steps=_throughput_steps(spec.get("throughput")),
    )


def _throughput_steps(value: Any) -> int | None:
    """throughput.steps (None without a throughput section): enough steps for a median past
    the first ones, which compile and warm up."""
    if value is None:
        return None
    data = _mapping(value, "throughput")
    check_keys(data, ("steps",), "throughput.")
    return _int(data.get("steps", THROUGHPUT_STEPS), "throughput.steps", MIN_THROUGHPUT_STEPS)


def load_spec(path: str | os.PathLike[str]) -> StudySpec:
    """The spec of a YAML file; ConfigError naming the file for a missing or malformed one."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"study spec {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read study spec {str(path)!r}: {error}") from error
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"study spec {path}: not valid YAML: {error}") from error
    return parse_spec(data, path)
