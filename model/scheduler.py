"""The model thread's queue: first come, first served, with waiting calls of one kind run together,
and calls that open a request first.

All model work runs on one thread (torch must not block the event loop, and a session must
never see two calls at once). Calls wait in one FIFO queue. When the thread frees up it takes
the oldest call and, if that call batches, every later waiting call of the same kind that
fits the bounds (calls, new tokens, one call per session), so a pass serves everyone who
was waiting at that moment (a call of many new tokens, such as a prefill, runs alone, except where the
engine runs it in one ubatch with the rows beside it: `_shared_call_tokens`); before it starts, it
gives the sessions the last pass served a moment to come back, so streams that alternate fall into
step and share passes. The oldest call always runs next, so nothing starves: a call waits at most for the passes of the
calls that were queued before it.

Except one kind of call: a call that opens a request (a cursor from token 0: the prompt's prefill,
whose first token the client waits for) runs before older calls, unless the oldest has waited
`opening_first_s`: a stream that has its first token loses a pass's time, one that waits for it gains
the queue's, as vLLM's scheduler puts prefills first. A kept answer (model/sessions.py keep_answer)
counts as one: the next turn's opening call, queued after it, would otherwise compute it itself.
On an engine that scores a pass in calls of a few positions (llama.cpp bitwise on a stock ggml-cpu: 3),
a fuller pass saves nothing, so there opening calls share a pass only with each other, that many at a
time: 16 requests sent at once get their first tokens a call apart, not all after one 16-row pass.
Where one call scores a whole pass's calls (the patched ggml-cpu: 63), an opening's scored position
rides in the decode steps' call and saves a pass of its own (its prompt's prefill runs in calls of its
own either way: model/llama_cpp_engine.py).

How long that moment is: `batch_wait_s` at least, and up to a quarter of the last pass's seconds
(`return_wait_share`). A stream that misses a pass runs in a pass of its own later, which reads the
weights again; and on llama.cpp a pass whose sessions' seq ids have gaps runs as several ubatches
(model/llama_cpp_engine.py). Under load the orchestrator's answer to the last pass takes longer
than a fixed 10 ms to come back. Measured on the default pair, `--exactness batched`, 16 streams of
unique prompts (`specd loadtest --unique-prompts --concurrency 4,16 --requests 16 --max-new-tokens
48`), 2 cores of an AMD EPYC Zen 5: with 10 ms, 34 of 74 decode passes carried all 16 streams (157 ms
each; those with fewer rows 200-275 ms), 46 tok/s (50 with speculation off); waiting up to a quarter
of the pass, 56 tok/s (60 off, with a fixed 40 ms); 4 streams 35 -> 36 tok/s.
"""

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


class Abandoned(Exception):
    """The call's deadline passed or its client left while it waited; it never ran."""


@dataclass(eq=False)
class Job:
    run: Callable[[list], list]  # run(payloads) -> one result (or exception) per payload
    payload: Any = None
    kind: Any = None  # jobs of the same kind may share a pass; None runs alone
    cost: int = 0  # new tokens it adds to a pass
    session_id: str = ""
    abandoned: Callable[[], str | None] = lambda: None  # why it should not run, if so
    future: Future = field(default_factory=Future)
    served_by: "Pass | None" = None  # the pass that ran it, once it ran
    opens: bool = False  # it opens a request (its first token waits on it): it runs before older calls
    queued: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Pass:
    """One run of the model over a batch of calls: what the orchestrator's K chooser prices."""

    calls: int
    tokens: int  # positions it computed: padded, every call as long as its longest (model/batch.py); else their sum
    seconds: float  # compute time, no queueing


@dataclass(frozen=True)
class Bounds:
    max_batch_size: int = 16  # calls in one pass
    max_batch_tokens: int = 256  # new tokens in one pass (the oldest call runs even if larger)
    batch_wait_s: float = 0.01  # how long a pass may wait for the sessions the last one served, at least
    return_wait_share: float = 0.25  # ... and up to this share of the last batched pass's seconds
    # A call with more new tokens (a prefill, a long catch-up) runs in a pass of its own (a padded pass
    # computes every row as long as its longest: model/batch.py), except on an engine that runs it in
    # one ubatch with the rows beside it (Scheduler._shared_call_tokens).
    max_shared_call_tokens: int = 32
    opening_first_s: float = 0.5  # a call that opens a request runs first unless the oldest has waited this long


class Scheduler:
    def __init__(self, bounds: Bounds = Bounds()):
        self.bounds = bounds
        self.queue: deque[Job] = deque()
        self.ready = threading.Condition()
        self.closed = False
        self.batch_sizes: Counter[int] = Counter()  # calls per batched pass -> passes run
        self.batched_tokens = 0  # new tokens over those passes
        self.served_last: set[str] = set()  # sessions of the last batched pass: likely back soon
        self.last_pass_seconds = 0.0  # what the last batched pass cost: a share of it is worth waiting
        self.padded = True  # the engine's passes compute every call as long as its longest (ModelDescription)
        self.scored_per_call: int | None = None  # the engine's calls score at most this many positions (ditto)
        self.splits_rows = False  # the engine runs rows of other lengths in ubatches apart (ditto)
        # what a call that opens a request computes, asked as it is taken (serving/thread.py: its
        # tokens less the prefix the cache would restore); None: its new tokens as submitted
        self.costing: Callable[[Job], int] | None = None
        self.thread = threading.Thread(target=self._serve, name="model", daemon=True)
        self.thread.start()

    @property
    def queue_depth(self) -> int:
        return len(self.queue)

    def submit(self, job: Job) -> Future:
        with self.ready:
            if self.closed:
                raise RuntimeError("the model thread has shut down")
            self.queue.append(job)
            self.ready.notify()
        return job.future

    def close(self) -> None:
        """Stop after the running pass; calls still queued fail."""
        with self.ready:
            self.closed = True
            left, self.queue = list(self.queue), deque()
            self.ready.notify()
        for job in left:
            if job.future.set_running_or_notify_cancel():  # a cancelled one has no caller to tell
                job.future.set_exception(RuntimeError("the model thread shut down before the call ran"))
        if threading.current_thread() is not self.thread:
            self.thread.join()

    def _serve(self) -> None:
        while True:
            with self.ready:
                while not self.queue and not self.closed:
                    self.ready.wait()
                self._wait_for_returning_sessions()
                if self.closed:
                    return
                batch = self._take_batch()
            seconds = self._run(batch)
            self.served_last = {job.session_id for job in batch if job.kind is not None}
            if self.served_last:
                self.last_pass_seconds = seconds

    def _wait_for_returning_sessions(self) -> None:
        """Give the sessions the last pass served a moment to send their next call (under the lock).

        Their callers answer within milliseconds; without this wait two streams fall into
        step, each arriving while the other's pass runs, and never share a pass. Under load the
        answers take longer to come back: the wait grows with the pass (see the module's docstring).
        """
        wait = max(self.bounds.batch_wait_s, self.bounds.return_wait_share * self.last_pass_seconds)
        deadline = time.monotonic() + wait
        while not self.closed and self.queue[0].kind is not None and len(self.queue) < self.bounds.max_batch_size:
            if any(job.opens for job in self.queue):  # a first token waits: it runs now
                return
            queued = {job.session_id for job in self.queue}
            left = deadline - time.monotonic()
            if self.served_last <= queued or left <= 0:
                return
            self.ready.wait(left)

    def _take_batch(self) -> list[Job]:
        """The next job (`_first`), plus the others that can share its pass (called under the lock).
        On an engine that scores a pass in calls of a few positions (`scored_per_call`, fewer than a
        pass's calls), a fuller pass computes nothing cheaper, so calls that open requests share passes
        only with each other, that many at most: their first tokens come a few calls apart, not all
        after everyone's."""
        first = self._first()
        shared = self._shared_call_tokens()
        if first.kind is None or self._cost(first) > shared:
            return [first]
        most = self.bounds.max_batch_size
        apart = self.scored_per_call is not None and self.scored_per_call < most
        if apart and first.opens:
            most = min(most, self.scored_per_call)
        batch, tokens, sessions = [first], first.cost, {first.session_id}
        for job in list(self.queue):
            if len(batch) == most:
                break
            if job.kind != first.kind or job.session_id in sessions or (apart and job.opens != first.opens):
                continue
            cost = self._cost(job)
            if tokens + cost <= self.bounds.max_batch_tokens and cost <= shared:
                self.queue.remove(job)
                batch.append(job)
                tokens += job.cost
                sessions.add(job.session_id)
        return batch

    def _shared_call_tokens(self) -> int:
        """The most new tokens a call may bring to a shared pass: up to the pass's bound on an engine
        that runs a prompt in one ubatch with the decode steps beside it (unpadded, rows not split:
        llama.cpp batched, as continuous batching does); else max_shared_call_tokens. A padded pass
        computes every row as long as its longest; llama.cpp bitwise runs a prompt in ubatches of its
        own, so there a shared pass only delays the steps beside it (measured on Zen 5, issue 50's
        benchmark at 16 streams of unique prompts: first tokens 5.3 s at p50 against 2.6 s, 41 tok/s
        against 48; docs/performance/under-load.md)."""
        if self.padded or self.splits_rows:
            return self.bounds.max_shared_call_tokens
        return self.bounds.max_batch_tokens

    def _cost(self, job: Job) -> int:
        """The job's new tokens; for a call that opens a request, what it computes, asked now
        (`costing`): a prompt the prefix cache holds costs its last position, not its length, and
        shares a pass as any short call does. A costing that fails leaves the cost as submitted."""
        if job.opens and self.costing is not None:
            try:
                job.cost = self.costing(job)
            except Exception:  # noqa: BLE001 - the model thread must go on; the call itself will say what is wrong
                log.exception("costing a call that opens a request failed")
        return job.cost

    def _first(self) -> Job:
        """The oldest job, or the oldest that opens a request where the oldest has waited less than
        `opening_first_s` (called under the lock)."""
        oldest = self.queue[0]
        if not oldest.opens and time.monotonic() - oldest.queued < self.bounds.opening_first_s:
            opening = next((job for job in self.queue if job.opens), None)
            if opening is not None:
                self.queue.remove(opening)
                return opening
        return self.queue.popleft()

    def _run(self, batch: list[Job]) -> float:
        """Run the batch's live jobs in one pass; returns its seconds (0 if none ran)."""
        live = []
        for job in batch:
            if not job.future.set_running_or_notify_cancel():
                continue  # its caller left (client cancel): answering would raise InvalidStateError here
            reason = job.abandoned()
            if reason:
                job.future.set_exception(Abandoned(reason))
            else:
                live.append(job)
        if not live:
            return 0.0
        if live[0].kind is not None:
            self.batch_sizes[len(live)] += 1
            self.batched_tokens += sum(job.cost for job in live)
        started = time.perf_counter()
        try:
            results = live[0].run([job.payload for job in live])
        except BaseException as error:  # a bug or out of memory: every call in the pass fails with it
            results = [error] * len(live)
        costs = [job.cost for job in live]
        tokens = len(live) * max(costs) if self.padded else sum(costs)
        served = Pass(len(live), tokens, time.perf_counter() - started)
        for job, result in zip(live, results):
            job.served_by = served
            if isinstance(result, BaseException):
                job.future.set_exception(result)
            else:
                job.future.set_result(result)
        return served.seconds
