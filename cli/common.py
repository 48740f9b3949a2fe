"""Flags and errors shared by the subcommands."""

import argparse
import json

from specd.proto.limits import QUANTIZATIONS


class UserError(Exception):
    """A mistake the user can fix (bad flag, missing model); printed without a traceback."""


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """--dtype and --threads, the same on every command that loads a model."""
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default=None,
        help="weights and compute dtype (default: bfloat16 where the CPU supports it, else float32)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")


def add_quantize_flag(parser: argparse.ArgumentParser, flag: str, role: str) -> None:
    """--quantize for a model service: weight-only int8/int4 (torchao); by default int4 for a CPU draft."""
    parser.add_argument(
        flag,
        choices=("auto",) + QUANTIZATIONS,
        default="auto",
        help=f"weight quantization of the {role} (default auto: "
        + (
            "int4 on a CPU, none on a GPU: measured faster at a small cost in acceptance, README)"
            if role == "draft"
            else "none; int8/int4 make a CPU target faster but change its output)"
        ),
    )


def draft_tokens_flag(value: str) -> int | None:
    """--draft-tokens: a K >= 0 (0 = speculation off), or `auto` (None): chosen every step."""
    if value == "auto":
        return None
    try:
        k = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number K >= 0 or `auto`, got {value!r}") from None
    if k < 0:
        raise argparse.ArgumentTypeError(f"K must be >= 0 (0 turns speculation off), got {k}")
    return k


def write_report(console, report: dict, json_path, plot_path, save_plot) -> None:
    """The --json and --plot outputs of bench and loadtest."""
    if json_path:
        json_path.write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"report written to {json_path}")
    if plot_path:
        save_plot(report, plot_path)
        console.print(f"plot written to {plot_path}")
