"""Sharded checkpoints of distributed runs (gloo on CPU): resumed on other world sizes and
strategies with the uninterrupted run's losses, never loaded unfinished, never running code."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch
from test_train import _rank_main, _spawn_ranks, make_corpus, run_config
from test_train_export import same_logits
from torch.distributed.checkpoint import FileSystemReader

from deltalab.data import ResumableSampler
from deltalab.errors import CheckpointError
from deltalab.train import train
from deltalab.train.checkpoint import list_checkpoints, prune_checkpoints, sampler_state_for
from deltalab.train.export import export_checkpoint
from deltalab.train.sharded import DIGESTS_FILE, sharded_problem

# Losses of runs on different world sizes: the same windows per step, summed in another order.
LOSS_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def _config(folder: Path, corpus: str, *extra: str):
    return run_config(folder, corpus, "eval.sample_tokens=0", *extra)


@pytest.fixture(scope="module")
def four_rank_run(tmp_path_factory, corpus) -> tuple[Path, list[float]]:
    """A DDP run of 6 steps on 4 gloo ranks, sharded checkpoints after steps 3 and 6."""
    folder = tmp_path_factory.mktemp("four")
    reports, exit_codes = _spawn_ranks(_rank_main, _config(folder, corpus), world=4)
    assert exit_codes == [0, 0, 0, 0]
    return folder / "run", dict(reports)[0]


@pytest.fixture(scope="module")
def context_parallel_run(tmp_path_factory, corpus) -> tuple[Path, list[float]]:
    """The DDP run of `four_rank_run` on 4 gloo ranks in two context-parallel groups of 2: two
    data-parallel replicas, each splitting its windows over 2 ranks."""
    folder = tmp_path_factory.mktemp("split")
    config = _config(folder, corpus, "train.context_parallel=2")
    reports, exit_codes = _spawn_ranks(_rank_main, config, world=4)
    assert exit_codes == [0, 0, 0, 0]
    results = dict(reports)
    assert all(results[rank] == results[0] for rank in range(4))
    return folder / "run", results[0]


def _resumable_copy(run: Path, folder: Path, *, keep_newest: bool = False) -> Path:
    """A copy of `run` in `folder/run`, without its last checkpoint unless `keep_newest`."""
    copy = folder / "run"
    shutil.copytree(run, copy)
    newest = list_checkpoints(copy)[-1]
    if keep_newest:
        return copy
    if newest.is_dir():
        shutil.rmtree(newest)
    else:
        newest.unlink()
    return copy


def test_a_distributed_run_writes_one_complete_sharded_checkpoint_per_save(four_rank_run):
    run, _ = four_rank_run
    saved = list_checkpoints(run)
    assert [path.name for path in saved] == ["step_00000003", "step_00000006"]
    for path in saved:
        assert path.is_dir() and sharded_problem(path) is None
        assert (path / ".metadata").is_file() and list(path.glob("__*_*.distcp"))
    assert not list((run / "checkpoints").glob(".*"))


@pytest.mark.parametrize("world", [2, 1])
def test_a_four_rank_checkpoint_resumes_on_fewer_ranks_with_the_same_losses(
    tmp_path, corpus, four_rank_run, world
):
    run, reference = four_rank_run
    _resumable_copy(run, tmp_path)
    config = _config(tmp_path, corpus, "checkpoint.resume=true")
    if world == 1:
        losses = train(config).losses
    else:
        reports, exit_codes = _spawn_ranks(_rank_main, config, world=world)
        assert exit_codes == [0] * world
        losses = dict(reports)[0]
    # Steps 1-3 come from the checkpoint's history, 4-6 are computed again, to rounding: gloo's
    # sums over ranks round by an element's place in the buffer reduced, which differs with
    # the world size and, under DDP, between the first step after a start (the initial
    # gradient buckets) and the later ones (buckets rebuilt in the order gradients arrived).
    assert losses[:3] == reference[:3]
    assert torch.allclose(torch.tensor(losses), torch.tensor(reference), **LOSS_TOLERANCE)


@pytest.mark.parametrize("context_parallel", [2, 1])
def test_a_context_parallel_checkpoint_resumes_split_or_not_with_the_same_losses(
    tmp_path, corpus, context_parallel_run, context_parallel
):
    # Saved by 2 replicas of 2 ranks; resumed on 2 ranks as 1 replica (the data position is
    # converted from 2 data-parallel ranks to 1) or as 2 replicas of 1 rank.
    run, reference = context_parallel_run
    _resumable_copy(run, tmp_path)
    split = f"train.context_parallel={context_parallel}"
    config = _config(tmp_path, corpus, "checkpoint.resume=true", split)
    reports, exit_codes = _spawn_ranks(_rank_main, config, world=2)
    assert exit_codes == [0, 0]
    losses = dict(reports)[0]
    assert losses[:3] == reference[:3]
    assert torch.allclose(torch.tensor(losses), torch.tensor(reference), **LOSS_TOLERANCE)


def test_a_context_parallel_save_writes_each_replicated_tensor_once(context_parallel_run):
    # Under DDP all 4 ranks hold the same full tensors: DCP keeps one writer per tensor.
    run, _ = context_parallel_run
    newest = list_checkpoints(run)[-1]
    metadata = FileSystemReader(newest).read_metadata()
    for name, entry in metadata.state_dict_metadata.items():
        assert [chunk.sizes for chunk in entry.chunks] == [entry.size], name
    # The shards hold exactly the chunks the metadata lists: replicas written by every rank
    # would leave unlisted copies in the other ranks' files.
    stored = sum(info.length for info in metadata.storage_data.values())
    assert sum(path.stat().st_size for path in newest.glob("__*.distcp")) == stored


def test_a_context_parallel_fsdp2_checkpoint_resumes_unsplit_under_ddp_with_the_same_losses(
    tmp_path, corpus, context_parallel_run
):
    # FSDP2 shards every parameter over all 4 ranks, across the context-parallel groups.
    _, reference = context_parallel_run
    split = ("train.context_parallel=2", "train.parallel=fsdp")
    reports, exit_codes = _spawn_ranks(
        _rank_main, _config(tmp_path / "fsdp", corpus, *split), world=4
    )
    assert exit_codes == [0, 0, 0, 0]
    assert torch.allclose(torch.tensor(dict(reports)[0]), torch.tensor(reference), **LOSS_TOLERANCE)
    _resumable_copy(tmp_path / "fsdp" / "run", tmp_path)
    config = _config(tmp_path, corpus, "checkpoint.resume=true")
    reports, exit_codes = _spawn_ranks(_rank_main, config, world=2)
    assert exit_codes == [0, 0]
    assert torch.allclose(torch.tensor(dict(reports)[0]), torch.tensor(reference), **LOSS_TOLERANCE)


def test_a_single_process_checkpoint_resumes_on_two_fsdp2_ranks(tmp_path, corpus):
    single = train(_config(tmp_path / "one", corpus))
    copy = _resumable_copy(tmp_path / "one" / "run", tmp_path)
    assert list_checkpoints(copy)[-1].name == "step_00000003.pt"
    config = _config(tmp_path, corpus, "checkpoint.resume=true", "train.parallel=fsdp")
    reports, exit_codes = _spawn_ranks(_rank_main, config, world=2)
    assert exit_codes == [0, 0]
    losses = dict(reports)[0]
    assert torch.allclose(torch.tensor(losses), torch.tensor(single.losses), **LOSS_TOLERANCE)


def test_an_unfinished_save_is_never_loaded_and_the_previous_checkpoint_resumes(
    tmp_path, corpus, four_rank_run
):
    run, reference = four_rank_run
    copy = _resumable_copy(run, tmp_path, keep_newest=True)
    newest = list_checkpoints(copy)[-1]
    # A save killed before its marker: the final directory without SHA256SUMS, and a temporary
    # directory of a later step with every shard but no marker.
    shutil.copytree(newest, copy / "checkpoints" / ".step_00000009.123.abcd1234.tmp")
    (newest / DIGESTS_FILE).unlink()
    assert sharded_problem(newest) == f"missing digest file {DIGESTS_FILE}"
    with pytest.warns(UserWarning, match=r"step_00000006: missing digest file SHA256SUMS"):
        resumed = train(_config(tmp_path, corpus, "checkpoint.resume=true"))
    assert torch.allclose(torch.tensor(resumed.losses), torch.tensor(reference), **LOSS_TOLERANCE)
    # The resumed run (one process) saved step 6 as a file; pruning took the temporary directory
    # and left the directory it cannot verify to the user.
    names = [path.name for path in list_checkpoints(copy)]
    assert names == ["step_00000003", "step_00000006.pt", "step_00000006"]
    assert not list((copy / "checkpoints").glob(".*"))


def test_a_damaged_shard_fails_its_digest_and_is_never_pruned(tmp_path, four_rank_run):
    run, _ = four_rank_run
    copy = _resumable_copy(run, tmp_path, keep_newest=True)
    newest = list_checkpoints(copy)[-1]
    shard = sorted(newest.glob("__*.distcp"))[-1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert sharded_problem(newest).startswith(f"digest mismatch of {shard.name}")
    # Pruning never deletes what it cannot verify.
    assert prune_checkpoints(copy, keep=1) == []


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return os.mkdir, (str(self.marker),)


def test_a_planted_metadata_pickle_never_runs_code(tmp_path, corpus, four_rank_run):
    import hashlib

    run, _ = four_rank_run
    copy = _resumable_copy(run, tmp_path)
    only = list_checkpoints(copy)[-1]
    marker = tmp_path / "metadata-ran"
    (only / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    lines = [
        f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.name}\n"
        for path in sorted(only.iterdir())
        if path.name != DIGESTS_FILE
    ]
    (only / DIGESTS_FILE).write_text("".join(lines))
    with pytest.raises(CheckpointError, match=r"step_00000003: its \.metadata calls \w+\.mkdir"):
        train(_config(tmp_path, corpus, "checkpoint.resume=true"))
    assert not marker.exists()


def test_a_ddp_checkpoint_resumes_under_fsdp2_with_the_same_losses(tmp_path, corpus, four_rank_run):
    run, reference = four_rank_run
    _resumable_copy(run, tmp_path)
    config = _config(tmp_path, corpus, "checkpoint.resume=true", "train.parallel=fsdp")
    reports, exit_codes = _spawn_ranks(_rank_main, config, world=2)
    assert exit_codes == [0, 0]
    losses = dict(reports)[0]
    assert torch.allclose(torch.tensor(losses), torch.tensor(reference), **LOSS_TOLERANCE)
    # The FSDP2 run's own checkpoint of step 6 (DTensor shards) resumes in one process: the
    # run is complete, so nothing is left to compute and the history is the checkpoint's.
    newest = list_checkpoints(tmp_path / "run")[-1]
    assert sharded_problem(newest) is None
    alone = train(_config(tmp_path, corpus, "checkpoint.resume=true"))
    assert alone.losses == losses
    export_checkpoint(newest, tmp_path / "exported")
    assert same_logits(tmp_path / "exported", tmp_path / "run" / "model")


def test_a_sharded_checkpoint_exports_the_trained_models_logits(tmp_path, four_rank_run):
    run, _ = four_rank_run
    export_checkpoint(run, tmp_path / "out")
    assert same_logits(tmp_path / "out", run / "model")


def _drawn(samplers, count: int) -> list[int]:
    """`count` indices from each sampler in turn, as the ranks' steps draw them together."""
    return [index for _ in range(count) for sampler in samplers for index in [sampler.next_index()]]


def test_a_sampler_state_continues_the_same_windows_on_another_world_size():
    # An epoch of 23 windows: 4 ranks draw 20 of them, 2 ranks 22.
    four = [ResumableSampler(23, seed=5, rank=r, world_size=4) for r in range(4)]
    fresh = [ResumableSampler(23, seed=5, rank=r, world_size=2) for r in range(2)]
    assert _drawn(four, 3) == _drawn(fresh, 6)
    two = [ResumableSampler(23, seed=5, rank=r, world_size=2) for r in range(2)]
    for sampler in two:
        sampler.load_state_dict(sampler_state_for(four[0].state_dict(), 2))
    # The same windows in the same order up to the end of the 4 ranks' epoch.
    assert _drawn(two, 4) == _drawn(four, 2)
    with pytest.raises(
        ValueError, match=r"\(15 windows of epoch 0\) does not split over 2 data-parallel ranks"
    ):
        sampler_state_for({**four[0].state_dict(), "world_size": 3}, 2)
