"""The task registry and typed task settings set from `name=value` words on the command line.

    deltalab eval runs/default/model --task passkey lengths=[1024,2048] depths=[0,0.5,1]

Each task declares a frozen dataclass of settings (deltalab/eval/settings.py) whose docstring has
one `name: text` line per field; a value is read as YAML and checked against the field's type
(`deltalab.config_parse`), and every error names the field, what was received and what was
expected. The registry names each task's function by import path: listing the tasks and checking
settings import no torch, and a task's module loads when it runs.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deltalab.config_parse import check_keys, coerce, field_docs, read_value, type_hints
from deltalab.errors import EvalError, closest
from deltalab.eval.settings import (
    GateSensitivitySettings,
    LmEvalSettings,
    MQARTrainSettings,
    NeedleSettings,
    PasskeySettings,
    PerplexitySettings,
    StreamingSettings,
)

if TYPE_CHECKING:
    from deltalab.eval.common import LoadedCheckpoint

__all__ = [
    "Task",
    "TaskContext",
    "TaskOutcome",
    "field_docs",
    "get_task",
    "parse_settings",
    "silenced_bars",
    "task_names",
]


@dataclass
class TaskContext:
    """What a task gets besides its settings."""

    checkpoint: LoadedCheckpoint | None
    seed: int
    device: str
    out_dir: Path
    long_context: str = "refuse"
    progress: bool | None = None  # tqdm's `disable` convention inverted: None = auto (a TTY)

    def bar(self, **kwargs: Any) -> Any:
        from tqdm.auto import tqdm

        disable = None if self.progress is None else not self.progress
        return tqdm(disable=disable, dynamic_ncols=True, leave=False, **kwargs)


@contextmanager
def silenced_bars(silence: bool = True) -> Iterator[None]:
    """While open (and `silence`), every tqdm bar is created disabled: deltalab's, and those of
    transformers (loading weights), datasets and lm-eval, which take no switch of ours. tqdm
    has no global off switch, so its constructor is wrapped and restored on exit."""
    if not silence:
        yield
        return
    from tqdm import std

    original = std.tqdm.__dict__["__init__"]

    def disabled(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["disable"] = True
        original.__get__(self, type(self))(*args, **kwargs)

    std.tqdm.__init__ = disabled  # type: ignore[method-assign]
    try:
        yield
    finally:
        std.tqdm.__init__ = original  # type: ignore[method-assign]


@dataclass
class TaskOutcome:
    """metrics: everything measured (results.json); summary: flat headline numbers (the
    --compare table); table: the markdown printed at the end; files: figures written."""

    metrics: dict[str, Any]
    summary: dict[str, Any]
    table: str
    files: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Task:
    """A task of `deltalab eval`: `runner` is the "module:function" that runs it, called as
    function(settings, ctx) -> TaskOutcome; with `family`, function(name) returns that function
    (one runner for a family of tasks)."""

    name: str
    summary: str
    settings: type
    runner: str
    needs_checkpoint: bool = True
    family: bool = False

    def run(self, settings: Any, ctx: TaskContext) -> TaskOutcome:
        """Imports the task's module and runs it."""
        module, _, name = self.runner.partition(":")
        function = getattr(importlib.import_module(module), name)
        return (function(self.name) if self.family else function)(settings, ctx)


_NEEDLES = {
    "niah-single-1": "S-NIAH-1: a number hidden in repeated noise",
    "niah-single-2": "S-NIAH-2: a number hidden in natural text",
    "niah-single-3": "S-NIAH-3: a uuid-like value hidden in natural text",
    "niah-multikey": "MK-NIAH: one key asked among 4 needles with different keys",
    "niah-multivalue": "MV-NIAH: all 4 values of one key",
    "niah-multiquery": "MQ-NIAH: the values of 4 keys asked at once",
    "variable-tracking": "chains of variable assignments: every name bound to a value",
}
_TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        Task(
            "perplexity",
            "loss per token, perplexity and bits per byte on held-out text",
            PerplexitySettings,
            "deltalab.eval.perplexity:perplexity",
        ),
        Task(
            "streaming",
            "loss per log-spaced position over a long stream read through the recurrent state",
            StreamingSettings,
            "deltalab.eval.streaming:streaming",
        ),
        Task(
            "gate-sensitivity",
            "per layer, how much each gate moves the memory and the loss, trained and at init",
            GateSensitivitySettings,
            "deltalab.eval.sensitivity:gate_sensitivity",
        ),
        Task(
            "mqar-train",
            "train small models on multi-query associative recall; test accuracy per setting at the "
            "learning rate chosen on validation examples",
            MQARTrainSettings,
            "deltalab.eval.mqar:train_mqar",
            needs_checkpoint=False,
        ),
        Task(
            "passkey",
            "a pass key hidden in noise: accuracy over a depth x length grid, heatmap",
            PasskeySettings,
            "deltalab.eval.needles:passkey",
        ),
        *(
            Task(
                name,
                f"{summary} (RULER style)",
                NeedleSettings,
                "deltalab.eval.needles:needle_runner",
                family=True,
            )
            for name, summary in _NEEDLES.items()
        ),
        Task(
            "lm-eval",
            "lm-evaluation-harness tasks (lm-eval 0.4.x) through the deltalab model",
            LmEvalSettings,
            "deltalab.eval.lm_eval_adapter:run_lm_eval",
        ),
    )
}


def task_names() -> list[str]:
    return sorted(_TASKS)


def get_task(name: str) -> Task:
    """The task called `name` (`lm-eval:TASKS` is the lm-evaluation-harness adapter)."""
    key = "lm-eval" if name.startswith("lm-eval:") else name
    if key not in _TASKS:
        hint = closest(name, list(_TASKS))
        # A prefix such as "mqar" or "niah" is too short for difflib but names a family.
        family = [t for t in sorted(_TASKS) if t.startswith(name)] if name else []
        if not hint and family:
            hint = f" (did you mean {' or '.join(map(repr, family))}?)"
        raise EvalError(f"--task: unknown task {name!r}{hint}; `deltalab eval --list` lists them")
    return _TASKS[key]


def parse_settings(cls: type, words: list[str]) -> Any:
    """A `cls` instance from `name=value` words (values in YAML syntax)."""
    hints = type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    values: dict[str, Any] = {}
    given: dict[str, str] = {}
    try:
        for word in words:
            name, sep, text = word.partition("=")
            if not sep or not name:
                raise EvalError(f"task setting {word!r} must be name=value, e.g. seq_len=512")
            check_keys(
                {name: text},
                names,
                what="setting",
                where=" for this task",
                listing="its settings are",
            )
            if name in given:
                raise EvalError(
                    f"{name} is given twice ({given[name]} and {text}); give each setting once"
                )
            given[name] = text
            values[name] = coerce(name, read_value(name, text, hints[name]), hints[name])
        return cls(**values)
    except EvalError:
        raise
    except (TypeError, ValueError) as error:
        raise EvalError(str(error)) from error
