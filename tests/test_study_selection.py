"""`deltalab study` chooses each variant's learning rate on validation numbers only, reports the
chosen rates and the test numbers at them, and refuses a selection it cannot make, naming the
field."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from test_study import FakeTrain, micro_spec, plan_of, quiet, write_corpus

from deltalab.cli import main
from deltalab.errors import ConfigError
from deltalab.study.cli import execute
from deltalab.study.report import collect

LRS = [1e-3, 1e-2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


class FakeSplit(FakeTrain):
    """FakeTrain whose perplexity evaluation reports a validation loss of its own per run
    (`validation` maps a run name to it) beside the test loss, and whose mqar-train jobs
    report a chosen rate."""

    def __init__(self, losses: dict[str, float], validation: dict[str, float]) -> None:
        super().__init__(losses)
        self.validation = validation

    def __call__(self, args, env, log):
        task = args[args.index("--task") + 1] if "--task" in args else None
        if task == "mqar-train":
            return self.mqar(args)
        if task != "perplexity":
            return super().__call__(args, env, log)
        code = super().__call__(args, env, log)
        out = Path(args[args.index("--out") + 1])
        results = json.loads((out / "results.json").read_text())
        loss = self.validation[out.parent.parent.name]
        results["summary"].update(validation_loss=loss, validation_bits_per_byte=loss)
        (out / "results.json").write_text(json.dumps(results))
        return code

    def mqar(self, args):
        self.calls.append(args)
        out = Path(args[args.index("--out") + 1])
        out.mkdir(parents=True, exist_ok=True)
        words = dict(w.split("=", 1) for w in args if "=" in w)
        settings = {name: yaml.safe_load(value) for name, value in words.items()}
        mixer = settings["mixers"][0]
        seed = int(out.name.rsplit(".s", 1)[1])
        # Seed 1 chose the higher rate on its validation examples.
        lr = 1e-2 if seed == 1 else 1e-3
        summary = {f"{mixer}@16x2": 0.5 + 0.1 * seed, f"{mixer}@lr": lr, f"{mixer}@validation": 0.6}
        (out / "results.json").write_text(json.dumps({"settings": settings, "summary": summary}))
        return 0


def sweep_spec(tmp_path, corpus) -> dict:
    spec = micro_spec(tmp_path, corpus)
    spec["grid"]["lrs"] = LRS
    spec["grid"]["seeds"] = [0, 1, 2]
    return spec


def test_the_rate_is_chosen_on_validation_even_where_the_test_loss_would_choose_the_other(
    tmp_path, corpus
):
    plan = plan_of(sweep_spec(tmp_path, corpus))
    # At 1e-3 every run is better on validation (1.0 against 2.0) and worse on test (3.0
    # against 1.0 + the fake's 0.25): validation must choose 1e-3, and the report must show
    # the test losses at 1e-3 only.
    losses, validation = {}, {}
    for run in plan.runs:
        low = run.lr == 1e-3
        losses[run.name] = (3.0 if low else 1.0) + 0.01 * run.seed
        validation[run.name] = (1.0 if low else 2.0) + 0.01 * run.seed
    assert execute(plan, launcher=FakeSplit(losses, validation), say=quiet) == 0
    perplexity = next(r for r in plan.runs[0].evals if r.task == "perplexity")
    assert perplexity.settings["validation_fraction"] == 0.5
    report = collect(plan)
    (group,) = report["groups"]
    for variant in ("transformer", "gdn2"):
        rate = group["rates"][variant]
        assert rate["lr"] == 1e-3
        assert rate["validation"][repr(1e-3)]["mean"] == pytest.approx(1.01)
        assert rate["validation"][repr(1e-2)]["mean"] == pytest.approx(2.01)
        test = group["statistics"][variant]["perplexity.loss"]["mean"]
        assert test == pytest.approx(3.01 + 0.25)
    markdown = (tmp_path / "study" / "study.md").read_text()
    assert "| variant | size | chosen | 0.001 | 0.01 |" in markdown
    assert "| transformer | tiny | 0.001 | 1.01 (n=3) | 2.01 (n=3) |" in markdown


def test_the_report_states_the_rate_mqar_chose_per_variant_and_does_not_compare_it(
    tmp_path, corpus
):
    spec = micro_spec(tmp_path, corpus)
    spec["grid"]["seeds"] = [0, 1]
    spec["evals"].append({"task": "mqar-train", "settings": {"lrs": LRS, "steps": 2}})
    plan = plan_of(spec)
    losses = {run.name: 1.0 + 0.1 * run.seed for run in plan.runs}
    validation = {run.name: 1.0 for run in plan.runs}
    assert execute(plan, launcher=FakeSplit(losses, validation), say=quiet) == 0
    report = collect(plan)
    (mqar,) = report["task_groups"]
    statistics = mqar["statistics"]["transformer"]
    assert "paired" in statistics["mqar-train.16x2"]
    assert "paired" not in statistics["mqar-train.lr"]
    assert "paired" not in statistics["mqar-train.validation"]
    markdown = (tmp_path / "study" / "study.md").read_text()
    assert "| transformer | 0.001 (seeds [0]); 0.01 (seeds [1]) |" in markdown


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"selection": {"metric": "perplexity.loss"}}, "selection.metric must be one of"),
        ({"selection": {"goal": "lowest"}}, "selection.goal"),
        ({"selection": {"validation_fraction": 1.0}}, "selection.validation_fraction must be in"),
        ({"selection": {"metrc": "x"}}, "unknown key 'selection.metrc'"),
        (
            {"evals": [{"task": "mqar-train"}]},
            "grid.lrs holds 2 rates but evals has no perplexity task",
        ),
        (
            {"evals": [{"task": "perplexity", "settings": {"validation_fraction": 0.2}}]},
            "validation_fraction is set by the study; give selection.validation_fraction",
        ),
    ],
)
def test_a_selection_the_study_cannot_make_is_refused_naming_the_field(
    tmp_path, corpus, change, message, capsys
):
    spec = sweep_spec(tmp_path, corpus)
    spec.update(change)
    with pytest.raises(ConfigError) as caught:
        plan_of(spec)
    assert message in str(caught.value) and "\n" not in str(caught.value)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert main(["study", str(path), "--dry-run"]) == 2
    assert message in capsys.readouterr().err


def test_one_rate_chooses_nothing_and_the_report_says_so(tmp_path, corpus):
    spec = micro_spec(tmp_path, corpus)
    plan = plan_of(spec)
    assert "validation_fraction" not in plan.runs[0].evals[0].settings
    losses = {run.name: 1.0 for run in plan.runs}
    assert execute(plan, launcher=FakeTrain(losses), say=quiet) == 0
    markdown = (tmp_path / "study" / "study.md").read_text()
    assert "One learning rate for every variant, 0.003: nothing is chosen" in markdown
    assert not math.isnan(collect(plan)["groups"][0]["statistics"]["gdn2"]["held_out_loss"]["mean"])
