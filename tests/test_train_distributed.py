"""deltalab train over several processes (gloo on CPU): DDP and FSDP ranks, and steps split over
context-parallel ranks, follow the one-process loss curve; a data error on rank 0 stops every
rank. tests/test_train_sharded.py starts its ranks with this file's helpers."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from test_train import _flatten, run_config

from deltalab.train import load_run_config, train


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(rank: int, world: int, port: int) -> None:
    """Makes this spawned process rank `rank` of a torchrun-like environment."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)


def _spawn_ranks(
    target, config, *, world: int = 2, timeout: float = 300, start: str | None = None
) -> tuple[list, list]:
    """Runs `target(rank, world, port, overrides, queue)` in `world` processes (started by
    the multiprocessing method `start`) with the flattened `config`; returns what each put on
    the queue (in arrival order) and the exit codes.

    By default forked: the ranks share this process's imports (spawned ones import torch and
    deltalab again, each, seconds to a minute on two busy cores); each rank runs on one thread.
    A process that has initialized CUDA cannot fork children that touch it: they are spawned."""
    overrides = [f"{k}={v}" for k, v in _flatten(config.to_dict())]
    if start is None:
        start = "spawn" if torch.cuda.is_initialized() else "fork"
    context = mp.get_context(start)
    queue = context.Queue()
    port = _free_port()
    processes = [
        context.Process(target=target, args=(rank, world, port, overrides, queue))
        for rank in range(world)
    ]
    for p in processes:
        p.start()
    results = [queue.get(timeout=timeout) for _ in processes]
    for p in processes:
        p.join(timeout=60)
    return results, [p.exitcode for p in processes]


def _rank_main(rank: int, world: int, port: int, overrides: list[str], queue) -> None:
    _join(rank, world, port)
    result = train(load_run_config(None, overrides))
    queue.put((rank, result.losses))
    torch.distributed.destroy_process_group()


# DDP's ranks are spawned, as torchrun starts them: fresh interpreters that import deltalab
# themselves and inherit nothing from this process; every other multi-rank test forks its ranks.
@pytest.mark.parametrize(
    ("parallel", "start"), [("ddp", "spawn"), ("fsdp", None)], ids=["ddp-spawned", "fsdp"]
)
def test_two_gloo_processes_follow_the_single_process_loss_curve(tmp_path, corpus, parallel, start):
    single = train(run_config(tmp_path / "one", corpus))
    config = run_config(tmp_path / "two", corpus, f"train.parallel={parallel}")
    reports, exit_codes = _spawn_ranks(_rank_main, config, start=start)
    results = dict(reports)
    assert exit_codes == [0, 0]
    assert results[0] == results[1]
    assert torch.allclose(
        torch.tensor(results[0]), torch.tensor(single.losses), rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_steps_split_over_two_context_parallel_ranks_have_the_one_process_losses(
    tmp_path, corpus, parallel, capfd
):
    # One window per step: two ranks can only share it by splitting its tokens.
    short = ("train.steps=2", "train.batch_size=1", "eval.every=2", "checkpoint.every=2")
    single = train(run_config(tmp_path / "one", corpus, *short))
    split = ("train.context_parallel=2", f"train.parallel={parallel}")
    config = run_config(tmp_path / "two", corpus, *short, *split)
    reports, exit_codes = _spawn_ranks(_rank_main, config)
    results = dict(reports)
    assert exit_codes == [0, 0]
    assert results[0] == results[1]
    assert torch.allclose(
        torch.tensor(results[0]), torch.tensor(single.losses), rtol=1e-5, atol=1e-6
    )
    # Each evaluation reads the one-process run's windows, which eval.batches asks for.
    assert "asks for more windows" not in capfd.readouterr().out


def _failing_rank_main(rank: int, world: int, port: int, overrides: list[str], queue) -> None:
    _join(rank, world, port)
    try:
        train(load_run_config(None, overrides))
    except Exception as error:
        queue.put((rank, type(error).__name__, str(error)))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_a_data_error_on_rank_0_stops_every_rank(tmp_path, corpus):
    # A document rank 0 cannot read: it fails while tokenizing, the others wait for its tokens.
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "broken.jsonl").write_text('{"title": "no text field"}\n')
    config = run_config(tmp_path, str(bad))
    reports, _ = _spawn_ranks(_failing_rank_main, config, timeout=120)
    errors = {rank: (kind, text) for rank, kind, text in reports}
    # A user error: every rank reports one, which the CLI prints as one line.
    assert errors[0][0] == "DataError" and "text" in errors[0][1]
    assert errors[1] == (
        "DataError",
        "rank 0 could not prepare the training data; see its error",
    )
