"""The Engine (model/engine.py) over llama.cpp, on a GGUF file, through llama-cpp-python's low-level API.

One llama context holds every session: a session is a sequence (a seq id of its own) with a KV
stream of its own (`kv_unified` off), allocated once for `session_tokens` tokens; crop is
`llama_memory_seq_rm` from the cut on, release frees the seq id. Logits come back only for the
positions a row keeps, as float32 on the CPU, where llama.cpp runs.

Exact by construction: speculation must score every position exactly as a plain decode step
would, or greedy output changes at near-ties (a Q4_K model quantizes each activation row to 8 bits,
so one rounding apart in a sum can move a logit by 0.5). So the positions a pass keeps logits for
(a decode step's one, a verify's K + 1) go through llama_decode in calls of at most `call_tokens`
positions, whatever their sessions, and the tokens before them in a row (a prompt, a catch-up)
run first, in calls of 512 of their own: a prompt is prefilled by the same calls with speculation
on or off, and every position after it is scored by the one-row kernels in both. Each session's
KV has a stream of its own (`kv_unified` off): in the unified cache a rollback lets a session's
next tokens land in cells before its earlier ones, and attention sums cells in cell order.

How many positions one call may score depends on ggml-cpu's matmul kernels on this CPU, and on
the patches setup.sh builds into them: a probe at load decides (model/llama_cpp_exactness.py).

Attention is llama.cpp's flash attention over a K cache of Q8_0 (`ATTENTION`; llama.cpp's default is F16).
ggml-cpu's flash attention (ggml_compute_forward_flash_attn_ext_f16) takes one of three
paths per call: for one query row of one KV stream over a view of 512 cells or more (a lone decode
step past 256 tokens: llama.cpp pads the view to 256 cells) it splits the cells across threads and adds
the partial softmax sums up; from 64 query rows it tiles; otherwise each row runs over the cells in
order. The three round differently, so past 256 tokens an F16 cache's lone decode step is not
bit-equal to the same position in a verify, or in a pass batched beside another session (a logit apart
by up to 0.6), and greedy output under load changed at near-ties. The split and the tiles are taken only
for an F16 or F32 K cache whose V has the same type: over a Q8_0 K every call runs row by row. Without
flash attention the KQ matmul of several rows rounds otherwise than one row's (a verify of 2 positions
at 8 tokens of context is off by 0.45), so that is exact only at one scored position per call.
Measured on the default target, AMD EPYC Zen 4 (family 25 model 17), 2 threads
(scripts/measure_attention.py, docs/results/attention_zen4.json), a decode step at 100/300/700 tokens of
context and a prefill of 512 tokens, with the weights and positions per call the probe found exact:
Q8_0 K, F16 V (repacked, 3 per call) 37/35/36 ms, 5.5 s; Q8_0 K and V 29/30/34 ms, 6.2 s; BF16 K and V
34/33/42 ms, 6.6 s; F16 flash, inexact with repacked weights past 256 tokens, so plain at one per call
(as without flash attention) 37/39/40 ms, 4.2 s. Decode steps vary by ±4 ms between runs here (an
earlier run: Q8_0 K, F16 V 29/30/36 ms): a Q8_0 K is as fast as any exact setting, keeps V at F16
and a verify of 3 positions in one call, and quantizes K as llama.cpp's `-ctk q8_0` does.
(Plain weights prefill faster than repacked ones here, 4.2 against 5.5 s: not yet used.)
The load-time probe (`_exact`) scores its positions past 256 tokens of context, so a llama.cpp that
rounds otherwise there is caught at load.

`--exactness batched` (`exactness="batched"`) gives the bitwise guarantee up for speed under load: no
probe, repacked weights (plain where ggml has AMX), and every kept position of a pass in one llama_decode
call (`BATCH_TOKENS`), so 8 sessions' decode steps are one gemm over 8 rows rather than three calls of
gemv. Each position then rounds as the shape of its pass has it, as llama-server's and vLLM's do: greedy
output can differ from target-only decoding at near-ties, and speculation still samples exactly from the
distribution the target computed in that pass. Its KV is one unified cache (`kv_unified`), which llama.cpp
cuts with `split_simple`: a pass is one ubatch whatever seq ids its sessions have and however many
positions each row scores, where a stream per session would split it at every gap in the seq ids and
every change of row length (split_equal above). Measured on Zen 5 (family 26), 2 cores, the default
prompts at 4 / 8 / 16 streams (docs/performance/under-load.md): 42.3 / 48.9 / 58.7 tok/s with a stream
per session, 61.5 / 47.5 / 75.3 unified. A new session's prompt runs in that ubatch too (continuous
batching, as llama-server's), not in prefill calls of its own: at 16 streams (48 tokens each, prompts
of ~39 tokens that never repeat) 54.9 tok/s, where bitwise, whose prompts take ubatches of their own
whatever the call, made 43.7; the prefix cache then keeps what such passes computed.

In both modes a new session takes the lowest free seq id and a pass's kept positions go in seq-id
order, so consecutive sessions share a ubatch (split_equal above);
in `bitwise`, a gap of one or two seq ids between a scored call's sessions is filled with a token each,
removed after the call (`GAP_FILL`), so a pass that carries 10 or 12 of 16 streams is one ubatch too.

Not thread-safe: the service's model thread is its only caller.
"""

import ctypes
import heapq
import logging
import os
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import llama_cpp as llama
import numpy as np
import torch
from llama_cpp._logger import set_verbose
from transformers import PreTrainedTokenizerBase

from specd.model.engine import ModelDescription, Row
from specd.model.errors import CapacityExceeded
from specd.model.llama_cpp_exactness import (
    EXACT_FOUND,
    TILED_MIN_ROWS,
    exact_settings,
    ggml_has_amx,
    probed_key,
    restores_as_fresh_prefill,
    scores_as_decode_steps,
)
from specd.model.loaded import tokenizer_files, tokenizer_fingerprint
from specd.model.prefix_cache import BLOCK_TOKENS, prefill_cuts, starts_call
from specd.proto.limits import EXACTNESS

MAX_SEQUENCES = 256  # LLAMA_MAX_SEQ: llama.cpp's own bound on sequences in one context
BATCH_TOKENS = 512  # the most tokens one llama_decode call takes
GGML_TYPE_BF16 = 30  # ggml.h's; llama-cpp-python names no constant for it
# (flash attention, K cache type, V cache type), the first a context can be made with: flash attention
# over a Q8_0 K cache, exact past 256 tokens of context where an F16 K cache is not (the docstring;
# scripts/measure_attention.py); over BF16 where the heads are too narrow for Q8_0's 32-value blocks
ATTENTION = (
    (llama.LLAMA_FLASH_ATTN_TYPE_ENABLED, llama.GGML_TYPE_Q8_0, llama.GGML_TYPE_F16),
    (llama.LLAMA_FLASH_ATTN_TYPE_ENABLED, GGML_TYPE_BF16, GGML_TYPE_BF16),
)
# A row's tokens before those it keeps logits for run in calls cut at every PREFILL_BLOCK-th position
# of its session, so that a prefix of whole blocks is computed alike wherever its prefill started
# (`reusable`, the prefix cache's blocks). 64-token calls prefill 5 % slower than calls of 512 here.
PREFILL_BLOCK = BLOCK_TOKENS
# A call's sessions run as one ubatch only where their seq ids are consecutive (split_equal, the
# module's docstring): a gap of up to this many seq ids between two of a scored call's sessions is
# filled with a token each that nothing keeps, removed after the call (`_fillers`). Measured on the
# default target (Zen 5, 2 threads, 16 sessions of 100 tokens, one decode step each of those called,
# medians of 7): 10 of 16 with gaps of 1-2, 217 -> 190 ms; 12 of 16 (every 4th out), 250 -> 202 ms;
# the same 12 with a verify of 3 guesses in every third, 430 -> 381 ms; all 16, 176 ms.
GAP_FILL = 2

log = logging.getLogger(__name__)


class LlamaCppEngine:
    copies_take_kv_memory = False  # the KV cells are allocated at start; the prefix cache's copies are in host RAM

    def __init__(
        self,
        gguf: Path,
        name: str,
        tokenizer: PreTrainedTokenizerBase,
        eos_token_ids: list[int],
        threads: int,
        sessions: int,
        session_tokens: int,
        exactness: str = "bitwise",
    ):
        if exactness not in EXACTNESS:
            raise ValueError(f"--exactness takes {' or '.join(EXACTNESS)}, not {exactness!r}")
        if not 1 <= sessions <= MAX_SEQUENCES:
            raise ValueError(f"the llama.cpp engine holds 1..{MAX_SEQUENCES} sessions, not {sessions}")
        set_verbose(False)  # llama.cpp logs every load and context on stderr; errors only
        llama.llama_backend_init()
        self.tokenizer = tokenizer
        self.sequences: dict[str, int] = {}  # session id -> its seq id
        self.lengths: dict[str, int] = {}  # session id -> tokens in its KV
        self.canonical: dict[str, int] = {}  # session id -> leading tokens a fresh prefill computes the same (reusable)
        self.boundaries = frozenset(eos_token_ids)  # a prefill call ends before each (prefix_cache.prefill_cuts)
        self.free = list(range(sessions))  # a heap: the lowest free seq id first, so a pass's seq ids stay consecutive
        self.filled = 0  # tokens of gaps filled so far (`_fillers`)
        self.exactness = exactness
        if exactness == "bitwise":  # ggml reads it at its first tiled matmul, once a process (TILED_MIN_ROWS)
            os.environ.setdefault("GGML_CPU_TILED_MM_MIN_ROWS", str(TILED_MIN_ROWS))
        if exactness == "batched":  # every scored position of a pass in one call: ggml's gemm from 4 rows
            self.repacked, self.call_tokens = not ggml_has_amx(), BATCH_TOKENS
            self._load(gguf, self.repacked, threads, sessions, session_tokens)
        elif (probed := probed_key(gguf, threads, sessions, session_tokens)) in EXACT_FOUND:
            self.repacked, self.call_tokens = EXACT_FOUND[probed]
            self._load(gguf, self.repacked, threads, sessions, session_tokens)
        else:
            for repacked, call_tokens in exact_settings():
                self._load(gguf, repacked, threads, sessions, session_tokens)
                self.repacked, self.call_tokens = repacked, call_tokens
                if self._exact():
                    break
                self._unload()
            else:  # no setting scores several positions as decode steps do: one per call always does
                self._load(gguf, False, threads, sessions, session_tokens)
                self.repacked, self.call_tokens = False, 1
            EXACT_FOUND[probed] = self.repacked, self.call_tokens
        # batched: a prompt is prefilled among the pass's other rows (`_calls`), so no two prefills
        # of it round alike and a restored prefix is as good as any (llama-server's prompt cache)
        self.prefixes_exact = exactness == "batched" or self._prefix_exact()
        weights = "repacked" if self.repacked else "plain"
        log.info(
            "%s: %s weights, at most %d scored positions per llama_decode call (--exactness %s)",
            name,
            weights,
            self.call_tokens,
            exactness,
        )
        if not self.prefixes_exact:
            log.warning("%s: a restored prefix does not give a fresh prefill's logits here: no prefix reuse", name)
        self.description = ModelDescription(
            name=name,
            vocab_size=self.vocab_size,
            max_positions=min(llama.llama_model_n_ctx_train(self.model), llama.llama_n_ctx_seq(self.context)),
            dtype="gguf",
            device="cpu",
            eos_token_ids=eos_token_ids,
            tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
            quantization=_file_type(self.model),
            max_sessions=sessions,
            padded=False,  # each row's own positions: calls are laid out by position, not padded
            scored_per_call=None if exactness == "batched" else self.call_tokens,
            splits_rows=exactness != "batched",  # a KV stream per session: llama.cpp's split_equal
        )

    def _load(self, gguf: Path, repacked: bool, threads: int, sessions: int, session_tokens: int) -> None:
        model_params = llama.llama_model_default_params()
        model_params.use_extra_bufts = repacked
        self.model = llama.llama_model_load_from_file(str(gguf).encode(), model_params)
        if not self.model:
            raise ValueError(f"llama.cpp could not load {gguf}")
        params = llama.llama_context_default_params()
        params.n_ctx = sessions * session_tokens
        params.n_batch = params.n_ubatch = BATCH_TOKENS
        params.n_seq_max = sessions
        # bitwise: a stream of n_ctx / n_seq_max cells per sequence (cell order is position order);
        # batched: one unified cache, so a pass is one ubatch whatever its seq ids and row lengths
        params.kv_unified = self.exactness == "batched"
        params.n_threads = params.n_threads_batch = threads
        params.no_perf = True
        for params.flash_attn_type, params.type_k, params.type_v in ATTENTION:
            self.context = llama.llama_init_from_model(self.model, params)
            if self.context:
                break
        if not self.context:
            raise CapacityExceeded(f"llama.cpp could not allocate {sessions} sessions of {session_tokens} tokens")
        self.memory = llama.llama_get_memory(self.context)
        self.batch = llama.llama_batch_init(BATCH_TOKENS, 0, 1)
        self.vocab_size = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(self.model))
        self.n_ctx = llama.llama_n_ctx(self.context)

    _exact = scores_as_decode_steps  # the probes at load (model/llama_cpp_exactness.py)
    _prefix_exact = restores_as_fresh_prefill

    def _unload(self) -> None:
        llama.llama_batch_free(self.batch)
        llama.llama_free(self.context)
        llama.llama_model_free(self.model)
        self.batch = self.context = self.model = None

    def __del__(self):
        if getattr(self, "batch", None) is not None:
            llama.llama_batch_free(self.batch)
        if getattr(self, "context", None):
            llama.llama_free(self.context)
        if getattr(self, "model", None):
            llama.llama_model_free(self.model)

    def kv_token_budget(self) -> int:
        """The context's cells: allocated once, the most the service may cache."""
        return self.n_ctx

    def forward(self, rows: list[Row]) -> list[torch.Tensor]:
        """llama_decode calls as `_calls` lays them out; on any failure every row is cut back to
        where it was."""
        new = [row.session_id for row in rows if row.session_id not in self.sequences]
        if len(new) > len(self.free):
            raise CapacityExceeded(f"{len(self.sequences)} sessions in the llama.cpp context, room for no more")
        for session_id in new:
            self._allocate(session_id)
        starts = [self.lengths[row.session_id] for row in rows]
        out = [np.empty((row.keep_logits, self.vocab_size), dtype=np.float32) for row in rows]
        try:
            sequences = [self.sequences[row.session_id] for row in rows]
            mixed = self.exactness == "batched"
            for call in _calls(rows, starts, self.call_tokens, sequences, self.boundaries, mixed):
                scored = all(offset >= len(rows[i].tokens) - rows[i].keep_logits for i, offset in call)
                fill = self._fillers({sequences[i] for i, _ in call}, set(sequences), len(call)) if scored else []
                self._decode(rows, starts, out, call, fill)
        except BaseException:
            for row, start in zip(rows, starts):
                llama.llama_memory_seq_rm(self.memory, self.sequences[row.session_id], start, -1)
            for session_id in new:
                self.release(session_id)
            raise
        for row, start in zip(rows, starts):
            self.lengths[row.session_id] = start + len(row.tokens)
            head_end = start + len(row.tokens) - row.keep_logits  # prefilled in the canonical calls (_calls)
            first = row.tokens[0] if row.tokens else -1
            canonical = self.exactness == "batched" or starts_call(start, first, self.boundaries)
            if self.canonical[row.session_id] == start and canonical:
                self.canonical[row.session_id] = head_end  # a fresh prefill of this head makes these calls
        return [torch.from_numpy(logits) for logits in out]

    def _allocate(self, session_id: str) -> None:
        self.sequences[session_id] = heapq.heappop(self.free)
        self.lengths[session_id] = self.canonical[session_id] = 0

    def _fillers(self, called: set[int], busy: set[int], positions: int) -> list[tuple[int, int]]:
        """(seq id, position) of a token for each seq id in a gap of at most GAP_FILL between the seq
        ids of a scored call (`called`), so that llama.cpp runs it as one ubatch; none of a session in
        this pass (`busy`: its cells are being written), none past a full stream, and never more than
        the call may hold (`call_tokens`, the rows the probe checked: a call of 3 takes none). Whatever
        the rows beside, each scores as alone (the kernels the probe found exact); the fillers' cells are
        removed after the call, so the streams hold what they held. `batched`: one unified cache, no gaps."""
        if self.exactness == "batched":
            return []
        owners = {sequence: session_id for session_id, sequence in self.sequences.items()}
        fill, order, room = [], sorted(called), llama.llama_n_ctx_seq(self.context)
        for low, high in zip(order, order[1:]):
            gap = range(low + 1, high)
            if len(gap) > GAP_FILL or positions + len(fill) + len(gap) > self.call_tokens or busy & set(gap):
                continue
            spots = [(sequence, self.lengths.get(owners.get(sequence), 0)) for sequence in gap]
            if all(position < room for _, position in spots):
                fill += spots
        return fill

    def _decode(
        self,
        rows: list[Row],
        starts: list[int],
        out: list[np.ndarray],
        call: list[tuple[int, int]],
        fill: list[tuple[int, int]] = (),
    ) -> None:
        """One llama_decode of the (row index, offset in its tokens) positions of `call`, and of a token
        at each (seq id, position) of `fill` (`_fillers`), whose cells are removed after it."""
        batch, wanted = self.batch, []
        # (seq id, token, position, row index, its kept row or -1), in seq-id order (the fillers among
        # the call's sessions: llama.cpp joins seq ids in the batch's order), each row's in its order
        entries = [(sequence, 0, position, -1, -1) for sequence, position in fill]
        for index, offset in call:
            row = rows[index]
            keep = offset - (len(row.tokens) - row.keep_logits)
            entries.append((self.sequences[row.session_id], row.tokens[offset], starts[index] + offset, index, keep))
        entries.sort(key=lambda entry: entry[0])  # stable: a row's positions stay in order
        for slot, (sequence, token, position, index, keep) in enumerate(entries):
            batch.token[slot], batch.pos[slot], batch.logits[slot] = token, position, keep >= 0
            batch.n_seq_id[slot], batch.seq_id[slot][0] = 1, sequence
            if keep >= 0:
                wanted.append((slot, index, keep))
        batch.n_tokens = len(entries)
        try:
            status = llama.llama_decode(self.context, batch)
        finally:
            for sequence, position in fill:
                llama.llama_memory_seq_rm(self.memory, sequence, position, -1)
        self.filled += len(fill)
        if status == 1:
            raise CapacityExceeded(
                f"no room for {len(call)} more tokens in the llama.cpp KV streams of this pass's sessions; "
                "retry with fewer (every session's cache is as it was before the call)"
            )
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status} on {len(call)} tokens")
        for slot, index, keep in wanted:
            pointer = llama.llama_get_logits_ith(self.context, slot)
            out[index][keep] = np.ctypeslib.as_array(pointer, shape=(self.vocab_size,))

    def passes(self, session_ids: list[str]):
        """Sessions keep their own cells between passes: nothing to hold."""
        return nullcontext()

    def crop(self, session_id: str, length: int) -> None:
        if self.lengths.get(session_id, 0) > length:
            llama.llama_memory_seq_rm(self.memory, self.sequences[session_id], length, -1)
            self.lengths[session_id] = length
            if length < self.canonical[session_id]:  # the cut block was computed for a longer head
                self.canonical[session_id] = length // PREFILL_BLOCK * PREFILL_BLOCK

    # -- the prefix cache's copies (model/prefix_cache.py) ---------------------------------------

    def reusable(self, session_id: str) -> int:
        """The session's leading tokens that prefill calls computed, from token 0 or from a restored
        prefix, up to the end of a head: each call ran from one cut to the next (`prefill_cuts`: every
        block, every end-of-turn token) after the same KV (`_calls`), exactly as a fresh prefill of any
        longer head runs it, and the last one as a fresh prefill of exactly this head (or of one with a
        cut right after it) runs it; restoring them is bit for bit that prefill. Checked at load
        (`_prefix_exact`): none where it fails. Tokens a pass kept logits for (decode steps, verifies)
        never count: they ran through the one-row kernels, which round otherwise than a prefill's
        matmuls. A crop inside the head keeps its whole blocks only. `batched` promises no bit of
        this: there every head counts (a prompt ran among other rows, rounding as their pass had it)."""
        return self.canonical.get(session_id, 0) if getattr(self, "prefixes_exact", True) else 0

    def snapshot(self, session_id: str, length: int) -> "SequenceState":
        """The session's sequence state (its cells' KV, llama_state_seq_get_data) in host memory:
        one copy of what it holds now, of which the first `length` tokens are kept for reuse."""
        sequence = self.sequences[session_id]
        size = llama.llama_state_seq_get_size(self.context, sequence)
        data = (ctypes.c_uint8 * size)()
        written = llama.llama_state_seq_get_data(self.context, data, size, sequence)
        if written == 0:
            raise RuntimeError(f"llama.cpp could not copy the state of session {session_id!r}")
        return SequenceState(data, written, length, self.lengths[session_id])

    def restore(self, session_id: str, snapshot: "SequenceState", length: int) -> None:
        """A new sequence for the session, filled from the snapshot and cut to `length` tokens."""
        if session_id in self.sequences:
            raise RuntimeError(f"session {session_id!r} already holds KV: restore starts a session")
        if not self.free:
            raise CapacityExceeded(f"{len(self.sequences)} sessions in the llama.cpp context, room for no more")
        self._allocate(session_id)
        sequence = self.sequences[session_id]
        if llama.llama_state_seq_set_data(self.context, snapshot.data, snapshot.nbytes, sequence) == 0:
            self.release(session_id)
            raise CapacityExceeded(f"no room in the llama.cpp KV stream of session {session_id!r} for its prefix")
        llama.llama_memory_seq_rm(self.memory, sequence, length, -1)
        self.lengths[session_id] = self.canonical[session_id] = length

    @property
    def scores_from_cache(self) -> bool:
        """Whether a prompt's last position, scored in its opening pass, may be restored with its logits
        (SessionStore's first tokens from the cache): in `bitwise` every scored position's logits and
        KV are a decode step's whatever the call (the probe at load), and restores are exact."""
        return self.exactness == "bitwise" and self.prefixes_exact

    def restore_scored(self, session_id: str, snapshot: "SequenceState", length: int) -> None:
        """`restore`, where the last of the `length` tokens is a position a pass scored (not a prefill's:
        it does not count as `reusable`)."""
        self.restore(session_id, snapshot, length)
        self.canonical[session_id] = length - 1

    def release(self, session_id: str) -> None:
        sequence = self.sequences.pop(session_id, None)
        if sequence is not None:
            llama.llama_memory_seq_rm(self.memory, sequence, -1, -1)
            heapq.heappush(self.free, sequence)
            del self.lengths[session_id], self.canonical[session_id]

    def tokenizer_files(self) -> dict[str, bytes]:
        return tokenizer_files(self.tokenizer)


@dataclass(frozen=True)
class SequenceState:
    """A copy of one sequence's KV in host memory (llama_state_seq_get_data's format)."""

    data: ctypes.Array
    nbytes: int
    length: int  # its leading tokens that may be restored
    held_tokens: int  # the whole sequence's: llama.cpp copies a sequence whole (the tail and drafts too)


def _calls(
    rows: list[Row],
    starts: list[int],
    call_tokens: int,
    sequences: list[int],
    boundaries: frozenset[int],
    mixed: bool = False,
) -> list[list[tuple[int, int]]]:
    """The pass's llama_decode calls, as (row index, offset) positions. `mixed` (batched): every
    position of every row, rows in seq-id order, in calls of `call_tokens`: prompts and decode steps
    in one ubatch, as llama-server's continuous batching runs them. Else (bitwise): first each row's tokens
    before the ones it keeps logits for (a prefill, a catch-up), in calls of their own cut at every
    PREFILL_BLOCK-th position of the session and before every end-of-turn token (`prefill_cuts`), so a
    call is the same whichever cut the prefill started from (a restored prefix, token 0); then the
    kept positions of every row together in calls of `call_tokens`, in the order of the rows' seq ids
    (`sequences`): llama.cpp puts sequences in one ubatch only while their seq ids rise by one
    (`split_equal`), else it runs the call as several graphs."""
    order = sorted(range(len(rows)), key=sequences.__getitem__)
    if mixed:
        every = [(index, offset) for index in order for offset in range(len(rows[index].tokens))]
        return [every[start : start + call_tokens] for start in range(0, len(every), call_tokens)]
    calls = []
    for index, (row, start) in enumerate(zip(rows, starts)):
        cuts = prefill_cuts(row.tokens, start, len(row.tokens) - row.keep_logits, boundaries)
        calls += [[(index, offset) for offset in range(a, b)] for a, b in zip(cuts, cuts[1:]) if b > a]
    kept = [
        (index, offset)
        for index in order
        for offset in range(len(rows[index].tokens) - rows[index].keep_logits, len(rows[index].tokens))
    ]
    return calls + [kept[start : start + call_tokens] for start in range(0, len(kept), call_tokens)]


def _file_type(model) -> str:
    """The GGUF's weight type as llama.cpp describes the model ("qwen2 1.5B Q4_K - Medium" -> "Q4_K - Medium")."""
    text = ctypes.create_string_buffer(256)
    llama.llama_model_desc(model, text, len(text))
    description = text.value.decode(errors="replace")
    return description.split(" ", 2)[-1] if description.count(" ") >= 2 else description or "gguf"
