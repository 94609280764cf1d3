"""The `deltalab` command: user errors are one line and exit 2, bugs keep their traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import deltalab.train.data as train_data
from deltalab.cli import main
from deltalab.errors import CheckpointError, ConfigError
from deltalab.ops._triton import INTERPRET

ROOT = Path(__file__).resolve().parents[1]
SMALL = "model.overrides={hidden_size: 32, num_layers: 1, num_heads: 2, head_dim: 16}"


@pytest.fixture
def corpus(tmp_path) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(20):
        (folder / f"doc_{i:02d}.txt").write_text(f"def f_{i}(x):\n    return x + {i}\n" * 8)
    return folder


def _train_args(tmp_path: Path, corpus: Path, *extra: str) -> list[str]:
    return [
        "train",
        f"data.source={corpus}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.held_out_fraction=0.3",
        SMALL,
        "train.seq_len=16",
        "train.batch_size=2",
        "train.steps=2",
        "train.device=cpu",
        "eval.batches=1",
        "eval.sample_tokens=0",
        "log.progress=false",
        "log.tensorboard=false",
        f"log.out_dir={tmp_path / 'run'}",
        *extra,
    ]


def _one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("deltalab: error: ") and "\n" not in err, err
    assert "Traceback" not in err
    return err


def test_a_missing_config_file_is_one_line(tmp_path, capsys):
    err = _one_line_error(capsys, ["train", "--config", str(tmp_path / "nope.yaml")])
    assert "config file" in err and "nope.yaml' does not exist" in err


def test_a_config_file_that_is_not_utf8_names_its_line(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_bytes(b"train:\n  steps: 10\n  # caf\xe9\n")
    err = _one_line_error(capsys, ["train", "--config", str(path)])
    assert "run.yaml:3 is not valid UTF-8" in err


def test_an_unknown_field_is_one_line(capsys):
    err = _one_line_error(capsys, ["train", "train.stepz=3"])
    assert "unknown config field 'train.stepz'" in err and "train.steps" in err


def test_an_out_dir_that_is_a_file_is_one_line(tmp_path, corpus, capsys):
    (tmp_path / "taken").write_text("a file")
    err = _one_line_error(
        capsys, _train_args(tmp_path, corpus, f"log.out_dir={tmp_path / 'taken' / 'run'}")
    )
    assert "log.out_dir must be a directory" in err and "is a file" in err


def test_an_endless_data_source_is_refused_not_read(tmp_path, capsys):
    if not Path("/dev/zero").exists():
        pytest.skip("needs /dev/zero")
    err = _one_line_error(capsys, _train_args(tmp_path, Path("/dev/zero")))
    assert "'/dev/zero' is not a regular file or directory" in err


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.mixer=mur", "mixer must be one of"),
        ("model.preset=tinyy", "preset must be one of"),
        ("model.overrides.mixer_options={bogus: 1}", "mixer_options.bogus is not an option"),
        # The backend is a model field (model.overrides.backend), not a mixer option.
        ("model.overrides.mixer_options={backend: naive}", "mixer_options.backend is not an"),
        ("model.overrides.backend=cuda", "backend must be one of"),
        # Without a GPU (CI), Triton kernels need the interpreter: refused before any data.
        pytest.param(
            "model.overrides.backend=triton",
            "backend='triton' cannot run on cpu",
            marks=pytest.mark.skipif(
                torch.cuda.is_available() or INTERPRET, reason="Triton can run here"
            ),
        ),
        # A config field is set as one; the other frontend options are mixer options.
        ("model.overrides.mixer_options={chunk_size: 32}", "mixer_options.chunk_size is not an"),
        ("model.overrides.mixer_options={gate_activation: tanh}", "gate_activation must be one"),
        ("model.overrides.vocab_size=100", "vocab_size must be >= the tokenizer's vocabulary"),
        ("model.overrides.num_layers=0", "num_layers must be > 0"),
        (
            ("model.mixer=transformer", "model.overrides.mixer_options={read_gate: true}"),
            "mixer_options.read_gate is not an option of the transformer mixer; its options are []",
        ),
    ],
)
def test_model_config_errors_come_before_any_data_is_tokenized(
    tmp_path, corpus, capsys, monkeypatch, override, message
):
    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized data before checking the model config")

    monkeypatch.setattr(train_data, "prepare_tokens", no_tokenizing)
    overrides = (override,) if isinstance(override, str) else override
    err = _one_line_error(capsys, _train_args(tmp_path, corpus, *overrides))
    assert message in err


def test_a_batch_larger_than_the_data_is_refused_before_allocating(tmp_path, corpus, capsys):
    err = _one_line_error(capsys, _train_args(tmp_path, corpus, "train.batch_size=100000"))
    assert "train.batch_size must be at most the" in err and "got 100000" in err


def test_a_run_prints_what_differs_from_the_defaults_and_where_the_config_is(
    tmp_path, corpus, capsys
):
    assert main(_train_args(tmp_path, corpus)) == 0
    out = capsys.readouterr().out
    assert (
        f"run config saved to {tmp_path / 'run' / 'config.yaml'}; apart from the defaults:" in out
    )
    assert "\n  train.steps=2\n" in out and "\n  log.progress=false\n" in out
    # Fields left at their defaults are not printed.
    assert "weight_decay" not in out and "log.tensorboard" not in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--threads", "0", "presets"], "argument --threads: invalid positive int value: '0'"),
        (
            ["generate", "some/dir", "hi", "--temperature", "-1"],
            "argument --temperature: invalid finite number >= 0 value: '-1'",
        ),
    ],
)
def test_bad_arguments_are_a_usage_error(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_generate_refuses_a_directory_without_a_model_in_one_line(tmp_path, capsys):
    err = _one_line_error(capsys, ["generate", str(tmp_path), "hi"])
    assert "holds no config.json" in err


def test_a_bug_keeps_its_traceback(monkeypatch):
    def broken(config):
        raise RuntimeError("a bug in the loop")

    monkeypatch.setattr("deltalab.train.train", broken)
    with pytest.raises(RuntimeError, match="a bug in the loop"):
        main(["train", "train.steps=1"])


def test_the_installed_command_prints_a_user_error_without_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "deltalab.cli", "train", "--config", str(tmp_path / "x.yaml")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"deltalab: error: config file {str(tmp_path / 'x.yaml')!r} does not exist"
    ]


def test_config_errors_stay_value_errors_for_the_python_api():
    from deltalab.train import load_run_config

    with pytest.raises(ValueError, match=r"train\.steps must be > 0") as caught:
        load_run_config(None, ["train.steps=0"])
    assert isinstance(caught.value, ConfigError)


@pytest.mark.parametrize(
    ("field", "value"), [("temperature", -0.5), ("top_k", 0), ("max_new_tokens", -1)]
)
def test_generate_config_refuses_out_of_range_values_naming_them(field, value):
    from deltalab.generate import GenerateConfig

    with pytest.raises(ConfigError, match=rf"generate {field} must be .* got {value}"):
        GenerateConfig(checkpoint="model", prompt="def", **{field: value})


def _wait_for(path: Path, process: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert process.poll() is None, f"the trainer exited with {process.returncode}"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def test_a_run_directory_takes_one_trainer_and_a_killed_one_leaves_no_lock(
    tmp_path, corpus, capsys
):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    # A trainer that writes no checkpoint: only the lock can refuse a second one.
    args = _train_args(tmp_path, corpus, "train.steps=1000000", "checkpoint.every=0")
    first = subprocess.Popen(
        [sys.executable, "-m", "deltalab", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for(tmp_path / "run" / "config.yaml", first)
        err = _one_line_error(capsys, _train_args(tmp_path, corpus))
        assert f"pid {first.pid}" in err and "log.out_dir" in err, err
    finally:
        # SIGKILL: the kernel releases the lock with the process, no stale lock is left.
        first.kill()
        first.wait()
    assert main(_train_args(tmp_path, corpus)) == 0


def _crash_at_optimizer_step(monkeypatch, call: int) -> None:
    original = torch.optim.AdamW.step
    calls = {"n": 0}

    def crashing(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            raise RuntimeError("simulated crash")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", crashing)


def test_a_run_refused_before_its_first_step_removes_the_directories_it_created(
    tmp_path, corpus, capsys
):
    out_dir = tmp_path / "runs" / "run"
    late = (f"log.out_dir={out_dir}", "train.batch_size=100000")
    assert main(_train_args(tmp_path, corpus, *late)) == 2
    assert not (tmp_path / "runs").exists()
    # A directory that was there before stays, with what it held.
    out_dir.mkdir(parents=True)
    (out_dir / "notes.txt").write_text("mine")
    assert main(_train_args(tmp_path, corpus, *late)) == 2
    assert (out_dir / "notes.txt").read_text() == "mine"


def test_a_run_that_fails_in_its_first_step_leaves_no_directory_and_no_lock(
    tmp_path, corpus, monkeypatch
):
    _crash_at_optimizer_step(monkeypatch, 1)
    with pytest.raises(RuntimeError, match="simulated crash"):
        main(_train_args(tmp_path, corpus, "log.tensorboard=true"))
    # Its config, provenance, empty log and event file were written, then removed with it.
    assert not (tmp_path / "run").exists()
    monkeypatch.undo()
    assert main(_train_args(tmp_path, corpus)) == 0


def test_a_failed_run_keeps_its_directory_once_it_holds_a_checkpoint(tmp_path, corpus, monkeypatch):
    _crash_at_optimizer_step(monkeypatch, 2)
    with pytest.raises(RuntimeError, match="simulated crash"):
        main(_train_args(tmp_path, corpus, "checkpoint.every=1"))
    assert (tmp_path / "run" / "checkpoints" / "step_00000001.pt").is_file()
    assert (tmp_path / "run" / "log.jsonl").stat().st_size > 0
    monkeypatch.undo()
    assert main(_train_args(tmp_path, corpus, "checkpoint.every=1", "--resume")) == 0


def _fail_inside(out_dir, discardable) -> None:
    from deltalab.train.lock import hold_run_directory

    with pytest.raises(RuntimeError, match="failed run"):
        with hold_run_directory(out_dir, discardable):
            raise RuntimeError("failed run")


def test_a_failed_run_with_a_checkpoint_but_no_logged_step_keeps_every_file(tmp_path):
    # A run whose first steps were skipped (train.nan_policy=skip) logs nothing, yet it may
    # have checkpointed: its config, provenance and log stay beside the checkpoint.
    from deltalab.train.report import unrecorded_files

    out_dir = tmp_path / "run"

    def written(out_dir):
        (out_dir / "config.yaml").write_text("model: {}\n")
        (out_dir / "log.jsonl").touch()
        (out_dir / "checkpoints").mkdir()
        (out_dir / "checkpoints" / "step_00000001.pt").write_bytes(b"weights")
        return unrecorded_files(out_dir)

    _fail_inside(out_dir, written)
    assert (out_dir / "config.yaml").read_text() == "model: {}\n"
    assert (out_dir / "log.jsonl").is_file()
    assert (out_dir / "checkpoints" / "step_00000001.pt").read_bytes() == b"weights"


def test_a_failed_run_never_removes_a_directory_reached_through_dot_dot(tmp_path, monkeypatch):
    # "typo/../old_run": "typo" is missing, but the run writes to old_run, which was there.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "old_run").mkdir()
    (tmp_path / "old_run" / "config.yaml").write_text("kept")
    _fail_inside(Path("typo/../old_run"), lambda out_dir: [out_dir / "config.yaml"])
    assert (tmp_path / "old_run" / "config.yaml").read_text() == "kept"


def test_a_lock_taken_on_a_lock_file_removed_meanwhile_is_refused(tmp_path):
    # A failed trainer unlinks its lock file while holding it; a trainer that opened that file
    # before and locks it after holds a lock on nothing, and is refused.
    import fcntl

    from deltalab.train.lock import LOCK_NAME, _lock

    out_dir = tmp_path / "run"
    out_dir.mkdir()
    with open(out_dir / LOCK_NAME, "a+", encoding="utf-8") as stale:
        (out_dir / LOCK_NAME).unlink()
        with pytest.raises(CheckpointError, match="in use by another trainer"):
            _lock(stale, out_dir)
    with open(out_dir / LOCK_NAME, "a+", encoding="utf-8") as fresh:
        _lock(fresh, out_dir)
        fcntl.flock(fresh, fcntl.LOCK_UN)
