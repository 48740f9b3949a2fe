"""Per-session KV caches behind a small API: sync (truncate + check), extend, release.

A session is (the token ids whose KV is cached, the KV cache). It never decides what is
committed: every call names the prefix to keep (`start` + fingerprint), the session
truncates to it (that *is* the rollback) and appends what the caller sends (docs/architecture.md §3).
Not thread-safe: the engine that owns a store calls it from one worker thread.
"""

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from specd.proto.contract import fingerprint
from specd.model.errors import EngineError, CapacityExceeded, CursorMismatch, InvalidRequest, SessionNotFound
from specd.proto.limits import Limits
from specd.model.loading import LoadedModel


@dataclass(frozen=True)
class Cursor:
    session_id: str
    start: int  # leading tokens to keep
    fingerprint: int  # fingerprint of those tokens
    tokens: list[int]  # tokens to append


@dataclass
class Session:
    tokens: list[int] = field(default_factory=list)  # ids whose KV is cached, in order
    cache: DynamicCache = field(default_factory=DynamicCache)
    last_used: float = field(default_factory=time.monotonic)


class SessionStore:
    def __init__(self, loaded: LoadedModel, limits: Limits):
        self.loaded = loaded
        self.limits = limits
        self.sessions: dict[str, Session] = {}

    @property
    def cached_tokens(self) -> int:
        return sum(len(session.tokens) for session in self.sessions.values())

    def open(self, cursor: Cursor) -> Session:
        """The session for a Prefill: created if new, else synced like any call."""
        if not 0 < len(cursor.session_id) <= 128:
            raise InvalidRequest("session_id must be 1..128 characters")
        if cursor.session_id in self.sessions:
            return self.sync(cursor)
        if cursor.start != 0:
            raise CursorMismatch(f"session {cursor.session_id!r} is new", 0, 0)
        if len(self.sessions) >= self.limits.max_sessions:
            raise CapacityExceeded(f"{len(self.sessions)} live sessions, the limit is {self.limits.max_sessions}")
        self.sessions[cursor.session_id] = Session()
        try:
            return self.sync(cursor)
        except EngineError:
            del self.sessions[cursor.session_id]  # a refused Prefill leaves nothing behind
            raise

    def check_tokens(self, tokens: list[int], what: str) -> None:
        vocab = self.loaded.vocab_size
        bad = next((token for token in tokens if token >= vocab), None)
        if bad is not None:
            raise InvalidRequest(f"{what} contain id {bad}, outside the vocabulary of {vocab}")

    def sync(self, cursor: Cursor, extra_tokens: int = 0) -> Session:
        """Check the cursor, roll the session back to `start`, reserve room for the new tokens.

        Checks come before any change: a refused call leaves the session as it was.
        `extra_tokens`: tokens the call will add beyond cursor.tokens (drafts).
        """
        self.check_tokens(cursor.tokens, "cursor tokens")
        session = self.get(cursor.session_id)
        self._check_cursor(session, cursor)
        self._check_room(session, cursor, len(cursor.tokens) + extra_tokens)
        self.truncate(session, cursor.start)
        return session

    def get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise SessionNotFound(f"no session {session_id!r} (never opened, released or evicted); Prefill it")
        session.last_used = time.monotonic()
        return session

    def _check_cursor(self, session: Session, cursor: Cursor) -> None:
        held = len(session.tokens)
        if cursor.start > held:
            raise CursorMismatch(f"start {cursor.start} is past the cached tokens", held, fingerprint(session.tokens))
        if fingerprint(session.tokens[: cursor.start]) != cursor.fingerprint:
            raise CursorMismatch(
                f"fingerprint of the first {cursor.start} tokens differs", held, fingerprint(session.tokens)
            )

    def _check_room(self, session: Session, cursor: Cursor, new_tokens: int) -> None:
        length = cursor.start + new_tokens
        if length > self.limits.max_session_tokens:
            raise InvalidRequest(f"session would hold {length} tokens, the limit is {self.limits.max_session_tokens}")
        total = self.cached_tokens - len(session.tokens) + length
        if total > self.limits.max_cached_tokens:
            raise CapacityExceeded(f"cache would hold {total} tokens, the limit is {self.limits.max_cached_tokens}")

    @staticmethod
    def truncate(session: Session, length: int) -> None:
        """Roll back: forget every token from `length` on (the cache keeps its first tokens)."""
        surplus = len(session.tokens) - length
        if surplus > 0:
            session.cache.crop(-surplus)
            del session.tokens[length:]

    @torch.inference_mode()
    def extend(self, session: Session, tokens: list[int], keep_logits: int = 1) -> torch.Tensor:
        """Append tokens, computing their KV in one forward pass.

        Returns float32 logits [keep_logits, V] of the last `keep_logits` new tokens (only
        those: the output layer over a whole prompt would cost more than the prompt).
        """
        if not tokens:
            return torch.empty(0, self.loaded.vocab_size)
        input_ids = torch.tensor([tokens], dtype=torch.long)
        output = self.loaded.model(
            input_ids=input_ids, cache=session.cache, use_cache=True, logits_to_keep=keep_logits
        )
        session.tokens.extend(tokens)
        return output.logits[0].float()

    def release(self, session_id: str) -> bool:
        return self.sessions.pop(session_id, None) is not None

    def evict_idle(self) -> list[str]:
        cutoff = time.monotonic() - self.limits.idle_timeout_s
        idle = [sid for sid, session in self.sessions.items() if session.last_used < cutoff]
        for session_id in idle:
            del self.sessions[session_id]
        return idle
