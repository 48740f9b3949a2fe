"""Session bookkeeping, whatever the engine: the consistency contract (docs/architecture.md §3).

A session is (the token ids whose KV is cached, the KV cache). The store owns the first, the
engine (model/engine.py) the second, and the store keeps them in step. It never decides what
is committed: every call names the prefix to keep (`start` + fingerprint); the store checks it
and the limits before anything changes, truncates to it (that *is* the rollback) and appends
what the caller sends. It also ends sessions: Release and idle eviction.
Not thread-safe: the service that owns a store calls it from one worker thread.
"""

import time
from dataclasses import dataclass, field

import torch

from specd.model.engine import Engine, Row
from specd.model.errors import CapacityExceeded, CursorMismatch, EngineError, InvalidRequest, SessionNotFound
from specd.proto.contract import fingerprint
from specd.proto.limits import Limits


@dataclass(frozen=True)
class Cursor:
    session_id: str
    start: int  # leading tokens to keep
    fingerprint: int  # fingerprint of those tokens
    tokens: list[int]  # tokens to append


@dataclass
class Session:
    session_id: str
    tokens: list[int] = field(default_factory=list)  # ids whose KV the engine holds, in order
    last_used: float = field(default_factory=time.monotonic)


class SessionStore:
    def __init__(self, engine: Engine, limits: Limits):
        self.engine = engine
        self.limits = limits
        self.sessions: dict[str, Session] = {}

    @property
    def cached_tokens(self) -> int:
        return sum(len(session.tokens) for session in self.sessions.values())

    def open(self, cursor: Cursor, extra_tokens: int = 0) -> Session:
        """The session for a Prefill, or for a call from token 0: created if new, else synced like any call."""
        if not 0 < len(cursor.session_id) <= 128:
            raise InvalidRequest("session_id must be 1..128 characters")
        if cursor.session_id in self.sessions:
            return self.sync(cursor, extra_tokens)
        if cursor.start != 0:
            raise CursorMismatch(f"session {cursor.session_id!r} is new", 0, 0)
        if len(self.sessions) >= self.limits.max_sessions:
            raise CapacityExceeded(f"{len(self.sessions)} live sessions, the limit is {self.limits.max_sessions}")
        self.sessions[cursor.session_id] = Session(cursor.session_id)
        try:
            return self.sync(cursor, extra_tokens)
        except EngineError:
            del self.sessions[cursor.session_id]  # a refused call leaves nothing behind
            raise

    def check_tokens(self, tokens: list[int], what: str) -> None:
        vocab = self.engine.description.vocab_size
        bad = next((token for token in tokens if token >= vocab), None)
        if bad is not None:
            raise InvalidRequest(f"{what} contain id {bad}, outside the vocabulary of {vocab}")

    def sync(self, cursor: Cursor, extra_tokens: int = 0) -> Session:
        """Check the cursor, roll the session back to `start`, reserve room for the new tokens.

        Checks come before any change: a refused call leaves the session as it was.
        `extra_tokens`: tokens the call will add beyond cursor.tokens (drafts). A cursor from token 0
        for a session the store does not hold opens it: the call is its prefill (docs/architecture.md §3).
        """
        if cursor.start == 0 and cursor.session_id not in self.sessions:
            return self.open(cursor, extra_tokens)
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

    def truncate(self, session: Session, length: int) -> None:
        """Roll back: forget every token from `length` on. The engine is told even when the store
        holds no more, so a new session never inherits KV under its id."""
        del session.tokens[length:]
        self.engine.crop(session.session_id, length)

    def forward(self, rows: list[Row]) -> list[torch.Tensor]:
        """The engine's forward pass (model/engine.py), each row's tokens then recorded as held."""
        logits = self.engine.forward(rows)
        for row in rows:
            self.sessions[row.session_id].tokens.extend(row.tokens)
        return logits

    def release(self, session_id: str) -> bool:
        self.engine.release(session_id)
        return self.sessions.pop(session_id, None) is not None

    def evict_idle(self) -> list[str]:
        cutoff = time.monotonic() - self.limits.idle_timeout_s
        idle = [session_id for session_id, session in self.sessions.items() if session.last_used < cutoff]
        for session_id in idle:
            self.release(session_id)
        return idle
