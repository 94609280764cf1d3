"""KDN ops: Exact KDN is the Kalman filter, Diagonal KDN is Exact KDN on one-hot keys, frozen
Isotropic KDN is Gated DeltaNet, and every fast path matches its reference."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

import deltalab.ops.kdn
from deltalab.ops import (
    kdn_diag,
    kdn_diag_step,
    kdn_exact,
    kdn_gain_diag,
    kdn_gain_iso,
    kdn_iso,
    kdn_iso_step,
)
from deltalab.ops._triton import INTERPRET
from deltalab.ops.kdn.exact import exact_gain
from deltalab.ops.options import KernelOptions
from deltalab.testing import TOLERANCE, assert_close

F64 = torch.float64
TOL = TOLERANCE[F64]
KDN = {"iso": kdn_iso, "diag": kdn_diag}
STEP = {"iso": kdn_iso_step, "diag": kdn_diag_step}
GAIN = {"iso": kdn_gain_iso, "diag": kdn_gain_diag}


def kdn_inputs(
    gen: torch.Generator,
    shape: tuple[int, int, int, int, int],
    *,
    variant: str,
    channel_decay: bool = True,
) -> dict[str, torch.Tensor]:
    """q, k, v, g, q_noise, r, p0 for `variant` ("iso", "diag" or "exact"), float64.

    Keys are not normalized, so every ||k||^2 factor is exercised.
    """
    batch, length, heads, key_dim, value_dim = shape

    def randn(*s):
        return torch.randn(*s, generator=gen, dtype=F64)

    def rand(*s):
        return torch.rand(*s, generator=gen, dtype=F64)

    tokens = (batch, length, heads)
    per_channel_noise = variant in ("diag", "exact")
    args = {
        "q": randn(*tokens, key_dim),
        "k": randn(*tokens, key_dim),
        "v": randn(*tokens, value_dim),
        "g": -rand(*tokens, key_dim) if channel_decay else -rand(*tokens),
        "q_noise": 0.2 * (rand(*tokens, key_dim) if per_channel_noise else rand(*tokens)),
        "r": 0.1 + rand(*tokens),
    }
    if variant == "iso":
        args["p0"] = 0.5 + rand(heads)
    elif variant == "diag":
        args["p0"] = 0.5 + rand(heads, key_dim)
    else:
        X = randn(heads, key_dim, key_dim)
        args["P0"] = X @ X.mT / key_dim + 0.5 * torch.eye(key_dim, dtype=F64)
    return args


def textbook_kalman(q, k, v, g, q_noise, r, P0, S0, scale):
    """The Kalman filter of docs/MATH.md sec. 2.2 in numpy, one value column at a time: state s
    (one column of S), transition diag(exp(g)), process noise diag(q_noise), observation
    v_j = k^T s + e with e ~ N(0, r). Returns (o, final S, final P, predictive k^T P_bar k
    `[B, T, H]`, the diagonal of each posterior P_t `[B, T, H, K]`) as numpy arrays."""
    q, k, v, g, q_noise, r, P0, S0 = (x.numpy() for x in (q, k, v, g, q_noise, r, P0, S0))
    batch, length, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    if g.ndim == 3:
        g = np.repeat(g[..., None], key_dim, axis=-1)
    o = np.zeros((batch, length, heads, value_dim))
    S = np.zeros((batch, heads, key_dim, value_dim))
    P_final = np.zeros((batch, heads, key_dim, key_dim))
    predictive = np.zeros((batch, length, heads))
    variances = np.zeros((batch, length, heads, key_dim))
    for b in range(batch):
        for h in range(heads):
            for j in range(value_dim):
                mean, P = S0[b, h, :, j].copy(), P0[b, h].copy()
                for t in range(length):
                    F = np.diag(np.exp(g[b, t, h]))
                    mean = F @ mean
                    P = F @ P @ F.T + np.diag(q_noise[b, t, h])
                    H = k[b, t, h][None, :]
                    innovation = v[b, t, h, j] - (H @ mean)[0]
                    predictive[b, t, h] = (H @ P @ H.T)[0, 0]
                    variance = predictive[b, t, h] + r[b, t, h]
                    gain = (P @ H.T)[:, 0] / variance
                    mean = mean + gain * innovation
                    P = (np.eye(key_dim) - gain[:, None] @ H) @ P
                    variances[b, t, h] = np.diag(P)
                    o[b, t, h, j] = scale * q[b, t, h] @ mean
                S[b, h, :, j] = mean
                P_final[b, h] = P
    return o, S, P_final, predictive, variances


@pytest.mark.parametrize("channel_decay", [True, False])
@pytest.mark.parametrize("with_initial_state", [False, True])
def test_exact_matches_textbook_kalman_filter_float64(channel_decay, with_initial_state):
    gen = torch.Generator().manual_seed(10 + 2 * channel_decay + with_initial_state)
    B, T, H, K, V = 2, 9, 2, 3, 2
    args = kdn_inputs(gen, (B, T, H, K, V), variant="exact", channel_decay=channel_decay)
    P0 = args["P0"].expand(B, H, K, K)
    S0 = torch.zeros(B, H, K, V, dtype=F64)
    initial_state = None
    if with_initial_state:
        S0 = torch.randn(B, H, K, V, generator=gen, dtype=F64)
        X = torch.randn(B, H, K, K, generator=gen, dtype=F64)
        P0 = X @ X.mT + 0.1 * torch.eye(K, dtype=F64)
        initial_state = (S0, P0)
    scale = 0.7
    o, (S, P) = kdn_exact(**args, scale=scale, initial_state=initial_state, output_final_state=True)
    o_ref, S_ref, P_ref, _, _ = textbook_kalman(
        args["q"], args["k"], args["v"], args["g"], args["q_noise"], args["r"], P0, S0, scale
    )
    assert_close(o, torch.from_numpy(o_ref), TOL, "outputs")
    assert_close(S, torch.from_numpy(S_ref), TOL, "memory")
    assert_close(P, torch.from_numpy(P_ref), TOL, "covariance")


@pytest.mark.parametrize("channel_decay", [True, False])
def test_exact_gain_trace_matches_textbook_kalman_filter_float64(channel_decay):
    gen = torch.Generator().manual_seed(30 + channel_decay)
    B, T, H, K, V = 2, 7, 2, 3, 1
    args = kdn_inputs(gen, (B, T, H, K, V), variant="exact", channel_decay=channel_decay)
    P0 = args["P0"].expand(B, H, K, K)
    noise = [args[n] for n in ("k", "g", "q_noise", "r")]
    gain, P, trace = exact_gain(*noise, P0, trace=True)
    untraced = exact_gain(*noise, P0)
    assert torch.equal(untraced[0], gain) and torch.equal(untraced[1], P) and untraced[2] is None
    zeros = torch.zeros(B, H, K, V, dtype=F64)
    *_, predictive, variances = textbook_kalman(
        args["q"], *noise[:1], args["v"], *noise[1:], P0, zeros, 1.0
    )
    assert torch.equal(trace.gain, gain)
    assert_close(trace.predictive, torch.from_numpy(predictive), TOL, "predictive k^T P_bar k")
    assert_close(trace.p, torch.from_numpy(variances), TOL, "diagonal of P_t")


def test_exact_without_final_state_returns_none():
    args = kdn_inputs(torch.Generator().manual_seed(11), (1, 3, 1, 2, 2), variant="exact")
    o, state = kdn_exact(**args)
    assert o.shape == (1, 3, 1, 2) and state is None


@pytest.mark.parametrize("channel_decay", [True, False])
def test_diagonal_equals_exact_for_one_hot_keys(channel_decay):
    """With one-hot keys (any scale) a diagonal covariance stays diagonal, and with s = 1 the
    mean-field precision update is the exact one."""
    gen = torch.Generator().manual_seed(12 + channel_decay)
    B, T, H, K, V = 2, 11, 2, 4, 3
    args = kdn_inputs(gen, (B, T, H, K, V), variant="diag", channel_decay=channel_decay)
    channel = torch.randint(K, (B, T, H), generator=gen)
    size = 0.5 + torch.rand(B, T, H, 1, generator=gen, dtype=F64)
    args["k"] = torch.nn.functional.one_hot(channel, K).to(F64) * size
    o_diag, (S_diag, precision) = kdn_diag(**args, info_scale=1.0, output_final_state=True)
    p0 = args.pop("p0")
    o_exact, (S_exact, P) = kdn_exact(**args, P0=torch.diag_embed(p0), output_final_state=True)
    assert_close(o_diag, o_exact, TOL, "outputs")
    assert_close(S_diag, S_exact, TOL, "memory")
    assert_close(torch.diag_embed(1.0 / precision), P, TOL, "covariance")


def test_isotropic_with_frozen_variance_is_gated_deltanet():
    """Process noise tied to the decay, q = (1 - exp(2 g)) pi, keeps the prior pi stationary;
    with negligible evidence (s = 1e-300) the variance stays pi, and Isotropic KDN must be GDN
    with beta = pi / (pi ||k||^2 + r), written here as its own token loop."""
    gen = torch.Generator().manual_seed(13)
    B, T, H, K, V = 2, 13, 3, 4, 5
    args = kdn_inputs(gen, (B, T, H, K, V), variant="iso", channel_decay=False)
    pi = 0.5 + torch.rand(H, generator=gen, dtype=F64)
    args["p0"] = pi
    args["q_noise"] = (1 - (2 * args["g"]).exp()) * pi
    S0 = torch.randn(B, H, K, V, generator=gen, dtype=F64)
    o, (S, precision) = kdn_iso(
        **args, info_scale=1e-300, initial_state=(S0, None), output_final_state=True
    )
    q, k, v, g, r = (args[n] for n in ("q", "k", "v", "g", "r"))
    beta = pi / (pi * (k * k).sum(-1) + r)
    state, outputs = S0.clone(), []
    for t in range(T):
        state = g[:, t].exp()[..., None, None] * state
        residual = v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], state)
        state = state + beta[:, t, :, None, None] * k[:, t, ..., None] * residual[..., None, :]
        outputs.append(K**-0.5 * torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    assert_close(o, torch.stack(outputs, dim=1), TOL, "outputs")
    assert_close(S, state, TOL, "memory")
    assert_close(precision, (1.0 / pi).expand(B, H), TOL, "the variance stays pi")


@pytest.mark.parametrize("variant", ["iso", "diag"])
def test_vanishing_observation_noise_replaces_the_stored_value(variant):
    """r -> 0 with a large variance: the gain along k is 1, so S_t^T k_t = v_t after every write
    (read with q = k, the output is scale * v)."""
    gen = torch.Generator().manual_seed(14)
    B, T, H, K, V = 2, 17, 2, 4, 3
    args = kdn_inputs(gen, (B, T, H, K, V), variant=variant)
    args["r"] = torch.full_like(args["r"], 1e-12)
    # Large process noise keeps p_bar >= 1 >> r after the first (exact) observation.
    args["q_noise"] = torch.ones_like(args["q_noise"])
    args["p0"] = torch.full_like(args["p0"], 1e6)
    args["q"] = args["k"]
    gain = GAIN[variant](*(args[n] for n in ("k", "g", "q_noise", "r", "p0")))[0]
    along_k = (
        gain * (args["k"] * args["k"]).sum(-1) if variant == "iso" else ((gain * args["k"]).sum(-1))
    )
    assert_close(along_k, torch.ones_like(along_k), 1e-10, "gain along k")
    o, _ = KDN[variant](**args, scale=1.0)
    assert_close(o, args["v"], 1e-9, "S_t^T k_t = v_t")


@pytest.mark.parametrize("variant", ["iso", "diag"])
def test_infinite_observation_noise_writes_nothing(variant):
    """r -> inf: no evidence, so the memory only decays and the variance only grows."""
    gen = torch.Generator().manual_seed(15)
    B, T, H, K, V = 2, 9, 2, 3, 4
    args = kdn_inputs(gen, (B, T, H, K, V), variant=variant)
    args["r"] = torch.full_like(args["r"], 1e30)
    S0 = torch.randn(B, H, K, V, generator=gen, dtype=F64)
    _, (S, precision) = KDN[variant](**args, initial_state=(S0, None), output_final_state=True)
    assert_close(S, args["g"].sum(1).exp()[..., None] * S0, 1e-12, "decayed memory")
    decay2 = (2 * args["g"]).exp()
    p = args["p0"].expand(precision.shape)
    for t in range(T):
        a = decay2[:, t].mean(-1) if variant == "iso" else decay2[:, t]
        p = a * p + args["q_noise"][:, t]
    assert_close(precision, 1.0 / p, 1e-12, "predicted variance only")


@pytest.mark.parametrize("variant", ["iso", "diag"])
@pytest.mark.parametrize("length", [1, 63, 100])
@pytest.mark.parametrize("with_initial_state", [False, True])
def test_chunk_backend_matches_naive_float64(variant, length, with_initial_state):
    gen = torch.Generator().manual_seed(length + with_initial_state)
    B, H, K, V = 2, 2, 4, 3
    args = kdn_inputs(gen, (B, length, H, K, V), variant=variant)
    initial_state = None
    if with_initial_state:
        tail = (H, K) if variant == "diag" else (H,)
        precision = 0.5 + torch.rand(B, *tail, generator=gen, dtype=F64)
        initial_state = (torch.randn(B, H, K, V, generator=gen, dtype=F64), precision)
    results = {
        backend: KDN[variant](
            **args,
            initial_state=initial_state,
            output_final_state=True,
            chunk_size=32,
            backend=backend,
        )
        for backend in ("naive", "chunk")
    }
    (o_naive, (S_naive, p_naive)), (o_chunk, (S_chunk, p_chunk)) = results.values()
    assert_close(o_chunk, o_naive, TOL, "outputs")
    assert_close(S_chunk, S_naive, TOL, "memory")
    assert_close(p_chunk, p_naive, TOL, "precision")


@pytest.mark.parametrize("variant", ["iso", "diag"])
@pytest.mark.parametrize("backend", ["naive", "chunk"])
@pytest.mark.parametrize("with_initial_state", [False, True])
def test_packed_sequences_match_one_by_one(variant, backend, with_initial_state):
    """cu_seqlens restarts both the memory and the variance scan at every boundary."""
    gen = torch.Generator().manual_seed(16 + with_initial_state)
    offsets = [0, 1, 17, 40, 70]
    N, H, K, V = len(offsets) - 1, 2, 3, 4
    args = kdn_inputs(gen, (1, offsets[-1], H, K, V), variant=variant)
    tail = (H, K) if variant == "diag" else (H,)
    args["p0"] = 0.5 + torch.rand(N, *tail, generator=gen, dtype=F64)
    memory, precision = None, None
    if with_initial_state:
        memory = torch.randn(N, H, K, V, generator=gen, dtype=F64)
        precision = 0.5 + torch.rand(N, *tail, generator=gen, dtype=F64)
    o, (S, p) = KDN[variant](
        **args,
        initial_state=(memory, precision),
        output_final_state=True,
        cu_seqlens=torch.tensor(offsets),
        backend=backend,
    )
    pieces = []
    for i in range(N):
        start, end = offsets[i], offsets[i + 1]
        piece = {n: x[:, start:end] for n, x in args.items() if n != "p0"}
        state = (
            None if memory is None else memory[i : i + 1],
            None if precision is None else precision[i : i + 1],
        )
        o_i, (S_i, p_i) = KDN[variant](
            **piece,
            p0=args["p0"][i : i + 1],
            initial_state=state,
            output_final_state=True,
            backend=backend,
        )
        assert_close(S[i : i + 1], S_i, TOL, f"memory of sequence {i}")
        assert_close(p[i : i + 1], p_i, TOL, f"precision of sequence {i}")
        pieces.append(o_i)
    assert_close(o, torch.cat(pieces, dim=1), TOL, "outputs")


@pytest.mark.parametrize("variant", ["iso", "diag"])
@pytest.mark.parametrize("channel_decay", [True, False])
def test_decode_steps_match_full_sequence(variant, channel_decay):
    gen = torch.Generator().manual_seed(17 + channel_decay)
    B, T, H, K, V = 2, 12, 2, 3, 4
    args = kdn_inputs(gen, (B, T, H, K, V), variant=variant, channel_decay=channel_decay)
    tail = (H, K) if variant == "diag" else (H,)
    state = (
        torch.randn(B, H, K, V, generator=gen, dtype=F64),
        0.5 + torch.rand(B, *tail, generator=gen, dtype=F64),
    )
    o, (S, p) = KDN[variant](**args, info_scale=2.5, initial_state=state, output_final_state=True)
    outputs = []
    for t in range(T):
        token = {n: x[:, t] for n, x in args.items() if n != "p0"}
        o_t, state = STEP[variant](**token, state=state, info_scale=2.5)
        outputs.append(o_t)
    assert_close(torch.stack(outputs, dim=1), o, TOL, "outputs")
    assert_close(state[0], S, TOL, "memory")
    assert_close(state[1], p, TOL, "precision")


def iso_gain_loop(k, g, q_noise, r, p0, info_scale):
    """docs/MATH.md sec. 3.2, Isotropic, as written: returns (beta, p, predictive) `[B, T, H]`."""
    batch, length, heads, key_dim = k.shape
    p, betas, variances, predictives = p0.expand(batch, heads), [], [], []
    for t in range(length):
        a = (2 * g[:, t]).exp()
        a = a.mean(-1) if g.dim() == 4 else a
        norm2 = (k[:, t] ** 2).sum(-1)
        p_bar = a * p + q_noise[:, t]
        betas.append(p_bar / (p_bar * norm2 + r[:, t]))
        predictives.append(p_bar * norm2)
        p = 1.0 / (1.0 / p_bar + info_scale * norm2 / (key_dim * r[:, t]))
        variances.append(p)
    return tuple(torch.stack(x, dim=1) for x in (betas, variances, predictives))


def diag_gain_loop(k, g, q_noise, r, p0, info_scale):
    """docs/MATH.md sec. 3.1, Diagonal, as written: returns (gain, p) `[B, T, H, K]` and
    predictive `[B, T, H]`."""
    batch, length, heads, key_dim = k.shape
    p, gains, variances, predictives = p0.expand(batch, heads, key_dim), [], [], []
    for t in range(length):
        a = (2 * g[:, t]).exp()
        a = a if g.dim() == 4 else a.unsqueeze(-1)
        r_t = r[:, t, :, None]
        p_bar = a * p + q_noise[:, t]
        gains.append(p_bar * k[:, t] / ((p_bar * k[:, t] ** 2).sum(-1, keepdim=True) + r_t))
        predictives.append((p_bar * k[:, t] ** 2).sum(-1))
        p = 1.0 / (1.0 / p_bar + info_scale * k[:, t] ** 2 / r_t)
        variances.append(p)
    return tuple(torch.stack(x, dim=1) for x in (gains, variances, predictives))


@pytest.mark.parametrize("variant", ["iso", "diag"])
@pytest.mark.parametrize("channel_decay", [True, False])
@pytest.mark.parametrize("info_scale", [None, 1.0])
def test_gain_scan_matches_python_loop_of_the_recurrence(variant, channel_decay, info_scale):
    gen = torch.Generator().manual_seed(18)
    B, T, H, K = 2, 37, 3, 5
    args = kdn_inputs(gen, (B, T, H, K, 1), variant=variant, channel_decay=channel_decay)
    inputs = [args[n] for n in ("k", "g", "q_noise", "r", "p0")]
    gain, p, final_precision = GAIN[variant](*inputs, info_scale=info_scale)
    loop = iso_gain_loop if variant == "iso" else diag_gain_loop
    gain_ref, p_ref, predictive_ref = loop(*inputs, K if info_scale is None else info_scale)
    assert_close(gain, gain_ref, TOL, "gain")
    assert_close(p, p_ref, TOL, "posterior variance")
    assert_close(final_precision, 1.0 / p_ref[:, -1], TOL, "final precision")
    *same, predictive = GAIN[variant](*inputs, info_scale=info_scale, output_predictive=True)
    for name, a, b in zip(("gain", "p", "final"), same, (gain, p, final_precision), strict=True):
        assert torch.equal(a, b), name
    assert_close(predictive, predictive_ref, TOL, "predictive variance k^T P_bar k")


@pytest.mark.parametrize("variant", ["iso", "diag"])
def test_gains_streamed_in_pieces_match_one_pass(variant):
    gen = torch.Generator().manual_seed(19)
    args = kdn_inputs(gen, (2, 30, 2, 3, 1), variant=variant)
    inputs = [args[n] for n in ("k", "g", "q_noise", "r")]
    gain, p, final = GAIN[variant](*inputs, args["p0"])
    first = GAIN[variant](*(x[:, :11] for x in inputs), args["p0"])
    second = GAIN[variant](*(x[:, 11:] for x in inputs), args["p0"], initial_precision=first[2])
    assert_close(torch.cat([first[0], second[0]], dim=1), gain, TOL, "gain")
    assert_close(torch.cat([first[1], second[1]], dim=1), p, TOL, "variance")
    assert_close(second[2], final, TOL, "final precision")


def test_diagonal_per_head_prior_is_broadcast_over_channels():
    """Issue 9 item 12: p0 `[H]` is the prior `[H, K]` with one value per head, gradients
    included (they sum over the channels)."""
    gen = torch.Generator().manual_seed(25)
    B, T, H, K, V = 2, 9, 3, 4, 2
    args = kdn_inputs(gen, (B, T, H, K, V), variant="diag")
    per_head = (0.5 + torch.rand(H, generator=gen, dtype=F64)).requires_grad_()
    shared = per_head.detach().unsqueeze(-1).expand(H, K).clone().requires_grad_()
    gates = [args[n] for n in ("k", "g", "q_noise", "r")]
    for fn in (kdn_gain_diag, lambda *a: kdn_diag(args["q"], a[0], args["v"], *a[1:])):
        head_out = fn(*gates, per_head)[0]
        shared_out = fn(*gates, shared)[0]
        assert_close(head_out, shared_out, 0.0, "per-head prior vs its [H, K] broadcast")
        weights = torch.randn(head_out.shape, generator=gen, dtype=F64)
        (grad_head,) = torch.autograd.grad((head_out * weights).sum(), per_head)
        (grad_shared,) = torch.autograd.grad((shared_out * weights).sum(), shared)
        assert_close(grad_head, grad_shared.sum(-1), TOL, "d/dp0 sums over channels")


@pytest.mark.parametrize("variant", ["iso", "diag"])
@pytest.mark.parametrize("from_precision", [False, True])
def test_gain_gradients_match_finite_differences(variant, from_precision):
    gen = torch.Generator().manual_seed(20)
    B, T, H, K = 2, 5, 2, 3
    args = kdn_inputs(gen, (B, T, H, K, 1), variant=variant)
    tail = (H, K) if variant == "diag" else (H,)
    start = 0.5 + torch.rand(B, *tail, generator=gen, dtype=F64)
    leaves = [args[n].requires_grad_() for n in ("k", "g", "q_noise", "r", "p0")]
    leaves.append(start.requires_grad_())

    def gains(k, g, q_noise, r, p0, precision):
        initial = precision if from_precision else None
        return GAIN[variant](k, g, q_noise, r, p0, initial_precision=initial)

    assert torch.autograd.gradcheck(gains, tuple(leaves))


@pytest.mark.parametrize("variant", ["iso", "diag"])
@pytest.mark.parametrize("backend", ["naive", "chunk"])
def test_kdn_gradients_match_finite_differences(variant, backend):
    gen = torch.Generator().manual_seed(21)
    args = kdn_inputs(gen, (1, 5, 1, 2, 2), variant=variant)
    names = list(args)
    leaves = tuple(args[n].requires_grad_() for n in names)

    def run(*xs):
        o, (S, p) = KDN[variant](
            **dict(zip(names, xs, strict=True)),
            output_final_state=True,
            chunk_size=16,
            backend=backend,
        )
        return o, S, p

    # Fast mode checks a random directional derivative: the per-element check of the gains is
    # above, this one checks the wiring into delta_rule at a fraction of the cost.
    assert torch.autograd.gradcheck(run, leaves, fast_mode=True)


def test_exact_gradients_match_finite_differences():
    gen = torch.Generator().manual_seed(22)
    args = kdn_inputs(gen, (1, 4, 1, 2, 2), variant="exact")
    root = torch.randn(1, 2, 2, generator=gen, dtype=F64)
    names = [n for n in args if n != "P0"]
    leaves = (*(args[n].requires_grad_() for n in names), root.requires_grad_())

    def run(*xs):
        # P0 through a symmetric positive definite parametrization, so that finite
        # differences stay valid inputs.
        P0 = xs[-1] @ xs[-1].mT + torch.eye(2, dtype=F64)
        inputs = dict(zip(names, xs[:-1], strict=True))
        o, (S, P) = kdn_exact(**inputs, P0=P0, output_final_state=True)
        return o, S, P

    assert torch.autograd.gradcheck(run, leaves, fast_mode=True)


def test_float32_inputs_give_float32_gains_close_to_float64():
    gen = torch.Generator().manual_seed(23)
    args = kdn_inputs(gen, (2, 300, 2, 8, 4), variant="iso")
    o64, (S64, p64) = kdn_iso(**args, output_final_state=True)
    o32, (S32, p32) = kdn_iso(**{n: x.float() for n, x in args.items()}, output_final_state=True)
    assert o32.dtype == S32.dtype == p32.dtype == torch.float32
    for name, lo, hi in (("o", o32, o64), ("memory", S32, S64), ("precision", p32, p64)):
        assert_close(lo, hi, TOLERANCE[torch.float32], name)


def valid_arguments(fn_name: str) -> dict[str, object]:
    gen = torch.Generator().manual_seed(24)
    B, T, H, K, V = 2, 4, 2, 3, 2
    variant = {"kdn_exact": "exact"}.get(fn_name, "diag" if "diag" in fn_name else "iso")
    args = kdn_inputs(gen, (B, T, H, K, V), variant=variant)
    if fn_name.startswith("kdn_gain"):
        return {n: args[n] for n in ("k", "g", "q_noise", "r", "p0")}
    if fn_name.endswith("_step"):
        tokens = {n: x[:, 0] for n, x in args.items() if n != "p0"}
        precision = 1.0 / args["p0"].expand(B, *args["p0"].shape)
        return {**tokens, "state": (torch.zeros(B, H, K, V, dtype=F64), precision)}
    return args


FUNCTIONS = {
    "kdn_iso": kdn_iso,
    "kdn_diag": kdn_diag,
    "kdn_exact": kdn_exact,
    "kdn_gain_iso": kdn_gain_iso,
    "kdn_gain_diag": kdn_gain_diag,
    "kdn_iso_step": kdn_iso_step,
    "kdn_diag_step": kdn_diag_step,
}
BAD_INPUTS = [
    ("kdn_iso", lambda a: {"r": a["r"] * 0}, ValueError, "r must be > 0"),
    ("kdn_diag", lambda a: {"r": -a["r"]}, ValueError, "r must be > 0"),
    ("kdn_exact", lambda a: {"r": a["r"] * 0}, ValueError, "r must be > 0"),
    ("kdn_diag_step", lambda a: {"r": a["r"] * 0}, ValueError, "r must be > 0"),
    ("kdn_gain_iso", lambda a: {"q_noise": a["q_noise"] - 1}, ValueError, "q_noise must be >= 0"),
    ("kdn_gain_diag", lambda a: {"q_noise": a["q_noise"] - 1}, ValueError, "q_noise must be >="),
    ("kdn_exact", lambda a: {"q_noise": a["q_noise"] - 1}, ValueError, "q_noise must be >= 0"),
    ("kdn_iso", lambda a: {"q_noise": a["q_noise"] / 0}, ValueError, "q_noise must be finite"),
    ("kdn_diag", lambda a: {"q_noise": a["q_noise"] / 0}, ValueError, "q_noise must be finite"),
    ("kdn_exact", lambda a: {"q_noise": a["q_noise"] / 0}, ValueError, "q_noise must be finite"),
    ("kdn_iso_step", lambda a: {"q_noise": a["q_noise"] / 0}, ValueError, "q_noise must be fin"),
    (
        "kdn_iso",
        lambda a: {"q_noise": a["q_noise"] * float("nan")},
        ValueError,
        "q_noise .* got NaN",
    ),
    (
        "kdn_diag",
        lambda a: {"q_noise": a["q_noise"] * float("nan")},
        ValueError,
        "q_noise .* got NaN",
    ),
    ("kdn_exact", lambda a: {"r": a["r"] / 0}, ValueError, r"r must be finite .* got inf at"),
    ("kdn_diag", lambda a: {"r": a["r"] / 0}, ValueError, r"r must be finite .* got inf at"),
    ("kdn_iso", lambda a: {"k": a["k"][..., :0]}, ValueError, r"k must have K >= 1"),
    ("kdn_diag", lambda a: {"v": a["v"][..., :0]}, ValueError, r"v must have V >= 1"),
    ("kdn_iso", lambda a: {"p0": a["p0"] * 0}, ValueError, "p0 must be > 0"),
    ("kdn_gain_diag", lambda a: {"p0": -a["p0"]}, ValueError, "p0 must be > 0"),
    ("kdn_diag", lambda a: {"p0": a["p0"] / 0}, ValueError, "p0 must be finite"),
    (
        "kdn_gain_iso",
        lambda a: {"initial_precision": torch.zeros(2, 2, dtype=F64)},
        ValueError,
        "initial_precision must be > 0",
    ),
    ("kdn_exact", lambda a: {"P0": -a["P0"]}, ValueError, "P0 must be positive definite"),
    (
        "kdn_exact",
        lambda a: {"P0": a["P0"] + torch.triu(torch.ones(3, 3, dtype=F64), 1)},
        ValueError,
        "P0 must be symmetric",
    ),
    ("kdn_exact", lambda a: {"P0": a["P0"][:, :2, :2]}, ValueError, "P0 must have shape"),
    (
        "kdn_exact",
        lambda a: {"initial_state": (None, torch.ones(2, 2, 3, 3, dtype=F64).triu())},
        ValueError,
        r"initial_state\[1\] must be symmetric",
    ),
    ("kdn_iso", lambda a: {"info_scale": 0.0}, ValueError, "info_scale"),
    ("kdn_gain_diag", lambda a: {"info_scale": -1}, ValueError, "info_scale"),
    ("kdn_diag", lambda a: {"info_scale": "K"}, TypeError, "info_scale"),
    ("kdn_iso_step", lambda a: {"info_scale": 0}, ValueError, "info_scale"),
    ("kdn_iso", lambda a: {"g": a["g"] + 2}, ValueError, "g must be <= 0"),
    ("kdn_gain_diag", lambda a: {"g": a["g"] + 2}, ValueError, "g must be <= 0"),
    ("kdn_exact", lambda a: {"g": a["g"] + 2}, ValueError, "g must be <= 0"),
    ("kdn_diag_step", lambda a: {"g": a["g"] + 2}, ValueError, "g must be <= 0"),
    ("kdn_iso", lambda a: {"r": a["r"][:, :-1]}, ValueError, "r must have shape"),
    ("kdn_iso", lambda a: {"q_noise": a["k"].abs()}, ValueError, "q_noise must have shape"),
    ("kdn_diag", lambda a: {"q_noise": a["r"]}, ValueError, "q_noise must have shape"),
    ("kdn_iso", lambda a: {"v": a["v"][:, :-1]}, ValueError, "v must have shape"),
    ("kdn_diag", lambda a: {"q": a["q"][..., :-1]}, ValueError, "q must have shape"),
    ("kdn_iso", lambda a: {"g": a["g"][..., :-1]}, ValueError, "g must have shape"),
    ("kdn_gain_iso", lambda a: {"p0": a["p0"][:-1]}, ValueError, "p0 must have shape"),
    ("kdn_diag", lambda a: {"p0": a["p0"][:, :1]}, ValueError, "p0 must have shape"),
    ("kdn_diag", lambda a: {"p0": a["p0"][0, 0]}, ValueError, "p0 must have rank"),
    ("kdn_diag", lambda a: {"p0": a["p0"][:1, 0]}, ValueError, r"p0 must have shape \[H\]"),
    ("kdn_gain_diag", lambda a: {"p0": -a["p0"][:, 0]}, ValueError, "p0 must be > 0"),
    ("kdn_gain_iso", lambda a: {"backend": "chunk"}, ValueError, "backend must be one of"),
    ("kdn_gain_iso", lambda a: {"k": a["k"][0]}, ValueError, "k must have rank"),
    ("kdn_gain_iso", lambda a: {"k": a["k"][:, :0]}, ValueError, r"T >= 1"),
    ("kdn_iso", lambda a: {"k": a["k"].long()}, TypeError, "k must be a floating-point"),
    ("kdn_iso", lambda a: {"initial_state": a["p0"]}, TypeError, "initial_state must be None or"),
    (
        "kdn_iso",
        lambda a: {"initial_state": (None, torch.ones(2, 3, dtype=F64))},
        ValueError,
        r"initial_state\[1\] must have shape",
    ),
    (
        "kdn_diag",
        lambda a: {"initial_state": (torch.zeros(2, 2, 3, 5), None)},
        ValueError,
        "initial_state must have shape",
    ),
    ("kdn_iso", lambda a: {"backend": "fast"}, ValueError, "backend must be one of"),
    ("kdn_iso", lambda a: {"cu_seqlens": torch.tensor([0, 4])}, ValueError, "cu_seqlens"),
    ("kdn_iso_step", lambda a: {"state": None}, TypeError, "state must be a pair"),
    (
        "kdn_iso_step",
        lambda a: {"state": (a["state"][0], a["state"][1][:, :1])},
        ValueError,
        r"state\[1\] must have shape",
    ),
    (
        "kdn_diag_step",
        lambda a: {"state": (a["state"][0], -a["state"][1])},
        ValueError,
        r"state\[1\] must be > 0",
    ),
    ("kdn_diag_step", lambda a: {"q_noise": a["r"]}, ValueError, "q_noise must have shape"),
]


@pytest.mark.parametrize(
    ("fn_name", "change", "error", "match"),
    BAD_INPUTS,
    ids=[f"{case[0]}-{case[3]}" for case in BAD_INPUTS],
)
def test_bad_inputs_raise_naming_the_argument(fn_name, change, error, match):
    args = valid_arguments(fn_name)
    FUNCTIONS[fn_name](**args)
    with pytest.raises(error, match=match):
        FUNCTIONS[fn_name](**{**args, **change(args)})


@pytest.mark.skipif(INTERPRET, reason="under TRITON_INTERPRET=1 the Triton scan runs on CPU")
@pytest.mark.parametrize("fn_name", ["kdn_iso", "kdn_diag", "kdn_gain_iso", "kdn_gain_diag"])
def test_triton_backend_on_cpu_says_it_needs_the_interpreter(fn_name):
    # tests/test_mobius_triton.py runs these ops on the Triton scan (GPU, or the interpreter).
    with pytest.raises(RuntimeError, match='backend="triton" cannot run here'):
        FUNCTIONS[fn_name](**valid_arguments(fn_name), backend="triton")


@pytest.mark.parametrize("variant", ["iso", "diag", "exact"])
def test_kdn_ops_hand_their_kernel_options_to_the_delta_rule(monkeypatch, variant):
    """The options a KDN op takes reach the delta rule that runs its memory, as given; None
    (the default) stays None, the delta rule's defaults."""
    from deltalab.ops.kdn import exact, mixers

    seen = []
    module = exact if variant == "exact" else mixers
    original = module.delta_rule

    def spy(*args, **kwargs):
        seen.append(kwargs.get("options"))
        return original(*args, **kwargs)

    monkeypatch.setattr(module, "delta_rule", spy)
    args = kdn_inputs(torch.Generator().manual_seed(12), (1, 3, 2, 2, 2), variant=variant)
    op = kdn_exact if variant == "exact" else KDN[variant]
    options = KernelOptions(checkpoint_every=2, walk_dots="float32")
    op(**args)
    op(**args, options=options)
    assert seen[0] is None and seen[1] is options


def kdn_import_cycle(folder: Path) -> list[str] | None:
    """A cycle among the modules of `folder` (deltalab/ops/kdn) by their imports, module-level or
    inside functions alike (a function's import closes a cycle when it runs), or None."""
    package = "deltalab.ops.kdn"
    names = {path.stem for path in folder.glob("*.py")}
    imports: dict[str, set[str]] = {}
    for name in names:
        found = set()
        for node in ast.walk(ast.parse((folder / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                module = node.module if node.level == 0 else f"{package}.{node.module}"
                found |= {f"{module}.{alias.name}" for alias in node.names} | {module}
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
        imports[name] = {m.rsplit(".", 1)[1] for m in found if m.startswith(f"{package}.")}
        imports[name] = (imports[name] & names) - {name, "__init__"}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str] | None:
        if name in path:
            return [*path[path.index(name) :], name]
        if name in done:
            return None
        for other in sorted(imports[name]):
            if cycle := visit(other, [*path, name]):
                return cycle
        done.add(name)
        return None

    return next((c for n in sorted(names) if (c := visit(n, [])) is not None), None)


def test_kdn_modules_import_one_another_without_a_cycle():
    """Each Triton module of the KDN ops imports only those below it (the carry passes, then the
    variance scan, then the gains' kernels), so none needs another imported inside a function."""
    folder = Path(deltalab.ops.kdn.__file__).parent
    assert kdn_import_cycle(folder) is None
    triton_modules = sorted(folder.glob("triton*.py"))
    assert len(triton_modules) >= 4
    for path in triton_modules:
        calls = [
            node.func.id
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        ]
        assert "getattr" not in calls, f"{path.name} fetches something by name"
