"""The prefix cache: KV of prompts already computed, kept past their sessions, so that a new session
(a request, a chat's next turn, a resync's re-prefill) computes only what it does not share.

What it keeps: after a session's opening pass (a prefill: the cursor from token 0) the engine's copy
of the KV a fresh prefill would reproduce bit for bit (`Engine.reusable`): the pass's head, the tokens
it computed before the first it kept logits for. The engines prefill a head in calls cut at every
BLOCK_TOKENS-th position and before every end-of-turn token (`prefill_cuts`: a chat message ends at a
call's end), so a prefix computes alike in every longer prompt up to any of those cuts: a new prompt
takes an entry's tokens up to the deepest position that is a cut of both (whole blocks; a message's
end; the entry's own end where the new prompt's message ends there, or where its head is exactly the
entry's). The same short prompt sent twice is prefilled once, and a chat's next turn finds the last
one's messages up to the end of the last question (where the engine scores a position alike in any
pass, `scores_from_cache`, the same prompt again computes nothing: its entry also keeps the prompt's
last position and the logits scored there, `Entry.first`). Not the answer as it was decoded: a decode step
computes a token's KV with other kernels than a prefill (one row against many;
model/llama_cpp_engine.py). The answer is kept by `SessionStore.keep_answer` instead, after its
request ends: the request's tokens prefilled again in those calls from the deepest cut the store
holds, as a fresh prefill of the next turn would compute them.

How it finds it: vLLM's hash chain over blocks (parent hash + the block's tokens, the tenant's salt
at the root); an index from each hash to the entries that hold it, and from each salt to its entries;
a lookup walks the new head's blocks while the chain is known, then looks for a cut inside the next
block among the entries that share those blocks. An entry is one engine snapshot of a head (one copy
each way: llama.cpp keeps a sequence's KV in a stream of its own, which cannot be shared in place),
and only leaves are kept: an entry whose tokens a new one of the same salt starts with is dropped for
it where the new one's prefill has a cut at its end (a chat's turn replaces the last turn's kept
answer); where it has none (a prompt's head, which its answer goes on from inside a message) the old
one stays for that prompt sent again, but is the next to be evicted. Dropped too is one that parts
from the new one only in its last whole block and tail (another question after the same system prompt
or document): every prompt that found the old one's blocks finds all but that last one in the new,
and the store holds one copy of a shared context, not one per request (the same prompt sent again
recomputes at most a block and its tail).

Bounded: entries are evicted least recently used first under `budget_tokens`, counted as the KV
positions each copy holds, not only those it may restore (a llama.cpp copy is its whole sequence: the
prompt's last token and a verify's drafts with it); 0 turns the store off. It never makes a
call fail: a copy that finds no memory is not kept, a restore that finds none is computed instead, and
where the copies take the sessions' memory (a GPU) the session store empties it before refusing for room.
Not thread-safe: the model thread is its only caller.
"""

from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from specd.proto.contract import block_hashes, root_hash

# Tokens per block: the unit of a hit. 64: the llama.cpp engine prefills in calls of one block each so
# that a block computes alike from any start (model/llama_cpp_engine.py `reusable`), and calls of 64
# rows run as fast as longer ones there; vLLM's blocks are 16 tokens.
BLOCK_TOKENS = 64
CANDIDATES = 32  # entries sharing a new prompt's blocks that a lookup compares past them, the newest first
FIRSTS_MOST = 64  # entries that keep their prompt's first-token logits, at most (a vocabulary of float32 each)


def starts_call(position: int, token: int, boundaries: Collection[int]) -> bool:
    """Whether a canonical prefill begins a call at this position of a session, where `token` sits:
    at every block, and at every end-of-turn token (`boundaries`: the model's EOS ids), so that a chat
    message's tokens end a call wherever the conversation goes on after them."""
    return position % BLOCK_TOKENS == 0 or token in boundaries


def prefill_cuts(tokens: Sequence[int], start: int, head: int, boundaries: Collection[int]) -> list[int]:
    """Where a row's head calls begin and end, as offsets in `tokens` (appended to a session that holds
    `start` tokens; the head: its first `head` tokens, those before the ones it keeps logits for):
    0, each offset where `starts_call`, and `head`. The same cuts, so the same calls, whether the
    session was fresh or restored at any of them."""
    inner = (offset for offset in range(1, head) if starts_call(start + offset, tokens[offset], boundaries))
    return [0, *inner, head] if head else [0]


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
    answers: int = 0  # answers kept after their requests ended (SessionStore.keep_answer)


@dataclass(eq=False)
class Entry:
    salt: str
    tokens: tuple[int, ...]  # whole blocks, then perhaps a tail: the rest of the head they were prefilled as
    snapshot: Any  # the engine's copy of their KV (model/engine.py Snapshot: .nbytes, .held_tokens)
    chain: list[bytes] = field(default_factory=list)  # the chain hash after each whole block
    # (the prompt's last token, the logits its opening pass scored there): a prompt of exactly `tokens`
    # and that token has its first token's logits here, and its copy holds that position too
    first: tuple[int, Any] | None = None

    @property
    def blocks(self) -> int:
        return len(self.tokens) // BLOCK_TOKENS

    @property
    def held_tokens(self) -> int:
        """What it counts against the budget: the KV positions its copy holds, its tokens at least."""
        return max(len(self.tokens), self.snapshot.held_tokens)


def _extends(new: Entry, old: Entry) -> bool:
    return len(old.tokens) <= len(new.tokens) and new.tokens[: len(old.tokens)] == old.tokens


def _same_context(new: Entry, old: Entry) -> bool:
    """Whether they part only in `old`'s last whole block and its tail (another question after the
    same context): every prompt that found `old`'s blocks finds all but that last one in `new`."""
    shared = 0
    for mine, theirs in zip(old.chain, new.chain):
        if mine != theirs:
            break
        shared += 1
    return shared >= 1 and shared >= old.blocks - 1


def chain_hashes(salt: str, tokens: list[int] | tuple[int, ...], blocks: int) -> list[bytes]:
    """The hash after each of the first `blocks` blocks (proto/contract.py's prefix keys, BLOCK_TOKENS each)."""
    return block_hashes(salt, tokens, blocks, BLOCK_TOKENS)


class PrefixCache:
    def __init__(self, budget_tokens: int, boundaries: Collection[int] = ()):
        self.budget_tokens = max(0, budget_tokens)
        self.boundaries = frozenset(boundaries)  # the engine's end-of-turn tokens: a call ends before each
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        # chain hash -> ids of the entries holding that prefix; the salt's root hash -> all of its entries
        self.index: dict[bytes, set[int]] = {}
        self.hit_tokens = self.miss_tokens = self.evictions = self.failures = self.answers = 0
        self.tokens = self.blocks = self.bytes = 0  # tokens: the KV positions the copies hold
        self._next_id = 0

    @property
    def enabled(self) -> bool:
        return self.budget_tokens >= BLOCK_TOKENS

    def lookup(self, salt: str, tokens: Sequence[int], most: int) -> tuple[Entry | None, int]:
        """The entry holding the longest prefix of `tokens` it may restore under this salt, at most
        `most` tokens (a call's head: the tokens it computes before the first it keeps logits for),
        and that length; (None, 0) when none. The length is a cut of both prefills (`starts_call`, or
        either head's end): whole blocks, then inside the next block a message's end, or the entry's
        end where `tokens` has a cut there or ends its head there. The entry becomes the most recently used."""
        most = min(most, len(tokens))
        if not self.enabled or most <= 0:
            return None, 0
        found, length, parent = None, 0, root_hash(salt)
        for depth, digest in enumerate(chain_hashes(salt, tokens, most // BLOCK_TOKENS), 1):
            holders = self.index.get(digest)
            if not holders:
                break
            found, length, parent = max(holders), depth * BLOCK_TOKENS, digest  # the newest holder
        for entry_id in sorted(self.index.get(parent, ()), reverse=True)[:CANDIDATES]:  # a cut in the next block
            cut = self._cut(self.entries[entry_id], tokens, length, most)
            if cut > length:
                found, length = entry_id, cut
        if found is None:
            return None, 0
        entry = self.entries[found]
        if entry.salt != salt or entry.tokens[:length] != tuple(tokens[:length]):
            return None, 0  # a hash collision: never serve another tenant's prefix, nor other tokens
        self.entries.move_to_end(found)
        return entry, length

    def _covers(self, entry: Entry, length: int) -> bool:
        """Whether `entry` may serve its first `length` tokens to whatever prompt ends its head there, or
        has a cut there: a cut of its own prefill at `length` (its end, a block, an end-of-turn token)."""
        held = entry.tokens
        return length == len(held) or length % BLOCK_TOKENS == 0 or held[length] in self.boundaries

    def _cut(self, entry: Entry, tokens: Sequence[int], start: int, most: int) -> int:
        """The deepest position after `start` (a block's start both share) and inside its block, up to
        which `entry` holds `tokens` and both prefills cut; `start` when none."""
        held, end = entry.tokens, min(most, len(entry.tokens), start + BLOCK_TOKENS - 1)
        same = start
        while same < end and held[same] == tokens[same]:
            same += 1
        for cut in range(same, start, -1):
            if self._covers(entry, cut) and (cut == most or tokens[cut] in self.boundaries):
                return cut
        return start

    def first_for(self, salt: str, tokens: Sequence[int]) -> Entry | None:
        """The entry that holds all of `tokens` as a prompt it saw: its head, then its last token with
        the logits scored there (`Entry.first`); None when there is none."""
        entry, length = self.lookup(salt, tokens, len(tokens) - 1)
        if entry is None or entry.first is None or length != len(entry.tokens) or length != len(tokens) - 1:
            return None
        return entry if entry.first[0] == tokens[-1] else None

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

    def insert(self, salt: str, tokens: list[int], snapshot: Any, first: tuple[int, Any] | None = None) -> None:
        """Keep `snapshot`, the KV of `tokens` (a head: whole blocks and a tail), dropping the entries
        whose tokens it starts with (a chat's last turn, the same prompt kept before), then evicting
        the least recently used until the budget holds. `first`: the prompt's last token and its
        logits (Entry.first), kept by the FIRSTS_MOST most recently used entries."""
        entry = Entry(salt, tuple(tokens), snapshot, chain_hashes(salt, tokens, len(tokens) // BLOCK_TOKENS), first)
        firsts = [held for held in self.entries.values() if held.first is not None]
        for held in firsts[: max(0, len(firsts) + (first is not None) - FIRSTS_MOST)]:
            held.first = None  # the least recently used give theirs up
        for entry_id in list(self.index.get(root_hash(salt), ())):
            old = self.entries[entry_id]
            extended = _extends(entry, old)
            if extended and not self._covers(entry, len(old.tokens)):
                self.entries.move_to_end(entry_id, last=False)  # it serves its own head alone: evicted first
            elif extended or _same_context(entry, old):
                self._drop(entry_id)
        entry_id, self._next_id = self._next_id, self._next_id + 1
        self.entries[entry_id] = entry
        for digest in (root_hash(salt), *entry.chain):
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
        for digest in (root_hash(entry.salt), *entry.chain):
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
            self.answers,
        )
