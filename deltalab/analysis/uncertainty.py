"""What a KDN layer is uncertain about, token by token: the trace and its plot.

    trace = uncertainty_trace(layer, x)          # x [B, T, D], layer an Isotropic/Diagonal/ExactKDN
    plot_uncertainty(trace, "uncertainty.png")   # per head for all variants, per channel too

The trace is read from the layer's gates (`return_gates=True`, see `deltalab.layers.kdn.KDNState`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import torch

from deltalab.analysis._plot import new_figure, save_figure
from deltalab.layers.kdn import KalmanMixer, KDNState

__all__ = ["UncertaintyTrace", "plot_uncertainty", "uncertainty_trace"]

# Floor of the heatmap's log10 scale: a variance that underflowed to 0 (certainty) stays drawable.
LOG_FLOOR = 1e-30


@dataclass(frozen=True)
class UncertaintyTrace:
    """One call of a KDN layer, token by token; float64 arrays, batch first.

    variant: the layer's class name ("IsotropicKDN", "DiagonalKDN", "ExactKDN").
    p: posterior variance p_t `[B, T, H]` (Isotropic) or `[B, T, H, K]` (Diagonal; Exact: the
        diagonal of P_t).
    predictive: `k_t^T P_bar_t k_t` `[B, T, H]`, the predicted variance of the observation
        before token t's update (observation noise excluded).
    r: observation noise `[B, T, H]`. q_noise: process noise `[B, T, H]` or `[B, T, H, K]`.
    gain: the write strength beta `[B, T, H]` (Isotropic) or the gain `[B, T, H, K]`.
    g: log decay `[B, T, H, K]`.
    """

    variant: str
    p: np.ndarray
    predictive: np.ndarray
    r: np.ndarray
    q_noise: np.ndarray
    gain: np.ndarray
    g: np.ndarray

    @property
    def per_channel(self) -> bool:
        """True when p has a key-channel axis (Diagonal, Exact)."""
        return self.p.ndim == 4

    def head_variance(self) -> np.ndarray:
        """p per head `[B, T, H]`: p itself, or its mean over the key channels."""
        return self.p.mean(axis=-1) if self.per_channel else self.p


def _numpy(x: torch.Tensor) -> np.ndarray:
    return x.detach().to(device="cpu", dtype=torch.float64).numpy()


@torch.no_grad()
def uncertainty_trace(
    layer: KalmanMixer, x: torch.Tensor, state: KDNState | None = None
) -> UncertaintyTrace:
    """Runs `layer` on x `[B, T, D]` (continuing `state` when given) and returns its trace."""
    if not isinstance(layer, KalmanMixer):
        raise TypeError(f"layer must be a KDN mixer, got {type(layer).__name__}")
    _, new_state = layer(x, state, return_gates=True)
    # return_gates=True always fills the gates.
    gates = cast(dict[str, torch.Tensor], new_state.gates)
    gain = gates["beta"] if "beta" in gates else gates["gain"]
    return UncertaintyTrace(
        variant=type(layer).__name__,
        p=_numpy(gates["p"]),
        predictive=_numpy(gates["predictive"]),
        r=_numpy(gates["r"]),
        q_noise=_numpy(gates["q_noise"]),
        gain=_numpy(gain),
        g=_numpy(gates["g"]),
    )


def _per_head(ax, values: np.ndarray, ylabel: str) -> None:
    """values `[T, H]`, one line per head, log scale."""
    tokens = np.arange(values.shape[0])
    for head in range(values.shape[1]):
        ax.plot(tokens, values[:, head], label=f"head {head}", linewidth=1.0)
    ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="major", alpha=0.3)


def plot_uncertainty(
    trace: UncertaintyTrace,
    path: str | os.PathLike[str],
    *,
    sequence: int = 0,
    title: str | None = None,
    dpi: int = 120,
) -> Path:
    """Draws one sequence of `trace` to `path` (PNG unless its suffix says otherwise), written
    atomically by `save_figure`; returns the path.

    Panels: the predictive variance `k^T P_bar k` per head; the posterior variance per head (its
    mean over channels for Diagonal/Exact); for Diagonal/Exact, a heatmap of log10 p over
    (head, channel) x token.
    """
    if not isinstance(trace, UncertaintyTrace):
        raise TypeError(f"trace must be an UncertaintyTrace, got {type(trace).__name__}")
    batch = trace.p.shape[0]
    if isinstance(sequence, bool) or not isinstance(sequence, int) or not 0 <= sequence < batch:
        raise ValueError(f"sequence must be an int in [0, {batch}), got {sequence!r}")
    rows = 3 if trace.per_channel else 2
    fig = new_figure(figsize=(9, 2.6 * rows))
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    _per_head(axes[0], trace.predictive[sequence], "k^T P_bar k")
    axes[0].legend(loc="upper right", fontsize="small", ncols=min(4, trace.p.shape[2]))
    label = "mean_i p_i" if trace.per_channel else "p"
    _per_head(axes[1], trace.head_variance()[sequence], f"posterior {label}")
    if trace.per_channel:
        _, length, heads, channels = trace.p.shape
        grid = trace.p[sequence].reshape(length, heads * channels).T
        image = axes[2].imshow(
            np.log10(np.maximum(grid, LOG_FLOOR)),
            aspect="auto",
            interpolation="nearest",
            extent=(-0.5, length - 0.5, heads * channels - 0.5, -0.5),
        )
        for head in range(1, heads):
            axes[2].axhline(head * channels - 0.5, color="white", linewidth=0.8)
        axes[2].set_ylabel("head x channel")
        fig.colorbar(image, ax=axes[2], label="log10 p")
    axes[-1].set_xlabel("token")
    fig.suptitle(title or f"{trace.variant}: uncertainty over the sequence (sequence {sequence})")
    return save_figure(fig, path, dpi=dpi)
