"""Launch tables by device (`deltalab.ops.launch_tables`): a card's own built-in table, its
family's, the default; the user's file over the built-in one; every field of a file checked by
name. Cards are given as properties and directories as arguments (no CUDA needed)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from deltalab.ops._triton import RowLaunch
from deltalab.ops.launch_tables import (
    BUILTIN_DIRECTORY,
    DeviceProperties,
    LaunchRegistry,
    read_table_file,
    table_as_dict,
    write_table_file,
)

H100 = DeviceProperties("NVIDIA H100 80GB HBM3", (9, 0), 132)
H200 = DeviceProperties("NVIDIA H200", (9, 0), 132)
DEFAULT = RowLaunch(forward_elements=4096, backward_elements=2048, forward_per_thread=16,
                    backward_per_thread=8, max_warps=16)  # fmt: skip


def registry() -> LaunchRegistry:
    return LaunchRegistry("norms", DEFAULT)


def builtins(tmp_path):
    """A built-in directory of two cards whose norms tables differ from the default and from
    each other (max_warps 4 and 8)."""
    directory = tmp_path / "builtin"
    for card, warps in ((H100, 4), (H200, 8)):
        write_table_file(directory / f"{card.key}.json", card, "norms",
                         dataclasses.replace(DEFAULT, max_warps=warps))  # fmt: skip
    return directory


def test_a_card_key_is_its_name_in_lower_case_with_dashes():
    assert H100.key == "nvidia-h100-80gb-hbm3"
    assert DeviceProperties("NVIDIA H200 NVL", (9, 0), 132).key == "nvidia-h200-nvl"


def test_a_known_card_takes_its_own_builtin_table(tmp_path):
    directory = builtins(tmp_path)
    assert registry().resolve(H100, None, directory).max_warps == 4
    assert registry().resolve(H200, None, directory).max_warps == 8


@pytest.mark.parametrize(
    ("name", "sms", "warps"),
    [("NVIDIA H100 PCIe", 114, 4), ("NVIDIA H100 NVL", 132, 4), ("NVIDIA H200 NVL", 132, 8)],
)
def test_an_unknown_card_of_a_known_capability_takes_the_nearest_family(tmp_path, name, sms, warps):
    card = DeviceProperties(name, (9, 0), sms)
    assert registry().resolve(card, None, builtins(tmp_path)).max_warps == warps


def test_a_card_of_another_capability_and_a_cpu_take_the_default(tmp_path):
    directory = builtins(tmp_path)
    a100 = DeviceProperties("NVIDIA A100-SXM4-80GB", (8, 0), 108)
    assert registry().resolve(a100, None, directory) is DEFAULT
    assert registry().resolve(None, tmp_path, directory) is DEFAULT
    assert registry().launch_table_for(torch.device("cpu")) is DEFAULT


def test_the_users_file_overrides_the_builtin_table_for_its_sections_only(tmp_path):
    directory, user = builtins(tmp_path), tmp_path / "user"
    mine = dataclasses.replace(DEFAULT, max_warps=2, backward_programs=64)
    write_table_file(user / f"{H200.key}.json", H200, "norms", mine)
    assert registry().resolve(H200, user, directory) == mine
    # The H100 has no file of its own there; a section the file lacks is the built-in one.
    assert registry().resolve(H100, user, directory).max_warps == 4
    swiglu = LaunchRegistry("swiglu", DEFAULT)
    write_table_file(user / f"{H100.key}.json", H100, "swiglu", mine)
    assert registry().resolve(H100, user, directory).max_warps == 4
    assert swiglu.resolve(H100, user, directory) == mine


def test_writing_a_section_keeps_the_files_other_sections(tmp_path):
    path = tmp_path / f"{H200.key}.json"
    write_table_file(path, H200, "norms", DEFAULT)
    write_table_file(path, H200, "swiglu", dataclasses.replace(DEFAULT, max_columns=256))
    tables = read_table_file(path)["tables"]
    assert tables["norms"] == table_as_dict(DEFAULT)
    assert tables["swiglu"]["max_columns"] == 256


GOOD = table_as_dict(DEFAULT)
MALFORMED = {
    "a string": ({**GOOD, "max_warps": "8"}, "tables.norms.max_warps"),
    "a missing field": ({k: v for k, v in GOOD.items() if k != "max_warps"},
                        "tables.norms.max_warps"),
    "an unknown field": ({**GOOD, "max_wraps": 8}, "tables.norms"),
    "zero": ({**GOOD, "backward_programs": 0}, "tables.norms.backward_programs"),
    "a bool": ({**GOOD, "max_warps": True}, "tables.norms.max_warps"),
    "None where the field needs an int": ({**GOOD, "max_warps": None}, "tables.norms.max_warps"),
}  # fmt: skip


@pytest.mark.parametrize(("section", "field"), MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_users_file_is_refused_naming_the_field(tmp_path, section, field):
    path = tmp_path / f"{H200.key}.json"
    header = {"device": H200.name, "capability": [9, 0], "multiprocessors": 132}
    path.write_text(json.dumps({**header, "tables": {"norms": section}}))
    with pytest.raises(ValueError, match=rf"{path}: {field}\b"):
        registry().resolve(H200, tmp_path, builtins(tmp_path))


HEADERS = {
    "capability": ({"capability": [9]}, "capability"),
    "multiprocessors": ({"multiprocessors": -1}, "multiprocessors"),
    "an unknown section": ({"tables": {"norm": GOOD}}, "tables"),
    "an unknown key": ({"sms": 132}, "sms"),
}


@pytest.mark.parametrize(("change", "field"), HEADERS.values(), ids=HEADERS.keys())
def test_a_malformed_file_header_is_refused_naming_the_field(tmp_path, change, field):
    path = tmp_path / f"{H200.key}.json"
    header = {"device": H200.name, "capability": [9, 0], "multiprocessors": 132}
    path.write_text(json.dumps({**header, "tables": {"norms": GOOD}, **change}))
    with pytest.raises(ValueError, match=field):
        read_table_file(path)


def test_a_block_that_is_not_a_power_of_2_is_refused_naming_the_nested_field(tmp_path):
    pytest.importorskip("triton")
    from deltalab.ops.delta_rule.triton.launch import LAUNCH

    table = table_as_dict(LAUNCH)
    table["factors"]["block"] = 48
    path = tmp_path / f"{H100.key}.json"
    header = {"device": H100.name, "capability": [9, 0], "multiprocessors": 132}
    path.write_text(json.dumps({**header, "tables": {"delta_rule": table}}))
    with pytest.raises(ValueError, match=r"tables\.delta_rule\.factors\.block: expected a power"):
        LaunchRegistry("delta_rule", LAUNCH).resolve(H100, tmp_path)


def test_every_shipped_file_holds_a_valid_table_of_each_op_for_its_card():
    pytest.importorskip("triton")
    from deltalab.ops.delta_rule.triton import fused_step, launch
    from deltalab.ops.log_decay import triton as log_decay
    from deltalab.ops.norms import triton as norms
    from deltalab.ops.swiglu import triton as swiglu

    files = sorted(BUILTIN_DIRECTORY.glob("*.json"))
    assert {p.stem for p in files} >= {H100.key, H200.key}
    for path in files:
        data = read_table_file(path)
        card = DeviceProperties(data["device"], tuple(data["capability"]),
                                data["multiprocessors"])  # fmt: skip
        assert card.key == path.stem
        for module in (launch, norms, swiglu, log_decay, fused_step):
            tables = module.LAUNCH_TABLES
            shipped = tables.builtin(card)
            # A file without an op's section ships that op's default table for its card.
            expected = data["tables"].get(tables.op, table_as_dict(tables.default))
            assert table_as_dict(shipped) == expected, (path.name, tables.op)


def _calls():
    """Each op's Triton function called with no table on tiny inputs, by its registry's op
    (the read gate launches by the log decay's table)."""
    from deltalab.ops.delta_rule.triton.chunk import delta_rule_triton
    from deltalab.ops.log_decay.triton import log_decay_triton
    from deltalab.ops.norms.triton import l2_normalize_triton, rms_norm_triton
    from deltalab.ops.read_gate.triton import read_query_triton
    from deltalab.ops.swiglu.triton import swiglu_triton

    x, w = torch.randn(2, 3, 8), torch.ones(8)
    q, b, u = (torch.randn(1, 16, 1, 8) for _ in range(3))
    a, g, state = torch.rand(1, 16, 1), -torch.rand(1, 16, 1, 8), torch.zeros(1, 1, 8, 8)

    def norms():
        rms_norm_triton(x, w, 1e-6, None, "silu", None)
        l2_normalize_triton(x, 1e-6)

    def log_decay():
        log_decay_triton(w, x, w)
        read_query_triton(x, w, None)

    def fused_step():
        from benchmarks.tune_decode_step import FORMS, step_inputs
        from deltalab.ops.delta_rule.triton.fused_step import fused_layer_step

        x = step_inputs(FORMS["beta"], 1, 1, 16, "cpu", torch.float32, torch.Generator())
        fused_layer_step(FORMS["beta"], x["qkv"], x["conv_weights"], x["caches"], x["memory"],
                         x["gate"], x["norm_weight"], x["out"], scale=0.25, l2_eps=1e-6,
                         norm_eps=1e-5, gates=x["gates"], params=x["params"])  # fmt: skip

    return {
        "delta_rule": lambda: delta_rule_triton(q, a, b, u, g, state, None, 16, 1.0),
        "fused_step": fused_step,
        "norms": norms,
        "swiglu": lambda: swiglu_triton(x),
        "log_decay": log_decay,
    }


@pytest.mark.interpreter
@pytest.mark.parametrize("op", ["delta_rule", "norms", "swiglu", "log_decay", "fused_step"])
def test_a_call_given_no_table_takes_its_ops_table_for_the_inputs_device(op, monkeypatch):
    pytest.importorskip("triton")
    from deltalab.ops._triton import INTERPRET
    from deltalab.ops.delta_rule.triton import fused_step, launch
    from deltalab.ops.log_decay import triton as log_decay
    from deltalab.ops.norms import triton as norms
    from deltalab.ops.swiglu import triton as swiglu

    if not INTERPRET:
        pytest.skip("runs the kernels on CPU tensors: needs TRITON_INTERPRET=1")
    tables = {m.LAUNCH_TABLES.op: m.LAUNCH_TABLES
              for m in (launch, norms, swiglu, log_decay, fused_step)}  # fmt: skip
    devices = []

    def spy(device):
        devices.append(device)
        return tables[op].default

    monkeypatch.setattr(tables[op], "launch_table_for", spy)
    _calls()[op]()
    calls = {"norms": 2, "log_decay": 2}.get(op, 1)
    assert devices == [torch.device("cpu")] * calls


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [("num_warps", 6, "a power of 2"), ("many_num_warps", 6, "a power of 2"),
     ("block_v", 6, "a power of 2"), ("split_num_warps", 6, "a power of 2"),
     ("splits", 0, "an int > 0"), ("split_programs", "all", "an int > 0")],
)  # fmt: skip
def test_a_fused_step_table_with_a_field_out_of_its_range_is_refused_naming_it(
    tmp_path, field, value, expected
):
    pytest.importorskip("triton")
    from deltalab.ops.delta_rule.triton.fused_step import LAUNCH

    table = table_as_dict(LAUNCH) | {field: value}
    path = tmp_path / f"{H100.key}.json"
    header = {"device": H100.name, "capability": [9, 0], "multiprocessors": 132}
    path.write_text(json.dumps({**header, "tables": {"fused_step": table}}))
    with pytest.raises(ValueError, match=rf"tables\.fused_step\.{field}: expected {expected}"):
        LaunchRegistry("fused_step", LAUNCH).resolve(H100, tmp_path)
