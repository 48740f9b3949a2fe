"""Pools of target and draft replicas behind one orchestrator (issue 39), on the simulated engine:
each new request goes to a target replica and a draft replica by load and prefix (one router per
role, orchestrator/router.py), says which in its stats, and gets the same tokens from whichever
replicas serve it."""

import asyncio

import grpc
import pytest
from conftest import serve_sim

from specd.orchestrator.server import OrchestratorServer
from specd.proto.client import complete, make_request
from specd.v1 import common_pb2, draft_pb2_grpc, specdecode_pb2_grpc, target_pb2_grpc

SYSTEMS = ["You are a careful Python reviewer. " * 6, "Answer in French, briefly and politely. " * 6]


@pytest.fixture(scope="module")
async def pool(ray_local):
    """Two sim draft replicas, two sim target replicas, an orchestrator over both pools."""
    servers = [await serve_sim(role) for role in ("draft", "draft", "target", "target")]
    drafts, targets = ([f"127.0.0.1:{server.port}" for server in pair] for pair in (servers[:2], servers[2:]))
    orchestrator = OrchestratorServer(",".join(drafts), ",".join(targets), workers=2)
    await orchestrator.start("127.0.0.1:0")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}")
    yield specdecode_pb2_grpc.SpecDecodeStub(channel), targets, orchestrator, drafts
    await channel.close()
    await orchestrator.stop(0)
    for server in servers:
        await server.stop(0)


async def test_requests_sharing_a_system_prompt_stay_together_and_the_replicas_share_the_load(pool):
    client, targets, orchestrator, drafts = pool
    one = [SYSTEMS[0] + f"Review snippet {i}:" for i in range(3)]
    other = [SYSTEMS[1] + f"Question {i}:" for i in range(3)]
    first = await complete(client, make_request(one[0], 16, ignore_eos=True))
    second = await complete(client, make_request(other[0], 16, ignore_eos=True))  # nothing in common: the idle one
    assert {first.final.stats.target, second.final.stats.target} == set(targets)
    rest = await asyncio.gather(*(complete(client, make_request(p, 16, ignore_eos=True)) for p in one[1:] + other[1:]))
    assert [c.final.stats.target for c in rest] == [first.final.stats.target] * 2 + [second.final.stats.target] * 2
    for role in ("target", "draft"):  # the drafts' router places them alike: each draft sees one system prompt
        router = orchestrator.pool.routers[role]
        assert router.decisions["affinity"] == 4, role
        assert all(replica.load == 0 for replica in router.replicas.values()), role
        for reason, count in router.decisions.items():  # the metrics count what the router decided
            labels = {"role": role, "reason": reason}
            assert orchestrator.metrics.registry.get_sample_value("specd_routes_total", labels) == count
    by_target = {c.final.stats.target: c.final.stats.draft for c in (first, second, *rest)}
    assert set(by_target.values()) == set(drafts) and len(by_target) == 2


async def test_a_request_gives_the_same_tokens_on_either_replica(pool):
    """The sim engine's tokens are a function of the context: the router's choice changes no output.
    The same prompt under several cache salts (no affinity between them: the load decides, so both
    replicas serve it), and greedy speculation off."""
    client, targets, _, drafts = pool
    prompt = "def quicksort(arr):"
    model = dict(drafter="model", draft_tokens=4)  # the draft guesses every step
    served = [
        await complete(client, make_request(prompt, 24, ignore_eos=True, cache_salt=f"t{i}", **model)) for i in range(6)
    ]
    off = await complete(client, make_request(prompt, 24, ignore_eos=True, draft_tokens=0))
    assert {c.final.stats.target for c in served} == set(targets)
    assert {c.final.stats.draft for c in served} == set(drafts)
    assert all(c.token_ids == off.token_ids for c in served) and len(off.token_ids) == 24
    assert all(c.final.stats.drafted > 0 for c in served)  # each draft replica guessed
    for _ in range(50):  # each request's sessions are released as it ends, on every replica
        if await live_sessions(targets, drafts) == [0] * 4:
            break
        await asyncio.sleep(0.1)
    assert await live_sessions(targets, drafts) == [0] * 4


async def test_a_lookup_only_request_is_routed_to_no_draft(pool):
    client, targets, orchestrator, _ = pool
    before = orchestrator.pool.routers["draft"].decisions.total()
    reply = await complete(client, make_request("def fizzbuzz(n):", 8, ignore_eos=True, drafter="ngram"))
    assert reply.final.stats.draft == "" and reply.final.stats.target in targets
    assert orchestrator.pool.routers["draft"].decisions.total() == before


async def live_sessions(targets: list[str], drafts: list[str]) -> list[int]:
    counts = []
    for stub, addresses in ((target_pb2_grpc.TargetServiceStub, targets), (draft_pb2_grpc.DraftServiceStub, drafts)):
        for address in addresses:
            async with grpc.aio.insecure_channel(address) as channel:
                counts.append((await stub(channel).Info(common_pb2.InfoRequest())).live_sessions)
    return counts
