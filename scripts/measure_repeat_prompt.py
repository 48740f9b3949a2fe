"""The same prompt sent twice, one request at a time, to each server: what the second took from the
server's prefix cache, how much sooner its first token came, and whether its greedy text was the same.

Issue 49's check for short prompts (under one 64-token block, as every prompt of bench/prompts.jsonl
is): specd should report all of the second's prompt tokens but at most one as cached, as llama-server
does from its slot's cache. Run it on servers that have not seen the prompts yet (the first send must
compute them), idle otherwise:

    .venv/bin/python scripts/measure_repeat_prompt.py --server specd=127.0.0.1:50051 \\
        --openai llama-server=http://127.0.0.1:8080 --out docs/results/repeat_prompt_zen3.json

One line per send as it ends (progress in a log too), then a table per server; JSON with every send.
"""

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

from specd.bench.grpc_target import GrpcTarget
from specd.bench.loadtest import machine_info
from specd.bench.openai_client import OpenAiTarget
from specd.bench.workload import DEFAULT_PROMPTS, Settings, load_prompts


def named(text: str) -> tuple[str, str]:
    name, _, where = text.partition("=")
    if not where:
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=ADDRESS")
    return name, where


async def measure(name: str, target, prompts: list[str], max_new_tokens: int) -> list[dict]:
    settings = Settings(server=name, prompts=prompts, max_new_tokens=max_new_tokens)
    await target.open(timeout=600)
    sends = []
    try:
        for index in range(len(prompts)):
            first, second = [await target.send(settings, index) for _ in range(2)]
            for attempt, result in ((1, first), (2, second)):
                if not result.ok:
                    raise SystemExit(f"{name}: prompt {index} send {attempt} failed: {result.error}")
            send = {
                "prompt": index,
                "prompt_tokens": second.prompt_tokens,
                "cached": [first.cached_prompt_tokens, second.cached_prompt_tokens],
                "ttft_ms": [round(first.ttft * 1000, 1), round(second.ttft * 1000, 1)],
                "same_text": first.text == second.text,
            }
            print(f"{name} prompt {index}: {json.dumps(send)}", flush=True)
            sends.append(send)
    finally:
        await target.close()
    return sends


def summary(sends: list[dict]) -> dict:
    return {
        "second_cached_all_but_at_most_one": all(
            s["cached"][1] is not None and s["prompt_tokens"] is not None and s["cached"][1] >= s["prompt_tokens"] - 1
            for s in sends
        ),
        "ttft_p50_ms": [statistics.median(s["ttft_ms"][i] for s in sends) for i in (0, 1)],
        "second_sooner": sum(s["ttft_ms"][1] < s["ttft_ms"][0] for s in sends),
        "same_text": sum(s["same_text"] for s in sends),
        "prompts": len(sends),
    }


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", type=named, action="append", default=[], help="NAME=HOST:PORT (specd gRPC)")
    parser.add_argument("--openai", type=named, action="append", default=[], help="NAME=URL (OpenAI-compatible)")
    parser.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    prompts = load_prompts(args.prompts)
    targets = [(n, GrpcTarget(w)) for n, w in args.server] + [(n, OpenAiTarget(w)) for n, w in args.openai]
    if not targets:
        parser.error("name at least one --server or --openai")
    report = {"machine": machine_info(), "max_new_tokens": args.max_new_tokens, "servers": {}}
    for name, target in targets:
        sends = await measure(name, target, prompts, args.max_new_tokens)
        report["servers"][name] = {"summary": summary(sends), "sends": sends}
    for name, server in report["servers"].items():
        print(f"\n{name}: {json.dumps(server['summary'])}")
        print("prompt  tokens  cached 1st/2nd  TTFT ms 1st/2nd  same text")
        for s in server["sends"]:
            cached, ttft = str(s["cached"]), str(s["ttft_ms"])
            print(f"{s['prompt']:>6}  {s['prompt_tokens']!s:>6}  {cached:>14}  {ttft:>15}  {s['same_text']}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
