"""The `kdn-authors-1.3B` preset: the KDN authors' released 1.3B configuration (their
`iso_kdn_1.3B` and `diag_kdn_1.3B`), as far as deltalab's layers reproduce it."""

from __future__ import annotations

import math

import pytest
import torch

from deltalab.layers.kdn import DiagonalKDN, IsotropicKDN
from deltalab.models import CausalLM, build_config, count_parameters
from deltalab.train import load_run_config

# The totals the authors' config lists for these models (embeddings and LM head included).
AUTHORS_TOTALS = {"kdn_iso": 1_449_848_592, "kdn_diag": 1_449_806_796}
SMALL = dict(hidden_size=64, num_layers=1, num_heads=2, head_dim=32, ffn_width=64, vocab_size=259)


@pytest.mark.parametrize("mixer", list(AUTHORS_TOTALS))
def test_the_preset_has_the_authors_parameter_counts(mixer):
    config = build_config("kdn-authors-1.3B", mixer=mixer)
    assert count_parameters(config, embeddings=True) == AUTHORS_TOTALS[mixer]
    assert (config.hidden_size, config.num_layers, config.num_heads, config.head_dim) == (
        2304,
        18,
        18,
        128,
    )
    assert config.attention_indices() == [] and config.vocab_size == 32000


@pytest.mark.parametrize("mixer", list(AUTHORS_TOTALS))
def test_the_presets_noise_model_starts_where_the_authors_does(mixer):
    torch.manual_seed(0)
    authors = CausalLM(build_config("kdn-authors-1.3B", mixer=mixer, **SMALL)).model.blocks[0]
    ours = CausalLM(build_config("1.3B", mixer=mixer, **SMALL)).model.blocks[0]
    x = torch.zeros(1, 3, SMALL["hidden_size"])
    _, q, r = authors.mixer.kalman_gates(x)
    assert torch.allclose(r, torch.full_like(r, 0.01 + math.log(2)))
    assert torch.allclose(q, torch.full_like(q, math.log(2)))
    _, q, r = ours.mixer.kalman_gates(x)
    assert torch.allclose(r, torch.ones_like(r)) and torch.allclose(q, torch.full_like(q, 0.1))
    # Both keep the reference's floor, evidence scale and prior precision of 1.
    assert authors.mixer.r_min == 0.01 and authors.mixer.info_scale == 32.0
    assert torch.allclose(authors.mixer.prior_variance(), torch.ones(SMALL["num_heads"]))


def test_the_run_configs_mixer_options_merge_over_the_presets():
    config = build_config("kdn-authors-1.3B", mixer="kdn_diag", mixer_options={"r_min": 0.02})
    assert config.mixer_options == {"r_bias": 0.0, "q_bias": 0.0, "r_min": 0.02}


def test_the_preset_trains_at_the_authors_peak_and_warmup():
    config = load_run_config(None, ["model.preset=kdn-authors-1.3B", "model.mixer=kdn_diag"])
    assert (config.optim.lr, config.schedule.warmup_steps) == (4e-4, 1907)
    assert (config.optim.betas, config.optim.weight_decay, config.optim.grad_clip) == (
        (0.9, 0.95),
        0.1,
        1.0,
    )
    assert config.schedule.min_lr_ratio == pytest.approx(4e-5 / 4e-4)


def test_the_preset_refuses_the_mixers_it_is_not_made_for():
    with pytest.raises(ValueError, match=r"made for the mixers \['kdn_iso', 'kdn_diag'\]"):
        build_config("kdn-authors-1.3B", mixer="gdn2")


@pytest.mark.parametrize("layer", [IsotropicKDN, DiagonalKDN])
def test_a_process_noise_bias_is_refused_where_the_process_noise_is_tied(layer):
    with pytest.raises(TypeError, match="q_bias"):
        layer(hidden_size=64, num_heads=2, head_dim=32, process_noise="tied", q_bias=0.0)
