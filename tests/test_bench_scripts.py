"""`python -m benchmarks`: the registry names every suite, each suite's command line parses, and
each runs its CPU smoke run (tiny shapes; the Triton kernels under the interpreter) to a JSON
file whose header says on what machine and at what commit it was measured."""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from benchmarks import SUITES
from benchmarks.__main__ import main, parse
from benchmarks.common import add_delta_rule_options, changed_options, delta_rule_options
from deltalab.ops.options import KernelOptions

ROOT = Path(__file__).parents[1]
SUITE_NAMES = {"ops", "kdn", "train", "decode", "tune", "profile", "cpu", "small_ops", "memory",
               "traffic"}  # fmt: skip
COMMANDS = [
    [name, *([mode] if mode else [])]
    for name, (module, _) in SUITES.items()
    for mode in (module if isinstance(module, dict) else [None])
]


def needs_triton() -> None:
    """Skips unless the Triton kernels can run: compiled on CUDA or under the interpreter."""
    pytest.importorskip("triton")
    from deltalab.ops._triton import INTERPRET

    if not (INTERPRET or torch.cuda.is_available()):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")


def run_suite(argv: list[str], path: Path, own_process: bool = False) -> dict:
    """Runs a suite in this process, or in its own where it patches modules for its run (the
    memory and traffic models), and reads its JSON. The traffic model replaces the Triton
    launches itself: its process runs without the interpreter (which importing the memory
    model turns on for the processes started after it)."""
    if own_process:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env |= {"PYTHONPATH": str(ROOT)}
        command = [sys.executable, "-m", "benchmarks", *argv, "--json", str(path)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    else:
        assert main([*argv, "--json", str(path)]) == 0
    return json.loads(path.read_text())


def test_the_registry_lists_every_suite_and_mode(capsys):
    assert set(SUITES) == SUITE_NAMES
    with pytest.raises(SystemExit) as done:
        parse(["--list"])
    assert done.value.code == 0
    listing = capsys.readouterr().out
    for name, (module, _) in SUITES.items():
        modes = f" {{{','.join(module)}}}" if isinstance(module, dict) else ""
        assert f"\n{name}{modes}: " in listing


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_suite_parses_its_help(command, capsys):
    if command[0] == "tune":
        pytest.importorskip("triton")
    with pytest.raises(SystemExit) as done:
        parse([*command, "--help"])
    assert done.value.code == 0
    assert "--json" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv", [["nope"], ["profile"], ["profile", "nope"], ["cpu", "kdn", "--nope"]]
)
def test_an_unknown_suite_mode_or_option_is_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as done:
        parse(argv)
    assert done.value.code == 2
    assert "error:" in capsys.readouterr().err.strip().splitlines()[-1]


def test_small_ops_tiny_run_measures_every_case_under_a_header(tmp_path):
    """The runner end to end, in its own process: every small op's cases measured with float32
    errors against float64 (those of a correct kernel) and the speedups from the times, under a
    header naming the machine, the versions, the commit and the command."""
    pytest.importorskip("triton")
    out = tmp_path / "small_ops.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "benchmarks", "small_ops", "--tiny", "--json", str(out)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    report = json.loads(out.read_text())
    header = report["header"]
    assert header["machine"] and header["torch"] == torch.__version__ and header["date"]
    assert len(header["commit"]) == 40 and isinstance(header["dirty"], bool)
    assert header["command"].endswith(f"small_ops --tiny --json {out}")
    from benchmarks.small_ops import OPS

    assert [(c["op"], c["case"]) for c in report["cases"]] == [
        (op, case) for op, cases in OPS.items() for case in cases
    ]
    for case in report["cases"]:
        for backend in ("torch", "triton"):
            row = case[backend]
            assert row["forward_ms"] > 0 and row["train_ms"] > 0 and row["errors"]
            for name, error in row["errors"].items():
                assert math.isfinite(error) and error < 1e-5, (case["case"], name, error)
        assert case["speedup_train"] == pytest.approx(
            case["torch"]["train_ms"] / case["triton"]["train_ms"]
        )


# Smoke runs on CPU: (argv, whether it runs Triton kernels, a key its JSON must hold).
SMOKE = {
    "ops": (["ops", "--tiny", "--parts", "time", "--chunk-sizes", "64", "--only", "gdn2_c64",
             "sdpa", "--shapes", "1x16x1x16"], True, "time"),
    "kdn": (["kdn", "--tiny", "--gain-chunks"], True, "gain_chunks"),
    "small_ops sweep": (["small_ops", "--tiny", "--ops", "short_conv", "--sweep"], True,
                        "short_conv_sweep"),
    "decode latency": (["decode", "latency", "--tiny", "--mixers", "gdn2"], False, "results"),
    "decode products": (["decode", "products", "--tiny", "--rows", "3"], False, "results"),
    "decode context": (["decode", "context", "--mixers", "gdn2", "--contexts", "8", "16",
                        "--steps", "2", "--repeats", "1"], False, "rows"),
    "profile train": (["profile", "train", "--mixers", "gdn2", "--warmup", "1", "--steps", "1",
                       "--seq-len", "32", "--batch", "2"], False, "mixers"),
    "profile diagonal": (["profile", "diagonal", "--preset", "tiny", "--mixers", "gdn2",
                          "--num-layers", "1", "--batch", "1", "--seq-len", "32"], False,
                         "models"),
    "cpu delta_rule": (["cpu", "delta_rule", "--length", "64", "--heads", "1", "--dim", "8",
                        "--repeats", "1", "--naive-repeats", "1", "--chunk-sizes", "16"], False,
                       "rows"),
    "cpu kdn": (["cpu", "kdn", "--length", "64", "--heads", "1", "--dim", "8", "--chunk-size",
                 "16", "--repeats", "1", "--sequential-repeats", "1"], False, "rows"),
    "cpu layers": (["cpu", "layers", "--batch", "1", "--length", "32", "--hidden", "32",
                    "--heads", "2", "--chunk-size", "16", "--repeats", "1", "--rounds", "1"],
                   False, "muir_vs_gdn2_rounds"),
    "memory": (["memory", "--preset", "tiny", "--mixers", "gdn2", "--length", "128", "--top",
                "3"], False, "mixers"),
    "traffic": (["traffic", "--preset", "tiny", "--mixers", "gdn2", "--seq-len", "32",
                 "--batch", "2", "--num-layers", "1"], False, "gdn2"),
}  # fmt: skip


# The runs of Triton kernels are the interpreter's (CI's interpreter pass), the others CPU's.
SMOKE_PARAMS = [pytest.param(name, marks=pytest.mark.interpreter) if SMOKE[name][1] else name
                for name in SMOKE]  # fmt: skip


@pytest.mark.parametrize("name", SMOKE_PARAMS)
def test_suite_smoke_run_writes_its_results_under_the_header(name, tmp_path):
    argv, triton_kernels, key = SMOKE[name]
    if triton_kernels:
        needs_triton()
    report = run_suite(argv, tmp_path / "out.json", own_process=name in ("memory", "traffic"))
    assert {"machine", "torch", "triton", "commit", "dirty", "date", "command"} <= set(
        report["header"]
    )
    assert report[key], f"{name}: nothing under {key!r}"


@pytest.mark.interpreter
def test_tune_writes_its_best_table_which_the_lookup_reads_back(tmp_path):
    """The tuner's CPU smoke run: its best table, written to --table-dir as the card's file, is
    the table the lookup then takes for that card, and its JSON holds the shipped table's time
    over the best one's, per stage and over the stages."""
    needs_triton()
    from benchmarks.tune_triton import card
    from deltalab.ops.delta_rule.triton.launch import LAUNCH, LAUNCH_TABLES
    from deltalab.ops.launch_tables import table_from_dict

    argv = ["tune", "--device", "cpu", "--shape", "1x32x1x16", "--stages", "intra",
            "--table-dir", str(tmp_path / "tables")]  # fmt: skip
    report = run_suite(argv, tmp_path / "out.json")
    assert {"machine", "torch", "commit", "command"} <= set(report["header"])
    assert report["table_file"] == str(tmp_path / "tables" / f"{report['device_key']}.json")
    read_back = LAUNCH_TABLES.resolve(card("cpu"), tmp_path / "tables")
    assert read_back == table_from_dict(LAUNCH, report["table"], "table")
    rows = [r for r in report["rows"] if "error" not in r]
    assert rows[0]["setting"] == "{}"  # the shipped table first
    times = [r["fwd_ms"] + r["bwd_ms"] for r in rows]
    intra = report["stages"]["intra"]
    assert intra["shipped_ms"] == times[0] and intra["best_ms"] == min(times)
    assert report["shipped_over_best"] == pytest.approx(times[0] / min(times))
    # On a CPU the shipped table is the default one; the best row's fields applied to it.
    assert read_back.intra == replace(LAUNCH.intra, **ast.literal_eval(intra["best"]))


def test_the_best_table_takes_each_stages_fastest_candidate_and_reports_conflicts():
    """Rows that widen the products or change the result are no candidates; a field two stages'
    winners set differently keeps the first stage's, reported."""
    pytest.importorskip("triton")
    from benchmarks.tune_triton import best_table
    from deltalab.ops.delta_rule.triton.launch import LAUNCH

    settings = [{}, {"block": 128}, {}, {"num_warps": 4, "block_v": 32},
                {"num_warps": 2, "walk_dots": "float32"}, {"num_warps": 2, "block_v": 16},
                {}, {"num_warps": 2, "operator_block_v": 64}]  # fmt: skip
    timing = [("intra", 2.0, 0), ("intra", 1.0, 0), ("state_pass", 4.0, 0),
              ("state_pass", 3.0, 0), ("state_pass", 1.0, 0), ("state_pass", 0.5, 0.5),
              ("operator_grads", 2.0, 0), ("operator_grads", 1.0, 0)]  # fmt: skip
    rows = [{"stage": stage, "setting": str(s), "fwd_ms": ms, "bwd_ms": None, "max_diff": diff}
            for (stage, ms, diff), s in zip(timing, settings, strict=True)]  # fmt: skip
    table, stages, conflicts = best_table(LAUNCH, rows, dict(enumerate(settings)))
    assert table.intra.block == 128 and table.block_v == 32 and table.num_warps == 4
    assert table.operator_block_v == 64
    assert conflicts == ["num_warps: operator_grads chose 2, state_pass kept 4"]
    assert {k: s["ratio"] for k, s in stages.items()} == {
        "intra": 2.0,
        "state_pass": 4.0 / 3.0,
        "operator_grads": 2.0,
    }


@pytest.mark.interpreter
def test_decode_tune_writes_its_best_table_which_the_lookup_reads_back(tmp_path):
    """The fused step's tuner, a CPU smoke run (a form of one state, one with a covariance):
    every launch tried at each batch, each giving the same result, its best table
    written to --table-dir as the card's fused_step section, which the lookup then takes."""
    needs_triton()
    from benchmarks.tune_decode_step import candidates
    from benchmarks.tune_triton import card
    from deltalab.ops.delta_rule.triton.fused_step import LAUNCH, LAUNCH_TABLES
    from deltalab.ops.launch_tables import table_from_dict

    argv = ["decode", "tune", "--device", "cpu", "--heads", "1", "--head-dim", "32",
            "--batches", "1", "2", "--layers", "1", "--rules", "beta", "kdn_exact",
            "--table-dir", str(tmp_path / "tables")]  # fmt: skip
    report = run_suite(argv, tmp_path / "out.json")
    assert report["table_file"] == str(tmp_path / "tables" / f"{report['device_key']}.json")
    read_back = LAUNCH_TABLES.resolve(card("cpu"), tmp_path / "tables")
    assert read_back == table_from_dict(LAUNCH, report["table"], "table")
    rows = report["rows"]
    assert len(rows) == 2 * (1 + len(candidates(32)))  # the shipped table, then each launch
    assert all(r["max_diff"] < 1e-5 for r in rows)
    assert set(report["shipped_over_best"]) == {"1", "2"}


def test_the_tuned_step_table_switches_launch_from_the_first_batch_the_wide_one_wins():
    from benchmarks.tune_decode_step import best_table
    from deltalab.ops.delta_rule.triton.fused_step import FusedStepLaunch

    def row(batch, block_v, warps, us, diff=0.0):
        setting = {"block_v": block_v, "num_warps": warps, "many_programs": None,
                   "many_block_v": 32, "many_num_warps": 2}  # fmt: skip
        return {"batch": batch, "setting": setting, "shipped": False, "us": us, "max_diff": diff}

    rows = [row(1, 64, 4, 7.0), row(1, 32, 2, 9.0), row(16, 64, 4, 14.0), row(16, 32, 2, 15.0),
            row(32, 64, 4, 20.0), row(32, 32, 2, 19.0), row(64, 64, 4, 36.0),
            row(64, 32, 2, 34.0), row(64, 16, 1, 1.0, diff=1.0)]  # fmt: skip
    assert best_table(rows, heads=8) == FusedStepLaunch(64, 4, 32 * 8, 32, 2)
    # Where the first batch's launch is fastest at the last batch too, there is one launch.
    same = [r for r in rows if r["setting"]["block_v"] == 64]
    assert best_table(same, heads=8) == FusedStepLaunch(64, 4, None)
    # A batch where the wide launch gave another result decides nothing.
    wrong_at_32 = [r for r in rows if not (r["batch"] == 32 and r["setting"]["block_v"] == 32)]
    assert best_table(wrong_at_32, heads=8) == FusedStepLaunch(64, 4, 64 * 8, 32, 2)


def test_train_smoke_run_reports_each_mixer_throughput(tmp_path):
    from benchmarks.bench_train import SKIPPED_STEPS

    argv = ["train", "--mixers", "gdn2", "--steps", str(SKIPPED_STEPS + 1), "--seq-len", "32",
            "--batch", "2", "--cache-dir", str(tmp_path / "tokens")]  # fmt: skip
    report = run_suite(argv, tmp_path / "out.json")
    (row,) = report["rows"]
    assert row[0] == "gdn2" and row[2] > 0  # tokens/s


@pytest.mark.parametrize("mode", ["gaps", "kernels"])
def test_cuda_only_profiles_say_so_without_cuda(mode, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    assert main(["profile", mode, "--json", str(tmp_path / "out.json")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.endswith("it needs CUDA")


def test_decode_profile_tiny_run_reports_every_mixer_by_operator(tmp_path):
    """The decode-step profile's CPU smoke run: every mixer profiled, at least one operator a
    layer, the projections' matrix products among them, none of the view or allocation
    operators that launch no kernel counted."""
    report = run_suite(["profile", "decode", "--tiny"], tmp_path / "out.json")
    mixers = [r["mixer"] for r in report["results"]]
    assert mixers == ["gdn2", "muir", "kdn_diag", "transformer"]
    for result in report["results"]:
        names = [row["name"] for row in result["kernels"]]
        assert result["kernels_per_token"] >= result["layers"], result["mixer"]
        assert not {"aten::view", "aten::as_strided", "aten::empty_strided"} & set(names)
        assert {"aten::mm", "aten::addmm"} & set(names), result["mixer"]


def test_delta_rule_flags_give_the_kernel_options_they_name():
    parser = argparse.ArgumentParser()
    add_delta_rule_options(parser)
    assert delta_rule_options(parser.parse_args([])) == KernelOptions()
    assert changed_options(KernelOptions()) == {}
    flags = ["--state-pass", "split", "--keep-states", "--operator-dtype", "float32"]
    flags += ["--walk-dots", "float32", "--keep-inputs"]
    options = delta_rule_options(parser.parse_args(flags))
    changed = dict(state_pass="split", recompute_states=False, operator_dtype="float32",
                   walk_dots="float32", rebuild_in_backward=False)  # fmt: skip
    assert options == KernelOptions(**changed)
    assert changed_options(options) == changed


def test_generate_bench_tiny_run_times_every_mixer_on_the_three_paths(tmp_path):
    """`decode generate` (model.generate against the loop and the step) runs its CPU smoke run:
    a finite time per token for every path, mixer and batch."""
    report = run_suite(["decode", "generate", "--tiny"], tmp_path / "out.json")
    cases = [(r["mixer"], r["batch"]) for r in report["results"]]
    assert cases == [(m, b) for m in ("gdn2", "kdn_diag", "kda", "transformer") for b in (1, 2)]
    for result in report["results"]:
        assert all(math.isfinite(result[k]) for k in ("generate_ms", "loop_ms", "step_ms"))


def test_each_timed_form_is_set_against_fla_normalizing_as_it_does():
    from benchmarks.bench_triton import add_ratios

    shape = "4x4096x16x128"
    times = {"kda_qk_c64": (1.0, 4.0), "gdn2_l2first_c64": (1.5, 6.0), "kdn_iso_c64": (2.0, 5.0),
             "gdn2_c64": (1.2, 5.5), "fla_kda_qk": (2.0, 5.0), "fla_gdn2_qk": (3.0, 8.0),
             "fla_kda": (4.0, 10.0), "sdpa": (0.5, 2.0)}  # fmt: skip
    rows = add_ratios(
        [{"shape": shape, "case": c, "fwd_ms": f, "train_ms": t} for c, (f, t) in times.items()]
    )
    ratios = {r["case"]: (r["fwd_vs_fla"], r["vs_fla"]) for r in rows}
    assert ratios["kda_qk_c64"] == (0.5, 0.8)
    assert ratios["gdn2_l2first_c64"] == (0.5, 0.75)
    assert ratios["kdn_iso_c64"] == (0.5, 0.5)
    # No fla_gdn2 row in this run: no ratio, never one against another form's kernel.
    assert all(math.isnan(x) for x in ratios["gdn2_c64"])
    assert {r["case"]: r["vs_sdpa"] for r in rows}["kda_qk_c64"] == 2.0


# (preset, mixer) -> x's projections' width, the second factors' weight: GDN-2's q, k, v, erase
# and write maps at the width and its decay's and output gate's first factors at their rank
# (128 = min(128, width)); DeltaNet's q, k, v, its output norm's gate and one write strength a
# head, no low-rank gate.
DECODER_PRODUCTS = {
    ("340M", "gdn2"): (5 * 1024 + 2 * 128, (2 * 1024, 2 * 128)),
    ("tiny", "gdn2"): (5 * 128 + 2 * 128, (2 * 128, 2 * 128)),
    ("340M", "deltanet"): (4 * 1024 + 8, None),
}


@pytest.mark.parametrize(("preset", "mixer"), list(DECODER_PRODUCTS))
def test_decode_products_times_the_products_the_fused_step_makes(preset, mixer):
    from benchmarks.decode_products import layer_products

    products, layers = layer_products(preset, mixer)
    width, second = DECODER_PRODUCTS[preset, mixer]
    hidden = 1024 if preset == "340M" else 128
    assert (products["x's projections"].n_out, products["x's projections"].n_in) == (width, hidden)
    got = products.get("second factors")
    assert (got and (got.n_out, got.n_in)) == second
    assert [n for n, p in products.items() if p.summed] == ["output projection", "FFN down"]
    assert layers == (24 if preset == "340M" else 6)
    with pytest.raises(SystemExit, match="no fused decoding step"):
        layer_products("tiny", "transformer")
