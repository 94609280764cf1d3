"""`deltalab eval`: run a task on checkpoints, list the tasks, or compare finished runs.

    deltalab eval runs/default/model --task perplexity
    deltalab eval runs/a/model runs/b/model --task streaming tokens=1048576 split=all
    deltalab eval --task mqar-train mixers=[gdn2,transformer]
    deltalab eval --list
    deltalab eval --compare runs/eval/perplexity-a runs/eval/perplexity-b

Words with `=` are the task's settings (`deltalab eval --list` shows them) unless they name an
existing path; the others are checkpoints; words after `--` are settings. Each result gets its own
directory: under runs/eval/ a new TASK-RUN (TASK-RUN-2, ... when taken); an --out that already
holds results.json is refused unless --overwrite. Mistakes in the input, --out included, end the
command before any evaluation with one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from deltalab.cli import DEVICE_HELP, DTYPE_HELP, add_command

__all__ = ["add_parser", "run_eval"]


def add_parser(commands: Any) -> None:
    """Adds the `eval` subcommand to the `deltalab` parser's subcommands."""
    parser = add_command(
        commands,
        "eval",
        "evaluate checkpoints: perplexity, streaming, MQAR, passkey, needles, lm-eval",
        __doc__,
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="CHECKPOINT|name=value", help="checkpoints and settings"
    )
    parser.add_argument("--task", help="task name (see --list); lm-eval:TASK1,TASK2 for lm-eval")
    parser.add_argument("--list", action="store_true", help="list the tasks and their settings")
    parser.add_argument("--compare", nargs="+", metavar="DIR", help="results dirs to tabulate")
    parser.add_argument(
        "--out", default=None, help="results directory (default: a new runs/eval/TASK-RUN)"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace the results an --out already holds"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of every random choice (>= 0)")
    parser.add_argument("--device", default="auto", help=DEVICE_HELP)
    parser.add_argument("--dtype", default=None, help=DTYPE_HELP)
    parser.add_argument("--tokenizer", default=None, help='"byte" or a local tokenizer path')
    parser.add_argument(
        "--trained-length",
        type=int,
        default=None,
        help="training sequence length, when no run config.yaml sits beside the checkpoint",
    )
    parser.add_argument(
        "--long-context",
        choices=("refuse", "window"),
        default="refuse",
        help="full-attention models past their trained length: refuse, or a sliding window",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    # Words after `--` (set by the `deltalab` parser): settings even where a path has their name.
    parser.set_defaults(run=run_eval, settings=[])


def _slug(checkpoint: str) -> str:
    from deltalab.eval.common import checkpoint_label

    return re.sub(r"[^A-Za-z0-9._-]+", "_", checkpoint_label(checkpoint)) or "checkpoint"


def _list_tasks() -> str:
    from deltalab.eval.tasks import field_docs, get_task, task_names

    lines = []
    described: dict[type, str] = {}
    for name in task_names():
        task = get_task(name)
        shown = "lm-eval:TASKS" if name == "lm-eval" else name
        lines.append(f"{shown}: {task.summary}")
        if task.settings in described:
            lines.append(f"    (settings as {described[task.settings]})")
            continue
        described[task.settings] = shown
        docs = field_docs(task.settings)
        for spec in dataclasses.fields(task.settings):
            default = (
                spec.default if spec.default is not dataclasses.MISSING else spec.default_factory()
            )
            lines.append(f"    {spec.name}={default!r}: {docs.get(spec.name, '')}")
    return "\n".join(lines)


def _compare(dirs: list[str], out: str | None) -> str:
    from deltalab.eval.common import checkpoint_label
    from deltalab.eval.results import compare_table, load_results
    from deltalab.eval.streaming import plot_streaming

    records = [(d, load_results(d)) for d in dirs]
    table = compare_table(records)
    if out is not None and all(r["task"] == "streaming" for _, r in records):
        runs = [
            (checkpoint_label((r["checkpoint"] or {}).get("path", d)), r["metrics"])
            for d, r in records
        ]
        plot = plot_streaming(runs, Path(out) / "streaming.png")
        table += f"\n\nplot: {plot}"
    return table


def _split_words(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(settings, checkpoints): a word is a setting when it holds `=` and names no existing path
    (a checkpoint directory may be called `lr=0.01`), or when it comes after `--`."""
    settings = [w for w in args.overrides if "=" in w and not Path(w).exists()]
    checkpoints = [w for w in args.overrides if w not in settings]
    return settings + list(args.settings), checkpoints


def _next_free(path: Path, chosen: list[Path], free: Any) -> Path:
    """`path`, else `path-2`, `path-3`, ...: the first not chosen already and `free`."""
    candidate, count = path, 1
    while candidate in chosen or not free(candidate):
        count += 1
        candidate = path.with_name(f"{path.name}-{count}")
    return candidate


def _result_dirs(
    task: str, checkpoints: list[str], args: argparse.Namespace
) -> tuple[list[Path], list[Path]]:
    """One results directory per checkpoint (one for a task that trains its own models), each
    checked writable and reserved before any evaluation runs; and those of them it created.

    Under the default runs/eval/ a directory that exists is never reused (TASK-RUN-2 ...), so an
    evaluation never replaces another; an --out that holds results.json is refused unless
    --overwrite. Two checkpoints of one name (a/run/model, b/run/model) get RUN and RUN-2.
    """
    from deltalab.errors import EvalError
    from deltalab.eval.results import RESULTS_NAME

    if args.out is None:
        names = [f"{task}-{_slug(c)}" for c in checkpoints] or [task]
        wanted = [Path("runs/eval") / name for name in names]
    elif len(checkpoints) > 1:
        wanted = [Path(args.out) / _slug(c) for c in checkpoints]
    else:
        wanted = [Path(args.out)]
    where = "--out" if args.out is not None else "results directory"
    chosen: list[Path] = []
    created: list[Path] = []
    for path in wanted:
        if args.out is None:
            path = _next_free(path, chosen, lambda p: not p.exists())
        else:
            path = _next_free(path, chosen, lambda p: True)
            if path.exists() and not path.is_dir():
                raise EvalError(f"--out {str(path)!r} is a file; results need a directory")
            if (path / RESULTS_NAME).exists() and not args.overwrite:
                raise EvalError(
                    f"--out {str(path)!r} already holds the {RESULTS_NAME} of an earlier "
                    "evaluation; choose another --out, or pass --overwrite to replace it"
                )
        try:
            if not path.exists():
                created.append(path)
            path.mkdir(parents=True, exist_ok=args.out is not None)
            tempfile.TemporaryFile(dir=path).close()
        except OSError as error:
            reason = error.strerror or error
            raise EvalError(f"{where} {str(path)!r} cannot be written: {reason}") from error
        chosen.append(path)
    return chosen, created


def _evaluate(args: argparse.Namespace) -> str:
    from deltalab.errors import EvalError
    from deltalab.eval.tasks import get_task, parse_settings

    settings_words, checkpoints = _split_words(args)
    if args.task is None:
        raise EvalError("--task is required (or --list, or --compare DIR...)")
    task = get_task(args.task)
    if args.task.startswith("lm-eval:"):
        if not args.task.split(":", 1)[1].strip(" ,"):
            raise EvalError(
                "--task lm-eval: names no lm-eval task; list them after the colon, e.g. "
                "--task lm-eval:hellaswag,arc_easy"
            )
        settings_words.insert(0, f"tasks={args.task.split(':', 1)[1]}")
    settings = parse_settings(task.settings, settings_words)
    if args.seed < 0:
        raise EvalError(f"--seed must be an int >= 0, got {args.seed}")
    # torch: past the checks of the words above
    from deltalab.generate import require_device, require_dtype

    # Resolved once ("auto"), so that the results record the device and dtype the task ran in.
    device = require_device(args.device, "--device")
    args.device = str(device)
    if task.needs_checkpoint and not checkpoints:
        raise EvalError(f"task {task.name!r} needs a CHECKPOINT directory (a run's model/)")
    if not task.needs_checkpoint and checkpoints:
        raise EvalError(f"task {task.name!r} trains its own models; got checkpoints {checkpoints}")
    if not task.needs_checkpoint and args.dtype is not None:
        raise EvalError(f"task {task.name!r} trains its own models; --dtype is for a checkpoint")
    dtype = require_dtype(args.dtype or "auto", device, "--dtype")
    args.dtype = str(dtype).removeprefix("torch.")
    out_dirs, created = _result_dirs(task.name, checkpoints, args)
    try:
        return _run_all(args, task, settings, checkpoints, out_dirs)
    finally:
        for path in created:
            # A directory reserved for a result that never came is not left behind.
            if path.is_dir() and not any(path.iterdir()):
                path.rmdir()


def _run_all(
    args: argparse.Namespace,
    task: Any,
    settings: Any,
    checkpoints: list[str],
    out_dirs: list[Path],
) -> str:
    from deltalab.eval.common import load_checkpoint
    from deltalab.eval.results import write_results
    from deltalab.eval.streaming import plot_streaming
    from deltalab.eval.tasks import TaskContext, silenced_bars

    reports, streams = [], []
    targets: list[str | None] = list(checkpoints) or [None]
    with silenced_bars(args.no_progress):
        for checkpoint, out_dir in zip(targets, out_dirs, strict=True):
            loaded = None
            if checkpoint is not None:
                loaded = load_checkpoint(
                    checkpoint,
                    tokenizer=args.tokenizer,
                    device=args.device,
                    dtype=args.dtype,
                    trained_length=args.trained_length,
                )
            ctx = TaskContext(
                checkpoint=loaded,
                seed=args.seed,
                device=args.device,
                out_dir=out_dir,
                long_context=args.long_context,
                progress=False if args.no_progress else None,
            )
            started = time.perf_counter()
            outcome = task.run(settings, ctx)
            elapsed = time.perf_counter() - started
            record_settings = {
                **dataclasses.asdict(settings),
                "device": args.device,
                # The weights' dtype of a loaded checkpoint (a task that trains its own models
                # keeps its own).
                "dtype": None if loaded is None else args.dtype,
                "long_context": args.long_context,
                "tokenizer": None if loaded is None else loaded.tokenizer.spec,
            }
            path = write_results(
                out_dir,
                task=args.task,
                settings=record_settings,
                metrics=outcome.metrics,
                summary=outcome.summary,
                seed=args.seed,
                checkpoint=None if loaded is None else loaded.describe(),
                elapsed_s=elapsed,
            )
            head = f"## {args.task}" + ("" if checkpoint is None else f" on {checkpoint}")
            notes = "" if loaded is None or not loaded.notes else "\n" + "\n".join(loaded.notes)
            files = "".join(f"\nfigure: {f}" for f in outcome.files)
            reports.append(
                f"{head} ({elapsed:.1f} s){notes}\n\n{outcome.table}\n\nresults: {path}{files}"
            )
            if task.name == "streaming":
                streams.append((out_dir.name.removeprefix(f"{task.name}-"), outcome.metrics))
    if len(streams) > 1:
        # In --out beside the runs' directories; by default in the first run's own directory
        # (one fixed runs/eval/streaming.png would be replaced by the next comparison).
        folder = Path(args.out) if args.out is not None else out_dirs[0]
        plot = plot_streaming(streams, folder / "streaming.png")
        reports.append(f"all checkpoints: {plot}")
    return "\n\n".join(reports)


def run_eval(args: argparse.Namespace) -> int:
    """The `deltalab eval` command; input errors -> one line on stderr, exit code 2."""
    from deltalab.errors import UserError, one_line

    try:
        if args.list:
            print(_list_tasks())
        elif args.compare:
            print(_compare(args.compare, args.out))
        else:
            print(_evaluate(args))
    except UserError as error:
        print(f"deltalab eval: error: {one_line(error)}", file=sys.stderr)
        return 2
    return 0
