"""Errors the engines raise; the gRPC layer maps each to one status code (docs/architecture.md §5)."""


class EngineError(Exception):
    """Base class: an error the caller caused or can act on (never a bug)."""


class InvalidRequest(EngineError):
    """Malformed input: INVALID_ARGUMENT."""


class SessionNotFound(EngineError):
    """Unknown or evicted session: NOT_FOUND."""


class CursorMismatch(EngineError):
    """The cursor's start or fingerprint disagrees with what the session holds: FAILED_PRECONDITION."""

    def __init__(self, message: str, held_tokens: int, held_fingerprint: int):
        super().__init__(f"{message}; the session holds {held_tokens} tokens, resend from there or from 0")
        self.held_tokens = held_tokens
        self.held_fingerprint = held_fingerprint


class CapacityExceeded(EngineError):
    """Session or cache limits reached: RESOURCE_EXHAUSTED (retry later or elsewhere)."""
