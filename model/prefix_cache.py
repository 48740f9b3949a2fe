"""The prefix cache: KV of prompts already computed, kept past their sessions, so that a new session
(a request, a chat's next turn, a resync's re-prefill) computes only what it does not share.

What it keeps: after a session's opening pass (a prefill: the cursor from token 0) the engine's copy
of the KV a fresh prefill would reproduce bit for bit (`Engine.reusable`): the pass's head, the tokens
it computed before the first it kept logits for. Any prompt that starts with the head's whole blocks
of BLOCK_TOKENS may take those; a prompt whose head is exactly the kept one takes it all, tail
included (its partial last block was prefilled by the very call a fresh prefill of that head makes),
and computes only its last token: the same short prompt sent twice is prefilled once. Not the output:
a decode step computes a token's KV with other kernels than a prefill (one row against many;
model/llama_cpp_engine.py), so a chat's next turn recomputes the last answer once, inside its own
prefill, and that prefill's KV is what the turn after it finds.

How it finds it: vLLM's hash chain over blocks (parent hash + the block's tokens, the tenant's salt
at the root), and a tail's hash after its last block's; an index from each hash to the entries that
hold it; a lookup walks the new head's blocks while the chain is known and takes the deepest, or the
head whole. An entry is one engine snapshot of a head (one copy each way: llama.cpp keeps a
sequence's KV in a stream of its own, which cannot be shared in place), and only leaves are kept: an
entry whose tokens a new one of the same salt starts with is dropped for it (a chat's turn replaces
the last turn's), and so is one that parts from the new one only in its last whole block and tail
(another question after the same system prompt or document): every prompt that found the old one's
blocks finds all but that last one in the new, and the store holds one copy of a shared context,
not one per request (the same prompt sent again recomputes at most a block and its tail).

Bounded: entries are evicted least recently used first under `budget_tokens`, counted as the KV
positions each copy holds, not only those it may restore (a llama.cpp copy is its whole sequence: the
prompt's last token and a verify's drafts with it); 0 turns the store off. It never makes a
call fail: a copy that finds no memory is not kept, a restore that finds none is computed instead, and
where the copies take the sessions' memory (a GPU) the session store empties it before refusing for room.
Not thread-safe: the model thread is its only caller.
"""

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from specd.proto.contract import block_hashes, tail_hash

# Tokens per block: the unit of a hit. 64: the llama.cpp engine prefills in calls of one block each so
# that a block computes alike from any start (model/llama_cpp_engine.py `reusable`), and calls of 64
# rows run as fast as longer ones there; vLLM's blocks are 16 tokens.
BLOCK_TOKENS = 64


@dataclass(frozen=True)
class PrefixStats:
    """What the store did since the service started, and what it holds now."""

    hit_tokens: int = 0  # prompt tokens new sessions took from the store
    miss_tokens: int = 0  # prompt tokens new sessions computed (the store on)
    entries: int = 0
    blocks: int = 0  # BLOCK_TOKENS-token blocks that may be restored, over all entries
    tokens: int = 0  # KV positions the copies hold (what counts against the budget): the blocks' and more
    bytes: int = 0  # the snapshots' size
    evictions: int = 0  # entries evicted for the budget (not those a longer one replaced)
    budget_tokens: int = 0
    failures: int = 0  # snapshots and restores that ran out of memory: those calls ran without the store


@dataclass(eq=False)
class Entry:
    salt: str
    tokens: tuple[int, ...]  # whole blocks, then perhaps a tail: the rest of the head they were prefilled as
    snapshot: Any  # the engine's copy of their KV (model/engine.py Snapshot: .nbytes, .held_tokens)
    chain: list[bytes] = field(default_factory=list)  # the chain hash after each block, then the tail's

    @property
    def blocks(self) -> int:
        return len(self.tokens) // BLOCK_TOKENS

    @property
    def held_tokens(self) -> int:
        """What it counts against the budget: the KV positions its copy holds, its tokens at least."""
        return max(len(self.tokens), self.snapshot.held_tokens)


def _replaced(old: Entry, new: Entry) -> bool:
    """Whether `new` makes `old` not worth its room: `old` is a prefix of it (a leaf no more), or they
    part only in `old`'s last whole block and its tail (the same context, another question)."""
    if len(old.tokens) <= len(new.tokens) and new.tokens[: len(old.tokens)] == old.tokens:
        return True
    shared = 0
    for mine, theirs in zip(old.chain[: old.blocks], new.chain[: new.blocks]):
        if mine != theirs:
            break
        shared += 1
    return shared >= 1 and shared >= old.blocks - 1


def chain_hashes(salt: str, tokens: list[int] | tuple[int, ...], blocks: int) -> list[bytes]:
    """The hash after each of the first `blocks` blocks (proto/contract.py's prefix keys, BLOCK_TOKENS each)."""
    return block_hashes(salt, tokens, blocks, BLOCK_TOKENS)


def entry_hashes(salt: str, tokens: list[int] | tuple[int, ...]) -> list[bytes]:
    """Every key an entry of these tokens is found by: each whole block's chain hash, then the tail's."""
    blocks = len(tokens) // BLOCK_TOKENS
    chain = chain_hashes(salt, tokens, blocks)
    if len(tokens) % BLOCK_TOKENS:
        chain.append(tail_hash(salt, chain, tokens[blocks * BLOCK_TOKENS :]))
    return chain


class PrefixCache:
    def __init__(self, budget_tokens: int):
        self.budget_tokens = max(0, budget_tokens)
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self.index: dict[bytes, set[int]] = {}  # chain hash -> ids of the entries holding that prefix
        self.hit_tokens = self.miss_tokens = self.evictions = self.failures = 0
        self.tokens = self.blocks = self.bytes = 0  # tokens: the KV positions the copies hold
        self._next_id = 0

    @property
    def enabled(self) -> bool:
        return self.budget_tokens >= BLOCK_TOKENS

    def lookup(self, salt: str, tokens: list[int], most: int) -> tuple[Entry | None, int]:
        """The entry holding the longest prefix of `tokens` it may restore under this salt, at most
        `most` tokens (a call's head: the tokens it computes before the first it keeps logits for),
        and that length; (None, 0) when none. Whole blocks, or the head itself where an entry's tokens
        are exactly it (its tail was prefilled by the very call a fresh prefill of this head makes).
        The entry becomes the most recently used."""
        most = min(most, len(tokens))
        if not self.enabled or most <= 0:
            return None, 0
        found, length = None, 0
        chain = chain_hashes(salt, tokens, most // BLOCK_TOKENS)
        for depth, digest in enumerate(chain, 1):
            holders = self.index.get(digest)
            if not holders:
                break
            found, length = max(holders), depth * BLOCK_TOKENS  # the newest holder
        else:
            if most % BLOCK_TOKENS:  # every whole block held: perhaps the head itself, tail and all
                head = tokens[len(chain) * BLOCK_TOKENS : most]
                holders = self.index.get(tail_hash(salt, chain, head))
                if holders:
                    found, length = max(holders), most
        if found is None:
            return None, 0
        entry = self.entries[found]
        partial = length % BLOCK_TOKENS and len(entry.tokens) != length
        if entry.salt != salt or partial or entry.tokens[:length] != tuple(tokens[:length]):
            return None, 0  # a hash collision: never serve another tenant's prefix, nor other tokens
        self.entries.move_to_end(found)
        return entry, length

    def count(self, hit: int, prompt: int) -> None:
        """A new session's prompt: `hit` of its `prompt` tokens came from the store."""
        if self.enabled:
            self.hit_tokens += hit
            self.miss_tokens += prompt - hit

    def wants(self, salt: str, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` (a head, as its prefill computed it) an insert would
        add: all of them, or 0 where the store already holds them or keeps nothing."""
        length = len(tokens)
        if not self.enabled or length == 0 or length > self.budget_tokens:
            return 0
        _, held = self.lookup(salt, tokens, length)
        return 0 if held >= length else length

    def insert(self, salt: str, tokens: list[int], snapshot: Any) -> None:
        """Keep `snapshot`, the KV of `tokens` (a head: whole blocks and a tail), dropping the entries
        whose tokens it starts with (a chat's last turn, the same prompt kept before), then evicting
        the least recently used until the budget holds."""
        entry = Entry(salt, tuple(tokens), snapshot, entry_hashes(salt, tokens))
        for entry_id in list(self.index.get(entry.chain[0], ())):  # those sharing its first block (or head)
            if _replaced(self.entries[entry_id], entry):
                self._drop(entry_id)
        entry_id, self._next_id = self._next_id, self._next_id + 1
        self.entries[entry_id] = entry
        for digest in entry.chain:
            self.index.setdefault(digest, set()).add(entry_id)
        self.tokens += entry.held_tokens
        self.blocks += entry.blocks
        self.bytes += snapshot.nbytes
        while self.tokens > self.budget_tokens and self.entries:
            self.evict_one()

    def evict_one(self) -> bool:
        """Drop the least recently used entry; False when there is none."""
        if not self.entries:
            return False
        self._drop(next(iter(self.entries)))
        self.evictions += 1
        return True

    def clear(self) -> int:
        """Drop every entry (memory is needed for sessions); returns how many."""
        dropped = len(self.entries)
        while self.evict_one():
            pass
        return dropped

    def failed(self, entry: Entry | None = None) -> None:
        """A snapshot or a restore (of `entry`, which is dropped) ran out of memory: counted, and the
        call goes on without the store."""
        self.failures += 1
        entry_id = next((key for key, held in self.entries.items() if held is entry), None)
        if entry_id is not None:
            self._drop(entry_id)

    def _drop(self, entry_id: int) -> None:
        entry = self.entries.pop(entry_id)
        for digest in entry.chain:
            holders = self.index[digest]
            holders.discard(entry_id)
            if not holders:
                del self.index[digest]
        self.tokens -= entry.held_tokens
        self.blocks -= entry.blocks
        self.bytes -= entry.snapshot.nbytes

    def stats(self) -> PrefixStats:
        return PrefixStats(
            self.hit_tokens,
            self.miss_tokens,
            len(self.entries),
            self.blocks,
            self.tokens,
            self.bytes,
            self.evictions,
            self.budget_tokens,
            self.failures,
        )
