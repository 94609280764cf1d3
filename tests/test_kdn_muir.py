"""KDN-Muir: the Diagonal KDN filter under Muir's fused gates. Shapes, gradients, exact decoding
(with left padding), backends, the primitive's inputs, the reduction to Diagonal KDN, ranks from
`allocate_ranks`, training on the tiny preset, preset parameter counts.

Exactness checks run in float64 (`.double()` on the module), as in test_muir.py and
test_layers_kdn.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import run_in_pieces
from torch import nn

from deltalab.analysis import allocate_ranks
from deltalab.layers.kdn import Q_INIT, R_MIN, DiagonalKDN, KDNState
from deltalab.layers.kdn_muir import (
    KDNMuir,
    KDNMuirRanks,
    kalman_matched_filter,
    stationary_predicted_variance,
)
from deltalab.layers.muir import READ_GATES, initial_log_decay, matched_filter
from deltalab.layers.norms import l2_normalize
from deltalab.models import CausalLM, build_config, count_parameters
from deltalab.models.presets import SCALES
from deltalab.ops import delta_rule, kdn_diag
from deltalab.testing import TOLERANCE, assert_close

F64 = TOLERANCE[torch.float64]
# Initial values are float32 parameters even after .double().
F32_INIT = TOLERANCE[torch.float32]
F32_DECODE = 1e-5
# The Diagonal KDN reduction is the same arithmetic in the same order: equal to the last bits.
EQUIVALENCE = 1e-12
D, H, K = 32, 2, 16
SIZES = {"hidden_size": D, "num_heads": H, "head_dim": K}
STATE_FIELDS = ("memory", "uncertainty", "conv_q", "conv_k", "conv_v")


def build(seed: int = 0, **overrides) -> KDNMuir:
    """A KDN-Muir layer with parameters drawn from `seed`, leaving the global RNG as it was."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return KDNMuir(**{**SIZES, **overrides})


def hidden(generator: torch.Generator, length: int, batch: int = 2, dtype=torch.float64):
    return torch.randn(batch, length, D, generator=generator, dtype=dtype)


def randomize_zero_initialized(layer: KDNMuir, generator: torch.Generator) -> None:
    """Moves the zero-initialized last maps (process noise, dynamic read) to trained-like values,
    so that those gates really depend on the token."""
    with torch.no_grad():
        for name in ("process", "read"):
            if name in layer.gate_proj.names:
                weight = layer.gate_proj.projection(name).weight
                weight.copy_(0.3 * torch.randn(weight.shape, generator=generator))


def count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("read_gate", READ_GATES)
@pytest.mark.parametrize("value_dim", [None, 8])
def test_shapes_gates_and_state(read_gate, value_dim, generator):
    layer = build(read_gate=read_gate, value_dim=value_dim)
    V = K if value_dim is None else value_dim
    x = hidden(generator, 7, dtype=torch.float32)
    y, state = layer(x, return_gates=True)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert isinstance(state, KDNState) and state.memory.shape == (2, H, K, V)
    assert state.uncertainty.shape == (2, H, K) and state.uncertainty.dtype == torch.float32
    shapes = {name: tuple(gate.shape) for name, gate in state.gates.items()}
    assert shapes == {
        "g": (2, 7, H, K),
        "q_noise": (2, 7, H, K),
        "r": (2, 7, H),
        "read": (2, 7, H, K),
        "gain": (2, 7, H, K),
        "p": (2, 7, H, K),
        "predictive": (2, 7, H),
    }
    gates = state.gates
    assert (gates["g"] <= 0).all() and (gates["q_noise"] >= 0).all()
    assert (gates["r"] >= R_MIN).all() and (gates["read"] > 0).all() and (gates["p"] > 0).all()
    assert layer(x)[1].gates is None


@pytest.mark.parametrize("read_gate", READ_GATES)
def test_gradient_reaches_every_parameter(read_gate, generator):
    layer = build(read_gate=read_gate)
    randomize_zero_initialized(layer, generator)
    x = hidden(generator, 20, dtype=torch.float32)
    y, _ = layer(x)
    (y * torch.randn(y.shape, generator=generator)).sum().backward()
    for name, param in layer.named_parameters():
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
    layer = build(read_gate=read_gate, chunk_size=16).double()
    randomize_zero_initialized(layer, generator)
    x = hidden(generator, 23)
    y_full, state_full = layer(x)
    y_steps, state_steps = run_in_pieces(layer, x, pieces)
    assert_close(y_steps, y_full, F64, "output")
    for field in STATE_FIELDS:
        assert_close(getattr(state_steps, field), getattr(state_full, field), F64, field)


def test_decoding_matches_full_forward_float32(generator):
    layer = build()
    x = hidden(generator, 23, dtype=torch.float32)
    y_full, _ = layer(x)
    y_steps, _ = run_in_pieces(layer, x, [7] + [1] * 16)
    assert_close(y_steps, y_full, F32_DECODE, "output")


@torch.no_grad()
def test_left_padding_then_decoding_is_the_unpadded_sequence(generator):
    """A row left-padded by 5 tokens and then decoded token by token through the state gives
    what the row alone gives: padding tokens leave memory and uncertainty untouched."""
    layer = build(chunk_size=16).double()
    randomize_zero_initialized(layer, generator)
    pad, prompt, steps = 5, 12, 6
    x = hidden(generator, pad + prompt + steps)
    mask = torch.ones(2, pad + prompt, dtype=torch.bool)
    mask[0, :pad] = False
    y_padded, state = layer(x[:, : pad + prompt], mask=mask)
    y_decoded, state = run_in_pieces(layer, x[:, pad + prompt :], [1] * steps, state)
    # Row 0 alone, without its padding, as one sequence.
    y_alone, state_alone = layer(x[:1, pad:])
    assert_close(y_padded[:1, pad:], y_alone[:, :prompt], F64, "prompt")
    assert_close(y_decoded[:1], y_alone[:, prompt:], F64, "decoded")
    for field in ("memory", "uncertainty"):
        assert_close(getattr(state, field)[:1], getattr(state_alone, field), F64, field)
    # Row 1 has no padding: the mask changes nothing there.
    assert_close(y_padded[1:], layer(x[1:, : pad + prompt])[0], F64, "unpadded row")


@torch.no_grad()
def test_backends_agree(generator):
    naive = build(chunk_size=16, backend="naive").double()
    chunk = build(chunk_size=16, backend="chunk").double()
    randomize_zero_initialized(naive, generator)
    chunk.load_state_dict(naive.state_dict())
    x = hidden(generator, 41)
    (y_naive, s_naive), (y_chunk, s_chunk) = naive(x), chunk(x)
    assert_close(y_chunk, y_naive, F64, "output")
    for field in ("memory", "uncertainty"):
        assert_close(getattr(s_chunk, field), getattr(s_naive, field), F64, field)


def frontend(layer: KDNMuir, x: torch.Tensor):
    """The layer's own q, k `[B, T, H, K]` and v `[B, T, H, V]`, recomputed from its modules."""
    q, _ = layer.q_conv(layer.q_proj(x))
    k, _ = layer.k_conv(layer.k_proj(x))
    v, _ = layer.v_conv(layer.v_proj(x))
    q = l2_normalize(q.unflatten(-1, (H, K)))
    k = l2_normalize(k.unflatten(-1, (H, K)))
    return q, k, v.unflatten(-1, (H, layer.value_dim))


@torch.no_grad()
def test_it_is_the_primitive_with_diagonal_kdn_inputs_read_through_rho(generator):
    """The memory path is `delta_rule(rho * q, gain, k, v, g)`, and that is the `kdn_diag` op
    on the layer's noise model with the query reweighted by the read gate."""
    layer = build(chunk_size=16).double()
    randomize_zero_initialized(layer, generator)
    x = hidden(generator, 19)
    _, state = layer(x, return_gates=True)
    gates = state.gates
    q, k, v = frontend(layer, x)
    o, memory = delta_rule(
        gates["read"] * q, gates["gain"], k, v, gates["g"], output_final_state=True, chunk_size=16
    )
    assert_close(memory, state.memory, F64, "memory by delta_rule")
    p0 = layer.prior_variance().unsqueeze(-1).expand(H, K)
    o_op, (memory_op, precision) = kdn_diag(
        gates["read"] * q, k, v, gates["g"], gates["q_noise"], gates["r"], p0,
        info_scale=layer.info_scale, output_final_state=True, chunk_size=16,
    )  # fmt: skip
    assert_close(o_op, o, F64, "kdn_diag output")
    assert_close(memory_op, state.memory, F64, "kdn_diag memory")
    assert_close(precision, state.uncertainty, F64, "uncertainty")
    inputs, _ = layer.primitive_inputs(x, q, k, v)
    assert torch.equal(inputs.q, gates["read"] * q) and torch.equal(inputs.a, gates["gain"])
    assert torch.equal(inputs.b, k) and torch.equal(inputs.u, v)


@torch.no_grad()
def test_with_diagonal_kdn_ranks_and_no_read_gate_it_is_diagonal_kdn(generator):
    """Given DiagonalKDN's weights in the fused projection's slices (decay and process noise of
    rank K, the observation noise full rank), KDN-Muir without a read gate computes exactly what
    Diagonal KDN computes: the fusion changes where the gates come from, not the filter."""
    kdn = DiagonalKDN(**SIZES, chunk_size=16).double()
    ranks = KDNMuirRanks(decay=K, process=K, observation=None, read=None, outgate=K)
    layer = KDNMuir(**SIZES, chunk_size=16, ranks=ranks, read_gate="none").double()
    assert count(layer) == count(kdn)
    source, target = kdn.state_dict(), layer.state_dict()
    randomize = 0.3 * torch.randn(source["process.proj.1.weight"].shape, generator=generator)
    source["process.proj.1.weight"] = randomize.double()
    renamed = {
        "decay.A_log": "A_log",
        "decay.dt_bias": "dt_bias",
        "decay.f_proj.1.weight": "gate_proj.up.decay.weight",
        "process.proj.1.weight": "gate_proj.up.process.weight",
        "process.proj.1.bias": "gate_proj.up.process.bias",
        "r_proj.weight": "gate_proj.full.observation.weight",
        "r_proj.bias": "gate_proj.full.observation.bias",
    }
    for name, tensor in source.items():
        if name == "decay.f_proj.0.weight":
            target["gate_proj.down.weight"][:K] = tensor
        elif name == "process.proj.0.weight":
            target["gate_proj.down.weight"][K:] = tensor
        else:
            target[renamed.get(name, name)] = tensor
    layer.load_state_dict(target)
    kdn.load_state_dict(source)
    x = hidden(generator, 37)
    (y_kdn, s_kdn), (y, s) = kdn(x, return_gates=True), layer(x, return_gates=True)
    assert_close(y, y_kdn, EQUIVALENCE, "output")
    for field in STATE_FIELDS:
        assert_close(getattr(s, field), getattr(s_kdn, field), EQUIVALENCE, field)
    for name in ("g", "q_noise", "r", "gain", "p", "predictive"):
        assert_close(s.gates[name], s_kdn.gates[name], EQUIVALENCE, name)
    assert_close(layer(x[:, :3], s)[0], kdn(x[:, :3], s_kdn)[0], EQUIVALENCE, "continued")


@torch.no_grad()
def test_initialization_matches_diagonal_kdn_and_the_matched_filter(generator):
    layer = build().double()
    x = hidden(generator, 9)
    _, state = layer(x, return_gates=True)
    assert_close(layer.prior_variance(), torch.ones(H, dtype=torch.float64), F32_INIT, "p0")
    q_noise = state.gates["q_noise"]
    assert_close(q_noise, torch.full_like(q_noise, Q_INIT), F32_INIT, "q_noise")
    # The read gate at the matched filter of the gain's writes: q = 0.1, evidence s / (K r) = 1.
    process = torch.full((H, K), Q_INIT, dtype=torch.float64)
    evidence = torch.ones(H, 1, dtype=torch.float64)
    filter_ = kalman_matched_filter(layer.A_log, layer.dt_bias, process, evidence)
    assert_close(state.gates["read"], filter_.expand(2, 9, H, K), F32_INIT, "read")
    assert layer.info_scale == K and layer.r_min == R_MIN
    unit = build(read_init="unit").double()
    assert_close(unit.read_log.exp(), matched_filter(unit.A_log, unit.dt_bias), F32_INIT, "unit")


def test_stationary_predicted_variance_is_the_fixed_point_of_the_variance_scan():
    decay = torch.tensor([0.0, 0.3, 0.9, 0.999, 1.0], dtype=torch.float64)
    process, evidence = torch.tensor(0.1, dtype=torch.float64), torch.tensor(1.0).double()
    p_bar = stationary_predicted_variance(decay, process, evidence)
    # One step of sec. 3.1 (update, then predict) leaves it where it is.
    assert_close(decay * p_bar / (1 + evidence * p_bar) + process, p_bar, F64, "fixed point")
    # The limits of docs/MATH.md sec. 4.8: eta when nothing is kept (a = 0), and at a = 1 the
    # positive root of c p^2 - eta c p - eta = 0, (eta + sqrt(eta^2 + 4 eta / c)) / 2 at c = 1.
    assert_close(p_bar[0], process, F64, "no memory")
    no_decay = torch.tensor((0.1 + (0.01 + 0.4) ** 0.5) / 2, dtype=torch.float64)
    assert_close(p_bar[-1], no_decay, F64, "no decay")


@torch.no_grad()
def test_writes_per_unit_key_follow_the_stationary_predicted_variance_not_a_unit_variance():
    """docs/MATH.md sec. 4.8: at initialization the gain writes channel i with strength p_bar_i
    per unit of key (gain_i (predictive + r) = p_bar_i k_i), and p_bar_i settles at the fixed
    point of the variance scan under the initial decay, eta = 0.1 and the evidence s / (K r) = 1:
    about 0.1 in fast channels and 0.37 in slow ones. Measured on random inputs after the prior
    has been forgotten, the rms write per unit key of each channel is that fixed point (median
    error ~3%), where the unit-variance assumption of Muir's read gate (one level for every
    channel) is off by ~36%."""
    layer = build().double()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(48, 96, D, generator=generator, dtype=torch.float64)
    _, state = layer(x, return_gates=True)
    gates = state.gates
    _, k, _ = frontend(layer, x)
    settled = slice(32, None)  # the prior's p_0 = 1 is forgotten within ~10 tokens
    write = gates["gain"] * (gates["predictive"] + gates["r"]).unsqueeze(-1)
    energy = write[:, settled].pow(2).sum((0, 1)) / k[:, settled].pow(2).sum((0, 1))
    measured = energy.sqrt()
    g0 = initial_log_decay(layer.A_log.double(), layer.dt_bias.double())
    process, evidence = torch.tensor(Q_INIT).double(), torch.tensor(1.0).double()
    derived = stationary_predicted_variance(torch.exp(2 * g0), process, evidence)
    kalman_error = (measured / derived).log().abs().median()
    unit_error = (measured / measured.mean(-1, keepdim=True)).log().abs().median()
    assert kalman_error < 0.15 and unit_error > 0.2, (kalman_error, unit_error)
    # The read gates of the two assumptions differ by more than a factor 2 between channels.
    ratio = layer.read_log.exp() / matched_filter(layer.A_log, layer.dt_bias)
    assert (ratio.amax(-1) / ratio.amin(-1) > 2).all(), ratio


def test_fused_projection_ranks_follow_allocate_ranks():
    sensitivity = {"g": 6.0, "q_noise": 1.0, "r": 50.0, "read": 3.0}
    allocated = allocate_ranks(sensitivity, 24, maximum={"observation": H}, ranks=KDNMuirRanks)
    # r's share (12) is above its width H = 2: capped there, the rest shared by the others.
    assert allocated == {"decay": 13, "process": 2, "observation": 2, "read": 7}
    layer = build(ranks=KDNMuirRanks(**allocated, outgate=8))
    projection = layer.gate_proj
    assert projection.down.out_features == 24
    assert dict(zip(projection.up, projection.split_sizes, strict=True)) == allocated
    assert layer.g_proj[0].out_features == 8


def test_default_ranks_and_their_limits():
    assert KDNMuirRanks.default(128, widths={"observation": 16}) == KDNMuirRanks(
        decay=128, process=32, observation=16, read=32, outgate=128
    )
    assert build().ranks == KDNMuirRanks(decay=K, process=4, observation=H, read=4, outgate=K)
    # Without a dynamic read gate, no read slice.
    assert build(read_gate="static").gate_proj.down.out_features == K + 4 + H


def hand_count(read_gate: str, ranks: KDNMuirRanks) -> int:
    """Parameters at D = 32, H = 2, K = V = 16, conv 4, counted by hand."""
    HK = HV = H * K
    frontend = 3 * D * HK + 4 * 3 * HK + K + HV * D  # q, k, v, convs, o_norm, o_proj
    outgate = D * ranks.outgate + ranks.outgate * HV + HV

    def gate(rank, width, bias=True):
        return D * width + bias * width if rank is None else D * rank + rank * width + bias * width

    decay = gate(ranks.decay, HK, bias=False) + H + HK  # A_log, dt_bias
    noise = gate(ranks.process, HK) + gate(ranks.observation, H) + H  # prior precision
    # The read gate's last map has a bias when it is low rank (as Muir's).
    dynamic = HK + gate(ranks.read, HK, bias=ranks.read is not None)
    read = {"none": 0, "static": HK, "dynamic": dynamic}[read_gate]
    return frontend + outgate + decay + noise + read


@pytest.mark.parametrize("read_gate", READ_GATES)
def test_parameter_count_matches_hand_count(read_gate):
    ranks = KDNMuirRanks(decay=K, process=4, observation=H, read=4, outgate=K)
    assert count(build(read_gate=read_gate)) == hand_count(read_gate, ranks)
    full = dataclasses.replace(ranks, process=None, observation=None, read=None)
    assert count(build(read_gate=read_gate, ranks=full)) == hand_count(read_gate, full)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"ranks": KDNMuirRanks(16, 4, 3, 4, 16)}, "ranks.observation"),
        ({"ranks": KDNMuirRanks(33, 4, 2, 4, 16)}, "ranks.decay"),
        ({"ranks": {"decay": 4}}, "ranks has unknown gates"),
        ({"read_gate": "matched"}, "read_gate"),
        ({"read_init": "matched"}, "read_init"),
        ({"r_min": 0.0}, "r_min"),
        ({"info_scale": -1.0}, "info_scale"),
    ],
)
def test_construction_errors_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        build(**overrides)


def test_gate_parameters_are_excluded_from_weight_decay():
    marked = {n for n, p in build().named_parameters() if getattr(p, "_no_weight_decay", False)}
    assert marked == {
        "A_log",
        "dt_bias",
        "read_log",
        "prior_precision_raw",
        "gate_proj.up.process.bias",
        "gate_proj.up.observation.bias",
        "gate_proj.up.read.bias",
    }


def test_trains_on_the_tiny_preset():
    torch.manual_seed(0)
    model = CausalLM(build_config("tiny", mixer="kdn_muir"))
    text = b"def add(a, b):\n    return a + b\n" * 4
    ids = torch.tensor([list(text[:64]), list(text[8:72])])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("preset", ["tiny", *SCALES])
def test_presets_match_the_parameter_count_of_their_size(preset):
    """Within 2%: at the scales, of every other mixer of that size; at tiny, of the unfused
    Diagonal KDN whose FFN it widens (the tiny presets of the other families differ more)."""
    kdn_muir = count_parameters(build_config(preset, mixer="kdn_muir"))
    others = ["kdn_diag"] if preset == "tiny" else ["transformer", "gdn2", "muir", "kdn_diag"]
    for mixer in others:
        other = count_parameters(build_config(preset, mixer=mixer))
        assert abs(kdn_muir - other) / other < 0.02, f"{preset}: {mixer}"


def test_ranks_in_the_model_config_survive_save_and_load(tmp_path, generator):
    ranks = KDNMuirRanks(decay=8, process=2, observation=None, read=2, outgate=4)
    config = build_config("tiny", mixer="kdn_muir", num_layers=1, mixer_options={"ranks": ranks})
    torch.manual_seed(0)
    model = CausalLM(config).eval()
    model.save_pretrained(tmp_path)
    loaded = CausalLM.from_pretrained(tmp_path).eval()
    assert loaded.model.blocks[0].mixer.ranks == ranks
    ids = torch.randint(0, 259, (1, 9), generator=generator)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_read_gate_keeps_the_query_in_its_dtype_under_autocast(generator):
    """rho is float32 under autocast (x's dtype), q bf16: the read query stays bf16, as Muir's."""
    layer = build(read_gate="dynamic").float()
    x = torch.randn(2, 5, D, generator=generator)
    q = torch.randn(2, 5, H, K, generator=generator).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gates = layer.gates(x)
        read = layer.read_query(q, gates)
    assert gates["read"].dtype == torch.float32
    assert read.dtype == torch.bfloat16
