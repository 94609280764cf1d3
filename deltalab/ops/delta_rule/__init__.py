"""The generalized delta rule: the one primitive every mixer of deltalab is built on.

    S_t = (I - a_t b_t^T) diag(exp(g_t)) S_{t-1} + a_t u_t^T,      o_t = scale * S_t^T q_t

a is a write direction per token, or one write strength per token (a_t = a_t b_t: DeltaNet,
Gated DeltaNet, KDA, Isotropic KDN), which the Triton kernels multiply in as they load b instead
of reading a product from memory; the other backends form the product.

Backends: "naive" (token loop, the definition), "chunk" (chunkwise-parallel PyTorch, stable up
to 256-token chunks), "triton" (the stages of "chunk", each a Triton kernel, forward and
backward; CUDA, or CPU under TRITON_INTERPRET=1). "auto" picks the fastest available for the
inputs' device.
"""

from __future__ import annotations

import torch

from deltalab.ops._checks import (
    check_cu_seqlens,
    one_host_read,
    require_choice,
    require_float,
    require_nonpositive,
    require_positive_number,
    require_rank,
    require_same_device,
    require_shape,
    send_answers,
    state_dtype,
)
from deltalab.ops._triton import require_triton, triton_available
from deltalab.ops.delta_rule.chunk import delta_rule_chunk
from deltalab.ops.delta_rule.naive import delta_rule_naive, delta_rule_token
from deltalab.ops.norms import L2_EPS, l2_normalize
from deltalab.ops.options import DEFAULT_OPTIONS, KernelOptions
from deltalab.ops.parametrize import DeltaRuleInputs

__all__ = ["BACKENDS", "MAX_CHUNK_SIZE", "MIN_CHUNK_SIZE", "delta_rule", "delta_rule_step"]

BACKENDS = ("auto", "naive", "chunk", "triton")
# Largest head dim K of the Triton kernels: the state tile [K, 32] stays in registers and every
# kernel fits a Hopper SM's shared memory up to here (tests/test_triton_compile.py).
TRITON_MAX_KEY_DIM = 256
MIN_CHUNK_SIZE, MAX_CHUNK_SIZE = 16, 256


def _resolve_backend(backend: str, device: torch.device, dtype: torch.dtype, key_dim: int) -> str:
    require_choice("backend", backend, BACKENDS)
    if backend == "triton":
        require_triton("backend", device)
        if key_dim > TRITON_MAX_KEY_DIM:
            raise ValueError(
                f'backend="triton" takes head dims K <= {TRITON_MAX_KEY_DIM}, got K = {key_dim} '
                '(q\'s last axis); use backend="chunk"'
            )
    if backend != "auto":
        return backend
    # The kernels compute in float32: float64 (references, gradient checks) stays in PyTorch.
    fits = dtype != torch.float64 and key_dim <= TRITON_MAX_KEY_DIM
    return "triton" if fits and triton_available(device) else "chunk"


def directions(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The write directions of `a`: a itself, or, for one strength per token (a [..., H] beside
    b [..., H, K]), a_t b_t in the dtype the two promote to."""
    return a.unsqueeze(-1) * b if a.dim() == b.dim() - 1 else a


def require_chunk_size(chunk_size: object) -> int:
    """chunk_size as an int in [MIN_CHUNK_SIZE, MAX_CHUNK_SIZE]: the chunked path's range (the
    layers check their `chunk_size` option with this too)."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size must be an int, got {type(chunk_size).__name__}")
    if not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE:
        raise ValueError(
            f"chunk_size must be in [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}], got {chunk_size}"
        )
    return chunk_size


def require_bool(name: str, value: object) -> bool:
    """`value` as a bool; else a TypeError naming the argument."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


# The norm before the rule where the rule's own path does not normalize q and b (`qk_l2norm`):
# the formula left to autograd for the definition, the norms' torch path (its output and one
# 1/norm per row kept) for the chunked PyTorch path, the norms' kernel for the Triton decoding
# step (the Triton chunked path normalizes inside its kernels).
_UNIT_QK_BACKEND = {"naive": "naive", "chunk": "torch", "triton": "triton"}


def unit_qk(q: torch.Tensor, b: torch.Tensor, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """q and b made unit-norm over K (`qk_l2norm`), `l2_normalize`d (x / sqrt(|x|^2 + eps)) in
    their dtypes by the norm op's path paired with the delta rule's `backend`."""
    norm_backend = _UNIT_QK_BACKEND[backend]
    unit_q, unit_b = (l2_normalize(x, L2_EPS, backend=norm_backend) for x in (q, b))
    return unit_q, unit_b


def require_options(options: object) -> KernelOptions:
    """`options` as a `KernelOptions` (None: the defaults)."""
    if options is None:
        return DEFAULT_OPTIONS
    if not isinstance(options, KernelOptions):
        raise TypeError(
            f"options must be a deltalab.ops.options.KernelOptions or None, got "
            f"{type(options).__name__}"
        )
    return options


def _check_gates(q, a, b, u, g, leading: str) -> None:
    """Shared shape checks; `leading` is "B, T, H" (sequences) or "B, H" (one token)."""
    rank = leading.count(",") + 2
    for name, x in (("q", q), ("a", a), ("b", b), ("u", u), ("g", g)):
        require_float(name, x)
    require_rank("q", q, (rank,), f"[{leading}, K]")
    # An empty key or value axis leaves no state: K = 0 would divide by zero in the default
    # scale K^-1/2, V = 0 would return empty outputs instead of saying what went wrong.
    if q.shape[-1] == 0:
        raise ValueError(f"q must have K >= 1 (last axis of [{leading}, K]), got {tuple(q.shape)}")
    require_shape("b", b, q.shape, f"[{leading}, K]", "to match q")
    require_rank("u", u, (rank,), f"[{leading}, V]")
    # Grouped value heads: u may have a multiple of q's heads; a, u and g have u's.
    heads = u.shape[-2] if u.shape[-2] % max(q.shape[-2], 1) == 0 else q.shape[-2]
    per_token = (*q.shape[:-2], heads)
    require_shape("u", u, (*per_token, u.shape[-1]), f"[{leading}, V]",
                  "to match q (H: q's heads or a multiple of them, grouped value heads)")  # fmt: skip
    if u.shape[-1] == 0:
        raise ValueError(f"u must have V >= 1 (last axis of [{leading}, V]), got {tuple(u.shape)}")
    require_rank("a", a, (rank - 1, rank), f"[{leading}, K] or [{leading}]")
    if a.dim() == rank:
        require_shape("a", a, (*per_token, q.shape[-1]), f"[{leading}, K]", "to match q and u")
    else:
        require_shape("a", a, per_token, f"[{leading}]", "(a strength per token) to match q and u")
    require_rank("g", g, (rank - 1, rank), f"[{leading}] or [{leading}, K]")
    expected_g = per_token if g.dim() == rank - 1 else (*per_token, q.shape[-1])
    layout = f"[{leading}]" if g.dim() == rank - 1 else f"[{leading}, K]"
    require_shape("g", g, expected_g, layout, "to match q and u")


def grouped_keys(q: torch.Tensor, b: torch.Tensor, value_heads: int):
    """q and b with every head repeated for the value heads that read it (head h of u reads
    head h // G of q and b, G = value_heads / q's heads), for the PyTorch paths; as they are
    without grouping."""
    group = value_heads // q.shape[-2]
    if group == 1:
        return q, b
    return tuple(x.repeat_interleave(group, dim=-2) for x in (q, b))


def delta_rule(
    q: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    backend: str = "auto",
    options: KernelOptions | None = None,
    qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Runs the generalized delta rule over whole sequences.

    Args:
        q: queries `[B, T, H_k, K]`.
        a: write directions `[B, T, H, K]`, or write strengths `[B, T, H]`, one per token:
            a_t = a_t b_t (the DeltaNet family's beta; the Triton kernels form it on load).
        b: erase keys `[B, T, H_k, K]`.
        u: target values `[B, T, H, V]`; H = H_k, or grouped value heads H = G H_k (as GQA):
            value head h reads q's and b's head h // G (the Triton kernels index it so; the
            PyTorch paths repeat q and b).
        g: log decays (<= 0), per channel `[B, T, H, K]` or one per head `[B, T, H]`.
        scale: output scale; defaults to `K ** -0.5`.
        initial_state: `[N, H, K, V]` (N = B, or the number of packed sequences); zeros if None.
        output_final_state: also return the state after the last token of each sequence.
        cu_seqlens: int `[N+1]` offsets of sequences packed along T (needs B == 1).
        chunk_size: tokens per chunk of the "chunk" backend, 16..256.
        backend: "auto", "naive", "chunk" or "triton" ("auto": "triton" on CUDA when Triton
            is installed, else "chunk").
        options: the Triton kernels' `deltalab.ops.options.KernelOptions` (None: the defaults,
            which measured best); the other backends ignore them.
        qk_l2norm: make q and b unit-norm over K first, `x / sqrt(|x|^2 + 1e-6)` as
            `deltalab.ops.norms.l2_normalize`, with gradients through it (a write strength `a`
            then scales the unit b; a write direction is used as given). The Triton kernels
            normalize the rows as they load them and keep one inverse norm per row.

    Returns:
        `(o [B, T, H, V] in q's dtype, final state [N, H, K, V] or None)`. The state is kept in
        float32 (float64 when any input is float64) whatever the input dtype.
    """
    _check_gates(q, a, b, u, g, "B, T, H")
    # The one value check (g <= 0) is read behind the work: queued here, in order before the
    # argument checks below (an error among them runs it first: `one_host_read`), its answer's
    # copy started before the launches (`send_answers`), waited for at the block's end. So the
    # device does not idle while the host prepares the launches, nor the host while the
    # device runs them. Safe: a positive log decay gives inf or NaN, never an access out of
    # bounds; the error is raised at the end and the results dropped. Inside an enclosing
    # block (a KDN op's, the trainer's) it joins that one.
    with one_host_read():
        require_nonpositive("g", g, "a log decay")
        o, final = _validated_call(
            q, a, b, u, g, scale, initial_state, cu_seqlens, chunk_size, backend,
            output_final_state, options, qk_l2norm,
        )  # fmt: skip
    return o.to(q.dtype), (final if output_final_state else None)


def _validated_call(
    q, a, b, u, g, scale, initial_state, cu_seqlens, chunk_size, backend, output_final_state,
    options, qk_l2norm,
):  # fmt: skip
    """delta_rule past its gates' checks: the other arguments', then the backend's call."""
    batch, length, _, key_dim = q.shape
    heads, value_dim = u.shape[-2:]
    if length == 0:
        raise ValueError("q must hold at least one token (T >= 1), got T = 0")
    require_same_device(
        {
            "q": q,
            "a": a,
            "b": b,
            "u": u,
            "g": g,
            "initial_state": initial_state,
            "cu_seqlens": cu_seqlens,
        }
    )
    chunk_size = require_chunk_size(chunk_size)
    options = require_options(options)
    require_bool("output_final_state", output_final_state)
    require_bool("qk_l2norm", qk_l2norm)
    if cu_seqlens is not None:
        # The backends take the validated offsets as an int64 tensor on q's device.
        cu_seqlens = check_cu_seqlens(cu_seqlens, batch, length, q.device)
    sequences = batch if cu_seqlens is None else cu_seqlens.numel() - 1
    dtype = state_dtype(q, a, b, u, g, initial_state)
    backend = _resolve_backend(backend, q.device, dtype, key_dim)
    if initial_state is None:
        state = q.new_zeros(sequences, heads, key_dim, value_dim, dtype=dtype)
    else:
        require_float("initial_state", initial_state)
        require_shape(
            "initial_state",
            initial_state,
            (sequences, heads, key_dim, value_dim),
            "[N, H, K, V]",
            "(N = B, or the number of sequences in cu_seqlens)",
        )
        state = initial_state.to(dtype)
    scale = key_dim**-0.5 if scale is None else require_positive_number("scale", scale)
    if backend == "triton" and dtype == torch.float64:
        raise ValueError(
            'backend="triton" computes in float32 (bf16/fp16/fp32 inputs); float64 inputs '
            'need backend="chunk" or "naive"'
        )

    send_answers()
    if backend == "triton":
        # Imported here: Triton is optional, and deltalab imports without it.
        from deltalab.ops.delta_rule.triton.chunk import delta_rule_triton

        # Given the inputs' own dtype: it picks the precision of its matrix products.
        o, final = delta_rule_triton(
            q, a, b, u, g, state, cu_seqlens, chunk_size, scale, options, qk_l2norm
        )
    else:
        if qk_l2norm:
            q, b = unit_qk(q, b, backend)
        q, b = grouped_keys(q, b, heads)
        q, a, b, u, g = (x.to(dtype) for x in (q, a, b, u, g))
        inputs = DeltaRuleInputs(q * scale, directions(a, b), b, u, g)
        if backend == "naive":
            o, final = delta_rule_naive(inputs, state, cu_seqlens)
        else:
            o, final = delta_rule_chunk(inputs, state, cu_seqlens, chunk_size)
    return o, final


def delta_rule_step(
    q: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor,
    state: torch.Tensor,
    *,
    scale: float | None = None,
    backend: str = "auto",
    in_place: bool = False,
    qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step of the generalized delta rule, one token per sequence.

    Args:
        q, b: `[B, H_k, K]`; a: `[B, H, K]` or `[B, H]` (a strength: a b); u: `[B, H, V]`
            (H = H_k, or grouped value heads G H_k as for `delta_rule`);
        g: `[B, H, K]` or `[B, H]` (log decay <= 0);
        state: `[B, H, K, V]`; scale: defaults to `K ** -0.5`.
        backend: "naive" (`delta_rule_token`), "triton" (one fused kernel; float32 state math,
            so no float64 inputs) or "auto" (Triton for CUDA tensors when it can run, unless an
            input is float64; else naive).
        in_place: write the new state into `state` and return it (`state` must already be in
            the state dtype). The static-cache decoder uses it: its state buffers stay where
            a captured CUDA graph reads them, and the step makes no copy of the state.
        qk_l2norm: make q and b unit-norm over K first, as `delta_rule` does (by the norm
            op before the step: `unit_qk`).

    Returns:
        `(o [B, H, V] in q's dtype, new state [B, H, K, V] in float32, or float64 when any
        input is float64)`.
    """
    from deltalab.ops._triton import require_triton, triton_available

    _check_gates(q, a, b, u, g, "B, H")
    require_nonpositive("g", g, "a log decay")
    batch, _, key_dim = q.shape
    heads = u.shape[1]
    require_float("state", state)
    require_shape(
        "state", state, (batch, heads, key_dim, u.shape[-1]), "[B, H, K, V]", "to match q, u"
    )
    require_same_device({"q": q, "a": a, "b": b, "u": u, "g": g, "state": state})
    scale = key_dim**-0.5 if scale is None else require_positive_number("scale", scale)
    require_choice("backend", backend, ("auto", "naive", "triton"))
    require_bool("in_place", in_place)
    require_bool("qk_l2norm", qk_l2norm)
    dtype = state_dtype(q, a, b, u, g, state)
    if in_place and state.dtype != dtype:
        raise ValueError(f"in_place=True needs state in {dtype}, got {state.dtype}")
    # The fused kernel records no backward: a step whose inputs need gradients runs the token
    # loop ("auto"), or is refused ("triton"), rather than losing them silently.
    tensors = (q, a, b, u, g, state)
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in tensors)
    if backend == "auto":
        use_triton = dtype == torch.float32 and triton_available(q.device) and not needs_grad
        backend = "triton" if use_triton else "naive"
    elif backend == "triton":
        if needs_grad:
            raise ValueError(
                'backend="triton" decodes without gradients (its kernel records no backward); '
                'inputs that require grad need backend="naive" or "auto"'
            )
        require_triton("backend", q.device)
        if dtype == torch.float64:
            raise ValueError(
                'backend="triton" keeps the state in float32; the inputs hold float64 '
                '(use backend="naive" for float64)'
            )

    if qk_l2norm:
        q, b = unit_qk(q, b, backend)
    q, b = grouped_keys(q, b, heads)
    a = directions(a, b)
    if backend == "triton":
        from deltalab.ops.delta_rule.triton.step import delta_rule_step_triton

        return delta_rule_step_triton(
            q, a, b, u, g, state, scale=scale, new_state=state if in_place else None
        )
    token = DeltaRuleInputs(q.to(dtype) * scale, *(x.to(dtype) for x in (a, b, u, g)))
    o, new_state = delta_rule_token(token, state.to(dtype))
    if in_place:
        new_state = state.copy_(new_state)
    return o.to(q.dtype), new_state
