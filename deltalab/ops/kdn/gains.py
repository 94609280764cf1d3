"""KDN gains from the uncertainty scan (docs/MATH.md sec. 3); the memory never enters.

Isotropic (`P = p I`, one p per head), channel-wise decay projected by its trace:

    a_t     = mean_i exp(2 g_t,i)          (exp(2 g_t) for one decay per head)
    p_bar_t = a_t p_{t-1} + q_t
    beta_t  = p_bar_t / (p_bar_t ||k_t||^2 + r_t)
    1/p_t   = 1/p_bar_t + s ||k_t||^2 / (K r_t)

Diagonal (`P = diag(p)`, mean-field):

    p_bar_t = exp(2 g_t) * p_{t-1} + q_t
    gain_t  = (p_bar_t * k_t) / (k_t^T (p_bar_t * k_t) + r_t)
    1/p_t   = 1/p_bar_t + s k_t^2 / r_t

Both variance recursions are the Mobius map p -> (A p + B) / (C p + D) with A = a, B = q,
C = c a, D = c q + 1 and evidence c (s ||k||^2 / (K r), resp. s k^2 / r), scanned over T.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from deltalab.ops._checks import (
    one_host_read,
    require_choice,
    require_same_device,
    send_answers,
    share_passes,
    state_dtype,
)
from deltalab.ops._recompute import rebuildable_as
from deltalab.ops.kdn._validate import (
    check_decay,
    check_info_scale,
    check_keys,
    check_noise,
    prior_variance,
)
from deltalab.ops.mobius import BACKENDS, resolve_backend, scan_along_time


def _variance_scan(
    decay2: torch.Tensor,
    q_noise: torch.Tensor,
    evidence: torch.Tensor,
    p_prior: torch.Tensor,
    scan: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Posterior p_t and predicted p_bar_t, both `[B, T, *rest]`, from p_prior `[B, *rest]`, by
    the Mobius scan `scan` ("sequential", "parallel" or "triton")."""
    if scan == "triton":
        # One kernel reads (a, q, c) and writes p and p_bar, forward and backward.
        from deltalab.ops.kdn.triton import kdn_variance_scan

        return kdn_variance_scan(decay2, q_noise, evidence, p_prior)
    maps = (decay2, q_noise, evidence * decay2, evidence * q_noise + 1)
    p = scan_along_time(*maps, p_prior, scan)
    previous = torch.cat([p_prior.unsqueeze(1), p[:, :-1]], dim=1)
    return p, decay2 * previous + q_noise


class Gains(NamedTuple):
    """What a gain computation gives: the gain (Isotropic: the write strength beta `[..., H]`,
    gain = beta k; Diagonal and Exact: the gain `[..., H, K]`), the posterior variance p
    (`[..., H]`, or `[..., H, K]`: Exact's is the diagonal of P), and the predicted variance of
    the observation `k^T P_bar k` `[..., H]` (r excluded), whose sum with r divides the gain.
    `k` and `g`, where given, are the keys and log decays for the delta rule that the gain feeds:
    the same values routed through the gain's autograd node, whose backward then sums the delta
    rule's gradients of them with its own (the gains' Triton kernels: Isotropic's terms,
    Diagonal's fused gain); None: take the inputs. `routed_inputs` hands them on."""

    gain: torch.Tensor
    p: torch.Tensor
    predictive: torch.Tensor
    k: torch.Tensor | None = None
    g: torch.Tensor | None = None


# The per-token formulas, written once for the scans below and the decoding steps (step.py).


def iso_terms(
    k: torch.Tensor, g: torch.Tensor, r: torch.Tensor, info_scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Isotropic contraction a = mean_i exp(2 g_i) (or exp(2 g) per head), ||k||^2 and the
    evidence s ||k||^2 / (K r); k `[..., H, K]`, g `[..., H(, K)]`, r `[..., H]`."""
    decay2 = (2 * g).exp()
    if g.dim() == k.dim():
        decay2 = decay2.mean(dim=-1)
    norm2 = (k * k).sum(dim=-1)
    return decay2, norm2, info_scale * norm2 / (k.shape[-1] * r)


def iso_beta(
    p_bar: torch.Tensor, norm2: torch.Tensor, r: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(beta = p_bar / (p_bar ||k||^2 + r), predictive = p_bar ||k||^2)."""
    predictive = p_bar * norm2
    return p_bar / (predictive + r), predictive


def diag_terms(
    k: torch.Tensor, g: torch.Tensor, r: torch.Tensor, info_scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Diagonal contraction exp(2 g) `[..., H, K]` (a per-head g is broadcast), r `[..., H, 1]`
    and the evidence s k^2 / r; k `[..., H, K]`, g `[..., H(, K)]`, r `[..., H]`."""
    decay2 = (2 * g).exp()
    if g.dim() < k.dim():
        decay2 = decay2.unsqueeze(-1).expand(k.shape)
    r = r.unsqueeze(-1)
    return decay2, r, info_scale * k * k / r


def diag_gain_from(
    p_bar: torch.Tensor, k: torch.Tensor, r: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gain = p_bar k / (k^T (p_bar k) + r), predictive = k^T (p_bar k)); r `[..., H, 1]`."""
    weighted = p_bar * k
    predictive = (weighted * k).sum(dim=-1)
    return weighted / (predictive.unsqueeze(-1) + r), predictive


def write_dtype(scan: str, k: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The dtype Diagonal KDN's write direction (its gain) reaches the delta rule in, for the
    state dtype `dtype`: k's on the Triton route, whose kernels read every input in its own
    dtype (a float32 write would be read, and kept for the backward, at twice the bytes), the
    state dtype on the PyTorch paths, which compute in it. (Isotropic KDN's gain is a strength
    per token [B, T, H], which the delta rule multiplies with k itself.)"""
    return k.dtype if scan == "triton" and dtype != torch.float64 else dtype


def iso_gain(
    k: torch.Tensor,
    g: torch.Tensor,
    q_noise: torch.Tensor,
    r: torch.Tensor,
    p_prior: torch.Tensor,
    info_scale: float,
    scan: str,
) -> Gains:
    """Validated inputs, each in its own float dtype: k `[B, T, H, K]`, g `[B, T, H(, K)]`,
    q_noise, r `[B, T, H]`, p_prior `[B, H]`; `scan` a resolved Mobius backend. Computes in the
    state dtype (float64 when any input is, else float32). Returns beta, p and predictive, all
    `[B, T, H]` in it."""
    dtype = state_dtype(k, g, q_noise, r, p_prior)
    p_prior = p_prior.to(dtype)
    if scan == "triton" and dtype != torch.float64:
        # Two stages each way (triton_iso_terms.kdn_iso_gain): the terms' reductions over K, which
        # read k and g as they come (16-bit: no float32 copies of [B, T, H, K]), then the scan
        # with the evidence and beta inside it, reading q_noise and r as they come (one kernel,
        # three where T is split over few lanes: triton.split_plan). As separate ops the glue
        # around the scan cost more host time than its kernels take on the device (Isotropic
        # KDN's forward at B=4 T=4096 H=16 bf16 on the H200: 2.00 ms, 1.64 on the kernels);
        # float64 stays here.
        from deltalab.ops.kdn.triton_iso_terms import kdn_iso_gain

        return Gains(*kdn_iso_gain(k, g, q_noise, r, p_prior, info_scale))
    k, g, q_noise, r = (x.to(dtype) for x in (k, g, q_noise, r))
    decay2, norm2, evidence = iso_terms(k, g, r, info_scale)
    p, p_bar = _variance_scan(decay2, q_noise, evidence, p_prior, scan)
    beta, predictive = iso_beta(p_bar, norm2, r)
    return Gains(beta, p, predictive)


def diag_gain(
    k: torch.Tensor,
    g: torch.Tensor,
    q_noise: torch.Tensor,
    r: torch.Tensor,
    p_prior: torch.Tensor,
    info_scale: float,
    scan: str,
    gain_dtype: torch.dtype | None = None,
) -> Gains:
    """Validated inputs, each in its own float dtype: k, q_noise `[B, T, H, K]`, g
    `[B, T, H(, K)]`, r `[B, T, H]`, p_prior `[B, H, K]`; `scan` a resolved Mobius backend.
    Computes in the state dtype (float64 when any input is, else float32). Returns gain and p
    `[B, T, H, K]`, predictive `[B, T, H]`: p and predictive in the state dtype, the gain in
    `gain_dtype` (None: the state dtype; the KDN mixers take k's, as the delta rule reads its
    inputs in their own dtype). On the Triton scan in float32 the whole gain is one walk each way
    (triton_diag_gain.py); float64, and the other scans, take the ops below."""
    dtype = state_dtype(k, g, q_noise, r, p_prior)
    gain_dtype = gain_dtype or dtype
    if scan == "triton" and dtype != torch.float64:
        # The terms, the scan and the gain in registers, reading the inputs as they come, split
        # over T (triton_diag_gain.py). As separate ops around the Triton scan, a Diagonal KDN
        # 340M training step (B=4 T=4096 bf16, H200, 2026-12-01) took 307.9 ms of kernel time
        # against 280.6. float64 stays on the ops below, as the kernels compute in float32.
        from deltalab.ops.kdn.triton_diag_gain import kdn_diag_gain

        gains = kdn_diag_gain(
            k, g, q_noise, r, p_prior.to(dtype), info_scale, gain_dtype=gain_dtype
        )
        return Gains(*gains)
    k, g, q_noise, r, p_prior = (x.to(dtype) for x in (k, g, q_noise, r, p_prior))
    decay2, r, evidence = diag_terms(k, g, r, info_scale)
    p, p_bar = _variance_scan(decay2, q_noise, evidence, p_prior, scan)
    gain, predictive = diag_gain_from(p_bar, k, r)
    return Gains(gain.to(gain_dtype), p, predictive)


def kdn_gain_iso(
    k: torch.Tensor,
    g: torch.Tensor,
    q_noise: torch.Tensor,
    r: torch.Tensor,
    p0: torch.Tensor,
    *,
    info_scale: float | None = None,
    initial_precision: torch.Tensor | None = None,
    backend: str = "auto",
    output_predictive: bool = False,
    route_inputs: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Isotropic KDN gains: one variance per head, scanned over time.

    Args:
        k: keys `[B, T, H, K]`.
        g: log decays (<= 0), per head `[B, T, H]` or per channel `[B, T, H, K]` (then the
            covariance contracts by a_t = mean_i exp(2 g_t,i)).
        q_noise: process-noise variances (>= 0) `[B, T, H]`.
        r: observation-noise variances (> 0) `[B, T, H]`.
        p0: prior variances (> 0), shared `[H]` or per sequence `[B, H]`.
        info_scale: evidence scale s (> 0); defaults to K.
        initial_precision: `[B, H]` precision 1/p left by an earlier call (streaming); when
            given, it replaces p0.
        backend: the variance scan, a `deltalab.ops.mobius` backend: "auto" (Triton on CUDA
            when installed, else "parallel"), "sequential", "parallel" or "triton".
        output_predictive: also return the predicted variance of each observation.
        route_inputs: also return k and g as the delta rule that these gains feed should take
            them (`routed_inputs`): on the Triton route the gain's backward then adds the delta
            rule's gradients of k and g to its own.

    Returns:
        `(beta [B, T, H], p [B, T, H], final_precision [B, H])`: the write strength
        (gain_t = beta_t k_t), the posterior variance p_t, and 1/p_T; with
        `output_predictive`, then `predictive [B, T, H]` = p_bar_t ||k_t||^2 (beta_t =
        p_bar_t / (predictive_t + r_t)). Float64 when any input is float64, else float32.
        With `route_inputs`, then k and g for the delta rule (`routed_inputs`), as given.
    """
    return _checked_gains(False, **locals())


def kdn_gain_diag(
    k: torch.Tensor,
    g: torch.Tensor,
    q_noise: torch.Tensor,
    r: torch.Tensor,
    p0: torch.Tensor,
    *,
    info_scale: float | None = None,
    initial_precision: torch.Tensor | None = None,
    backend: str = "auto",
    output_predictive: bool = False,
    gain_dtype: torch.dtype | None = None,
    route_inputs: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Diagonal KDN gains: one variance per head and key channel, scanned over time.

    Args:
        k, g, q_noise, r: keys `[B, T, H, K]` and the noise model, as for `kdn_diag`.
        p0: prior variances (> 0): per head `[H]` (the same for every channel), shared
            `[H, K]` or per sequence `[B, H, K]`.
        info_scale: evidence scale s (> 0); defaults to K.
        initial_precision: `[B, H, K]` precision 1/p left by an earlier call; replaces p0.
        backend: the variance scan, as for `kdn_gain_iso`.
        output_predictive: also return the predicted variance of each observation.
        route_inputs: also return k and g as the delta rule that these gains feed should take
            them (`routed_inputs`): on the Triton route the gain's backward then adds the delta
            rule's gradients of k and g to its own.
        gain_dtype: the gain's dtype; None: the state dtype (the layers pass `write_dtype`'s, k's
            on the Triton route, so that the delta rule reads it in 16 bits).

    Returns:
        `(gain [B, T, H, K], p [B, T, H, K], final_precision [B, H, K])`; with
        `output_predictive`, then `predictive [B, T, H]` = k_t^T (p_bar_t * k_t) (the gain's
        denominator less r_t). Float64 when any input is float64, else float32 (the gain in
        `gain_dtype` when given). With `route_inputs`, then k and g for the delta rule
        (`routed_inputs`), as given.
    """
    return _checked_gains(True, **locals())


def _checked_gains(
    diagonal: bool,
    *,
    k: torch.Tensor,
    g: torch.Tensor,
    q_noise: torch.Tensor,
    r: torch.Tensor,
    p0: torch.Tensor,
    info_scale: float | None,
    initial_precision: torch.Tensor | None,
    backend: str,
    output_predictive: bool,
    route_inputs: bool,
    gain_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, ...]:
    """`kdn_gain_diag` (diagonal) or `kdn_gain_iso`, their arguments by name. One block holds
    the checks and the work they guard, as in the mixers (mixers._kdn has the reasoning): the
    answers are sent before the work and read once after it."""
    with one_host_read():
        k = check_keys(k, "B, T, H")
        g = check_decay(g, k, "B, T, H")
        check_noise(q_noise, r, k, "B, T, H", per_channel_process=diagonal)
        batch, _, heads, key_dim = k.shape
        tail = (heads, key_dim) if diagonal else (heads,)
        p_prior = prior_variance(p0, initial_precision, batch, tail, per_head=diagonal)
        scale = check_info_scale(info_scale, key_dim)
        named = {"k": k, "g": g, "q_noise": q_noise, "r": r, "p0": p0}
        require_same_device({**named, "initial_precision": initial_precision})
        scan = resolve_backend(require_choice("backend", backend, BACKENDS), k.device)
        # In the state dtype: p_prior's (the rest may come in 16-bit, read as it is by the
        # kernels and cast by the PyTorch path).
        dtype = state_dtype(*named.values(), initial_precision)
        send_answers()
        if diagonal:
            gains = diag_gain(k, g, q_noise, r, p_prior.to(dtype), scale, scan, gain_dtype)
        else:
            gains = iso_gain(k, g, q_noise, r, p_prior.to(dtype), scale, scan)
    return _returned(gains, output_predictive, (k, g) if route_inputs else None)


def _returned(
    gains: Gains, output_predictive: bool, route: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[torch.Tensor, ...]:
    """The public gain functions' result: (gain, p, final precision[, predictive][, k, g]),
    k and g routed when `route` holds the validated inputs."""
    returned = (gains.gain, gains.p, 1.0 / gains.p[:, -1])
    if output_predictive:
        returned += (gains.predictive,)
    return returned if route is None else (*returned, *routed_inputs(gains, *route))


def routed_inputs(
    gains: Gains, k: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k and g for the delta rule that `gains` (computed from k and g) feed: where the gain's
    node hands them back (`Gains.k`, `Gains.g`), those views, so that its backward sums the
    delta rule's gradients of k and g with its own; else k and g. A view carries what k and g
    carry: the checks they passed (`_checks.share_passes`: the delta rule checks g again, and
    in a block that has sent its answers a check it does not find is read behind the work) and
    the recipe that rebuilds them in the backward (`_recompute.rebuildable_as`: else the delta
    rule would keep the view, and with it the tensor the rebuild spares)."""
    if gains.k is None or gains.g is None:
        return k, g
    share_passes(gains.k, k)
    share_passes(gains.g, g)
    return rebuildable_as(gains.k, k), rebuildable_as(gains.g, g)
