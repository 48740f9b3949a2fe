"""Flags and errors shared by the subcommands."""

import argparse
import json
import re
import sys

from specd.proto.limits import ENGINES, EXACTNESS, QUANTIZATIONS, is_sim_engine


class UserError(Exception):
    """A mistake the user can fix (bad flag, missing model); printed without a traceback."""


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """--dtype and --threads, the same on every command that loads a model."""
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default=None,
        help="weights and compute dtype (default: bfloat16 on a GPU and where the CPU supports it, else float32)",
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
            "int4 on a CPU, none on a GPU: measured faster at a small cost in acceptance: docs/performance/avx2.md)"
            if role == "draft"
            else "none; int8/int4 make a CPU target faster but change its output)"
        ),
    )


def add_engine_flag(parser: argparse.ArgumentParser, flag: str, role: str, note: str = "") -> None:
    """--engine of a model service (`--draft-engine` for the draft of a whole stack)."""
    parser.add_argument(
        flag,
        type=engine_choice,
        default="auto",
        metavar="{" + ",".join(ENGINES) + ",sim[:...]}",
        help=f"{note}what the {role} runs its model on (default auto: llama.cpp on a CPU when the model has a "
        "GGUF file, as the default pair does; transformers on a GPU or for a plain HF model). sim: passes "
        "simulated from a measured cost profile, for testing pools and routing on a small machine, never auto: "
        "sim:profile=gpu|cpu,alpha=A,scale=S (model/sim_engine.py)",
    )


def engine_choice(text: str) -> str:
    """An --engine value: one of ENGINES, or the simulated engine with its options."""
    if text in ENGINES or is_sim_engine(text):
        return text
    raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(ENGINES)}, sim[:options])")


def add_exactness_flag(parser: argparse.ArgumentParser, note: str = "") -> None:
    """--exactness of the llama.cpp engine: a model service's (`specd up`: both services')."""
    parser.add_argument(
        "--exactness",
        choices=EXACTNESS,
        default=EXACTNESS[0],
        help=f"{note}the llama.cpp engine's scoring (default {EXACTNESS[0]}: every position bit for bit as a lone "
        "decode step scores it, so greedy output equals target-only decoding at any load; batched: a pass's "
        "positions in one llama.cpp call, faster under load, rounded as the batch's shape has it, as llama-server "
        "and vLLM round: greedy output may differ at near-ties; docs/performance/under-load.md)",
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


# ---------------------------------------------------------------- devices (docs/architecture.md §4)

DEVICE_FORM = re.compile(r"auto|cpu|cuda(:\d+)?")  # what specd.model.devices.resolve_device takes
DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
STACK_DEVICE_FLAGS = {"draft": "--draft-device", "target": "--device"}  # on up, generate and bench


def add_device_flag(parser: argparse.ArgumentParser, flag: str, role: str, note: str = "") -> None:
    """--device of one model service (`--draft-device` for the draft of a whole stack)."""
    auto = (
        "cuda:0 when a GPU is visible, else cpu"
        if role == "target"
        else "the CPU, the cheap device; name a GPU to put it on one"
    )
    parser.add_argument(
        flag,
        default="auto",
        metavar="auto|cpu|cuda|cuda:N",
        help=f"{note}where the {role} computes (default auto: {auto})",
    )


def add_cuda_graphs_flag(parser: argparse.ArgumentParser, services: str, note: str = "") -> None:
    parser.add_argument(
        "--cuda-graphs",
        choices=("auto", "on", "off"),
        default="auto",
        help=f"{note}capture the decode and verify steps of {services} in CUDA graphs "
        "(default auto: on for a CUDA device, off on a CPU; off: eager only)",
    )


def add_drafter_flag(parser: argparse.ArgumentParser, note: str = "", server_default: bool = False) -> None:
    """--drafter; with server_default, leaving it out means the running orchestrator's own."""
    from specd.orchestrator.lookup import DEFAULT_DRAFTER, DRAFTERS

    default = "default: the orchestrator's" if server_default else "default"
    parser.add_argument(
        "--drafter",
        choices=DRAFTERS,
        default=None if server_default else DEFAULT_DRAFTER,
        help=f"{note}who guesses: hybrid ({default}; each step the suffix drafter or the draft model, whichever "
        "promises more), model (the draft service only), ngram (prompt lookup only), suffix (the suffix "
        "drafter only: continuations ranked by frequency in the request and the worker's recent outputs)",
    )


def add_stack_device_flags(parser: argparse.ArgumentParser, note: str = "", services_note: str = "") -> None:
    """--device (the target's), --draft-device, --cuda-graphs, --engine (the target's) and --draft-engine:
    the same on up, generate and bench. `services_note` (default `note`) prefixes the help of the flags
    only specd's model services take (bench's HF baselines take the devices too)."""
    add_device_flag(parser, "--device", "target", note)
    add_device_flag(parser, "--draft-device", "draft", note)
    add_cuda_graphs_flag(parser, "each service on a GPU", services_note or note)
    add_engine_flag(parser, "--engine", "target service", services_note or note)
    add_engine_flag(parser, "--draft-engine", "draft service", services_note or note)


def roles_from_args(args, graphs: dict[str, str], threads: dict[str, int | None] | None = None) -> dict:
    """Each role's RoleConfig (deploy/roles.py) from a stack command's flags (up, generate, bench): the
    draft's --draft-X and the target's --X or --target-X, --cuda-graphs as check_stack_devices resolved
    it per role, `threads` per role where the command splits them; ports and replicas where it has them."""
    from specd.deploy.roles import RoleConfig

    def flag(name: str, default=None):
        return getattr(args, name, default)

    return {
        role: RoleConfig(
            model=flag(f"{role}_model"),
            quantize=flag(f"{role}_quantize"),
            device=flag("draft_device" if role == "draft" else "device"),
            cuda_graphs=graphs[role],
            engine=flag("draft_engine" if role == "draft" else "engine"),
            threads=(threads or {}).get(role),
            port=flag(f"{role}_port", 0),
            metrics_port=flag(f"{role}_metrics_port", 0),
            replicas=flag(f"{role}_replicas", 1),
        )
        for role in ("draft", "target")
    }


def measured_choice(args, roles: dict, drafter: str | None) -> tuple[dict, str | None]:
    """A stack here whose flags leave the engines and the drafter to specd (--engine and --draft-engine
    auto, --device and --draft-device auto, no --drafter) runs the configuration `specd bench
    --configurations` measured fastest on this machine for this pair, where it measured one
    (deploy/choice.py), and says so on stderr; otherwise the roles and drafter stay as given."""
    from dataclasses import replace

    from specd.deploy import choice

    left = all(getattr(args, name, "auto") == "auto" for name in ("engine", "draft_engine", "device", "draft_device"))
    if not left or drafter:
        return roles, drafter
    chosen = choice.load(roles["draft"].model, roles["target"].model)
    if chosen is None:
        return roles, drafter
    print(f"configuration: {chosen.describe()}; other flags override it", file=sys.stderr, flush=True)
    roles = {role: replace(config, engine=chosen.engine) for role, config in roles.items()}
    return roles, chosen.drafter


def device_choice(flag: str, value: str) -> str:
    """A --device value in its normal form, or a UserError (checked without torch)."""
    choice = (value or "auto").strip().lower()
    if not DEVICE_FORM.fullmatch(choice):
        raise UserError(f"{flag} {value}: unknown device; choose {DEVICE_CHOICES}")
    return choice


def resolve_here(role: str, flag: str, value: str):
    """The torch.device `role` gets for `flag value` on this machine, or a one-line UserError when the
    device does not exist here (e.g. --device cuda without a GPU). Imports torch."""
    from specd.model.devices import DeviceUnavailable, resolve_device

    choice = device_choice(flag, value)
    try:
        return resolve_device(role, choice)
    except DeviceUnavailable as error:
        raise UserError(str(error).replace("--device", flag)) from None  # e.g. --draft-device


def check_service_device(role: str, args) -> None:
    """`specd serve draft|target`: --device and --cuda-graphs checked before the server starts."""
    device = resolve_here(role, "--device", args.device)
    if args.cuda_graphs == "on" and device.type != "cuda":
        raise UserError(f"--cuda-graphs on needs a CUDA device; this {role} runs on {device}")


def check_stack_devices(args, here: bool = True) -> dict[str, str]:
    """--device, --draft-device and --cuda-graphs of a whole stack (up, generate, bench), checked before
    anything starts; returns the --cuda-graphs each service gets ({"draft": ..., "target": ...}).

    `here`: the services run on this machine, so a CUDA device must exist here (this imports torch,
    but only when a choice names CUDA or --cuda-graphs is on: auto and cpu always exist). On a Ray
    cluster (`here=False`) only the form is checked; each service resolves its device on its node.
    `--cuda-graphs on` turns graphs on for every service on a CUDA device (an error when none is);
    a service on the CPU runs eager.
    """
    choices = {
        role: device_choice(flag, getattr(args, flag[2:].replace("-", "_")))
        for role, flag in STACK_DEVICE_FLAGS.items()
    }
    graphs = args.cuda_graphs
    on_cuda: dict[str, bool | None] = {}  # None: decided on the node it lands on
    for role, choice in choices.items():
        if here and (choice.startswith("cuda") or graphs == "on"):
            on_cuda[role] = resolve_here(role, STACK_DEVICE_FLAGS[role], choice).type == "cuda"
        elif choice.startswith("cuda"):
            on_cuda[role] = True
        elif choice == "cpu" or role == "draft":  # the draft's auto is the CPU (specd.model.devices)
            on_cuda[role] = False
        else:
            on_cuda[role] = None
    if graphs != "on":
        return dict.fromkeys(choices, graphs)
    if not any(value is not False for value in on_cuda.values()):
        raise UserError("--cuda-graphs on needs a CUDA device, and every service here runs on the CPU")
    return {role: "on" if on_cuda[role] is not False else "off" for role in choices}
