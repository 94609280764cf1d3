"""Steps and time to the baseline's loss (`deltalab.study.to_loss`), and the record of how many
jobs shared a run's device, from which a time is a time alone."""

from __future__ import annotations

import dataclasses
import json
import math
import tarfile
import threading
import time
from pathlib import Path

import pytest
import yaml
from test_study import FakeTrain, micro_spec, plan_of, quiet

from deltalab.cli import main
from deltalab.study.cli import JOBS_LEFT, execute, select
from deltalab.study.markdown import render_markdown
from deltalab.study.records import pack_records, packed_files
from deltalab.study.report import collect
from deltalab.study.runner import RECORD_NAME, StudyRunner, run_state
from deltalab.study.to_loss import held_out_curve, steps_to_loss, to_loss
from deltalab.train.checkpoint import CHECKPOINT_DIR


def test_steps_to_loss_interpolates_between_the_evaluations_that_bracket_the_target():
    curve = [(0, 5.0), (10, 3.0), (20, 2.0), (30, 1.0)]
    # 2.5 lies halfway between the evaluations at 10 (3.0) and 20 (2.0).
    assert steps_to_loss(curve, 2.5) == pytest.approx(15.0)
    assert steps_to_loss(curve, 2.0) == pytest.approx(20.0)
    assert steps_to_loss(curve, 1.2) == pytest.approx(28.0)
    # The first point at or below: a curve that dips and climbs again is read where it first dips.
    assert steps_to_loss([(0, 5.0), (10, 1.0), (20, 3.0), (30, 0.5)], 2.0) == pytest.approx(7.5)


def test_a_curve_never_reaching_the_target_has_no_steps_and_one_below_at_once_its_first_step():
    curve = [(0, 5.0), (10, 3.0)]
    assert steps_to_loss(curve, 2.9) is None
    assert steps_to_loss(curve, 6.0) == 0.0
    assert steps_to_loss([], 1.0) is None


def test_the_held_out_curve_is_the_trainers_evaluations_in_step_order(tmp_path):
    history = {"train": [], "eval": [{"step": 30, "loss": 2.0}, {"step": 0, "loss": 5.5},
                                     {"step": 10, "loss": 4.0}]}  # fmt: skip
    (tmp_path / "metrics.json").write_text(json.dumps({"history": history}))
    assert held_out_curve(tmp_path) == [(0, 5.5), (10, 4.0), (30, 2.0)]
    (tmp_path / "metrics.json").write_text(json.dumps({"final_eval_loss": 2.0}))
    assert held_out_curve(tmp_path) == []
    assert held_out_curve(tmp_path / "missing") == []


class CurveTrain(FakeTrain):
    """FakeTrain whose runs evaluate along the way: held-out loss falling linearly from 5 at
    step 0 to the run's final loss at step 4, evaluated at steps 0, 2 and 4 (or at 0 and 4 only
    where `sparse` names the run); tokens/s per run from `speeds`."""

    def __init__(self, losses: dict[str, float], speeds: dict[str, float], sparse=()) -> None:
        super().__init__(losses)
        self.speeds = speeds
        self.sparse = set(sparse)

    def __call__(self, args, env, log):
        code = super().__call__(args, env, log)
        if "train" in args:
            config = yaml.safe_load(Path(args[args.index("--config") + 1]).read_text())
            out = Path(config["log"]["out_dir"])
            final = self.losses[out.name]
            metrics = json.loads((out / "metrics.json").read_text())
            curve = [(0, 5.0), (2, (5.0 + final) / 2), (4, final)]
            if out.name in self.sparse:
                del curve[1]
            metrics["history"]["eval"] = [{"step": s, "loss": v} for s, v in curve]
            metrics["median_tokens_per_s"] = self.speeds[out.name]
            (out / "metrics.json").write_text(json.dumps(metrics))
        return code


GDN2 = "gdn2.tiny.lr0.003"
TRANSFORMER = "transformer.tiny.lr0.003"


def _study(tmp_path, corpus, parallel: int, seeds=(0, 1), sparse=(), losses=None):
    spec = micro_spec(tmp_path, corpus, parallel=parallel)
    spec["grid"]["seeds"] = list(seeds)
    plan = plan_of(spec)
    # Seed 0: gdn2's 2.0 is reached by the transformer's line from 5 to 1 at step 3 (4 / 3
    # sooner); seed 1: its line from 5 to 3.5 never reaches gdn2's 3.0; seed 2: 1.6 and 1.0.
    losses = losses or {
        f"{GDN2}.s0": 2.0, f"{GDN2}.s1": 3.0, f"{GDN2}.s2": 1.6,
        f"{TRANSFORMER}.s0": 1.0, f"{TRANSFORMER}.s1": 3.5, f"{TRANSFORMER}.s2": 1.0,
    }  # fmt: skip
    # Seconds a step (batch 2 x 16 tokens): gdn2 32 / 64 = 0.5, the transformer 32 / 16 = 2.
    speeds = {name: 64.0 if name.startswith("gdn2") else 16.0 for name in losses}
    assert execute(plan, launcher=CurveTrain(losses, speeds, sparse), say=quiet) == 0
    return plan, collect(plan)


def _row(text: str, variant: str) -> str:
    section = text.split("### Steps and time to gdn2's loss")[1]
    return next(line for line in section.splitlines() if line.startswith(f"| {variant} |"))


def test_the_factors_pair_each_seed_with_the_baseline_and_time_only_runs_alone(tmp_path, corpus):
    plan, report = _study(tmp_path, corpus, parallel=1)
    (group,) = report["groups"]
    found = group["to_loss"]
    assert list(found) == ["gdn2", "transformer"]
    base = found["gdn2"]["seeds"]
    assert base["0"]["steps"] == pytest.approx(4.0) and base["1"]["steps"] == pytest.approx(4.0)
    transformer = found["transformer"]
    s0, s1 = transformer["seeds"]["0"], transformer["seeds"]["1"]
    assert s0["target"] == 2.0 and s0["steps"] == pytest.approx(3.0)
    assert s0["status"] == "reached" and s0["steps_factor"] == pytest.approx(4 / 3)
    # Alone on its device: 3 steps x 2 s against gdn2's 4 steps x 0.5 s.
    assert s0["time_factor"] == pytest.approx((4 * 0.5) / (3 * 2.0))
    assert s1["status"] == "not reached"
    assert s1["steps"] is None and s1["steps_factor"] is None and s1["time_factor"] is None
    # A seed that never got there would raise a mean it is left out of: no summary.
    assert transformer["reached"] == 1
    assert transformer["steps_factor"] is None and transformer["time_factor"] is None
    row = _row(render_markdown(plan, report, []), "transformer")
    assert "– (1/2 reached)" in row and "s0: 3, s1: not reached" in row


def test_every_seed_reaching_gives_the_geometric_mean_and_range(tmp_path, corpus):
    # Seed 0: 4/3; seed 2: gdn2's 1.6 is reached at step 3.4 of the line from 5 to 1 (4/3.4).
    plan, report = _study(tmp_path, corpus, parallel=1, seeds=(0, 2))
    transformer = report["groups"][0]["to_loss"]["transformer"]
    factors = [4 / 3, 4 / 3.4]
    summary = transformer["steps_factor"]
    assert summary["n"] == 2
    assert summary["geometric_mean"] == pytest.approx(math.sqrt(factors[0] * factors[1]))
    assert (summary["min"], summary["max"]) == pytest.approx((min(factors), max(factors)))
    assert "1.25 [1.18, 1.33] (2/2 reached)" in _row(
        render_markdown(plan, report, []), "transformer"
    )


def test_runs_that_shared_their_device_get_steps_but_no_time(tmp_path, corpus):
    plan, report = _study(tmp_path, corpus, parallel=2)
    transformer = report["groups"][0]["to_loss"]["transformer"]
    s0 = transformer["seeds"]["0"]
    assert s0["steps_factor"] == pytest.approx(4 / 3)
    assert s0["time_factor"] is None and s0["no_time"] == "shared a device"
    assert transformer["no_time"] == ["shared a device"]
    assert "– (shared a device; 1/2 reached)" in _row(
        render_markdown(plan, report, []), "transformer"
    )


def test_a_curve_of_two_evaluations_or_a_seed_without_its_baseline_gives_no_factor(
    tmp_path, corpus
):
    plan = plan_of(micro_spec(tmp_path, corpus))
    _, report = _study(tmp_path, corpus, parallel=1, sparse=[f"{TRANSFORMER}.s0"])
    transformer = report["groups"][0]["to_loss"]["transformer"]
    assert transformer["seeds"]["0"]["status"] == "too few evaluations"
    assert transformer["seeds"]["0"]["steps_factor"] is None
    # gdn2's seed-1 run gone: the transformer's seed 1 has nothing to pair with.
    run = next(r for r in plan.runs if r.name == f"{GDN2}.s1")
    (run.directory / "metrics.json").unlink()
    report = collect(plan)
    transformer = report["groups"][0]["to_loss"]["transformer"]
    assert list(transformer["seeds"]) == ["0"] and transformer["unpaired"] == [1]
    assert "s1: no gdn2 run" in _row(render_markdown(plan, report, []), "transformer")


def test_speeds_alone_time_a_pair_only_when_both_were_measured_on_one_device(tmp_path):
    curves = {"gdn2": [(0, 5.0), (2, 3.0), (4, 2.0)], "transformer": [(0, 5.0), (2, 2.0), (4, 1.0)]}
    entries = []
    for variant, curve in curves.items():
        (tmp_path / variant).mkdir()
        history = {"eval": [{"step": step, "loss": loss} for step, loss in curve]}
        (tmp_path / variant / "metrics.json").write_text(json.dumps({"history": history}))
        entries.append({"variant": variant, "seed": 0, "status": "completed",
                        "directory": variant, "metrics": {"tokens_per_s": 1.0},
                        "device_shared_by": 4})  # fmt: skip

    def seed0(speeds):
        return to_loss(entries, "gdn2", tmp_path, 32, speeds)["transformer"]["seeds"]["0"]

    one = {"gdn2": {"tokens_per_s": 64.0, "device": "cuda: A"},
           "transformer": {"tokens_per_s": 16.0, "device": "cuda: A"}}  # fmt: skip
    # 2 steps x 2 s against gdn2's 4 x 0.5 s, at the speeds alone (the grid runs shared).
    assert seed0(one)["steps_factor"] == pytest.approx(2.0)
    assert seed0(one)["time_factor"] == pytest.approx((4 * 0.5) / (2 * 2.0))
    two = {**one, "transformer": {"tokens_per_s": 16.0, "device": "cuda: B"}}
    assert seed0(two)["time_factor"] is None
    assert seed0(two)["no_time"] == "speed runs on different devices"
    # Without speed runs, the grid's runs shared their device; alone, on two kinds of device.
    assert seed0({})["no_time"] == "shared a device"
    for entry, device in zip(entries, ("cuda: A", "cuda: B"), strict=True):
        entry.update(device_shared_by=1, recorded_device=device)
    assert seed0({})["no_time"] == "trained on different devices"
    entries[1]["recorded_device"] = "cuda: A"
    # Alone on one kind of device: each at its own run's 1 token/s, 2 steps against 4.
    assert seed0({})["time_factor"] == pytest.approx(2.0)
    # A variant at the target before training has no number of steps to compare.
    history = {
        "eval": [{"step": 0, "loss": 1.5}, {"step": 2, "loss": 1.2}, {"step": 4, "loss": 1.0}]
    }
    (tmp_path / "transformer" / "metrics.json").write_text(json.dumps({"history": history}))
    assert seed0(one)["status"] == "at the target from the start"
    assert seed0(one)["steps_factor"] is None
    # A baseline whose last loss is no lower than its first: no factor, said so.
    history = {
        "eval": [{"step": 0, "loss": 2.0}, {"step": 2, "loss": 3.0}, {"step": 4, "loss": 2.5}]
    }
    (tmp_path / "gdn2" / "metrics.json").write_text(json.dumps({"history": history}))
    assert seed0(one)["status"] == "baseline did not improve"
    assert seed0(one)["steps_factor"] is None and seed0(one)["time_factor"] is None


def test_a_run_records_how_many_jobs_shared_its_device_and_a_resume_keeps_the_most(
    tmp_path, corpus
):
    plan = plan_of(micro_spec(tmp_path, corpus, parallel=2))
    # On the CPU every job shares the one machine; on CUDA, parallel over the devices.
    assert StudyRunner(plan, say=quiet).device_shared_by() == 2
    # One run picked with --only runs alone, whatever `parallel` says.
    assert StudyRunner(select(plan, [plan.runs[0].name]), say=quiet).device_shared_by() == 1
    losses = {run.name: 2.0 for run in plan.runs}
    speeds = dict.fromkeys(losses, 10.0)
    assert execute(plan, launcher=CurveTrain(losses, speeds), say=quiet) == 0
    for run in plan.runs:
        assert json.loads((run.directory / RECORD_NAME).read_text())["device_shared_by"] == 2
    # Resumed alone, a run that once shared its device still counts as shared; a run trained
    # anew alone counts as alone.
    alone = plan_of(micro_spec(tmp_path, corpus, parallel=1))
    resumed, fresh = alone.runs[0], alone.runs[1]
    for run in (resumed, fresh):
        (run.directory / "metrics.json").unlink()
    checkpoints = resumed.directory / CHECKPOINT_DIR
    checkpoints.mkdir(parents=True, exist_ok=True)
    (checkpoints / "step_00000002.pt").write_bytes(b"")
    launcher = CurveTrain(losses, speeds)
    assert execute(alone, launcher=launcher, say=quiet) == 0
    assert any("--resume" in call for call in launcher.calls)
    shared = {
        run.name: json.loads((run.directory / RECORD_NAME).read_text())["device_shared_by"]
        for run in (resumed, fresh)
    }
    assert shared == {resumed.name: 2, fresh.name: 1}


# --- the throughput runs: each variant's speed, one run alone ------------------------------------


def test_a_throughput_run_is_the_variants_grid_config_cut_short_and_evaluated_only_at_its_end(
    tmp_path, corpus
):
    spec = micro_spec(tmp_path, corpus, **{"throughput.steps": 9, "run.schedule.warmup_steps": 2})
    spec["grid"]["lrs"] = [1e-3, 3e-3]
    spec["run"]["train"]["steps"] = 6
    plan = plan_of(spec)
    assert [job.name for job in plan.throughput] == [
        "throughput.transformer.tiny",
        "throughput.gdn2.tiny",
    ]
    for job in plan.throughput:
        grid = next(r for r in plan.runs if r.variant == job.variant and r.seed == 0)
        assert job.directory == plan.spec.out_dir / "throughput" / job.name
        assert job.config.train.steps == 9 and job.config.train.seed == 0
        assert job.config.optim.lr == 1e-3
        assert job.config.eval.every == 0 and job.config.eval.sample_tokens == 0
        # Warmup cut in proportion to the steps: 2 of 6 -> 3 of 9.
        assert job.config.schedule.warmup_steps == 3
        assert job.config.model == grid.config.model
        assert job.config.train.batch_size == grid.config.train.batch_size
        assert job.config.train.seq_len == grid.config.train.seq_len
    assert plan_of(micro_spec(tmp_path, corpus)).throughput == []


class Recording(CurveTrain):
    """CurveTrain that keeps the order of its launches and how many ran at once at most."""

    def __init__(self, losses, speeds) -> None:
        super().__init__(losses, speeds)
        self.running = 0
        self.most = 0
        self.lock = threading.Lock()

    def __call__(self, args, env, log):
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(0.05)  # long enough for a second worker to start beside it
        try:
            if "train" in args:
                config = Path(args[args.index("--config") + 1])
                name = Path(yaml.safe_load(config.read_text())["log"]["out_dir"]).name
                if name.startswith("throughput."):
                    return self._speed_run(config, name)
            return super().__call__(args, env, log)
        finally:
            with self.lock:
                self.running -= 1

    def _speed_run(self, config: Path, name: str) -> int:
        out = Path(yaml.safe_load(config.read_text())["log"]["out_dir"])
        self.calls.append(["train", name, f"concurrent={self.running}"])
        speed = {"throughput.gdn2.tiny": 50.0, "throughput.transformer.tiny": 10.0}[name]
        metrics = {"status": "completed", "median_tokens_per_s": speed, "steps_done": 8}
        (out / "metrics.json").write_text(json.dumps(metrics))
        for left in ("checkpoints/step_00000008.pt", "model/config.json"):
            (out / left).parent.mkdir(parents=True, exist_ok=True)
            (out / left).write_text("")
        return 0


def test_the_throughput_runs_train_first_one_at_a_time_and_time_the_steps_to_loss(tmp_path, corpus):
    spec = micro_spec(tmp_path, corpus, parallel=2, **{"throughput.steps": 8})
    plan = plan_of(spec)
    names = [run.name for run in plan.runs]
    losses = {n: (2.0 if n.startswith("gdn2") else 1.0) for n in names}
    launcher = Recording(losses, dict.fromkeys(names, 100.0))
    assert execute(plan, launcher=launcher, say=quiet) == 0
    speed_calls = [c for c in launcher.calls if c[1:2] and c[1].startswith("throughput.")]
    assert [c[1] for c in launcher.calls[:2]] == [
        "throughput.transformer.tiny",
        "throughput.gdn2.tiny",
    ]
    assert all(c[2] == "concurrent=1" for c in speed_calls)
    assert launcher.most == 2  # the grid ran two at a time after them
    record = json.loads((plan.throughput[0].directory / RECORD_NAME).read_text())
    assert record["device_shared_by"] == 1 and record["status"] == "completed"
    # A speed run keeps its records, not its checkpoint or model.
    for job in plan.throughput:
        assert not (job.directory / "checkpoints").exists()
        assert not (job.directory / "model").exists()
        assert (job.directory / "metrics.json").exists()
    report = collect(plan)
    assert report["throughput"]["tiny"]["gdn2"]["tokens_per_s"] == 50.0
    s0 = report["groups"][0]["to_loss"]["transformer"]["seeds"]["0"]
    # The grid shared its device, but the speeds alone time it: 3 steps at 32 / 10 s against
    # gdn2's 4 at 32 / 50 s.
    assert s0["time_factor"] == pytest.approx((4 * 32 / 50) / (3 * 32 / 10))
    # A rerun skips the speed runs; an interrupted one (no completed metrics) starts over.
    (plan.throughput[1].directory / "metrics.json").unlink()
    (plan.throughput[1].directory / "stale").write_text("")
    launcher = Recording(losses, dict.fromkeys(names, 100.0))
    assert execute(plan, launcher=launcher, say=quiet) == 0
    assert [c[1] for c in launcher.calls] == ["throughput.gdn2.tiny"]
    assert not (plan.throughput[1].directory / "stale").exists()


def test_launch_until_starts_no_job_after_it_and_lets_the_running_ones_finish(tmp_path, corpus):
    spec = micro_spec(tmp_path, corpus, parallel=2)
    spec["grid"]["seeds"] = [0, 1, 2]
    plan = plan_of(spec)
    names = [run.name for run in plan.runs]
    losses = dict.fromkeys(names, 2.0)

    class Slow(CurveTrain):
        def __call__(self, args, env, log):
            time.sleep(1.0)
            return super().__call__(args, env, log)

    # The two workers start one job each at once; a job takes 1 s, past the 0.3 s window.
    lines: list[str] = []
    launcher = Slow(losses, dict.fromkeys(names, 100.0))
    until = time.monotonic() + 0.3
    assert execute(plan, launcher=launcher, say=lines.append, launch_until=until) == JOBS_LEFT
    started = [c for c in launcher.calls if "train" in c]
    assert len(started) == 2
    done = [run for run in plan.runs if run_state(run) == "done"]
    assert len(done) == 2
    assert "4 not started (--launch-for)" in lines[-1]
    # The next invocation takes up the rest; finished jobs do not count as not started.
    lines.clear()
    launcher = Slow(losses, dict.fromkeys(names, 100.0))
    until = time.monotonic() + 60
    assert execute(plan, launcher=launcher, say=lines.append, launch_until=until) == 0
    assert all(run_state(run) == "done" for run in plan.runs)
    assert "not started" not in lines[-1]
    assert len([c for c in launcher.calls if "train" in c]) == 4


@pytest.mark.parametrize(
    ("words", "message"),
    [
        (["--launch-for", "-1"], "--launch-for must be a number of seconds >= 0, got -1.0"),
        (["--launch-for", "nan"], "--launch-for must be a number of seconds >= 0, got nan"),
        (["--launch-for", "5", "--dry-run"], "--launch-for goes with a study that runs"),
        (["--pack-records", "r.tar.gz", "--only", "x"], "--pack-records goes alone"),
    ],
)
def test_launch_for_and_pack_records_are_refused_naming_the_option(
    tmp_path, corpus, capsys, words, message
):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(micro_spec(tmp_path, corpus)))
    assert main(["study", str(path), *words]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "study").exists()


# --- packing a study's records -----------------------------------------------------------------


def test_packed_records_leave_out_checkpoints_and_models_and_rebuild_the_report(tmp_path, corpus):
    plan, _ = _study(tmp_path, corpus, parallel=1)
    run = plan.runs[0].directory
    for junk in ("checkpoints/step_00000004.pt", "model/model.safetensors", "tb/events.out"):
        (run / junk).parent.mkdir(parents=True, exist_ok=True)
        (run / junk).write_bytes(b"x")
    (run / "loss_curve.png").write_bytes(b"png")
    first, second = tmp_path / "a.tar.gz", tmp_path / "b.tar.gz"
    assert pack_records(plan, first) == len(packed_files(plan))
    pack_records(plan, second)
    assert first.read_bytes() == second.read_bytes()  # the same records, the same bytes
    with tarfile.open(first) as archive:
        names = archive.getnames()
        archive.extractall(tmp_path / "copy", filter="data")
    assert f"runs/{run.name}/metrics.json" in names
    assert not [n for n in names if "checkpoints/" in n or "/model/" in n or "/tb/" in n]
    assert not [n for n in names if n.endswith(".png")]
    copied = dataclasses.replace(plan.spec, out_dir=tmp_path / "copy")
    moved = [
        dataclasses.replace(r, directory=tmp_path / "copy" / "runs" / r.name) for r in plan.runs
    ]
    replan = dataclasses.replace(plan, spec=copied, runs=moved)
    assert all(run_state(r) == "done" for r in replan.runs)
    original = render_markdown(plan, collect(plan), [])
    rebuilt = render_markdown(replan, collect(replan), [])
    assert rebuilt.split("### Steps and time")[1] == original.split("### Steps and time")[1]
