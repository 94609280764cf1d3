"""The run configuration of `deltalab train`: defaults, files, overrides, errors, round trips."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import yaml

from deltalab.errors import ConfigError
from deltalab.train.config import (
    SECTIONS,
    ModelSection,
    OptimSection,
    RunConfig,
    TrainSection,
)
from deltalab.train.config_io import (
    config_changes,
    config_help,
    load_run_config,
    save_run_config,
)

# One out-of-range override per check, with the dotted field its error must name.
INVALID_OVERRIDES = [
    ("model.preset=''", "model.preset"),
    ("model.overrides.mixer=gdn2", "model.mixer"),
    ("data.source=''", "data.source"),
    ("data.max_bytes=0", "data.max_bytes"),
    ("data.held_out_fraction=0", "data.held_out_fraction"),
    ("data.held_out_fraction=1", "data.held_out_fraction"),
    ("optim.lr=0", "optim.lr"),
    ("optim.lr=-1e-3", "optim.lr"),
    ("optim.betas=[0.9,1.0]", "optim.betas"),
    ("optim.betas=[-0.1,0.9]", "optim.betas"),
    ("optim.eps=0", "optim.eps"),
    ("optim.weight_decay=-0.1", "optim.weight_decay"),
    ("optim.grad_clip=-1", "optim.grad_clip"),
    ("schedule.kind=linear", "schedule.kind"),
    ("schedule.warmup_steps=-1", "schedule.warmup_steps"),
    ("schedule.min_lr_ratio=1.5", "schedule.min_lr_ratio"),
    ("schedule.decay_fraction=-0.2", "schedule.decay_fraction"),
    ("train.steps=0", "train.steps"),
    ("train.batch_size=0", "train.batch_size"),
    ("train.seq_len=-4", "train.seq_len"),
    ("train.grad_accum=0", "train.grad_accum"),
    ("train.grad_accum=3", "train.grad_accum"),
    ("train.precision=fp16", "train.precision"),
    ("train.seed=-1", "train.seed"),
    ("train.nan_policy=ignore", "train.nan_policy"),
    ("train.parallel=tp", "train.parallel"),
    ("train.context_parallel=0", "train.context_parallel"),
    ("train.context_parallel=3", "train.context_parallel"),
    ("train.device=tpu", "train.device"),
    ("eval.every=-1", "eval.every"),
    ("eval.batches=0", "eval.batches"),
    ("eval.sample_tokens=-1", "eval.sample_tokens"),
    ("checkpoint.every=-5", "checkpoint.every"),
    ("checkpoint.keep=0", "checkpoint.keep"),
    ("log.out_dir=''", "log.out_dir"),
]

# Values of the wrong type, with the dotted field the error must name.
MISTYPED_OVERRIDES = [
    ("train.steps=abc", "train.steps"),
    ("train.steps=2.5", "train.steps"),
    ("train.steps=true", "train.steps"),
    ("train.compile=maybe", "train.compile"),
    ("train.compile=1", "train.compile"),
    ("optim.lr=fast", "optim.lr"),
    ("optim.lr=.nan", "optim.lr"),
    ("optim.betas=0.9", "optim.betas"),
    ("optim.betas=[0.9]", "optim.betas"),
    ("optim.betas=[0.9,x]", "optim.betas"),
    ("data.max_bytes=lots", "data.max_bytes"),
    ("train.steps=null", "train.steps"),
    ("model.overrides=[1,2]", "model.overrides"),
]


def write(path: Path, data: object) -> Path:
    path.write_text(yaml.safe_dump(data) if path.suffix != ".json" else json.dumps(data))
    return path


def test_defaults_construct_with_the_documented_values() -> None:
    config = RunConfig()
    assert config == load_run_config(None, [])
    assert config.model == ModelSection(preset="tiny", mixer="muir", overrides={})
    assert config.optim.betas == (0.9, 0.95)
    assert config.data.max_bytes == 4194304
    assert config.train.batch_size == 8 and config.train.precision == "auto"
    assert config.eval.sample_prompt == "def "
    assert list(SECTIONS) == [f.name for f in dataclasses.fields(RunConfig)]
    assert all(section.key == name for name, section in SECTIONS.items())


def test_presets_bring_their_learning_rate_and_warmup_unless_the_run_sets_them() -> None:
    from deltalab.models.presets import PRESET_TRAINING, PRESETS

    assert set(PRESET_TRAINING) == set(PRESETS)
    tiny = RunConfig()
    assert (tiny.optim.lr, tiny.schedule.warmup_steps) == (3e-3, 20)
    big = load_run_config(None, ["model.preset=340M"])
    assert (big.optim.lr, big.schedule.warmup_steps) == (1e-3, 1000)
    assert load_run_config(None, ["model.preset=1.3B"]).optim.lr == 4e-4
    # Larger models never get a larger learning rate.
    rates = [PRESET_TRAINING[name].lr for name in PRESETS]
    assert rates == sorted(rates, reverse=True)
    chosen = load_run_config(None, ["model.preset=340M", "optim.lr=2e-3"])
    assert (chosen.optim.lr, chosen.schedule.warmup_steps) == (2e-3, 1000)
    # What a run saves is resolved, so a resume compares numbers, not nulls.
    assert RunConfig.from_dict(big.to_dict()) == big
    assert big.to_dict()["optim"]["lr"] == 1e-3


def test_presets_command_and_help_show_the_preset_learning_rates(capsys) -> None:
    from deltalab.cli import main

    assert main(["presets", "--mixer", "muir"]) == 0
    out = capsys.readouterr().out
    header, _, *rows = out.splitlines()
    assert header.split()[-2:] == ["lr", "warmup"]
    assert rows[2].split()[0] == "340M" and rows[2].split()[-2:] == ["0.001", "1000"]
    assert "340M 0.001" in config_help() and "1.3B 1000" in config_help()


def test_sections_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        RunConfig().train.steps = 3  # type: ignore[misc]


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_file_then_overrides_the_override_wins(tmp_path: Path, suffix: str) -> None:
    path = write(
        tmp_path / f"run{suffix}",
        {"train": {"steps": 50, "seq_len": 64}, "optim": {"lr": 1e-3}, "log": None},
    )
    config = load_run_config(path, ["train.steps=10", "train.steps=12", "schedule.kind=wsd"])
    assert config.train.steps == 12
    assert config.train.seq_len == 64
    assert config.optim.lr == 1e-3
    assert config.schedule.kind == "wsd"
    assert config.log == RunConfig().log


def test_empty_file_gives_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_run_config(path, []) == RunConfig()


def test_nested_overrides_merge_into_model_overrides(tmp_path: Path) -> None:
    path = write(
        tmp_path / "run.yaml",
        {"model": {"overrides": {"num_layers": 4, "mixer_options": {"read_gate": False}}}},
    )
    config = load_run_config(
        path,
        [
            "model.overrides.num_layers=2",
            "model.overrides.mixer_options.rank=8",
            "model.overrides.attention_layers=[1]",
        ],
    )
    assert config.model.overrides == {
        "num_layers": 2,
        "mixer_options": {"read_gate": False, "rank": 8},
        "attention_layers": [1],
    }


def test_override_values_are_read_as_yaml_and_coerced() -> None:
    config = load_run_config(
        None,
        [
            "optim.betas=[0.9,0.99]",
            "data.max_bytes=null",
            "optim.lr=1e-3",  # YAML 1.1 reads this as a string
            "optim.grad_clip=2",  # an int where a float is expected
            "train.compile=true",
            "data.source=2024",  # a string field keeps the text YAML read as an int
            "eval.sample_prompt='class '",
            "data.source=a=b",  # only the first '=' separates
        ],
    )
    assert config.optim.betas == (0.9, 0.99) and isinstance(config.optim.betas, tuple)
    assert config.data.max_bytes is None
    assert config.optim.lr == 1e-3
    assert config.optim.grad_clip == 2.0 and isinstance(config.optim.grad_clip, float)
    assert config.train.compile is True
    assert config.data.source == "a=b"
    assert config.eval.sample_prompt == "class "
    assert load_run_config(None, ["data.source=2024"]).data.source == "2024"


@pytest.mark.parametrize(("override", "field"), MISTYPED_OVERRIDES)
def test_mistyped_value_is_refused_naming_the_field(override: str, field: str) -> None:
    with pytest.raises(TypeError, match=rf"^{field}(\[\d+\])? must be"):
        load_run_config(None, [override])


@pytest.mark.parametrize(("override", "field"), INVALID_OVERRIDES)
def test_invalid_value_is_refused_naming_the_field(override: str, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        load_run_config(None, [override])


def test_cuda_graphs_and_compile_together_are_refused_naming_both() -> None:
    with pytest.raises(ValueError, match=r"train\.cuda_graphs=true and train\.compile=true"):
        load_run_config(None, ["train.cuda_graphs=true", "train.compile=true"])
    assert load_run_config(None, ["train.cuda_graphs=true"]).train.cuda_graphs is True


def test_context_parallel_and_compile_together_are_refused_naming_both() -> None:
    with pytest.raises(ValueError, match=r"train\.context_parallel=2 and train\.compile=true"):
        load_run_config(None, ["train.context_parallel=2", "train.compile=true"])
    assert load_run_config(None, ["train.context_parallel=2"]).train.context_parallel == 2


def test_cuda_graphs_default_to_null_which_leaves_compiled_runs_alone() -> None:
    """null ("wherever it can run") is the default, and with compile it is not refused: the
    trainer then simply steps eagerly (tests/test_train.py)."""
    assert load_run_config(None, []).train.cuda_graphs is None
    config = load_run_config(None, ["train.compile=true"])
    assert config.train.cuda_graphs is None
    assert load_run_config(None, ["train.cuda_graphs=false"]).train.cuda_graphs is False


def test_sections_validate_when_built_directly() -> None:
    with pytest.raises(ValueError, match=r"train\.batch_size must be > 0, got 0"):
        TrainSection(batch_size=0)
    with pytest.raises(TypeError, match=r"optim\.lr must be a finite number"):
        OptimSection(lr="fast")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"model\.overrides\.x must hold YAML data"):
        ModelSection(overrides={"x": object()})
    with pytest.raises(TypeError, match="train must be a TrainSection"):
        RunConfig(train={"steps": 3})  # type: ignore[arg-type]
    assert OptimSection(betas=[0.8, 0.9]).betas == (0.8, 0.9)  # type: ignore[arg-type]


def test_batch_size_must_divide_by_grad_accum() -> None:
    assert TrainSection(batch_size=8, grad_accum=4).grad_accum == 4
    with pytest.raises(ValueError, match=r"train\.batch_size \(8\).*train\.grad_accum \(3\)"):
        TrainSection(batch_size=8, grad_accum=3)


def test_micro_batch_splits_the_batch_over_ranks_and_accumulation_or_says_why_not() -> None:
    section = TrainSection(batch_size=12, grad_accum=2)
    assert section.micro_batch(world_size=1) == 6 and section.micro_batch(world_size=3) == 2
    with pytest.raises(ValueError, match=r"batch_size \(12\).*over 4 rank\(s\).*grad_accum \(2\)"):
        section.micro_batch(world_size=4)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.step=10", "unknown config field 'train.step' (did you mean 'train.steps'?)"),
        ("optim.betas1=0.9", "'optim.betas1' (did you mean 'optim.betas'?)"),
        ("trian.steps=10", "unknown config section 'trian' (did you mean 'train'?)"),
        ("eval.sample_promt=x", "(did you mean 'eval.sample_prompt'?)"),
    ],
)
def test_unknown_override_names_the_closest_field(override: str, message: str) -> None:
    with pytest.raises(ValueError) as error:
        load_run_config(None, [override])
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"train": {"step": 10}},
            "unknown config field 'train.step' (did you mean 'train.steps'?)",
        ),
        (
            {"schedul": {"kind": "wsd"}},
            "unknown config section 'schedul' (did you mean 'schedule'?)",
        ),
    ],
)
def test_unknown_file_entry_names_the_file_and_closest_field(
    tmp_path: Path, data: dict[str, object], message: str
) -> None:
    path = write(tmp_path / "run.yaml", data)
    with pytest.raises(ValueError) as error:
        load_run_config(path, [])
    assert message in str(error.value) and str(path) in str(error.value)


@pytest.mark.parametrize(("name", "text"), [("run.yaml", "train: [steps"), ("run.json", "{")])
def test_unreadable_file_is_refused_naming_it(tmp_path: Path, name: str, text: str) -> None:
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=name):
        load_run_config(tmp_path / name, [])


def test_file_that_is_not_a_mapping_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("- train\n- steps\n")
    with pytest.raises(TypeError, match="mapping by section"):
        load_run_config(path, [])
    path.write_text("train: 10\n")
    with pytest.raises(TypeError, match="train must be a mapping"):
        load_run_config(path, [])


@pytest.mark.parametrize(
    "override", ["train.steps", "train=10", "steps=10", "=10", "train.=3", ".steps=3"]
)
def test_malformed_override_is_refused(override: str) -> None:
    with pytest.raises(ValueError, match=r"section\.field=value|unknown config"):
        load_run_config(None, [override])


def test_override_below_a_non_mapping_is_refused() -> None:
    with pytest.raises(ValueError, match=r"train\.steps is not a mapping"):
        load_run_config(None, ["train.steps.x=1"])
    with pytest.raises(ValueError, match=r"model\.overrides\.num_layers is 2, not a mapping"):
        load_run_config(None, ["model.overrides.num_layers=2", "model.overrides.num_layers.x=1"])


def custom_config() -> RunConfig:
    return load_run_config(
        None,
        [
            "model.preset=340M",
            "model.overrides={num_layers: 2, mixer_options: {read_gate: true}}",
            "data.max_bytes=null",
            "optim.betas=[0.8,0.99]",
            "optim.eps=1e-6",
            "schedule.kind=wsd",
            "train.grad_accum=2",
            "eval.sample_prompt='Grüße '",
            "checkpoint.resume=true",
        ],
    )


def test_to_dict_from_dict_round_trip() -> None:
    config = custom_config()
    data = config.to_dict()
    assert data["optim"]["betas"] == [0.8, 0.99]
    assert json.loads(json.dumps(data)) == data
    assert RunConfig.from_dict(data) == config
    assert RunConfig.from_dict({}) == RunConfig()


@pytest.mark.parametrize("name", ["config.yaml", "config.json"])
def test_save_then_load_round_trip(tmp_path: Path, name: str) -> None:
    config = custom_config()
    path = save_run_config(config, tmp_path / "run" / name)
    assert load_run_config(path, []) == config
    assert [p.name for p in path.parent.iterdir()] == [name]  # no temporary file left
    save_run_config(RunConfig(), path)
    assert load_run_config(path, []) == RunConfig()


def test_saved_yaml_is_plain_yaml(tmp_path: Path) -> None:
    path = save_run_config(custom_config(), tmp_path / "config.yaml")
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert list(data) == list(SECTIONS)
    assert data["model"]["overrides"]["mixer_options"] == {"read_gate": True}


def test_config_help_lists_every_field_with_type_default_and_description() -> None:
    text = config_help()
    for name, section in SECTIONS.items():
        assert f"\n{name}: " in text
        for f in dataclasses.fields(section):
            line = next(
                (ln for ln in text.splitlines() if ln.strip().startswith(f"{name}.{f.name} (")),
                None,
            )
            assert line is not None, f"{name}.{f.name} is missing from config_help()"
            assert f"({f.type}, default " in line
            description = line.partition("): ")[2]
            assert description.strip(), f"{name}.{f.name} has no description in its docstring"
    assert "train.batch_size (int, default 8): " in text
    assert "data.max_bytes (int | None, default 4194304): " in text
    assert 'eval.sample_prompt (str, default "def "): ' in text


def test_string_overrides_keep_the_text_as_written_and_null_clears_a_mapping():
    from deltalab.train.config_io import load_run_config

    config = load_run_config(
        None, ["log.out_dir=runs/exp #2", "data.source=2024", "model.overrides=null"]
    )
    assert config.log.out_dir == "runs/exp #2"
    assert config.data.source == "2024"
    assert config.model.overrides == {}
    assert load_run_config(None, ["eval.sample_prompt='class '"]).eval.sample_prompt == "class "


def test_lr_schedules_end_at_the_floor_on_the_last_step():
    from types import SimpleNamespace

    from deltalab.train.optim import lr_multiplier

    def schedule(kind, warmup, fraction=0.2):
        return SimpleNamespace(
            kind=kind, warmup_steps=warmup, min_lr_ratio=0.1, decay_fraction=fraction
        )

    for kind in ("cosine", "wsd"):
        for warmup in (0, 3, 9):
            f = lr_multiplier(schedule(kind, warmup), 10)
            assert abs(f(9) - 0.1) < 1e-12, (kind, warmup)
    wsd = lr_multiplier(schedule("wsd", 0, fraction=0.1), 10)
    assert [wsd(s) for s in range(9)] == [1.0] * 9
    warm = lr_multiplier(schedule("constant", 4), 10)
    assert [warm(s) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]


def test_cli_takes_overrides_before_and_after_options(tmp_path, monkeypatch):
    import deltalab.cli as cli

    seen = {}
    monkeypatch.setattr(cli, "_train", lambda args: seen.update(vars(args)) or 0)
    cli.main(["train", "train.steps=5", "--resume", "log.out_dir=x"])
    assert seen["overrides"] == ["train.steps=5", "log.out_dir=x"] and seen["resume"]


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["train.steps=5", "log.out_dir=runs/a b"],
        ["model.preset=340M", "model.overrides={num_layers: 2}", "optim.betas=[0.8, 0.9]"],
        ["model.preset=340M", "optim.lr=2e-3", "data.max_bytes=null", "eval.sample_prompt=''"],
    ],
)
def test_config_changes_rebuild_the_config_from_the_defaults(overrides) -> None:
    config = load_run_config(None, overrides)
    changes = config_changes(config)
    assert load_run_config(None, changes) == config
    # Only what differs: each change alone moves the defaults.
    assert all(load_run_config(None, [change]) != RunConfig() for change in changes)


def test_config_changes_leave_out_the_values_a_preset_brings() -> None:
    assert config_changes(RunConfig()) == []
    # optim.lr and schedule.warmup_steps follow the preset unless set.
    assert config_changes(load_run_config(None, ["model.preset=340M"])) == ["model.preset=340M"]


def test_tensorboard_logging_is_off_unless_asked_and_refused_where_not_installed(
    monkeypatch,
) -> None:
    assert RunConfig().log.tensorboard is False
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"log\.tensorboard must be false where tensorboard"):
        load_run_config(None, ["log.tensorboard=true"])


def test_a_config_saved_before_a_field_existed_counts_it_at_its_default():
    from deltalab.train.config import RunConfig, resume_changes

    current = RunConfig().to_dict()
    saved = {section: dict(fields) for section, fields in current.items()}
    del saved["train"]["seed"]  # as if the field had been added after the run was saved
    assert resume_changes(saved, current) == []
    current["train"]["seed"] = 5
    assert resume_changes(saved, current) == ["train.seed: 0 -> 5"]
