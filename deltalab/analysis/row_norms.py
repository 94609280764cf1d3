"""State row norms against decay (docs/MATH.md sec. 4.5): why Muir reads through a matched filter.

Row i (key channel i) of a memory `S [K, V]` decays by alpha_i = exp(g_i) per token and gains a
write each token, so its norm grows like 1 / sqrt(1 - alpha_i^2): slowly decaying rows grow
largest and dominate an unweighted read `S^T q`. `row_norms` measures, for one layer after one
sequence, each row's norm against its channel's mean decay, with their rank correlation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from deltalab.analysis._plot import new_figure, save_figure
from deltalab.layers.delta_mixer import DeltaMixer
from deltalab.layers.states import RecurrentState

__all__ = ["RowNormReport", "plot_row_norms", "row_norms", "spearman"]


@dataclass(frozen=True)
class RowNormReport:
    """row_norm `[H, K]`: ||S[b, h, k, :]|| after the sequence, averaged over the batch.
    mean_decay `[H, K]`: exp(g) averaged over batch and tokens (a per-head decay is broadcast
    over K). correlation: Spearman rank correlation of the two over all H*K channels."""

    row_norm: torch.Tensor
    mean_decay: torch.Tensor
    correlation: float


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Ranks 0..n-1 of a 1-D tensor, ties given their average rank."""
    order = torch.argsort(x, stable=True)
    ranks = torch.empty_like(x, dtype=torch.float64)
    ranks[order] = torch.arange(x.numel(), dtype=torch.float64)
    _, groups = torch.unique(x, return_inverse=True)
    sums = torch.zeros(int(groups.max()) + 1, dtype=torch.float64).index_add_(0, groups, ranks)
    counts = torch.bincount(groups).to(torch.float64)
    return (sums / counts)[groups]


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    """Spearman rank correlation of two tensors of n values (flattened); NaN when either is
    constant, which has no ranking."""
    if x.numel() != y.numel() or x.numel() < 2:
        raise ValueError(f"need two tensors of n >= 2 values, got {x.numel()} and {y.numel()}")
    rx, ry = _ranks(x.detach().flatten().cpu()), _ranks(y.detach().flatten().cpu())
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denominator = (rx.norm() * ry.norm()).item()
    return float("nan") if denominator == 0 else (rx @ ry).item() / denominator


@torch.no_grad()
def row_norms(
    layer: DeltaMixer, x: torch.Tensor, state: RecurrentState | None = None
) -> RowNormReport:
    """Runs `layer` on x `[B, T, D]` (continuing `state` if given) and reports its memory's row
    norms against the channels' mean decays. The layer must have a log-decay gate "g"."""
    _, new_state = layer(x, state, return_gates=True)
    gates = new_state.gates or {}
    if "g" not in gates:
        raise ValueError(f"{type(layer).__name__} has no decay gate 'g'; gates: {list(gates)}")
    memory = new_state.memory  # [B, H, K, V]
    decay = gates["g"].to(memory.dtype).exp()  # [B, T, H] or [B, T, H, K]
    if decay.dim() == 3:
        decay = decay.unsqueeze(-1).expand(*decay.shape, memory.shape[2])
    row_norm = memory.norm(dim=-1).mean(dim=0)
    mean_decay = decay.mean(dim=(0, 1))
    return RowNormReport(row_norm, mean_decay, spearman(mean_decay, row_norm))


def plot_row_norms(report: RowNormReport, path: str | os.PathLike[str]) -> Path:
    """Scatter of row norm (log scale) against mean decay, one colour per head, as a PNG."""
    figure = new_figure(figsize=(6.0, 4.5))
    ax = figure.subplots()
    for head, (decay, norm) in enumerate(
        zip(report.mean_decay.cpu(), report.row_norm.cpu(), strict=True)
    ):
        ax.scatter(decay.numpy(), norm.numpy(), s=14, alpha=0.8, label=f"head {head}")
    ax.set_yscale("log")
    ax.set_xlabel("mean decay exp(g) of the channel")
    ax.set_ylabel("state row norm ||S[k, :]||")
    ax.set_title(f"State row norms vs decay (Spearman {report.correlation:.2f})")
    if report.row_norm.shape[0] <= 16:
        ax.legend(fontsize="small")
    return save_figure(figure, path)
