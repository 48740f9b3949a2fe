"""`specd generate PROMPT`: stream a completion, then the speculation stats and the speed-up."""

import argparse
import asyncio
import json
import sys

from rich.console import Console
from rich.table import Table

from specd.cli.common import (
    UserError,
    add_model_flags,
    add_quantize_flag,
    add_stack_device_flags,
    check_stack_devices,
    measured_choice,
    roles_from_args,
)
from specd.orchestrator.lookup import DRAFTERS
from specd.proto.auth import add_client_flags, client_security_from_args


def add_parser(verbs) -> None:
    parser = verbs.add_parser("generate", help="generate a completion (starts an embedded stack without --server)")
    parser.add_argument("prompt")
    parser.add_argument(
        "--server", default=None, metavar="HOST:PORT", help="a running orchestrator (default: start one)"
    )
    add_client_flags(parser, "--server")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument(
        "--seed", type=int, default=None, help="seed a sampled run (default: a fresh one, printed with the stats)"
    )
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument(
        "--draft-tokens",
        type=int,
        default=None,
        help="a fixed K (default: the server's, which chooses K every step unless started with one)",
    )
    parser.add_argument(
        "--drafter",
        choices=DRAFTERS,
        default="",
        help="who guesses (default: the server's, hybrid unless started otherwise; orchestrator/lookup.py)",
    )
    parser.add_argument("--no-speculation", action="store_true", help="target only (K = 0)")
    parser.add_argument(
        "--no-baseline", action="store_true", help="skip the target-only run that measures the speed-up"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    parser.add_argument("--draft-model", default="draft", help="embedded stack only: the draft model")
    parser.add_argument("--target-model", default="target", help="embedded stack only: the target model")
    add_model_flags(parser)
    add_stack_device_flags(parser, "embedded stack only: ")
    add_quantize_flag(parser, "--draft-quantize", "draft")
    add_quantize_flag(parser, "--target-quantize", "target")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # the embedded stack's devices, checked before it starts (one line and exit 2, e.g. no GPU here)
    graphs = check_stack_devices(args) if args.server is None else None
    try:
        result = asyncio.run(_generate(args, graphs))
    except Exception as error:  # grpc errors carry an actionable message: show it, not a traceback
        if type(error).__name__ in ("AioRpcError", "TimeoutError", "RuntimeError", "PairMismatch"):
            raise UserError(_describe(error)) from error
        raise
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_stats(result)
    return 0


async def _generate(args, graphs: dict[str, str] | None) -> dict:
    from specd.cli.up import service_threads
    from specd.deploy.local import SHARED_CORES_ENV, LocalStack, StackConfig

    stack = None
    address = args.server
    if address is None:  # a stack here, as `specd up` runs one: each service's share of the cores
        roles, drafter = measured_choice(args, roles_from_args(args, graphs, service_threads(args)), args.drafter)
        config = StackConfig(
            dtype=args.dtype,
            service_env=SHARED_CORES_ENV,
            **roles,
            drafter=drafter or None,
            extra_service_flags=["--max-cached-tokens", str(_cached_tokens(args))],
        )
        stack = await LocalStack(config).start()
        address = stack.address
    try:
        return await _run_requests(args, address, warm_up=stack is not None)
    finally:
        if stack:
            stack.stop()


def _cached_tokens(args) -> int:
    """The KV budget of an embedded stack's services: its requests run one at a time, so room for one
    is enough. A llama.cpp service reserves its whole budget at start (131,072 tokens by default: 3.7 GB
    for the target), which made `scripts/run.sh` peak at 6 GB; 16,384 tokens hold the default request
    many times over; a longer prompt gets room too (a character is at most 4 tokens: one per UTF-8 byte)."""
    return max(16_384, 4 * len(args.prompt) + args.max_new_tokens + 1_024)


async def _run_requests(args, address: str, warm_up: bool = False) -> dict:
    """The request, then (unless --no-baseline) the same with speculation off. `warm_up` (a stack just
    started here): first one token of the same prompt, so that the timed run does not pay the fresh
    services' first passes and the comparison that follows it does not find the prompt cached alone
    (both find it so)."""
    from specd.proto.client import channel, complete, make_request
    from specd.v1 import specdecode_pb2_grpc

    settings = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
    )
    k = 0 if args.no_speculation else args.draft_tokens
    try:
        security = client_security_from_args(args)
    except ValueError as error:
        raise UserError(str(error)) from error
    async with channel(address, security) as open_channel:
        stub = specdecode_pb2_grpc.SpecDecodeStub(open_channel)
        on_text = None if args.json else _echo
        if warm_up:
            one_token = {**settings, "max_new_tokens": 1}
            await complete(stub, make_request(args.prompt, draft_tokens=k, drafter=args.drafter, **one_token))
        request = make_request(args.prompt, draft_tokens=k, drafter=args.drafter, **settings)
        completion = await complete(stub, request, on_text)
        if not args.json:
            print(flush=True)
        result = _as_dict(completion)
        if not (args.no_speculation or args.no_baseline):
            if not args.json:
                print("measuring target-only for comparison ...", file=sys.stderr, flush=True)
            settings["seed"] = completion.final.seed  # the same draws: with a drawn seed too
            result.update(await _compare(stub, make_request(args.prompt, draft_tokens=0, **settings), result))
        return result


async def _compare(stub, target_only, result: dict) -> dict:
    """The speed-up over a target-only run of the same request. The completion stands without it:
    a refused run (a draining server, a limit) is one warning line and no comparison."""
    from specd.proto.client import complete

    try:
        baseline = await complete(stub, target_only)
    except Exception as error:  # grpc's AioRpcError, a timeout: whatever ended the comparison
        print(f"specd: warning: no speed-up measured: the target-only run failed: {_describe(error)}", file=sys.stderr)
        return {"baseline_error": _describe(error)}
    base_speed = baseline.final.stats.tokens_per_s
    return {
        "baseline": {"tokens_per_s": base_speed, "same_text": baseline.text == result["text"]},
        "speedup_vs_target": result["stats"]["tokens_per_s"] / base_speed if base_speed else None,
    }


def _echo(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _as_dict(completion) -> dict:
    from google.protobuf.json_format import MessageToDict

    final = completion.final
    stats = MessageToDict(final.stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    usage = MessageToDict(final.usage, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    return {
        "text": completion.text,
        "token_ids": completion.token_ids,
        "finish_reason": final.finish_reason,
        "seed": final.seed,
        "usage": usage,
        "stats": stats,
    }


def _print_stats(result: dict) -> None:
    stats = result["stats"]
    table = Table(title="speculation", show_header=False)
    rows = [
        ("finish reason", result["finish_reason"]),
        ("seed (--seed reproduces it)", result["seed"]),
        (
            "tokens (prompt / completion)",
            f"{result['usage']['prompt_tokens']} / {result['usage']['completion_tokens']}",
        ),
        ("draft length K", describe_draft_lengths(stats)),
        ("steps (target calls)", stats["steps"]),
        (
            "guessed by (steps)",
            f"{stats.get('drafter') or '?'}: prompt lookup {stats.get('lookup_steps', 0)}, "
            f"draft model {stats.get('drafting_steps', 0) - stats.get('lookup_steps', 0)}",
        ),
        ("acceptance rate α", f"{stats['acceptance_rate']:.2f}"),
        ("mean accepted length", f"{stats['mean_accepted_length']:.2f}"),
        ("accepted by draft position", " ".join(map(str, stats["accepted_per_position"]))),
        (
            "seconds draft / verify / other",
            f"{stats['draft_seconds']:.2f} / {stats['verify_seconds']:.2f} / {stats['other_seconds']:.2f}",
        ),
        ("tokens/s", f"{stats['tokens_per_s']:.2f}"),
    ]
    if "baseline" in result:
        rows.append(("target-only tokens/s", f"{result['baseline']['tokens_per_s']:.2f}"))
        rows.append(("speed-up over target-only", f"{result['speedup_vs_target']:.2f}×"))
        rows.append(("same text as target-only", "yes" if result["baseline"]["same_text"] else "no"))
    for name, value in rows:
        table.add_row(name, str(value))
    Console(stderr=True).print(table)


def describe_draft_lengths(stats: dict) -> str:
    """Fixed K, or for an adaptive request its bound, the mean K and the target-only share of steps."""
    if not stats.get("adaptive"):
        return str(stats["draft_tokens"])
    lengths = stats.get("draft_lengths") or [0]
    drafting = [k for k in lengths if k]
    mean = f"mean {sum(drafting) / len(drafting):.1f} when drafting" if drafting else "never drafted"
    return f"auto (≤ {stats['draft_tokens']}): {mean}, target-only {lengths.count(0)} of {len(lengths)} steps"


def _describe(error: Exception) -> str:
    if hasattr(error, "code") and hasattr(error, "details"):
        return f"{error.code().name}: {error.details()}"
    return str(error)
