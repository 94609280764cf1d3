"""Muir: fused low-rank gates, read gate modes, exact decoding, GDN-2 equivalence, FFN sizing.

Exactness checks run in float64 (`.double()` on the module), as in test_layers_baselines.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import run_in_pieces
from torch import nn

from deltalab.layers.gdn2 import GatedDeltaNet2
from deltalab.layers.muir import (
    READ_GATES,
    Muir,
    MuirRanks,
    matched_filter,
    muir_ffn_width,
)
from deltalab.layers.states import RecurrentState
from deltalab.testing import TOLERANCE, assert_close

F64 = TOLERANCE[torch.float64]
# The GDN-2 reduction is the same arithmetic in the same order: equal to the last bits.
EQUIVALENCE = 1e-12
F32_DECODE = 1e-5
# A float32 parameter against its float64 formula.
F32_PARAMETER = 1e-6
D, H, K = 32, 2, 16
SIZES = {"hidden_size": D, "num_heads": H, "head_dim": K}
# GDN-2's 1.3B configuration (docs/MATH.md sec. 4.3).
GDN2_1B3 = {"hidden_size": 2304, "num_heads": 16, "head_dim": 128}
GDN2_1B3_FFN, GDN2_1B3_LAYERS = 6208, 18


def build(seed: int = 0, **overrides) -> Muir:
    """A Muir layer with parameters drawn from `seed`, leaving the global RNG as it was."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return Muir(**{**SIZES, **overrides})


def build_gdn2(seed: int = 0, **overrides) -> GatedDeltaNet2:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return GatedDeltaNet2(**{**SIZES, **overrides})


def hidden(generator: torch.Generator, length: int, batch: int = 2, dtype=torch.float64):
    return torch.randn(batch, length, D, generator=generator, dtype=dtype)


def count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("read_gate", READ_GATES)
@pytest.mark.parametrize("value_dim", [None, 8])
def test_shapes_and_gates_include_the_read_gate(read_gate, value_dim, generator):
    mixer = build(read_gate=read_gate, value_dim=value_dim)
    V = K if value_dim is None else value_dim
    x = hidden(generator, 7, dtype=torch.float32)
    y, state = mixer(x, return_gates=True)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert isinstance(state, RecurrentState) and state.memory.shape == (2, H, K, V)
    shapes = {name: tuple(gate.shape) for name, gate in state.gates.items()}
    assert shapes == {
        "erase": (2, 7, H, K),
        "write": (2, 7, H, V),
        "g": (2, 7, H, K),
        "read": (2, 7, H, K),
    }
    gates = state.gates
    assert ((gates["erase"] > 0) & (gates["erase"] < 1)).all()
    assert ((gates["write"] > 0) & (gates["write"] < 1)).all()
    assert (gates["g"] <= 0).all() and (gates["read"] > 0).all()
    assert mixer(x)[1].gates is None


@pytest.mark.parametrize("read_gate", READ_GATES)
def test_gradient_reaches_every_parameter(read_gate, generator):
    mixer = build(read_gate=read_gate)
    x = hidden(generator, 20, dtype=torch.float32)
    y, _ = mixer(x)
    (y * torch.randn(y.shape, generator=generator)).sum().backward()
    for name, param in mixer.named_parameters():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name


@pytest.mark.parametrize("read_gate", READ_GATES)
@pytest.mark.parametrize(
    "pieces",
    [[1] * 23, [9, 1, 1, 5, 7], [22, 1]],
    ids=["token_by_token", "prefill_then_mixed", "prefill_then_step"],
)
def test_decoding_with_state_matches_full_forward_float64(read_gate, pieces, generator):
    # Chunks of 16 put chunk boundaries inside the 23 tokens and inside the pieces.
    mixer = build(read_gate=read_gate, chunk_size=16).double()
    if read_gate == "dynamic":
        # Away from its zero init, so that the read gate really depends on the token.
        nn.init.normal_(mixer.gate_proj.projection("read").weight, std=0.5)
    x = hidden(generator, 23)
    y_full, state_full = mixer(x)
    y_steps, state_steps = run_in_pieces(mixer, x, pieces)
    assert_close(y_steps, y_full, F64, "output")
    for field in ("memory", "conv_q", "conv_k", "conv_v"):
        assert_close(getattr(state_steps, field), getattr(state_full, field), F64, field)


def test_decoding_matches_full_forward_float32(generator):
    mixer = build()
    x = hidden(generator, 23, dtype=torch.float32)
    y_full, _ = mixer(x)
    y_steps, _ = run_in_pieces(mixer, x, [7] + [1] * 16)
    assert_close(y_steps, y_full, F32_DECODE, "output")


def test_same_seed_gives_same_layer_and_output(generator):
    x = hidden(generator, 9, dtype=torch.float32)
    first, second, other = build(seed=3), build(seed=3), build(seed=4)
    for (key, p1), (_, p2) in zip(
        first.state_dict().items(), second.state_dict().items(), strict=True
    ):
        assert torch.equal(p1, p2), key
    assert torch.equal(first(x)[0], second(x)[0])
    assert not torch.equal(first(x)[0], other(x)[0])


def hand_count(read_gate: str, ranks: MuirRanks) -> int:
    """Parameters at D = 32, H = 2, K = V = 16, conv 4, counted by hand."""
    HK = HV = H * K
    frontend = 3 * D * HK + 4 * 3 * HK + K + HV * D  # q, k, v, convs, o_norm, o_proj

    def gate(rank, width, bias=True):
        # Full rank: D x width, no bias. Low rank: a slice of the fused down-projection
        # (D x rank), the up-projection and its bias.
        return D * width if rank is None else D * rank + rank * width + bias * width

    outgate = gate(ranks.outgate, HV)  # frontend's low-rank output gate: bias on its second map
    decay = gate(ranks.decay, HK, bias=False) + H + HK  # A_log, dt_bias
    erase, write = gate(ranks.erase, HK), gate(ranks.write, HV)
    read = {"none": 0, "static": HK, "dynamic": HK + gate(ranks.read, HK)}[read_gate]
    return frontend + outgate + decay + erase + write + read


@pytest.mark.parametrize("read_gate", READ_GATES)
@pytest.mark.parametrize(
    "ranks",
    [None, MuirRanks(decay=8, erase=None, write=4, read=None, outgate=None)],
    ids=["default", "mixed_full_rank"],
)
def test_parameter_count_matches_hand_count(read_gate, ranks):
    mixer = build(read_gate=read_gate, ranks=ranks)
    expected = hand_count(read_gate, MuirRanks.default(K, D) if ranks is None else ranks)
    assert count(mixer) == expected


def test_hand_counts_are_the_expected_numbers():
    # Guards the formula above against drifting along with the code (GDN-2 here: 10706).
    ranks = MuirRanks.default(K, D)
    counts = {mode: hand_count(mode, ranks) for mode in READ_GATES}
    assert counts == {"dynamic": 7634, "static": 7346, "none": 7314}


def test_fused_projection_is_one_matrix_sliced_per_gate():
    ranks = MuirRanks(decay=6, erase=2, write=4, read=3, outgate=5)
    assert build(ranks=ranks).gate_proj.down.out_features == 6 + 2 + 4 + 3
    # Without a dynamic read gate, no read slice; full-rank gates are not in the fusion.
    assert build(ranks=ranks, read_gate="static").gate_proj.down.out_features == 6 + 2 + 4
    unfused = dataclasses.replace(ranks, erase=None, write=None)
    mixer = build(ranks=unfused, read_gate="none")
    assert mixer.gate_proj.down.out_features == 6
    assert set(mixer.gate_proj.full) == {"erase", "write"}
    assert mixer.g_proj[0].out_features == 5  # the output gate keeps its own projection


def test_default_ranks_give_the_erase_gate_the_lowest_rank():
    ranks = MuirRanks.default(128)
    assert ranks == MuirRanks(decay=128, erase=16, write=64, read=32, outgate=128)
    assert min(dataclasses.asdict(ranks).values()) == ranks.erase
    assert MuirRanks.default(4) == MuirRanks(decay=4, erase=1, write=2, read=1, outgate=4)
    # Never above the hidden size, which bounds every rank.
    assert MuirRanks.default(64, hidden_size=16).decay == 16


def test_static_read_starts_at_the_matched_filter_of_the_initial_decays(generator):
    mixer = build(read_gate="static").double()
    g0 = -mixer.A_log.exp().unsqueeze(-1) * nn.functional.softplus(mixer.dt_bias)
    weight = 1 - torch.exp(2 * g0)
    expected = weight / weight.mean(-1, keepdim=True)
    # Built in float32: the init is a float32 rounding of the matched filter.
    assert_close(mixer.read_log.exp(), expected, F32_PARAMETER, "static read")
    mixer.reset_read_gate()
    assert_close(mixer.read_log.exp(), expected, F64, "static read, float64")
    assert_close(expected.mean(-1), torch.ones(H, dtype=torch.float64), F64, "mean 1 per head")
    # The slowest channel of each head is read the least.
    slowest = g0.argmax(-1)
    assert torch.equal(expected.argmin(-1), slowest)
    _, state = mixer(hidden(generator, 5), return_gates=True)
    assert_close(state.gates["read"], expected.expand(2, 5, H, K), F64, "read gate")
    assert_close(matched_filter(mixer.A_log, mixer.dt_bias), expected, F64)


def test_dynamic_read_equals_the_static_filter_at_init(generator):
    dynamic = build(read_gate="dynamic").double()
    x = hidden(generator, 6)
    _, state = dynamic(x, return_gates=True)
    assert_close(state.gates["read"], dynamic.read_log.exp().expand(2, 6, H, K), F64, "rho")


@torch.no_grad()
def test_from_gdn2_computes_exactly_what_gdn2_computes(generator):
    gdn2 = build_gdn2(seed=1, decay_rank=8, gate_rank=8, value_dim=8).double()
    muir = Muir.from_gdn2(gdn2)
    assert muir.read_gate == "none"
    assert muir.ranks == MuirRanks(decay=8, erase=None, write=None, read=4, outgate=8)
    assert count(muir) == count(gdn2)
    x = hidden(generator, 37)
    y_gdn2, state_gdn2 = gdn2(x, return_gates=True)
    y_muir, state_muir = muir(x, return_gates=True)
    assert_close(y_muir, y_gdn2, EQUIVALENCE, "output")
    for field in ("memory", "conv_q", "conv_k", "conv_v"):
        assert_close(getattr(state_muir, field), getattr(state_gdn2, field), EQUIVALENCE, field)
    for name in ("erase", "write", "g"):
        assert_close(state_muir.gates[name], state_gdn2.gates[name], EQUIVALENCE, name)
    # Continuing both from their states keeps them equal.
    assert_close(muir(x[:, :3], state_muir)[0], gdn2(x[:, :3], state_gdn2)[0], EQUIVALENCE)
    # A matched-filter read reweights the query: no longer GDN-2, though the state is.
    static = Muir.from_gdn2(gdn2, read_gate="static")
    y_static, state_static = static(x)
    assert_close(state_static.memory, state_gdn2.memory, EQUIVALENCE, "memory")
    assert not torch.allclose(y_static, y_gdn2, atol=1e-6)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"ranks": MuirRanks(decay=8, erase=2, write=4, read=2, outgate=33)}, "ranks.outgate"),
        ({"ranks": MuirRanks(decay=33, erase=2, write=4, read=2, outgate=8)}, "ranks.decay"),
        ({"value_dim": 4, "ranks": MuirRanks(8, 2, 9, 2, 8)}, "ranks.write"),
        ({"hidden_size": 8, "ranks": MuirRanks(8, 9, 4, 2, 8)}, "ranks.erase"),
        ({"read_gate": "static", "ranks": MuirRanks(8, 2, 4, 40, 8)}, "ranks.read"),
        ({"read_gate": "matched"}, "read_gate"),
        ({"num_heads": 0}, "num_heads"),
        ({"chunk_size": 8}, "chunk_size"),
    ],
)
def test_construction_errors_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        build(**overrides)


@pytest.mark.parametrize("field", ["decay", "erase", "write", "read", "outgate"])
def test_zero_or_negative_rank_is_refused_naming_the_field(field):
    ranks = dataclasses.asdict(MuirRanks.default(K))
    for bad in (0, -3):
        with pytest.raises(ValueError, match=f"ranks.{field}"):
            MuirRanks(**{**ranks, field: bad})
    with pytest.raises(TypeError, match=f"ranks.{field}"):
        MuirRanks(**{**ranks, field: 2.0})


def test_ranks_must_be_a_muir_ranks_or_a_complete_mapping():
    with pytest.raises(TypeError, match="ranks must be a MuirRanks, a mapping or None"):
        build(ranks=[8, 2, 4, 3, 8])
    with pytest.raises(ValueError, match=r"ranks has unknown gates \[\] and lacks \['erase'"):
        build(ranks={"decay": 8})


@pytest.mark.parametrize("read_gate", READ_GATES)
def test_ffn_width_matches_the_gdn2_block_at_1_3b(read_gate):
    width = muir_ffn_width(**GDN2_1B3, gdn2_ffn_width=GDN2_1B3_FFN, read_gate=read_gate)
    with torch.device("meta"):
        gdn2 = GatedDeltaNet2(**GDN2_1B3)
        muir = Muir(**GDN2_1B3, read_gate=read_gate)
    ffn = 3 * GDN2_1B3["hidden_size"]
    gdn2_block = count(gdn2) + ffn * GDN2_1B3_FFN
    muir_block = count(muir) + ffn * width
    assert abs(muir_block - gdn2_block) / gdn2_block < 0.005
    # The saved gate parameters went into the FFN (GDN-2's full-rank gates are ~9.4M a block).
    assert width % 64 == 0 and width > GDN2_1B3_FFN + 1000
    total_gdn2, total_muir = GDN2_1B3_LAYERS * gdn2_block, GDN2_1B3_LAYERS * muir_block
    assert abs(total_muir - total_gdn2) / total_gdn2 < 0.005


def test_ffn_width_is_the_gdn2_width_when_nothing_is_saved():
    # Full-rank erase and write, no read gate, GDN-2's ranks: the mixers are the same size.
    ranks = MuirRanks(decay=D, erase=None, write=None, read=None, outgate=D)
    same = {"ranks": ranks, "read_gate": "none"}
    assert muir_ffn_width(**SIZES, gdn2_ffn_width=128, **same) == 128
    assert muir_ffn_width(**SIZES, gdn2_ffn_width=100, multiple_of=1, **same) == 100


@pytest.mark.parametrize("read_gate", READ_GATES)
def test_bfloat16_activations_keep_a_float32_memory(read_gate, generator):
    mixer = build(read_gate=read_gate).to(torch.bfloat16)
    x = hidden(generator, 5, dtype=torch.bfloat16)
    y, state = mixer(x)
    y_step, state = mixer(x[:, :1], state)
    assert y.dtype == y_step.dtype == torch.bfloat16
    assert state.memory.dtype == torch.float32
    assert torch.isfinite(y).all() and torch.isfinite(y_step).all()


@pytest.mark.parametrize("read_gate", ["dynamic", "static"])
def test_read_gate_keeps_the_query_in_its_dtype_under_autocast(read_gate, generator):
    """Under autocast rho comes out float32 (x's dtype) while q is bf16: the primitive's query
    must stay bf16 (a float32 query sends the Triton kernels to IEEE float32 products)."""
    mixer = build(read_gate=read_gate).float()
    x = hidden(generator, 5, dtype=torch.float32)
    q, k, v = (torch.randn(2, 5, H, K, generator=generator).bfloat16() for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gates = mixer.gates(x)
        inputs = mixer.inputs_from_gates(q, k, v, gates)
    assert gates["read"].dtype == torch.float32
    assert inputs.q.dtype == torch.bfloat16
