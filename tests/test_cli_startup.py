"""The `deltalab` command answers help, `presets`, `eval --list` and config and eval-settings
errors without loading torch, transformers or matplotlib: each is imported by the command that
needs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "matplotlib", "lm_eval", "tensorboard")

# Runs the command in a fresh interpreter, then prints the heavy modules it loaded.
PROBE = """
import sys
from deltalab.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as stop:
    code = stop.code
print("LOADED", *sorted(m for m in {heavy!r} if m in sys.modules), "EXIT", code)
"""


def run_command(argv: list[str]) -> tuple[list[str], int, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(heavy=HEAVY), *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    last = done.stdout.strip().splitlines()[-1].split()
    assert last[0] == "LOADED" and last[-2] == "EXIT", done.stdout + done.stderr
    return last[1:-2], int(last[-1]), done.stdout + done.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["train", "--help"],
        ["eval", "--help"],
        ["study", "--help"],
        ["generate", "--help"],
        ["presets"],
        ["presets", "--mixer", "muir"],
        ["train", "train.stepz=3"],
        ["train", "--config", "no/such/file.yaml"],
        ["eval", "--list"],
        ["eval", "--task", "perplexity", "seq_lne=5"],
        ["eval", "--task", "passkey", "lengths=[1024,x]"],
        ["eval", "--task", "mqar-train", "mixers=[gnd2]"],
        ["eval", "--task", "perplexty"],
    ],
)
def test_help_presets_and_config_errors_load_no_heavy_module(argv):
    loaded, code, output = run_command(argv)
    assert loaded == [], output
    assert code in (0, 2), output


def test_presets_prints_the_stored_table_rows():
    _, code, output = run_command(["presets", "--mixer", "kdn_diag"])
    assert code == 0
    rows = [line.split() for line in output.splitlines() if "kdn_diag" in line]
    assert [row[0] for row in rows] == ["tiny", "166M", "340M", "750M", "1.3B", "kdn-authors-1.3B"]
    # The KDN authors' preset is listed with the mixers it is made for only.
    _, code, output = run_command(["presets", "--mixer", "gdn2"])
    assert code == 0 and "kdn-authors" not in output


def test_the_stored_preset_table_is_the_models_own_count():
    from deltalab.catalog import stored_preset_table
    from deltalab.models.presets import preset_table

    # If this fails, a model's shape changed: rewrite the table with
    # `deltalab.models.presets.write_preset_table()`.
    assert stored_preset_table() == preset_table()


SAVE_TINY = """
import sys
from deltalab.models import CausalLM, build_config
CausalLM(build_config("tiny", mixer="gdn2", num_layers=1)).save_pretrained(sys.argv[1])
"""

# `import deltalab` loads no torch, so it cannot register the model (a transformers config class
# imports torch); reading `deltalab.models` imports the subpackage, which registers it.
LOAD = """
import sys
import deltalab
from transformers import AutoModelForCausalLM
try:
    AutoModelForCausalLM.from_pretrained(sys.argv[1])
except ValueError as error:
    print("BEFORE", "does not recognize" in str(error))
print("REGISTERED", "deltalab.models" in sys.modules)
print("SUBPACKAGES", all(hasattr(deltalab, n) for n in ("ops", "layers", "data", "train")))
deltalab.models
print("LOADED", type(AutoModelForCausalLM.from_pretrained(sys.argv[1])).__name__)
"""


def test_reading_deltalab_models_registers_the_model_with_the_auto_classes(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    path = str(tmp_path / "model")
    for script in (SAVE_TINY, LOAD):
        done = subprocess.run(
            [sys.executable, "-c", script, path],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines == ["BEFORE True", "REGISTERED False", "SUBPACKAGES True", "LOADED CausalLM"], (
        lines
    )
    # The docs say so: a plain `import deltalab` registers nothing.
    architecture, usage = (
        " ".join((ROOT / "docs" / name).read_text().split())
        for name in ("ARCHITECTURE.md", "USAGE.md")
    )
    assert "`import deltalab` registers" not in architecture
    assert "`import deltalab` alone does not register" in usage
