"""Which llama_decode calls score a position bit for bit as a decode step does, on this CPU and
this llama.cpp build: the llama.cpp engine's settings and its probes at load (model/llama_cpp_engine.py).

How many positions one call may score depends on the weights' kernels (ggml-cpu):
- repacked weights (`use_extra_bufts`, llama.cpp's default: Q4_K/Q5_K/Q6_K/Q8_0 interleaved for
  AVX2/AVX-512): a matmul of 4 rows or more takes the gemm kernel, whose sums differ from the
  one-row gemv; up to 3 rows each row goes through gemv, as a decode step does. So calls of 3.
  With scripts/batch_invariant_ggml/'s patches, which setup.sh builds into the binding's ggml-cpu,
  the x86 Q4_K gemm sums each super-block as the gemv does (bit for bit its result, whatever the rows
  beside), and the weights x86 does not repack (Q6_K) take the one-row vec_dot in calls of fewer
  than TILED_MIN_ROWS rows: calls of up to 63 positions, 16 sessions' steps ~1.8x faster than in
  calls of 3 (docs/performance/under-load.md, "Which kernels are batch-invariant").
- plain weights: up to 7 rows take the one-row kernel; from 8 on (TILED_MIN_ROWS with the patch), a
  tiled K-quant matmul.
Repacked is the faster (measured on the default target, AMD EPYC Zen 5, family 26, AVX-512, 2
threads: a decode step 32 ms against 37 ms; 5 positions in calls of 3 + 2, 114 ms, against one call
of 5, 119 ms). Other CPUs may add buffer types of their own, so the engine does not take this on
trust: at load it scores a few positions both ways (`scores_as_decode_steps`) and takes the first setting that is
bit-for-bit exact on this CPU, else one position per call.

Why scoring every call through the gemm (rows padded to 4) is no way out either, measured on an AMD EPYC
(family 23, AVX2 only, 2 threads, the default target): the gemm is slower per row there (1 real row padded to 4:
313 ms against a 98 ms one-row decode; 16 rows 1003 ms), and not exact against itself across call shapes (a
position scored in a call of 5 rows differs from the same position in a call of 4). And a pass batches only
as far as llama.cpp splits it: with a KV stream per sequence, one ubatch takes sequences with consecutive seq
ids and as many tokens each (`llama_batch_allocr::split_equal`), so sessions with scattered seq ids run as
several ubatches.

On Intel CPUs with AMX, ggml's extra buffer types include AMX's, and its matmul crashes the process
(a general protection fault in ggml_backend_amx_mul_mat; ggml-org/llama.cpp#20824, open): measured
on an Intel Xeon (family 6, model 167) with llama-cpp-python 0.3.36 and with llama-server 0.26.
There the engine uses plain weights only (`exact_settings`); repacking the Q4_K weights alone (the
AMX type left out by tensor overrides) was no faster there than plain, within the noise.
"""

from pathlib import Path

import llama_cpp as llama
import torch

from specd.model.engine import Row
from specd.model.prefix_cache import BLOCK_TOKENS

# ggml's tiled matmul (for the weights x86 does not repack: Q6_K) from this many rows of a call, not 8
# (GGML_CPU_TILED_MM_MIN_ROWS, a patch's): a whole prefill block (BLOCK_TOKENS) keeps it, and every
# scored call, of fewer rows, runs the one-row vec_dot
TILED_MIN_ROWS = BLOCK_TOKENS
# (repacked weights, positions one call may score) tried in order: see this module's docstring. The
# first holds where ggml-cpu has scripts/batch_invariant_ggml/'s patches (setup.sh installs them)
EXACT_SETTINGS = ((True, TILED_MIN_ROWS - 1), (True, 3), (False, 7))
# the call sizes the probe tries, of those up to a setting's (and its own): each remainder the gemm
# leaves to the gemv (rows past a multiple of 4), the 16-row blocks, the tiled matmul's old threshold (8)
PROBE_CALLS = (2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 33)
# the self-test's context before the positions it scores: past 256 tokens, where llama.cpp's attention
# view grows to 512 cells and flash attention would split a lone decode step across threads
PROBE_TOKENS = 264


def ggml_has_amx() -> bool:
    """Whether ggml here would put weights in its AMX buffer type, which crashes (module docstring)."""
    llama.llama_backend_init()
    return b"AMX_INT8 = 1" in llama.llama_print_system_info()


# What the probe (`scores_as_decode_steps`) found, by probed_key's key: a fact of the file, this CPU and
# llama.cpp build, the threads and the context's shape, so a process that loads the same model again (a
# restarted service in the same process, the tests) takes it without loading each setting again.
EXACT_FOUND: dict[tuple, tuple[bool, int]] = {}


def probed_key(gguf: Path, threads: int, sessions: int, session_tokens: int) -> tuple:
    stat = Path(gguf).stat()
    return str(Path(gguf).resolve()), stat.st_size, stat.st_mtime_ns, threads, sessions, session_tokens


def exact_settings() -> tuple[tuple[bool, int], ...]:
    """EXACT_SETTINGS that are safe to try here: none with extra buffer types where ggml has AMX."""
    amx = ggml_has_amx()
    return tuple(setting for setting in EXACT_SETTINGS if not (amx and setting[0]))


def scores_as_decode_steps(engine) -> bool:
    """Whether, past PROBE_TOKENS of context (or as far as a session's stream holds), calls of
    PROBE_CALLS positions up to call_tokens (and of call_tokens) give bit for bit a decode step's
    logits at each, and a decode step scored beside other sessions' (as many as there is room for,
    up to a call's worth and 32) gives its own. Stops at the first that does not."""
    sizes = sorted({n for n in (*PROBE_CALLS, engine.call_tokens) if 2 <= n <= engine.call_tokens})
    sizes = [n for n in sizes if n < llama.llama_n_ctx_seq(engine.context)]
    length = min(PROBE_TOKENS, llama.llama_n_ctx_seq(engine.context) - max(sizes, default=1))
    tokens = [(7 * i + 3) % engine.vocab_size for i in range(length + max(sizes, default=1))]
    try:
        steps = [engine.forward([Row("probe", tokens[: length + 1], 1)])[0]]
        steps += [engine.forward([Row("probe", [token], 1)])[0] for token in tokens[length + 1 :]]
        for n in sizes:
            engine.crop("probe", length)
            if not torch.equal(engine.forward([Row("probe", tokens[length : length + n], n)])[0], torch.cat(steps[:n])):
                return False
        engine.crop("probe", length)
        others = [Row(f"probe-{i}", [tokens[i]], 1) for i in range(min(len(engine.free), engine.call_tokens - 1, 32))]
        return not others or torch.equal(
            engine.forward([Row("probe", tokens[length : length + 1], 1), *others])[0], steps[0]
        )
    finally:
        for session_id in [*engine.sequences]:
            if session_id.startswith("probe"):
                engine.release(session_id)


def restores_as_fresh_prefill(engine) -> bool:
    """Whether a session restored from a prefix's snapshot, then prefilled on, scores bit for bit as a
    fresh prefill of the same tokens (the engine's `reusable`: the prefix cache's premise), on this CPU
    and these weights. Its prefills are cut at every BLOCK_TOKENS-th position (the engine's PREFILL_BLOCK)."""
    tokens = [(11 * i + 5) % engine.vocab_size for i in range(2 * BLOCK_TOKENS + 3)]
    fresh = engine.forward([Row("probe", tokens, 1)])[0]
    state = engine.snapshot("probe", len(tokens) - 1)
    engine.release("probe")
    exact = True
    for held in (BLOCK_TOKENS, len(tokens) - 1):  # the first block of the head's two; the head whole
        engine.restore("probe", state, held)
        resumed = engine.forward([Row("probe", tokens[held:], 1)])[0]
        engine.release("probe")
        exact = exact and torch.equal(fresh, resumed)
    return exact
