"""The Engine (model/engine.py) over a transformers causal LM, on the device the model sits on.

Each session has its own DynamicCache. One row runs on its session's own cache, in place;
several rows run as one PaddedBatch (model/batch.py), whose new KV goes back to each session's
cache when the pass, or the `passes` block, ends. With `graphs` (a CUDA device), passes of up to
eight sessions run in StaticSlots (model/static_slot.py) instead, through CUDA graphs: those
sessions stay in their rows between steps, and go back to a cache of their own when others need
the rows or they join a larger batch. Everything stays on the device; logits come back there too.
The prefix cache's copies (`snapshot`, `restore`: model/prefix_cache.py) are KV tensors on the
device too: a copy from wherever the session sits, and a restored session starts in a cache of its own.
Exact reuse, as the llama.cpp engine does it: a lone session's prompt (the tokens before those a pass
keeps logits for) runs in calls cut at every BLOCK_TOKENS-th position of the session and before every
end-of-turn token (model/prefix_cache.py `prefill_cuts`), so a call is the same whether the session
was fresh or restored from a prefix up to that cut, and the kept rows run as one call after them;
`reusable` counts only tokens computed that way (not those of a padded batch or a static row, whose
shapes differ, nor decode steps). At load the engine prefills a probe both ways and keeps no prefix
if they differ bit for bit (`prefixes_exact`, `_prefix_exact`).
Not thread-safe: the service's model thread is its only caller.
"""

import logging
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from specd.model.batch import PaddedBatch
from specd.model.devices import kv_token_budget
from specd.model.engine import ModelDescription, Row
from specd.model.errors import CapacityExceeded
from specd.model.loaded import LoadedModel, tokenizer_files, tokenizer_fingerprint
from specd.model.prefix_cache import BLOCK_TOKENS, prefill_cuts, starts_call
from specd.model.static_slot import BATCH_BUCKETS, StaticSlots

# A row of the static slots holds a session of up to this many tokens (the model's own limit if
# lower); the longest step they graph is a verify of K = 16 (the largest K a service allows by default).
SLOT_CAPACITY = 16_384
MAX_GRAPH_TOKENS = 17

log = logging.getLogger("specd.model")


class TransformersEngine:
    copies_take_kv_memory = True  # the prefix cache's copies and the sessions' KV share the device's memory

    def __init__(self, loaded: LoadedModel, graphs: bool = False):
        self.loaded = loaded
        self.device = loaded.device
        self.caches: dict[str, DynamicCache] = {}
        self.canonical: dict[str, int] = {}  # session id -> leading tokens a fresh prefill computes the same
        self.boundaries = frozenset(loaded.eos_token_ids)  # a prefill call ends before each (prefill_cuts)
        self.batch: PaddedBatch | None = None  # while a block of passes over several sessions runs
        self.description = ModelDescription(
            name=loaded.name,
            vocab_size=loaded.vocab_size,
            max_positions=loaded.max_positions,
            dtype=str(loaded.dtype).removeprefix("torch."),
            device=str(self.device),
            eos_token_ids=loaded.eos_token_ids,
            tokenizer_fingerprint=tokenizer_fingerprint(loaded.tokenizer),
            quantization=loaded.quantization,
        )
        capacity = min(SLOT_CAPACITY, loaded.max_positions)
        rows = BATCH_BUCKETS[-1]
        self.slots = StaticSlots(loaded.model, rows, capacity, MAX_GRAPH_TOKENS, graphs=True) if graphs else None
        self.prefixes_exact = self._prefix_exact()
        if not self.prefixes_exact:
            log.warning(
                "%s on %s: a restored prefix does not give a fresh prefill's logits: no prefix reuse",
                loaded.name,
                self.device,
            )

    @property
    def graphs(self) -> int:
        """CUDA graphs captured so far (0 without graphs)."""
        return len(self.slots.graphs) if self.slots is not None else 0

    def kv_token_budget(self) -> int | None:
        """Cached tokens the device's free memory holds; None on a CPU."""
        layers, heads, _, head_dim = self._kv_shape(0)
        return kv_token_budget(self.device, 2 * layers * heads * head_dim * self.loaded.dtype.itemsize)

    @torch.inference_mode()
    def forward(self, rows: list[Row]) -> list[torch.Tensor]:
        try:
            if self.batch is not None:
                return self.batch.forward(rows)
            if len(rows) == 1 and rows[0].keep_logits < len(rows[0].tokens):  # a prompt: in canonical calls
                return [self._forward_one(rows[0])]
            if any(row.keep_logits < len(row.tokens) for row in rows):
                return self._heads_first(rows)
            if self.slots is not None and self._arrange(rows):
                return self.slots.forward([row.tokens for row in rows], [row.keep_logits for row in rows])
            if len(rows) == 1:
                return [self._forward_one(rows[0])]
            with self.passes([row.session_id for row in rows]):
                return self.batch.forward(rows)
        except torch.OutOfMemoryError:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            tokens = sum(len(row.tokens) for row in rows)
            raise CapacityExceeded(
                f"{self.device} ran out of memory on {tokens} new tokens for {len(rows)} session(s); "
                "retry with fewer tokens or later (every session's cache is as it was before the call)"
            ) from None

    @contextmanager
    def passes(self, session_ids: list[str]):
        """Several sessions share one padded cache for the whole block; one session needs none, nor
        a block the static slots hold."""
        if len(session_ids) < 2 or (self.slots is not None and len(session_ids) <= self.slots.rows):
            yield
            return
        self.batch = PaddedBatch(self.loaded, {session_id: self._cache(session_id) for session_id in session_ids})
        try:
            yield
        finally:
            self.batch.write_back()
            self.batch = None

    def _heads_first(self, rows: list[Row]) -> list[torch.Tensor]:
        """Several rows, some with a head (tokens before those whose logits they keep): each head alone,
        in a lone prompt's canonical calls (what the prefix cache may reuse), then the kept positions
        together. On a failure every session is cut back to where it was."""
        before = {row.session_id: self.held(row.session_id) for row in rows}
        try:
            for row in rows:
                if (head := len(row.tokens) - row.keep_logits) > 0:
                    self._forward_one(Row(row.session_id, row.tokens[:head], 0))
            kept = [
                Row(row.session_id, row.tokens[-row.keep_logits :], row.keep_logits) for row in rows if row.keep_logits
            ]
            logits = iter(self.forward(kept) if kept else [])
        except BaseException:
            for session_id, length in before.items():
                self.crop(session_id, length)
            raise
        empty = torch.empty(0, self.description.vocab_size, device=self.device)
        return [next(logits) if row.keep_logits else empty for row in rows]

    def _forward_one(self, row: Row) -> torch.Tensor:
        if not row.tokens:
            return torch.empty(0, self.description.vocab_size, device=self.device)
        cache = self._cache(row.session_id)
        length = cache.get_seq_length()
        head = len(row.tokens) - row.keep_logits
        # From a cut the session reached canonically: the head in the canonical calls (prefill_cuts)
        canonical = self.canonical.get(row.session_id, 0) == length and starts_call(
            length, row.tokens[0], self.boundaries
        )
        cuts = (
            sorted({*prefill_cuts(row.tokens, length, head, self.boundaries), len(row.tokens)})
            if canonical
            else [0, len(row.tokens)]
        )
        try:
            for start, end in zip(cuts, cuts[1:]):
                tokens = torch.tensor([row.tokens[start:end]], dtype=torch.long, device=self.device)
                hidden = self.loaded.model.model(input_ids=tokens, cache=cache, use_cache=True).last_hidden_state
        except torch.OutOfMemoryError:
            _crop(cache, length)  # the layers that took the new KV give it back
            raise
        if canonical:
            self.canonical[row.session_id] = length + head
        return self.loaded.model.lm_head(hidden[0, hidden.shape[1] - row.keep_logits :]).float()

    def _arrange(self, rows: list[Row]) -> bool:
        """Put the pass's sessions in static rows 0..B-1, in order, if they fit; False if not."""
        slots = self.slots
        if len(rows) > slots.rows:
            return False
        for row in rows:
            held = slots.row_of(row.session_id)
            cache = self.caches.get(row.session_id)
            length = slots.lengths[held] if held is not None else cache.get_seq_length() if cache is not None else 0
            if length + len(row.tokens) > slots.capacity:
                return False
        for index, row in enumerate(rows):
            held = slots.row_of(row.session_id)
            if held == index:
                continue
            if held is not None:  # in a later row: trade places with whoever sits in this one
                slots.swap(index, held) if slots.sessions[index] is not None else slots.move(held, index)
                continue
            if slots.sessions[index] is not None:  # make room: to a free row past the pass's, or out
                free = slots.free_row(len(rows))
                slots.move(index, free) if free is not None else self._unload(index)
            slots.load(index, row.session_id, self.caches.pop(row.session_id, None))
        return True

    def _unload(self, row: int) -> None:
        session_id, cache = self.slots.unload(row)
        self.caches[session_id] = cache

    def _cache(self, session_id: str) -> DynamicCache:
        if self.slots is not None and (row := self.slots.row_of(session_id)) is not None:
            self._unload(row)
        return self.caches.setdefault(session_id, DynamicCache())

    def crop(self, session_id: str, length: int) -> None:
        self._check_no_block("crop")
        if length < self.canonical.get(session_id, 0):  # the cut block was computed for a longer head
            self.canonical[session_id] = length // BLOCK_TOKENS * BLOCK_TOKENS
        if self.slots is not None and self.slots.row_of(session_id) is not None:
            self.slots.set_length(session_id, length)
            return
        if session_id in self.caches:
            _crop(self.caches[session_id], length)

    def release(self, session_id: str) -> None:
        self._check_no_block("release")
        if self.slots is not None and self.slots.row_of(session_id) is not None:
            self.slots.forget(session_id)
        self.caches.pop(session_id, None)
        self.canonical.pop(session_id, None)

    # -- the prefix cache's copies (model/prefix_cache.py) ---------------------------------------

    def reusable(self, session_id: str) -> int:
        """The session's leading tokens that lone prefill calls computed, from token 0 or from a restored
        prefix, up to the end of a head (`_forward_one`): restored, they give bit for bit the logits a
        fresh prefill of them would, where the load-time probe found so (`prefixes_exact`; else 0).
        Never a decode step's or a verify's tokens, nor those of a padded batch or a static row."""
        return min(self.canonical.get(session_id, 0), self.held(session_id)) if self.prefixes_exact else 0

    def held(self, session_id: str) -> int:
        """All the session's cached tokens, wherever they sit (0 for an unknown session)."""
        if self.batch is not None and session_id in self.batch.caches:
            return self.batch.positions[list(self.batch.caches).index(session_id)]
        if self.slots is not None and self.slots.row_of(session_id) is not None:
            return self.slots.length_of(session_id)
        cache = self.caches.get(session_id)
        return cache.get_seq_length() if cache is not None else 0

    @torch.inference_mode()
    def _prefix_exact(self) -> bool:
        """Whether a session restored from a prefix's snapshot, then prefilled on, scores bit for bit as
        a fresh prefill of the same tokens (`reusable`'s premise), on this device and these weights."""
        tokens = [(11 * i + 5) % self.description.vocab_size for i in range(2 * BLOCK_TOKENS + 3)]
        fresh = self._forward_one(Row("probe", tokens, 1))
        state = self.snapshot("probe", len(tokens) - 1)
        self.release("probe")
        exact = True
        for held in (BLOCK_TOKENS, len(tokens) - 1):  # the first block of the head's two; the head whole
            self.restore("probe", state, held)
            exact = exact and torch.equal(fresh, self._forward_one(Row("probe", tokens[held:], 1)))
            self.release("probe")
        return exact

    @torch.inference_mode()
    def snapshot(self, session_id: str, length: int) -> "KVSnapshot":
        """A copy of the KV of the session's first `length` tokens, from wherever it sits (its own
        cache, or its static row, which it keeps): device memory on a GPU, like the sessions' KV.
        The copy is the caller's: nothing the session does later changes it. Not inside a block of
        passes over several sessions (their KV is in the padded batch until it ends)."""
        self._check_no_block("snapshot")
        held = self.held(session_id)
        if not 0 <= length <= held:
            raise ValueError(f"session {session_id!r} holds {held} tokens: no snapshot of {length}")
        try:
            if self.slots is not None and self.slots.row_of(session_id) is not None:
                keys, values = self.slots.copy(session_id, length)
            elif length:
                layers = self.caches[session_id].layers
                keys = torch.stack([layer.keys[0, :, :length] for layer in layers])
                values = torch.stack([layer.values[0, :, :length] for layer in layers])
            else:
                keys = torch.empty(self._kv_shape(0), dtype=self.loaded.dtype, device=self.device)
                values = keys.clone()
        except torch.OutOfMemoryError:
            raise self._out_of_memory(f"a copy of {length} cached tokens") from None
        return KVSnapshot(keys, values, keys.nbytes + values.nbytes)

    @torch.inference_mode()
    def restore(self, session_id: str, snapshot: "KVSnapshot", length: int) -> None:
        """Start the session, which holds nothing, with the first `length` tokens of the snapshot's KV
        in a cache of its own (a copy: the snapshot stays as it is, for other sessions too). Later
        passes take it as any cache: alone, in a padded batch, or into a static row. Not inside a
        block of passes over several sessions."""
        self._check_no_block("restore")
        if self.held(session_id):
            raise RuntimeError(f"session {session_id!r} already holds KV: restore starts a session")
        if not 0 <= length <= snapshot.length:
            raise ValueError(f"the snapshot holds {snapshot.length} tokens, not {length}")
        if self.slots is not None and self.slots.row_of(session_id) is not None:
            self.slots.forget(session_id)  # an empty row: the session starts in a cache of its own
        try:
            # DynamicLayer.update concatenates onto an empty tensor: each layer gets a copy of its own.
            layers = [(keys[None, :, :length], values[None, :, :length]) for keys, values in snapshot.layers()]
            self.caches[session_id] = DynamicCache(ddp_cache_data=layers) if length else DynamicCache()
            self.canonical[session_id] = length  # the snapshot's tokens came from canonical prefill calls
        except torch.OutOfMemoryError:
            self.caches.pop(session_id, None)
            raise self._out_of_memory(f"a cached prefix of {length} tokens") from None

    def _kv_shape(self, length: int) -> tuple[int, int, int, int]:
        config = self.loaded.model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return config.num_hidden_layers, config.num_key_value_heads, length, head_dim

    def _out_of_memory(self, what: str) -> CapacityExceeded:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return CapacityExceeded(f"{self.device} ran out of memory for {what}; every session's cache is as it was")

    def _check_no_block(self, what: str) -> None:
        if self.batch is not None:
            raise RuntimeError(f"{what} inside a block of passes: the sessions' KV is in the padded batch")

    def tokenizer_files(self) -> dict[str, bytes]:
        return tokenizer_files(self.loaded.tokenizer)


@dataclass(frozen=True, eq=False)
class KVSnapshot:
    """The KV of a session's first tokens (model/engine.py `Snapshot`), on the engine's device (GPU
    memory on a GPU): keys and values [layers, kv heads, length, head dim], in the model's dtype."""

    keys: torch.Tensor
    values: torch.Tensor
    nbytes: int  # the memory it takes

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    @property
    def held_tokens(self) -> int:
        return self.length  # the prefix alone

    def layers(self):
        """(keys, values) [kv heads, length, head dim] of each layer, views of the snapshot."""
        return zip(self.keys.unbind(0), self.values.unbind(0))


def _crop(cache: DynamicCache, length: int) -> None:
    """Keep each layer's first `length` tokens (layer by layer: after a failed pass they may differ)."""
    for layer in cache.layers:
        surplus = layer.get_seq_length() - length
        if surplus > 0:
            layer.crop(-surplus)
