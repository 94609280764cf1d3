"""Process-group setup and model wrapping for `torchrun` (DDP or FSDP2), a no-op alone."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Distributed", "all_reduce_mean", "setup_distributed", "wrap_model"]


@dataclass(frozen=True)
class Distributed:
    """This process's place: rank, world size, and the device it trains on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1


def setup_distributed(device: str) -> Distributed:
    """Reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK) and joins the process group:
    NCCL on CUDA, gloo on CPU. `device`: "auto", "cpu" or "cuda"."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device is 'cuda' but no CUDA device is available")
    if use_cuda:
        torch.cuda.set_device(local_rank)
        target = torch.device("cuda", local_rank)
    else:
        target = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return Distributed(rank, world_size, local_rank, target)


def wrap_model(model: nn.Module, ctx: Distributed, parallel: str) -> nn.Module:
    """DistributedDataParallel, or FSDP2 (`fully_shard` on every block, then the root)."""
    if not ctx.active:
        return model
    if parallel == "ddp":
        ids = [ctx.local_rank] if ctx.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)
    from torch.distributed.fsdp import fully_shard

    for block in model.model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def all_reduce_mean(value: torch.Tensor, ctx: Distributed) -> torch.Tensor:
    """The mean of `value` over ranks (itself when alone)."""
    if ctx.active:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= ctx.world_size
    return value
