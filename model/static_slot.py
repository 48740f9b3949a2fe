"""Sessions' KV in static rows, stepped through CUDA graphs (docs/architecture.md §4).

At small batches an eager forward of a 1.5B model on a GPU is bound by kernel launches (hundreds
per step), not by the GPU. A CUDA graph replays a whole step as one launch, but it needs every
tensor it touches at a fixed address. So the sessions being stepped live in preallocated rows,
keys and values [layers][rows, kv heads, width, head dim]. A pass over B sessions puts them in
rows 0..B-1, in the pass's order, and runs the graph of the smallest batch bucket b >= B (1, 2,
4, 8), the longest row's new tokens T (a decode: 1; a verify: K + 1) and a column bucket C (a
power of two) just past the longest row. Each row's new KV goes to its own next columns (a
scatter); attention reads the first C columns under a mask that hides each row's columns past
each new token. Rows b > B and tokens past a row's own are padding: they write only past their
row's length, which the next pass overwrites. Graphs are captured the first time their shape is
needed. Longer steps (a prefill) run the same code eagerly.

Without graphs (`graphs=False`, and always on a CPU) the rows run eagerly: the tests check them
against the DynamicCache path on any machine, and graph replays against them on a GPU. Which
session sits in which row is decided here; the engine (model/transformers_engine.py) moves a
session between the rows and a cache of its own.
"""

import logging

import torch
from transformers import DynamicCache, PreTrainedModel

log = logging.getLogger(__name__)

SMALLEST_COLUMN_BUCKET = 256
BATCH_BUCKETS = (1, 2, 4, 8)


class StaticSlots:
    def __init__(self, model: PreTrainedModel, rows: int, capacity: int, max_graph_tokens: int, graphs: bool):
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.model = model
        self.device = model.device
        self.rows = rows
        self.capacity = capacity  # the longest session a row holds
        self.max_graph_tokens = max_graph_tokens
        self.graphs_enabled = graphs and self.device.type == "cuda"
        width = capacity + max_graph_tokens  # padding tokens write past a full row, never over it
        # One more row than the graphs use: the spare row that swaps go through.
        shape = (config.num_hidden_layers, rows + 1, config.num_key_value_heads, width, head_dim)
        self.keys = torch.zeros(shape, dtype=model.dtype, device=self.device)
        self.values = torch.zeros_like(self.keys)
        self.sessions: list[str | None] = [None] * (rows + 1)  # who sits in each row
        self.lengths = [0] * (rows + 1)  # the cached tokens of each row
        # The graphs' inputs, at fixed addresses; a step uses the first b rows and T tokens.
        self.input_ids = torch.zeros(rows, max_graph_tokens, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(rows, max_graph_tokens, dtype=torch.long, device=self.device)
        self.mask = torch.zeros(rows, 1, max_graph_tokens, width, dtype=torch.bool, device=self.device)
        self.columns = torch.arange(width, device=self.device)
        self.graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.graphs_enabled else None

    # -- which session sits where --------------------------------------------------------------

    def row_of(self, session_id: str) -> int | None:
        return self.sessions.index(session_id) if session_id in self.sessions else None

    def length_of(self, session_id: str) -> int:
        return self.lengths[self.sessions.index(session_id)]

    def set_length(self, session_id: str, length: int) -> None:
        row = self.sessions.index(session_id)
        self.lengths[row] = min(self.lengths[row], length)

    def forget(self, session_id: str) -> None:
        row = self.sessions.index(session_id)
        self.sessions[row], self.lengths[row] = None, 0

    def load(self, row: int, session_id: str, cache: DynamicCache | None) -> None:
        """Put `session_id` in a free row, its KV copied in from its own cache (None: empty)."""
        length = cache.get_seq_length() if cache is not None else 0
        for index in range(self.keys.shape[0]) if length else ():
            self.keys[index, row, :, :length] = cache.layers[index].keys[0]
            self.values[index, row, :, :length] = cache.layers[index].values[0]
        self.sessions[row], self.lengths[row] = session_id, length

    def unload(self, row: int) -> tuple[str, DynamicCache]:
        """Take the row's session out, with its KV as a cache of its own; the row is free after."""
        session_id, length = self.sessions[row], self.lengths[row]
        layers = [
            (self.keys[index, row : row + 1, :, :length].clone(), self.values[index, row : row + 1, :, :length].clone())
            for index in range(self.keys.shape[0])
        ]
        self.sessions[row], self.lengths[row] = None, 0
        return session_id, DynamicCache(ddp_cache_data=layers) if length else DynamicCache()

    def copy(self, session_id: str, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of the first `length` tokens of the session's row, keys and values
        [layers, kv heads, length, head dim], on the device: one strided copy each, all layers.
        The session stays where it is."""
        row = self.sessions.index(session_id)
        if length > self.lengths[row]:
            raise ValueError(f"session {session_id!r} holds {self.lengths[row]} tokens, not {length}")
        return self.keys[:, row, :, :length].clone(), self.values[:, row, :, :length].clone()

    def move(self, source: int, target: int) -> None:
        """Move a session to a free row: one strided copy each for keys and values, all layers."""
        length = self.lengths[source]
        self.keys[:, target, :, :length] = self.keys[:, source, :, :length]
        self.values[:, target, :, :length] = self.values[:, source, :, :length]
        self.sessions[target], self.lengths[target] = self.sessions[source], length
        self.sessions[source], self.lengths[source] = None, 0

    def swap(self, first: int, second: int) -> None:
        spare = self.rows
        self.move(first, spare)
        self.move(second, first)
        self.move(spare, second)

    def free_row(self, avoid: int) -> int | None:
        """A free row at or past `avoid` (rows below it are taken by the pass being arranged)."""
        for row in range(avoid, self.rows):
            if self.sessions[row] is None:
                return row
        return None

    # -- stepping ----------------------------------------------------------------------------

    def forward(self, tokens: list[list[int]], keep: list[int]) -> list[torch.Tensor]:
        """Append tokens[i] to the session in row i (rows 0..B-1); per row, float32 logits
        [keep[i], V] of its last keep[i] tokens, on the device. Rows with no tokens sit it out."""
        count, longest = len(tokens), max(len(row) for row in tokens)
        if longest == 0:
            return [torch.empty(0, self.model.config.vocab_size, device=self.device) for _ in tokens]
        bucket = self._bucket(max(self.lengths[row] + len(new) for row, new in enumerate(tokens)))
        batch = next((size for size in BATCH_BUCKETS if size >= count), count)
        graphed = self.graphs_enabled and longest <= self.max_graph_tokens and batch <= self.rows
        rows = batch if graphed else count
        ids = torch.zeros(rows, longest, dtype=torch.long)
        for row, new in enumerate(tokens):
            ids[row, : len(new)] = torch.tensor(new, dtype=torch.long)
        starts = torch.tensor(self.lengths[:rows]).unsqueeze(1)
        ids, positions = ids.to(self.device), (starts + torch.arange(longest)).to(self.device)
        mask = self.columns[:bucket] <= positions[:, :, None]
        if graphed:
            self.input_ids[:rows, :longest].copy_(ids)
            self.positions[:rows, :longest].copy_(positions)
            self.mask[:rows, 0, :longest, :bucket].copy_(mask)
            try:
                graph, logits = self.graphs.get((rows, longest, bucket)) or self._capture(rows, longest, bucket)
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as error:  # an op that cannot be captured: say so, and step eagerly
                log.warning("CUDA graph capture failed, stepping eagerly from now on: %s", error)
                self.graphs_enabled = False
                return self.forward(tokens, keep)
            graph.replay()
            kept = [logits[row, len(new) - n : len(new)].clone() for row, (new, n) in enumerate(zip(tokens, keep))]
        else:
            hidden = self._step(ids, positions, mask.unsqueeze(1), bucket)
            wanted = [hidden[row, len(new) - n : len(new)] for row, (new, n) in enumerate(zip(tokens, keep))]
            kept = list(self.model.lm_head(torch.cat(wanted)).float().split(keep))
        for row, new in enumerate(tokens):
            self.lengths[row] += len(new)
        return kept

    def _bucket(self, length: int) -> int:
        bucket = SMALLEST_COLUMN_BUCKET
        while bucket < length:
            bucket *= 2
        return min(bucket, self.keys.shape[3])

    def _step(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, bucket: int) -> torch.Tensor:
        """The model's last hidden states [rows, tokens, hidden] for one step over the rows."""
        return self.model.model(
            input_ids=ids,
            position_ids=positions,
            attention_mask={"full_attention": mask},
            cache=_RowsCache(self, positions, bucket),
            use_cache=True,
        ).last_hidden_state

    def _capture(self, rows: int, count: int, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Record one step of `count` tokens in `rows` rows over the first `bucket` columns. The
        warm-up runs write the KV of the step about to run, where it runs: harmless."""
        args = (self.input_ids[:rows, :count], self.positions[:rows, :count], self.mask[:rows, :, :count, :bucket])
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.model.lm_head(self._step(*args, bucket)).float()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another engine's thread in this process (tests, benches) may run meanwhile
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits = self.model.lm_head(self._step(*args, bucket)).float()
        self.graphs[(rows, count, bucket)] = graph, logits
        log.info("CUDA graph: %d rows x %d tokens over %d columns (%d graphs)", rows, count, bucket, len(self.graphs))
        return graph, logits


class _RowsCache:
    """The cache the model's attention layers see for one step: each row's new KV goes to its own
    next columns; attention reads the first `bucket` columns of the step's rows."""

    def __init__(self, slots: StaticSlots, positions: torch.Tensor, bucket: int):
        self.slots, self.positions, self.bucket = slots, positions, bucket

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        rows = keys.shape[0]
        slot_keys, slot_values = self.slots.keys[layer_idx, :rows], self.slots.values[layer_idx, :rows]
        index = self.positions[:, None, :, None].expand_as(keys)
        slot_keys.scatter_(2, index, keys)
        slot_values.scatter_(2, index, values)
        return slot_keys[:, :, : self.bucket], slot_values[:, :, : self.bucket]
