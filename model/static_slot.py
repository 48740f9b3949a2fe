"""One session's KV in a static buffer, stepped through CUDA graphs (docs/architecture.md §4).

At batch 1 an eager forward of a 1.5B model on a GPU is bound by kernel launches (hundreds per
step), not by the GPU. A CUDA graph replays a whole step as one launch, but it needs every
tensor it touches at a fixed address. So the session being stepped at batch 1 lives in one
preallocated slot, [layers][1, kv heads, capacity, head dim], and each step writes its new KV
at the session's next columns (`index_copy_`); attention reads the first C columns, a bucket
(a power of two) just past the session's length, with a mask that hides the columns beyond
each new token. One graph is captured per (new tokens T, bucket C) the first time it is needed:
T = 1 is a decode step, T = K + 1 a verify. Longer rows (a prefill) run the same code eagerly.

Without graphs (`graphs=False`, and always on a CPU) the slot runs eagerly: the tests check it
against the engine's DynamicCache path on any machine, and graph replays against it on a GPU.
The engine (model/transformers_engine.py) decides which session is resident and moves a
session's KV between the slot and its own cache when another one needs the slot.
"""

import logging

import torch
from transformers import DynamicCache, PreTrainedModel

log = logging.getLogger(__name__)

SMALLEST_BUCKET = 256


class StaticSlot:
    def __init__(self, model: PreTrainedModel, capacity: int, max_graph_tokens: int, graphs: bool):
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.model = model
        self.device = model.device
        self.capacity = capacity
        self.graphs_enabled = graphs and self.device.type == "cuda"
        self.max_graph_tokens = max_graph_tokens
        shape = (config.num_hidden_layers, 1, config.num_key_value_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=model.dtype, device=self.device)
        self.values = torch.zeros_like(self.keys)
        self.session_id: str | None = None  # the resident session
        self.length = 0  # its cached tokens
        # The graphs' inputs, at fixed addresses; a step of T tokens uses their first T entries.
        self.input_ids = torch.zeros(1, max_graph_tokens, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(1, max_graph_tokens, dtype=torch.long, device=self.device)
        self.mask = torch.zeros(1, 1, max_graph_tokens, capacity, dtype=torch.bool, device=self.device)
        self.columns = torch.arange(capacity, device=self.device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.graphs_enabled else None

    # -- residency ---------------------------------------------------------------------------

    def load(self, session_id: str, cache: DynamicCache | None) -> None:
        """Make `session_id` resident, its KV copied in from its own cache (None: empty)."""
        length = cache.get_seq_length() if cache is not None else 0
        for index in range(self.keys.shape[0]) if length else ():
            self.keys[index, :, :, :length] = cache.layers[index].keys
            self.values[index, :, :, :length] = cache.layers[index].values
        self.session_id, self.length = session_id, length

    def unload(self) -> DynamicCache:
        """The resident session's KV as a cache of its own; the slot is free after."""
        layers = [
            (self.keys[index, :, :, : self.length].clone(), self.values[index, :, :, : self.length].clone())
            for index in range(self.keys.shape[0])
        ]
        self.session_id, self.length = None, 0
        return DynamicCache(ddp_cache_data=layers) if layers[0][0].shape[2] else DynamicCache()

    def fits(self, new_tokens: int) -> bool:
        return self.length + new_tokens <= self.capacity

    # -- stepping ----------------------------------------------------------------------------

    def forward(self, tokens: list[int]) -> torch.Tensor:
        """Append `tokens` to the resident session; float32 logits [len(tokens), V], on the device."""
        count = len(tokens)
        bucket = self._bucket(self.length + count)
        ids = torch.tensor([tokens], dtype=torch.long).to(self.device, non_blocking=True)
        positions = torch.arange(self.length, self.length + count, device=self.device).unsqueeze(0)
        if self.graphs_enabled and count <= self.max_graph_tokens:
            self.input_ids[:, :count].copy_(ids)
            self.positions[:, :count].copy_(positions)
            self.mask[0, 0, :count, :bucket].copy_(self.columns[:bucket] <= positions[0, :, None])
            try:
                graph, logits = self.graphs.get((count, bucket)) or self._capture(count, bucket)
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as error:  # an op that cannot be captured: say so, and step eagerly
                log.warning("CUDA graph capture failed, stepping eagerly from now on: %s", error)
                self.graphs_enabled = False
                return self.forward(tokens)
            graph.replay()
            logits = logits.clone()
        else:
            mask = (self.columns[:bucket] <= positions[0, :, None]).reshape(1, 1, count, bucket)
            logits = self._step(ids, positions, mask, bucket)
        self.length += count
        return logits

    def _bucket(self, length: int) -> int:
        bucket = SMALLEST_BUCKET
        while bucket < length:
            bucket *= 2
        return min(bucket, self.capacity)

    def _step(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, bucket: int) -> torch.Tensor:
        hidden = self.model.model(
            input_ids=ids,
            position_ids=positions,
            attention_mask={"full_attention": mask},
            cache=_SlotCache(self, positions[0], bucket),
            use_cache=True,
        ).last_hidden_state
        return self.model.lm_head(hidden[0]).float()

    def _capture(self, count: int, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Record one step of `count` tokens over the first `bucket` columns. The warm-up runs
        write the KV of the step about to run, at columns past the session's length: harmless."""
        args = (self.input_ids[:, :count], self.positions[:, :count], self.mask[:, :, :count, :bucket], bucket)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(*args)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another engine's thread in this process (tests, benches) may run meanwhile
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits = self._step(*args)
        self.graphs[(count, bucket)] = graph, logits
        log.info("captured a CUDA graph for %d new tokens over %d columns (%d graphs)", count, bucket, len(self.graphs))
        return graph, logits


class _SlotCache:
    """The cache the model's attention layers see for one step: each layer's new KV goes into
    the slot at the step's positions; attention reads the slot's first `bucket` columns."""

    def __init__(self, slot: StaticSlot, positions: torch.Tensor, bucket: int):
        self.slot, self.positions, self.bucket = slot, positions, bucket

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        slot_keys, slot_values = self.slot.keys[layer_idx], self.slot.values[layer_idx]
        slot_keys.index_copy_(2, self.positions, keys)
        slot_values.index_copy_(2, self.positions, values)
        return slot_keys[:, :, : self.bucket], slot_values[:, :, : self.bucket]
