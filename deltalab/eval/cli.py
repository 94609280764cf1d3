"""`deltalab eval`: run a task on checkpoints, list the tasks, or compare finished runs.

    deltalab eval runs/default/model --task perplexity
    deltalab eval runs/a/model runs/b/model --task streaming tokens=1048576 split=all
    deltalab eval --task mqar-train mixers=[gdn2,transformer]
    deltalab eval --list
    deltalab eval --compare runs/eval/perplexity-a runs/eval/perplexity-b

Words with `=` are the task's settings (`deltalab eval --list` shows them), the others are
checkpoints. Mistakes in the input end the command with one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "run_eval"]


def add_parser(commands: Any) -> None:
    """Adds the `eval` subcommand to the `deltalab` parser's subcommands."""
    parser = commands.add_parser(
        "eval",
        help="evaluate checkpoints: perplexity, streaming, MQAR, passkey, needles, lm-eval",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="CHECKPOINT|name=value", help="checkpoints and settings"
    )
    parser.add_argument("--task", help="task name (see --list); lm-eval:TASK1,TASK2 for lm-eval")
    parser.add_argument("--list", action="store_true", help="list the tasks and their settings")
    parser.add_argument("--compare", nargs="+", metavar="DIR", help="results dirs to tabulate")
    parser.add_argument("--out", default=None, help="results directory (default runs/eval/...)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every random choice")
    parser.add_argument("--device", default="cpu")
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
    parser.set_defaults(run=run_eval)


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


def _evaluate(args: argparse.Namespace) -> str:
    from deltalab.eval.common import EvalError, load_checkpoint
    from deltalab.eval.results import write_results
    from deltalab.eval.streaming import plot_streaming
    from deltalab.eval.tasks import TaskContext, get_task, parse_settings

    words = list(args.overrides)
    settings_words = [w for w in words if "=" in w]
    checkpoints = [w for w in words if "=" not in w]
    if args.task is None:
        raise EvalError("--task is required (or --list, or --compare DIR...)")
    task = get_task(args.task)
    if args.task.startswith("lm-eval:"):
        settings_words.insert(0, f"tasks={args.task.split(':', 1)[1]}")
    settings = parse_settings(task.settings, settings_words)
    if task.needs_checkpoint and not checkpoints:
        raise EvalError(f"task {task.name!r} needs a CHECKPOINT directory (a run's model/)")
    if not task.needs_checkpoint and checkpoints:
        raise EvalError(f"task {task.name!r} trains its own models; got checkpoints {checkpoints}")
    base = Path(args.out) if args.out else Path("runs/eval")
    targets: list[str | None] = list(checkpoints) or [None]
    reports, streams = [], []
    for checkpoint in targets:
        if checkpoint is None:
            out_dir = base if args.out else base / task.name
        elif args.out and len(targets) == 1:
            out_dir = base
        else:
            out_dir = base / (_slug(checkpoint) if args.out else f"{task.name}-{_slug(checkpoint)}")
        loaded = None
        if checkpoint is not None:
            loaded = load_checkpoint(
                checkpoint,
                tokenizer=args.tokenizer,
                device=args.device,
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
            streams.append((_slug(checkpoint), outcome.metrics))
    if len(streams) > 1:
        plot = plot_streaming(streams, base / "streaming.png")
        reports.append(f"all checkpoints: {plot}")
    return "\n\n".join(reports)


def run_eval(args: argparse.Namespace) -> int:
    """The `deltalab eval` command; input errors -> one line on stderr, exit code 2."""
    from deltalab.errors import one_line
    from deltalab.eval.common import EvalError

    try:
        if args.list:
            print(_list_tasks())
        elif args.compare:
            print(_compare(args.compare, args.out))
        else:
            print(_evaluate(args))
    except EvalError as error:
        print(f"deltalab eval: error: {one_line(error)}", file=sys.stderr)
        return 2
    return 0
