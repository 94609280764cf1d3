"""What a run tells its user: printed lines, a progress bar, JSONL and TensorBoard logs, and the
loss-curve PNG. Only rank 0's logger writes (`enabled=False` elsewhere)."""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["RunLogger", "plot_loss_curve", "truncate_log"]


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
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text("".join(kept), encoding="utf-8")
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


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
