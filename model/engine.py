"""The engine interface: what the draft and target services need from a model, and nothing more.

An engine owns the KV cache of every session (opaque to its callers, keyed by session id) and
runs the model over it. It does no bookkeeping: which tokens a session holds, the cursor
checks and the limits live in model/sessions.py (docs/architecture.md §3), which tells the
engine to forward, crop and release. Implementations: model/transformers_engine.py, model/llama_cpp_engine.py,
and model/sim_engine.py (simulated passes, for testing pools on a small machine).
"""

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class ModelDescription:
    """What an engine runs, as the services report it in Info."""

    name: str  # as the user named it
    vocab_size: int
    max_positions: int  # the longest session the model can hold
    dtype: str
    device: str
    eos_token_ids: list[int]
    tokenizer_fingerprint: str  # equal on both sides means they agree on token ids
    quantization: str = "none"
    max_sessions: int | None = None  # the most sessions the engine can hold; None: no bound of its own
    padded: bool = True  # a batched pass computes every row as long as its longest (else each row's own)
    # the most positions one call scores together where the engine splits a pass into calls of its
    # own (llama.cpp, bitwise: 3); None: a pass is one call. Where set, a fuller pass saves nothing
    # and only makes every first token in it later (model/scheduler.py)
    scored_per_call: int | None = None
    # a pass runs rows of different lengths, and sessions not side by side, as parts of their own, each
    # reading the weights again (llama.cpp with a KV stream per session): a verify among decode steps
    # costs about a pass of its guesses (orchestrator/costs.py prices speculation under load so)
    splits_rows: bool = False


@dataclass(frozen=True)
class Row:
    """One session's part of a forward pass."""

    session_id: str
    tokens: list[int]  # appended to the session's KV (may be empty: the row sits this pass out)
    keep_logits: int = 0  # logits wanted for the last `keep_logits` of them (0 <= keep <= len(tokens))


class Snapshot(Protocol):
    """An engine's copy of a prefix's KV (opaque to its callers)."""

    nbytes: int  # the memory it takes
    held_tokens: int  # the KV positions it holds: those it may restore, or more (a whole llama.cpp sequence)


class Engine(Protocol):
    description: ModelDescription

    def forward(self, rows: list[Row]) -> list[torch.Tensor]:
        """Append each row's tokens to its session's KV, all rows in one batched pass (one row per
        session; a session the engine has not seen starts empty). Returns, per row, float32
        logits [keep_logits, vocab_size] of its last tokens, on the engine's device (sampling and
        the acceptance rule run there; only token ids and pruned q rows cross to the host).
        Running out of device memory raises CapacityExceeded, every session's KV as it was."""

    def passes(self, session_ids: list[str]) -> AbstractContextManager:
        """A block of forward calls over exactly these sessions, in this order (the drafting
        loop: one pass per guessed token). The engine may keep them batched in between; crop and
        release wait until the block ends."""

    def crop(self, session_id: str, length: int) -> None:
        """Keep the KV of the session's first `length` tokens (the rollback); no-op when it holds
        no more, or nothing."""

    def release(self, session_id: str) -> None:
        """Forget the session's KV (no-op for an unknown session)."""

    def kv_token_budget(self) -> int | None:
        """KV-cached tokens the device's free memory holds (the default --max-cached-tokens on a
        GPU); None where the limit's own default holds (a CPU)."""

    def tokenizer_files(self) -> dict[str, bytes]:
        """The files a remote orchestrator needs to rebuild the tokenizer (AutoTokenizer-loadable)."""

    # The prefix cache (model/prefix_cache.py). An engine without these three keeps no prefixes.
    # `copies_take_kv_memory`: its copies sit in the memory the sessions' KV grows into (a GPU's), so the
    # session store empties the prefix cache before a pass refuses for room; where the KV is allocated up
    # front (llama.cpp) emptying it frees nothing a pass could use.
    copies_take_kv_memory: bool

    def reusable(self, session_id: str) -> int:
        """How many leading tokens of the session's KV a fresh prefill of exactly those tokens (its
        head: no logits kept for them) would compute bit for bit the same, every whole block of them
        also as any longer prefill would: what the prefix cache may keep of it."""

    def snapshot(self, session_id: str, length: int) -> Snapshot:
        """A copy of the KV of the session's first `length` tokens (length <= reusable), owned by the
        caller: later crops, passes and releases of the session leave it as it is."""

    def restore(self, session_id: str, snapshot: Snapshot, length: int) -> None:
        """Start the session, which holds nothing, with the first `length` tokens of a snapshot's KV."""
