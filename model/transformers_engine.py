"""The Engine (model/engine.py) over a transformers causal LM, on the device the model sits on.

Each session has its own DynamicCache. One row runs on its session's own cache, in place;
several rows run as one PaddedBatch (model/batch.py), whose new KV goes back to each session's
cache when the pass, or the `passes` block, ends. With `graphs` (a CUDA device), a row of one
session runs in the StaticSlot (model/static_slot.py) instead, through CUDA graphs: that session
stays resident there between steps, and goes back to a cache of its own when another session
needs the slot or the session joins a batch. Everything stays on the device; logits come back
there too. Not thread-safe: the service's model thread is its only caller.
"""

from contextlib import contextmanager

import torch
from transformers import DynamicCache

from specd.model.batch import PaddedBatch
from specd.model.devices import kv_token_budget
from specd.model.engine import ModelDescription, Row
from specd.model.errors import CapacityExceeded
from specd.model.loading import LoadedModel, tokenizer_files, tokenizer_fingerprint
from specd.model.static_slot import StaticSlot

# The static slot holds one session of up to this many tokens (the model's own limit if lower);
# the largest step it graphs is a verify of K = 16 (the largest K a service allows by default).
SLOT_CAPACITY = 16_384
MAX_GRAPH_TOKENS = 17


class TransformersEngine:
    def __init__(self, loaded: LoadedModel, graphs: bool = False):
        self.loaded = loaded
        self.device = loaded.device
        self.caches: dict[str, DynamicCache] = {}
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
        self.slot = StaticSlot(loaded.model, capacity, MAX_GRAPH_TOKENS, graphs=True) if graphs else None

    @property
    def graphs(self) -> int:
        """CUDA graphs captured so far (0 without graphs)."""
        return len(self.slot.graphs) if self.slot is not None else 0

    def kv_token_budget(self) -> int | None:
        """Cached tokens the device's free memory holds; None on a CPU."""
        config = self.loaded.model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * self.loaded.dtype.itemsize
        return kv_token_budget(self.device, per_token)

    @torch.inference_mode()
    def forward(self, rows: list[Row]) -> list[torch.Tensor]:
        try:
            if self.batch is not None:
                return self.batch.forward(rows)
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
        """Several sessions share one padded cache for the whole block; one session needs none."""
        if len(session_ids) < 2:
            yield
            return
        self.batch = PaddedBatch(self.loaded, {session_id: self._cache(session_id) for session_id in session_ids})
        try:
            yield
        finally:
            self.batch.write_back()
            self.batch = None

    def _forward_one(self, row: Row) -> torch.Tensor:
        if not row.tokens:
            return torch.empty(0, self.description.vocab_size, device=self.device)
        if self.slot is not None and self._make_resident(row.session_id, len(row.tokens)):
            return self.slot.forward(row.tokens)[len(row.tokens) - row.keep_logits :]
        cache = self._cache(row.session_id)
        length = cache.get_seq_length()
        try:
            hidden = self.loaded.model.model(
                input_ids=torch.tensor([row.tokens], dtype=torch.long, device=self.device), cache=cache, use_cache=True
            ).last_hidden_state
        except torch.OutOfMemoryError:
            _crop(cache, length)  # the layers that took the new KV give it back
            raise
        return self.loaded.model.lm_head(hidden[0, len(row.tokens) - row.keep_logits :]).float()

    def _make_resident(self, session_id: str, new_tokens: int) -> bool:
        """Move the session into the static slot (the resident one back to its own cache) if it fits."""
        if self.slot.session_id != session_id:
            cache = self.caches.get(session_id)
            if (cache.get_seq_length() if cache is not None else 0) + new_tokens > self.slot.capacity:
                return False
            self._evict_resident()
            self.slot.load(session_id, self.caches.pop(session_id, None))
        return self.slot.fits(new_tokens) or self._evict_resident()

    def _evict_resident(self) -> bool:
        if self.slot is not None and self.slot.session_id is not None:
            session_id = self.slot.session_id
            self.caches[session_id] = self.slot.unload()
        return False

    def _cache(self, session_id: str) -> DynamicCache:
        if self.slot is not None and self.slot.session_id == session_id:
            self._evict_resident()
        return self.caches.setdefault(session_id, DynamicCache())

    def crop(self, session_id: str, length: int) -> None:
        self._check_no_block("crop")
        if self.slot is not None and self.slot.session_id == session_id:
            self.slot.length = min(self.slot.length, length)
            return
        if session_id in self.caches:
            _crop(self.caches[session_id], length)

    def release(self, session_id: str) -> None:
        self._check_no_block("release")
        if self.slot is not None and self.slot.session_id == session_id:
            self.slot.session_id, self.slot.length = None, 0
        self.caches.pop(session_id, None)

    def _check_no_block(self, what: str) -> None:
        if self.batch is not None:
            raise RuntimeError(f"{what} inside a block of passes: the sessions' KV is in the padded batch")

    def tokenizer_files(self) -> dict[str, bytes]:
        return tokenizer_files(self.loaded.tokenizer)


def _crop(cache: DynamicCache, length: int) -> None:
    """Keep each layer's first `length` tokens (layer by layer: after a failed pass they may differ)."""
    for layer in cache.layers:
        surplus = layer.get_seq_length() - length
        if surplus > 0:
            layer.crop(-surplus)
