"""Replicas added and removed while serving (issue 39, specd.v1.Replicas, `specd scale`), on the
simulated engine: a pool of 2 target replicas grows to 4 and shrinks back to 2 under load, no
request fails, the removed ones drain (no new request, no session left) and the added ones serve."""

import asyncio

import grpc
import pytest
from conftest import serve_sim

from specd.cli import main as cli_main
from specd.orchestrator.server import OrchestratorServer
from specd.proto.client import complete, make_request
from specd.v1 import common_pb2, specdecode_pb2, specdecode_pb2_grpc, target_pb2_grpc

STREAMS = 6


@pytest.fixture(scope="module")
async def stack(ray_local):
    """A sim draft, four sim targets (an orchestrator over the first two), and a draft of another model."""
    draft, *servers = [await serve_sim(role) for role in ("draft", "target", "target", "target", "target")]
    servers.append(await serve_sim("draft", model="another"))
    targets = [f"127.0.0.1:{server.port}" for server in servers[:4]]
    orchestrator = OrchestratorServer(f"127.0.0.1:{draft.port}", ",".join(targets[:2]), workers=2)
    await orchestrator.start("127.0.0.1:0")
    address = f"127.0.0.1:{orchestrator.port}"
    channel = grpc.aio.insecure_channel(address)
    yield (
        specdecode_pb2_grpc.SpecDecodeStub(channel),
        specdecode_pb2_grpc.ReplicasStub(channel),
        targets,
        f"127.0.0.1:{servers[4].port}",
        address,
    )
    await channel.close()
    await orchestrator.stop(0)
    for server in (draft, *servers):
        await server.stop(0)


async def test_two_replicas_grow_to_four_and_back_under_load_and_no_request_fails(stack):
    client, replicas, targets, _, _ = stack
    served: list[tuple[float, str]] = []  # (when it started, the target replica that served it)
    failures: list[str] = []
    stop = asyncio.Event()

    async def user(number: int) -> None:
        turn = 0
        while not stop.is_set():
            turn += 1
            started = asyncio.get_running_loop().time()
            try:  # prompts of their own: the load decides where each goes
                reply = await complete(
                    client, make_request(f"# user {number} turn {turn}\ndef f():", 16, ignore_eos=True)
                )
                served.append((started, reply.final.stats.target))
            except grpc.aio.AioRpcError as error:
                failures.append(f"{error.code().name}: {error.details()}")

    users = [asyncio.create_task(user(number)) for number in range(STREAMS)]
    clock = asyncio.get_running_loop().time
    await asyncio.sleep(1.0)
    for address in targets[2:]:
        listed = await replicas.Add(specdecode_pb2.ReplicaRequest(role="target", address=address))
        assert address in [r.address for r in listed.replicas if r.role == "target" and not r.draining]
    grown = clock()
    await asyncio.sleep(2.0)
    removals = [
        replicas.Remove(specdecode_pb2.ReplicaRequest(role="target", address=address, drain_seconds=30))
        for address in targets[:2]
    ]
    removed_at = clock()
    await asyncio.gather(*removals)  # each answers when its own replica has drained
    drained_at = clock()
    listed = await replicas.List(specdecode_pb2.ListReplicasRequest())
    assert sorted(r.address for r in listed.replicas if r.role == "target") == sorted(targets[2:])
    await asyncio.sleep(1.0)
    stop.set()
    await asyncio.gather(*users)

    assert failures == []
    assert {target for started, target in served if started > grown} >= set(targets[2:])  # the new ones serve
    late = [target for started, target in served if started > removed_at + 0.05]
    assert late and not set(late) & set(targets[:2])  # nothing new went to a removed replica
    assert drained_at - removed_at < 30  # each Remove answered when its requests had ended
    assert [await live_sessions(address) for address in targets[:2]] == [0, 0]  # drained: no session left


async def test_bad_changes_are_refused_with_the_right_code(stack):
    _, replicas, targets, other_draft, _ = stack
    serving = await serving_targets(replicas)
    cases = [
        (replicas.Add, "target", serving[0], grpc.StatusCode.ALREADY_EXISTS),
        (replicas.Add, "target", "127.0.0.1:1", grpc.StatusCode.UNAVAILABLE),  # nothing listens there
        (replicas.Add, "draft", other_draft, grpc.StatusCode.FAILED_PRECONDITION),  # another model
        (replicas.Add, "reviewer", targets[0], grpc.StatusCode.INVALID_ARGUMENT),
        (replicas.Remove, "target", "127.0.0.1:1", grpc.StatusCode.NOT_FOUND),
    ]
    for call, role, address, code in cases:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call(specdecode_pb2.ReplicaRequest(role=role, address=address), timeout=30)
        assert caught.value.code() == code, (role, address, caught.value.details())
    for address in serving[1:]:
        await replicas.Remove(specdecode_pb2.ReplicaRequest(role="target", address=address))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await replicas.Remove(specdecode_pb2.ReplicaRequest(role="target", address=serving[0]))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "last" in caught.value.details()


async def test_specd_scale_lists_adds_and_removes(stack, capsys):
    _, replicas, targets, _, address = stack

    async def scale(*words: str) -> int:
        return await asyncio.to_thread(cli_main, ["scale", "--server", address, *words])

    absent = [target for target in targets if target not in await serving_targets(replicas)]
    assert await scale("add", "target", absent[0]) == 0
    capsys.readouterr()
    assert await scale("list") == 0
    listing = capsys.readouterr().out
    assert absent[0] in listing and "serving" in listing
    assert await scale("remove", "target", absent[0], "--drain-seconds", "10") == 0
    assert absent[0] not in capsys.readouterr().out
    assert await scale("remove", "target", "127.0.0.1:1") == 2
    assert "NOT_FOUND" in capsys.readouterr().err


async def serving_targets(replicas) -> list[str]:
    listed = await replicas.List(specdecode_pb2.ListReplicasRequest())
    return [r.address for r in listed.replicas if r.role == "target" and not r.draining]


async def live_sessions(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        return (await target_pb2_grpc.TargetServiceStub(channel).Info(common_pb2.InfoRequest())).live_sessions
