"""Issue 39's real-pair check of a pool: a running `specd up --target-replicas 2` (the default pair and
engine) serves exact greedy output from both target replicas. Each prompt of bench/prompts.jsonl is
sent speculatively (the server's default drafter and K) and with speculation off (K = 0) under
another cache salt (no prefix in common, so the router places it by load alone and the two may land
on different replicas); the pair must give the same token ids, whichever replicas served them.

    specd up --target-replicas 2 &
    .venv/bin/python scripts/check_real_pool.py --out docs/results/real_pool_2_replicas_zen5.json

One line per prompt as it ends; exit 1 if any pair differs or a replica served nothing.
"""

import argparse
import asyncio
import json
import sys
from pathlib import Path

import grpc

from specd.bench.loadtest import machine_info
from specd.bench.workload import DEFAULT_PROMPTS, load_prompts
from specd.proto.client import complete, make_request
from specd.v1 import common_pb2, specdecode_pb2_grpc


async def check(server: str, prompts: list[str], max_new_tokens: int, speculation: dict) -> list[dict]:
    results = []
    async with grpc.aio.insecure_channel(server) as channel:
        client = specdecode_pb2_grpc.SpecDecodeStub(channel)
        for index, prompt in enumerate(prompts):
            settings = dict(max_new_tokens=max_new_tokens, ignore_eos=True)
            spec = await complete(client, make_request(prompt, cache_salt="spec", **speculation, **settings))
            off = await complete(client, make_request(prompt, draft_tokens=0, cache_salt="off", **settings))
            result = {
                "prompt": index,
                "replicas": [spec.final.stats.target, off.final.stats.target],
                "draft_replica": spec.final.stats.draft,
                "drafted": spec.final.stats.drafted,
                "accepted": spec.final.stats.accepted,
                "tokens": len(spec.token_ids),
                "same_tokens": list(spec.token_ids) == list(off.token_ids),
            }
            print(json.dumps(result), flush=True)
            results.append(result)
        info = await client.Info(common_pb2.InfoRequest())
    return results, info


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", default="127.0.0.1:50051")
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    parser.add_argument("--count", type=int, default=12, help="the file's first N prompts")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--draft-tokens", type=int, default=None, help="a fixed K (default: the server's choice)")
    parser.add_argument("--drafter", default="", help="model, ngram, suffix or hybrid (default: the server's)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    speculation = dict(draft_tokens=args.draft_tokens, drafter=args.drafter)
    prompts = load_prompts(args.prompts)[: args.count]
    results, info = asyncio.run(check(args.server, prompts, args.max_new_tokens, speculation))
    served = {replica for result in results for replica in result["replicas"]}
    report = {
        "results": results,
        "replicas_serving": sorted(served),
        "same_tokens": sum(result["same_tokens"] for result in results),
        "across_replicas": sum(len(set(r["replicas"])) == 2 for r in results),
        "prompts": len(results),
        "speculation": speculation,
        "target_model": info.target.model,
        "draft_model": info.draft.model,
        "machine": machine_info(),
    }
    print(
        f"{report['same_tokens']} of {len(results)} prompts gave the same tokens speculative and off "
        f"({report['across_replicas']} of them on two different replicas); replicas serving: {sorted(served)}"
    )
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if report["same_tokens"] == len(results) and len(served) >= 2 else 1


if __name__ == "__main__":
    sys.exit(main())
