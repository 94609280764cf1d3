"""What a run tells its user: printed lines, a progress bar, JSONL and TensorBoard logs, and the
loss-curve PNG. Only rank 0's logger writes (`enabled=False` elsewhere)."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["RunLogger", "plot_loss_curve"]


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
    """Rank 0's voice: stdout, `log.jsonl`, TensorBoard (`tb/`) when installed and enabled."""

    def __init__(self, out_dir: Path, config, *, enabled: bool, append: bool = False) -> None:
        self.enabled = enabled
        self.show_progress = enabled and config.log.progress
        self.jsonl = None
        self.writer = None
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        # A resumed run continues its log; a new run starts one.
        self.jsonl = (out_dir / "log.jsonl").open("a" if append else "w")
        if config.log.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                self.print(
                    "log.tensorboard is on but tensorboard is not installed "
                    "(pip install tensorboard); logging to log.jsonl only"
                )
            else:
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
