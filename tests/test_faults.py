"""Faults, each injected for real on tiny models: a draft process killed (SIGKILL) or frozen
(SIGSTOP) mid-stream, a target restarted or gone, a Ray worker killed, client deadlines and
cancels. The output is never a wrong token, no request is lost silently, nothing leaks.

The draft runs as its own process (`specd serve draft`), so killing it is a real crash; the
target runs in this process behind an interceptor that can slow it down (so the outage spans
enough steps to see what happens) and records the deadline each call arrives with.
"""

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specd.deploy.local import free_port
from specd.model.transformers_engine import TransformersEngine
from specd.orchestrator.faults import FaultPolicy
from specd.orchestrator.remote import wait_until_serving
from specd.orchestrator.server import OrchestratorServer
from specd.proto.auth import ServerSecurity
from specd.proto.limits import Limits
from specd.target_service.server import create_target_server
from specd.target_service.verifier import Verifier
from specd.v1 import common_pb2, draft_pb2_grpc, specdecode_pb2, specdecode_pb2_grpc, target_pb2_grpc

# Deadlines of half a second and less, and calls timed against them: on a machine shared with another
# test, a Propose misses its deadline or no target call starts within a 1.5 s request.
pytestmark = pytest.mark.serial

PROMPT = "def quicksort(arr):"
POLICY = FaultPolicy(propose_timeout_s=0.5, call_timeout_s=5.0, target_retry_s=2.0, draft_backoff_s=(0.2, 1.0))


def request(k: int, max_new_tokens: int) -> specdecode_pb2.GenerateRequest:
    """The draft model guesses every step (no prompt lookup): these faults are the draft service's."""
    return specdecode_pb2.GenerateRequest(
        prompt=PROMPT, max_new_tokens=max_new_tokens, draft_tokens=k, ignore_eos=True, drafter="model"
    )


class Recorder(grpc.aio.ServerInterceptor):
    """Slows every specd call by `delay` seconds a step (a Decode run of n tokens: n steps), counts
    the Verify calls and records the deadline each session call (all but Release) arrived with."""

    def __init__(self):
        self.delay = 0.0
        self.time_remaining: list[float | None] = []
        self.cancel_next = False  # end the next call CANCELLED, as a stopping server may
        self.verifies = 0

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith("/specd.v1.") or handler.unary_unary is None:
            return handler
        behavior = handler.unary_unary

        async def slowed(request, context):
            if not details.method.endswith("/Release"):  # cleanup, sent after the request ended: its own cap
                self.time_remaining.append(context.time_remaining())
            self.verifies += details.method.endswith("/Verify")
            if self.delay:
                await asyncio.sleep(self.delay * max(1, getattr(request, "steps", 1)))
            if self.cancel_next and not details.method.endswith("/Release"):
                self.cancel_next = False
                await context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")
            return await behavior(request, context)

        return grpc.unary_unary_rpc_method_handler(slowed, handler.request_deserializer, handler.response_serializer)


class Instrumented(ServerSecurity):
    """No auth, plus the recorder."""

    def __init__(self, recorder: Recorder):
        super().__init__()
        object.__setattr__(self, "recorder", recorder)

    def interceptors(self):
        return [self.recorder, *super().interceptors()]


class DraftProcess:
    """`specd serve draft` on a tiny model, on a fixed port so a restart comes back at the same address."""

    role = "draft"
    extra_args: tuple[str, ...] = ()  # more `specd serve` flags
    serving_timeout_s = 120

    def __init__(self, model_dir, log_path):
        self.model_dir, self.log_path = model_dir, log_path
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def spawn(self) -> None:
        command = [
            sys.executable,
            "-m",
            "specd.cli",
            "serve",
            self.role,
            "--model",
            str(self.model_dir),
            "--dtype",
            "float32",
            "--threads",
            "1",
            "--port",
            str(self.port),
            "--no-metrics",
            *self.extra_args,
        ]
        self.process = subprocess.Popen(
            command,
            stdout=open(self.log_path, "a"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    async def serving(self) -> None:
        await wait_until_serving(self.address, timeout_s=self.serving_timeout_s)

    def signal(self, signum: int) -> None:
        os.kill(self.process.pid, signum)

    def kill(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


class FaultStack:
    def __init__(self, draft: DraftProcess, target, recorder: Recorder, target_loaded):
        self.draft, self.target, self.recorder, self.target_loaded = draft, target, recorder, target_loaded
        self.orchestrator: OrchestratorServer | None = None
        self.channels: list[grpc.aio.Channel] = []

    async def start_orchestrator(self, **options) -> specdecode_pb2_grpc.SpecDecodeStub:
        if self.orchestrator:
            await self.orchestrator.stop(0)
        self.orchestrator = OrchestratorServer(
            self.draft.address, f"127.0.0.1:{self.target.port}", workers=1, policy=POLICY, **options
        )
        await self.orchestrator.start("127.0.0.1:0")
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.orchestrator.port}")
        self.channels.append(channel)
        return specdecode_pb2_grpc.SpecDecodeStub(channel)

    async def restart_target(self, gap_s: float, stop: bool = True) -> None:
        """Stop the target (its sessions die with it), wait, start a fresh one on the same port."""
        port = self.target.port
        if stop:
            await self.target.stop(0)
        await asyncio.sleep(gap_s)
        loaded = self.target_loaded
        self.target = create_target_server(lambda: Verifier(TransformersEngine(loaded), Limits()))
        await self.target.start(f"127.0.0.1:{port}", Instrumented(self.recorder))
        await self.target.load()

    async def live_sessions(self) -> tuple[int, int]:
        async with grpc.aio.insecure_channel(self.draft.address) as channel:
            draft = await draft_pb2_grpc.DraftServiceStub(channel).Info(common_pb2.InfoRequest(), timeout=5)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.target.port}") as channel:
            target = await target_pb2_grpc.TargetServiceStub(channel).Info(common_pb2.InfoRequest(), timeout=5)
        return draft.live_sessions, target.live_sessions

    async def sessions_reach(self, expected: tuple[int, int], timeout_s: float = 10.0) -> tuple[int, int]:
        deadline = time.monotonic() + timeout_s
        while (live := await self.live_sessions()) != expected and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return live

    async def sessions_drain(self, timeout_s: float = 10.0) -> tuple[int, int]:
        return await self.sessions_reach((0, 0), timeout_s)


@pytest.fixture(scope="module")
async def faults(tiny_dirs, tiny_loaded, ray_local, tmp_path_factory):
    # The draft serves the target's own weights: it then agrees at every position (the tiny noisy
    # draft drifts away after ~150 tokens), so each speculative step shows as a multi-token delta.
    draft = DraftProcess(tiny_dirs["target"], tmp_path_factory.mktemp("faults") / "draft.log")
    draft.spawn()
    recorder = Recorder()
    target = create_target_server(lambda: Verifier(TransformersEngine(tiny_loaded["target"]), Limits()))
    await target.start("127.0.0.1:0", Instrumented(recorder))
    await target.load()
    stack = FaultStack(draft, target, recorder, tiny_loaded["target"])
    try:
        await draft.serving()
        stack.client = await stack.start_orchestrator()
        yield stack
    finally:
        for channel in stack.channels:
            await channel.close()
        if stack.orchestrator:
            await stack.orchestrator.stop(0)
        await stack.target.stop(0)
        draft.kill()


async def baseline(client, max_new_tokens: int) -> list[int]:
    tokens = []
    async for reply in client.Generate(request(0, max_new_tokens)):
        tokens += reply.delta.token_ids
    return tokens


async def stream_through_fault(client, recorder: Recorder, max_new_tokens: int, inject, recover, recovered):
    """Stream a greedy K=4 request; inject() after 3 deltas, recover() once recovered() says so.

    Returns (tokens, final, phases): phases[i] is ("before", "during" or "after", K, tokens) for delta
    i, one delta per step, K its guesses (the final stats' draft_lengths: 0 for a target-only step).
    """
    tokens, final, phases, phase, verifies = [], None, [], "before", 0
    async for reply in client.Generate(request(4, max_new_tokens)):
        if reply.HasField("final"):
            final = reply.final
            continue
        tokens += reply.delta.token_ids
        phases.append((phase, len(reply.delta.token_ids)))
        if phase == "before" and len(phases) == 3:
            await inject()
            phase = "during"
        elif phase == "during" and recovered():
            await recover()
            phase, verifies = "after", recorder.verifies
        elif phase == "after" and recorder.verifies > verifies:
            recorder.delay = 0.0  # speculation is back: the rest may run at full speed
    assert len(final.stats.draft_lengths) == len(phases)
    return tokens, final, [(phase, k, size) for (phase, size), k in zip(phases, final.stats.draft_lengths)]


def check_fail_closed(phases) -> None:
    during = [(k, size) for phase, k, size in phases if phase == "during"]
    after = [k for phase, k, _ in phases if phase == "after"]
    assert sum(size for _, size in during) >= 8, "the request kept streaming while the draft was out"
    # Target-only while the draft is out (K = 0: Decode runs, each token slowed as one step), until
    # speculation resumes. (A step in flight at the fault may still finish speculatively, and on a
    # loaded machine the test notices a comeback a second or more after the orchestrator did.)
    settled = during[2:]
    resumed = next((i for i, (k, _) in enumerate(settled) if k > 0), len(settled))
    target_only = sum(size for _, size in settled[:resumed])
    assert resumed >= 1 and target_only >= 8, f"target-only while the draft is out: (K, tokens) {during}"
    assert any(k > 0 for k in after), "speculation resumed once the draft was back"


async def test_draft_killed_mid_stream_fails_closed_then_resumes_after_restart(faults):
    max_new_tokens = 800
    expected = await baseline(faults.client, max_new_tokens)
    faults.recorder.delay = 0.1  # 10 target steps/s: the draft's restart (a new process) spans many of them
    restarted = []

    async def kill_and_restart():
        faults.draft.kill()  # SIGKILL: no goodbye, sessions gone
        faults.draft.spawn()
        restarted.append(asyncio.create_task(faults.draft.serving()))

    async def nothing():
        pass

    started = time.monotonic()
    tokens, final, phases = await stream_through_fault(
        faults.client, faults.recorder, max_new_tokens, kill_and_restart, nothing, lambda: restarted[0].done()
    )
    faults.recorder.delay = 0.0
    print(
        f"draft kill: {len(phases)} deltas in {time.monotonic() - started:.1f} s, "
        f"{sum(p == 'during' for p, _, _ in phases)} while the draft was down; resyncs {final.stats.resyncs}"
    )
    assert tokens == expected  # exact: every token is the target's own
    assert final.finish_reason == "length"
    check_fail_closed(phases)
    assert final.stats.resyncs >= 1  # the restarted draft had lost the session: re-prefilled
    assert final.stats.drafted > 4 * sum(p == "before" for p, _, _ in phases)  # it drafted again after the restart
    assert await faults.sessions_drain() == (0, 0)


async def test_draft_frozen_past_its_deadline_fails_closed_then_resumes(faults):
    max_new_tokens = 600
    expected = await baseline(faults.client, max_new_tokens)
    faults.recorder.delay = 0.02
    frozen_at = []

    async def freeze():
        faults.draft.signal(signal.SIGSTOP)  # alive but silent: every Propose runs past its 0.5 s cap
        frozen_at.append(time.monotonic())

    async def thaw():
        faults.draft.signal(signal.SIGCONT)

    try:
        tokens, final, phases = await stream_through_fault(
            faults.client, faults.recorder, max_new_tokens, freeze, thaw, lambda: time.monotonic() - frozen_at[0] > 3
        )
    finally:
        faults.draft.signal(signal.SIGCONT)
        faults.recorder.delay = 0.0
    assert tokens == expected
    check_fail_closed(phases)
    assert await faults.sessions_drain() == (0, 0)


async def test_target_restarted_mid_request_is_retried_and_the_output_stays_exact(faults):
    expected = await baseline(faults.client, 200)
    faults.recorder.delay = 0.01
    tokens, restarted = [], False
    async for reply in faults.client.Generate(request(4, 200)):
        tokens += reply.delta.token_ids
        if len(tokens) > 20 and not restarted:
            restarted = True
            await faults.restart_target(gap_s=0.7)  # UNAVAILABLE for 0.7 s, then NOT_FOUND: re-prefill
    faults.recorder.delay = 0.0
    assert tokens == expected
    assert await faults.sessions_drain() == (0, 0)


async def test_a_call_the_target_cancelled_is_retried_and_the_output_stays_exact(faults):
    expected = await baseline(faults.client, 40)
    tokens, injected = [], False
    async for reply in faults.client.Generate(request(4, 40)):
        tokens += reply.delta.token_ids
        if len(tokens) > 10 and not injected:
            injected = faults.recorder.cancel_next = True  # the target's next call ends CANCELLED
    assert not faults.recorder.cancel_next, "a call was cancelled"
    assert tokens == expected


async def test_target_gone_ends_the_request_unavailable_within_the_retry_window(faults):
    faults.recorder.delay = 0.01
    port = faults.target.port
    started, tokens = None, 0
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for reply in faults.client.Generate(request(4, 1000)):
            tokens += len(reply.delta.token_ids)
            if tokens > 10 and started is None:
                await faults.target.stop(0)  # and it does not come back
                started = time.monotonic()
    waited = time.monotonic() - started
    faults.recorder.delay = 0.0
    print(f"target gone: UNAVAILABLE after {waited:.1f} s: {caught.value.details()}")
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "the target service did not answer" in caught.value.details() and "retry it" in caught.value.details()
    assert POLICY.target_retry_s - 0.3 < waited < POLICY.target_retry_s + 3
    # Bring it back (empty) for the next tests; the draft's session was released by the orchestrator.
    await faults.restart_target(gap_s=0, stop=False)
    # Each worker's channel reconnects after its back-off (up to 1 s, orchestrator/remote.py), riding it
    # out within the retry window: one request through each (ties rotate) leaves every channel ready for
    # the next test, whose 1.5 s deadline would otherwise spend itself waiting on a reconnect.
    for _ in faults.orchestrator.pool.actors:
        assert len(await baseline(faults.client, 4)) == 4
    assert faults.target.port == port
    assert await faults.sessions_drain() == (0, 0)


async def test_client_deadline_reaches_both_services_and_ends_deadline_exceeded(faults):
    faults.recorder.delay = 0.05
    faults.recorder.time_remaining.clear()
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in faults.client.Generate(request(4, 1000), timeout=1.5):
            pass
    faults.recorder.delay = 0.0
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 3
    seen = [left for left in faults.recorder.time_remaining if left is not None]
    assert seen and len(seen) == len(faults.recorder.time_remaining), "every target call carries a deadline"
    assert max(seen) <= 1.55, "timeout = min(the client's seconds left, the per-call cap)"
    # No client deadline: the per-call cap (5 s here) still bounds every call.
    faults.recorder.time_remaining.clear()
    await baseline(faults.client, 4)
    seen = faults.recorder.time_remaining
    assert seen and all(left is not None and 0 < left <= POLICY.call_timeout_s + 0.05 for left in seen), seen
    assert await faults.sessions_drain() == (0, 0)


async def test_client_cancel_releases_sessions_on_both_services(faults):
    faults.recorder.delay = 0.02
    call = faults.client.Generate(request(4, 1000))
    async for reply in call:
        if reply.HasField("delta"):
            break
    # The first token is the target's alone; the draft's session opens with the first Propose after it.
    assert await faults.sessions_reach((1, 1)) == (1, 1)
    call.cancel()
    faults.recorder.delay = 0.0
    assert await faults.sessions_drain() == (0, 0)


async def test_worker_actor_killed_mid_stream_the_request_goes_on_where_it_was(faults):
    """The Ray worker running a request dies mid-stream: the pool carries the request on (the restarted
    actor, as there is one) from the tokens it streamed, as it moves one off a failed target replica."""
    expected = await baseline(faults.client, 200)
    faults.recorder.delay = 0.02
    actor = faults.orchestrator.pool.actors[0]
    tokens, killed, final = [], False, None
    async for reply in faults.client.Generate(request(4, 200)):
        tokens += reply.delta.token_ids
        if len(tokens) > 10 and not killed:
            killed = True
            ray.kill(actor, no_restart=False)  # Ray restarts it (max_restarts=-1)
        if reply.HasField("final"):
            final = reply.final
    faults.recorder.delay = 0.0
    assert tokens == expected  # not a token lost, repeated or changed
    assert final.stats.migrations == 1
    metric = faults.orchestrator.metrics.registry.get_sample_value("specd_migrations_total", {"role": "worker"})
    assert metric == 1
    assert await faults.sessions_drain() == (0, 0)  # the dead worker's sessions were released


async def test_with_migration_off_a_killed_worker_actor_ends_its_request_unavailable(faults):
    client = await faults.start_orchestrator(migration_limit=0)
    try:
        faults.recorder.delay = 0.02
        actor = faults.orchestrator.pool.actors[0]
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            tokens = 0
            async for reply in client.Generate(request(4, 1000)):
                tokens += len(reply.delta.token_ids)
                if tokens > 10:
                    ray.kill(actor, no_restart=False)
        faults.recorder.delay = 0.0
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "worker running this request died" in caught.value.details()
        assert await faults.sessions_drain() == (0, 0)  # the pool released the dead worker's sessions
        assert len(await baseline(client, 8)) == 8  # the restarted actor serves
    finally:
        faults.client = await faults.start_orchestrator()


async def test_health_is_serving_everywhere_after_the_faults(faults):
    for address in (faults.draft.address, f"127.0.0.1:{faults.target.port}", f"127.0.0.1:{faults.orchestrator.port}"):
        async with grpc.aio.insecure_channel(address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
