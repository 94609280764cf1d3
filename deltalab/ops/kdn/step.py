"""One decoding step of Isotropic / Diagonal KDN: the variance recursion advanced by one token
(no scan needed), then one step of the generalized delta rule."""

from __future__ import annotations

import torch

from deltalab.ops._checks import (
    one_host_read,
    require_float,
    require_positive,
    require_shape,
    send_answers,
    state_dtype,
)
from deltalab.ops.delta_rule import delta_rule_step
from deltalab.ops.kdn._validate import (
    check_decay,
    check_info_scale,
    check_keys,
    check_noise,
    check_query_value,
    split_state,
)
from deltalab.ops.kdn.gains import diag_gain_from, diag_terms, iso_beta, iso_terms


def _step(
    diagonal: bool,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    q_noise: torch.Tensor,
    r: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor],
    scale: float | None,
    info_scale: float | None,
    backend: str,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    # One block holds the checks and the step they guard (mixers._kdn has the reasoning): the
    # answers are sent before the work and read once after it. The step writes a new state
    # (delta_rule_step is not asked to write in place), so a failed check leaves the given
    # state untouched.
    with one_host_read():
        k = check_keys(k, "B, H")
        check_query_value(q, v, k, "B, H")
        g = check_decay(g, k, "B, H")
        check_noise(q_noise, r, k, "B, H", per_channel_process=diagonal)
        if state is None:
            raise TypeError("state must be a pair (memory, precision), got None")
        memory, precision = split_state(state, "state")
        memory = require_float("state[0]", memory)
        precision = require_float("state[1]", precision)
        layout = "[B, H, K]" if diagonal else "[B, H]"
        require_shape("state[1]", precision, k.shape if diagonal else k.shape[:-1], layout)
        require_positive("state[1]", precision, "a precision 1 / p")
        s = check_info_scale(info_scale, k.shape[-1])
        send_answers()

        dtype = state_dtype(q, k, v, g, q_noise, r, memory, precision)
        k_, g_, q_noise_, r_, precision_ = (x.to(dtype) for x in (k, g, q_noise, r, precision))
        # One token of the scans' recursion: p_bar from the last posterior, then the gain and
        # the posterior precision 1/p = 1/p_bar + evidence, by the formulas of gains.py.
        # `shape_term` is diag_terms' r `[B, H, 1]`, iso_terms' ||k||^2 `[B, H]`.
        decay2, shape_term, evidence = (diag_terms if diagonal else iso_terms)(k_, g_, r_, s)
        p_bar = decay2 * (1.0 / precision_) + q_noise_
        if diagonal:
            write, _ = diag_gain_from(p_bar, k_, shape_term)
        else:
            beta, _ = iso_beta(p_bar, shape_term, r_)
            write = beta.unsqueeze(-1) * k_
        new_precision = 1.0 / p_bar + evidence
        o, new_memory = delta_rule_step(q, write, k, v, g, memory, scale=scale, backend=backend)
    return o, (new_memory, new_precision)


def kdn_iso_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    q_noise: torch.Tensor,
    r: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor],
    *,
    scale: float | None = None,
    info_scale: float | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One token of Isotropic KDN per sequence.

    Args:
        q, k: `[B, H, K]`; v: `[B, H, V]`; g: `[B, H]` or `[B, H, K]` (log decay <= 0);
        q_noise, r: `[B, H]`; state: `(memory [B, H, K, V], precision [B, H])`, e.g. the final
        state of `kdn_iso` (start from zeros and 1 / p0); scale: defaults to `K ** -0.5`;
        info_scale: defaults to K; backend: of the memory update, as `delta_rule_step`'s.

    Returns:
        `(o [B, H, V] in q's dtype, (memory [B, H, K, V], precision [B, H]))`.
    """
    return _step(False, q, k, v, g, q_noise, r, state, scale, info_scale, backend)


def kdn_diag_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    q_noise: torch.Tensor,
    r: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor],
    *,
    scale: float | None = None,
    info_scale: float | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One token of Diagonal KDN per sequence.

    Args:
        q, k, q_noise: `[B, H, K]`; v: `[B, H, V]`; g: `[B, H, K]` or `[B, H]` (log decay <= 0);
        r: `[B, H]`; state: `(memory [B, H, K, V], precision [B, H, K])`; scale: defaults to
        `K ** -0.5`; info_scale: defaults to K; backend: of the memory update, as
        `delta_rule_step`'s.

    Returns:
        `(o [B, H, V] in q's dtype, (memory [B, H, K, V], precision [B, H, K]))`.
    """
    return _step(True, q, k, v, g, q_noise, r, state, scale, info_scale, backend)
