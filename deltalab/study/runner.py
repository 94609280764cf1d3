"""Carrying out a study plan: each run as `python -m deltalab train` then `deltalab eval`
subprocesses, several at a time, surviving interruption.

A run is done when its `metrics.json` says completed and every evaluation's `results.json`
exists with the planned settings; a rerun skips it. A run that stopped part way resumes from
its newest checkpoint (`deltalab train --resume`); one whose training completed but whose
evaluations did not runs only the missing ones. A run that diverged is a result and is not
retried; a run that failed (a crash, a bad setting found late) is recorded with its error line
and retried on the next invocation. What happened to each run is in its `study_run.json`.

Stopping: SIGINT (Ctrl-C) or SIGTERM to the study launches nothing more and passes SIGTERM to
the running children, which checkpoint and exit; the study waits for them (`grace` seconds, then
SIGKILL; a second signal kills them at once) and records them "interrupted" only once they have
exited. Each child leads a process group of its own, so a terminal's Ctrl-C reaches it only
through the study, once. A child that dies of a signal the study did not send (SIGKILL from the kernel's
out-of-memory killer) "failed", naming the signal.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deltalab.errors import ConfigError
from deltalab.provenance import read_json as _read_json
from deltalab.study.plan import EvalStep, PlannedRun, PlannedTask, PlannedThroughput, StudyPlan
from deltalab.study.records import job_provenance

__all__ = [
    "DEFAULT_GRACE",
    "RECORD_NAME",
    "Launcher",
    "StudyRunner",
    "StudyStopped",
    "SubprocessLauncher",
    "error_line",
    "run_state",
    "task_state",
]

RECORD_NAME = "study_run.json"
# Where `deltalab train` exports a run's trained model (its evaluations load it from there).
MODEL_DIR = "model"
# Seconds a stopped study waits for its children to checkpoint and exit before SIGKILL: a
# trainer finishes its step, checkpoints, evaluates and exports its model first.
DEFAULT_GRACE = 120.0
# The signals that stop a study (and that a stopped trainer exits with, as 128 + the number).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Environment a child must not inherit: a study under torchrun must not make its runs join the
# launcher's process group.
DISTRIBUTED_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)

Launcher = Callable[[list[str], dict[str, str], Path], int]


class StudyStopped(Exception):
    """A launch asked for after the study was told to stop: nothing is started."""


class SubprocessLauncher:
    """Runs `python -m deltalab ARGS` with its output in a log file, each child leading
    a process group of its own; remembers the live children so that a stopped study can pass the signal on,
    and once closed starts no more."""

    def __init__(self) -> None:
        self.live: set[subprocess.Popen] = set()
        self.lock = threading.Lock()
        self.closed = False

    def command(self, args: list[str]) -> list[str]:
        return [sys.executable, "-m", "deltalab", *args]

    def __call__(self, args: list[str], env: dict[str, str], log: Path) -> int:
        command = self.command(args)
        with log.open("a", encoding="utf-8") as out:
            out.write(f"$ {' '.join(command)}\n")
            out.flush()
            # Under the lock: a child started after `close` signalled the others would run on.
            with self.lock:
                if self.closed:
                    raise StudyStopped
                process = subprocess.Popen(
                    command,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,
                )
                self.live.add(process)
            try:
                return process.wait()
            finally:
                with self.lock:
                    self.live.discard(process)

    def close(self, signum: int) -> int:
        """Starts nothing more and sends `signum` to the live children and the processes they
        started; returns the children's count."""
        with self.lock:
            self.closed = True
            for process in self.live:
                # The child leads its own process group: the signal reaches the
                # processes it started too (torch.compile's workers), which SIGKILL to the
                # child alone would leave running.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signum)
            return len(self.live)


def error_line(log: Path) -> str:
    """The error a failed command printed: its `deltalab: error:` line, else the last line (a
    traceback's exception)."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines()]
    except OSError:
        return ""
    for line in reversed(lines):
        for prefix in ("deltalab: error: ", "deltalab eval: error: "):
            if line.startswith(prefix):
                return line[len(prefix) :]
    # "$ ..." lines are the runner's own echo of each command.
    lines = [line for line in lines if line and not line.startswith("$ ")]
    return lines[-1] if lines else ""


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    temporary.write_text(json.dumps(data, indent=2, default=str))
    os.replace(temporary, path)


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, default=list))


def eval_done(directory: Path, step: EvalStep) -> bool:
    """Whether `step`'s results.json exists with the planned settings."""
    results = _read_json(directory / step.out / "results.json")
    if results is None:
        return False
    recorded = results.get("settings") or {}
    return all(_plain(recorded.get(k)) == _plain(v) for k, v in step.settings.items())


def trained(run: PlannedRun) -> dict[str, Any] | None:
    """The run's metrics.json when its training completed, else None."""
    metrics = _read_json(run.directory / "metrics.json")
    if metrics is None or metrics.get("status") != "completed":
        return None
    return metrics


def config_changes(run: PlannedRun) -> list[str]:
    """How the config a finished run was trained with differs from the planned one."""
    from deltalab.train.config import resume_changes

    metrics = _read_json(run.directory / "metrics.json")
    if metrics is None or "config" not in metrics:
        return []
    return resume_changes(metrics["config"], run.config.to_dict())


def run_state(run: PlannedRun) -> str:
    """ "done", "diverged" (a recorded divergence), "evaluate" (trained; evaluations missing),
    "resume" (checkpoints to continue from) or "new".

    A run trained but not fully evaluated whose exported model is gone (its records were
    copied from another machine without the model, as studies/results/ keeps them) cannot be
    evaluated: it is "resume" from its checkpoints if they came along, else "new" (`run_one`
    then drops the lost model's results)."""
    from deltalab.train.checkpoint import list_checkpoints

    record = _read_json(run.directory / RECORD_NAME) or {}
    metrics = trained(run)
    if record.get("status") == "diverged" and metrics is None:
        return "diverged"
    if metrics is not None:
        if not math.isfinite(metrics.get("final_eval_loss", math.nan)):
            return "diverged"
        if all(eval_done(run.directory, step) for step in run.evals):
            return "done"
        if (run.directory / MODEL_DIR).is_dir():
            return "evaluate"
    return "resume" if list_checkpoints(run.directory) else "new"


def _drop_lost_model_results(directory: Path) -> None:
    """Before a run trains from scratch: the metrics and evaluation results of an earlier
    training whose model is gone (`run_state`) would otherwise count for the new one."""
    (directory / "metrics.json").unlink(missing_ok=True)
    shutil.rmtree(directory / "eval", ignore_errors=True)


def task_state(task: PlannedTask) -> str:
    return "done" if eval_done(task.directory, task.step) else "new"


def throughput_state(job: PlannedThroughput) -> str:
    """ "done" (its speed measured) or "new" (an interrupted speed run starts over)."""
    return "done" if trained(job) is not None else "new"


@dataclass
class Outcome:
    name: str
    status: str  # completed, diverged, failed, interrupted, skipped, not started (launch_until)
    error: str = ""
    launches: int = 0


@dataclass
class StudyRunner:
    """Runs the plan's pending jobs, `spec.parallel` at a time; `grace`: seconds a stopped study
    gives its children to exit before SIGKILL; `launch_until`: the `time.monotonic()` after
    which no job starts (None: no limit): the running ones finish, the rest are left for the
    next invocation."""

    plan: StudyPlan
    launcher: Launcher | None = None
    say: Callable[[str], None] = print
    grace: float = DEFAULT_GRACE
    launch_until: float | None = None
    stopping: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.launches = 0
        # Jobs with work to do left pending because `launch_until` had passed.
        self.not_started = 0
        # `device_shared_by` as `run` counts it before the first job (None until then).
        self._shared_by: int | None = None
        # The signal that stopped the study (its exit status is 128 + it), and when the grace ends.
        self.stopped_by: int | None = None
        self._deadline: float | None = None
        self._killed = False
        # The stop signals received, in order: the handler only appends (it runs in the main
        # thread between any two bytecodes, possibly while that thread holds a lock `say` or
        # `close` takes); the main thread's wait loop acts on them (`_take_signals`).
        self._signals: list[int] = []
        self._signals_taken = 0
        self._count_lock = threading.Lock()
        if self.launcher is None:
            self.launcher = SubprocessLauncher()
        say, say_lock = self.say, threading.Lock()

        def locked(line: str) -> None:
            # Workers report from their threads: one whole line at a time.
            with say_lock:
                say(line)

        self.say = locked

    # --- environment of a child ---------------------------------------------------------------

    def _devices(self) -> list[str]:
        if self.plan.device != "cuda":
            return []
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible:
            return [d.strip() for d in visible.split(",") if d.strip()]
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]

    def device_shared_by(self) -> int:
        """The most jobs one device runs at once: `parallel`, or fewer where fewer of the grid's
        jobs have work to do, over the CUDA devices, round-robin (`_env`); on the CPU every job
        shares the one machine. So a run picked alone with --only counts as alone."""
        devices = len(self._devices())
        pending = sum(run_state(r) not in ("done", "diverged") for r in self.plan.runs)
        pending += sum(task_state(t) != "done" for t in self.plan.tasks)
        at_once = max(1, min(self.plan.spec.parallel, pending))
        return -(-at_once // devices) if devices else at_once

    def _env(self, worker: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_ENV}
        threads = str(self.plan.threads)
        env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
        devices = self._devices()
        if devices:
            # Round-robin: worker i on device i mod n, so `parallel` > n shares devices.
            env["CUDA_VISIBLE_DEVICES"] = devices[worker % len(devices)]
        return env

    def _launch(self, args: list[str], worker: int, log: Path) -> int:
        if self.stopping.is_set():
            raise StudyStopped
        with self._count_lock:
            self.launches += 1
        assert self.launcher is not None
        return self.launcher(["--threads", str(self.plan.threads), *args], self._env(worker), log)

    def _eval_args(
        self, step: EvalStep, directory: Path, checkpoint: Path | None, seed: int
    ) -> list[str]:
        args = ["eval"] + ([str(checkpoint)] if checkpoint is not None else [])
        args += ["--task", step.task, *step.words, "--out", str(directory / step.out)]
        args += ["--seed", str(seed), "--device", self.plan.device, "--no-progress"]
        # Evaluated again only when its results are missing or of other settings: replaced.
        args.append("--overwrite")
        if step.long_context != "refuse":
            args += ["--long-context", step.long_context]
        return args

    # --- one job --------------------------------------------------------------------------------

    def _record(self, directory: Path, **fields: Any) -> None:
        """Updates the job's study_run.json; `elapsed_s` adds up over invocations (training in
        one, an evaluation added later in another)."""
        path = directory / RECORD_NAME
        record = _read_json(path) or {}
        if "elapsed_s" in fields:
            fields["elapsed_s"] += record.get("elapsed_s") or 0.0
        record.update(fields, updated=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        _write_json(path, record)

    def _ended(self, code: int, log: Path) -> tuple[str, str]:
        """(status, error) of a child that exited with `code` != 0: "interrupted" only when the
        study itself was stopped, else "failed" with what ended it.

        A child stopped by SIGINT/SIGTERM from elsewhere (a scheduler signals every process of
        a job, the study among them) waits a second for the study's own signal to account for
        it."""
        died = -code if code < 0 else None
        stopped = died in STOP_SIGNALS or code - 128 in STOP_SIGNALS
        if self.stopping.is_set() or (stopped and self.stopping.wait(1.0)):
            how = f"killed by {signal_name(died)}" if died else f"exit {code}"
            return "interrupted", f"stopped by the study ({how})"
        if died == signal.SIGKILL:
            return "failed", (
                f"killed by signal {died} (SIGKILL: the kernel's out-of-memory killer, or kill -9)"
            )
        if died:
            return "failed", f"killed by signal {died} ({signal_name(died)})"
        if stopped:
            name = signal_name(code - 128)
            return "failed", f"stopped by {name} sent from outside the study (exit {code})"
        return "failed", error_line(log)

    def run_one(self, run: PlannedRun, worker: int) -> Outcome:
        from deltalab.train.config_io import save_run_config

        state = run_state(run)
        if state in ("done", "diverged"):
            return Outcome(run.name, "skipped")
        if (late := self._window_over(run.name)) is not None:
            return late
        directory = run.directory
        directory.mkdir(parents=True, exist_ok=True)
        log = directory / "study.log"
        started = time.perf_counter()
        base = dict(
            name=run.name, variant=run.variant.name, seed=run.seed, size=run.size, lr=run.lr
        )
        self._record(directory, **base, status="running", stage="train", error="")
        if state == "new":
            _drop_lost_model_results(directory)
        if state in ("new", "resume"):
            # How many jobs its device ran at once at most: its tokens/s is a speed alone only
            # at 1 (`to_loss`). A resumed run keeps the most of its invocations.
            shared: int | None = self._shared_by or self.device_shared_by()
            if state == "resume":
                # A record from before this field says nothing of the earlier steps: unknown.
                before = (_read_json(directory / RECORD_NAME) or {}).get("device_shared_by")
                shared = None if before is None else max(shared, before)
            self._record(directory, device_shared_by=shared)
            config_path = save_run_config(run.config, directory / "run.yaml")
            args = ["train", "--config", str(config_path)] + (
                ["--resume"] if state == "resume" else []
            )
            self.say(f"{run.name}: {'resuming' if state == 'resume' else 'training'}")
            code = self._launch(args, worker, log)
            if code != 0:
                status, error = self._ended(code, log)
                if status == "failed" and "is not finite" in error:
                    status = "diverged"
                self._record(directory, status=status, stage="train", error=error, returncode=code)
                self.say(f"{run.name}: {status} in training{': ' + error if error else ''}")
                return Outcome(run.name, status, error)
            metrics = trained(run)
            if metrics is None or not math.isfinite(metrics.get("final_eval_loss", math.nan)):
                status = "diverged" if metrics is not None else "failed"
                error = (
                    "held-out loss not finite"
                    if metrics is not None
                    else "no completed metrics.json"
                )
                self._record(directory, status=status, stage="train", error=error, returncode=code)
                self.say(f"{run.name}: {status}: {error}")
                return Outcome(run.name, status, error)
        # The trainer's record of code, packages, device and data (or the study's own).
        self._record(directory, provenance=job_provenance(directory, self.plan.device))
        failures = []
        for step in run.evals:
            if eval_done(directory, step):
                continue
            if self.stopping.is_set():
                return self._interrupted(directory, run.name, "stopped before its evaluations")
            self._record(directory, stage=f"eval {step.task}")
            self.say(f"{run.name}: eval {step.task}")
            code = self._launch(
                self._eval_args(step, directory, directory / MODEL_DIR, run.seed), worker, log
            )
            if code != 0:
                status, error = self._ended(code, log)
                if status == "interrupted":
                    return self._interrupted(directory, run.name, error)
                failures.append(f"eval {step.task}: {error}")
        elapsed = time.perf_counter() - started
        if failures:
            error = "; ".join(failures)
            self._record(directory, status="failed", stage="eval", error=error, elapsed_s=elapsed)
            self.say(f"{run.name}: failed: {error}")
            return Outcome(run.name, "failed", error)
        self._record(directory, status="completed", stage="", error="", elapsed_s=elapsed)
        self.say(f"{run.name}: completed in {elapsed:.0f} s")
        return Outcome(run.name, "completed")

    def _window_over(self, name: str) -> Outcome | None:
        """Past `launch_until`: the job (which has work to do) waits for the next invocation."""
        if self.launch_until is None or time.monotonic() < self.launch_until:
            return None
        with self._count_lock:
            self.not_started += 1
        return Outcome(name, "not started")

    def throughput_one(self, job: PlannedThroughput, worker: int = 0) -> Outcome:
        """A variant's speed run, trained alone: `run` starts it before any other job."""
        from deltalab.train.config_io import save_run_config

        if throughput_state(job) == "done":
            return Outcome(job.name, "skipped")
        if (late := self._window_over(job.name)) is not None:
            return late
        # An interrupted speed run starts over: its speed is a median over one process's steps.
        shutil.rmtree(job.directory, ignore_errors=True)
        job.directory.mkdir(parents=True)
        log = job.directory / "study.log"
        self._record(job.directory, name=job.name, variant=job.variant.name, size=job.size,
                     status="running", stage="train", error="", device_shared_by=1)  # fmt: skip
        config_path = save_run_config(job.config, job.directory / "run.yaml")
        self.say(f"{job.name}: training alone")
        code = self._launch(["train", "--config", str(config_path)], worker, log)
        if code != 0:
            status, error = self._ended(code, log)
            self._record(job.directory, status=status, error=error, returncode=code)
            self.say(f"{job.name}: {status}{': ' + error if error else ''}")
            return Outcome(job.name, status, error)
        if not (trained(job) or {}).get("median_tokens_per_s"):
            error = "no completed metrics.json with a median tokens/s"
            self._record(job.directory, status="failed", error=error, returncode=code)
            self.say(f"{job.name}: failed: {error}")
            return Outcome(job.name, "failed", error)
        # Its speed is all a speed run is for: the final checkpoint and the exported model (as
        # large as the model, per variant) go.
        from deltalab.train.checkpoint import CHECKPOINT_DIR

        for kept in (CHECKPOINT_DIR, MODEL_DIR):
            shutil.rmtree(job.directory / kept, ignore_errors=True)
        self._record(job.directory, status="completed", stage="",
                     provenance=job_provenance(job.directory, self.plan.device))  # fmt: skip
        return Outcome(job.name, "completed")

    def _interrupted(self, directory: Path, name: str, error: str) -> Outcome:
        self._record(directory, status="interrupted", error=error)
        self.say(f"{name}: interrupted: {error}")
        return Outcome(name, "interrupted", error)

    def task_one(self, task: PlannedTask, worker: int) -> Outcome:
        if task_state(task) == "done":
            return Outcome(task.name, "skipped")
        if (late := self._window_over(task.name)) is not None:
            return late
        directory = task.directory
        directory.mkdir(parents=True, exist_ok=True)
        log = directory / "study.log"
        started = time.perf_counter()
        base = dict(name=task.name, variant=task.variant.name, seed=task.seed, task=task.step.task)
        self._record(
            directory,
            **base,
            status="running",
            stage=task.step.task,
            error="",
            provenance=job_provenance(directory, self.plan.device),
        )
        self.say(f"{task.name}: running")
        code = self._launch(self._eval_args(task.step, directory, None, task.seed), worker, log)
        if code != 0:
            status, error = self._ended(code, log)
            if status == "interrupted":
                return self._interrupted(directory, task.name, error)
            self._record(directory, status="failed", error=error, returncode=code)
            self.say(f"{task.name}: failed: {error}")
            return Outcome(task.name, "failed", error)
        elapsed = time.perf_counter() - started
        self._record(directory, status="completed", stage="", elapsed_s=elapsed)
        self.say(f"{task.name}: completed in {elapsed:.0f} s")
        return Outcome(task.name, "completed")

    # --- the pool ---------------------------------------------------------------------------------

    def run(self) -> list[Outcome]:
        """Every pending job until done or stopped by SIGINT/SIGTERM (see the module
        docstring): first the speed runs (`plan.throughput`), one at a time, each alone on its
        device; then the rest `parallel` at a time, longest first (training runs, then the
        task jobs)."""
        speed: queue.Queue = queue.Queue()
        for job in self.plan.throughput:
            speed.put((self.throughput_one, job))
        # Counted before any job runs: jobs finishing later do not make the earlier ones alone.
        self._shared_by = self.device_shared_by()
        jobs: queue.Queue = queue.Queue()
        for run in self.plan.runs:
            jobs.put((self.run_one, run))
        for task in self.plan.tasks:
            jobs.put((self.task_one, task))
        outcomes: list[Outcome] = []
        lock = threading.Lock()

        def worker(index: int, pending: queue.Queue) -> None:
            while not self.stopping.is_set():
                try:
                    job, item = pending.get_nowait()
                except queue.Empty:
                    return
                try:
                    outcome = job(item, index)
                except StudyStopped:
                    outcome = self._interrupted(
                        item.directory, item.name, "stopped before it began"
                    )
                except Exception as error:  # a bug or an OS error in one job: the others go on
                    outcome = Outcome(item.name, "failed", f"{type(error).__name__}: {error}")
                    self._record(item.directory, status="failed", error=outcome.error)
                    self.say(f"{item.name}: failed: {outcome.error}")
                with lock:
                    outcomes.append(outcome)

        phases = [
            [threading.Thread(target=worker, args=(0, speed), daemon=True)],
            [
                threading.Thread(target=worker, args=(i, jobs), daemon=True)
                for i in range(self.plan.spec.parallel)
            ],
        ]
        previous = {}
        if threading.current_thread() is threading.main_thread():
            previous = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        try:
            for threads in phases:
                for thread in threads:
                    thread.start()
                # The handler raises nothing, so no join is cut short (on Python 3.11 an
                # exception in `join` marks the thread stopped): a phase ends once every worker
                # has recorded its job, after its child exited.
                for thread in threads:
                    while thread.is_alive():
                        thread.join(0.2)
                        self._take_signals()
                        if self._deadline is not None and time.monotonic() > self._deadline:
                            self._kill(f"the {self.grace:g} s grace is over")
            self._take_signals()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        return outcomes

    def stop(self, signum: int = signal.SIGTERM) -> int:
        """Launch nothing more; SIGTERM to the running children (they checkpoint first), who
        get `grace` seconds to exit; returns how many there are."""
        if self.stopped_by is None:
            self.stopped_by = signum
            self._deadline = time.monotonic() + self.grace
        self.stopping.set()
        close = getattr(self.launcher, "close", None)
        return close(signal.SIGTERM) if close is not None else 0

    def _kill(self, why: str) -> None:
        close = getattr(self.launcher, "close", None)
        if self._killed or close is None:
            return
        self._killed = True
        if close(signal.SIGKILL):
            self.say(f"deltalab study: {why}: killing the running jobs (SIGKILL)")

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signals.append(signum)

    def _take_signals(self) -> None:
        """Acts on the signals received since the last call: the first stops the study, a
        second kills the running jobs."""
        while self._signals_taken < len(self._signals):
            signum = self._signals[self._signals_taken]
            self._signals_taken += 1
            name = signal_name(signum)
            if self.stopped_by is not None:
                self._kill(f"{name} again")
                continue
            running = self.stop(signum)
            self.say(
                f"deltalab study: stopping ({name}): nothing new starts; waiting up to "
                f"{self.grace:g} s for {running} running job(s) to checkpoint and exit ({name} "
                "again kills them now); rerun the same command to continue"
            )


def check_finished_runs(plan: StudyPlan) -> None:
    """Refuse, before anything trains, a study directory whose finished runs were trained with
    another config than the spec now gives them (their results would be mixed with new ones)."""
    changed = []
    for run in [*plan.throughput, *plan.runs]:
        if trained(run) is not None:
            differences = config_changes(run)
            if differences:
                changed.append(f"{run.name} ({'; '.join(differences)})")
    if changed:
        raise ConfigError(
            f"{plan.spec.out_dir} holds runs trained with another config than the spec gives: "
            f"{', '.join(changed)}; restore the spec or choose another out_dir (a throughput "
            "run alone measures again once its directory under throughput/ is removed)"
        )
