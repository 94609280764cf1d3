"""`deltalab study`: the spec's checks, matched parameter counts, skipping and resuming runs,
failures recorded, and the statistics of the report against hand-computed numbers."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch
import yaml

import deltalab.train.loop as loop
from deltalab.cli import main
from deltalab.data import load_tokenizer
from deltalab.errors import ConfigError
from deltalab.models.presets import count_parameters
from deltalab.study.cli import execute
from deltalab.study.plan import make_plan
from deltalab.study.report import collect
from deltalab.study.runner import SubprocessLauncher, run_state
from deltalab.study.spec import parse_spec
from deltalab.study.stats import (
    NOT_DISTINGUISHABLE,
    paired_difference,
    summarize,
    t_quantile,
    verdict,
)
from deltalab.train import preflight
from deltalab.train.checkpoint import list_checkpoints

MICRO = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "head_dim": 16}
MQAR = {
    "vocab_size": 16, "train": [[16, 2]], "test": [[16, 2]], "steps": 2, "lrs": [1e-2],
    "train_examples": 8, "test_examples": 4, "hidden_size": 16,
}  # fmt: skip


def write_corpus(folder: Path) -> Path:
    for i in range(20):
        (folder / f"doc_{i:02d}.txt").write_text(f"def f_{i}(x):\n    return x + {i}\n" * 8)
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def micro_spec(tmp_path: Path, corpus: Path, **changes) -> dict:
    """A 2-mixer x 2-seed study of 4 steps at a micro size."""
    spec = {
        "out_dir": str(tmp_path / "study"),
        "parallel": 1,
        "device": "cpu",
        "baseline": "gdn2",
        "params": {"ffn_multiple": 4},
        "run": {
            "model": {"preset": "tiny", "overrides": dict(MICRO)},
            "data": {
                "source": str(corpus),
                "cache_dir": str(tmp_path.parent / "study-cache"),
                "held_out_fraction": 0.3,
            },
            "train": {"steps": 4, "batch_size": 2, "seq_len": 16},
            "schedule": {"warmup_steps": 0},
            "eval": {"batches": 1, "sample_tokens": 0, "every": 0},
            "checkpoint": {"every": 2},
        },
        "grid": {"mixers": ["transformer", "gdn2"], "seeds": [0, 1]},
        "evals": [{"task": "perplexity", "settings": {"max_tokens": 64}}],
    }
    for key, value in changes.items():
        node = spec
        *path, last = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return spec


def plan_of(spec: dict):
    return make_plan(parse_spec(copy.deepcopy(spec)))


class InProcess:
    """Runs `deltalab ARGS` in this process (a subprocess costs seconds of imports), its output
    in the log; counts the launches. `fail` maps a run name to an error the launch prints."""

    def __init__(self, fail: dict[str, str] | None = None) -> None:
        self.calls: list[list[str]] = []
        self.fail = fail or {}

    def __call__(self, args: list[str], env: dict[str, str], log: Path) -> int:
        self.calls.append(args)
        for name, error in self.fail.items():
            if any(name in arg for arg in args):
                log.write_text(f"Traceback (most recent call last):\n{error}\n")
                return 1
        with log.open("a") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            return main(args)

    def trains(self) -> list[list[str]]:
        return [c for c in self.calls if "train" in c]


def quiet(line: str) -> None:
    pass


# --- the spec and the plan ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"grid.mixer": ["gdn2"]}, "unknown key 'grid.mixer' (did you mean 'grid.mixers'?)"),
        ({"paralel": 2}, "unknown key 'paralel' (did you mean 'parallel'?)"),
        ({"run.train.seed": 3}, "run.train.seed is set by the study"),
        ({"run.trian": {}}, "unknown config section 'trian' (did you mean 'train'?)"),
        ({"grid.mixers": ["gdn2", "muri"]}, "did you mean 'muir'?"),
        ({"baseline": "gdn"}, "baseline 'gdn' is not a grid.mixers name"),
        ({"params.tolerance": 0.05}, "params.tolerance must be in [0, 0.02]"),
        (
            {"evals": [{"task": "perplexty"}]},
            "unknown task 'perplexty' (did you mean 'perplexity'?)",
        ),
        (
            {"evals": [{"task": "perplexity", "skip": ["transfomer"]}]},
            "skip names 'transfomer', not a grid.mixers name (did you mean 'transformer'?)",
        ),
        (
            {"evals": [{"task": "mqar-train", "settings": {"stepz": 3}}]},
            "unknown setting 'stepz' for this task (did you mean 'steps'?)",
        ),
        (
            {"grid.mixers": ["gdn2", {"name": "m", "mixer": "muir", "options": {"read_gat": "x"}}]},
            "mixer_options.read_gat is not an option of the muir mixer",
        ),
        ({"throughput.steps": 4}, "throughput.steps must be an int >= 8"),
        (
            {"throughput.step": 30},
            "unknown key 'throughput.step' (did you mean 'throughput.steps'?)",
        ),
    ],
)
def test_the_plan_refuses_a_bad_spec_naming_the_key(tmp_path, corpus, change, message):
    spec = micro_spec(tmp_path, corpus, **change)
    with pytest.raises(ConfigError) as caught:
        plan_of(spec)
    assert message in str(caught.value)
    assert not (tmp_path / "study").exists()


def test_every_run_is_within_two_percent_of_the_matched_count(tmp_path, corpus):
    spec = micro_spec(tmp_path, corpus)
    spec["grid"]["mixers"] = [
        "transformer", "gdn2", "kdn_diag", {"name": "m-none", "mixer": "muir", "options": {"read_gate": "none"}},
    ]  # fmt: skip
    plan = plan_of(spec)
    target = plan.targets["tiny"]
    for run in plan.runs:
        # Counted again from the run's own config, as the trainer will build it.
        model = preflight.model_config(run.config, load_tokenizer("byte"), torch.device("cpu"))
        assert count_parameters(model) == run.params
        assert abs(run.params / target - 1) <= 0.02, run.name
    widths = {run.variant.name: run.ffn_width for run in plan.runs}
    # The attention mixer is the smallest: it gets the widest FFN.
    assert widths["transformer"] > widths["gdn2"]


def test_a_grid_that_cannot_be_matched_is_refused_naming_the_runs(tmp_path, corpus, capsys):
    spec = micro_spec(tmp_path, corpus)
    spec["grid"]["mixers"] = [
        "gdn2",
        {"name": "wide", "mixer": "gdn", "overrides": {"ffn_width": 512}},
    ]
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert main(["study", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "parameter counts do not match gdn2's within 2%" in err
    assert "wide.tiny (" in err and "gdn2.tiny" not in err.split("):")[-1]
    assert not (tmp_path / "study").exists()


def test_runs_of_one_seed_differ_only_in_the_model(tmp_path, corpus):
    plan = plan_of(micro_spec(tmp_path, corpus))
    by_seed: dict[int, list[dict]] = {}
    for run in plan.runs:
        config = run.config.to_dict()
        config.pop("model")
        config["log"].pop("out_dir")
        by_seed.setdefault(run.seed, []).append(config)
    for configs in by_seed.values():
        # Same data, order (train.seed), schedule and evaluation for every mixer.
        assert all(c == configs[0] for c in configs)
    assert by_seed[0][0]["train"]["seed"] == 0 and by_seed[1][0]["train"]["seed"] == 1


def test_a_task_is_not_planned_for_the_variants_it_skips(tmp_path, corpus):
    evals = [
        {"task": "perplexity", "skip": ["transformer"]},
        {"task": "mqar-train", "settings": MQAR, "skip": ["gdn2"]},
    ]
    plan = plan_of(micro_spec(tmp_path, corpus, evals=evals))
    assert {r.variant.name: [s.task for s in r.evals] for r in plan.runs} == {
        "transformer": [],
        "gdn2": ["perplexity"],
    }
    assert {t.variant.name for t in plan.tasks} == {"transformer"}


def test_learning_rates_that_print_alike_get_runs_of_their_own(tmp_path, corpus):
    grid = {"mixers": ["gdn2"], "seeds": [0], "lrs": [0.0030000001, 0.003, 1e-5]}
    plan = plan_of(micro_spec(tmp_path, corpus, grid=grid))
    # Rates `:g` writes exactly keep their names (1e-05); the others take every digit they need.
    assert [r.name for r in plan.runs] == [
        "gdn2.tiny.lr0.0030000001.s0", "gdn2.tiny.lr0.003.s0", "gdn2.tiny.lr1e-05.s0",
    ]  # fmt: skip
    assert [r.config.optim.lr for r in plan.runs] == [0.0030000001, 0.003, 1e-5]
    assert execute(plan, launcher=FakeTrain({r.name: 1.0 for r in plan.runs}), say=quiet) == 0
    markdown = (tmp_path / "study" / "study.md").read_text()
    # Each rate its own column of the learning-rate table; without validation numbers (the fake
    # writes none) no rate is chosen, and the report says so.
    assert "| variant | size | chosen | 0.0030000001 | 0.003 | 1e-05 |" in markdown
    assert "| gdn2 | tiny | – | – | – | – |" in markdown
    assert "gdn2 (size tiny): no rate chosen" in markdown


def test_grid_points_that_would_share_a_directory_are_refused_at_plan_time(tmp_path, corpus):
    # Distinct names to Linux; one directory on a case-insensitive file system.
    mixers = ["gdn2", {"name": "GDN2", "mixer": "gdn2"}]
    with pytest.raises(ConfigError) as caught:
        plan_of(micro_spec(tmp_path, corpus, grid={"mixers": mixers, "seeds": [0]}))
    message = str(caught.value)
    assert "share a directory" in message, message
    assert "run gdn2.tiny.lr0.003.s0 and run GDN2.tiny.lr0.003.s0" in message, message


def dry_run_error(tmp_path: Path, spec: dict, capsys) -> str:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert main(["study", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("deltalab: error: study spec") and "\n" not in err, err
    return err


def test_an_out_dir_that_is_a_file_is_refused_by_the_dry_run(tmp_path, corpus, capsys):
    (tmp_path / "taken").write_text("a file")
    spec = micro_spec(tmp_path, corpus, out_dir=str(tmp_path / "taken" / "study"))
    err = dry_run_error(tmp_path, spec, capsys)
    assert f"out_dir {str(tmp_path / 'taken' / 'study')!r} cannot be a directory" in err, err
    assert f"{str(tmp_path / 'taken')!r} is a file" in err, err


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            {"task": "passkey", "settings": {"lengths": [100]}},
            r"evals 'passkey' of run transformer\.tiny\.lr0\.003\.s0: lengths holds 100: passkey "
            r"needs more than the \d+ tokens",
        ),
        (
            {"task": "passkey", "settings": {"lengths": [500]}},
            r"evals 'passkey' of run transformer\.tiny\.lr0\.003\.s0: contexts of up to 5\d\d "
            r"tokens, longer than the 16 tokens of train\.seq_len, which transformer \(full "
            r"attention\) refuses",
        ),
    ],
)
def test_evaluations_that_can_only_fail_are_refused_by_the_dry_run(
    tmp_path, corpus, capsys, entry, message
):
    spec = micro_spec(tmp_path, corpus, evals=[entry])
    assert re.search(message, dry_run_error(tmp_path, spec, capsys))
    assert not (tmp_path / "study").exists()


def test_long_contexts_plan_where_the_run_can_take_them(tmp_path, corpus):
    # Windowed attention, or a recurrent mixer alone: a passkey longer than train.seq_len runs.
    windowed = {"task": "passkey", "settings": {"lengths": [500]}, "long_context": "window"}
    plan_of(micro_spec(tmp_path, corpus, evals=[windowed]))
    skipped = {"task": "passkey", "settings": {"lengths": [500]}, "skip": ["transformer"]}
    plan = plan_of(micro_spec(tmp_path, corpus, evals=[skipped]))
    assert {r.variant.name: len(r.evals) for r in plan.runs} == {"transformer": 0, "gdn2": 1}


def test_dry_run_prints_the_plan_and_trains_nothing(tmp_path, corpus, capsys):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(micro_spec(tmp_path, corpus)))
    assert main(["study", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "4 runs (2 variants" in out and "vs gdn2" in out and "transformer.tiny.lr0.003.s1" in out
    assert not (tmp_path / "study" / "runs").exists()


# --- running ----------------------------------------------------------------------------------


def test_a_rerun_skips_the_finished_runs(tmp_path, corpus):
    spec = micro_spec(tmp_path, corpus, evals=[{"task": "perplexity", "settings": {"max_tokens": 64}}, {"task": "mqar-train", "settings": MQAR}])  # fmt: skip
    plan = plan_of(spec)
    first = InProcess()
    assert execute(plan, launcher=first, say=quiet) == 0
    # 4 runs x (train + perplexity) + 2 mixers x 2 seeds of mqar-train.
    assert len(first.calls) == 4 * 2 + 4
    report = json.loads((tmp_path / "study" / "study.json").read_text())
    assert report["counts"]["completed"] == 8
    again = InProcess()
    assert execute(plan_of(spec), launcher=again, say=quiet) == 0
    assert again.calls == []
    # Evaluation settings changed: only the evaluations run again, not the training.
    spec["evals"][0]["settings"]["max_tokens"] = 32
    changed = InProcess()
    assert execute(plan_of(spec), launcher=changed, say=quiet) == 0
    assert len(changed.calls) == 4 and all(c[2] == "eval" for c in changed.calls)


def test_an_interrupted_run_resumes_from_its_checkpoint_and_ends_as_an_uninterrupted_one(
    tmp_path, corpus, monkeypatch
):
    spec = micro_spec(tmp_path, corpus)
    spec["grid"] = {"mixers": ["gdn2"], "seeds": [0]}
    plan = plan_of(spec)
    calls = {"n": 0}
    real = loop._stop_everywhere

    def stop_after_two_steps(stop, ctx):
        calls["n"] += 1
        if calls["n"] == 2:
            # The study is stopped (its handler runs in the main thread) while the run trains.
            os.kill(os.getpid(), signal.SIGTERM)
            return True
        return real(stop, ctx)

    monkeypatch.setattr(loop, "_stop_everywhere", stop_after_two_steps)
    launcher = InProcess()
    assert execute(plan, launcher=launcher, say=quiet) == 128 + signal.SIGTERM
    (run,) = plan.runs
    assert run_state(run) == "resume"
    assert json.loads((run.directory / "metrics.json").read_text())["steps_done"] == 2
    monkeypatch.setattr(loop, "_stop_everywhere", real)
    resumed = InProcess()
    assert execute(plan_of(spec), launcher=resumed, say=quiet) == 0
    assert "--resume" in resumed.trains()[0]
    metrics = json.loads((run.directory / "metrics.json").read_text())
    reference = plan_of(
        micro_spec(tmp_path / "ref", corpus, grid={"mixers": ["gdn2"], "seeds": [0]})
    )
    assert execute(reference, launcher=InProcess(), say=quiet) == 0
    expected = json.loads((reference.runs[0].directory / "metrics.json").read_text())
    assert [r["step"] for r in metrics["history"]["train"]] == [1, 2, 3, 4]
    assert metrics["final_eval_loss"] == expected["final_eval_loss"]


def test_a_trained_run_whose_model_is_gone_trains_again_and_its_old_results_do_not_count(
    tmp_path, corpus
):
    """Records that came back without the exported model and checkpoints (a run cut off
    during an evaluation): the run is "new", not "evaluate", which would fail for want of
    a model; it trains from scratch, and the lost model's evaluation results are not kept."""
    spec = micro_spec(tmp_path, corpus, grid={"mixers": ["gdn2"], "seeds": [0]})
    assert execute(plan_of(spec), launcher=InProcess(), say=quiet) == 0
    (run,) = plan_of(spec).runs
    shutil.rmtree(run.directory / "model")
    for checkpoint in list_checkpoints(run.directory):
        shutil.rmtree(checkpoint, ignore_errors=True)
        Path(checkpoint).unlink(missing_ok=True)
    results = run.directory / run.evals[0].out / "results.json"
    stale = json.loads(results.read_text())
    stale["metrics"]["loss"] = -1.0  # a mark the new evaluation must not keep
    results.write_text(json.dumps(stale))
    # One evaluation missing: a trained run that the old rule would only evaluate.
    spec["evals"].append({"task": "gate-sensitivity", "settings": {"batch_size": 1, "probes": 1}})
    (run,) = plan_of(spec).runs
    assert list_checkpoints(run.directory) == []
    assert run_state(run) == "new"
    again = InProcess()
    assert execute(plan_of(spec), launcher=again, say=quiet) == 0
    assert len(again.trains()) == 1 and "--resume" not in again.trains()[0]
    assert len([c for c in again.calls if "eval" in c]) == 2
    assert json.loads(results.read_text())["metrics"]["loss"] > 0
    assert run_state(run) == "done" and (run.directory / "model").is_dir()


def test_a_failed_run_is_recorded_and_the_study_goes_on(tmp_path, corpus):
    plan = plan_of(micro_spec(tmp_path, corpus))
    failing = InProcess(fail={"transformer.tiny.lr0.003.s1": "RuntimeError: out of memory"})
    assert execute(plan, launcher=failing, say=quiet) == 1
    report = json.loads((tmp_path / "study" / "study.json").read_text())
    status = {r["name"]: (r["status"], r["error"]) for r in report["runs"]}
    assert status.pop("transformer.tiny.lr0.003.s1") == ("failed", "RuntimeError: out of memory")
    assert all(s == "completed" for s, _ in status.values())
    markdown = (tmp_path / "study" / "study.md").read_text()
    assert (
        "| transformer.tiny.lr0.003.s1 | failed | train | RuntimeError: out of memory |" in markdown
    )
    # The transformer's mean counts the seed that completed, and says so.
    assert "| transformer | " in markdown and " | 1/2 | " in markdown
    retry = InProcess()
    assert execute(plan_of(micro_spec(tmp_path, corpus)), launcher=retry, say=quiet) == 0
    assert len(retry.trains()) == 1


def test_a_diverged_run_is_reported_and_not_retried(tmp_path, corpus):
    spec = micro_spec(
        tmp_path, corpus, grid={"mixers": ["gdn2"], "seeds": [0], "lrs": [1e-3, 1e30]}
    )
    launcher = InProcess()
    assert execute(plan_of(spec), launcher=launcher, say=quiet) == 0
    report = json.loads((tmp_path / "study" / "study.json").read_text())
    status = {r["lr"]: r for r in report["runs"]}
    assert status[1e-3]["status"] == "completed"
    assert status[1e30]["status"] == "diverged" and "is not finite" in status[1e30]["error"]
    assert (
        "| gdn2.tiny.lr1e+30.s0 | diverged | train |"
        in (tmp_path / "study" / "study.md").read_text()
    )
    again = InProcess()
    assert execute(plan_of(spec), launcher=again, say=quiet) == 0
    assert again.calls == []


def test_runs_go_as_subprocesses_two_at_a_time(tmp_path, corpus):
    # The evaluations' command lines are those the in-process tests run through `main`.
    spec = micro_spec(tmp_path, corpus, parallel=2, threads=1, evals=[])
    spec["grid"]["seeds"] = [0]
    plan = plan_of(spec)
    launcher = SubprocessLauncher()
    assert execute(plan, launcher=launcher, say=quiet) == 0
    for run in plan.runs:
        assert run_state(run) == "done"
        log = (run.directory / "study.log").read_text()
        assert "-m deltalab --threads 1 train --config" in log
    starts = [json.loads((r.directory / "study_run.json").read_text()) for r in plan.runs]
    assert all(s["status"] == "completed" for s in starts)


# --- the statistics of the report -------------------------------------------------------------


def test_t_quantiles_match_the_tables():
    assert t_quantile(0.975, 1) == pytest.approx(12.7062047, abs=1e-6)
    assert t_quantile(0.975, 2) == pytest.approx(4.30265273, abs=1e-7)
    assert t_quantile(0.975, 4) == pytest.approx(2.77644511, abs=1e-7)
    assert t_quantile(0.975, 30) == pytest.approx(2.04227246, abs=1e-7)
    assert t_quantile(0.025, 4) == pytest.approx(-2.77644511, abs=1e-7)


def test_paired_interval_by_hand():
    # Differences 0.5, 0.6, 0.55: mean 0.55, sd 0.05, half-width 4.3027 * 0.05 / sqrt(3).
    paired = paired_difference({0: 1.5, 1: 2.6, 2: 3.55}, {0: 1.0, 1: 2.0, 2: 3.0})
    half = 4.302652729749464 * 0.05 / math.sqrt(3)
    assert paired.n == 3 and paired.mean == pytest.approx(0.55) and paired.sd == pytest.approx(0.05)
    assert (paired.low, paired.high) == (pytest.approx(0.55 - half), pytest.approx(0.55 + half))
    assert verdict(paired.low, paired.high) == "higher"
    # A seed missing on one side is not paired; a NaN (a diverged run) neither.
    assert paired_difference({0: 1.0, 1: math.nan, 2: 2.0}, {0: 2.0, 2: 2.5, 3: 1.0}).n == 2
    assert summarize([1.0, 2.0, 4.0]).sd == pytest.approx(math.sqrt(7 / 3))


class FakeTrain(InProcess):
    """Writes the files of a finished run with chosen numbers instead of training."""

    def __init__(self, losses: dict[str, float]) -> None:
        super().__init__()
        self.losses = losses

    def __call__(self, args, env, log):
        self.calls.append(args)
        if "train" in args:
            config = yaml.safe_load(Path(args[args.index("--config") + 1]).read_text())
            out = Path(config["log"]["out_dir"])
            name = out.name
            history = {"train": [{"step": 1, "loss": 5.0}], "eval": []}
            metrics = {
                "status": "completed", "steps_done": 4, "final_eval_loss": self.losses[name],
                "config": config, "history": history, "median_tokens_per_s": 100.0,
            }  # fmt: skip
            (out / "metrics.json").write_text(json.dumps(metrics))
            (out / "log.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "loss": 5.0}))
        else:
            out = Path(args[args.index("--out") + 1])
            out.mkdir(parents=True, exist_ok=True)
            words = [w.split("=", 1) for w in args if "=" in w]
            settings = {name: yaml.safe_load(value) for name, value in words}
            name = out.parent.parent.name
            loss = self.losses[name] + 0.25
            summary = {"loss": loss, "perplexity": math.exp(loss), "bits_per_byte": loss}
            (out / "results.json").write_text(
                json.dumps({"settings": settings, "summary": summary})
            )
        return 0


def test_the_report_holds_means_sds_and_paired_intervals_computed_by_hand(tmp_path, corpus):
    spec = micro_spec(tmp_path, corpus)
    spec["grid"]["seeds"] = [0, 1, 2]
    plan = plan_of(spec)
    losses = {
        "gdn2.tiny.lr0.003.s0": 1.0, "gdn2.tiny.lr0.003.s1": 2.0, "gdn2.tiny.lr0.003.s2": 3.0,
        # Differences 0.5, 0.1, 0.8 against gdn2: the interval covers zero.
        "transformer.tiny.lr0.003.s0": 1.5, "transformer.tiny.lr0.003.s1": 2.1,
        "transformer.tiny.lr0.003.s2": 3.8,
    }  # fmt: skip
    assert execute(plan, launcher=FakeTrain(losses), say=quiet) == 0
    report = collect(plan)
    (group,) = report["groups"]
    assert group["rates"]["transformer"]["lr"] == 0.003
    transformer = group["statistics"]["transformer"]["held_out_loss"]
    assert transformer["n"] == 3 and transformer["mean"] == pytest.approx(7.4 / 3)
    assert transformer["sd"] == pytest.approx(
        math.sqrt(((1.5 - 7.4 / 3) ** 2 + (2.1 - 7.4 / 3) ** 2 + (3.8 - 7.4 / 3) ** 2) / 2)
    )
    # The test loss in nats per byte is compared (the fake bits per byte are loss + 0.25), the
    # training loop's held-out loss only shown; one comparison, so Holm's level is 0.05.
    assert "paired" not in transformer
    paired = group["statistics"]["transformer"]["perplexity.nats_per_byte"]["paired"]
    ln2 = math.log(2)
    mean = 1.4 / 3 * ln2
    sd = ln2 * math.sqrt(((0.5 - 1.4 / 3) ** 2 + (0.1 - 1.4 / 3) ** 2 + (0.8 - 1.4 / 3) ** 2) / 2)
    half = 4.302652729749464 * sd / math.sqrt(3)
    assert paired["mean"] == pytest.approx(mean) and paired["sd"] == pytest.approx(sd)
    assert paired["interval"] == [pytest.approx(mean - half), pytest.approx(mean + half)]
    assert paired["level"] == pytest.approx(0.05) and report["family"]["size"] == 1
    assert paired["verdict"].startswith(NOT_DISTINGUISHABLE)
    assert "paired" not in group["statistics"]["gdn2"]["perplexity.nats_per_byte"]
    markdown = (tmp_path / "study" / "study.md").read_text()
    row = (
        f"| transformer | 3 | +{mean:.4g} | [{mean - half:+.4g}, {mean + half:+.4g}] (0.95) | "
        f"{paired['p_holm']:.3g} | {paired['seeds_needed']} | {NOT_DISTINGUISHABLE} (interval "
        f"[{mean - half:+.4g}, {mean + half:+.4g}]) |"
    )
    assert row in markdown
    assert (tmp_path / "study" / "loss_curves.png").stat().st_size > 0


def finished_micro_study(tmp_path, corpus) -> dict:
    """A micro study run to the end with fake training: each variant's losses rise by 0.1 a
    seed, GDN-2's 0.3 above the Transformer's at every seed. Returns its spec."""
    spec = micro_spec(tmp_path, corpus)
    plan = plan_of(spec)
    losses = {
        run.name: 1.0 + 0.1 * run.seed + (0.3 if run.variant.name == "gdn2" else 0)
        for run in plan.runs
    }
    assert execute(plan, launcher=FakeTrain(losses), say=quiet) == 0
    return spec


def test_aggregate_only_rebuilds_the_report_without_running(tmp_path, corpus, capsys):
    spec = finished_micro_study(tmp_path, corpus)
    (tmp_path / "study" / "study.md").unlink()
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert main(["study", str(path), "--aggregate-only"]) == 0
    markdown = (tmp_path / "study" / "study.md").read_text()
    # Differences of exactly -0.3 nats a token (-0.2079 a byte) at every seed: sd 0, an
    # interval of one point, below zero: the Transformer's test loss is lower, better.
    assert (
        "| transformer | 2 | -0.2079 | [-0.2079, -0.2079] (0.95) | < 0.0001 | 2 | better |"
        in markdown
    )


def test_aggregate_only_refuses_runs_trained_with_another_config_than_the_spec(
    tmp_path, corpus, capsys
):
    spec = finished_micro_study(tmp_path, corpus)
    spec["run"]["train"]["steps"] = 8
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert main(["study", str(path), "--aggregate-only"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "holds runs trained with another config" in err, err
    assert "gdn2.tiny.lr0.003.s0 (train.steps: 4 -> 8)" in err, err


def test_only_runs_the_matching_runs_and_reports_the_others_pending(tmp_path, corpus):
    plan = plan_of(micro_spec(tmp_path, corpus))
    launcher = FakeTrain({run.name: 1.0 for run in plan.runs})
    assert execute(plan, launcher=launcher, say=quiet, only=["gdn2.*.s1"]) == 0
    assert [Path(c[c.index("--config") + 1]).parent.name for c in launcher.trains()] == [
        "gdn2.tiny.lr0.003.s1"
    ]
    report = json.loads((tmp_path / "study" / "study.json").read_text())
    assert report["counts"] == {
        "completed": 1, "diverged": 0, "failed": 0, "interrupted": 0, "pending": 3,
    }  # fmt: skip


class FakeGates(FakeTrain):
    """FakeTrain whose gate-sensitivity evaluations write chosen per-layer numbers: GDN-2's one
    layer has erase/write ratios of the final memory `trained[seed]` after training and 0.25 at
    initialization, none for the loss, and ranks allocated by the memory's sensitivity."""

    trained = (0.5, 0.7, 1.5)

    def __call__(self, args, env, log):
        code = super().__call__(args, env, log)
        if "train" in args or "gate-sensitivity" not in args:
            return code
        out = Path(args[args.index("--out") + 1])
        seed = int(args[args.index("--seed") + 1])
        ranks = {
            "source": "GDN-2 layer", "budget": 10, "reference": {"erase": 2, "write": 8},
            "allocated": {"erase": 2 + seed, "write": 8 - seed},
        }  # fmt: skip

        def layer(ratio, with_ranks):
            return {"model.blocks.0.mixer": {
                "erase_write": {"state": ratio, "loss": None},
                "ranks": {"state": ranks if with_ranks else None, "loss": None},
            }}  # fmt: skip

        results = json.loads((out / "results.json").read_text())
        results["metrics"] = {
            "trained": {"layers": layer(self.trained[seed], True)},
            "init": {"layers": layer(0.25, False)},
        }
        (out / "results.json").write_text(json.dumps(results))
        return code


def test_the_report_gives_erase_write_ratios_per_layer_and_the_allocated_ranks(tmp_path, corpus):
    spec = micro_spec(tmp_path, corpus)
    spec["grid"]["seeds"] = [0, 1, 2]
    spec["evals"].append(
        {"task": "gate-sensitivity", "settings": {"probes": 1}, "skip": ["transformer"]}
    )
    plan = plan_of(spec)
    assert execute(plan, launcher=FakeGates({r.name: 1.0 for r in plan.runs}), say=quiet) == 0
    (group,) = collect(plan)["gate_sensitivity"]
    assert list(group["variants"]) == ["gdn2"]
    gdn2 = group["variants"]["gdn2"]
    assert gdn2["layers"]["model.blocks.0.mixer"]["trained_state"] == {"0": 0.5, "1": 0.7, "2": 1.5}
    written = json.loads((tmp_path / "study" / "study.json").read_text())
    assert written["gate_sensitivity"] == json.loads(json.dumps(collect(plan)["gate_sensitivity"]))
    assert gdn2["ranks"]["state"]["allocated"] == [
        {"erase": 2, "write": 8},
        {"erase": 3, "write": 7},
        {"erase": 4, "write": 6},
    ]
    assert "loss" not in gdn2["ranks"]
    markdown = (tmp_path / "study" / "study.md").read_text()
    # Mean 0.9, sd sqrt((0.4^2 + 0.2^2 + 0.6^2) / 2); two of three seeds below 1; no loss ratios.
    sd = math.sqrt((0.4**2 + 0.2**2 + 0.6**2) / 2)
    row = f"| model.blocks.0.mixer | 0.25 ± 0 | 0.9 ± {sd:.4g} | 2/3 | – | – | 0/0 |"
    assert row in markdown
    assert "| by the final memory's sensitivity | 3 ± 1 (2) | 7 ± 1 (8) |" in markdown
    assert "the GDN-2 layer's" in markdown


def test_aggregate_only_pairs_against_another_baseline_beside_the_studys_own_report(
    tmp_path, corpus, capsys
):
    spec = finished_micro_study(tmp_path, corpus)
    own = (tmp_path / "study" / "study.md").read_text()
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert main(["study", str(path), "--aggregate-only", "--baseline", "transformer"]) == 0
    assert (tmp_path / "study" / "study.md").read_text() == own
    assert (
        json.loads((tmp_path / "study" / "study_vs_transformer.json").read_text())["baseline"]
        == "transformer"
    )
    markdown = (tmp_path / "study" / "study_vs_transformer.md").read_text()
    # GDN-2's test loss is 0.3 nats a token above the Transformer's at every seed: worse, in
    # nats per byte, at 0.3 ln 2 (the fake bits per byte are the loss plus 0.25).
    assert (
        f"| gdn2 | 2 | +{0.3 * math.log(2):.4g} | [+0.2079, +0.2079] (0.95) | < 0.0001 | 2 | worse |"
        in (markdown)
    )
    assert main(["study", str(path), "--baseline", "transformer"]) == 2
    assert "--baseline goes with --aggregate-only" in capsys.readouterr().err
    assert main(["study", str(path), "--aggregate-only", "--baseline", "gdn"]) == 2
    assert "--baseline 'gdn' is not a grid.mixers name (did you mean 'gdn2'?)" in (
        capsys.readouterr().err
    )
