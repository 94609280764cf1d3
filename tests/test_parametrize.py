"""Each mixer's parametrization of delta_rule against its recurrence as its paper writes it.

DeltaNet, Gated DeltaNet and GDN-2 papers keep the state as S in R^{V x K} with o_t = S_t q_t;
Kimi Delta Attention writes S in R^{K x V}. The loops below follow each paper's own layout.
"""

from __future__ import annotations

import pytest
import torch

from deltalab.ops import delta_rule
from deltalab.ops.parametrize import deltanet_inputs, gated_deltanet_inputs, gdn2_inputs, kda_inputs
from deltalab.testing import TOLERANCE, assert_close

F64 = TOLERANCE[torch.float64]
B, T, H, K, V = 2, 37, 2, 6, 5


@pytest.fixture
def qkv(generator):
    q = torch.randn(B, T, H, K, generator=generator, dtype=torch.float64)
    k = torch.nn.functional.normalize(
        torch.randn(B, T, H, K, generator=generator, dtype=torch.float64), dim=-1
    )
    v = torch.randn(B, T, H, V, generator=generator, dtype=torch.float64)
    beta = torch.rand(B, T, H, generator=generator, dtype=torch.float64)
    return q, k, v, beta


def run_paper_loop(step, q, initial):
    """Applies `step(t, S) -> S` for every token; returns o_t = S_t q_t (V x K layout)."""
    S, outputs = initial, []
    for t in range(T):
        S = step(t, S)
        outputs.append(torch.einsum("bhvk,bhk->bhv", S, q[:, t]))
    return torch.stack(outputs, dim=1)


def primitive(inputs):
    return delta_rule(*inputs, scale=1.0, backend="chunk", chunk_size=16)[0]


def test_deltanet_matches_its_recurrence(qkv):
    q, k, v, beta = qkv

    # S_t = S_{t-1} - beta_t (S_{t-1} k_t - v_t) k_t^T
    def step(t, S):
        kt, vt, bt = k[:, t], v[:, t], beta[:, t, :, None, None]
        prediction = torch.einsum("bhvk,bhk->bhv", S, kt)
        return S - bt * torch.einsum("bhv,bhk->bhvk", prediction - vt, kt)

    expected = run_paper_loop(step, q, torch.zeros(B, H, V, K, dtype=torch.float64))
    assert_close(primitive(deltanet_inputs(q, k, v, beta)), expected, F64)


def test_gated_deltanet_matches_its_recurrence(qkv, generator):
    q, k, v, beta = qkv
    g = -torch.rand(B, T, H, generator=generator, dtype=torch.float64)

    # S_t = S_{t-1} (alpha_t (I - beta_t k_t k_t^T)) + beta_t v_t k_t^T
    def step(t, S):
        kt, vt, bt, alpha = (
            k[:, t],
            v[:, t],
            beta[:, t, :, None, None],
            g[:, t, :, None, None].exp(),
        )
        eye = torch.eye(K, dtype=torch.float64)
        transition = alpha * (eye - bt * torch.einsum("bhi,bhj->bhij", kt, kt))
        return S @ transition + bt * torch.einsum("bhv,bhk->bhvk", vt, kt)

    expected = run_paper_loop(step, q, torch.zeros(B, H, V, K, dtype=torch.float64))
    assert_close(primitive(gated_deltanet_inputs(q, k, v, beta, g)), expected, F64)


def test_kda_matches_its_recurrence(qkv, generator):
    q, k, v, beta = qkv
    g = -torch.rand(B, T, H, K, generator=generator, dtype=torch.float64)

    # S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T   (S in K x V)
    S, outputs = torch.zeros(B, H, K, V, dtype=torch.float64), []
    eye = torch.eye(K, dtype=torch.float64)
    for t in range(T):
        kt, vt, bt = k[:, t], v[:, t], beta[:, t, :, None, None]
        erase = eye - bt * torch.einsum("bhi,bhj->bhij", kt, kt)
        S = erase @ (torch.diag_embed(g[:, t].exp()) @ S) + bt * torch.einsum(
            "bhk,bhv->bhkv", kt, vt
        )
        outputs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    assert_close(primitive(kda_inputs(q, k, v, beta, g)), torch.stack(outputs, dim=1), F64)


def test_gdn2_matches_its_recurrence(qkv, generator):
    q, k, v, _ = qkv
    erase = torch.rand(B, T, H, K, generator=generator, dtype=torch.float64)
    write = torch.rand(B, T, H, V, generator=generator, dtype=torch.float64)
    g = -torch.rand(B, T, H, K, generator=generator, dtype=torch.float64)

    # Decay, then erase along the gated key, then write the gated value:
    # S' = S_{t-1} Diag(alpha_t);  S_t = S' (I - (b_t * k_t) k_t^T) + (w_t * v_t) k_t^T
    def step(t, S):
        kt = k[:, t]
        decayed = S * g[:, t].exp().unsqueeze(-2)
        erased = decayed - torch.einsum(
            "bhv,bhk->bhvk", torch.einsum("bhvk,bhk->bhv", decayed, erase[:, t] * kt), kt
        )
        return erased + torch.einsum("bhv,bhk->bhvk", write[:, t] * v[:, t], kt)

    expected = run_paper_loop(step, q, torch.zeros(B, H, V, K, dtype=torch.float64))
    assert_close(primitive(gdn2_inputs(q, k, v, erase, write, g)), expected, F64)


def test_parametrizations_reject_mismatched_gates(qkv):
    q, k, v, beta = qkv
    with pytest.raises(ValueError, match=r"beta must have shape"):
        deltanet_inputs(q, k, v, beta[..., :1])
    with pytest.raises(ValueError, match=r"g must have shape .*one log decay per head"):
        gated_deltanet_inputs(q, k, v, beta, -torch.rand(B, T, H, K))
    with pytest.raises(ValueError, match=r"g must have shape .*one log decay per key channel"):
        kda_inputs(q, k, v, beta, -torch.rand(B, T, H))
    with pytest.raises(ValueError, match=r"write must have shape"):
        gdn2_inputs(
            q, k, v, torch.rand(B, T, H, K), torch.rand(B, T, H, K), -torch.rand(B, T, H, K)
        )
