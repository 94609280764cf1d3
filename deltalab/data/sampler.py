"""Training windows over the packed token stream and the order in which ranks visit them.

`PackedSequences` cuts the stream into windows of `seq_len + 1` tokens (inputs and shifted
targets); `ResumableSampler` deals window indices to ranks epoch by epoch, from a permutation
that is a pure function of (seed, epoch), and saves where it stands so that a resumed run draws
exactly the indices the uninterrupted run would have; `batches` stacks them into `[B, T+1]`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, TypedDict

import numpy as np
import torch

from deltalab.data._validate import require_int
from deltalab.errors import DataError


class TokenStream(Protocol):
    """A 1-D token sequence with slicing: `TokenShards` or a NumPy array."""

    def __len__(self) -> int: ...

    def __getitem__(self, key: slice, /) -> np.ndarray: ...


class PackedSequences:
    """Windows `[seq_len + 1]` over the token stream, documents packed back to back.

    Window i is tokens `[i * seq_len, i * seq_len + seq_len + 1)`: consecutive windows share one
    token, so every token but the first is a target exactly once; a tail shorter than a window
    is left out. Inputs are `window[:-1]`, targets `window[1:]`; the EOS separators stay in the
    stream, so the model learns where documents end and attends across the boundary.

    Example: stream `[a b c d e f g h]`, seq_len=3 -> 2 windows, `[a b c d]` and `[d e f g]`;
    window 0 has inputs `[a b c]` and targets `[b c d]`; `h` is left out.
    """

    def __init__(self, tokens: TokenStream, seq_len: int) -> None:
        self.tokens = tokens
        self.seq_len = require_int("seq_len", seq_len, minimum=1)
        available = len(tokens)
        if available < seq_len + 1:
            raise DataError(
                f"the corpus has {available} tokens; seq_len={seq_len} needs at least "
                f"{seq_len + 1} (one window of inputs plus the shifted target)"
            )
        self.num_windows = (available - 1) // seq_len

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, index: int) -> torch.Tensor:
        """Window `index` as a LongTensor `[seq_len + 1]`."""
        index = int(index)
        if not 0 <= index < self.num_windows:
            raise IndexError(f"window index {index} is out of range for {self.num_windows} windows")
        start = index * self.seq_len
        window = np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)
        return torch.from_numpy(window)


class SamplerState(TypedDict):
    """Where a `ResumableSampler` stands: `position` indices of `epoch` were handed out.

    The other fields identify the sequence of indices; resuming with different ones is refused.
    """

    epoch: int
    position: int
    seed: int
    num_windows: int
    world_size: int
    shuffle: bool


# The fields of a SamplerState that identify the sequence of indices (the others say where in
# it the sampler stands).
_IDENTITY = ("seed", "num_windows", "world_size", "shuffle")


class ResumableSampler:
    """Window indices for one rank, epoch after epoch, without end.

    Each epoch permutes `range(num_windows)` with a NumPy generator seeded by `(seed, epoch)`
    (the identity when `shuffle=False`), keeps the first `world_size * len(self)` indices and
    gives rank r every world_size-th of them from r: the ranks' shares are disjoint, equally
    long (so every rank takes the same number of steps), and together cover the epoch but for
    the `num_windows % world_size` last indices of the permutation, a different few each epoch.

    Example: num_windows=5, world_size=2, an epoch's permutation `[3 0 4 1 2]` -> rank 0 draws
    3, 4 and rank 1 draws 0, 1; window 2 waits for another epoch.

    `state_dict()` after k indices, loaded into a fresh sampler, makes it continue with index
    k + 1 of the uninterrupted sequence. The state counts indices handed out, so draw them where
    they are used (as `batches` does), not through a prefetching DataLoader.
    """

    def __init__(
        self,
        num_windows: int,
        *,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
    ) -> None:
        self.num_windows = require_int("num_windows", num_windows, minimum=1)
        self.seed = require_int("seed", seed, minimum=0)
        self.world_size = require_int("world_size", world_size, minimum=1)
        self.rank = require_int("rank", rank, minimum=0)
        if rank >= world_size:
            raise ValueError(f"rank must be < world_size = {world_size}, got {rank}")
        if num_windows < world_size:
            raise ValueError(
                f"num_windows must be >= world_size = {world_size} so that every rank gets a "
                f"window, got {num_windows}"
            )
        self.shuffle = bool(shuffle)
        self.epoch = 0
        self.position = 0
        self._indices_epoch = -1
        self._indices = np.empty(0, dtype=np.int64)

    def __len__(self) -> int:
        """Indices per epoch on this rank."""
        return self.num_windows // self.world_size

    def epoch_indices(self, epoch: int) -> np.ndarray:
        """This rank's indices of `epoch`, in order, `[len(self)]` int64."""
        require_int("epoch", epoch, minimum=0)
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
        else:
            order = np.arange(self.num_windows)
        return order[: len(self) * self.world_size][self.rank :: self.world_size]

    def next_index(self) -> int:
        """The next window index; moves to the next epoch after the last one."""
        if self.position >= len(self):
            self.epoch += 1
            self.position = 0
        # Recomputed on an epoch change or a load_state_dict, the only times it goes stale.
        if self._indices_epoch != self.epoch:
            self._indices = self.epoch_indices(self.epoch)
            self._indices_epoch = self.epoch
        index = int(self._indices[self.position])
        self.position += 1
        return index

    def __iter__(self) -> Iterator[int]:
        while True:
            yield self.next_index()

    def state_dict(self) -> SamplerState:
        return SamplerState(**{name: getattr(self, name) for name in SamplerState.__annotations__})

    def load_state_dict(self, state: SamplerState) -> None:
        """Continues from `state`; refuses a state of a different corpus, seed or world size.

        The rank is not compared: all ranks advance in lockstep, so any rank's state fits.
        """
        saved: dict[str, object] = dict(state)
        for name in _IDENTITY:
            mine = getattr(self, name)
            if saved.get(name) != mine:
                raise ValueError(
                    f"the sampler state has {name} = {saved.get(name)!r}, this sampler has "
                    f"{mine!r}; resuming would not continue the same sequence"
                )
        epoch = require_int("state['epoch']", state["epoch"], minimum=0)
        position = require_int("state['position']", state["position"], minimum=0)
        if position > len(self):
            raise ValueError(
                f"state['position'] must be <= {len(self)} indices per epoch, got {position}"
            )
        self.epoch, self.position = epoch, position


def batches(
    sequences: PackedSequences, sampler: ResumableSampler, batch_size: int
) -> Iterator[torch.Tensor]:
    """Endless batches of windows, LongTensor `[B, seq_len + 1]`, B = batch_size.

    Exactly `batch_size` indices are drawn per batch and none ahead, so the sampler's state
    after n batches resumes at batch n + 1. Batches run across epoch boundaries.
    """
    require_int("batch_size", batch_size, minimum=1)
    if sampler.num_windows != len(sequences):
        raise ValueError(
            f"the sampler deals {sampler.num_windows} windows but the sequences have "
            f"{len(sequences)}; build the sampler with num_windows=len(sequences)"
        )
    while True:
        yield torch.stack([sequences[sampler.next_index()] for _ in range(batch_size)])
