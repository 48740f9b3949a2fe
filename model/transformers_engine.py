"""The Engine (model/engine.py) over a transformers causal LM: one DynamicCache per session.

One row runs on its session's own cache, in place; several rows run as one PaddedBatch
(model/batch.py), whose new KV goes back to each session's cache when the pass, or the
`passes` block, ends. Not thread-safe: the service's model thread is its only caller.
"""

from contextlib import contextmanager

import torch
from transformers import DynamicCache

from specd.model.batch import PaddedBatch
from specd.model.engine import ModelDescription, Row
from specd.model.loading import LoadedModel, tokenizer_files, tokenizer_fingerprint


class TransformersEngine:
    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.caches: dict[str, DynamicCache] = {}
        self.batch: PaddedBatch | None = None  # while a block of passes over several sessions runs
        self.description = ModelDescription(
            name=loaded.name,
            vocab_size=loaded.vocab_size,
            max_positions=loaded.max_positions,
            dtype=str(loaded.dtype).removeprefix("torch."),
            device=str(loaded.model.device),
            eos_token_ids=loaded.eos_token_ids,
            tokenizer_fingerprint=tokenizer_fingerprint(loaded.tokenizer),
            quantization=loaded.quantization,
        )

    @torch.inference_mode()
    def forward(self, rows: list[Row]) -> list[torch.Tensor]:
        if self.batch is not None:
            return self.batch.forward(rows)
        if len(rows) == 1:
            return [self._forward_in_place(rows[0])]
        with self.passes([row.session_id for row in rows]):
            return self.batch.forward(rows)

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

    def _forward_in_place(self, row: Row) -> torch.Tensor:
        if not row.tokens:
            return torch.empty(0, self.description.vocab_size)
        hidden = self.loaded.model.model(
            input_ids=torch.tensor([row.tokens], dtype=torch.long), cache=self._cache(row.session_id), use_cache=True
        ).last_hidden_state
        return self.loaded.model.lm_head(hidden[0, len(row.tokens) - row.keep_logits :]).float()

    def _cache(self, session_id: str) -> DynamicCache:
        return self.caches.setdefault(session_id, DynamicCache())

    def crop(self, session_id: str, length: int) -> None:
        self._check_no_block("crop")
        cache = self.caches.get(session_id)
        surplus = cache.get_seq_length() - length if cache is not None else 0
        if surplus > 0:
            cache.crop(-surplus)

    def release(self, session_id: str) -> None:
        self._check_no_block("release")
        self.caches.pop(session_id, None)

    def _check_no_block(self, what: str) -> None:
        if self.batch is not None:
            raise RuntimeError(f"{what} inside a block of passes: the sessions' KV is in the padded batch")

    def tokenizer_files(self) -> dict[str, bytes]:
        return tokenizer_files(self.loaded.tokenizer)
