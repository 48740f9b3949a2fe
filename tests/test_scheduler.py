"""The model thread's queue (model/scheduler.py): which waiting calls share a pass, in what order, and
what a pass reports; split from test_batching.py, which checks that a shared pass gives each call its
unbatched result."""

import asyncio
import threading
import time

import pytest
from conftest import start_services
from test_batching import PROMPTS

from specd.model.scheduler import Bounds, Job, Scheduler
from specd.proto.contract import LIVE_SESSIONS_KEY, PASS_CALLS_KEY, PASS_SECONDS_KEY, PASS_TOKENS_KEY, fingerprint
from specd.proto.limits import Limits
from specd.v1 import common_pb2, target_pb2


def run_recording(passes: list, gate: threading.Event | None = None):
    def run(payloads):
        if gate is not None:
            gate.wait()
        passes.append(list(payloads))
        return [payload * 10 for payload in payloads]

    return run


def test_scheduler_gathers_waiting_calls_first_come_first_served():
    passes, gate = [], threading.Event()
    scheduler = Scheduler(Bounds(max_batch_size=3, max_batch_tokens=100))
    blocker = scheduler.submit(Job(run_recording(passes, gate), payload=0))  # holds the thread
    time.sleep(0.05)
    verify = run_recording(passes)
    futures = [scheduler.submit(Job(verify, i, kind="verify", cost=10, session_id=f"s{i}")) for i in range(1, 6)]
    futures.append(scheduler.submit(Job(verify, 6, kind="verify", cost=10, session_id="s1")))  # same session as 1
    futures.append(scheduler.submit(Job(verify, 7, kind="verify", cost=95, session_id="s7")))  # over the budget
    gate.set()
    assert [f.result(5) for f in futures] == [10, 20, 30, 40, 50, 60, 70]
    assert blocker.result(5) == 0
    assert passes == [[0], [1, 2, 3], [4, 5, 6], [7]]
    assert scheduler.batch_sizes == {3: 2, 1: 1}
    scheduler.close()


def test_a_long_call_runs_in_a_pass_of_its_own():
    """A prefill-sized call (a Decode from token 0) would make a padded pass compute every row as
    long as itself: it runs alone, and the short calls around it share their passes."""
    passes, gate = [], threading.Event()
    scheduler = Scheduler(Bounds(max_batch_size=8, max_batch_tokens=256, max_shared_call_tokens=32))
    blocker = scheduler.submit(Job(run_recording(passes, gate), payload=0))
    time.sleep(0.05)
    verify = run_recording(passes)
    costs = {1: 1, 2: 100, 3: 6, 4: 33, 5: 1}
    jobs = [Job(verify, i, kind="verify", cost=c, session_id=f"s{i}") for i, c in costs.items()]
    futures = [scheduler.submit(job) for job in jobs]
    gate.set()
    assert [f.result(5) for f in futures] == [10, 20, 30, 40, 50] and blocker.result(5) == 0
    assert passes == [[0], [1, 3, 5], [2], [4]]
    # A pass reports the positions it computed: three calls padded to the longest (6 tokens).
    served = [(job.served_by.calls, job.served_by.tokens) for job in jobs]
    assert served == [(3, 18), (1, 100), (3, 18), (1, 33), (3, 18)]
    scheduler.close()


def test_on_an_unpadded_engine_a_long_call_shares_the_pass_up_to_its_token_bound():
    """Issue 50: an unpadded pass that runs rows of any length in one ubatch (llama.cpp batched: a
    prompt and the decode steps beside it, as continuous batching runs them) takes a prefill-sized call
    along up to max_batch_tokens; a call past the bound still runs alone. Where rows of other lengths
    run apart (llama.cpp bitwise) a long call runs alone, as on a padded engine."""
    passes, gate = [], threading.Event()
    scheduler = Scheduler(Bounds(max_batch_size=8, max_batch_tokens=150, max_shared_call_tokens=32))
    scheduler.padded = False
    blocker = scheduler.submit(Job(run_recording(passes, gate), payload=0))
    time.sleep(0.05)
    verify = run_recording(passes)
    costs = {1: 1, 2: 100, 3: 6, 4: 200, 5: 33, 6: 20}
    futures = [scheduler.submit(Job(verify, i, kind="verify", cost=c, session_id=f"s{i}")) for i, c in costs.items()]
    gate.set()
    assert [f.result(5) for f in futures] == [10, 20, 30, 40, 50, 60] and blocker.result(5) == 0
    assert passes == [[0], [1, 2, 3, 5], [4], [6]]  # 140 tokens; 200 alone; 6 did not fit beside the 140
    scheduler.close()
    # llama.cpp bitwise (a KV stream per session: a prompt runs in ubatches of its own): no gain, alone
    passes, gate = [], threading.Event()
    scheduler = Scheduler(Bounds(max_batch_size=8, max_batch_tokens=150, max_shared_call_tokens=32))
    scheduler.padded, scheduler.splits_rows = False, True
    blocker = scheduler.submit(Job(run_recording(passes, gate), payload=0))
    time.sleep(0.05)
    verify = run_recording(passes)
    futures = [scheduler.submit(Job(verify, i, kind="verify", cost=c, session_id=f"s{i}")) for i, c in costs.items()]
    gate.set()
    assert [f.result(5) for f in futures] == [10, 20, 30, 40, 50, 60] and blocker.result(5) == 0
    assert passes == [[0], [1, 3, 6], [2], [4], [5]]
    scheduler.close()


def test_a_call_that_opens_a_request_runs_before_older_calls_until_the_oldest_has_waited_too_long():
    """Issue 50: a request's first call (a cursor from token 0) goes before decode steps queued before
    it, taking the waiting steps of its kind into its pass; once the oldest call has waited
    opening_first_s it goes first again, so nothing starves."""
    passes, gate = [], threading.Event()
    scheduler = Scheduler(Bounds(max_batch_size=8, opening_first_s=0.2))
    blocker = scheduler.submit(Job(run_recording(passes, gate), payload=0))
    time.sleep(0.05)
    decode, prefill = run_recording(passes), run_recording(passes)
    futures = [scheduler.submit(Job(decode, i, kind="decode", cost=1, session_id=f"s{i}")) for i in (1, 2)]
    futures.append(scheduler.submit(Job(prefill, 3, kind="verify", cost=100, session_id="s3", opens=True)))
    futures.append(scheduler.submit(Job(decode, 4, kind="verify", cost=1, session_id="s4", opens=True)))
    gate.set()
    assert [f.result(5) for f in futures] == [10, 20, 30, 40] and blocker.result(5) == 0
    assert passes == [[0], [3], [4], [1, 2]]  # the prefill alone (too long to share), then the short opening
    passes.clear()
    gate.clear()
    blocker = scheduler.submit(Job(run_recording(passes, gate), payload=0))
    time.sleep(0.05)
    old = scheduler.submit(Job(decode, 5, kind="decode", cost=1, session_id="s5"))
    time.sleep(0.25)  # past opening_first_s
    new = scheduler.submit(Job(prefill, 6, kind="verify", cost=1, session_id="s6", opens=True))
    gate.set()
    assert (old.result(5), new.result(5), blocker.result(5)) == (50, 60, 0)
    assert passes == [[0], [5], [6]]
    scheduler.close()


def test_an_engine_that_does_not_pad_reports_the_positions_its_calls_computed():
    """llama.cpp lays a pass out by position (ModelDescription.padded False): a verify of 6 among two
    decodes computes 8 positions, not 18, and the K chooser's slope is per position computed."""
    passes, gate = [], threading.Event()
    scheduler = Scheduler(Bounds(max_batch_size=8))
    scheduler.padded = False
    blocker = scheduler.submit(Job(run_recording(passes, gate), payload=0))
    time.sleep(0.05)
    jobs = [
        Job(run_recording(passes), i, kind="verify", cost=c, session_id=f"s{i}") for i, c in ((1, 1), (2, 6), (3, 1))
    ]
    futures = [scheduler.submit(job) for job in jobs]
    gate.set()
    assert [f.result(5) for f in futures] == [10, 20, 30] and blocker.result(5) == 0
    assert {(job.served_by.calls, job.served_by.tokens) for job in jobs} == {(3, 8)}
    scheduler.close()


@pytest.mark.serial  # timed in tens of milliseconds
@pytest.mark.parametrize("pass_seconds, joins", [(0.4, True), (0.02, False)])
def test_the_wait_for_returning_sessions_grows_with_the_pass(pass_seconds, joins):
    """After a pass of a and b, a's next call comes back at once and b's 40 ms later: past the 10 ms
    floor, within a quarter of a 0.4 s pass. After a long pass the next pass waits for b and carries
    both; after a short one it runs a alone."""
    passes = []
    scheduler = Scheduler(Bounds(max_batch_size=8, batch_wait_s=0.01, return_wait_share=0.25))

    def run(payloads):
        passes.append(list(payloads))
        if len(passes) == 1:
            time.sleep(pass_seconds)
        return list(payloads)

    def submit(payload, session_id):
        return scheduler.submit(Job(run, payload, kind="decode", cost=1, session_id=session_id))

    first = [submit(1, "a"), submit(2, "b")]
    later = []
    first[0].add_done_callback(lambda _: later.append(submit(3, "a")))
    first[1].add_done_callback(lambda _: threading.Timer(0.04, lambda: later.append(submit(4, "b"))).start())
    assert [f.result(5) for f in first] == [1, 2]
    time.sleep(0.3)
    assert [f.result(5) for f in later] == [3, 4]
    assert passes == ([[1, 2], [3, 4]] if joins else [[1, 2], [3], [4]])
    scheduler.close()


def test_scheduler_runs_an_oversized_call_and_skips_abandoned_ones():
    passes = []
    scheduler = Scheduler(Bounds(max_batch_size=4, max_batch_tokens=8))
    big = scheduler.submit(Job(run_recording(passes), 1, kind="verify", cost=50, session_id="a"))
    gone = scheduler.submit(Job(run_recording(passes), 2, kind="verify", abandoned=lambda: "client left"))
    assert big.result(5) == 10
    with pytest.raises(Exception, match="client left"):
        gone.result(5)
    scheduler.close()


async def test_a_long_request_finishes_under_a_steady_stream_of_short_ones(tiny_loaded):
    """No starvation: 60 decode steps in one session while four others keep the queue full."""
    services = await start_services(tiny_loaded["draft"], tiny_loaded["target"], Limits(max_batch_size=2))
    try:

        async def decode_loop(session_id: str, prompt: list[int], steps: int | None, stop: asyncio.Event):
            await services.target.Prefill(
                common_pb2.PrefillRequest(cursor=proto_cursor(session_id, 0, [], prompt[:-1]))
            )
            committed, done = list(prompt), 0
            while (steps is None and not stop.is_set()) or (steps is not None and done < steps):
                cursor = proto_cursor(session_id, len(committed) - 1, committed[:-1], committed[-1:])
                reply = await services.target.Decode(target_pb2.DecodeRequest(cursor=cursor))
                committed += list(reply.emitted_tokens)
                done += 1
            return committed

        stop = asyncio.Event()
        short = [asyncio.create_task(decode_loop(f"short-{i}", PROMPTS[i], None, stop)) for i in range(4)]
        long_output = await asyncio.wait_for(decode_loop("long", PROMPTS[0], 60, stop), timeout=120)
        stop.set()
        await asyncio.gather(*short)
        alone = await decode_loop("alone", PROMPTS[0], 60, stop)
        assert long_output == alone
        info = await services.target.Info(common_pb2.InfoRequest())
        assert info.max_batch_size == 2 and set(info.batch_sizes) <= {1, 2} and info.batch_sizes[2] > 0
    finally:
        await services.close()


def proto_cursor(session_id: str, start: int, held: list[int], tokens: list[int]) -> common_pb2.SessionCursor:
    return common_pb2.SessionCursor(session_id=session_id, start=start, fingerprint=fingerprint(held), tokens=tokens)


async def test_two_decode_streams_fall_into_step_and_share_passes(tiny_loaded):
    """Without the short wait for returning sessions, two streams alternate and never share a pass."""
    services = await start_services(tiny_loaded["draft"], tiny_loaded["target"])
    try:
        passes = []  # what each Decode's trailing metadata says of the pass that served it

        async def decode(session_id: str, prompt: list[int], steps: int) -> list[int]:
            await services.target.Prefill(
                common_pb2.PrefillRequest(cursor=proto_cursor(session_id, 0, [], prompt[:-1]))
            )
            committed = list(prompt)
            for _ in range(steps):
                cursor = proto_cursor(session_id, len(committed) - 1, committed[:-1], committed[-1:])
                call = services.target.Decode(target_pb2.DecodeRequest(cursor=cursor))
                committed += list((await call).emitted_tokens)
                said = dict(await call.trailing_metadata())
                passes.append((int(said[PASS_CALLS_KEY]), int(said[PASS_TOKENS_KEY]), float(said[PASS_SECONDS_KEY])))
                assert int(said[LIVE_SESSIONS_KEY]) >= 1  # the streams a pass could carry
            return committed

        together = await asyncio.gather(decode("one", PROMPTS[1], 30), decode("two", PROMPTS[3], 30))
        info = await services.target.Info(common_pb2.InfoRequest())
        assert info.batch_sizes[2] >= 20, dict(info.batch_sizes)
        # Each call says what its pass carried (one new token per Decode) and cost.
        assert all(tokens == calls and 0 < seconds < 10 for calls, tokens, seconds in passes)
        assert sum(calls == 2 for calls, _, _ in passes) == 2 * info.batch_sizes[2]
        assert together == [await decode("one-alone", PROMPTS[1], 30), await decode("two-alone", PROMPTS[3], 30)]
    finally:
        await services.close()


def test_a_cancelled_call_neither_runs_nor_breaks_the_thread():
    passes, gate = [], threading.Event()
    scheduler = Scheduler()
    scheduler.submit(Job(run_recording(passes, gate), payload=0))
    time.sleep(0.05)
    cancelled = scheduler.submit(Job(run_recording(passes), 1, kind="verify", session_id="a"))
    kept = scheduler.submit(Job(run_recording(passes), 2, kind="verify", session_id="b"))
    assert cancelled.cancel()
    gate.set()
    assert kept.result(5) == 20 and passes == [[0], [2]]
    gate = threading.Event()
    scheduler.submit(Job(run_recording(passes, gate), 3))  # holds the thread while it closes
    time.sleep(0.05)
    gone, waiting = scheduler.submit(Job(run_recording(passes), 4)), scheduler.submit(Job(run_recording(passes), 5))
    gone.cancel()
    closing = threading.Thread(target=scheduler.close)
    closing.start()
    gate.set()
    closing.join(5)
    assert not closing.is_alive() and not scheduler.thread.is_alive()
    with pytest.raises(RuntimeError, match="shut down"):
        waiting.result(1)
    assert passes == [[0], [2], [3]]


def test_the_streams_a_service_reports_count_the_calls_still_waiting_for_a_first_pass():
    """The K chooser's load B: a new stream's first call (its prefill) waits in the queue before its
    session exists, and must count already, or every stream arriving at once would start speculating."""
    from types import SimpleNamespace

    from specd.serving.thread import ModelThread

    thread, gate = ModelThread(), threading.Event()
    thread.service = SimpleNamespace(store=SimpleNamespace(sessions={"held-1": None, "held-2": None}))
    busy = thread.scheduler.submit(Job(lambda _: [gate.wait()]))  # holds the model thread
    time.sleep(0.05)
    for session_id in ("held-1", "new-1", "new-2", "new-2"):
        thread.scheduler.submit(Job(lambda calls: calls, session_id, kind="decode", cost=1, session_id=session_id))
    assert thread.streams() == 4  # two held, two more waiting for their first pass; one stream per session
    gate.set()
    busy.result(5)
    thread.shutdown()


def test_on_an_engine_that_scores_a_few_positions_a_call_openings_share_passes_only_with_each_other():
    """Issue 50: llama.cpp's exact calls score at most 3 positions (ModelDescription.scored_per_call),
    so a fuller pass costs the sum of its rows and only delays every first token in it: calls that open
    requests go 3 to a pass, without the decode steps, which then share one pass as before. On an
    engine without that bound, or whose calls score a whole pass (the patched ggml-cpu: 63), the
    opening pass takes the decode steps along."""
    joined = [[0], [3, 1, 2, 4, 5, 6]]
    for scored_per_call, expected in ((3, [[0], [3, 4, 5], [6], [1, 2]]), (None, joined), (63, joined)):
        passes, gate = [], threading.Event()
        scheduler = Scheduler(Bounds(max_batch_size=8))
        scheduler.scored_per_call = scored_per_call
        blocker = scheduler.submit(Job(run_recording(passes, gate), payload=0))
        time.sleep(0.05)
        step = run_recording(passes)
        futures = [scheduler.submit(Job(step, i, kind="verify", cost=1, session_id=f"s{i}")) for i in (1, 2)]
        futures += [
            scheduler.submit(Job(step, i, kind="verify", cost=5, session_id=f"s{i}", opens=True)) for i in (3, 4, 5, 6)
        ]
        gate.set()
        assert [f.result(5) for f in futures] == [10, 20, 30, 40, 50, 60] and blocker.result(5) == 0
        assert passes == expected, scored_per_call
        scheduler.close()


def test_a_call_that_opens_a_request_is_priced_at_what_the_prefix_cache_leaves_it_to_compute():
    """A prompt the prefix cache holds is one position to compute, not its length: asked as the call
    is taken (Scheduler.costing, serving/thread.py), so cached openings share passes like any short
    call, and their pass reports what it computed. A costing that fails leaves the submitted cost."""
    passes, gate = [], threading.Event()
    scheduler = Scheduler(Bounds(max_batch_size=8, max_batch_tokens=150, max_shared_call_tokens=32))
    scheduler.padded, scheduler.scored_per_call = False, 3  # unpadded: 150 tokens share no pass of 150
    held = {"s1": 149, "s2": 149, "s3": 0, "s4": 149}
    scheduler.costing = lambda job: job.cost - held[job.session_id] if job.session_id != "s5" else 1 / 0
    blocker = scheduler.submit(Job(run_recording(passes, gate), payload=0))
    time.sleep(0.05)
    step = run_recording(passes)
    jobs = [Job(step, i, kind="verify", cost=150, session_id=f"s{i}", opens=True) for i in (1, 2, 3, 4, 5)]
    futures = [scheduler.submit(job) for job in jobs]
    gate.set()
    assert [f.result(5) for f in futures] == [10, 20, 30, 40, 50] and blocker.result(5) == 0
    assert passes == [[0], [1, 2, 4], [3], [5]]  # the uncached prompt and the unpriced one alone
    assert [job.served_by.tokens for job in jobs] == [3, 3, 150, 3, 150]
    scheduler.close()
