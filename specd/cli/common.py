"""Flags and errors shared by the subcommands."""

import argparse
import json


class UserError(Exception):
    """A mistake the user can fix (bad flag, missing model); printed without a traceback."""


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """--dtype and --threads, the same on every command that loads a model."""
    parser.add_argument(
        "--dtype", choices=("bfloat16", "float32"), default=None,
        help="weights and compute dtype (default: bfloat16 where the CPU supports it, else float32)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")


def write_report(console, report: dict, json_path, plot_path, save_plot) -> None:
    """The --json and --plot outputs of bench and loadtest."""
    if json_path:
        json_path.write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"report written to {json_path}")
    if plot_path:
        save_plot(report, plot_path)
        console.print(f"plot written to {plot_path}")
