"""What both engines share: a session store over one loaded model, and its self-description."""

from dataclasses import dataclass
from typing import Callable, TypeVar

from specd.model.errors import EngineError, InvalidRequest
from specd.model.loading import LoadedModel, tokenizer_fingerprint, tokenizer_files
from specd.model.sampling import Sampling
from specd.proto.limits import Limits
from specd.model.sessions import Cursor, SessionStore


@dataclass(frozen=True)
class ModelDescription:
    model: str
    role: str
    vocab_size: int
    tokenizer_fingerprint: str
    dtype: str
    eos_token_ids: list[int]
    quantization: str = "none"


class Engine:
    """A model plus its sessions. Every method runs on the service's single model thread."""

    role = "?"

    def __init__(self, loaded: LoadedModel, limits: Limits):
        if limits.max_session_tokens > loaded.max_positions:
            limits = Limits(**{**limits.__dict__, "max_session_tokens": loaded.max_positions})
        self.loaded = loaded
        self.limits = limits
        self.store = SessionStore(loaded, limits)
        self.description = ModelDescription(
            model=loaded.name,
            role=self.role,
            vocab_size=loaded.vocab_size,
            tokenizer_fingerprint=tokenizer_fingerprint(loaded.tokenizer),
            dtype=str(loaded.dtype).removeprefix("torch."),
            eos_token_ids=loaded.eos_token_ids,
            quantization=loaded.quantization,
        )

    def prefill(self, cursor: Cursor) -> int:
        """Open or resync a session and cache cursor.tokens; returns the cached length."""
        session = self.store.open(cursor)
        self.store.extend(session, cursor.tokens)
        return len(session.tokens)

    def release(self, session_id: str) -> bool:
        return self.store.release(session_id)

    def evict_idle(self) -> list[str]:
        return self.store.evict_idle()

    def tokenizer_files(self) -> dict[str, bytes]:
        return tokenizer_files(self.loaded.tokenizer)

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


def check_continuation(cursor: Cursor) -> None:
    if not cursor.tokens:
        raise InvalidRequest("the cursor must carry at least the last committed token")
