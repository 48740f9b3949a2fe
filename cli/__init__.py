"""The `specd` console command: one subcommand module per verb.

Each subcommand imports what it runs only when it runs, so the client commands start without torch
and work in an orchestrator-only install (docs/architecture.md §1; tests/test_layering.py).
"""

import argparse
import sys

from specd.cli import bench, generate, loadtest, models, scale, serve, up
from specd.cli.common import UserError

SUBCOMMANDS = (models, serve, up, scale, generate, loadtest, bench)
MODEL_PARTS = {"torch", "transformers"}  # what a model command needs beyond the client side


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
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if missing.split(".")[0] not in MODEL_PARTS and not missing.startswith("specd."):
            raise  # a bug, not a missing part
        print(
            f"specd: error: `specd {args.verb}` needs {missing}, which this install lacks (an orchestrator-only "
            f"install has no model services): install the full image, or `pip install ./model ./serving "
            f"./draft_service ./target_service` from a checkout",
            file=sys.stderr,
        )
        return 2
