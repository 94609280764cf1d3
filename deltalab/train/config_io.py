"""A run config's outside forms: a file and dotted overrides in (`load_run_config`), a file out
(`save_run_config`), the fields that differ from the defaults as overrides (`config_changes`)
and the `deltalab train --help` text (`config_help`).

    config = load_run_config("run.yaml", ["train.steps=10", "model.overrides.num_layers=2"])
    save_run_config(config, "runs/default/config.yaml")

A file (YAML or JSON) is a mapping by section, e.g. `{"train": {"steps": 10}}`; an override is
`section.field=value` with the value read as YAML (`optim.betas=[0.9,0.99]`,
`data.max_bytes=null`), or deeper under a mapping field (`model.overrides.mixer_options.x=1`).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from deltalab._files import write_text_atomically
from deltalab.catalog import PRESET_TRAINING
from deltalab.config_parse import field_docs, plain, read_value, type_hints
from deltalab.errors import ConfigError, ConfigTypeError, UserError
from deltalab.train.config import SECTIONS, ModelSection, RunConfig, checked_sections, section_class

__all__ = ["config_changes", "config_help", "load_run_config", "save_run_config"]


def _apply_override(tree: dict[str, dict[str, Any]], override: str) -> None:
    """Set `section.field[.key...]=value` in `tree`, the value read as YAML."""
    key, equals, text = override.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not equals or len(parts) < 2 or not all(parts):
        raise ValueError(f"override {override!r} must be section.field=value, e.g. train.steps=10")
    section = section_class(parts[0])
    section.check_names({parts[1]: None})
    hint = type_hints(section)[parts[1]]
    if len(parts) > 2 and typing.get_origin(hint) is not dict:
        raise ValueError(f"cannot set {key!r}: {section.dotted(parts[1])} is not a mapping")
    value = read_value(key, text, hint)
    if typing.get_origin(hint) is dict and len(parts) == 2 and value is None:
        value = {}
    node = tree.setdefault(parts[0], {})
    for depth in range(1, len(parts) - 1):
        child = node.get(parts[depth])
        node[parts[depth]] = child = {} if child is None else child
        if not isinstance(child, dict):
            raise ValueError(
                f"cannot set {key!r}: {'.'.join(parts[: depth + 1])} is {child!r}, not a mapping"
            )
        node = child
    node[parts[-1]] = value


def load_run_config(path: str | os.PathLike[str] | None, overrides: Sequence[str]) -> RunConfig:
    """The config of an optional YAML or JSON file (`.json` is read as JSON), then `overrides`
    (`section.field=value`, later ones win).

    Raises `ConfigError` (a ValueError) or `ConfigTypeError` (a TypeError) naming the file or the
    dotted field: a missing or unreadable file, text that is not UTF-8 (with its line), an
    unknown section or field (with the closest valid name), a malformed override, a value of the
    wrong type or out of range.
    """
    try:
        tree: dict[str, dict[str, Any]] = {} if path is None else _read_config_file(Path(path))
        for override in overrides:
            _apply_override(tree, override)
        return RunConfig.from_dict(tree)
    except UserError:
        raise
    except TypeError as error:
        raise ConfigTypeError(str(error)) from error
    except ValueError as error:
        raise ConfigError(str(error)) from error


def _read_config_file(path: Path) -> dict[str, dict[str, Any]]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except OSError as error:
        raise ConfigError(f"cannot read config file {str(path)!r}: {error.strerror}") from error
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        raise ConfigError(
            f"{path}:{line} is not valid UTF-8 (byte {raw[error.start]:#04x} at offset "
            f"{error.start}); save the config file as UTF-8"
        ) from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        return checked_sections({} if data is None else data)
    except TypeError as error:
        raise ConfigTypeError(f"{path}: {error}") from error
    except (ValueError, yaml.YAMLError) as error:
        raise ConfigError(f"{path}: {error}") from error


def save_run_config(config: RunConfig, path: str | os.PathLike[str]) -> Path:
    """Write `config` as YAML (JSON for a `.json` path) atomically: a temporary file, then
    `os.replace`, so a reader never sees half a file. Returns the path."""
    path = Path(path)
    data = config.to_dict()
    if path.suffix == ".json":
        text = json.dumps(data, indent=2) + "\n"
    else:
        text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, text)
    return path


def config_changes(config: RunConfig) -> list[str]:
    """The fields of `config` that differ from the defaults, as `section.field=value` overrides
    (values in YAML) that rebuild it from them; optim.lr and schedule.warmup_steps are compared
    with its preset's values (`PRESET_TRAINING`), which they default to."""
    defaults = RunConfig.from_dict({"model": {"preset": config.model.preset}}).to_dict()
    defaults["model"]["preset"] = ModelSection().preset
    changes = []
    for name, fields in config.to_dict().items():
        for key, value in fields.items():
            if value != defaults[name][key]:
                text = yaml.safe_dump(value, default_flow_style=True, width=math.inf)
                # A scalar's document ends with "...".
                changes.append(f"{name}.{key}=" + text.removesuffix("...\n").strip())
    return changes


# Fields whose null default means the preset's value (`PRESET_TRAINING`).
PRESET_FIELDS = ("optim.lr", "schedule.warmup_steps")


def config_help() -> str:
    """Every field as `section.field (type, default X): description`, grouped by section."""
    lines = [
        "run configuration: a YAML/JSON file by section, then section.field=value overrides"
        " (values in YAML):"
    ]
    for name, section in SECTIONS.items():
        summary = inspect.cleandoc(section.__doc__ or "").partition("\n")[0]
        lines.append(f"\n{name}: {summary}")
        defaults, docs = section(), field_docs(section)
        for f in dataclasses.fields(section):
            default = json.dumps(plain(f.name, getattr(defaults, f.name)))
            doc = docs.get(f.name, "")
            if f"{name}.{f.name}" in PRESET_FIELDS:
                values = ", ".join(
                    f"{preset} {getattr(training, f.name):g}"
                    for preset, training in PRESET_TRAINING.items()
                )
                doc += f" Preset values: {values}."
            lines.append(f"  {name}.{f.name} ({f.type}, default {default}): {doc}")
    return "\n".join(lines)
