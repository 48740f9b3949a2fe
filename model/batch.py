"""Several sessions in one forward pass: their caches side by side, padded, split back after.

Each session keeps its own DynamicCache between calls (rollback stays a per-session crop).
For a batched pass the caches are copied into one left-padded cache, so every row's next
token lands in the same column; an attention mask hides the padding and explicit position
ids keep each row's own positions. New tokens are right-padded to the longest row. After
the passes, each row's real new columns are appended to its session.

The copy costs a few MB per pass, small next to reading the weights once instead of B times.
"""

import torch
from transformers import DynamicCache

from specd.model.loading import LoadedModel
from specd.model.sessions import Session, SessionStore


class PaddedBatch:
    def __init__(self, loaded: LoadedModel, sessions: list[Session]):
        self.loaded = loaded
        self.sessions = sessions
        self.new_tokens: list[list[int]] = [[] for _ in sessions]  # appended to each session at the end
        self.new_columns: list[list[int]] = [[] for _ in sessions]  # where their KV sits in the padded cache
        self.positions = [len(session.tokens) for session in sessions]  # each row's next position
        width = max(self.positions)
        self.mask = torch.zeros(len(sessions), width, dtype=torch.long)
        for row, length in enumerate(self.positions):
            self.mask[row, width - length:] = 1
        self.cache = DynamicCache(ddp_cache_data=self._padded_layers(width))

    def _padded_layers(self, width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        config = self.loaded.model.config
        heads = config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        layers = []
        for index in range(config.num_hidden_layers):
            keys = torch.zeros(len(self.sessions), heads, width, head_dim, dtype=self.loaded.dtype)
            values = torch.zeros_like(keys)
            for row, session in enumerate(self.sessions):
                length = self.positions[row]
                if length:
                    layer = session.cache.layers[index]
                    keys[row, :, width - length:] = layer.keys[0]
                    values[row, :, width - length:] = layer.values[0]
            layers.append((keys, values))
        return layers

    @torch.inference_mode()
    def extend(self, token_lists: list[list[int]], keep_logits: list[int]) -> list[torch.Tensor]:
        """Append token_lists[row] to each row in one pass (empty lists allowed: pure padding).

        Returns, per row, float32 logits [keep_logits[row], V] of its last new tokens.
        """
        rows, width = len(token_lists), self.mask.shape[1]
        longest = max(len(tokens) for tokens in token_lists)
        input_ids = torch.zeros(rows, longest, dtype=torch.long)
        real = torch.zeros(rows, longest, dtype=torch.long)
        for row, tokens in enumerate(token_lists):
            input_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            real[row, : len(tokens)] = 1
        position_ids = torch.tensor(self.positions).unsqueeze(1) + torch.arange(longest)
        self.mask = torch.cat([self.mask, real], dim=1)
        hidden = self.loaded.model.model(
            input_ids=input_ids, attention_mask=self.mask, position_ids=position_ids, cache=self.cache, use_cache=True
        ).last_hidden_state
        kept = [hidden[row, len(tokens) - keep: len(tokens)] for row, (tokens, keep) in enumerate(zip(token_lists, keep_logits))]
        logits = self.loaded.model.lm_head(torch.cat(kept)).float()
        for row, tokens in enumerate(token_lists):
            self.new_tokens[row].extend(tokens)
            self.new_columns[row].extend(range(width, width + len(tokens)))
            self.positions[row] += len(tokens)
        return list(logits.split(keep_logits))

    def write_back(self) -> None:
        """Append each row's new tokens and their KV to its session."""
        for row, session in enumerate(self.sessions):
            if not self.new_tokens[row]:
                continue
            columns = torch.tensor(self.new_columns[row])
            for index, layer in enumerate(self.cache.layers):
                keys = layer.keys[row: row + 1, :, columns]
                values = layer.values[row: row + 1, :, columns]
                session.cache.update(keys, values, index)
            session.tokens.extend(self.new_tokens[row])


class SoloPass:
    """The same interface for a single session: its cache is extended in place, no copies."""

    def __init__(self, store: SessionStore, session: Session):
        self.store = store
        self.session = session

    def extend(self, token_lists: list[list[int]], keep_logits: list[int]) -> list[torch.Tensor]:
        return [self.store.extend(self.session, token_lists[0], keep_logits[0])]

    def write_back(self) -> None:
        pass


def start_pass(store: SessionStore, sessions: list[Session]) -> PaddedBatch | SoloPass:
    """A forward pass over these sessions: padded and batched when there are several."""
    if len(sessions) == 1:
        return SoloPass(store, sessions[0])
    return PaddedBatch(store.loaded, sessions)
