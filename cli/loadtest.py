"""`specd loadtest --server HOST:PORT`: a closed-loop concurrency sweep or open-loop Poisson load.

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
"""

import argparse
import asyncio
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from specd.cli.common import UserError, add_drafter_flag, write_report


def add_parser(verbs) -> None:
    parser = verbs.add_parser(
        "loadtest",
        help="measure throughput, latency and acceptance under load",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--server", required=True, metavar="HOST:PORT", help="a running orchestrator")
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
    parser.add_argument("--respect-eos", action="store_true", help="let requests stop at EOS (default: ignore it)")
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

    _check_compare(args, parser or argparse.ArgumentParser(prog="specd loadtest"))
    _check(args)
    settings = _settings(args, loadtest)
    console = Console(stderr=True)
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as progress:
        report = asyncio.run(
            loadtest.run_loadtest(
                settings,
                args.requests,
                concurrency=[] if args.rate else args.concurrency,
                rates=args.rate or [],
                progress=_progress_hook(progress),
                prompts_file=str(args.prompts or loadtest.DEFAULT_PROMPTS),
                compare=args.compare,
                repeats=args.repeats,
                warmup=args.warmup,
            )
        )
    console.print(loadtest_report.summary_table(report))
    if args.compare:
        console.print(loadtest_report.comparison_table(report))
    write_report(console, report, args.json, args.plot, loadtest_report.save_plot)
    return 1 if all(r["completed"] == 0 for r in report["runs"]) else 0


def _settings(args, loadtest):
    try:
        prompts = loadtest.load_prompts(args.prompts or loadtest.DEFAULT_PROMPTS)
    except loadtest.PromptsError as error:
        raise UserError(str(error)) from error
    return loadtest.Settings(
        server=args.server,
        prompts=prompts,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        draft_tokens=0 if args.no_speculation else args.draft_tokens,
        drafter=args.drafter or "",
        ignore_eos=not args.respect_eos,
        timeout=args.timeout,
    )


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


def _progress_hook(progress: Progress):
    def start(label: str, total: int):
        task = progress.add_task(label, total=total)
        return lambda: progress.advance(task)

    return start


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
