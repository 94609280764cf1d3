"""What a run tells its user: its opening lines, a progress bar, JSONL and TensorBoard logs,
the metrics JSON and the loss-curve PNG. Only rank 0's logger writes (`enabled=False`
elsewhere)."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from deltalab._files import write_text_atomically
from deltalab.provenance import PROVENANCE_NAME
from deltalab.train.config_io import config_changes, save_run_config

if TYPE_CHECKING:
    from deltalab.train.loop import TrainState

__all__ = [
    "RunLogger",
    "announce",
    "plot_loss_curve",
    "truncate_log",
    "unrecorded_files",
    "write_metrics",
]


class _Progress:
    def __init__(self, bar) -> None:
        self.bar = bar

    def update(self, record: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.set_postfix(
                loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}", refresh=False
            )
            self.bar.update(1)


class RunLogger:
    """Rank 0's voice: stdout, `log.jsonl`, TensorBoard (`tb/`) when log.tensorboard asks for it."""

    def __init__(
        self, out_dir: Path, config, *, enabled: bool, resume_step: int | None = None
    ) -> None:
        self.enabled = enabled
        self.show_progress = enabled and config.log.progress
        self.jsonl = None
        self.writer = None
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        # A resumed run continues its log from the checkpoint's step; a new run starts one.
        path = out_dir / "log.jsonl"
        if resume_step is not None:
            truncate_log(path, resume_step)
        self.jsonl = path.open("a" if resume_step is not None else "w")
        if config.log.tensorboard:
            # Installed: the config refuses log.tensorboard=true otherwise.
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(out_dir / "tb"))

    def print(self, line: str) -> None:
        if self.enabled:
            print(line, flush=True)

    def _write(self, record: dict[str, Any]) -> None:
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()

    def train_step(self, record: dict[str, Any]) -> None:
        self._write({"kind": "train", **record})
        if self.writer is not None:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
                self.writer.add_scalar(f"train/{key}", record[key], record["step"])

    def eval_step(self, step: int, loss: float) -> None:
        self._write({"kind": "eval", "step": step, "loss": loss, "perplexity": math.exp(loss)})
        self.print(f"step {step}: held-out perplexity {math.exp(loss):.3f}")
        if self.writer is not None:
            self.writer.add_scalar("eval/loss", loss, step)

    @contextlib.contextmanager
    def progress(self, start: int, total: int) -> Iterator[_Progress]:
        bar = None
        if self.show_progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)
        try:
            yield _Progress(bar)
        finally:
            if bar is not None:
                bar.close()

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.writer is not None:
            self.writer.close()


def unrecorded_files(out_dir: Path) -> list[Path]:
    """While `log.jsonl` holds no record (no step done), the files a run has written: its config,
    provenance, the empty log and TensorBoard's empty event files, none worth keeping from a run
    that fails there (deltalab/train/lock.py removes them with the directory it created); none
    once a step is logged."""
    log = out_dir / "log.jsonl"
    if log.is_file() and log.stat().st_size > 0:
        return []
    return [out_dir / name for name in ("config.yaml", PROVENANCE_NAME, "log.jsonl", "tb")]


def truncate_log(path: Path, step: int) -> None:
    """Keep the records of `log.jsonl` up to `step`, atomically.

    A run resumed from the checkpoint of `step` logs the steps after it again; without this,
    the steps between that checkpoint and the crash would appear twice. A torn last line (a
    crash mid-write) is dropped too.
    """
    if not path.exists():
        return
    kept = []
    with path.open(encoding="utf-8", errors="replace") as lines:
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if (
                isinstance(record, dict)
                and isinstance(record.get("step"), int)
                and record["step"] <= step
            ):
                kept.append(line if line.endswith("\n") else line + "\n")
    write_text_atomically(path, "".join(kept))


def plot_loss_curve(history: dict[str, list[dict[str, Any]]], path: Path) -> Path:
    """Training loss per step and held-out loss at its evaluations, to a PNG (atomic write)."""
    from deltalab.analysis._plot import new_figure, save_figure

    fig = new_figure()
    ax = fig.add_subplot(1, 1, 1)
    train = history.get("train", [])
    if train:
        ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train", lw=1)
    held = history.get("eval", [])
    if held:
        ax.plot([r["step"] for r in held], [r["loss"] for r in held], "o-", label="held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.legend()
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def announce(state: TrainState) -> None:
    """Rank 0's opening lines: the saved config, the model and data, the optimizer, and what
    of the config will not do what it says (too few held-out windows, warmup past the end)."""
    config, ctx, out_dir, logger = state.config, state.ctx, state.out_dir, state.logger
    held_out_windows = len(state.held_out)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_run_config(config, out_dir / "config.yaml")
    changes = config_changes(config)
    logger.print(
        f"run config saved to {out_dir / 'config.yaml'}; "
        + ("its fields are the defaults" if not changes else "apart from the defaults:")
    )
    for change in changes:
        logger.print(f"  {change}")
    logger.print(
        f"model: {config.model.preset} {config.model.mixer}, "
        f"{sum(p.numel() for p in state.core.parameters()) / 1e6:.2f}M parameters; "
        f"{len(state.train_data)} train / {held_out_windows} held-out windows of "
        f"{config.train.seq_len} tokens; {ctx.world_size} process(es) on {ctx.device}"
    )
    if state.eval_windows < config.eval.batches * state.micro * state.split.data.world_size:
        logger.print(
            f"eval.batches={config.eval.batches} asks for more windows than the "
            f"{held_out_windows} held-out ones; each evaluation uses all {state.eval_windows}"
        )
    logger.print(
        f"optimizer: peak optim.lr={config.optim.lr:g} after "
        f"schedule.warmup_steps={config.schedule.warmup_steps} ({config.schedule.kind})"
    )
    if config.schedule.warmup_steps >= config.train.steps:
        logger.print(
            f"note: schedule.warmup_steps={config.schedule.warmup_steps} >= train.steps="
            f"{config.train.steps}: the learning rate never reaches its peak; set "
            "schedule.warmup_steps lower for a short run"
        )
    if config.train.cuda_graphs is None and state.graph is not None:
        logger.print(
            "CUDA graphs: each step after the first two replays one recording of its passes "
            "(train.cuda_graphs=null, the default; false trains eagerly)"
        )
    if config.train.cuda_graphs and ctx.device.type != "cuda":
        logger.print(
            f"note: train.cuda_graphs=true on {ctx.device.type}: there are no CUDA graphs, the "
            "step's passes run eagerly"
        )
    if config.train.recompute_ffn and config.train.activation_checkpointing:
        logger.print(
            "note: train.recompute_ffn=true does nothing with train.activation_checkpointing="
            "true, which recomputes each whole block"
        )


def write_metrics(
    state: TrainState, eval_losses: tuple[float, float], sample: str, status: dict[str, Any]
) -> None:
    """Rank 0's `metrics.json` and `loss_curve.png` in the run directory.

    eval_losses: the held-out loss before and after training. `status` leads the metrics:
    "completed", or "interrupted" with the steps done of those planned, so an interrupted run's
    outputs are never mistaken for a finished one's.
    """
    out_dir, history = state.out_dir, state.history
    initial_eval, final_eval = eval_losses
    speeds = [r["tokens_per_s"] for r in history["train"]]
    metrics = {
        **status,
        "steps": len(history["train"]),
        "initial_eval_loss": initial_eval,
        "final_eval_loss": final_eval,
        "initial_perplexity": math.exp(initial_eval),
        "final_perplexity": math.exp(final_eval),
        "median_tokens_per_s": sorted(speeds)[len(speeds) // 2] if speeds else None,
        "parameters": sum(p.numel() for p in state.core.parameters()),
        "peak_memory_bytes": torch.cuda.max_memory_allocated()
        if torch.cuda.is_available()
        else None,
        # What the allocator held at most, its cached blocks and a CUDA graph's pool included:
        # a replay allocates nothing, so only this counts the memory a graph keeps between
        # steps beside the tensors live at the capture's peak.
        "peak_reserved_bytes": torch.cuda.max_memory_reserved()
        if torch.cuda.is_available()
        else None,
        "sample": sample,
        "config": state.config.to_dict(),
        "history": history,
        "provenance": state.provenance,
    }
    write_text_atomically(out_dir / "metrics.json", json.dumps(metrics, indent=2))
    plot_loss_curve(history, out_dir / "loss_curve.png")
