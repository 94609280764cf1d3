"""The `deltalab` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deltalab", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser(
        "check", help="run the delta-rule backends against each other and print errors and timings"
    )
    check.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    check.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args(argv)

    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.command == "check":
        from deltalab.check import CheckConfig
        from deltalab.check import main as check_main

        return check_main(CheckConfig(seed=args.seed))
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
