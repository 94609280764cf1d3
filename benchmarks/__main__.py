"""`python -m benchmarks SUITE [MODE] [ARGS]`: runs one suite; `--list` names them."""

from __future__ import annotations

import argparse
import datetime
import importlib
import sys
from pathlib import Path

from benchmarks import SUITES
from benchmarks.common import ROOT, header, save
from deltalab.errors import UserError, one_line

USAGE = "python -m benchmarks [--list] SUITE [MODE] [ARGS]"


def suite_parser(name: str, module_name: str, prog: str) -> argparse.ArgumentParser:
    """The command line of one suite (or mode): its module's options and --json."""
    module = importlib.import_module(f"benchmarks.{module_name}")
    parser = argparse.ArgumentParser(
        prog=prog, description=module.__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        help=f"the JSON file to write (default: runs/bench/{name}-<UTC time>.json)",
    )
    module.add_arguments(parser)
    parser.set_defaults(run=module.run)
    return parser


def list_suites() -> str:
    lines = []
    for name, (module, summary) in SUITES.items():
        modes = f" {{{','.join(module)}}}" if isinstance(module, dict) else ""
        lines.append(f"{name}{modes}: {summary}")
    return "\n".join(lines)


def parse(argv: list[str]) -> argparse.Namespace:
    top = argparse.ArgumentParser(prog="python -m benchmarks", usage=USAGE, add_help=False)
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print(f"usage: {USAGE}\n\nsuites:\n{list_suites()}")
        sys.exit(0)
    name, rest = argv[0], argv[1:]
    if name not in SUITES:
        top.error(f"unknown suite {name!r} (choose from {', '.join(SUITES)})")
    module, _ = SUITES[name]
    prog = f"python -m benchmarks {name}"
    if isinstance(module, dict):
        if rest and rest[0] in ("-h", "--help"):
            print(f"usage: {prog} {{{','.join(module)}}} [ARGS]")
            sys.exit(0)
        if not rest:
            top.error(f"{name} needs a mode: one of {', '.join(module)}")
        mode = rest.pop(0)
        if mode not in module:
            top.error(f"unknown mode {mode!r} of {name} (choose from {', '.join(module)})")
        name, module, prog = f"{name}-{mode}", module[mode], f"{prog} {mode}"
    args = suite_parser(name, module, prog).parse_args(rest)
    if args.json is None:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
        args.json = ROOT / "runs" / "bench" / f"{name}-{stamp}.json"
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    args.header = header(argv)
    print(" ".join(f"{k}={v}" for k, v in args.header.items() if k != "command"))
    try:
        results = args.run(args)
    except UserError as error:
        print(f"python -m benchmarks: error: {one_line(error)}", file=sys.stderr)
        return 2
    if results is not None:
        save(args, results)
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
