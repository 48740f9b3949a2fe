"""A target replica that dies mid-run (issue 40, orchestrator/migration.py), on the simulated engine:
its requests move to the other replicas and finish with the tokens a fault-free run gives, none
fails, no session is left behind, and the replica rejoins once it serves again."""

import asyncio

import grpc
import pytest
from conftest import serve_sim

from specd.orchestrator.faults import FaultPolicy
from specd.orchestrator.server import OrchestratorServer
from specd.proto.client import complete, make_request
from specd.v1 import common_pb2, specdecode_pb2_grpc, target_pb2_grpc

STREAMS = 8
TOKENS = 160  # long enough that the kill finds requests mid-stream


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


async def run(client, count: int, first: int = 0) -> list:
    """Requests `first` to `first + count` (greedy) over STREAMS streams; each reply or its error, in order."""
    queue = asyncio.Queue()
    for number in range(count):
        queue.put_nowait(number)
    replies: list = [None] * count

    async def stream() -> None:
        while not queue.empty():
            number = queue.get_nowait()
            try:
                request = make_request(prompt(first + number), TOKENS, ignore_eos=True)
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
    await asyncio.sleep(0.3)  # and have streamed some of their tokens
    victim = max(router.replicas.values(), key=lambda replica: replica.load).name
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
    metric = orchestrator.metrics.registry.get_sample_value("specd_migrations_total")
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


async def live_sessions(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        return (await target_pb2_grpc.TargetServiceStub(channel).Info(common_pb2.InfoRequest())).live_sessions


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

            clean = await asyncio.gather(*(sampled(seed) for seed in range(8)))
            running = asyncio.gather(*(sampled(seed) for seed in range(8)))
            router = orchestrator.pool.routers["target"]
            while router.replicas[addresses[0]].load == 0:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # some tokens streamed
            await targets[0].stop(0)
            replies = await running
        assert [reply.token_ids for reply in replies] == [reply.token_ids for reply in clean]
        assert len({tuple(reply.token_ids) for reply in clean}) == 8  # seeds that sample apart
        assert sum(reply.final.stats.migrations for reply in replies) >= 1
    finally:
        await orchestrator.stop(0)
        for server in targets:
            await server.stop(0)
