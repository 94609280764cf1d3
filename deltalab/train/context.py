"""Context parallelism in the trainer (`train.context_parallel`): each sequence split over a group
of ranks, the groups data-parallel.

Ranks `[d N, (d + 1) N)` form context-parallel group d (N = train.context_parallel; consecutive
ranks, so a group shares a host where torchrun places them so): they read the same windows, and
rank r of a group computes tokens `[r T/N, (r + 1) T/N)` of each (`deltalab.ops.context_parallel`
carries the recurrences across). The groups deal the data as the ranks of a data-parallel run of
world_size / N processes (`ContextSplit.data`).

Gradients: each rank's loss is the mean over its tokens, and the layers send every gradient back
to the rank whose tokens made it, so the average over all ranks that DDP or FSDP forms is the
data-parallel gradient of the whole windows. The loss each rank reports is its group's mean
(`ContextParallelLoss`), the whole windows' loss, identical within the group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from deltalab.errors import ConfigError
from deltalab.ops.context_parallel import context_parallel, gather_ranks
from deltalab.train.distributed import Distributed

__all__ = ["ContextParallelLoss", "ContextSplit", "split_context"]


@dataclass(frozen=True)
class ContextSplit:
    """This rank's place in the split: its context-parallel group (None: no split), its rank
    and the group's size, and `data`, its place among the data-parallel replicas."""

    group: dist.ProcessGroup | None
    rank: int
    size: int
    data: Distributed

    def piece(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of `[B, T]`: `[:, r T/N : (r+1) T/N]`."""
        length = tokens.shape[1] // self.size
        return tokens[:, self.rank * length : (self.rank + 1) * length]

    def wrap(self, model: nn.Module) -> nn.Module:
        """`model`, or where the windows are split, `ContextParallelLoss` around it (in its
        training mode)."""
        if self.group is None:
            return model
        return ContextParallelLoss(model, self).train(model.training)


def split_context(ctx: Distributed, size: int, seq_len: int, conv_size: int) -> ContextSplit:
    """The split of `ctx.world_size` ranks into groups of `size` (train.context_parallel) over
    sequences of `seq_len` tokens; every rank creates every group (`dist.new_group` is
    collective). Refuses sizes that do not divide, and pieces shorter than a short
    convolution's carry."""
    if size == 1:
        return ContextSplit(None, 0, 1, ctx)
    if ctx.world_size % size:
        raise ConfigError(
            f"train.context_parallel ({size}) must divide the number of ranks evenly, got "
            f"{ctx.world_size} (torchrun's processes)"
        )
    if seq_len // size < conv_size - 1:
        raise ConfigError(
            f"train.context_parallel ({size}) leaves {seq_len // size} tokens per rank, fewer "
            f"than the short convolution's carry of conv_size - 1 = {conv_size - 1}"
        )
    groups = [
        dist.new_group(list(range(start, start + size))) for start in range(0, ctx.world_size, size)
    ]
    data = Distributed(ctx.rank // size, ctx.world_size // size, ctx.local_rank, ctx.device)
    return ContextSplit(groups[ctx.rank // size], ctx.rank % size, size, data)


class ContextParallelLoss(nn.Module):
    """`model(input_ids=..., shift_labels=..., ...)` on this rank's piece of the windows inside
    `context_parallel(group)`; the output's loss is the group's mean (differentiable: its
    backward hands each rank the gradient of its own tokens' loss)."""

    def __init__(self, model: nn.Module, split: ContextSplit) -> None:
        super().__init__()
        self.model = model
        self.split = split

    def forward(self, *, input_ids: torch.Tensor, shift_labels: torch.Tensor, **kwargs):
        piece = self.split.piece
        with context_parallel(self.split.group):
            out = self.model(input_ids=piece(input_ids), shift_labels=piece(shift_labels), **kwargs)
        if self.split.group is not None:
            out.loss = gather_ranks(out.loss, self.split.group).mean(0)
        return out
