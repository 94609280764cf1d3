"""`deltalab study SPEC`: a grid of training runs, their evaluations and one report.

    deltalab study studies/cpu_tiny.yaml              # plan, check, run what is left, report
    deltalab study studies/cpu_tiny.yaml --dry-run    # the plan and its parameter counts only
    deltalab study studies/cpu_tiny.yaml --aggregate-only   # rebuild the report from the runs
    deltalab study studies/gpu.yaml --only 'kdn_diag.*.s0'  # a subset (time one run first)
    deltalab study studies/gpu.yaml --pack-records records.tar.gz  # the records, to move or keep

The spec (see `deltalab/study/spec.py` and docs/STUDY.md) names the mixers, seeds, learning
rates and sizes, the shared train config, the evaluations, and how many runs go at once. The
whole plan is checked first (spec keys, every run's config, parameter counts matched within 2%,
eval settings); nothing trains unless all of it passes. Runs already finished are skipped, an
interrupted one resumes from its checkpoint. The report is written to the study directory:
study.json, study.md and figures.

Each run's study_run.json records the code's git commit (or installed version), the package
versions, the device and the SHA-256 of the train and held-out data it read. A study refuses to
resume into, or aggregate, records of another commit unless --allow-mixed-commits is given, nor
runs trained on other data (another Python's stdlib, an edited file) unless --allow-mixed-data.

Ctrl-C (SIGINT) or SIGTERM stops the study: nothing new starts, the running jobs get SIGTERM,
checkpoint and exit (after --grace seconds, or a second Ctrl-C, they are killed), and are
recorded "interrupted" once they have exited. A run directory takes one trainer at a time:
`deltalab train` locks it, and a second one is refused naming the first's pid.

Exit status: 0 every run completed or diverged (a divergence is a result, reported); 1 some
runs failed (each with its error line in study.md; a run killed by a signal the study did not
send, such as the out-of-memory killer's SIGKILL, failed); 2 a spec or plan error, one line;
3 none failed, but --launch-for left jobs for the next invocation; 130 stopped by Ctrl-C
(SIGINT), 143 by SIGTERM (rerun the same command to continue).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import fnmatch
import math
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from deltalab.cli import add_command

__all__ = ["JOBS_LEFT", "add_parser", "format_plan", "run_study"]

# The exit status of a study that left jobs for its next invocation (--launch-for).
JOBS_LEFT = 3


def add_parser(commands: Any) -> None:
    parser = add_command(
        commands,
        "study",
        "a grid of runs (mixers x seeds x lrs x sizes), their evals, one report",
        __doc__,
    )
    parser.add_argument("spec", help="a study spec (YAML)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan; run nothing")
    parser.add_argument(
        "--aggregate-only", action="store_true", help="rebuild the report from finished runs"
    )
    parser.add_argument("--out", default=None, help="study directory (instead of the spec's)")
    parser.add_argument(
        "--baseline",
        default=None,
        metavar="VARIANT",
        help="with --aggregate-only: pair the differences against this variant instead of the "
        "spec's baseline, into study_vs_VARIANT.md and .json beside the study's own report (the "
        "parameter matching stays the spec's)",
    )
    parser.add_argument(
        "--only",
        action="append",
        metavar="GLOB",
        help="run only the runs and jobs whose names match (repeatable; e.g. 'gdn2.*.s0' "
        "to time one run first); the report still lists every run",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=None,
        metavar="SECONDS",
        help="on Ctrl-C or SIGTERM, how long to wait for the running jobs to checkpoint and exit "
        "before killing them (default 120; a second Ctrl-C kills them at once)",
    )
    parser.add_argument(
        "--pack-records",
        default=None,
        metavar="FILE",
        help="write the study's records (every job's files but checkpoints, exported models, "
        "figures and TensorBoard logs) to the .tar.gz FILE and exit: unpacked into a study "
        "directory they rebuild the report and count as done",
    )
    parser.add_argument(
        "--launch-for",
        type=float,
        default=None,
        metavar="SECONDS",
        help="start jobs for this many seconds only, then let those running finish and write "
        "the report: the rest wait for the next invocation (a study spread over time-limited "
        "allocations ends each one with whole runs, no checkpoint to carry over)",
    )
    parser.add_argument(
        "--allow-mixed-commits",
        action="store_true",
        help="resume, extend or aggregate a study whose records were written by other code "
        "(another git commit or installed version) than the code running now; refused by default",
    )
    parser.add_argument(
        "--allow-mixed-data",
        action="store_true",
        help="resume, extend or aggregate a study whose runs recorded other train or held-out "
        "token streams (SHA-256) than each other or than the spec's source gives now; refused "
        "by default",
    )
    parser.set_defaults(run=run_study)


def format_plan(plan: Any) -> str:
    """The plan as text: budget, matched parameter counts, every run with its state."""
    from deltalab.benchmarking import format_table
    from deltalab.study.runner import run_state, task_state, throughput_state

    spec = plan.spec
    first = plan.runs[0].config.train
    lines = [
        f"study {spec.path or '(given as data)'} -> {spec.out_dir}",
        f"{len(plan.runs)} runs ({len(spec.variants)} variants x {len(plan.sizes)} size(s) x "
        f"{len(plan.lrs)} lr(s) x {len(spec.seeds)} seed(s)), {len(plan.tasks)} task job(s), "
        f"{len(plan.throughput)} throughput run(s); "
        f"{first.steps} steps x {first.batch_size} x {first.seq_len} = "
        f"{plan.tokens_per_run:,} tokens per run; device {plan.device}, {spec.parallel} at a "
        f"time, {plan.threads} thread(s) each; baseline {spec.baseline}",
        f"non-embedding parameters matched to {spec.match} within {spec.tolerance:.0%} by the "
        f"FFN width (a multiple of {spec.ffn_multiple}):",
    ]
    rows, seen = [], set()
    for run in plan.runs:
        key = (run.variant.name, run.size)
        if key in seen:
            continue
        seen.add(key)
        target = plan.targets[run.size]
        options = ", ".join(
            f"{k}={v}" for k, v in {**run.variant.options, **run.variant.overrides}.items()
        )
        rows.append(
            [
                run.variant.name,
                run.variant.mixer,
                options or "-",
                run.size,
                run.ffn_width,
                f"{run.params:,}",
                f"{run.params / target - 1:+.2%}",
            ]
        )
    lines.append(
        format_table(
            ["variant", "mixer", "options", "size", "ffn", "params", f"vs {spec.match}"], rows
        )
    )
    states = [[job.name, throughput_state(job)] for job in plan.throughput]
    states += [[run.name, run_state(run)] for run in plan.runs]
    states += [[task.name, task_state(task)] for task in plan.tasks]
    lines.append(format_table(["run", "state"], states))
    if plan.runs[0].evals:
        lines.append(
            "evaluations of each checkpoint: "
            + "; ".join(
                f"{step.task} {' '.join(step.words)}".strip() for step in plan.runs[0].evals
            )
        )
    return "\n".join(lines)


@contextlib.contextmanager
def _exclusive(out_dir: Path) -> Iterator[None]:
    """One study process per directory at a time."""
    from deltalab.errors import ConfigError

    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".study.lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(
                f"another deltalab study is running in {out_dir}; wait for it or stop it"
            ) from None
        yield


def _prepare_data(plan: Any) -> dict[str, Any]:
    """Tokenize the shared data once, before any run starts (a bad source fails here, and the
    runs do not tokenize it side by side); returns its fingerprint by split, as the runs record
    it."""
    from deltalab.data import load_tokenizer
    from deltalab.train.data import prepare_sequences
    from deltalab.train.distributed import Distributed

    config = plan.runs[0].config
    tokenizer = load_tokenizer(config.data.tokenizer)
    import torch

    ctx = Distributed(0, 1, 0, torch.device("cpu"))
    return {
        split: prepare_sequences(config, tokenizer, split, ctx).tokens.manifest.fingerprint()
        for split in ("train", "held_out")
    }


def _note_invocation(out_dir: Path, **fields: Any) -> None:
    from deltalab.study.report import INVOCATIONS_NAME
    from deltalab.study.runner import _read_json, _write_json

    path = out_dir / INVOCATIONS_NAME
    data = _read_json(path) or {"invocations": []}
    if fields.get("started") and (not data["invocations"] or "wall_s" in data["invocations"][-1]):
        command = "deltalab " + " ".join(sys.argv[1:])
        data["invocations"].append({"command": command, **fields})
    else:
        data["invocations"][-1].update(fields)
    _write_json(path, data)


def _say(line: str) -> None:
    print(line, flush=True)


def select(plan: Any, patterns: list[str]) -> Any:
    """The plan restricted to the runs, task jobs and throughput runs whose names match a glob
    of `patterns`."""
    from deltalab.errors import ConfigError

    def chosen(name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)

    runs = [r for r in plan.runs if chosen(r.name)]
    tasks = [t for t in plan.tasks if chosen(t.name)]
    speed = [j for j in plan.throughput if chosen(j.name)]
    if not runs and not tasks and not speed:
        raise ConfigError(f"--only {' '.join(patterns)} matches no run or job of the plan")
    return dataclasses.replace(plan, runs=runs, tasks=tasks, throughput=speed)


def execute(
    plan: Any,
    *,
    launcher: Any = None,
    say: Any = _say,
    only: list[str] | None = None,
    grace: float | None = None,
    launch_until: float | None = None,
    allow_mixed_commits: bool = False,
    allow_mixed_data: bool = False,
) -> int:
    """Runs the plan's pending jobs (those matching `only`, if given) and writes the report of
    the whole plan; the exit status of the module docstring. `grace`: seconds a stopped study
    waits for its children before SIGKILL (default `runner.DEFAULT_GRACE`); `launch_until`:
    the `time.monotonic()` after which no job starts (None: until none is left);
    `allow_mixed_commits`: run even where records of other code are (`records.check_commits`);
    `allow_mixed_data`: even where runs trained on other data are (`records.check_data`)."""
    from deltalab.study.records import check_commits, check_data
    from deltalab.study.report import write_report
    from deltalab.study.runner import DEFAULT_GRACE, StudyRunner, check_finished_runs, signal_name

    out_dir = plan.spec.out_dir
    with _exclusive(out_dir):
        check_finished_runs(plan)
        check_commits(plan, aggregate=False, allow_mixed=allow_mixed_commits)
        check_data(plan, _prepare_data(plan), allow_mixed=allow_mixed_data)
        started = time.perf_counter()
        _note_invocation(out_dir, started=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        runner = StudyRunner(
            select(plan, only) if only else plan,
            launcher=launcher,
            say=say,
            grace=DEFAULT_GRACE if grace is None else grace,
            launch_until=launch_until,
        )
        outcomes = runner.run()
        _note_invocation(
            out_dir,
            wall_s=round(time.perf_counter() - started, 1),
            launched=runner.launches,
            not_started=runner.not_started,
        )
        written = write_report(plan)
    statuses = [o.status for o in outcomes]
    stopped = "" if runner.stopped_by is None else f"stopped by {signal_name(runner.stopped_by)}: "
    left = f", {runner.not_started} not started (--launch-for)" if runner.not_started else ""
    say(
        f"{stopped}{statuses.count('completed')} completed, {statuses.count('skipped')} already "
        f"done, {statuses.count('diverged')} diverged, {statuses.count('failed')} failed, "
        f"{statuses.count('interrupted')} interrupted{left}; report: {written['markdown']}"
    )
    if runner.stopped_by is not None:
        return 128 + runner.stopped_by
    if "failed" in statuses:
        return 1
    return JOBS_LEFT if runner.not_started else 0


def run_study(args: argparse.Namespace) -> int:
    from deltalab.errors import ConfigError
    from deltalab.study.plan import make_plan
    from deltalab.study.report import write_report
    from deltalab.study.spec import load_spec

    spec = load_spec(args.spec)
    if args.out is not None:
        spec = dataclasses.replace(spec, out_dir=Path(args.out).resolve())
    if args.dry_run and args.aggregate_only:
        raise ConfigError("--dry-run and --aggregate-only exclude each other")
    if args.grace is not None and not args.grace >= 0:
        raise ConfigError(f"--grace must be a number of seconds >= 0, got {args.grace}")
    if args.pack_records is not None and (
        args.dry_run or args.aggregate_only or args.only or args.launch_for is not None
    ):
        raise ConfigError("--pack-records goes alone (not with --dry-run, --aggregate-only, "
                          "--only or --launch-for)")  # fmt: skip
    # The window counts from the command's start: data preparation and checks are within it.
    launch_until = None
    if args.launch_for is not None:
        if args.dry_run or args.aggregate_only:
            raise ConfigError("--launch-for goes with a study that runs (not --dry-run or "
                              "--aggregate-only)")  # fmt: skip
        if not 0 <= args.launch_for < math.inf:
            raise ConfigError(
                f"--launch-for must be a number of seconds >= 0, got {args.launch_for}"
            )
        launch_until = time.monotonic() + args.launch_for
    stem = "study"
    if args.baseline is not None:
        from deltalab.errors import closest

        if not args.aggregate_only:
            raise ConfigError("--baseline goes with --aggregate-only (a report of finished runs)")
        names = [v.name for v in spec.variants]
        if args.baseline not in names:
            raise ConfigError(
                f"--baseline {args.baseline!r} is not a grid.mixers name"
                f"{closest(args.baseline, names)}; they are {names}"
            )
        # params.match was resolved when the spec was read: the plan's runs stay the same.
        spec = dataclasses.replace(spec, baseline=args.baseline)
        stem = f"study_vs_{args.baseline}"
    plan = make_plan(spec)
    print(format_plan(plan), flush=True)
    if args.dry_run:
        return 0
    if args.pack_records is not None:
        from deltalab.study.records import pack_records

        count = pack_records(plan, Path(args.pack_records))
        print(f"{count} files of {spec.out_dir} packed into {args.pack_records}")
        return 0
    if args.aggregate_only:
        from deltalab.study.runner import check_finished_runs

        # Finished runs are held to the spec as when the study runs: a report of runs trained
        # otherwise would describe settings they never had.
        check_finished_runs(plan)
        from deltalab.study.records import check_commits, check_data

        check_commits(plan, aggregate=True, allow_mixed=args.allow_mixed_commits)
        check_data(plan, allow_mixed=args.allow_mixed_data)
        written = write_report(plan, stem=stem)
        print(f"report: {written['markdown']}")
        return 0
    if args.only:
        select(plan, args.only)  # refuses patterns that match nothing, before any work
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return execute(
        plan,
        only=args.only,
        grace=args.grace,
        launch_until=launch_until,
        allow_mixed_commits=args.allow_mixed_commits,
        allow_mixed_data=args.allow_mixed_data,
    )
