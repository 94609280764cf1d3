"""`deltalab study` as processes: a stopped study waits for its runs and records them
interrupted once they have exited, kills those that outlast the grace, and reports a run killed
by a signal it did not send as failed. The children here are stand-ins for `deltalab train`:
what is tested is the processes, not the training."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_study import micro_spec, plan_of, quiet, write_corpus

from deltalab.cli import main
from deltalab.study.cli import execute
from deltalab.study.runner import SubprocessLauncher

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


# A stand-in for `deltalab train` where the processes are the point: with its SIGTERM handler in
# place it writes its pid beside the run's config, then sleeps. "trainer": on SIGTERM it takes
# 2 s (a step and a checkpoint), notes the signal and exits 128 + it; "stubborn": it ignores
# SIGTERM; "oom": it dies of SIGKILL; "parent": it ignores SIGTERM and first starts a sleeping
# grandchild (as torch.compile starts its workers), whose pid it writes beside its own.
CHILD = r"""
import os, signal, sys, time
from pathlib import Path
mode, args = sys.argv[1], sys.argv[2:]
directory = Path(args[args.index("--config") + 1]).parent
def checkpoint_and_exit(signum, frame):
    time.sleep(2)
    (directory / "child.stopped").write_text(str(signum))
    sys.exit(128 + signum)
signal.signal(signal.SIGTERM, checkpoint_and_exit if mode == "trainer" else signal.SIG_IGN)
if mode == "parent":
    import subprocess
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    (directory / "grandchild.pid").write_text(str(worker.pid))
(directory / "child.pid.tmp").write_text(str(os.getpid()))
os.replace(directory / "child.pid.tmp", directory / "child.pid")
if mode == "oom":
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(300)
"""


class FakeChild(SubprocessLauncher):
    """Starts CHILD in `mode` where the study would start `python -m deltalab`."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode

    def command(self, args: list[str]) -> list[str]:
        return [sys.executable, "-c", CHILD, self.mode, *args]


# A study in a process of its own (to be signalled): argv spec.json, CHILD's mode, grace. Its
# `say` takes SAY_DELAY seconds over the stopping line, after writing the file "saying" beside
# spec.json (a second signal can then arrive while the first one's line is being printed).
DRIVER = f"""
import json, sys, time
from pathlib import Path
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_study_stop import FakeChild
from deltalab.cli import main
from deltalab.study.cli import execute
from deltalab.study.plan import make_plan
from deltalab.study.spec import parse_spec
plan = make_plan(parse_spec(json.loads(open(sys.argv[1]).read())))
def say(line):
    if line.startswith("deltalab study: stopping"):
        (Path(sys.argv[1]).parent / "saying").write_text(line)
        time.sleep(float(sys.argv[4]))
    print(line, flush=True)
launcher = FakeChild(sys.argv[2])
sys.exit(execute(plan, launcher=launcher, grace=float(sys.argv[3]), say=say))
"""


def one_run_spec(tmp_path: Path, corpus: Path) -> dict:
    return micro_spec(tmp_path, corpus, grid={"mixers": ["gdn2"], "seeds": [0]}, evals=[])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def gone(pid: int) -> bool:
    """No such process, or a zombie (exited; its reaping is up to whoever adopted it)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status


def study_waiting_on(tmp_path: Path, corpus: Path, mode: str, grace: float, say_delay: float = 0.0):
    """A study process of one run, once its child is running: (process, run directory, the
    child's pid)."""
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(one_run_spec(tmp_path, corpus)))
    process = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(path), mode, str(grace), str(say_delay)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    run = tmp_path / "study" / "runs" / "gdn2.tiny.lr0.003.s0"
    deadline = time.monotonic() + 120
    while not (run / "child.pid").exists():
        assert process.poll() is None, process.communicate()[0]
        assert time.monotonic() < deadline, "the study never started its run"
        time.sleep(0.1)
    return process, run, int((run / "child.pid").read_text())


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stopped_study_waits_for_its_runs_and_records_them_interrupted_once_they_exited(
    tmp_path, corpus, signum
):
    process, run, child = study_waiting_on(tmp_path, corpus, "trainer", grace=60)
    try:
        process.send_signal(signum)
        out = process.communicate(timeout=60)[0]
    finally:
        process.kill()
    assert process.returncode == 128 + signum, out
    # The child was asked to stop with SIGTERM and had finished before the study returned.
    assert (run / "child.stopped").read_text() == str(int(signal.SIGTERM))
    assert not alive(child)
    record = json.loads((run / "study_run.json").read_text())
    assert record["status"] == "interrupted", record
    assert f"stopped by {signal.Signals(signum).name}: 0 completed" in out
    assert "1 interrupted" in out


def test_a_stopped_study_kills_the_runs_that_outlast_the_grace(tmp_path, corpus):
    process, run, child = study_waiting_on(tmp_path, corpus, "stubborn", grace=1)
    try:
        process.send_signal(signal.SIGINT)
        out = process.communicate(timeout=60)[0]
    finally:
        process.kill()
    assert process.returncode == 130, out
    assert not alive(child)
    record = json.loads((run / "study_run.json").read_text())
    assert record["status"] == "interrupted" and "SIGKILL" in record["error"], record


def test_a_second_signal_while_the_first_is_reported_kills_the_runs_at_once(tmp_path, corpus):
    """The second Ctrl-C arrives while the study prints the first one's line: it still stops
    the study (nothing waits on the printing) and kills the runs without waiting the grace."""
    process, _, child = study_waiting_on(tmp_path, corpus, "stubborn", grace=300, say_delay=3)
    try:
        process.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 30
        while not (tmp_path / "saying").exists():
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.05)
        process.send_signal(signal.SIGINT)
        out = process.communicate(timeout=30)[0]
    finally:
        process.kill()
        if alive(child):
            os.kill(child, signal.SIGKILL)
    assert process.returncode == 130, out
    assert not alive(child)
    assert "SIGINT again: killing the running jobs (SIGKILL)" in out, out


def test_a_stopped_study_kills_the_processes_its_runs_started(tmp_path, corpus):
    process, run, child = study_waiting_on(tmp_path, corpus, "parent", grace=1)
    grandchild = int((run / "grandchild.pid").read_text())
    try:
        process.send_signal(signal.SIGTERM)
        out = process.communicate(timeout=60)[0]
    finally:
        process.kill()
    assert process.returncode == 128 + signal.SIGTERM, out
    assert not alive(child)
    deadline = time.monotonic() + 5
    while not gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        assert gone(grandchild), "the run's own child outlived the stopped study"
    finally:
        if not gone(grandchild):
            os.kill(grandchild, signal.SIGKILL)


def test_a_run_killed_by_sigkill_failed_and_the_exit_status_says_so(tmp_path, corpus):
    plan = plan_of(one_run_spec(tmp_path, corpus))
    assert execute(plan, launcher=FakeChild("oom"), say=quiet) == 1
    (run,) = json.loads((tmp_path / "study" / "study.json").read_text())["runs"]
    assert run["status"] == "failed"
    assert run["error"].startswith("killed by signal 9 (SIGKILL"), run


def test_a_negative_grace_is_refused_in_one_line(tmp_path, corpus, capsys):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(one_run_spec(tmp_path, corpus)))
    assert main(["study", str(path), "--grace", "-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "deltalab: error: --grace must be a number of seconds >= 0, got -1.0", err
