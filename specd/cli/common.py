"""Flags and errors shared by the subcommands."""

import argparse


class UserError(Exception):
    """A mistake the user can fix (bad flag, missing model); printed without a traceback."""


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """--dtype and --threads, the same on every command that loads a model."""
    parser.add_argument(
        "--dtype", choices=("bfloat16", "float32"), default=None,
        help="weights and compute dtype (default: bfloat16 where the CPU supports it, else float32)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
