"""Several sessions in one forward pass: their caches side by side, padded, split back after.

Each session keeps its own DynamicCache between calls (rollback stays a per-session crop).
For a batched pass the caches are copied into one left-padded cache, so every row's next
token lands in the same column; an attention mask hides the padding and explicit position
ids keep each row's own positions. New tokens are right-padded to the longest row. After
the passes, each row's real new columns are appended to its session's cache.

The copy costs a few MB per pass, small next to reading the weights once instead of B times.
Used by model/transformers_engine.py only.
"""

import torch
from transformers import DynamicCache

from specd.model.engine import Row
from specd.model.loaded import LoadedModel


class PaddedBatch:
    def __init__(self, loaded: LoadedModel, caches: dict[str, DynamicCache]):
        self.loaded = loaded
        self.caches = caches  # session id -> its own cache, in row order
        self.new_columns: list[list[int]] = [[] for _ in caches]  # where each row's new KV sits in the padded cache
        self.positions = [cache.get_seq_length() for cache in caches.values()]  # each row's next position
        self.device = loaded.device
        width = max(self.positions)
        self.mask = torch.zeros(len(caches), width, dtype=torch.long, device=self.device)
        for row, length in enumerate(self.positions):
            self.mask[row, width - length :] = 1
        self.cache = DynamicCache(ddp_cache_data=self._padded_layers(width))

    def _padded_layers(self, width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        config = self.loaded.model.config
        heads = config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        layers = []
        for index in range(config.num_hidden_layers):
            keys = torch.zeros(len(self.caches), heads, width, head_dim, dtype=self.loaded.dtype, device=self.device)
            values = torch.zeros_like(keys)
            for row, cache in enumerate(self.caches.values()):
                length = self.positions[row]
                if length:
                    keys[row, :, width - length :] = cache.layers[index].keys[0]
                    values[row, :, width - length :] = cache.layers[index].values[0]
            layers.append((keys, values))
        return layers

    def forward(self, rows: list[Row]) -> list[torch.Tensor]:
        """Append each row's tokens in one pass (empty rows allowed: pure padding); rows in the
        batch's order. Returns, per row, float32 logits [keep_logits, V] of its last new tokens."""
        if [row.session_id for row in rows] != list(self.caches):
            raise ValueError("a batched pass takes the rows of its own sessions, in order")
        width, longest = self.mask.shape[1], max(len(row.tokens) for row in rows)
        input_ids = torch.zeros(len(rows), longest, dtype=torch.long)  # built here, then one copy each
        real = torch.zeros(len(rows), longest, dtype=torch.long)
        for index, row in enumerate(rows):
            input_ids[index, : len(row.tokens)] = torch.tensor(row.tokens, dtype=torch.long)
            real[index, : len(row.tokens)] = 1
        position_ids = torch.tensor(self.positions).unsqueeze(1) + torch.arange(longest)
        input_ids, real, position_ids = (tensor.to(self.device) for tensor in (input_ids, real, position_ids))
        self.mask = torch.cat([self.mask, real], dim=1)
        hidden = self.loaded.model.model(
            input_ids=input_ids, attention_mask=self.mask, position_ids=position_ids, cache=self.cache, use_cache=True
        ).last_hidden_state
        kept = [hidden[index, len(row.tokens) - row.keep_logits : len(row.tokens)] for index, row in enumerate(rows)]
        logits = self.loaded.model.lm_head(torch.cat(kept)).float()
        for index, row in enumerate(rows):
            self.new_columns[index].extend(range(width, width + len(row.tokens)))
            self.positions[index] += len(row.tokens)
        return list(logits.split([row.keep_logits for row in rows]))

    def write_back(self) -> None:
        """Append each row's new KV to its session's cache."""
        for row, cache in enumerate(self.caches.values()):
            if not self.new_columns[row]:
                continue
            columns = torch.tensor(self.new_columns[row], device=self.device)
            for index, layer in enumerate(self.cache.layers):
                cache.update(layer.keys[row : row + 1, :, columns], layer.values[row : row + 1, :, columns], index)
