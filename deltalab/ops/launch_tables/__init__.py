"""Launch tables chosen by the device: each Triton op's block sizes, warps and thresholds per card.

Each op with a launch table (the delta rule, the norms, SwiGLU, the log decay and the read gate,
which launches by the log decay's, and the decoder's fused layer step) keeps its default table
in its kernel module and a `LaunchRegistry` beside it; its public Triton function takes the
registry's table for the input's device when no `table=` is given
(`LaunchRegistry.launch_table_for`: the first call on a device resolves it, later calls are one
dict lookup, and nothing reads back from the device).

A table file is JSON, one per card, named by the card's key (`DeviceProperties.key`, the CUDA
device name in lower case with runs of other characters as "-": "nvidia-h200"):

    {"device": "NVIDIA H200", "capability": [9, 0], "multiprocessors": 132,
     "tables": {"delta_rule": {...}, "norms": {...}, "swiglu": {...}, "log_decay": {...},
                "fused_step": {...}}}

Each section holds every field of its op's table (nested tables as objects); a file may leave
out whole sections. The tables of a CUDA device, in order:

1. the user's file `<key>.json` in `user_table_directory()` (`$DELTALAB_LAUNCH_DIR`, default
   `~/.cache/deltalab/launch`), which `python -m benchmarks tune` writes, where it has the op's
   section;
2. the built-in file of that key (this directory: the cards the defaults were measured on);
3. the built-in file of the nearest known family: the same compute capability, then the
   longest common key prefix ("nvidia-h100-pcie" takes "nvidia-h100-80gb-hbm3"), then the
   nearest multiprocessor count;
4. the op's default table (a card of another compute capability: its shared memory and
   registers differ, and a table tuned for sm_90 may not compile there).

CPU tensors (Triton's interpreter) take the default tables: launch parameters change no result
that matters there, and the tests' paths stay the ones they were written for.

Why JSON and not Python: the tuner writes the same format the package ships, so a measured
table is shipped by copying the file, and one reader validates both. Every field is checked
(present, of its type, positive, a power of 2 where it is a block), and an error names the file
and the field (`tables.delta_rule.factors.block`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch

__all__ = [
    "BUILTIN_DIRECTORY",
    "OPS",
    "DeviceProperties",
    "LaunchRegistry",
    "device_properties",
    "read_table_file",
    "table_as_dict",
    "table_from_dict",
    "user_table_directory",
    "write_table_file",
]

# The sections a table file may hold: one per op with a registry.
OPS = ("delta_rule", "norms", "swiglu", "log_decay", "fused_step")
BUILTIN_DIRECTORY = Path(__file__).resolve().parent
ENV_DIRECTORY = "DELTALAB_LAUNCH_DIR"

Table = TypeVar("Table")


@dataclass(frozen=True)
class DeviceProperties:
    """What a lookup knows of a card: its CUDA name, compute capability and multiprocessors."""

    name: str
    capability: tuple[int, int]
    multiprocessors: int

    @property
    def key(self) -> str:
        """The card's table file name without .json: the name in lower case, each run of other
        characters than letters and digits one "-" ("NVIDIA H100 80GB HBM3":
        "nvidia-h100-80gb-hbm3")."""
        return re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-")


def device_properties(device: torch.device) -> DeviceProperties | None:
    """The properties of a CUDA device (no device work), None for any other device."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return DeviceProperties(props.name, (props.major, props.minor), props.multi_processor_count)


def user_table_directory() -> Path:
    """Where the user's table files are read (and the tuner writes): `$DELTALAB_LAUNCH_DIR`,
    else `$XDG_CACHE_HOME/deltalab/launch`, else `~/.cache/deltalab/launch`."""
    if os.environ.get(ENV_DIRECTORY):
        return Path(os.environ[ENV_DIRECTORY]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "deltalab" / "launch"


def _require(condition: bool, where: str, expected: str, value: Any) -> None:
    if not condition:
        raise ValueError(f"{where}: expected {expected}, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def table_from_dict(default: Table, data: Any, where: str) -> Table:
    """A table of `default`'s type from a JSON object, every field checked: present, no other
    keys, an int > 0 (a power of 2 where the field is a block or a number of warps; None where
    the type allows it),
    nested tables in turn. Errors are ValueErrors naming `where`.field."""
    cls = type(default)
    _require(isinstance(data, dict), where, "an object of the table's fields", data)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    _require(not unknown, where, f"only the fields {names}", unknown)
    hints = typing.get_type_hints(cls)
    values = {}
    for name in names:
        field = f"{where}.{name}"
        _require(name in data, field, "a value (the field is missing)", None)
        value, inner = data[name], getattr(default, name)
        if dataclasses.is_dataclass(inner):
            values[name] = table_from_dict(inner, value, field)
            continue
        if value is None:
            _require(type(None) in typing.get_args(hints[name]), field, "an int", value)
        else:
            _require(_is_int(value) and value > 0, field, "an int > 0", value)
            power = value & (value - 1) == 0
            counted = "block" in name or "warps" in name  # Triton takes powers of 2 only
            _require(not counted or power, field, "a power of 2", value)
        values[name] = value
    return cls(**values)


def table_as_dict(table: Any) -> dict:
    """The JSON object of a table (nested tables as objects)."""
    return dataclasses.asdict(table)


def read_table_file(path: Path) -> dict:
    """A table file's contents, its header checked (sections are checked by their registries):
    {"device", "capability", "multiprocessors", "tables"}. Errors name the file and the field."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not JSON ({error})") from None
    where = str(path)
    _require(isinstance(data, dict), where, "an object", type(data).__name__)
    _require(
        isinstance(data.get("device"), str), f"{where}: device", "a string", data.get("device")
    )
    cap = data.get("capability")
    pair = isinstance(cap, list) and len(cap) == 2 and all(_is_int(c) for c in cap)
    _require(pair, f"{where}: capability", "[major, minor]", cap)
    count = data.get("multiprocessors")
    _require(_is_int(count) and count > 0, f"{where}: multiprocessors", "an int > 0", count)
    tables = data.get("tables")
    _require(isinstance(tables, dict), f"{where}: tables", "an object", tables)
    unknown = sorted(set(tables) - set(OPS))
    _require(not unknown, f"{where}: tables", f"only the sections {list(OPS)}", unknown)
    known = set(data) - {"device", "capability", "multiprocessors", "tables"}
    _require(not known, where, "only device, capability, multiprocessors, tables", sorted(known))
    return data


def write_table_file(path: Path, properties: DeviceProperties, op: str, table: Any) -> None:
    """Writes `table` as op's section of the table file at `path`, keeping its other sections."""
    path = Path(path)
    tables = read_table_file(path)["tables"] if path.exists() else {}
    data = {"device": properties.name, "capability": list(properties.capability),
            "multiprocessors": properties.multiprocessors,
            "tables": {**tables, op: table_as_dict(table)}}  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def _table_files(directory: Path) -> dict[str, dict]:
    """The table files of `directory` by key."""
    return {p.stem: read_table_file(p) for p in sorted(Path(directory).glob("*.json"))}


def _common_prefix(a: str, b: str) -> int:
    """The number of leading characters a and b share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))  # fmt: skip


def nearest_builtin(properties: DeviceProperties, builtins: dict[str, dict]) -> str | None:
    """The key of the built-in file for `properties`: its own, else the nearest of the same
    compute capability (longest common key prefix, then nearest multiprocessor count), else
    None."""
    if properties.key in builtins:
        return properties.key
    family = [k for k, d in builtins.items() if tuple(d["capability"]) == properties.capability]
    if not family:
        return None
    return min(family, key=lambda k: (-_common_prefix(k, properties.key),
                                      abs(builtins[k]["multiprocessors"]
                                          - properties.multiprocessors), k))  # fmt: skip


class LaunchRegistry(Generic[Table]):
    """One op's launch tables by device (module docstring: the order of the lookup)."""

    def __init__(self, op: str, default: Table) -> None:
        if op not in OPS:
            raise ValueError(f"op: expected one of {list(OPS)}, got {op!r}")
        self.op, self.default = op, default
        self._by_device: dict[torch.device, Table] = {}

    def _section(self, data: dict, where: str) -> Table | None:
        section = data["tables"].get(self.op)
        if section is None:
            return None
        return table_from_dict(self.default, section, f"{where}: tables.{self.op}")

    def builtin(self, properties: DeviceProperties | None,
                builtin_directory: Path = BUILTIN_DIRECTORY) -> Table:  # fmt: skip
        """The table the package ships for `properties` (None: a CPU, the default table), from
        the files of `builtin_directory` (tests pass their own)."""
        builtins = _table_files(builtin_directory) if properties is not None else {}
        key = None if properties is None else nearest_builtin(properties, builtins)
        table = None if key is None else self._section(builtins[key], f"{key}.json")
        return self.default if table is None else table

    def resolve(self, properties: DeviceProperties | None, directory: Path | None,
                builtin_directory: Path = BUILTIN_DIRECTORY) -> Table:  # fmt: skip
        """The table for `properties`: the user's file in `directory` (None: none read), else
        the built-in one (`builtin`)."""
        if properties is not None and directory is not None:
            path = Path(directory) / f"{properties.key}.json"
            if path.exists():
                table = self._section(read_table_file(path), str(path))
                if table is not None:
                    return table
        return self.builtin(properties, builtin_directory)

    def launch_table_for(self, device: torch.device) -> Table:
        """The table for tensors on `device`, resolved on the first call for it (reading
        `user_table_directory()` then), a dict lookup afterwards."""
        table = self._by_device.get(device)
        if table is None:
            table = self.resolve(device_properties(device), user_table_directory())
            self._by_device[device] = table
        return table
