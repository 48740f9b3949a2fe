"""`specd loadtest --server HOST:PORT | --openai URL`: a closed-loop concurrency sweep or open-loop Poisson load.

Targets: --server HOST:PORT is specd's gRPC API; --openai URL any OpenAI-compatible server
(vLLM, llama.cpp's llama-server, TGI, SGLang, specd's own HTTP API), streamed from /v1/completions.
Both flags repeat: several targets run interleaved (at each concurrency or rate every target in turn,
in the order given), in one report and one plot. --model and --api-key go with --openai: once for
every OpenAI target, or once per --openai in the same order (default: the first model the server's
/v1/models lists; the key from $OPENAI_API_KEY). Only gRPC runs report α and K. A target is
named by its address in the report and the plot, or by NAME when given as NAME=HOST:PORT / NAME=URL.

Requests ask for ignore_eos by default, so each yields exactly --max-new-tokens tokens and
runs compare like for like; --respect-eos lets them stop at end-of-sequence instead.

--compare measures speculation on and off against the same server in one sweep: at each
concurrency a speculative run (the server's K, or --draft-tokens) and a speculation-off run
(K = 0) back to back with the same requests, alternating which goes first from one
concurrency to the next; --repeats N runs each pair N times and reports per mode the median
throughput run (the JSON keeps every run). It prints both side by side (tokens/s, TTFT p50,
their ratios speculative / off, mean K, share of steps with speculation off, target rows
per pass) and --plot draws them together. The report records the CPU it ran on.

--chat runs a multi-turn chat workload instead (bench/chat.py; default file bench/chat.jsonl, 16
ShareGPT-style conversations of 6 human turns): --conversations N of --turns T turns, each turn the
whole history (the answers the server gave included) plus the next human message, as one Qwen2.5
chat-format text prompt; one --concurrency level C of conversations at once. Per target and turn
number: TTFT p50/p90, tokens/s, prompt tokens served from the server's prefix cache and the hit rate
over turns 2..T; the JSON keeps every turn's output, so a run with a cache and one without compare.

  specd loadtest --server cache=localhost:50051 --server nocache=localhost:50052 \\
      --openai llama=http://localhost:8080 --chat --conversations 4 --turns 6 --concurrency 4 \\
      --max-new-tokens 32 --json chat.json --plot chat.png
  specd loadtest --server localhost:50051 --concurrency 1,2,4,8,16 --compare --repeats 3 \\
      --prompts bench/prose.jsonl --json compare.json --plot compare.png
  specd loadtest --server specd=localhost:50051 --openai vllm=http://gpu-box:8000 \\
      --openai llama=http://localhost:8080 --concurrency 1,4,16 --json side_by_side.json --plot side_by_side.png
"""

import argparse
import asyncio
import re
from pathlib import Path

from rich.console import Console

from specd.cli.common import UserError, add_drafter_flag, write_report

REQUESTS = 32  # per run
CONCURRENCY = [1, 2, 4, 8]
CHAT_CONVERSATIONS, CHAT_TURNS, CHAT_CONCURRENCY = 4, 6, 4  # --chat's defaults: issue 38's run


def add_parser(verbs) -> None:
    parser = verbs.add_parser(
        "loadtest",
        help="measure throughput, latency and acceptance under load",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--server",
        action=_Target,
        dest="targets",
        const="grpc",
        metavar="[NAME=]HOST:PORT",
        help="a running orchestrator's gRPC API (repeatable; NAME labels it in the report)",
    )
    parser.add_argument(
        "--openai",
        action=_Target,
        dest="targets",
        const="openai",
        metavar="[NAME=]URL",
        help="an OpenAI-compatible server, e.g. llama=http://127.0.0.1:8080 (/v1 optional; repeatable)",
    )
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME",
        help="the model to ask an --openai target for (default: the first its /v1/models lists)",
    )
    parser.add_argument(
        "--api-key", action="append", default=[], metavar="KEY", help="an --openai target's key ($OPENAI_API_KEY)"
    )
    parser.add_argument(
        "--concurrency",
        type=_int_list,
        default=None,
        metavar="C1,C2,...",
        help="closed loop: workers per run, each sends its next request when the last ends (default 1,2,4,8; "
        f"--chat: one level, conversations at once, default {CHAT_CONCURRENCY})",
    )
    parser.add_argument(
        "--rate",
        type=_float_list,
        default=None,
        metavar="R[,R2,...]",
        help="open loop instead: Poisson arrivals at R requests/s (seeded)",
    )
    parser.add_argument("--requests", type=int, default=None, help=f"requests per run (default {REQUESTS})")
    parser.add_argument(
        "--prompts",
        type=Path,
        default=None,
        metavar="FILE.jsonl",
        help='one {"prompt": ...} per line, used in turn (default: bench/prompts.jsonl; '
        "bench/prose.jsonl: LLMPerf-style prose)",
    )
    parser.add_argument(
        "--unique-prompts",
        action="store_true",
        help="open every prompt with a line of its own (`# ` and 12 hex digits), warm-ups too, so that no "
        "prompt repeats and no server answers one from its prefix cache",
    )
    parser.add_argument(
        "--shared-prefixes",
        type=int,
        default=0,
        metavar="N",
        help="many users over N system prompts: every prompt opens with one of N shared ~1,000-token contexts "
        "(picked per request by a hash of --seed and its number), then a line of its own (as --unique-prompts) "
        "and a prompt in turn; for prefix caches and prefix-aware routing",
    )
    parser.add_argument(
        "--chat",
        nargs="?",
        const="",
        default=None,
        metavar="FILE.jsonl",
        help="the multi-turn chat workload instead of single prompts: ShareGPT-style conversations, human turns "
        "only (no FILE: bench/chat.jsonl)",
    )
    parser.add_argument(
        "--conversations",
        type=int,
        default=None,
        metavar="N",
        help=f"with --chat: the file's first N conversations (default {CHAT_CONVERSATIONS})",
    )
    parser.add_argument(
        "--turns",
        type=int,
        default=None,
        metavar="T",
        help=f"with --chat: the first T human turns of each (default {CHAT_TURNS})",
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=0, help="request i uses seed + i; also seeds the arrivals")
    parser.add_argument(
        "--draft-tokens",
        type=int,
        default=None,
        help="a fixed K (default: the server's, which chooses K every step unless started with one); "
        "with --compare, the K of the speculative runs",
    )
    parser.add_argument("--no-speculation", action="store_true", help="target only (K = 0)")
    add_drafter_flag(parser, server_default=True)
    parser.add_argument(
        "--compare",
        action="store_true",
        help="closed loop: per concurrency, a speculative run and a speculation-off run (K = 0) back to back, "
        "reported and plotted side by side",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="N",
        help="with --compare: run each speculative/off pair N times, report each mode's median (default 1)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=2,
        metavar="N",
        help="short requests per mode before the measured runs, not reported (default 2; 0: none)",
    )
    parser.add_argument(
        "--respect-eos",
        action="store_true",
        help="let requests stop at EOS (default: ignore it; an --openai request then carries `ignore_eos`, "
        "which vLLM, llama-server and specd take)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT.json", help="write the report here")
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="OUT.png",
        help="draw throughput, latency, acceptance (--compare: tokens/s, TTFT p50 and their ratio, both modes)",
    )
    parser.set_defaults(run=lambda args: run(args, parser))


def run(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    from specd.bench import loadtest, loadtest_report
    from specd.bench.output import Progress, print_tables

    parser = parser or argparse.ArgumentParser(prog="specd loadtest")
    _check_targets(args, parser)
    if args.chat is not None:
        return run_chat(args, parser)
    _check_single(args, parser)
    args.requests = REQUESTS if args.requests is None else args.requests
    args.concurrency = CONCURRENCY if args.concurrency is None else args.concurrency
    _check_compare(args, parser)
    _check(args)
    settings = _settings(args, loadtest)
    targets = _targets(args, loadtest)
    console = Console(stderr=True)
    with Progress(console) as progress:
        try:
            report = asyncio.run(
                loadtest.run_loadtest(
                    settings,
                    args.requests,
                    concurrency=[] if args.rate else args.concurrency,
                    rates=args.rate or [],
                    progress=progress.task,
                    prompts_file=str(args.prompts or loadtest.DEFAULT_PROMPTS),
                    compare=args.compare,
                    repeats=args.repeats,
                    warmup=args.warmup,
                    targets=targets,
                    unique_prompts=args.unique_prompts or args.shared_prefixes > 0,
                )
            )
        except _target_errors(targets) as error:  # a server that refuses connections, no model, ...
            raise UserError(str(error)) from None
    tables = [loadtest_report.summary_table(report)]
    if args.compare:
        tables.append(loadtest_report.comparison_table(report))
    print_tables(console, *tables)
    write_report(console, report, args.json, args.plot, loadtest_report.save_plot)
    return 1 if all(r["completed"] == 0 for r in report["runs"]) else 0


def run_chat(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`specd loadtest --chat`: the multi-turn chat workload (bench/chat.py) against every target in turn."""
    from specd.bench import chat, chat_report, loadtest
    from specd.bench.output import Progress, print_tables

    refused = {
        "--rate": args.rate,
        "--compare": args.compare,
        "--repeats": args.repeats != 1,
        "--requests": args.requests is not None,
        "--prompts": args.prompts is not None,
        "--unique-prompts": args.unique_prompts,
        "--shared-prefixes": args.shared_prefixes,
    }
    for flag, given in refused.items():
        if given:
            parser.error(f"{flag} does not apply to --chat (its requests are its conversations' turns)")
    concurrency = args.concurrency or [CHAT_CONCURRENCY]
    if len(concurrency) != 1:
        parser.error("--chat runs one --concurrency level: a second would find the first one's prompts cached")
    conversations, turns = args.conversations or CHAT_CONVERSATIONS, args.turns or CHAT_TURNS
    if min(conversations, turns, concurrency[0], args.max_new_tokens) < 1 or args.timeout <= 0:
        raise UserError("--conversations, --turns, --concurrency and --max-new-tokens must be >= 1, --timeout > 0")
    path = Path(args.chat) if args.chat else chat.DEFAULT_CHAT  # `--chat` alone: the shipped file
    try:
        chosen = chat.pick_conversations(chat.load_conversations(path), conversations, turns)
    except chat.ChatError as error:
        raise UserError(str(error)) from None
    settings = _settings(args, loadtest, prompts=[])
    targets = _targets(args, loadtest)
    console = Console(stderr=True)
    with Progress(console) as progress:
        try:
            report = asyncio.run(
                chat.run_chat(settings, chosen, turns, concurrency[0], targets, progress.task, args.warmup, str(path))
            )
        except _target_errors(targets) as error:
            raise UserError(str(error)) from None
    print_tables(console, chat_report.chat_summary_table(report), chat_report.chat_turn_table(report))
    write_report(console, report, args.json, args.plot, chat_report.save_chat_plot)
    return 1 if all(run["completed"] == 0 for run in report["runs"]) else 0


def _check_single(args, parser: argparse.ArgumentParser) -> None:
    """--conversations and --turns go with --chat."""
    for flag, value in (("--conversations", args.conversations), ("--turns", args.turns)):
        if value is not None:
            parser.error(f"{flag} goes with --chat")


def _settings(args, loadtest, prompts: list[str] | None = None):
    try:
        prompts = loadtest.load_prompts(args.prompts or loadtest.DEFAULT_PROMPTS) if prompts is None else prompts
    except loadtest.PromptsError as error:
        raise UserError(str(error)) from error
    servers = [_named(value)[1] for kind, value in args.targets if kind == "grpc"]
    return loadtest.Settings(
        server=servers[0] if servers else "",  # the report's `server`: the first gRPC target
        prompts=prompts,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        draft_tokens=0 if args.no_speculation else args.draft_tokens,
        drafter=args.drafter or "",
        ignore_eos=not args.respect_eos,
        timeout=args.timeout,
        shared_prefixes=loadtest.shared_contexts(args.shared_prefixes),
    )


class _Target(argparse.Action):
    """--server and --openai append (kind, value) to one list, so the targets run in the order given."""

    def __call__(self, parser, namespace, value, option_string=None):
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest, None) or []), (self.const, value)])


def _check_targets(args, parser: argparse.ArgumentParser) -> None:
    """At least one target; --model and --api-key once for all --openai targets or once for each."""
    if not args.targets:
        parser.error("give a target: --server HOST:PORT (specd's gRPC API) and/or --openai URL")
    openai = sum(kind == "openai" for kind, _ in args.targets)
    for flag, values in (("--model", args.model), ("--api-key", args.api_key)):
        if values and not openai:
            parser.error(f"{flag} goes with --openai URL (a gRPC --server serves one pair)")
        if len(values) not in (0, 1, openai):
            parser.error(f"{flag} given {len(values)} times for {openai} --openai targets: give it once or once each")
    if args.compare and (len(args.targets) > 1 or openai):
        parser.error("--compare measures speculation on and off of one --server: give just that one")


def _targets(args, loadtest) -> list:
    """The targets in the order given (the openai package is imported only when one is an --openai)."""
    targets, index = [], 0
    for kind, given in args.targets:
        name, value = _named(given)
        if kind == "grpc":
            targets.append(loadtest.GrpcTarget(value))
        else:
            from specd.bench.openai_client import OpenAiTarget, TargetError

            model, key = (_nth(values, index) for values in (args.model, args.api_key))
            index += 1
            try:
                targets.append(OpenAiTarget(value, model, key))
            except TargetError as error:
                raise UserError(f"--openai {value}: {error}") from None
        targets[-1].name = name or targets[-1].name
    names = [target.name for target in targets]
    if len(set(names)) < len(names):
        raise UserError(f"a target is given twice: {', '.join(sorted({n for n in names if names.count(n) > 1}))}")
    return targets


_NAME = re.compile(r"([A-Za-z][\w.-]*)=(.+)")


def _named(value: str) -> tuple[str | None, str]:
    """NAME=ADDRESS -> (NAME, ADDRESS); a bare address -> (None, address). A URL's own `=` (a query) is not a name:
    a name has no `:` or `/`, so `http://h/v1?x=1` and `h:50051` stay whole."""
    match = _NAME.fullmatch(value)
    return (match[1], match[2]) if match else (None, value)


def _target_errors(targets: list) -> tuple:
    """What an unusable target raises: openai_client.TargetError where an --openai target runs (else nothing)."""
    if all(target.backend == "grpc" for target in targets):
        return ()
    from specd.bench.openai_client import TargetError

    return (TargetError,)


def _nth(values: list[str], index: int) -> str | None:
    """One value for every target, or the index-th of one per target (None: none given)."""
    return None if not values else values[0] if len(values) == 1 else values[index]


def _check_compare(args, parser: argparse.ArgumentParser) -> None:
    """Flags that contradict --compare or --repeats: a usage error (exit status 2)."""
    if args.compare and args.no_speculation:
        parser.error("--compare runs speculation on and off itself: drop --no-speculation")
    if args.compare and args.rate:
        parser.error("--compare is for closed-loop sweeps (--concurrency): drop --rate")
    if args.compare and args.draft_tokens == 0:
        parser.error("--compare --draft-tokens 0 would compare off with off: give a K >= 1, or none for the server's")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.repeats > 1 and not args.compare:
        parser.error("--repeats applies to --compare")


def _check(args) -> None:
    if args.requests < 1 or args.max_new_tokens < 1 or args.timeout <= 0:
        raise UserError("--requests and --max-new-tokens must be >= 1, --timeout > 0")
    if any(c < 1 for c in args.concurrency) or any(r <= 0 for r in args.rate or []):
        raise UserError("--concurrency levels must be >= 1 and --rate > 0")
    if not (args.rate or args.concurrency):
        raise UserError("give at least one --concurrency level or --rate")
    if args.shared_prefixes < 0:
        raise UserError("--shared-prefixes must be >= 0")


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None


def _float_list(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}") from None
