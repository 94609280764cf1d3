"""The training loop behind `deltalab train`.

One function, `train(config)`: data -> model -> AdamW steps with accumulation, clipping and the
schedule -> held-out evaluation -> atomic checkpoints (every N steps, on SIGINT/SIGTERM, at the
end) -> a Hugging Face export, a metrics JSON, a loss-curve PNG and a generated sample. Under
`torchrun` the same function trains with DDP or FSDP2; only rank 0 writes.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from deltalab.data import (
    CorpusConfig,
    PackedSequences,
    ResumableSampler,
    batches,
    load_tokenizer,
    prepare_tokens,
    save_tokenizer,
)
from deltalab.models import CausalLM, build_config
from deltalab.train.checkpoint import (
    GracefulStop,
    capture_rng_state,
    list_checkpoints,
    load_latest_checkpoint,
    prune_checkpoints,
    restore_rng_state,
    save_checkpoint,
)
from deltalab.train.config import RunConfig, save_run_config
from deltalab.train.distributed import Distributed, all_reduce_mean, setup_distributed, wrap_model
from deltalab.train.optim import build_optimizer, build_scheduler, no_decay_names
from deltalab.train.report import RunLogger, plot_loss_curve

__all__ = ["TrainResult", "train"]

FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)


@dataclass
class TrainResult:
    """What a run produced. Perplexities are exp(held-out loss per token)."""

    out_dir: Path
    steps: int
    initial_perplexity: float
    final_perplexity: float
    losses: list[float] = field(default_factory=list)
    sample: str = ""
    interrupted: bool = False


def _sequences(config: RunConfig, tokenizer, split: str, ctx: Distributed) -> PackedSequences:
    source = config.data.source
    # One cache entry per source, however its path is spelled (`data`, `./data/`, absolute).
    source = source if source == "stdlib" else str(Path(source).resolve())
    corpus = CorpusConfig(
        source=source,
        split=split,
        held_out_fraction=config.data.held_out_fraction,
        max_bytes=config.data.max_bytes,
        text_field=config.data.text_field,
    )
    # Rank 0 tokenizes; the others then find the finished cache entry. Rank 0's failure is
    # shared (instead of a barrier the others would wait at forever) so every rank stops.
    failure = None
    if ctx.is_main:
        try:
            tokens = prepare_tokens(corpus, tokenizer, config.data.cache_dir)
        except Exception as error:
            failure = error
    if ctx.active:
        failed = torch.tensor(float(failure is not None), device=ctx.device)
        dist.all_reduce(failed)
        if failed.item() and failure is None:
            raise RuntimeError("rank 0 could not prepare the training data; see its error")
    if failure is not None:
        raise failure
    if not ctx.is_main:
        tokens = prepare_tokens(corpus, tokenizer, config.data.cache_dir)
    return PackedSequences(tokens, config.train.seq_len)


def _check_outside_source(config: RunConfig) -> None:
    """The run's own files must not become training data on the next run."""
    if config.data.source == "stdlib":
        return
    source = Path(config.data.source).resolve()
    for name, value in (
        ("log.out_dir", config.log.out_dir),
        ("data.cache_dir", config.data.cache_dir),
    ):
        inside = Path(value).resolve()
        if inside == source or source in inside.parents:
            raise ValueError(
                f"{name} {value!r} lies inside data.source {config.data.source!r}: the run's "
                "files would be read as documents; put them elsewhere"
            )


def _micro_batch(config: RunConfig, ctx: Distributed) -> int:
    per_step = config.train.batch_size
    parts = ctx.world_size * config.train.grad_accum
    if per_step % parts:
        raise ValueError(
            f"train.batch_size = {per_step} must divide evenly over {ctx.world_size} rank(s) x "
            f"train.grad_accum = {config.train.grad_accum}"
        )
    return per_step // parts


def _autocast(config: RunConfig, ctx: Distributed):
    precision = config.train.precision
    if precision == "bf16" or (precision == "auto" and ctx.device.type == "cuda"):
        return torch.autocast(ctx.device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _loss(model, window: torch.Tensor, autocast) -> torch.Tensor:
    """Mean next-token cross-entropy of windows `[B, T + 1]`."""
    with autocast:
        logits = model(input_ids=window[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), window[:, 1:].flatten())


@torch.no_grad()
def evaluate(model, held_out: PackedSequences, count: int, micro: int, ctx, autocast) -> float:
    """Mean held-out loss over the first `count` windows (dealt evenly over ranks), in order."""
    was_training = model.training
    model.eval()
    used = min(count, len(held_out)) // ctx.world_size * ctx.world_size
    if used == 0:
        raise ValueError(
            f"the held-out split has {len(held_out)} windows, fewer than the {ctx.world_size} "
            "ranks; raise data.held_out_fraction or lower train.seq_len"
        )
    indices = list(range(used))[ctx.rank :: ctx.world_size]
    total = torch.zeros((), dtype=torch.float64, device=ctx.device)
    for start in range(0, len(indices), micro):
        window = torch.stack([held_out[i] for i in indices[start : start + micro]]).to(ctx.device)
        total += _loss(model, window, autocast).double() * window.shape[0]
    total = all_reduce_mean(total, ctx) * ctx.world_size
    model.train(was_training)
    return (total / used).item()


def _stop_everywhere(stop, ctx: Distributed) -> bool:
    """Whether any rank was signalled: ranks must checkpoint and leave at the same step."""
    flag = torch.tensor(float(stop.stop_requested), device=ctx.device)
    return bool(all_reduce_mean(flag, ctx).item() > 0)


def _payload(step, core, optimizer, scheduler, sampler, config, history) -> dict[str, Any]:
    return {
        "step": step,
        "model": get_model_state_dict(core, options=FULL_STATE),
        "optimizer": get_optimizer_state_dict(core, optimizer, options=FULL_STATE),
        "scheduler": scheduler.state_dict(),
        "sampler": sampler.state_dict(),
        "rng": capture_rng_state(),
        "config": config.to_dict(),
        "history": history,
    }


def _checkpoint(out_dir, step, core, optimizer, scheduler, sampler, config, history, ctx) -> None:
    payload = _payload(step, core, optimizer, scheduler, sampler, config, history)
    if ctx.is_main:
        save_checkpoint(out_dir, step, payload)
        prune_checkpoints(out_dir, config.checkpoint.keep)
    if ctx.active:
        dist.barrier()


# Fields a resumed run may change: they do not change what is computed.
RESUMABLE_CHANGES = {
    "checkpoint.resume",
    "checkpoint.every",
    "checkpoint.keep",
    "train.device",
    "train.compile",
    "train.activation_checkpointing",
    "train.nan_policy",
    "eval.every",
    "eval.sample_tokens",
    "eval.sample_prompt",
    "log.progress",
    "log.tensorboard",
    "log.out_dir",
    "data.cache_dir",
}


def _changed_fields(saved: dict, current: dict) -> list[str]:
    changed = []
    for section, fields in current.items():
        for name, value in fields.items():
            key = f"{section}.{name}"
            if key not in RESUMABLE_CHANGES and saved.get(section, {}).get(name) != value:
                changed.append(f"{key}: {saved.get(section, {}).get(name)!r} -> {value!r}")
    return changed


def _check_fresh_start(out_dir: Path, config: RunConfig) -> None:
    """A new run must not share a directory with another run's checkpoints: the older ones
    would be pruned in its place and picked up by a later resume."""
    if not config.checkpoint.resume and list_checkpoints(out_dir):
        raise ValueError(
            f"log.out_dir {str(out_dir)!r} already holds checkpoints of a run; continue it with "
            "--resume (checkpoint.resume=true) or choose another log.out_dir"
        )


def _resume(out_dir, core, optimizer, scheduler, sampler, config) -> tuple[int, dict]:
    found = load_latest_checkpoint(out_dir)
    if found is None:
        return 0, {"train": [], "eval": []}
    path, payload = found
    changed = _changed_fields(payload["config"], config.to_dict())
    if changed:
        raise ValueError(
            f"cannot resume {path}: the run config changed ({'; '.join(changed)}); restore "
            "those fields or start a new run in another log.out_dir"
        )
    set_model_state_dict(core, payload["model"], options=FULL_STATE)
    set_optimizer_state_dict(core, optimizer, payload["optimizer"], options=FULL_STATE)
    scheduler.load_state_dict(payload["scheduler"])
    sampler.load_state_dict(payload["sampler"])
    restore_rng_state(payload["rng"])
    return int(payload["step"]), payload["history"]


def _grad_norm(core, max_norm: float) -> float:
    """The global gradient norm, clipped to `max_norm` (0: measured, not clipped)."""
    norm = torch.nn.utils.clip_grad_norm_(core.parameters(), max_norm or math.inf)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def _due(step: int, every: int) -> bool:
    """Every `every` steps; 0 means at the last step only (handled by the caller)."""
    return every > 0 and step % every == 0


def train(config: RunConfig) -> TrainResult:
    """Trains the configured model; returns its perplexities, losses and sample."""
    ctx = setup_distributed(config.train.device)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    out_dir = Path(config.log.out_dir)
    _check_fresh_start(out_dir, config)
    _check_outside_source(config)
    torch.manual_seed(config.train.seed)
    tokenizer = load_tokenizer(config.data.tokenizer)
    train_data = _sequences(config, tokenizer, "train", ctx)
    held_out = _sequences(config, tokenizer, "held_out", ctx)
    micro = _micro_batch(config, ctx)

    model_config = build_config(
        config.model.preset,
        mixer=config.model.mixer,
        **{"vocab_size": tokenizer.vocab_size, **config.model.overrides},
    )
    for name in ("bos", "eos", "pad"):
        setattr(model_config, f"{name}_token_id", getattr(tokenizer, f"{name}_id"))
    core = CausalLM(model_config).to(ctx.device)
    core.model.checkpoint_blocks = config.train.activation_checkpointing
    exempt = no_decay_names(core)
    model = wrap_model(core, ctx, config.train.parallel)
    forward = torch.compile(model) if config.train.compile else model
    optimizer = build_optimizer(core, config.optim, exempt)
    scheduler = build_scheduler(optimizer, config.schedule, config.train.steps)
    sampler = ResumableSampler(
        len(train_data), seed=config.train.seed, rank=ctx.rank, world_size=ctx.world_size
    )
    start, history = 0, {"train": [], "eval": []}
    if config.checkpoint.resume:
        start, history = _resume(out_dir, core, optimizer, scheduler, sampler, config)

    autocast = _autocast(config, ctx)
    eval_windows = config.eval.batches * micro * ctx.world_size
    logger = RunLogger(out_dir, config, enabled=ctx.is_main, append=start > 0)
    if ctx.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_run_config(config, out_dir / "config.yaml")
        logger.print(f"run config saved to {out_dir / 'config.yaml'}")
        logger.print(
            f"model: {config.model.preset} {config.model.mixer}, "
            f"{sum(p.numel() for p in core.parameters()) / 1e6:.2f}M parameters; "
            f"{len(train_data)} train / {len(held_out)} held-out windows of {config.train.seq_len}"
            f" tokens; {ctx.world_size} process(es) on {ctx.device}"
        )
    first_eval = evaluate(core, held_out, eval_windows, micro, ctx, autocast)
    if start == 0:
        history["eval"].append({"step": 0, "loss": first_eval})
    logger.print(f"held-out perplexity at step {start}: {math.exp(first_eval):.3f}")

    stream = batches(train_data, sampler, micro)
    tokens_per_step = config.train.batch_size * config.train.seq_len
    interrupted = False
    model.train()
    with GracefulStop() as stop, logger.progress(start, config.train.steps) as progress:
        for step in range(start, config.train.steps):
            began = time.perf_counter()
            total = torch.zeros((), device=ctx.device)
            for micro_step in range(config.train.grad_accum):
                window = next(stream).to(ctx.device)
                last = micro_step == config.train.grad_accum - 1
                sync = (
                    model.no_sync()
                    if (ctx.active and not last and config.train.parallel == "ddp")
                    else contextlib.nullcontext()
                )
                with sync:
                    loss = _loss(forward, window, autocast) / config.train.grad_accum
                    loss.backward()
                total += loss.detach()
            loss_value = all_reduce_mean(total, ctx).item()
            grad_norm = _grad_norm(core, config.optim.grad_clip)
            lr = scheduler.get_last_lr()[0]
            done = step + 1
            finite = math.isfinite(loss_value) and math.isfinite(grad_norm)
            if not finite and config.train.nan_policy == "stop":
                raise FloatingPointError(
                    f"loss {loss_value} / gradient norm {grad_norm} at step {done} is not "
                    "finite; stopping (train.nan_policy=stop). The last checkpoint in "
                    f"{out_dir / 'checkpoints'} is intact; lower optim.lr or set "
                    "train.nan_policy=skip to skip such steps"
                )
            if finite:
                optimizer.step()
            else:
                # Skipped: no update, but the step counts (schedule, data, checkpoints below).
                logger.print(f"step {done}: non-finite loss or gradient, step skipped")
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            if finite:
                record = {
                    "step": done,
                    "loss": loss_value,
                    "lr": lr,
                    "grad_norm": grad_norm,
                    "tokens_per_s": tokens_per_step / (time.perf_counter() - began),
                }
                history["train"].append(record)
                logger.train_step(record)
                progress.update(record)
            if _due(done, config.eval.every) and done < config.train.steps:
                value = evaluate(core, held_out, eval_windows, micro, ctx, autocast)
                history["eval"].append({"step": done, "loss": value})
                logger.eval_step(done, value)
            checkpoint_due = _due(done, config.checkpoint.every) or done == config.train.steps
            stopping = _stop_everywhere(stop, ctx)
            if checkpoint_due or stopping:
                _checkpoint(
                    out_dir, done, core, optimizer, scheduler, sampler, config, history, ctx
                )
            if stopping:
                interrupted = True
                logger.print(
                    f"stopped by signal after step {done}; resume with checkpoint.resume=true"
                )
                break

    final_eval = evaluate(core, held_out, eval_windows, micro, ctx, autocast)
    if not interrupted and (
        not history["eval"] or history["eval"][-1]["step"] != config.train.steps
    ):
        history["eval"].append({"step": config.train.steps, "loss": final_eval})
    logger.print(f"held-out perplexity at the end: {math.exp(final_eval):.3f}")
    sample = _sample(core, tokenizer, config, ctx)
    # Gathering the full weights is a collective under FSDP: every rank takes part.
    weights = get_model_state_dict(core, options=FULL_STATE)
    if ctx.is_main:
        logger.print(f"sample:\n{config.eval.sample_prompt}{sample}")
        _export(core, weights, tokenizer, out_dir, config, history, first_eval, final_eval, sample)
    logger.close()
    if ctx.active:
        dist.barrier()
    return TrainResult(
        out_dir=out_dir,
        steps=len(history["train"]),
        initial_perplexity=math.exp(history["eval"][0]["loss"])
        if history["eval"]
        else math.exp(first_eval),
        final_perplexity=math.exp(final_eval),
        losses=[r["loss"] for r in history["train"]],
        sample=sample,
        interrupted=interrupted,
    )


@torch.no_grad()
def _sample(core: CausalLM, tokenizer, config: RunConfig, ctx: Distributed) -> str:
    """A continuation of `eval.sample_prompt`: sampled at `eval.sample_temperature` from a
    generator seeded by `train.seed` (the same tokens on every rank, which all take part under
    FSDP), or greedy at temperature 0."""
    if config.eval.sample_tokens == 0:
        return ""
    core.eval()
    ids = tokenizer.encode(config.eval.sample_prompt) or [tokenizer.bos_id]
    prompt = torch.tensor([ids], device=ctx.device)
    temperature = config.eval.sample_temperature
    with torch.random.fork_rng(devices=[ctx.device] if ctx.device.type == "cuda" else []):
        torch.manual_seed(config.train.seed)
        out = core.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=config.eval.sample_tokens,
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None,
            top_k=None,
            eos_token_id=None,
            pad_token_id=tokenizer.pad_id,
        )
    core.train()
    return tokenizer.decode(out[0, prompt.shape[1] :].tolist())


def _export(
    core, weights, tokenizer, out_dir: Path, config, history, first_eval, final_eval, sample
) -> None:
    """Rank 0's outputs: HF model (from the gathered `weights`), metrics JSON, loss curve."""
    model_dir = out_dir / "model"
    core.save_pretrained(model_dir, state_dict=weights)
    save_tokenizer(tokenizer, model_dir)
    speeds = [r["tokens_per_s"] for r in history["train"]]
    metrics = {
        "steps": len(history["train"]),
        "initial_eval_loss": history["eval"][0]["loss"] if history["eval"] else first_eval,
        "final_eval_loss": final_eval,
        "initial_perplexity": math.exp(history["eval"][0]["loss"])
        if history["eval"]
        else math.exp(first_eval),
        "final_perplexity": math.exp(final_eval),
        "median_tokens_per_s": sorted(speeds)[len(speeds) // 2] if speeds else None,
        "parameters": sum(p.numel() for p in core.parameters()),
        "peak_memory_bytes": torch.cuda.max_memory_allocated()
        if torch.cuda.is_available()
        else None,
        "sample": sample,
        "config": config.to_dict(),
        "history": history,
        "versions": {"torch": torch.__version__},
    }
    path = out_dir / "metrics.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(metrics, indent=2))
    os.replace(tmp, path)
    plot_loss_curve(history, out_dir / "loss_curve.png")
