"""The training loop behind `deltalab train`.

One function, `train(config)`: data -> model -> AdamW steps with accumulation, clipping and the
schedule -> held-out evaluation -> atomic checkpoints (every N steps, on SIGINT/SIGTERM, at the
end) -> a Hugging Face export, a metrics JSON, a loss-curve PNG and a generated sample. Under
`torchrun` the same function trains with DDP or FSDP2; every rank writes its shard of a
checkpoint, only rank 0 writes the rest.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from deltalab.data import PackedSequences, ResumableSampler, batches, load_tokenizer
from deltalab.errors import DataError, DivergenceError
from deltalab.generate import continuation, printable
from deltalab.models import CausalLM
from deltalab.models.lm import check_token_ids
from deltalab.ops._checks import NonFiniteError, one_host_read
from deltalab.provenance import write_run_provenance
from deltalab.train import graphs, preflight
from deltalab.train.checkpoint import (
    GracefulStop,
    capture_rng_state,
    list_checkpoints,
    prune_checkpoints,
    restore_rng_state,
    resumable_checkpoint,
)
from deltalab.train.config import RunConfig
from deltalab.train.context import ContextSplit, split_context
from deltalab.train.data import prepare_sequences
from deltalab.train.distributed import Distributed, all_reduce_mean, setup_distributed, wrap_model
from deltalab.train.export import load_initial_weights, save_model_directory
from deltalab.train.graphs import StepGraph
from deltalab.train.lock import hold_run_directory
from deltalab.train.optim import build_optimizer, build_scheduler, no_decay_names
from deltalab.train.report import RunLogger, announce, unrecorded_files, write_metrics
from deltalab.train.sharded import FULL_STATE, load_training_arrays, save_training_checkpoint

__all__ = ["TrainResult", "train"]


@dataclass
class TrainResult:
    """What a run produced. Perplexities are exp(held-out loss per token).

    `steps` counts the recorded (not skipped) steps; `last_step` is the step the run reached of
    `config.train.steps`. `stop_signal` is the signal number that interrupted the run, if any.
    """

    out_dir: Path
    steps: int
    initial_perplexity: float
    final_perplexity: float
    losses: list[float] = field(default_factory=list)
    sample: str = ""
    interrupted: bool = False
    last_step: int = 0
    stop_signal: int | None = None


def _autocast(config: RunConfig, ctx: Distributed, cache: bool = True):
    precision = config.train.precision
    if precision == "bf16" or (precision == "auto" and ctx.device.type == "cuda"):
        return torch.autocast(ctx.device.type, dtype=torch.bfloat16, cache_enabled=cache)
    return contextlib.nullcontext()


def _loss(model, window: torch.Tensor, autocast) -> torch.Tensor:
    """Mean next-token cross-entropy of windows `[B, T + 1]`: the model reads window[:, :-1]
    and each of its T positions predicts the next token, window[:, 1:] (passed as shift_labels:
    CausalLM's labels would shift inside and leave the last position without a target).

    The loss is computed inside the model's forward (return_logits=False: the LM head and the
    cross-entropy in chunks, no `[B, T, vocab]` logits), so DDP sees one forward and FSDP2 has
    the root's parameters, the LM head's among them, unsharded around it."""
    with autocast:
        return model(input_ids=window[:, :-1], shift_labels=window[:, 1:], return_logits=False).loss


@torch.no_grad()
def evaluate(
    model, held_out: PackedSequences, count: int, micro: int, ctx, autocast, data=None
) -> float:
    """Mean held-out loss over the first `count` windows (dealt evenly over the data-parallel
    ranks `data`, by default every rank; a context-parallel group shares its windows), in
    order."""
    data = ctx if data is None else data
    was_training = model.training
    model.eval()
    used = min(count, len(held_out)) // data.world_size * data.world_size
    if used == 0:
        raise DataError(
            f"the held-out split has {len(held_out)} windows, fewer than the {data.world_size} "
            "ranks; raise data.held_out_fraction or lower train.seq_len"
        )
    indices = list(range(used))[data.rank :: data.world_size]
    total = torch.zeros((), dtype=torch.float64, device=ctx.device)
    for start in range(0, len(indices), micro):
        window = torch.stack([held_out[i] for i in indices[start : start + micro]]).to(ctx.device)
        try:
            total += _loss(model, window, autocast).double() * window.shape[0]
        except NonFiniteError:
            # A diverged model: its held-out loss is NaN, which the caller reports.
            total += math.nan
    # The ranks of a context-parallel group hold the same total (their group's mean loss).
    total = all_reduce_mean(total, ctx) * data.world_size
    model.train(was_training)
    return (total / used).item()


@dataclass
class TrainState:
    """What a run's phases share (setup, resume, the step loop, evaluations, checkpoints, the
    finish): one object instead of the same dozen values passed to each.

    core: the unwrapped model (state dicts, export); model: its DDP/FSDP wrapper (or core);
    forward: what the steps call (model, compiled with train.compile).
    graph: the step's CUDA graph (train.cuda_graphs), or None for eager steps.
    micro: windows per forward on each rank; eval_windows: held-out windows per evaluation.
    split: the ranks' context-parallel groups (train.context_parallel).
    history: {"train": step records, "eval": {"step", "loss"} records}, checkpointed with the
    rest.
    done: the steps done of train.steps (skipped ones included); skipped: those skipped as
    non-finite (train.nan_policy=skip); interrupted and stop_signal: whether, and by which
    signal, the run stopped before its last step.
    """

    config: RunConfig
    ctx: Distributed
    out_dir: Path
    core: CausalLM
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: ResumableSampler
    model: Any
    forward: Any
    graph: StepGraph | None
    tokenizer: Any
    train_data: PackedSequences
    held_out: PackedSequences
    micro: int
    eval_windows: int
    autocast: Any
    split: ContextSplit
    # What the run's record says of its code, packages, device and data (deltalab.provenance).
    provenance: dict[str, Any] = field(default_factory=dict)
    history: dict[str, list[dict[str, Any]]] = field(
        default_factory=lambda: {"train": [], "eval": []}
    )
    logger: RunLogger | None = None
    done: int = 0
    skipped: int = 0
    interrupted: bool = False
    stop_signal: int | None = None

    def held_out_loss(self) -> float:
        """The held-out loss now (`evaluate` over `eval_windows` windows)."""
        return evaluate(
            self.split.wrap(self.core), self.held_out, self.eval_windows, self.micro, self.ctx,
            self.autocast, self.split.data,
        )  # fmt: skip

    def payload(self, step: int) -> dict[str, Any]:
        """Everything a resume needs after `step` but the model's and optimizer's state."""
        return {
            "step": step,
            "scheduler": self.scheduler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "rng": capture_rng_state(),
            "config": self.config.to_dict(),
            "history": self.history,
        }

    def checkpoint(self, step: int) -> None:
        """Saves the state after `step` and prunes old checkpoints (rank 0), all ranks waiting
        for the save. A distributed run writes a sharded checkpoint, each rank its shard; one
        process writes one file (`save_training_checkpoint`). Either resumes on any number of
        ranks."""
        save_training_checkpoint(
            self.out_dir, step, self.core, self.optimizer, self.payload(step),
            sharded=self.ctx.active,
        )  # fmt: skip
        if self.ctx.is_main:
            prune_checkpoints(self.out_dir, self.config.checkpoint.keep)
        if self.ctx.active:
            dist.barrier()

    def resume(self) -> int:
        """Loads the newest usable checkpoint of `out_dir` into the state (`resumable_checkpoint`:
        its data position converted for this run's data-parallel ranks, which deal the data);
        returns its step (0, and the state as it was, when there is none)."""
        found = resumable_checkpoint(
            self.out_dir, self.config.to_dict(), self.split.data.world_size
        )
        if found is None:
            return 0
        path, payload = found
        load_training_arrays(path, payload, self.core, self.optimizer)
        self.scheduler.load_state_dict(payload["scheduler"])
        self.sampler.load_state_dict(payload["sampler"])
        restore_rng_state(payload["rng"])
        self.history = payload["history"]
        return int(payload["step"])

    def initial_eval_loss(self, first_eval: float) -> float:
        """The held-out loss before training: step 0's evaluation when the history has it (a
        resumed run evaluates again at its resume step), else `first_eval`."""
        return self.history["eval"][0]["loss"] if self.history["eval"] else first_eval


def _stop_everywhere(stop, ctx: Distributed) -> bool:
    """Whether any rank was signalled: ranks must checkpoint and leave at the same step."""
    flag = torch.tensor(float(stop.stop_requested), device=ctx.device)
    return bool(all_reduce_mean(flag, ctx).item() > 0)


def _grad_norm(core, max_norm: float) -> float:
    """The global gradient norm, clipped to `max_norm` (0: measured, not clipped)."""
    norm = torch.nn.utils.clip_grad_norm_(core.parameters(), max_norm or math.inf)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def _due(step: int, every: int) -> bool:
    """Every `every` steps; 0 means at the last step only (handled by the caller)."""
    return every > 0 and step % every == 0


def _nonfinite_hint(out_dir: Path, step: int, config: RunConfig, cause: str) -> str:
    """The message of a run stopped by train.nan_policy=stop, true about what is on disk."""
    saved = list_checkpoints(out_dir)
    if saved:
        where = f"the newest checkpoint is {saved[-1]}"
    else:
        where = "no checkpoint was written before it"
    return (
        f"step {step} is not finite ({cause}); stopping (train.nan_policy=stop), {where}. The "
        f"learning rate is likely too high for this model: lower optim.lr (now "
        f"{config.optim.lr:g}) or lengthen schedule.warmup_steps (now "
        f"{config.schedule.warmup_steps}) and start a new run, or set train.nan_policy=skip "
        "to skip such steps"
    )


def _forward_checks(checkpointing: bool):
    """The context of a training forward's value checks (each op's refusal of bad gates, e.g.
    a log decay > 0): their answers read back once, at the end of the forward
    (`one_host_read`), not once per layer. Each read makes the host wait for every queued
    kernel, after which the GPU waits for the host: a 340M GDN-2 step read 24 times, Diagonal
    KDN 48 (benchmarks/traffic.py). A failing check raises the error it raises alone, after
    the forward and before the backward, and the step fails as it did. With activation
    checkpointing the checks stay immediate: a queued check keeps its input alive to the end
    of the forward (to run again should it fail), which checkpointing would otherwise free."""
    return contextlib.nullcontext() if checkpointing else one_host_read()


def _refused(error: NonFiniteError) -> str:
    """Why a step failed when an op refused the non-finite values the model produced."""
    return f"the model produced non-finite values: {error}"


def _micro_pass(forward, window: torch.Tensor, autocast, accum: int, checkpointing: bool):
    """One micro-batch's forward and backward passes; returns its share of the step's loss
    (detached): the loss over `accum`, so that the gradients add up to the step's mean."""
    with _forward_checks(checkpointing):
        loss = _loss(forward, window, autocast) / accum
    loss.backward()
    return loss.detach()


def _accumulate(
    state: TrainState, model, forward, stream, autocast, graph: StepGraph | None = None
) -> tuple[float, str | None]:
    """One step's forward and backward passes over `train.grad_accum` micro-batches: (the
    mean loss over ranks, NaN if any part failed; why the step failed, or None).

    With `graph` (`train.cuda_graphs`) past its warmup steps, the passes are the graph's
    replay on the step's windows, checked on the host first (the replay reads nothing back)."""
    config, ctx = state.config, state.ctx
    accum = config.train.grad_accum
    if graph is not None and not graph.warming_up:
        windows = torch.stack([next(stream) for _ in range(accum)])
        check_token_ids(windows.flatten(0, 1), state.core.config.vocab_size)
        try:
            return graph.step(windows).item(), None
        except NonFiniteError as error:  # only where there is no graph: the passes ran eagerly
            return math.nan, _refused(error)
    total = torch.zeros((), device=ctx.device)
    cause = None
    with graph.warmup_step() if graph is not None else contextlib.nullcontext():
        for micro_step in range(accum):
            window = next(stream).to(ctx.device)
            if cause is not None:
                continue  # the step is lost; its windows are still drawn, as in a clean run
            last = micro_step == accum - 1
            sync = (
                model.no_sync()
                if (ctx.active and not last and config.train.parallel == "ddp")
                else contextlib.nullcontext()
            )
            try:
                with sync:
                    total += _micro_pass(
                        forward, window, autocast, accum, config.train.activation_checkpointing
                    )
            except NonFiniteError as error:
                # An op refused the non-finite values the model produced (a NaN gate): the
                # same event as a non-finite loss, under the same policy.
                cause = _refused(error)
                total += math.nan
    if graph is not None and cause is not None:
        graph.warmup_failed()
    return all_reduce_mean(total, ctx).item(), cause


def _step_graph(config: RunConfig, ctx: Distributed, core, forward, micro: int) -> StepGraph | None:
    """The step's passes as a `StepGraph`, every micro-batch in one graph, where the run
    records its steps (`graphs.records_steps`: train.cuda_graphs), else None for eager steps.
    A recording that fails stops the run, naming train.cuda_graphs=false."""
    if not graphs.records_steps(config, ctx):
        return None
    accum = config.train.grad_accum
    # No autocast cache, as PyTorch asks of code a CUDA graph records (a cast cached by one
    # autocast region and read in another would hold the capture's values); here each micro-
    # batch's region ends inside the recording, so it costs nothing either way.
    autocast = _autocast(config, ctx, cache=False)
    checkpointing = config.train.activation_checkpointing

    def passes(windows: torch.Tensor) -> torch.Tensor:
        total = torch.zeros((), device=windows.device)
        for i in range(accum):
            total += _micro_pass(forward, windows[i], autocast, accum, checkpointing)
        return total

    shape = (accum, micro, config.train.seq_len + 1)
    return StepGraph(passes, shape, core.parameters(), ctx.device)


def train(config: RunConfig) -> TrainResult:
    """Trains the configured model; returns its perplexities, losses and sample. Holds the run
    directory's trainer lock throughout (deltalab/train/lock.py): one trainer per log.out_dir; a
    run that fails before it logs a step removes the directory it created."""
    ctx = setup_distributed(config.train.device)
    preflight.check_directories(config)
    # The ranks of one run share its directory: the main rank holds the lock for them all.
    held = (
        hold_run_directory(Path(config.log.out_dir), unrecorded_files)
        if ctx.is_main
        else contextlib.nullcontext()
    )
    with held:
        return _train(config, ctx)


def _train(config: RunConfig, ctx: Distributed) -> TrainResult:
    state = _setup(config, ctx)
    start = state.resume() if config.checkpoint.resume else 0
    if ctx.is_main:
        data = {
            "train": state.train_data.tokens.manifest.fingerprint(),
            "held_out": state.held_out.tokens.manifest.fingerprint(),
        }
        state.provenance = write_run_provenance(state.out_dir, ctx.device, data)
    state.done = start
    state.logger = RunLogger(state.out_dir, config, enabled=ctx.is_main, resume_step=start or None)
    if ctx.is_main:
        announce(state)
    first_eval = state.held_out_loss()
    if start == 0:
        state.history["eval"].append({"step": 0, "loss": first_eval})
    state.logger.print(f"held-out perplexity at step {start}: {math.exp(first_eval):.3f}")

    stream = batches(state.train_data, state.sampler, state.micro)
    state.model.train()
    with GracefulStop() as stop, state.logger.progress(start, config.train.steps) as progress:
        for step in range(start, config.train.steps):
            _optimizer_step(state, step, stream, progress)
            if _after_step(state, stop):
                break
    return _finish(state, first_eval)


def _setup(config: RunConfig, ctx: Distributed) -> TrainState:
    """The run's data, model, optimizer, schedule and step graph, checked before anything big
    is allocated; the state of step 0."""
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    out_dir = Path(config.log.out_dir)
    preflight.check_fresh_start(out_dir, config)
    preflight.check_outside_source(config)
    torch.manual_seed(config.train.seed)
    tokenizer = load_tokenizer(config.data.tokenizer)
    model_config = preflight.model_config(config, tokenizer, ctx.device)
    split = split_context(
        ctx, config.train.context_parallel, config.train.seq_len, model_config.conv_size
    )
    # The data is dealt over the data-parallel replicas: a context-parallel group reads one.
    micro = config.train.micro_batch(split.data.world_size)
    train_data = prepare_sequences(config, tokenizer, "train", ctx)
    held_out = prepare_sequences(config, tokenizer, "held_out", ctx)
    eval_windows = preflight.check_batch_sizes(config, train_data, held_out, micro, split.data)

    # The seed again: building the model on the meta device above draws nothing, but the
    # initialization must not depend on what the checks did.
    torch.manual_seed(config.train.seed)
    core = CausalLM(model_config).to(ctx.device)
    # A resumed run's weights come from its checkpoint: the seed directory is not read again
    # (it may be gone by then).
    resuming = config.checkpoint.resume and list_checkpoints(config.log.out_dir)
    if config.model.init_from is not None and not resuming:
        load_initial_weights(core, config.model.init_from)
    core.model.checkpoint_blocks = config.train.activation_checkpointing
    core.model.recompute_ffn = config.train.recompute_ffn
    exempt = no_decay_names(core)
    model = wrap_model(core, ctx, config.train.parallel)
    forward = split.wrap(torch.compile(model) if config.train.compile else model)
    optimizer = build_optimizer(core, config.optim, exempt)
    graph = _step_graph(config, ctx, core, forward, micro)
    return TrainState(
        config=config,
        ctx=ctx,
        out_dir=out_dir,
        core=core,
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, config.schedule, config.train.steps),
        sampler=ResumableSampler(
            len(train_data),
            seed=config.train.seed,
            rank=split.data.rank,
            world_size=split.data.world_size,
        ),
        model=model,
        forward=forward,
        graph=graph,
        tokenizer=tokenizer,
        train_data=train_data,
        held_out=held_out,
        micro=micro,
        eval_windows=eval_windows,
        autocast=_autocast(config, ctx),
        split=split,
    )


def _optimizer_step(state: TrainState, step: int, stream, progress) -> None:
    """Step `step` (0-based): the passes, clipping, the update under train.nan_policy (a
    non-finite step stops the run or is skipped, still counting for the schedule, the data and
    checkpoints), the schedule, and the step's record."""
    config, graph, optimizer = state.config, state.graph, state.optimizer
    began = time.perf_counter()
    loss_value, cause = _accumulate(
        state, state.model, state.forward, stream, state.autocast, graph
    )
    grad_norm = _grad_norm(state.core, config.optim.grad_clip)
    lr = state.scheduler.get_last_lr()[0]
    state.done = done = step + 1
    finite = math.isfinite(loss_value) and math.isfinite(grad_norm)
    if not finite and config.train.nan_policy == "stop":
        cause = cause or f"loss {loss_value}, gradient norm {grad_norm}"
        raise DivergenceError(_nonfinite_hint(state.out_dir, done, config, cause))
    if finite:
        optimizer.step()
    else:
        state.skipped += 1
        state.logger.print(f"step {done}: non-finite loss or gradient, step skipped")
    if graph is None or not graph.captured:
        # A captured graph's replay writes the next gradients into these tensors.
        optimizer.zero_grad(set_to_none=True)
    state.scheduler.step()
    if finite:
        tokens_per_step = config.train.batch_size * config.train.seq_len
        record = {
            "step": done,
            "loss": loss_value,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_step / (time.perf_counter() - began),
        }
        state.history["train"].append(record)
        state.logger.train_step(record)
        progress.update(record)


def _after_step(state: TrainState, stop: GracefulStop) -> bool:
    """The evaluation and checkpoint due after the step just done, and a checkpoint on a
    signal to any rank; whether the run stops here (signalled before its last step)."""
    config, done = state.config, state.done
    if _due(done, config.eval.every) and done < config.train.steps:
        value = state.held_out_loss()
        state.history["eval"].append({"step": done, "loss": value})
        state.logger.eval_step(done, value)
    checkpoint_due = _due(done, config.checkpoint.every) or done == config.train.steps
    stopping = _stop_everywhere(stop, state.ctx)
    if checkpoint_due or stopping:
        state.checkpoint(done)
    if not (stopping and done < config.train.steps):
        return False
    state.interrupted = True
    # Ranks not signalled themselves stop for a peer, which launchers signal with SIGTERM.
    state.stop_signal = int(stop.received or signal.SIGTERM)
    state.logger.print(
        f"stopped by signal after step {done} of {config.train.steps}; the run is "
        "incomplete, resume it with --resume (checkpoint.resume=true)"
    )
    return True


def _finish(state: TrainState, first_eval: float) -> TrainResult:
    """After the last step (or a signal): the final evaluation, the sample, rank 0's export
    (model, metrics, loss curve) and the run's result."""
    config, ctx, history, logger = state.config, state.ctx, state.history, state.logger
    # Whether steps were replayed from a CUDA graph (train.cuda_graphs: null decides by the run;
    # without CUDA a StepGraph records nothing).
    graphed = state.graph is not None and state.graph.graph is not None
    if state.graph is not None:
        # The graph's memory pool and the gradients it owns are of no use past the last step:
        # freed before the final evaluation, the sample and the export.
        state.optimizer.zero_grad(set_to_none=True)
        state.graph = None
    final_eval = state.held_out_loss()
    if not state.interrupted and (
        not history["eval"] or history["eval"][-1]["step"] != config.train.steps
    ):
        history["eval"].append({"step": config.train.steps, "loss": final_eval})
    logger.print(f"held-out perplexity at the end: {math.exp(final_eval):.3f}")
    if state.skipped:
        logger.print(f"{state.skipped} of the run's steps were skipped as non-finite")
    if math.isfinite(final_eval):
        sample = _sample(state.core, state.tokenizer, config, ctx)
    else:
        # A model whose held-out loss is not finite has nothing to sample from (NaN logits).
        sample = ""
        logger.print("no sample: the model's held-out loss is not finite")
    # Gathering the full weights is a collective under FSDP: every rank takes part.
    weights = get_model_state_dict(state.core, options=FULL_STATE)
    status = {
        "status": "interrupted" if state.interrupted else "completed",
        "steps_done": state.done,
        "steps_planned": config.train.steps,
        "skipped_steps": state.skipped,
        "cuda_graphs": graphed,
    }
    initial_eval = state.initial_eval_loss(first_eval)
    if ctx.is_main:
        if config.eval.sample_tokens > 0 and math.isfinite(final_eval):
            logger.print(f"sample:\n{config.eval.sample_prompt}{printable(sample)}")
        save_model_directory(state.core, state.tokenizer, state.out_dir / "model", weights)
        write_metrics(state, (initial_eval, final_eval), sample, status)
    logger.close()
    if ctx.active:
        dist.barrier()
    return TrainResult(
        out_dir=state.out_dir,
        steps=len(history["train"]),
        initial_perplexity=math.exp(initial_eval),
        final_perplexity=math.exp(final_eval),
        losses=[r["loss"] for r in history["train"]],
        sample=sample,
        interrupted=state.interrupted,
        last_step=state.done,
        stop_signal=state.stop_signal,
    )


def _sample(core: CausalLM, tokenizer, config: RunConfig, ctx: Distributed) -> str:
    """A continuation of `eval.sample_prompt`: sampled at `eval.sample_temperature` from a
    generator seeded by `train.seed` (the same tokens on every rank, which all take part under
    FSDP), or greedy at temperature 0."""
    if config.eval.sample_tokens == 0:
        return ""
    core.eval()
    ids = tokenizer.encode(config.eval.sample_prompt) or [tokenizer.bos_id]
    with torch.random.fork_rng(devices=[ctx.device] if ctx.device.type == "cuda" else []):
        torch.manual_seed(config.train.seed)
        sample = continuation(
            core, tokenizer, ids, ctx.device, max_new_tokens=config.eval.sample_tokens,
            temperature=config.eval.sample_temperature,
        )  # fmt: skip
    core.train()
    return sample
