"""Limits answer RESOURCE_EXHAUSTED (or INVALID_ARGUMENT for a too-long prompt, docs/architecture.md §5)
before memory runs out, each set the way `specd serve` sets it, each tested on tiny models."""

import asyncio
import contextlib

import grpc
import pytest
from test_faults import POLICY, Instrumented, Recorder

from specd.draft_service.drafter import Drafter
from specd.draft_service.server import create_draft_server
from specd.model.transformers_engine import TransformersEngine
from specd.orchestrator.server import OrchestratorServer
from specd.proto.limits import Limits
from specd.target_service.server import create_target_server
from specd.target_service.verifier import Verifier
from specd.v1 import common_pb2, specdecode_pb2, specdecode_pb2_grpc, target_pb2_grpc


def request(max_new_tokens: int, k: int = 4, prompt: str = "def quicksort(arr):", **fields):
    return specdecode_pb2.GenerateRequest(
        prompt=prompt, max_new_tokens=max_new_tokens, draft_tokens=k, ignore_eos=True, **fields
    )


@contextlib.asynccontextmanager
async def limited_stack(tiny_loaded, draft_limits=Limits(), target_limits=Limits(), **orchestrator_options):
    """In-process draft and target with these limits (the target slowed by a Recorder), an orchestrator."""
    recorder = Recorder()
    draft = create_draft_server(lambda: Drafter(TransformersEngine(tiny_loaded["draft"]), draft_limits))
    target = create_target_server(lambda: Verifier(TransformersEngine(tiny_loaded["target"]), target_limits))
    await draft.start("127.0.0.1:0")
    await target.start("127.0.0.1:0", Instrumented(recorder))
    for server in (draft, target):
        await server.load()
    orchestrator = OrchestratorServer(
        f"127.0.0.1:{draft.port}", f"127.0.0.1:{target.port}", workers=1, policy=POLICY, **orchestrator_options
    )
    await orchestrator.start("127.0.0.1:0")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}")
    try:
        yield specdecode_pb2_grpc.SpecDecodeStub(channel), recorder, target
    finally:
        await channel.close()
        await orchestrator.stop(0)
        await draft.stop(0)
        await target.stop(0)


async def first_delta(call) -> None:
    async for reply in call:
        if reply.HasField("delta"):
            return


async def collect(call) -> list[int]:
    return [token async for reply in call for token in reply.delta.token_ids]


async def refused(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(call)
    return caught.value


async def test_orchestrator_limits_concurrent_requests_and_prompt_length(tiny_loaded, ray_local):
    async with limited_stack(tiny_loaded, max_concurrent_requests=1, max_prompt_tokens=16) as (client, recorder, _):
        recorder.delay = 0.02
        running = client.Generate(request(1000))
        await first_delta(running)
        error = await refused(client.Generate(request(4)))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-concurrent-requests 1" in error.details() and "retry later" in error.details()
        running.cancel()
        recorder.delay = 0.0
        for _ in range(50):  # the slot frees as soon as the cancel reaches the orchestrator
            try:
                assert len(await collect(client.Generate(request(4)))) == 4
                break
            except grpc.aio.AioRpcError as retry:
                assert retry.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                await asyncio.sleep(0.1)
        else:
            pytest.fail("the slot never freed")
        error = await refused(client.Generate(request(4, prompt_token_ids=[13] * 17, prompt="")))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "17 tokens" in error.details() and "--max-prompt-tokens" in error.details()


async def test_service_session_and_cache_limits_are_resource_exhausted(tiny_loaded, ray_local):
    target_limits = Limits(max_sessions=2, max_cached_tokens=300)
    async with limited_stack(tiny_loaded, target_limits=target_limits) as (client, recorder, target):
        recorder.delay = 0.02
        holding = [client.Generate(request(100)), client.Generate(request(100))]
        for call in holding:
            await first_delta(call)
        error = await refused(client.Generate(request(4)))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "2 live sessions, the limit is 2 (from the target service)" in error.details()
        for call in holding:
            call.cancel()
        recorder.delay = 0.0
        await asyncio.sleep(0.5)
        # One session that keeps growing hits the cache limit mid-stream: refused, not an OOM.
        error = await refused(client.Generate(request(500, k=0)))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "the limit is 300" in error.details()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{target.port}") as channel:
            info = await target_pb2_grpc.TargetServiceStub(channel).Info(common_pb2.InfoRequest())
        assert info.cached_tokens <= 300


async def test_a_full_draft_fails_closed_and_the_output_stays_exact(tiny_loaded, ray_local):
    async with limited_stack(tiny_loaded, draft_limits=Limits(max_sessions=1)) as (client, recorder, _):
        prompts = ["def quicksort(arr):", "The capital of France is"]
        expected = [await collect(client.Generate(request(40, k=0, prompt=p))) for p in prompts]
        recorder.delay = 0.01
        # Two requests, one draft session: the second runs target-only while the draft is full.
        got = await asyncio.gather(*(collect(client.Generate(request(40, prompt=p))) for p in prompts))
        assert got == expected


def test_limits_are_serve_settings():
    from specd.cli import build_parser
    from specd.cli.serve import limits_from_args

    args = build_parser().parse_args(
        [
            "serve",
            "target",
            "--max-sessions",
            "3",
            "--max-cached-tokens",
            "500",
            "--max-session-tokens",
            "200",
            "--max-draft-tokens",
            "6",
        ]
    )
    assert limits_from_args(args) == Limits(
        max_sessions=3,
        max_cached_tokens=500,
        max_session_tokens=200,
        max_draft_tokens=6,
        max_batch_size=args.max_batch_size,
        max_batch_tokens=args.max_batch_tokens,
    )
    args = build_parser().parse_args(
        [
            "serve",
            "orchestrator",
            "--draft",
            "d:1",
            "--target",
            "t:2",
            "--max-concurrent-requests",
            "8",
            "--max-prompt-tokens",
            "2048",
            "--propose-timeout",
            "2",
            "--call-timeout",
            "60",
            "--target-retry",
            "15",
        ]
    )
    assert (args.max_concurrent_requests, args.max_prompt_tokens) == (8, 2048)
    assert (args.propose_timeout, args.call_timeout, args.target_retry) == (2, 60, 15)


def test_the_prefix_cache_budget_is_a_serve_and_an_up_setting(monkeypatch, capsys):
    """--prefix-cache-tokens on `specd serve draft|target` and `specd up` (both services, here and on a
    cluster): into Limits, and onto the command line of each service a stack here starts."""
    from specd.cli import build_parser
    from specd.cli.serve import limits_from_args
    from specd.cli.up import run_here
    from specd.deploy import local
    from specd.proto.limits import AUTO_PREFIX_TOKENS

    parse = build_parser().parse_args
    for role in ("draft", "target"):
        assert limits_from_args(parse(["serve", role])).prefix_cache_tokens == AUTO_PREFIX_TOKENS
        assert limits_from_args(parse(["serve", role, "--prefix-cache-tokens", "0"])).prefix_cache_tokens == 0
    assert limits_from_args(parse(["serve", "target", "--prefix-cache-tokens", "auto"])).prefix_cache_tokens == -1
    with pytest.raises(SystemExit):
        parse(["serve", "target", "--prefix-cache-tokens", "-5"])
    assert "--prefix-cache-tokens" in capsys.readouterr().err
    up = parse(["up", "--prefix-cache-tokens", "2048", "--device", "cpu", "--draft-device", "cpu"])
    assert limits_from_args(up).prefix_cache_tokens == 2048  # what a cluster's service actors get
    assert "--prefix-cache-tokens" not in up.cluster_only  # a stack here passes it on too

    started = []

    class Started(local.LocalStack):
        async def start(self):
            started.extend(self._service(role) for role in ("draft", "target"))
            raise KeyboardInterrupt  # `specd up` stops here, as on Ctrl-C

        def _spawn(self, name, port, metrics_port, serve_args, env=None):
            return serve_args

        def stop(self, timeout_s=None):
            pass

    monkeypatch.setattr(local, "LocalStack", Started)
    run_here(up, {"draft": "off", "target": "off"})
    assert [args[args.index("--prefix-cache-tokens") + 1] for args in started] == ["2048", "2048"]
    started.clear()
    run_here(parse(["up", "--device", "cpu", "--draft-device", "cpu"]), {"draft": "off", "target": "off"})
    assert started and not any("--prefix-cache-tokens" in args for args in started)  # the services' own default


def test_exactness_is_a_serve_and_an_up_setting(monkeypatch, capsys):
    """--exactness on `specd serve draft|target` and `specd up`: bitwise by default, batched on request,
    anything else refused by the parser; a stack here passes it to both services, a cluster's config
    carries it to both service actors."""
    from specd.cli import build_parser
    from specd.cli.up import run_here
    from specd.deploy import local

    parse = build_parser().parse_args
    for role in ("draft", "target"):
        assert parse(["serve", role]).exactness == "bitwise"
        assert parse(["serve", role, "--exactness", "batched"]).exactness == "batched"
    with pytest.raises(SystemExit):
        parse(["serve", "target", "--exactness", "fast"])
    assert "--exactness" in capsys.readouterr().err
    started = []

    class Started(local.LocalStack):
        async def start(self):
            started.extend(self._service(role) for role in ("draft", "target"))
            raise KeyboardInterrupt

        def _spawn(self, name, port, metrics_port, serve_args, env=None):
            return serve_args

        def stop(self, timeout_s=None):
            pass

    monkeypatch.setattr(local, "LocalStack", Started)
    up = parse(["up", "--exactness", "batched", "--device", "cpu", "--draft-device", "cpu"])
    assert "--exactness" not in up.cluster_only
    run_here(up, {"draft": "off", "target": "off"})
    assert [args[args.index("--exactness") + 1] for args in started] == ["batched", "batched"]
    configs = []

    class Cluster:
        def __init__(self, config):
            configs.append(config)

        async def start(self):
            raise KeyboardInterrupt

        def stop(self):
            pass

    from specd.cli.up import run_on_cluster
    from specd.deploy import cluster

    monkeypatch.setattr(cluster, "ClusterStack", Cluster)
    run_on_cluster(
        parse(["up", "--ray-address", "auto", "--exactness", "batched"]), {"draft": "auto", "target": "auto"}
    )
    assert [config.exactness for config in configs] == ["batched"]
    assert cluster.ClusterConfig("auto").exactness == "bitwise"
