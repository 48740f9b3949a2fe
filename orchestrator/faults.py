"""How the orchestrator rides out slow, dead and restarted services (no gRPC calls here).

- Every service call gets timeout = min(seconds left of the client's deadline, a per-call cap):
  `propose_timeout_s` for Propose, `call_timeout_s` for everything else. A Propose that first
  catches the draft up on n tokens (it opens the session, or follows target-only steps) gets
  (1 + n / CATCHUP_TOKENS_PER_CAP) Propose caps, at most `call_timeout_s`: a prefill's time, yet
  bounded by its size, so a frozen draft stalls a step for about one Propose cap, never for a
  prefill's (before: `call_timeout_s` for any catch-up, 300 s by default).
- The draft is optional ("fail closed"): when a Propose fails or runs past its cap, the step
  runs target-only (a Decode), so the output stays the target's own. A `DraftGate`, one per
  worker, then keeps every request off the draft for a back-off (0.5 s, doubling to 8 s) and
  lets the next step try again; once the draft answers, speculation resumes (its session is
  resynced by a Prefill when the draft lost it).
- The target is required: an UNAVAILABLE target (restarting), a call it cancelled (a server
  stopping cancels its calls in flight) or one that ran past its cap is retried with back-off
  for up to `target_retry_s`, with resync and re-prefill when it comes back; after that the
  request ends UNAVAILABLE. The output is never a wrong token: every retried call names the
  committed prefix it starts from (docs/architecture.md §3).
- Where another target replica can take the request over (a pool, orchestrator/migration.py), a
  failing target is given up sooner: retried for `failover_retry_s`, not `target_retry_s`, and a
  Verify or Decode that does not answer within the step deadline (`step_timeout_s`, more for a call
  that catches up first, as a Propose's) counts as a failure: a frozen replica (SIGSTOP, a black
  hole) is left after the step deadline, not after `call_timeout_s`.
"""

import time
from dataclasses import dataclass

import grpc

CATCHUP_TOKENS_PER_CAP = 128  # a catch-up Propose gets one more Propose cap per this many tokens


@dataclass(frozen=True)
class FaultPolicy:
    propose_timeout_s: float = 10.0  # cap on one Propose; slower drafts are skipped for the step
    call_timeout_s: float = 300.0  # cap on one Prefill/Verify/Decode (long prompts on a CPU are slow)
    target_retry_s: float = 30.0  # keep retrying an unavailable target this long, then UNAVAILABLE
    draft_backoff_s: tuple[float, float] = (0.5, 8.0)  # first and longest pause after a draft failure
    # With a pool: how long a failing target is retried before its request moves to another replica, and
    # the cap on one Verify or Decode (--step-deadline; a pass under load takes seconds on a CPU, not 30)
    failover_retry_s: float = 1.0
    step_timeout_s: float = 30.0

    def propose_cap(self, tokens: int) -> float:
        """The cap on a Propose whose cursor sends `tokens` (more than 2: it first catches up on them)."""
        return self._catching_up(self.propose_timeout_s, tokens)

    def step_cap(self, tokens: int) -> float:
        """With a pool: the cap on a Verify or Decode whose cursor sends `tokens` (the step deadline, as a
        Propose's cap grows with what it first catches up on)."""
        return self._catching_up(self.step_timeout_s, tokens)

    def _catching_up(self, cap: float, tokens: int) -> float:
        """`cap`, one more per CATCHUP_TOKENS_PER_CAP tokens a call first catches up on, at most call_timeout_s."""
        catch_up = max(0, tokens - 2) / CATCHUP_TOKENS_PER_CAP
        return min(self.call_timeout_s, cap * (1 + catch_up))


class ServiceFailed(Exception):
    """A model service failed this request for good: the status to end it with, and why."""

    def __init__(self, service: str, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.service = service
        self.code = code


class DraftGate:
    """Whether to ask the draft now; closes for a growing back-off after each failure."""

    def __init__(self, policy: FaultPolicy = FaultPolicy()):
        self.first_pause, self.longest_pause = policy.draft_backoff_s
        self.pause = 0.0
        self.closed_until = 0.0
        self.lost = False  # the last failure was the draft down or silent (not a refusal)

    def is_open(self) -> bool:
        return time.monotonic() >= self.closed_until

    def is_down(self) -> bool:
        """Closed after the draft was down or silent: a request with another draft replica to go to leaves
        this one (Generation.move_draft). Once open again, the next Propose tries it: it may be back."""
        return self.lost and not self.is_open()

    def failed(self, lost: bool = False) -> None:
        self.pause = min(self.longest_pause, max(self.first_pause, self.pause * 2))
        self.closed_until = time.monotonic() + self.pause
        self.lost = lost

    def succeeded(self) -> None:
        self.pause, self.closed_until, self.lost = 0.0, 0.0, False


class Backoff:
    """Pauses of 50 ms doubling to 1 s, for at most `window_s` seconds in all."""

    def __init__(self, window_s: float):
        self.give_up_at = time.monotonic() + window_s
        self.pause = 0.05
        self.attempts = 0

    def next_pause(self, seconds_left: float | None) -> float | None:
        """Seconds to wait before the next attempt, or None when the window (or the deadline) is spent."""
        limit = self.give_up_at - time.monotonic()
        if seconds_left is not None:
            limit = min(limit, seconds_left)
        if limit <= 0.01:
            return None
        pause, self.pause = min(self.pause, limit), min(1.0, self.pause * 2)  # the last try at the window's end
        self.attempts += 1
        return pause
