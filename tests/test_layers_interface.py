"""The interface every delta-rule mixer shares: its frontend as one `FrontendOptions` or as the
plain keywords users wrote before it existed (wrong keywords fail naming themselves), and its
gates apart from the memory (`gates`, gate hooks, `inputs_from_gates`)."""

from __future__ import annotations

from typing import get_type_hints

import pytest
import torch

from deltalab.layers import (
    DeltaNet,
    DiagonalKDN,
    ExactKDN,
    GatedDeltaNet,
    GatedDeltaNet2,
    IsotropicKDN,
    KDNMuir,
    KimiDeltaAttention,
    Muir,
)
from deltalab.layers.frontend import FRONTEND_FIELDS, FrontendKeywords, FrontendOptions
from deltalab.models import CausalLM, DeltaLabConfig
from deltalab.ops import delta_rule

MIXERS = (
    DeltaNet,
    GatedDeltaNet,
    KimiDeltaAttention,
    GatedDeltaNet2,
    Muir,
    IsotropicKDN,
    DiagonalKDN,
    ExactKDN,
    KDNMuir,
)
FRONTEND = dict(hidden_size=16, num_heads=2, head_dim=8, value_dim=4, conv_size=3, chunk_size=16)


def seeded(build):
    torch.manual_seed(0)
    return build()


@pytest.mark.parametrize("mixer", MIXERS, ids=lambda cls: cls.__name__)
def test_options_object_and_plain_keywords_build_the_same_layer(mixer):
    by_keywords = seeded(lambda: mixer(**FRONTEND, norm_eps=1e-3))
    by_options = seeded(lambda: mixer(options=FrontendOptions(**FRONTEND, norm_eps=1e-3)))
    assert by_keywords.options == by_options.options
    assert by_options.options.norm_eps == by_options.o_norm.eps == 1e-3
    expected = by_keywords.state_dict()
    for name, tensor in by_options.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize("mixer", MIXERS, ids=lambda cls: cls.__name__)
def test_misspelt_keyword_is_refused_naming_it_and_the_closest_valid_one(mixer):
    with pytest.raises(TypeError, match=r"'hiden_size' \(did you mean 'hidden_size'\?\)"):
        mixer(hiden_size=16, num_heads=2, head_dim=8)


def test_misspelt_own_keyword_of_a_mixer_gets_the_closest_of_its_own_arguments():
    with pytest.raises(TypeError, match=r"Muir got .*'read_gates' \(did you mean 'read_gate'\?\)"):
        Muir(**FRONTEND, read_gates="static")


def test_options_and_frontend_keywords_together_are_refused():
    with pytest.raises(TypeError, match=r"options or the frontend keywords.*\['conv_size'\]"):
        GatedDeltaNet2(FrontendOptions(**FRONTEND), conv_size=2)


def test_mixer_default_gate_activation_applies_when_the_options_leave_it_open():
    options = FrontendOptions(**FRONTEND)
    assert DeltaNet(options).o_norm.activation == "silu"
    assert KimiDeltaAttention(options).o_norm.activation == "sigmoid"
    assert KimiDeltaAttention(options).options.gate_activation == "sigmoid"


def test_frontend_options_are_validated_naming_the_field():
    with pytest.raises(ValueError, match="chunk_size must be in"):
        FrontendOptions(**{**FRONTEND, "chunk_size": 8})
    with pytest.raises(ValueError, match="backend must be one of"):
        FrontendOptions(**FRONTEND, backend="cuda")


@pytest.mark.parametrize("chunk_size", [0, 15, 257, 64.0])
def test_layers_refuse_exactly_the_chunk_sizes_the_op_refuses(chunk_size, generator):
    q, a, b = (torch.randn(1, 4, 1, 8, generator=generator) for _ in range(3))
    u, g = torch.randn(1, 4, 1, 4, generator=generator), torch.zeros(1, 4, 1)
    with pytest.raises((TypeError, ValueError)) as op_error:
        delta_rule(q, a, b, u, g, chunk_size=chunk_size)
    with pytest.raises(type(op_error.value)) as layer_error:
        GatedDeltaNet(**{**FRONTEND, "chunk_size": chunk_size})
    assert str(layer_error.value) == str(op_error.value)


def test_kdn_options_that_a_variant_lacks_are_refused_by_name():
    with pytest.raises(TypeError, match="IsotropicKDN got noise_rank"):
        IsotropicKDN(**FRONTEND, noise_rank=2)
    with pytest.raises(TypeError, match="ExactKDN got info_scale"):
        ExactKDN(**FRONTEND, info_scale=2.0)


def test_model_config_gives_frontend_options_from_its_fields_and_mixer_options():
    config = DeltaLabConfig(
        **FRONTEND, mixer="kda", num_layers=1, mixer_options={"norm_eps": 1e-3, "decay_rank": 2}
    )
    mixer = CausalLM(config).model.blocks[0].mixer
    assert mixer.options == FrontendOptions(**FRONTEND, gate_activation="sigmoid", norm_eps=1e-3)
    assert mixer.decay.f_proj[0].out_features == 2


def test_mixer_options_repeating_a_config_field_are_refused():
    config = DeltaLabConfig(**FRONTEND, mixer="gdn", mixer_options={"chunk_size": 32})
    with pytest.raises(ValueError, match=r"mixer_options\.chunk_size repeats the config field"):
        CausalLM(config)


@pytest.mark.parametrize("mixer", MIXERS, ids=lambda cls: cls.__name__)
def test_gates_then_inputs_from_gates_are_what_the_forward_feeds_the_primitive(mixer, generator):
    layer = seeded(lambda: mixer(**FRONTEND)).double()
    x = torch.randn(2, 5, FRONTEND["hidden_size"], generator=generator, dtype=torch.float64)
    seen = {}

    def record(gates):
        seen.update(gates)
        return gates

    handle = layer.register_gate_hook(record)
    y, state = layer(x, return_gates=True)
    handle.remove()
    assert set(seen) == set(layer.gates(x)) and set(seen) <= set(state.gates)
    for name, value in layer.gates(x).items():
        assert torch.equal(value, seen[name]) and torch.equal(value, state.gates[name]), name
    # A hook that replaces the gates replaces what the layer computes with; removed, it is gone.
    halved = {name: 0.5 * value for name, value in seen.items()}
    with torch.no_grad():
        handle = layer.register_gate_hook(lambda gates: halved)
        y_hooked, _ = layer(x)
        handle.remove()
        y_again, _ = layer(x)
    assert not torch.allclose(y_hooked, y) and torch.equal(y_again, y)


@pytest.mark.parametrize(
    "mixer", [GatedDeltaNet2, Muir, DiagonalKDN, KDNMuir], ids=lambda c: c.__name__
)
def test_inputs_from_gates_rebuild_the_primitive_inputs_of_a_first_call(mixer, generator):
    layer = seeded(lambda: mixer(**FRONTEND)).double()
    x = torch.randn(2, 5, FRONTEND["hidden_size"], generator=generator, dtype=torch.float64)
    q, k, v = (
        torch.randn(2, 5, 2, dim, generator=generator, dtype=torch.float64) for dim in (8, 8, 4)
    )
    inputs, _ = layer.primitive_inputs(x, q, k, v)
    rebuilt = layer.inputs_from_gates(q, k, v, layer.gates(x))
    for name, a, b in zip(inputs._fields, inputs, rebuilt, strict=True):
        assert torch.equal(a, b), name


def test_frontend_keywords_type_the_same_fields_as_the_options():
    # FrontendKeywords repeats FrontendOptions for type checkers (Unpack needs a TypedDict):
    # a field added to one and not the other would make plain keywords and options diverge.
    assert tuple(get_type_hints(FrontendKeywords)) == FRONTEND_FIELDS
    assert get_type_hints(FrontendKeywords) == get_type_hints(FrontendOptions)


@pytest.mark.parametrize(
    ("layer_backend", "expected"),
    # "triton" steps on "auto": the fused kernel, or the token loop where a step needs
    # gradients (the kernel records no backward).
    [("naive", "naive"), ("chunk", "naive"), ("triton", "auto"), ("auto", "auto")],
)
def test_a_decoding_step_runs_on_the_step_backend_of_the_layer_backend(
    layer_backend, expected, generator, monkeypatch
):
    """One token continuing a state takes `delta_rule_step` with the layer's backend mapped to
    the step's (the PyTorch paths to the token loop), not "auto" whatever the layer runs on."""
    from deltalab.layers import recurrence
    from deltalab.ops.parametrize import DeltaRuleInputs

    seen, original = [], recurrence.delta_rule_step

    def step(*args, backend, in_place):
        seen.append(backend)
        return original(*args, backend="naive", in_place=in_place)

    monkeypatch.setattr(recurrence, "delta_rule_step", step)
    q, a, b = (torch.randn(2, 1, 3, 4, generator=generator) for _ in range(3))
    u = torch.randn(2, 1, 3, 5, generator=generator)
    g = -torch.rand(2, 1, 3, generator=generator)
    memory = torch.randn(2, 3, 4, 5, generator=generator)
    o, new = recurrence.run_delta_rule(
        DeltaRuleInputs(q, a, b, u, g), memory, chunk_size=16, backend=layer_backend
    )
    assert seen == [expected]
    assert o.shape == (2, 1, 3, 5) and new.shape == memory.shape
