"""Checkpoint I/O: atomic saves, verified loads with fallback, pruning, RNG state, clean stops."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from deltalab.train.checkpoint import (
    CheckpointWarning,
    GracefulStop,
    capture_rng_state,
    find_latest_checkpoint,
    list_checkpoints,
    load_latest_checkpoint,
    prune_checkpoints,
    restore_rng_state,
    save_checkpoint,
)


def _payload(step: int) -> dict:
    generator = torch.Generator().manual_seed(step)
    return {
        "step": step,
        "model": {"weight": torch.randn(4, 3, generator=generator), "bias": torch.zeros(3)},
        "optimizer": {"state": {0: {"exp_avg": torch.ones(2)}}, "param_groups": [{"lr": 1e-3}]},
        "config": {"model": {"dim": 64, "layers": [1, 2]}, "name": "tiny"},
    }


def _digest_of(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _save_steps(run_dir: Path, steps: list[int]) -> list[Path]:
    return [save_checkpoint(run_dir, step, _payload(step)) for step in steps]


def test_round_trip_preserves_tensors_and_nested_dicts(tmp_path):
    payload = {**_payload(7), "rng": capture_rng_state(), "metrics": [(1, 2.5), (2, 2.25)]}
    path = save_checkpoint(tmp_path, 7, payload)
    assert path == tmp_path / "checkpoints" / "step_00000007.pt"
    # sha256sum format, so `sha256sum -c` verifies a run directory by hand.
    assert (
        _digest_of(path).read_text()
        == f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.name}\n"
    )

    loaded_path, loaded = load_latest_checkpoint(tmp_path)
    assert loaded_path == path
    assert torch.equal(loaded["model"]["weight"], payload["model"]["weight"])
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"], torch.ones(2))
    assert loaded["config"] == payload["config"]
    assert loaded["metrics"] == payload["metrics"]
    assert np.array_equal(loaded["rng"]["numpy"][1], payload["rng"]["numpy"][1])


def test_list_is_sorted_by_step_and_ignores_other_files(tmp_path):
    _save_steps(tmp_path, [20, 3, 100_000_000])
    (tmp_path / "checkpoints" / ".step_00000050.pt.123.abcd.tmp").write_bytes(b"partial")
    (tmp_path / "checkpoints" / "notes.txt").write_text("hi")
    names = [path.name for path in list_checkpoints(tmp_path)]
    assert names == ["step_00000003.pt", "step_00000020.pt", "step_100000000.pt"]


def test_no_checkpoint_gives_none(tmp_path):
    assert list_checkpoints(tmp_path) == []
    assert load_latest_checkpoint(tmp_path) is None
    assert prune_checkpoints(tmp_path, keep=1) == []


def test_newest_complete_checkpoint_wins(tmp_path):
    paths = _save_steps(tmp_path, [1, 2, 3])
    path, payload = load_latest_checkpoint(tmp_path)
    assert path == paths[-1]
    assert payload["step"] == 3


def test_truncated_checkpoint_is_skipped_for_the_previous_one(tmp_path):
    paths = _save_steps(tmp_path, [1, 2])
    os.truncate(paths[1], paths[1].stat().st_size // 2)
    with pytest.warns(CheckpointWarning, match=r"step_00000002\.pt.*digest mismatch"):
        path, payload = load_latest_checkpoint(tmp_path)
    assert path == paths[0]
    assert payload["step"] == 1


def test_missing_digest_is_skipped(tmp_path):
    paths = _save_steps(tmp_path, [1, 2])
    _digest_of(paths[1]).unlink()
    with pytest.warns(CheckpointWarning, match=r"step_00000002\.pt.*missing digest"):
        path, _ = load_latest_checkpoint(tmp_path)
    assert path == paths[0]


def test_wrong_digest_is_skipped(tmp_path):
    paths = _save_steps(tmp_path, [1, 2])
    _digest_of(paths[1]).write_text("0" * 64 + "  step_00000002.pt\n")
    with pytest.warns(CheckpointWarning, match=r"step_00000002\.pt.*digest mismatch"):
        path, _ = load_latest_checkpoint(tmp_path)
    assert path == paths[0]


def test_unloadable_file_with_matching_digest_is_skipped(tmp_path):
    paths = _save_steps(tmp_path, [1])
    bad = save_checkpoint(tmp_path, 2, {})
    bad.write_bytes(b"not a torch file")
    _digest_of(bad).write_text(hashlib.sha256(b"not a torch file").hexdigest())
    with pytest.warns(CheckpointWarning, match=r"step_00000002\.pt.*torch\.load.* failed"):
        path, _ = load_latest_checkpoint(tmp_path)
    assert path == paths[0]


class _RunsCode:
    """Pickles as a call of `os.mkdir(marker)`: what a planted checkpoint would execute."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def test_a_code_payload_with_a_matching_digest_is_refused_without_running(tmp_path):
    paths = _save_steps(tmp_path, [1])
    marker = tmp_path / "payload-ran"
    planted = tmp_path / "checkpoints" / "step_00000002.pt"
    torch.save({"step": 2, "model": _RunsCode(marker)}, planted)
    # A digest only proves the file is whole; anyone who can plant a file can write one.
    _digest_of(planted).write_text(f"{hashlib.sha256(planted.read_bytes()).hexdigest()}  x\n")
    with pytest.warns(CheckpointWarning, match=r"step_00000002\.pt.*weights_only=True"):
        path, _ = load_latest_checkpoint(tmp_path)
    assert path == paths[0]
    assert not marker.exists()


def test_the_weights_only_refusal_says_what_was_refused_and_why_without_torchs_advice(tmp_path):
    planted = tmp_path / "checkpoints" / "step_00000002.pt"
    planted.parent.mkdir()
    torch.save({"step": 2, "model": _RunsCode(tmp_path / "payload-ran")}, planted)
    _digest_of(planted).write_text(f"{hashlib.sha256(planted.read_bytes()).hexdigest()}  x\n")
    found, skipped = find_latest_checkpoint(tmp_path)
    assert found is None
    ((path, problem),) = skipped
    assert path == planted and "\n" not in problem
    # What: the global the pickle would call; why: loading it could run code.
    assert "mkdir" in problem and "could run code" in problem, problem
    assert "weights_only=False" not in problem and "set to `False`" not in problem, problem


def test_a_payload_without_a_required_key_is_skipped(tmp_path):
    paths = _save_steps(tmp_path, [1])
    save_checkpoint(tmp_path, 2, {"step": 2, "model": {}})
    with pytest.warns(CheckpointWarning, match=r"step_00000002\.pt.*lacks \['config'\]"):
        path, _ = load_latest_checkpoint(tmp_path, required=("step", "config"))
    assert path == paths[0]


def test_every_checkpoint_broken_gives_none_with_a_warning_each(tmp_path):
    paths = _save_steps(tmp_path, [1, 2])
    for path in paths:
        _digest_of(path).unlink()
    with pytest.warns(CheckpointWarning) as record:
        assert load_latest_checkpoint(tmp_path) is None
    assert len(record) == 2


def test_leftover_temp_file_is_ignored_and_pruned(tmp_path):
    paths = _save_steps(tmp_path, [1])
    # What a process killed inside torch.save leaves behind.
    temp = tmp_path / "checkpoints" / ".step_00000002.pt.4242.deadbeef.tmp"
    temp.write_bytes(b"PK\x03\x04 half a zip")
    assert list_checkpoints(tmp_path) == paths
    path, _ = load_latest_checkpoint(tmp_path)
    assert path == paths[0]
    assert prune_checkpoints(tmp_path, keep=1) == [temp]
    assert not temp.exists()


def test_prune_keeps_the_newest_complete_checkpoints(tmp_path):
    paths = _save_steps(tmp_path, [1, 2, 3, 4, 5])
    deleted = prune_checkpoints(tmp_path, keep=2)
    expected = {p for path in paths[:3] for p in (path, _digest_of(path))}
    assert set(deleted) == expected
    assert list_checkpoints(tmp_path) == paths[3:]
    assert all(_digest_of(path).exists() for path in paths[3:])
    assert load_latest_checkpoint(tmp_path)[1]["step"] == 5


def test_prune_never_deletes_the_newest_complete_checkpoint_nor_unverifiable_ones(tmp_path):
    paths = _save_steps(tmp_path, [1, 2, 3, 4])
    # Step 2 was copied without its digest and step 4 is damaged: neither is pruning's to delete,
    # so step 3 is the newest complete one, and step 1 the only one deleted.
    _digest_of(paths[1]).unlink()
    os.truncate(paths[3], 10)
    assert prune_checkpoints(tmp_path, keep=1) == [paths[0], _digest_of(paths[0])]
    assert list_checkpoints(tmp_path) == paths[1:]
    with pytest.warns(CheckpointWarning, match=r"step_00000004"):
        assert load_latest_checkpoint(tmp_path)[1]["step"] == 3
    with pytest.raises(ValueError, match="keep"):
        prune_checkpoints(tmp_path, keep=0)


def test_interrupted_save_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    paths = _save_steps(tmp_path, [1])

    def failing_save(obj, file, *args, **kwargs):
        file.write(b"PK\x03\x04 the first bytes")
        raise RuntimeError("disk full")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint(tmp_path, 2, _payload(2))
    monkeypatch.undo()

    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_00000001.pt",
        "step_00000001.pt.sha256",
    ]
    path, payload = load_latest_checkpoint(tmp_path)
    assert path == paths[0]
    assert payload["step"] == 1


def test_saving_a_step_again_replaces_it(tmp_path):
    save_checkpoint(tmp_path, 1, {"value": 1})
    save_checkpoint(tmp_path, 1, {"value": 2})
    assert load_latest_checkpoint(tmp_path)[1] == {"value": 2}


def _draw() -> tuple[float, np.ndarray, torch.Tensor]:
    # The global generators on purpose: they are what a resumed run must reproduce.
    return random.random(), np.random.rand(3), torch.rand(3)  # noqa: NPY002


def test_a_checkpoint_with_numpy_rng_state_from_before_weights_only_loading_still_loads(
    tmp_path,
):
    # The format of earlier runs: NumPy's own state tuple, its key array an ndarray.
    save_checkpoint(tmp_path, 1, {"rng": {**capture_rng_state(), "numpy": np.random.get_state()}})  # noqa: NPY002
    first = _draw()
    restore_rng_state(load_latest_checkpoint(tmp_path)[1]["rng"])
    again = _draw()
    assert first[0] == again[0] and np.array_equal(first[1], again[1])


def test_rng_restore_repeats_the_same_draws_through_a_checkpoint(tmp_path):
    save_checkpoint(tmp_path, 1, {"rng": capture_rng_state()})
    first = _draw()
    _draw()
    restore_rng_state(load_latest_checkpoint(tmp_path)[1]["rng"])
    again = _draw()
    assert first[0] == again[0]
    assert np.array_equal(first[1], again[1])
    assert torch.equal(first[2], again[2])


def test_graceful_stop_sets_the_flag_and_restores_handlers():
    before = {signum: signal.getsignal(signum) for signum in GracefulStop.SIGNALS}
    with GracefulStop() as stop:
        assert not stop.stop_requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.stop_requested
        assert stop.received == signal.SIGTERM
    assert {signum: signal.getsignal(signum) for signum in GracefulStop.SIGNALS} == before


def test_graceful_stop_second_sigint_raises_keyboard_interrupt():
    before = signal.getsignal(signal.SIGINT)
    with GracefulStop() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.stop_requested
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before


def test_graceful_stop_is_a_no_op_outside_the_main_thread():
    before = {signum: signal.getsignal(signum) for signum in GracefulStop.SIGNALS}
    seen: list[dict] = []

    def worker() -> None:
        with GracefulStop():
            seen.append({signum: signal.getsignal(signum) for signum in GracefulStop.SIGNALS})

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [before]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_rng_and_tensors_survive_a_checkpoint_loaded_on_cpu(tmp_path):
    weight = torch.randn(4, 3, device="cuda")
    save_checkpoint(tmp_path, 1, {"weight": weight, "rng": capture_rng_state()})
    first = torch.rand(3, device="cuda")
    torch.rand(3, device="cuda")
    _, payload = load_latest_checkpoint(tmp_path)
    assert payload["weight"].device.type == "cpu"
    assert torch.equal(payload["weight"], weight.cpu())
    restore_rng_state(payload["rng"])
    assert torch.equal(torch.rand(3, device="cuda"), first)
