"""The read-gate ablations of studies/gpu_sweep.yaml are the layers they claim to ablate: with
the read gate off, GDN-2's and Diagonal KDN's parameters, at the language models' and the MQAR
models' sizes (the equivalence of the computation at these ranks is tests/test_muir.py's and
tests/test_kdn_muir.py's)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltalab.layers.gdn2 import GatedDeltaNet2
from deltalab.layers.kdn import DiagonalKDN
from deltalab.layers.kdn_muir import KDNMuir
from deltalab.layers.muir import Muir
from deltalab.study.spec import load_spec

SPEC = Path(__file__).resolve().parents[1] / "studies" / "gpu_sweep.yaml"
ABLATIONS = {"gdn2-read": (Muir, GatedDeltaNet2), "kdn_diag-read": (KDNMuir, DiagonalKDN)}


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("name", list(ABLATIONS))
def test_a_read_gate_ablation_without_its_read_gate_is_the_layer_it_ablates(name):
    spec = load_spec(SPEC)
    variant = spec.variant(name)
    assert variant.options["read_gate"] == "dynamic"
    model = spec.run["model"]["overrides"]
    mqar = next(e for e in spec.evals if e.task == "mqar-train").settings
    sizes = [
        {k: model[k] for k in ("hidden_size", "num_heads", "head_dim")},
        {"hidden_size": mqar["hidden_size"], "num_heads": 1, "head_dim": mqar["hidden_size"]},
    ]
    ablation, base = ABLATIONS[name]
    with torch.device("meta"):
        for size in sizes:
            off = ablation(**size, ranks=variant.options["ranks"], read_gate="none")
            on = ablation(**size, ranks=variant.options["ranks"], read_gate="dynamic")
            assert count(off) == count(base(**size)) < count(on)


def test_the_long_gpu_study_spec_parses_with_its_throughput_runs_and_validated_rates():
    spec = load_spec(Path(__file__).resolve().parents[1] / "studies" / "gpu_long.yaml")
    assert spec.throughput_steps == 30 and spec.sweeps and spec.baseline == "gdn2"
    assert len(spec.variants) * len(spec.lrs) * len(spec.seeds) == 54
    train = spec.run["train"]
    assert train["steps"] * train["batch_size"] * train["seq_len"] == 19_660_800
