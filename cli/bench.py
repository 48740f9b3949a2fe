"""`specd bench`: specd against Hugging Face generate, side by side on the same prompts.

Five systems, batch 1, greedy, each generating exactly --max-new-tokens tokens (EOS ignored),
interleaved per prompt (A B C D E, A B C D E, ...) so machine drift falls on all alike:
  hf_target     transformers generate() on the target alone
  hf_assisted   generate(assistant_model=draft), transformers' assisted decoding
  hf_lookup     generate(prompt_lookup_num_tokens=10), transformers' prompt lookup decoding
  specd_target  specd, speculation off (K = 0), through the gRPC services and the orchestrator
  specd_spec    specd speculative (K chosen every step, or a fixed --draft-tokens K; --drafter)
  NAME          each --peer NAME=URL: an OpenAI-compatible server (vLLM, llama-server with its own
                draft, TGI, SGLang, specd's HTTP API) streamed from /v1/completions: the same prompt
                token ids, greedy, max_tokens and ignore_eos; its first /v1/models model
The HF models load in this process, the target on --device and the draft on --draft-device, as
specd places its services (so on a GPU both targets compute on the same one); specd runs as a
local stack (three processes) in the same dtype, or at --server. Reports tokens/s, the ratios,
α, c, the mean accepted length, the analytic best speed-up for the measured α and c, and whether
specd's output equals the target's plain greedy output (greedy_match); for each peer, specd_spec /
peer and whether its text equals specd_target's.

  specd bench --quick --peer llama=http://127.0.0.1:8080 --json bench_peers.json --plot bench_peers.png
"""

import argparse
import asyncio
import re
import time
from pathlib import Path

from rich.console import Console

from specd.cli.common import (
    UserError,
    add_drafter_flag,
    add_model_flags,
    add_quantize_flag,
    add_stack_device_flags,
    check_stack_devices,
    draft_tokens_flag,
    roles_from_args,
    write_report,
)


def add_parser(verbs) -> None:
    parser = verbs.add_parser(
        "bench",
        help="benchmark specd against HF generate (target only and assisted)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="the first 4 prompts, 32 tokens (unless --max-new-tokens says otherwise)"
    )
    parser.add_argument(
        "--prompts",
        type=Path,
        default=None,
        metavar="FILE.jsonl",
        help='one {"prompt": ..., "kind": ...} per line (default: bench/prompts.jsonl)',
    )
    parser.add_argument(
        "--limit", type=int, default=None, metavar="N", help="the first N prompts of the file (default: all of them)"
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=None, help="tokens per prompt and system (default 64; 32 with --quick)"
    )
    parser.add_argument(
        "--draft-tokens",
        type=draft_tokens_flag,
        default=None,
        metavar="K|auto",
        help="K of specd_spec (default auto: chosen every step by the orchestrator)",
    )
    add_drafter_flag(parser, "specd_spec's drafter: ", server_default=True)
    parser.add_argument("--draft-model", default="draft", help="default-pair name, local HF directory or hub id")
    parser.add_argument("--target-model", default="target", help="default-pair name, local HF directory or hub id")
    parser.add_argument(
        "--server",
        default=None,
        metavar="HOST:PORT",
        help="a running orchestrator serving the same pair in the same dtype (default: start one)",
    )
    parser.add_argument(
        "--peer",
        type=_peer,
        action="append",
        default=[],
        metavar="NAME=URL",
        help="also bench an OpenAI-compatible server as system NAME, e.g. llama=http://127.0.0.1:8080 (repeatable)",
    )
    parser.add_argument(
        "--configurations",
        action="store_true",
        help="instead: each engine × drafter of specd side by side (no HF, no peers), the fastest and the "
        "default's ratio to it (bench/configurations.py)",
    )
    parser.add_argument(
        "--engines",
        default=None,
        metavar="E,E",
        help="--configurations' engines (default: llama.cpp, and transformers where the pair is converted)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per specd request (default 600)")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT.json", help="write the report here")
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="OUT.png",
        help="draw tokens/s per system and acceptance by draft position",
    )
    add_model_flags(parser)
    add_stack_device_flags(parser, "HF's and specd's: ", "specd's services: ")
    add_quantize_flag(parser, "--draft-quantize", "draft")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specd.bench import systems
    from specd.bench.output import Progress, print_tables
    from specd.bench.report import SYSTEMS, save_plot, summary_tables

    settings = _settings(args)
    console = Console(stderr=True)
    started = time.perf_counter()
    if args.configurations:
        return _run_configurations(args, settings, console, started)
    total = len(settings.prompts) * (len(SYSTEMS) + len(settings.peers))
    with Progress(console) as progress:
        advance = progress.task("starting", total)
        try:
            report = asyncio.run(systems.run_bench(settings, advance=advance, say=progress.say))
        except Exception as error:
            if type(error).__name__ in (
                "AioRpcError",
                "RuntimeError",
                "ModelNotFetchedError",
                "PromptsError",
                "TimeoutError",
                "TargetError",  # a --peer that refuses connections, lists no model, or fails a request
            ):
                raise UserError(_describe(error)) from error
            raise
    report["settings"]["wall_seconds"] = round(time.perf_counter() - started, 1)
    print_tables(console, *summary_tables(report))
    console.print(f"wall time {report['settings']['wall_seconds']:.0f} s (model loading included)")
    write_report(console, report, args.json, args.plot, save_plot)
    return 0


def _run_configurations(args, settings, console: Console, started: float) -> int:
    from rich.table import Table

    from specd.bench import configurations
    from specd.bench.output import Progress
    from specd.deploy import choice

    if settings.server or settings.peers:
        raise UserError("--configurations starts its own stacks: it takes no --server and no --peer")
    engines = _engines(args.engines)
    stacks = 2 * len(engines)
    per_stack = len(settings.prompts) * len(configurations.WITH_DRAFT)
    with Progress(console) as progress:
        advance = progress.task("starting", stacks * per_stack)
        report = configurations.run(settings, engines, progress.say, advance)
    report["settings"]["wall_seconds"] = round(time.perf_counter() - started, 1)
    table = Table(title=f"engine × drafter on this machine ({report['environment'].get('cpu', '')})")
    for column in ("configuration", "tokens/s", "÷ fastest", "α", "steps off", "same text"):
        table.add_column(column)
    for row in configurations.summary_rows(report):
        table.add_row(*row)
    ratio = report["default_vs_fastest"]
    table.caption = f"the default is {ratio:.2f}× the fastest ({report['fastest']})" if ratio else ""
    Console().print(table)
    write_report(console, report, args.json, args.plot, configurations.save_plot)
    kept = choice.save(report, settings.draft.model, settings.target.model)
    if kept:
        console.print(f"kept for `specd up` and `specd generate` here: {kept.describe()} (deploy/choice.py)")
    return 0


def _engines(given: str | None) -> list[str]:
    """--engines, checked; by default llama.cpp, and transformers where the default pair is converted."""
    from specd.model.store import list_models

    if given is None:
        return ["llama.cpp"] + (["transformers"] if all(status.converted for status in list_models()) else [])
    engines = [engine.strip() for engine in given.split(",") if engine.strip()]
    unknown = [engine for engine in engines if engine not in ("llama.cpp", "transformers")]
    if not engines or unknown:
        raise UserError(f"--engines takes llama.cpp and/or transformers, comma-separated; not {given!r}")
    return engines


def _settings(args):
    from specd.bench import systems
    from specd.bench.workload import DEFAULT_PROMPTS, PromptsError

    if args.draft_tokens == 0:
        raise UserError("--draft-tokens must be >= 1 or auto (specd_target already measures K = 0)")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be >= 1")
    if args.timeout <= 0:
        raise UserError("--timeout must be > 0")
    peers = _peers(getattr(args, "peer", []))  # a Namespace built by hand may lack it
    graphs = check_stack_devices(args)  # before anything loads: e.g. --device cuda without a GPU, one line
    prompts_file = args.prompts or DEFAULT_PROMPTS
    try:
        prompts, kinds = systems.load_prompts(prompts_file)
    except PromptsError as error:
        raise UserError(str(error)) from error
    limit = getattr(args, "limit", None)  # a Namespace built by hand may lack it
    limit = limit if limit is not None else (systems.QUICK_PROMPTS if args.quick else None)
    if limit is not None and limit < 1:
        raise UserError("--limit must be >= 1")
    prompts, kinds = prompts[:limit], kinds[:limit]
    tokens = args.max_new_tokens or (systems.QUICK_TOKENS if args.quick else systems.DEFAULT_TOKENS)
    return systems.BenchSettings(
        prompts=prompts,
        kinds=kinds,
        max_new_tokens=tokens,
        draft_tokens=args.draft_tokens,
        drafter=args.drafter or "",
        dtype=args.dtype,
        threads=args.threads,
        **roles_from_args(args, graphs),
        server=args.server,
        peers=peers,
        timeout=args.timeout,
        prompts_file=str(prompts_file),
        quick=args.quick,
    )


PEER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # a system's name: it goes into ratio names such as a/b


def _peer(text: str) -> tuple[str, str]:
    """--peer NAME=URL, split and checked for form (the URL's server is reached when the bench starts)."""
    name, equals, url = text.partition("=")
    name, url = name.strip(), url.strip()
    if not equals or not name or not url:
        raise argparse.ArgumentTypeError(f"expected NAME=URL (e.g. llama=http://127.0.0.1:8080), got {text!r}")
    if not PEER_NAME.fullmatch(name):
        raise argparse.ArgumentTypeError(f"peer name {name!r}: use letters, digits, _, . and - (no /)")
    return name, url


def _peers(given: list[tuple[str, str]]) -> dict[str, str]:
    """--peer flags as name -> URL; a UserError for a name taken twice or by a built-in system, or a bad URL."""
    from specd.bench.report import SYSTEMS

    peers: dict[str, str] = {}
    for name, url in given:
        if name in SYSTEMS or name == "hf_best" or name in peers:
            raise UserError(f"--peer {name}=...: the name {name!r} is taken; choose another")
        if not re.match(r"https?://[^/\s]+", url):
            raise UserError(f"--peer {name}={url}: the URL must be http(s)://HOST:PORT (its /v1 optional)")
        peers[name] = url
    return peers


def _describe(error: Exception) -> str:
    if hasattr(error, "code") and hasattr(error, "details"):
        return f"{error.code().name}: {error.details()}"
    return str(error)
