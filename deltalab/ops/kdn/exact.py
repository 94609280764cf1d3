"""Exact KDN: the Kalman filter with a dense K x K covariance per head (docs/MATH.md sec. 2.2).

    P_bar = D P D + diag(q)           sigma2 = k^T P_bar k + r        gain = P_bar k / sigma2
    P     = (I - gain k^T) P_bar (I - gain k^T)^T + r gain gain^T       (Joseph form)

The covariance recursion never reads the memory: the gains are computed first by a token loop
(O(K^2) per token and head, sequential), then the mean runs through `delta_rule`.
"""

from __future__ import annotations

import torch

from deltalab.ops._checks import (
    one_host_read,
    require_float,
    require_rank,
    require_same_device,
    require_shape,
    state_dtype,
    values_checkable,
)
from deltalab.ops.delta_rule import delta_rule
from deltalab.ops.kdn._validate import (
    check_decay,
    check_keys,
    check_noise,
    check_query_value,
    split_state,
)
from deltalab.ops.kdn.gains import Gains
from deltalab.ops.options import KernelOptions

# P0 may differ from its transpose by this many units of roundoff (relative to its largest
# entry): enough for X @ X.T + c I built in floating point, far below any intended asymmetry.
SYMMETRY_ULPS = 1000


def _check_symmetric(name: str, P: torch.Tensor) -> None:
    tolerance = SYMMETRY_ULPS * torch.finfo(P.dtype).eps * P.abs().max().item()
    asymmetry = (P - P.mT).abs().max().item()
    if not asymmetry <= tolerance:
        raise ValueError(f"{name} must be symmetric, got max |P - P^T| = {asymmetry:.4g}")


def _check_positive_definite(name: str, P: torch.Tensor) -> None:
    if not values_checkable(P):
        return  # a CUDA graph records (train.cuda_graphs): nothing may be read back
    _check_symmetric(name, P)
    _, info = torch.linalg.cholesky_ex(P.double())
    if bool((info != 0).any()):
        raise ValueError(f"{name} must be positive definite (its Cholesky factorization failed)")


def _prior_covariance(
    P0: object, P_init: object, batch: int, heads: int, key_dim: int
) -> torch.Tensor:
    """`[B, H, K, K]`: initial_state[1] when given, else P0 (`[H, K, K]` or `[B, H, K, K]`)."""
    P0 = require_float("P0", P0)
    require_rank("P0", P0, (3, 4), "[H, K, K] or [B, H, K, K]")
    if P0.dim() == 3:
        require_shape("P0", P0, (heads, key_dim, key_dim), "[H, K, K]", "to match k")
    else:
        require_shape("P0", P0, (batch, heads, key_dim, key_dim), "[B, H, K, K]", "to match k")
    _check_positive_definite("P0", P0)
    if P_init is None:
        return P0.expand(batch, heads, key_dim, key_dim)
    P_init = require_float("initial_state[1]", P_init)
    layout = "[B, H, K, K]"
    require_shape("initial_state[1]", P_init, (batch, heads, key_dim, key_dim), layout)
    # Only symmetry: a covariance carried over from an earlier call may be singular (certainty
    # along some direction, e.g. after near noiseless observations), which the filter allows.
    _check_symmetric("initial_state[1]", P_init)
    return P_init


def exact_gain(
    k: torch.Tensor,
    g: torch.Tensor,
    q_noise: torch.Tensor,
    r: torch.Tensor,
    P: torch.Tensor,
    trace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, Gains | None]:
    """Validated inputs in one dtype: k, q_noise `[B, T, H, K]`, g `[B, T, H(, K)]`, r
    `[B, T, H]`, P `[B, H, K, K]`. Returns (gain `[B, T, H, K]`, final P `[B, H, K, K]`, and
    with `trace` the `Gains` of every token: gain, the diagonal of each P_t `[B, T, H, K]` and
    predictive `[B, T, H]`; else None)."""
    decay = g.exp()
    if g.dim() < k.dim():
        decay = decay.unsqueeze(-1).expand(k.shape)
    eye = torch.eye(k.shape[-1], dtype=k.dtype, device=k.device)
    gains, variances, predictives = [], [], []
    for t in range(k.shape[1]):
        d, k_t, r_t = decay[:, t], k[:, t], r[:, t, :, None]
        P_bar = d.unsqueeze(-1) * P * d.unsqueeze(-2) + torch.diag_embed(q_noise[:, t])
        P_k = (P_bar @ k_t.unsqueeze(-1)).squeeze(-1)
        predictive = (k_t * P_k).sum(dim=-1, keepdim=True)
        gain = P_k / (predictive + r_t)
        X = eye - gain.unsqueeze(-1) * k_t.unsqueeze(-2)
        # Joseph form keeps P positive semi-definite under roundoff; the average keeps it
        # exactly symmetric, which the textbook (I - gain k^T) P_bar is not.
        P = X @ P_bar @ X.mT + r_t.unsqueeze(-1) * gain.unsqueeze(-1) * gain.unsqueeze(-2)
        P = 0.5 * (P + P.mT)
        gains.append(gain)
        if trace:
            variances.append(P.diagonal(dim1=-2, dim2=-1))
            predictives.append(predictive.squeeze(-1))
    gain = torch.stack(gains, dim=1)
    if not trace:
        return gain, P, None
    return gain, P, Gains(gain, torch.stack(variances, dim=1), torch.stack(predictives, dim=1))


def kdn_exact(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    q_noise: torch.Tensor,
    r: torch.Tensor,
    P0: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
    output_final_state: bool = False,
    options: KernelOptions | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Exact KDN: each value column of the memory is Kalman-filtered, one shared covariance.

    Args:
        q, k: queries and keys `[B, T, H, K]`.
        v: values (the observations) `[B, T, H, V]`.
        g: log decays (<= 0), per channel `[B, T, H, K]` or per head `[B, T, H]`.
        q_noise: diagonal process-noise variances (>= 0) `[B, T, H, K]`.
        r: observation-noise variances (> 0) `[B, T, H]`.
        P0: prior covariance, symmetric positive definite, shared `[H, K, K]` or `[B, H, K, K]`.
        scale: output scale; defaults to `K ** -0.5`.
        initial_state: None or a pair `(memory [B, H, K, V] or None, covariance [B, H, K, K]
            or None)`, e.g. the final state of an earlier call; a None memory starts from
            zeros, a None covariance from P0. The covariance must be symmetric (it may be
            singular: certainty along a direction).
        output_final_state: also return the state after the last token.
        options: the Triton delta rule's choices (`deltalab.ops.options.KernelOptions`), passed
            on to `delta_rule` for the memory; None: the defaults.

    Returns:
        `(o [B, T, H, V] in q's dtype, (memory [B, H, K, V], covariance [B, H, K, K]) or
        None)`, o_t = scale * S_t^T q_t with S_t the posterior mean after token t.
    """
    with one_host_read():  # the value checks below read back once, not one by one
        k = check_keys(k, "B, T, H")
        check_query_value(q, v, k, "B, T, H")
        g = check_decay(g, k, "B, T, H")
        check_noise(q_noise, r, k, "B, T, H", per_channel_process=True)
        batch, _, heads, key_dim = k.shape
        memory, P_init = split_state(initial_state, "initial_state")
        P_prior = _prior_covariance(P0, P_init, batch, heads, key_dim)
        named = {"q": q, "k": k, "v": v, "g": g, "q_noise": q_noise, "r": r, "P0": P0}
        require_same_device({**named, "initial_state[1]": P_init})

    dtype = state_dtype(*named.values(), P_init)
    inputs = [x.to(dtype) for x in (k, g, q_noise, r)]
    gain, P, _ = exact_gain(*inputs, 0.5 * (P_prior + P_prior.mT).to(dtype))
    o, final_memory = delta_rule(
        q, gain, k, v, g, scale=scale, initial_state=memory,
        output_final_state=output_final_state, options=options,
    )  # fmt: skip
    if not output_final_state:
        return o, None
    return o, (final_memory, P)
