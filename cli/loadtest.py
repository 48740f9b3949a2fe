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
        default=[1, 2, 4, 8],
        metavar="C1,C2,...",
        help="closed loop: workers per run, each sends its next request when the last ends (default 1,2,4,8)",
    )
    parser.add_argument(
        "--rate",
        type=_float_list,
        default=None,
        metavar="R[,R2,...]",
        help="open loop instead: Poisson arrivals at R requests/s (seeded)",
    )
    parser.add_argument("--requests", type=int, default=32, help="requests per run (default 32)")
    parser.add_argument(
        "--prompts",
        type=Path,
        default=None,
        metavar="FILE.jsonl",
        help='one {"prompt": ...} per line, used in turn (default: bench/prompts.jsonl; '
        "bench/prose.jsonl: LLMPerf-style prose)",
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


def _settings(args, loadtest):
    try:
        prompts = loadtest.load_prompts(args.prompts or loadtest.DEFAULT_PROMPTS)
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
