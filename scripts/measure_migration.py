"""Issue 40's chaos check: a running stack with pools of replicas (e.g. `specd up --engine sim
--draft-engine sim --target-replicas 4 --draft-replicas 2 --step-deadline 3`), greedy requests at
STREAMS streams, run once without a fault and once with one replica's process hit mid-run:
`--fault kill` (SIGKILL to a target replica), `stop` (SIGSTOP to a target replica for `--stop-for`
seconds, longer than the step deadline, then SIGCONT) or `draft-kill` (SIGKILL to a draft replica);
with `--lab`, the script starts deploy/lab.py's namespaced lab (Ray on three hosts, 4 sim target
replicas on one, each behind a proxy of its own, --step-deadline 3) and the faults are network
faults at one replica's proxy: `cut` (a black hole for `--stop-for` seconds) or `loss` (30 % of
packets lost for the whole faulted run, emulated at the proxy, deploy/delay_proxy.py).
Per fault: completed, failed, wrong tokens (outputs that differ from the fault-free run's), sessions
left (on the surviving replicas of that role; after a stop, on all of them, the thawed one included),
requests moved, and the end-to-end latency of the moved requests against the others.

    .venv/bin/python scripts/measure_migration.py --server 127.0.0.1:50051 --fault kill \\
        --targets 127.0.0.1:50063,127.0.0.1:50163,127.0.0.1:50263,127.0.0.1:50363 \\
        --out docs/results/chaos_kill_sim.json

The victim is the replica of that role with the most requests on it a moment after the faulted run
starts (`specd.v1.Replicas` List); its process is found by its --port (pgrep).

    .venv/bin/python scripts/measure_migration.py --lab --fault cut --out docs/results/chaos_cut_lab_sim.json
"""

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc

from specd.bench.loadtest import machine_info, percentiles
from specd.proto.client import complete, make_request
from specd.v1 import common_pb2, draft_pb2_grpc, specdecode_pb2, specdecode_pb2_grpc, target_pb2_grpc

FAULTS = {  # name: (the role hit, what happens); cut and loss need --lab (its proxies)
    "kill": ("target", "SIGKILL one target replica mid-run"),
    "stop": ("target", "SIGSTOP one target replica mid-run, past the step deadline, then SIGCONT"),
    "draft-kill": ("draft", "SIGKILL one draft replica mid-run"),
    "cut": ("target", "black-hole one target replica mid-run (lab: its packets held, none refused), then restore"),
    "loss": ("target", "30 % packet loss to one target replica for the whole run (lab: emulated at its proxy)"),
}


async def run(client, count: int, tokens: int, streams: int, tag: str) -> list[dict]:
    queue = list(range(count))[::-1]
    results: list[dict] = [{} for _ in range(count)]

    async def stream() -> None:
        while queue:
            number = queue.pop()
            started = time.perf_counter()
            request = make_request(f"# {tag} request {number}\ndef handler_{number}(event):", tokens, ignore_eos=True)
            try:
                reply = await complete(client, request)
                results[number] = {
                    "tokens": list(reply.token_ids),
                    "migrations": reply.final.stats.migrations + reply.final.stats.draft_moves,
                    "target": reply.final.stats.target,
                    "seconds": time.perf_counter() - started,
                }
            except grpc.aio.AioRpcError as error:
                results[number] = {"error": error.code().name, "seconds": time.perf_counter() - started}

    await asyncio.gather(*(stream() for _ in range(streams)))
    return results


async def busiest(channel, role: str) -> str:
    listed = await specdecode_pb2_grpc.ReplicasStub(channel).List(specdecode_pb2.ListReplicasRequest())
    replicas = [r for r in listed.replicas if r.role == role and not r.draining]
    return max(replicas, key=lambda r: r.in_flight).address


async def live_sessions(address: str, role: str) -> int | None:
    stub = draft_pb2_grpc.DraftServiceStub if role == "draft" else target_pb2_grpc.TargetServiceStub
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            return (await stub(channel).Info(common_pb2.InfoRequest(), timeout=5)).live_sessions
    except grpc.aio.AioRpcError:
        return None


def kill(address: str, signum: int, role: str) -> int:
    port = address.rsplit(":", 1)[1]
    found = subprocess.run(["pgrep", "-f", f"serve {role} .*--port {port} "], capture_output=True, text=True)
    pids = [int(pid) for pid in found.stdout.split()]
    if len(pids) != 1:
        raise SystemExit(f"expected one {role} process on port {port}, found {pids}")
    os.kill(pids[0], signum)
    return pids[0]


async def main(args) -> dict:
    if not args.lab:
        replicas = (args.drafts if FAULTS[args.fault][0] == "draft" else args.targets).split(",")
        return await measure(args, args.server, replicas)
    from specd.deploy.lab import Lab, LabConfig

    sim = [f"sim:scale={args.scale:g}"]
    config = LabConfig(target_replicas=4, up_flags=["--engine", *sim, "--draft-engine", *sim, "--step-deadline", "3"])
    async with Lab(config) as lab:
        server = await lab.deploy()
        proxies = {proxy.address: proxy for proxy in lab.proxies.values()}
        targets = [address for address, proxy in proxies.items() if proxy.upstream_host == lab.hosts["target"].ip]
        return await measure(args, server, targets, proxies)


async def inject(args, victim: str, role: str, proxies: dict):
    """Hit `victim` with the fault; returns what heals it (None: nothing does)."""
    if args.fault in ("cut", "loss"):
        proxy = proxies[victim]
        if args.fault == "loss":
            proxy.loss = args.loss
            return lambda: setattr(proxy, "loss", 0.0)
        proxy.cut()
        await asyncio.sleep(args.stop_for)
        proxy.restore()
        print(f"restored after {args.stop_for:g} s", flush=True)
        return None
    pid = kill(victim, signal.SIGSTOP if args.fault == "stop" else signal.SIGKILL, role)
    print(f"pid {pid}", flush=True)
    if args.fault == "stop":
        await asyncio.sleep(args.stop_for)
        os.kill(pid, signal.SIGCONT)
        print(f"SIGCONT after {args.stop_for:g} s", flush=True)
    return None


async def measure(args, server: str, replicas: list[str], proxies: dict | None = None) -> dict:
    role, fault = FAULTS[args.fault]
    async with grpc.aio.insecure_channel(server) as channel:
        client = specdecode_pb2_grpc.SpecDecodeStub(channel)
        clean = await run(client, args.requests, args.tokens, args.streams, "chaos")
        print(f"fault-free run: {sum('tokens' in r for r in clean)} of {args.requests} completed", flush=True)
        faulted = asyncio.create_task(run(client, args.requests, args.tokens, args.streams, "chaos"))
        await asyncio.sleep(args.kill_after)
        victim = await busiest(channel, role)
        print(f"{args.fault} to the {role} replica {victim}", flush=True)
        heal = await inject(args, victim, role, proxies or {})
        results = await faulted
        if heal:
            heal()
    await asyncio.sleep(args.settle)  # a thawed replica rejoins (health SERVING), and its left sessions are released
    counted = [address for address in replicas if args.fault not in ("kill", "draft-kill") or address != victim]
    survivors = {address: await live_sessions(address, role) for address in counted}
    moved = [r["seconds"] for r in results if r.get("migrations")]
    others = [r["seconds"] for r in results if "tokens" in r and not r.get("migrations")]
    report = {
        "fault": fault,
        "victim": victim,
        "lab": bool(proxies),
        "requests": args.requests,
        "streams": args.streams,
        "max_new_tokens": args.tokens,
        "completed": sum("tokens" in r for r in results),
        "failed": sum("error" in r for r in results),
        "wrong_tokens": sum("tokens" in r and r["tokens"] != c.get("tokens") for r, c in zip(results, clean)),
        "leaked_sessions": sum(count or 0 for count in survivors.values()),
        "survivors_live_sessions": survivors,
        "migrated": len(moved),
        "moved_e2e_s": percentiles(moved),
        "others_e2e_s": percentiles(others),
        "clean_e2e_s": percentiles([r["seconds"] for r in clean if "tokens" in r]),
        "machine": machine_info(),
    }
    print(json.dumps({k: v for k, v in report.items() if k != "machine"}, indent=1))
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", default="127.0.0.1:50051")
    parser.add_argument("--targets", default="", help="the target replicas, comma-separated (for their sessions)")
    parser.add_argument("--drafts", default="", help="the draft replicas, comma-separated (for --fault draft-kill)")
    parser.add_argument("--fault", choices=FAULTS, default="kill")
    parser.add_argument("--stop-for", type=float, default=10.0, help="seconds a stopped replica stays stopped")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds after the run before sessions are counted")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--kill-after", type=float, default=2.0, help="seconds into the faulted run")
    parser.add_argument("--lab", action="store_true", help="start the namespaced lab (4 sim targets) and use it")
    parser.add_argument("--scale", type=float, default=5.0, help="with --lab: the sim engines' time scale")
    parser.add_argument("--loss", type=float, default=0.3, help="with --fault loss: the fraction of packets lost")
    parser.add_argument("--out", type=Path, default=None)
    arguments = parser.parse_args()
    outcome = asyncio.run(main(arguments))
    if arguments.out:
        arguments.out.write_text(json.dumps(outcome, indent=1) + "\n")
    sys.exit(0 if outcome["failed"] == 0 and outcome["wrong_tokens"] == 0 else 1)
