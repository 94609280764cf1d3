"""What a study report says about its runs beyond the comparisons: the device the runs trained
on (their records', not the machine writing the report) and the one definition of a ratio over
layers (the ratio of the summed sensitivities)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from test_study import FakeTrain, finished_micro_study, micro_spec, plan_of, quiet, write_corpus

from deltalab.cli import main
from deltalab.study.cli import execute


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def test_the_report_names_the_device_the_records_trained_on(tmp_path, corpus, capsys):
    spec = finished_micro_study(tmp_path, corpus)
    # As if the runs had trained on a GPU and the report were rebuilt on this CPU machine.
    for metrics in (tmp_path / "study" / "runs").glob("*/metrics.json"):
        data = json.loads(metrics.read_text())
        data["config"]["train"]["device"] = "cuda"
        metrics.write_text(json.dumps(data))
    for record in (tmp_path / "study" / "runs").glob("*/provenance.json"):
        data = json.loads(record.read_text())
        data["device"] = "cuda: NVIDIA H100 80GB HBM3"
        record.write_text(json.dumps(data))
    for record in (tmp_path / "study" / "runs").glob("*/study_run.json"):
        data = json.loads(record.read_text())
        data.get("provenance", {})["device"] = "cuda: NVIDIA H100 80GB HBM3"
        record.write_text(json.dumps(data))
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert main(["study", str(path), "--aggregate-only"]) == 0
    capsys.readouterr()
    header = (tmp_path / "study" / "study.md").read_text().splitlines()[2]
    assert "the runs trained on cuda: NVIDIA H100 80GB HBM3 (their records)" in header
    assert "cpu" not in header.split("trained on")[1]


class TwoLayerGates(FakeTrain):
    """FakeTrain whose gate-sensitivity evaluation reports two layers with erase/write
    sensitivities (1, 10) and (3, 1): ratios 0.1 and 3 (mean 1.55), summed 4 / 11."""

    def __call__(self, args, env, log):
        code = super().__call__(args, env, log)
        if "train" in args or "gate-sensitivity" not in args:
            return code
        out = Path(args[args.index("--out") + 1])
        layers = {
            f"model.blocks.{i}.mixer": {"erase_write": {"state": ratio, "loss": None}}
            for i, ratio in enumerate((0.1, 3.0))
        }
        phase = {"layers": layers, "mean": {"erase_write": {"state": 4 / 11, "loss": None}}}
        results = json.loads((out / "results.json").read_text())
        results["metrics"] = {"trained": phase, "init": phase}
        (out / "results.json").write_text(json.dumps(results))
        return code


def test_a_ratio_over_layers_is_the_ratio_of_the_summed_sensitivities(tmp_path, corpus):
    spec = micro_spec(tmp_path, corpus)
    spec["evals"].append(
        {"task": "gate-sensitivity", "settings": {"probes": 1}, "skip": ["transformer"]}
    )
    plan = plan_of(spec)
    assert execute(plan, launcher=TwoLayerGates({r.name: 1.0 for r in plan.runs}), say=quiet) == 0
    markdown = (tmp_path / "study" / "study.md").read_text()
    ratio = f"{4 / 11:.4g} ± 0"
    assert f"| all layers | {ratio} | {ratio} | 2/2 | – | – | 0/0 |" in markdown
    assert "1.55" not in markdown
