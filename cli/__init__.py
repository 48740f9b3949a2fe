"""The `specd` console command: one subcommand module per verb."""

import argparse
import sys

from specd.cli import bench, generate, loadtest, models, serve, up
from specd.cli.common import UserError

SUBCOMMANDS = (models, serve, up, generate, loadtest, bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specd", description="Distributed speculative decoding server.")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.add_parser(verbs)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args) or 0
    except KeyboardInterrupt:
        return 130
    except UserError as error:
        print(f"specd: error: {error}", file=sys.stderr)
        return 2

