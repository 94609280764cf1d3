"""deltalab train across an interruption: a crash or a stop signal (which checkpoints, and makes
the command exit non-zero) resumes bit for bit; checkpoints that cannot be verified, would run
code or lack their config are refused or skipped, never loaded; a skipped last step still writes
the final checkpoint; a new run refuses a directory with checkpoints, and resume a changed
config."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import warnings
from pathlib import Path

import pytest
import torch
from test_train import _flatten, _metrics, poison_loss_at, run_config

from deltalab.errors import CheckpointError
from deltalab.train import train
from deltalab.train.checkpoint import CheckpointWarning, list_checkpoints


def _final_weights(out_dir) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(out_dir / "model").state_dict()


def test_crash_and_resume_continues_bit_for_bit(tmp_path, corpus, monkeypatch):
    reference = train(run_config(tmp_path / "a", corpus))

    original_step = torch.optim.AdamW.step
    calls = {"n": 0}

    def crashing_step(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("simulated crash")
        return original_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", crashing_step)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(run_config(tmp_path / "b", corpus))
    monkeypatch.setattr(torch.optim.AdamW, "step", original_step)
    resumed = train(run_config(tmp_path / "b", corpus, "checkpoint.resume=true"))

    assert resumed.losses == reference.losses
    a, b = _final_weights(tmp_path / "a" / "run"), _final_weights(tmp_path / "b" / "run")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The crash came after step 4 was logged and the checkpoint of step 3 was written: the
    # resumed log holds step 4 once, as the uninterrupted run's does.
    assert _logged_steps(tmp_path / "b" / "run") == _logged_steps(tmp_path / "a" / "run")


def _logged_steps(run: Path) -> list[tuple[str, int]]:
    lines = (run / "log.jsonl").read_text().splitlines()
    return [(record["kind"], record["step"]) for record in map(json.loads, lines)]


def test_resume_refuses_unverifiable_checkpoints_instead_of_starting_over(tmp_path, corpus):
    train(run_config(tmp_path, corpus))
    run = tmp_path / "run"
    # Copied to another machine without their digests.
    for sidecar in (run / "checkpoints").glob("*.sha256"):
        sidecar.unlink()
    before = {path: path.read_bytes() for path in [*list_checkpoints(run), run / "log.jsonl"]}
    with pytest.raises(CheckpointError, match=r"none can be used") as caught:
        train(run_config(tmp_path, corpus, "checkpoint.resume=true"))
    message = str(caught.value)
    assert "step_00000003.pt: missing digest" in message and "step_00000006.pt" in message
    assert "sha256sum step_00000006.pt > step_00000006.pt.sha256" in message
    # Nothing pruned, nothing truncated.
    assert {path: path.read_bytes() for path in before} == before


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def test_resume_never_runs_code_from_a_planted_checkpoint(tmp_path, corpus):
    planted = tmp_path / "run" / "checkpoints" / "step_00000003.pt"
    planted.parent.mkdir(parents=True)
    marker = tmp_path / "payload-ran"
    torch.save({"step": 3, "config": {}, "model": _RunsCode(marker)}, planted)
    digest = hashlib.sha256(planted.read_bytes()).hexdigest()
    planted.with_name(planted.name + ".sha256").write_text(f"{digest}  {planted.name}\n")
    with pytest.raises(CheckpointError, match=r"step_00000003\.pt: torch\.load\(weights_only"):
        train(run_config(tmp_path, corpus, "checkpoint.resume=true"))
    assert not marker.exists() and planted.exists()


def test_a_checkpoint_without_its_config_is_skipped_like_a_damaged_one(tmp_path, corpus):
    reference = train(run_config(tmp_path, corpus))
    newest = list_checkpoints(tmp_path / "run")[-1]
    fake = {"step": 6, "model": {}}
    torch.save(fake, newest)
    digest = hashlib.sha256(newest.read_bytes()).hexdigest()
    newest.with_name(newest.name + ".sha256").write_text(f"{digest}  {newest.name}\n")
    with pytest.warns(CheckpointWarning, match=r"step_00000006\.pt: payload lacks .*'config'"):
        resumed = train(run_config(tmp_path, corpus, "checkpoint.resume=true"))
    assert resumed.losses == reference.losses


def test_truncated_checkpoint_is_skipped_and_the_previous_one_resumed(tmp_path, corpus):
    reference = train(run_config(tmp_path, corpus))
    newest = list_checkpoints(tmp_path / "run")[-1]
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = train(run_config(tmp_path, corpus, "checkpoint.resume=true"))
    assert any(issubclass(w.category, CheckpointWarning) for w in caught)
    assert resumed.losses == reference.losses


def test_a_stop_signal_checkpoints_and_the_run_resumes_bit_for_bit(tmp_path, corpus, monkeypatch):
    reference = train(run_config(tmp_path / "a", corpus))
    original = torch.optim.AdamW.step
    calls = {"n": 0}

    # A real SIGTERM to this process right after the second optimizer step (the scheduler wraps
    # the optimizer's step when it is built, so the class is patched before the run starts).
    def step(optimizer, *args, **kwargs):
        result = original(optimizer, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    stopped = train(run_config(tmp_path / "b", corpus))
    monkeypatch.undo()
    assert stopped.interrupted and len(stopped.losses) == 2
    assert stopped.stop_signal == signal.SIGTERM
    assert [p.name for p in list_checkpoints(tmp_path / "b" / "run")] == ["step_00000002.pt"]
    interrupted = _metrics(tmp_path / "b" / "run")
    assert (interrupted["status"], interrupted["steps_done"], interrupted["steps_planned"]) == (
        "interrupted",
        2,
        6,
    )
    resumed = train(run_config(tmp_path / "b", corpus, "checkpoint.resume=true"))
    assert resumed.losses == reference.losses
    assert _metrics(tmp_path / "b" / "run")["status"] == "completed"
    assert _metrics(tmp_path / "b" / "run")["steps_done"] == 6


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_run_stopped_by_a_signal_exits_non_zero(tmp_path, corpus, monkeypatch, signum, status):
    from deltalab.cli import main

    original = torch.optim.AdamW.step

    def step(optimizer, *args, **kwargs):
        result = original(optimizer, *args, **kwargs)
        os.kill(os.getpid(), signum)
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    overrides = [f"{k}={v}" for k, v in _flatten(run_config(tmp_path, corpus).to_dict())]
    assert main(["train", *overrides]) == status
    assert _metrics(tmp_path / "run")["status"] == "interrupted"


def test_a_skipped_last_step_still_writes_the_final_checkpoint(tmp_path, corpus, monkeypatch):
    poison_loss_at(monkeypatch, 6)
    result = train(run_config(tmp_path, corpus, "train.nan_policy=skip"))
    assert len(result.losses) == 5
    names = [p.name for p in list_checkpoints(tmp_path / "run")]
    assert names[-1] == "step_00000006.pt"


def test_a_new_run_refuses_a_directory_with_checkpoints_and_resume_refuses_a_changed_config(
    tmp_path, corpus
):
    train(run_config(tmp_path, corpus))
    with pytest.raises(ValueError, match=r"already holds checkpoints of a run; continue it with"):
        train(run_config(tmp_path, corpus, "optim.lr=0.001"))
    with pytest.raises(ValueError, match=r"the run config changed \(optim.lr: 0.01 -> 0.001\)"):
        train(run_config(tmp_path, corpus, "optim.lr=0.001", "checkpoint.resume=true"))
