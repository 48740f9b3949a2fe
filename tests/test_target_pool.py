"""A pool of target replicas behind one orchestrator (issue 39), on the simulated engine: each new
request goes to a replica by load and prefix (orchestrator/router.py), says which in its stats, and
gets the same tokens from whichever replica serves it."""

import asyncio

import grpc
import pytest
from conftest import TOKENIZER, serve_engines

from specd.model.fetch import resolve_tokenizer
from specd.model.loaded import folder_tokenizer
from specd.model.sim_engine import SimEngine, SimSettings
from specd.orchestrator.server import OrchestratorServer
from specd.proto.client import complete, make_request
from specd.proto.limits import Limits
from specd.target_service.server import create_target_server
from specd.target_service.verifier import Verifier
from specd.v1 import common_pb2, specdecode_pb2_grpc, target_pb2_grpc

SYSTEMS = ["You are a careful Python reviewer. " * 6, "Answer in French, briefly and politely. " * 6]


@pytest.fixture(scope="module")
async def pool(ray_local):
    """A sim draft, two sim target replicas, an orchestrator over both."""
    tokenizer = folder_tokenizer(TOKENIZER or resolve_tokenizer("draft"))[0]
    settings = SimSettings(scale=0.5)
    services = await serve_engines(
        lambda limits: SimEngine("draft", "sim-draft", tokenizer, settings),
        lambda limits: SimEngine("target", "sim-target", tokenizer, settings),
    )
    second = create_target_server(lambda: Verifier(SimEngine("target", "sim-target", tokenizer, settings), Limits()))
    await second.start("127.0.0.1:0")
    await second.load()
    targets = [f"127.0.0.1:{services.target_server.port}", f"127.0.0.1:{second.port}"]
    orchestrator = OrchestratorServer(f"127.0.0.1:{services.draft_server.port}", ",".join(targets), workers=2)
    await orchestrator.start("127.0.0.1:0")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}")
    yield specdecode_pb2_grpc.SpecDecodeStub(channel), targets, orchestrator
    await channel.close()
    await orchestrator.stop(0)
    await second.stop(0)
    await services.close()


async def test_requests_sharing_a_system_prompt_stay_together_and_the_replicas_share_the_load(pool):
    client, targets, orchestrator = pool
    one = [SYSTEMS[0] + f"Review snippet {i}:" for i in range(3)]
    other = [SYSTEMS[1] + f"Question {i}:" for i in range(3)]
    first = await complete(client, make_request(one[0], 16, ignore_eos=True))
    second = await complete(client, make_request(other[0], 16, ignore_eos=True))  # nothing in common: the idle one
    assert {first.final.stats.target, second.final.stats.target} == set(targets)
    rest = await asyncio.gather(*(complete(client, make_request(p, 16, ignore_eos=True)) for p in one[1:] + other[1:]))
    assert [c.final.stats.target for c in rest] == [first.final.stats.target] * 2 + [second.final.stats.target] * 2
    assert orchestrator.pool.router.decisions["affinity"] == 4
    assert all(replica.load == 0 for replica in orchestrator.pool.router.replicas.values())


async def test_a_request_gives_the_same_tokens_on_either_replica(pool):
    """The sim engine's tokens are a function of the context: the router's choice changes no output.
    The same prompt under several cache salts (no affinity between them: the load decides, so both
    replicas serve it), and greedy speculation off."""
    client, targets, _ = pool
    prompt = "def quicksort(arr):"
    served = [await complete(client, make_request(prompt, 24, ignore_eos=True, cache_salt=f"t{i}")) for i in range(6)]
    off = await complete(client, make_request(prompt, 24, ignore_eos=True, draft_tokens=0))
    assert {c.final.stats.target for c in served} == set(targets)
    assert all(c.token_ids == off.token_ids for c in served) and len(off.token_ids) == 24
    for _ in range(50):  # each request's sessions are released as it ends
        if [await target_sessions(address) for address in targets] == [0, 0]:
            break
        await asyncio.sleep(0.1)
    assert [await target_sessions(address) for address in targets] == [0, 0]


async def target_sessions(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        return (await target_pb2_grpc.TargetServiceStub(channel).Info(common_pb2.InfoRequest())).live_sessions
