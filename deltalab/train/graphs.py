"""A training step's passes replayed as one CUDA graph (`train.cuda_graphs`).

Why: in eager PyTorch the host queues every kernel of a step from Python, one operation at a
time, and where the kernels are short the device waits for it. Measured on an H200
(2026-12-02, docs/PERFORMANCE.md): a 340M GDN-2 step at B=4 T=4096 holds
185 ms of kernels, yet the host needs 131 ms to queue its forward (whose kernels take about a
third of that) and 97 ms to queue its backward, so the step takes 264 ms. Recorded once as a
graph, the forward and backward passes of all the step's micro-batches are queued by one call.

How: the first `WARMUP_STEPS` steps run eagerly, on the stream the capture will use (every
kernel is compiled and every lazily created handle exists before the capture, which may create
neither). Then the passes are recorded reading their windows from one static buffer, with the
gradients of the parameters unset, so that the recording's backward writes the gradients (an
assignment, not an accumulation) into memory the graph owns. Each later step copies its windows
into the buffer and replays: the replay writes the new gradients over the previous step's in
the same tensors, which the optimizer and the gradient clipping read as before. The caller must
therefore not unset the gradients after a step once the passes are captured (`captured`).

What a replay does not do that an eager step does: no value check reads anything back (none may
during a capture, `deltalab.ops._checks.values_checkable`). A NaN or infinite gate then shows as
a non-finite loss or gradient norm, which the trainer's `train.nan_policy` handles as it handles
any other; a finite value an op would refuse (a log decay above 0, a Mobius map whose
determinant is not positive, a P0 that is not positive definite) goes unchecked after the
warmup steps, whose eager passes checked the same ops on the run's first data. The model's own
check of the token ids is skipped too, so the trainer checks each step's windows on the host
before copying them (`check_token_ids`, on CPU tensors: no device sync).

A recording fails where the passes do what a capture forbids (read a value back, synchronize,
allocate pinned memory); none of this library's models do (tests/test_cuda.py records each).
The failure stops the run naming `train.cuda_graphs=false`: the process cannot go on eagerly,
as the failed recording leaves the CUDA random generator registered with it.

Without CUDA there is no graph: the same object runs the same passes eagerly at every step
(unsetting the gradients first, as a replay overwrites them), which is how the CPU tests check
the trainer's use of it step for step against plain eager training.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch

from deltalab.errors import ConfigError

# Eager steps before the capture: the first compiles the Triton kernels and creates cuBLAS's
# workspace for the capture stream, the second runs with everything in place.
WARMUP_STEPS = 2


class StepGraph:
    """The forward and backward passes of a training step, captured once and replayed.

    passes: windows `[accum, micro, T + 1]` (on the device) -> the step's loss, a 0-d tensor
        (the mean over its micro-batches), after running every backward pass.
    windows_shape: the shape of every step's windows.
    parameters: the model's parameters (their gradients are the graph's outputs).
    device: where the model lives; without CUDA, `step` runs `passes` eagerly every time.
    """

    def __init__(
        self,
        passes: Callable[[torch.Tensor], torch.Tensor],
        windows_shape: tuple[int, ...],
        parameters: Iterable[torch.nn.Parameter],
        device: torch.device,
    ) -> None:
        self.passes = passes
        self.parameters = list(parameters)
        self.windows = torch.zeros(windows_shape, dtype=torch.int64, device=device)
        self.on_cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.on_cuda else None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.loss: torch.Tensor | None = None
        self.eager_steps = 0
        self.captured = False

    @property
    def warming_up(self) -> bool:
        """Whether the next step runs eagerly (inside `warmup_step`) instead of replaying."""
        return self.eager_steps < WARMUP_STEPS

    @contextlib.contextmanager
    def warmup_step(self) -> Iterator[None]:
        """The context of one eager step before the capture: on the capture stream, ordered
        after everything queued before it and before everything queued after it. It counts
        towards `WARMUP_STEPS` unless `warmup_failed` is called (a step whose passes stopped
        early may have left kernels uncompiled)."""
        self.eager_steps += 1
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            torch.cuda.current_stream().wait_stream(self.stream)

    def warmup_failed(self) -> None:
        """The last warmup step's passes did not all run (a refused value): it does not count."""
        self.eager_steps -= 1

    def step(self, windows: torch.Tensor) -> torch.Tensor:
        """Runs the passes on `windows` (captured at the first call after the warmup steps,
        replayed at the later ones); returns the loss tensor, which the next step overwrites."""
        if self.warming_up:
            raise RuntimeError(f"StepGraph.step called before its {WARMUP_STEPS} warmup steps")
        if tuple(windows.shape) != tuple(self.windows.shape):
            raise ValueError(
                f"windows must have the captured shape {tuple(self.windows.shape)}, got "
                f"{tuple(windows.shape)}"
            )
        self.windows.copy_(windows, non_blocking=True)
        if not self.on_cuda:
            for p in self.parameters:
                p.grad = None  # what a replay's writes amount to: the new gradients alone
            self.captured = True
            return self.passes(self.windows)
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.loss

    def _capture(self) -> None:
        for p in self.parameters:
            p.grad = None  # the recorded backward then assigns each gradient
        # `torch.cuda.graph` synchronizes and empties the allocator's cache first: the warmup
        # steps' freed blocks, cached for the capture stream, go back for the graph's own pool.
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=self.stream):
                self.loss = self.passes(self.windows)
        except RuntimeError as error:
            # No falling back to eager steps: a recording that failed leaves the CUDA random
            # generator registered with it, and the next draw outside a capture then fails
            # ("Offset increment outside graph capture", seen on the H200 with torch 2.11).
            raise RuntimeError(
                f"recording the training step as a CUDA graph failed ({error}); set "
                "train.cuda_graphs=false to train eagerly"
            ) from error
        self.graph = graph
        self.captured = True


def graphable(config, ctx) -> bool:
    """Whether the steps of the run of `config` on `ctx` (a `Distributed`) can be recorded as a
    CUDA graph: on CUDA, in one process (the gradient all-reduce of DDP and FSDP is not
    recorded), not compiled."""
    return ctx.device.type == "cuda" and not ctx.active and not config.train.compile


def records_steps(config, ctx) -> bool:
    """Whether the run's steps go through a `StepGraph` (`train.cuda_graphs`): where the
    setting is true, or null (the default) and the run can record them (`graphable`). True in
    a run of several processes is refused, naming train.cuda_graphs=false."""
    wanted = config.train.cuda_graphs
    if wanted is False or (wanted is None and not graphable(config, ctx)):
        return False
    if ctx.active:
        raise ConfigError(
            f"train.cuda_graphs=true trains in one process; this run has {ctx.world_size} "
            f"processes (train.parallel={config.train.parallel}): set train.cuda_graphs=false"
        )
    return True
