"""A target replica that dies or freezes mid-run (issue 40, orchestrator/migration.py), on the simulated
engine: its requests move to the other replicas and finish with the tokens a fault-free run gives,
none fails, no session is left behind, and the replica rejoins once it serves again. A draft replica
that dies: its requests go on speculating with another (generation.py move_draft)."""

import asyncio
import os
import signal
import socket
import subprocess
import sys

import grpc
import pytest
from conftest import TOKENIZER, serve_sim

from specd.model.fetch import resolve_tokenizer
from specd.orchestrator.faults import FaultPolicy
from specd.orchestrator.remote import wait_until_serving
from specd.orchestrator.server import OrchestratorServer
from specd.proto.client import complete, make_request
from specd.v1 import common_pb2, draft_pb2_grpc, specdecode_pb2_grpc, target_pb2_grpc

STREAMS = 8
TOKENS = 160  # long enough that the kill finds requests mid-stream
SAMPLED = 32  # seeded sampled requests (issue 40: 32, one replica killed mid-run)


@pytest.fixture(scope="module")
async def pool(ray_local):
    """A sim draft, four sim target replicas, an orchestrator over them."""
    draft, *targets = [await serve_sim(role) for role in ("draft", "target", "target", "target", "target")]
    addresses = [f"127.0.0.1:{server.port}" for server in targets]
    orchestrator = OrchestratorServer(f"127.0.0.1:{draft.port}", ",".join(addresses), workers=2)
    await orchestrator.start("127.0.0.1:0")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}")
    yield specdecode_pb2_grpc.SpecDecodeStub(channel), orchestrator, targets, addresses
    await channel.close()
    await orchestrator.stop(0)
    for server in (draft, *targets):
        await server.stop(0)


def prompt(number: int) -> str:
    return f"# request {number}\ndef handler_{number}(event):"


async def run(client, count: int, first: int = 0, **options) -> list:
    """Requests `first` to `first + count` (greedy) over STREAMS streams; each reply or its error, in order.
    `options`: more make_request fields."""
    queue = asyncio.Queue()
    for number in range(count):
        queue.put_nowait(number)
    replies: list = [None] * count

    async def stream() -> None:
        while not queue.empty():
            number = queue.get_nowait()
            try:
                request = make_request(prompt(first + number), TOKENS, ignore_eos=True, **options)
                replies[number] = await complete(client, request)
            except grpc.aio.AioRpcError as error:
                replies[number] = error

    await asyncio.gather(*(stream() for _ in range(STREAMS)))
    return replies


async def test_a_replica_killed_mid_run_loses_no_request_and_changes_no_token(pool, caplog):
    client, orchestrator, targets, addresses = pool
    clean = await run(client, 32)
    assert all(not isinstance(reply, Exception) for reply in clean)

    router = orchestrator.pool.routers["target"]
    faulted = asyncio.create_task(run(client, 32))
    while max(replica.load for replica in router.replicas.values()) < 2:  # wait until requests run everywhere
        await asyncio.sleep(0.01)
    victim = max(router.replicas.values(), key=lambda replica: replica.load).name
    held = targets[addresses.index(victim)].thread.service.engine.kv  # its sessions' tokens
    for _ in range(1000):  # and until one of its requests has streamed tokens (a prompt is under 20)
        if max(map(len, list(held.values())), default=0) > 40:
            break
        await asyncio.sleep(0.01)
    await targets[addresses.index(victim)].stop(0)  # its calls in flight fail, new ones are refused
    replies = await faulted

    failed = [reply for reply in replies if isinstance(reply, Exception)]
    assert failed == []
    assert [reply.token_ids for reply in replies] == [reply.token_ids for reply in clean]  # not a token changed
    moved = [reply for reply in replies if reply.final.stats.migrations]
    assert moved and all(reply.final.stats.target != victim for reply in moved)
    assert all(len(reply.token_ids) == TOKENS and reply.final.usage.completion_tokens == TOKENS for reply in moved)
    streamed = [int(m.split(" after ")[1].split()[0]) for m in caplog.messages if "moving it" in m]
    assert len(streamed) == len(moved) and max(streamed) > 0  # some moved mid-stream, and went on from there
    assert router.replicas[victim].down and victim not in [r.name for r in router.serving()]
    metric = orchestrator.metrics.registry.get_sample_value("specd_migrations_total", {"role": "target"})
    assert metric == len(moved)
    survivors = [address for address in addresses if address != victim]
    for _ in range(50):
        if [await live_sessions(address) for address in survivors] == [0, 0, 0]:
            break
        await asyncio.sleep(0.1)
    assert [await live_sessions(address) for address in survivors] == [0, 0, 0]

    # It comes back on its port: health says SERVING, it rejoins, and new requests reach it again.
    back = await serve_sim("target", port=int(victim.rsplit(":", 1)[1]))
    targets[addresses.index(victim)] = back
    for _ in range(100):
        if not router.replicas[victim].down:
            break
        await asyncio.sleep(0.1)
    assert not router.replicas[victim].down
    again = await run(client, 16, first=100)  # new prompts: the load decides, and it carries none
    assert victim in {reply.final.stats.target for reply in again}


async def test_with_migration_off_a_dead_replica_fails_its_requests_unavailable(ray_local):
    draft, *targets = [await serve_sim(role) for role in ("draft", "target", "target")]
    addresses = [f"127.0.0.1:{server.port}" for server in targets]
    orchestrator = OrchestratorServer(
        f"127.0.0.1:{draft.port}",
        ",".join(addresses),
        workers=1,
        migration_limit=0,
        policy=FaultPolicy(target_retry_s=1.0),  # not the default 30 s of retries of the dead one
    )
    await orchestrator.start("127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
            client = specdecode_pb2_grpc.SpecDecodeStub(channel)
            await targets[0].stop(0)
            replies = await run(client, 8)
        codes = {reply.code() for reply in replies if isinstance(reply, grpc.aio.AioRpcError)}
        assert codes == {grpc.StatusCode.UNAVAILABLE}  # the ones routed to the dead replica
        assert any(not isinstance(reply, Exception) for reply in replies)  # the others served
    finally:
        await orchestrator.stop(0)
        for server in (draft, *targets):
            await server.stop(0)


async def live_sessions(address: str, stub=target_pb2_grpc.TargetServiceStub) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        return (await stub(channel).Info(common_pb2.InfoRequest())).live_sessions


async def until(check, seconds: float = 10.0) -> bool:
    """Whether `check()` (a coroutine function) comes true within `seconds`."""
    for _ in range(int(seconds / 0.1)):
        if await check():
            return True
        await asyncio.sleep(0.1)
    return await check()


async def test_a_frozen_replica_is_left_after_the_step_deadline_and_rejoins_when_it_thaws(ray_local, tmp_path):
    """SIGSTOP to a target replica's process for longer than the step deadline (3 s here; 30 s by default,
    where a lone target waits --call-timeout, 300 s): its requests move on and finish with the fault-free
    tokens; once it thaws it serves again, rejoins, and the sessions the moved requests left there are released."""
    tokenizer = str(TOKENIZER or resolve_tokenizer("draft"))  # the model name every target replica shares
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    command = [sys.executable, "-m", "specd.cli", "serve", "target", "--engine", "sim:scale=0.5"]
    command += ["--model", tokenizer, "--port", str(port), "--no-metrics"]
    with open(tmp_path / "frozen.log", "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    servers = [await serve_sim("draft")] + [await serve_sim("target", model=tokenizer) for _ in range(3)]
    orchestrator = None
    try:
        victim = f"127.0.0.1:{port}"
        await wait_until_serving(victim, 120)
        addresses = [victim] + [f"127.0.0.1:{server.port}" for server in servers[1:]]
        policy = FaultPolicy(step_timeout_s=3.0)
        orchestrator = OrchestratorServer(f"127.0.0.1:{servers[0].port}", ",".join(addresses), workers=2, policy=policy)
        await orchestrator.start("127.0.0.1:0")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
            client = specdecode_pb2_grpc.SpecDecodeStub(channel)
            clean = await run(client, 24)
            router = orchestrator.pool.routers["target"]
            faulted = asyncio.create_task(run(client, 24))
            while router.replicas[victim].load == 0:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)  # its requests have streamed some tokens
            os.kill(process.pid, signal.SIGSTOP)
            try:
                replies = await faulted
                assert router.replicas[victim].down
            finally:
                os.kill(process.pid, signal.SIGCONT)
        assert [reply for reply in replies if isinstance(reply, Exception)] == []
        assert [reply.token_ids for reply in replies] == [reply.token_ids for reply in clean]
        moved = [reply for reply in replies if reply.final.stats.migrations]
        assert moved and all(reply.final.stats.target != victim for reply in moved)

        async def rejoined() -> bool:
            return not router.replicas[victim].down

        assert await until(rejoined, 20)  # SERVING again: back in the pool

        async def no_sessions() -> bool:
            return [await live_sessions(address) for address in addresses] == [0, 0, 0, 0]

        assert await until(no_sessions)  # the frozen one's included: the pool released what moved off it
    finally:
        process.kill()
        process.wait()
        if orchestrator:
            await orchestrator.stop(0)
        for server in servers:
            await server.stop(0)


async def test_a_draft_replica_killed_mid_run_its_requests_go_on_speculating_with_another(ray_local):
    """Two sim draft replicas, two targets, the draft model guessing K = 4 every step: one draft replica
    stops mid-run. Its requests lose at most that step's guesses (target-only, fail closed), then go on
    with the other draft replica; every output is the fault-free one, the pool routes no new request to
    the dead one, and it rejoins when it serves again on its port."""
    servers = [await serve_sim(role) for role in ("draft", "draft", "target", "target")]
    drafts = [f"127.0.0.1:{server.port}" for server in servers[:2]]
    targets = [f"127.0.0.1:{server.port}" for server in servers[2:]]
    orchestrator = OrchestratorServer(",".join(drafts), ",".join(targets), workers=2, drafter="model")
    await orchestrator.start("127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
            client = specdecode_pb2_grpc.SpecDecodeStub(channel)
            clean = await run(client, 16, draft_tokens=4)
            router = orchestrator.pool.routers["draft"]
            faulted = asyncio.create_task(run(client, 16, draft_tokens=4))
            while min(replica.load for replica in router.replicas.values()) == 0:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)
            victim = drafts[0]
            await servers[0].stop(0)
            replies = await faulted
            assert [reply for reply in replies if isinstance(reply, Exception)] == []
            assert [reply.token_ids for reply in replies] == [reply.token_ids for reply in clean]
            moved = [reply.final.stats for reply in replies if reply.final.stats.draft_moves]
            assert moved and all(stats.draft == drafts[1] for stats in moved)
            for stats in moved:  # between the first step (the target's) and the last (one token left): the failed one
                assert list(stats.draft_lengths)[1:-1].count(0) <= 1, str(list(stats.draft_lengths))
            assert router.replicas[victim].down
            metric = orchestrator.metrics.registry.get_sample_value("specd_migrations_total", {"role": "draft"})
            assert metric == len(moved)
            after = await run(client, 8, first=100, draft_tokens=4)
            assert {reply.final.stats.draft for reply in after} == {drafts[1]}

            servers[0] = await serve_sim("draft", port=int(victim.rsplit(":", 1)[1]))

            async def rejoined() -> bool:
                return not router.replicas[victim].down

            assert await until(rejoined)
            served = []  # the workers leave it while their back-off after its failures lasts (up to 8 s), then use it

            async def served_there() -> bool:
                served.extend(await run(client, 4, first=200 + len(served), draft_tokens=4))
                return any(reply.final.stats.draft == victim and not reply.final.stats.draft_moves for reply in served)

            assert await until(served_there, 20)
        assert await live_sessions(drafts[1], draft_pb2_grpc.DraftServiceStub) == 0
    finally:
        await orchestrator.stop(0)
        for server in servers:
            await server.stop(0)


async def test_seeded_sampled_requests_moved_off_a_killed_replica_give_the_fault_free_tokens(tiny_loaded, ray_local):
    """Real (tiny) models, temperature 1 with seeds, speculation off: the target's draws are keyed by
    seed and position, so a request moved mid-stream to another replica samples the very tokens it
    would have. (Speculating, which draws are made depends on the guesses and the K of each step, and
    a moved request's first step is the target's alone: the distribution stays exact, the sample may not.)"""
    from specd.model.transformers_engine import TransformersEngine
    from specd.proto.limits import Limits
    from specd.target_service.server import create_target_server
    from specd.target_service.verifier import Verifier

    async def target_server(port: int = 0):
        server = create_target_server(lambda: Verifier(TransformersEngine(tiny_loaded["target"]), Limits()))
        await server.start(f"127.0.0.1:{port}")
        await server.load()
        return server

    targets = [await target_server() for _ in range(2)]
    addresses = [f"127.0.0.1:{server.port}" for server in targets]
    orchestrator = OrchestratorServer(None, ",".join(addresses), workers=1, drafter="suffix")
    await orchestrator.start("127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
            client = specdecode_pb2_grpc.SpecDecodeStub(channel)

            async def sampled(seed: int):
                request = make_request(prompt(seed), 96, temperature=1.0, seed=seed, ignore_eos=True, draft_tokens=0)
                return await complete(client, request)

            clean = await asyncio.gather(*(sampled(seed) for seed in range(SAMPLED)))
            running = asyncio.gather(*(sampled(seed) for seed in range(SAMPLED)))
            router = orchestrator.pool.routers["target"]
            while router.replicas[addresses[0]].load == 0:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # some tokens streamed
            await targets[0].stop(0)
            replies = await running
        assert [reply.token_ids for reply in replies] == [reply.token_ids for reply in clean]
        assert len({tuple(reply.token_ids) for reply in clean}) == SAMPLED  # seeds that sample apart
        assert sum(reply.final.stats.migrations for reply in replies) >= 1
    finally:
        await orchestrator.stop(0)
        for server in targets:
            await server.stop(0)
