"""Analysis helpers: gate sensitivity against finite differences, rank allocation, row norms.

Exactness checks run in float64. The finite differences perturb the primitive's inputs by hand
(docs/MATH.md sec. 1.2 table: erase scales b = e * k, write scales u = w * v, g adds to the log
decay, read scales q), independently of the rebuild that `perturb_gate` uses. KDN layers are
perturbed by hand in the tensors that `kalman_gates` returns (g, q_noise, r).
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os

import pytest
import torch
from torch import nn

from deltalab.analysis import (
    SensitivityReport,
    allocate_ranks,
    gate_sensitivity,
    perturb_gate,
    plot_gate_sensitivity,
    plot_row_norms,
    row_norms,
    save_figure,
    spearman,
    unit_directions,
)
from deltalab.analysis._plot import new_figure
from deltalab.layers.delta_mixer import DeltaMixer
from deltalab.layers.deltanet import DeltaNet, GatedDeltaNet
from deltalab.layers.gdn2 import GatedDeltaNet2
from deltalab.layers.kda import KimiDeltaAttention
from deltalab.layers.kdn import DiagonalKDN, IsotropicKDN
from deltalab.layers.kdn_muir import KDNMuirRanks
from deltalab.layers.muir import Muir
from deltalab.models import CausalLM, build_config
from deltalab.ops.parametrize import DeltaRuleInputs, deltanet_inputs

D, H, K = 16, 2, 8
SIZES = {"hidden_size": D, "num_heads": H, "head_dim": K}
# Central differences in float64: truncation ~ eps^2, rounding ~ 1e-16 / eps.
FD_EPS, FD_TOL = 1e-6, 1e-6

# torch's forward-mode AD scripts its decompositions on first use, which warns on torch 2.13.
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning"
)


class Stack(nn.Module):
    """Residual stack of mixers with a regression loss; batch = (x, target), both `[B, T, D]`."""

    def __init__(self, *layers: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, target = batch
        for layer in self.layers:
            x = x + layer(x)[0]
        return (x - target).square().mean()


def seeded(factory, seed: int, **kwargs) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return factory(**{**SIZES, **kwargs}).double()


def gdn2_muir_stack() -> Stack:
    muir = seeded(Muir, 1)
    with torch.no_grad():
        # Away from the zero init, so that the dynamic read gate depends on the token.
        nn.init.normal_(muir.gate_proj.projection("read").weight, std=0.5)
    return Stack(seeded(GatedDeltaNet2, 0), muir)


def make_batch(generator: torch.Generator, batch: int = 2, length: int = 19):
    draw = lambda: torch.randn(batch, length, D, generator=generator, dtype=torch.float64)  # noqa: E731
    return draw(), draw()


def remembered_directions(generator):
    """(directions, direction): a `direction` argument of `gate_sensitivity` drawing one random
    unit direction per (layer, gate) on first use and keeping it in `directions`, so that a
    test can perturb the same gates by hand along the same directions."""
    directions = {}

    def direction(layer, gate, value):
        if (layer, gate) not in directions:
            directions[layer, gate] = unit_directions(value, generator)
        return directions[layer, gate]

    return directions, direction


def count_gate_computations(model) -> dict[str, int]:
    """layer name -> how many times each `DeltaMixer` of `model` has computed its gates since
    (a gate hook counting every call), updated in place."""
    computed = {}
    for name, layer in model.named_modules():
        if isinstance(layer, DeltaMixer):
            computed[name] = 0

            def count(gates, name=name):
                computed[name] += 1
                return gates

            layer.register_gate_hook(count)
    return computed


# How each gate enters the primitive: inputs -> inputs with the gate moved by delta.
BY_HAND = {
    "erase": lambda i, q, k, v, d: i._replace(b=i.b + d * k),
    "write": lambda i, q, k, v, d: i._replace(u=i.u + d * v),
    "g": lambda i, q, k, v, d: i._replace(g=i.g + d),
    "read": lambda i, q, k, v, d: i._replace(q=i.q + d * q),
}


def run_perturbed_by_hand(model, batch, layer, gate, delta):
    """(loss, the layer's final memory) with `delta` added to the gate, written out by hand."""
    original, seen = layer.primitive_inputs, {}

    def perturbed(x, q, k, v):
        inputs, gates = original(x, q, k, v)
        return DeltaRuleInputs(*BY_HAND[gate](inputs, q, k, v, delta)), gates

    layer.primitive_inputs = perturbed
    handle = layer.register_forward_hook(lambda m, a, out: seen.update(memory=out[1].memory))
    try:
        loss = model(batch)
    finally:
        handle.remove()
        del layer.primitive_inputs
    return loss, seen["memory"]


GATES = [("layers.0", g) for g in ("erase", "write", "g")] + [
    ("layers.1", g) for g in ("erase", "write", "g", "read")
]


@torch.no_grad()
def test_sensitivity_matches_finite_differences_float64(generator):
    model = gdn2_muir_stack()
    batch = make_batch(generator)
    tokens = batch[0].shape[0] * batch[0].shape[1]
    directions, direction = remembered_directions(generator)

    report = gate_sensitivity(model, batch, probes=1, direction=direction)
    assert sorted(directions) == sorted(GATES)
    for layer_name, gate in GATES:
        layer = model.get_submodule(layer_name)
        d = directions[layer_name, gate]
        loss_plus, memory_plus = run_perturbed_by_hand(model, batch, layer, gate, FD_EPS * d)
        loss_minus, memory_minus = run_perturbed_by_hand(model, batch, layer, gate, -FD_EPS * d)
        state_fd = ((memory_plus - memory_minus) / (2 * FD_EPS)).norm().item()
        loss_fd = abs((loss_plus - loss_minus).item()) / (2 * FD_EPS)
        what = f"{layer_name} {gate}"
        reported_state = report.state[layer_name][gate]
        reported_loss = report.loss[layer_name][gate]
        assert reported_state == pytest.approx(
            state_fd / math.sqrt(tokens), rel=FD_TOL, abs=1e-12
        ), what
        assert reported_loss == pytest.approx(loss_fd / math.sqrt(tokens), rel=FD_TOL), what
    # The read gate weighs the query only: the memory does not move, the loss does.
    assert report.state["layers.1"]["read"] == 0.0
    assert report.loss["layers.1"]["read"] > 0.0


class _LossOf(nn.Module):
    """A language model's loss on ids as its own labels: model(batch) -> loss."""

    def __init__(self, lm: CausalLM) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, labels=ids).loss


@torch.no_grad()
def test_sensitivity_through_a_later_attention_block_matches_finite_differences_float64(
    generator,
):
    """A hybrid model (a GDN-2 block, then softmax attention): the probes' tangents cross the
    attention block, whose fused SDPA kernels define no forward-mode derivative; the reported
    loss sensitivity equals the finite difference, batched or not, and the model's attention
    runs its usual kernels again afterwards."""
    with torch.random.fork_rng():
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=generator)))
        config = build_config(
            "tiny", mixer="gdn2", hidden_size=32, num_layers=2, num_heads=2, head_dim=16,
            chunk_size=16, attention_layers=[1],
        )  # fmt: skip
        model = _LossOf(CausalLM(config).double().eval())
    batch = torch.randint(0, config.vocab_size, (2, 21), generator=generator)
    tokens, name = batch.numel(), "lm.model.blocks.0.mixer"
    directions, direction = remembered_directions(generator)

    def report(per_pass):
        return gate_sensitivity(
            model, batch, probes=1, direction=direction, gates=["erase", "write"],
            per_pass=per_pass,
        )  # fmt: skip

    reports = [report(1), report(None)]
    layer = model.get_submodule(name)
    for gate in ("erase", "write"):
        d = directions[name, gate]
        loss_plus, _ = run_perturbed_by_hand(model, batch, layer, gate, FD_EPS * d)
        loss_minus, _ = run_perturbed_by_hand(model, batch, layer, gate, -FD_EPS * d)
        loss_fd = abs((loss_plus - loss_minus).item()) / (2 * FD_EPS) / math.sqrt(tokens)
        for report in reports:
            assert report.loss[name][gate] == pytest.approx(loss_fd, rel=FD_TOL), gate
    assert (
        torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    )


KALMAN_GATES = ("g", "q_noise", "r")


def run_noise_perturbed_by_hand(model, batch, layer, gate, delta):
    """(loss, the layer's final memory) with `delta` added to one of the KDN layer's
    `kalman_gates` outputs, written out by hand."""
    original, seen = layer.kalman_gates, {}

    def perturbed(x):
        gates = list(original(x))
        index = KALMAN_GATES.index(gate)
        gates[index] = gates[index] + delta
        # The perturbed point is a valid noise model: q_noise >= 0, r >= r_min.
        assert gates[1].min() >= 0 and gates[2].min() >= layer.r_min
        return tuple(gates)

    layer.kalman_gates = perturbed
    handle = layer.register_forward_hook(lambda m, a, out: seen.update(memory=out[1].memory))
    try:
        loss = model(batch)
    finally:
        handle.remove()
        del layer.kalman_gates
    return loss, seen["memory"]


@torch.no_grad()
def test_kdn_sensitivity_matches_finite_differences_float64(generator):
    model = Stack(seeded(IsotropicKDN, 0), seeded(DiagonalKDN, 1))
    batch = make_batch(generator)
    tokens = batch[0].shape[0] * batch[0].shape[1]
    for layer in model.layers:
        # Every point of the central difference stays a valid noise model (|d| <= 1 per token).
        _, q_noise, r = layer.kalman_gates(batch[0])
        assert q_noise.min() > 10 * FD_EPS and (r - layer.r_min).min() > 10 * FD_EPS
    directions, direction = remembered_directions(generator)

    report = gate_sensitivity(model, batch, probes=1, direction=direction)
    expected = [(f"layers.{i}", g) for i in range(2) for g in KALMAN_GATES]
    assert sorted(directions) == sorted(expected)
    assert report.gates == list(KALMAN_GATES)
    for layer_name, gate in expected:
        layer = model.get_submodule(layer_name)
        d = directions[layer_name, gate]
        plus = run_noise_perturbed_by_hand(model, batch, layer, gate, FD_EPS * d)
        minus = run_noise_perturbed_by_hand(model, batch, layer, gate, -FD_EPS * d)
        state_fd = ((plus[1] - minus[1]) / (2 * FD_EPS)).norm().item()
        loss_fd = abs((plus[0] - minus[0]).item()) / (2 * FD_EPS)
        what = f"{layer_name} {gate}"
        assert state_fd > 0 and loss_fd > 0, what
        assert report.state[layer_name][gate] == pytest.approx(
            state_fd / math.sqrt(tokens), rel=FD_TOL
        ), what
        assert report.loss[layer_name][gate] == pytest.approx(
            loss_fd / math.sqrt(tokens), rel=FD_TOL
        ), what
    # The hooks are gone after the probes.
    assert not any(layer._gate_hooks for layer in model.layers)


@torch.no_grad()
def test_kdn_perturb_gate_moves_the_reported_noise_and_restores_the_layer(generator):
    layer = seeded(DiagonalKDN, 0)
    x = make_batch(generator, length=5)[0]
    y, state = layer(x, return_gates=True)
    with perturb_gate(layer, "r", torch.zeros_like):
        y_wrapped, state_wrapped = layer(x)
    assert torch.equal(y_wrapped, y) and torch.equal(state_wrapped.memory, state.memory)
    with perturb_gate(layer, "r", lambda r: 2 * r):
        _, moved = layer(x, return_gates=True)
    torch.testing.assert_close(moved.gates["r"], 3 * state.gates["r"])
    with pytest.raises(KeyError, match="beta"), perturb_gate(layer, "beta", torch.zeros_like):
        layer(x)
    assert not layer._gate_hooks


@torch.no_grad()
def test_kdn_language_model_reports_finite_sensitivities(generator):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = CausalLM(build_config("tiny", mixer="kdn_diag", num_layers=2)).eval()
    batch = torch.randint(0, model.config.vocab_size, (2, 12), generator=generator)
    report = gate_sensitivity(
        model, batch, probes=1, loss_fn=lambda m, b: m(input_ids=b, labels=b).loss
    )
    assert len(report.layers) == 2
    for table in (report.state, report.loss):
        for per_layer in table.values():
            assert list(per_layer) == list(KALMAN_GATES)
            assert all(math.isfinite(v) for v in per_layer.values())


def test_random_probes_estimate_the_mean_over_tokens(generator):
    """With all tokens perturbed at once, E||J d||^2 / T is the mean over tokens of the exact
    E||J_t d_t||^2 = ||J_t||_F^2 / n over unit directions: checked against the full Jacobian."""
    layer = seeded(GatedDeltaNet2, 2, hidden_size=4, num_heads=1, head_dim=4)
    model = Stack(layer)
    x = torch.randn(1, 6, 4, generator=generator, dtype=torch.float64)
    batch = (x, torch.randn(1, 6, 4, generator=generator, dtype=torch.float64))
    zero = torch.zeros(1, 6, 1, 4, dtype=torch.float64)
    jacobian = torch.autograd.functional.jacobian(
        lambda delta: run_perturbed_by_hand(model, batch, layer, "erase", delta)[1], zero
    )  # [memory dims..., B, T, H, K]
    per_token = jacobian.square().flatten(0, 3).sum(0).sum((-2, -1))  # ||J_t||_F^2 [B, T]
    exact = math.sqrt((per_token / 4).mean().item())
    with torch.no_grad():
        report = gate_sensitivity(model, batch, probes=300, gates=["erase"], seed=1)
    assert report.state["layers.0"]["erase"] == pytest.approx(exact, rel=0.1)


@torch.no_grad()
def test_every_baseline_reports_its_own_gates(generator):
    model = Stack(seeded(DeltaNet, 0), seeded(GatedDeltaNet, 1), seeded(KimiDeltaAttention, 2))
    report = gate_sensitivity(model, make_batch(generator, length=9), probes=2)
    assert {layer: list(gates) for layer, gates in report.state.items()} == {
        "layers.0": ["beta"],
        "layers.1": ["beta", "g"],
        "layers.2": ["beta", "g"],
    }
    for table in (report.state, report.loss):
        for per_layer in table.values():
            assert all(math.isfinite(v) and v > 0 for v in per_layer.values())


@torch.no_grad()
@pytest.mark.parametrize(
    ("factory", "gate"),
    [
        (DeltaNet, "beta"),
        (GatedDeltaNet, "g"),
        (KimiDeltaAttention, "beta"),
        (GatedDeltaNet2, "write"),
        (Muir, "read"),
    ],
)
def test_a_zero_perturbation_rebuilds_the_layers_own_inputs(factory, gate, generator):
    layer = seeded(factory, 0)
    x = make_batch(generator, length=9)[0]
    y, state = layer(x)
    with perturb_gate(layer, gate, torch.zeros_like):
        y_wrapped, state_wrapped = layer(x)
    assert torch.equal(y_wrapped, y) and torch.equal(state_wrapped.memory, state.memory)
    assert not layer._gate_hooks


@torch.no_grad()
def test_perturb_gate_restores_the_layer_after_an_error(generator):
    layer = seeded(GatedDeltaNet2, 0)
    x = make_batch(generator, length=5)[0]
    with pytest.raises(KeyError, match="beta"), perturb_gate(layer, "beta", torch.zeros_like):
        layer(x)
    assert not layer._gate_hooks
    with pytest.raises(RuntimeError, match="inside"), perturb_gate(layer, "g", torch.zeros_like):
        raise RuntimeError("inside")
    assert not layer._gate_hooks
    # The perturbed gate is what the layer reports.
    with perturb_gate(layer, "erase", lambda e: torch.full_like(e, 0.25) - e):
        _, state = layer(x, return_gates=True)
    assert torch.equal(state.gates["erase"], torch.full_like(state.gates["erase"], 0.25))


@torch.no_grad()
def test_same_seed_gives_the_same_report(generator):
    model, batch = gdn2_muir_stack(), make_batch(generator, length=7)
    first = gate_sensitivity(model, batch, probes=2, seed=5)
    second = gate_sensitivity(model, batch, probes=2, seed=5)
    other = gate_sensitivity(model, batch, probes=2, seed=6)
    assert first == second and first != other


def test_unit_directions_have_unit_norm_per_token(generator):
    value = torch.rand(3, 5, 2, 4, dtype=torch.float32)
    d = unit_directions(value, generator)
    assert d.shape == value.shape and d.dtype == torch.float32
    torch.testing.assert_close(d.flatten(2).norm(dim=-1), torch.ones(3, 5))
    beta = unit_directions(torch.rand(3, 5, 2), generator)
    torch.testing.assert_close(beta.norm(dim=-1), torch.ones(3, 5))


@torch.no_grad()
def test_bad_models_losses_and_directions_are_refused(generator):
    batch = make_batch(generator, length=5)
    with pytest.raises(ValueError, match="no delta-rule layer"):
        gate_sensitivity(Stack(nn.Identity()), batch)
    model = Stack(seeded(GatedDeltaNet2, 0))
    with pytest.raises(ValueError, match="scalar"):
        gate_sensitivity(model, batch, loss_fn=lambda m, b: m.layers[0](b[0])[0])
    with pytest.raises(ValueError, match="direction for gate"):
        gate_sensitivity(model, batch, direction=lambda layer, gate, value: value[:, :1])
    with pytest.raises(ValueError, match="probes"):
        gate_sensitivity(model, batch, probes=0)


class Unregistered(DeltaMixer):
    """A mixer that neither has `inputs_from_gates` nor is a baseline."""

    def primitive_inputs(self, x, q, k, v):
        beta = torch.sigmoid(x[..., :H])
        return deltanet_inputs(q, k, v, beta), {"beta": beta}


@torch.no_grad()
def test_layers_whose_gates_cannot_be_perturbed_are_refused_or_left_out(generator):
    model = Stack(seeded(GatedDeltaNet2, 0), seeded(Unregistered, 1))
    batch = make_batch(generator, length=5)
    with pytest.raises(TypeError, match=r"layers\.1.*Unregistered"):
        gate_sensitivity(model, batch)
    report = gate_sensitivity(model, batch, probes=1, layers=["layers.0"])
    assert report.layers == ["layers.0"]
    with pytest.raises(ValueError, match=r"layers\.7"):
        gate_sensitivity(model, batch, layers=["layers.7"])


def test_table_and_bar_chart(tmp_path, generator):
    model = gdn2_muir_stack()
    with torch.no_grad():
        report = gate_sensitivity(model, make_batch(generator, length=7), probes=1)
    lines = report.table().splitlines()
    for header in ("layer", "gate", "d state / d gate", "d loss / d gate"):
        assert header in lines[0]
    assert len(lines) == 2 + 7 + 4  # header, rule, one row per layer and gate, mean rows
    rows = [line.split()[:2] for line in lines[2:]]
    assert rows[:7] == [list(key) for key in GATES]
    assert rows[7:] == [["mean", gate] for gate in ("erase", "write", "g", "read")]
    mean = report.mean("state")
    assert mean["erase"] == pytest.approx(
        (report.state["layers.0"]["erase"] + report.state["layers.1"]["erase"]) / 2
    )
    path = plot_gate_sensitivity(report, tmp_path / "figures" / "sensitivity.png")
    assert path.read_bytes().startswith(b"\x89PNG") and path.stat().st_size > 1000
    assert os.listdir(path.parent) == ["sensitivity.png"]  # no temporary file left


def test_save_figure_leaves_nothing_behind_on_failure(tmp_path):
    figure = new_figure()
    figure.subplots().plot([0, 1], [1, 0])
    with pytest.raises(ValueError):
        save_figure(figure, tmp_path / "plot.unknownformat")
    assert os.listdir(tmp_path) == []


def test_allocate_ranks_is_proportional_and_sums_to_the_budget():
    assert allocate_ranks({"g": 6, "erase": 1, "write": 3}, 20) == {
        "decay": 12,
        "erase": 2,
        "write": 6,
    }
    # Equal remainders: the extra rank goes to the first gate given.
    assert allocate_ranks({"erase": 1, "write": 1, "read": 1}, 10) == {
        "erase": 4,
        "write": 3,
        "read": 3,
    }
    # Largest remainder: quotas 5.6, 2.8, 1.6 -> floors 5, 2, 1 and the two largest remainders.
    assert allocate_ranks({"decay": 7, "write": 3.5, "read": 2}, 10) == {
        "decay": 6,
        "write": 3,
        "read": 1,
    }
    # Below the minimum: floored there, the rest shared among the others.
    assert allocate_ranks({"decay": 100, "erase": 1e-6, "write": 0}, 10, minimum=2) == {
        "decay": 6,
        "erase": 2,
        "write": 2,
    }
    assert allocate_ranks({"erase": 0, "write": 0}, 5) == {"erase": 3, "write": 2}
    generator = torch.Generator().manual_seed(0)
    for budget in (4, 17, 64, 333):
        weights = torch.rand(4, generator=generator).square().tolist()
        ranks = allocate_ranks(
            dict(zip(("decay", "erase", "write", "read"), weights, strict=True)), budget
        )
        assert sum(ranks.values()) == budget and min(ranks.values()) >= 1


def test_allocate_ranks_keeps_each_gate_within_its_maximum():
    # r's share (10 of 12) is above its width 2: it gets 2, the rest is split 6 : 1 again,
    # and process's quota 10/7 is then above the minimum, so it is not floored first.
    assert allocate_ranks(
        {"g": 6, "q_noise": 1, "r": 50}, 12, maximum={"observation": 2}, ranks=KDNMuirRanks
    ) == {"decay": 9, "process": 1, "observation": 2}
    assert allocate_ranks(
        {"g": 6.0, "q_noise": 1.0, "r": 50.0, "read": 3.0},
        24,
        maximum={"observation": 2},
        ranks=KDNMuirRanks,
    ) == {"decay": 13, "process": 2, "observation": 2, "read": 7}
    # Every gate with a share at its maximum: the zero-share gates take the rest evenly.
    assert allocate_ranks({"decay": 5, "erase": 0, "write": 0}, 10, maximum={"decay": 4}) == {
        "decay": 4,
        "erase": 3,
        "write": 3,
    }
    generator = torch.Generator().manual_seed(1)
    for budget in (6, 19, 40):
        weights = torch.rand(4, generator=generator).square().tolist()
        names = ("decay", "erase", "write", "read")
        maximum = {"erase": 2, "read": 3}
        ranks = allocate_ranks(dict(zip(names, weights, strict=True)), budget, maximum=maximum)
        assert sum(ranks.values()) == budget and min(ranks.values()) >= 1
        assert ranks["erase"] <= 2 and ranks["read"] <= 3


def test_allocate_ranks_refuses_bad_input():
    with pytest.raises(ValueError, match="beta"):
        allocate_ranks({"beta": 1.0}, 8)
    with pytest.raises(ValueError, match="budget"):
        allocate_ranks({"erase": 1.0, "write": 1.0}, 3, minimum=2)
    with pytest.raises(ValueError, match="finite"):
        allocate_ranks({"erase": float("nan")}, 3)
    with pytest.raises(ValueError, match=">= 0"):
        allocate_ranks({"erase": -1.0}, 3)
    with pytest.raises(ValueError, match="twice"):
        allocate_ranks({"g": 1.0, "decay": 1.0}, 3)
    with pytest.raises(ValueError, match="not a KDNMuirRanks field"):
        allocate_ranks({"erase": 1.0}, 3, ranks=KDNMuirRanks)
    with pytest.raises(ValueError, match="sum of the maxima"):
        allocate_ranks({"erase": 1.0, "write": 1.0}, 9, maximum={"erase": 2, "write": 3})
    with pytest.raises(ValueError, match="maximum has gate 'read'"):
        allocate_ranks({"erase": 1.0}, 3, maximum={"read": 2})


def test_spearman_ranks_with_ties():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert spearman(x, x * 10) == pytest.approx(1.0)
    assert spearman(x, -x) == pytest.approx(-1.0)
    # Ties share their average rank: ranks (0, 1.5, 1.5, 3) against (0, 1, 2, 3).
    assert spearman(torch.tensor([0.0, 5.0, 5.0, 9.0]), x) == pytest.approx(
        4.5 / math.sqrt(4.5 * 5)
    )
    assert math.isnan(spearman(torch.ones(4), x))


@torch.no_grad()
def test_slow_rows_grow_largest(tmp_path, generator):
    layer = seeded(GatedDeltaNet2, 3)
    slow, fast = 1e-2, 2.0  # softplus(dt_bias): the log decay per token, as A = 1
    rates = torch.tensor([slow, fast], dtype=torch.float64).repeat(K // 2)  # alternate channels
    layer.decay.f_proj[1].weight.zero_()  # the decay no longer depends on the token
    layer.decay.A_log.zero_()
    layer.decay.dt_bias.copy_((rates + torch.log(-torch.expm1(-rates))).expand(H, K))
    x = torch.randn(2, 200, D, generator=generator, dtype=torch.float64)
    report = row_norms(layer, x)
    assert report.row_norm.shape == report.mean_decay.shape == (H, K)
    torch.testing.assert_close(report.mean_decay, torch.exp(-rates).expand(H, K))
    assert report.row_norm[:, 0::2].min() > report.row_norm[:, 1::2].max()
    assert report.correlation > 0.5
    path = plot_row_norms(report, tmp_path / "rows.png")
    assert path.stat().st_size > 1000
    with pytest.raises(ValueError, match="decay gate"):
        row_norms(seeded(DeltaNet, 0), x)


def test_report_mean_refuses_unknown_kind():
    report = SensitivityReport(state={"a": {"g": 1.0}}, loss={"a": {"g": 2.0}}, probes=1)
    assert report.mean("loss") == {"g": 2.0}
    with pytest.raises(ValueError, match="kind"):
        report.mean("memory")


@torch.no_grad()
def test_probes_run_triton_layers_on_the_chunk_path_and_restore_their_backend(generator):
    """Forward-mode AD cannot go through the Triton kernels (their autograd Functions define no
    jvp): a model built for the Triton backend is probed on the chunk path, gives the chunk
    path's numbers, and keeps its backend."""
    batch = torch.randint(0, 256, (2, 12), generator=generator)

    def report_for(backend: str) -> SensitivityReport:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            config = build_config("tiny", mixer="gdn2", num_layers=2, backend=backend)
            model = CausalLM(config).eval()
        report = gate_sensitivity(
            model, batch, probes=1, loss_fn=lambda m, b: m(input_ids=b, labels=b).loss
        )
        assert {m.backend for m in model.modules() if isinstance(m, DeltaMixer)} == {backend}
        return report

    triton, chunk = report_for("triton"), report_for("chunk")
    for kind in ("state", "loss"):
        for layer, values in getattr(chunk, kind).items():
            assert getattr(triton, kind)[layer] == pytest.approx(values, rel=1e-6)


@torch.no_grad()
def test_probes_replay_the_layers_before_the_probed_one(generator, monkeypatch):
    """A probe's tangent starts at the probed layer, so the layers called before it are replayed
    from the recording pass, not computed: each layer computes once for the recording and once
    per probe of itself and of every earlier layer. The report equals a full recomputation."""
    module = importlib.import_module("deltalab.analysis.gate_sensitivity")
    model = Stack(seeded(GatedDeltaNet2, 0), seeded(GatedDeltaNet2, 1), seeded(GatedDeltaNet2, 2))
    batch = make_batch(generator)
    computed = count_gate_computations(model)
    replayed = gate_sensitivity(model, batch, probes=2, seed=3, per_pass=1)
    gates = len(replayed.gates)  # erase, write, g in every layer
    assert gates == 3
    assert computed == {f"layers.{i}": 1 + (i + 1) * gates * 2 for i in range(3)}
    assert not any("forward" in vars(layer) for layer in model.layers)

    monkeypatch.setattr(module, "_replaying", lambda calls: contextlib.nullcontext())
    full = gate_sensitivity(model, batch, probes=2, seed=3, per_pass=1)
    assert computed["layers.0"] == 2 + (1 + 3) * gates * 2  # the full run computes every layer
    for kind in ("state", "loss"):
        for layer, values in getattr(full, kind).items():
            assert getattr(replayed, kind)[layer] == pytest.approx(values, rel=1e-12)


@torch.no_grad()
def test_batched_probes_compute_each_layer_once_per_pass_and_replay_the_earlier_ones(generator):
    """With per_pass directions in one pass, a layer computes once for the recording and once
    per pass of itself and of every later-probed layer: by default (per_pass = probes) one pass
    per gate, with per_pass = gates * probes one pass per layer."""
    model = Stack(seeded(GatedDeltaNet2, 0), seeded(GatedDeltaNet2, 1), seeded(GatedDeltaNet2, 2))
    batch = make_batch(generator)
    computed = count_gate_computations(model)
    gates, probes = 3, 2  # erase, write, g in every layer
    gate_sensitivity(model, batch, probes=probes, seed=3)
    assert computed == {f"layers.{i}": 1 + (i + 1) * gates for i in range(3)}
    computed.update(dict.fromkeys(computed, 0))
    gate_sensitivity(model, batch, probes=probes, seed=3, per_pass=gates * probes)
    assert computed == {f"layers.{i}": 1 + (i + 1) for i in range(3)}
    assert not any("forward" in vars(layer) for layer in model.layers)


def assert_same_reports(got, expected, rel):
    assert got.layers == expected.layers and got.gates == expected.gates
    for kind in ("state", "loss"):
        for layer, values in getattr(expected, kind).items():
            assert list(getattr(got, kind)[layer]) == list(values)
            assert getattr(got, kind)[layer] == pytest.approx(values, rel=rel, abs=0)


@torch.no_grad()
@pytest.mark.parametrize("mixer", ["muir", "gdn2", "kdn_diag"])
def test_batched_probes_give_the_numbers_of_one_pass_per_direction_float32(mixer, generator):
    """Batching directions into one forward pass (per_pass > 1: torch.func.jvp under vmap, the
    primal once) reports what one forward_ad pass per direction reports, with the same random
    directions, up to float32 rounding: fresh random language models, per_pass dividing the
    probes, straddling gates, or taking every direction of a layer at once."""
    with torch.random.fork_rng():
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=generator)))
        config = build_config(
            "tiny", mixer=mixer, hidden_size=32, num_layers=2, num_heads=2, head_dim=16,
            chunk_size=16,
        )  # fmt: skip
        model = CausalLM(config).eval()
    batch = torch.randint(0, config.vocab_size, (2, 41), generator=generator)

    def report(per_pass):
        return gate_sensitivity(
            model, batch, loss_fn=lambda m, b: m(input_ids=b, labels=b).loss, probes=3, seed=7,
            per_pass=per_pass,
        )  # fmt: skip

    one = report(1)
    for per_pass in (None, 2, 100):
        assert_same_reports(report(per_pass), one, rel=1e-5)


@torch.no_grad()
def test_batched_probes_give_the_numbers_of_one_pass_per_direction_float64(generator):
    """The same in float64, to 1e-12, with a direction function that reads the gate values
    (the recording pass hands it the values the probes see) and a read gate that never moves
    the memory (0 in both)."""
    model, batch = gdn2_muir_stack(), make_batch(generator, length=23)

    def along_the_gate(layer, gate, value):
        return value / value.flatten(2).norm(dim=-1)[(..., *[None] * (value.dim() - 2))]

    for direction in (None, along_the_gate):
        one = gate_sensitivity(model, batch, probes=2, seed=4, direction=direction, per_pass=1)
        for per_pass in (None, 3, 7):
            batched = gate_sensitivity(
                model, batch, probes=2, seed=4, direction=direction, per_pass=per_pass
            )
            assert_same_reports(batched, one, rel=1e-12)
        assert one.state["layers.1"]["read"] == batched.state["layers.1"]["read"] == 0


@torch.no_grad()
def test_batched_probes_fall_back_to_one_pass_per_direction_where_vmap_fails(generator):
    """A loss that vmap cannot go through (here a random op, which vmap refuses) gets a warning and one forward_ad pass per direction, with the same directions: the report of
    per_pass=1."""
    model, batch = gdn2_muir_stack(), make_batch(generator, length=11)

    def loss_fn(model, batch):
        loss = model(batch)
        return loss + 0 * torch.rand((), dtype=loss.dtype)

    one = gate_sensitivity(model, batch, loss_fn=loss_fn, probes=2, seed=2, per_pass=1)
    with pytest.warns(RuntimeWarning, match="batched probes failed"):
        batched = gate_sensitivity(model, batch, loss_fn=loss_fn, probes=2, seed=2)
    assert batched == one
    assert not any("forward" in vars(layer) for layer in model.layers)
    assert not any(layer._gate_hooks for layer in model.layers)
