"""What the draft and target services share, whatever the engine: an engine, its sessions, the
limits, and the request checks both sides make (docs/architecture.md §5). No gRPC here: the
servicers in draft_service/ and target_service/ translate messages and call these methods.
"""

from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

from specd.model.devices import trim_host_memory
from specd.model.engine import Engine, Row
from specd.model.errors import EngineError, InvalidRequest
from specd.model.pass_profile import PassProfile
from specd.model.prefix_cache import PrefixStats
from specd.model.sampling import Sampling
from specd.model.sessions import Cursor, SessionStore
from specd.proto.limits import AUTO_CACHED_TOKENS, AUTO_PREFIX_TOKENS, Limits

AUTO_PREFIX_MOST = 16_384  # the prefix cache's default budget, in tokens, at most (a quarter of the KV's below it)


class ModelService:
    """An engine plus its sessions. Every method runs on the service's single model thread."""

    role = "?"
    passes: PassProfile | None = None  # what its passes cost here (model/pass_profile.py), where measured

    def __init__(self, engine: Engine, limits: Limits):
        if limits.max_session_tokens > engine.description.max_positions:
            limits = replace(limits, max_session_tokens=engine.description.max_positions)
        if engine.description.max_sessions is not None and limits.max_sessions > engine.description.max_sessions:
            limits = replace(limits, max_sessions=engine.description.max_sessions)
        budget = engine.kv_token_budget() if limits.max_cached_tokens == AUTO_CACHED_TOKENS else None
        if limits.max_cached_tokens == AUTO_CACHED_TOKENS:  # no --max-cached-tokens: what the device's memory holds
            limits = replace(limits, max_cached_tokens=budget or Limits().max_cached_tokens)
        if limits.prefix_cache_tokens == AUTO_PREFIX_TOKENS:
            limits = replace(limits, prefix_cache_tokens=min(AUTO_PREFIX_MOST, limits.max_cached_tokens // 4))
        if budget and getattr(engine, "copies_take_kv_memory", False):
            # the prefix cache's copies take the device memory the sessions' KV would (a GPU): the
            # sessions get what the copies leave, a token of either costing the same bytes
            sessions = max(budget - limits.prefix_cache_tokens, budget // 2)
            limits = replace(limits, max_cached_tokens=sessions, prefix_cache_tokens=budget - sessions)
        self.engine = engine
        self.limits = limits
        self.store = SessionStore(engine, limits)

    def prefill(self, cursor: Cursor) -> int:
        """Open or resync a session and cache cursor.tokens; returns the cached length."""
        session = self.store.open(cursor)
        self.store.forward([Row(cursor.session_id, cursor.tokens)])
        return len(session.tokens)

    def release(self, session_id: str, committed: list[int] | None = None) -> bool:
        """End a session; `committed`, its request's tokens, for the prefix cache to keep after the
        reply (`keep_answers`: SessionStore.release)."""
        if committed:
            self.store.check_tokens(committed, "committed tokens")
        released = self.store.release(session_id, committed)
        self._trim_when_idle(released and not self.store.answers)
        return released

    def keep_answers(self) -> None:
        """Keep what released sessions' requests answered (SessionStore.keep_answer), then give the
        memory back if no session is left."""
        kept = bool(self.store.answers)
        self.store.keep_answers()
        self._trim_when_idle(kept)

    def evict_idle(self) -> list[str]:
        evicted = self.store.evict_idle()
        self._trim_when_idle(bool(evicted))
        return evicted

    def _trim_when_idle(self, ended: bool) -> None:
        """The last session just ended: give the memory it freed back (model/devices.py)."""
        if ended and not self.store.sessions:
            trim_host_memory()

    def prefix_stats(self) -> PrefixStats:
        """What the prefix cache holds and did (model/prefix_cache.py): Info and the metrics."""
        return self.store.prefix.stats()

    def tokenizer_files(self) -> dict[str, bytes]:
        return self.engine.tokenizer_files()

    def check_draft_length(self, k: int) -> None:
        if not 1 <= k <= self.limits.max_draft_tokens:
            raise InvalidRequest(f"draft length K={k} is outside 1..{self.limits.max_draft_tokens}")


def check_sampling(sampling: Sampling) -> None:
    """Reject sampling settings no distribution matches (docs/architecture.md §5)."""
    if not sampling.temperature >= 0 or sampling.temperature == float("inf"):
        raise InvalidRequest(f"temperature must be a finite number >= 0, got {sampling.temperature}")
    if not 0 < sampling.top_p <= 1:
        raise InvalidRequest(f"top_p must be in (0, 1], got {sampling.top_p}")
    if sampling.top_k < 0:
        raise InvalidRequest(f"top_k must be >= 0, got {sampling.top_k}")


def check_continuation(cursor: Cursor) -> None:
    if not cursor.tokens:
        raise InvalidRequest("the cursor must carry at least the last committed token")


Call = TypeVar("Call")
Opened = TypeVar("Opened")


def open_each(calls: list[Call], open_call: Callable[[Call], Opened]):
    """Check and sync every call of a batch; a refused call gets its error, the others go on.

    Returns (results with the errors filled in, [(index, call, opened)] for the calls to run).
    """
    results: list = [None] * len(calls)
    ready = []
    for index, call in enumerate(calls):
        try:
            ready.append((index, call, open_call(call)))
        except EngineError as error:
            results[index] = error
    return results, ready


def single(results: list):
    """The one result of a batch of one, raised if it is an error."""
    if isinstance(results[0], EngineError):
        raise results[0]
    return results[0]
