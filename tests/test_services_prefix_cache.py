"""The prefix cache on the wire, on each engine (test_services.py's services and helpers): the salt
in, what was reused and what the cache holds out."""

import test_services
from test_services import PROMPT, cursor

from specd.v1 import common_pb2, draft_pb2, target_pb2

tiny_services = test_services.tiny_services  # the fixture: the services on each engine


async def test_the_salt_reaches_every_call_and_the_opening_calls_reuse_comes_back(tiny_services, monkeypatch):
    """Each RPC hands the service the cursor's cache_salt; a Verify or Decode (a run: its first call)
    answers cached_prompt_tokens as the verifier said it for the call that opened the session."""
    from specd.draft_service.drafter import Drafter
    from specd.model.errors import EngineError
    from specd.target_service.verifier import Verifier

    salts, verify_batch = [], Verifier.verify_batch

    def reusing(service, calls):  # the verifier, saying that an opening call took 4 tokens from its store
        salts.extend(("Verify", call.cursor.salt) for call in calls)
        results = verify_batch(service, calls)
        for call, result in zip(calls, results):
            if not isinstance(result, EngineError):
                result.cached_prompt_tokens = 4 if call.cursor.start == 0 else 0
        return results

    def recorded(method, name):
        def call(service, first, *rest):
            cursors = [item.cursor for item in first] if isinstance(first, list) else [first]
            salts.extend((name, cursor.salt) for cursor in cursors)
            return method(service, first, *rest)

        return call

    monkeypatch.setattr(Verifier, "verify_batch", reusing)
    monkeypatch.setattr(Verifier, "prefill", recorded(Verifier.prefill, "target Prefill"))
    monkeypatch.setattr(Drafter, "prefill", recorded(Drafter.prefill, "draft Prefill"))
    monkeypatch.setattr(Drafter, "propose_batch", recorded(Drafter.propose_batch, "Propose"))
    salted = cursor("salted", PROMPT, 0)
    salted.cache_salt = "tenant-a"
    run = await tiny_services.target.Decode(target_pb2.DecodeRequest(cursor=salted, steps=3))
    assert len(run.emitted_tokens) == 3 and run.cached_prompt_tokens == 4  # from the run's first call
    committed = PROMPT + list(run.emitted_tokens)
    after = cursor("salted", committed, len(committed) - 1)
    after.cache_salt = "tenant-a"
    assert (
        await tiny_services.target.Verify(target_pb2.VerifyRequest(cursor=after, draft_tokens=[5]))
    ).cached_prompt_tokens == 0
    assert await tiny_services.draft.Propose(draft_pb2.ProposeRequest(cursor=salted, num_draft_tokens=2))
    for stub in (tiny_services.draft, tiny_services.target):
        await stub.Prefill(
            common_pb2.PrefillRequest(
                cursor=common_pb2.SessionCursor(session_id="other", tokens=PROMPT[:-1], cache_salt="tenant-b")
            )
        )
        for session in ("salted", "other"):
            await stub.Release(common_pb2.ReleaseRequest(session_id=session))
    verified = [salt for method, salt in salts if method == "Verify"]  # the run's 3 steps, then the Verify
    assert len(verified) == 4 and verified[0] == verified[-1] == "tenant-a"  # what came on the wire
    assert {(method, salt) for method, salt in salts if method != "Verify"} == {
        ("Propose", "tenant-a"),
        ("draft Prefill", "tenant-b"),
        ("target Prefill", "tenant-b"),
    }


async def test_info_and_the_metrics_report_the_prefix_cache(tiny_services, monkeypatch):
    from prometheus_client import generate_latest

    from specd.model.prefix_cache import PrefixStats

    counts = dict(hit_tokens=48, miss_tokens=16, entries=2, blocks=5, tokens=80, bytes=123_456, evictions=1)
    said = PrefixStats(**counts, budget_tokens=4096, failures=3, answers=6)
    for server, stub in (
        (tiny_services.draft_server, tiny_services.draft),
        (tiny_services.target_server, tiny_services.target),
    ):
        monkeypatch.setattr(server.thread.service, "prefix_stats", lambda: said, raising=False)
        info = await stub.Info(common_pb2.InfoRequest())
        assert (
            info.prefix_cache_hit_tokens,
            info.prefix_cache_miss_tokens,
            info.prefix_cache_entries,
            info.prefix_cache_blocks,
            info.prefix_cache_tokens,
            info.prefix_cache_bytes,
            info.prefix_cache_evictions,
            info.prefix_cache_budget_tokens,
            info.prefix_cache_failures,
            info.prefix_cache_answers,
        ) == (48, 16, 2, 5, 80, 123_456, 1, 4096, 3, 6)
        exported = {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in generate_latest(server.metrics.registry).decode().splitlines()
            if line.startswith("specd_prefix_cache_")
        }
        assert exported == {
            "specd_prefix_cache_hit_tokens_total": 48,
            "specd_prefix_cache_miss_tokens_total": 16,
            "specd_prefix_cache_evictions_total": 1,
            "specd_prefix_cache_failures_total": 3,
            "specd_prefix_cache_answers_total": 6,
            "specd_prefix_cache_entries": 2,
            "specd_prefix_cache_blocks": 5,
            "specd_prefix_cache_tokens": 80,
            "specd_prefix_cache_bytes": 123_456,
            "specd_prefix_cache_budget_tokens": 4096,
        }
