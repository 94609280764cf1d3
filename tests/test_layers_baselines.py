"""The baseline token mixers: shapes, gradients, exact decoding, parameter counts, reductions.

Every mixer follows `forward(x [B, T, D], state=None, *, return_gates=False) -> (y, state)`.
Decoding tests run in float64 (`.double()` on the module) so that "equal" means equal to rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from conftest import run_in_pieces
from torch import nn

import deltalab.layers.recurrence as recurrence
from deltalab.layers import (
    Attention,
    AttentionState,
    DeltaNet,
    DiagonalKDN,
    ExactKDN,
    GatedDeltaNet,
    GatedDeltaNet2,
    GatedRMSNorm,
    IsotropicKDN,
    KDNMuir,
    KimiDeltaAttention,
    Muir,
    RecurrentState,
    ShortConvolution,
)
from deltalab.ops import delta_rule
from deltalab.ops.parametrize import gated_deltanet_inputs, kda_inputs
from deltalab.testing import TOLERANCE, assert_close

F64 = TOLERANCE[torch.float64]
# Chunked float32 vs token-by-token float32: different summation orders, same contraction.
F32_DECODE = 1e-5
D, H, K = 32, 2, 16
SIZES = {"hidden_size": D, "num_heads": H, "head_dim": K}
WINDOW = 5

MIXERS: dict[str, Callable[..., nn.Module]] = {
    "deltanet": DeltaNet,
    "gdn": GatedDeltaNet,
    "kda": KimiDeltaAttention,
    "gdn2": GatedDeltaNet2,
    "attention": Attention,
    "sliding": lambda **kw: Attention(window=WINDOW, **kw),
}
RECURRENT = ("deltanet", "gdn", "kda", "gdn2")


def build(name: str, seed: int = 0, **overrides) -> nn.Module:
    """The mixer `name` with its parameters drawn from `seed`, leaving the global RNG as it was."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return MIXERS[name](**{**SIZES, **overrides})


def hidden(generator: torch.Generator, length: int, batch: int = 2, dtype=torch.float64):
    return torch.randn(batch, length, D, generator=generator, dtype=dtype)


def state_tensors(state) -> dict[str, torch.Tensor]:
    if isinstance(state, RecurrentState):
        names = ("memory", "conv_q", "conv_k", "conv_v")
    else:
        names = ("key", "value")
    return {name: getattr(state, name) for name in names}


@pytest.mark.parametrize("name", MIXERS)
@pytest.mark.parametrize("value_dim", [None, 8])
def test_output_shape_and_state_types(name, value_dim, generator):
    mixer = build(name, value_dim=value_dim)
    x = hidden(generator, 11, dtype=torch.float32)
    y, state = mixer(x)
    assert y.shape == x.shape and y.dtype == torch.float32
    V = K if value_dim is None else value_dim
    if name in RECURRENT:
        assert isinstance(state, RecurrentState)
        assert state.memory.shape == (2, H, K, V)
        assert state.conv_q.shape == state.conv_k.shape == (2, H * K, 3)
        assert state.conv_v.shape == (2, H * V, 3)
    else:
        assert isinstance(state, AttentionState)
        cached = 11 if name == "attention" else WINDOW - 1
        assert state.key.shape == (2, cached, H, K)
        assert state.value.shape == (2, cached, H, V)
        assert state.offset == 11
    assert state.gates is None


@pytest.mark.parametrize("name", MIXERS)
def test_gradient_reaches_every_parameter(name, generator):
    mixer = build(name)
    x = hidden(generator, 20, dtype=torch.float32)
    y, _ = mixer(x)
    (y * torch.randn(y.shape, generator=generator)).sum().backward()
    for param_name, param in mixer.named_parameters():
        assert param.grad is not None, param_name
        assert torch.isfinite(param.grad).all(), param_name
        assert param.grad.abs().sum() > 0, param_name


@pytest.mark.parametrize("name", MIXERS)
@pytest.mark.parametrize(
    "pieces",
    [[1] * 23, [9, 1, 1, 5, 7], [22, 1]],
    ids=["token_by_token", "prefill_then_mixed", "prefill_then_step"],
)
def test_decoding_with_state_matches_full_forward_float64(name, pieces, generator):
    # Chunks of 16 put chunk boundaries inside the 23 tokens and inside the pieces.
    mixer = build(name, **({"chunk_size": 16} if name in RECURRENT else {})).double()
    x = hidden(generator, 23)
    y_full, state_full = mixer(x)
    y_steps, state_steps = run_in_pieces(mixer, x, pieces)
    assert_close(y_steps, y_full, F64, "output")
    full, steps = state_tensors(state_full), state_tensors(state_steps)
    for field, tensor in full.items():
        assert_close(steps[field], tensor, F64, field)
    if name == "sliding":
        assert state_steps.key.shape[1] == WINDOW - 1
    if name in ("attention", "sliding"):
        assert state_steps.offset == state_full.offset == 23


@pytest.mark.parametrize("name", MIXERS)
def test_decoding_matches_full_forward_float32(name, generator):
    mixer = build(name)
    x = hidden(generator, 23, dtype=torch.float32)
    y_full, _ = mixer(x)
    y_steps, _ = run_in_pieces(mixer, x, [7] + [1] * 16)
    assert_close(y_steps, y_full, F32_DECODE, "output")


@pytest.mark.parametrize("name", MIXERS)
def test_same_seed_gives_same_layer_and_output(name, generator):
    x = hidden(generator, 9, dtype=torch.float32)
    first, second, other = build(name, seed=3), build(name, seed=3), build(name, seed=4)
    for (key, p1), (_, p2) in zip(
        first.state_dict().items(), second.state_dict().items(), strict=True
    ):
        assert torch.equal(p1, p2), key
    assert torch.equal(first(x)[0], second(x)[0])
    assert not torch.equal(first(x)[0], other(x)[0])


def hand_count(name: str) -> int:
    """Parameters of each mixer at D = 32, H = 2, K = V = 16, conv 4, counted by hand."""
    HK = HV = H * K
    qkv = D * HK + D * HK + D * HV
    convs = 4 * (HK + HK + HV)
    o_norm, o_proj = K, HV * D
    frontend = qkv + convs + o_norm + o_proj
    full_gate = D * HV
    beta = D * H
    scalar_decay = D * H + H + H  # a_proj, A_log, dt_bias
    if name == "deltanet":
        return frontend + full_gate + beta
    if name == "gdn":
        return frontend + full_gate + beta + scalar_decay
    if name == "kda":
        rank = K  # fla KDA: decay and output gate both of rank head_dim
        low_rank_gate = D * rank + rank * HV + HV  # second projection has a bias
        channel_decay = D * rank + rank * HK + H + HK  # f_proj, A_log, dt_bias
        return frontend + low_rank_gate + channel_decay + beta
    if name == "gdn2":
        rank = min(128, D)
        low_rank_gate = D * rank + rank * HV + HV
        channel_decay = D * rank + rank * HK + H + HK
        erase, write = D * HK, D * HV
        return frontend + low_rank_gate + channel_decay + erase + write
    return 4 * D * HK  # attention: q, k, v, o projections


@pytest.mark.parametrize("name", MIXERS)
def test_parameter_count_matches_hand_count(name):
    mixer = build(name)
    # A sliding window adds no parameters.
    expected = hand_count("attention" if name == "sliding" else name)
    assert sum(p.numel() for p in mixer.parameters()) == expected


def test_hand_counts_are_the_expected_numbers():
    # Guards the formula above against drifting along with the code.
    counts = {name: hand_count(name) for name in ("deltanet", "gdn", "kda", "gdn2", "attention")}
    assert counts == {
        "deltanet": 5584,
        "gdn": 5652,
        "kda": 6674,
        "gdn2": 10706,
        "attention": 4096,
    }


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("deltanet", {"beta": (2, 7, H)}),
        ("gdn", {"beta": (2, 7, H), "g": (2, 7, H)}),
        ("kda", {"beta": (2, 7, H), "g": (2, 7, H, K)}),
        ("gdn2", {"erase": (2, 7, H, K), "write": (2, 7, H, 8), "g": (2, 7, H, K)}),
        ("attention", {}),
    ],
)
def test_return_gates_puts_the_gates_on_the_state(name, expected, generator):
    mixer = build(name, value_dim=8)
    _, state = mixer(hidden(generator, 7, dtype=torch.float32), return_gates=True)
    assert {k: tuple(v.shape) for k, v in state.gates.items()} == expected
    for gate_name, gate in state.gates.items():
        if gate_name == "g":
            assert (gate <= 0).all()
        else:
            assert ((gate > 0) & (gate < 1)).all()


def copy_shared(source: nn.Module, target: nn.Module, skip: set[str], target_own: set[str]) -> None:
    """Copies every parameter of `source` but `skip` into `target`; the parameters of `target`
    left out must be exactly `target_own`, so nothing shared is forgotten."""
    shared = {k: v for k, v in source.state_dict().items() if k not in skip}
    result = target.load_state_dict(shared, strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) == target_own


@torch.no_grad()
def test_gdn2_with_tied_scalar_gates_equals_kda(generator):
    """erase = write = beta broadcast: (I - k (beta k)^T) D S + k (beta v)^T is KDA's update."""
    ranks = {"decay_rank": 8, "gate_rank": 8}
    kda = build("kda", seed=1, **ranks).double()
    gdn2 = build("gdn2", seed=2, **ranks).double()
    copy_shared(kda, gdn2, skip={"b_proj.weight"}, target_own={"b_proj.weight", "w_proj.weight"})
    # Every channel of head h reads the same row of W_b, so erase[h, :] = write[h, :] = beta[h].
    gdn2.b_proj.weight.copy_(kda.b_proj.weight.repeat_interleave(K, dim=0))
    gdn2.w_proj.weight.copy_(kda.b_proj.weight.repeat_interleave(K, dim=0))
    x = hidden(generator, 21)
    y_kda, state_kda = kda(x, return_gates=True)
    y_gdn2, state_gdn2 = gdn2(x, return_gates=True)
    beta = state_kda.gates["beta"].unsqueeze(-1).expand(-1, -1, -1, K)
    assert_close(state_gdn2.gates["erase"], beta, F64, "erase")
    assert_close(state_gdn2.gates["write"], beta, F64, "write")
    assert_close(y_gdn2, y_kda, F64, "output")
    assert_close(state_gdn2.memory, state_kda.memory, F64, "memory")
    # Untying a single write channel breaks the equality: the match above is not vacuous.
    gdn2.w_proj.weight[3].mul_(-1.0)
    assert not torch.allclose(gdn2(x)[0], y_kda, atol=1e-6)


@torch.no_grad()
def test_kda_with_equal_channel_decays_equals_gdn(generator):
    """KDA whose decay projection and dt_bias are constant over the channels of each head has
    g[h, k] = g[h]: the Gated DeltaNet whose a_proj is the composed low-rank map."""
    rank = 8
    kda = build("kda", seed=1, decay_rank=rank, gate_rank=rank).double()
    gdn = build("gdn", seed=2, gate_rank=rank, gate_activation="sigmoid").double()
    decay = {"decay.A_log", "decay.dt_bias"}
    kda_decay = decay | {"decay.f_proj.0.weight", "decay.f_proj.1.weight"}
    copy_shared(kda, gdn, skip=kda_decay, target_own=decay | {"decay.a_proj.weight"})
    head_rows = torch.randn(H, rank, generator=generator, dtype=torch.float64)
    kda.decay.f_proj[1].weight.copy_(head_rows.repeat_interleave(K, dim=0))
    kda.decay.dt_bias.copy_(gdn.decay.dt_bias.unsqueeze(-1).expand(H, K))
    kda.decay.A_log.copy_(gdn.decay.A_log)
    gdn.decay.a_proj.weight.copy_(head_rows @ kda.decay.f_proj[0].weight)
    x = hidden(generator, 21)
    y_kda, state_kda = kda(x, return_gates=True)
    y_gdn, state_gdn = gdn(x, return_gates=True)
    g_gdn = state_gdn.gates["g"].unsqueeze(-1).expand(-1, -1, -1, K)
    assert_close(state_kda.gates["g"], g_gdn, F64, "g")
    assert_close(y_kda, y_gdn, F64, "output")
    assert_close(state_kda.memory, state_gdn.memory, F64, "memory")
    kda.decay.dt_bias[0, 5] += 1.0
    assert not torch.allclose(kda(x)[0], y_gdn, atol=1e-6)


def test_kda_inputs_with_equal_channel_decay_equal_gdn_inputs(generator):
    """Ops-level form of the same reduction: a broadcast per-head g gives the same primitive."""
    q, k = (torch.randn(2, 9, H, K, generator=generator, dtype=torch.float64) for _ in "qk")
    v = torch.randn(2, 9, H, 4, generator=generator, dtype=torch.float64)
    beta = torch.rand(2, 9, H, generator=generator, dtype=torch.float64)
    g = -torch.rand(2, 9, H, generator=generator, dtype=torch.float64)
    o_kda, s_kda = delta_rule(
        *kda_inputs(q, k, v, beta, g.unsqueeze(-1).expand(-1, -1, -1, K)), output_final_state=True
    )
    o_gdn, s_gdn = delta_rule(*gated_deltanet_inputs(q, k, v, beta, g), output_final_state=True)
    assert_close(o_kda, o_gdn, F64, "output")
    assert_close(s_kda, s_gdn, F64, "state")


def reference_attention(layer: Attention, x: torch.Tensor, window: int | None) -> torch.Tensor:
    """Softmax attention written out: own RoPE, an explicit banded mask, float64."""
    batch, length, _ = x.shape
    q = (x @ layer.q_proj.weight.T).view(batch, length, H, K)
    k = (x @ layer.k_proj.weight.T).view(batch, length, H, K)
    v = (x @ layer.v_proj.weight.T).view(batch, length, H, K)
    half = K // 2
    freq = torch.tensor([10000.0 ** (-i / half) for i in range(half)], dtype=torch.float64)
    angle = torch.arange(length, dtype=torch.float64)[:, None] * freq  # [T, K/2]
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]

    def rotate(t):
        first, second = t[..., :half], t[..., half:]
        return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)

    q, k = rotate(q), rotate(k)
    scores = torch.einsum("bthk,bshk->bhts", q, k) / math.sqrt(K)
    band = torch.zeros(length, length, dtype=torch.bool)
    for t in range(length):
        for s in range(length):
            band[t, s] = s <= t and (window is None or t - s < window)
    weights = scores.masked_fill(~band, -math.inf).softmax(dim=-1)
    o = torch.einsum("bhts,bshv->bthv", weights, v).reshape(batch, length, H * K)
    return o @ layer.o_proj.weight.T


@torch.no_grad()
@pytest.mark.parametrize("window", [None, 1, 4, 19, 40])
def test_attention_matches_explicit_banded_reference(window, generator):
    layer = build("attention", window=window).double()
    x = hidden(generator, 19)
    assert_close(layer(x)[0], reference_attention(layer, x, window), F64, f"window {window}")


@torch.no_grad()
def test_window_of_one_attends_only_to_itself(generator):
    layer = build("attention", window=1).double()
    x = hidden(generator, 6)
    expected = layer.o_proj(layer.v_proj(x))  # softmax over one key is 1
    assert_close(layer(x)[0], expected, F64)


def test_mode_helper_takes_the_step_path_only_for_one_token_with_state(generator, monkeypatch):
    calls = []
    step = recurrence.delta_rule_step

    def counted_step(*args, **kwargs):
        calls.append(1)
        return step(*args, **kwargs)

    monkeypatch.setattr(recurrence, "delta_rule_step", counted_step)
    mixer = build("kda").double()
    x = hidden(generator, 4)
    _, state = mixer(x[:, :1])
    assert not calls  # no state yet: chunked path from zeros
    _, state = mixer(x[:, 1:2], state)
    assert len(calls) == 1
    mixer(x[:, 2:], state)
    assert len(calls) == 1


def test_short_convolution_is_a_causal_depthwise_conv_with_silu(generator):
    conv = ShortConvolution(3, 4).double()
    x = torch.randn(2, 10, 3, generator=generator, dtype=torch.float64)
    w = conv.weight[:, 0]  # [C, W]
    padded = F.pad(x, (0, 0, 3, 0))
    expected = torch.stack([(padded[:, t : t + 4] * w.T).sum(1) for t in range(10)], dim=1)
    y, cache = conv(x)
    assert_close(y, F.silu(expected), F64)
    assert torch.equal(cache, x[:, -3:].transpose(1, 2))


def test_gated_rms_norm_formula(generator):
    o = torch.randn(2, 5, H, K, generator=generator, dtype=torch.float64)
    gate = torch.randn(2, 5, H, K, generator=generator, dtype=torch.float64)
    for activation, act in (("sigmoid", torch.sigmoid), ("silu", F.silu)):
        norm = GatedRMSNorm(K, eps=0.0, activation=activation).double()
        expected = o / o.square().mean(-1, keepdim=True).sqrt() * act(gate)
        assert_close(norm(o, gate), expected, F64, activation)


def test_bfloat16_activations_keep_a_float32_memory(generator):
    mixer = build("gdn2").to(torch.bfloat16)
    x = hidden(generator, 5, dtype=torch.bfloat16)
    y, state = mixer(x)
    y_step, state = mixer(x[:, :1], state)
    assert y.dtype == y_step.dtype == torch.bfloat16
    assert state.memory.dtype == torch.float32
    assert torch.isfinite(y).all() and torch.isfinite(y_step).all()


@pytest.mark.parametrize(
    ("name", "overrides", "field"),
    [
        ("deltanet", {"hidden_size": 0}, "hidden_size"),
        ("gdn", {"num_heads": -1}, "num_heads"),
        ("kda", {"head_dim": 0}, "head_dim"),
        ("gdn2", {"value_dim": 0}, "value_dim"),
        ("gdn2", {"hidden_size": -4}, "hidden_size"),
        ("deltanet", {"conv_size": 0}, "conv_size"),
        ("gdn", {"chunk_size": 8}, "chunk_size"),
        ("kda", {"decay_rank": 0}, "decay_rank"),
        ("gdn2", {"decay_rank": -2}, "decay_rank"),
        ("gdn2", {"gate_rank": 0}, "gate_rank"),
        ("deltanet", {"gate_activation": "relu"}, "gate_activation"),
        ("attention", {"window": 0}, "window"),
        ("attention", {"window": -3}, "window"),
        ("attention", {"head_dim": 7}, "head_dim"),
        ("attention", {"hidden_size": 0}, "hidden_size"),
        ("attention", {"rope_base": 0.5}, "rope_base"),
    ],
)
def test_construction_errors_name_the_field(name, overrides, field):
    with pytest.raises(ValueError, match=field):
        build(name, **overrides)


@pytest.mark.parametrize(("name", "other"), [("deltanet", "attention"), ("attention", "gdn")])
def test_forward_refuses_wrong_width_and_foreign_state(name, other, generator):
    mixer = build(name)
    with pytest.raises(ValueError, match="hidden_size"):
        mixer(torch.randn(1, 3, D + 1))
    x = hidden(generator, 3, dtype=torch.float32)
    _, foreign_state = build(other)(x)
    with pytest.raises(TypeError, match="state must be"):
        mixer(x, foreign_state)


def test_padding_after_real_tokens_is_refused():
    from deltalab.layers import GatedDeltaNet

    layer = GatedDeltaNet(hidden_size=16, num_heads=2, head_dim=8)
    x = torch.randn(2, 5, 16)
    layer(x, mask=torch.tensor([[False, False, True, True, True]] * 2))
    with pytest.raises(ValueError, match=r"mask must be left padding"):
        layer(x, mask=torch.tensor([[True, True, True, False, False]] * 2))


# Every mixer class of the package, the KDN variants, Muir and KDN-Muir included.
ALL_MIXERS = {
    **MIXERS,
    "muir": Muir,
    "kdn_iso": IsotropicKDN,
    "kdn_diag": DiagonalKDN,
    "kdn_exact": ExactKDN,
    "kdn_muir": KDNMuir,
}


@pytest.mark.parametrize("name", ALL_MIXERS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_integer_input_is_refused_with_its_dtype_and_a_pointer_to_the_embedding(name, dtype):
    mixer = ALL_MIXERS[name](**SIZES)
    token_ids = torch.zeros(2, 5, dtype=dtype)
    pattern = rf"x must be floating-point hidden states .*got .*dtype {dtype}.*embedding"
    with pytest.raises(TypeError, match=pattern):
        mixer(token_ids)
    # The same with the right rank: the dtype is what is wrong, not only the shape.
    with pytest.raises(TypeError, match=pattern):
        mixer(token_ids.unsqueeze(-1).expand(2, 5, D))


@pytest.mark.parametrize("name", ALL_MIXERS)
def test_a_state_from_another_batch_size_is_refused_naming_the_state(name, generator):
    mixer = ALL_MIXERS[name](**SIZES)
    _, state = mixer(hidden(generator, 4, batch=2, dtype=torch.float32))
    cached = "state.key" if isinstance(state, AttentionState) else "state.memory"
    with pytest.raises(
        ValueError, match=rf"{cached} must be for x's batch of B = 3, got one for 2"
    ):
        mixer(hidden(generator, 1, batch=3, dtype=torch.float32), state)
