"""AdamW with the usual no-decay groups, and the learning-rate schedules of the run config."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

__all__ = [
    "build_optimizer",
    "build_scheduler",
    "fused_adamw_applies",
    "lr_multiplier",
    "no_decay_names",
    "parameter_groups",
    "with_step_implementation",
]


def no_decay_names(model: nn.Module) -> set[str]:
    """Names of the parameters trained without weight decay: every parameter of rank < 2
    (norms, biases) and those the layers mark with `_no_weight_decay` (decay rates, gate
    biases, read-gate vectors). Taken before sharding: FSDP2 replaces the parameter objects and
    their marks with them, but keeps the names."""
    return {
        name
        for name, param in model.named_parameters()
        if param.dim() < 2 or getattr(param, "_no_weight_decay", False)
    }


def parameter_groups(
    model: nn.Module, weight_decay: float, exempt: set[str] | None = None
) -> list[dict]:
    """Two AdamW groups: decayed matrices, and `exempt` (default `no_decay_names(model)`)."""
    exempt = no_decay_names(model) if exempt is None else exempt
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if name in exempt else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def fused_adamw_applies(params: list[torch.Tensor]) -> bool:
    """Whether AdamW takes its fused kernel: every parameter a plain CUDA tensor (not a DTensor
    of FSDP2, which keeps the default multi-tensor step). The fused step reads and writes each
    parameter, gradient and moment once per step; the default runs a chain of multi-tensor
    kernels over them. CPU training keeps the default, so its results do not move."""
    if not params or not all(p.device.type == "cuda" for p in params):
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a build without torch.distributed
        return True
    return not any(isinstance(p, DTensor) for p in params)


def with_step_implementation(saved: dict, optimizer: torch.optim.Optimizer) -> dict:
    """`saved` (an optimizer state dict, as a checkpoint holds it) with the step implementation
    of `optimizer` (`fused`, `foreach`) in its groups: loading a state restores its groups'
    settings, and a checkpoint written on another machine or before AdamW was fused here would
    otherwise bring its own. (Loading also places the step counts where that implementation
    keeps them: on the parameters' device for the fused step.)"""
    groups = [
        {**group, **{k: built[k] for k in ("fused", "foreach") if k in built}}
        for group, built in zip(saved["param_groups"], optimizer.param_groups, strict=True)
    ]
    return {**saved, "param_groups": groups}


def build_optimizer(
    model: nn.Module, optim, exempt: set[str] | None = None, fused: bool | None = None
) -> torch.optim.AdamW:
    """AdamW over `parameter_groups`; `optim` is the run config's OptimSection. fused: whether
    AdamW takes its fused step; None (the default) where it applies (`fused_adamw_applies`: on
    CUDA, not under FSDP2)."""
    groups = parameter_groups(model, optim.weight_decay, exempt)
    if fused is None:
        fused = fused_adamw_applies([p for group in groups for p in group["params"]])
    return torch.optim.AdamW(
        groups,
        lr=optim.lr,
        betas=tuple(optim.betas),
        eps=optim.eps,
        fused=fused or None,
    )


def lr_multiplier(schedule, total_steps: int) -> Callable[[int], float]:
    """step -> factor on the peak learning rate; `schedule` is the run config's ScheduleSection.

    Linear warmup over `warmup_steps`, then "cosine" (to `min_lr_ratio` at the last step), "wsd"
    (warmup-stable-decay: flat, then linear to `min_lr_ratio` over the last `decay_fraction`
    of the steps) or "constant".
    """
    warmup, floor = schedule.warmup_steps, schedule.min_lr_ratio
    decay_steps = round(schedule.decay_fraction * total_steps)
    decay_start = max(warmup, total_steps - decay_steps)

    def factor(step: int) -> float:
        """Factor of 0-based `step`; the last step (total_steps - 1) ends a decay at `floor`."""
        if step < warmup:
            return (step + 1) / warmup
        if schedule.kind == "constant":
            return 1.0
        if schedule.kind == "cosine":
            progress = min(1.0, (step - warmup + 1) / max(1, total_steps - warmup))
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start + 1) / max(1, total_steps - decay_start))
        return 1 - (1 - floor) * progress

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, schedule, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(schedule, total_steps))
