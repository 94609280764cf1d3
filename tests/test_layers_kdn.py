"""The KDN token mixers: shapes, gradients, exact decoding, parameter counts, wiring of the ops,
the noise parametrization, the uncertainty trace and its plot.

Exactness tests run in float64 (`.double()` on the module) so that "equal" means equal to rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import run_in_pieces
from matplotlib.figure import Figure
from torch import nn

from deltalab.analysis.uncertainty import UncertaintyTrace, plot_uncertainty, uncertainty_trace
from deltalab.layers.kda import KimiDeltaAttention
from deltalab.layers.kdn import (
    PRECISION_FLOOR,
    Q_INIT,
    R_MIN,
    DiagonalKDN,
    ExactKDN,
    IsotropicKDN,
    KDNMixer,
    KDNState,
)
from deltalab.layers.norms import l2_normalize
from deltalab.layers.states import RecurrentState
from deltalab.ops import delta_rule, kdn_diag, kdn_exact, kdn_iso
from deltalab.testing import TOLERANCE, assert_close

F64 = TOLERANCE[torch.float64]
# Initial values are float32 parameters (softplus^-1 rounded to float32) even after .double().
F32_INIT = TOLERANCE[torch.float32]
# Chunked float32 vs token-by-token float32: different summation orders, same contraction.
F32_DECODE = 1e-5
D, H, K = 32, 2, 16
SIZES = {"hidden_size": D, "num_heads": H, "head_dim": K}

VARIANTS: dict[str, Callable[..., KDNMixer]] = {
    "iso": IsotropicKDN,
    "diag": DiagonalKDN,
    "exact": ExactKDN,
}
MODES = ("free", "tied")


def build(name: str, seed: int = 0, **overrides) -> KDNMixer:
    """The variant `name` with its parameters drawn from `seed`, leaving the global RNG alone."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return VARIANTS[name](**{**SIZES, **overrides})


def hidden(generator: torch.Generator, length: int, batch: int = 2, dtype=torch.float64):
    return torch.randn(batch, length, D, generator=generator, dtype=dtype)


def state_tensors(state: KDNState) -> dict[str, torch.Tensor]:
    names = ("memory", "uncertainty", "conv_q", "conv_k", "conv_v")
    return {name: getattr(state, name) for name in names}


def frontend(layer: KDNMixer, x: torch.Tensor, state: KDNState | None = None):
    """The layer's own q, k `[B, T, H, K]` and v `[B, T, H, V]`, recomputed from its modules."""
    caches = (None, None, None) if state is None else (state.conv_q, state.conv_k, state.conv_v)
    q, _ = layer.q_conv(layer.q_proj(x), caches[0])
    k, _ = layer.k_conv(layer.k_proj(x), caches[1])
    v, _ = layer.v_conv(layer.v_proj(x), caches[2])
    q = l2_normalize(q.unflatten(-1, (H, K)))
    k = l2_normalize(k.unflatten(-1, (H, K)))
    return q, k, v.unflatten(-1, (H, layer.value_dim))


def readout(layer: KDNMixer, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    gate = layer.g_proj(x).unflatten(-1, (H, layer.value_dim))
    return layer.o_proj(layer.o_norm(o, gate).flatten(-2))


def randomize_zero_initialized(layer: KDNMixer, generator: torch.Generator) -> None:
    """Gives the zero-initialized up-projection of the process noise a trained-like value."""
    proj = getattr(layer.process, "proj", None)
    if isinstance(proj, nn.Sequential):
        with torch.no_grad():
            weight = proj[1].weight
            weight.copy_(0.1 * torch.randn(weight.shape, generator=generator))


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("value_dim", [None, 8])
def test_output_shape_and_state_types(name, value_dim, generator):
    layer = build(name, value_dim=value_dim)
    x = hidden(generator, 11, dtype=torch.float32)
    y, state = layer(x)
    assert y.shape == x.shape and y.dtype == torch.float32
    V = K if value_dim is None else value_dim
    assert isinstance(state, KDNState)
    assert state.memory.shape == (2, H, K, V)
    assert state.conv_q.shape == state.conv_k.shape == (2, H * K, 3)
    assert state.conv_v.shape == (2, H * V, 3)
    expected = {"iso": (2, H), "diag": (2, H, K), "exact": (2, H, K, K)}[name]
    assert state.uncertainty.shape == expected
    assert state.uncertainty.dtype == torch.float32
    assert state.gates is None


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("mode", MODES)
def test_gradient_reaches_every_parameter(name, mode, generator):
    layer = build(name, process_noise=mode)
    randomize_zero_initialized(layer, generator)
    x = hidden(generator, 20, dtype=torch.float32)
    y, _ = layer(x)
    (y * torch.randn(y.shape, generator=generator)).sum().backward()
    for param_name, param in layer.named_parameters():
        assert param.grad is not None, param_name
        assert torch.isfinite(param.grad).all(), param_name
        assert param.grad.abs().sum() > 0, param_name


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "pieces",
    [[1] * 23, [9, 1, 1, 5, 7], [22, 1]],
    ids=["token_by_token", "prefill_then_mixed", "prefill_then_step"],
)
def test_decoding_with_state_matches_full_forward_float64(name, mode, pieces, generator):
    # Chunks of 16 put a chunk boundary inside the 23 tokens and inside the pieces.
    layer = build(name, chunk_size=16, process_noise=mode).double()
    x = hidden(generator, 23)
    y_full, state_full = layer(x)
    y_steps, state_steps = run_in_pieces(layer, x, pieces)
    assert_close(y_steps, y_full, F64, "output")
    full, steps = state_tensors(state_full), state_tensors(state_steps)
    for field, tensor in full.items():
        assert_close(steps[field], tensor, F64, field)


@pytest.mark.parametrize("name", VARIANTS)
def test_decoding_matches_full_forward_float32(name, generator):
    layer = build(name)
    x = hidden(generator, 23, dtype=torch.float32)
    y_full, _ = layer(x)
    y_steps, _ = run_in_pieces(layer, x, [7] + [1] * 16)
    assert_close(y_steps, y_full, F32_DECODE, "output")


@pytest.mark.parametrize("name", VARIANTS)
def test_same_seed_gives_same_layer_and_output(name, generator):
    x = hidden(generator, 9, dtype=torch.float32)
    first, second, other = build(name, seed=3), build(name, seed=3), build(name, seed=4)
    for (key, p1), (_, p2) in zip(
        first.state_dict().items(), second.state_dict().items(), strict=True
    ):
        assert torch.equal(p1, p2), key
    assert torch.equal(first(x)[0], second(x)[0])
    assert not torch.equal(first(x)[0], other(x)[0])


def hand_count(name: str, mode: str) -> int:
    """Parameters of each variant at D = 32, H = 2, K = V = 16, conv 4, counted by hand."""
    HK = HV = H * K
    qkv = D * HK + D * HK + D * HV
    convs = 4 * (HK + HK + HV)
    o_norm, o_proj = K, HV * D
    rank = K  # as KDA: decay, output gate and channel process noise of rank head_dim
    low_rank_gate = D * rank + rank * HV + HV  # second projection has a bias
    channel_decay = D * rank + rank * HK + H + HK  # f_proj, A_log, dt_bias
    observation = D * H + H  # r_proj with bias
    prior = H  # prior precision per head
    common = qkv + convs + o_norm + o_proj + low_rank_gate + channel_decay + observation + prior
    if mode == "tied":
        return common + H  # p_inf per head
    if name == "iso":
        return common + D * H + H  # process noise per head, with bias
    return common + D * rank + rank * HK + HK  # low rank per head-channel, with bias


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("mode", MODES)
def test_parameter_count_matches_hand_count(name, mode):
    layer = build(name, process_noise=mode)
    assert sum(p.numel() for p in layer.parameters()) == hand_count(name, mode)


def test_hand_counts_are_the_expected_numbers():
    # Guards the formula above against drifting along with the code.
    counts = {(n, m): hand_count(n, m) for n in VARIANTS for m in MODES}
    assert counts == {
        ("iso", "free"): 6744,
        ("iso", "tied"): 6680,
        ("diag", "free"): 7734,
        ("diag", "tied"): 6680,
        ("exact", "free"): 7734,
        ("exact", "tied"): 6680,
    }


def call_op(name: str, layer: KDNMixer, q, k, v, gates, initial_state):
    """The KDN op of variant `name` on the layer's q, k, v and gates."""
    p0 = layer.prior_variance().detach().double()
    noise = (gates["g"], gates["q_noise"], gates["r"])
    if name == "iso":
        return kdn_iso(
            q, k, v, *noise, p0, info_scale=layer.info_scale, initial_state=initial_state,
            output_final_state=True, chunk_size=layer.chunk_size,
        )  # fmt: skip
    if name == "diag":
        return kdn_diag(
            q, k, v, *noise, p0.unsqueeze(-1).expand(H, K), info_scale=layer.info_scale,
            initial_state=initial_state, output_final_state=True, chunk_size=layer.chunk_size,
        )  # fmt: skip
    P0 = p0[:, None, None] * torch.eye(K, dtype=torch.float64)
    return kdn_exact(q, k, v, *noise, P0, initial_state=initial_state, output_final_state=True)


@torch.no_grad()
@pytest.mark.parametrize("name", VARIANTS)
def test_layer_equals_the_kdn_op_on_its_own_inputs(name, generator):
    layer = build(name, chunk_size=16).double()
    x = hidden(generator, 30)
    first, second = x[:, :19], x[:, 19:]
    y1, state1 = layer(first, return_gates=True)
    y2, state2 = layer(second, state1, return_gates=True)
    for x_part, y, start, end in ((first, y1, None, state1), (second, y2, state1, state2)):
        q, k, v = frontend(layer, x_part, start)
        initial = None if start is None else (start.memory, start.uncertainty)
        o, (memory, uncertainty) = call_op(name, layer, q, k, v, end.gates, initial)
        assert_close(y, readout(layer, x_part, o), F64, "output")
        assert_close(end.memory, memory, F64, "memory")
        assert_close(end.uncertainty, uncertainty, F64, "uncertainty")
    # The gates handed to the op are the layer's noise model, not a copy of something else.
    _, q_noise, r = layer.kalman_gates(second)
    assert_close(state2.gates["q_noise"], q_noise, F64, "q_noise")
    assert_close(state2.gates["r"], r, F64, "r")


@torch.no_grad()
@pytest.mark.parametrize("name", VARIANTS)
def test_primitive_inputs_are_the_first_call_of_the_layer(name, generator):
    layer = build(name).double()
    x = hidden(generator, 13)
    _, state = layer(x)
    inputs, gates = layer.primitive_inputs(x, *frontend(layer, x))
    _, memory = delta_rule(*inputs, output_final_state=True)
    assert_close(memory, state.memory, F64, "memory")
    assert {"g", "r", "q_noise", "p", "predictive"} <= set(gates)


@torch.no_grad()
@pytest.mark.parametrize("name", VARIANTS)
def test_tied_process_noise_follows_the_decay(name, generator):
    layer = build(name, process_noise="tied").double()
    layer.process.p_inf_raw.copy_(torch.randn(H, generator=generator, dtype=torch.float64))
    _, state = layer(hidden(generator, 17), return_gates=True)
    g, q_noise = state.gates["g"], state.gates["q_noise"]
    p_inf = torch.nn.functional.softplus(layer.process.p_inf_raw)
    if name == "iso":
        # The isotropic projection of the per-channel contraction: its mean over the channels.
        expected = (1 - torch.exp(2 * g).mean(dim=-1)) * p_inf
    else:
        expected = (1 - torch.exp(2 * g)) * p_inf[:, None]
    assert_close(q_noise, expected, F64, "q_noise")
    assert (q_noise >= 0).all()
    assert not any("process.proj" in n for n, _ in layer.named_parameters())


@torch.no_grad()
@pytest.mark.parametrize("name", VARIANTS)
def test_initialization_of_the_noise_model(name, generator):
    layer = build(name).double()
    assert_close(layer.prior_variance(), torch.ones(H, dtype=torch.float64), F32_INIT, "p0")
    g, q_noise, r = layer.kalman_gates(hidden(generator, 9))
    assert (g <= 0).all() and (r > R_MIN).all()
    if name != "iso":
        # The zero-initialized low-rank projection: q starts at Q_INIT whatever the input.
        assert_close(q_noise, torch.full_like(q_noise, Q_INIT), F32_INIT, "q_noise")


@torch.no_grad()
@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("extreme", [-1e4, 1e4])
def test_no_parameter_value_gives_invalid_noise(name, mode, extreme, generator):
    layer = build(name, process_noise=mode).double()
    for param_name, param in layer.named_parameters():
        if param_name.endswith("bias") or param_name.endswith("_raw"):
            param.fill_(extreme)
    p0 = layer.prior_variance()
    assert ((p0 > 0) & (p0 <= 1 / PRECISION_FLOOR) & torch.isfinite(p0)).all()
    x = hidden(generator, 21)
    g, q_noise, r = layer.kalman_gates(x)
    assert (r >= R_MIN).all() and (q_noise >= 0).all() and (g <= 0).all()
    y, state = layer(x, return_gates=True)
    assert torch.isfinite(y).all()
    assert (state.gates["p"] > 0).all()


@torch.no_grad()
@pytest.mark.parametrize("name", VARIANTS)
def test_trace_is_consistent_with_the_gains(name, generator):
    """The gain is P_bar k / (k^T P_bar k + r), so k^T gain = predictive / (predictive + r)."""
    layer = build(name, process_noise="free").double()
    randomize_zero_initialized(layer, generator)
    x = hidden(generator, 25)
    _, state = layer(x, return_gates=True)
    gates = state.gates
    _, k, _ = frontend(layer, x)
    predictive, r = gates["predictive"], gates["r"]
    if name == "iso":
        explained = gates["beta"] * k.square().sum(-1)
        # Isotropic: 1/p = 1/p_bar + s ||k||^2 / (K r), with p_bar = predictive / ||k||^2.
        norm2 = k.square().sum(-1)
        precision = norm2 / predictive + layer.info_scale * norm2 / (K * r)
        assert_close(1 / gates["p"], precision, F64, "precision")
    else:
        explained = (gates["gain"] * k).sum(-1)
    assert_close(explained, predictive / (predictive + r), F64, "k^T gain")
    if name == "exact":
        diagonal = state.uncertainty.diagonal(dim1=-2, dim2=-1)
        assert_close(gates["p"][:, -1], diagonal, F64, "p_T")


@pytest.mark.parametrize("name", VARIANTS)
def test_uncertainty_trace_shapes_and_positivity(name, generator):
    layer = build(name)
    trace = uncertainty_trace(layer, hidden(generator, 200, batch=1, dtype=torch.float32))
    assert isinstance(trace, UncertaintyTrace)
    assert trace.variant == type(layer).__name__
    per_head, per_channel = (1, 200, H), (1, 200, H, K)
    assert trace.p.shape == (per_head if name == "iso" else per_channel)
    assert trace.gain.shape == (per_head if name == "iso" else per_channel)
    assert trace.q_noise.shape == (per_head if name == "iso" else per_channel)
    assert trace.predictive.shape == trace.r.shape == per_head
    assert trace.g.shape == per_channel
    assert trace.head_variance().shape == per_head
    for field in ("p", "predictive", "r"):
        values = getattr(trace, field)
        assert ((values > 0) & (values < math.inf)).all(), field


def test_uncertainty_trace_refuses_other_layers(generator):
    with pytest.raises(TypeError, match="KDN"):
        uncertainty_trace(KimiDeltaAttention(**SIZES), hidden(generator, 3, dtype=torch.float32))


@pytest.mark.parametrize("name", VARIANTS)
def test_plot_writes_a_png(name, generator, tmp_path):
    trace = uncertainty_trace(build(name), hidden(generator, 40, dtype=torch.float32))
    path = plot_uncertainty(trace, tmp_path / f"{name}.png", sequence=1)
    assert path == tmp_path / f"{name}.png"
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000
    assert [p.name for p in tmp_path.iterdir()] == [f"{name}.png"]


def test_plot_failure_leaves_the_old_file_and_no_temporary(generator, tmp_path, monkeypatch):
    trace = uncertainty_trace(build("diag"), hidden(generator, 10, dtype=torch.float32))
    path = tmp_path / "plot.png"
    path.write_bytes(b"old")

    def broken(self, *args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(Figure, "savefig", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        plot_uncertainty(trace, path)
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["plot.png"]


def test_plot_refuses_a_sequence_out_of_range(generator, tmp_path):
    trace = uncertainty_trace(build("iso"), hidden(generator, 5, dtype=torch.float32))
    with pytest.raises(ValueError, match="sequence"):
        plot_uncertainty(trace, tmp_path / "x.png", sequence=2)
    assert not any(Path(tmp_path).iterdir())


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("mode", MODES)
def test_gate_parameters_are_excluded_from_weight_decay(name, mode):
    layer = build(name, process_noise=mode)
    marked = {n for n, p in layer.named_parameters() if getattr(p, "_no_weight_decay", False)}
    expected = {"decay.A_log", "decay.dt_bias", "r_proj.bias", "prior_precision_raw"}
    if mode == "tied":
        expected.add("process.p_inf_raw")
    elif name == "iso":
        expected.add("process.proj.bias")
    else:
        expected.add("process.proj.1.bias")
    assert marked == expected


@pytest.mark.parametrize(
    ("name", "overrides", "field"),
    [
        ("iso", {"hidden_size": 0}, "hidden_size"),
        ("diag", {"num_heads": 0}, "num_heads"),
        ("exact", {"head_dim": -1}, "head_dim"),
        ("iso", {"value_dim": 0}, "value_dim"),
        ("diag", {"chunk_size": 8}, "chunk_size"),
        ("exact", {"conv_size": 0}, "conv_size"),
        ("iso", {"decay_rank": 0}, "decay_rank"),
        ("diag", {"gate_rank": 0}, "gate_rank"),
        ("diag", {"noise_rank": 0}, "noise_rank"),
        ("exact", {"noise_rank": -3, "process_noise": "tied"}, "noise_rank"),
        ("iso", {"process_noise": "learned"}, "process_noise"),
        ("exact", {"process_noise": "Free"}, "process_noise"),
        ("iso", {"info_scale": 0.0}, "info_scale"),
        ("diag", {"info_scale": -2.0}, "info_scale"),
        ("diag", {"info_scale": math.inf}, "info_scale"),
        ("exact", {"r_min": 0.0}, "r_min"),
        ("iso", {"gate_activation": "relu"}, "gate_activation"),
    ],
)
def test_construction_errors_name_the_field(name, overrides, field):
    with pytest.raises(ValueError, match=field):
        build(name, **overrides)


def test_exact_kdn_has_no_information_scale():
    with pytest.raises(TypeError, match="info_scale"):
        build("exact", info_scale=1.0)


@pytest.mark.parametrize(("name", "other"), [("iso", "diag"), ("diag", "exact"), ("exact", "iso")])
def test_forward_refuses_foreign_states(name, other, generator):
    layer = build(name)
    x = hidden(generator, 3, dtype=torch.float32)
    _, kda_state = KimiDeltaAttention(**SIZES)(x)
    assert type(kda_state) is RecurrentState
    with pytest.raises(TypeError, match="KDNState"):
        layer(x, kda_state)
    _, other_state = build(other)(x)
    with pytest.raises(ValueError, match=r"uncertainty|precision"):
        layer(x, other_state)
