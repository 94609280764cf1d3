"""Isotropic and Diagonal KDN over whole sequences: gains by the uncertainty scan, then the
memory through the generalized delta rule with a = gain, b = k, u = v (docs/MATH.md sec. 1, 3)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from deltalab.ops._checks import (
    check_cu_seqlens,
    one_host_read,
    require_choice,
    require_same_device,
    send_answers,
    state_dtype,
)
from deltalab.ops._varlen import max_seqlen, pad_packed, unpad_packed
from deltalab.ops.delta_rule import (
    BACKENDS,
    _resolve_backend,
    delta_rule,
    require_bool,
    unit_qk,
)
from deltalab.ops.kdn._validate import (
    check_decay,
    check_info_scale,
    check_keys,
    check_noise,
    check_query_value,
    prior_variance,
    split_state,
)
from deltalab.ops.kdn.gains import Gains, diag_gain, iso_gain, routed_inputs, write_dtype
from deltalab.ops.mobius import resolve_backend
from deltalab.ops.options import KernelOptions

GainFn = Callable[..., Gains]
State = tuple[torch.Tensor | None, torch.Tensor | None]


def scan_backend(backend: str, device: torch.device) -> str:
    """The variance scan paired with a KDN backend: the token loop with the step loop, the
    PyTorch chunked rule with the PyTorch parallel scan, Triton with Triton ("auto": Triton on
    CUDA when installed)."""
    if backend == "naive":
        return "sequential"
    if backend == "chunk":
        return "parallel"
    return resolve_backend(backend, device)


def _packed_gains(
    gain_fn: GainFn,
    k: torch.Tensor,
    g: torch.Tensor,
    q_noise: torch.Tensor,
    r: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gains `[B, T, H(, K)]`, each sequence's last posterior variance `[N, H(, K)]`, and the k
    and g for the delta rule (`Gains.k`, `Gains.g`: routed through the gain's node where its
    backward sums their gradients, else the inputs).

    `gain_fn` takes (k, g, q_noise, r), its prior, info_scale and scan bound. Packed sequences
    are scanned as a padded batch, each from its own prior. Padding tokens get k = 0, g = 0,
    q_noise = 0 and r = 1: the identity map, finite in both directions.
    """
    if cu_seqlens is None:
        gains = gain_fn(k, g, q_noise, r)
        return gains.gain, gains.p[:, -1], *routed_inputs(gains, k, g)
    length = k.shape[1]
    max_len = max_seqlen(cu_seqlens, length)  # one device -> host sync (see max_seqlen)
    real = pad_packed(torch.ones_like(r), cu_seqlens, max_len) > 0
    r_padded = pad_packed(r, cu_seqlens, max_len)
    r_padded = torch.where(real, r_padded, torch.ones_like(real, dtype=r.dtype))
    padded = [pad_packed(x, cu_seqlens, max_len) for x in (k, g, q_noise)]
    # The padded k and g are not the delta rule's: its gradients of k and g and the gain's
    # reach the inputs apart and are summed by autograd.
    gain, p, *_ = gain_fn(*padded, r_padded)
    last = cu_seqlens[1:] - cu_seqlens[:-1] - 1
    sequences = torch.arange(last.numel(), device=p.device)
    return unpad_packed(gain, cu_seqlens, length), p[sequences, last], k, g


def _kdn(
    variant: str,
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    q_noise: torch.Tensor,
    r: torch.Tensor,
    p0: torch.Tensor,
    scale: float | None,
    info_scale: float | None,
    initial_state: State | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
    chunk_size: int,
    backend: str,
    options: KernelOptions | None,
    qk_l2norm: bool,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    diagonal = variant == "diag"
    # One block holds the checks and the work they guard (the gain and the delta rule). The
    # checks queue their answers, `send_answers` starts their copy to the host, the work is
    # queued behind it, and the block's end waits for that copy alone. Where the wait sits
    # decides what the device waits for (on the H200, B=4 T=4096 H=16 bf16, forward+backward):
    # - a read before the gain left the device idle while the host launched the gain's kernels
    #   and glue one by one: 7.07 ms against 5.63 unchecked for Isotropic KDN, 6.57 against
    #   5.77 for Diagonal;
    # - a read after the delta rule drained the whole forward, and the device then idled while
    #   the host returned and started the backward: 0.43 ms per call for either form; a read
    #   between the gain and the delta rule, while the host prepared the delta rule's first
    #   launch: 0.29 (Isotropic) and 0.49 ms (Diagonal);
    # - here the host waits for a copy started before the work, done by the block's end:
    #   0.02 ms per call for either form. A check queued after the
    #   send is read at the block's end behind all the work, so none must be: the delta
    #   rule finds its check of g queued or passed (check_decay's g is the one the gain's
    #   node takes, and gains.routed_inputs hands its pass on).
    # Safe because these are value checks: out-of-range values make NaN or inf, never an
    # access out of bounds (the offsets in cu_seqlens, which index memory, are read back and
    # checked before anything is launched). When a check fails its error is raised at the
    # block's end and the work's results are dropped. The delta rule's own check of g is not
    # queued again (the block knows it queued it for this tensor unchanged), and the delta
    # rule, a block inside this one, sends nothing of its own.
    with one_host_read():
        k = check_keys(k, "B, T, H")
        check_query_value(q, v, k, "B, T, H")
        g = check_decay(g, k, "B, T, H")
        check_noise(q_noise, r, k, "B, T, H", per_channel_process=diagonal)
        require_choice("backend", backend, BACKENDS)
        require_bool("qk_l2norm", qk_l2norm)
        batch, length, heads, key_dim = k.shape
        # Validated as an int64 tensor on k's device: the variance scan takes it as it is.
        cu = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, batch, length, k.device)
        sequences = batch if cu is None else cu.numel() - 1
        memory, precision = split_state(initial_state, "initial_state")
        tail = (heads, key_dim) if diagonal else (heads,)
        p_prior = prior_variance(
            p0, precision, sequences, tail, ("p0", "initial_state[1]"), per_head=diagonal
        )
        s = check_info_scale(info_scale, key_dim)
        named = {"q": q, "k": k, "v": v, "g": g, "q_noise": q_noise, "r": r, "p0": p0}
        require_same_device({**named, "initial_state[1]": precision})

        dtype = state_dtype(*named.values(), precision)
        scan = scan_backend(backend, k.device)
        # The gain functions take the inputs in their own dtypes: the Triton kernels read 16-bit
        # ones as they are (no float32 copies of [B, T, H, K]), the PyTorch paths cast them. The
        # diagonal gain (the write direction) reaches the delta rule in k's dtype on the kernels'
        # route, in the state dtype elsewhere; the isotropic one is the write's strength per
        # token [B, T, H], which the delta rule multiplies with k itself (as KDA's beta).
        written = {"gain_dtype": write_dtype(scan, k, dtype)} if diagonal else {}
        gain_fn = functools.partial(
            diag_gain if diagonal else iso_gain,
            p_prior=p_prior.to(dtype),
            info_scale=s,
            scan=scan,
            **written,
        )
        send_answers()
        if qk_l2norm:
            # The gains read k before the delta rule (the evidence is k's square): q and k are
            # made unit-norm once, by the norm op paired with the delta rule's backend, for both.
            q, k = unit_qk(q, k, _resolve_backend(backend, k.device, dtype, key_dim))
        gain, p_last, k_rule, g_rule = _packed_gains(gain_fn, k, g, q_noise, r, cu)
        o, final_memory = delta_rule(
            q,
            gain,
            k_rule,
            v,
            g_rule,
            scale=scale,
            initial_state=memory,
            output_final_state=output_final_state,
            cu_seqlens=cu,
            chunk_size=chunk_size,
            backend=backend,
            options=options,
        )
    if not output_final_state:
        return o, None
    return o, (final_memory, 1.0 / p_last)


def kdn_iso(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    q_noise: torch.Tensor,
    r: torch.Tensor,
    p0: torch.Tensor,
    *,
    scale: float | None = None,
    info_scale: float | None = None,
    initial_state: State | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    backend: str = "auto",
    options: KernelOptions | None = None,
    qk_l2norm: bool = False,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Isotropic KDN: KDA (or GDN) whose beta comes from a per-head variance scan.

    Args:
        q, k: queries and keys `[B, T, H, K]`.
        v: values `[B, T, H, V]`.
        g: log decays (<= 0), per channel `[B, T, H, K]` or per head `[B, T, H]`.
        q_noise: process-noise variances (>= 0) `[B, T, H]`.
        r: observation-noise variances (> 0) `[B, T, H]`.
        p0: prior variances (> 0), shared `[H]` or per sequence `[N, H]`.
        scale: output scale; defaults to `K ** -0.5`.
        info_scale: evidence scale s (> 0); defaults to K.
        initial_state: None or a pair `(memory [N, H, K, V] or None, precision [N, H] or None)`;
            a None memory starts from zeros, a None precision from 1 / p0.
        output_final_state: also return the state after each sequence's last token.
        cu_seqlens: int `[N+1]` offsets of sequences packed along T (needs B == 1); the memory
            and the variance scan both restart at every boundary.
        chunk_size: tokens per chunk of the "chunk" backend of `delta_rule`, 16..256.
        backend: "auto", "naive", "chunk" or "triton", for `delta_rule` and the variance scan:
            "naive" scans the variance step by step, "chunk" by the PyTorch parallel scan,
            "triton" by the Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1); "auto" takes
            the Triton scan on CUDA when Triton is installed, else the parallel scan.
        options: the Triton delta rule's choices (`deltalab.ops.options.KernelOptions`), passed
            on to `delta_rule`; None: the defaults.
        qk_l2norm: make q and k unit-norm over K first (`x / sqrt(|x|^2 + 1e-6)`, as
            `deltalab.ops.norms.l2_normalize`), with gradients through it; the gain then sees
            the unit k.

    N = B, or the number of sequences in cu_seqlens.

    Returns:
        `(o [B, T, H, V] in q's dtype, (memory [N, H, K, V], precision [N, H]) or None)`.
    """
    # The arguments by name (locals() holds exactly the parameters here): _kdn takes
    # keywords only, so scale and info_scale, both floats, can never trade places.
    return _kdn("iso", **locals())


def kdn_diag(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    q_noise: torch.Tensor,
    r: torch.Tensor,
    p0: torch.Tensor,
    *,
    scale: float | None = None,
    info_scale: float | None = None,
    initial_state: State | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    backend: str = "auto",
    options: KernelOptions | None = None,
    qk_l2norm: bool = False,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Diagonal KDN: the delta rule with write direction gain_t from a per-channel variance scan.

    Args:
        q, k: queries and keys `[B, T, H, K]`.
        v: values `[B, T, H, V]`.
        g: log decays (<= 0), per channel `[B, T, H, K]` or per head `[B, T, H]`.
        q_noise: process-noise variances (>= 0) `[B, T, H, K]`.
        r: observation-noise variances (> 0) `[B, T, H]`.
        p0: prior variances (> 0): per head `[H]` (the same for every channel), shared
            `[H, K]` or per sequence `[N, H, K]`.
        scale: output scale; defaults to `K ** -0.5`.
        info_scale: evidence scale s (> 0); defaults to K.
        initial_state: None or a pair `(memory [N, H, K, V] or None, precision [N, H, K] or
            None)`; a None memory starts from zeros, a None precision from 1 / p0.
        output_final_state: also return the state after each sequence's last token.
        cu_seqlens: int `[N+1]` offsets of sequences packed along T (needs B == 1).
        chunk_size: tokens per chunk of the "chunk" backend of `delta_rule`, 16..256.
        backend: "auto", "naive", "chunk" or "triton" (as for `kdn_iso`).
        options: the Triton delta rule's choices, as for `kdn_iso`.
        qk_l2norm: make q and k unit-norm first, as for `kdn_iso`.

    N = B, or the number of sequences in cu_seqlens.

    Returns:
        `(o [B, T, H, V] in q's dtype, (memory [N, H, K, V], precision [N, H, K]) or None)`.
    """
    # The arguments by name (locals() holds exactly the parameters here): _kdn takes
    # keywords only, so scale and info_scale, both floats, can never trade places.
    return _kdn("diag", **locals())
