"""Session bookkeeping, whatever the engine: the consistency contract (docs/architecture.md §3).

A session is (the token ids whose KV is cached, the KV cache). The store owns the first, the
engine (model/engine.py) the second, and the store keeps them in step. It never decides what
is committed: every call names the prefix to keep (`start` + fingerprint); the store checks it
and the limits before anything changes, truncates to it (that *is* the rollback) and appends
what the caller sends. It also ends sessions: Release and idle eviction.

Below the contract sits the prefix cache (model/prefix_cache.py): a session opened from token 0
starts from the longest prefix of its tokens the store holds under its salt, and the row of its
first pass skips those tokens (`forward`); after that pass the store keeps what the engine says a
fresh prefill would reproduce. Callers see the same session either way.
Not thread-safe: the service that owns a store calls it from one worker thread.
"""

import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from specd.model.engine import Engine, Row
from specd.model.errors import CapacityExceeded, CursorMismatch, EngineError, InvalidRequest, SessionNotFound
from specd.model.prefix_cache import BLOCK_TOKENS, Entry, PrefixCache
from specd.proto.contract import fingerprint
from specd.proto.limits import Limits

ANSWER_SESSION = "\0answer"  # the session a kept answer is prefilled in (a client's id holds no NUL: `open`)
ANSWER_MOST = 1024  # the most tokens keeping one answer computes
ANSWERS_WAITING = 16  # answers released and not yet kept, at most (the oldest is dropped)


@dataclass(frozen=True)
class Cursor:
    session_id: str
    start: int  # leading tokens to keep
    fingerprint: int  # fingerprint of those tokens
    tokens: list[int]  # tokens to append
    salt: str = ""  # the tenant's cache_salt: a session opened from token 0 reuses only prefixes kept under it


@dataclass
class Session:
    session_id: str
    tokens: list[int] = field(default_factory=list)  # ids whose KV the engine holds, in order
    last_used: float = field(default_factory=time.monotonic)
    salt: str = ""  # the cache_salt it was opened with
    reused: int = 0  # tokens its opening call took from the prefix cache
    skip: int = 0  # leading tokens of its next row already held (restored from the store)
    opening: bool = False  # its next pass is its first: the store may keep the prefix it computes
    keep_until: int | None = None  # after that pass: its tokens before those the pass kept logits for
    first: torch.Tensor | None = None  # the logits of its next row's first scored position, from the cache


class SessionStore:
    def __init__(self, engine: Engine, limits: Limits):
        self.engine = engine
        self.limits = limits
        self.sessions: dict[str, Session] = {}
        keeps = hasattr(engine, "snapshot") and limits.prefix_cache_tokens > 0
        self.prefix = PrefixCache(limits.prefix_cache_tokens if keeps else 0, engine.description.eos_token_ids)
        self.answers: deque[tuple[str, list[int]]] = deque(maxlen=ANSWERS_WAITING)  # (salt, tokens) to keep
        self.in_block = False  # inside `passes`: the engine may hold the sessions' KV elsewhere until it ends

    @property
    def cached_tokens(self) -> int:
        """Read off the model thread too (Info, metrics): a copy of the sessions first, taken at once,
        since the model thread may open or end one between two steps of the sum."""
        return sum(len(session.tokens) for session in list(self.sessions.values()))

    def open(self, cursor: Cursor, extra_tokens: int = 0) -> Session:
        """The session for a Prefill, or for a call from token 0: created if new, else synced like any call."""
        if not 0 < len(cursor.session_id) <= 128 or "\0" in cursor.session_id:
            raise InvalidRequest("session_id must be 1..128 characters, none of them NUL")
        if cursor.session_id in self.sessions:
            return self.sync(cursor, extra_tokens)
        if cursor.start != 0:
            raise CursorMismatch(f"session {cursor.session_id!r} is new", 0, 0)
        if len(self.sessions) >= self.limits.max_sessions:
            raise CapacityExceeded(f"{len(self.sessions)} live sessions, the limit is {self.limits.max_sessions}")
        self.sessions[cursor.session_id] = Session(cursor.session_id, salt=cursor.salt)
        try:
            return self.sync(cursor, extra_tokens)
        except EngineError:
            self.release(cursor.session_id)  # a refused call leaves nothing behind
            raise

    def _reuse(self, session: Session, cursor: Cursor) -> Session:
        """A call from token 0, rolled back to nothing: a new session's opening call, or a live one's
        prefill again (a resync, a reset record). Either starts from the longest prefix of its tokens
        the store holds (never all of them: the call computes at least its last token, unless the
        store holds this very prompt with the logits scored at its last position, `Entry.first`), and
        its first pass may be kept. A restore that runs out of memory drops that entry and the call computes the
        prefix itself: the store never fails a call."""
        session.salt, session.opening, session.keep_until = cursor.salt, True, None
        self.engine.release(session.session_id)  # nothing held (truncated to 0): a restore starts it anew
        entry, length = self.opening_prefix(cursor)
        answered = self.prefix.first_for(cursor.salt, cursor.tokens) if self.scores_from_cache else None
        if answered is not None:  # the same prompt again: its last position too, with its logits
            entry, length = answered, len(cursor.tokens)
        if entry is not None:
            try:
                restore = self.engine.restore_scored if answered is not None else self.engine.restore
                restore(session.session_id, entry.snapshot, length)
            except (CapacityExceeded, MemoryError):  # no room for the copy: the call computes it all
                self.engine.release(session.session_id)
                self.prefix.failed(entry)
                length = 0
            else:
                session.tokens, session.reused, session.skip = list(cursor.tokens[:length]), length, length
                if answered is not None:
                    session.first, session.opening = answered.first[1], False
        self.prefix.count(length, len(cursor.tokens))
        return session

    @property
    def scores_from_cache(self) -> bool:
        """Whether a prompt seen before may take its first token's logits from the cache: where the
        engine scores a position alike in any pass (model/llama_cpp_engine.py `scores_from_cache`)."""
        return self.prefix.enabled and getattr(self.engine, "scores_from_cache", False)

    def opening_prefix(self, cursor: Cursor) -> tuple[Entry | None, int]:
        """The prefix-cache entry a call from token 0 opens from, and the tokens of it restored (never
        all of the cursor's: the call computes at least its last): `_reuse` restores it, the scheduler
        prices the call at the rest (serving/thread.py). Model thread only."""
        return self.prefix.lookup(cursor.salt, cursor.tokens, len(cursor.tokens) - 1)

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
        return self._reuse(session, cursor) if cursor.start == 0 else session

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
        holds no more, so a new session never inherits KV under its id. The next row starts at
        `length`: none of its tokens is held from the prefix cache any more (a restore whose opening
        pass failed must not make the next call from token 0 skip them), and of the tokens the
        opening call took from the store at most `length` are left."""
        del session.tokens[length:]
        self.engine.crop(session.session_id, length)
        session.skip, session.reused, session.first = 0, min(session.reused, length), None

    def forward(self, rows: list[Row]) -> list[torch.Tensor]:
        """The engine's forward pass (model/engine.py), each row's tokens then recorded as held. A
        row's leading tokens that its session took from the prefix cache are not computed again.
        When the engine runs out of memory that the prefix cache's copies take (a GPU's), the store
        gives it back and the pass runs once more: the store never makes a call fail that would have
        run without it. Where they take none of it (llama.cpp's KV is allocated at start), emptying
        the store would free nothing for the pass and cost every tenant its prefixes: the call fails."""
        rows = [self._unheld(row) for row in rows]
        try:
            logits = self.engine.forward(rows)
        except CapacityExceeded:
            if not (getattr(self.engine, "copies_take_kv_memory", False) and self.prefix.clear()):
                raise
            logits = self.engine.forward(rows)
        for index, row in enumerate(rows):
            session = self.sessions[row.session_id]
            session.tokens.extend(row.tokens)
            session.skip = 0
            if session.opening and session.keep_until is None:
                session.keep_until = len(session.tokens) - row.keep_logits
            if session.first is not None:  # its first scored position came from the cache (`_unheld`)
                logits[index] = torch.cat([session.first[None].to(logits[index]), logits[index]])
                session.first = None
        if not self.in_block:
            session_ids = [row.session_id for row in rows]
            self.keep_prefixes(session_ids, dict(zip(session_ids, logits)))
        return logits

    def _unheld(self, row: Row) -> Row:
        """The row without the tokens its session already holds from the prefix cache; where the call
        wants logits for some of those, the session gives them back and computes them."""
        session = self.sessions[row.session_id]
        if not session.skip:
            return row
        head = len(row.tokens) - row.keep_logits
        if session.first is not None and session.skip == head + 1:  # it scores the held position first
            return Row(row.session_id, row.tokens[session.skip :], row.keep_logits - 1)
        # a position held with its logits (`first`) is not a prefill's: a call that does not score it
        # (a Prefill) computes it as it computes its others
        held = session.skip - (session.first is not None)
        session.first = None
        skip = min(held, head)
        if skip < held:  # back to whole blocks: a restored tail is exact only as the head it ended
            skip = skip // BLOCK_TOKENS * BLOCK_TOKENS
        if skip < session.skip:
            self.engine.crop(session.session_id, skip)
            del session.tokens[skip:]
            self.prefix.count(skip - session.reused, 0)  # fewer hit tokens, as many more computed
            session.reused = skip
        return Row(row.session_id, row.tokens[skip:], row.keep_logits)

    @contextmanager
    def passes(self, session_ids: list[str]):
        """The engine's block of passes (model/engine.py `passes`); the prefix cache takes its copies
        after the block, where the engine holds each session's KV in its own place again."""
        self.in_block = True
        try:
            with self.engine.passes(session_ids):
                yield
        finally:
            self.in_block = False
        self.keep_prefixes(session_ids)

    def keep_prefixes(self, session_ids: list[str], scored: dict[str, torch.Tensor] | None = None) -> None:
        """After a session's opening pass: keep in the prefix cache what a fresh prefill would
        reproduce of it, in whole blocks, never the positions that pass kept logits for (a verify's
        draft tokens, a draft's guesses: not committed). `scored`: each session's logits from the
        pass; where the engine scores alike in any pass, the first of them (its prompt's last
        position) is kept with the head, and the same prompt sent again takes it with no pass."""
        for session_id in session_ids if self.prefix.enabled else ():
            session = self.sessions.get(session_id)
            if session is None or session.keep_until is None:
                continue  # no opening pass ran
            keep_until = session.keep_until
            end = min(self.engine.reusable(session_id), keep_until, len(session.tokens))
            session.opening, session.keep_until = False, None
            length = self.prefix.wants(session.salt, session.tokens[:end])
            if length:
                try:
                    copy = self.engine.snapshot(session_id, length)
                except (CapacityExceeded, MemoryError):  # no memory for the copy: the call that ran keeps its result
                    self.prefix.failed()
                    continue
                logits = (scored or {}).get(session_id)
                first = None
                if self.scores_from_cache and logits is not None and len(logits) and length == keep_until:
                    first = (session.tokens[length], logits[0].clone())  # the prompt's last position's
                self.prefix.insert(session.salt, session.tokens[:length], copy, first)

    def release(self, session_id: str, committed: list[int] | None = None) -> bool:
        """End the session. `committed`: its request's tokens, prompt and answer; where they are a
        chat's, they wait to be kept (`keep_answers`, which the caller runs after replying)."""
        self.engine.release(session_id)
        session = self.sessions.pop(session_id, None)
        if session is not None and committed and self.prefix.enabled:
            if any(token in self.prefix.boundaries for token in committed):
                self.answers.append((session.salt, committed))
        return session is not None

    def keep_answers(self) -> None:
        """Keep the answers released sessions left (`keep_answer`), oldest first."""
        while self.answers:
            self.keep_answer(*self.answers.popleft())

    def keep_answer(self, salt: str, tokens: list[int]) -> int:
        """Keep a finished request's tokens (a chat's: the prompt and the answer) in the prefix cache as
        a fresh prefill computes them: from the deepest prefix of them the store holds (the prompt's
        messages, kept after its opening pass), the rest prefilled in the canonical calls in a session
        of its own, then copied. The answer's decode steps computed its KV with other kernels, so the
        next turn, which repeats these tokens, would compute them again in its own prefill; kept now,
        it finds them all, up to the answer's end where its end-of-turn token follows (an answer that
        ended on one leaves that token to the next prompt: a call starts there). At most ANSWER_MOST
        tokens are computed (a prompt whose prefix was evicted is not computed again whole). Never
        fails: out of memory or of sessions it keeps nothing. Returns the tokens it computed."""
        if tokens and tokens[-1] in self.prefix.boundaries:
            tokens = tokens[:-1]
        entry, length = self.prefix.lookup(salt, tokens, len(tokens))
        if not self.prefix.wants(salt, tokens) or len(tokens) - length > ANSWER_MOST:
            return 0
        try:
            if entry is not None:
                self.engine.restore(ANSWER_SESSION, entry.snapshot, length)
            self.engine.forward([Row(ANSWER_SESSION, tokens[length:], 0)])
            if self.engine.reusable(ANSWER_SESSION) < len(tokens):
                return 0
            self.prefix.insert(salt, tokens, self.engine.snapshot(ANSWER_SESSION, len(tokens)))
        except (CapacityExceeded, MemoryError):  # no room for it: nothing kept, nothing else changed
            self.prefix.failed()
            return 0
        finally:
            self.engine.release(ANSWER_SESSION)
        self.prefix.answers += 1
        return len(tokens) - length

    def evict_idle(self) -> list[str]:
        cutoff = time.monotonic() - self.limits.idle_timeout_s
        idle = [session_id for session_id, session in self.sessions.items() if session.last_used < cutoff]
        for session_id in idle:
            self.release(session_id)
        return idle
