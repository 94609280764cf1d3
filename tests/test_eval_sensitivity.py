"""`deltalab eval --task gate-sensitivity`: per-layer gate sensitivities of a checkpoint (and of
its initialization), the erase/write ratios and rank allocations read from them, the refusal of
a model without gates. Micro models (2 layers, width 32) keep the file to a few seconds."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from deltalab.cli import main
from deltalab.eval.common import EvalError, load_checkpoint
from deltalab.eval.sensitivity import GateSensitivitySettings, gate_sensitivity
from deltalab.eval.tasks import TaskContext
from deltalab.models import CausalLM, DeltaLabConfig

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n\n" * 30
MICRO = dict(hidden_size=32, num_layers=2, num_heads=2, head_dim=16, chunk_size=16)

# torch's forward-mode AD scripts its decompositions on first use, which warns on torch 2.13.
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning"
)


def save_micro(path: Path, mixer: str, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    CausalLM(DeltaLabConfig(mixer=mixer, **MICRO)).save_pretrained(path)
    return path


def settings(tmp_path: Path, **fields) -> GateSensitivitySettings:
    (tmp_path / "text.txt").write_text(TEXT)
    return GateSensitivitySettings(
        source=str(tmp_path / "text.txt"),
        split="all",
        cache_dir=str(tmp_path / "cache"),
        **{"seq_len": 24, "batch_size": 2, "probes": 2, **fields},
    )


def run(tmp_path: Path, checkpoint: Path, seed: int = 0, **fields):
    ctx = TaskContext(
        checkpoint=load_checkpoint(str(checkpoint)),
        seed=seed,
        device="cpu",
        out_dir=tmp_path / f"out-{seed}",
        progress=False,
    )
    return gate_sensitivity(settings(tmp_path, **fields), ctx)


def test_muir_reports_finite_sensitivities_ratios_and_ranks_from_its_numbers(tmp_path):
    outcome = run(tmp_path, save_micro(tmp_path / "muir", "muir"))
    metrics = outcome.metrics
    assert set(metrics) >= {"trained", "init"} and metrics["tokens"] == 2 * 25
    for model in ("trained", "init"):
        layers = metrics[model]["layers"]
        assert list(layers) == ["model.blocks.0.mixer", "model.blocks.1.mixer"]
        for layer in layers.values():
            for kind in ("state", "loss"):
                values = layer[kind]
                assert list(values) == ["erase", "write", "g", "read"]
                assert all(math.isfinite(v) and v >= 0 for v in values.values())
                # The ratio is the one of the reported numbers.
                assert layer["erase_write"][kind] == values["erase"] / values["write"]
                ranks = layer["ranks"][kind]
                assert ranks["reference"] == {"decay": 16, "erase": 2, "write": 8, "read": 4}
                assert sum(ranks["allocated"].values()) == ranks["budget"] == 30
            # The read gate never touches the memory.
            assert layer["state"]["read"] == 0 and layer["loss"]["read"] > 0
        mean = metrics[model]["mean"]
        assert mean["erase_write"]["loss"] == mean["loss"]["erase"] / mean["loss"]["write"]
    summary = outcome.summary
    assert summary["reference_ranks"] == "decay=16 erase=2 write=8 read=4"
    assert summary["trained_erase_below_write_state"].endswith("/2")
    names = {Path(f).name for f in outcome.files}
    assert names == {"gate_sensitivity_trained.png", "gate_sensitivity_init.png", "erase_write.png"}
    assert all(Path(f).stat().st_size > 0 for f in outcome.files)
    assert "| rank | Muir layer |" in outcome.table


def test_same_seed_gives_the_same_numbers_and_another_seed_others(tmp_path):
    checkpoint = save_micro(tmp_path / "muir", "muir")
    first = run(tmp_path, checkpoint, seed=3, at_init=False).metrics
    again = run(tmp_path, checkpoint, seed=3, at_init=False).metrics
    other = run(tmp_path, checkpoint, seed=4, at_init=False).metrics
    assert first == again
    assert first["trained"] != other["trained"]
    assert "init" not in first and first["init_seed"] is None


def test_per_pass_batches_the_probes_and_reports_the_same_numbers(tmp_path):
    """per_pass only groups the probes' derivatives into forward passes: one pass per direction
    (1), the default (one gate's probes a pass) and every direction of a layer at once agree up
    to float32 rounding; 0 is refused."""
    checkpoint = save_micro(tmp_path / "muir", "muir")
    one = run(tmp_path, checkpoint, seed=3, at_init=False, per_pass=1).metrics["trained"]
    for per_pass in (None, 8):
        batched = run(tmp_path, checkpoint, seed=3, at_init=False, per_pass=per_pass).metrics
        for name, layer in one["layers"].items():
            for kind in ("state", "loss"):
                got = batched["trained"]["layers"][name][kind]
                assert got == pytest.approx(layer[kind], rel=1e-5, abs=0)
    with pytest.raises(ValueError, match="per_pass"):
        settings(tmp_path, per_pass=0)


def test_init_is_the_runs_own_initialization(tmp_path):
    """A checkpoint beside a run config with train.seed = 5 is compared with the weights
    `deltalab train` draws for seed 5: a checkpoint that is exactly that initialization gives the
    same numbers twice."""
    run_dir = tmp_path / "run"
    checkpoint = save_micro(run_dir / "model", "gdn2", seed=5)
    (run_dir / "config.yaml").write_text("train:\n  seed: 5\n  seq_len: 24\n")
    metrics = run(tmp_path, checkpoint, seed=0, seq_len=None).metrics
    assert metrics["init_seed"] == 5 and metrics["init_seed_from"] == "train.seed of the run"
    assert metrics["seq_len"] == 24
    assert metrics["trained"] == metrics["init"]


@pytest.mark.parametrize("mixer", ["gdn2", "kdn_muir", "kdn_diag", "gdn"])
def test_every_gated_family_is_measured(tmp_path, mixer):
    metrics = run(tmp_path, save_micro(tmp_path / mixer, mixer), at_init=False).metrics
    layer = metrics["trained"]["layers"]["model.blocks.0.mixer"]
    gates = {
        "gdn2": ["erase", "write", "g"],
        "kdn_muir": ["g", "q_noise", "r", "read"],
        "kdn_diag": ["g", "q_noise", "r"],
        "gdn": ["beta", "g"],
    }[mixer]
    assert list(layer["loss"]) == gates
    assert all(math.isfinite(v) for v in layer["loss"].values())
    has_both = mixer == "gdn2"
    assert (layer["erase_write"]["state"] is not None) == has_both
    ranks = layer["ranks"]["loss"]
    expected = {
        # GDN-2 is compared with the Muir preset's ranks, KDN with the KDN-Muir preset's.
        "gdn2": ("muir preset", {"decay": 16, "erase": 2, "write": 8}),
        "kdn_muir": ("KDNMuir layer", {"decay": 16, "process": 4, "observation": 2, "read": 4}),
        "kdn_diag": ("kdn_muir preset", {"decay": 16, "process": 4, "observation": 2}),
    }.get(mixer)
    if expected is None:
        assert ranks is None  # beta has no rank in a fused projection
    else:
        assert (ranks["source"], ranks["reference"]) == expected
        assert sum(ranks["allocated"].values()) == ranks["budget"]
        assert ranks["allocated"].get("observation", 0) <= 2  # never above its width, H


def test_a_model_without_gates_is_refused(tmp_path):
    checkpoint = save_micro(tmp_path / "transformer", "transformer")
    with pytest.raises(EvalError, match=r"needs gated delta-rule layers.*transformer.*no gates"):
        run(tmp_path, checkpoint)


def test_command_writes_results_and_refuses_a_transformer_on_one_line(tmp_path, capsys):
    checkpoint = save_micro(tmp_path / "muir", "muir")
    (tmp_path / "text.txt").write_text(TEXT)
    words = [
        f"source={tmp_path / 'text.txt'}",
        "split=all",
        f"cache_dir={tmp_path / 'cache'}",
        "seq_len=24",
        "batch_size=2",
        "probes=1",
    ]
    out = tmp_path / "results"
    args = ["eval", str(checkpoint), "--task", "gate-sensitivity", *words, "--no-progress"]
    assert main([*args, "--out", str(out)]) == 0
    record = json.loads((out / "results.json").read_text())
    assert record["task"] == "gate-sensitivity" and record["settings"]["probes"] == 1
    assert record["summary"]["reference_ranks"] == "decay=16 erase=2 write=8 read=4"
    capsys.readouterr()
    transformer = save_micro(tmp_path / "transformer", "transformer")
    capsys.readouterr()
    assert main(["eval", str(transformer), "--task", "gate-sensitivity", *words]) == 2
    # The last line of stderr (the weights' loading bar comes before it) is the whole error.
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("deltalab eval: error: gate-sensitivity needs gated delta-rule")
