"""The engine interface (model/engine.py), engine by engine: batching, rollback and release must
not change a single logit. Every test takes `make_engine`; a new engine joins by adding itself
to ENGINES (a factory from the tiny target's LoadedModel and its GGUF file)."""

import pytest
import torch
from conftest import DEVICES

from specd.draft_service.drafter import Drafter, ProposeCall
from specd.model.engine import Engine, Row
from specd.model.errors import CapacityExceeded
from specd.model.loaded import tokenizer_fingerprint
from specd.model.loading import load_engine
from specd.model.sampling import Sampling
from specd.model.sessions import Cursor
from specd.model.transformers_engine import TransformersEngine
from specd.proto.contract import fingerprint
from specd.proto.limits import Limits

try:
    from specd.model import llama_cpp_engine
    from specd.model.llama_cpp_engine import BATCH_TOKENS, LlamaCppEngine
    from specd.model.llama_cpp_exactness import EXACT_SETTINGS, exact_settings
except ModuleNotFoundError:  # no llama-cpp-python (the lent GPU machine): the CUDA engine tests still run
    llama_cpp_engine = BATCH_TOKENS = EXACT_SETTINGS = exact_settings = None
    LlamaCppEngine = type("LlamaCppEngine", (), {})

# Factories from the tiny target's LoadedModel and its GGUF. "static-slot" steps batch-1 rows in the
# static slot (model/static_slot.py): through CUDA graphs on a GPU, eagerly on a CPU; its batch-1
# rows are checked against batched passes, which never use the slot. llama.cpp runs the same
# weights from a float32 GGUF (tests/tiny_gguf.py), on the CPU only.
ENGINES = {
    "transformers": lambda loaded, gguf: TransformersEngine(loaded),
    "transformers-static-slot": lambda loaded, gguf: TransformersEngine(loaded, graphs=True),
    "llama.cpp": lambda loaded, gguf: load_engine("target", str(gguf()), engine="llama.cpp"),
}
PROMPTS = [list(range(1000, 1007)), list(range(2000, 2003)), list(range(3000, 3012))]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture(params=list(ENGINES))
def make_engine(request, tiny_on, device):
    if request.param == "llama.cpp" and device != "cpu":
        pytest.skip("the llama.cpp engine runs on the CPU")
    return lambda: ENGINES[request.param](
        tiny_on(device)["target"], lambda: request.getfixturevalue("tiny_gguf")["target"]
    )


@pytest.fixture
def engine(make_engine) -> Engine:
    return make_engine()


def feed(engine: Engine, session_id: str, tokens: list[int], keep: int = 1) -> torch.Tensor:
    return engine.forward([Row(session_id, tokens, keep)])[0]


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def test_description(engine, device, tiny_loaded):
    described = engine.description
    assert described.vocab_size == 151_936 and described.max_positions == 4096
    assert described.device.startswith(device)
    weights = (described.dtype, described.quantization)
    assert weights == (("gguf", "all F32") if isinstance(engine, LlamaCppEngine) else ("float32", "none"))
    assert described.eos_token_ids == tiny_loaded["target"].eos_token_ids and len(described.tokenizer_fingerprint) == 64
    assert described.tokenizer_fingerprint == tokenizer_fingerprint(tiny_loaded["target"].tokenizer)


def test_llama_cpp_runs_the_same_model_as_transformers(tiny_loaded, tiny_gguf):
    """The GGUF holds the tiny target's weights: both engines give the same logits, alone and batched."""
    engines = [
        TransformersEngine(tiny_loaded["target"]),
        load_engine("target", str(tiny_gguf["target"]), engine="llama.cpp"),
    ]
    rows = [Row(f"s{index}", prompt, len(prompt)) for index, prompt in enumerate(PROMPTS)]
    transformers, llama_cpp = (engine.forward(rows) for engine in engines)
    for expected, actual in zip(transformers, llama_cpp):
        torch.testing.assert_close(actual, expected, atol=2e-3, rtol=0)  # ggml keeps the KV in float16
        assert torch.equal(actual.argmax(-1), expected.argmax(-1))


def test_logits_are_float32_for_the_last_keep_positions(engine):
    logits = feed(engine, "s", PROMPTS[0], keep=3)
    assert logits.dtype == torch.float32 and logits.shape == (3, engine.description.vocab_size)
    assert str(logits.device) == engine.description.device  # logits stay on the engine's device
    assert feed(engine, "t", PROMPTS[0], keep=0).shape == (0, engine.description.vocab_size)
    assert_same(logits, feed(engine, "u", PROMPTS[0], keep=len(PROMPTS[0]))[-3:])


def test_extending_in_pieces_equals_feeding_at_once(engine):
    whole = feed(engine, "whole", PROMPTS[2], keep=len(PROMPTS[2]))
    feed(engine, "pieces", PROMPTS[2][:5], keep=0)
    assert_same(feed(engine, "pieces", PROMPTS[2][5:9], keep=4), whole[5:9])
    assert_same(feed(engine, "pieces", PROMPTS[2][9:], keep=3), whole[9:])


def test_one_pass_over_several_rows_equals_each_row_alone(engine):
    """Different cached lengths (one new session), new tokens and kept logits in one pass."""
    tails = [[11, 12, 13, 14], [21], [31, 32]]
    keeps = [4, 1, 2]
    for index, prompt in enumerate(PROMPTS[:2]):
        for tag in ("alone", "together"):
            feed(engine, f"{tag}-{index}", prompt, keep=0)
    together = engine.forward([Row(f"together-{i}", tail, keep) for i, (tail, keep) in enumerate(zip(tails, keeps))])
    for index, (tail, keep) in enumerate(zip(tails, keeps)):
        assert_same(together[index], feed(engine, f"alone-{index}", tail, keep))
    # the KV each session got back is its own: the next step still matches
    together = engine.forward([Row(f"together-{i}", [40 + i], 1) for i in range(3)])
    for index in range(3):
        assert_same(together[index], feed(engine, f"alone-{index}", [40 + index]))


def test_a_row_with_no_tokens_sits_the_pass_out(engine):
    for tag in ("alone", "together"):
        feed(engine, f"{tag}-0", PROMPTS[0], keep=0)
        feed(engine, f"{tag}-1", PROMPTS[1], keep=0)
    together = engine.forward([Row("together-0", [], 0), Row("together-1", [7, 8], 2)])
    assert together[0].shape == (0, engine.description.vocab_size)
    assert_same(together[1], feed(engine, "alone-1", [7, 8], keep=2))
    assert_same(feed(engine, "together-0", [9]), feed(engine, "alone-0", [9]))


def test_a_block_of_passes_equals_the_same_passes_one_by_one(engine):
    """The drafting loop: K passes over the same sessions, rows dropping out as their K ends."""
    for index, prompt in enumerate(PROMPTS):
        for tag in ("block", "loose"):
            feed(engine, f"{tag}-{index}", prompt[:-1], keep=0)
    steps = [[[p[-1]] for p in PROMPTS], [[5], [6], [7]], [[8], [], [9]], [[], [], [10]]]
    in_block = []
    with engine.passes([f"block-{i}" for i in range(3)]):
        for step in steps:
            in_block.append(engine.forward([Row(f"block-{i}", tokens, len(tokens)) for i, tokens in enumerate(step)]))
    for step, block_logits in zip(steps, in_block):
        for index, tokens in enumerate(step):
            assert_same(block_logits[index], feed(engine, f"loose-{index}", tokens, len(tokens)))
    assert_same(engine.forward([Row(f"block-{i}", [50], 1) for i in range(3)])[2], feed(engine, "loose-2", [50]))


def test_crop_then_forward_equals_a_fresh_session_fed_the_same_tokens(engine):
    feed(engine, "s", PROMPTS[2], keep=0)
    engine.crop("s", 6)
    engine.crop("s", 9)  # holds 6: nothing to drop
    assert_same(feed(engine, "s", [77, 78], keep=2), feed(engine, "fresh", PROMPTS[2][:6] + [77, 78], keep=2))
    engine.crop("s", 0)
    assert_same(feed(engine, "s", [5, 6]), feed(engine, "fresh-2", [5, 6]))


def test_crop_after_a_batched_pass_rolls_back_that_session_only(engine):
    for index, prompt in enumerate(PROMPTS[:2]):
        feed(engine, f"s{index}", prompt, keep=0)
    engine.forward([Row("s0", [1, 2, 3], 0), Row("s1", [4, 5], 0)])
    engine.crop("s0", len(PROMPTS[0]) + 1)
    assert_same(feed(engine, "s0", [9]), feed(engine, "fresh-0", PROMPTS[0] + [1, 9]))
    assert_same(feed(engine, "s1", [9]), feed(engine, "fresh-1", PROMPTS[1] + [4, 5, 9]))


def test_release_forgets_the_session(engine):
    feed(engine, "s", PROMPTS[0], keep=0)
    engine.release("s")
    engine.release("s")  # twice, or never opened: nothing to do
    engine.release("nobody")
    engine.crop("nobody", 3)
    assert_same(feed(engine, "s", PROMPTS[1]), feed(engine, "fresh", PROMPTS[1]))


def test_transformers_engine_frees_the_cache_on_release(tiny_loaded):
    engine = TransformersEngine(tiny_loaded["target"])
    engine.forward([Row("a", PROMPTS[0]), Row("b", PROMPTS[1])])
    assert set(engine.caches) == {"a", "b"}
    engine.release("a")
    assert set(engine.caches) == {"b"}


def test_tokenizer_files_rebuild_the_tokenizer(engine, tmp_path):
    from transformers import AutoTokenizer

    for name, data in engine.tokenizer_files().items():
        (tmp_path / name).write_bytes(data)
    assert AutoTokenizer.from_pretrained(tmp_path).encode("hello world")


def test_the_session_store_keeps_the_transformers_engine_in_step(tiny_loaded):
    """Every session the store holds has a cache of its length; whatever ends a session (Release,
    eviction) takes its cache along, and a refused Prefill leaves none."""
    service = Drafter(TransformersEngine(tiny_loaded["draft"]), Limits(max_sessions=3, idle_timeout_s=0))
    engine = service.engine
    for index, prompt in enumerate(PROMPTS):
        service.prefill(Cursor(f"s{index}", 0, 0, prompt[:-1]))
    with pytest.raises(CapacityExceeded):
        service.prefill(Cursor("one-too-many", 0, 0, PROMPTS[0]))
    cursors = [Cursor(f"s{i}", len(p) - 1, fingerprint(p[:-1]), p[-1:]) for i, p in enumerate(PROMPTS)]
    service.propose_batch([ProposeCall(cursor, 3, Sampling()) for cursor in cursors])
    assert set(engine.caches) == set(service.store.sessions) == {"s0", "s1", "s2"}
    for index in range(3):
        assert engine.caches[f"s{index}"].get_seq_length() == len(service.store.sessions[f"s{index}"].tokens)
    service.release("s0")
    assert set(engine.caches) == set(service.store.sessions) == {"s1", "s2"}
    service.evict_idle()
    assert engine.caches == {} and service.store.sessions == {}


def llama_cpp(tiny_gguf, **limits) -> LlamaCppEngine:
    return load_engine("target", str(tiny_gguf["target"]), engine="llama.cpp", limits=Limits(**limits))


def test_llama_cpp_a_pass_longer_than_one_decode_call_equals_it_in_pieces(tiny_gguf):
    """A prefill past BATCH_TOKENS runs as several llama_decode calls, rows split across them."""
    engine = llama_cpp(tiny_gguf)
    long = [1000 + index % 5000 for index in range(BATCH_TOKENS + 90)]
    together = engine.forward([Row("long", long, 3), Row("short", PROMPTS[2], 2)])
    feed(engine, "pieces", long[:300], keep=0)
    pieces = feed(engine, "pieces", long[300:], keep=3)
    torch.testing.assert_close(pieces, together[0], atol=2e-3, rtol=0)  # other splits of 600 positions' sums
    assert torch.equal(pieces.argmax(-1), together[0].argmax(-1))
    alone = feed(engine, "alone", PROMPTS[2], keep=2)
    torch.testing.assert_close(alone, together[1], atol=2e-3, rtol=0)  # ggml's kernels differ by batch size
    assert torch.equal(alone.argmax(-1), together[1].argmax(-1))


def test_llama_cpp_a_full_kv_stream_is_capacity_exceeded_and_changes_nothing(tiny_gguf):
    """A row whose first llama_decode call fits its session's stream and whose second does not:
    its first call's KV goes, and so does the KV of the row decoded before it in the same pass."""
    engine, reference = llama_cpp(tiny_gguf, max_session_tokens=768), llama_cpp(tiny_gguf)
    assert engine.kv_token_budget() == 768 * engine.description.max_sessions  # allocated at start
    assert engine.description.max_positions == 768
    for each in (engine, reference):
        feed(each, "held", PROMPTS[2] * 10, keep=0)  # 120 tokens
    with pytest.raises(CapacityExceeded, match="no room"):  # 120 + 512 fit, then 188 more do not
        engine.forward([Row("other", [4] * 300, 1), Row("held", [5] * 700, 1)])
    assert set(engine.sequences) == {"held"} and engine.lengths == {"held": 120}
    assert_same(feed(engine, "held", [7, 8], 2), feed(reference, "held", [7, 8], 2))  # its KV is as it was
    feed(engine, "held", [9] * 600, keep=0)  # the failed pass's cells are free again: 122 + 600 fit


def test_llama_cpp_the_kv_budget_bounds_the_sessions(tiny_gguf):
    engine = llama_cpp(tiny_gguf, max_cached_tokens=3 * 1024, max_session_tokens=1024, max_sessions=8)
    assert (engine.description.max_sessions, engine.description.max_positions) == (3, 1024)
    small = llama_cpp(tiny_gguf, max_cached_tokens=512)  # one session, as long as the budget
    assert (small.description.max_sessions, small.description.max_positions) == (1, 512)


def test_llama_cpp_verify_scores_as_decode_steps(tiny_gguf):
    """Also after rollbacks and beside other sessions. Bit for bit on the real pair's K-quants
    (tests/test_real_llama_cpp.py); the tiny float32 GGUF's matmuls take tiled kernels for several
    rows, close to a float's rounding."""
    engine = llama_cpp(tiny_gguf)
    tokens = PROMPTS[2] + [5, 6, 7, 8, 9, 10, 11, 12]
    steps = [feed(engine, "decode", tokens[:1])] + [feed(engine, "decode", [token]) for token in tokens[1:]]
    feed(engine, "verify", tokens[:4], keep=0)
    engine.forward([Row("other", PROMPTS[0], 1), Row("verify", tokens[4:9] + [1, 2], 7)])
    engine.crop("verify", 9)
    engine.release("other")
    scored = engine.forward([Row("verify", tokens[9:], len(tokens) - 9), Row("third", PROMPTS[1], 2)])[0]
    assert_same(scored, torch.cat(steps[9:]))


def test_llama_cpp_takes_the_first_exact_setting_and_falls_back_to_one_position_per_call(tiny_gguf, monkeypatch):
    """The self-test at load (model/llama_cpp_engine.py: EXACT_SETTINGS) decides, not an assumption:
    a setting it refuses is unloaded and the next one tried; with none, one position per call."""
    monkeypatch.setattr(llama_cpp_engine, "EXACT_FOUND", {})  # no verdict kept from an earlier load
    tried = []
    exact = LlamaCppEngine._exact
    monkeypatch.setattr(LlamaCppEngine, "_exact", lambda engine: tried.append(engine.call_tokens) or exact(engine))
    engine = llama_cpp(tiny_gguf)
    settings = exact_settings()  # all of EXACT_SETTINGS, or the plain ones where ggml has AMX
    assert tried[0] == settings[0][1]
    # The tiny float32 GGUF's matmuls take tiled kernels for several rows: no setting is bit-exact.
    assert tried == [calls for _, calls in settings] and (engine.repacked, engine.call_tokens) == (False, 1)
    monkeypatch.setattr(LlamaCppEngine, "_exact", lambda engine: engine.call_tokens == EXACT_SETTINGS[1][1])
    llama_cpp_engine.EXACT_FOUND.clear()
    engine = llama_cpp(tiny_gguf)
    assert (engine.repacked, engine.call_tokens) == EXACT_SETTINGS[1]
    assert not engine.description.padded  # its passes cost what their rows hold (model/scheduler.py)
    assert engine.description.scored_per_call == EXACT_SETTINGS[1][1]  # openings share passes that many at a time
    tokens = PROMPTS[2] + [5, 6, 7]
    steps = [feed(engine, "decode", tokens[:1])] + [feed(engine, "decode", [token]) for token in tokens[1:]]
    assert_same(feed(engine, "verify", tokens, keep=4), torch.cat(steps[-4:]))


@pytest.mark.parametrize(
    "system", [b"CPU : AVX512 = 1 | AMX_INT8 = 1 | REPACK = 1 |", b"CPU : AVX512 = 1 | REPACK = 1 |"]
)
def test_where_ggml_has_amx_no_setting_uses_extra_buffer_types(system, monkeypatch):
    """ggml's AMX matmul crashes the process (ggml-org/llama.cpp#20824): where ggml reports AMX,
    the engine never loads with extra buffer types, whose first is AMX's; elsewhere it tries them all."""
    monkeypatch.setattr(llama_cpp_engine.llama, "llama_print_system_info", lambda: system)
    settings = exact_settings()
    if b"AMX" in system:
        assert settings and not any(repacked for repacked, _ in settings)
    else:
        assert settings == EXACT_SETTINGS


def test_llama_cpp_sessions_beyond_its_sequences_are_refused_and_released_ids_are_reused(tiny_gguf):
    engine = llama_cpp(tiny_gguf, max_sessions=2)
    feed(engine, "a", PROMPTS[0])
    feed(engine, "b", PROMPTS[1])
    with pytest.raises(CapacityExceeded):
        feed(engine, "c", PROMPTS[2])
    engine.release("a")
    assert_same(feed(engine, "c", PROMPTS[2]), feed(llama_cpp(tiny_gguf), "fresh", PROMPTS[2]))
    with pytest.raises(ValueError, match="1..256 sessions"):
        llama_cpp(tiny_gguf, max_sessions=257, max_session_tokens=256, max_cached_tokens=257 * 256)


def test_llama_cpp_batched_scores_a_pass_in_one_call_close_to_bitwise(tiny_gguf, monkeypatch):
    """--exactness batched: no probe at load, a unified KV cache, every kept position of a pass in one
    llama_decode call, a new session's prompt among them (continuous batching: one ubatch), scores within a float's
    rounding of the bitwise engine's and the same argmax, and counts the prompt as reusable for the prefix cache;
    a bad value is refused before anything loads."""
    monkeypatch.setattr(LlamaCppEngine, "_exact", lambda engine: pytest.fail("batched runs no exactness probe"))
    batched = load_engine("target", str(tiny_gguf["target"]), engine="llama.cpp", exactness="batched")
    assert batched.call_tokens == BATCH_TOKENS and batched.exactness == "batched"
    assert batched.description.scored_per_call is None  # a pass is one call: a fuller one is cheaper per row
    assert not batched.description.splits_rows  # one unified cache: a pass is one ubatch (costs.py prices it so)
    monkeypatch.undo()
    bitwise = llama_cpp(tiny_gguf)
    assert bitwise.description.splits_rows  # a KV stream per session: rows of other lengths run apart
    # batched: one unified KV cache (a pass is one ubatch); bitwise: a stream of its own per session
    n_ctx_seq = llama_cpp_engine.llama.llama_n_ctx_seq
    assert n_ctx_seq(batched.context) == batched.n_ctx and n_ctx_seq(bitwise.context) < bitwise.n_ctx
    for each in (batched, bitwise):
        for index, prompt in enumerate(PROMPTS):
            feed(each, f"s{index}", prompt, keep=0)
    calls = []
    decode = LlamaCppEngine._decode
    monkeypatch.setattr(LlamaCppEngine, "_decode", lambda engine, *args: calls.append(args[3]) or decode(engine, *args))
    rows = [Row("s2", [5, 6, 7], 3), Row("s0", [8], 1), Row("s1", [9, 10], 2), Row("new", PROMPTS[0], 1)]
    scored = batched.forward(rows)
    assert len(calls) == 1 and len(calls[0]) == 6 + len(PROMPTS[0])  # 3 + 1 + 2 positions and a prompt, one call
    assert batched.reusable("new") == len(PROMPTS[0]) - 1  # its head: all but the scored position
    for actual, expected in zip(scored, bitwise.forward(rows)):
        torch.testing.assert_close(actual, expected, atol=2e-3, rtol=0)
        assert torch.equal(actual.argmax(-1), expected.argmax(-1))
    with pytest.raises(ValueError, match="--exactness takes bitwise or batched"):
        load_engine("target", str(tiny_gguf["target"]), engine="llama.cpp", exactness="fast")


def test_llama_cpp_seq_ids_stay_compact_and_a_pass_runs_in_seq_id_order(tiny_gguf):
    """A new session takes the lowest free seq id, and a pass's kept positions go to llama_decode in
    seq-id order: llama.cpp's split_equal puts sequences in one ubatch only while their seq ids rise by
    one, in batch order."""
    engine = llama_cpp(tiny_gguf, max_sessions=4)
    for name in "abcd":
        feed(engine, name, PROMPTS[0], keep=0)
    assert [engine.sequences[name] for name in "abcd"] == [0, 1, 2, 3]
    engine.release("a")
    engine.release("c")  # a list used as a stack would give "e" seq id 2, the last one freed
    feed(engine, "e", PROMPTS[1], keep=0)
    assert engine.sequences["e"] == 0
    rows = [Row("d", [1, 2], 2), Row("b", [3, 4, 5], 1), Row("e", [6], 1)]
    starts = [engine.lengths[row.session_id] for row in rows]
    sequences = [engine.sequences[row.session_id] for row in rows]  # 3, 1, 0
    calls = llama_cpp_engine._calls(rows, starts, 512, sequences, frozenset())
    assert calls == [[(1, 0), (1, 1)], [(2, 0), (1, 2), (0, 0), (0, 1)]]  # b's head first, then e, b, d
    assert llama_cpp_engine._calls(rows, starts, 3, sequences, frozenset())[1:] == [[(2, 0), (1, 2), (0, 0)], [(0, 1)]]
    # batched (`mixed`): heads and kept positions together, rows in seq-id order, each in its order
    mixed = llama_cpp_engine._calls(rows, starts, 4, sequences, frozenset(), mixed=True)
    assert mixed == [[(2, 0), (1, 0), (1, 1), (1, 2)], [(0, 0), (0, 1)]]


def test_llama_cpp_probes_a_model_once_per_process_and_shape(tiny_gguf, monkeypatch):
    """What the exactness probe found is kept per file, threads and context shape: the same model
    loaded again takes the same settings without probing; another shape probes again."""
    monkeypatch.setattr(llama_cpp_engine, "EXACT_FOUND", {})
    first = llama_cpp(tiny_gguf)
    assert list(llama_cpp_engine.EXACT_FOUND.values()) == [(first.repacked, first.call_tokens)]
    with monkeypatch.context() as patched:
        patched.setattr(LlamaCppEngine, "_exact", lambda engine: pytest.fail("probed again"))
        again = llama_cpp(tiny_gguf)
    assert (again.repacked, again.call_tokens) == (first.repacked, first.call_tokens)
    assert_same(feed(again, "a", PROMPTS[0]), feed(first, "a", PROMPTS[0]))
    probes = []
    monkeypatch.setattr(LlamaCppEngine, "_exact", lambda engine: probes.append(engine) or False)
    llama_cpp(tiny_gguf, max_sessions=3)
    assert probes and len(llama_cpp_engine.EXACT_FOUND) == 2  # another context shape: its own probe
