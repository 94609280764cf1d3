"""The definition of the generalized delta rule: a token loop (exact in float64).

    S_t = (I - a_t b_t^T) diag(exp(g_t)) S_{t-1} + a_t u_t^T,      o_t = S_t^T q_t

Written as decay, corrected residual, rank-one write:
    S' = diag(exp(g_t)) S_{t-1};  nu_t = u_t - S'^T b_t;  S_t = S' + a_t nu_t^T.
"""

from __future__ import annotations

import itertools

import torch

from deltalab.ops.parametrize import DeltaRuleInputs


def delta_rule_token(
    token: DeltaRuleInputs, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of every sequence.

    token: q, a, b `[B, H, K]`; u `[B, H, V]`; g `[B, H, K]` or `[B, H]`. state: [B, H, K, V].
    Returns (o [B, H, V], new state [B, H, K, V]). `q` carries the output scale already.
    """
    q, a, b, u, g = token
    decay = g.exp()
    decay = decay.unsqueeze(-1) if g.dim() == q.dim() else decay[..., None, None]
    state = decay * state
    nu = u - torch.einsum("bhk,bhkv->bhv", b, state)
    state = state + a.unsqueeze(-1) * nu.unsqueeze(-2)
    return torch.einsum("bhk,bhkv->bhv", q, state), state


def _run(inputs: DeltaRuleInputs, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    outputs = []
    for t in range(inputs.q.shape[1]):
        o_t, state = delta_rule_token(DeltaRuleInputs(*(x[:, t] for x in inputs)), state)
        outputs.append(o_t)
    return torch.stack(outputs, dim=1), state


def delta_rule_naive(
    inputs: DeltaRuleInputs, initial_state: torch.Tensor, cu_seqlens: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token loop over validated inputs already scaled and cast to the state dtype.

    inputs: q, a, b [B, T, H, K]; u [B, T, H, V]; g [B, T, H(, K)]. initial_state: [N, H, K, V];
    cu_seqlens: the packed-sequence boundaries [N+1] (B == 1, int64 on the inputs' device) or
    None. Returns (o [B, T, H, V], final state [N, H, K, V]).
    """
    if cu_seqlens is None:
        return _run(inputs, initial_state)
    # The definition runs each sequence alone, sliced by Python offsets: one device -> host sync
    # (this backend is a Python loop over tokens, so one more read back costs nothing).
    offsets = cu_seqlens.tolist()
    outputs, finals = [], []
    for i, (start, end) in enumerate(itertools.pairwise(offsets)):
        piece = DeltaRuleInputs(*(x[:, start:end] for x in inputs))
        o_i, s_i = _run(piece, initial_state[i : i + 1])
        outputs.append(o_i)
        finals.append(s_i)
    return torch.cat(outputs, dim=1), torch.cat(finals, dim=0)
