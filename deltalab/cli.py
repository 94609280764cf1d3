"""The `deltalab` command: check, presets, generate."""

from __future__ import annotations

import argparse
import sys


def _check(args: argparse.Namespace) -> int:
    from deltalab.check import CheckConfig
    from deltalab.check import main as check_main

    return check_main(CheckConfig(seed=args.seed))


def _presets(args: argparse.Namespace) -> int:
    from deltalab.benchmarking import format_table
    from deltalab.models.config import MIXER_KINDS
    from deltalab.models.presets import preset_table

    mixers = tuple(args.mixer) if args.mixer else MIXER_KINDS
    headers = ["preset", "mixer", "width", "layers", "heads", "ffn", "non-embedding", "total"]
    rows = [
        [*row[:6], f"{row[6] / 1e6:.2f}M", f"{row[7] / 1e6:.2f}M"] for row in preset_table(mixers)
    ]
    print(format_table(headers, rows))
    return 0


def _generate(args: argparse.Namespace) -> int:
    from deltalab.generate import GenerateConfig, generate_text

    config = GenerateConfig(
        checkpoint=args.checkpoint,
        prompt=args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        tokenizer=args.tokenizer,
        device=args.device,
    )
    print(args.prompt + generate_text(config))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deltalab", description=__doc__)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    commands = parser.add_subparsers(dest="command", required=True)

    check = commands.add_parser(
        "check", help="run the delta-rule backends against each other and print errors and timings"
    )
    check.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    check.set_defaults(run=_check)

    presets = commands.add_parser(
        "presets", help="print every model preset with its parameter count"
    )
    presets.add_argument("--mixer", action="append", help="only this mixer kind (repeatable)")
    presets.set_defaults(run=_presets)

    generate = commands.add_parser("generate", help="continue a prompt with a saved checkpoint")
    generate.add_argument("checkpoint", help="a save_pretrained directory")
    generate.add_argument("prompt")
    generate.add_argument("--max-new-tokens", type=int, default=200)
    generate.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    generate.add_argument("--top-k", type=int, default=None)
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--tokenizer", default=None, help='"byte" or a local tokenizer path')
    generate.add_argument("--device", default="cpu")
    generate.set_defaults(run=_generate)

    args = parser.parse_args(argv)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
