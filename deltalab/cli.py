"""The `deltalab` command: train, export, check, presets, generate, eval, study, tokenizer.

Exit status: 0 done; 2 a user error (a config, data, checkpoint or argument problem), printed as
one line on stderr; 128 + the signal number (130 SIGINT, 143 SIGTERM) for a training run stopped
by a signal, whose outputs are marked `"status": "interrupted"`; 1 for a study some of whose runs
failed (each recorded in its report). Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

USER_ERROR = 2
# The --device of the commands that load a checkpoint (`deltalab.generate.require_device`).
DEVICE_HELP = (
    "auto (default: the first CUDA GPU where torch finds one, else the CPU), cpu, cuda, cuda:N "
    "or mps"
)
# Their --dtype (`deltalab.generate.require_dtype`).
DTYPE_HELP = (
    "the dtype the model's weights are cast to: auto (default: bfloat16 on a CUDA GPU that "
    "computes it, else float32), float32 or bfloat16"
)
T = TypeVar("T")


@contextlib.contextmanager
def _transformers_bars_off() -> Iterator[None]:
    """While open, transformers' progress bars ("Loading weights", "Writing model shards") are
    off: a command's output is its own lines and bar. On exit the switch is as it was found, so
    a program that runs a command in-process keeps its bars; the library functions leave it
    alone."""
    from huggingface_hub import utils as hub
    from transformers.utils import logging

    if not logging.is_progress_bar_enabled():
        yield
        return
    # transformers' switch turns the hub's bars off and on with its own.
    hub_off = hub.are_progress_bars_disabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.enable_progress_bar()
        if hub_off:
            hub.disable_progress_bars()


def _train(args: argparse.Namespace) -> int:
    from deltalab.train import load_run_config

    overrides = list(args.overrides) + (["checkpoint.resume=true"] if args.resume else [])
    config = load_run_config(args.config, overrides)
    from deltalab.train import train  # torch: after the config is checked

    with _transformers_bars_off():
        result = train(config)
    change = f"{result.initial_perplexity:.3f} -> {result.final_perplexity:.3f}"
    if result.interrupted:
        print(
            f"interrupted after step {result.last_step} of {config.train.steps}: held-out "
            f"perplexity {change}; outputs in {result.out_dir} are marked interrupted; continue "
            "with --resume",
            file=sys.stderr,
        )
        return 128 + (result.stop_signal or 15)
    print(f"held-out perplexity {change}; outputs in {result.out_dir}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from deltalab.train.export import export_checkpoint

    with _transformers_bars_off():
        source = export_checkpoint(args.checkpoint, args.out)
    print(f"exported {source} to {args.out}")
    return 0


def _check(args: argparse.Namespace) -> int:
    from deltalab.check import CheckConfig
    from deltalab.check import main as check_main

    return check_main(CheckConfig(seed=args.seed))


def _presets(args: argparse.Namespace) -> int:
    from deltalab.catalog import MIXER_KINDS, stored_preset_table
    from deltalab.tables import format_table

    mixers = tuple(args.mixer) if args.mixer else MIXER_KINDS
    headers = [
        "preset",
        "mixer",
        "width",
        "layers",
        "heads",
        "ffn",
        "non-embedding",
        "total",
        "lr",
        "warmup",
    ]
    rows = [
        [*row[:6], f"{row[6] / 1e6:.2f}M", f"{row[7] / 1e6:.2f}M", f"{row[8]:g}", row[9]]
        for row in stored_preset_table(mixers)
    ]
    print(format_table(headers, rows))
    print(
        "lr and warmup: the preset's optim.lr and schedule.warmup_steps, used unless the run "
        "config sets them"
    )
    return 0


def _generate(args: argparse.Namespace) -> int:
    import dataclasses
    import warnings

    from deltalab.generate import (
        GenerateConfig,
        generate_text,
        printable,
        require_device,
        require_dtype,
    )

    # Errors that name the options, not the config's fields.
    require_dtype(args.dtype, require_device(args.device, "--device"), "--dtype")
    # The command's arguments are the config's fields, by the same names.
    fields = dataclasses.fields(GenerateConfig)
    config = GenerateConfig(**{field.name: getattr(args, field.name) for field in fields})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        text = generate_text(config)
    for warning in caught:
        print(f"deltalab generate: warning: {warning.message}", file=sys.stderr)
    print(printable(args.prompt + text))
    return 0


def argument_type(parse: Callable[[str], T], valid: Callable[[T], bool], name: str):
    """An argparse type: `parse(text)`, refused unless `valid` holds for the value. argparse
    turns the ValueError into a usage error that names the argument and `name`."""

    def convert(text: str) -> T:
        value = parse(text)
        if not valid(value):
            raise ValueError(text)
        return value

    convert.__name__ = name
    return convert


def add_command(commands: Any, name: str, summary: str, description: str | None, **kwargs: Any):
    """A subcommand's parser: `summary` in the command list, `description` (a module docstring,
    its line breaks kept) atop its --help."""
    return commands.add_parser(
        name,
        help=summary,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        **kwargs,
    )


positive_int = argument_type(int, lambda value: value > 0, "positive int")
_non_negative_float = argument_type(
    float, lambda value: value >= 0 and value != float("inf"), "finite number >= 0"
)


def main(argv: list[str] | None = None) -> int:
    """Runs the command of `argv`; returns its exit status (see the module docstring)."""
    from deltalab.errors import UserError, one_line

    try:
        return _main(argv)
    except UserError as error:
        print(f"deltalab: error: {one_line(error)}", file=sys.stderr)
        return USER_ERROR


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(
        prog="deltalab", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    commands = parser.add_subparsers(dest="command", required=True)

    from deltalab.train.config_io import config_help

    train = add_command(
        commands,
        "train",
        "train a language model (default: a tiny Muir on the Python standard library)",
        "Train a language model. Fields are set by a YAML/JSON file and dotted overrides "
        "(section.field=value, values in YAML syntax), later ones winning.",
        epilog="fields:\n" + config_help(),
    )
    train.add_argument("--config", default=None, help="a YAML or JSON run config")
    train.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100")
    train.set_defaults(run=_train)

    export = commands.add_parser(
        "export",
        help="write a training checkpoint as a Hugging Face model directory",
        description="Write the model of a training checkpoint (a single file or a sharded "
        "directory) as a Hugging Face directory: weights, config and the run's tokenizer.",
    )
    export.add_argument(
        "checkpoint",
        metavar="CKPT",
        help="a run directory (its newest complete checkpoint) or one checkpoint",
    )
    export.add_argument("out", metavar="OUT", help="the directory to write (new or empty)")
    export.set_defaults(run=_export)

    check = commands.add_parser(
        "check", help="run the delta-rule backends against each other and print errors and timings"
    )
    check.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    check.set_defaults(run=_check)

    presets = commands.add_parser(
        "presets", help="print every model preset with its parameter count"
    )
    from deltalab.catalog import MIXER_KINDS

    presets.add_argument(
        "--mixer", action="append", choices=MIXER_KINDS, help="only this mixer kind (repeatable)"
    )
    presets.set_defaults(run=_presets)

    generate = commands.add_parser("generate", help="continue a prompt with a saved checkpoint")
    generate.add_argument("checkpoint", help="a save_pretrained directory")
    generate.add_argument("prompt")
    generate.add_argument("--max-new-tokens", type=positive_int, default=200)
    generate.add_argument(
        "--temperature", type=_non_negative_float, default=0.0, help=">= 0; 0: greedy"
    )
    generate.add_argument("--top-k", type=positive_int, default=None)
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--tokenizer", default=None, help='"byte" or a local tokenizer path')
    generate.add_argument("--device", default="auto", help=DEVICE_HELP)
    generate.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    generate.set_defaults(run=_generate)

    from deltalab.eval.cli import add_parser as add_eval_parser

    add_eval_parser(commands)

    from deltalab.study.cli import add_parser as add_study_parser

    add_study_parser(commands)
    from deltalab.bpe import add_parser as add_tokenizer_parser

    add_tokenizer_parser(commands)

    raw = list(sys.argv[1:] if argv is None else argv)
    args, extra = parser.parse_known_args(raw)
    if args.command == "eval" and "--" in raw:
        # Words after `--` are the task's settings, even where a path of that name exists.
        cut = raw.index("--")
        args, extra = parser.parse_known_args(raw[:cut])
        args.settings = raw[cut + 1 :]
    # Overrides after an option (`deltalab train a=1 --resume b=2`) arrive as leftovers; so do
    # the checkpoints of `deltalab eval --task perplexity CHECKPOINT`.
    if args.command in ("train", "eval"):
        words = args.command == "eval"
        args.overrides += [e for e in extra if (words or "=" in e) and not e.startswith("-")]
        extra = [e for e in extra if e not in args.overrides]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
